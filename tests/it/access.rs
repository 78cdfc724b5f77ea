//! Keys and scopes: every scope against every route (a table), the bodies of 401 and 403, a
//! register key kept to its services (the stored instance's service included), `keys new`,
//! a bad keys file refused at start, and no token in the log, `/metrics` or the command line.

use std::path::Path;
use std::process::Command;

use reqwest::Method;
use serde_json::{Value, json};

use crate::child;
use crate::common::{self, KEY, TestServer};

/// A fresh token and its `[[key]]` table, from `koder-dns keys new`.
fn new_key(id: &str, scope: &str, services: &[&str]) -> (String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_koder-dns"));
    cmd.args(["keys", "new", "--id", id, "--scope", scope]);
    for service in services {
        cmd.args(["--service", service]);
    }
    let out = cmd.output().expect("run koder-dns keys new");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let (token, table) = text.split_once('\n').unwrap();
    (token.to_owned(), table.to_owned())
}

/// The read key `edge` and the register key `voice-agent` (voice, sip-*), in a keys file.
struct Keys {
    read: String,
    register: String,
    file: tempfile::NamedTempFile,
}

impl Keys {
    fn new() -> Self {
        let (read, edge) = new_key("edge", "read", &[]);
        let (register, agent) = new_key("voice-agent", "register", &["voice", "sip-*"]);
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), format!("{edge}\n{agent}")).unwrap();
        Self { read, register, file }
    }

    fn path(&self) -> &Path {
        self.file.path()
    }
}

async fn send(
    server: &TestServer,
    method: Method,
    path: &str,
    key: Option<&str>,
    body: Option<&Value>,
) -> (u16, Value) {
    let mut request = server.http.request(method, server.url(path));
    if let Some(key) = key {
        request = request.header("X-API-Key", key);
    }
    request = match body {
        // The drift reference goes as it is: a TOML file, not JSON.
        Some(Value::String(text)) => request.body(text.clone()),
        Some(body) => request.json(body),
        None => request,
    };
    server.send(request).await
}

/// What a request is, for the table: a read, or a change to an instance of a service.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Read,
    Change(&'static str),
}

/// The status a scope is refused a kind of request with, or `None` when it is served.
type Refused = fn(Kind) -> Option<u16>;

