#!/usr/bin/env bash
# Following the registry: zone transfer to secondaries, and held blocking queries.
#
#   1. AXFR of a SERVICES x INSTANCES zone (default 1000 x 100 = 100,000 instances) to one
#      Knot secondary, alternating between koder-dns as its primary and NSD as its primary
#      serving the same zone (koder-dns's own AXFR, saved as NSD's zone file), ROUNDS times;
#      times from Knot's log ("AXFR, incoming ... finished, N seconds").
#   2. IXFR bytes for one registration in that zone, against the AXFR's bytes (dig).
#   3. Propagation: PROPAGATIONS registrations, one every INTERVAL seconds, each timed from
#      its 200 to the moment each secondary (Knot and NSD, NOTIFY-driven, SOA refresh an
#      hour) serves its serial or a later one; p50/p99 per secondary. NSD reloads a zone at
#      most once per xfrd-reload-timeout (NSD_RELOAD_TIMEOUT, NSD's default 1 s).
#   4. Held blocking queries: HELD requests held on their own connections; koder-dns's RSS
#      per connection and per held request, and its CPU over IDLE seconds.
#
# Env knobs: SERVICES=1000 INSTANCES=100 ROUNDS=3 PROPAGATIONS=200 INTERVAL=0.25
#            NSD_RELOAD_TIMEOUT=1 HELD=10000 IDLE=5
#            KODER_DNS_BIN, SKIP_BUILD=1, KEEP_TMP=1 (see lib/common.sh)
set -euo pipefail

# shellcheck source=lib/common.sh
source "$(dirname "$0")/lib/common.sh"
# shellcheck source=lib/peers.sh
source "$BENCH_LIB_DIR/peers.sh"

SERVICES="${SERVICES:-1000}"
INSTANCES="${INSTANCES:-100}"
ROUNDS="${ROUNDS:-3}"
PROPAGATIONS="${PROPAGATIONS:-200}"
INTERVAL="${INTERVAL:-0.25}"
NSD_RELOAD_TIMEOUT="${NSD_RELOAD_TIMEOUT:-1}"
HELD="${HELD:-10000}"
IDLE="${IDLE:-5}"
THREADS="${THREADS:-2}"
DOMAIN=service.koder

bench_init follow
need_peers
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"

DNS_PORT="$(free_port)"
HTTP_PORT="$(free_port)"
KNOT_PORT="$(free_port)"
NSD_SEC_PORT="$(free_port)"
NSD_PRI_PORT="$(free_port)"

start_koder "$DNS_PORT" "$HTTP_PORT" --allow-transfer 127.0.0.1 --max-instances 400000 \
    --notify "$BENCH_HOST:$KNOT_PORT" --notify "$BENCH_HOST:$NSD_SEC_PORT" \
    --watch-max $((HELD + 100)) --http-max-connections $((HELD + 100)) \
    --http-max-connections-per-client $((HELD + 100)) --http-request-timeout 120s
IN="$BENCH_TMP/in"
mkdir -p "$IN"
python3 "$BENCH_LIB_DIR/gen.py" "$IN" --services "$SERVICES" --instances "$INSTANCES" >/dev/null
log "registering $((SERVICES * INSTANCES)) instances over REST"
register_jsonl "$IN/register.jsonl" "the fleet" --procs 4

# ---------------------------------------------------------------- 1. AXFR, koder-dns vs NSD
dig @"$BENCH_HOST" -p "$DNS_PORT" AXFR "$DOMAIN." +nocmd +nostats +nocomments | sed '$d' >"$IN/zone" ||
    die "AXFR from koder-dns failed"
