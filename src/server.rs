//! Wiring: one process, one registry, served over DNS and REST, kept true by the reaper.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::gauge::ConstGauge;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::access::Access;
use crate::api::{self, AppState};
use crate::config::{Config, LogFormat, ServeArgs};
use crate::dns::{self, Authority, answer::ZoneAnswerer};
use crate::health;
use crate::model::clock::{Clock, SystemClock};
use crate::registry::{self, Registry, Settings};
use crate::reload::{self, Reloader};
use crate::store::{self, Store};
use crate::tls::ServerCert;
use crate::zone::records::{SoaTimers, ZoneNames};

/// Opens the store `--store` names: redb under `--data-dir` (see [`store::redb`]), or etcd.
async fn open_store(config: &Config, registry: &Arc<Registry>) -> anyhow::Result<Store> {
    if config.store == crate::cluster::StoreKind::Etcd {
        return open_etcd(config, registry).await;
    }
    let redb = store::redb::Redb::open(&config.data_dir, config.persist_interval, registry).await?;
    Ok(Store::new(registry.clone(), Arc::new(redb)))
}

/// `--store etcd`: the registry is loaded from etcd and follows it (see [`store::etcd`]).
#[cfg(feature = "etcd")]
async fn open_etcd(config: &Config, registry: &Arc<Registry>) -> anyhow::Result<Store> {
    let node_id = match config.node_id.as_str() {
        // Port 0 is picked at bind, after this: the process id tells such nodes apart.
        "auto" if config.http_listen.port() == 0 => format!("{}:0-{}", dns::host_name(), std::process::id()),
        "auto" => format!("{}:{}", dns::host_name(), config.http_listen.port()),
        id => id.to_owned(),
    };
    let settings = store::etcd::Settings {
        connection: config.etcd_connection()?,
        prefix: config.etcd_prefix.clone(),
        node_id,
        reaper_interval: config.reaper_interval,
    };
    // etcd refusing this node (its certificate, the client certificate, the user, the role)
    // is a setting to fix, like an unreadable file: exit 2.
    let etcd = store::etcd::Etcd::open(settings, registry.clone()).await.map_err(|e| {
        if e.chain().any(|cause| cause.is::<store::Refused>()) || e.is::<crate::tls::FileError>() {
            bad_setting(e)
        } else {
            e
        }
    })?;
    Ok(Store::new(registry.clone(), etcd))
}

#[cfg(not(feature = "etcd"))]
async fn open_etcd(_: &Config, _: &Arc<Registry>) -> anyhow::Result<Store> {
    anyhow::bail!("--store etcd: {}", crate::cluster::NO_ETCD)
}

/// With `--dnssec`, the signer of the service zone and its key (see [`crate::keystore`]): a
/// node on etcd must be given the key (`--dnssec-key`), since every node signs with one.
fn signer(config: &Config) -> anyhow::Result<Option<Arc<crate::sign::Signer>>> {
    if !config.dnssec {
        return Ok(None);
    }
    let source = crate::keystore::KeySource {
        data_dir: config.data_dir.clone(),
        key: config.dnssec_key.clone(),
        publish: config.dnssec_publish_key.clone(),
    };
    if config.store == crate::cluster::StoreKind::Etcd && config.dnssec_key.is_none() {
        anyhow::bail!(
            "--dnssec with --store etcd needs --dnssec-key: every node must sign with the same key, which \
             one node cannot generate for the others (make one with `koder-dns dnssec keygen --out FILE` \
             and give it to every node)"
        );
    }
    let key = crate::keystore::ZoneKey::load(&source, true)?;
    let zone = ZoneNames::new(&config.domain).map_err(|e| anyhow::anyhow!("--domain: {e}"))?;
    info!(key_tag = key.key_tag(), zone = %zone.origin, "signing the service zone (DNSSEC)");
    Ok(Some(Arc::new(crate::sign::Signer::new(
        key,
        zone.origin,
        config.dns_ttl.as_secs() as u32,
    ))))
}

/// How often a signed zone checks whether the signatures its secondaries hold are due to be
/// made again: a day before they expire, so hourly is ample.
const SIGNATURE_CHECK: Duration = Duration::from_secs(3600);

async fn refresh_once(authority: &Authority, store: &Store) -> bool {
    if !authority.signatures_due() {
        return false;
    }
    match store.touch().await {
        Ok(()) => {
            info!("signatures sent to secondaries are a day from expiring: a new serial carries new ones");
            true
        }
        Err(e) => {
            warn!(error = %e, "could not move the revision to refresh the secondaries' signatures; trying again later");
            false
        }
    }
}

/// See [`Running::refresh_signatures`].
async fn refresh_signatures(authority: Authority, store: Arc<Store>, shutdown: CancellationToken) {
    let mut every = tokio::time::interval(SIGNATURE_CHECK);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = every.tick() => {
                refresh_once(&authority, &store).await;
            }
        }
    }
}

