//! The command line: `serve`, and the operator tools `export` and `drift` that talk to a
//! running server.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::config::{Config, FileConfig, parse_duration, split_keys};
use crate::health::CheckKind;

#[derive(Debug, Parser)]
#[command(
    name = "koder-dns",
    version,
    about = "Service registry and authoritative DNS server for the Koder Cloud",
    long_about = "Service registry and authoritative DNS server for the Koder Cloud.\n\n\
Services register their endpoint over REST (POST /api/v1/services/register) and heart-beat a \
lease; koder-dns expires the dead, health-checks the living, and answers DNS for the service \
zone with healthy instances only:\n\n    dig @127.0.0.1 -p 1053 SRV _voice._tcp.service.koder\n\n\
Start with `koder-dns serve`; `koder-dns serve --help` explains every setting in full."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant, reason = "parsed once at start")]
pub enum Command {
    /// Run the registry: DNS (UDP and TCP) and the REST API in one process.
    Serve(ServeArgs),
    /// Write the live registry as koder-service-ports.toml (R8).
    Export(ExportArgs),
    /// Compare the live registry with a reference koder-service-ports.toml (R8).
    ///
    /// Exit status: 0 no drift, 1 drift, 2 error.
    Drift(DriftArgs),
}

/// How the operator tools reach a running server.
#[derive(Debug, Args)]
pub struct Remote {
    /// Base URL of the server's REST API.
    #[arg(long, env = "KODER_DNS_URL", default_value = "http://127.0.0.1:8053")]
    pub url: String,
    /// API key (the first of a comma-separated list is used).
    #[arg(long, env = "KODER_DNS_API_KEY", hide_env_values = true)]
    pub api_key: String,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    #[command(flatten)]
    pub remote: Remote,
    /// Where to write the file; `-` for standard output.
    #[arg(short, long, default_value = "-")]
    pub output: PathBuf,
}

