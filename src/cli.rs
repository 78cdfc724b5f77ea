//! The command line: `serve`, and the operator tools `export` and `drift` that talk to a
//! running server.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

pub use crate::config::ServeArgs;
use crate::config::split_keys;

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
    /// Keep one instance registered while this process runs; deregister on SIGTERM or Ctrl-C.
    ///
    /// The API key comes from KODER_DNS_API_KEY or --api-key-file, never from the command line
    /// (other users can read a process's arguments).
    Agent(AgentArgs),
    /// Check a producer against the service-registry contract (R1-R8), one line per check.
    ///
    /// Exit status: 0 all pass, 1 any failed, 2 could not run. Key from KODER_DNS_API_KEY.
    Conformance(ConformanceArgs),
    /// Copy a redb registry (`--data-dir`) into etcd, for a move to `--store etcd`.
    ///
    /// Refuses when the prefix already holds a registry, unless --force. Exit status: 0
    /// copied, 1 refused or failed, 2 bad arguments or etcd refusing the TLS files, user or role.
    Migrate(crate::cluster::MigrateArgs),
    /// API keys: `keys new` makes one for a --keys-file.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// The zone's DNSSEC key: `ds` for the parent, `dnskey` for a resolver's trust anchor,
    /// `keygen` to make a key for --dnssec-key.
    #[command(subcommand)]
    Dnssec(DnssecCommand),
}

#[derive(Debug, Subcommand)]
pub enum DnssecCommand {
    /// Print the zone's DS record (digest type 2, SHA-256), for the parent zone.
    Ds(DnssecArgs),
    /// Print the zone's DNSKEY records as zone-file lines, for a resolver's trust anchor
    /// (unbound `trust-anchor-file`, Knot Resolver `trust_anchors.add_file`).
    Dnskey(DnssecArgs),
    /// Write a new ECDSA P-256 key (PKCS#8 PEM, mode 0600) to --out, for --dnssec-key or
    /// --dnssec-publish-key. Refuses to replace a file.
    Keygen(KeygenArgs),
}

/// The key `serve --dnssec` signs with: the same flags and variables as `serve`.
#[derive(Debug, Args)]
pub struct DnssecArgs {
    #[arg(long, env = "KODER_DNS_DATA_DIR", default_value = "data", value_name = "DIR")]
    pub data_dir: PathBuf,
    #[arg(long, env = "KODER_DNS_DNSSEC_KEY", value_name = "FILE")]
    pub dnssec_key: Option<PathBuf>,
    #[arg(long, env = "KODER_DNS_DNSSEC_PUBLISH_KEY", value_name = "FILE")]
    pub dnssec_publish_key: Option<PathBuf>,
    #[arg(long, env = "KODER_DNS_DOMAIN", default_value = "service.koder")]
    pub domain: String,
}

