//! koder-dns: a service registry and authoritative DNS server.
//!
//! One process holds the registry ([`registry`]) and serves it over DNS ([`dns`]) and REST
//! ([`api`]), while the reaper and the health checker ([`health`]) keep it true.
//!
//! `unsafe` is denied crate-wide; the one exception is the UDP batching in `dns::udp`
//! (`recvmmsg`/`sendmmsg`), which carries a SAFETY comment above each block.

#![deny(unsafe_code)]

pub mod access;
pub mod api;
pub mod cli;
pub mod client;
pub mod cluster;
pub mod config;
pub mod dns;
pub mod export;
pub mod health;
pub mod keystore;
pub mod listener;
pub mod metrics;
pub mod model;
pub mod registry;
pub mod reload;
pub mod server;
pub mod sign;
pub mod store;
pub mod tls;
pub mod zone;
