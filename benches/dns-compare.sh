#!/usr/bin/env bash
# DNS macro benchmark: koder-dns vs NSD vs Knot DNS, same records, same query mix.
#
# One fleet description (SERVICES x INSTANCES) becomes a zone file for NSD and
# Knot and REST registrations for koder-dns. dnsperf runs against each server
# in alternating rounds (the order rotates each round). See benches/README.md.
#
# Env knobs (defaults):
#   DURATION=10       seconds per dnsperf run
#   ROUNDS=3          rounds (each round runs every server once)
#   WARMUP=2          seconds of unmeasured dnsperf per server before round 1
#   THREADS=2         worker threads for every server (koder-dns: TOKIO_WORKER_THREADS,
#                     NSD: server-count, Knot: udp-workers and tcp-workers)
#   SERVICES=200 INSTANCES=5
#   FILL_SERVICES=0 FILL_INSTANCES=5   when > 0, a second koder-dns ("koder+fill") with
#                     the same instances plus these "fill<n>" ones (not in the peers' zone,
#                     never queried), measured in the same rounds: registry size without
#                     changing the queries
#   QUERY_MIX=srv=60,a=20,txt=10,nx=10
#   CLIENTS=8 OUTSTANDING=200 DNSPERF_THREADS=1   dnsperf -c, -q, -T
#   DNSPERF_MODE=udp  (or tcp)
#   DNSPERF_TIMEOUT=2 dnsperf -t: a query unanswered this long counts as lost
#   RRL_RATE=0        when > 0, a second koder-dns ("koder+rrl") with the same instances and
#                     --dns-rrl-rate RRL_RATE, measured in the same rounds: the cost of rate
#                     limiting when no client is over the rate (dnsperf's one source must stay
#                     under it: pick a rate well above the QPS, e.g. 1000000)
#   BASELINE_BIN      a koder-dns binary of another build (say, the commit before a change):
#                     a second koder-dns ("baseline") from it with the same instances,
#                     measured in the same rounds; the table adds koder-dns / baseline
#   FIXED_QPS=100000  when > 0, after the rounds at saturation, as many rounds with dnsperf
#                     -Q FIXED_QPS (an offered load below saturation, where answers per
#                     server core-second are steady); 0 = saturation only
#   PEERS="nsd knot null"  which peers to run (subset allowed, or empty). "null" is a
#                     responder that does nothing (benches/null_responder.rs: header and
#                     question echoed, recvmmsg/sendmmsg in batches of 32): the floor of
#                     serving a query here. "hickory" adds hickory-server's own Server with a
#                     handler that does nothing (benches/hickory_ceiling.rs), the framework's
#                     ceiling. Neither is in the "fastest peer" ratio or the answer check
#   NULL_PAD=0        bytes of zeros the null responder adds after the question (240 makes its
#                     replies as long as koder-dns's answers to the default mix, 285 bytes on
#                     average): the same kernel cost per reply on both sides
#   NSD_MINIMAL=no    NSD minimal-responses (no = NSD default: adds NS + glue)
#   KODER_DNS_BIN     koder-dns binary (default: cargo build --release in the repo)
#   SKIP_BUILD=1      do not run cargo build
#   KEEP_TMP=1        keep the work dir (configs, logs, dnsperf outputs)
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
# shellcheck source=lib/peers.sh
source "$BENCH_LIB_DIR/peers.sh"

