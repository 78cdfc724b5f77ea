//! Prometheus metrics (`GET /metrics`, names `koder_dns_*`), with `prometheus-client`.
//!
//! The counters are process-wide ([`get`]): the places that count (REST handlers, the
//! reaper, the health checker, the store, the DNS loops) call a small function here and know
//! nothing of Prometheus. Each server builds its own [`Exposition`] around them, which adds
//! what is read from its registry at scrape time (instances by service and health).
//!
//! DNS is the hot path (about 6.5 µs of CPU per query, most of it in the kernel): each
//! thread that answers counts into its own block of plain counters, written only by that
//! thread (a relaxed load and store, no read-modify-write, no lock, no allocation), and a
//! scrape sums the blocks. Families with a lock per update (`Family`) are kept to REST,
//! checks and commits, which cost milliseconds anyway.

use std::cell::OnceCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry as Prometheus;

type Labels2 = [(&'static str, &'static str); 2];
type Labels1 = [(&'static str, &'static str); 1];
type RouteLabel = [(&'static str, &'static str); 1];

/// One REST request's labels: nothing allocated to count it.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct RequestLabels {
    route: &'static str,
    method: &'static str,
    status: u16,
}

fn histogram() -> Histogram {
    // 100 µs .. ~6.5 s, doubling.
    Histogram::new(exponential_buckets(0.0001, 2.0, 17))
}

/// The process-wide counters.
pub struct Metrics {
    registrations: Family<Labels2, Counter>,
    heartbeats: Family<Labels1, Counter>,
    deregistrations: Family<Labels1, Counter>,
    expiries: Counter,
    health_checks: Family<Labels1, Counter>,
    health_check_seconds: Histogram,
    health_checks_running: Gauge,
    http_requests: Family<RequestLabels, Counter>,
    http_request_seconds: Family<RouteLabel, Histogram, fn() -> Histogram>,
    store_commits: Family<Labels1, Counter>,
    store_commit_seconds: Histogram,
    watches_held: Gauge,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| Metrics {
    registrations: Family::default(),
    heartbeats: Family::default(),
    deregistrations: Family::default(),
    expiries: Counter::default(),
    health_checks: Family::default(),
    health_check_seconds: histogram(),
    health_checks_running: Gauge::default(),
    http_requests: Family::default(),
    http_request_seconds: Family::new_with_constructor(histogram),
    store_commits: Family::default(),
    store_commit_seconds: histogram(),
    watches_held: Gauge::default(),
});

/// The process-wide counters.
pub fn get() -> &'static Metrics {
    &METRICS
}

/// How a registration ended: `created`, `refreshed`, or `refused` for a `reason`
/// (`invalid`, `full`, `unavailable`).
pub fn registration(outcome: &'static str, reason: &'static str) {
    get()
        .registrations
        .get_or_create(&[("outcome", outcome), ("reason", reason)])
        .inc();
}

/// `ok` or `gone` (410).
pub fn heartbeat(outcome: &'static str) {
    get().heartbeats.get_or_create(&[("outcome", outcome)]).inc();
}

/// `ok`, `not_found` or `unavailable`.
pub fn deregistration(outcome: &'static str) {
    get().deregistrations.get_or_create(&[("outcome", outcome)]).inc();
}

/// An instance removed because its lease ran out.
pub fn expiry() {
    get().expiries.inc();
}

/// One probe: `pass` or `fail`, and how long it took.
pub fn health_check(passed: bool, took: Duration) {
    let m = get();
    m.health_checks
        .get_or_create(&[("result", if passed { "pass" } else { "fail" })])
        .inc();
    m.health_check_seconds.observe(took.as_secs_f64());
}

/// How many instances this node checks now (on etcd: its share of the checked ones).
pub fn health_checks_running(n: usize) {
    get().health_checks_running.set(n as i64);
}

/// The request counters of one route pattern (not the raw path, so ids make no new
/// series), resolved when the router is built. A heartbeat costs about 12 µs of CPU; counting
/// it with labels built per request (five small strings, two family lookups) cost ~1 µs of
/// that, measured A/B with `benches/rest-load.sh`.
#[derive(Clone)]
pub struct RouteCounters {
    route: &'static str,
    seconds: Histogram,
}

impl RouteCounters {
    pub fn new(route: &'static str) -> Self {
        let seconds = get().http_request_seconds.get_or_create(&[("route", route)]).clone();
        Self { route, seconds }
    }

    /// One request: its method, status and latency.
    pub fn record(&self, method: &'static str, status: u16, took: Duration) {
        let labels = RequestLabels {
            route: self.route,
            method,
            status,
        };
        get().http_requests.get_or_create(&labels).inc();
        self.seconds.observe(took.as_secs_f64());
    }
}