axfr_records="$(grep -vc '^;' "$IN/zone")"
log "koder-dns AXFR: $axfr_records records; NSD serves the same as a primary"
mkdir -p "$BENCH_TMP/nsd-primary"
cp "$IN/zone" "$BENCH_TMP/nsd-primary/zone"
cat >"$BENCH_TMP/nsd-primary/nsd.conf" <<EOF
server:
    ip-address: $BENCH_HOST@$NSD_PRI_PORT
    do-ip6: no
    server-count: $THREADS
    username: ""
    chroot: ""
    zonesdir: "$BENCH_TMP/nsd-primary"
    pidfile: "$BENCH_TMP/nsd-primary/nsd.pid"
    database: ""
    zonelistfile: "$BENCH_TMP/nsd-primary/zone.list"
    xfrdfile: "$BENCH_TMP/nsd-primary/xfrd.state"
    xfrdir: "$BENCH_TMP/nsd-primary"
    logfile: "$BENCH_TMP/nsd-primary/log"
remote-control:
    control-enable: no
zone:
    name: "$DOMAIN."
    zonefile: "zone"
    provide-xfr: $BENCH_HOST NOKEY
EOF
nsd -d -c "$BENCH_TMP/nsd-primary/nsd.conf" >/dev/null 2>&1 &
NSD_PRIMARY_PID=$!
track_pid "$NSD_PRIMARY_PID"
wait_dns "$NSD_PRI_PORT" "$DOMAIN." 60 || die "NSD (primary) did not answer ($BENCH_TMP/nsd-primary/log)"

# A Knot secondary of PRIMARY_PORT; prints the seconds its AXFR took.
knot_axfr_seconds() {
    local primary_port="$1" dir="$BENCH_TMP/knot-axfr"
    rm -rf "$dir"
    mkdir -p "$dir"
    cat >"$dir/knot.conf" <<EOF
server:
    rundir: "$dir"
    listen: $BENCH_HOST@$KNOT_PORT
log:
  - target: "$dir/knot.log"
    any: info
database:
    storage: "$dir"
control:
    listen: "$dir/knot.sock"
remote:
  - id: primary
    address: $BENCH_HOST@$primary_port
zone:
  - domain: $DOMAIN.
    storage: "$dir"
    master: primary
    zonefile-sync: -1
    journal-content: none
    semantic-checks: off
EOF
    knotd -c "$dir/knot.conf" >/dev/null 2>&1 &
    local pid=$!
    local deadline=$((SECONDS + 120))
    while ! grep -q "AXFR, incoming.*finished" "$dir/knot.log" 2>/dev/null; do
        ((SECONDS < deadline)) || die "Knot did not finish an AXFR from :$primary_port ($dir/knot.log)"
        sleep 0.1
    done
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null || true
    grep "AXFR, incoming.*finished" "$dir/knot.log" | sed -E 's/.*finished, ([0-9.]+) seconds.*/\1/'
}

declare -a koder_axfr nsd_axfr
for round in $(seq 1 "$ROUNDS"); do
    k="$(knot_axfr_seconds "$DNS_PORT")"
    n="$(knot_axfr_seconds "$NSD_PRI_PORT")"
    koder_axfr+=("$k")
    nsd_axfr+=("$n")
    log "round $round: AXFR to Knot from koder-dns ${k}s, from NSD ${n}s"
done
stop_pid "$NSD_PRIMARY_PID"

# ---------------------------------------------------------------- 2. IXFR bytes
serial="$(dig @"$BENCH_HOST" -p "$DNS_PORT" SOA "$DOMAIN." +short | awk '{print $3}')"
axfr_bytes="$(dig @"$BENCH_HOST" -p "$DNS_PORT" AXFR "$DOMAIN." | sed -nE 's/.*XFR size: .*bytes ([0-9]+)\)/\1/p')"
curl -fsS -o /dev/null -H "X-API-Key: $API_KEY" "http://$BENCH_HOST:$HTTP_PORT/api/v1/services/register" \
    -d '{"name":"ixfr-probe","address":"10.250.0.1","port":9}'
