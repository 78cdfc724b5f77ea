//! Settings: command-line flags, then `KODER_DNS_*` environment variables, then the
//! `--config` TOML file, then built-in defaults, strongest first.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use anyhow::{Context, bail};

use crate::model::check::CheckKind;
use crate::model::parse_duration;

/// A setting's text, from a flag, the environment or the file, parsed by the type's `FromStr`.
fn parsed<T: FromStr>(s: &str) -> Result<T, String>
where
    T::Err: fmt::Display,
{
    s.trim().parse().map_err(|e| format!("{s:?}: {e}"))
}

/// An address that may be absent. An alias, because clap's derive reads a literal
/// `Option<Option<T>>` as a flag whose value is optional, which this is not.
pub type MaybeAddr = Option<SocketAddr>;

/// A file that may be absent.
pub type MaybePath = Option<PathBuf>;

/// Addresses and networks (`--allow-transfer`). An alias named apart from `Vec`, because
/// clap's derive reads a literal `Vec<T>` as a flag given once per value.
pub type Networks = Vec<ipnet::IpNet>;

/// Addresses with ports (`--notify`); see [`Networks`] for why an alias.
pub type Targets = Vec<SocketAddr>;

/// Comma-separated `ADDR:PORT`s, or `none`.
fn targets(s: &str) -> Result<Targets, String> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty() && *t != "none")
        .map(parsed)
        .collect()
}

/// `none` (or empty) is no file.
fn optional_path(s: &str) -> Result<MaybePath, String> {
    match s.trim() {
        "" | "none" => Ok(None),
        p => Ok(Some(PathBuf::from(p))),
    }
}

/// `none` (or empty) is no address of its own.
fn optional_addr(s: &str) -> Result<MaybeAddr, String> {
    match s.trim() {
        "" | "none" => Ok(None),
        a => parsed(a).map(Some),
    }
}

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// One line per event for a person: `tracing`'s compact text.
    Text,
    /// One JSON object per line, for a log pipeline.
    Json,
}

fn log_format(s: &str) -> Result<LogFormat, String> {
    match s.trim() {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        other => Err(format!("{other:?} is not a log format; use text or json")),
    }
}

/// `auto` is the host name.
fn identity(s: &str) -> Result<String, String> {
    match s.trim() {
        "auto" => Ok(crate::dns::host_name()),
        name => Ok(name.to_owned()),
    }
}

/// `auto` is one per CPU.
fn workers(s: &str) -> Result<usize, String> {
    match s.trim() {
        "auto" => Ok(std::thread::available_parallelism().map_or(1, |n| n.get())),
        n => parsed(n),
    }
}

