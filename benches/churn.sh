#!/usr/bin/env bash
# Churn: DNS latency with the registry idle vs while registrations and
# heartbeats run. See benches/README.md.
#
# Each round has two phases of DURATION seconds, "idle" then "churn":
#   both:  dnsperf at a fixed DNS_QPS (-Q) with the dns-compare query mix, and
#          lib/dnsprobe.py (one query at a time, PROBE_QPS/s) for p50/p99
#          (dnsperf 2.10 reports only the average latency)
#   churn: + wrk POSTing new registrations at REG_RATE/s and heartbeats on the
#          1000 live instances (the ones DNS is asked about) at HB_RATE/s.
#          Debian's wrk has no -R, so lib/rest.lua paces each wrk thread with
#          delay() slots; the achieved rates are printed next to the targets.
#
# Env knobs (defaults):
#   DURATION=10 ROUNDS=2
#   DNS_QPS=20000       dnsperf -Q (fixed offered DNS load; 0 = unlimited)
#   PROBE_QPS=1000      latency probe rate
#   REG_RATE=1000 REG_CONNS=32
#   HB_RATE=10000 HB_CONNS=64
#   SERVICES=200 INSTANCES=5 QUERY_MIX=srv=60,a=20,txt=10,nx=10
#   BASELINE_PEER=nsd   also run an idle and a churn phase with DNS asked of NSD serving the same zone
#                       (same offered load, THREADS server processes): what the
#                       machine gives a fast server; empty = skip
#   THREADS=2           TOKIO_WORKER_THREADS of koder-dns
#   KODER_DNS_BIN, SKIP_BUILD=1, KEEP_TMP=1, KODER_DNS_LOG=warn
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"

DURATION="${DURATION:-10}"
ROUNDS="${ROUNDS:-2}"
DNS_QPS="${DNS_QPS:-20000}"
PROBE_QPS="${PROBE_QPS:-1000}"
REG_RATE="${REG_RATE:-1000}"
REG_CONNS="${REG_CONNS:-32}"
HB_RATE="${HB_RATE:-10000}"
HB_CONNS="${HB_CONNS:-64}"
SERVICES="${SERVICES:-200}"
INSTANCES="${INSTANCES:-5}"
QUERY_MIX="${QUERY_MIX:-srv=60,a=20,txt=10,nx=10}"
BASELINE_PEER="${BASELINE_PEER-nsd}"
DOMAIN=service.koder

bench_init churn
need_common_tools
need_pkg dnsperf dnsperf
need_pkg wrk wrk
KODER_BIN="$(koder_bin)"
if [[ -n $BASELINE_PEER ]]; then
    [[ $BASELINE_PEER == nsd ]] || die "BASELINE_PEER: only nsd is supported"
    # shellcheck source=lib/peers.sh
    source "$BENCH_LIB_DIR/peers.sh"
    need_peers
fi

IN="$BENCH_TMP/in"
python3 "$BENCH_LIB_DIR/gen.py" "$IN" --services "$SERVICES" --instances "$INSTANCES" \
    --mix "$QUERY_MIX" --domain "$DOMAIN" >&2

DNS_PORT="$(free_port)"
HTTP_PORT="$(free_port)"
start_koder "$DNS_PORT" "$HTTP_PORT"
log "registering $((SERVICES * INSTANCES)) live instances (lease 1 h)"
register_jsonl "$IN/register.jsonl" "live instances" --procs 4

QFLAG=()
[[ $DNS_QPS -gt 0 ]] && QFLAG=(-Q "$DNS_QPS")

