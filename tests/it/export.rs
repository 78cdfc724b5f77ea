//! Edge routes (R5) and generated artifacts (R8), issue #4: `GET /api/v1/routes`, the
//! `koder-service-ports.toml` export and its golden file, the drift check over REST, and the
//! `koder-dns export` / `koder-dns drift` commands run as child processes against the
//! in-process server.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use crate::common::{KEY, TestServer};
use serde_json::{Value, json};

const GOLDEN: &str = "tests/data/ports.golden.toml";

// ---------------------------------------------------------------------------------------
// helpers

async fn routes(server: &TestServer) -> Vec<Value> {
    let (status, body) = server.get("/api/v1/routes").await;
    assert_eq!(status, 200, "GET /routes: {body}");
    body["routes"].as_array().expect("routes array").clone()
}

fn route<'a>(routes: &'a [Value], domain: &str) -> &'a Value {
    routes
        .iter()
        .find(|r| r["domain"] == domain)
        .unwrap_or_else(|| panic!("no route for {domain}: {routes:?}"))
}

fn domains(routes: &[Value]) -> Vec<&str> {
    routes.iter().map(|r| r["domain"].as_str().unwrap()).collect()
}

fn route_ids(route: &Value) -> Vec<&str> {
    route["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].as_str().unwrap())
        .collect()
}

/// The export as raw text, with its Content-Type.
async fn export_text(server: &TestServer) -> (String, String) {
    let response = server
        .http
        .get(server.url("/api/v1/services/export"))
        .header("X-API-Key", KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let content_type = response
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (response.text().await.unwrap(), content_type)
}

/// `POST /services/drift` with `reference` as the raw body.
async fn drift(server: &TestServer, reference: impl Into<reqwest::Body>) -> (u16, Value) {
    server
        .send(
            server
                .http
                .post(server.url("/api/v1/services/drift"))
                .header("X-API-Key", KEY)
                .body(reference),
        )
        .await
}

/// The fixed registry behind the golden file. Covers: several instances on one port, a
/// port shared by two services (owner = most instances), a tie (owner = first by name),
/// `service`/`container` from metadata and from tags (metadata wins), the same port on two
/// protocols, and a host-name address.
async fn fixed_registry(server: &TestServer) {
    let instances = [
        // Registered out of order on purpose: the export must not depend on it.
        json!({"id": "zeta-1", "name": "zeta", "address": "10.0.9.1", "port": 9000}),
        json!({"id": "voice-2", "name": "voice", "address": "10.0.0.2", "port": 5060, "protocol": "udp",
               "tags": ["container=koder-voice"]}),
        json!({"id": "voice-1", "name": "voice", "address": "10.0.0.1", "port": 5060, "protocol": "udp",
               "metadata": {"container": "koder-voice", "jet.domain": "voice.koder.dev"}}),
        json!({"id": "api-2", "name": "api", "address": "10.0.1.2", "port": 8080,
               "metadata": {"service": "koder-api", "container": "api"}}),
        json!({"id": "metrics-1", "name": "metrics", "address": "metrics.internal", "port": 8080}),
        json!({"id": "api-1", "name": "api", "address": "10.0.1.1", "port": 8080,
               "tags": ["service=koder-api", "container=api"]}),
        json!({"id": "pg-1", "name": "postgres", "address": "10.0.3.1", "port": 5432,
               "tags": ["container=from-tag"], "metadata": {"container": "koder-postgres"}}),
        json!({"id": "dns-udp", "name": "dns", "address": "10.0.4.1", "port": 53, "protocol": "udp"}),
        json!({"id": "dns-tcp", "name": "dns", "address": "10.0.4.1", "port": 53, "protocol": "tcp"}),
        json!({"id": "alpha-1", "name": "alpha", "address": "10.0.9.2", "port": 9000}),
    ];
    for i in instances {
        server.register(i).await;
    }
}

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_koder-dns")
}

/// Runs the binary with `args`, no KODER_DNS_* environment, within 20 s.
/// The tool with `args`, the API key `key` in `KODER_DNS_API_KEY` (the only place it is
/// taken from), and no other `KODER_DNS_*` variable.
async fn run(key: Option<&str>, args: &[&str]) -> Output {
    let mut command = tokio::process::Command::new(bin());
    command.args(args).kill_on_drop(true);
    for (k, _) in std::env::vars() {
        if k.starts_with("KODER_DNS_") {
            command.env_remove(k);
        }
    }
    if let Some(key) = key {
        command.env("KODER_DNS_API_KEY", key);
    }
    tokio::time::timeout(Duration::from_secs(20), command.output())
        .await
        .expect("the command finished")
        .expect("the command ran")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `koder-dns export --url <base> -o <file>`.
async fn cli_export(base: &str, file: &Path) -> Output {
    run(Some(KEY), &["export", "--url", base, "-o", file.to_str().unwrap()]).await
}

async fn cli_drift(server: &TestServer, reference: &Path, json: bool) -> Output {
    let reference = reference.to_str().unwrap();
    let mut args = vec!["drift", "--reference", reference, "--url", &server.base];
    if json {
        args.push("--json");
    }
    run(Some(KEY), &args).await
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// A URL nothing answers on.
fn dead_url() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}", listener.local_addr().unwrap())
}

/// A live registry of three ports, and a reference that differs from it in one of each
/// kind: 7000 missing (reference only), 7002 extra (live only), 7001 owner_mismatch.
async fn drifting(server: &TestServer) -> &'static str {
    server
        .register(json!({"id": "a", "name": "alpha", "address": "10.0.0.1", "port": 7001}))
        .await;
    server
        .register(json!({"id": "b", "name": "beta", "address": "10.0.0.2", "port": 7002}))
        .await;
    server
        .register(json!({"id": "c", "name": "gamma", "address": "10.0.0.3", "port": 7003}))
        .await;
    "\
[[ports]]
port = 7000
service = \"ghost\"
container = \"ghost-box\"

[[ports]]
port = 7001
service = \"impostor\"

[[ports]]
port = 7003
service = \"gamma\"
"
}