DURATION="${DURATION:-10}"
ROUNDS="${ROUNDS:-3}"
WARMUP="${WARMUP:-2}"
SERVICES="${SERVICES:-200}"
INSTANCES="${INSTANCES:-5}"
FILL_SERVICES="${FILL_SERVICES:-0}"
FILL_INSTANCES="${FILL_INSTANCES:-5}"
RRL_RATE="${RRL_RATE:-0}"
BASELINE_BIN="${BASELINE_BIN:-}"
QUERY_MIX="${QUERY_MIX:-srv=60,a=20,txt=10,nx=10}"
CLIENTS="${CLIENTS:-8}"
OUTSTANDING="${OUTSTANDING:-200}"
DNSPERF_THREADS="${DNSPERF_THREADS:-1}"
DNSPERF_MODE="${DNSPERF_MODE:-udp}"
DNSPERF_TIMEOUT="${DNSPERF_TIMEOUT:-2}"
PEERS="${PEERS-nsd knot null}"
FIXED_QPS="${FIXED_QPS:-100000}"
NULL_PAD="${NULL_PAD:-0}"
export NSD_MINIMAL="${NSD_MINIMAL:-no}"
DOMAIN=service.koder

bench_init dns-compare
need_common_tools
need_pkg dnsperf dnsperf
need_peers
KODER_BIN="$(koder_bin)"

IN="$BENCH_TMP/in"
python3 "$BENCH_LIB_DIR/gen.py" "$IN" --services "$SERVICES" --instances "$INSTANCES" \
    --mix "$QUERY_MIX" --domain "$DOMAIN" \
    --fill-services "$FILL_SERVICES" --fill-instances "$FILL_INSTANCES" >&2

declare -A PORT PID
SERVERS=(koder)
[[ $FILL_SERVICES -gt 0 ]] && SERVERS+=(koderfill)
[[ $RRL_RATE -gt 0 ]] && SERVERS+=(koderrrl)
[[ -n $BASELINE_BIN ]] && SERVERS+=(koderbase)
for p in $PEERS; do
    case "$p" in
        nsd | knot | null | hickory) SERVERS+=("$p") ;;
        *) die "unknown peer '$p' (nsd, knot, null, hickory)" ;;
    esac
done

# ---- start everything
PORT[koder]="$(free_port)"
HTTP_PORT="$(free_port)"
start_koder "${PORT[koder]}" "$HTTP_PORT"
PID[koder]="$KODER_PID"
log "registering $((SERVICES * INSTANCES)) instances over REST"
register_jsonl "$IN/register.jsonl" "live instances" --procs 4
if [[ -s $IN/fill.jsonl ]]; then
    PORT[koderfill]="$(free_port)"
    HTTP_PORT="$(free_port)"
    KODER_NAME=koder-fill start_koder "${PORT[koderfill]}" "$HTTP_PORT"
    PID[koderfill]="$KODER_PID"
    register_jsonl "$IN/register.jsonl" "live instances (koder-dns+fill)" --procs 4
    log "registering $((FILL_SERVICES * FILL_INSTANCES)) filler instances (koder-dns+fill only)"
    register_jsonl "$IN/fill.jsonl" filler --procs 4 --conns 8
fi

# start_second_koder KEY NAME [serve args...]: another koder-dns ($KODER_BIN) with the live
# instances, measured as KEY
start_second_koder() {
    local key="$1" name="$2"
    shift 2
    PORT[$key]="$(free_port)"
    HTTP_PORT="$(free_port)"
    KODER_NAME="$name" start_koder "${PORT[$key]}" "$HTTP_PORT" "$@"
    PID[$key]="$KODER_PID"
    register_jsonl "$IN/register.jsonl" "live instances ($name)" --procs 4
}
[[ $RRL_RATE -gt 0 ]] && start_second_koder koderrrl koder-rrl --dns-rrl-rate "$RRL_RATE"
if [[ -n $BASELINE_BIN ]]; then
    [[ -x $BASELINE_BIN ]] || die "BASELINE_BIN=$BASELINE_BIN is not an executable"
    KODER_BIN="$BASELINE_BIN" start_second_koder koderbase koder-before
fi

