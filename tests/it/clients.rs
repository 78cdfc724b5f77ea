//! The client library and `koder-dns agent` against the real server: registration,
//! heartbeats, recovery from a lost lease, a registry restarted empty or down at start,
//! failover between URLs, and a clean deregistration on SIGTERM.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{KEY, TestServer};
use koder_dns::client::{Client, Error, Instance, Registrant};

const TTL: Duration = Duration::from_millis(1500);

fn client(urls: &[&str]) -> Arc<Client> {
    Arc::new(
        Client::new(
            urls.iter().map(|u| u.to_string()).collect(),
            KEY,
            Duration::from_secs(2),
        )
        .unwrap(),
    )
}

fn registration(name: &str) -> Instance {
    Instance {
        name: name.into(),
        address: "127.0.0.1".parse().unwrap(),
        port: 7000,
        ..Instance::default()
    }
}

/// A loopback port nothing listens on (bound, then released).
fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// The ids of the live instances of `name`.
async fn ids(server_base: &str, name: &str) -> Vec<String> {
    let c = client(&[server_base]);
    match c.instances(Some(name)).await {
        Ok(list) => list.into_iter().map(|i| i.id.to_string()).collect(),
        Err(_) => Vec::new(),
    }
}

/// Waits up to `limit` for `name` to have exactly `want` live instances; returns how long it took.
async fn until_count(base: &str, name: &str, want: usize, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        if ids(base, name).await.len() == want {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "{name} did not reach {want} instance(s) within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn spawn_registrant(
    registrant: Registrant,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<(), Error>>,
) {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(registrant.run(async {
        let _ = stopped.await;
    }));
    (stop, task)
}

#[tokio::test]
async fn client_maps_registry_answers_to_typed_errors() {
    let server = common::start().await;
    let c = client(&[&server.base]);
    let registered = c.register(&registration("typed")).await.unwrap();
    assert!(registered.created);
    assert_eq!(registered.id, "typed-127.0.0.1-7000");
    assert_eq!(c.heartbeat(&registered.id).await.unwrap().name, "typed");
    assert!(matches!(c.heartbeat("nobody").await, Err(Error::Gone)));
    assert!(matches!(c.deregister("nobody").await, Err(Error::NotFound(_))));
    let mut bad = registration("typed");
    bad.port = 0;
    match c.register(&bad).await {
        Err(Error::Invalid { field, .. }) => assert_eq!(field, "port"),
        other => panic!("expected Invalid(port), got {other:?}"),
    }
    let wrong = Arc::new(Client::new(vec![server.base.clone()], "wrong-key", Duration::from_secs(2)).unwrap());
    assert!(matches!(wrong.services().await, Err(Error::Unauthorized)));
    let dead = format!("http://{}", free_addr());
    assert!(matches!(client(&[&dead]).services().await, Err(Error::Unavailable(_))));
}

#[tokio::test]
async fn client_fails_over_to_the_next_url() {
    let server = common::start().await;
    let dead = format!("http://{}", free_addr());
    let c = client(&[&dead, &server.base]);
    c.register(&registration("failover")).await.unwrap();
    assert_eq!(c.services().await.unwrap(), vec!["failover"]);
}

#[tokio::test]
async fn registrant_keeps_the_lease_and_reregisters_when_deregistered_behind_its_back() {
    let server = common::start().await;
    let (stop, task) = spawn_registrant(Registrant::new(client(&[&server.base]), registration("keep"), TTL));
    until_count(&server.base, "keep", 1, TTL).await;
    // Three TTLs of heartbeats keep it alive.
    tokio::time::sleep(TTL * 3).await;
    assert_eq!(ids(&server.base, "keep").await, vec!["keep-127.0.0.1-7000"]);
    // Removed behind its back: the next heartbeat gets 410 and it registers again.
    client(&[&server.base]).deregister("keep-127.0.0.1-7000").await.unwrap();
    until_count(&server.base, "keep", 0, TTL).await;
    let back = until_count(&server.base, "keep", 1, TTL).await;
    assert!(back < TTL, "re-registered after {back:?}");
    // Shutdown deregisters at once.
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    assert!(ids(&server.base, "keep").await.is_empty());
}

#[tokio::test]
async fn registrant_reregisters_after_the_registry_restarts_with_an_empty_data_dir() {
    let first = common::start().await;
    let addr = first.running.http_addr;
    let (stop, task) = spawn_registrant(Registrant::new(client(&[&first.base]), registration("restart"), TTL));
    until_count(&first.base, "restart", 1, TTL).await;
    first.running.shutdown().await.expect("the registry flushed");
    // Down for a moment, then back on the same address with a fresh data directory.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = common::start_with(|c| c.http_listen = addr).await;
    assert_eq!(second.running.http_addr, addr);
    let back = until_count(&second.base, "restart", 1, TTL).await;
    assert!(back < TTL, "re-registered after {back:?}");
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
}

#[tokio::test]
async fn registrant_started_while_the_registry_is_down_registers_when_it_comes_up() {
    let addr = free_addr();
    let base = format!("http://{addr}");
    let (stop, task) = spawn_registrant(Registrant::new(client(&[&base]), registration("late"), TTL));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let server = common::start_with(|c| c.http_listen = addr).await;
    let up = until_count(&server.base, "late", 1, TTL).await;
    assert!(up < TTL, "registered {up:?} after the registry came up");
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
    assert!(ids(&server.base, "late").await.is_empty());
}

#[tokio::test]
async fn registrant_with_a_refused_key_stops_with_unauthorized() {
    let server = common::start().await;
    let wrong = Arc::new(Client::new(vec![server.base.clone()], "wrong-key", Duration::from_secs(2)).unwrap());
    let result = Registrant::new(wrong, registration("refused"), TTL)
        .run(std::future::pending())
        .await;
    assert!(matches!(result, Err(Error::Unauthorized)), "{result:?}");
}

fn agent(server: &TestServer, extra: &[&str]) -> std::process::Child {
    std::process::Command::new(env!("CARGO_BIN_EXE_koder-dns"))
        .args([
            "agent",
            "--url",
            &server.base,
            "--name",
            "agent",
            "--address",
            "127.0.0.1",
            "--port",
            "7100",
        ])
        .args([
            "--ttl",
            "1500ms",
            "--tag",
            "edge",
            "--meta",
            "jet.domain=agent.koder.dev",
        ])
        .args(extra)
        .env("KODER_DNS_API_KEY", KEY)
        .env_remove("KODER_DNS_URL")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("koder-dns agent starts")
}

#[tokio::test]
async fn agent_registers_and_deregisters_on_sigterm_with_the_key_out_of_argv() {
    let server = common::start().await;
    let mut child = agent(&server, &[]);
    until_count(&server.base, "agent", 1, Duration::from_secs(10)).await;
    let instance = &client(&[&server.base]).instances(Some("agent")).await.unwrap()[0];
    assert_eq!(instance.port, 7100);
    assert_eq!(instance.tags, vec!["edge"]);
    assert_eq!(instance.metadata.get("jet.domain"), Some("agent.koder.dev"));
    assert_eq!(instance.ttl_ns, 1_500_000_000);
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", child.id())).unwrap();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains(KEY),
        "the API key is in the agent's argv"
    );
    // Alive past its TTL: it heart-beats.
    tokio::time::sleep(TTL * 2).await;
    assert_eq!(ids(&server.base, "agent").await.len(), 1);
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exit = tokio::task::spawn_blocking(move || child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "agent exited with {exit}");
    // Gone at once, not after its lease.
    assert!(ids(&server.base, "agent").await.is_empty());
}