#[derive(Debug, Args)]
pub struct DriftArgs {
    #[command(flatten)]
    pub remote: Remote,
    /// The reference koder-service-ports.toml to compare against.
    #[arg(long, value_name = "FILE")]
    pub reference: PathBuf,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// The command line, with the settings of `serve` summarised in the top-level help too, built
/// from `ServeArgs` itself so the two never disagree.
pub fn command() -> clap::Command {
    let serve = ServeArgs::augment_args(clap::Command::new("serve"));
    let mut settings = String::from("Settings of `koder-dns serve`:\n");
    for arg in serve.get_arguments() {
        let (Some(long), Some(help)) = (arg.get_long(), arg.get_help()) else { continue };
        let env = arg.get_env().map(|e| e.to_string_lossy().into_owned()).unwrap_or_default();
        settings.push_str(&format!("  --{long}  ({env})\n          {help}\n"));
    }
    settings.push_str("  (no flag)  (KODER_DNS_API_KEY)\n          API keys, comma-separated\n\n");
    settings.push_str("Settings come from flags, then KODER_DNS_* environment variables, then the --config file, then defaults.");
    Cli::command().after_help(settings)
}

impl Cli {
    pub fn parse_args() -> Self {
        Self::from_arg_matches(&command().get_matches()).unwrap_or_else(|e| e.exit())
    }
}

fn duration(s: &str) -> Result<Duration, String> {
    parse_duration(s)
}

#[derive(Debug, Default, Args)]
#[command(after_help = "Durations are written like 90s, 500ms, 2m or 0.\n\
API keys come from KODER_DNS_API_KEY (comma-separated) or `api_keys = [...]` in the config file; \
with none, a key is generated into <data-dir>/api-key (mode 0600) and its path is logged.")]
pub struct ServeArgs {
    /// TOML file with any of these settings in snake_case (e.g. dns_listen = "127.0.0.1:53").
    #[arg(long, env = "KODER_DNS_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// DNS address, UDP and TCP [default: 127.0.0.1:1053]. Port 0 picks a free one.
    #[arg(long, env = "KODER_DNS_DNS_LISTEN", value_name = "ADDR")]
    pub dns_listen: Option<SocketAddr>,
    /// REST API address [default: 127.0.0.1:8053].
    #[arg(long, env = "KODER_DNS_HTTP_LISTEN", value_name = "ADDR")]
    pub http_listen: Option<SocketAddr>,
    /// The service zone [default: service.koder].
    #[arg(long, env = "KODER_DNS_DOMAIN", value_name = "DOMAIN")]
    pub domain: Option<String>,
    /// Lease of an instance whose ttl_ns is 0 or negative; 0 = never expire [default: 90s].
    #[arg(long, env = "KODER_DNS_DEFAULT_TTL", value_name = "DURATION", value_parser = duration)]
    pub default_ttl: Option<Duration>,
    /// How often expired instances are removed [default: 30s]. Expired instances are never
    /// served, whether or not the reaper has run.
    #[arg(long, env = "KODER_DNS_REAPER_INTERVAL", value_name = "DURATION", value_parser = duration)]
    pub reaper_interval: Option<Duration>,
    /// TTL of service-zone records, never above the instance's remaining lease [default: 5s].
    #[arg(long, env = "KODER_DNS_DNS_TTL", value_name = "DURATION", value_parser = duration)]
    pub dns_ttl: Option<Duration>,
    /// SOA minimum: how long resolvers cache NXDOMAIN and NODATA [default: 5s].
    #[arg(long, env = "KODER_DNS_NEGATIVE_TTL", value_name = "DURATION", value_parser = duration)]
    pub negative_ttl: Option<Duration>,
    /// Directory of BIND-format zone files (*.zone), each served as its own zone [default: zones].
    #[arg(long, env = "KODER_DNS_ZONES_DIR", value_name = "DIR")]
    pub zones_dir: Option<PathBuf>,
    /// Durable state: the registry database and the generated API key [default: data].
    #[arg(long, env = "KODER_DNS_DATA_DIR", value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Health check for instances that name none: tcp, http or none [default: none].
    #[arg(long, env = "KODER_DNS_DEFAULT_CHECK", value_name = "KIND")]
    pub default_check: Option<CheckKind>,
    /// Consecutive failed checks that make an instance unhealthy [default: 2].
    #[arg(long, env = "KODER_DNS_CHECK_FALL", value_name = "N")]
    pub check_fall: Option<u32>,
    /// Consecutive passed checks that make an instance healthy again [default: 1].
    #[arg(long, env = "KODER_DNS_CHECK_RISE", value_name = "N")]
    pub check_rise: Option<u32>,
    /// Health checks in flight at once, server-wide [default: 64].
    #[arg(long, env = "KODER_DNS_CHECK_CONCURRENCY", value_name = "N")]
    pub check_concurrency: Option<usize>,
    /// Most instances the registry stores; registrations beyond get 507 [default: 200000].
    #[arg(long, env = "KODER_DNS_MAX_INSTANCES", value_name = "N")]
    pub max_instances: Option<usize>,
    /// How often lease renewals (heartbeats) are written to disk in one batch [default: 1s].
    #[arg(long, env = "KODER_DNS_PERSIST_INTERVAL", value_name = "DURATION", value_parser = duration)]
    pub persist_interval: Option<Duration>,
    /// Idle time after which a DNS TCP connection is closed [default: 10s].
    #[arg(long, env = "KODER_DNS_DNS_TCP_IDLE_TIMEOUT", value_name = "DURATION", value_parser = duration)]
    pub dns_tcp_idle_timeout: Option<Duration>,
    /// DNS TCP connections open at once; more wait to be accepted [default: 512].
    #[arg(long, env = "KODER_DNS_DNS_TCP_MAX_CONNECTIONS", value_name = "N")]
    pub dns_tcp_max_connections: Option<usize>,
    /// Threads answering DNS over UDP, each with its own socket [default: one per CPU].
    #[arg(long, env = "KODER_DNS_DNS_UDP_WORKERS", value_name = "N")]
    pub dns_udp_workers: Option<usize>,
    /// HTTP connections open at once; more wait to be accepted [default: 1024].
    #[arg(long, env = "KODER_DNS_HTTP_MAX_CONNECTIONS", value_name = "N")]
    pub http_max_connections: Option<usize>,
    /// Time a client has to send a whole HTTP request and get its answer [default: 10s].
    #[arg(long, env = "KODER_DNS_HTTP_REQUEST_TIMEOUT", value_name = "DURATION", value_parser = duration)]
    pub http_request_timeout: Option<Duration>,
}

impl ServeArgs {
    /// Merges flags and environment (already combined by clap) over the config file and
    /// the defaults.
    pub fn into_config(self) -> anyhow::Result<Config> {
        let file = match &self.config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        let d = Config::default();
        let env_keys = std::env::var("KODER_DNS_API_KEY").ok().map(|s| split_keys(&s));
        let config = Config {
            dns_listen: self.dns_listen.or(file.dns_listen).unwrap_or(d.dns_listen),
            http_listen: self.http_listen.or(file.http_listen).unwrap_or(d.http_listen),
            domain: self.domain.or(file.domain).unwrap_or(d.domain),
            default_ttl: self.default_ttl.or(file.default_ttl).unwrap_or(d.default_ttl),
            reaper_interval: self.reaper_interval.or(file.reaper_interval).unwrap_or(d.reaper_interval),
            dns_ttl: self.dns_ttl.or(file.dns_ttl).unwrap_or(d.dns_ttl),
            negative_ttl: self.negative_ttl.or(file.negative_ttl).unwrap_or(d.negative_ttl),
            zones_dir: self.zones_dir.or(file.zones_dir).unwrap_or(d.zones_dir),
            data_dir: self.data_dir.or(file.data_dir).unwrap_or(d.data_dir),
            api_keys: env_keys.filter(|k| !k.is_empty()).or(file.api_keys).unwrap_or(d.api_keys),
            default_check: self.default_check.or(file.default_check).unwrap_or(d.default_check),
            check_fall: self.check_fall.or(file.check_fall).unwrap_or(d.check_fall),
            check_rise: self.check_rise.or(file.check_rise).unwrap_or(d.check_rise),
            check_concurrency: self.check_concurrency.or(file.check_concurrency).unwrap_or(d.check_concurrency),
            max_instances: self.max_instances.or(file.max_instances).unwrap_or(d.max_instances),
            persist_interval: self.persist_interval.or(file.persist_interval).unwrap_or(d.persist_interval),
            dns_tcp_idle_timeout: self.dns_tcp_idle_timeout.or(file.dns_tcp_idle_timeout).unwrap_or(d.dns_tcp_idle_timeout),
            dns_tcp_max_connections: self
                .dns_tcp_max_connections
                .or(file.dns_tcp_max_connections)
                .unwrap_or(d.dns_tcp_max_connections),
            dns_udp_workers: self.dns_udp_workers.or(file.dns_udp_workers).unwrap_or(d.dns_udp_workers),
            http_max_connections: self.http_max_connections.or(file.http_max_connections).unwrap_or(d.http_max_connections),
            http_request_timeout: self.http_request_timeout.or(file.http_request_timeout).unwrap_or(d.http_request_timeout),
        };
        config.validate()?;
        Ok(config)
    }
}

impl Remote {
    async fn request(&self, method: reqwest::Method, path: &str, body: Option<String>) -> anyhow::Result<reqwest::Response> {
        let url = format!("{}/api/v1{path}", self.url.trim_end_matches('/'));
        let key = split_keys(&self.api_key).into_iter().next().unwrap_or_default();
        let mut request = reqwest::Client::new().request(method, &url).header("X-API-Key", key);
        if let Some(body) = body {
            request = request.body(body);
        }
        let response = request.send().await.map_err(|e| anyhow::anyhow!("cannot reach {url}: {e} (is `koder-dns serve` running there? see --url)"))?;
        if response.status().is_success() {
            return Ok(response);
        }
        let status = response.status();
        let text = response.text().await.unwrap_or_default();
        let message = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_owned))
            .unwrap_or(text);
        anyhow::bail!("{url} answered {status}: {message}")
    }
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio runtime").block_on(f)
}

