#!/usr/bin/env bash
# Memory: resident size of koder-dns holding COUNT registered instances.
# See benches/README.md.
#
# Env knobs (defaults):
#   COUNT=100000        instances to register (PER_SERVICE per service name)
#   PER_SERVICE=100
#   PROCS=4 CONNS=8     registration clients: processes x keep-alive connections each
#   SETTLE=3            seconds to wait after the last registration before measuring
#   THREADS=2           TOKIO_WORKER_THREADS of koder-dns
#   KODER_DNS_BIN, SKIP_BUILD=1, KEEP_TMP=1, KODER_DNS_LOG=warn
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"

COUNT="${COUNT:-100000}"
PER_SERVICE="${PER_SERVICE:-100}"
PROCS="${PROCS:-4}"
CONNS="${CONNS:-8}"
SETTLE="${SETTLE:-3}"
DOMAIN=service.koder

bench_init memory
need_common_tools
need_pkg dig bind9-dnsutils
need_pkg dnsperf dnsperf
KODER_BIN="$(koder_bin)"

SERVICES=$(((COUNT + PER_SERVICE - 1) / PER_SERVICE))
IN="$BENCH_TMP/in"
python3 "$BENCH_LIB_DIR/gen.py" "$IN" --services "$SERVICES" --instances "$PER_SERVICE" --no-zone >&2
N="$(wc -l <"$IN/register.jsonl")"

DNS_PORT="$(free_port)"
HTTP_PORT="$(free_port)"
start_koder "$DNS_PORT" "$HTTP_PORT"
sleep 1
RSS0="$(rss_kib "$KODER_PID")"
log "baseline VmRSS ${RSS0} KiB; registering $N instances ($PROCS procs x $CONNS conns)"

register_jsonl "$IN/register.jsonl" instances --procs "$PROCS" --conns "$CONNS" --max-seconds 600
sleep "$SETTLE"
RSS1="$(rss_kib "$KODER_PID")"
HWM1="$(hwm_kib "$KODER_PID")"

# touch the DNS path (answers may be built lazily), then the name listing
mapfile -t SNAMES < <(python3 -c '
import json, sys
seen = []
for line in open(sys.argv[1]):
    n = json.loads(line)["name"]
    if not seen or seen[-1] != n:
        seen.append(n)
step = max(1, len(seen) // 50)
print("\n".join(seen[::step]))' "$IN/register.jsonl")
srv="$(dig @"$BENCH_HOST" -p "$DNS_PORT" "_${SNAMES[0]}._tcp.$DOMAIN" SRV +tcp +short +time=5 | wc -l)"
for s in "${SNAMES[@]}"; do
    python3 "$BENCH_LIB_DIR/dnsprobe.py" ping --port "$DNS_PORT" --name "$s.$DOMAIN" --type A >/dev/null
    python3 "$BENCH_LIB_DIR/dnsprobe.py" ping --port "$DNS_PORT" --name "_$s._tcp.$DOMAIN" --type SRV >/dev/null
done
RSS2="$(rss_kib "$KODER_PID")"
names="$(curl -s -H "X-API-Key: $API_KEY" "http://$BENCH_HOST:$HTTP_PORT/api/v1/services" |
    python3 -c 'import json,sys; print(len(json.load(sys.stdin)["services"]))')"
RSS2B="$(rss_kib "$KODER_PID")"

# every answer prepared: SRV, A and TXT of every service, each asked once
python3 -c '
import json, sys
names = sorted({json.loads(line)["name"] for line in open(sys.argv[1])})
for n in names:
    print(f"_{n}._tcp.service.koder. SRV\n{n}.service.koder. A\n{n}.service.koder. TXT")' "$IN/register.jsonl" >"$IN/every.txt"
dnsperf -s "$BENCH_HOST" -p "$DNS_PORT" -d "$IN/every.txt" -n 1 -c 1 -q 50 >"$BENCH_TMP/every.dnsperf" 2>&1 \
    || { cat "$BENCH_TMP/every.dnsperf" >&2; die "dnsperf failed"; }
grep -q "Queries lost: *0 " "$BENCH_TMP/every.dnsperf" || { cat "$BENCH_TMP/every.dnsperf" >&2; die "queries lost"; }
RSS2C="$(rss_kib "$KODER_PID")"

# full listing last: its response (tens of MB) raises the peak, not the steady state
detail="$(curl -s -H "X-API-Key: $API_KEY" "http://$BENCH_HOST:$HTTP_PORT/api/v1/services?detail=1" |
    python3 -c 'import json,sys; print(len(json.load(sys.stdin)["instances"]))')"
