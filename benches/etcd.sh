#!/usr/bin/env bash
# koder-dns nodes on etcd, driven by the etcd-bench example (benches/etcd_bench.rs). Prints
# Markdown tables on stdout; progress on stderr. One MEASURE per run:
#
#   cluster     (default) 3 etcd members, 3 nodes: raw etcd transactions against
#               registrations through the nodes (alternated rounds), propagation node 1 ->
#               node 3, DNS QPS of an etcd node against a redb node.
#   heartbeats  3 etcd members, 3 nodes of this build and, with BASELINE_BIN, 3 nodes of
#               another build (e.g. the previous design) on their own prefix: heartbeats/s
#               and p50/p99 through one node of each, alternated rounds.
#   scale       one etcd member, 3 nodes: INSTANCES registered, then heart-beaten at RATE
#               renewals/s: renewals/s, latency, etcd watch events/s, CPU and RSS of each
#               process; with BASELINE_BIN, the same for 3 nodes of that build, alternated.
#               WATCHERS=N adds N raw etcd watches of the prefix (as N more nodes would).
#
# Env knobs (defaults): MEASURE=cluster, CLIENTS=64, DURATION=5 (seconds per measure),
# ROUNDS=3, PIN=1 (etcd on CPU 0, the nodes and the load on CPU 1: `taskset`),
# INSTANCES=100000, RATE=3333, WATCHERS=0, BASELINE_BIN (a koder-dns binary to compare),
# SKIP_BUILD=1 (use the built binaries), KEEP_TMP=1 (keep logs). Needs /usr/bin/etcd
# (Debian: etcd-server) and, to build, protoc (protobuf-compiler libprotobuf-dev).
# Only 127.0.0.1 is used.
set -euo pipefail
cd "$(dirname "$0")/.."

MEASURE="${MEASURE:-cluster}"
CLIENTS="${CLIENTS:-64}"
DURATION="${DURATION:-5}"
ROUNDS="${ROUNDS:-3}"
PIN="${PIN:-1}"
INSTANCES="${INSTANCES:-100000}"
RATE="${RATE:-3333}"
WATCHERS="${WATCHERS:-0}"
KEY="etcd-bench-key-0123456789abcdef"
log() { echo "etcd.sh: $*" >&2; }
[ -x /usr/bin/etcd ] || { log "/usr/bin/etcd is missing: apt-get install etcd-server"; exit 1; }
if [ "${SKIP_BUILD:-}" != 1 ]; then
    log "building koder-dns and etcd-bench (release, --features etcd)"
    cargo build --release --features etcd --quiet --bin koder-dns --example etcd-bench
fi
BIN=target/release/koder-dns
BENCH=target/release/examples/etcd-bench
if [ "$PIN" = 1 ] && [ "$(nproc)" -ge 2 ]; then
    ON_ETCD=(taskset -c 0)
    ON_NODES=(taskset -c 1)
else
    ON_ETCD=()
    ON_NODES=()
fi

TMP="$(mktemp -d /tmp/koder-bench-etcd.XXXXXX)"
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if [ "${KEEP_TMP:-}" = 1 ]; then log "kept $TMP"; else rm -rf "$TMP"; fi
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
log "machine before: $(uptime)"

# etcd: 3 members (1 for `scale`), each on ON_ETCD's CPU.
MEMBERS=3
[ "$MEASURE" = scale ] && MEMBERS=1
declare -a CLIENT_PORTS PEER_PORTS ETCD_PIDS
INITIAL=""
for i in $(seq 0 $((MEMBERS - 1))); do
    CLIENT_PORTS[$i]="$(free_port)"; PEER_PORTS[$i]="$(free_port)"
    INITIAL="${INITIAL:+$INITIAL,}m$i=http://127.0.0.1:${PEER_PORTS[$i]}"
done
ENDPOINTS=""
for i in $(seq 0 $((MEMBERS - 1))); do
    ENDPOINTS="${ENDPOINTS:+$ENDPOINTS,}http://127.0.0.1:${CLIENT_PORTS[$i]}"
    "${ON_ETCD[@]}" /usr/bin/etcd --name "m$i" --data-dir "$TMP/etcd-m$i" \
        --listen-client-urls "http://127.0.0.1:${CLIENT_PORTS[$i]}" \
        --advertise-client-urls "http://127.0.0.1:${CLIENT_PORTS[$i]}" \
        --listen-peer-urls "http://127.0.0.1:${PEER_PORTS[$i]}" \
        --initial-advertise-peer-urls "http://127.0.0.1:${PEER_PORTS[$i]}" \
        --initial-cluster "$INITIAL" --initial-cluster-state new \
        --quota-backend-bytes $((8 * 1024 * 1024 * 1024)) \
        --logger zap --log-outputs stderr 2>"$TMP/etcd-m$i.log" &
    PIDS+=($!)
    ETCD_PIDS+=($!)