for p in $PEERS; do
    PORT[$p]="$(free_port)"
    case "$p" in
        nsd)
            start_nsd "${PORT[nsd]}" "$IN/$DOMAIN.zone" "$DOMAIN"
            PID[nsd]="$NSD_PID"
            ;;
        knot)
            start_knot "${PORT[knot]}" "$IN/$DOMAIN.zone" "$DOMAIN"
            PID[knot]="$KNOT_PID"
            ;;
        null)
            start_example null-responder "${PORT[null]}" "$NULL_PAD"
            PID[null]="$EXAMPLE_PID"
            ;;
        hickory)
            start_example hickory-ceiling "${PORT[hickory]}"
            PID[hickory]="$EXAMPLE_PID"
            ;;
    esac
done
ANSWERING_PEERS="${PEERS//hickory/}"
ANSWERING_PEERS="${ANSWERING_PEERS//null/}"

# ---- same answers? (sorted answer + additional sections, TTLs dropped; the
# ns.<domain> glue that NSD adds without minimal-responses is ignored)
canon() {
    local port="$1" name type
    while read -r name type; do
        printf '== %s %s: ' "$name" "$type"
        dig @"$BENCH_HOST" -p "$port" "$name" "$type" +norec +noedns +time=2 +tries=1 \
            +noall +comments +answer +additional 2>&1 |
            awk '/status:/ {sub(/,.*/, "", $6); print $6; next}
                 /^;/ || NF == 0 {next}
                 $1 == ns {next}
                 {$2 = ""; print}' ns="ns.$DOMAIN." | sort | tr '\n' '|'
        echo
    done <"$IN/check.txt"
}
canon "${PORT[koder]}" >"$BENCH_TMP/answers.koder"
MISMATCH=0
for p in ${PORT[koderfill]:+koderfill} ${PORT[koderrrl]:+koderrrl} ${PORT[koderbase]:+koderbase} $ANSWERING_PEERS; do
    canon "${PORT[$p]}" >"$BENCH_TMP/answers.$p"
    if ! diff -u "$BENCH_TMP/answers.$p" "$BENCH_TMP/answers.koder" >"$BENCH_TMP/answers.diff.$p"; then
        MISMATCH=1
        log "WARNING: koder-dns answers differ from $p (answer/additional sections):"
        grep '^[-+]=' "$BENCH_TMP/answers.diff.$p" | cut -c1-300 >&2
    fi
done
[[ $MISMATCH == 0 ]] && log "answer check: koder-dns returns the same records as: ${PORT[koderfill]:+koder-dns+fill }${PORT[koderbase]:+baseline }${ANSWERING_PEERS:-(no peers)}"

# ---- dnsperf runs
# run_dnsperf SERVER SECONDS OUTFILE [QPS]  (also records server CPU ticks); QPS > 0 offers
# that load (dnsperf -Q) instead of as much as the server takes
run_dnsperf() {
    local s="$1" secs="$2" out="$3" qps="${4:-0}" t0 t1 d0 d1 limit=()
    ((qps > 0)) && limit=(-Q "$qps")
    d0="$(udp_rcvbuf_errors)"
    t0="$(cpu_ticks "${PID[$s]}")"
    "${ON_LOAD[@]}" dnsperf -s "$BENCH_HOST" -p "${PORT[$s]}" -m "$DNSPERF_MODE" -d "$IN/queries.txt" \
        -l "$secs" -c "$CLIENTS" -q "$OUTSTANDING" -T "$DNSPERF_THREADS" -t "$DNSPERF_TIMEOUT" "${limit[@]}" >"$out" 2>&1 \
        || { cat "$out" >&2; die "dnsperf against $s failed"; }
    t1="$(cpu_ticks "${PID[$s]}")"
    d1="$(udp_rcvbuf_errors)"
    echo "server_cpu_ticks $((t1 - t0))" >>"$out"
    echo "udp_rcvbuf_errors $((d1 - d0))" >>"$out"
}

if [[ $WARMUP -gt 0 ]]; then
    for s in "${SERVERS[@]}"; do
        log "warm-up $s (${WARMUP}s)"
        run_dnsperf "$s" "$WARMUP" "$BENCH_TMP/warmup.$s"
    done
fi