/// Declares every setting of `koder-dns serve` once: its field, type, default, environment
/// variable, parser and help. From that one list come [`Config`] and its `Default`,
/// [`ServeArgs`] (flags and environment, through clap), the `--config` file's keys, and the
/// merge of all four sources, so a new setting is one entry here and one line in the README.
/// Defaults are written as text and go through the setting's own parser, so the default in
/// `--help` is the one the server runs with.
macro_rules! settings {
    ($(
        $name:ident: $ty:ty = $default:literal, $env:literal, $value_name:literal, $parse:path, $help:literal
            $(, [$($clap:tt)*])?;
    )+) => {
        /// Everything `koder-dns serve` runs with, after all sources are merged.
        #[derive(Debug, Clone)]
        pub struct Config {
            $( #[doc = $help] pub $name: $ty, )+
            /// API keys; several may be valid at once, for rotation.
            pub api_keys: Vec<String>,
        }

        impl Default for Config {
            fn default() -> Self {
                Self {
                    $( $name: $parse($default).expect(concat!("the default of ", stringify!($name))), )+
                    api_keys: Vec::new(),
                }
            }
        }

        /// The settings of `koder-dns serve` as flags and `KODER_DNS_*` variables; each is
        /// `None` unless given, so the file and the defaults can fill in.
        #[derive(Debug, Default, Clone, clap::Args)]
        #[command(after_help = "Durations are written like 90s, 500ms, 2m or 0.\n\
API keys come from KODER_DNS_API_KEY (comma-separated) or `api_keys = [...]` in the config file; \
with none, a key is generated into <data-dir>/api-key (mode 0600) and its path is logged.\n\
No secret is ever a flag (every user of the host can read a process's arguments): TSIG keys come \
from KODER_DNS_TSIG_KEYS (NAME:ALG:BASE64, comma-separated) or `tsig_key` in the config file, the \
etcd user's password from KODER_DNS_ETCD_PASSWORD.")]
        pub struct ServeArgs {
            /// TOML file with any of these settings in snake_case (e.g. dns_listen = "127.0.0.1:53").
            #[arg(long, env = "KODER_DNS_CONFIG", value_name = "FILE")]
            pub config: Option<PathBuf>,
            $(
                #[arg(long, env = $env, value_name = $value_name,
                      value_parser = |s: &str| -> Result<$ty, String> { $parse(s) },
                      $($($clap)*,)?
                      help = concat!($help, " [default: ", $default, "]"))]
                pub $name: Option<$ty>,
            )+
        }

        impl Config {
            /// The settings whose values differ between `self` and `other`, by their names in
            /// the config file (a reload warns about those it cannot take).
            pub fn differences(&self, other: &Config) -> Vec<&'static str> {
                let mut changed = Vec::new();
                $(
                    if format!("{:?}", self.$name) != format!("{:?}", other.$name) {
                        changed.push(stringify!($name));
                    }
                )+
                if self.api_keys != other.api_keys {
                    changed.push("api_keys");
                }
                changed
            }
        }

        /// The keys the `--config` file may hold.
        const FILE_KEYS: &[&str] = &[$(stringify!($name),)+ "api_keys"];

        impl ServeArgs {
            /// Merges flags and environment (already combined by clap) over the config file
            /// and the defaults, then validates the result.
            pub fn into_config(self) -> anyhow::Result<Config> {
                let file = match &self.config {
                    Some(path) => load_file(path)?,
                    None => toml::Table::new(),
                };
                let mut config = Config::default();
                $(
                    // A bad value in the file is refused even where a flag overrides it.
                    if let Some(value) = file.get(stringify!($name)) {
                        config.$name = $parse(&file_text(value))
                            .map_err(|e| anyhow::anyhow!("config file: {}: {e}", stringify!($name)))?;
                    }
                    if let Some(value) = self.$name {
                        config.$name = value;
                    }
                )+
                config.api_keys = api_keys(&file)?;
                config.validate()?;
                Ok(config)
            }
        }
    };
}

