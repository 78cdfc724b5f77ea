#!/usr/bin/env bash
# Soak test: one koder-dns on loopback with a temporary data dir, under registrants that
# heart-beat, continuous churn and DNS load, for SOAK_SECONDS; then checks that nothing
# failed, nothing was lost or leaked, and memory stayed flat. Exit status 0 = pass.
#
#   deploy/soak.sh                       # 60 s, 200 registrants
#   SOAK_SECONDS=600 SOAK_REGISTRANTS=1000 deploy/soak.sh
#
# Settings (environment):
#   SOAK_SECONDS=60            load phase length
#   SOAK_REGISTRANTS=200       long-lived instances, TTL SOAK_TTL_SECONDS=5, heartbeat every
#                              SOAK_HEARTBEAT_SECONDS=1
#   SOAK_CHURN_WORKERS=2       threads that register + deregister short-lived instances
#                              (SOAK_CHURN_ABANDON_FRACTION=0.1 of them are left to expire)
#   SOAK_DNS_QPS=2000          dnsperf rate cap (UDP); dig in a loop if dnsperf is missing
#   SOAK_SAMPLE_SECONDS=3      VmRSS sampling period
#   SOAK_RSS_GROWTH_PCT=10, SOAK_RSS_GROWTH_MIB=4
#                              memory fails only if the last third's mean exceeds the
#                              first third's by both
#   SOAK_DNS_MAX_LOST_PCT=0.1  tolerated UDP loss
#   SOAK_FAULT_SECONDS=40      fault phase afterwards (0 = none): a second server, alternately
#                              SIGSTOPped and SIGKILLed (then restarted) for
#                              SOAK_FAULT_OUTAGE_SECONDS=5, longer than the TTL of its
#                              SOAK_FAULT_REGISTRANTS=50 registrants (SOAK_FAULT_TTL_SECONDS=3),
#                              under a writer that registers and deregisters; checks that
#                              acknowledged = present and that no live registrant saw 410
#   SOAK_BINARY=path           use this binary instead of building target/release/koder-dns
#   SOAK_KEEP=1                keep the temporary directory (server log, data) afterwards
#
# Only 127.0.0.1 is ever contacted; every loop is bounded in time; everything started here
# is stopped on exit.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"

SOAK_SECONDS="${SOAK_SECONDS:-60}"
SOAK_REGISTRANTS="${SOAK_REGISTRANTS:-200}"
SOAK_REAPER_SECONDS="${SOAK_REAPER_SECONDS:-1}"
export SOAK_SECONDS SOAK_REGISTRANTS SOAK_REAPER_SECONDS

log() { printf 'soak: %s\n' "$*" >&2; }

