//! `koder-dns conformance`: checks a producer against the service-registry contract (R1-R8),
//! one line per check saying what was sent and what came back.
//!
//! It speaks raw HTTP rather than through [`super::Client`] because the exact statuses are what
//! is checked. Every name and id it registers is unique to the run (`conf<random>`), and
//! everything it registered is deregistered at the end, whether the checks passed or not.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{Value, json};

/// One check's outcome.
#[derive(Debug)]
pub struct Check {
    pub rule: &'static str,
    pub what: &'static str,
    pub pass: bool,
    /// What was sent and what was seen.
    pub detail: String,
}

/// The producer could not be checked at all (unreachable, key refused).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CannotRun(String);

struct Producer {
    http: reqwest::Client,
    base: String,
    key: String,
}

impl Producer {
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>, key: bool) -> (u16, Value, String) {
        let mut request = self.http.request(method, format!("{}/api/v1{path}", self.base));
        if key {
            request = request.header("X-API-Key", &self.key);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        match request.send().await {
            Ok(response) => {
                let status = response.status().as_u16();
                let text = response.text().await.unwrap_or_default();
                (status, serde_json::from_str(&text).unwrap_or(Value::Null), text)
            }
            Err(e) => (0, Value::Null, e.to_string()),
        }
    }

    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let (status, value, _) = self.call(reqwest::Method::POST, path, Some(body), true).await;
        (status, value)
    }

    async fn get(&self, path: &str) -> (u16, Value, String) {
        self.call(reqwest::Method::GET, path, None, true).await
    }

    async fn instance(&self, name: &str, id: &str) -> Option<Value> {
        let (_, list, _) = self.get(&format!("/services?detail=1&name={name}")).await;
        list["instances"].as_array()?.iter().find(|i| i["id"] == id).cloned()
    }
}

/// Runs every check. `dns` adds the SRV check of the service zone `domain`.
/// `http` is the client to build on (see [`crate::tls::trusting`] for a private CA).
pub async fn run(
    http: reqwest::ClientBuilder,
    url: &str,
    key: &str,
    dns: Option<SocketAddr>,
    domain: &str,
) -> Result<Vec<Check>, CannotRun> {
    let producer = Producer {
        http: http
            .timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| CannotRun(e.to_string()))?,
        base: url.trim_end_matches('/').to_owned(),
        key: key.to_owned(),
    };
    let (status, _, text) = producer.get("/services").await;
    match status {
        0 => return Err(CannotRun(format!("cannot reach {url}: {text}"))),
        401 => return Err(CannotRun(format!("{url} refused the API key (401)"))),
        _ => {}
    }
    let run_id = format!("{:08x}", fastrand::u32(..));
    let name = format!("conf{run_id}");
    let mut registered = Vec::new();
    let mut checks = Vec::new();
    checks_with(&producer, &name, dns, domain, &mut registered, &mut checks).await;
    for id in registered {
        producer.post("/services/deregister", json!({ "id": id })).await;
    }
    Ok(checks)
}

