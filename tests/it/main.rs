//! The integration tests: one binary, a module per area, and one shared harness (`common`).
//!
//! Every test starts what it needs itself (the server in-process or as a child process, and
//! NSD, Knot, unbound or HAProxy where a test drives one) on ephemeral loopback ports, so the
//! tests run in parallel. Tests that need a tool from outside Rust are `#[ignore = "needs ..."]`;
//! `tests/run.sh` installs the tools and runs them too.

mod child;
mod common;

mod access;
mod api;
mod clients;
mod concurrency;
mod deploy;
mod dns;
mod dnssec;
mod etcd;
mod export;
mod fuzz_regressions;
mod hardening;
mod health;
mod metrics;
mod model;
mod openapi;
mod prepared;
mod reload;
mod restart;
mod sd;
mod strangers;
mod tls;
mod tools;
mod transfer;
mod ui;
mod watch;