#[tokio::test]
async fn agent_reads_the_key_from_a_file_and_exits_2_without_one() {
    let server = common::start().await;
    let keyfile = server.dir.path().join("key");
    std::fs::write(&keyfile, format!("{KEY}\n")).unwrap();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_koder-dns"))
        .args([
            "agent",
            "--url",
            &server.base,
            "--name",
            "keyfile",
            "--address",
            "127.0.0.1",
            "--port",
            "7200",
        ])
        .arg("--api-key-file")
        .arg(&keyfile)
        .env_remove("KODER_DNS_API_KEY")
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    until_count(&server.base, "keyfile", 1, Duration::from_secs(10)).await;
    std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(child.wait().unwrap().success());

    let output = std::process::Command::new(env!("CARGO_BIN_EXE_koder-dns"))
        .args([
            "agent",
            "--url",
            &server.base,
            "--name",
            "nokey",
            "--address",
            "127.0.0.1",
            "--port",
            "7300",
        ])
        .env_remove("KODER_DNS_API_KEY")
        .env_remove("KODER_DNS_API_KEY_FILE")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("KODER_DNS_API_KEY"));
}

fn routed(name: &str, port: u16, domain: &str) -> serde_json::Value {
    serde_json::json!({
        "name": name, "address": "127.0.0.1", "port": port,
        "metadata": { "jet.domain": domain },
    })
}

