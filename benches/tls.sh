#!/usr/bin/env bash
# What TLS and scoped keys cost, each as a ratio within one run:
#   - REST heartbeats/s and registrations/s over HTTPS (keep-alive) against plain HTTP:
#     two koder-dns, one of each, the runs alternating (goal >= 0.85x);
#   - heartbeats/s with a register-scoped key against an admin key made the same way
#     (tokens of one length), same server (goal >= 0.98x): for a scoped key, the lookup of
#     the instance's service and the pattern match (the key itself is hashed once per
#     connection, then compared with the one the connection presented before);
#   - DNS over TLS QPS against DNS over TCP on the same server (dnsperf -m dot / -m tcp,
#     goal >= 0.8x), and against unbound's DNS over TLS serving the same records as
#     local data (Knot 3.2 in Debian 12 has no DNS-over-TLS server).
# See benches/README.md.
#
# Env knobs (defaults):
#   DURATION=10 ROUNDS=3        seconds per run; rounds (each runs every test once)
#   CONNS=32 WRK_THREADS=1      wrk -c (keep-alive connections), wrk -t
#   LIVE=1000                   live instances (200 services x 5)
#   CLIENTS=8 OUTSTANDING=100   dnsperf -c (connections), -q
#   TESTS="rest scope dns"      which comparisons to run
#   THREADS=2                   TOKIO_WORKER_THREADS of koder-dns, unbound num-threads
#   PIN=0                       1: servers on CPU 0, wrk and dnsperf on CPU 1 (taskset), so the
#                               load tools' own TLS work does not take the server's CPU
#                               (with PIN=1, THREADS=1 fits the one CPU)
#   KODER_DNS_BIN, SKIP_BUILD=1, KEEP_TMP=1, KODER_DNS_LOG=warn
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"

DURATION="${DURATION:-10}"
ROUNDS="${ROUNDS:-3}"
CONNS="${CONNS:-32}"
WRK_THREADS="${WRK_THREADS:-1}"
LIVE="${LIVE:-1000}"
CLIENTS="${CLIENTS:-8}"
OUTSTANDING="${OUTSTANDING:-100}"
TESTS="${TESTS:-rest scope dns}"

bench_init tls
need_common_tools
need_pkg wrk wrk
need_pkg dnsperf dnsperf
need_pkg unbound unbound
need_pkg openssl openssl
KODER_BIN="$(koder_bin)"

INSTANCES=5
SERVICES=$(((LIVE + INSTANCES - 1) / INSTANCES))
IN="$BENCH_TMP/in"
python3 "$BENCH_LIB_DIR/gen.py" "$IN" --services "$SERVICES" --instances "$INSTANCES" >&2

# A self-signed certificate (neither wrk nor dnsperf checks it) and keys made the way an
# operator makes them: the scoped key may register the fleet's services, svc*.
PKI="$BENCH_TMP/pki"
mkdir -p "$PKI"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=localhost \
    -addext "subjectAltName=IP:$BENCH_HOST" -keyout "$PKI/key.pem" -out "$PKI/cert.pem" 2>/dev/null
# An admin key made the same way, so that the two heartbeat runs send tokens of one length
# and differ only in the scope check (a 12-byte key against a 47-byte one made the request,
# and hyper's reading of it, the bigger part of the difference).
"$KODER_BIN" keys new --id fleet --scope register --service 'svc*' >"$PKI/scoped"
"$KODER_BIN" keys new --id ops --scope admin >"$PKI/admin"
SCOPED_KEY="$(head -n1 "$PKI/scoped")"
ADMIN_KEY="$(head -n1 "$PKI/admin")"
{ tail -n +2 "$PKI/scoped"; tail -n +2 "$PKI/admin"; } >"$PKI/keys.toml"