TCK="$(clk_tck)"
RESULTS="$BENCH_TMP/results.tsv"
: >"$RESULTS"
n=${#SERVERS[@]}
LOADS=(0)
((FIXED_QPS > 0)) && LOADS+=("$FIXED_QPS")
for load in "${LOADS[@]}"; do
    for ((r = 1; r <= ROUNDS; r++)); do
        for ((i = 0; i < n; i++)); do
            s="${SERVERS[$(((i + r - 1) % n))]}"
            out="$BENCH_TMP/dnsperf.$s.$load.$r"
            if ((load > 0)); then at="$load qps"; else at=saturation; fi
            log "round $r/$ROUNDS at $at: $s (${DURATION}s)"
            run_dnsperf "$s" "$DURATION" "$out" "$load"
            qps="$(dnsperf_field "$out" 'Queries per second:')"
            lat="$(dnsperf_field "$out" 'Average Latency (s):')"
            sent="$(dnsperf_field "$out" 'Queries sent:')"
            lost="$(dnsperf_field "$out" 'Queries lost:')"
            rsize="$(sed -n 's/.*response \([0-9]*\).*/\1/p' "$out" | head -n1)"
            nx="$(sed -n 's/.*NXDOMAIN [0-9]* (\([0-9.]*\)%).*/\1/p' "$out" | head -n1)"
            ticks="$(awk '/^server_cpu_ticks/ {print $2}' "$out")"
            drops="$(awk '/^udp_rcvbuf_errors/ {print $2}' "$out")"
            printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$load" "$s" "$r" "$qps" "$lat" "$sent" "$lost" \
                "${rsize:-0}" "${nx:-0}" "$ticks" "$drops" >>"$RESULTS"
        done
    done
done

# ---- report
python3 - "$RESULTS" "$TCK" "$DURATION" <<'EOF'
import statistics, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1]) if l.strip()]
tck, dur = float(sys.argv[2]), float(sys.argv[3])
names = {"koder": "koder-dns", "koderfill": "koder+fill", "koderrrl": "koder+rrl", "koderbase": "baseline", "nsd": "NSD", "knot": "Knot DNS",
         "null": "null*", "hickory": "hickory*"}
by = {}
for load, s, r, qps, lat, sent, lost, rsize, nx, ticks, drops in rows:
    by.setdefault(int(load), {}).setdefault(s, []).append(dict(
        qps=float(qps), lat=float(lat), sent=int(sent), lost=int(lost), rsize=int(rsize), nx=float(nx),
        cpu=int(ticks) / tck, drops=int(drops)))
