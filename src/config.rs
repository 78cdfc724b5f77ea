//! Settings: command-line flags, then `KODER_DNS_*` environment variables, then the
//! `--config` TOML file, then built-in defaults, strongest first.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use serde::Deserialize;

use crate::health::CheckKind;

/// Parses `90s`, `500ms`, `2m`, `1h30m` or `0`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    humantime::parse_duration(s).map_err(|e| format!("{s:?} is not a duration like 90s, 500ms or 2m ({e})"))
}

/// Everything `koder-dns serve` runs with, after all sources are merged.
#[derive(Debug, Clone)]
pub struct Config {
    pub dns_listen: SocketAddr,
    pub http_listen: SocketAddr,
    pub domain: String,
    pub default_ttl: Duration,
    pub reaper_interval: Duration,
    pub dns_ttl: Duration,
    pub negative_ttl: Duration,
    pub zones_dir: PathBuf,
    pub data_dir: PathBuf,
    pub api_keys: Vec<String>,
    pub default_check: CheckKind,
    pub check_fall: u32,
    pub check_rise: u32,
    pub check_concurrency: usize,
    pub max_instances: usize,
    pub persist_interval: Duration,
    pub dns_tcp_idle_timeout: Duration,
    pub dns_tcp_max_connections: usize,
    pub dns_udp_workers: usize,
    pub http_max_connections: usize,
    pub http_request_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            dns_listen: "127.0.0.1:1053".parse().unwrap(),
            http_listen: "127.0.0.1:8053".parse().unwrap(),
            domain: "service.koder".into(),
            default_ttl: Duration::from_secs(90),
            reaper_interval: Duration::from_secs(30),
            dns_ttl: Duration::from_secs(5),
            negative_ttl: Duration::from_secs(5),
            zones_dir: "zones".into(),
            data_dir: "data".into(),
            api_keys: Vec::new(),
            default_check: CheckKind::None,
            check_fall: 2,
            check_rise: 1,
            check_concurrency: 64,
            max_instances: 200_000,
            persist_interval: Duration::from_secs(1),
            dns_tcp_idle_timeout: Duration::from_secs(10),
            dns_tcp_max_connections: 512,
            dns_udp_workers: std::thread::available_parallelism().map_or(1, |n| n.get()),
            http_max_connections: 1024,
            http_request_timeout: Duration::from_secs(10),
        }
    }
}

fn de_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let s = Option::<String>::deserialize(d)?;
    s.map(|s| parse_duration(&s).map_err(serde::de::Error::custom)).transpose()
}

/// The `--config` file: the same settings as the flags, in snake_case.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub dns_listen: Option<SocketAddr>,
    pub http_listen: Option<SocketAddr>,
    pub domain: Option<String>,
    #[serde(default, deserialize_with = "de_duration")]
    pub default_ttl: Option<Duration>,
    #[serde(default, deserialize_with = "de_duration")]
    pub reaper_interval: Option<Duration>,
    #[serde(default, deserialize_with = "de_duration")]
    pub dns_ttl: Option<Duration>,
    #[serde(default, deserialize_with = "de_duration")]
    pub negative_ttl: Option<Duration>,
    pub zones_dir: Option<PathBuf>,
    pub data_dir: Option<PathBuf>,
    pub api_keys: Option<Vec<String>>,
    pub default_check: Option<CheckKind>,
    pub check_fall: Option<u32>,
    pub check_rise: Option<u32>,
    pub check_concurrency: Option<usize>,
    pub max_instances: Option<usize>,
    #[serde(default, deserialize_with = "de_duration")]
    pub persist_interval: Option<Duration>,
    #[serde(default, deserialize_with = "de_duration")]
    pub dns_tcp_idle_timeout: Option<Duration>,
    pub dns_tcp_max_connections: Option<usize>,
    pub dns_udp_workers: Option<usize>,
    pub http_max_connections: Option<usize>,
    #[serde(default, deserialize_with = "de_duration")]
    pub http_request_timeout: Option<Duration>,
}

impl FileConfig {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the config file {}", path.display()))?;
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("config file {}: {e}", path.display()))
    }
}

/// Comma-separated keys, as `KODER_DNS_API_KEY` carries them.
pub fn split_keys(s: &str) -> Vec<String> {
    s.split(',').map(str::trim).filter(|k| !k.is_empty()).map(str::to_owned).collect()
}

impl Config {
    /// Refuses settings that would make the server misbehave, naming the setting.
    pub fn validate(&self) -> anyhow::Result<()> {
        crate::dns::records::ZoneNames::new(&self.domain).map_err(|e| anyhow::anyhow!("--domain: {e}"))?;
        if self.reaper_interval.is_zero() {
            bail!("--reaper-interval must be positive (e.g. 30s)");
        }
        if self.dns_ttl.as_secs() > u32::MAX as u64 || self.negative_ttl.as_secs() > u32::MAX as u64 {
            bail!("--dns-ttl and --negative-ttl must fit a DNS TTL (at most 136 years)");
        }
        if self.default_ttl.as_nanos() > i64::MAX as u128 {
            bail!("--default-ttl is too long");
        }
        if self.check_fall == 0 || self.check_rise == 0 {
            bail!("--check-fall and --check-rise must be at least 1");
        }
        if self.check_concurrency == 0 {
            bail!("--check-concurrency must be at least 1");
        }
        if self.max_instances == 0 {
            bail!("--max-instances must be at least 1");
        }
        if self.persist_interval.is_zero() {
            bail!("--persist-interval must be positive (e.g. 1s)");
        }
        if self.dns_tcp_max_connections == 0 || self.http_max_connections == 0 || self.dns_udp_workers == 0 {
            bail!("--dns-tcp-max-connections, --dns-udp-workers and --http-max-connections must be at least 1");
        }
        if self.http_request_timeout.is_zero() {
            bail!("--http-request-timeout must be positive");
        }
        Ok(())
    }
}
