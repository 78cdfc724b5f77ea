//! The REST API (R2–R4, R7) over real HTTP, the configuration sources, the command-line help
//! and the generated API key.
use crate::common;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use hickory_proto::rr::RecordType;
use serde_json::{Value, json};

use crate::common::{KEY, TestServer};

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

const REGISTER: &str = "/api/v1/services/register";
const HEARTBEAT: &str = "/api/v1/services/heartbeat";
const DEREGISTER: &str = "/api/v1/services/deregister";
const SERVICES: &str = "/api/v1/services";

fn voice(id: &str) -> Value {
    json!({"id": id, "name": "voice", "address": "10.0.0.1", "port": 5060})
}

/// A raw POST with the test key and a body sent as is.
async fn post_raw(server: &TestServer, path: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
    server
        .send(server.http.post(server.url(path)).header("X-API-Key", KEY).body(body))
        .await
}

fn instance_ids(body: &Value) -> Vec<String> {
    body["instances"]
        .as_array()
        .expect("instances array")
        .iter()
        .map(|i| i["id"].as_str().unwrap().to_owned())
        .collect()
}

fn names(body: &Value) -> Vec<String> {
    body["services"]
        .as_array()
        .expect("services array")
        .iter()
        .map(|n| n.as_str().unwrap().to_owned())
        .collect()
}

/// Every error is `{"error": "<code>", "message": "<text>"}`.
#[track_caller]
fn assert_error_body(body: &Value) {
    assert!(body.is_object(), "error body is not a JSON object: {body}");
    let code = body["error"]
        .as_str()
        .unwrap_or_else(|| panic!("no \"error\" string in {body}"));
    assert!(!code.is_empty(), "{body}");
    let message = body["message"]
        .as_str()
        .unwrap_or_else(|| panic!("no \"message\" string in {body}"));
    assert!(!message.is_empty(), "{body}");
}

fn parse_time(s: &str) -> chrono::DateTime<chrono::FixedOffset> {
    chrono::DateTime::parse_from_rfc3339(s).unwrap_or_else(|e| panic!("{s:?} is not RFC 3339: {e}"))
}

/// RFC 3339, in UTC, with sub-second digits.
#[track_caller]
fn assert_wire_time(v: &Value) {
    let s = v.as_str().unwrap_or_else(|| panic!("timestamp is not a string: {v}"));
    let t = parse_time(s);
    assert_eq!(t.offset().local_minus_utc(), 0, "{s} is not UTC");
    assert!(s.ends_with('Z'), "{s} does not say UTC with Z");
    let frac = s.split_once('.').map(|(_, f)| f.trim_end_matches('Z')).unwrap_or("");
    assert!(
        !frac.is_empty() && frac.bytes().all(|b| b.is_ascii_digit()),
        "{s} has no sub-second digits"
    );
}

/// Every field of R1, each of the right JSON type.
#[track_caller]
fn assert_full_instance(i: &Value) {
    for (field, ok) in [
        ("id", i["id"].is_string()),
        ("name", i["name"].is_string()),
        ("address", i["address"].is_string()),
        ("port", i["port"].is_u64()),
        ("protocol", i["protocol"].is_string()),
        ("tags", i["tags"].is_array()),
        ("metadata", i["metadata"].is_object()),
        ("weight", i["weight"].is_u64()),
        ("priority", i["priority"].is_u64()),
        ("healthy", i["healthy"].is_boolean()),
        ("ttl_ns", i["ttl_ns"].is_i64()),
        ("registered_at", i["registered_at"].is_string()),
        ("updated_at", i["updated_at"].is_string()),
    ] {
        assert!(ok, "field {field} missing or of the wrong type in {i}");
    }
    assert_wire_time(&i["registered_at"]);
    assert_wire_time(&i["updated_at"]);
}

async fn export_text(server: &TestServer) -> String {
    let response = server
        .http
        .get(server.url("/api/v1/services/export"))
        .header("X-API-Key", KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 200);
    response.text().await.unwrap()
}

fn find<'a>(body: &'a Value, id: &str) -> &'a Value {
    body["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == id)
        .unwrap_or_else(|| panic!("{id} not in {body}"))
}

// ---------------------------------------------------------------------------------------
// The lifecycle
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn register_heartbeat_list_detail_deregister() {
    let (server, clock) = common::start_manual(|c| c.default_ttl = Duration::from_secs(30)).await;

    let r = server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    assert_eq!(r, json!({"id": "voice-10.0.0.1-5060", "created": true}));
    let id = "voice-10.0.0.1-5060";

    let (status, body) = server.get(SERVICES).await;
    assert_eq!(status, 200);
    assert_eq!(body, json!({"services": ["voice"]}));

    let listed = server.detail().await;
    assert_eq!(instance_ids(&listed), vec![id]);
    let i = find(&listed, id);
    assert_full_instance(i);
    assert_eq!(i["name"], "voice");
    assert_eq!(i["address"], "10.0.0.1");
    assert_eq!(i["port"], 5060);
    assert_eq!(i["protocol"], "tcp");
    assert_eq!(i["tags"], json!([]));
    assert_eq!(i["metadata"], json!({}));
    assert_eq!(i["weight"], 100);
    assert_eq!(i["priority"], 10);
    assert_eq!(i["healthy"], true);
    assert_eq!(i["ttl_ns"], 0);
    assert_eq!(i["registered_at"], i["updated_at"]);
    let registered_at = parse_time(i["registered_at"].as_str().unwrap());

    let srv = server.query("_voice._tcp.service.koder.", RecordType::SRV).await;
    assert_eq!(srv.answers.len(), 1, "registered instance is in DNS");

    clock.advance(Duration::from_secs(20));
    let (status, beat) = server.post(HEARTBEAT, &json!({"id": id})).await;
    assert_eq!(status, 200, "{beat}");
    assert_full_instance(&beat);
    assert_eq!(beat["id"], id);
    assert_eq!(parse_time(beat["registered_at"].as_str().unwrap()), registered_at);
    assert_eq!(
        parse_time(beat["updated_at"].as_str().unwrap()) - registered_at,
        chrono::Duration::seconds(20),
        "the heartbeat bumps updated_at to now"
    );
    let listed = server.detail().await;
    assert_eq!(find(&listed, id)["updated_at"], beat["updated_at"]);

    // 20s + 20s: alive only thanks to the heartbeat.
    clock.advance(Duration::from_secs(20));
    assert_eq!(instance_ids(&server.detail().await), vec![id]);

    let (status, body) = server.post(DEREGISTER, &json!({"id": id})).await;
    assert_eq!(status, 200, "{body}");
    assert!(instance_ids(&server.detail().await).is_empty());
    let (_, body) = server.get(SERVICES).await;
    assert_eq!(body, json!({"services": []}));
    let srv = server.query("_voice._tcp.service.koder.", RecordType::SRV).await;
    assert!(srv.answers.is_empty(), "deregistered instance is out of DNS");

    let (status, body) = server.post(HEARTBEAT, &json!({"id": id})).await;
    assert_eq!(status, 410, "heartbeat after deregister: {body}");
    let (status, body) = server.post(DEREGISTER, &json!({"id": id})).await;
    assert_eq!(status, 404, "second deregister: {body}");
    assert_error_body(&body);
}

