#!/usr/bin/env bash
# The signed zone (issue #28): what --dnssec costs koder-dns, and how it compares with Knot
# DNS signing the same zone itself. Four figures, in one run:
#
#   1. DO vs no DO: dnsperf with the DO bit (-D) against the signed koder-dns, and the same
#      queries without it, in the same rounds (goal >= 0.9x).
#   2. koder-dns signed vs Knot DNS with automatic signing (dnssec-signing: on, ECDSA P-256
#      combined key, NSEC), same names, same mix, both with DO (goal >= 1.0x).
#   3. Registrations/s into a koder-dns with --dnssec against one without, fresh batches in
#      alternated rounds (goal >= 0.8x).
#   4. Memory per instance with signatures: after 3, every name of both servers asked
#      (SRV, A, TXT, with DO), resident size per instance of each.
#
# Env knobs (defaults):
#   DURATION=10 ROUNDS=3 WARMUP=2      dnsperf seconds per run, rounds (order rotates), warm-up
#   THREADS=2                          worker threads of every server
#   SERVICES=200 INSTANCES=5           the fleet of 1 and 2
#   QUERY_MIX=srv=60,a=20,txt=10,nx=10 (nx: names that do not exist, each once per pass)
#   CLIENTS=8 OUTSTANDING=200          dnsperf -c, -q
#   REG_COUNT=20000 REG_ROUNDS=3       instances per registration round, rounds
#   REG_PROCS=4 REG_CONNS=8            registration clients
#   KODER_DNS_BIN, SKIP_BUILD=1, KEEP_TMP=1
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
QUERY_MIX="${QUERY_MIX:-srv=60,a=20,txt=10,nx=10}"
CLIENTS="${CLIENTS:-8}"
OUTSTANDING="${OUTSTANDING:-200}"
REG_COUNT="${REG_COUNT:-20000}"
REG_ROUNDS="${REG_ROUNDS:-3}"
REG_PROCS="${REG_PROCS:-4}"
REG_CONNS="${REG_CONNS:-8}"
DOMAIN=service.koder

bench_init dnssec
need_common_tools
need_pkg dnsperf dnsperf
need_peers
KODER_BIN="$(koder_bin)"

IN="$BENCH_TMP/in"
python3 "$BENCH_LIB_DIR/gen.py" "$IN" --services "$SERVICES" --instances "$INSTANCES" \
    --mix "$QUERY_MIX" --domain "$DOMAIN" >&2

# ---- 1 and 2: queries
declare -A PORT PID DO
PORT[koder]="$(free_port)"
HTTP_PORT="$(free_port)"
KODER_NAME=koder-signed start_koder "${PORT[koder]}" "$HTTP_PORT" --dnssec
PID[koder]="$KODER_PID"
register_jsonl "$IN/register.jsonl" "live instances" --procs 4
PORT[knot]="$(free_port)"
KNOT_DNSSEC=on start_knot "${PORT[knot]}" "$IN/$DOMAIN.zone" "$DOMAIN"
PID[knot]="$KNOT_PID"
for ((i = 0; i < 100; i++)); do
    dig @"$BENCH_HOST" -p "${PORT[knot]}" "$DOMAIN" DNSKEY +short +time=1 | grep -q . && break
    sleep 0.1
done
dig @"$BENCH_HOST" -p "${PORT[knot]}" "$DOMAIN" DNSKEY +short +time=1 | grep -q . || die "Knot did not sign the zone"
# Three targets: the signed koder-dns without and with DO, Knot with DO.
TARGETS=(koder koderdo knotdo)
PID[koderdo]="${PID[koder]}" PORT[koderdo]="${PORT[koder]}" PID[knotdo]="${PID[knot]}" PORT[knotdo]="${PORT[knot]}"
DO[koder]="" DO[koderdo]="-D" DO[knotdo]="-D"