#[tokio::test]
async fn every_scope_against_every_route() {
    let keys = Keys::new();
    let path = keys.path().to_owned();
    let server = common::start_with(|c| c.keys_file = Some(path)).await;
    // Any ports file will do as the drift reference: the export of the registry as it starts.
    let drift = server
        .http
        .get(server.url("/api/v1/services/export"))
        .header("X-API-Key", KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let routes: Vec<(Method, &str, Option<Value>, Kind)> = vec![
        (Method::GET, "/api/v1/services", None, Kind::Read),
        (
            Method::GET,
            "/api/v1/services?detail=1&healthy_only=1",
            None,
            Kind::Read,
        ),
        (Method::GET, "/api/v1/services/export", None, Kind::Read),
        (Method::GET, "/api/v1/services/drift", None, Kind::Read),
        (Method::POST, "/api/v1/services/drift", Some(json!(drift)), Kind::Read),
        (Method::GET, "/api/v1/routes", None, Kind::Read),
        (Method::GET, "/api/v1/sd/prometheus", None, Kind::Read),
        (Method::GET, "/api/v1/openapi.json", None, Kind::Read),
        (Method::GET, "/api/v1/services?index=1&wait=1ms", None, Kind::Read),
        (
            Method::POST,
            "/api/v1/services/register",
            Some(json!({"id": "voice-2", "name": "voice", "address": "10.0.0.2", "port": 5060})),
            Kind::Change("voice"),
        ),
        (
            Method::POST,
            "/api/v1/services/register",
            Some(json!({"name": "SIP-edge", "address": "10.0.0.3", "port": 5060})),
            Kind::Change("sip-edge"),
        ),
        (
            Method::POST,
            "/api/v1/services/register",
            Some(json!({"id": "db-2", "name": "db", "address": "10.0.0.4", "port": 5432})),
            Kind::Change("db"),
        ),
        // Taking over db's id under a name the key may register is changing db.
        (
            Method::POST,
            "/api/v1/services/register",
            Some(json!({"id": "db-1", "name": "voice", "address": "10.6.6.6", "port": 5060})),
            Kind::Change("db"),
        ),
        (
            Method::POST,
            "/api/v1/services/heartbeat",
            Some(json!({"id": "voice-1"})),
            Kind::Change("voice"),
        ),
        (
            Method::POST,
            "/api/v1/services/heartbeat",
            Some(json!({"id": "db-1"})),
            Kind::Change("db"),
        ),
        (
            Method::POST,
            "/api/v1/services/deregister",
            Some(json!({"id": "voice-1"})),
            Kind::Change("voice"),
        ),
        (
            Method::POST,
            "/api/v1/services/deregister",
            Some(json!({"id": "db-1"})),
            Kind::Change("db"),
        ),
    ];
    let scopes: [(&str, Option<&str>, Refused); 5] = [
        // Some(status) when the scope is refused with it, None when the route answers.
        ("admin", Some(KEY), |_| None),
        ("read", Some(keys.read.as_str()), |kind| match kind {
            Kind::Read => None,
            Kind::Change(_) => Some(403),
        }),
        ("register", Some(keys.register.as_str()), |kind| match kind {
            Kind::Change(service) if service != "voice" && !service.starts_with("sip-") => Some(403),
            _ => None,
        }),
        ("unknown key", Some("kdns_not-a-key-of-this-server"), |_| Some(401)),
        ("no key", None, |_| Some(401)),
    ];
    for (scope, key, refused) in scopes {
        for (method, path, body, kind) in &routes {
            // The same fixtures before every request: db-1 of db, voice-1 of voice.
            server
                .register(json!({"id": "db-1", "name": "db", "address": "10.0.0.1", "port": 5432}))
                .await;
            server
                .register(json!({"id": "voice-1", "name": "voice", "address": "10.0.0.1", "port": 5060}))
                .await;
            let (status, answer) = send(&server, method.clone(), path, key, body.as_ref()).await;
            let what = format!("{scope}: {method} {path} {body:?}");
            match refused(*kind) {
                Some(expected) => assert_eq!(status, expected, "{what}: {answer}"),
                None => {
                    assert!(![401, 403].contains(&status), "{what}: {status} {answer}");
                    // Reads answer 200 (drift without a reference: 404); changes 200.
                    let wanted = if *path == "/api/v1/services/drift" && *method == Method::GET {
                        404
                    } else {
                        200
                    };
                    assert_eq!(status, wanted, "{what}: {answer}");
                }
            }
        }
    }
    // A refused change changed nothing: db-1 is still db's, at its own address.
    let (_, listed) = server.get("/api/v1/services?detail=1&name=db").await;
    assert_eq!(listed["instances"][0]["address"], "10.0.0.1", "{listed}");
}

#[tokio::test]
async fn unknown_ids_stay_410_and_404_for_a_register_key() {
    let keys = Keys::new();
    let path = keys.path().to_owned();
    let server = common::start_with(|c| c.keys_file = Some(path)).await;
    let key = Some(keys.register.as_str());
    let heartbeat = json!({"id": "nobody"});
    let (status, _) = send(
        &server,
        Method::POST,
        "/api/v1/services/heartbeat",
        key,
        Some(&heartbeat),
    )
    .await;
    assert_eq!(status, 410);
    let (status, _) = send(
        &server,
        Method::POST,
        "/api/v1/services/deregister",
        key,
        Some(&heartbeat),
    )
    .await;
    assert_eq!(status, 404);
    // Unknown routes under /api/v1: 404 with any known key, 401 without.
    let (status, _) = send(&server, Method::GET, "/api/v1/nosuch", Some(keys.read.as_str()), None).await;
    assert_eq!(status, 404);
    let (status, _) = send(&server, Method::GET, "/api/v1/nosuch", Some("wrong"), None).await;
    assert_eq!(status, 401);
}

#[tokio::test]
async fn a_401_and_a_403_say_what_was_wrong_and_never_repeat_the_token() {
    let keys = Keys::new();
    let path = keys.path().to_owned();
    let server = common::start_with(|c| c.keys_file = Some(path)).await;
    let (status, body) = send(&server, Method::GET, "/api/v1/services", Some("kdns_wrong-token"), None).await;
    assert_eq!(status, 401);
    assert_eq!(body["error"], "unauthorized");
    assert!(!body.to_string().contains("wrong-token"), "{body}");

    let register = json!({"name": "voice", "address": "10.0.0.1", "port": 5060});
    let (status, body) = send(
        &server,
        Method::POST,
        "/api/v1/services/register",
        Some(&keys.read),
        Some(&register),
    )
    .await;
    assert_eq!(status, 403);
    assert_eq!(body.as_object().unwrap().len(), 2, "{body}");
    assert_eq!(body["error"], "forbidden");
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("\"edge\"")
            && message.contains("scope read")
            && message.contains("POST /api/v1/services/register"),
        "{message}"
    );
    assert!(!message.contains(&keys.read), "{message}");

    let db = json!({"name": "db", "address": "10.0.0.1", "port": 5432});
    let (status, body) = send(
        &server,
        Method::POST,
        "/api/v1/services/register",
        Some(&keys.register),
        Some(&db),
    )
    .await;
    assert_eq!(status, 403);
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("\"voice-agent\"") && message.contains("service \"db\"") && message.contains("voice, sip-*"),
        "{message}"
    );
    server
        .register(json!({"id": "db-1", "name": "db", "address": "10.0.0.1", "port": 5432}))
        .await;
    let (status, body) = send(
        &server,
        Method::POST,
        "/api/v1/services/heartbeat",
        Some(&keys.register),
        Some(&json!({"id": "db-1"})),
    )
    .await;
    assert_eq!(status, 403);
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("renew instance \"db-1\", which belongs to service \"db\""),
        "{body}"
    );
    // A registration refused for its service is counted as such (one refused before its
    // body was read, for the key's scope, is a 403 of the route, like a 401).
    let metrics = common::scrape(&server.http, &server.base).await;
    assert!(
        common::sample(
            &metrics,
            r#"koder_dns_registrations_total{outcome="refused",reason="forbidden"}"#
        ) >= 1.0,
        "{metrics}"
    );
}