sleep 1
RSS3="$(rss_kib "$KODER_PID")"
HWM3="$(hwm_kib "$KODER_PID")"
DISK="$(du -sk "$BENCH_TMP/koder/data" | awk '{print $1}')"

# restart on the same data dir: the registry is rebuilt from disk without the
# garbage and allocator slack of 100k HTTP requests
log "restarting koder-dns on the same data dir"
stop_pid "$KODER_PID"
start_koder "$DNS_PORT" "$HTTP_PORT"
sleep "$SETTLE"
RSS4="$(rss_kib "$KODER_PID")"
restored="$(curl -s -H "X-API-Key: $API_KEY" "http://$BENCH_HOST:$HTTP_PORT/api/v1/services?detail=1&name=${SNAMES[0]}" |
    python3 -c 'import json,sys; print(len(json.load(sys.stdin)["instances"]))')"

python3 - "$N" "$RSS0" "$RSS1" "$HWM1" "$RSS2" "$RSS3" "$HWM3" "$DISK" "$REGISTERED" "$detail" "$names" "$srv" "$PER_SERVICE" "$RSS2B" "${#SNAMES[@]}" "$RSS4" "$restored" "$RSS2C" <<'EOF'
import json, sys
n, rss0, rss1, hwm1, rss2, rss3, hwm3, disk = (int(x) for x in sys.argv[1:9])
reg = json.loads(sys.argv[9])
detail, names, srv, per = int(sys.argv[10]), int(sys.argv[11]), int(sys.argv[12]), int(sys.argv[13])
rss2b, nq, rss4, restored, rss2c = int(sys.argv[14]), int(sys.argv[15]), int(sys.argv[16]), int(sys.argv[17]), int(sys.argv[18])
mib = lambda k: f"{k / 1024:.1f} MiB"
rows = [
    ("instances registered (200 OK)", f"{reg['ok']} of {n} in {reg['elapsed_s']} s ({reg['rate']:.0f}/s)"),
    ("instances listed (?detail=1)", f"{detail} in {names} services"),
    ("SRV records for one service (TCP)", f"{srv} ({per} registered; one TCP message holds at most 64 KiB)"),
    ("VmRSS at start (empty)", mib(rss0)),
    ("VmRSS after registering", mib(rss1)),
    ("VmHWM (peak) after registering", mib(hwm1)),
    (f"VmRSS after A+SRV for {nq} names (UDP)", mib(rss2)),
    ("VmRSS after GET /services (names)", mib(rss2b)),
    ("VmRSS after SRV+A+TXT of every service", f"{mib(rss2c)}  (every answer prepared)"),
    ("VmRSS after full ?detail=1 listing", mib(rss3)),
    ("VmHWM after full listing", mib(hwm3)),
    ("data dir on disk", mib(disk)),
    ("VmRSS after restart (loaded from disk)", f"{mib(rss4)}  ({restored} instances in the first service after restart)"),
    ("bytes per instance (RSS)", f"{(rss1 - rss0) * 1024 / n:.0f}  ((after registering - empty) / instances)"),
    ("bytes per instance (after DNS)", f"{(rss2 - rss0) * 1024 / n:.0f}"),
    ("bytes per instance (every answer prepared)", f"{(rss2c - rss0) * 1024 / n:.0f}"),
    ("bytes per instance (after restart)", f"{(rss4 - rss0) * 1024 / n:.0f}  (no request garbage)"),
    ("bytes per instance on disk", f"{disk * 1024 / n:.0f}"),
]
print()
w = max(len(k) for k, _ in rows)
print(f"{'measure':<{w}}  value")
print("-" * (w + 50))
for k, v in rows:
    print(f"{k:<{w}}  {v}")
EOF
echo
echo "instance shape: name svcNNN ($PER_SERVICE instances per name), IPv4 address, port, 2 metadata entries,"
echo "default tags/weight/priority, lease 1 h. RSS includes allocator slack (glibc malloc arenas: up to 8 x cores)."
echo "koder-dns: TOKIO_WORKER_THREADS=$THREADS. $(machine_note)"