# start_wrk MODE RATE CONNS SECONDS OUT -> sets WRK_PID (no subshell: we wait for it)
WRK_RUNS=0
start_wrk() {
    local mode="$1" rate="$2" conns="$3" secs="$4" out="$5"
    WRK_RUNS=$((WRK_RUNS + 1)) # registrations of each run get new ids
    BENCH_MODE="$mode" BENCH_KEY="$API_KEY" BENCH_THREADS=1 BENCH_RATE="$rate" BENCH_ROUND="$WRK_RUNS" \
        BENCH_BODIES="$IN/heartbeat.jsonl" BENCH_LEASE_NS=120000000000 \
        wrk -t 1 -c "$conns" -d "${secs}s" --timeout 5s \
        -s "$BENCH_LIB_DIR/rest.lua" "http://$BENCH_HOST:$HTTP_PORT/" >"$out" 2>&1 &
    WRK_PID=$!
    track_pid "$WRK_PID"
}

# phase NAME ROUND: one measured phase; churn load (against koder-dns's REST API) when NAME
# ends in "churn"; DNS against NSD when NAME starts with "baseline"
phase() {
    local name="$1" r="$2" pre="$BENCH_TMP/$1.$2" wr="" wh="" t0 t1
    local port="$DNS_PORT" pid="$KODER_PID"
    [[ $name == baseline* ]] && port="$NSD_PORT" pid="$NSD_PID"
    if [[ $name == *churn ]]; then
        start_wrk register "$REG_RATE" "$REG_CONNS" $((DURATION + 2)) "$pre.wrk-register"
        wr="$WRK_PID"
        start_wrk heartbeat "$HB_RATE" "$HB_CONNS" $((DURATION + 2)) "$pre.wrk-heartbeat"
        wh="$WRK_PID"
        sleep 1
    fi
    log "round $r/$ROUNDS $name: dnsperf ${DNS_QPS}/s + probe ${PROBE_QPS}/s for ${DURATION}s"
    t0="$(cpu_ticks "$pid")"
    python3 "$BENCH_LIB_DIR/dnsprobe.py" latency --port "$port" --queries "$IN/queries.txt" \
        --qps "$PROBE_QPS" --duration "$DURATION" >"$pre.probe" &
    local probe=$!
    track_pid "$probe"
    dnsperf -s "$BENCH_HOST" -p "$port" -d "$IN/queries.txt" -l "$DURATION" -c 8 -q 200 -t 2 \
        "${QFLAG[@]}" >"$pre.dnsperf" 2>&1 || { cat "$pre.dnsperf" >&2; die "dnsperf failed"; }
    wait "$probe" || die "latency probe failed"
    t1="$(cpu_ticks "$pid")"
    echo "$((t1 - t0))" >"$pre.cpu"
    if [[ -n $wr ]]; then
        wait "$wr" || { cat "$pre.wrk-register" >&2; die "wrk register failed"; }
        wait "$wh" || { cat "$pre.wrk-heartbeat" >&2; die "wrk heartbeat failed"; }
    fi
    kill -0 "$KODER_PID" 2>/dev/null || die "koder-dns died (see $BENCH_TMP/koder/log)"
}

for ((r = 1; r <= ROUNDS; r++)); do
    phase idle "$r"
    phase churn "$r"
done
if [[ -n $BASELINE_PEER ]]; then
    NSD_PORT="$(free_port)"
    start_nsd "$NSD_PORT" "$IN/$DOMAIN.zone" "$DOMAIN"
    phase baseline 1
    phase baseline-churn 1
fi

python3 - "$BENCH_TMP" "$ROUNDS" "$(clk_tck)" "$DURATION" "$BASELINE_PEER" <<'EOF'
import json, os, re, sys
d, rounds, tck, dur = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
baseline = sys.argv[5]

def dnsperf(path):
    t = open(path).read()
    num = lambda rx: float(re.search(rx, t).group(1))
    return dict(qps=num(r"Queries per second:\s+([\d.]+)"), lat=num(r"Average Latency \(s\):\s+([\d.]+)") * 1000,
                sent=num(r"Queries sent:\s+(\d+)"), lost=num(r"Queries lost:\s+(\d+)"))