async fn checks_with(
    p: &Producer,
    name: &str,
    dns: Option<SocketAddr>,
    domain: &str,
    registered: &mut Vec<String>,
    checks: &mut Vec<Check>,
) {
    let mut check = |rule, what, pass, detail: String| {
        checks.push(Check {
            rule,
            what,
            pass,
            detail,
        })
    };
    let id = format!("{name}-a");
    registered.push(id.clone());
    let body = json!({"id": id, "name": name, "address": "127.0.0.1", "port": 7401, "ttl_ns": 60_000_000_000i64});

    // R7: a key is required.
    let (status, _, _) = p.call(reqwest::Method::GET, "/services", None, false).await;
    check(
        "R7",
        "no X-API-Key is refused",
        status == 401,
        format!("sent GET /services without a key; saw {status}, want 401"),
    );

    // R1 + R2: register, defaults filled in.
    let (status, answer) = p.post("/services/register", body.clone()).await;
    check(
        "R2",
        "first registration",
        status == 200 && answer["created"] == true,
        format!("sent POST /services/register {body}; saw {status} {answer}, want 200 created=true"),
    );
    let seen = p.instance(name, &id).await.unwrap_or(Value::Null);
    let defaults = seen["protocol"] == "tcp"
        && seen["weight"] == 100
        && seen["priority"] == 10
        && seen["healthy"] == true
        && seen["tags"] == json!([])
        && seen["metadata"] == json!({})
        && seen["registered_at"].is_string()
        && seen["updated_at"].is_string();
    check(
        "R1",
        "instance listed with every field and its defaults",
        defaults,
        format!("sent GET /services?detail=1&name={name}; saw {seen}"),
    );
    let bad = json!({"name": name, "address": "127.0.0.1", "port": 0});
    let (status, answer) = p.post("/services/register", bad.clone()).await;
    check(
        "R1",
        "port 0 is refused",
        status == 400,
        format!("sent POST /services/register {bad}; saw {status} {answer}, want 400"),
    );

    // R2: the same id again is an upsert.
    let again = json!({"id": id, "name": name, "address": "127.0.0.1", "port": 7402, "ttl_ns": 60_000_000_000i64});
    let (status, answer) = p.post("/services/register", again.clone()).await;
    let after = p.instance(name, &id).await.unwrap_or(Value::Null);
    check(
        "R2",
        "re-registration is an idempotent upsert",
        status == 200
            && answer["created"] == false
            && after["port"] == 7402
            && after["registered_at"] == seen["registered_at"],
        format!(
            "sent POST /services/register {again}; saw {status} {answer}, then port {} registered_at {} (was {})",
            after["port"], after["registered_at"], seen["registered_at"]
        ),
    );

    // R3: heartbeats.
    let (status, _) = p.post("/services/heartbeat", json!({"id": id})).await;
    check(
        "R3",
        "heartbeat of a live instance",
        status == 200,
        format!("sent POST /services/heartbeat {{\"id\":\"{id}\"}}; saw {status}, want 200"),
    );
    let unknown = format!("{name}-unknown");
    let (status, _) = p.post("/services/heartbeat", json!({"id": unknown})).await;
    check(
        "R3",
        "heartbeat of an unknown id is 410",
        status == 410,
        format!("sent POST /services/heartbeat {{\"id\":\"{unknown}\"}}; saw {status}, want 410"),
    );
    let short = format!("{name}-short");
    registered.push(short.clone());
    let body = json!({"id": short, "name": name, "address": "127.0.0.1", "port": 7403, "ttl_ns": 1_000_000_000i64});
    let (status, _) = p.post("/services/register", body.clone()).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let listed = p.instance(name, &short).await.is_some();
    let (beat, _) = p.post("/services/heartbeat", json!({"id": short})).await;
    check(
        "R3",
        "an expired lease is gone and its heartbeat is 410",
        status == 200 && !listed && beat == 410,
        format!(
            "sent {body}, waited 2.5s; register {status}, still listed {listed}, heartbeat {beat}, want 200, false, 410"
        ),
    );

    // R5 + R6: edge opt-in, health preserved and filtered.
    let edge = format!("{name}-edge");
    registered.push(edge.clone());
    let domain_name = format!("{name}.example.test");
    let body = json!({"id": edge, "name": name, "address": "127.0.0.1", "port": 7404, "healthy": false,
        "metadata": {"jet.domain": domain_name}, "ttl_ns": 60_000_000_000i64});
    p.post("/services/register", body.clone()).await;
    let seen = p.instance(name, &edge).await.unwrap_or(Value::Null);
    check(
        "R5",
        "jet.domain metadata kept",
        seen["metadata"]["jet.domain"] == domain_name.as_str(),
        format!("sent {body}; saw metadata {}", seen["metadata"]),
    );
    check(
        "R6",
        "healthy=false preserved in the listing",
        seen["healthy"] == false,
        format!("sent {body}; saw healthy {}", seen["healthy"]),
    );
    let (_, healthy, _) = p.get(&format!("/services?detail=1&healthy_only=1&name={name}")).await;
    let ids: Vec<&str> = healthy["instances"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|i| i["id"].as_str())
        .collect();
    check(
        "R6",
        "healthy_only leaves unhealthy instances out",
        ids.contains(&id.as_str()) && !ids.contains(&edge.as_str()),
        format!("sent GET /services?detail=1&healthy_only=1&name={name}; saw ids {ids:?}"),
    );

    // R8: export.
    let (status, _, text) = p.get("/services/export").await;
    check(
        "R8",
        "export renders the registry as TOML",
        status == 200 && text.contains(name) && text.parse::<toml::Table>().is_ok(),
        format!(
            "sent GET /services/export; saw {status}, {} bytes, names {name}: {}",
            text.len(),
            text.contains(name)
        ),
    );

    // DNS: SRV of the healthy instance only.
    if let Some(dns) = dns {
        let qname = format!("_{name}._tcp.{}.", domain.trim_end_matches('.'));
        let ports = srv_ports(dns, &qname).await;
        check(
            "R6",
            "SRV answers the healthy instance only",
            ports.as_deref() == Ok(&[7402][..]),
            format!("sent SRV {qname} to {dns}; saw ports {ports:?}, want [7402]"),
        );
    }

    // R4: deregister.
    let (status, _) = p.post("/services/deregister", json!({"id": id})).await;
    let listed = p.instance(name, &id).await.is_some();
    check(
        "R4",
        "deregistration removes at once",
        status == 200 && !listed,
        format!("sent POST /services/deregister {{\"id\":\"{id}\"}}; saw {status}, still listed {listed}"),
    );
    let (status, _) = p.post("/services/deregister", json!({"id": id})).await;
    check(
        "R4",
        "deregistering an unknown id is 404",
        status == 404,
        format!("sent POST /services/deregister {{\"id\":\"{id}\"}} again; saw {status}, want 404"),
    );
}

async fn srv_ports(server: SocketAddr, qname: &str) -> Result<Vec<u16>, String> {
    use hickory_proto::op::{Message, Query};
    use hickory_proto::rr::{Name, RData, RecordType};
    let mut message = Message::query();
    message.add_query(Query::query(
        Name::from_ascii(qname).map_err(|e| e.to_string())?,
        RecordType::SRV,
    ));
    message.metadata.id = fastrand::u16(..);
    let bytes = message.to_vec().map_err(|e| e.to_string())?;
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    socket.send_to(&bytes, server).await.map_err(|e| e.to_string())?;
    let mut buf = vec![0; 4096];
    let n = tokio::time::timeout(Duration::from_secs(3), socket.recv(&mut buf))
        .await
        .map_err(|_| "no answer in 3s".to_owned())?
        .map_err(|e| e.to_string())?;
    let answer = Message::from_vec(&buf[..n]).map_err(|e| e.to_string())?;
    let mut ports: Vec<u16> = answer
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::SRV(srv) => Some(srv.port),
            _ => None,
        })
        .collect();
    ports.sort_unstable();
    Ok(ports)
}