/// A started server.
pub struct Running {
    pub dns_addr: SocketAddr,
    pub http_addr: SocketAddr,
    /// `--dot-listen`'s address, when DNS over TLS is served.
    pub dot_addr: Option<SocketAddr>,
    pub registry: Arc<Registry>,
    store: Arc<Store>,
    authority: Authority,
    reloader: Arc<Reloader>,
    shutdown: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

/// A setting that keeps the server from starting (exit 2, as a bad flag): a keys file or a
/// TLS file that cannot be read, or does not parse, or does not match.
#[derive(Debug, thiserror::Error)]
#[error("{0:#}")]
pub struct BadSetting(anyhow::Error);

fn bad_setting(e: impl Into<anyhow::Error>) -> anyhow::Error {
    BadSetting(e.into()).into()
}

impl Running {
    /// What SIGHUP does: re-reads the keys, the certificate, the zones and the TSIG keys (see
    /// [`crate::reload`]). An error, logged too, when nothing was changed.
    pub async fn reload(&self) -> anyhow::Result<()> {
        self.reloader.reload().await
    }

    /// In a signed zone, moves the revision when signatures sent to secondaries are to be
    /// made again, so that the next transfer carries new ones; true when it did. The server
    /// does it every [`SIGNATURE_CHECK`]; tests on a manual clock call it.
    pub async fn refresh_signatures(&self) -> bool {
        refresh_once(&self.authority, &self.store).await
    }

