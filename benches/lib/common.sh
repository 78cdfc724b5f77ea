# shellcheck shell=bash
# Shared helpers for the koder-dns macro benchmarks (sourced, not run).
#
# Provides: logging, package installation, free-port picking, a process
# registry that the EXIT trap stops, koder-dns build/start helpers, and
# CPU-time sampling from /proc.
#
# Every script that sources this file must call `bench_init` first.

BENCH_LIB_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BENCH_DIR="$(cd "$BENCH_LIB_DIR/.." && pwd)"
REPO_ROOT="$(cd "$BENCH_DIR/.." && pwd)"

# Loopback only. Nothing in these scripts ever targets another address.
BENCH_HOST=127.0.0.1
API_KEY="${KODER_DNS_API_KEY:-bench-secret}"
THREADS="${THREADS:-2}"

_BENCH_PIDS=()
BENCH_TMP=""

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

bench_init() {
    local name="$1"
    BENCH_TMP="$(mktemp -d "${TMPDIR:-/tmp}/koder-bench-${name}.XXXXXX")"
    trap bench_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    log "work dir: $BENCH_TMP"
    busy_check
}

# busy_check: warn when something else already uses the CPU (results would be skewed).
BUSY_PCT=0
busy_check() {
    local a b
    read -r -a a </proc/stat
    sleep 1
    read -r -a b </proc/stat
    local idle=$(( (b[4] + b[5]) - (a[4] + a[5]) )) total=0 i
    for i in 1 2 3 4 5 6 7 8; do total=$((total + b[i] - a[i])); done
    BUSY_PCT=$(( total > 0 ? 100 * (total - idle) / total : 0 ))
    if [[ $BUSY_PCT -gt 15 ]]; then
        log "WARNING: the machine is already ${BUSY_PCT}% busy before the benchmark (top: $(ps -eo comm --sort=-pcpu --no-headers | head -n3 | tr '\n' ' ')); figures will be low"
    fi
}

# Register a background process so that the EXIT trap stops it.
track_pid() { _BENCH_PIDS+=("$1"); }

