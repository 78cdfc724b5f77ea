//! Reloading what may change while the server runs, on SIGHUP (`systemctl reload`): the keys
//! file, the config file's `api_keys`, the TLS certificate and key, the zones directory and
//! the TSIG keys and the secrets of DNS cookies.
//!
//! A reload reads everything first and replaces nothing until all of it has been read: a
//! missing file, one that does not parse, or a certificate and key that do not match leaves
//! the old settings in force, logs which file and why, and the server runs on. Each part is
//! swapped whole (an `ArcSwap`), so a request, a handshake or a transfer that started before
//! finishes with what it started with, and the next one sees the new settings. Settings read
//! once at start (listen addresses, data directory, store, domain, ...) are kept; a reload
//! warns about each one that changed in the config file.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use anyhow::Context;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use tracing::{error, info, warn};

use crate::access::{self, Access, Scope, Table};
use crate::config::{Config, ServeArgs};
use crate::dns::Authority;
use crate::tls::{Credentials, ServerCert};

/// The settings a reload takes, by their names in the config file.
const RELOADED: &[&str] = &[
    "keys_file",
    "api_keys",
    "tls_cert",
    "tls_key",
    "zones_dir",
    "tsig_key",
    "dns_cookie_secret_file",
];

/// The keys a config gives: its `api_keys` (or `KODER_DNS_API_KEY`) as admin keys named
/// `api-key-1`, `api-key-2`, ..., then the keys file's. With neither an API key nor an admin
/// key in the keys file, the admin key generated into `<data-dir>/api-key` (made at the
/// first start) is in force too, named `generated`, so the server never runs without one
/// and the operator tools on its own host need no key.
///
/// The second value is the generated key's file when one was just made.
pub fn keys(config: &Config) -> anyhow::Result<(Table, Option<PathBuf>)> {
    let file = match &config.keys_file {
        Some(path) => access::load_file(path)?,
        None => Vec::new(),
    };
    let mut admin: Vec<(String, String)> = config
        .api_keys
        .iter()
        .enumerate()
        .map(|(i, key)| (format!("api-key-{}", i + 1), key.clone()))
        .collect();
    let mut generated = None;
    if admin.is_empty() && !file.iter().any(|k| k.scope == Scope::Admin) {
        let (key, path, created) = crate::api::auth::load_or_generate(&config.data_dir)?;
        admin.push(("generated".to_owned(), key));
        generated = Some(path).filter(|_| created);
    }
    Ok((Table::new(&admin, &file), generated))
}

/// The certificate and key a config names, if it names them.
pub fn credentials(config: &Config) -> anyhow::Result<Option<Credentials>> {
    match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => Ok(Some(Credentials::load(cert, key)?)),
        _ => Ok(None),
    }
}

/// What a reload replaces, and how the reloads went.
pub struct Reloader {
    /// The flags and environment the server started with: a reload merges them over the
    /// config file as it is now. `None` for a server started from a [`Config`] alone (tests,
    /// an embedding program): then the files that config names are read again.
    args: Option<ServeArgs>,
    /// The settings the server started with.
    started: Config,
    access: Arc<Access>,
    cert: Option<Arc<ServerCert>>,
    authority: Authority,
    /// One reload at a time: a second SIGHUP waits for the first.
    one_at_a_time: tokio::sync::Mutex<()>,
    ok: AtomicU64,
    failed: AtomicU64,
    last_ok: AtomicBool,
}

impl Reloader {
    pub fn new(
        args: Option<ServeArgs>,
        started: Config,
        access: Arc<Access>,
        cert: Option<Arc<ServerCert>>,
        authority: Authority,
    ) -> Self {
        Self {
            args,
            started,
            access,
            cert,
            authority,
            one_at_a_time: tokio::sync::Mutex::new(()),
            ok: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            last_ok: AtomicBool::new(true),
        }
    }