#[derive(Debug, Args)]
pub struct KeygenArgs {
    /// Where to write the key.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

#[derive(Debug, Subcommand)]
pub enum KeysCommand {
    /// Print a new token (first line: give it to the client, nowhere else) and the [[key]]
    /// table for the server's --keys-file (the token's SHA-256, never the token). Writes no file.
    ///
    /// Scopes: admin (every route), read (every GET under /api/v1 and POST /services/drift:
    /// for an edge proxy or a dashboard), register (reads, and register, heartbeat and
    /// deregister of the services named with --service: for a registrant).
    New(KeysNewArgs),
}

#[derive(Debug, Args)]
pub struct KeysNewArgs {
    /// The key's name in logs and error messages (never the secret), e.g. edge or voice-agent.
    #[arg(long)]
    pub id: String,
    /// admin, read or register.
    #[arg(long, value_parser = |s: &str| s.parse::<crate::access::Scope>())]
    pub scope: crate::access::Scope,
    /// A service the register key may change; a trailing * matches any suffix (sip-*).
    /// Repeat for several. Register keys only.
    #[arg(long = "service", value_name = "PATTERN")]
    pub services: Vec<String>,
}

/// The CA option of every client: `https://` URLs whose certificate a private CA signed.
#[derive(Debug, Args, Clone)]
pub struct Trust {
    /// PEM file of CA certificates to trust besides the system's roots, for a registry
    /// serving HTTPS with a certificate from a private CA.
    #[arg(long, env = "KODER_DNS_CA", value_name = "FILE")]
    pub ca: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ConformanceArgs {
    /// Base URL of the producer's REST API.
    #[arg(long, env = "KODER_DNS_URL")]
    pub url: String,
    /// The producer's DNS server; adds the SRV check.
    #[arg(long, value_name = "HOST:PORT")]
    pub dns: Option<SocketAddr>,
    /// The service zone the DNS check queries.
    #[arg(long, default_value = "service.koder")]
    pub domain: String,
    #[command(flatten)]
    pub trust: Trust,
}

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// Base URL of a registry; repeat (or separate with commas) to fail over between nodes.
    #[arg(long, env = "KODER_DNS_URL", value_delimiter = ',', required = true)]
    pub url: Vec<String>,
    /// File holding the API key (first line), read instead of KODER_DNS_API_KEY.
    #[arg(long, env = "KODER_DNS_API_KEY_FILE", value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Service name (one DNS label).
    #[arg(long)]
    pub name: String,
    /// Address of the instance: IPv4, IPv6 or host name.
    #[arg(long)]
    pub address: String,
    /// Port of the instance.
    #[arg(long)]
    pub port: u16,
    /// Protocol [default: the registry's, tcp].
    #[arg(long)]
    pub protocol: Option<String>,
    /// Instance id [default: the registry's, <name>-<address>-<port>].
    #[arg(long)]
    pub id: Option<String>,
    /// A tag; repeat for several.
    #[arg(long = "tag", value_name = "TAG")]
    pub tags: Vec<String>,
    /// Metadata as KEY=VALUE; repeat for several.
    #[arg(long = "meta", value_name = "KEY=VALUE", value_parser = key_value)]
    pub meta: Vec<(String, String)>,
    /// The lease; heartbeats go at a third of it.
    #[arg(long, default_value = "30s", value_parser = crate::model::parse_duration)]
    pub ttl: Duration,
    #[command(flatten)]
    pub trust: Trust,
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

/// How the operator tools reach a running server.
#[derive(Debug, Args)]
pub struct Remote {
    /// Base URL of the server's REST API.
    #[arg(long, env = "KODER_DNS_URL", default_value = "http://127.0.0.1:8053")]
    pub url: String,
    /// The server's data directory, where it keeps the key it generated: read when
    /// KODER_DNS_API_KEY is not set (the API key, never a flag), so on the server's own host no
    /// key is needed.
    #[arg(long, env = "KODER_DNS_DATA_DIR", value_name = "DIR", default_value = "data")]
    pub data_dir: PathBuf,
    #[command(flatten)]
    pub trust: Trust,
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
    let serve = serve_settings(ServeArgs::augment_args(clap::Command::new("serve")));
    let mut settings = String::from("Settings of `koder-dns serve`:\n");
    for arg in serve.get_arguments() {
        let (Some(long), Some(help)) = (arg.get_long(), arg.get_help()) else {
            continue;
        };
        let env = arg
            .get_env()
            .map(|e| e.to_string_lossy().into_owned())
            .unwrap_or_default();
        let flag = if arg.is_hide_set() {
            "(no flag)".to_owned()
        } else {
            format!("--{long}")
        };
        settings.push_str(&format!("  {flag}  ({env})\n          {help}\n"));
    }
    settings.push_str("  (no flag)  (KODER_DNS_API_KEY)\n          API keys, comma-separated\n");
    settings.push_str(&format!(
        "  (no flag)  ({})\n          The --etcd-user's password\n\n",
        crate::cluster::PASSWORD_ENV
    ));
    settings.push_str(
        "Settings come from flags, then KODER_DNS_* environment variables, then the --config file, then defaults.",
    );
    Cli::command()
        .mut_subcommand("serve", serve_settings)
        .after_help(settings)
}

impl Cli {
    pub fn parse_args() -> Self {
        let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
        if let Some(refused) = secret_flag(&args) {
            eprintln!("koder-dns: {refused}");
            std::process::exit(2);
        }
        let args = merge_repeated(args);
        Self::from_arg_matches(&command().get_matches_from(args)).unwrap_or_else(|e| e.exit())
    }
}

/// Flags that would carry a secret, refused before parsing (clap's own error would repeat
/// the value), with where the secret goes instead: a process's arguments are readable by
/// every user of the host (`ps`, `/proc/PID/cmdline`).
const SECRET_FLAGS: &[(&str, &str)] = &[
    ("--api-key", "the environment variable KODER_DNS_API_KEY"),
    ("--etcd-password", "the environment variable KODER_DNS_ETCD_PASSWORD"),
    (
        "--tsig-key",
        "the environment variable KODER_DNS_TSIG_KEYS or the config file's tsig_key",
    ),
];

/// The settings of `serve` that hold a secret: read from the environment and the config file
/// only, so hidden from the flags `--help` lists.
const SECRET_SETTINGS: &[&str] = &["tsig_key"];

/// `serve`'s settings as `--help` shows them: without the secret ones' flags.
fn serve_settings(serve: clap::Command) -> clap::Command {
    SECRET_SETTINGS
        .iter()
        .fold(serve, |serve, id| serve.mut_arg(*id, |arg| arg.hide(true)))
}

/// The error for the first secret-carrying flag in `args` (before a `--`), never quoting its value.
pub fn secret_flag(args: &[std::ffi::OsString]) -> Option<String> {
    args.iter()
        .skip(1)
        .map(|arg| arg.to_string_lossy())
        .take_while(|arg| arg != "--")
        .find_map(|arg| {
            let (flag, env) = SECRET_FLAGS.iter().find(|(flag, _)| {
                arg.strip_prefix(flag)
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('='))
            })?;
            Some(format!(
                "{flag} is not accepted: every user of this host can read a process's arguments; \
                 put the secret in {env} instead"
            ))
        })
}

/// The first key of `KODER_DNS_API_KEY` (comma-separated): where every client takes the key
/// from, never a flag.
fn api_key_from_env() -> Option<String> {
    std::env::var("KODER_DNS_API_KEY")
        .ok()
        .and_then(|keys| split_keys(&keys).into_iter().next())
}

/// Settings that may be given several times, each time adding to the list.
const REPEATABLE: &[&str] = &["--notify"];

/// Folds every `--notify T` (or `--notify=T`) into one comma-separated `--notify=T1,T2`,
/// the form their environment variables and config keys take, so the one parser of each
/// setting reads all three sources.
pub fn merge_repeated(args: impl IntoIterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    let mut lists: Vec<(&str, Vec<String>)> = Vec::new();
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let text = arg.to_string_lossy();
        let found = REPEATABLE.iter().find_map(|flag| {
            if text == *flag {
                Some((*flag, None))
            } else {
                text.strip_prefix(flag)
                    .and_then(|rest| rest.strip_prefix('='))
                    .map(|value| (*flag, Some(value.to_owned())))
            }
        });
        let Some((flag, value)) = found else {
            out.push(arg);
            continue;
        };
        let Some(value) = value.or_else(|| args.next().map(|v| v.to_string_lossy().into_owned())) else {
            // A flag without its value: left for clap to explain.
            out.push(arg);
            continue;
        };
        match lists.iter_mut().find(|(f, _)| *f == flag) {
            Some((_, values)) => values.push(value),
            None => lists.push((flag, vec![value])),
        }
    }
    out.extend(
        lists
            .into_iter()
            .map(|(flag, values)| format!("{flag}={}", values.join(",")).into()),
    );
    out
}

