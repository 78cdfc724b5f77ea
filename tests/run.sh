#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs the tools the end-to-end
# tests drive (dig, unbound), then runs every test, ignored ones included.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v dig >/dev/null || missing+=(bind9-dnsutils)
command -v unbound >/dev/null || missing+=(unbound)
if ((${#missing[@]})); then
    echo "tests/run.sh: installing ${missing[*]}" >&2
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The Debian package starts an unbound on port 53; the tests run their own.
command -v dig unbound >/dev/null

cargo test --lib --bins --tests -- --include-ignored
# The benchmarks must keep compiling; `cargo bench` runs them.
cargo check --benches --quiet