#[tokio::test]
async fn keys_new_refuses_what_cannot_be_a_key() {
    for args in [
        &["keys", "new", "--id", "a", "--scope", "register"][..],
        &["keys", "new", "--id", "a", "--scope", "read", "--service", "voice"],
        &["keys", "new", "--id", "a", "--scope", "root"],
        &[
            "keys",
            "new",
            "--id",
            "a",
            "--scope",
            "register",
            "--service",
            "bad name",
        ],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_koder-dns"))
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(out.stdout.is_empty(), "{args:?}: no token printed");
    }
    // Two keys made one after the other differ.
    assert_ne!(new_key("a", "read", &[]).0, new_key("a", "read", &[]).0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_keys_file_stops_the_start_naming_its_line() {
    let data = tempfile::tempdir().unwrap();
    let (_, table) = new_key("edge", "read", &[]);
    let file = data.path().join("keys.toml");
    std::fs::write(&file, format!("{table}owner = \"ops\"\n")).unwrap();
    let (status, stderr) = child::launch_refused(data.path(), &["--keys-file", file.to_str().unwrap()]).await;
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("keys.toml:5") && stderr.contains("unknown field"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_appear_in_no_log_line_metric_or_command_line_and_changes_name_their_key() {
    let data = tempfile::tempdir().unwrap();
    let keys = Keys::new();
    let proc = child::launch_ok(data.path(), &["--keys-file", keys.path().to_str().unwrap()]).await;
    let http = common::http();
    let base = proc.base();
    let post = |key: &str, path: &str, body: Value| {
        http.post(format!("{base}{path}"))
            .header("X-API-Key", key)
            .json(&body)
            .send()
    };
    let registered = post(
        &keys.register,
        "/api/v1/services/register",
        json!({"id": "v1", "name": "voice", "address": "10.0.0.1", "port": 5060}),
    )
    .await
    .unwrap();
    assert_eq!(registered.status(), 200);
    assert_eq!(
        post(
            &keys.read,
            "/api/v1/services/register",
            json!({"name": "voice", "address": "10.0.0.1", "port": 1})
        )
        .await
        .unwrap()
        .status(),
        403
    );
    assert_eq!(
        post("kdns_guess", "/api/v1/services/deregister", json!({"id": "v1"}))
            .await
            .unwrap()
            .status(),
        401
    );
    let deregistered = post(child::KEY, "/api/v1/services/deregister", json!({"id": "v1"}))
        .await
        .unwrap();
    assert_eq!(deregistered.status(), 200);
    let metrics = common::scrape(&http, &base).await;
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", proc.child.id())).unwrap();
    let cmdline = String::from_utf8_lossy(&cmdline).into_owned();
    let (_, log) = proc.terminate().await;
    for token in [keys.read.as_str(), keys.register.as_str(), child::KEY, "kdns_guess"] {
        assert!(!log.contains(token), "a token in the log:\n{log}");
        assert!(!metrics.contains(token), "a token in /metrics");
        assert!(!cmdline.contains(token), "a token on the command line: {cmdline}");
    }
    // Each accepted change: which key, from where.
    let line = |what: &str| {
        log.lines()
            .find(|l| l.contains("koder_dns::audit") && l.contains(what))
            .unwrap_or_else(|| panic!("no audit line {what:?}:\n{log}"))
            .to_owned()
    };
    let registered = line("registered");
    assert!(
        registered.contains("key=voice-agent")
            && registered.contains("client=127.0.0.1:")
            && registered.contains("id=v1"),
        "{registered}"
    );
    let deregistered = line("deregistered");
    assert!(
        deregistered.contains("key=api-key-1") && deregistered.contains("client=127.0.0.1:"),
        "{deregistered}"
    );
}