for load, servers in sorted(by.items()):
    print()
    print("at saturation (as many queries as the server takes)" if load == 0 else
          f"at a fixed offered load of {load} queries/s (dnsperf -Q)")
    hdr = (f"{'server':<10} {'QPS per round':<28} {'median QPS':>10} {'avg lat ms':>10} {'loss %':>7} {'resp B':>6} "
           f"{'NXD %':>6} {'srv cores':>9} {'us CPU/q':>8} {'answers/core-s':>14} {'rcvbuf drops':>12}")
    print(hdr)
    print("-" * len(hdr))
    med, per_core = {}, {}
    for s in ["koder", "koderfill", "koderrrl", "koderbase", "nsd", "knot", "null", "hickory"]:
        if s not in servers:
            continue
        rs = servers[s]
        med[s] = statistics.median(x["qps"] for x in rs)
        # answers per second of the server's own CPU: the median of the rounds
        per_core[s] = statistics.median((x["sent"] - x["lost"]) / x["cpu"] if x["cpu"] else 0 for x in rs)
        lat = statistics.mean(x["lat"] for x in rs) * 1000
        sent = sum(x["sent"] for x in rs)
        loss = 100.0 * sum(x["lost"] for x in rs) / sent if sent else 0
        cores = statistics.mean(x["cpu"] for x in rs) / dur
        usq = 1e6 * sum(x["cpu"] for x in rs) / max(1, sum(x["sent"] - x["lost"] for x in rs))
        per = " ".join(f"{x['qps']/1000:.1f}k" for x in rs)
        print(f"{names[s]:<10} {per:<28} {med[s]:>10.0f} {lat:>10.3f} {loss:>7.2f} {rs[0]['rsize']:>6} "
              f"{statistics.mean(x['nx'] for x in rs):>6.1f} {cores:>9.2f} {usq:>8.1f} {per_core[s]:>14.0f} "
              f"{sum(x['drops'] for x in rs):>12}")
    if "koder" not in med:
        continue
    peers = {s: q for s, q in med.items() if s in ("nsd", "knot")}
    if peers:
        best = max(peers, key=peers.get)
        print(f"ratio koder-dns / fastest peer ({names[best]}): {med['koder'] / peers[best]:.2f} (median QPS)")
        frugal = max(peers, key=per_core.get)
        print(f"ratio koder-dns / most frugal peer ({names[frugal]}): {per_core['koder'] / per_core[frugal]:.2f}"
              " (answers per server core-second)")
    if "null" in med:
        print(f"ratio koder-dns / null*: {med['koder'] / med['null']:.2f} (median QPS), "
              f"{per_core['koder'] / per_core['null']:.2f} (answers per server core-second)")
    if "koderfill" in med:
        print(f"ratio koder-dns+fill / koder-dns: {med['koderfill'] / med['koder']:.2f} (median QPS)")
    if "koderrrl" in med:
        print(f"ratio koder-dns+rrl / koder-dns: {med['koderrrl'] / med['koder']:.2f} (median QPS), "
              f"{per_core['koderrrl'] / per_core['koder']:.2f} (answers per server core-second);"
              " rate limiting on, no client over the rate")
    if "koderbase" in med:
        print(f"ratio koder-dns / baseline: {med['koder'] / med['koderbase']:.2f} (median QPS), "
              f"{per_core['koder'] / per_core['koderbase']:.2f} (answers per server core-second)")
    if "hickory" in med:
        print(f"ratio koder-dns / hickory*: {med['koder'] / med['hickory']:.2f} (median QPS)")
print()
print("null* = a responder that does nothing (benches/null_responder.rs: header and question echoed, no lookup,"
      " recvmmsg/sendmmsg in batches of 32 over UDP, over TCP a thread per connection that reads"
      " through a buffer and writes the replies to queries read together at once); hickory* = hickory-server's"
      " Server with a handler that answers nothing, the framework's ceiling")
EOF
echo
echo "query mix: $QUERY_MIX over $((SERVICES * INSTANCES)) instances in $SERVICES services;" \
    "dnsperf -m $DNSPERF_MODE -c $CLIENTS -q $OUTSTANDING -T $DNSPERF_THREADS -l $DURATION, $ROUNDS rounds (order rotates)"
if [[ $FILL_SERVICES -gt 0 ]]; then
    echo "koder+fill = a second koder-dns that also holds $((FILL_SERVICES * FILL_INSTANCES)) filler instances in $FILL_SERVICES services" \
        "(never queried; not in the peers' zone): $((SERVICES * INSTANCES + FILL_SERVICES * FILL_INSTANCES)) registered in all"
fi
echo "servers: $THREADS worker threads each (koder-dns TOKIO_WORKER_THREADS and --dns-udp-workers, NSD server-count + reuseport," \
    "Knot udp/tcp-workers); NSD rrl off, minimal-responses $NSD_MINIMAL"
echo "srv cores = server CPU time / run time; us CPU/q = server CPU per answered query;" \
    "answers/core-s = answered queries per second of server CPU (median of the rounds); rcvbuf drops = UDP RcvbufErrors (whole machine) during the runs; resp B = dnsperf's average response size"
echo "$(machine_note); dnsperf takes the rest of the CPU, so QPS is what the server gets from the cores left to it"