/// `koder-dns export`: exit 0 written, 2 error.
pub fn export(args: ExportArgs) -> std::process::ExitCode {
    let result = block_on(async {
        let text = args.remote.request(reqwest::Method::GET, "/services/export", None).await?.text().await?;
        if args.output.as_os_str() == "-" {
            print!("{text}");
        } else {
            std::fs::write(&args.output, text).map_err(|e| anyhow::anyhow!("cannot write {}: {e}", args.output.display()))?;
        }
        anyhow::Ok(())
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("koder-dns export: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

/// `koder-dns drift`: exit 0 no drift, 1 drift, 2 error.
pub fn drift(args: DriftArgs) -> std::process::ExitCode {
    let result = block_on(async {
        let reference = std::fs::read_to_string(&args.reference)
            .map_err(|e| anyhow::anyhow!("cannot read the reference file {}: {e}", args.reference.display()))?;
        crate::export::PortsFile::parse(&reference).map_err(|e| anyhow::anyhow!("{}: {e}", args.reference.display()))?;
        let report: crate::export::drift::DriftReport =
            args.remote.request(reqwest::Method::POST, "/services/drift", Some(reference)).await?.json().await?;
        anyhow::Ok(report)
    });
    match result {
        Ok(report) => {
            if args.json {
                println!("{}", serde_json::to_string_pretty(&report).expect("a report serialises"));
            } else {
                print!("{}", report.table());
            }
            std::process::ExitCode::from(if report.drift { 1 } else { 0 })
        }
        Err(e) => {
            eprintln!("koder-dns drift: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}
