#!/usr/bin/env bash
# Response rate limiting under a spoofed-source flood: are legitimate clients on another
# network still answered, and how much slower? See benches/README.md.
#
# One koder-dns with --dns-rrl-rate RATE. Three phases of DURATION seconds each, in every
# round, with lib/dnsprobe.py as the legitimate client (from 127.0.0.1, one query at a
# time, PROBE_QPS/s, under the rate) measuring p50/p99:
#   idle:    the probe alone;
#   random:  + lib/spoof.py forging FLOOD_QPS queries/s for one name from random sources
#            all over 127.0.0.0/8 (outside 127.0.0.0/16): each /24 sees a query now and
#            then, so nothing is limited, and the table turns over;
#   victim:  + the same flood from one /24 (127.2.0.0/24), as a reflection attack aimed at
#            it looks: limited to RATE/s, the rest dropped or slipped.
# The report: the probe's p50/p99 per phase and p99 / idle p99, its losses, the flood's
# achieved rate, the server's CPU, and what the RRL metrics counted.
#
# Env knobs (defaults):
#   DURATION=10 ROUNDS=1 RATE=200 SLIP=2 FLOOD_QPS=20000 PROBE_QPS=100
#   KODER_DNS_BIN, SKIP_BUILD=1, KEEP_TMP=1, KODER_DNS_LOG=warn
# Needs root for the raw socket of lib/spoof.py. Only 127.0.0.1 is ever a destination.
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"

DURATION="${DURATION:-10}"
ROUNDS="${ROUNDS:-1}"
RATE="${RATE:-200}"
SLIP="${SLIP:-2}"
FLOOD_QPS="${FLOOD_QPS:-20000}"
PROBE_QPS="${PROBE_QPS:-100}"
[[ $PROBE_QPS -lt $RATE ]] || die "PROBE_QPS ($PROBE_QPS) must stay under RATE ($RATE): the probe is a client within the rate"
[[ $(id -u) == 0 ]] || die "lib/spoof.py forges source addresses with a raw socket: run as root"

bench_init rrl-flood
need_common_tools
KODER_BIN="$(koder_bin)"

DNS_PORT="$(free_port)"
HTTP_PORT="$(free_port)"
start_koder "$DNS_PORT" "$HTTP_PORT" --dns-rrl-rate "$RATE" --dns-rrl-slip "$SLIP"
for body in '{"name":"voice","address":"10.0.0.1","port":5060,"ttl_ns":3600000000000}' \
    '{"name":"voice","address":"10.0.0.2","port":5060,"ttl_ns":3600000000000}' \
    '{"name":"flood","address":"10.0.9.1","port":80,"ttl_ns":3600000000000}'; do
    curl -sf -H "X-API-Key: $API_KEY" -d "$body" "http://$BENCH_HOST:$HTTP_PORT/api/v1/services/register" >/dev/null ||
        die "registration failed"
done
printf '_voice._tcp.service.koder SRV\nvoice.service.koder A\n' >"$BENCH_TMP/probe.txt"

metric() { # metric NAME -> the counter's value now
    curl -sf "http://$BENCH_HOST:$HTTP_PORT/metrics" | awk -v n="$1" '$1 == n {print $2}'
}

# phase NAME ROUND
phase() {
    local name="$1" r="$2" pre="$BENCH_TMP/$1.$2" t0 t1 flood=""
    local d0 s0
    d0="$(metric koder_dns_rrl_dropped_total)" s0="$(metric koder_dns_rrl_slipped_total)"
    if [[ $name != idle ]]; then
        python3 "$BENCH_LIB_DIR/spoof.py" --port "$DNS_PORT" --name _flood._tcp.service.koder --type SRV \
            --qps "$FLOOD_QPS" --duration $((DURATION + 1)) --sources "$name" >"$pre.spoof" &
        flood=$!
        track_pid "$flood"
        sleep 0.5
    fi
    log "round $r/$ROUNDS $name: probe ${PROBE_QPS}/s for ${DURATION}s${flood:+, flood ${FLOOD_QPS}/s from $name sources}"
    t0="$(cpu_ticks "$KODER_PID")"
    python3 "$BENCH_LIB_DIR/dnsprobe.py" latency --port "$DNS_PORT" --queries "$BENCH_TMP/probe.txt" \
        --qps "$PROBE_QPS" --duration "$DURATION" --timeout 1 >"$pre.probe" || die "latency probe failed"
    t1="$(cpu_ticks "$KODER_PID")"
    [[ -z $flood ]] || wait "$flood" || die "spoof.py failed"
    echo "$((t1 - t0)) $(($(metric koder_dns_rrl_dropped_total) - d0)) $(($(metric koder_dns_rrl_slipped_total) - s0))" >"$pre.server"
    kill -0 "$KODER_PID" 2>/dev/null || die "koder-dns died (see $BENCH_TMP/koder/log)"
}

for ((r = 1; r <= ROUNDS; r++)); do
    for name in idle random victim; do
        phase "$name" "$r"
    done
done

python3 - "$BENCH_TMP" "$ROUNDS" "$(clk_tck)" "$DURATION" <<'EOF'
import json, os, statistics, sys
d, rounds, tck, dur = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
rows = {}
for r in range(1, rounds + 1):
    for ph in ("idle", "random", "victim"):
        pre = os.path.join(d, f"{ph}.{r}")
        probe = json.loads(open(pre + ".probe").read())
        ticks, dropped, slipped = (int(x) for x in open(pre + ".server").read().split())
        spoof = json.loads(open(pre + ".spoof").read()) if os.path.exists(pre + ".spoof") else None
        rows.setdefault(ph, []).append(dict(probe=probe, cores=ticks / tck / dur, dropped=dropped,
                                            slipped=slipped, flood=spoof["sent"] / spoof["elapsed_s"] if spoof else 0))
hdr = (f"{'phase':<7} {'flood/s':>8} | {'probe p50 ms':>12} {'p99 ms':>7} {'p99/idle':>8} {'lost':>5} {'answered %':>10} "
       f"| {'srv cores':>9} {'rrl dropped':>11} {'rrl slipped':>11}")
print()
print(hdr)
print("-" * len(hdr))
idle_p99 = statistics.median(x["probe"]["p99_us"] for x in rows["idle"])
for ph in ("idle", "random", "victim"):
    for x in rows[ph]:
        p = x["probe"]
        answered = 100.0 * p["received"] / p["sent"] if p["sent"] else 0
        print(f"{ph:<7} {x['flood']:>8.0f} | {p['p50_us']/1000:>12.3f} {p['p99_us']/1000:>7.3f} "
              f"{p['p99_us']/idle_p99:>8.2f} {p['lost']:>5} {answered:>10.2f} | {x['cores']:>9.2f} "
              f"{x['dropped']:>11} {x['slipped']:>11}")
EOF
echo
echo "koder-dns --dns-rrl-rate $RATE --dns-rrl-slip $SLIP; probe = lib/dnsprobe.py from 127.0.0.1 (its own /24), ${PROBE_QPS}/s,"
echo "one query at a time; flood = lib/spoof.py, one name, forged sources: random = all over 127.0.0.0/8, victim = 127.2.0.0/24."
echo "p99/idle = the phase's probe p99 over the idle phase's (the target: within 2x). srv cores = server CPU / phase time."
echo "$(machine_note): the probe and the flooder share them with the server"
