//! Health-check integration tests (issue #4, contract R6): the real server in-process,
//! probing real TCP listeners and a real HTTP server started by each test.
//!
//! Checks run on short intervals (100–300 ms) and every wait polls against a deadline, so
//! each test takes a second or two. Where a test asserts that something has NOT happened yet
//! (fewer than `fall` failures, fewer than `rise` successes) it counts the probes the test's
//! own listener received rather than trusting the clock, so the assertion is deterministic.

use crate::common;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::common::TestServer;
use hickory_proto::rr::{RData, RecordType};
use koder_dns::config::Config;
use koder_dns::model::check::CheckKind;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

const ZONE: &str = "service.koder.";
const POLL: Duration = Duration::from_millis(15);

// ---------------------------------------------------------------------------------------
// test peers: TCP listeners, a closed port, an HTTP server

/// A TCP listener on 127.0.0.1 that accepts and counts connections (each one a TCP probe).
struct Listener {
    port: u16,
    accepted: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Listener {
    /// Listens on `port` (0 = any free port).
    async fn bind(port: u16) -> Self {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, port))
            .await
            .expect("bind test listener");
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        let task = tokio::spawn(async move {
            loop {
                if let Ok((stream, _)) = listener.accept().await {
                    count.fetch_add(1, Ordering::SeqCst);
                    drop(stream);
                }
            }
        });
        Self { port, accepted, task }
    }

    fn count(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// Stops listening: from now on connections to the port are refused.
    async fn close(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

/// A port nothing listens on: bound, then released.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    listener.local_addr().unwrap().port()
}

/// How long `/slow…` takes to answer.
const SLOW: Duration = Duration::from_millis(600);

/// An HTTP server (axum) whose answer depends on the path:
/// `/fail…` → 500, `/slow…` → 200 after [`SLOW`], anything else → 200. Counts hits per path.
struct HttpPeer {
    port: u16,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    task: JoinHandle<()>,
}

impl HttpPeer {
    async fn start() -> Self {
        let hits: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
        let state = hits.clone();
        let app = axum::Router::new().fallback(move |uri: axum::http::Uri| {
            let hits = state.clone();
            async move {
                let path = uri.path().to_owned();
                *hits.lock().entry(path.clone()).or_default() += 1;
                if path.starts_with("/fail") {
                    (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "failing")
                } else {
                    if path.starts_with("/slow") {
                        tokio::time::sleep(SLOW).await;
                    }
                    (axum::http::StatusCode::OK, "ok")
                }
            }
        });
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { port, hits, task }
    }

    fn hits(&self, path: &str) -> usize {
        self.hits.lock().get(path).copied().unwrap_or(0)
    }
}

impl Drop for HttpPeer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// ---------------------------------------------------------------------------------------
// helpers

async fn start(tweak: impl FnOnce(&mut Config)) -> TestServer {
    common::start_with(tweak).await
}

/// A registration on 127.0.0.1:`port` with the given `check*` labels in its metadata.
fn checked(id: &str, name: &str, port: u16, labels: &[(&str, &str)]) -> Value {
    let metadata: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), Value::String(v.to_string())))
        .collect();
    json!({ "id": id, "name": name, "address": "127.0.0.1", "port": port, "metadata": metadata })
}

/// Every live instance, from `GET /services?detail=1`.
async fn instances(server: &TestServer, query: &str) -> Vec<Value> {
    let (status, body) = server.get(&format!("/api/v1/services?detail=1{query}")).await;
    assert_eq!(status, 200, "listing: {body}");
    body["instances"].as_array().expect("instances array").clone()
}

/// The instance `id` as the REST API shows it.
async fn instance(server: &TestServer, id: &str) -> Value {
    instances(server, "")
        .await
        .into_iter()
        .find(|i| i["id"] == id)
        .unwrap_or_else(|| panic!("instance {id} is not listed"))
}

async fn healthy(server: &TestServer, id: &str) -> bool {
    instance(server, id).await["healthy"]
        .as_bool()
        .expect("healthy is a bool")
}