#[tokio::test]
async fn created_is_true_then_false_and_registered_at_is_kept() {
    let (server, clock) = common::start_manual(|_| {}).await;
    let first = server.register(voice("v1")).await;
    assert_eq!(first, json!({"id": "v1", "created": true}));
    let before = find(&server.detail().await, "v1").clone();

    clock.advance(Duration::from_secs(3));
    let second = server
        .register(
            json!({"id": "v1", "name": "voice", "address": "10.0.0.9", "port": 6000, "weight": 5,
                         "tags": ["a"], "metadata": {"k": "v"}}),
        )
        .await;
    assert_eq!(second, json!({"id": "v1", "created": false}));
    let after = server.detail().await;
    assert_eq!(instance_ids(&after), vec!["v1"], "no duplicate");
    let after = find(&after, "v1");
    assert_eq!(after["registered_at"], before["registered_at"]);
    assert_ne!(after["updated_at"], before["updated_at"]);
    assert_eq!(after["address"], "10.0.0.9");
    assert_eq!(after["port"], 6000);
    assert_eq!(after["weight"], 5);
    assert_eq!(after["tags"], json!(["a"]));
    assert_eq!(after["metadata"], json!({"k": "v"}));
}

#[tokio::test]
async fn every_field_is_present_as_sent() {
    let server = common::start().await;
    server
        .register(json!({
            "id": "full", "name": "Voice", "address": "2001:db8::1", "port": 443, "protocol": "UDP",
            "tags": ["x", "container=voice-1"], "metadata": {"service": "voice", "b": "2"},
            "weight": 0, "priority": 65535, "healthy": false, "ttl_ns": 60_000_000_000i64
        }))
        .await;
    server
        .register(json!({"name": "bare", "address": "bare.internal", "port": 1}))
        .await;
    let body = server.detail().await;
    for i in body["instances"].as_array().unwrap() {
        assert_full_instance(i);
    }
    let full = find(&body, "full");
    assert_eq!(full["name"], "voice", "names are stored lower-case");
    assert_eq!(full["address"], "2001:db8::1");
    assert_eq!(full["port"], 443);
    assert_eq!(full["protocol"], "udp");
    assert_eq!(full["tags"], json!(["x", "container=voice-1"]));
    assert_eq!(full["metadata"], json!({"service": "voice", "b": "2"}));
    assert_eq!(full["weight"], 0);
    assert_eq!(full["priority"], 65535);
    assert_eq!(full["healthy"], false);
    assert_eq!(full["ttl_ns"], 60_000_000_000i64);
    let bare = find(&body, "bare-bare.internal-1");
    assert_eq!(bare["tags"], json!([]));
    assert_eq!(bare["metadata"], json!({}));
    assert_eq!(bare["healthy"], true);
    let now = chrono::Utc::now();
    let at = parse_time(bare["registered_at"].as_str().unwrap());
    assert!(
        (now.timestamp_millis() - at.timestamp_millis()).abs() < 60_000,
        "registered_at is about now: {at}"
    );
}