    /// Re-reads and, when everything could be read, replaces. An error (also logged) when
    /// nothing was replaced.
    pub async fn reload(&self) -> anyhow::Result<()> {
        let _one = self.one_at_a_time.lock().await;
        info!("reloading: keys, TLS certificate, zones, TSIG keys, cookie secrets");
        let outcome = self.try_reload().await;
        let ok = outcome.is_ok();
        self.last_ok.store(ok, Ordering::Relaxed);
        if ok {
            self.ok.fetch_add(1, Ordering::Relaxed);
        } else {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        if let Err(e) = &outcome {
            error!(error = %format!("{e:#}"), "reload failed; the settings in force are unchanged");
        }
        outcome
    }

    async fn try_reload(&self) -> anyhow::Result<()> {
        let config = match &self.args {
            Some(args) => args.clone().into_config()?,
            None => self.started.clone(),
        };
        // Everything is read before anything is replaced.
        let (table, generated) = keys(&config)?;
        let credentials = match &self.cert {
            Some(_) if config.tls_cert.is_none() => {
                warn!(
                    "tls_cert and tls_key are gone from the settings; HTTPS goes on with the certificate in force until a restart"
                );
                None
            }
            Some(_) => credentials(&config)?,
            None => None,
        };
        // Without a secrets file the secret is random and stays: a new one would refuse
        // every cookie handed out so far.
        let cookie_secrets = match &config.dns_cookie_secret_file {
            Some(path) => Some(
                crate::dns::cookie::Secrets::load(path)
                    .map_err(|e| anyhow::anyhow!("--dns-cookie-secret-file: {e}"))?,
            ),
            None if self.started.dns_cookie_secret_file.is_some() => {
                warn!(
                    "dns_cookie_secret_file is gone from the settings; DNS cookies go on with the secrets in force until a restart"
                );
                None
            }
            None => None,
        };
        let origin = self.authority.origin();
        let zones_dir = config.zones_dir.clone();
        let zones = tokio::task::spawn_blocking(move || crate::dns::zones::load(&zones_dir, &origin))
            .await
            .context("loading the zones")??;
        // HTTPS itself is chosen at start: only a server that serves it takes a new certificate.
        let reloaded = |setting: &str| {
            RELOADED.contains(&setting) && (self.cert.is_some() || !matches!(setting, "tls_cert" | "tls_key"))
        };
        for setting in self.started.differences(&config) {
            if !reloaded(setting) {
                warn!(
                    setting,
                    "changed in the config file, but it is read at start only: the value in force stays until a restart"
                );
            }
        }
        // Now replace.
        let keys = table.len();
        self.access.replace(table);
        if let Some(path) = generated {
            warn!(path = %path.display(), "no admin key configured any more; generated one");
        }
        if let (Some(cert), Some(credentials)) = (&self.cert, credentials) {
            info!(serial = %credentials.serial, not_after = credentials.not_after, "TLS certificate in force");
            cert.replace(credentials);
        }
        self.authority.replace_tsig_keys(config.tsig_key.clone());
        if let Some(secrets) = cookie_secrets {
            self.authority.replace_cookie_secrets(secrets);
        }
        self.authority.replace_static_zones(zones).await;
        info!(keys, "reloaded");
        Ok(())
    }
}

/// `koder_dns_config_reloads_total`, `koder_dns_config_last_reload_ok` and
/// `koder_dns_tls_cert_not_after_seconds`, read from a [`Reloader`] at scrape time.
#[derive(Debug)]
pub struct Metrics(pub Arc<Reloader>);

impl Collector for Metrics {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let this = &self.0;
        let mut family = encoder.encode_descriptor(
            "config_reloads",
            "Reloads (SIGHUP) by result: ok, or error (nothing was changed)",
            None,
            MetricType::Counter,
        )?;
        for (result, n) in [("ok", &this.ok), ("error", &this.failed)] {
            ConstCounter::new(n.load(Ordering::Relaxed)).encode(family.encode_family(&[("result", result)])?)?;
        }
        let family = encoder.encode_descriptor(
            "config_last_reload_ok",
            "1 when the last reload took (or none was tried), 0 when it failed",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(i64::from(this.last_ok.load(Ordering::Relaxed))).encode(family)?;
        if let Some(cert) = &this.cert {
            let family = encoder.encode_descriptor(
                "tls_cert_not_after_seconds",
                "When the TLS certificate in force expires (Unix time)",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(cert.current().not_after).encode(family)?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for Reloader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reloader")
    }
}