# Both signed servers answer with signatures that verify? (one SRV each, by dig +dnssec)
for s in koder knot; do
    sigs="$(dig @"$BENCH_HOST" -p "${PORT[$s]}" "$(head -n1 "$IN/check.txt" | cut -d' ' -f1)" SRV +dnssec +norec +short | grep -c '^SRV ' || true)"
    [[ $sigs -ge 1 ]] || die "$s answers DO queries without an RRSIG"
done

run_dnsperf() { # TARGET SECONDS OUTFILE
    local s="$1" secs="$2" out="$3" t0 t1
    t0="$(cpu_ticks "${PID[$s]}")"
    # shellcheck disable=SC2086
    "${ON_LOAD[@]}" dnsperf -s "$BENCH_HOST" -p "${PORT[$s]}" -d "$IN/queries.txt" ${DO[$s]} \
        -l "$secs" -c "$CLIENTS" -q "$OUTSTANDING" -t 2 >"$out" 2>&1 || { cat "$out" >&2; die "dnsperf against $s failed"; }
    t1="$(cpu_ticks "${PID[$s]}")"
    echo "server_cpu_ticks $((t1 - t0))" >>"$out"
}

for s in "${TARGETS[@]}"; do
    log "warm-up $s (${WARMUP}s)"
    run_dnsperf "$s" "$WARMUP" "$BENCH_TMP/warmup.$s"
