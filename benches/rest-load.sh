#!/usr/bin/env bash
# REST load: heartbeats on live instances, registrations, and GET /healthz as the
# ceiling of the HTTP stack, each driven by wrk (Debian's wrk 4, LuaJIT script
# lib/rest.lua). See benches/README.md.
#
# Env knobs (defaults):
#   DURATION=10        seconds per wrk run
#   CONNS=32           wrk -c (keep-alive connections)
#   WRK_THREADS=1      wrk -t (the machine has 2 cores; the server needs the other)
#   LIVE=1000          live instances that the heartbeats cycle through (200 services x 5)
#   TESTS="healthz heartbeat register reregister"
#   ROUNDS=3           each round runs every test once, in order; the table has medians
#   THREADS=2          TOKIO_WORKER_THREADS of koder-dns
#   KODER_DNS_BIN, SKIP_BUILD=1, KEEP_TMP=1, KODER_DNS_LOG=warn (server log filter)
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"

DURATION="${DURATION:-10}"
CONNS="${CONNS:-32}"
WRK_THREADS="${WRK_THREADS:-1}"
LIVE="${LIVE:-1000}"
TESTS="${TESTS:-healthz heartbeat register reregister}"
ROUNDS="${ROUNDS:-3}"

bench_init rest-load
need_common_tools
need_pkg wrk wrk
KODER_BIN="$(koder_bin)"

INSTANCES=5
SERVICES=$(((LIVE + INSTANCES - 1) / INSTANCES))
IN="$BENCH_TMP/in"
python3 "$BENCH_LIB_DIR/gen.py" "$IN" --services "$SERVICES" --instances "$INSTANCES" --no-zone >&2

DNS_PORT="$(free_port)"
HTTP_PORT="$(free_port)"
# Room for every round's new registrations (about 15k/s).
start_koder "$DNS_PORT" "$HTTP_PORT" --max-instances 2000000
log "registering $((SERVICES * INSTANCES)) live instances (lease 1 h)"
register_jsonl "$IN/register.jsonl" "live instances" --procs 4

# quick functional check of each route before loading it
hb_id="$(head -n1 "$IN/heartbeat.jsonl")"
code="$(curl -s -o /dev/null -w '%{http_code}' -H "X-API-Key: $API_KEY" -d "$hb_id" \
    "http://$BENCH_HOST:$HTTP_PORT/api/v1/services/heartbeat")"
[[ $code == 200 ]] || die "heartbeat returned $code"

TCK="$(clk_tck)"
RESULTS="$BENCH_TMP/results.tsv"
: >"$RESULTS"
for t in $TESTS; do
    case "$t" in
        healthz | heartbeat | register | reregister) ;;
        *) die "unknown test $t" ;;
    esac
done
for ((r = 1; r <= ROUNDS; r++)); do
  for t in $TESTS; do
    out="$BENCH_TMP/wrk.$t.$r"
    log "round $r/$ROUNDS: wrk $t -t $WRK_THREADS -c $CONNS -d ${DURATION}s"
    t0="$(cpu_ticks "$KODER_PID")"
    BENCH_MODE="$t" BENCH_KEY="$API_KEY" BENCH_THREADS="$WRK_THREADS" BENCH_RATE=0 BENCH_ROUND="$r" \
        BENCH_BODIES="$([[ $t == heartbeat ]] && echo "$IN/heartbeat.jsonl" || echo "$IN/register.jsonl")" \
        BENCH_LEASE_NS=3600000000000 \
        wrk -t "$WRK_THREADS" -c "$CONNS" -d "${DURATION}s" --timeout 5s \
        -s "$BENCH_LIB_DIR/rest.lua" "http://$BENCH_HOST:$HTTP_PORT/" >"$out" 2>&1 \
        || { cat "$out" >&2; die "wrk $t failed"; }
    t1="$(cpu_ticks "$KODER_PID")"
    line="$(grep '^RESULT ' "$out")" || { cat "$out" >&2; die "no RESULT line from wrk $t"; }
    printf '%s\t%s\tcpu_ticks=%s\n' "$t" "${line#RESULT }" "$((t1 - t0))" >>"$RESULTS"
    kill -0 "$KODER_PID" 2>/dev/null || die "koder-dns died during $t (see $BENCH_TMP/koder/log)"
  done
done

INST_AFTER="$(curl -s -H "X-API-Key: $API_KEY" "http://$BENCH_HOST:$HTTP_PORT/api/v1/services?detail=1" |
    python3 -c 'import json,sys; print(len(json.load(sys.stdin)["instances"]))')"

python3 - "$RESULTS" "$TCK" <<'EOF'
import statistics, sys
tck = float(sys.argv[2])
runs = {}
order = []
for line in open(sys.argv[1]):
    name, kv, cpu = line.rstrip("\n").split("\t")
    d = dict(x.split("=") for x in kv.split())
    d["cpu_ticks"] = cpu.split("=")[1]
    d = {k: float(v) for k, v in d.items()}
    d["rate"] = d["requests"] / (d["duration_us"] / 1e6)
    runs.setdefault(name, []).append(d)
    if name not in order:
        order.append(name)
# Per test, the round with the median rate, and the rates of every round.
rows = {n: sorted(rs, key=lambda d: d["rate"])[len(rs) // 2] for n, rs in runs.items()}
label = {"healthz": "GET /healthz (ceiling)", "heartbeat": "POST heartbeat",
         "register": "POST register (new id)", "reregister": "POST register (update)"}
hdr = (f"{'route':<24} {'req/s per round':<22} {'median':>7} {'mean ms':>8} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} "
       f"{'max ms':>7} {'non-2xx':>8} {'sock err':>8} {'srv cores':>9} {'us CPU/req':>10}")
print()
print(hdr)
print("-" * len(hdr))
rate = {}
for n in order:
    d = rows[n]
    secs = d["duration_us"] / 1e6
    rate[n] = d["rate"]
    # Errors count in every round; latency and CPU are the median round's.
    status = sum(int(x["err_status"]) for x in runs[n])
    sockerr = sum(int(x["err_connect"] + x["err_read"] + x["err_write"] + x["err_timeout"]) for x in runs[n])
    per = " ".join(f"{x['rate']/1000:.1f}k" for x in runs[n])
    cpu = d["cpu_ticks"] / tck
    print(f"{label[n]:<24} {per:<22} {rate[n]:>7.0f} {d['lat_mean_us']/1000:>8.2f} {d['lat_p50_us']/1000:>7.2f} "
          f"{d['lat_p90_us']/1000:>7.2f} {d['lat_p99_us']/1000:>7.2f} {d['lat_max_us']/1000:>7.1f} "
          f"{status:>8} {sockerr:>8} {cpu/secs:>9.2f} {1e6*cpu/max(1,d['requests']):>10.1f}")
print()
if "healthz" in rate:
    for n in ("heartbeat", "register", "reregister"):
        if n in rate:
            print(f"ratio {n} / healthz ceiling: {rate[n] / rate['healthz']:.2f}  (median req/s)")
EOF
echo
echo "wrk -t $WRK_THREADS -c $CONNS -d ${DURATION}s (keep-alive), $ROUNDS rounds (each runs: $TESTS); heartbeats cycle over $((SERVICES * INSTANCES)) live ids;"
echo "register (new id) adds a fresh instance per request (instances in the registry at the end: $INST_AFTER);"
echo "register (update) re-registers the existing ids (created=false, lease renewed)."
echo "koder-dns: TOKIO_WORKER_THREADS=$THREADS, log filter ${KODER_DNS_LOG:-warn}"
echo "$(machine_note); wrk takes up to $WRK_THREADS core(s) of them"
