//! `GET /metrics` against the real binary (the counters are per process, so each test has a
//! process of its own): every counter moves by exactly what the test did.

use std::net::SocketAddr;
use std::time::Duration;

use hickory_proto::rr::RecordType;
use serde_json::{Value, json};

use crate::child::{KEY, Proc, launch_ok};
use crate::common::{query_message, sample, scrape, tcp_query, udp_query};

async fn post(client: &reqwest::Client, proc: &Proc, path: &str, body: Value) -> u16 {
    client
        .post(format!("{}{path}", proc.base()))
        .header("X-API-Key", KEY)
        .json(&body)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test]
async fn metrics_move_by_exactly_the_operations_done() {
    let data = tempfile::tempdir().unwrap();
    let proc = launch_ok(data.path(), &[]).await;
    let client = crate::common::http();
    let base = proc.base();
    let before = scrape(&client, &base).await;
    assert!(
        before.contains("# TYPE koder_dns_dns_queries_total counter"),
        "{before}"
    );
    assert_eq!(
        sample(
            &before,
            "koder_dns_registrations_total{outcome=\"created\",reason=\"\"}"
        ),
        0.0
    );

    let reg = "/api/v1/services/register";
    let voice = |id: &str, healthy: bool| json!({"id": id, "name": "voice", "address": "10.0.0.1", "port": 5060, "healthy": healthy});
    assert_eq!(post(&client, &proc, reg, voice("v1", true)).await, 200);
    assert_eq!(post(&client, &proc, reg, voice("v2", false)).await, 200);
    assert_eq!(post(&client, &proc, reg, voice("v1", true)).await, 200);
    assert_eq!(
        post(&client, &proc, reg, json!({"name": "voice", "port": 1})).await,
        400
    );
    let hb = "/api/v1/services/heartbeat";
    assert_eq!(post(&client, &proc, hb, json!({"id": "v1"})).await, 200);
    assert_eq!(post(&client, &proc, hb, json!({"id": "nobody"})).await, 410);
    let dereg = "/api/v1/services/deregister";
    assert_eq!(post(&client, &proc, dereg, json!({"id": "nobody"})).await, 404);

    for _ in 0..3 {
        udp_query(
            proc.dns,
            &query_message("_voice._tcp.service.koder.", RecordType::SRV, None),
        )
        .await;
    }
    udp_query(proc.dns, &query_message("nothing.service.koder.", RecordType::A, None)).await;
    tcp_query(proc.dns, &query_message("voice.service.koder.", RecordType::A, None)).await;

    let after = scrape(&client, &base).await;
    let expect = [
        ("koder_dns_registrations_total{outcome=\"created\",reason=\"\"}", 2.0),
        ("koder_dns_registrations_total{outcome=\"refreshed\",reason=\"\"}", 1.0),
        (
            "koder_dns_registrations_total{outcome=\"refused\",reason=\"invalid_field\"}",
            1.0,
        ),
        ("koder_dns_heartbeats_total{outcome=\"ok\"}", 1.0),
        ("koder_dns_heartbeats_total{outcome=\"gone\"}", 1.0),
        ("koder_dns_deregistrations_total{outcome=\"not_found\"}", 1.0),
        (
            "koder_dns_dns_queries_total{qtype=\"SRV\",rcode=\"NOERROR\",transport=\"udp\"}",
            3.0,
        ),
        (
            "koder_dns_dns_queries_total{qtype=\"A\",rcode=\"NXDOMAIN\",transport=\"udp\"}",
            1.0,
        ),
        (
            "koder_dns_dns_queries_total{qtype=\"A\",rcode=\"NOERROR\",transport=\"tcp\"}",
            1.0,
        ),
        ("koder_dns_instances{service=\"voice\",health=\"healthy\"}", 1.0),
        ("koder_dns_instances{service=\"voice\",health=\"unhealthy\"}", 1.0),
        (
            "koder_dns_http_requests_total{route=\"/api/v1/services/register\",method=\"POST\",status=\"200\"}",
            3.0,
        ),
        (
            "koder_dns_http_requests_total{route=\"/api/v1/services/heartbeat\",method=\"POST\",status=\"410\"}",
            1.0,
        ),
        (
            "koder_dns_http_request_duration_seconds_count{route=\"/api/v1/services/register\"}",
            4.0,
        ),
    ];
    for (series, value) in expect {
        assert_eq!(sample(&after, series), value, "{series} in:\n{after}");
    }
    // Two registrations and a refresh were committed before they were answered.
    assert!(
        sample(&after, "koder_dns_store_commits_total{result=\"ok\"}") >= 3.0,
        "{after}"
    );
    assert!(sample(&after, "koder_dns_soa_serial") > sample(&before, "koder_dns_soa_serial"));

    // Deregistration and expiry.
    assert_eq!(post(&client, &proc, dereg, json!({"id": "v2"})).await, 200);
    let short = json!({"id": "s1", "name": "brief", "address": "10.0.0.2", "port": 1, "ttl_ns": 1_000_000_000});
    assert_eq!(post(&client, &proc, reg, short).await, 200);
    tokio::time::sleep(Duration::from_millis(1300)).await;
    // A query for the dead instance's name reaps it at once (the serial moves at expiry).
    // On a machine so loaded that the server went unscheduled for over 0.9 s as the lease
    // ended, the registry counts that as its own stall and parks the instance for one more
    // TTL instead (README "Leases"): then it is reaped a second later.
    let mut last = String::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(4);
    while std::time::Instant::now() < deadline {
        udp_query(proc.dns, &query_message("brief.service.koder.", RecordType::A, None)).await;
        last = scrape(&client, &base).await;
        if sample(&last, "koder_dns_expiries_total") >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        sample(&last, "koder_dns_deregistrations_total{outcome=\"ok\"}"),
        1.0,
        "{last}"
    );
    assert_eq!(sample(&last, "koder_dns_expiries_total"), 1.0, "{last}");
    assert_eq!(
        sample(&last, "koder_dns_instances{service=\"voice\",health=\"unhealthy\"}"),
        0.0
    );
}

fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

#[tokio::test]
async fn metrics_listen_moves_the_endpoint_to_its_own_address() {
    let data = tempfile::tempdir().unwrap();
    let addr = free_port();
    let proc = launch_ok(data.path(), &["--metrics-listen", &addr.to_string()]).await;
    let client = crate::common::http();
    let text = scrape(&client, &format!("http://{addr}")).await;
    assert!(text.contains("koder_dns_soa_serial"), "{text}");
    let on_api = client.get(format!("{}/metrics", proc.base())).send().await.unwrap();
    assert_eq!(on_api.status(), 404, "metrics moved away from the REST address");
}

#[tokio::test]
async fn log_format_json_writes_one_object_per_line() {
    let data = tempfile::tempdir().unwrap();
    let proc = launch_ok(data.path(), &["--log-format", "json"]).await;
    let (status, log) = proc.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
    let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() >= 2, "{log}");
    for line in &lines {
        let event: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            event["level"].is_string() && event["fields"]["message"].is_string(),
            "{line}"
        );
    }
    assert!(log.contains("\"message\":\"koder-dns listening\""), "{log}");
}

#[tokio::test]
async fn held_blocking_queries_are_a_gauge() {
    let data = tempfile::tempdir().unwrap();
    let proc = launch_ok(data.path(), &[]).await;
    let client = crate::common::http();
    let base = proc.base();
    let listing = client
        .get(format!("{base}/api/v1/services"))
        .header("X-API-Key", KEY)
        .send()
        .await
        .unwrap();
    let index = listing.headers()["x-koder-index"].to_str().unwrap().to_owned();
    let held = {
        let (client, base) = (client.clone(), base.clone());
        tokio::spawn(async move {
            client
                .get(format!("{base}/api/v1/services?index={index}&wait=3s"))
                .header("X-API-Key", KEY)
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sample(&scrape(&client, &base).await, "koder_dns_watches_held"), 1.0);
    assert_eq!(
        post(
            &client,
            &proc,
            "/api/v1/services/register",
            json!({"name": "v", "address": "10.0.0.1", "port": 1})
        )
        .await,
        200
    );
    assert_eq!(held.await.unwrap(), 200);
    assert_eq!(sample(&scrape(&client, &base).await, "koder_dns_watches_held"), 0.0);
}