done
RESULTS="$BENCH_TMP/queries.tsv"
: >"$RESULTS"
n=${#TARGETS[@]}
for ((r = 1; r <= ROUNDS; r++)); do
    for ((i = 0; i < n; i++)); do
        s="${TARGETS[$(((i + r - 1) % n))]}"
        out="$BENCH_TMP/dnsperf.$s.$r"
        log "round $r/$ROUNDS: $s (${DURATION}s)"
        run_dnsperf "$s" "$DURATION" "$out"
        rsize="$(sed -n 's/.*response \([0-9]*\).*/\1/p' "$out" | head -n1)"
        printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$s" "$r" "$(dnsperf_field "$out" 'Queries per second:')" \
            "$(dnsperf_field "$out" 'Queries lost:')" "${rsize:-0}" "$(awk '/^server_cpu_ticks/ {print $2}' "$out")" >>"$RESULTS"
    done
done
stop_pid "${PID[knot]}"

# ---- 3: registrations/s, signed against unsigned
python3 "$BENCH_LIB_DIR/gen.py" "$BENCH_TMP/reg" --services $((REG_COUNT * REG_ROUNDS / 100)) --instances 100 \
    --no-zone >&2
split -d -n "l/$REG_ROUNDS" "$BENCH_TMP/reg/register.jsonl" "$BENCH_TMP/reg/round."
declare -A RPORT RHTTP RPID RSS0
for s in plain signed; do
    RPORT[$s]="$(free_port)" RHTTP[$s]="$(free_port)"
    flag=()
    [[ $s == signed ]] && flag=(--dnssec)
    KODER_NAME="koder-reg-$s" start_koder "${RPORT[$s]}" "${RHTTP[$s]}" "${flag[@]}"
    RPID[$s]="$KODER_PID"
    sleep 1
    RSS0[$s]="$(rss_kib "$KODER_PID")"
done
REG="$BENCH_TMP/registrations.tsv"
: >"$REG"
r=0
for chunk in "$BENCH_TMP"/reg/round.*; do
    r=$((r + 1))
    order=(plain signed)
    ((r % 2 == 0)) && order=(signed plain)
    for s in "${order[@]}"; do
        HTTP_PORT="${RHTTP[$s]}"
        register_jsonl "$chunk" "round $r into $s" --procs "$REG_PROCS" --conns "$REG_CONNS"
        rate="$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["rate"])' "$REGISTERED")"
        printf '%s\t%s\t%s\n' "$s" "$r" "$rate" >>"$REG"
    done
done

# ---- 4: memory per instance, every name asked with DO (the signed one signs them all)
SWEEP="$BENCH_TMP/sweep.txt"
python3 - "$BENCH_TMP/reg/register.jsonl" "$DOMAIN" >"$SWEEP" <<'EOF'
import json, sys
names = sorted({json.loads(l)["name"] for l in open(sys.argv[1])})
for n in names:
    print(f"_{n}._tcp.{sys.argv[2]}. SRV\n{n}.{sys.argv[2]}. A\n{n}.{sys.argv[2]}. TXT")
EOF
MEM="$BENCH_TMP/memory.tsv"
: >"$MEM"
TOTAL="$(wc -l <"$BENCH_TMP/reg/register.jsonl")"
for s in plain signed; do
    dnsperf -s "$BENCH_HOST" -p "${RPORT[$s]}" -m tcp -d "$SWEEP" -D -n 1 -c 4 -q 50 -t 5 >"$BENCH_TMP/sweep.$s" 2>&1 \
        || { cat "$BENCH_TMP/sweep.$s" >&2; die "the sweep of $s failed"; }
    sleep 1
    printf '%s\t%s\t%s\n' "$s" "${RSS0[$s]}" "$(rss_kib "${RPID[$s]}")" >>"$MEM"
done

# ---- report
python3 - "$RESULTS" "$REG" "$MEM" "$(clk_tck)" "$DURATION" "$TOTAL" <<'EOF'
import statistics, sys
q, reg, mem, tck, dur, total = sys.argv[1:7]
tck, dur, total = float(tck), float(dur), int(total)
names = {"koder": "koder-dns signed, no DO", "koderdo": "koder-dns signed, DO", "knotdo": "Knot DNS signed, DO"}
by = {}
for s, r, qps, lost, rsize, ticks in (l.split("\t") for l in open(q).read().splitlines()):
    by.setdefault(s, []).append((float(qps), int(lost), int(rsize), int(ticks) / tck))
med = {}
print()
print(f"{'target':<26} {'QPS per round':<26} {'median QPS':>10} {'lost':>6} {'resp B':>6} {'srv cores':>9}")
for s in ("koder", "koderdo", "knotdo"):
    rs = by[s]
    med[s] = statistics.median(x[0] for x in rs)
    per = " ".join(f"{x[0] / 1000:.1f}k" for x in rs)
    print(f"{names[s]:<26} {per:<26} {med[s]:>10.0f} {sum(x[1] for x in rs):>6} {rs[0][2]:>6} "
          f"{statistics.mean(x[3] for x in rs) / dur:>9.2f}")
print()
print(f"DO / no DO (koder-dns, same run): {med['koderdo'] / med['koder']:.2f}  (goal >= 0.9)")
print(f"koder-dns / Knot DNS, both signed, DO: {med['koderdo'] / med['knotdo']:.2f}  (goal >= 1.0)")
rates = {}
for s, r, rate in (l.split("\t") for l in open(reg).read().splitlines()):
    rates.setdefault(s, []).append(float(rate))
print()
for s in ("plain", "signed"):
    print(f"registrations/s {s:<7} per round: {' '.join(f'{x:.0f}' for x in rates[s])}  median {statistics.median(rates[s]):.0f}")
print(f"registrations/s --dnssec / without: {statistics.median(rates['signed']) / statistics.median(rates['plain']):.2f}  (goal >= 0.8)")
print()
for s, before, after in (l.split("\t") for l in open(mem).read().splitlines()):
    per = (int(after) - int(before)) * 1024 / total
    print(f"memory {s:<7}: VmRSS {int(before) // 1024} -> {int(after) // 1024} MiB for {total} instances, {per:.0f} B per instance (every name asked with DO)")
EOF
echo
echo "fleet of 1-2: $((SERVICES * INSTANCES)) instances in $SERVICES services, mix $QUERY_MIX, dnsperf -c $CLIENTS -q $OUTSTANDING -l $DURATION," \
    "$ROUNDS rounds (order rotates); registrations: $REG_ROUNDS rounds of $REG_COUNT new instances, $REG_PROCS x $REG_CONNS clients"
echo "servers: $THREADS worker threads each; Knot: dnssec-signing on, ECDSAP256SHA256 combined key, NSEC"
echo "$(machine_note)"
