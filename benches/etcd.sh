#!/usr/bin/env bash
# Several nodes on etcd: a 3-member etcd cluster and 3 koder-dns nodes on loopback, driven
# by the etcd-bench example (benches/etcd_bench.rs): raw etcd transactions against
# registrations through the nodes in the same run, propagation node 1 -> node 3, and
# heartbeats/s on one node. Prints a Markdown table on stdout; progress on stderr.
#
# Env knobs (defaults): CLIENTS=64, DURATION=5 (seconds per measure), SKIP_BUILD=1 (use the built binaries),
# KEEP_TMP=1 (keep logs). Needs /usr/bin/etcd (Debian: etcd-server) and, to build, protoc
# (protobuf-compiler libprotobuf-dev). Only 127.0.0.1 is used.
set -euo pipefail
cd "$(dirname "$0")/.."

CLIENTS="${CLIENTS:-64}"
DURATION="${DURATION:-5}"
KEY="etcd-bench-key-0123456789abcdef"
log() { echo "etcd.sh: $*" >&2; }
[ -x /usr/bin/etcd ] || { log "/usr/bin/etcd is missing: apt-get install etcd-server"; exit 1; }
if [ "${SKIP_BUILD:-}" != 1 ]; then
    log "building koder-dns and etcd-bench (release, --features etcd)"
    cargo build --release --features etcd --quiet --bin koder-dns --example etcd-bench
fi
BIN=target/release/koder-dns
BENCH=target/release/examples/etcd-bench

TMP="$(mktemp -d /tmp/koder-bench-etcd.XXXXXX)"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [ "${KEEP_TMP:-}" = 1 ]; then log "kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

declare -a CLIENT_PORTS PEER_PORTS
for i in 0 1 2; do CLIENT_PORTS[$i]="$(free_port)"; PEER_PORTS[$i]="$(free_port)"; done
INITIAL="m0=http://127.0.0.1:${PEER_PORTS[0]},m1=http://127.0.0.1:${PEER_PORTS[1]},m2=http://127.0.0.1:${PEER_PORTS[2]}"
ENDPOINTS="http://127.0.0.1:${CLIENT_PORTS[0]},http://127.0.0.1:${CLIENT_PORTS[1]},http://127.0.0.1:${CLIENT_PORTS[2]}"
for i in 0 1 2; do
    /usr/bin/etcd --name "m$i" --data-dir "$TMP/etcd-m$i" \
        --listen-client-urls "http://127.0.0.1:${CLIENT_PORTS[$i]}" \
        --advertise-client-urls "http://127.0.0.1:${CLIENT_PORTS[$i]}" \
        --listen-peer-urls "http://127.0.0.1:${PEER_PORTS[$i]}" \
        --initial-advertise-peer-urls "http://127.0.0.1:${PEER_PORTS[$i]}" \
        --initial-cluster "$INITIAL" --initial-cluster-state new \
        --logger zap --log-outputs stderr 2>"$TMP/etcd-m$i.log" &
    PIDS+=($!)
done
for i in 0 1 2; do
    for _ in $(seq 200); do
        curl -sf "http://127.0.0.1:${CLIENT_PORTS[$i]}/health" | grep -q true && break
        sleep 0.1
    done
done
log "etcd up at $ENDPOINTS"

NODE_URLS=()
for i in 0 1 2; do
    http="$(free_port)"; dns="$(free_port)"
    KODER_DNS_API_KEY="$KEY" KODER_DNS_LOG=warn "$BIN" serve --store etcd --etcd-endpoints "$ENDPOINTS" \
        --etcd-prefix /bench/ --http-listen "127.0.0.1:$http" --dns-listen "127.0.0.1:$dns" \
        --data-dir "$TMP/node$i" --zones-dir "$TMP/node$i/zones" --max-instances 2000000 \
        2>"$TMP/node$i.log" &
    PIDS+=($!)
    NODE_URLS+=("http://127.0.0.1:$http")
    DNS3="127.0.0.1:$dns"
    for _ in $(seq 200); do curl -sf "http://127.0.0.1:$http/healthz" >/dev/null && break; sleep 0.1; done
done
log "nodes up at ${NODE_URLS[*]}"

# CPU seconds (user + system) of a process, from /proc.
cpu() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.1f", ($14 + $15) / hz }' "/proc/$1/stat"; }
declare -A BEFORE
for pid in "${PIDS[@]}"; do BEFORE[$pid]="$(cpu "$pid")"; done
"$BENCH" "$ENDPOINTS" "$(IFS=,; echo "${NODE_URLS[*]}")" "$DNS3" "$KEY" "$CLIENTS" "$DURATION"
echo
names=(etcd-m0 etcd-m1 etcd-m2 node1 node2 node3)
echo -n "CPU seconds during the run:"
for i in "${!PIDS[@]}"; do
    echo -n " ${names[$i]} $(awk -v a="$(cpu "${PIDS[$i]}")" -v b="${BEFORE[${PIDS[$i]}]}" 'BEGIN { printf "%.1f", a - b }')"
done
echo
# DNS QPS of an etcd node against a redb node holding the same 200 instances (prop0..199,
# registered by the bench on node 1), dnsperf for DURATION seconds each, twice, alternated.
if command -v dnsperf >/dev/null; then
    rhttp="$(free_port)"; rdns="$(free_port)"
    KODER_DNS_API_KEY="$KEY" KODER_DNS_LOG=warn "$BIN" serve --http-listen "127.0.0.1:$rhttp" \
        --dns-listen "127.0.0.1:$rdns" --data-dir "$TMP/redb" --zones-dir "$TMP/redb/zones" 2>"$TMP/redb.log" &
    PIDS+=($!)
    for _ in $(seq 200); do curl -sf "http://127.0.0.1:$rhttp/healthz" >/dev/null && break; sleep 0.1; done
    for i in $(seq 0 199); do
        curl -sf -H "X-API-Key: $KEY" -d "{\"id\":\"prop$i\",\"name\":\"prop$i\",\"address\":\"10.9.0.1\",\"port\":$((1000 + i)),\"ttl_ns\":300000000000}" \
            "http://127.0.0.1:$rhttp/api/v1/services/register" >/dev/null
    done
    for i in $(seq 0 199); do echo "_prop$i._tcp.service.koder SRV"; done >"$TMP/queries"
    qps() { dnsperf -s 127.0.0.1 -p "$1" -d "$TMP/queries" -l "$DURATION" -c 4 -Q 1000000 2>/dev/null |
        awk '/Queries per second/ { printf "%.0f", $4 }'; }
    e1="$(qps "${DNS3##*:}")"; r1="$(qps "$rdns")"; e2="$(qps "${DNS3##*:}")"; r2="$(qps "$rdns")"
    echo "DNS QPS (dnsperf, 200 SRV names): etcd node $e1 / $e2, redb node $r1 / $r2"
else
    log "dnsperf not installed: DNS QPS not measured (apt-get install dnsperf)"
fi
echo "$(nproc) CPUs, etcd $(/usr/bin/etcd --version | head -1 | awk '{print $3}'), everything on this one machine"
