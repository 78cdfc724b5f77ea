#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs the tools the end-to-end
# tests drive (Debian packages through apt-get, Python tools into a venv under target/),
# then checks style and lints and runs every test, ignored ones included.
# Runs as root, or as a user with sudo for apt-get.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages: one `need COMMAND PACKAGE` line per tool a test drives.
missing=()
need() { command -v "$1" >/dev/null || [ -x "/usr/sbin/$1" ] || missing+=("$2"); }
need dig bind9-dnsutils
need unbound unbound
need systemd-analyze systemd
need prometheus prometheus
need chromium chromium
need chromedriver chromium-driver
need nsd nsd
need haproxy haproxy
need knotd knot
need kdig knot-dnsutils
# The signed zone (tests/it/dnssec.rs): delv comes with dig, kresd validates beside unbound,
# ldns-verify-zone checks a transferred zone.
need delv bind9-dnsutils
need kresd knot-resolver
need ldns-verify-zone ldnsutils
need etcd etcd-server
# etcdctl: the etcd TLS tests make the limited role and user with it, as the README does.
need etcdctl etcd-client
# The TLS tests: curl and openssl s_client as clients (TLS 1.1 refused), openssl for an RSA key.
need curl curl
need openssl openssl
# The etcd client (cargo feature `etcd`) is generated at build time by protoc, which also
# needs the protobuf well-known types (google/protobuf/*.proto, in libprotobuf-dev).
need protoc protobuf-compiler
[ -e /usr/include/google/protobuf/descriptor.proto ] || missing+=(libprotobuf-dev)
if ((${#missing[@]})); then
    echo "tests/run.sh: installing ${missing[*]}" >&2
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Debian's unbound and nsd packages may start servers on port 53; the tests run their own.

# Python tools, pinned, in a venv of the suite's own.
python_tools=(kubernetes-validate==1.37.0 schemathesis==4.32.5 openapi-spec-validator==0.9.0)
venv=target/test-venv
if [ "$(cat "$venv/installed" 2>/dev/null)" != "${python_tools[*]}" ]; then
    echo "tests/run.sh: installing ${python_tools[*]} into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --disable-pip-version-check "${python_tools[@]}"
    echo "${python_tools[*]}" >"$venv/installed"
fi
export PATH="$PWD/$venv/bin:$PATH"

# Style and lints first: a formatting drift or a clippy warning fails the suite. Both builds:
# the default one (one node, no protoc needed) and every feature (the etcd code included).
# `--all-targets` also compiles the benchmarks and examples, so they keep building.
cargo fmt --check
cargo clippy --all-targets --quiet -- -D warnings
cargo clippy --all-targets --all-features --quiet -- -D warnings
# The default build must not need protoc: etcd-client stays out of its dependency tree.
if cargo tree --edges normal,build --prefix none | grep -q '^etcd-client '; then
    echo "tests/run.sh: the default build depends on etcd-client (it must stay behind --features etcd)" >&2
    exit 1
fi
# The default build refuses --store etcd, saying how to build a cluster node.
cargo test --quiet --test it etcd::without_the_feature

# watch::ten_thousand_held_requests... holds 10,000 connections: room for them (root may
# raise the hard limit; the test raises its soft limit and says so if it is still too low).
hard="$(ulimit -Hn)"
if [ "$hard" != unlimited ] && [ "$hard" -lt 65536 ]; then ulimit -Hn 65536 2>/dev/null || true; fi

# tests/it/clients.rs runs the routing_file example as a consumer would.
cargo build --examples --features etcd --quiet
cargo test --features etcd --lib --bins --tests -- --include-ignored
# So must the fuzz targets (their own crate; `cargo fuzz` runs them, see fuzz/README.md).
(cd fuzz && cargo check --quiet)