ixfr_line="$(dig @"$BENCH_HOST" -p "$DNS_PORT" IXFR="$serial" "$DOMAIN." | grep 'XFR size')"
ixfr_bytes="$(sed -nE 's/.*bytes ([0-9]+)\)/\1/p' <<<"$ixfr_line")"
log "one registration: IXFR $ixfr_bytes bytes ($ixfr_line) vs AXFR $axfr_bytes bytes"

# ---------------------------------------------------------------- 3. propagation
start_secondary() {
    local kind="$1" port="$2" dir="$BENCH_TMP/sec-$1"
    mkdir -p "$dir"
    if [[ "$kind" == knot ]]; then
        cat >"$dir/knot.conf" <<EOF
server:
    rundir: "$dir"
    listen: $BENCH_HOST@$port
log:
  - target: "$dir/log"
    any: ${KNOT_LOG_LEVEL:-warning}
database:
    storage: "$dir"
control:
    listen: "$dir/knot.sock"
remote:
  - id: primary
    address: $BENCH_HOST@$DNS_PORT
acl:
  - id: notify
    address: $BENCH_HOST
    action: notify
zone:
  - domain: $DOMAIN.
    storage: "$dir"
    master: primary
    acl: notify
    zonefile-sync: -1
    semantic-checks: off
EOF
        knotd -c "$dir/knot.conf" >/dev/null 2>&1 &
    else
        cat >"$dir/nsd.conf" <<EOF
server:
    ip-address: $BENCH_HOST@$port
    do-ip6: no
    username: ""
    chroot: ""
    zonesdir: "$dir"
    database: ""
    zonelistfile: "$dir/zone.list"
    xfrdfile: "$dir/xfrd.state"
    xfrdir: "$dir"
    pidfile: "$dir/nsd.pid"
    logfile: "$dir/log"
    server-count: 1
    xfrd-reload-timeout: $NSD_RELOAD_TIMEOUT
remote-control:
    control-enable: no
zone:
    name: "$DOMAIN."
    zonefile: "$DOMAIN.zone"
    request-xfr: $BENCH_HOST@$DNS_PORT NOKEY
    allow-notify: $BENCH_HOST NOKEY
EOF
        nsd -d -c "$dir/nsd.conf" >/dev/null 2>&1 &
    fi
    track_pid $!
}
start_secondary knot "$KNOT_PORT"
start_secondary nsd "$NSD_SEC_PORT"
python3 - "$HTTP_PORT" "$API_KEY" "$DNS_PORT" "$KNOT_PORT" "$NSD_SEC_PORT" "$PROPAGATIONS" "$INTERVAL" <<'EOF'
import json, socket, struct, sys, time, urllib.request

http, key, primary, knot, nsd, n = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
interval = float(sys.argv[7])
HOST = "127.0.0.1"

def soa_serial(port, timeout=0.5):
    q = struct.pack(">HHHHHH", 0x4b44, 0, 1, 0, 0, 0) + b"\x07service\x05koder\x00" + struct.pack(">HH", 6, 1)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    try:
        s.sendto(q, (HOST, port))
        r = s.recv(4096)
    except OSError:
        return None
    finally:
        s.close()
    if struct.unpack(">H", r[6:8])[0] < 1:
        return None
    # The answer's SOA: skip the question, the answer's name (a pointer), type/class/ttl/len,
    # then MNAME and RNAME (pointers or labels), then the serial.
    i = 12 + len(q) - 12
    def skip_name(i):
        while True:
            l = r[i]
            if l == 0:
                return i + 1
            if l & 0xC0:
                return i + 2
            i += 1 + l
    i = skip_name(i) + 10
    i = skip_name(skip_name(i))
    return struct.unpack(">I", r[i:i + 4])[0]

def wait_serial(port, serial, deadline):
    while time.monotonic() < deadline:
        if soa_serial(port) == serial:
            return True
        time.sleep(0.001)
    return False