/// Polls until `id` shows `healthy == want`; panics after `within`. Returns the time taken.
async fn wait_health(server: &TestServer, id: &str, want: bool, within: Duration) -> Duration {
    let start = Instant::now();
    loop {
        if healthy(server, id).await == want {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "{id} did not become healthy={want} within {within:?}: {}",
            instance(server, id).await
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Polls until `cond()` holds; panics with `what` after `within`.
async fn wait_until(what: &str, within: Duration, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < within,
            "timed out after {within:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The (port, target) of every SRV answer, sorted.
async fn srv_ports(server: &TestServer, name: &str) -> Vec<u16> {
    let reply = server.query(&format!("_{name}._tcp.{ZONE}"), RecordType::SRV).await;
    let mut ports: Vec<u16> = reply
        .answers
        .iter()
        .map(|r| match &r.data {
            RData::SRV(srv) => srv.port,
            other => panic!("expected SRV, got {other:?}"),
        })
        .collect();
    ports.sort_unstable();
    ports
}

async fn a_addresses(server: &TestServer, name: &str) -> Vec<IpAddr> {
    let reply = server.query(&format!("{name}.{ZONE}"), RecordType::A).await;
    let mut addrs: Vec<IpAddr> = reply
        .answers
        .iter()
        .map(|r| match &r.data {
            RData::A(a) => IpAddr::V4(a.0),
            other => panic!("expected A, got {other:?}"),
        })
        .collect();
    addrs.sort_unstable();
    addrs
}

const FAST: [(&str, &str); 3] = [
    ("check", "tcp"),
    ("check_interval", "100ms"),
    ("check_timeout", "200ms"),
];

// ---------------------------------------------------------------------------------------
// TCP checks

#[tokio::test]
async fn tcp_open_port_stays_healthy() {
    let server = start(|_| {}).await;
    let peer = Listener::bind(0).await;
    server.register(checked("up-1", "up", peer.port, &FAST)).await;
    // Watch it through several probes: it must never be marked unhealthy.
    let start = Instant::now();
    while peer.count() < 5 {
        assert!(
            healthy(&server, "up-1").await,
            "an instance whose port accepts must stay healthy"
        );
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "the TCP check did not probe the port ({} probes)",
            peer.count()
        );
        tokio::time::sleep(POLL).await;
    }
    assert!(healthy(&server, "up-1").await);
    peer.close().await;
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn tcp_closed_port_turns_unhealthy_only_after_fall_failures() {
    // fall = 3 with a 300 ms interval: the third failure can come no sooner than
    // 0 + 270 + 270 ms after registration (first probe within one interval, then ±10%).
    let server = start(|c| c.check_fall = 3).await;
    let port = closed_port();
    let registered = Instant::now();
    server
        .register(checked(
            "down-1",
            "down",
            port,
            &[
                ("check", "tcp"),
                ("check_interval", "300ms"),
                ("check_timeout", "200ms"),
            ],
        ))
        .await;
    tokio::time::sleep(Duration::from_millis(150).saturating_sub(registered.elapsed())).await;
    let still_healthy = healthy(&server, "down-1").await;
    if registered.elapsed() < Duration::from_millis(540) {
        assert!(
            still_healthy,
            "after at most 2 failed probes (< fall = 3) the instance must still be healthy"
        );
    } else {
        eprintln!("machine too slow to observe the state before the third probe; skipping that assertion");
    }
    let took = wait_health(&server, "down-1", false, Duration::from_secs(3)).await;
    assert!(
        registered.elapsed() >= Duration::from_millis(540),
        "turned unhealthy too early ({took:?}): fall = 3 not honoured"
    );
    server.running.shutdown().await.expect("durable state flushed");
}

// ---------------------------------------------------------------------------------------
// HTTP checks

#[tokio::test]
async fn http_fall_counts_consecutive_failed_probes() {
    let server = start(|c| c.check_fall = 3).await;
    let http = HttpPeer::start().await;
    server
        .register(checked(
            "flaky-1",
            "flaky",
            http.port,
            &[
                ("check", "http"),
                ("check_path", "/fail"),
                ("check_interval", "300ms"),
                ("check_timeout", "200ms"),
            ],
        ))
        .await;
    // Two failed probes (fall - 1): still healthy. The third comes ~300 ms later.
    wait_until("two probes of /fail", Duration::from_secs(3), || {
        http.hits("/fail") >= 2
    })
    .await;
    assert!(
        healthy(&server, "flaky-1").await,
        "unhealthy after {} failed probes; fall is 3",
        http.hits("/fail")
    );
    assert_eq!(http.hits("/fail"), 2, "the probes came faster than check_interval");
    wait_health(&server, "flaky-1", false, Duration::from_secs(3)).await;
    assert!(
        http.hits("/fail") >= 3,
        "unhealthy after only {} failed probes; fall is 3",
        http.hits("/fail")
    );
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn http_200_is_healthy_and_check_path_is_used() {
    let server = start(|_| {}).await;
    let http = HttpPeer::start().await;
    let labels = [
        ("check", "http"),
        ("check_interval", "100ms"),
        ("check_timeout", "200ms"),
    ];
    let mut with_path = labels.to_vec();
    with_path.push(("check_path", "/ok"));
    server.register(checked("ok-path", "web", http.port, &with_path)).await;
    // No check_path: the default is `/`.
    server.register(checked("ok-root", "web", http.port, &labels)).await;
    wait_until("3 probes of /ok and of /", Duration::from_secs(3), || {
        http.hits("/ok") >= 3 && http.hits("/") >= 3
    })
    .await;
    assert!(
        healthy(&server, "ok-path").await,
        "HTTP 200 on the check path must be healthy"
    );
    assert!(healthy(&server, "ok-root").await, "HTTP 200 on / must be healthy");
    let hits = http.hits.lock().clone();
    assert_eq!(
        hits.keys().filter(|p| *p != "/" && *p != "/ok").count(),
        0,
        "probed paths other than / and /ok: {hits:?}"
    );
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn http_500_is_unhealthy() {
    let server = start(|_| {}).await;
    let http = HttpPeer::start().await;
    server
        .register(checked(
            "err-1",
            "err",
            http.port,
            &[
                ("check", "http"),
                ("check_path", "/fail/500"),
                ("check_interval", "100ms"),
                ("check_timeout", "200ms"),
            ],
        ))
        .await;
    wait_health(&server, "err-1", false, Duration::from_secs(2)).await;
    assert!(
        http.hits("/fail/500") >= 2,
        "flipped before fall = 2 failed probes ({})",
        http.hits("/fail/500")
    );
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn http_slower_than_the_timeout_is_unhealthy() {
    let server = start(|_| {}).await;
    let http = HttpPeer::start().await;
    // /slow answers 200, but only after 600 ms.
    server
        .register(checked(
            "slow-1",
            "slow",
            http.port,
            &[
                ("check", "http"),
                ("check_path", "/slow/a"),
                ("check_interval", "100ms"),
                ("check_timeout", "200ms"),
            ],
        ))
        .await;
    // The same slow answer within a longer timeout is a pass: the timeout decides.
    server
        .register(checked(
            "patient-1",
            "slow",
            http.port,
            &[
                ("check", "http"),
                ("check_path", "/slow/b"),
                ("check_interval", "100ms"),
                ("check_timeout", "1500ms"),
            ],
        ))
        .await;
    let took = wait_health(&server, "slow-1", false, Duration::from_secs(2)).await;
    assert!(
        took < Duration::from_millis(1500),
        "the timeout (200 ms) was not applied: took {took:?}"
    );
    wait_until("2 probes of /slow/b", Duration::from_secs(4), || {
        http.hits("/slow/b") >= 2
    })
    .await;
    tokio::time::sleep(SLOW + Duration::from_millis(100)).await; // let the second probe finish
    assert!(
        healthy(&server, "patient-1").await,
        "a 600 ms answer within a 1500 ms timeout must pass"
    );
    server.running.shutdown().await.expect("durable state flushed");
}

// ---------------------------------------------------------------------------------------
// rise, and what a flip changes

#[tokio::test]
async fn recovered_instance_turns_healthy_after_rise_successes() {
    let server = start(|c| {
        c.check_fall = 1;
        c.check_rise = 3;
    })
    .await;
    let port = closed_port();
    server
        .register(checked(
            "phoenix-1",
            "phoenix",
            port,
            &[
                ("check", "tcp"),
                ("check_interval", "300ms"),
                ("check_timeout", "200ms"),
            ],
        ))
        .await;
    wait_health(&server, "phoenix-1", false, Duration::from_secs(3)).await;

    // The service comes back.
    let peer = Listener::bind(port).await;
    wait_until("2 successful probes", Duration::from_secs(3), || peer.count() >= 2).await;
    assert!(
        !healthy(&server, "phoenix-1").await,
        "healthy again after {} successes; rise is 3",
        peer.count()
    );
    wait_health(&server, "phoenix-1", true, Duration::from_secs(3)).await;
    assert!(
        peer.count() >= 3,
        "healthy again after only {} successes; rise is 3",
        peer.count()
    );
    peer.close().await;
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn recovered_instance_turns_healthy_with_default_rise() {
    let server = start(|_| {}).await; // fall 2, rise 1
    let peer = Listener::bind(0).await;
    let port = peer.port;
    server.register(checked("lazarus-1", "lazarus", port, &FAST)).await;
    wait_until("a probe", Duration::from_secs(2), || peer.count() >= 1).await;
    peer.close().await;
    wait_health(&server, "lazarus-1", false, Duration::from_secs(2)).await;
    let peer = Listener::bind(port).await;
    wait_health(&server, "lazarus-1", true, Duration::from_secs(2)).await;
    peer.close().await;
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn health_flip_removes_from_dns_restores_and_bumps_the_serial() {
    let server = start(|_| {}).await;
    let peer = Listener::bind(0).await;
    let port = peer.port;
    server.register(checked("web-checked", "web", port, &FAST)).await;
    // An unchecked sibling keeps the service in the zone.
    server
        .register(json!({ "id": "web-static", "name": "web", "address": "10.0.0.9", "port": 9000 }))
        .await;
    let localhost = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let sibling: IpAddr = "10.0.0.9".parse().unwrap();

    wait_until("two probes", Duration::from_secs(2), || peer.count() >= 2).await;
    assert!(healthy(&server, "web-checked").await);
    let mut both = vec![port, 9000];
    both.sort_unstable();
    assert_eq!(srv_ports(&server, "web").await, both);
    assert_eq!(a_addresses(&server, "web").await, vec![sibling, localhost]);
    let s0 = server.serial().await;

    // Down: out of SRV and A, and the serial moves.
    peer.close().await;
    wait_health(&server, "web-checked", false, Duration::from_secs(2)).await;
    assert_eq!(
        srv_ports(&server, "web").await,
        vec![9000],
        "an unhealthy instance must leave the SRV answer"
    );
    assert_eq!(
        a_addresses(&server, "web").await,
        vec![sibling],
        "an unhealthy instance's address must leave the A answer"
    );
    let s1 = server.serial().await;
    assert!(
        s1 > s0,
        "the SOA serial must grow when an instance turns unhealthy ({s0} → {s1})"
    );

    // Up again: back in the answers, and the serial moves again.
    let peer = Listener::bind(port).await;
    wait_health(&server, "web-checked", true, Duration::from_secs(2)).await;
    assert_eq!(
        srv_ports(&server, "web").await,
        both,
        "a recovered instance must return to the SRV answer"
    );
    assert_eq!(a_addresses(&server, "web").await, vec![sibling, localhost]);
    let s2 = server.serial().await;
    assert!(
        s2 > s1,
        "the SOA serial must grow when an instance turns healthy again ({s1} → {s2})"
    );
    peer.close().await;
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn service_whose_only_instance_is_unhealthy_has_no_records() {
    // Ten failed probes (~1 s at 100 ms) before it turns: time to see it served first, even
    // on a loaded machine.
    let server = start(|c| c.check_fall = 10).await;
    server
        .register(checked("lonely-1", "lonely", closed_port(), &FAST))
        .await;
    assert_eq!(srv_ports(&server, "lonely").await.len(), 1, "served while healthy");
    wait_health(&server, "lonely-1", false, Duration::from_secs(5)).await;
    assert!(
        srv_ports(&server, "lonely").await.is_empty(),
        "no SRV for a service with no healthy instance"
    );
    assert!(
        a_addresses(&server, "lonely").await.is_empty(),
        "no A for a service with no healthy instance"
    );
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn rest_listings_show_unhealthy_and_healthy_only_excludes_it() {
    let server = start(|_| {}).await;
    server.register(checked("api-down", "api", closed_port(), &FAST)).await;
    server
        .register(json!({ "id": "api-up", "name": "api", "address": "10.0.0.1", "port": 8080 }))
        .await;
    server.register(checked("gone-1", "gone", closed_port(), &FAST)).await;
    wait_health(&server, "api-down", false, Duration::from_secs(2)).await;
    wait_health(&server, "gone-1", false, Duration::from_secs(2)).await;

    // Unfiltered: everything, with the flag as the checker set it.
    let all = instances(&server, "").await;
    let flags: Vec<(String, bool)> = all
        .iter()
        .map(|i| (i["id"].as_str().unwrap().to_owned(), i["healthy"].as_bool().unwrap()))
        .collect();
    assert_eq!(
        flags,
        vec![
            ("api-down".to_owned(), false),
            ("api-up".to_owned(), true),
            ("gone-1".to_owned(), false)
        ],
        "unhealthy instances stay listed with healthy:false"
    );
    let (_, names) = server.get("/api/v1/services").await;
    assert_eq!(names["services"], json!(["api", "gone"]));

    // healthy_only: the unhealthy ones, and the service with none healthy, are gone.
    for flag in ["1", "true"] {
        let ids: Vec<Value> = instances(&server, &format!("&healthy_only={flag}"))
            .await
            .iter()
            .map(|i| i["id"].clone())
            .collect();
        assert_eq!(ids, vec![json!("api-up")], "?healthy_only={flag}&detail=1");
        let (status, names) = server.get(&format!("/api/v1/services?healthy_only={flag}")).await;
        assert_eq!(status, 200);
        assert_eq!(names["services"], json!(["api"]), "?healthy_only={flag}");
    }
    let ids: Vec<Value> = instances(&server, "&healthy_only=1&name=api")
        .await
        .iter()
        .map(|i| i["id"].clone())
        .collect();
    assert_eq!(ids, vec![json!("api-up")], "?healthy_only=1&name=api");
    server.running.shutdown().await.expect("durable state flushed");
}

// ---------------------------------------------------------------------------------------
// the life cycle of a check

#[tokio::test]
async fn deregistered_instance_is_no_longer_checked() {
    let server = start(|_| {}).await;
    let peer = Listener::bind(0).await;
    server.register(checked("bye-1", "bye", peer.port, &FAST)).await;
    wait_until("two probes", Duration::from_secs(2), || peer.count() >= 2).await;
    server.deregister("bye-1").await;
    tokio::time::sleep(Duration::from_millis(250)).await; // a probe already in flight may land
    let after = peer.count();
    tokio::time::sleep(Duration::from_millis(700)).await; // ~7 intervals
    assert_eq!(peer.count(), after, "the deregistered instance is still being probed");
    peer.close().await;
    server.running.shutdown().await.expect("durable state flushed");
}

/// After expiry, registering the same id again is a new registration (docs/interface.md). A new
/// registration with a check must be checked, even when the reaper has not yet removed the
/// expired entry (with the default 30 s reaper interval, a registrant that restarts just
/// after its lease ran out hits exactly that window).
#[tokio::test]
async fn reregistered_after_expiry_is_checked_again() {
    let (server, clock) = common::start_manual(|_| {}).await;
    let peer = Listener::bind(0).await;
    let port = peer.port;
    let mut body = checked("again-1", "again", port, &FAST);
    body["ttl_ns"] = json!(1_000_000_000i64); // a 1 s lease, on the manual clock
    assert_eq!(server.register(body.clone()).await["created"], true);
    wait_until("two probes", Duration::from_secs(2), || peer.count() >= 2).await;

    // The lease runs out (no heartbeat, no DNS query, so the 30 s reaper does not run yet).
    clock.advance(Duration::from_secs(2));
    assert!(
        instances(&server, "").await.is_empty(),
        "expired instances are not listed"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;

    // The registrant comes back on the same id with the same check; then its port dies.
    // (Closing the port before registering raced the 100 ms probes against the commit and
    // the listing on a loaded machine.)
    assert_eq!(
        server.register(body).await["created"],
        true,
        "after expiry, a new registration"
    );
    assert!(healthy(&server, "again-1").await);
    peer.close().await;
    wait_health(&server, "again-1", false, Duration::from_secs(2)).await;
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn reregistering_keeps_health_unless_the_check_changes() {
    let server = start(|_| {}).await;
    let port = closed_port();
    let body = |weight: u16, labels: &[(&str, &str)]| {
        let mut b = checked("rr-1", "rr", port, labels);
        b["weight"] = json!(weight);
        b["healthy"] = json!(true); // what a registrant sends on every (re)start
        b
    };
    server.register(body(5, &FAST)).await;
    wait_health(&server, "rr-1", false, Duration::from_secs(2)).await;

    // Same check settings (another field changed): the checker's verdict stands.
    let response = server.register(body(7, &FAST)).await;
    assert_eq!(response["created"], false);
    let now = instance(&server, "rr-1").await;
    assert_eq!(now["weight"], 7, "the mutable fields are replaced");
    assert_eq!(
        now["healthy"], false,
        "re-registering with the same check must not reset the unhealthy state"
    );
    assert!(
        srv_ports(&server, "rr").await.is_empty(),
        "still out of DNS after re-registering"
    );

    // Changed check settings: a new check, starting healthy…
    let changed = [
        ("check", "tcp"),
        ("check_interval", "120ms"),
        ("check_timeout", "200ms"),
    ];
    server.register(body(7, &changed)).await;
    assert_eq!(
        instance(&server, "rr-1").await["healthy"],
        true,
        "a changed check must start over from healthy"
    );
    assert_eq!(srv_ports(&server, "rr").await, vec![port]);
    // …which runs: the closed port fails it again.
    wait_health(&server, "rr-1", false, Duration::from_secs(2)).await;

    // check=none: nobody owns the flag but the registrant, and nothing turns it off.
    let none = [("check", "none"), ("check_interval", "100ms")];
    server.register(body(7, &none)).await;
    assert_eq!(instance(&server, "rr-1").await["healthy"], true);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        instance(&server, "rr-1").await["healthy"],
        true,
        "an instance with check=none must not be probed"
    );
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn default_check_applies_to_instances_that_name_none() {
    let server = start(|c| c.default_check = CheckKind::Tcp).await;
    let peer = Listener::bind(0).await;
    let fast_no_kind = [("check_interval", "100ms"), ("check_timeout", "200ms")];
    server
        .register(checked("dflt-down", "dflt", closed_port(), &fast_no_kind))
        .await;
    server
        .register(checked("dflt-up", "dflt", peer.port, &fast_no_kind))
        .await;
    // An explicit check=none opts out of the default.
    server
        .register(checked(
            "optout",
            "optout",
            closed_port(),
            &[("check", "none"), ("check_interval", "100ms")],
        ))
        .await;

    wait_health(&server, "dflt-down", false, Duration::from_secs(2)).await;
    wait_until("probes of the open port", Duration::from_secs(2), || peer.count() >= 2).await;
    assert!(healthy(&server, "dflt-up").await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        healthy(&server, "optout").await,
        "check=none must override default_check = tcp"
    );
    peer.close().await;
    server.running.shutdown().await.expect("durable state flushed");

    // With the built-in default (none), the same registration is not probed at all.
    let server = start(|_| {}).await;
    server
        .register(checked("nocheck", "nocheck", closed_port(), &fast_no_kind))
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        healthy(&server, "nocheck").await,
        "default_check = none must leave unlabelled instances unchecked"
    );
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn invalid_check_labels_are_400_naming_the_field() {
    let server = start(|_| {}).await;
    let meta = |k: &str, v: &str| json!({ "name": "bad", "address": "127.0.0.1", "port": 80, "metadata": { k: v } });
    let tag = |t: &str| json!({ "name": "bad", "address": "127.0.0.1", "port": 80, "tags": [t] });
    let cases = [
        (meta("check", "ping"), "check", "ping"),
        (tag("check=icmp"), "check", "icmp"),
        (meta("check_path", "healthz"), "check_path", "healthz"),
        (meta("check_path", "/a b"), "check_path", "/a b"),
        (meta("check_interval", "10ms"), "check_interval", "10ms"),
        (meta("check_interval", "soon"), "check_interval", "soon"),
        (tag("check_interval=1ms"), "check_interval", "1ms"),
        (meta("check_timeout", "0"), "check_timeout", "0"),
        (meta("check_timeout", "forever"), "check_timeout", "forever"),
    ];
    for (body, field, value) in cases {
        let (status, response) = server.post("/api/v1/services/register", &body).await;
        assert_eq!(status, 400, "{body} must be refused: {response}");
        let message = response["message"].as_str().unwrap_or_default();
        assert!(
            response["error"].is_string(),
            "{body}: errors are JSON with a code: {response}"
        );
        assert!(
            message.contains(field),
            "{body}: the message must name {field}: {message}"
        );
        assert!(
            message.contains(value),
            "{body}: the message should quote the bad value {value:?}: {message}"
        );
    }
    let (_, names) = server.get("/api/v1/services").await;
    assert_eq!(names["services"], json!([]), "nothing invalid was stored");
    server.running.shutdown().await.expect("durable state flushed");
}