    /// Stops accepting and answers held blocking queries at once; [`Self::shutdown`] then
    /// waits for the rest and flushes.
    pub fn begin_shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Stops accepting, lets in-flight requests finish, flushes durable state. An error
    /// when the final flush failed.
    pub async fn shutdown(mut self) -> Result<(), String> {
        self.begin_shutdown();
        for task in std::mem::take(&mut self.tasks) {
            let _ = task.await;
        }
        self.store.close().await
    }
}

/// A server dropped without [`Running::shutdown`] still stops: its UDP workers are threads
/// that outlive the runtime, and their `SO_REUSEPORT` sockets would otherwise stay bound, so
/// a later server on the same port would share its queries with a dead registry's answers.
impl Drop for Running {
    fn drop(&mut self) {
        self.begin_shutdown();
    }
}

pub async fn start(config: Config) -> anyhow::Result<Running> {
    start_with_clock(config, Arc::new(SystemClock)).await
}

pub async fn start_with_clock(config: Config, clock: Arc<dyn Clock>) -> anyhow::Result<Running> {
    start_from(config, None, clock).await
}

/// [`start`], remembering the flags and environment it was given (`args`) so that a reload
/// reads the config file again under them.
pub async fn start_from(config: Config, args: Option<ServeArgs>, clock: Arc<dyn Clock>) -> anyhow::Result<Running> {
    crate::tls::install_provider();
    let (keys, generated) = reload::keys(&config).map_err(bad_setting)?;
    if let Some(path) = generated {
        warn!(path = %path.display(), "no API key configured; generated an admin key (set KODER_DNS_API_KEY or --keys-file to choose your own)");
    }
    info!(keys = keys.len(), keys_file = ?config.keys_file, "API keys loaded");
    let access = Arc::new(Access::new(keys));
    let cert = reload::credentials(&config).map_err(bad_setting)?.map(|credentials| {
        info!(serial = %credentials.serial, not_after = credentials.not_after, "TLS certificate in force");
        ServerCert::new(credentials)
    });
    let mut zone = ZoneNames::new(&config.domain).map_err(|e| anyhow::anyhow!("--domain: {e}"))?;
    zone.timers = SoaTimers {
        refresh: config.soa_refresh.as_secs() as u32,
        retry: config.soa_retry.as_secs() as u32,
        expire: config.soa_expire.as_secs() as u32,
    };
    let static_zones = dns::zones::load(&config.zones_dir, &zone.origin)?;
    let settings = Settings {
        default_ttl: config.default_ttl.as_nanos() as i64,
        max_instances: config.max_instances,
        default_check: config.default_check,
        zone,
    };
    let signer = signer(&config).map_err(bad_setting)?;
    let registry = Arc::new(Registry::new(settings, clock));
    let health_events = registry.subscribe_lifecycle();
    let store = Arc::new(open_store(&config, &registry).await?);
    let shutdown = CancellationToken::new();
    let mut tasks = Vec::new();

    let (udp, tcp) = dns::bind(config.dns_listen, config.dns_udp_workers)
        .await
        .with_context(|| format!("cannot listen for DNS on {} (--dns-listen)", config.dns_listen))?;
    let dns_addr = tcp.local_addr()?;
    let answerer = ZoneAnswerer {
        host_addresses: Default::default(),
        registry: registry.clone(),
        dns_ttl: config.dns_ttl.as_secs() as u32,
        negative_ttl: config.negative_ttl.as_secs() as u32,
        ns_address: dns::ns_address(dns_addr),
        signer,
    };
    let cookies = match &config.dns_cookie_secret_file {
        Some(path) => dns::cookie::Secrets::load(path).map_err(|e| anyhow::anyhow!("--dns-cookie-secret-file: {e}"))?,
        None => dns::cookie::Secrets::default(),
    };
    let wire = dns::WireSettings {
        cookies: arc_swap::ArcSwap::from_pointee(cookies),
        hide_version: config.dns_hide_version,
        rrl: dns::rrl::Settings {
            rate: config.dns_rrl_rate,
            slip: config.dns_rrl_slip,
            exempt: config.dns_rrl_exempt.clone(),
        },
        udp_max_payload: config.dns_udp_max_payload,
        identity: config.dns_identity.clone(),
        transfer: dns::transfer::TransferSettings {
            allow: config.allow_transfer.clone(),
            journal: dns::journal::Limits {
                max_changes: config.journal_max_changes,
                max_bytes: config.journal_max_bytes,
            },
        },
    };
    let authority = Authority::new(answerer, static_zones, wire);
    authority.replace_tsig_keys(config.tsig_key.clone());
    let reloader = Arc::new(Reloader::new(
        args,
        config.clone(),
        access.clone(),
        cert.clone(),
        authority.clone(),
    ));
    tasks.push(dns::udp::spawn(udp, authority.clone(), shutdown.clone())?);
    tasks.push(tokio::spawn(dns::notify::run(
        registry.clone(),
        authority.clone(),
        config.notify.clone(),
        shutdown.clone(),
    )));
    let dns_limits = || dns::tcp::Limits {
        max_connections: config.dns_tcp_max_connections,
        idle_timeout: config.dns_tcp_idle_timeout,
    };
    let mut dot_addr = None;
    if let (Some(addr), Some(cert)) = (config.dot_listen, &cert) {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen for DNS over TLS on {addr} (--dot-listen)"))?;
        dot_addr = Some(listener.local_addr()?);
        let tls = cert.server_config(&[dns::tcp::DOT_ALPN]);
        tasks.push(tokio::spawn(dns::tcp::serve(
            listener,
            authority.clone(),
            dns_limits(),
            Some(tls),
            shutdown.clone(),
        )));
    }
    tasks.push(tokio::spawn(dns::tcp::serve(
        tcp,
        authority.clone(),
        dns_limits(),
        None,
        shutdown.clone(),
    )));

    let http = tokio::net::TcpListener::bind(config.http_listen)
        .await
        .with_context(|| format!("cannot listen for HTTP on {} (--http-listen)", config.http_listen))?;
    let http_addr = http.local_addr()?;
    let metrics = Arc::new(crate::metrics::Exposition::new(vec![
        Box::new(RegistryCollector(registry.clone())),
        Box::new(reload::Metrics(reloader.clone())),
    ]));
    if let Some(addr) = config.metrics_listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen for metrics on {addr} (--metrics-listen)"))?;
        info!(metrics = %listener.local_addr()?, "metrics on their own address");
        let router = axum::Router::new()
            .route("/metrics", axum::routing::get(api::metrics))
            .with_state(metrics.clone());
        let limits = api::serve::Limits {
            max_connections: 16,
            max_connections_per_client: 16,
            header_timeout: config.http_request_timeout,
        };
        // Plain HTTP, for a Prometheus on a management network without a private CA.
        tasks.push(tokio::spawn(api::serve::serve(
            listener,
            router,
            limits,
            None,
            shutdown.clone(),
        )));
    }
    let state = AppState::new(api::Shared {
        store: store.clone(),
        ui: api::ui_page(config.default_ttl),
        watches: api::watch::Watches::new(config.watch_max, shutdown.clone()),
        drift_reference: config.drift_reference.clone(),
        metrics,
        access,
        ttl_bounds: api::TtlBounds {
            min: config.min_ttl,
            max: config.max_ttl,
        },
    });
    let router = api::router(state, config.http_request_timeout, config.metrics_listen.is_none());
    let limits = api::serve::Limits {
        max_connections: config.http_max_connections,
        max_connections_per_client: config.http_max_connections_per_client,
        header_timeout: config.http_request_timeout,
    };
    let https = cert.as_ref().map(|cert| cert.server_config(&[api::serve::HTTPS_ALPN]));
    tasks.push(tokio::spawn(api::serve::serve(
        http,
        router,
        limits,
        https,
        shutdown.clone(),
    )));