start = time.monotonic() + 120
current = soa_serial(primary)
for port in (knot, nsd):
    if not wait_serial(port, current, start):
        sys.exit(f"secondary :{port} did not load serial {current}")
# Registrations every INTERVAL, not waiting for the secondaries; a poller watches both
# secondaries' serials every millisecond. Each registration's delay: from its 200 to the
# first moment a secondary serves its serial or a later one.
import threading
seen = {"knot": [], "nsd": []}
done = False
def poll(name, port):
    # One thread per secondary, so that one slow to answer does not delay seeing the other.
    while not done:
        now = time.monotonic()
        s = soa_serial(port, 0.05)
        if s is not None and (not seen[name] or seen[name][-1][1] != s):
            seen[name].append((now, s))
        time.sleep(0.001)
pollers = [threading.Thread(target=poll, args=a) for a in (("knot", knot), ("nsd", nsd))]
for p in pollers:
    p.start()
acks = []
for i in range(n):
    body = json.dumps({"name": "propagation", "address": f"10.251.{i // 250}.{i % 250 + 1}", "port": 9}).encode()
    req = urllib.request.Request(f"http://{HOST}:{http}/api/v1/services/register", body,
                                 {"X-API-Key": key, "Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        index = int(r.headers.get("X-Koder-Index") or 0)
    acked = time.monotonic()
    acks.append((acked, soa_serial(primary)))
    time.sleep(interval)
time.sleep(5)
done = True
for p in pollers:
    p.join()
delays = {}
for name in seen:
    delays[name] = []
    for acked, serial in acks:
        t = next((t for t, s in seen[name] if s >= serial and t >= acked - 0.002), None)
        delays[name].append(max(0.0, t - acked) if t is not None else float("inf"))

def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]

for name, xs in delays.items():
    print(f"propagation to {name}: p50 {pct(xs, 50) * 1000:.0f} ms, p99 {pct(xs, 99) * 1000:.0f} ms, max {max(xs) * 1000:.0f} ms ({len(xs)} registrations)")
EOF

# ---------------------------------------------------------------- 4. held blocking queries
python3 - "$HTTP_PORT" "$API_KEY" "$KODER_PID" "$HELD" "$IDLE" <<'EOF'
import socket, sys, time, urllib.request

http, key, pid, held, idle = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])

def rss():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

def cpu():
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100

req = urllib.request.Request(f"http://127.0.0.1:{http}/api/v1/services?name=nothing", headers={"X-API-Key": key})
index = urllib.request.urlopen(req).headers["X-Koder-Index"]
before = rss()
conns = [socket.create_connection(("127.0.0.1", http)) for _ in range(held)]
time.sleep(1)
connected = rss()
request = f"GET /api/v1/services?name=nothing&index={index}&wait=5m HTTP/1.1\r\nHost: k\r\nX-API-Key: {key}\r\n\r\n".encode()
for c in conns:
    c.sendall(request)
time.sleep(2)
holding = rss()
c0 = cpu()
time.sleep(idle)
c1 = cpu()
print(f"{held} held requests: {(connected - before) / held:.0f} bytes of RSS per connection, "
      f"{(holding - connected) / held:.0f} more per held request, {c1 - c0:.2f} s of CPU in {idle} s idle")
EOF

python3 - "${koder_axfr[*]}" "${nsd_axfr[*]}" "$axfr_records" <<'EOF'
import statistics, sys
# Knot logs two decimals: a floor of 5 ms keeps a tiny zone from dividing by zero.
k = [max(float(x), 0.005) for x in sys.argv[1].split()]
n = [max(float(x), 0.005) for x in sys.argv[2].split()]
print(f"AXFR of {sys.argv[3]} records to Knot: koder-dns median {statistics.median(k):.2f} s, "
      f"NSD median {statistics.median(n):.2f} s: koder-dns at {statistics.median(n) / statistics.median(k):.2f}x NSD's speed")
EOF
