//! koder-dns: a service registry and authoritative DNS server.
//!
//! One process holds the registry ([`registry`]) and serves it over DNS ([`dns`]) and REST
//! ([`api`]), while the reaper and the health checker ([`health`]) keep it true.

pub mod api;
pub mod cli;
pub mod config;
pub mod dns;
pub mod export;
pub mod health;
pub mod listener;
pub mod registry;
pub mod server;