// ---------------------------------------------------------------------------------------
// Listings
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn names_are_sorted_unique_and_instances_sorted_by_name_then_id() {
    let server = common::start().await;
    for (id, name) in [
        ("z", "mid"),
        ("b", "zeta"),
        ("y", "alpha"),
        ("a", "mid"),
        ("x", "zeta"),
        ("c", "alpha"),
        ("m", "mid"),
    ] {
        server
            .register(json!({"id": id, "name": name, "address": "10.0.0.1", "port": 80}))
            .await;
    }
    let (status, body) = server.get(SERVICES).await;
    assert_eq!(status, 200);
    assert_eq!(names(&body), vec!["alpha", "mid", "zeta"]);
    let body = server.detail().await;
    let pairs: Vec<(String, String)> = body["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            (
                i["name"].as_str().unwrap().to_owned(),
                i["id"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let expect: Vec<(String, String)> = [
        ("alpha", "c"),
        ("alpha", "y"),
        ("mid", "a"),
        ("mid", "m"),
        ("mid", "z"),
        ("zeta", "b"),
        ("zeta", "x"),
    ]
    .iter()
    .map(|(n, i)| (n.to_string(), i.to_string()))
    .collect();
    assert_eq!(pairs, expect);
}

#[tokio::test]
async fn detail_healthy_only_and_name_filters() {
    let server = common::start().await;
    server
        .register(json!({"id": "v1", "name": "voice", "address": "10.0.0.1", "port": 1}))
        .await;
    server
        .register(json!({"id": "v2", "name": "voice", "address": "10.0.0.2", "port": 1, "healthy": false}))
        .await;
    server
        .register(json!({"id": "s1", "name": "sick", "address": "10.0.0.3", "port": 1, "healthy": false}))
        .await;
    server
        .register(json!({"id": "c1", "name": "chat", "address": "10.0.0.4", "port": 1}))
        .await;

    for q in ["?detail=1", "?detail=true", "?detail=TRUE"] {
        let (status, body) = server.get(&format!("{SERVICES}{q}")).await;
        assert_eq!(status, 200, "{q}: {body}");
        assert_eq!(instance_ids(&body), vec!["c1", "s1", "v1", "v2"], "{q}");
        assert!(body.get("services").is_none(), "{q}: detail answers instances");
    }
    for q in ["", "?detail=0", "?detail=false"] {
        let (status, body) = server.get(&format!("{SERVICES}{q}")).await;
        assert_eq!(status, 200, "{q}: {body}");
        assert_eq!(names(&body), vec!["chat", "sick", "voice"], "{q}");
        assert!(body.get("instances").is_none(), "{q}: without detail, names only");
    }
    for q in ["?healthy_only=1", "?healthy_only=true"] {
        let (_, body) = server.get(&format!("{SERVICES}{q}")).await;
        assert_eq!(names(&body), vec!["chat", "voice"], "{q}: sick has no healthy instance");
        let (_, body) = server.get(&format!("{SERVICES}{q}&detail=1")).await;
        assert_eq!(instance_ids(&body), vec!["c1", "v1"], "{q}");
    }
    let (_, body) = server.get(&format!("{SERVICES}?healthy_only=0&detail=1")).await;
    assert_eq!(instance_ids(&body), vec!["c1", "s1", "v1", "v2"]);

    let (_, body) = server.get(&format!("{SERVICES}?name=voice&detail=1")).await;
    assert_eq!(instance_ids(&body), vec!["v1", "v2"]);
    let (_, body) = server.get(&format!("{SERVICES}?name=voice")).await;
    assert_eq!(names(&body), vec!["voice"]);
    let (_, body) = server.get(&format!("{SERVICES}?name=VOICE&detail=1")).await;
    assert_eq!(instance_ids(&body), vec!["v1", "v2"], "names are compared lower-case");
    let (_, body) = server
        .get(&format!("{SERVICES}?name=voice&healthy_only=1&detail=1"))
        .await;
    assert_eq!(instance_ids(&body), vec!["v1"]);
    let (_, body) = server.get(&format!("{SERVICES}?name=sick&healthy_only=1")).await;
    assert_eq!(names(&body), Vec::<String>::new());
    let (status, body) = server.get(&format!("{SERVICES}?name=nothing&detail=1")).await;
    assert_eq!(status, 200);
    assert_eq!(body, json!({"instances": []}));
}

// ---------------------------------------------------------------------------------------
// Expiry over HTTP
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn heartbeat_after_expiry_is_410_on_a_manual_clock() {
    let (server, clock) = common::start_manual(|c| {
        c.default_ttl = Duration::from_secs(10);
        c.reaper_interval = Duration::from_secs(3600);
    })
    .await;
    server.register(voice("v1")).await;
    let export = export_text(&server).await;
    assert!(
        export.contains("\"v1\"") && export.contains("5060"),
        "live: in the export:\n{export}"
    );
    clock.advance(Duration::from_secs(10) - Duration::from_nanos(1));
    let (status, body) = server.post(HEARTBEAT, &json!({"id": "v1"})).await;
    assert_eq!(status, 200, "1ns before the deadline: {body}");
    clock.advance(Duration::from_secs(10));
    let (status, body) = server.post(HEARTBEAT, &json!({"id": "v1"})).await;
    assert_eq!(status, 410, "exactly at the renewed deadline: {body}");
    assert_error_body(&body);
    assert!(
        body["message"].as_str().unwrap().contains("v1"),
        "the message names the id: {body}"
    );
    let (status, _) = server.post(HEARTBEAT, &json!({"id": "v1"})).await;
    assert_eq!(status, 410, "the failed heartbeat resurrected nothing");
    assert!(
        instance_ids(&server.detail().await).is_empty(),
        "expired: in no listing"
    );
    let (_, body) = server.get(SERVICES).await;
    assert_eq!(names(&body), Vec::<String>::new());
    let srv = server.query("_voice._tcp.service.koder.", RecordType::SRV).await;
    assert!(srv.answers.is_empty(), "expired: in no DNS answer");
    let export = export_text(&server).await;
    assert!(
        !export.contains("\"v1\"") && !export.contains("5060"),
        "expired: in no export:\n{export}"
    );

    // Registering again is a new registration.
    clock.advance(Duration::from_secs(1));
    let r = server.register(voice("v1")).await;
    assert_eq!(r["created"], true);
    let i = find(&server.detail().await, "v1").clone();
    assert_eq!(i["registered_at"], i["updated_at"], "a new registered_at");
    let (status, _) = server.post(HEARTBEAT, &json!({"id": "v1"})).await;
    assert_eq!(status, 200, "re-registered: renewable again");
}

#[tokio::test]
async fn heartbeat_after_expiry_is_410_before_the_reaper_runs() {
    let server = common::start_with(|c| {
        c.default_ttl = Duration::from_millis(300);
        c.reaper_interval = Duration::from_secs(3600);
    })
    .await;
    server.register(voice("v1")).await;
    server
        .register(json!({"id": "long", "name": "voice", "address": "10.0.0.2", "port": 1, "ttl_ns": 60_000_000_000i64}))
        .await;
    let (status, _) = server.post(HEARTBEAT, &json!({"id": "v1"})).await;
    assert_eq!(status, 200);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (status, body) = server.post(HEARTBEAT, &json!({"id": "v1"})).await;
    assert_eq!(status, 410, "{body}");
    assert_error_body(&body);
    assert_eq!(instance_ids(&server.detail().await), vec!["long"]);
    let (status, _) = server.post(HEARTBEAT, &json!({"id": "long"})).await;
    assert_eq!(status, 200, "ttl_ns overrides the short default");
    let r = server.register(voice("v1")).await;
    assert_eq!(r["created"], true, "after expiry, registering is a creation");
}

#[tokio::test]
async fn heartbeat_unknown_is_410_and_deregister_unknown_is_404() {
    let server = common::start().await;
    let (status, body) = server.post(HEARTBEAT, &json!({"id": "ghost"})).await;
    assert_eq!(status, 410, "{body}");
    assert_error_body(&body);
    let (status, body) = server.post(DEREGISTER, &json!({"id": "ghost"})).await;
    assert_eq!(status, 404, "{body}");
    assert_error_body(&body);
    for path in [HEARTBEAT, DEREGISTER] {
        for bad in [json!({}), json!({"id": ""}), json!({"id": 5}), json!({"id": null})] {
            let (status, body) = server.post(path, &bad).await;
            assert_eq!(status, 400, "{path} {bad}: {body}");
            assert_error_body(&body);
            assert!(body["message"].as_str().unwrap().contains("id"), "{path} {bad}: {body}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Authentication
// ---------------------------------------------------------------------------------------

fn every_route() -> Vec<(reqwest::Method, &'static str, Option<Value>)> {
    use reqwest::Method;
    vec![
        (Method::GET, "/api/v1/services", None),
        (Method::GET, "/api/v1/services?detail=1", None),
        (Method::POST, REGISTER, Some(voice("sneaky"))),
        (Method::POST, HEARTBEAT, Some(json!({"id": "v1"}))),
        (Method::POST, DEREGISTER, Some(json!({"id": "v1"}))),
        (Method::GET, "/api/v1/services/export", None),
        (Method::POST, "/api/v1/services/drift", Some(json!("[[ports]]"))),
        (Method::GET, "/api/v1/routes", None),
        (Method::GET, "/api/v1/sd/prometheus", None),
        (Method::GET, "/api/v1/openapi.json", None),
    ]
}

#[tokio::test]
async fn every_route_needs_a_valid_key() {
    let server = common::start().await;
    server.register(voice("v1")).await;
    let before = server.detail().await;
    let wrong_keys = [
        "wrong",
        "",
        &KEY[..KEY.len() - 1],
        &format!("{KEY}x"),
        &KEY.to_uppercase(),
    ];
    for (method, path, body) in every_route() {
        let mut attempts = vec![("no key", server.http.request(method.clone(), server.url(path)))];
        for k in wrong_keys {
            attempts.push((
                "wrong key",
                server
                    .http
                    .request(method.clone(), server.url(path))
                    .header("X-API-Key", k),
            ));
        }
        for (what, mut request) in attempts {
            if let Some(b) = &body {
                request = request.json(b);
            }
            let (status, response) = server.send(request).await;
            assert_eq!(status, 401, "{method} {path} with {what}: {response}");
            assert_error_body(&response);
        }
    }
    assert_eq!(
        server.detail().await,
        before,
        "unauthenticated requests changed nothing"
    );
    // And the right key works on every route.
    for (method, path, body) in every_route() {
        let mut request = server
            .http
            .request(method.clone(), server.url(path))
            .header("x-api-key", KEY);
        if let Some(b) = &body {
            request = request.json(b);
        }
        let status = request.send().await.unwrap().status().as_u16();
        assert_ne!(status, 401, "{method} {path} with the key");
    }
}

#[tokio::test]
async fn any_of_several_configured_keys_is_accepted() {
    let server = common::start_with(|c| c.api_keys = vec!["first-key".into(), "second-key".into()]).await;
    for key in ["first-key", "second-key"] {
        let (status, _) = server
            .send(server.http.get(server.url(SERVICES)).header("X-API-Key", key))
            .await;
        assert_eq!(status, 200, "{key}");
    }
    let (status, _) = server
        .send(server.http.get(server.url(SERVICES)).header("X-API-Key", KEY))
        .await;
    assert_eq!(status, 401);
    let (status, _) = server
        .send(
            server
                .http
                .get(server.url(SERVICES))
                .header("X-API-Key", "first-key,second-key"),
        )
        .await;
    assert_eq!(status, 401);
}

#[tokio::test]
async fn healthz_answers_200_without_a_key() {
    let server = common::start().await;
    let response = server.http.get(server.url("/healthz")).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let response = server
        .http
        .get(server.url("/healthz"))
        .header("X-API-Key", "wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status().as_u16(),
        200,
        "a wrong key does not matter on /healthz"
    );
}

#[tokio::test]
async fn generated_api_key_is_stored_with_mode_0600_and_works() {
    let server = common::start_with(|c| c.api_keys.clear()).await;
    let path = server.dir.path().join("data").join("api-key");
    let key = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{} should exist: {e}", path.display()));
    let key = key.trim().to_owned();
    assert!(key.len() >= 32, "a generated key is long enough: {key:?}");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the key file is readable by its owner only");
    }
    let (status, body) = server
        .send(server.http.get(server.url(SERVICES)).header("X-API-Key", &key))
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = server
        .send(
            server
                .http
                .post(server.url(REGISTER))
                .header("X-API-Key", &key)
                .json(&voice("v1")),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = server.send(server.http.get(server.url(SERVICES))).await;
    assert_eq!(status, 401, "without the key: {body}");
    assert_error_body(&body);
    let (status, _) = server
        .send(server.http.get(server.url(SERVICES)).header("X-API-Key", KEY))
        .await;
    assert_eq!(status, 401, "the test key is not configured here");

    // A restart on the same data directory keeps the key, so clients keep working.
    let data_dir = server.dir.path().join("data");
    let TestServer { running, dir, .. } = server;
    running.shutdown().await.expect("durable state flushed");
    let again = common::start_with(|c| {
        c.api_keys.clear();
        c.data_dir = data_dir.clone();
    })
    .await;
    assert_eq!(std::fs::read_to_string(&path).unwrap().trim(), key);
    let (status, _) = again
        .send(again.http.get(again.url(SERVICES)).header("X-API-Key", &key))
        .await;
    assert_eq!(status, 200);
    drop(dir);
}

// ---------------------------------------------------------------------------------------
// Validation and malformed requests
// ---------------------------------------------------------------------------------------

fn with(patch: Value) -> Value {
    let mut body = json!({"name": "voice", "address": "10.0.0.1", "port": 5060});
    for (k, v) in patch.as_object().unwrap() {
        if v.is_null() {
            body.as_object_mut().unwrap().remove(k);
        } else {
            body[k] = v.clone();
        }
    }
    body
}

/// (body, the field the 400 must name)
fn invalid_registrations() -> Vec<(Value, &'static str)> {
    vec![
        (with(json!({"name": null})), "name"),
        (with(json!({"name": ""})), "name"),
        (with(json!({"name": "a".repeat(64)})), "name"),
        (with(json!({"name": "-voice"})), "name"),
        (with(json!({"name": "voice-"})), "name"),
        (with(json!({"name": "voice.koder"})), "name"),
        (with(json!({"name": "voice_1"})), "name"),
        (with(json!({"address": null})), "address"),
        (with(json!({"address": ""})), "address"),
        (with(json!({"address": "not an address"})), "address"),
        (with(json!({"address": "10.0.0.300"})), "address"),
        (with(json!({"port": null})), "port"),
        (with(json!({"port": 0})), "port"),
        (with(json!({"port": 65536})), "port"),
        (with(json!({"port": -1})), "port"),
        (with(json!({"protocol": "_tcp"})), "protocol"),
        (with(json!({"protocol": "t cp"})), "protocol"),
        (with(json!({"weight": 65536})), "weight"),
        (with(json!({"weight": -1})), "weight"),
        (with(json!({"priority": 70000})), "priority"),
        (with(json!({"priority": -1})), "priority"),
        (with(json!({"id": "i".repeat(256)})), "id"),
        (with(json!({"id": "line\nbreak"})), "id"),
        (with(json!({"metadata": {"jet.domain": "not a domain"}})), "jet.domain"),
        (with(json!({"metadata": {"jet.domain": "voice"}})), "jet.domain"),
        (with(json!({"tags": ["jet.domain=bad..domain"]})), "jet.domain"),
    ]
}

/// Bodies of the wrong JSON types: (body, the field the 400 must name)
fn wrong_types() -> Vec<(Value, &'static str)> {
    vec![
        (with(json!({"port": "5060"})), "port"),
        (with(json!({"port": 50.5})), "port"),
        (with(json!({"name": 5})), "name"),
        (with(json!({"name": ["voice"]})), "name"),
        (with(json!({"address": {"ip": "10.0.0.1"}})), "address"),
        (with(json!({"tags": "a,b"})), "tags"),
        (with(json!({"tags": [1, 2]})), "tags"),
        (with(json!({"metadata": ["a=b"]})), "metadata"),
        (with(json!({"metadata": {"a": 1}})), "metadata"),
        (with(json!({"healthy": "yes"})), "healthy"),
        (with(json!({"ttl_ns": "5s"})), "ttl_ns"),
        (with(json!({"weight": 1.5})), "weight"),
        (with(json!({"priority": true})), "priority"),
        (with(json!({"protocol": 6})), "protocol"),
        (with(json!({"id": 7})), "id"),
    ]
}

#[tokio::test]
async fn every_validation_error_is_400_naming_the_field() {
    let server = common::start().await;
    for (body, field) in invalid_registrations() {
        let (status, response) = server.post(REGISTER, &body).await;
        assert_eq!(status, 400, "{body}: {response}");
        assert_error_body(&response);
        let message = response["message"].as_str().unwrap();
        assert!(
            message.contains(field),
            "the message for {body} should name {field}: {message}"
        );
    }
    assert!(
        instance_ids(&server.detail().await).is_empty(),
        "no refused registration was stored"
    );
}

#[tokio::test]
async fn wrong_json_types_are_400_naming_the_field() {
    let server = common::start().await;
    for (body, field) in wrong_types() {
        let (status, response) = server.post(REGISTER, &body).await;
        assert_eq!(status, 400, "{body}: {response}");
        assert_error_body(&response);
        let message = response["message"].as_str().unwrap();
        assert!(
            message.contains(field),
            "the message for {body} should name {field}: {message}"
        );
    }
    assert!(instance_ids(&server.detail().await).is_empty());
}

const MALFORMED: [&str; 9] = [
    "",
    "not json",
    "{\"name\": \"voice\",",
    "{\"name\": \"voice\", \"address\": \"10.0.0.1\", \"port\": 5060} trailing",
    "{\"name\": \"voice\" \"address\": \"10.0.0.1\"}",
    "[1, 2]",
    "\"voice\"",
    "null",
    "{\"name\": \"voice\", \"address\": \"10.0.0.1\", \"port\": 5060, }",
];

#[tokio::test]
async fn malformed_json_is_400() {
    let server = common::start().await;
    for path in [REGISTER, HEARTBEAT, DEREGISTER] {
        for body in MALFORMED {
            let (status, response) = post_raw(&server, path, body).await;
            assert_eq!(status, 400, "{path} {body:?}: {response}");
            assert_error_body(&response);
        }
    }
    let (status, response) = post_raw(&server, REGISTER, vec![0xff, 0xfe, b'{']).await;
    assert_eq!(status, 400, "bytes that are not UTF-8: {response}");
    assert!(instance_ids(&server.detail().await).is_empty());
}

/// A valid registration padded with trailing whitespace to exactly `len` bytes.
fn padded(len: usize) -> String {
    let mut body = voice("big").to_string();
    assert!(body.len() <= len);
    body.extend(std::iter::repeat_n(' ', len - body.len()));
    body
}

#[tokio::test]
async fn body_over_64_kib_is_413_and_64_kib_is_accepted() {
    let server = common::start().await;
    let (status, response) = post_raw(&server, REGISTER, padded(64 * 1024 + 1)).await;
    assert_eq!(status, 413, "{response}");
    assert_error_body(&response);
    assert!(instance_ids(&server.detail().await).is_empty());

    let big_metadata =
        json!({"name": "voice", "address": "10.0.0.1", "port": 1, "metadata": {"pad": "x".repeat(70_000)}});
    let (status, response) = server.post(REGISTER, &big_metadata).await;
    assert_eq!(status, 413, "{response}");
    let (status, response) = post_raw(&server, HEARTBEAT, format!("{{\"id\": \"{}\"}}", "x".repeat(70_000))).await;
    assert_eq!(status, 413, "heartbeat bodies are limited too: {response}");

    let (status, response) = post_raw(&server, REGISTER, padded(64 * 1024)).await;
    assert_eq!(status, 200, "exactly 64 KiB is not over the limit: {response}");
    assert_eq!(instance_ids(&server.detail().await), vec!["big"]);
}

#[tokio::test]
async fn body_is_read_without_a_content_type() {
    let server = common::start().await;
    for (ct, id) in [
        (None, "no-ct"),
        (Some("text/plain"), "text-ct"),
        (Some("application/x-www-form-urlencoded"), "form-ct"),
    ] {
        let mut request = server
            .http
            .post(server.url(REGISTER))
            .header("X-API-Key", KEY)
            .body(voice(id).to_string());
        if let Some(ct) = ct {
            request = request.header("Content-Type", ct);
        }
        let (status, body) = server.send(request).await;
        assert_eq!(status, 200, "Content-Type {ct:?}: {body}");
        assert_eq!(body["created"], true);
    }
    // Heartbeat and deregister too.
    let (status, _) = post_raw(&server, HEARTBEAT, "{\"id\": \"no-ct\"}").await;
    assert_eq!(status, 200);
    let (status, _) = post_raw(&server, DEREGISTER, "{\"id\": \"no-ct\"}").await;
    assert_eq!(status, 200);
    assert_eq!(instance_ids(&server.detail().await), vec!["form-ct", "text-ct"]);
}

#[tokio::test]
async fn unknown_fields_are_ignored() {
    let server = common::start().await;
    let body = json!({"id": "v1", "name": "voice", "address": "10.0.0.1", "port": 5060,
                      "future": {"nested": [1, 2]}, "ID": "other", "Name": 5, "check_v2": true});
    let r = server.register(body).await;
    assert_eq!(r, json!({"id": "v1", "created": true}));
    let i = find(&server.detail().await, "v1").clone();
    assert!(i.get("future").is_none());
    assert_eq!(i["name"], "voice");
    let (status, _) = server.post(HEARTBEAT, &json!({"id": "v1", "extra": 1})).await;
    assert_eq!(status, 200);
    let (status, _) = server
        .post(DEREGISTER, &json!({"id": "v1", "reason": "shutdown"}))
        .await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn unknown_route_is_404_json_and_wrong_method_is_405_json() {
    let server = common::start().await;
    for path in [
        "/nope",
        "/api/v1/nope",
        "/api/v2/services",
        "/api/v1/services/register/extra",
    ] {
        let (status, body) = server.get(path).await;
        assert_eq!(status, 404, "GET {path}: {body}");
        assert_error_body(&body);
    }
    use reqwest::Method;
    for (method, path) in [
        (Method::GET, REGISTER),
        (Method::GET, HEARTBEAT),
        (Method::GET, DEREGISTER),
        (Method::DELETE, REGISTER),
        (Method::POST, SERVICES),
        (Method::PUT, SERVICES),
        (Method::POST, "/api/v1/services/export"),
        (Method::POST, "/healthz"),
    ] {
        let (status, body) = server
            .send(
                server
                    .http
                    .request(method.clone(), server.url(path))
                    .header("X-API-Key", KEY)
                    .body("{}"),
            )
            .await;
        assert_eq!(status, 405, "{method} {path}: {body}");
        assert_error_body(&body);
    }
}

#[tokio::test]
async fn failed_requests_change_nothing() {
    let server = common::start().await;
    server.register(voice("v1")).await;
    server
        .register(
            json!({"id": "v2", "name": "chat", "address": "chat.internal", "port": 80, "tags": ["t"],
                           "metadata": {"k": "v"}, "healthy": false}),
        )
        .await;
    let before = server.detail().await;
    let (_, names_before) = server.get(SERVICES).await;
    let serial = server.running.registry.serial();

    // Invalid re-registrations of an existing id must not touch it.
    for (mut body, _) in invalid_registrations().into_iter().chain(wrong_types()) {
        if body.get("id").is_none() {
            body["id"] = json!("v1");
        }
        let (status, _) = server.post(REGISTER, &body).await;
        assert_eq!(status, 400, "{body}");
    }
    for body in MALFORMED {
        post_raw(&server, REGISTER, body).await;
        post_raw(&server, HEARTBEAT, body).await;
        post_raw(&server, DEREGISTER, body).await;
    }
    let mut big = voice("v1");
    big["address"] = json!("10.9.9.9");
    big["metadata"] = json!({"pad": "x".repeat(70_000)});
    let (status, _) = server.post(REGISTER, &big).await;
    assert_eq!(status, 413);
    for path in [REGISTER, DEREGISTER] {
        let body = json!({"id": "v1", "name": "gone", "address": "10.9.9.9", "port": 1});
        let (status, _) = server.send(server.http.post(server.url(path)).json(&body)).await;
        assert_eq!(status, 401);
        let (status, _) = server
            .send(
                server
                    .http
                    .post(server.url(path))
                    .header("X-API-Key", "bad")
                    .json(&body),
            )
            .await;
        assert_eq!(status, 401);
    }
    let (status, _) = server.post(DEREGISTER, &json!({"id": "nobody"})).await;
    assert_eq!(status, 404);
    let (status, _) = server.post(HEARTBEAT, &json!({"id": "nobody"})).await;
    assert_eq!(status, 410);
    let (status, _) = server
        .send(server.http.get(server.url(REGISTER)).header("X-API-Key", KEY))
        .await;
    assert_eq!(status, 405);
    let (status, _) = server.get("/api/v1/services?detail=banana").await;
    assert_eq!(status, 400, "a bad boolean is refused, not guessed");

    assert_eq!(server.detail().await, before, "listing before == after");
    assert_eq!(server.get(SERVICES).await.1, names_before);
    assert_eq!(server.running.registry.serial(), serial, "the SOA serial did not move");
    assert!(server.running.registry.get("nobody").is_none());
}

// ---------------------------------------------------------------------------------------
// Configuration: flags > env > TOML file > defaults
// ---------------------------------------------------------------------------------------

fn binary() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_koder-dns"));
    for (k, _) in std::env::vars() {
        if k.starts_with("KODER_DNS") {
            command.env_remove(k);
        }
    }
    command.env("KODER_DNS_LOG", "error");
    command
}

/// Runs a command that should exit by itself; kills it (and fails) after 10 seconds.
fn run(mut command: Command) -> Output {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if start.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{command:?} did not exit: it accepted settings it should refuse\nstderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `serve` with free ports and a private data directory, plus `args`.
fn serve(dir: &std::path::Path, args: &[&str]) -> Command {
    let mut command = binary();
    command
        .arg("serve")
        .args(["--dns-listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"]);
    command
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--zones-dir")
        .arg(dir.join("zones"));
    command.args(args);
    command
}

#[test]
fn bad_default_ttl_flag_is_refused_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(serve(dir.path(), &["--default-ttl", "banana"]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("default-ttl"), "names the setting: {stderr}");
    assert!(stderr.contains("banana"), "quotes the value: {stderr}");
}

#[test]
fn bad_environment_value_is_refused_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let mut command = serve(dir.path(), &[]);
    command.env("KODER_DNS_REAPER_INTERVAL", "soon");
    let out = run(command);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(
        stderr.contains("reaper-interval") || stderr.contains("REAPER_INTERVAL"),
        "names the setting: {stderr}"
    );
}

#[test]
fn unknown_key_in_the_config_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("koder-dns.toml");
    std::fs::write(&file, "default_ttl = \"30s\"\ndefualt_ttl = \"30s\"\n").unwrap();
    let out = run(serve(dir.path(), &["--config", file.to_str().unwrap()]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("defualt_ttl"), "names the unknown key: {stderr}");
}

#[test]
fn bad_value_in_the_config_file_is_refused_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("koder-dns.toml");
    std::fs::write(&file, "default_ttl = \"banana\"\n").unwrap();
    let out = run(serve(dir.path(), &["--config", file.to_str().unwrap()]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("default_ttl"), "names the setting: {stderr}");
}

#[test]
fn missing_config_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(serve(
        dir.path(),
        &["--config", dir.path().join("absent.toml").to_str().unwrap()],
    ));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("absent.toml"), "names the file: {stderr}");
}

/// The settings of the README's table: (flag, env).
const SETTINGS: [(&str, &str); 9] = [
    ("--dns-listen", "KODER_DNS_DNS_LISTEN"),
    ("--http-listen", "KODER_DNS_HTTP_LISTEN"),
    ("--domain", "KODER_DNS_DOMAIN"),
    ("--default-ttl", "KODER_DNS_DEFAULT_TTL"),
    ("--reaper-interval", "KODER_DNS_REAPER_INTERVAL"),
    ("--dns-ttl", "KODER_DNS_DNS_TTL"),
    ("--negative-ttl", "KODER_DNS_NEGATIVE_TTL"),
    ("--zones-dir", "KODER_DNS_ZONES_DIR"),
    ("--data-dir", "KODER_DNS_DATA_DIR"),
];

#[test]
fn serve_help_mentions_every_setting() {
    let mut command = binary();
    command.args(["serve", "--help"]);
    let out = run(command);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for (flag, env) in SETTINGS {
        assert!(help.contains(flag), "serve --help does not mention {flag}:\n{help}");
        assert!(help.contains(env), "serve --help does not mention {env}:\n{help}");
    }
    for extra in ["--config", "KODER_DNS_API_KEY", "api-key", "0600"] {
        assert!(help.contains(extra), "serve --help does not mention {extra}:\n{help}");
    }
    for default in ["127.0.0.1:1053", "127.0.0.1:8053", "service.koder", "90s", "30s"] {
        assert!(
            help.contains(default),
            "serve --help does not give the default {default}:\n{help}"
        );
    }
}

#[test]
fn top_level_help_mentions_every_setting() {
    let mut command = binary();
    command.arg("--help");
    let out = run(command);
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("serve"), "{help}");
    for (flag, _) in SETTINGS {
        assert!(help.contains(flag), "koder-dns --help does not mention {flag}:\n{help}");
    }
}

/// No secret is a flag: the help lists none (it names the variables instead), a secret given
/// as a flag is refused without being repeated, and the variable still works.
#[test]
fn secrets_are_no_flags_the_help_names_their_variables_and_a_flag_is_refused() {
    let mut command = binary();
    command.args(["serve", "--help"]);
    let out = run(command);
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in ["--api-key ", "--tsig-key", "--etcd-password"] {
        assert!(!help.contains(flag), "serve --help lists {flag}:\n{help}");
    }
    for env in ["KODER_DNS_API_KEY", "KODER_DNS_TSIG_KEYS", "KODER_DNS_ETCD_PASSWORD"] {
        assert!(help.contains(env), "serve --help does not name {env}:\n{help}");
    }
    let dir = tempfile::tempdir().unwrap();
    let secret = "transfer.:hmac-sha256:c2VjcmV0LXNlY3JldC1zZWNyZXQ=";
    let out = run(serve(dir.path(), &["--tsig-key", secret]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--tsig-key is not accepted") && stderr.contains("KODER_DNS_TSIG_KEYS"),
        "{stderr}"
    );
    assert!(!stderr.contains("c2VjcmV0"), "the secret is repeated: {stderr}");
    // The variable is read (a malformed key there stops the start, naming the setting).
    let mut command = serve(dir.path(), &[]);
    command.env("KODER_DNS_TSIG_KEYS", "not-a-key");
    let out = run(command);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("tsig"), "{stderr}");
}

/// Environment variables are process-wide, so every environment-dependent check runs in a
/// child process of this test binary (the ignored test below), alone.
#[test]
fn config_sources_flags_beat_env_beat_file_beat_defaults() {
    let mut command = Command::new(std::env::current_exe().unwrap());
    for (k, _) in std::env::vars() {
        if k.starts_with("KODER_DNS") {
            command.env_remove(k);
        }
    }
    command.env(CHILD_MARKER, "1");
    command.args([
        "api::config_precedence_in_a_child_process",
        "--exact",
        "--ignored",
        "--test-threads=1",
        "--nocapture",
    ]);
    let out = run(command);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("1 passed"), "the child test did not run:\n{stdout}");
    assert!(
        stdout.contains("config checks ran in the child"),
        "the child test skipped its checks:\n{stdout}"
    );
}

/// Set only in the child process: `--include-ignored` (tests/run.sh) also runs the ignored
/// test below inside the parent, where changing the environment would race the other tests.
const CHILD_MARKER: &str = "KODERDNS_TEST_CONFIG_CHILD";

fn parse(args: &[&str]) -> anyhow::Result<koder_dns::config::Config> {
    use clap::Parser;
    use koder_dns::cli::{Cli, Command as Sub};
    let mut argv = vec!["koder-dns", "serve"];
    argv.extend_from_slice(args);
    match Cli::try_parse_from(argv)?.command {
        Sub::Serve(args) => args.into_config(),
        _ => unreachable!(),
    }
}

fn set(k: &str, v: &str) {
    // SAFETY: this runs alone in its own process (see the test above).
    unsafe { std::env::set_var(k, v) }
}

fn unset(k: &str) {
    // SAFETY: as above.
    unsafe { std::env::remove_var(k) }
}

#[test]
#[ignore = "run by config_sources_flags_beat_env_beat_file_beat_defaults in a child process"]
fn config_precedence_in_a_child_process() {
    use std::path::PathBuf;
    if std::env::var_os(CHILD_MARKER).is_none() {
        // Not the child: the environment is shared with the tests running beside this one.
        return;
    }
    for (k, _) in std::env::vars() {
        if k.starts_with("KODER_DNS") {
            unset(&k);
        }
    }
    let s = Duration::from_secs;

    // Defaults, as the README gives them.
    let c = parse(&[]).unwrap();
    assert_eq!(c.dns_listen.to_string(), "127.0.0.1:1053");
    assert_eq!(c.http_listen.to_string(), "127.0.0.1:8053");
    assert_eq!(c.domain, "service.koder");
    assert_eq!(c.default_ttl, s(90));
    assert_eq!(c.reaper_interval, s(30));
    assert_eq!(c.dns_ttl, s(5));
    assert_eq!(c.negative_ttl, s(5));
    assert_eq!(c.zones_dir, PathBuf::from("zones"));
    assert_eq!(c.data_dir, PathBuf::from("data"));
    assert!(c.api_keys.is_empty());

    // The file.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("koder-dns.toml");
    std::fs::write(
        &file,
        r#"
dns_listen = "127.0.0.2:2053"
http_listen = "127.0.0.2:2080"
domain = "file.koder"
default_ttl = "2m"
reaper_interval = "500ms"
dns_ttl = "7s"
negative_ttl = "8s"
zones_dir = "/file/zones"
data_dir = "/file/data"
api_keys = ["file-key-1", "file-key-2"]
"#,
    )
    .unwrap();
    let path = file.to_str().unwrap();
    let from_file = |c: &koder_dns::config::Config| {
        assert_eq!(c.dns_listen.to_string(), "127.0.0.2:2053");
        assert_eq!(c.http_listen.to_string(), "127.0.0.2:2080");
        assert_eq!(c.domain, "file.koder");
        assert_eq!(c.default_ttl, s(120));
        assert_eq!(c.reaper_interval, Duration::from_millis(500));
        assert_eq!(c.dns_ttl, s(7));
        assert_eq!(c.negative_ttl, s(8));
        assert_eq!(c.zones_dir, PathBuf::from("/file/zones"));
        assert_eq!(c.data_dir, PathBuf::from("/file/data"));
        assert_eq!(c.api_keys, vec!["file-key-1", "file-key-2"]);
    };
    from_file(&parse(&["--config", path]).unwrap());
    set("KODER_DNS_CONFIG", path);
    from_file(&parse(&[]).unwrap());
    unset("KODER_DNS_CONFIG");

    // A partial file leaves the rest at the defaults.
    let partial = dir.path().join("partial.toml");
    std::fs::write(&partial, "default_ttl = \"0\"\n").unwrap();
    let c = parse(&["--config", partial.to_str().unwrap()]).unwrap();
    assert_eq!(c.default_ttl, Duration::ZERO, "0 = never expire is accepted");
    assert_eq!(c.reaper_interval, s(30));
    assert_eq!(c.domain, "service.koder");

    // The environment beats the file.
    let env = [
        ("KODER_DNS_DNS_LISTEN", "127.0.0.3:3053"),
        ("KODER_DNS_HTTP_LISTEN", "127.0.0.3:3080"),
        ("KODER_DNS_DOMAIN", "env.koder"),
        ("KODER_DNS_DEFAULT_TTL", "45s"),
        ("KODER_DNS_REAPER_INTERVAL", "3s"),
        ("KODER_DNS_DNS_TTL", "9s"),
        ("KODER_DNS_NEGATIVE_TTL", "10s"),
        ("KODER_DNS_ZONES_DIR", "/env/zones"),
        ("KODER_DNS_DATA_DIR", "/env/data"),
        ("KODER_DNS_API_KEY", "env-key-1, env-key-2"),
    ];
    for (k, v) in env {
        set(k, v);
    }
    let from_env = |c: &koder_dns::config::Config| {
        assert_eq!(c.dns_listen.to_string(), "127.0.0.3:3053");
        assert_eq!(c.http_listen.to_string(), "127.0.0.3:3080");
        assert_eq!(c.domain, "env.koder");
        assert_eq!(c.default_ttl, s(45));
        assert_eq!(c.reaper_interval, s(3));
        assert_eq!(c.dns_ttl, s(9));
        assert_eq!(c.negative_ttl, s(10));
        assert_eq!(c.zones_dir, PathBuf::from("/env/zones"));
        assert_eq!(c.data_dir, PathBuf::from("/env/data"));
        assert_eq!(c.api_keys, vec!["env-key-1", "env-key-2"], "comma-separated keys");
    };
    from_env(&parse(&["--config", path]).unwrap());
    from_env(&parse(&[]).unwrap());

    // Flags beat the environment.
    let flags = [
        "--config",
        path,
        "--dns-listen",
        "127.0.0.4:4053",
        "--http-listen",
        "127.0.0.4:4080",
        "--domain",
        "flag.koder",
        "--default-ttl",
        "15s",
        "--reaper-interval",
        "250ms",
        "--dns-ttl",
        "1s",
        "--negative-ttl",
        "2s",
        "--zones-dir",
        "/flag/zones",
        "--data-dir",
        "/flag/data",
    ];
    let c = parse(&flags).unwrap();
    assert_eq!(c.dns_listen.to_string(), "127.0.0.4:4053");
    assert_eq!(c.http_listen.to_string(), "127.0.0.4:4080");
    assert_eq!(c.domain, "flag.koder");
    assert_eq!(c.default_ttl, s(15));
    assert_eq!(c.reaper_interval, Duration::from_millis(250));
    assert_eq!(c.dns_ttl, s(1));
    assert_eq!(c.negative_ttl, s(2));
    assert_eq!(c.zones_dir, PathBuf::from("/flag/zones"));
    assert_eq!(c.data_dir, PathBuf::from("/flag/data"));
    assert_eq!(
        c.api_keys,
        vec!["env-key-1", "env-key-2"],
        "no flag for keys: the environment's"
    );

    // Mixed: each setting from the strongest source that has it.
    for k in [
        "KODER_DNS_DNS_LISTEN",
        "KODER_DNS_HTTP_LISTEN",
        "KODER_DNS_DOMAIN",
        "KODER_DNS_API_KEY",
        "KODER_DNS_ZONES_DIR",
    ] {
        unset(k);
    }
    let c = parse(&["--config", path, "--default-ttl", "1m", "--domain", "flag.koder"]).unwrap();
    assert_eq!(c.default_ttl, s(60), "flag over env and file");
    assert_eq!(c.domain, "flag.koder", "flag over file");
    assert_eq!(c.reaper_interval, s(3), "env over file");
    assert_eq!(c.dns_ttl, s(9), "env over file");
    assert_eq!(c.data_dir, PathBuf::from("/env/data"), "env over file");
    assert_eq!(c.dns_listen.to_string(), "127.0.0.2:2053", "file, nothing stronger");
    assert_eq!(c.zones_dir, PathBuf::from("/file/zones"), "file, nothing stronger");
    assert_eq!(
        c.api_keys,
        vec!["file-key-1", "file-key-2"],
        "file keys when the environment has none"
    );
    let c = parse(&["--default-ttl", "1m"]).unwrap();
    assert_eq!(c.default_ttl, s(60));
    assert_eq!(c.reaper_interval, s(3), "env over default");
    assert_eq!(c.domain, "service.koder", "default, nothing stronger");
    assert_eq!(c.http_listen.to_string(), "127.0.0.1:8053");

    // Bad values are refused, naming the setting.
    set("KODER_DNS_DEFAULT_TTL", "banana");
    let e = parse(&[]).unwrap_err().to_string();
    assert!(e.contains("default-ttl"), "{e}");
    assert!(
        parse(&["--default-ttl", "90s"]).is_ok(),
        "a flag overrides a bad environment value"
    );
    unset("KODER_DNS_DEFAULT_TTL");
    let e = parse(&["--default-ttl", "banana"]).unwrap_err().to_string();
    assert!(e.contains("default-ttl"), "{e}");
    let e = parse(&["--reaper-interval", "0"]).unwrap_err().to_string();
    assert!(e.contains("reaper-interval"), "{e}");
    let e = parse(&["--domain", "bad domain!"]).unwrap_err().to_string();
    assert!(e.contains("domain"), "{e}");
    let e = parse(&["--dns-listen", "nowhere"]).unwrap_err().to_string();
    assert!(e.contains("dns-listen"), "{e}");
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "reaper_interval = \"forever\"\n").unwrap();
    let e = format!("{:#}", parse(&["--config", bad.to_str().unwrap()]).unwrap_err());
    assert!(e.contains("reaper_interval"), "{e}");
    std::fs::write(&bad, "api_key = \"singular\"\n").unwrap();
    let e = format!("{:#}", parse(&["--config", bad.to_str().unwrap()]).unwrap_err());
    assert!(e.contains("api_key"), "unknown key refused: {e}");
    println!("config checks ran in the child");
}

/// Without a key nothing under /api/v1 is revealed, not even which routes exist.
#[tokio::test]
async fn unknown_api_routes_need_a_key_too() {
    let server = common::start().await;
    for (method, path) in [
        ("GET", "/api/v1/nope"),
        ("GET", "/api/v1/services/register"),
        ("DELETE", "/api/v1/services"),
    ] {
        let request = server.http.request(method.parse().unwrap(), server.url(path));
        let (status, body) = server.send(request).await;
        assert_eq!(status, 401, "{method} {path} without a key: {body}");
        assert_eq!(body["error"], "unauthorized");
    }
    let (status, body) = server.get("/api/v1/nope").await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = server
        .send(
            server
                .http
                .get(server.url("/api/v1/services/register"))
                .header("X-API-Key", common::KEY),
        )
        .await;
    assert_eq!(status, 405, "{body}");
    server.running.shutdown().await.expect("durable state flushed");
}