#[tokio::test]
async fn watcher_yields_the_edge_view_on_each_change_and_fails_over_keeping_the_last_view() {
    let a = common::start().await;
    let b = common::start().await;
    a.register(routed("voice", 7001, "voice.koder.dev")).await;
    a.register(serde_json::json!({"name": "internal", "address": "127.0.0.1", "port": 7002}))
        .await;
    let mut watcher = koder_dns::client::Watcher::new(client(&[&a.base, &b.base]), Duration::from_secs(5));
    let first = watcher.next().await.unwrap();
    assert_eq!(first.len(), 1, "internal-only instances are not routed: {first:?}");
    assert_eq!(first[0].domain, "voice.koder.dev");
    assert!(!first[0].conflict);
    assert!(first[0].instances[0].healthy);

    // A second service claims the domain (by tag), one unhealthy: a conflict, health kept.
    // The watcher is held on a blocking query meanwhile, so it sees the change at once.
    let pending = tokio::spawn(async move {
        let view = watcher.next().await;
        (watcher, view, Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!pending.is_finished(), "nothing changed yet");
    a.register(serde_json::json!({
        "name": "rogue", "address": "127.0.0.1", "port": 7003,
        "tags": ["jet.domain=voice.koder.dev"], "healthy": false,
    }))
    .await;
    let registered = Instant::now();
    let (mut watcher, second, seen) = tokio::time::timeout(Duration::from_secs(8), pending)
        .await
        .expect("the change is seen")
        .unwrap();
    let second = second.unwrap();
    let lag = seen.saturating_duration_since(registered);
    assert!(lag < Duration::from_millis(250), "seen {lag:?} after the registration");
    assert!(second[0].conflict, "{second:?}");
    assert_eq!(second[0].services, vec!["rogue", "voice"]);
    let rogue = second[0].instances.iter().find(|i| i.service == "rogue").unwrap();
    assert!(!rogue.healthy);

    // Node A goes away: the last view stands, then node B's view arrives.
    a.running.shutdown().await.expect("the registry flushed");
    assert_eq!(watcher.last(), Some(&second[..]));
    b.register(routed("video", 7004, "video.koder.dev")).await;
    let third = tokio::time::timeout(Duration::from_secs(8), watcher.next())
        .await
        .expect("the other node is followed")
        .unwrap();
    assert_eq!(third.len(), 1);
    assert_eq!(third[0].domain, "video.koder.dev");
}

#[tokio::test]
async fn example_routing_file_rewrites_the_haproxy_map_on_change() {
    let server = common::start().await;
    server.register(routed("voice", 7001, "voice.koder.dev")).await;
    let map = server.dir.path().join("koder.map");
    let example = std::path::Path::new(env!("CARGO_BIN_EXE_koder-dns"))
        .parent()
        .unwrap()
        .join("examples/routing_file");
    assert!(
        example.exists(),
        "build it with `cargo build --examples` ({})",
        example.display()
    );
    let mut child = std::process::Command::new(&example)
        .arg(&server.base)
        .arg(&map)
        .env("KODER_DNS_API_KEY", KEY)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let read_until = |want: &'static str| {
        let map = map.clone();
        async move {
            let start = Instant::now();
            loop {
                let text = std::fs::read_to_string(&map).unwrap_or_default();
                if text == want {
                    return;
                }
                assert!(
                    start.elapsed() < Duration::from_secs(10),
                    "map is {text:?}, want {want:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    read_until("voice.koder.dev 127.0.0.1:7001\n").await;
    server.register(routed("voice", 7005, "voice.koder.dev")).await;
    read_until("voice.koder.dev 127.0.0.1:7001\nvoice.koder.dev 127.0.0.1:7005\n").await;
    child.kill().unwrap();
    child.wait().unwrap();
}

fn conformance(url: &str, extra: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_koder-dns"))
        .args(["conformance", "--url", url])
        .args(extra)
        .env("KODER_DNS_API_KEY", KEY)
        .env_remove("KODER_DNS_URL")
        .output()
        .expect("koder-dns conformance runs")
}

#[tokio::test]
async fn conformance_passes_against_koder_dns_and_cleans_up() {
    let server = common::start().await;
    let dns = server.dns().to_string();
    let base = server.base.clone();
    let output = tokio::task::spawn_blocking(move || conformance(&base, &["--dns", &dns]))
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{stdout}");
    for rule in ["R1", "R2", "R3", "R4", "R5", "R6", "R7", "R8"] {
        assert!(
            stdout.contains(&format!("PASS {rule} ")),
            "no passing {rule} check:\n{stdout}"
        );
    }
    assert!(stdout.contains("SRV"), "the DNS check ran:\n{stdout}");
    assert!(!stdout.contains("FAIL"));
    assert!(
        client(&[&server.base]).services().await.unwrap().is_empty(),
        "conformance left registrations behind"
    );
}

/// A pass-through to a real koder-dns that counts requests; `break_r3` makes it a producer
/// that breaks R3, answering 404 where the contract says 410 (a heartbeat for an unknown or
/// expired lease).
async fn proxy(upstream: String, break_r3: bool, hits: Arc<std::sync::atomic::AtomicUsize>) -> String {
    use axum::body::Bytes;
    use axum::http::{HeaderMap, Method, StatusCode, Uri};
    let http = crate::common::http();
    let app = axum::Router::new().fallback(move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
        let http = http.clone();
        let upstream = upstream.clone();
        let hits = hits.clone();
        async move {
            hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut request = http.request(method, format!("{upstream}{uri}")).body(body);
            if let Some(key) = headers.get("X-API-Key") {
                request = request.header("X-API-Key", key);
            }
            let response = request.send().await.unwrap();
            let mut status = StatusCode::from_u16(response.status().as_u16()).unwrap();
            if break_r3 && uri.path().ends_with("/heartbeat") && status == StatusCode::GONE {
                status = StatusCode::NOT_FOUND;
            }
            (status, response.bytes().await.unwrap())
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

#[tokio::test]
async fn conformance_fails_naming_the_rule_against_a_broken_producer() {
    let server = common::start().await;
    let broken = proxy(server.base.clone(), true, Default::default()).await;
    let output = tokio::task::spawn_blocking(move || conformance(&broken, &[]))
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    let failed: Vec<&str> = stdout.lines().filter(|l| l.starts_with("FAIL")).collect();
    assert!(!failed.is_empty(), "{stdout}");
    assert!(
        failed.iter().all(|l| l.starts_with("FAIL R3 ")),
        "only R3 is broken:\n{stdout}"
    );
    assert!(failed.iter().any(|l| l.contains("saw 404, want 410")), "{stdout}");
    assert!(client(&[&server.base]).services().await.unwrap().is_empty());
}

#[test]
fn conformance_exits_2_when_it_cannot_run() {
    let dead = format!("http://{}", free_addr());
    let output = conformance(&dead, &[]);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("cannot reach"));
}

#[tokio::test]
async fn watcher_does_not_poll_in_a_loop_while_nothing_changes() {
    let server = common::start().await;
    server.register(routed("voice", 7001, "voice.koder.dev")).await;
    let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let front = proxy(server.base.clone(), false, hits.clone()).await;
    let mut watcher = koder_dns::client::Watcher::new(client(&[&front]), Duration::from_secs(30));
    watcher.next().await.unwrap();
    // Nothing changes for 3 s: with blocking queries one held request, without them at most one
    // request a second.
    let quiet = tokio::time::timeout(Duration::from_secs(3), watcher.next()).await;
    assert!(quiet.is_err(), "no change was made, yet the watcher yielded {quiet:?}");
    let sent = hits.load(std::sync::atomic::Ordering::Relaxed);
    assert!(sent <= 5, "{sent} requests in 3 quiet seconds");
}

#[tokio::test]
async fn registrant_reregisters_on_404_from_a_producer_that_breaks_r3() {
    let server = common::start().await;
    let broken = proxy(server.base.clone(), true, Default::default()).await;
    let (stop, task) = spawn_registrant(Registrant::new(client(&[&broken]), registration("lenient"), TTL));
    until_count(&server.base, "lenient", 1, TTL).await;
    client(&[&server.base])
        .deregister("lenient-127.0.0.1-7000")
        .await
        .unwrap();
    until_count(&server.base, "lenient", 0, TTL).await;
    until_count(&server.base, "lenient", 1, TTL).await;
    stop.send(()).unwrap();
    task.await.unwrap().unwrap();
}
