//! Several nodes on etcd: the settings every build knows (`--store`, `--etcd-*`), and the
//! arguments of `koder-dns migrate` (run by [`crate::cli::migrate`]). The etcd client itself
//! is in `crate::store::etcd`, compiled only with the cargo feature `etcd`: its build script
//! needs `protoc`, and the default build (one node on redb) must build on a machine with
//! nothing installed.

use std::path::PathBuf;

use clap::Args;

/// Where the registry is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// One node: a redb file under `--data-dir`.
    Redb,
    /// Any number of nodes sharing one registry in etcd v3.
    Etcd,
}

pub fn store_kind(s: &str) -> Result<StoreKind, String> {
    match s.trim() {
        "redb" => Ok(StoreKind::Redb),
        "etcd" => Ok(StoreKind::Etcd),
        other => Err(format!("{other:?} is not a store; use redb or etcd")),
    }
}

/// etcd client URLs. An alias, so that clap's derive does not read `Option<Vec<_>>` as a
/// flag given several times.
pub type Endpoints = Vec<String>;

pub fn endpoints(s: &str) -> Result<Endpoints, String> {
    let urls: Endpoints = s
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(str::to_owned)
        .collect();
    if urls.is_empty() {
        return Err("no etcd endpoint; give URLs like http://127.0.0.1:2379, comma-separated".into());
    }
    Ok(urls)
}

/// A key prefix: non-empty, ending in `/` so that one registry's keys never share a prefix
/// with another's (`/a` would cover `/ab/...`).
pub fn prefix(s: &str) -> Result<String, String> {
    let s = s.trim();
    if s.is_empty() {
        return Err("the etcd prefix must not be empty (e.g. /koder-dns/)".into());
    }
    Ok(if s.ends_with('/') {
        s.to_owned()
    } else {
        format!("{s}/")
    })
}

/// What a build without the feature says to `--store etcd` and `migrate`.
pub const NO_ETCD: &str = "this koder-dns was built without etcd support; build a cluster node with \
`cargo build --release --features etcd` (needs protoc and the protobuf well-known types: \
apt-get install protobuf-compiler libprotobuf-dev)";

/// `koder-dns migrate`.
#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Copy the redb registry into etcd (the only direction there is).
    #[arg(long, required = true)]
    pub to_etcd: bool,
    /// The data directory of the redb registry; no server may be running on it.
    #[arg(long, env = "KODER_DNS_DATA_DIR", value_name = "DIR", default_value = "data")]
    pub data_dir: PathBuf,
    /// etcd v3 client URLs, comma-separated.
    #[arg(long, env = "KODER_DNS_ETCD_ENDPOINTS", value_name = "URLS", value_parser = endpoints)]
    pub etcd_endpoints: Endpoints,
    /// Key prefix of the registry in etcd.
    #[arg(long, env = "KODER_DNS_ETCD_PREFIX", default_value = "/koder-dns/", value_parser = prefix)]
    pub etcd_prefix: String,
    /// Replace what the prefix holds instead of refusing.
    #[arg(long)]
    pub force: bool,
}