done
for i in $(seq 0 $((MEMBERS - 1))); do
    for _ in $(seq 200); do
        curl -sf "http://127.0.0.1:${CLIENT_PORTS[$i]}/health" | grep -q true && break
        sleep 0.1
    done
done
log "etcd up at $ENDPOINTS"

# start_nodes BIN PREFIX: 3 nodes of BIN on PREFIX; sets NODE_URLS (comma-separated),
# NODE_PIDS (name=pid,...) and DNS3.
start_nodes() {
    local bin="$1" prefix="$2" urls=() pids=()
    for i in 0 1 2; do
        local http dns name="node${prefix//\//}$i"
        http="$(free_port)"; dns="$(free_port)"
        KODER_DNS_API_KEY="$KEY" KODER_DNS_LOG=warn "${ON_NODES[@]}" "$bin" serve --store etcd \
            --etcd-endpoints "$ENDPOINTS" --etcd-prefix "$prefix" --node-id "$name" \
            --http-listen "127.0.0.1:$http" --dns-listen "127.0.0.1:$dns" \
            --data-dir "$TMP/$name" --zones-dir "$TMP/$name/zones" --max-instances 2000000 \
            2>"$TMP/$name.log" &
        PIDS+=($!)
        pids+=("$name=$!")
        urls+=("http://127.0.0.1:$http")
        DNS3="127.0.0.1:$dns"
        for _ in $(seq 200); do curl -sf "http://127.0.0.1:$http/healthz" >/dev/null && break; sleep 0.1; done
    done
    NODE_URLS="$(IFS=,; echo "${urls[*]}")"
    NODE_PIDS="$(IFS=,; echo "${pids[*]}")"
    log "nodes of $bin on $prefix up at $NODE_URLS"
}

# CPU seconds (user + system) of a process, from /proc.
cpu() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.1f", ($14 + $15) / hz }' "/proc/$1/stat"; }

case "$MEASURE" in
cluster)
    start_nodes "$BIN" /bench/
    declare -A BEFORE
    for pid in "${PIDS[@]}"; do BEFORE[$pid]="$(cpu "$pid")"; done
    "${ON_NODES[@]}" "$BENCH" cluster "$ENDPOINTS" "$NODE_URLS" "$DNS3" "$KEY" "$CLIENTS" "$DURATION" "$ROUNDS"
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
        KODER_DNS_API_KEY="$KEY" KODER_DNS_LOG=warn "${ON_NODES[@]}" "$BIN" serve --http-listen "127.0.0.1:$rhttp" \
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
    ;;
heartbeats)
    start_nodes "$BIN" /bench/
    groups="$NODE_URLS"
    if [ -n "${BASELINE_BIN:-}" ]; then
        start_nodes "$BASELINE_BIN" /bench-base/
        groups="$groups;$NODE_URLS"
    fi
    "${ON_NODES[@]}" "$BENCH" heartbeats "$groups" "$KEY" "$CLIENTS" "$DURATION" "$ROUNDS"
    echo "(first row: $BIN; second: ${BASELINE_BIN:-none})"
    ;;
scale)
    # Raw watches of both prefixes, as WATCHERS more nodes would hold.
    watchers=()
    for _ in $(seq "$WATCHERS"); do
        for prefix in /bench/ /bench-base/; do
            ETCDCTL_API=3 etcdctl --endpoints "$ENDPOINTS" watch --prefix "$prefix" >/dev/null 2>&1 &
            PIDS+=($!)
            watchers+=($!)
        done
    done
    start_nodes "$BIN" /bench/
    designs=("$NODE_URLS|$NODE_PIDS,etcd=${ETCD_PIDS[0]}|$BIN")
    if [ -n "${BASELINE_BIN:-}" ]; then
        start_nodes "$BASELINE_BIN" /bench-base/
        designs+=("$NODE_URLS|$NODE_PIDS,etcd=${ETCD_PIDS[0]}|$BASELINE_BIN")
    fi
    for round in $(seq "$ROUNDS"); do
        for design in "${designs[@]}"; do
            IFS='|' read -r urls pids bin <<<"$design"
            # Registered in the first round only.
            log "round $round: $bin"
            echo "round $round, $bin, $WATCHERS extra watchers:"
            "${ON_NODES[@]}" "$BENCH" scale "${ENDPOINTS%%,*}" "$urls" "$KEY" "$INSTANCES" "$RATE" "$DURATION" "$pids" \
                "$([ "$round" = 1 ] && echo 1 || echo 0)"
            echo
        done
    done
    ;;
*)
    log "MEASURE=$MEASURE: not cluster, heartbeats or scale"
    exit 2
    ;;
esac
log "machine after: $(uptime)"
echo "$(nproc) CPUs, etcd $(/usr/bin/etcd --version | head -1 | awk '{print $3}'), PIN=$PIN, everything on this one machine"