impl Remote {
    /// The first key of `KODER_DNS_API_KEY`, else the one in `<data-dir>/api-key`.
    fn key(&self) -> anyhow::Result<String> {
        if let Some(key) = api_key_from_env() {
            return Ok(key);
        }
        let path = crate::api::auth::key_path(&self.data_dir);
        match std::fs::read_to_string(&path) {
            Ok(key) if !key.trim().is_empty() => Ok(key.trim().to_owned()),
            _ => anyhow::bail!(
                "no API key: set KODER_DNS_API_KEY, or give --data-dir of a server that \
                 generated {} (cannot read {})",
                path.file_name().unwrap_or_default().to_string_lossy(),
                path.display()
            ),
        }
    }

    async fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<String>,
    ) -> anyhow::Result<reqwest::Response> {
        let url = format!("{}/api/v1{path}", self.url.trim_end_matches('/'));
        let key = self.key()?;
        let client = crate::tls::trusting(crate::tls::client_builder(), self.trust.ca.as_deref())?.build()?;
        let mut request = client.request(method, &url).header("X-API-Key", key);
        if let Some(body) = body {
            request = request.body(body);
        }
        let response = request
            .send()
            .await
            .map_err(|e| anyhow::anyhow!("cannot reach {url}: {e} (is `koder-dns serve` running there? see --url)"))?;
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
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(f)
}