# Stop one tracked process (TERM, then KILL after a grace period).
stop_pid() {
    local pid="$1" i
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for i in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        log "pid $pid ignored SIGTERM for 5 s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

bench_cleanup() {
    local rc=$?
    set +e
    local i
    for ((i = ${#_BENCH_PIDS[@]} - 1; i >= 0; i--)); do
        stop_pid "${_BENCH_PIDS[$i]}"
    done
    if [[ -n "$BENCH_TMP" && -d "$BENCH_TMP" ]]; then
        if [[ "${KEEP_TMP:-0}" == 1 || $rc -ne 0 ]]; then
            log "kept work dir (logs, configs): $BENCH_TMP"
        else
            rm -rf "$BENCH_TMP"
        fi
    fi
    return $rc
}

# ---------------------------------------------------------------- packages

_APT_UPDATED=0
# need_pkg CMD PACKAGE: install the Debian package when CMD is missing.
need_pkg() {
    local cmd="$1" pkg="$2"
    command -v "$cmd" >/dev/null 2>&1 && return 0
    log "installing $pkg (for $cmd)"
    [[ $(id -u) -eq 0 ]] || die "$cmd is missing and we are not root; install $pkg"
    if [[ $_APT_UPDATED -eq 0 ]]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2 || die "apt-get update failed"
        _APT_UPDATED=1
    fi
    # policy-rc.d / no systemd keeps the packaged services from starting; we
    # never use them anyway: every daemon here runs from our own config.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$pkg" >&2 \
        || die "apt-get install $pkg failed"
    command -v "$cmd" >/dev/null 2>&1 || die "$pkg installed but $cmd still missing"
}

need_common_tools() {
    need_pkg python3 python3
    need_pkg curl curl
    need_pkg ps procps
}

# ---------------------------------------------------------------- ports

# free_port: a port free for both TCP and UDP on 127.0.0.1.
free_port() {
    python3 - <<'EOF'
import socket
for _ in range(100):
    t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    t.bind(("127.0.0.1", 0))
    port = t.getsockname()[1]
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        u.bind(("127.0.0.1", port))
    except OSError:
        t.close(); continue
    u.close(); t.close()
    print(port)
    break
EOF
}

# wait_udp_dns PORT NAME TIMEOUT_S: wait until a DNS server answers on PORT.
wait_dns() {
    local port="$1" name="$2" timeout="${3:-20}" i
    for ((i = 0; i < timeout * 10; i++)); do
        if python3 "$BENCH_LIB_DIR/dnsprobe.py" ping --port "$port" --name "$name" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.1
    done
    return 1
}

wait_http() {
    local url="$1" timeout="${2:-30}" i
    for ((i = 0; i < timeout * 10; i++)); do
        if curl -fsS -o /dev/null --max-time 1 "$url" 2>/dev/null; then
            return 0
        fi
        sleep 0.1
    done
    return 1
}

# ---------------------------------------------------------------- koder-dns

# koder_bin: path of a release build of koder-dns.
# KODER_DNS_BIN overrides; otherwise build (cargo build --release) unless
# SKIP_BUILD=1.
koder_bin() {
    if [[ -n "${KODER_DNS_BIN:-}" ]]; then
        [[ -x "$KODER_DNS_BIN" ]] || die "KODER_DNS_BIN=$KODER_DNS_BIN is not executable"
        echo "$KODER_DNS_BIN"
        return
    fi
    local bin="$REPO_ROOT/target/release/koder-dns"
    if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
        command -v cargo >/dev/null 2>&1 || die "cargo not found: install Rust (rustup) or set KODER_DNS_BIN"
        log "cargo build --release (set SKIP_BUILD=1 to skip)"
        (cd "$REPO_ROOT" && cargo build --release --quiet --bin koder-dns >&2) || die "cargo build --release failed"
    fi
    [[ -x "$bin" ]] || die "no binary at $bin (build it or set KODER_DNS_BIN)"
    echo "$bin"
}

# start_koder DNS_PORT HTTP_PORT [extra serve args...]
# Runs in $BENCH_TMP/${KODER_NAME:-koder} (data, zones, log). Sets KODER_PID. Waits for /healthz.
# PIN=1: the servers on CPU 0 and the load tools on CPU 1 (taskset), so that what a load
# tool spends (the TLS of wrk and dnsperf, say) does not come out of the server's share of
# the cores. Scripts prefix their servers with "${ON_SERVER[@]}" and load with "${ON_LOAD[@]}".
if [[ "${PIN:-0}" == 1 ]]; then
    ON_SERVER=(taskset -c 0)
    ON_LOAD=(taskset -c 1)
else
    ON_SERVER=()
    ON_LOAD=()
fi

start_koder() {
    local dport="$1" hport="$2"
    shift 2
    local dir
    [[ -n "${KODER_BIN:-}" ]] || KODER_BIN="$(koder_bin)"
    dir="$BENCH_TMP/${KODER_NAME:-koder}"
    mkdir -p "$dir/data" "$dir/zones"
    log "starting koder-dns (TOKIO_WORKER_THREADS=$THREADS) dns=$dport http=$hport"
    KODER_DNS_API_KEY="$API_KEY" TOKIO_WORKER_THREADS="$THREADS" KODER_DNS_DNS_UDP_WORKERS="$THREADS" KODER_DNS_LOG="${KODER_DNS_LOG:-warn}" \
        "${ON_SERVER[@]}" "$KODER_BIN" serve \
        --dns-listen "$BENCH_HOST:$dport" \
        --http-listen "$BENCH_HOST:$hport" \
        --data-dir "$dir/data" \
        --zones-dir "$dir/zones" \
        "$@" >"$dir/log" 2>&1 &
    KODER_PID=$!
    track_pid "$KODER_PID"
    if ! wait_http "http://$BENCH_HOST:$hport/healthz" 30; then
        tail -n 30 "$dir/log" >&2 || true
        die "koder-dns did not become healthy on :$hport"
    fi
    kill -0 "$KODER_PID" 2>/dev/null || die "koder-dns exited (see $dir/log)"
}

# dnsperf_field OUTFILE LABEL -> the first number after LABEL in dnsperf's report
# (e.g. 'Queries per second:').
dnsperf_field() {
    sed -n "s/^ *$2 *\([0-9.]*\).*/\1/p" "$1" | head -n1
}

# ---------------------------------------------------------------- /proc

# cpu_ticks PID: utime+stime (clock ticks) of PID and all of its descendants.
cpu_ticks() {
    python3 "$BENCH_LIB_DIR/proctool.py" cpu "$1"
}

clk_tck() { getconf CLK_TCK; }

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
hwm_kib() { awk '/^VmHWM:/ {print $2}' "/proc/$1/status"; }

machine_note() {
    local placement="load generators run on the SAME cores as the servers, so figures are lower bounds and noisy"
    [[ "${PIN:-0}" == 1 ]] && placement="PIN=1: servers on CPU 0, load generators on CPU 1"
    echo "machine: $(nproc) cores (${BUSY_PCT}% busy before start), $(awk '/MemTotal/ {printf "%.1f GiB", $2/1048576}' /proc/meminfo); $placement"
}

# udp_rcvbuf_errors: the kernel's UDP RcvbufErrors counter (whole machine).
udp_rcvbuf_errors() {
    awk '/^Udp:/ { if (!h) { for (i = 1; i <= NF; i++) if ($i == "RcvbufErrors") c = i; h = 1 } else print $c }' /proc/net/snmp
}

# register_jsonl FILE WHAT [httpload.py options...]: POSTs every line of FILE to the
# register route of the koder-dns on $HTTP_PORT; dies on any failure, leaves the JSON
# summary in REGISTERED.
register_jsonl() {
    local file="$1" what="$2"
    shift 2
    REGISTERED="$(python3 "$BENCH_LIB_DIR/httpload.py" post --port "$HTTP_PORT" --key "$API_KEY" \
        --path /api/v1/services/register --file "$file" --strict "$@")" \
        || die "$what registration failed: $REGISTERED"
    log "registered $what: $REGISTERED"
}
