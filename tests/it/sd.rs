//! Prometheus HTTP service discovery: the target groups, and Debian's Prometheus scraping a
//! target it found there.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::common::{self, KEY};

#[tokio::test]
async fn sd_lists_one_target_group_per_instance_with_metadata_labels() {
    let server = common::start().await;
    server
        .register(json!({"id": "v1", "name": "voice", "address": "10.0.0.1", "port": 5060,
                         "tags": ["blue", "jet.domain=voice.koder.dev"], "metadata": {"team": "rtc", "k8s.pod": "v-1"}}))
        .await;
    server
        .register(json!({"id": "v6", "name": "voice", "address": "2001:db8::6", "port": 5061, "healthy": false}))
        .await;
    server
        .register(json!({"id": "c1", "name": "chat", "address": "chat.internal", "port": 80}))
        .await;

    let (status, all) = server.get("/api/v1/sd/prometheus").await;
    assert_eq!(status, 200, "{all}");
    let groups = all.as_array().unwrap();
    assert_eq!(groups.len(), 3, "{all}");
    let by_id = |id: &str| -> &Value {
        groups
            .iter()
            .find(|g| g["labels"]["__meta_koder_id"] == id)
            .unwrap_or_else(|| panic!("{id} in {all}"))
    };
    let v1 = by_id("v1");
    assert_eq!(v1["targets"], json!(["10.0.0.1:5060"]));
    assert_eq!(v1["labels"]["__meta_koder_service"], "voice");
    assert_eq!(v1["labels"]["__meta_koder_healthy"], "true");
    assert_eq!(v1["labels"]["__meta_koder_tags"], ",blue,jet.domain=voice.koder.dev,");
    assert_eq!(v1["labels"]["__meta_koder_metadata_team"], "rtc");
    assert_eq!(
        v1["labels"]["__meta_koder_metadata_k8s_pod"], "v-1",
        "label names are sanitised"
    );
    assert_eq!(by_id("v6")["targets"], json!(["[2001:db8::6]:5061"]));
    assert_eq!(by_id("v6")["labels"]["__meta_koder_healthy"], "false");
    assert_eq!(by_id("c1")["targets"], json!(["chat.internal:80"]));

    let (_, healthy) = server.get("/api/v1/sd/prometheus?healthy_only=1").await;
    let ids: Vec<&str> = healthy
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["labels"]["__meta_koder_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["c1", "v1"], "{healthy}");
    let (_, voice) = server.get("/api/v1/sd/prometheus?name=voice&healthy_only=1").await;
    assert_eq!(voice.as_array().unwrap().len(), 1, "{voice}");
    let (status, body) = server.get("/api/v1/sd/prometheus?healthy_only=maybe").await;
    assert_eq!(status, 400, "{body}");

    // Prometheus sends the key as a bearer token.
    let bearer = server
        .http
        .get(server.url("/api/v1/sd/prometheus"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(bearer.status(), 200);
    let wrong = server
        .http
        .get(server.url("/api/v1/sd/prometheus"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
}

/// Kills Prometheus when the test ends, however it ends.
struct Prometheus(Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A real Prometheus finds koder-dns's own `/metrics` through the discovery route (the
/// instance registered there is koder-dns itself), scrapes it, and keeps a metadata label.
#[tokio::test]
#[ignore = "needs prometheus (Debian package)"]
async fn prometheus_scrapes_a_target_it_discovered() {
    let server = common::start().await;
    let http = server.running.http_addr;
    server
        .register(
            json!({"id": "self", "name": "koder", "address": "127.0.0.1", "port": http.port(),
                         "metadata": {"team": "ops"}}),
        )
        .await;
    let dir = tempfile::tempdir().unwrap();
    let web = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
         scrape_configs:\n  - job_name: koder\n    http_sd_configs:\n\
         \x20     - url: http://{http}/api/v1/sd/prometheus?healthy_only=1\n\
         \x20       refresh_interval: 1s\n        authorization:\n          type: Bearer\n          credentials: {KEY}\n\
         \x20   relabel_configs:\n      - source_labels: [__meta_koder_metadata_team]\n\
         \x20       target_label: team\n"
    );
    let file = dir.path().join("prometheus.yml");
    std::fs::write(&file, config).unwrap();
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let _prometheus = Prometheus(
        Command::new("prometheus")
            .arg(format!("--config.file={}", file.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("tsdb").display()))
            .arg(format!("--web.listen-address={web}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("run prometheus (apt-get install prometheus)"),
    );
    let client = crate::common::http();
    let deadline = Instant::now() + Duration::from_secs(60);
    let target = loop {
        let targets: Option<Value> = match client.get(format!("http://{web}/api/v1/targets")).send().await {
            Ok(r) => r.json().await.ok(),
            Err(_) => None,
        };
        let up = targets.as_ref().and_then(|t| {
            t["data"]["activeTargets"]
                .as_array()?
                .iter()
                .find(|t| t["health"] == "up")
                .cloned()
        });
        if let Some(target) = up {
            break target;
        }
        assert!(
            Instant::now() < deadline,
            "no target up within 60s: {targets:?}\nlog:\n{}",
            std::fs::read_to_string(dir.path().join("prometheus.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(target["scrapeUrl"], format!("http://{http}/metrics"), "{target}");
    assert_eq!(target["labels"]["team"], "ops", "{target}");
    assert_eq!(target["discoveredLabels"]["__meta_koder_service"], "koder", "{target}");
}