def wrk(path):
    for line in open(path):
        if line.startswith("RESULT "):
            return {k: float(v) for k, v in (x.split("=") for x in line.split()[1:])}
    raise SystemExit(f"no RESULT in {path}:\n" + open(path).read())

hdr = (f"{'phase':<9} {'dnsperf QPS':>11} {'avg ms':>7} {'loss %':>7} | {'probe p50 ms':>12} {'p90':>6} {'p99':>6} "
       f"{'p99.9':>6} {'max':>6} {'lost':>5} | {'srv cores':>9}")
print()
print("DNS under load (dnsperf = bulk load, probe = latency sampler)")
print(hdr)
print("-" * len(hdr))
churn_rows = []
phases = [(ph, r) for r in range(1, rounds + 1) for ph in ("idle", "churn")]
if baseline:
    phases += [("baseline", 1), ("baseline-churn", 1)]
for ph, r in phases:
        pre = os.path.join(d, f"{ph}.{r}")
        p = dnsperf(pre + ".dnsperf")
        pr = json.loads(open(pre + ".probe").read())
        cores = int(open(pre + ".cpu").read()) / tck / dur
        loss = 100 * p["lost"] / p["sent"] if p["sent"] else 0
        label = {"baseline": f"{baseline} idle", "baseline-churn": f"{baseline} churn"}.get(ph, f"{ph} {r}")
        print(f"{label:<9} {p['qps']:>11.0f} {p['lat']:>7.3f} {loss:>7.2f} | {pr['p50_us']/1000:>12.3f} "
              f"{pr['p90_us']/1000:>6.3f} {pr['p99_us']/1000:>6.3f} {pr['p999_us']/1000:>6.2f} {pr['max_us']/1000:>6.1f} "
              f"{pr['lost']:>5} | {cores:>9.2f}")
        if ph.endswith("churn"):
            churn_rows.append((label, wrk(pre + ".wrk-register"), wrk(pre + ".wrk-heartbeat")))
print()
print("REST churn load during the churn phases (wrk, paced)")
hdr2 = f"{'phase':<10} {'load':<10} {'target/s':>8} {'achieved/s':>10} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'non-2xx':>8} {'sock err':>8}"
print(hdr2)
print("-" * len(hdr2))
targets = {"register": float(os.environ.get("REG_RATE", 1000)), "heartbeat": float(os.environ.get("HB_RATE", 10000))}
for r, reg, hb in churn_rows:
    for name, w in (("register", reg), ("heartbeat", hb)):
        rate = w["requests"] / (w["duration_us"] / 1e6)
        se = w["err_connect"] + w["err_read"] + w["err_write"] + w["err_timeout"]
        print(f"{r:<10} {name:<10} {targets[name]:>8.0f} {rate:>10.0f} {w['lat_p50_us']/1000:>7.2f} "
              f"{w['lat_p99_us']/1000:>7.2f} {w['lat_max_us']/1000:>7.1f} {int(w['err_status']):>8} {int(se):>8}")
EOF
echo
echo "register = a new instance per request (50 service names churn00..49, not asked about over DNS, lease 120 s);"
echo "heartbeat = renewals of the $((SERVICES * INSTANCES)) instances whose SRV/A/TXT the DNS load asks for."
echo "wrk runs $((DURATION + 2)) s (starts 1 s before the DNS phase). probe times include ~10-20 us of Python overhead."
echo "koder-dns: TOKIO_WORKER_THREADS=$THREADS; srv cores = the server's CPU time / phase time"
[[ -n $BASELINE_PEER ]] && echo "'$BASELINE_PEER idle' / '$BASELINE_PEER churn' = the same phases with DNS asked of NSD (server-count $THREADS) serving the same records, the churn load still on koder-dns's REST API: what this machine gives a fast server, idle and under the same CPU contention"
echo "$(machine_note): dnsperf, the probe and two wrk processes share them with the server"