# Two servers: plain HTTP, and HTTPS with DNS over TLS; the same keys, the same fleet.
PLAIN_HTTP="$(free_port)"
PLAIN_DNS="$(free_port)"
KODER_NAME=plain start_koder "$PLAIN_DNS" "$PLAIN_HTTP" --keys-file "$PKI/keys.toml" --max-instances 2000000
PLAIN_PID="$KODER_PID"
TLS_HTTP="$(free_port)"
TLS_DNS="$(free_port)"
DOT_PORT="$(free_port)"
# start_koder waits on plain /healthz; this one speaks HTTPS, so wait here.
log "starting koder-dns with TLS (https=$TLS_HTTP dot=$DOT_PORT dns=$TLS_DNS)"
mkdir -p "$BENCH_TMP/tls/data" "$BENCH_TMP/tls/zones"
KODER_DNS_API_KEY="$API_KEY" TOKIO_WORKER_THREADS="$THREADS" KODER_DNS_DNS_UDP_WORKERS="$THREADS" \
    KODER_DNS_LOG="${KODER_DNS_LOG:-warn}" "${ON_SERVER[@]}" "$KODER_BIN" serve \
    --dns-listen "$BENCH_HOST:$TLS_DNS" --http-listen "$BENCH_HOST:$TLS_HTTP" --dot-listen "$BENCH_HOST:$DOT_PORT" \
    --tls-cert "$PKI/cert.pem" --tls-key "$PKI/key.pem" --keys-file "$PKI/keys.toml" \
    --data-dir "$BENCH_TMP/tls/data" --zones-dir "$BENCH_TMP/tls/zones" --max-instances 2000000 \
    >"$BENCH_TMP/tls/log" 2>&1 &
TLS_PID=$!
track_pid "$TLS_PID"
for _ in $(seq 1 300); do
    curl -sk -o /dev/null "https://$BENCH_HOST:$TLS_HTTP/healthz" && break
    sleep 0.1
done
curl -sfk -o /dev/null "https://$BENCH_HOST:$TLS_HTTP/healthz" || die "koder-dns with TLS did not start (see $BENCH_TMP/tls/log)"

log "registering $((SERVICES * INSTANCES)) live instances on each"
HTTP_PORT="$PLAIN_HTTP" register_jsonl "$IN/register.jsonl" "live instances (plain)" --procs 4
HTTP_PORT="$TLS_HTTP" register_jsonl "$IN/register.jsonl" "live instances (TLS)" --procs 4 --tls

TCK="$(clk_tck)"
RESULTS="$BENCH_TMP/results.tsv"
: >"$RESULTS"

# wrk_run NAME PID URL KEY MODE BODIES ROUND
wrk_run() {
    local name="$1" pid="$2" url="$3" key="$4" mode="$5" bodies="$6" round="$7" out t0 t1 line
    out="$BENCH_TMP/wrk.$name.$round"
    log "round $round/$ROUNDS: $name"
    t0="$(cpu_ticks "$pid")"
    BENCH_MODE="$mode" BENCH_KEY="$key" BENCH_THREADS="$WRK_THREADS" BENCH_RATE=0 BENCH_ROUND="$round$name" \
        BENCH_BODIES="$bodies" BENCH_LEASE_NS=3600000000000 \
        "${ON_LOAD[@]}" wrk -t "$WRK_THREADS" -c "$CONNS" -d "${DURATION}s" --timeout 5s -s "$BENCH_LIB_DIR/rest.lua" "$url" >"$out" 2>&1 \
        || { cat "$out" >&2; die "wrk $name failed"; }
    t1="$(cpu_ticks "$pid")"
    line="$(grep '^RESULT ' "$out")" || { cat "$out" >&2; die "no RESULT line from wrk $name"; }
    printf '%s\t%s\tcpu_ticks=%s\n' "$name" "${line#RESULT }" "$((t1 - t0))" >>"$RESULTS"
}

