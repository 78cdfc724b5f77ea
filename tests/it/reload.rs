//! Reload (SIGHUP, `systemctl reload`): a rotated key and certificate take effect within a
//! second while a held watch and a DNS-over-TCP connection go on; a broken file changes
//! nothing; the zones, the TSIG keys and the config file's `api_keys` are read again;
//! settings read at start only are kept, with a warning naming each.

use std::path::Path;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::{RData, RecordType};
use serde_json::json;

use crate::child;
use crate::common::{self, KEY, Pki};

/// A fresh token and its `[[key]]` table (what `koder-dns keys new` prints).
fn key(id: &str, scope: koder_dns::access::Scope) -> (String, String) {
    let token = koder_dns::access::new_token().unwrap();
    let table = koder_dns::access::file_entry(id, &token, scope, &[]);
    (token, table)
}

async fn status(http: &reqwest::Client, base: &str, token: &str) -> u16 {
    http.get(format!("{base}/api/v1/services"))
        .header("X-API-Key", token)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_rotates_a_key_and_the_certificate_while_a_watch_and_a_dns_connection_go_on() {
    let pki = Pki::new();
    let (cert, cert_key) = pki.issue("server", 1);
    let data = tempfile::tempdir().unwrap();
    let keys = data.path().join("keys.toml");
    let (old, old_table) = key("edge-2024", koder_dns::access::Scope::Read);
    std::fs::write(&keys, &old_table).unwrap();
    let proc = child::launch_ok(
        data.path(),
        &[
            "--keys-file",
            keys.to_str().unwrap(),
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            cert_key.to_str().unwrap(),
        ],
    )
    .await;
    assert!(proc.https, "{}", proc.stderr());
    let (http, base) = (pki.http(), proc.base());
    assert_eq!(status(&http, &base, &old).await, 200);

    // Held across the reload: a blocking query (with the old key) and a DNS-over-TCP connection.
    let listed = http
        .get(format!("{base}/api/v1/services"))
        .header("X-API-Key", &old)
        .send()
        .await
        .unwrap();
    let index = listed.headers()["x-koder-index"].to_str().unwrap().to_owned();
    let watch = tokio::spawn({
        let (http, base, old) = (http.clone(), base.clone(), old.clone());
        async move {
            let response = http
                .get(format!("{base}/api/v1/services?index={index}&wait=60s"))
                .header("X-API-Key", old)
                .send()
                .await
                .unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    });
    let mut dns = tokio::net::TcpStream::connect(proc.dns).await.unwrap();
    let soa = common::query_message("service.koder.", RecordType::SOA, None);
    assert_eq!(common::framed_query(&mut dns, &soa).await.answers.len(), 1);
    let before = common::tls_connect(proc.http, pki.client_config(&[b"http/1.1"]))
        .await
        .unwrap();
    assert_eq!(common::peer_serial(&before), 1);

    // Rotate: a new key in place of the old, a new certificate in the same files.
    let (new, new_table) = key("edge-2025", koder_dns::access::Scope::Read);
    std::fs::write(&keys, &new_table).unwrap();
    let (next_cert, next_key) = pki.issue("next", 2);
    std::fs::copy(&next_cert, &cert).unwrap();
    std::fs::copy(&next_key, &cert_key).unwrap();
    proc.signal("HUP");
    let sent = Instant::now();
    loop {
        let (was, is) = (status(&http, &base, &old).await, status(&http, &base, &new).await);
        if (was, is) == (401, 200) {
            break;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(1),
            "a second after SIGHUP the old key answers {was} and the new one {is}:\n{}",
            proc.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let after = common::tls_connect(proc.http, pki.client_config(&[b"http/1.1"]))
        .await
        .unwrap();
    assert_eq!(
        common::peer_serial(&after),
        2,
        "a new handshake gets the new certificate"
    );

    // What was open before goes on.
    assert!(!watch.is_finished(), "the held watch is still held");
    let registered = http
        .post(format!("{base}/api/v1/services/register"))
        .header("X-API-Key", child::KEY)
        .json(&json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .send()
        .await
        .unwrap();
    assert_eq!(registered.status(), 200);
    let (watched, body) = tokio::time::timeout(Duration::from_secs(10), watch)
        .await
        .expect("the watch answers the change")
        .unwrap();
    assert_eq!(watched, 200, "{body}");
    assert!(body.contains("voice"), "{body}");
    let srv = common::query_message("_voice._tcp.service.koder.", RecordType::SRV, None);
    assert_eq!(common::framed_query(&mut dns, &srv).await.answers.len(), 1);

    // Counted once the whole reload is done (the zones are swapped last).
    let deadline = Instant::now() + Duration::from_secs(5);
    let metrics = loop {
        let metrics = common::scrape(&http, &base).await;
        if common::sample(&metrics, r#"koder_dns_config_reloads_total{result="ok"}"#) == 1.0
            || Instant::now() > deadline
        {
            break metrics;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        common::sample(&metrics, r#"koder_dns_config_reloads_total{result="ok"}"#),
        1.0,
        "{metrics}"
    );
    assert_eq!(common::sample(&metrics, "koder_dns_config_last_reload_ok"), 1.0);
    let (status, log) = proc.terminate().await;
    assert_eq!(
        status.code(),
        Some(0),
        "SIGHUP did not end it, SIGTERM does cleanly:\n{log}"
    );
    assert!(log.contains("reloaded"), "{log}");
}

#[tokio::test]
async fn a_broken_file_on_reload_changes_nothing_and_names_the_file() {
    let pki = Pki::new();
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.toml");
    let (old, old_table) = key("old", koder_dns::access::Scope::Read);
    std::fs::write(&keys, &old_table).unwrap();
    let keys_file = keys.clone();
    let server = common::start_https(&pki, |c| c.keys_file = Some(keys_file)).await;
    let (http, base) = (server.http.clone(), server.base.clone());

    // A keys file that does not parse.
    std::fs::write(&keys, "[[key]]\nid = \"broken\"\nsha256 = \"00\"\nscope = \"read\"\n").unwrap();
    let error = server.running.reload().await.unwrap_err();
    let message = format!("{error:#}");
    assert!(
        message.contains("keys.toml:3") && message.contains("64 hex digits"),
        "{message}"
    );
    assert_eq!(status(&http, &base, &old).await, 200, "the old key still works");

    // A good keys file with a certificate whose key does not match: neither is taken.
    let (new, new_table) = key("new", koder_dns::access::Scope::Read);
    std::fs::write(&keys, &new_table).unwrap();
    let (_, stranger_key) = pki.issue("stranger", 9);
    let cert_key = pki.dir.path().join("server.key");
    let kept_key = std::fs::read(&cert_key).unwrap();
    std::fs::copy(&stranger_key, &cert_key).unwrap();
    let message = format!("{:#}", server.running.reload().await.unwrap_err());
    assert!(
        message.contains("server.key") && message.contains("does not belong"),
        "{message}"
    );
    assert_eq!(status(&http, &base, &old).await, 200, "the old key still works");
    assert_eq!(status(&http, &base, &new).await, 401, "the new key is not taken alone");
    let metrics = common::scrape(&http, &base).await;
    assert_eq!(
        common::sample(&metrics, r#"koder_dns_config_reloads_total{result="error"}"#),
        2.0
    );
    assert_eq!(common::sample(&metrics, "koder_dns_config_last_reload_ok"), 0.0);

    // Put right, the next reload takes both.
    std::fs::write(&cert_key, kept_key).unwrap();
    server.running.reload().await.unwrap();
    assert_eq!(status(&http, &base, &old).await, 401);
    assert_eq!(status(&http, &base, &new).await, 200);
    let metrics = common::scrape(&http, &base).await;
    assert_eq!(
        common::sample(&metrics, r#"koder_dns_config_reloads_total{result="ok"}"#),
        1.0
    );
    assert_eq!(common::sample(&metrics, "koder_dns_config_last_reload_ok"), 1.0);
    // The admin key of the config is untouched by all of this.
    assert_eq!(status(&http, &base, KEY).await, 200);
}

const ZONE: &str = "$ORIGIN example.test.
$TTL 300
@ IN SOA ns.example.test. hostmaster.example.test. SERIAL 3600 600 86400 300
@ IN NS ns.example.test.
ns IN A 192.0.2.1
www IN A ADDRESS
";

fn write_zone(dir: &Path, serial: u32, address: &str) {
    let text = ZONE.replace("SERIAL", &serial.to_string()).replace("ADDRESS", address);
    std::fs::write(dir.join("example.test.zone"), text).unwrap();
}

fn addresses(reply: &Message) -> Vec<String> {
    let mut out: Vec<String> = reply
        .answers
        .iter()
        .chain(&reply.additionals)
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(a.0.to_string()),
            _ => None,
        })
        .collect();
    out.sort();
    out
}

#[tokio::test]
async fn a_reload_serves_the_zones_directory_as_it_is_now() {
    let zones = tempfile::tempdir().unwrap();
    write_zone(zones.path(), 1, "192.0.2.10");
    let dir = zones.path().to_owned();
    let server = common::start_with(|c| c.zones_dir = dir).await;
    server
        .register(json!({"name": "web", "address": "www.example.test", "port": 443}))
        .await;
    let srv = "_web._tcp.service.koder.";
    assert_eq!(
        addresses(&server.query("www.example.test.", RecordType::A).await),
        ["192.0.2.10"]
    );
    // Asked twice, so the second answer is the prepared one.
    for _ in 0..2 {
        assert_eq!(addresses(&server.query(srv, RecordType::SRV).await), ["192.0.2.10"]);
    }

    write_zone(zones.path(), 2, "192.0.2.20");
    std::fs::write(
        zones.path().join("other.test.zone"),
        ZONE.replace("example.test", "other.test")
            .replace("SERIAL", "1")
            .replace("ADDRESS", "198.51.100.1"),
    )
    .unwrap();
    server.running.reload().await.unwrap();
    assert_eq!(
        addresses(&server.query("www.example.test.", RecordType::A).await),
        ["192.0.2.20"]
    );
    assert_eq!(
        addresses(&server.query(srv, RecordType::SRV).await),
        ["192.0.2.20"],
        "the service zone's glue follows the zone file"
    );
    assert_eq!(
        addresses(&server.query("www.other.test.", RecordType::A).await),
        ["198.51.100.1"]
    );

    // A broken zone file: the reload fails naming it, and the zones in force stay.
    std::fs::write(zones.path().join("broken.test.zone"), "this is not a zone\n").unwrap();
    let message = format!("{:#}", server.running.reload().await.unwrap_err());
    assert!(message.contains("broken.test.zone"), "{message}");
    assert_eq!(
        addresses(&server.query("www.other.test.", RecordType::A).await),
        ["198.51.100.1"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_rereads_the_config_files_api_keys_and_tsig_keys_and_warns_about_the_rest() {
    let data = tempfile::tempdir().unwrap();
    let config = data.path().join("koder-dns.toml");
    let secret = data_encoding::BASE64.encode(b"0123456789abcdef0123456789abcdef");
    let write = |api_key: &str, tsig: &str, dns_ttl: &str| {
        std::fs::write(
            &config,
            format!(
                "api_keys = [\"{api_key}\"]\ntsig_key = \"{tsig}.:hmac-sha256:{secret}\"\ndns_ttl = \"{dns_ttl}\"\n"
            ),
        )
        .unwrap();
    };
    write("first-admin-key-0123456789", "first", "5s");
    let mut cmd = child::command(data.path(), &["--config", config.to_str().unwrap()]);
    cmd.env_remove("KODER_DNS_API_KEY");
    let child::Started::Up(proc) = child::launch_command(cmd).await else {
        panic!("koder-dns did not start");
    };
    let (http, base) = (common::http(), proc.base());
    assert_eq!(status(&http, &base, "first-admin-key-0123456789").await, 200);
    let signed = |name: &str| {
        let mut query = common::query_message("service.koder.", RecordType::SOA, None);
        query
            .finalize(
                &crate::transfer::signer(name, b"0123456789abcdef0123456789abcdef"),
                crate::transfer::now(),
            )
            .unwrap();
        query
    };
    assert_eq!(
        common::udp_query(proc.dns, &signed("first."))
            .await
            .metadata
            .response_code,
        ResponseCode::NoError
    );

    write("second-admin-key-0123456789", "second", "7s");
    proc.signal("HUP");
    let sent = Instant::now();
    while status(&http, &base, "second-admin-key-0123456789").await != 200 {
        assert!(sent.elapsed() < Duration::from_secs(2), "{}", proc.stderr());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(status(&http, &base, "first-admin-key-0123456789").await, 401);
    assert_eq!(
        common::udp_query(proc.dns, &signed("second."))
            .await
            .metadata
            .response_code,
        ResponseCode::NoError
    );
    assert_eq!(
        common::udp_query(proc.dns, &signed("first."))
            .await
            .metadata
            .response_code,
        ResponseCode::NotAuth,
        "the old TSIG key is gone"
    );
    // dns_ttl is read at start only: kept, with a warning naming it.
    let log = proc.stderr();
    let warning = log
        .lines()
        .find(|l| l.contains("read at start only"))
        .unwrap_or_else(|| panic!("no warning:\n{log}"));
    assert!(warning.contains("dns_ttl"), "{warning}");
    assert!(
        !log.contains("setting=api_keys") && !log.contains("setting=tsig_key"),
        "{log}"
    );
    let (status, log) = proc.terminate().await;
    assert_eq!(status.code(), Some(0), "{log}");
}