/// `koder-dns migrate --to-etcd`: exit 0 copied, 1 refused or failed, 2 bad arguments (etcd
/// refusing the TLS files, the user or the role included).
pub fn migrate(args: crate::cluster::MigrateArgs) -> std::process::ExitCode {
    #[cfg(feature = "etcd")]
    {
        let connection = match args.connection() {
            Ok(connection) => connection,
            Err(e) => {
                eprintln!("koder-dns migrate: {e}");
                return std::process::ExitCode::from(2);
            }
        };
        let copied = block_on(crate::store::etcd::migrate(
            &args.data_dir,
            &connection,
            &args.etcd_prefix,
            args.force,
        ));
        match copied {
            Ok(copied) => {
                println!("copied {copied} instances into etcd under {}", args.etcd_prefix);
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("koder-dns migrate: {e:#}");
                // etcd refusing the certificate, the user or the role is a bad argument too.
                let refused = e.is::<crate::store::Refused>() || e.is::<crate::tls::FileError>();
                std::process::ExitCode::from(if refused { 2 } else { 1 })
            }
        }
    }
    #[cfg(not(feature = "etcd"))]
    {
        let _ = args;
        eprintln!("koder-dns migrate: {}", crate::cluster::NO_ETCD);
        std::process::ExitCode::from(1)
    }
}