/// A blocking query starts (`true`) or ends (`false`) being held.
pub fn watch_held(held: bool) {
    if held {
        get().watches_held.inc();
    } else {
        get().watches_held.dec();
    }
}

/// One store commit (a batch of registrations, removals and renewals).
pub fn store_commit(ok: bool, took: Duration) {
    let m = get();
    m.store_commits
        .get_or_create(&[("result", if ok { "ok" } else { "failed" })])
        .inc();
    m.store_commit_seconds.observe(took.as_secs_f64());
}

// ---------------------------------------------------------------------------------------
// DNS: per-thread counters.

/// The query types counted by name; the rest are `other`.
const QTYPES: [(u16, &str); 13] = [
    (1, "A"),
    (28, "AAAA"),
    (33, "SRV"),
    (16, "TXT"),
    (6, "SOA"),
    (2, "NS"),
    (5, "CNAME"),
    (12, "PTR"),
    (15, "MX"),
    (255, "ANY"),
    (252, "AXFR"),
    (251, "IXFR"),
    (0, "other"),
];
/// RCODEs 0..=9 by name (the header's four bits); anything else is `other`.
const RCODES: [&str; 11] = [
    "NOERROR", "FORMERR", "SERVFAIL", "NXDOMAIN", "NOTIMP", "REFUSED", "YXDOMAIN", "YXRRSET", "NXRRSET", "NOTAUTH",
    "other",
];

/// Over which transport a reply went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Udp = 0,
    Tcp = 1,
    /// DNS over TLS (`--dot-listen`).
    Tls = 2,
}

const TRANSPORTS: [&str; 3] = ["udp", "tcp", "tls"];

/// One thread's DNS counters, written by that thread only.
#[derive(Debug)]
struct DnsBlock {
    replies: [[[AtomicU64; RCODES.len()]; QTYPES.len()]; TRANSPORTS.len()],
    truncated: [AtomicU64; TRANSPORTS.len()],
    /// Responses over the rate: dropped, slipped.
    rate_limited: [AtomicU64; 2],
}

impl DnsBlock {
    fn new() -> Self {
        Self {
            replies: std::array::from_fn(|_| std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0)))),
            truncated: std::array::from_fn(|_| AtomicU64::new(0)),
            rate_limited: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

/// Every thread's block, for the scrape to sum. Threads come and go with the runtime; a
/// block outlives its thread so that no count is lost.
static DNS_BLOCKS: Mutex<Vec<Arc<DnsBlock>>> = Mutex::new(Vec::new());

thread_local! {
    static DNS_BLOCK: OnceCell<Arc<DnsBlock>> = const { OnceCell::new() };
}

/// Only this thread writes the counter, so load + store is an exact increment without the
/// cost of a locked read-modify-write; the scrape's loads may be a moment behind.
fn bump(counter: &AtomicU64) {
    counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
}

/// Counts one DNS reply from its wire form: the question's type, the RCODE and TC.
pub fn dns_reply(transport: Transport, reply: &[u8]) {
    if reply.len() < 12 {
        return;
    }
    let rcode = usize::from(reply[3] & 0x0f).min(RCODES.len() - 1);
    let truncated = reply[2] & 0x02 != 0;
    let qtype = question_type(reply).unwrap_or(0);
    let q = QTYPES.iter().position(|&(t, _)| t == qtype).unwrap_or(QTYPES.len() - 1);
    with_dns_block(|block| {
        bump(&block.replies[transport as usize][q][rcode]);
        if truncated {
            bump(&block.truncated[transport as usize]);
        }
    });
}

/// Counts one UDP response over `--dns-rrl-rate`: dropped, or `slipped` (an empty TC
/// reply went instead). Neither counts as a query answered.
pub fn rate_limited(slipped: bool) {
    with_dns_block(|block| bump(&block.rate_limited[slipped as usize]));
}

/// `f` on this thread's DNS counters.
fn with_dns_block(f: impl FnOnce(&DnsBlock)) {
    DNS_BLOCK.with(|cell| {
        f(cell.get_or_init(|| {
            let block = Arc::new(DnsBlock::new());
            DNS_BLOCKS.lock().push(block.clone());
            block
        }))
    });
}

/// The QTYPE of a message's first question, if it has one written out in full.
fn question_type(message: &[u8]) -> Option<u16> {
    if u16::from_be_bytes([message[4], message[5]]) == 0 {
        return None;
    }
    let mut at = 12;
    loop {
        let len = usize::from(*message.get(at)?);
        if len == 0 {
            at += 1;
            break;
        }
        if len & 0xc0 != 0 {
            return None;
        }
        at += 1 + len;
    }
    Some(u16::from_be_bytes([*message.get(at)?, *message.get(at + 1)?]))
}

// ---------------------------------------------------------------------------------------
// Exposition.

