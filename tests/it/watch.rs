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