/// `koder-dns export`: exit 0 written, 2 error.
pub fn export(args: ExportArgs) -> std::process::ExitCode {
    let result = block_on(async {
        let text = args
            .remote
            .request(reqwest::Method::GET, "/services/export", None)
            .await?
            .text()
            .await?;
        if args.output.as_os_str() == "-" {
            print!("{text}");
        } else {
            std::fs::write(&args.output, text)
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", args.output.display()))?;
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
        crate::export::PortsFile::parse(&reference)
            .map_err(|e| anyhow::anyhow!("{}: {e}", args.reference.display()))?;
        let report: crate::export::drift::DriftReport = args
            .remote
            .request(reqwest::Method::POST, "/services/drift", Some(reference))
            .await?
            .json()
            .await?;
        anyhow::Ok(report)
    });
    match result {
        Ok(report) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&report).expect("a report serialises")
                );
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

/// `koder-dns agent`: exit 0 after a clean shutdown, 2 when it cannot run (no key, refused
/// key, invalid registration).
pub fn agent(args: AgentArgs) -> std::process::ExitCode {
    crate::server::init_logging(crate::config::LogFormat::Text);
    let result = block_on(async {
        let key = match &args.api_key_file {
            Some(path) => std::fs::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("cannot read the API key file {}: {e}", path.display()))?
                .lines()
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned(),
            None => api_key_from_env().unwrap_or_default(),
        };
        anyhow::ensure!(!key.is_empty(), "no API key: set KODER_DNS_API_KEY or --api-key-file");
        let client = crate::client::Client::with_ca(args.url, key, Duration::from_secs(10), args.trust.ca.as_deref())?;
        let registration = crate::client::Instance {
            id: args.id.unwrap_or_default().into(),
            name: args.name.into(),
            address: args.address.parse().map_err(|e| anyhow::anyhow!("--address: {e}"))?,
            port: args.port,
            protocol: args.protocol.unwrap_or_default().into(),
            tags: args.tags,
            metadata: args.meta.into_iter().collect(),
            ..Default::default()
        };
        let registrant = crate::client::Registrant::new(std::sync::Arc::new(client), registration, args.ttl);
        // Handlers installed before the first request, so an early SIGTERM still deregisters.
        let signal = tokio::spawn(crate::server::wait_for_signal());
        tokio::task::yield_now().await;
        registrant
            .run(async {
                let _ = signal.await;
            })
            .await?;
        anyhow::Ok(())
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("koder-dns agent: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

/// `koder-dns keys new`: exit 0 printed, 2 bad arguments.
pub fn keys(command: KeysCommand) -> std::process::ExitCode {
    let KeysCommand::New(args) = command;
    let made = (|| {
        let id = args.id.trim();
        anyhow::ensure!(
            !id.is_empty() && id.len() <= 64 && !id.chars().any(char::is_control),
            "--id: 1-64 printable characters"
        );
        let services = args
            .services
            .iter()
            .map(|p| crate::access::Pattern::parse(p).map_err(|e| anyhow::anyhow!("--service: {e}")))
            .collect::<anyhow::Result<Vec<_>>>()?;
        match args.scope {
            crate::access::Scope::Register => anyhow::ensure!(
                !services.is_empty(),
                "a register key needs at least one --service (a name, or a prefix ending in *)"
            ),
            scope => anyhow::ensure!(
                services.is_empty(),
                "--service belongs to register keys only (this one is {})",
                scope.as_str()
            ),
        }
        let token = crate::access::new_token()?;
        let entry = crate::access::file_entry(id, &token, args.scope, &services);
        anyhow::Ok(format!("{token}\n{entry}"))
    })();
    match made {
        Ok(text) => {
            print!("{text}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("koder-dns keys new: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

/// `koder-dns dnssec ...`: exit 0 printed or written, 2 no key or a bad one.
pub fn dnssec(command: DnssecCommand) -> std::process::ExitCode {
    let done = (|| match command {
        DnssecCommand::Keygen(args) => {
            crate::keystore::write_new_key(&args.out)?;
            eprintln!("koder-dns dnssec keygen: wrote {} (mode 0600)", args.out.display());
            anyhow::Ok(String::new())
        }
        DnssecCommand::Ds(args) => {
            let (zone, key) = dnssec_key(&args)?;
            Ok(format!("{zone} IN DS {}\n", key.ds(&zone)?))
        }
        DnssecCommand::Dnskey(args) => {
            let (zone, key) = dnssec_key(&args)?;
            Ok(key
                .published()
                .iter()
                .map(|k| format!("{zone} IN DNSKEY {k}\n"))
                .collect())
        }
    })();
    match done {
        Ok(text) => {
            print!("{text}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("koder-dns dnssec: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

/// The zone and the key `serve --dnssec` would sign it with; never generates one.
fn dnssec_key(args: &DnssecArgs) -> anyhow::Result<(hickory_proto::rr::Name, crate::keystore::ZoneKey)> {
    let zone = crate::zone::records::ZoneNames::new(&args.domain).map_err(|e| anyhow::anyhow!("--domain: {e}"))?;
    let source = crate::keystore::KeySource {
        data_dir: args.data_dir.clone(),
        key: args.dnssec_key.clone(),
        publish: args.dnssec_publish_key.clone(),
    };
    let key = crate::keystore::ZoneKey::load(&source, false);
    // Without --dnssec-key the only failure worth telling apart is "no key yet".
    let key = match &args.dnssec_key {
        Some(_) => key?,
        None => key.map_err(|e| {
            e.context("start `koder-dns serve --dnssec` once with this --data-dir, or give --dnssec-key")
        })?,
    };
    Ok((zone.origin, key))
}

/// `koder-dns conformance`: exit 0 all pass, 1 any failed, 2 could not run.
pub fn conformance(args: ConformanceArgs) -> std::process::ExitCode {
    let Some(key) = api_key_from_env() else {
        eprintln!("koder-dns conformance: no API key: set KODER_DNS_API_KEY");
        return std::process::ExitCode::from(2);
    };
    let http = match crate::tls::trusting(crate::tls::client_builder(), args.trust.ca.as_deref()) {
        Ok(http) => http,
        Err(e) => {
            eprintln!("koder-dns conformance: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    match block_on(crate::client::conformance::run(
        http,
        &args.url,
        &key,
        args.dns,
        &args.domain,
    )) {
        Ok(checks) => {
            for check in &checks {
                let verdict = if check.pass { "PASS" } else { "FAIL" };
                println!("{verdict} {} {}: {}", check.rule, check.what, check.detail);
            }
            let failed = checks.iter().filter(|c| !c.pass).count();
            println!("{} checks, {failed} failed", checks.len());
            std::process::ExitCode::from(if failed == 0 { 0 } else { 1 })
        }
        Err(e) => {
            eprintln!("koder-dns conformance: {e}");
            std::process::ExitCode::from(2)
        }
    }
}

#[cfg(test)]
mod secret_flags {
    use super::secret_flag;

    fn refused(list: &[&str]) -> Option<String> {
        secret_flag(&list.iter().map(|s| s.into()).collect::<Vec<_>>())
    }

    #[test]
    fn a_secret_on_the_command_line_is_refused_naming_the_variable_without_repeating_it() {
        for args in [
            &["koder-dns", "export", "--api-key", "s3cret"][..],
            &["koder-dns", "drift", "--url", "http://x", "--api-key=s3cret"],
        ] {
            let e = refused(args).expect("refused");
            assert!(e.contains("--api-key") && e.contains("KODER_DNS_API_KEY"), "{e}");
            assert!(!e.contains("s3cret"), "{e}");
        }
        let e = refused(&["koder-dns", "serve", "--etcd-password", "s3cret"]).unwrap();
        assert!(e.contains("KODER_DNS_ETCD_PASSWORD") && !e.contains("s3cret"), "{e}");
        let e = refused(&["koder-dns", "serve", "--tsig-key=t.:hmac-sha256:czNjcmV0"]).unwrap();
        assert!(e.contains("KODER_DNS_TSIG_KEYS") && !e.contains("czNjcmV0"), "{e}");
        // The key file is no secret on the command line, nor is a value after `--`.
        assert_eq!(refused(&["koder-dns", "agent", "--api-key-file", "/etc/k"]), None);
        assert_eq!(refused(&["koder-dns", "agent", "--", "--api-key"]), None);
    }
}

#[cfg(test)]
mod repeated_flags {
    use super::merge_repeated;

    fn args(list: &[&str]) -> Vec<String> {
        merge_repeated(list.iter().map(|s| s.into()))
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect()
    }

    #[test]
    fn repeated_notify_targets_are_folded_into_one_list() {
        assert_eq!(
            args(&[
                "koder-dns",
                "serve",
                "--notify=127.0.0.1:53",
                "--dns-ttl",
                "5s",
                "--notify",
                "127.0.0.1:54"
            ]),
            [
                "koder-dns",
                "serve",
                "--dns-ttl",
                "5s",
                "--notify=127.0.0.1:53,127.0.0.1:54",
            ]
        );
        // A flag missing its value is left for clap to explain.
        assert_eq!(
            args(&["koder-dns", "serve", "--notify"]),
            ["koder-dns", "serve", "--notify"]
        );
    }
}