# dnsperf_run NAME PID PORT MODE ROUND
dnsperf_run() {
    local name="$1" pid="$2" port="$3" mode="$4" round="$5" out t0 t1 qps
    out="$BENCH_TMP/dnsperf.$name.$round"
    log "round $round/$ROUNDS: $name (dnsperf -m $mode)"
    t0="$(cpu_ticks "$pid")"
    "${ON_LOAD[@]}" dnsperf -s "$BENCH_HOST" -p "$port" -m "$mode" -d "$IN/queries.txt" -l "$DURATION" \
        -c "$CLIENTS" -q "$OUTSTANDING" -t 2 >"$out" 2>&1 || { cat "$out" >&2; die "dnsperf $name failed"; }
    t1="$(cpu_ticks "$pid")"
    qps="$(dnsperf_field "$out" 'Queries per second:')"
    [[ -n $qps ]] || { cat "$out" >&2; die "no QPS from dnsperf $name"; }
    printf '%s\trequests=%s duration_us=%s lat_mean_us=0\tcpu_ticks=%s\n' \
        "$name" "$(awk '/Queries completed:/ {print $3}' "$out")" "$((DURATION * 1000000))" "$((t1 - t0))" >>"$RESULTS"
}

if [[ " $TESTS " == *" dns "* ]]; then
    # unbound with the same records as local data, DNS over TLS on a port of its own.
    UB="$BENCH_TMP/unbound"
    mkdir -p "$UB"
    UB_PORT="$(free_port)"
    UB_DOT="$(free_port)"
    {
        cat <<EOF
server:
    interface: $BENCH_HOST@$UB_PORT
    interface: $BENCH_HOST@$UB_DOT
    tls-port: $UB_DOT
    tls-service-key: "$PKI/key.pem"
    tls-service-pem: "$PKI/cert.pem"
    do-ip6: no
    do-daemonize: no
    username: ""
    chroot: ""
    directory: "$UB"
    pidfile: "$UB/unbound.pid"
    use-syslog: no
    logfile: "$UB/unbound.log"
    num-threads: $THREADS
    so-reuseport: yes
    incoming-num-tcp: 1024
    access-control: 127.0.0.0/8 allow
    module-config: "iterator"
    local-zone: "service.koder." static
EOF
        # Every record of the zone NSD and Knot get in dns-compare.sh, as local-data, with
        # its names written out in full (unbound reads local-data without an origin).
        python3 - "$IN/service.koder.zone" <<'PY'
import sys
origin, ttl = "service.koder.", "5"
for line in open(sys.argv[1]):
    f = line.split()
    if not f or f[0].startswith(";"):
        continue
    if f[0] == "$ORIGIN":
        origin = f[1]
        continue
    if f[0] == "$TTL":
        ttl = f[1]
        continue
    full = lambda n: origin if n == "@" else n if n.endswith(".") else f"{n}.{origin}"
    owner, cls, rtype, rdata = full(f[0]), f[1], f[2], f[3:]
    if rtype in ("SRV", "NS", "CNAME", "MX"):
        rdata[-1] = full(rdata[-1])
    # Single quotes around it, as unbound's manual writes TXT data: the strings keep theirs.
    print(f"    local-data: '{owner} {ttl} {cls} {rtype} {' '.join(rdata)}'")
PY
        echo "remote-control:"
        echo "    control-enable: no"
    } >"$UB/unbound.conf"
    unbound-checkconf "$UB/unbound.conf" >&2 || die "unbound rejects $UB/unbound.conf"
    "${ON_SERVER[@]}" unbound -d -c "$UB/unbound.conf" >"$UB/stdout" 2>&1 &
    UB_PID=$!
    track_pid "$UB_PID"
    wait_dns "$UB_PORT" svc000.service.koder 10 || die "unbound did not answer (see $UB/unbound.log)"
fi