    tasks.push(tokio::spawn(registry::reaper::run(
        registry.clone(),
        config.reaper_interval,
        shutdown.clone(),
    )));
    let health = health::Settings {
        default_check: config.default_check,
        fall: config.check_fall,
        rise: config.check_rise,
        concurrency: config.check_concurrency,
    };
    tasks.push(tokio::spawn(health::run(
        store.clone(),
        health_events,
        health,
        shutdown.clone(),
    )));
    if config.dnssec {
        tasks.push(tokio::spawn(refresh_signatures(
            authority.clone(),
            store.clone(),
            shutdown.clone(),
        )));
    }

    let dot = dot_addr.map(|a| a.to_string()).unwrap_or_else(|| "off".into());
    info!(dns = %dns_addr, http = %http_addr, https = cert.is_some(), dot = %dot, zone = %registry.zone().origin,
          default_ttl_s = config.default_ttl.as_secs_f64(), "koder-dns listening");
    Ok(Running {
        dns_addr,
        http_addr,
        dot_addr,
        registry,
        store,
        authority,
        reloader,
        shutdown,
        tasks,
    })
}

pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    // hickory logs two INFO lines per query; that costs a third of the throughput.
    let filter = EnvFilter::try_from_env("KODER_DNS_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new("info,hickory_server=warn,hickory_proto=warn,hickory_net=warn"));
    // Colours only for a person at a terminal, never into log files.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs.with_ansi(ansi).init(),
        LogFormat::Json => logs.json().init(),
    }
}

/// `koder-dns serve`.
pub fn main(args: ServeArgs) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    // SIGHUP's default action ends the process: listen for it before reading anything, so that
    // a `systemctl reload` during the start is a reload too.
    let mut signals = {
        let _runtime = runtime.enter();
        Signals::listen()
    };
    let reread = args.clone();
    let config = match args.into_config() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("koder-dns: {e:#}");
            return ExitCode::from(2);
        }
    };
    init_logging(config.log_format);
    runtime.block_on(async {
        let running = match start_from(config, Some(reread), Arc::new(SystemClock)).await {
            Ok(running) => running,
            Err(e) => {
                eprintln!("koder-dns: {e:#}");
                return ExitCode::from(if e.is::<BadSetting>() { 2 } else { 1 });
            }
        };
        while let Received::Reload = signals.next().await {
            // Logged by the reload itself; a failed one changes nothing.
            let _ = running.reload().await;
        }
        info!("shutting down");
        match tokio::time::timeout(Duration::from_secs(10), running.shutdown()).await {
            Ok(Ok(())) => {
                info!("stopped");
                ExitCode::SUCCESS
            }
            Ok(Err(e)) => {
                error!(error = %e, "stopped without writing the registry to disk");
                ExitCode::from(1)
            }
            Err(_) => {
                error!("in-flight work did not finish within 10s; exiting without a final flush");
                ExitCode::from(1)
            }
        }
    })
}

/// What the server is told by signal.
enum Received {
    /// SIGHUP: re-read the keys, the certificate, the zones, the TSIG keys.
    Reload,
    /// SIGTERM or Ctrl-C.
    Stop,
}

/// The signals `serve` acts on, listened for from the moment this is made.
struct Signals {
    #[cfg(unix)]
    hangup: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    /// Inside a runtime. From here on SIGHUP no longer ends the process.
    fn listen() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Self {
                hangup: signal(SignalKind::hangup()).expect("SIGHUP handler"),
                terminate: signal(SignalKind::terminate()).expect("SIGTERM handler"),
            }
        }
        #[cfg(not(unix))]
        Self {}
    }

    async fn next(&mut self) -> Received {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.hangup.recv() => Received::Reload,
                _ = self.terminate.recv() => Received::Stop,
                _ = tokio::signal::ctrl_c() => Received::Stop,
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            Received::Stop
        }
    }
}

/// SIGTERM or Ctrl-C.
pub async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// The registry's state for `/metrics`, read at scrape time: instances by service and
/// health, and the SOA serial.
struct RegistryCollector(Arc<Registry>);

impl std::fmt::Debug for RegistryCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RegistryCollector")
    }
}

impl Collector for RegistryCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let counts = self.0.instance_counts();
        let mut family = encoder.encode_descriptor(
            "instances",
            "Live instances by service and health (healthy ones are in DNS answers)",
            None,
            MetricType::Gauge,
        )?;
        for (service, healthy, unhealthy) in &counts {
            for (state, n) in [("healthy", healthy), ("unhealthy", unhealthy)] {
                let labels = [("service", service.as_str()), ("health", state)];
                ConstGauge::new(*n as i64).encode(family.encode_family(&labels)?)?;
            }
        }
        let family = encoder.encode_descriptor(
            "soa_serial",
            "The service zone's SOA serial: grows with every change readers can see",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(i64::from(self.0.serial())).encode(family)?;
        Ok(())
    }
}