// ---------------------------------------------------------------------------------------
// R5: edge routes

#[tokio::test]
async fn route_opt_in_via_metadata() {
    let server = common::start().await;
    server
        .register(
            json!({"id": "voice-1", "name": "voice", "address": "10.0.0.1", "port": 5060,
                         "metadata": {"jet.domain": "voice.koder.dev"}}),
        )
        .await;
    // Case and a trailing dot do not make another domain.
    server
        .register(
            json!({"id": "voice-2", "name": "voice", "address": "10.0.0.2", "port": 5060,
                         "metadata": {"jet.domain": "Voice.Koder.Dev."}}),
        )
        .await;
    let routes = routes(&server).await;
    assert_eq!(domains(&routes), vec!["voice.koder.dev"], "{routes:?}");
    let r = route(&routes, "voice.koder.dev");
    assert_eq!(r["conflict"], false);
    assert_eq!(r["services"], json!(["voice"]));
    assert_eq!(
        r["instances"],
        json!([
            {"id": "voice-1", "service": "voice", "address": "10.0.0.1", "port": 5060, "healthy": true},
            {"id": "voice-2", "service": "voice", "address": "10.0.0.2", "port": 5060, "healthy": true},
        ])
    );
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn route_opt_in_via_tag() {
    let server = common::start().await;
    server
        .register(
            json!({"id": "chat-1", "name": "chat", "address": "10.0.0.3", "port": 443,
                         "tags": ["edge", "jet.domain=chat.koder.dev"]}),
        )
        .await;
    let routes = routes(&server).await;
    assert_eq!(domains(&routes), vec!["chat.koder.dev"]);
    assert_eq!(route_ids(route(&routes, "chat.koder.dev")), vec!["chat-1"]);
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn route_metadata_wins_over_tag() {
    let server = common::start().await;
    server
        .register(
            json!({"id": "both-1", "name": "both", "address": "10.0.0.4", "port": 443,
                         "tags": ["jet.domain=from-tag.koder.dev"], "metadata": {"jet.domain": "from-meta.koder.dev"}}),
        )
        .await;
    let routes = routes(&server).await;
    assert_eq!(
        domains(&routes),
        vec!["from-meta.koder.dev"],
        "metadata must win over the tag: {routes:?}"
    );
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn internal_only_instance_is_not_routed() {
    let server = common::start().await;
    server
        .register(json!({"id": "db-1", "name": "db", "address": "10.0.0.5", "port": 5432,
                           "tags": ["internal", "container=db"], "metadata": {"service": "db"}}))
        .await;
    assert_eq!(routes(&server).await, Vec::<Value>::new(), "no jet.domain: no route");
    // Routed and internal instances of the same service: only the routed one is listed.
    server
        .register(
            json!({"id": "web-public", "name": "web", "address": "10.0.0.6", "port": 80,
                         "metadata": {"jet.domain": "www.koder.dev"}}),
        )
        .await;
    server
        .register(json!({"id": "web-internal", "name": "web", "address": "10.0.0.7", "port": 80}))
        .await;
    let routes = routes(&server).await;
    assert_eq!(domains(&routes), vec!["www.koder.dev"]);
    assert_eq!(route_ids(route(&routes, "www.koder.dev")), vec!["web-public"]);
    // Internal-only is still registered and discoverable.
    let (_, names) = server.get("/api/v1/services").await;
    assert_eq!(names["services"], json!(["db", "web"]));
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn invalid_jet_domain_is_400() {
    let server = common::start().await;
    let bad = [
        "not a domain",
        "localhost",
        "-bad.koder.dev",
        "bad_.koder.dev",
        "koder..dev",
        "http://x.koder.dev",
    ];
    for domain in bad {
        for body in [
            json!({"name": "edge", "address": "10.0.0.1", "port": 443, "metadata": {"jet.domain": domain}}),
            json!({"name": "edge", "address": "10.0.0.1", "port": 443, "tags": [format!("jet.domain={domain}")]}),
        ] {
            let (status, response) = server.post("/api/v1/services/register", &body).await;
            assert_eq!(status, 400, "{body} must be refused: {response}");
            let message = response["message"].as_str().unwrap_or_default();
            assert!(
                message.contains("jet.domain"),
                "{body}: the message must name jet.domain: {message}"
            );
        }
    }
    assert_eq!(routes(&server).await, Vec::<Value>::new());
    let (_, names) = server.get("/api/v1/services").await;
    assert_eq!(names["services"], json!([]), "nothing invalid was stored");
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn two_services_claiming_one_domain_are_a_conflict() {
    let server = common::start().await;
    server
        .register(
            json!({"id": "voice-1", "name": "voice", "address": "10.0.0.1", "port": 5060,
                         "metadata": {"jet.domain": "voice.koder.dev"}}),
        )
        .await;
    server
        .register(
            json!({"id": "voice-2", "name": "voice", "address": "10.0.0.2", "port": 5060,
                         "metadata": {"jet.domain": "voice.koder.dev"}}),
        )
        .await;
    let routes_before = routes(&server).await;
    assert_eq!(
        route(&routes_before, "voice.koder.dev")["conflict"],
        false,
        "one service, two instances: no conflict"
    );

    server
        .register(
            json!({"id": "rogue-1", "name": "rogue", "address": "10.0.0.9", "port": 8080,
                         "tags": ["jet.domain=voice.koder.dev"]}),
        )
        .await;
    let claimed = routes(&server).await;
    let r = route(&claimed, "voice.koder.dev");
    assert_eq!(r["conflict"], true, "two services on one domain: {r}");
    assert_eq!(r["services"], json!(["rogue", "voice"]));
    assert_eq!(
        route_ids(r),
        vec!["rogue-1", "voice-1", "voice-2"],
        "every claimant is listed"
    );

    // The conflict ends when the second claimant leaves.
    let (status, _) = server
        .post("/api/v1/services/deregister", &json!({"id": "rogue-1"}))
        .await;
    assert_eq!(status, 200);
    assert_eq!(route(&routes(&server).await, "voice.koder.dev")["conflict"], false);
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn route_keeps_unhealthy_instances_with_their_flag() {
    let server = common::start().await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    server
        .register(
            json!({"id": "app-down", "name": "app", "address": "127.0.0.1", "port": closed,
                         "metadata": {"jet.domain": "app.koder.dev", "check": "tcp",
                                      "check_interval": "100ms", "check_timeout": "200ms"}}),
        )
        .await;
    server
        .register(json!({"id": "app-up", "name": "app", "address": "10.0.0.2", "port": 80,
                         "metadata": {"jet.domain": "app.koder.dev"}}))
        .await;
    // The health checker marks app-down unhealthy…
    let start = Instant::now();
    loop {
        let (_, body) = server.get("/api/v1/services?detail=1&healthy_only=1").await;
        if body["instances"].as_array().unwrap().len() == 1 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "app-down never turned unhealthy"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // …and the route still lists it, flagged, so the edge can drain it.
    let routes = routes(&server).await;
    let r = route(&routes, "app.koder.dev");
    let flags: Vec<(&str, bool)> = r["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (i["id"].as_str().unwrap(), i["healthy"].as_bool().unwrap()))
        .collect();
    assert_eq!(flags, vec![("app-down", false), ("app-up", true)]);
    server.running.shutdown().await.expect("durable state flushed");
}

// ---------------------------------------------------------------------------------------
// R8: the export

#[tokio::test]
async fn export_matches_the_golden_file() {
    let server = common::start().await;
    fixed_registry(&server).await;
    let (text, content_type) = export_text(&server).await;
    assert!(
        content_type.starts_with("application/toml"),
        "Content-Type: {content_type}"
    );
    if std::env::var_os("KODER_DNS_UPDATE_GOLDEN").is_some() {
        std::fs::write(GOLDEN, &text).unwrap();
    }
    let golden = std::fs::read_to_string(GOLDEN).expect("the golden file");
    assert!(
        text == golden,
        "the export differs from {GOLDEN}:\n--- export ---\n{text}\n--- golden ---\n{golden}"
    );
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn export_of_an_empty_registry_is_a_valid_ports_file() {
    let server = common::start().await;
    let (text, content_type) = export_text(&server).await;
    assert!(content_type.starts_with("application/toml"));
    assert!(
        text.starts_with("# koder-service-ports.toml"),
        "the export starts with its header: {text}"
    );
    let parsed: toml::Value = toml::from_str(&text).expect("the export is TOML");
    assert_eq!(
        parsed
            .get("ports")
            .and_then(|p| p.as_array())
            .map(|p| p.len())
            .unwrap_or(0),
        0,
        "{text}"
    );
    let (status, report) = drift(&server, text).await;
    assert_eq!(status, 200);
    assert_eq!(report["drift"], false);
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn export_leaves_out_expired_instances() {
    let (server, clock) = common::start_manual(|_| {}).await;
    server
        .register(
            json!({"id": "short", "name": "short", "address": "10.0.0.1", "port": 6001, "ttl_ns": 1_000_000_000i64}),
        )
        .await;
    server
        .register(
            json!({"id": "long", "name": "long", "address": "10.0.0.2", "port": 6002, "ttl_ns": 3_600_000_000_000i64}),
        )
        .await;
    let (before, _) = export_text(&server).await;
    assert!(before.contains("6001") && before.contains("6002"), "{before}");
    clock.advance(Duration::from_secs(2));
    let (after, _) = export_text(&server).await;
    assert!(
        !after.contains("6001") && !after.contains("\"short\""),
        "an expired instance must not be exported:\n{after}"
    );
    assert!(after.contains("6002"), "{after}");
    server.running.shutdown().await.expect("durable state flushed");
}

// ---------------------------------------------------------------------------------------
// R8: drift over REST

#[tokio::test]
async fn export_round_trip_has_no_drift() {
    let server = common::start().await;
    fixed_registry(&server).await;
    let (text, _) = export_text(&server).await;
    let (status, report) = drift(&server, text).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(
        report,
        json!({"drift": false, "missing": [], "extra": [], "owner_mismatch": []})
    );
    // The golden file is a valid reference for the same registry too.
    let (status, report) = drift(&server, std::fs::read_to_string(GOLDEN).unwrap()).await;
    assert_eq!(status, 200);
    assert_eq!(report["drift"], false, "{report}");
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn drift_detects_a_missing_port() {
    let server = common::start().await;
    server
        .register(json!({"id": "a", "name": "alpha", "address": "10.0.0.1", "port": 7001}))
        .await;
    // A hand-written reference: protocol defaults to tcp, instances may be left out.
    let reference = "\
[[ports]]
port = 7001
service = \"alpha\"

[[ports]]
port = 7000
protocol = \"udp\"
service = \"ghost\"
container = \"ghost-box\"
";
    let (status, report) = drift(&server, reference).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["drift"], true);
    assert_eq!(
        report["missing"],
        json!([{"port": 7000, "protocol": "udp", "service": "ghost", "container": "ghost-box"}])
    );
    assert_eq!(report["extra"], json!([]));
    assert_eq!(report["owner_mismatch"], json!([]));
    server.running.shutdown().await.expect("durable state flushed");
}

/// The export of a large registry is well over the 64 KiB limit of JSON bodies; the drift
/// check must still take it.
#[tokio::test]
async fn drift_takes_a_reference_larger_than_64_kib() {
    let server = common::start().await;
    let reference: String = (1..=3000)
        .map(|port| {
            format!(
                "[[ports]]\nport = {port}\nservice = \"svc{port}\"\ninstances = [\"svc{port}-10.0.0.1-{port}\"]\n\n"
            )
        })
        .collect();
    assert!(
        reference.len() > 64 * 1024,
        "the fixture must exceed 64 KiB: {} bytes",
        reference.len()
    );
    let (status, report) = drift(&server, reference).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["missing"].as_array().unwrap().len(), 3000);
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn drift_detects_an_extra_port() {
    let server = common::start().await;
    server
        .register(json!({"id": "a", "name": "alpha", "address": "10.0.0.1", "port": 7001}))
        .await;
    server
        .register(json!({"id": "b", "name": "beta", "address": "10.0.0.2", "port": 7002,
                           "metadata": {"container": "beta-box"}}))
        .await;
    // Same port number, other protocol: also extra.
    server
        .register(json!({"id": "a-udp", "name": "alpha", "address": "10.0.0.1", "port": 7001, "protocol": "udp"}))
        .await;
    let reference = "[[ports]]\nport = 7001\nservice = \"alpha\"\n";
    let (status, report) = drift(&server, reference).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["drift"], true);
    assert_eq!(report["missing"], json!([]));
    assert_eq!(
        report["extra"],
        json!([
            {"port": 7001, "protocol": "udp", "service": "alpha"},
            {"port": 7002, "protocol": "tcp", "service": "beta", "container": "beta-box"},
        ])
    );
    assert_eq!(report["owner_mismatch"], json!([]));
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn drift_detects_an_owner_mismatch_of_service() {
    let server = common::start().await;
    server
        .register(json!({"id": "a", "name": "alpha", "address": "10.0.0.1", "port": 7001,
                           "metadata": {"container": "box"}}))
        .await;
    let reference = "[[ports]]\nport = 7001\nservice = \"impostor\"\ncontainer = \"box\"\n";
    let (status, report) = drift(&server, reference).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["drift"], true);
    assert_eq!(
        report["owner_mismatch"],
        json!([{"port": 7001, "protocol": "tcp",
                "expected": {"service": "impostor", "container": "box"},
                "actual": {"service": "alpha", "container": "box"}}])
    );
    assert_eq!(report["missing"], json!([]));
    assert_eq!(report["extra"], json!([]));
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn drift_detects_an_owner_mismatch_of_container() {
    let server = common::start().await;
    server
        .register(json!({"id": "a", "name": "alpha", "address": "10.0.0.1", "port": 7001,
                           "tags": ["container=new-box"]}))
        .await;
    let reference = "[[ports]]\nport = 7001\nservice = \"alpha\"\ncontainer = \"old-box\"\n";
    let (status, report) = drift(&server, reference).await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["drift"], true);
    assert_eq!(
        report["owner_mismatch"],
        json!([{"port": 7001, "protocol": "tcp",
                "expected": {"service": "alpha", "container": "old-box"},
                "actual": {"service": "alpha", "container": "new-box"}}])
    );
    // A container the live side lacks is a mismatch too.
    let server2 = common::start().await;
    server2
        .register(json!({"id": "a", "name": "alpha", "address": "10.0.0.1", "port": 7001}))
        .await;
    let (_, report) = drift(&server2, reference).await;
    assert_eq!(report["drift"], true, "{report}");
    assert_eq!(
        report["owner_mismatch"][0]["expected"],
        json!({"service": "alpha", "container": "old-box"})
    );
    assert_eq!(report["owner_mismatch"][0]["actual"], json!({"service": "alpha"}));
    server2.running.shutdown().await.expect("durable state flushed");
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn malformed_reference_is_400_naming_the_line() {
    let server = common::start().await;
    server
        .register(json!({"id": "a", "name": "alpha", "address": "10.0.0.1", "port": 7001}))
        .await;
    let fixture = std::fs::read_to_string("tests/data/ports-malformed.toml").unwrap();
    let cases: [(&str, String, &str); 4] = [
        // Broken TOML syntax on line 7.
        ("syntax", fixture, "line 7"),
        // Valid TOML, wrong type: the port on line 3 is a string.
        (
            "type",
            "[[ports]]\nservice = \"alpha\"\nport = \"seventy\"\n".into(),
            "line 3",
        ),
        // Valid TOML, a port out of range on line 5.
        (
            "range",
            "[[ports]]\nport = 7001\nservice = \"alpha\"\n[[ports]]\nport = 70000\nservice = \"beta\"\n".into(),
            "line 5",
        ),
        // Unterminated string on line 2.
        ("string", "[[ports]]\nservice = \"alpha\nport = 7001\n".into(), "line 2"),
    ];
    for (what, reference, line) in cases {
        let (status, body) = drift(&server, reference.clone()).await;
        assert_eq!(status, 400, "{what}: a malformed reference must be refused: {body}");
        let message = body["message"].as_str().unwrap_or_default();
        assert!(body["error"].is_string(), "{what}: errors are JSON with a code: {body}");
        assert!(
            message.contains(line),
            "{what}: the message must name {line}: {message}"
        );
    }
    // Not UTF-8 at all.
    let (status, body) = drift(&server, vec![0xffu8, 0xfe, b'\n']).await;
    assert_eq!(status, 400, "{body}");
    server.running.shutdown().await.expect("durable state flushed");
}

// ---------------------------------------------------------------------------------------
// R8: the command line

#[tokio::test]
async fn cli_export_writes_the_same_text_as_the_route() {
    let server = common::start().await;
    fixed_registry(&server).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("koder-service-ports.toml");
    let out = cli_export(&server.base, &file).await;
    assert_eq!(out.status.code(), Some(0), "export failed: {}", stderr(&out));
    let (route, _) = export_text(&server).await;
    let written = std::fs::read_to_string(&file).expect("export wrote the file");
    assert!(
        written == route,
        "the file differs from the route:\n--- file ---\n{written}\n--- route ---\n{route}"
    );

    // `-o -` (the default) writes it to standard output.
    let out = run(Some(KEY), &["export", "--url", &server.base]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out) == route,
        "stdout differs from the route:\n{}",
        stdout(&out)
    );

    // Errors: exit 2 with a message.
    let out = cli_export(&dead_url(), &dir.path().join("x.toml")).await;
    assert_eq!(out.status.code(), Some(2), "unreachable server: {}", stderr(&out));
    assert!(!stderr(&out).is_empty());
    assert!(!dir.path().join("x.toml").exists(), "nothing is written on error");
    let out = run(Some("wrong-key"), &["export", "--url", &server.base]).await;
    assert_eq!(out.status.code(), Some(2), "wrong key: {}", stderr(&out));
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn cli_drift_exits_0_without_drift() {
    let server = common::start().await;
    fixed_registry(&server).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ports.toml");
    let out = cli_export(&server.base, &file).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let out = cli_drift(&server, &file, false).await;
    assert_eq!(
        out.status.code(),
        Some(0),
        "no drift must exit 0:\n{}{}",
        stdout(&out),
        stderr(&out)
    );
    assert!(stdout(&out).contains("no drift"), "{}", stdout(&out));
    let out = cli_drift(&server, &file, true).await;
    assert_eq!(out.status.code(), Some(0));
    let report: Value = serde_json::from_str(&stdout(&out)).expect("--json prints JSON");
    assert_eq!(
        report,
        json!({"drift": false, "missing": [], "extra": [], "owner_mismatch": []})
    );
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn cli_drift_exits_1_and_prints_a_table_of_the_kinds() {
    let server = common::start().await;
    let reference = drifting(&server).await;
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "ports.toml", reference);
    let out = cli_drift(&server, &file, false).await;
    assert_eq!(
        out.status.code(),
        Some(1),
        "drift must exit 1:\n{}{}",
        stdout(&out),
        stderr(&out)
    );
    let table = stdout(&out);
    let line = |kind: &str, port: &str| {
        table
            .lines()
            .find(|l| l.split_whitespace().next() == Some(kind) && l.contains(port))
            .unwrap_or_else(|| panic!("no {kind} row for port {port} in:\n{table}"))
            .to_owned()
    };
    assert!(line("missing", "7000").contains("ghost"), "{table}");
    assert!(line("extra", "7002").contains("beta"), "{table}");
    let mismatch = line("owner_mismatch", "7001");
    assert!(
        mismatch.contains("impostor") && mismatch.contains("alpha"),
        "the row shows both owners: {mismatch}"
    );
    assert!(!table.contains("7003"), "a matching port is not drift:\n{table}");
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn cli_drift_json_has_the_report_fields() {
    let server = common::start().await;
    let reference = drifting(&server).await;
    let dir = tempfile::tempdir().unwrap();
    let file = write(dir.path(), "ports.toml", reference);
    let out = cli_drift(&server, &file, true).await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let report: Value = serde_json::from_str(&stdout(&out))
        .unwrap_or_else(|e| panic!("--json must print JSON ({e}):\n{}", stdout(&out)));
    assert_eq!(report["drift"], true);
    assert_eq!(
        report["missing"],
        json!([{"port": 7000, "protocol": "tcp", "service": "ghost", "container": "ghost-box"}])
    );
    assert_eq!(
        report["extra"],
        json!([{"port": 7002, "protocol": "tcp", "service": "beta"}])
    );
    assert_eq!(
        report["owner_mismatch"],
        json!([{"port": 7001, "protocol": "tcp", "expected": {"service": "impostor"}, "actual": {"service": "alpha"}}])
    );
    // The CLI prints what the route answers.
    let (_, route) = drift(&server, reference).await;
    assert_eq!(report, route);
    server.running.shutdown().await.expect("durable state flushed");
}

#[tokio::test]
async fn cli_drift_exits_2_on_errors() {
    let server = common::start().await;
    server
        .register(json!({"id": "a", "name": "alpha", "address": "10.0.0.1", "port": 7001}))
        .await;
    let dir = tempfile::tempdir().unwrap();
    let good = write(dir.path(), "good.toml", "[[ports]]\nport = 7001\nservice = \"alpha\"\n");

    // Unreachable server.
    let dead = dead_url();
    let out = run(
        Some(KEY),
        &["drift", "--reference", good.to_str().unwrap(), "--url", &dead],
    )
    .await;
    assert_eq!(
        out.status.code(),
        Some(2),
        "unreachable URL must exit 2: {}{}",
        stdout(&out),
        stderr(&out)
    );
    assert!(!stderr(&out).is_empty(), "an error says why on stderr");
    // Same with --json: still an error, not a report.
    let out = run(
        Some(KEY),
        &["drift", "--reference", good.to_str().unwrap(), "--url", &dead, "--json"],
    )
    .await;
    assert_eq!(out.status.code(), Some(2));

    // Unreadable reference file.
    let missing = dir.path().join("no-such-file.toml");
    let out = cli_drift(&server, &missing, false).await;
    assert_eq!(
        out.status.code(),
        Some(2),
        "missing reference must exit 2: {}",
        stderr(&out)
    );
    assert!(
        stderr(&out).contains("no-such-file.toml"),
        "the message names the file: {}",
        stderr(&out)
    );
    let out = cli_drift(&server, dir.path(), false).await; // a directory
    assert_eq!(
        out.status.code(),
        Some(2),
        "a directory as the reference must exit 2: {}",
        stderr(&out)
    );

    // Malformed reference file: exit 2, naming the line.
    let malformed = PathBuf::from("tests/data/ports-malformed.toml");
    let out = cli_drift(&server, &malformed, false).await;
    assert_eq!(
        out.status.code(),
        Some(2),
        "malformed reference must exit 2: {}{}",
        stdout(&out),
        stderr(&out)
    );
    assert!(
        stderr(&out).contains("line 7"),
        "the message names the line: {}",
        stderr(&out)
    );

    // A rejected key.
    let out = run(
        Some("wrong"),
        &["drift", "--reference", good.to_str().unwrap(), "--url", &server.base],
    )
    .await;
    assert_eq!(
        out.status.code(),
        Some(2),
        "a rejected key must exit 2: {}",
        stderr(&out)
    );

    // And the good file really is fine.
    let out = cli_drift(&server, &good, false).await;
    assert_eq!(out.status.code(), Some(0), "{}{}", stdout(&out), stderr(&out));
    server.running.shutdown().await.expect("durable state flushed");
}

/// On the server's host the tools need no key: they read the one the server generated.
#[tokio::test]
async fn cli_export_reads_the_generated_key_from_the_data_dir() {
    let server = common::start().await;
    fixed_registry(&server).await;
    let (route, _) = export_text(&server).await;
    let data = tempfile::tempdir().unwrap();
    let data_dir = data.path().to_str().unwrap();

    // No key anywhere: exit 2, saying where the key could come from.
    let out = run(None, &["export", "--url", &server.base, "--data-dir", data_dir]).await;
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("KODER_DNS_API_KEY"), "{}", stderr(&out));

    std::fs::write(data.path().join("api-key"), format!("{KEY}\n")).unwrap();
    let out = run(None, &["export", "--url", &server.base, "--data-dir", data_dir]).await;
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out) == route,
        "stdout differs from the route:\n{}",
        stdout(&out)
    );
}

/// A key on the command line, where every user of the host can read it, is refused: export
/// and drift take it from `KODER_DNS_API_KEY` only. The refusal names the variable and does
/// not repeat the key.
#[tokio::test]
async fn a_key_given_as_a_flag_is_refused_pointing_at_the_environment_variable() {
    let server = common::start().await;
    let reference = tempfile::NamedTempFile::new().unwrap();
    let reference = reference.path().to_str().unwrap();
    let with_flag = format!("--api-key={KEY}");
    for args in [
        &["export", "--url", &server.base, "--api-key", KEY][..],
        &["drift", "--url", &server.base, "--reference", reference, &with_flag],
    ] {
        let out = run(None, args).await;
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stdout(&out).is_empty(), "{args:?}: nothing ran");
        let message = stderr(&out);
        assert!(
            message.contains("--api-key is not accepted") && message.contains("KODER_DNS_API_KEY"),
            "{message}"
        );
        assert!(!message.contains(KEY), "the key is repeated: {message}");
    }
}

/// `GET /services/drift` compares with the `--drift-reference` file, read on each request.
#[tokio::test]
async fn get_drift_compares_with_the_configured_reference() {
    let unconfigured = common::start().await;
    let (status, body) = unconfigured.get("/api/v1/services/drift").await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"], "no_reference");

    let dir = tempfile::tempdir().unwrap();
    let reference = dir.path().join("ports.toml");
    std::fs::write(
        &reference,
        "[[ports]]\nport = 7001\nprotocol = \"tcp\"\nservice = \"alpha\"\n",
    )
    .unwrap();
    let path = reference.clone();
    let server = common::start_with(move |c| c.drift_reference = Some(path)).await;
    let (status, report) = server.get("/api/v1/services/drift").await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["drift"], true);
    assert_eq!(report["missing"][0]["service"], "alpha", "{report}");
    server
        .register(json!({"id": "a1", "name": "alpha", "address": "10.0.0.1", "port": 7001}))
        .await;
    let (_, report) = server.get("/api/v1/services/drift").await;
    assert_eq!(report["drift"], false, "{report}");
    // An unreadable reference is the server's problem of the moment, not the client's.
    std::fs::write(&reference, "not a ports file [[").unwrap();
    let (status, body) = server.get("/api/v1/services/drift").await;
    assert_eq!(status, 503, "{body}");
}

#[test]
fn a_reference_that_does_not_parse_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = koder_dns::config::Config {
        drift_reference: Some(dir.path().join("missing.toml")),
        ..Default::default()
    };
    let e = config.validate().unwrap_err().to_string();
    assert!(e.contains("--drift-reference"), "{e}");
}
