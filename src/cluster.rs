//! Several nodes on etcd: the settings every build knows (`--store`, `--etcd-*`), and the
//! arguments of `koder-dns migrate` (run by [`crate::cli::migrate`]). The etcd client itself
//! is in `crate::store::etcd`, compiled only with the cargo feature `etcd`: its build script
//! needs `protoc`, and the default build (one node on redb) must build on a machine with
//! nothing installed.

use std::fmt;
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

/// The environment variable that alone carries the etcd user's password: never a flag (other
/// users can read a process's arguments) nor a config-file key.
pub const PASSWORD_ENV: &str = "KODER_DNS_ETCD_PASSWORD";

/// How this process reaches etcd: the endpoints, the TLS files and the user it authenticates
/// as. Made by [`Self::new`], which refuses combinations that cannot work before any
/// connection is tried; the files are read when connecting, each error naming its flag.
#[derive(Clone)]
pub struct Connection {
    pub endpoints: Endpoints,
    /// `--etcd-cacert`: the CA that signed etcd's certificate; without it, the system's roots.
    pub cacert: Option<PathBuf>,
    /// `--etcd-cert` and `--etcd-key`: a client certificate, for etcd's `--client-cert-auth`.
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    /// `--etcd-user` and the password from [`PASSWORD_ENV`].
    pub user: Option<(String, String)>,
}

/// Never prints the password.
impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("endpoints", &self.endpoints)
            .field("cacert", &self.cacert)
            .field("cert", &self.cert)
            .field("key", &self.key)
            .field("user", &self.user.as_ref().map(|(name, _)| name))
            .finish()
    }
}

impl Connection {
    /// The TLS files and the user, with the password `password` (what [`PASSWORD_ENV`] holds).
    pub fn new(
        endpoints: Endpoints,
        cacert: Option<PathBuf>,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        user: Option<String>,
        password: Option<String>,
    ) -> Result<Self, String> {
        match (&cert, &key) {
            (Some(cert), None) => {
                return Err(format!(
                    "--etcd-cert {} is given without --etcd-key: give both, or neither",
                    cert.display()
                ));
            }
            (None, Some(key)) => {
                return Err(format!(
                    "--etcd-key {} is given without --etcd-cert: give both, or neither",
                    key.display()
                ));
            }
            _ => {}
        }
        let https = endpoints.iter().filter(|e| e.starts_with("https://")).count();
        if https > 0 && https < endpoints.len() {
            return Err(format!(
                "--etcd-endpoints mixes https:// and other URLs ({}): etcd serves its clients either \
                 over TLS or not; give every endpoint the same scheme",
                endpoints.join(",")
            ));
        }
        if https == 0 {
            let flag = [("--etcd-cacert", &cacert), ("--etcd-cert", &cert)]
                .into_iter()
                .find_map(|(flag, file)| file.as_ref().map(|_| flag));
            if let Some(flag) = flag {
                return Err(format!(
                    "{flag} is for etcd over TLS, but --etcd-endpoints ({}) are not https:// URLs",
                    endpoints.join(",")
                ));
            }
        }
        let password = password.filter(|p| !p.is_empty());
        let user = match (user, password) {
            (Some(user), Some(password)) => Some((user, password)),
            (Some(user), None) => {
                return Err(format!(
                    "--etcd-user {user} needs its password in {PASSWORD_ENV} (never on the command \
                     line, where other users can read it)"
                ));
            }
            (None, Some(_)) => {
                return Err(format!(
                    "{PASSWORD_ENV} is set but --etcd-user is not: give the user it belongs to"
                ));
            }
            (None, None) => None,
        };
        Ok(Self {
            endpoints,
            cacert,
            cert,
            key,
            user,
        })
    }

    /// [`Self::new`] with the password from [`PASSWORD_ENV`].
    pub fn from_env(
        endpoints: Endpoints,
        cacert: Option<PathBuf>,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        user: Option<String>,
    ) -> Result<Self, String> {
        Self::new(endpoints, cacert, cert, key, user, std::env::var(PASSWORD_ENV).ok())
    }

    /// Whether the endpoints are `https://`.
    pub fn tls(&self) -> bool {
        self.endpoints.iter().any(|e| e.starts_with("https://"))
    }
}

