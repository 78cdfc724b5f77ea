//! Hardening limits, each crossed: the instance cap, HTTP body size and deadlines, bounded
//! HTTP and DNS TCP connections, DNS TCP idle timeout, UDP response sizing, minimal ANY,
//! and malformed input that must change nothing.

use crate::common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::RecordType;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{KEY, TestServer};

// ---------------------------------------------------------------------------------------
// Helpers.

/// Reads until the peer closes (or resets) the connection; `Err` when `limit` passes first.
/// Returns what was received.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> Result<Vec<u8>, Vec<u8>> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + limit;
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return Err(got),
            Ok(Ok(0)) | Ok(Err(_)) => return Ok(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// The status code of a raw HTTP/1.1 response, if there is a status line.
fn status_of(response: &[u8]) -> Option<u16> {
    let text = String::from_utf8_lossy(response);
    let line = text.lines().next()?;
    let mut parts = line.split_whitespace();
    parts.next().filter(|v| v.starts_with("HTTP/1."))?;
    parts.next()?.parse().ok()
}

/// The JSON body of a raw HTTP/1.1 response (Content-Length or chunked with one chunk).
fn json_of(response: &[u8]) -> Value {
    let text = String::from_utf8_lossy(response);
    let Some((_, body)) = text.split_once("\r\n\r\n") else {
        return Value::Null;
    };
    if let Ok(v) = serde_json::from_str(body) {
        return v;
    }
    // Chunked: "<hex>\r\n<data>\r\n0\r\n\r\n".
    body.split("\r\n")
        .find_map(|part| serde_json::from_str(part).ok())
        .unwrap_or(Value::Null)
}

/// One request over a fresh connection with `Connection: close`; returns the raw response.
async fn raw_request(addr: SocketAddr, request: &[u8]) -> Vec<u8> {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    match read_until_closed(&mut stream, Duration::from_secs(5)).await {
        Ok(got) => got,
        Err(got) => panic!(
            "no complete response within 5s; got {:?}",
            String::from_utf8_lossy(&got)
        ),
    }
}

fn http_addr(server: &TestServer) -> SocketAddr {
    server.running.http_addr
}

fn assert_json_error(body: &Value, code: &str) {
    assert_eq!(body["error"], json!(code), "JSON error {code:?} expected: {body}");
    assert!(
        body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "error has a message: {body}"
    );
}

/// Registers every body concurrently; returns the statuses in order.
async fn register_concurrently(server: &TestServer, bodies: Vec<Value>) -> Vec<u16> {
    let mut tasks = tokio::task::JoinSet::new();
    for (i, body) in bodies.into_iter().enumerate() {
        let (client, url) = (server.http.clone(), server.url("/api/v1/services/register"));
        tasks.spawn(async move {
            let r = client
                .post(url)
                .header("X-API-Key", KEY)
                .json(&body)
                .send()
                .await
                .expect("register");
            (i, r.status().as_u16())
        });
    }
    let mut out = vec![0; tasks.len()];
    while let Some(r) = tasks.join_next().await {
        let (i, status) = r.unwrap();
        out[i] = status;
    }
    out
}

fn reg(i: usize) -> Value {
    json!({ "id": format!("i-{i}"), "name": "capped", "address": format!("10.3.0.{}", i + 1), "port": 7000 + i })
}

// ---------------------------------------------------------------------------------------
// The instance cap.

#[tokio::test]
async fn max_instances_gives_507_but_updates_and_freed_slots_still_work() {
    let server = common::start_with(|c| c.max_instances = 5).await;
    for i in 0..5 {
        let r = server.register(reg(i)).await;
        assert_eq!(r["created"], json!(true));
    }
    let (status, body) = server.post("/api/v1/services/register", &reg(5)).await;
    assert_eq!(status, 507, "the 6th new instance: {body}");
    assert_json_error(&body, "registry_full");
    assert_eq!(server.detail().await["instances"].as_array().unwrap().len(), 5);
    assert!(
        server
            .query_tcp("_capped._tcp.service.koder.", RecordType::SRV)
            .await
            .answers
            .len()
            == 5
    );

    // Re-registering an existing id is an update, not a new instance.
    let mut update = reg(0);
    update["port"] = json!(7999);
    let (status, body) = server.post("/api/v1/services/register", &update).await;
    assert_eq!(status, 200, "re-registering an existing id at the cap: {body}");
    assert_eq!(body["created"], json!(false));
    let (status, _) = server.post("/api/v1/services/heartbeat", &json!({"id": "i-1"})).await;
    assert_eq!(status, 200, "heartbeats work at the cap");

    // A deregistration frees a slot.
    let (status, body) = server.post("/api/v1/services/deregister", &json!({"id": "i-2"})).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = server.post("/api/v1/services/register", &reg(5)).await;
    assert_eq!(status, 200, "a new instance fits after a deregistration: {body}");
    assert_eq!(body["created"], json!(true));
    let (status, body) = server.post("/api/v1/services/register", &reg(6)).await;
    assert_eq!(status, 507, "and the cap holds again: {body}");
    let ids: Vec<String> = server.detail().await["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, vec!["i-0", "i-1", "i-3", "i-4", "i-5"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_registrations_never_overshoot_the_cap() {
    let server = common::start_with(|c| c.max_instances = 5).await;
    let statuses = register_concurrently(&server, (0..40).map(reg).collect()).await;
    let ok = statuses.iter().filter(|s| **s == 200).count();
    let full = statuses.iter().filter(|s| **s == 507).count();
    assert_eq!((ok, full), (5, 35), "exactly the cap succeeds: {statuses:?}");
    assert_eq!(server.detail().await["instances"].as_array().unwrap().len(), 5);
}

#[tokio::test]
async fn expired_instances_do_not_count_against_the_cap_before_the_reaper_runs() {
    // The reaper's interval is the default 30s: only a reap before refusing frees the slots.
    let (server, clock) = common::start_manual(|c| c.max_instances = 3).await;
    for i in 0..3 {
        let mut body = reg(i);
        body["ttl_ns"] = json!(1_000_000_000i64);
        server.register(body).await;
    }
    let (status, body) = server.post("/api/v1/services/register", &reg(3)).await;
    assert_eq!(status, 507, "the cap holds while the three are alive: {body}");
    clock.advance(Duration::from_secs(2));
    let (status, body) = server.post("/api/v1/services/register", &reg(3)).await;
    assert_eq!(
        status, 200,
        "three expired instances must not crowd out a live one: {body}"
    );
    let ids: Vec<Value> = server.detail().await["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].clone())
        .collect();
    assert_eq!(ids, vec![json!("i-3")]);
}

// ---------------------------------------------------------------------------------------
// Per-instance bounds: metadata, tags and the lease.

#[tokio::test]
async fn oversized_metadata_and_tags_get_400_naming_the_field_and_limit_and_change_nothing() {
    let server = common::start().await;
    let base = json!({"id": "bounded", "name": "bounded", "address": "10.9.0.1", "port": 80});
    let with = |field: &str, value: Value| {
        let mut body = base.clone();
        body[field] = value;
        body
    };
    let many = |n: usize, len: usize| -> Value {
        (0..n)
            .map(|i| (format!("k{i:03}"), Value::String("v".repeat(len))))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    let cases = [
        (with("metadata", many(65, 1)), "metadata", "64"),
        (with("metadata", json!({ "k".repeat(129): "v" })), "metadata", "128"),
        (with("metadata", json!({ "": "v" })), "metadata", "128"),
        (
            with("metadata", json!({ "big": "v".repeat(513) })),
            "metadata.big",
            "512",
        ),
        (
            with("tags", json!((0..65).map(|i| format!("t{i}")).collect::<Vec<_>>())),
            "tags",
            "64",
        ),
        (with("tags", json!(["ok", "t".repeat(257)])), "tags[1]", "256"),
    ];
    for (body, field, limit) in cases {
        let (status, response) = server.post("/api/v1/services/register", &body).await;
        assert_eq!(status, 400, "{field}: {response}");
        assert_json_error(&response, "invalid_field");
        let message = response["message"].as_str().unwrap();
        assert!(
            message.starts_with(&format!("{field}:")) && message.contains(limit),
            "the message names {field} and its limit {limit}: {message}"
        );
    }
    assert_eq!(server.detail().await["instances"], json!([]), "nothing was stored");
    // Exactly at every limit is accepted.
    let mut body = with("metadata", many(64, 512));
    body["tags"] = json!((0..64).map(|i| format!("{i}{}", "t".repeat(250))).collect::<Vec<_>>());
    server.register(body).await;
    let mut body = base.clone();
    body["id"] = json!("long-key");
    body["metadata"] = json!({ "k".repeat(128): "v" });
    server.register(body).await;
    assert_eq!(server.detail().await["instances"].as_array().unwrap().len(), 2);
}

#[tokio::test]
async fn ttl_outside_min_and_max_gets_400_naming_ttl_ns_and_the_bounds() {
    let server = common::start_with(|c| {
        c.min_ttl = Duration::from_secs(2);
        c.max_ttl = Duration::from_secs(60);
    })
    .await;
    let body =
        |id: &str, ttl: i64| json!({"id": id, "name": "leased", "address": "10.9.0.2", "port": 80, "ttl_ns": ttl});
    for ttl in [1, 1_999_999_999, 60_000_000_001, i64::MAX] {
        let (status, response) = server.post("/api/v1/services/register", &body("bad", ttl)).await;
        assert_eq!(status, 400, "ttl_ns {ttl}: {response}");
        let message = response["message"].as_str().unwrap();
        assert!(
            message.starts_with("ttl_ns:") && message.contains("2000000000") && message.contains("60000000000"),
            "names ttl_ns and both bounds: {message}"
        );
    }
    assert_eq!(server.detail().await["instances"], json!([]));
    for (id, ttl) in [
        ("min", 2_000_000_000),
        ("max", 60_000_000_000),
        ("default", 0),
        ("negative", -5),
    ] {
        server.register(body(id, ttl)).await;
    }
    assert_eq!(server.detail().await["instances"].as_array().unwrap().len(), 4);
}

// ---------------------------------------------------------------------------------------
// HTTP limits.

/// A registration of `len` bytes: padded with trailing white space, since no one field may
/// be large enough to fill 64 KiB.
fn padded_body(len: usize) -> String {
    let body = r#"{"name":"pad","address":"10.4.0.1","port":80}"#;
    assert!(len >= body.len());
    format!("{body}{}", " ".repeat(len - body.len()))
}

#[tokio::test]
async fn body_over_64k_is_413() {
    let server = common::start().await;
    let register = server.url("/api/v1/services/register");
    let send = |body: String| server.send(server.http.post(&register).header("X-API-Key", KEY).body(body));

    let (status, body) = send(padded_body(64 * 1024)).await;
    assert_eq!(status, 200, "a body of exactly 64 KiB is accepted: {body}");
    let (status, body) = send(padded_body(64 * 1024 + 1)).await;
    assert_eq!(status, 413, "64 KiB + 1: {body}");
    assert_json_error(&body, "payload_too_large");
    let (status, body) = send(padded_body(1024 * 1024)).await;
    assert_eq!(status, 413, "1 MiB: {body}");
    assert_json_error(&body, "payload_too_large");
    assert_eq!(server.detail().await["instances"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn chunked_body_over_64k_is_413() {
    let server = common::start().await;
    let body = padded_body(80 * 1024);
    let mut request = format!(
        "POST /api/v1/services/register HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY}\r\nContent-Type: application/json\r\n\
         Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
    )
    .into_bytes();
    for chunk in body.as_bytes().chunks(8192) {
        request.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        request.extend_from_slice(chunk);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    let response = raw_request(http_addr(&server), &request).await;
    assert_eq!(
        status_of(&response),
        Some(413),
        "{}",
        String::from_utf8_lossy(&response)
    );
    assert_json_error(&json_of(&response), "payload_too_large");

    // A small chunked body is fine, so the 413 above is about the size.
    let small = br#"{"name":"chunky","address":"10.4.0.2","port":81}"#;
    let mut request = format!(
        "POST /api/v1/services/register HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n{:x}\r\n",
        small.len()
    )
    .into_bytes();
    request.extend_from_slice(small);
    request.extend_from_slice(b"\r\n0\r\n\r\n");
    let response = raw_request(http_addr(&server), &request).await;
    assert_eq!(
        status_of(&response),
        Some(200),
        "{}",
        String::from_utf8_lossy(&response)
    );
    let ids: Vec<Value> = server.detail().await["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].clone())
        .collect();
    assert_eq!(ids, vec![json!("chunky")]);
}

#[tokio::test]
async fn huge_content_length_is_413_without_waiting_for_the_body() {
    let server = common::start_with(|c| c.http_request_timeout = Duration::from_secs(3)).await;
    let mut stream = TcpStream::connect(http_addr(&server)).await.unwrap();
    let head = format!(
        "POST /api/v1/services/register HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY}\r\nContent-Length: 10000000\r\nConnection: close\r\n\r\n{{\"name\":"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let response = read_until_closed(&mut stream, Duration::from_secs(5))
        .await
        .unwrap_or_else(|got| got);
    assert_eq!(
        status_of(&response),
        Some(413),
        "a declared Content-Length over 64 KiB must be refused from the header; got after {:?}: {}",
        started.elapsed(),
        String::from_utf8_lossy(&response)
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "answered from the header, not after the deadline: {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn slowloris_partial_header_is_closed_after_the_request_timeout() {
    let timeout = Duration::from_millis(500);
    let server = common::start_with(|c| c.http_request_timeout = timeout).await;
    let mut stream = TcpStream::connect(http_addr(&server)).await.unwrap();
    let started = Instant::now();
    stream
        .write_all(b"POST /api/v1/services/register HTTP/1.1\r\nHost: x\r\nX-API-")
        .await
        .unwrap();
    let got = read_until_closed(&mut stream, timeout + Duration::from_millis(1500))
        .await
        .unwrap_or_else(|_| {
            panic!(
                "a partial header still holds the connection {:?} later",
                started.elapsed()
            )
        });
    let elapsed = started.elapsed();
    assert!(
        elapsed >= timeout - Duration::from_millis(100),
        "closed after {elapsed:?}, before the timeout"
    );
    if let Some(status) = status_of(&got) {
        assert_eq!(status, 408, "{}", String::from_utf8_lossy(&got));
    }
    // And the server still answers others.
    assert_eq!(server.get("/api/v1/services").await.0, 200);
}

#[tokio::test]
async fn slowloris_header_dripped_byte_by_byte_is_closed_after_the_request_timeout() {
    let timeout = Duration::from_millis(500);
    let server = common::start_with(|c| c.http_request_timeout = timeout).await;
    let stream = TcpStream::connect(http_addr(&server)).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let started = Instant::now();
    let dripper = tokio::spawn(async move {
        // An endless header, one byte every 50ms.
        for b in b"GET /healthz HTTP/1.1\r\nX-Slow: "
            .iter()
            .copied()
            .chain(std::iter::repeat(b'a'))
        {
            if write.write_all(&[b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(timeout + Duration::from_millis(1500), async {
        loop {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
    dripper.abort();
    assert!(
        closed.is_ok(),
        "a dripping header still holds the connection {:?} later",
        started.elapsed()
    );
}

#[tokio::test]
async fn idle_connection_that_sends_nothing_is_closed_after_the_request_timeout() {
    // Otherwise http_max_connections idle sockets would shut everyone else out for good.
    let timeout = Duration::from_millis(500);
    let server = common::start_with(|c| c.http_request_timeout = timeout).await;
    let mut stream = TcpStream::connect(http_addr(&server)).await.unwrap();
    let started = Instant::now();
    let closed = read_until_closed(&mut stream, timeout + Duration::from_millis(1500)).await;
    assert!(
        closed.is_ok(),
        "a connection that never sends a byte is still open {:?} later",
        started.elapsed()
    );
}

#[tokio::test]
async fn idle_keep_alive_connection_is_closed_after_the_request_timeout() {
    let timeout = Duration::from_millis(500);
    let server = common::start_with(|c| c.http_request_timeout = timeout).await;
    let mut stream = TcpStream::connect(http_addr(&server)).await.unwrap();
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status_of(&buf[..n]), Some(200));
    let started = Instant::now();
    let closed = read_until_closed(&mut stream, timeout + Duration::from_millis(1500)).await;
    assert!(
        closed.is_ok(),
        "an idle keep-alive connection is still open {:?} after its last response",
        started.elapsed()
    );
}

#[tokio::test]
async fn body_trickling_slower_than_the_deadline_gets_408_and_changes_nothing() {
    let timeout = Duration::from_millis(500);
    let server = common::start_with(|c| c.http_request_timeout = timeout).await;
    let body = br#"{"name":"slow","address":"10.4.0.9","port":99}"#;
    let stream = TcpStream::connect(http_addr(&server)).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let head = format!(
        "POST /api/v1/services/register HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    write.write_all(head.as_bytes()).await.unwrap();
    let started = Instant::now();
    let trickle = tokio::spawn(async move {
        for b in body.iter() {
            tokio::time::sleep(Duration::from_millis(60)).await; // ~2.9s for the whole body
            if write.write_all(&[*b]).await.is_err() {
                return;
            }
        }
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let outcome = tokio::time::timeout(timeout + Duration::from_millis(1500), async {
        loop {
            match read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
            if status_of(&got).is_some() && got.windows(4).any(|w| w == b"\r\n\r\n") && json_of(&got) != Value::Null {
                break;
            }
        }
    })
    .await;
    trickle.abort();
    assert!(
        outcome.is_ok(),
        "a trickling body still holds the request {:?} later",
        started.elapsed()
    );
    // Closed without an answer is acceptable; an answer must be the JSON 408.
    if let Some(status) = status_of(&got) {
        assert_eq!(status, 408, "{}", String::from_utf8_lossy(&got));
        assert_json_error(&json_of(&got), "request_timeout");
    }
    eprintln!("trickling body: {:?}", status_of(&got));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        server.detail().await["instances"],
        json!([]),
        "the timed-out registration was not applied"
    );
}

#[tokio::test]
async fn http_max_connections_makes_the_next_client_wait_for_a_free_slot() {
    let server = common::start_with(|c| c.http_max_connections = 4).await;
    let addr = http_addr(&server);
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut fifth = TcpStream::connect(addr).await.unwrap();
    fifth
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let early = read_until_closed(&mut fifth, Duration::from_millis(300)).await;
    assert!(
        matches!(&early, Err(got) if got.is_empty()),
        "the 5th connection was answered while 4 were held: {early:?}"
    );
    drop(idle.pop());
    let response = read_until_closed(&mut fifth, Duration::from_secs(3))
        .await
        .unwrap_or_else(|got| panic!("the 5th connection was not answered after a slot freed: {got:?}"));
    assert_eq!(
        status_of(&response),
        Some(200),
        "{}",
        String::from_utf8_lossy(&response)
    );
}

#[tokio::test]
async fn one_client_holding_its_limit_of_connections_does_not_block_others() {
    let server = common::start_with(|c| {
        c.http_max_connections = 8;
        c.http_max_connections_per_client = 4;
    })
    .await;
    let addr = http_addr(&server);
    // 127.0.0.1 opens more slow connections than the server has slots.
    let mut hog = Vec::new();
    for _ in 0..12 {
        hog.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut closed = 0;
    for stream in &mut hog {
        let mut byte = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(50), stream.read(&mut byte)).await {
            closed += 1;
        }
    }
    assert_eq!(
        closed, 8,
        "the connections beyond the per-client limit of 4 are closed at once"
    );
    // Another client address is served at once.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut other = socket.connect(addr).await.unwrap();
    other
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let response = read_until_closed(&mut other, Duration::from_secs(1))
        .await
        .unwrap_or_else(|got| panic!("another client waited behind the hog: {got:?}"));
    assert_eq!(status_of(&response), Some(200));
}

// ---------------------------------------------------------------------------------------
// DNS over TCP.

async fn tcp_send(stream: &mut TcpStream, message: &Message) {
    let bytes = message.to_vec().unwrap();
    stream.write_all(&(bytes.len() as u16).to_be_bytes()).await.unwrap();
    stream.write_all(&bytes).await.unwrap();
}

async fn tcp_recv(stream: &mut TcpStream, limit: Duration) -> Option<Message> {
    tokio::time::timeout(limit, async {
        let mut len = [0u8; 2];
        stream.read_exact(&mut len).await.ok()?;
        let mut reply = vec![0u8; u16::from_be_bytes(len) as usize];
        stream.read_exact(&mut reply).await.ok()?;
        Message::from_vec(&reply).ok()
    })
    .await
    .ok()
    .flatten()
}

#[tokio::test]
async fn dns_tcp_idle_connection_is_closed_after_the_idle_timeout() {
    let idle = Duration::from_millis(300);
    let server = common::start_with(|c| c.dns_tcp_idle_timeout = idle).await;
    server
        .register(json!({"name": "voice", "address": "10.5.0.1", "port": 5060}))
        .await;

    // Silent from the start.
    let mut stream = TcpStream::connect(server.dns()).await.unwrap();
    let started = Instant::now();
    assert!(
        read_until_closed(&mut stream, idle + Duration::from_millis(1000))
            .await
            .is_ok(),
        "silent connection kept open"
    );
    assert!(
        started.elapsed() >= idle - Duration::from_millis(50),
        "closed after {:?}, before the idle timeout",
        started.elapsed()
    );

    // Answers queries while they keep coming, then closes once they stop.
    let mut stream = TcpStream::connect(server.dns()).await.unwrap();
    for i in 0..4 {
        if i > 0 {
            tokio::time::sleep(idle * 2 / 3).await;
        }
        tcp_send(
            &mut stream,
            &common::query_message("_voice._tcp.service.koder.", RecordType::SRV, None),
        )
        .await;
        let reply = tcp_recv(&mut stream, Duration::from_secs(2))
            .await
            .expect("answered on the open connection");
        assert_eq!(reply.answers.len(), 1);
    }
    let started = Instant::now();
    assert!(
        read_until_closed(&mut stream, idle + Duration::from_millis(1000))
            .await
            .is_ok(),
        "connection kept open after queries stopped"
    );
    assert!(started.elapsed() >= idle - Duration::from_millis(50));

    // A frame started but never finished.
    let mut stream = TcpStream::connect(server.dns()).await.unwrap();
    stream.write_all(&[0x00, 0x40, 0x12, 0x34]).await.unwrap();
    assert!(
        read_until_closed(&mut stream, idle + Duration::from_millis(1000))
            .await
            .is_ok(),
        "half a frame held the connection"
    );
}

#[tokio::test]
async fn dns_tcp_max_connections_makes_the_next_client_wait() {
    let server = common::start_with(|c| c.dns_tcp_max_connections = 2).await;
    server
        .register(json!({"name": "voice", "address": "10.5.0.1", "port": 5060}))
        .await;
    let mut held = vec![
        TcpStream::connect(server.dns()).await.unwrap(),
        TcpStream::connect(server.dns()).await.unwrap(),
    ];
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut third = TcpStream::connect(server.dns()).await.unwrap();
    tcp_send(
        &mut third,
        &common::query_message("_voice._tcp.service.koder.", RecordType::SRV, None),
    )
    .await;
    assert!(
        tcp_recv(&mut third, Duration::from_millis(300)).await.is_none(),
        "the 3rd connection was answered while 2 were held"
    );
    // UDP is not affected by the TCP bound.
    assert_eq!(
        server
            .query("_voice._tcp.service.koder.", RecordType::SRV)
            .await
            .answers
            .len(),
        1
    );
    drop(held.pop());
    let reply = tcp_recv(&mut third, Duration::from_secs(3))
        .await
        .expect("answered once a slot freed");
    assert_eq!(reply.answers.len(), 1);
}

// ---------------------------------------------------------------------------------------
// DNS over UDP: sizes.

/// The query with its OPT record's payload size set to `payload` verbatim (hickory clamps
/// values below 512 when building, so small ones are patched into the wire form).
fn query_bytes(name: &str, rtype: RecordType, payload: Option<u16>) -> Vec<u8> {
    let mut bytes = common::query_message(name, rtype, payload.map(|p| p.max(512)))
        .to_vec()
        .unwrap();
    if let Some(p) = payload {
        // The OPT record is last: root name (1), TYPE (2), CLASS = payload (2), TTL (4), RDLEN (2).
        let n = bytes.len();
        assert_eq!(&bytes[n - 11..n - 8], &[0, 0, 41], "OPT record at the end");
        bytes[n - 8..n - 6].copy_from_slice(&p.to_be_bytes());
    }
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn udp_responses_never_exceed_the_client_buffer() {
    let server = common::start().await;
    let statuses = register_concurrently(&server, common::instances("big", 300)).await;
    assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    let srv = server.query_tcp("_big._tcp.service.koder.", RecordType::SRV).await;
    assert_eq!(srv.answers.len(), 300, "TCP returns every record");
    assert!(!srv.metadata.truncation);

    // At most the client's buffer, and never above --dns-udp-max-payload (default 1232).
    let cases: [(Option<u16>, usize); 7] = [
        (None, 512),
        (Some(100), 512),
        (Some(512), 512),
        (Some(1232), 1232),
        (Some(1400), 1232),
        (Some(4096), 1232),
        (Some(65535), 1232),
    ];
    for (name, rtype) in [
        ("_big._tcp.service.koder.", RecordType::SRV),
        ("big.service.koder.", RecordType::A),
        ("big.service.koder.", RecordType::TXT),
    ] {
        for (payload, limit) in cases {
            let bytes = query_bytes(name, rtype, payload);
            let raw = common::udp_raw(server.dns(), &bytes, Duration::from_secs(3))
                .await
                .expect("UDP answer");
            assert!(
                raw.len() <= limit,
                "{rtype} {name} with buffer {payload:?}: {} bytes > {limit}",
                raw.len()
            );
            let reply =
                Message::from_vec(&raw).unwrap_or_else(|e| panic!("{rtype} with buffer {payload:?}: undecodable: {e}"));
            assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
            assert!(
                reply.metadata.truncation,
                "{rtype} with buffer {payload:?}: 300 records do not fit, so TC is set"
            );
            assert_eq!(
                reply.edns.is_some(),
                payload.is_some(),
                "EDNS in the answer iff in the question"
            );
            // Never a partial RRset: TC comes with an empty answer (RFC 2181 §9).
            assert!(
                reply.answers.is_empty() && reply.additionals.is_empty(),
                "{rtype} with buffer {payload:?}: TC with records"
            );
        }
    }
}

#[tokio::test]
async fn any_is_answered_minimally() {
    let server = common::start().await;
    let statuses = register_concurrently(&server, common::instances("many", 50)).await;
    assert!(statuses.iter().all(|s| *s == 200));
    for name in [
        "many.service.koder.",
        "_many._tcp.service.koder.",
        "service.koder.",
        "ns.service.koder.",
    ] {
        for payload in [None, Some(4096)] {
            let raw = common::udp_raw(
                server.dns(),
                &query_bytes(name, RecordType::ANY, payload),
                Duration::from_secs(3),
            )
            .await
            .expect("UDP answer");
            let reply = Message::from_vec(&raw).unwrap();
            assert_eq!(reply.metadata.response_code, ResponseCode::NoError, "ANY {name}");
            assert_eq!(
                reply.answers.len(),
                1,
                "ANY {name}: one record, not every RRset: {:?}",
                reply.answers
            );
            assert_eq!(
                reply.answers[0].record_type(),
                RecordType::HINFO,
                "ANY {name}: RFC 8482 HINFO"
            );
            assert!(
                reply.additionals.is_empty(),
                "ANY {name}: nothing extra: {:?}",
                reply.additionals
            );
            assert!(!reply.metadata.truncation);
            assert!(raw.len() < 200, "ANY {name}: a small response, got {} bytes", raw.len());
        }
        let reply = server.query_tcp(name, RecordType::ANY).await;
        assert_eq!(reply.answers.len(), 1, "ANY {name} over TCP is minimal too");
    }
    for name in ["nosuch.service.koder.", "_nosuch._tcp.service.koder."] {
        let reply = server.query(name, RecordType::ANY).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain, "ANY {name}");
        assert!(reply.answers.is_empty());
    }
}

// ---------------------------------------------------------------------------------------
// Malformed input.

fn garbage_packets(rng: &mut fastrand::Rng) -> Vec<Vec<u8>> {
    let valid = common::query_message("_voice._tcp.service.koder.", RecordType::SRV, Some(1232))
        .to_vec()
        .unwrap();
    let mut packets: Vec<Vec<u8>> = vec![
        vec![],
        vec![0],
        vec![0x12, 0x34],
        vec![0; 12],
        // Header claims 1 question, 65535 answers, nothing follows.
        vec![0xab, 0xcd, 0x01, 0x00, 0x00, 0x01, 0xff, 0xff, 0, 0, 0, 0],
        // Question name that is a compression pointer to itself.
        vec![
            0xab, 0xce, 0x01, 0x00, 0x00, 0x01, 0, 0, 0, 0, 0, 0, 0xc0, 0x0c, 0x00, 0x21, 0x00, 0x01,
        ],
        // A label longer than the packet.
        vec![0xab, 0xcf, 0x01, 0x00, 0x00, 0x01, 0, 0, 0, 0, 0, 0, 0x3f, b'a', b'b'],
        vec![0xff; 600],
    ];
    // A response (QR=1) and other opcodes/flags on a valid query.
    for flags in [0x80u8, 0x78, 0x7f, 0xff] {
        let mut p = valid.clone();
        p[2] = flags;
        packets.push(p);
    }
    // The valid query cut at every length, and with random bytes flipped.
    for cut in 0..valid.len() {
        packets.push(valid[..cut].to_vec());
    }
    for _ in 0..300 {
        let mut p = valid.clone();
        for _ in 0..rng.usize(1..6) {
            let i = rng.usize(..p.len());
            p[i] = rng.u8(..);
        }
        packets.push(p);
    }
    for _ in 0..1000 {
        let len = rng.usize(0..700);
        packets.push((0..len).map(|_| rng.u8(..)).collect());
    }
    packets
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn garbage_dns_changes_nothing_and_normal_queries_still_work() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.5.0.1", "port": 5060}))
        .await;
    let serial_before = server.serial().await;
    let mut rng = fastrand::Rng::with_seed(0x5eed);
    let packets = garbage_packets(&mut rng);

    // UDP: one socket fires everything without waiting.
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    for p in &packets {
        let _ = socket.send_to(p, server.dns()).await;
    }
    // Whatever comes back must be a decodable DNS message (FORMERR and friends).
    let mut buf = vec![0u8; 65535];
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(200), socket.recv(&mut buf)).await {
        assert!(n >= 12, "a reply shorter than a DNS header: {:?}", &buf[..n]);
        assert!(buf[2] & 0x80 != 0, "every reply is a response (QR=1)");
    }
    drop(socket);

    // TCP: garbage frames on several connections, some cut mid-frame.
    for (i, chunk) in packets.chunks(50).enumerate() {
        let Ok(mut stream) = TcpStream::connect(server.dns()).await else {
            panic!("connect")
        };
        let mut frames = Vec::new();
        for p in chunk {
            frames.extend_from_slice(&(p.len() as u16).to_be_bytes());
            frames.extend_from_slice(p);
        }
        if i % 3 == 0 {
            frames.extend_from_slice(&[0xff, 0xff, 1, 2, 3]); // promises 65535 bytes, sends 3
        }
        let _ = stream.write_all(&frames).await;
        let _ = stream.shutdown().await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut sink)).await;
    }

    for _ in 0..3 {
        let reply = server.query("_voice._tcp.service.koder.", RecordType::SRV).await;
        assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
        assert_eq!(reply.answers.len(), 1);
        let reply = server.query_tcp("_voice._tcp.service.koder.", RecordType::SRV).await;
        assert_eq!(reply.answers.len(), 1);
        let reply = server.query("voice.service.koder.", RecordType::A).await;
        assert_eq!(reply.answers.len(), 1);
    }
    assert_eq!(server.serial().await, serial_before, "garbage changed the zone serial");
    assert_eq!(server.detail().await["instances"].as_array().unwrap().len(), 1);
}

/// A JSON value of random shape, up to `depth` deep.
fn random_json(rng: &mut fastrand::Rng, depth: u32) -> Value {
    let keys = [
        "id", "name", "address", "port", "protocol", "tags", "metadata", "weight", "priority", "healthy", "ttl_ns",
        "x", "",
    ];
    match rng.u8(..if depth == 0 { 6 } else { 8 }) {
        0 => Value::Null,
        1 => json!(rng.bool()),
        2 => json!(rng.i64(..)),
        3 => json!(rng.f64() * 1e6 - 5e5),
        4 => json!((0..rng.usize(0..20)).map(|_| rng.char(..)).collect::<String>()),
        5 => json!(
            [
                "10.0.0.1",
                "-bad-",
                "",
                "a.b.c",
                "::1",
                "999.1.1.1",
                "UPPER",
                "with space"
            ][rng.usize(..8)]
        ),
        6 => Value::Array((0..rng.usize(0..4)).map(|_| random_json(rng, depth - 1)).collect()),
        _ => Value::Object(
            (0..rng.usize(0..8))
                .map(|_| (keys[rng.usize(..keys.len())].to_owned(), random_json(rng, depth - 1)))
                .collect(),
        ),
    }
}

/// A registration body that is certainly invalid: random, with the port made wrong.
fn invalid_registration(rng: &mut fastrand::Rng) -> Value {
    let mut body = random_json(rng, 3);
    if let Value::Object(map) = &mut body {
        let bad_ports = [
            json!(0),
            json!(-1),
            json!(65536),
            json!("80"),
            json!(80.5),
            json!(null),
            json!([80]),
            json!({"p": 80}),
            json!(1e12),
        ];
        match rng.u8(..3) {
            0 => {
                map.remove("port");
            }
            _ => {
                map.insert("port".into(), bad_ports[rng.usize(..bad_ports.len())].clone());
            }
        }
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn malformed_registrations_change_nothing() {
    let server = common::start().await;
    server
        .register(json!({"id": "keep", "name": "voice", "address": "10.5.0.1", "port": 5060, "metadata": {"a": "b"}}))
        .await;
    let before = server.detail().await;
    let serial_before = server.serial().await;
    let register = server.url("/api/v1/services/register");

    let mut crafted: Vec<Value> = vec![
        json!({}),
        json!([]),
        json!(null),
        json!("register me"),
        json!(42),
        json!({"name": "", "address": "10.0.0.1", "port": 80}),
        json!({"name": "-bad", "address": "10.0.0.1", "port": 80}),
        json!({"name": "a".repeat(64), "address": "10.0.0.1", "port": 80}),
        json!({"name": "ok", "address": "", "port": 80}),
        json!({"name": "ok", "address": "999.1.1.1", "port": 80}),
        json!({"name": "ok", "address": "10.0.0.1", "port": 0}),
        json!({"name": "ok", "address": "10.0.0.1", "port": 65536}),
        json!({"name": "ok", "address": "10.0.0.1", "port": "80"}),
        json!({"name": "ok", "address": "10.0.0.1", "port": 80, "weight": 65536}),
        json!({"name": "ok", "address": "10.0.0.1", "port": 80, "priority": -1}),
        json!({"name": "ok", "address": "10.0.0.1", "port": 80, "protocol": "t c p"}),
        json!({"name": "ok", "address": "10.0.0.1", "port": 80, "id": "x".repeat(256)}),
        json!({"name": "ok", "address": "10.0.0.1", "port": 80, "id": "bad\u{7}id"}),
        json!({"name": "ok", "address": "10.0.0.1", "port": 80, "healthy": "yes"}),
        json!({"name": "ok", "address": "10.0.0.1", "port": 80, "ttl_ns": "1s"}),
        json!({"name": "ok", "address": "10.0.0.1", "port": 80, "tags": "a,b"}),
        json!({"name": "ok", "address": "10.0.0.1", "port": 80, "metadata": {"n": 1}}),
        json!({"name": "ok", "address": "10.0.0.1", "port": 80, "metadata": ["a"]}),
        // The existing id, with a bad field: must not touch "keep".
        json!({"id": "keep", "name": "voice", "address": "10.5.0.1", "port": 70000}),
        json!({"id": "keep", "name": "voice", "address": "not an address!", "port": 5060}),
        json!({"id": "keep", "name": "Bad_Name", "address": "10.5.0.1", "port": 5060}),
    ];
    let mut rng = fastrand::Rng::with_seed(42);
    crafted.extend((0..300).map(|_| invalid_registration(&mut rng)));
    for body in &crafted {
        let (status, response) = server
            .send(server.http.post(&register).header("X-API-Key", KEY).json(body))
            .await;
        assert_eq!(status, 400, "{body} -> {response}");
        assert!(
            response["error"].is_string() && response["message"].is_string(),
            "{body} -> {response}"
        );
    }

    // Bytes that are not JSON at all.
    // Deep, but under the 64 KiB limit, so the parser (not the size check) must cope.
    let deep_array = "[".repeat(60_000);
    let deep_object = "{\"a\":".repeat(12_000);
    let raw: Vec<Vec<u8>> = vec![
        b"".to_vec(),
        b"{".to_vec(),
        b"{\"name\":\"x\",".to_vec(),
        b"\xef\xbb\xbf{\"name\":\"voice\",\"address\":\"10.0.0.2\",\"port\":1}".to_vec(),
        b"{\"name\":\"voice\",\"address\":\"10.0.0.2\",\"port\":1} trailing".to_vec(),
        b"{\"name\":\"voice\",\"address\":\"10.0.0.2\",\"port\":1e400}".to_vec(),
        b"{\"name\":\"voice\",\"address\":\"10.0.0.2\",\"port\":NaN}".to_vec(),
        b"\xff\xfe\x00garbage".to_vec(),
        b"{\"name\":\"vo\xffice\",\"address\":\"10.0.0.2\",\"port\":1}".to_vec(),
        b"name=voice&address=10.0.0.2&port=1".to_vec(),
        deep_array.into_bytes(),
        deep_object.into_bytes(),
    ];
    for body in raw {
        let shown = String::from_utf8_lossy(&body[..body.len().min(60)]).into_owned();
        let (status, response) = server
            .send(server.http.post(&register).header("X-API-Key", KEY).body(body))
            .await;
        assert_eq!(status, 400, "{shown:?} -> {response}");
        assert!(response["error"].is_string(), "{shown:?} -> {response}");
    }

    // Heartbeat and deregister with ids that are not strings.
    for body in [
        json!({"id": 5}),
        json!({"id": ["keep"]}),
        json!({"id": {"id": "keep"}}),
        json!({"id": null}),
        json!([]),
        json!("keep"),
    ] {
        for route in ["/api/v1/services/heartbeat", "/api/v1/services/deregister"] {
            let (status, response) = server.post(route, &body).await;
            assert_eq!(status, 400, "{route} {body} -> {response}");
        }
    }

    // Garbage at the HTTP level.
    for request in [
        &b"GARBAGE\r\n\r\n"[..],
        b"POST / HTTP/9.9\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    ] {
        let mut stream = TcpStream::connect(http_addr(&server)).await.unwrap();
        stream.write_all(request).await.unwrap();
        let got = read_until_closed(&mut stream, Duration::from_secs(3)).await;
        if let Ok(got) | Err(got) = &got
            && let Some(status) = status_of(got)
        {
            assert!(
                (400..500).contains(&status),
                "{:?} -> {status}",
                String::from_utf8_lossy(request)
            );
        }
    }

    assert_eq!(server.detail().await, before, "malformed input changed the registry");
    assert_eq!(
        server.serial().await,
        serial_before,
        "malformed input changed the zone serial"
    );
    assert_eq!(
        server
            .query("_voice._tcp.service.koder.", RecordType::SRV)
            .await
            .answers
            .len(),
        1
    );
}