for ((r = 1; r <= ROUNDS; r++)); do
    if [[ " $TESTS " == *" rest "* ]]; then
        wrk_run heartbeat-http "$PLAIN_PID" "http://$BENCH_HOST:$PLAIN_HTTP/" "$API_KEY" heartbeat "$IN/heartbeat.jsonl" "$r"
        wrk_run heartbeat-https "$TLS_PID" "https://$BENCH_HOST:$TLS_HTTP/" "$API_KEY" heartbeat "$IN/heartbeat.jsonl" "$r"
        wrk_run register-http "$PLAIN_PID" "http://$BENCH_HOST:$PLAIN_HTTP/" "$API_KEY" register "$IN/register.jsonl" "$r"
        wrk_run register-https "$TLS_PID" "https://$BENCH_HOST:$TLS_HTTP/" "$API_KEY" register "$IN/register.jsonl" "$r"
    fi
    if [[ " $TESTS " == *" scope "* ]]; then
        wrk_run heartbeat-admin "$PLAIN_PID" "http://$BENCH_HOST:$PLAIN_HTTP/" "$ADMIN_KEY" heartbeat "$IN/heartbeat.jsonl" "$r"
        wrk_run heartbeat-scoped "$PLAIN_PID" "http://$BENCH_HOST:$PLAIN_HTTP/" "$SCOPED_KEY" heartbeat "$IN/heartbeat.jsonl" "$r"
    fi
    if [[ " $TESTS " == *" dns "* ]]; then
        dnsperf_run dns-tcp "$TLS_PID" "$TLS_DNS" tcp "$r"
        dnsperf_run dns-dot "$TLS_PID" "$DOT_PORT" dot "$r"
        dnsperf_run unbound-dot "$UB_PID" "$UB_DOT" dot "$r"
    fi
    kill -0 "$PLAIN_PID" 2>/dev/null && kill -0 "$TLS_PID" 2>/dev/null || die "a koder-dns died (see $BENCH_TMP)"
done

python3 - "$RESULTS" "$TCK" <<'EOF'
import statistics, sys
tck = float(sys.argv[2])
runs, order = {}, []
for line in open(sys.argv[1]):
    name, kv, cpu = line.rstrip("\n").split("\t")
    d = {k: float(v) for k, v in (x.split("=") for x in kv.split())}
    d["cpu"] = float(cpu.split("=")[1]) / tck
    d["rate"] = d["requests"] / (d["duration_us"] / 1e6)
    runs.setdefault(name, []).append(d)
    if name not in order:
        order.append(name)
med = {n: statistics.median(x["rate"] for x in rs) for n, rs in runs.items()}
print()
print(f"{'run':<18} {'per round':<30} {'median/s':>9} {'us CPU/req':>10}")
for n in order:
    per = " ".join(f"{x['rate']/1000:.1f}k" for x in runs[n])
    cpu = statistics.median(1e6 * x["cpu"] / max(1, x["requests"]) for x in runs[n])
    print(f"{n:<18} {per:<30} {med[n]:>9.0f} {cpu:>10.1f}")
print()
for a, b, goal in [("heartbeat-https", "heartbeat-http", 0.85), ("register-https", "register-http", 0.85),
                   ("heartbeat-scoped", "heartbeat-admin", 0.98), ("dns-dot", "dns-tcp", 0.8),
                   ("dns-dot", "unbound-dot", None)]:
    if a in med and b in med:
        ratio = med[a] / med[b]
        verdict = "" if goal is None else f"  (goal >= {goal}: {'met' if ratio >= goal else 'NOT met'})"
        print(f"ratio {a} / {b}: {ratio:.2f}{verdict}")
EOF
echo
echo "wrk -t $WRK_THREADS -c $CONNS -d ${DURATION}s (keep-alive, so one handshake per connection); dnsperf -c $CLIENTS -q $OUTSTANDING;"
echo "$ROUNDS rounds, the compared runs alternating within each; medians over the rounds."
echo "koder-dns: TOKIO_WORKER_THREADS=$THREADS; unbound num-threads $THREADS, the same records as local data."
if [[ "${PIN:-0}" == 1 ]]; then
    echo "PIN=1: koder-dns and unbound on CPU 0, wrk and dnsperf on CPU 1 (taskset)"
fi
echo "$(machine_note)"
