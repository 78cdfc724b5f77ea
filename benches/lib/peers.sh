# shellcheck shell=bash
# Peer authoritative servers (NSD, Knot DNS) for the DNS comparison, and two references
# built from this repository's examples: a responder that does nothing (null-responder) and
# hickory-server's own Server with a no-op handler (hickory-ceiling).
# Sourced after common.sh. Each daemon runs from its own config, pid file and
# database under $BENCH_TMP, on 127.0.0.1 only; the packaged system services
# are never used.

need_peers() {
    need_pkg nsd nsd
    need_pkg knotd knot
    need_pkg dig bind9-dnsutils
}

# start_nsd PORT ZONEFILE DOMAIN -> sets NSD_PID
start_nsd() {
    local port="$1" zonefile="$2" domain="$3" dir="$BENCH_TMP/nsd"
    mkdir -p "$dir"
    cp "$zonefile" "$dir/zone"
    cat >"$dir/nsd.conf" <<EOF
server:
    ip-address: $BENCH_HOST@$port
    port: $port
    do-ip4: yes
    do-ip6: no
    server-count: $THREADS
    reuseport: yes
    username: ""
    chroot: ""
    zonesdir: "$dir"
    pidfile: "$dir/nsd.pid"
    database: ""
    zonelistfile: "$dir/zone.list"
    xfrdfile: "$dir/xfrd.state"
    xfrdir: "$dir"
    logfile: "$dir/nsd.log"
    verbosity: 0
    hide-version: yes
    # response rate limiting off for the comparison
    rrl-ratelimit: 0
    rrl-whitelist-ratelimit: 0
    minimal-responses: ${NSD_MINIMAL:-no}
remote-control:
    control-enable: no
zone:
    name: "$domain."
    zonefile: "$dir/zone"
EOF
    nsd-checkconf "$dir/nsd.conf" || die "nsd-checkconf failed ($dir/nsd.conf)"
    log "starting NSD (server-count $THREADS) on :$port"
    "${ON_SERVER[@]}" nsd -d -c "$dir/nsd.conf" >"$dir/stdout.log" 2>&1 &
    NSD_PID=$!
    track_pid "$NSD_PID"
    wait_dns "$port" "$domain." 20 || { cat "$dir"/*.log >&2; die "NSD did not answer on :$port"; }
}

# start_knot PORT ZONEFILE DOMAIN -> sets KNOT_PID. KNOT_DNSSEC=on: Knot signs the zone
# itself (automatic signing: ECDSAP256SHA256, one combined key, NSEC), as koder-dns --dnssec.
start_knot() {
    local port="$1" zonefile="$2" domain="$3" dir="$BENCH_TMP/knot" policy="" signing=""
    if [[ "${KNOT_DNSSEC:-off}" == on ]]; then
        policy="policy:
  - id: csk
    algorithm: ecdsap256sha256
    single-type-signing: on
    nsec3: off
"
        signing="    dnssec-signing: on
    dnssec-policy: csk"
    fi
    mkdir -p "$dir/db"
    cp "$zonefile" "$dir/$domain.zone"
    cat >"$dir/knot.conf" <<EOF
server:
    rundir: "$dir"
    pidfile: "$dir/knot.pid"
    listen: $BENCH_HOST@$port
    udp-workers: $THREADS
    tcp-workers: $THREADS
    background-workers: 1
    identity: ""
    version: ""

database:
    storage: "$dir/db"

control:
    listen: "$dir/knot.sock"

log:
  - target: stderr
    any: warning

template:
  - id: default
    storage: "$dir"
    file: "%s.zone"
    semantic-checks: off
    journal-content: none
    zonefile-sync: -1
    zonefile-load: whole

${policy}
zone:
  - domain: $domain.
${signing}
EOF
    knotc -c "$dir/knot.conf" conf-check >/dev/null || die "knot conf-check failed ($dir/knot.conf)"
    log "starting Knot DNS (udp/tcp-workers $THREADS) on :$port"
    "${ON_SERVER[@]}" knotd -c "$dir/knot.conf" >"$dir/stdout.log" 2>&1 &
    KNOT_PID=$!
    track_pid "$KNOT_PID"
    wait_dns "$port" "$domain." 20 || { cat "$dir/stdout.log" >&2; die "Knot did not answer on :$port"; }
}

# start_example NAME PORT [ARG...] -> sets EXAMPLE_PID: one of the repository's examples that
# serves DNS as `NAME ADDR:PORT THREADS [ARG...]`, built in release unless SKIP_BUILD=1.
start_example() {
    local name="$1" port="$2" dir="$BENCH_TMP/$1" bin="$REPO_ROOT/target/release/examples/$1"
    shift 2
    mkdir -p "$dir"
    if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
        log "cargo build --release --example $name"
        (cd "$REPO_ROOT" && cargo build --release --quiet --example "$name" >&2) ||
            die "cargo build --release --example $name failed"
    fi
    [[ -x "$bin" ]] || die "no binary at $bin (cargo build --release --example $name)"
    log "starting $name ($THREADS sockets and workers) on :$port"
    "${ON_SERVER[@]}" "$bin" "$BENCH_HOST:$port" "$THREADS" "$@" >"$dir/log" 2>&1 &
    EXAMPLE_PID=$!
    track_pid "$EXAMPLE_PID"
    wait_dns "$port" "ceiling.example." 20 || { cat "$dir/log" >&2; die "$name did not answer on :$port"; }
}