/// The media type of [`Exposition::render`].
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// What one server exposes: the process-wide counters, and what each of `state` reads at
/// scrape time (the server plugs in its registry's and its reloads': this module knows no
/// registry, so that the registry can count into it).
pub struct Exposition {
    prometheus: Prometheus,
}

impl Exposition {
    pub fn new(state: Vec<Box<dyn Collector>>) -> Self {
        let m = get();
        let mut p = Prometheus::with_prefix("koder_dns");
        p.register(
            "registrations",
            "Registrations by outcome (created, refreshed, refused) and reason of a refusal",
            m.registrations.clone(),
        );
        p.register(
            "heartbeats",
            "Heartbeats by outcome (ok, gone = 410)",
            m.heartbeats.clone(),
        );
        p.register(
            "deregistrations",
            "Deregistrations by outcome (ok, not_found, unavailable)",
            m.deregistrations.clone(),
        );
        p.register(
            "expiries",
            "Instances removed because their lease ran out",
            m.expiries.clone(),
        );
        p.register(
            "health_checks",
            "Health-check probes by result",
            m.health_checks.clone(),
        );
        p.register(
            "health_check_duration_seconds",
            "Time a health-check probe took",
            m.health_check_seconds.clone(),
        );
        p.register(
            "health_checks_running",
            "Instances this node runs a health check for (on etcd, its share of the checked instances)",
            m.health_checks_running.clone(),
        );
        p.register(
            "http_requests",
            "REST requests by route pattern, method and status",
            m.http_requests.clone(),
        );
        p.register(
            "http_request_duration_seconds",
            "REST request latency by route pattern",
            m.http_request_seconds.clone(),
        );
        p.register(
            "store_commits",
            "Commits to the durable store by result",
            m.store_commits.clone(),
        );
        p.register(
            "store_commit_duration_seconds",
            "Time a commit to the durable store took, fsync included",
            m.store_commit_seconds.clone(),
        );
        p.register(
            "watches_held",
            "Blocking queries (?index=&wait=) held right now",
            m.watches_held.clone(),
        );
        p.register_collector(Box::new(DnsCollector));
        for collector in state {
            p.register_collector(collector);
        }
        Self { prometheus: p }
    }

    /// The Prometheus text format (0.0.4), as [`CONTENT_TYPE`] says.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &self.prometheus).expect("writing to a String");
        out
    }
}

/// Sums the DNS blocks at scrape time.
#[derive(Debug)]
struct DnsCollector;

impl Collector for DnsCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let blocks = DNS_BLOCKS.lock().clone();
        let mut replies = [[[0u64; RCODES.len()]; QTYPES.len()]; TRANSPORTS.len()];
        let mut truncated = [0u64; TRANSPORTS.len()];
        let mut rate_limited = [0u64; 2];
        for block in &blocks {
            for (sum, n) in rate_limited.iter_mut().zip(&block.rate_limited) {
                *sum += n.load(Ordering::Relaxed);
            }
            for (t, per_type) in block.replies.iter().enumerate() {
                for (q, per_rcode) in per_type.iter().enumerate() {
                    for (r, n) in per_rcode.iter().enumerate() {
                        replies[t][q][r] += n.load(Ordering::Relaxed);
                    }
                }
                truncated[t] += block.truncated[t].load(Ordering::Relaxed);
            }
        }
        let mut family = encoder.encode_descriptor(
            "dns_queries",
            "DNS queries answered, by question type, RCODE and transport",
            None,
            MetricType::Counter,
        )?;
        for (t, per_type) in replies.iter().enumerate() {
            for (q, per_rcode) in per_type.iter().enumerate() {
                for (r, &n) in per_rcode.iter().enumerate() {
                    if n == 0 {
                        continue;
                    }
                    let labels = [
                        ("qtype", QTYPES[q].1),
                        ("rcode", RCODES[r]),
                        ("transport", TRANSPORTS[t]),
                    ];
                    ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
                }
            }
        }
        let mut family = encoder.encode_descriptor(
            "dns_truncated",
            "DNS replies sent with TC set (the client retries over TCP), by transport",
            None,
            MetricType::Counter,
        )?;
        for (t, &n) in truncated.iter().enumerate() {
            ConstCounter::new(n).encode(family.encode_family(&[("transport", TRANSPORTS[t])])?)?;
        }
        for (name, help, n) in [
            (
                "rrl_dropped",
                "UDP responses over --dns-rrl-rate, dropped",
                rate_limited[0],
            ),
            (
                "rrl_slipped",
                "UDP responses over --dns-rrl-rate sent as an empty reply with TC instead (every --dns-rrl-slip-th)",
                rate_limited[1],
            ),
        ] {
            let family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            ConstCounter::new(n).encode(family)?;
        }
        Ok(())
    }
}