settings! {
    dns_listen: SocketAddr = "127.0.0.1:1053", "KODER_DNS_DNS_LISTEN", "ADDR", parsed,
        "DNS address, UDP and TCP. Port 0 picks a free one.";
    http_listen: SocketAddr = "127.0.0.1:8053", "KODER_DNS_HTTP_LISTEN", "ADDR", parsed,
        "REST API address.";
    domain: String = "service.koder", "KODER_DNS_DOMAIN", "DOMAIN", parsed,
        "The service zone.";
    default_ttl: Duration = "90s", "KODER_DNS_DEFAULT_TTL", "DURATION", parse_duration,
        "Lease of an instance whose ttl_ns is 0 or negative; 0 = never expire.";
    min_ttl: Duration = "1s", "KODER_DNS_MIN_TTL", "DURATION", parse_duration,
        "Shortest ttl_ns a registration may ask for; shorter ones get 400.";
    max_ttl: Duration = "24h", "KODER_DNS_MAX_TTL", "DURATION", parse_duration,
        "Longest ttl_ns a registration may ask for; longer ones get 400.";
    reaper_interval: Duration = "30s", "KODER_DNS_REAPER_INTERVAL", "DURATION", parse_duration,
        "How often expired instances are removed. Expired instances are never served, \
         whether or not the reaper has run (on etcd the expiry leader deletes each at its lease's end; \
         this is how often it also sweeps for what expired before it led).";
    dns_ttl: Duration = "5s", "KODER_DNS_DNS_TTL", "DURATION", parse_duration,
        "TTL of service-zone records, never above the instance's remaining lease.";
    negative_ttl: Duration = "5s", "KODER_DNS_NEGATIVE_TTL", "DURATION", parse_duration,
        "SOA minimum: how long resolvers cache NXDOMAIN and NODATA.";
    zones_dir: PathBuf = "zones", "KODER_DNS_ZONES_DIR", "DIR", parsed,
        "Directory of BIND-format zone files (*.zone), each served as its own zone.";
    data_dir: PathBuf = "data", "KODER_DNS_DATA_DIR", "DIR", parsed,
        "Durable state: the registry database and the generated API key.";
    default_check: CheckKind = "none", "KODER_DNS_DEFAULT_CHECK", "KIND", parsed,
        "Health check for instances that name none: tcp, http or none.";
    check_fall: u32 = "2", "KODER_DNS_CHECK_FALL", "N", parsed,
        "Consecutive failed checks that make an instance unhealthy.";
    check_rise: u32 = "1", "KODER_DNS_CHECK_RISE", "N", parsed,
        "Consecutive passed checks that make an instance healthy again.";
    check_concurrency: usize = "64", "KODER_DNS_CHECK_CONCURRENCY", "N", parsed,
        "Health checks in flight at once, server-wide.";
    max_instances: usize = "200000", "KODER_DNS_MAX_INSTANCES", "N", parsed,
        "Most instances the registry stores; registrations beyond get 507.";
    persist_interval: Duration = "1s", "KODER_DNS_PERSIST_INTERVAL", "DURATION", parse_duration,
        "How often lease renewals (heartbeats) and health flips are written to disk in one batch (redb; \
         on etcd each renewal is in etcd before its heartbeat is answered).";
    dns_tcp_idle_timeout: Duration = "10s", "KODER_DNS_DNS_TCP_IDLE_TIMEOUT", "DURATION", parse_duration,
        "Idle time after which a DNS TCP connection is closed.";
    dns_tcp_max_connections: usize = "512", "KODER_DNS_DNS_TCP_MAX_CONNECTIONS", "N", parsed,
        "DNS TCP connections open at once; more wait to be accepted.";
    dns_udp_workers: usize = "auto", "KODER_DNS_DNS_UDP_WORKERS", "N", workers,
        "Threads answering DNS over UDP, each with its own socket; auto = one per CPU.";
    dns_udp_max_payload: u16 = "1232", "KODER_DNS_DNS_UDP_MAX_PAYLOAD", "BYTES", parsed,
        "Largest UDP response, advertised in our OPT record; 512-4096 (1232: DNS Flag Day 2020).";
    dns_identity: String = "auto", "KODER_DNS_DNS_IDENTITY", "TEXT", identity,
        "What CH TXT id.server./hostname.bind. and NSID answer; auto = the host name.";
    dns_hide_version: bool = "false", "KODER_DNS_DNS_HIDE_VERSION", "BOOL", parsed,
        "Refuse CH TXT version.bind./version.server. instead of answering koder-dns <version>.",
        [num_args = 0..=1, default_missing_value = "true"];
    dns_rrl_rate: u32 = "0", "KODER_DNS_DNS_RRL_RATE", "N", parsed,
        "Response rate limiting over UDP: responses per second to one client network (a /24, an \
         IPv6 /56), with bursts of 5 s worth; past it responses are dropped or slipped. 0 = off.";
    dns_rrl_slip: u32 = "2", "KODER_DNS_DNS_RRL_SLIP", "N", parsed,
        "Every N-th response over the rate is sent as an empty reply with TC, so a real client \
         retries over TCP; 0 = drop them all, 1 = slip them all.";
    dns_rrl_exempt: Networks = "none", "KODER_DNS_DNS_RRL_EXEMPT", "CIDRS", crate::dns::transfer::parse_allow,
        "Addresses or CIDRs (comma-separated) never rate-limited: your own resolvers, monitoring, secondaries.";
    dns_cookie_secret_file: MaybePath = "none", "KODER_DNS_DNS_COOKIE_SECRET_FILE", "FILE", optional_path,
        "DNS cookie secret: 16 bytes in hex on the first line, optionally a second accepted beside it \
         (for a rollover); nodes with one file accept each other's cookies. none = random at every start.";
    http_max_connections: usize = "1024", "KODER_DNS_HTTP_MAX_CONNECTIONS", "N", parsed,
        "HTTP connections open at once; more wait to be accepted.";
    http_max_connections_per_client: usize = "200", "KODER_DNS_HTTP_MAX_CONNECTIONS_PER_CLIENT", "N", parsed,
        "HTTP connections one client address may hold open; beyond it new ones from that \
         address are closed at once, so others are still served.";
    http_request_timeout: Duration = "10s", "KODER_DNS_HTTP_REQUEST_TIMEOUT", "DURATION", parse_duration,
        "Time a client has to send a whole HTTP request and get its answer.";
    metrics_listen: MaybeAddr = "none", "KODER_DNS_METRICS_LISTEN", "ADDR", optional_addr,
        "Serve GET /metrics on an address of its own instead of the REST address.";
    log_format: LogFormat = "text", "KODER_DNS_LOG_FORMAT", "FORMAT", log_format,
        "Log lines as text (for a person) or json (one object per line).";
    drift_reference: MaybePath = "none", "KODER_DNS_DRIFT_REFERENCE", "FILE", optional_path,
        "A reference koder-service-ports.toml: GET /api/v1/services/drift and the status page compare \
         the live registry with it.";
    watch_max: usize = "8192", "KODER_DNS_WATCH_MAX", "N", parsed,
        "Blocking queries (?index=&wait=) held at once; more get 429.";
    allow_transfer: Networks = "none", "KODER_DNS_ALLOW_TRANSFER", "CIDRS", crate::dns::transfer::parse_allow,
        "Addresses or CIDRs (comma-separated) that may transfer the zones (AXFR, IXFR) without TSIG; \
         none = only transfers signed with a TSIG key (KODER_DNS_TSIG_KEYS).";
    tsig_key: crate::dns::tsig::Keys = "none", "KODER_DNS_TSIG_KEYS", "NAME:ALG:BASE64", crate::dns::tsig::parse_keys,
        "TSIG keys, comma-separated (hmac-sha256, hmac-sha384 or hmac-sha512): transfers signed with one \
         are allowed from anywhere, and signed queries get signed answers. A secret: from the environment \
         or the config file only, never a flag.";
    notify: Targets = "none", "KODER_DNS_NOTIFY", "ADDR:PORT", targets,
        "Secondary told by NOTIFY of every serial change (repeatable, or comma-separated); coalesced \
         over 100ms, retried with back-off until it answers.";
    soa_refresh: Duration = "1h", "KODER_DNS_SOA_REFRESH", "DURATION", parse_duration,
        "SOA refresh: how often a secondary without NOTIFY asks whether the zone changed.";
    soa_retry: Duration = "10m", "KODER_DNS_SOA_RETRY", "DURATION", parse_duration,
        "SOA retry: how soon a secondary asks again after a failed refresh.";
    soa_expire: Duration = "1d", "KODER_DNS_SOA_EXPIRE", "DURATION", parse_duration,
        "SOA expire: how long a secondary cut off from us serves its last copy (instances that \
         died since included) before it stops answering for the zone.";
    journal_max_changes: usize = "1024", "KODER_DNS_JOURNAL_MAX_CHANGES", "N", parsed,
        "Zone versions the IXFR journal keeps; a secondary older than all of them gets the whole zone.";
    journal_max_bytes: usize = "67108864", "KODER_DNS_JOURNAL_MAX_BYTES", "BYTES", parsed,
        "Bytes of changed records the IXFR journal keeps at most.";
    store: crate::cluster::StoreKind = "redb", "KODER_DNS_STORE", "KIND", crate::cluster::store_kind,
        "Where the registry is kept: redb (one node, a file under --data-dir) or etcd (any number of \
         nodes sharing one registry; needs a build with --features etcd).";
    etcd_endpoints: crate::cluster::Endpoints = "http://127.0.0.1:2379", "KODER_DNS_ETCD_ENDPOINTS", "URLS",
        crate::cluster::endpoints, "etcd v3 client URLs, comma-separated (with --store etcd).";
    etcd_prefix: String = "/koder-dns/", "KODER_DNS_ETCD_PREFIX", "PREFIX", crate::cluster::prefix,
        "Key prefix of this registry in etcd; nodes with the same prefix share one registry.";
    etcd_cacert: MaybePath = "none", "KODER_DNS_ETCD_CACERT", "FILE", optional_path,
        "PEM file of the CA that signed etcd's certificate, for https:// endpoints; none = the \
         system's roots.";
    etcd_cert: MaybePath = "none", "KODER_DNS_ETCD_CERT", "FILE", optional_path,
        "PEM client certificate for an etcd started with --client-cert-auth (with --etcd-key).";
    etcd_key: MaybePath = "none", "KODER_DNS_ETCD_KEY", "FILE", optional_path,
        "PEM private key of --etcd-cert (PKCS#8, SEC1 or PKCS#1).";
    etcd_user: crate::cluster::MaybeUser = "none", "KODER_DNS_ETCD_USER", "NAME", crate::cluster::user,
        "etcd user, for an etcd with auth enabled; its password comes from KODER_DNS_ETCD_PASSWORD \
         only, never a flag. A role granting readwrite on --etcd-prefix alone is enough.";
    keys_file: MaybePath = "none", "KODER_DNS_KEYS_FILE", "FILE", optional_path,
        "Scoped API keys: a TOML file of [[key]] tables (id, sha256, scope = admin|read|register, services \
         for register keys); digests only, made with `koder-dns keys new`. Re-read on SIGHUP.";
    tls_cert: MaybePath = "none", "KODER_DNS_TLS_CERT", "FILE", optional_path,
        "PEM certificate chain (leaf first): with --tls-key, --http-listen serves HTTPS only (TLS 1.2 \
         and 1.3) and --dot-listen can serve DNS over TLS. Re-read on SIGHUP.";
    tls_key: MaybePath = "none", "KODER_DNS_TLS_KEY", "FILE", optional_path,
        "PEM private key of --tls-cert (PKCS#8, SEC1 or PKCS#1). Re-read on SIGHUP.";
    dot_listen: MaybeAddr = "none", "KODER_DNS_DOT_LISTEN", "ADDR", optional_addr,
        "DNS over TLS (RFC 7858) address, e.g. 0.0.0.0:853; needs --tls-cert and --tls-key. Same \
         answers, connection bound and idle timeout as DNS over TCP.";
    dnssec: bool = "false", "KODER_DNS_DNSSEC", "BOOL", parsed,
        "Sign the service zone (DNSSEC, ECDSAP256SHA256, one combined key): RRSIGs for DO queries, \
         compact denial (RFC 9824), signed transfers. The key is --dnssec-key, or generated into \
         <data-dir>/dnssec/ at the first start and kept (`--dnssec` alone means true).",
        [num_args = 0..=1, default_missing_value = "true"];
    dnssec_key: MaybePath = "none", "KODER_DNS_DNSSEC_KEY", "FILE", optional_path,
        "The zone's signing key, PKCS#8 PEM (ECDSA P-256), used as given; nodes sharing etcd must all be \
         given the same one (`koder-dns dnssec keygen --out FILE` makes one). none = generated under --data-dir.";
    dnssec_publish_key: MaybePath = "none", "KODER_DNS_DNSSEC_PUBLISH_KEY", "FILE", optional_path,
        "A second key, PKCS#8 PEM, published as a DNSKEY beside the signing key but not signed with: \
         the first step of a key rollover.";
    node_id: String = "auto", "KODER_DNS_NODE_ID", "ID", parsed,
        "This node's name among the etcd nodes (its membership key and the expiry leader's lock say it); \
         a node whose id a live node holds does not start (exit 2); auto = host:http-port.";
}