/// An etcd user that may be absent; an alias for the reason [`Endpoints`] is one.
pub type MaybeUser = Option<String>;

/// `none` (or empty) is no user.
pub fn user(s: &str) -> Result<MaybeUser, String> {
    match s.trim() {
        "" | "none" => Ok(None),
        name => Ok(Some(name.to_owned())),
    }
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
    /// PEM file of the CA that signed etcd's certificate (https:// endpoints); without it, the
    /// system's roots.
    #[arg(long, env = "KODER_DNS_ETCD_CACERT", value_name = "FILE")]
    pub etcd_cacert: Option<PathBuf>,
    /// PEM client certificate, for an etcd started with --client-cert-auth (with --etcd-key).
    #[arg(long, env = "KODER_DNS_ETCD_CERT", value_name = "FILE")]
    pub etcd_cert: Option<PathBuf>,
    /// PEM private key of --etcd-cert.
    #[arg(long, env = "KODER_DNS_ETCD_KEY", value_name = "FILE")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user (etcd with auth enabled); the password comes from KODER_DNS_ETCD_PASSWORD only.
    #[arg(long, env = "KODER_DNS_ETCD_USER", value_name = "NAME")]
    pub etcd_user: Option<String>,
    /// Replace what the prefix holds instead of refusing.
    #[arg(long)]
    pub force: bool,
}

impl MigrateArgs {
    /// How to reach etcd, the password from [`PASSWORD_ENV`].
    pub fn connection(&self) -> Result<Connection, String> {
        Connection::from_env(
            self.etcd_endpoints.clone(),
            self.etcd_cacert.clone(),
            self.etcd_cert.clone(),
            self.etcd_key.clone(),
            self.etcd_user.clone(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connection(
        urls: &str,
        cacert: bool,
        cert: bool,
        key: bool,
        user: bool,
        password: bool,
    ) -> Result<Connection, String> {
        Connection::new(
            endpoints(urls).unwrap(),
            cacert.then(|| "ca.pem".into()),
            cert.then(|| "node.pem".into()),
            key.then(|| "node.key".into()),
            user.then(|| "koder".into()),
            password.then(|| "s3cret".into()),
        )
    }

    #[test]
    fn a_client_certificate_needs_its_key_and_the_key_its_certificate() {
        let e = connection("https://a:2379", true, true, false, false, false).unwrap_err();
        assert!(
            e.contains("--etcd-cert node.pem") && e.contains("without --etcd-key"),
            "{e}"
        );
        let e = connection("https://a:2379", true, false, true, false, false).unwrap_err();
        assert!(
            e.contains("--etcd-key node.key") && e.contains("without --etcd-cert"),
            "{e}"
        );
        assert!(connection("https://a:2379", true, true, true, false, false).is_ok());
    }

    #[test]
    fn tls_files_need_https_endpoints_all_of_them() {
        let e = connection("http://a:2379", true, false, false, false, false).unwrap_err();
        assert!(e.contains("--etcd-cacert") && e.contains("not https://"), "{e}");
        let e = connection("http://a:2379", false, true, true, false, false).unwrap_err();
        assert!(e.starts_with("--etcd-cert"), "{e}");
        let e = connection("https://a:2379,http://b:2379", false, false, false, false, false).unwrap_err();
        assert!(e.contains("mixes"), "{e}");
        // https:// without a CA file: the system's roots.
        assert!(
            connection("https://a:2379,https://b:2379", false, false, false, false, false)
                .unwrap()
                .tls()
        );
    }

    #[test]
    fn the_user_needs_the_password_from_the_environment_and_debug_never_shows_it() {
        let e = connection("http://a:2379", false, false, false, true, false).unwrap_err();
        assert!(e.contains(PASSWORD_ENV) && e.contains("--etcd-user koder"), "{e}");
        let e = connection("http://a:2379", false, false, false, false, true).unwrap_err();
        assert!(e.contains("--etcd-user is not"), "{e}");
        let ok = connection("http://a:2379", false, false, false, true, true).unwrap();
        assert_eq!(ok.user, Some(("koder".into(), "s3cret".into())));
        let shown = format!("{ok:?}");
        assert!(shown.contains("koder") && !shown.contains("s3cret"), "{shown}");
    }
}