# --- tools -------------------------------------------------------------------------------
need_pkgs=()
command -v python3 >/dev/null || need_pkgs+=(python3)
command -v dig >/dev/null || need_pkgs+=(dnsutils)
command -v dnsperf >/dev/null || need_pkgs+=(dnsperf)
if ((${#need_pkgs[@]})); then
    log "installing ${need_pkgs[*]}"
    sudo=""
    [[ $(id -u) -eq 0 ]] || sudo="sudo"
    $sudo apt-get update -qq >&2 || true
    # dnsperf is optional (the driver falls back to dig in a loop); dig and python3 are not.
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >&2 \
        || $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]/dnsperf/}" >&2 \
        || true
fi
command -v python3 >/dev/null || { log "python3 is required"; exit 2; }
command -v dig >/dev/null || { log "dig is required (apt-get install dnsutils)"; exit 2; }

# --- binary ------------------------------------------------------------------------------
bin="${SOAK_BINARY:-}"
if [[ -z $bin ]]; then
    log "cargo build --release (waits for other builds' file locks)"
    (cd "$root" && cargo build --release --quiet --bin koder-dns) >&2
    bin="$root/target/release/koder-dns"
fi
[[ -x $bin ]] || { log "no binary at $bin"; exit 2; }

# --- server ------------------------------------------------------------------------------
work="$(mktemp -d "${TMPDIR:-/tmp}/koder-dns-soak.XXXXXX")"
server_pid=""
driver_pid=""
cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    for pid in $driver_pid $server_pid; do
        kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in $driver_pid $server_pid; do
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    if [[ ${SOAK_KEEP:-0} == 1 || $rc -ne 0 ]]; then
        log "kept $work (server.log, data/)"
    else
        rm -rf "$work"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Two free loopback ports: HTTP (TCP), and DNS (free for both UDP and TCP).
read -r http_port dns_port < <(python3 - <<'EOF'
import socket
def free(udp_too):
    for _ in range(100):
        t = socket.socket(); t.bind(("127.0.0.1", 0)); port = t.getsockname()[1]
        if not udp_too:
            t.close(); return port
        u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            u.bind(("127.0.0.1", port)); u.close(); t.close(); return port
        except OSError:
            u.close(); t.close()
    raise SystemExit("no free port")
h = free(False); d = free(True)
while d == h: d = free(True)
print(h, d)
EOF
)
api_key="soak-$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')"
mkdir -p "$work/data"

log "starting $bin (http 127.0.0.1:$http_port, dns 127.0.0.1:$dns_port, data $work/data)"
KODER_DNS_API_KEY="$api_key" KODER_DNS_LOG="${KODER_DNS_LOG:-warn}" \
    "$bin" serve \
    --http-listen "127.0.0.1:$http_port" \
    --dns-listen "127.0.0.1:$dns_port" \
    --data-dir "$work/data" \
    --zones-dir "$root/zones" \
    --reaper-interval "${SOAK_REAPER_SECONDS}s" \
    >"$work/server.log" 2>&1 &
server_pid=$!

up=0
for _ in $(seq 100); do
    kill -0 "$server_pid" 2>/dev/null || break
    if python3 -c "
import http.client,sys
c=http.client.HTTPConnection('127.0.0.1',$http_port,timeout=1)
c.request('GET','/healthz'); sys.exit(c.getresponse().status!=200)" 2>/dev/null; then
        up=1
        break
    fi
    sleep 0.1
done
if ((!up)); then
    log "the server did not come up; its log:"
    cat "$work/server.log" >&2
    exit 1
fi

# --- load and checks ---------------------------------------------------------------------
set +e
SOAK_HTTP_PORT="$http_port" SOAK_DNS_PORT="$dns_port" SOAK_API_KEY="$api_key" \
    SOAK_SERVER_PID="$server_pid" SOAK_WORKDIR="$work" \
    timeout --signal=TERM --kill-after=10 "$((SOAK_SECONDS + 180))" \
    python3 "$here/soak/driver.py" &
driver_pid=$!
wait "$driver_pid"
rc=$?
driver_pid=""
set -e

# The server must still be running, then stop cleanly on SIGTERM, and must have logged no
# panic or error.
if ! kill -0 "$server_pid" 2>/dev/null; then
    log "FAIL: the server died during the soak"
    rc=1
else
    kill -TERM "$server_pid"
    set +e
    for _ in $(seq 150); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.1; done
    wait "$server_pid"
    server_rc=$?
    set -e
    server_pid=""
    echo "server: exit status $server_rc after SIGTERM"
    ((server_rc == 0)) || { log "FAIL: the server exited with $server_rc"; rc=1; }
fi
if grep -nE 'panicked|ERROR' "$work/server.log" >&2; then
    log "FAIL: the server log has panics or errors (above)"
    rc=1
fi
echo "server log: $(wc -l <"$work/server.log") lines at KODER_DNS_LOG=${KODER_DNS_LOG:-warn}"

# --- fault phase -------------------------------------------------------------------------
if ((${SOAK_FAULT_SECONDS:-40} > 0)); then
    mkdir -p "$work/faults"
    log "fault phase: ${SOAK_FAULT_SECONDS:-40}s of SIGSTOP and SIGKILL outages"
    set +e
    SOAK_BINARY="$bin" SOAK_FAULT_WORKDIR="$work/faults" \
        timeout --signal=TERM --kill-after=10 "$((${SOAK_FAULT_SECONDS:-40} + 120))" \
        python3 "$here/soak/faults.py"
    fault_rc=$?
    set -e
    ((fault_rc == 0)) || { log "FAIL: the fault phase (log: $work/faults/server.log)"; rc=1; }
fi
exit "$rc"