/// Reads the `--config` file, refusing keys that are no setting.
fn load_file(path: &Path) -> anyhow::Result<toml::Table> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read the config file {}", path.display()))?;
    let table: toml::Table =
        toml::from_str(&text).map_err(|e| anyhow::anyhow!("config file {}: {e}", path.display()))?;
    if let Some(unknown) = table.keys().find(|k| !FILE_KEYS.contains(&k.as_str())) {
        bail!(
            "config file {}: unknown key {unknown:?}; the keys are the settings of \
             `koder-dns serve --help` in snake_case: {}",
            path.display(),
            FILE_KEYS.join(", ")
        );
    }
    Ok(table)
}

/// A file value as the text a flag would carry: strings as they are, numbers and booleans
/// written out, so one parser serves every source.
fn file_text(value: &toml::Value) -> String {
    match value {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// `KODER_DNS_API_KEY` (comma-separated), else the file's `api_keys`, else none.
fn api_keys(file: &toml::Table) -> anyhow::Result<Vec<String>> {
    if let Some(keys) = std::env::var("KODER_DNS_API_KEY").ok().map(|s| split_keys(&s))
        && !keys.is_empty()
    {
        return Ok(keys);
    }
    match file.get("api_keys") {
        None => Ok(Vec::new()),
        Some(toml::Value::Array(keys)) => keys
            .iter()
            .map(|k| k.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .context("config file: api_keys must be a list of strings"),
        Some(_) => bail!("config file: api_keys must be a list of strings, e.g. api_keys = [\"...\"]"),
    }
}

/// Comma-separated keys, as `KODER_DNS_API_KEY` carries them.
pub fn split_keys(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
        .collect()
}

impl Config {
    /// Refuses settings that would make the server misbehave, naming the setting.
    pub fn validate(&self) -> anyhow::Result<()> {
        crate::zone::records::ZoneNames::new(&self.domain).map_err(|e| anyhow::anyhow!("--domain: {e}"))?;
        if self.reaper_interval.is_zero() {
            bail!("--reaper-interval must be positive (e.g. 30s)");
        }
        if self.dns_ttl.as_secs() > u32::MAX as u64 || self.negative_ttl.as_secs() > u32::MAX as u64 {
            bail!("--dns-ttl and --negative-ttl must fit a DNS TTL (at most 136 years)");
        }
        if self.default_ttl.as_nanos() > i64::MAX as u128 {
            bail!("--default-ttl is too long");
        }
        if self.min_ttl.is_zero() || self.min_ttl > self.max_ttl || self.max_ttl.as_nanos() > i64::MAX as u128 {
            bail!("--min-ttl must be positive and at most --max-ttl");
        }
        if self.check_fall == 0 || self.check_rise == 0 {
            bail!("--check-fall and --check-rise must be at least 1");
        }
        for (flag, timer) in [
            ("--soa-refresh", self.soa_refresh),
            ("--soa-retry", self.soa_retry),
            ("--soa-expire", self.soa_expire),
        ] {
            if timer.is_zero() || timer.as_secs() > i32::MAX as u64 {
                bail!("{flag} must be between 1s and 68 years (RFC 1035 timers are 31-bit seconds)");
            }
        }
        if self.soa_expire < self.soa_refresh + self.soa_retry {
            bail!("--soa-expire must be at least --soa-refresh plus --soa-retry (RFC 1912 §2.2)");
        }
        if self.journal_max_changes == 0 {
            bail!("--journal-max-changes must be at least 1");
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
        if self.http_max_connections_per_client == 0 {
            bail!("--http-max-connections-per-client must be at least 1");
        }
        if !(512..=crate::dns::MAX_UDP_PAYLOAD).contains(&self.dns_udp_max_payload) {
            bail!("--dns-udp-max-payload must be between 512 and 4096 bytes");
        }
        if self.dns_identity.is_empty() || self.dns_identity.len() > 255 {
            bail!("--dns-identity must be 1-255 bytes (one TXT string)");
        }
        if self.dns_rrl_rate > crate::dns::rrl::MAX_RATE {
            bail!(
                "--dns-rrl-rate must be at most {} responses per second (0 = off)",
                crate::dns::rrl::MAX_RATE
            );
        }
        if let Some(path) = &self.dns_cookie_secret_file {
            crate::dns::cookie::Secrets::load(path).map_err(|e| anyhow::anyhow!("--dns-cookie-secret-file: {e}"))?;
        }
        if let Some(path) = &self.drift_reference {
            crate::export::drift::load_reference(path).map_err(|e| anyhow::anyhow!("--drift-reference: {e}"))?;
        }
        if self.watch_max == 0 {
            bail!("--watch-max must be at least 1");
        }
        if self.http_request_timeout.is_zero() {
            bail!("--http-request-timeout must be positive");
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), None) => bail!(
                "--tls-cert {} is given without --tls-key: give both, or neither",
                cert.display()
            ),
            (None, Some(key)) => bail!(
                "--tls-key {} is given without --tls-cert: give both, or neither",
                key.display()
            ),
            _ => {}
        }
        if let Some(addr) = self.dot_listen
            && self.tls_cert.is_none()
        {
            bail!("--dot-listen {addr} needs a certificate: give --tls-cert and --tls-key");
        }
        if self.store == crate::cluster::StoreKind::Etcd {
            self.etcd_connection()?;
        }
        Ok(())
    }

    /// How to reach etcd (`--etcd-*`), the password from `KODER_DNS_ETCD_PASSWORD`.
    pub fn etcd_connection(&self) -> anyhow::Result<crate::cluster::Connection> {
        crate::cluster::Connection::from_env(
            self.etcd_endpoints.clone(),
            self.etcd_cacert.clone(),
            self.etcd_cert.clone(),
            self.etcd_key.clone(),
            self.etcd_user.clone(),
        )
        .map_err(anyhow::Error::msg)
    }
}
