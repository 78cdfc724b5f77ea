//! Blocking queries: `X-Koder-Index` on every listing, `?index=N&wait=D` held until the
//! revision passes N or D elapses, bounded by `--watch-max`, answered at shutdown.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{self, KEY, TestServer};

/// GET `path` with the key: status, `X-Koder-Index`, body.
async fn get(server: &TestServer, path: &str) -> (u16, Option<u64>, Value) {
    let response = server
        .http
        .get(server.url(path))
        .header("X-API-Key", KEY)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let index = response
        .headers()
        .get("x-koder-index")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    let text = response.text().await.unwrap();
    (
        status,
        index,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn voice(id: &str) -> Value {
    json!({"id": id, "name": "voice", "address": "10.0.0.1", "port": 5060, "metadata": {"jet.domain": "voice.koder.dev"}})
}

#[tokio::test]
async fn every_listing_carries_the_revision_and_it_grows_with_each_change() {
    let server = common::start().await;
    for path in [
        "/api/v1/services",
        "/api/v1/services?detail=1",
        "/api/v1/services/export",
        "/api/v1/routes",
    ] {
        let (status, index, _) = get(&server, path).await;
        assert_eq!(status, 200);
        assert!(index.is_some(), "{path} carries X-Koder-Index");
    }
    let (_, before, _) = get(&server, "/api/v1/services").await;
    server.register(voice("v1")).await;
    let (_, after, _) = get(&server, "/api/v1/routes").await;
    assert!(after > before, "{after:?} > {before:?}");
    assert_eq!(
        u64::from(server.serial().await),
        after.unwrap() & 0xffff_ffff,
        "the SOA serial is its low 32 bits"
    );
}

#[tokio::test]
async fn a_held_request_is_answered_as_soon_as_the_registry_changes() {
    let server = std::sync::Arc::new(common::start().await);
    let (_, index, _) = get(&server, "/api/v1/routes").await;
    let index = index.unwrap();
    let held = {
        let server = server.clone();
        tokio::spawn(async move {
            let r = get(&server, &format!("/api/v1/routes?index={index}&wait=30s")).await;
            (r, Instant::now())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!held.is_finished(), "held while nothing changes");
    server.register(voice("v1")).await;
    let registered = Instant::now();
    let ((status, new_index, body), answered) = held.await.unwrap();
    let lag = answered.saturating_duration_since(registered);
    assert_eq!(status, 200);
    assert!(new_index.unwrap() > index);
    assert_eq!(
        body["routes"][0]["domain"], "voice.koder.dev",
        "the answer shows the change: {body}"
    );
    assert!(lag < Duration::from_millis(250), "answered {lag:?} after the change");

    // An index already passed is answered at once.
    let started = Instant::now();
    let (status, _, _) = get(&server, &format!("/api/v1/services?index={index}&wait=30s")).await;
    assert_eq!(status, 200);
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn a_held_request_without_a_change_is_answered_at_wait() {
    let server = common::start().await;
    let (_, index, _) = get(&server, "/api/v1/services").await;
    let started = Instant::now();
    let (status, same, _) = get(
        &server,
        &format!("/api/v1/services?index={}&wait=400ms", index.unwrap()),
    )
    .await;
    let took = started.elapsed();
    assert_eq!(status, 200);
    assert_eq!(same, index, "nothing changed");
    assert!(
        took >= Duration::from_millis(400) && took < Duration::from_millis(400 + 25 + 300),
        "answered after {took:?}: wait plus at most a sixteenth of jitter"
    );
}

#[tokio::test]
async fn an_expiry_wakes_a_held_request() {
    let server = common::start().await;
    server
        .register(json!({"id": "brief", "name": "brief", "address": "10.0.0.2", "port": 1, "ttl_ns": 1_000_000_000}))
        .await;
    let (_, index, _) = get(&server, "/api/v1/services").await;
    let started = Instant::now();
    let (_, next, body) = get(&server, &format!("/api/v1/services?index={}&wait=20s", index.unwrap())).await;
    assert!(next > index);
    assert_eq!(body["services"], json!([]), "the expired instance is gone: {body}");
    assert!(started.elapsed() < Duration::from_secs(3), "woken at the lease's end");
}

#[tokio::test]
async fn bad_index_is_400_and_too_many_held_requests_get_429() {
    let server = std::sync::Arc::new(common::start_with(|c| c.watch_max = 2).await);
    for bad in ["index=banana", "index=-1", "index=5&wait=soon"] {
        let (status, _, body) = get(&server, &format!("/api/v1/services?{bad}")).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert_eq!(body["error"], "bad_request", "{body}");
    }
    let (_, index, _) = get(&server, "/api/v1/services").await;
    let path = format!("/api/v1/services?index={}&wait=20s", index.unwrap());
    let held: Vec<_> = (0..2)
        .map(|_| {
            let (server, path) = (server.clone(), path.clone());
            tokio::spawn(async move { get(&server, &path).await.0 })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, _, body) = get(&server, &path).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"], "too_many_watches");
    // Plain reads are never refused.
    assert_eq!(get(&server, "/api/v1/services").await.0, 200);
    // A change answers the two held ones, which frees their slots.
    server.register(voice("v1")).await;
    for h in held {
        assert_eq!(h.await.unwrap(), 200);
    }
    let (status, _, _) = get(&server, &format!("/api/v1/services?index={}&wait=10ms", index.unwrap())).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn shutdown_answers_held_requests_at_once() {
    let server = std::sync::Arc::new(common::start().await);
    let (_, index, _) = get(&server, "/api/v1/services").await;
    let held = {
        let server = server.clone();
        tokio::spawn(async move { get(&server, &format!("/api/v1/services?index={}&wait=5m", index.unwrap())).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    server.running.begin_shutdown();
    let (status, _, _) = tokio::time::timeout(Duration::from_secs(5), held)
        .await
        .expect("answered at shutdown")
        .unwrap();
    assert_eq!(status, 200);
    assert!(started.elapsed() < Duration::from_secs(2));
}

/// Raises this process's soft limit on open files to its hard limit (children inherit it);
/// panics when even that is below `need`, saying what to raise.
fn open_files_at_least(need: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed by reference.
    #[allow(unsafe_code)]
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        limit.rlim_cur = limit.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
    }
    assert!(
        limit.rlim_cur >= need,
        "this test holds {need} connections but `ulimit -Hn` is {}; raise it (e.g. ulimit -n 65536)",
        limit.rlim_cur
    );
}

/// CPU seconds (user + system) and resident bytes of a process, from /proc.
fn cpu_and_rss(pid: u32) -> (f64, u64) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap().split_whitespace().collect();
    // After the command's ')': state is field 3, utime 14 and stime 15 (1-based, proc(5)).
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    (ticks as f64 / 100.0, rss_kib * 1024)
}

/// 10,000 held blocking queries: the server spends no CPU on them while nothing changes,
/// holds each in a few KiB, and answers every one soon after one change.
#[tokio::test]
async fn ten_thousand_held_requests_cost_no_cpu_while_idle_and_all_wake_on_a_change() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const HELD: usize = 10_000;
    open_files_at_least(HELD as u64 + 1024);
    let dir = tempfile::tempdir().unwrap();
    let bound = (HELD + 100).to_string();
    let proc = crate::child::launch_ok(
        dir.path(),
        &[
            "--watch-max",
            &bound,
            "--http-max-connections",
            &bound,
            "--http-max-connections-per-client",
            &bound,
            // Opening 10,000 connections takes longer than the default 10 s for a request.
            "--http-request-timeout",
            "120s",
        ],
    )
    .await;
    let http = crate::common::http();
    let register = |body: Value| {
        http.post(format!("{}/api/v1/services/register", proc.base()))
            .header("X-API-Key", crate::child::KEY)
            .json(&body)
            .send()
    };
    assert_eq!(register(voice("first")).await.unwrap().status(), 200);
    let index: u64 = http
        .get(format!("{}/api/v1/services", proc.base()))
        .header("X-API-Key", crate::child::KEY)
        .send()
        .await
        .unwrap()
        .headers()["x-koder-index"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let pid = proc.child.id();
    let (_, rss_before) = cpu_and_rss(pid);
    let request = format!(
        "GET /api/v1/services?index={index}&wait=5m HTTP/1.1\r\nHost: koder\r\nX-API-Key: {}\r\n\r\n",
        crate::child::KEY
    );
    // The connections first, idle, then a held request on each: what a held request costs
    // beyond its connection (hyper's per-connection buffers are its own).
    let mut held = Vec::with_capacity(HELD);
    for _ in 0..HELD {
        held.push(tokio::net::TcpStream::connect(proc.http).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, rss_connected) = cpu_and_rss(pid);
    for stream in &mut held {
        stream.write_all(request.as_bytes()).await.unwrap();
    }
    // Held once the server's gauge says so.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let gauge = common::sample(&common::scrape(&http, &proc.base()).await, "koder_dns_watches_held");
        if gauge as usize >= HELD {
            break;
        }
        assert!(Instant::now() < deadline, "only {gauge} of {HELD} requests held");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (cpu_start, rss_held) = cpu_and_rss(pid);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (cpu_end, _) = cpu_and_rss(pid);
    let per_connection = rss_connected.saturating_sub(rss_before) / HELD as u64;
    let per_watch = rss_held.saturating_sub(rss_connected) / HELD as u64;
    let idle_cpu = cpu_end - cpu_start;
    eprintln!(
        "{HELD} held: {per_connection} bytes of RSS per open connection, {per_watch} more per held \
         request on it, {idle_cpu:.2} s of CPU in 2 s idle"
    );
    assert!(
        idle_cpu <= 0.1,
        "{idle_cpu} s of CPU in 2 s with {HELD} idle held requests"
    );
    assert!(per_watch <= 16 * 1024, "{per_watch} bytes of RSS per held request");

    let changed = Instant::now();
    assert_eq!(register(voice("second")).await.unwrap().status(), 200);
    let mut answered = 0;
    for stream in &mut held {
        let mut head = [0u8; 12];
        tokio::time::timeout(Duration::from_secs(10), stream.read_exact(&mut head))
            .await
            .expect("every held request answered after the change")
            .unwrap();
        assert_eq!(&head, b"HTTP/1.1 200");
        answered += 1;
    }
    eprintln!(
        "{answered} held requests answered within {:?} of the change",
        changed.elapsed()
    );
}
