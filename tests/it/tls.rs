//! HTTPS on `--http-listen` and DNS over TLS on `--dot-listen`, with a private CA the test
//! makes as it runs: the API over HTTPS to clients that trust the CA (reqwest and curl), no
//! HTTP answer to plain HTTP, no TLS 1.1, the same DNS answers over TLS as over TCP, and the
//! start refused (exit 2, naming the file) for a certificate without its key or a key of
//! another certificate.

use std::process::Command;
use std::time::Duration;

use hickory_proto::rr::RecordType;
use rustls::pki_types::pem::PemObject;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::child;
use crate::common::{self, KEY, Pki};
use crate::tools::tool;

async fn https_server(pki: &Pki) -> common::TestServer {
    common::start_https(pki, |_| {}).await
}

#[tokio::test]
async fn https_serves_the_api_and_metrics_to_a_client_trusting_the_ca() {
    let pki = Pki::new();
    let server = https_server(&pki).await;
    let base = format!("https://{}", server.running.http_addr);
    let client = pki.http();
    let response = client
        .post(format!("{base}/api/v1/services/register"))
        .header("X-API-Key", KEY)
        .json(&json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let listed: serde_json::Value = client
        .get(format!("{base}/api/v1/services"))
        .header("X-API-Key", KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(listed["services"], json!(["voice"]));
    let healthz = client.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(healthz.status(), 200);
    // The certificate's expiry, as the certificate itself says.
    let metrics = common::scrape(&client, &base).await;
    let pem = std::fs::read(pki.dir.path().join("server.crt")).unwrap();
    let der = rustls::pki_types::CertificateDer::from_pem_slice(&pem).unwrap();
    let (_, leaf) = x509_parser::parse_x509_certificate(&der).unwrap();
    assert_eq!(
        common::sample(&metrics, "koder_dns_tls_cert_not_after_seconds"),
        leaf.validity().not_after.timestamp() as f64,
        "{metrics}"
    );
    // A client that trusts only the system's roots refuses the private CA's certificate.
    let error = common::http()
        .get(format!("{base}/healthz"))
        .send()
        .await
        .expect_err("an unknown CA is not trusted");
    assert!(error.is_connect(), "{error:?}");
}

#[tokio::test]
async fn plain_http_on_the_https_port_gets_no_http_answer() {
    let pki = Pki::new();
    let server = https_server(&pki).await;
    let mut stream = tokio::net::TcpStream::connect(server.running.http_addr).await.unwrap();
    stream
        .write_all(format!("GET /healthz HTTP/1.1\r\nHost: x\r\nX-API-Key: {KEY}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
    assert!(
        !answer.starts_with(b"HTTP/"),
        "plain HTTP got an HTTP answer: {:?}",
        String::from_utf8_lossy(&answer)
    );
    // And reqwest with an http:// URL fails outright.
    let error = common::http()
        .get(format!("http://{}/healthz", server.running.http_addr))
        .send()
        .await;
    assert!(error.is_err(), "{error:?}");
}

/// Slowloris over TLS: a client that connects and never finishes its handshake holds its
/// connection no longer than the header timeout (`--http-request-timeout`), and the
/// connection bound holds for HTTPS as for HTTP.
#[tokio::test]
async fn an_unfinished_handshake_is_cut_at_the_header_timeout_and_the_connection_bound_holds() {
    let pki = Pki::new();
    let server = common::start_https(&pki, |c| {
        c.http_request_timeout = Duration::from_millis(400);
        c.http_max_connections = 2;
    })
    .await;
    let addr = server.running.http_addr;
    let started = std::time::Instant::now();
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut byte = [0u8; 1];
    let closed = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut byte)).await;
    assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    // Two silent clients hold both connections; a third waits until one is cut.
    let _a = tokio::net::TcpStream::connect(addr).await.unwrap();
    let _b = tokio::net::TcpStream::connect(addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = std::time::Instant::now();
    let status = server.http.get(server.url("/healthz")).send().await.unwrap().status();
    assert_eq!(status, 200);
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "the third connection was served before a slot was free: {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn dns_over_tls_answers_as_dns_over_tcp_does() {
    let pki = Pki::new();
    let server = https_server(&pki).await;
    for body in common::instances("voice", 3) {
        server.register(body).await;
    }
    let dot = server.running.dot_addr.expect("--dot-listen");
    // With the ALPN of DNS over TLS and without any: both are served.
    for alpn in [&[b"dot".as_slice()][..], &[]] {
        let mut tls = common::tls_connect(dot, pki.client_config(alpn)).await.unwrap();
        for (name, rtype) in [
            ("_voice._tcp.service.koder.", RecordType::SRV),
            ("voice.service.koder.", RecordType::A),
            ("nosuch.service.koder.", RecordType::A),
            ("service.koder.", RecordType::SOA),
        ] {
            // Several queries on one connection, as a resolver keeps it open.
            let message = common::query_message(name, rtype, Some(1232));
            let over_tls = common::framed_query(&mut tls, &message).await;
            let over_tcp = common::tcp_query(server.dns(), &message).await;
            assert_eq!(
                over_tls.metadata.response_code, over_tcp.metadata.response_code,
                "{name}"
            );
            assert_eq!(
                over_tls.metadata.authoritative, over_tcp.metadata.authoritative,
                "{name}"
            );
            let sorted = |m: &hickory_proto::op::Message| {
                let mut records: Vec<String> = m.answers.iter().map(|r| r.to_string()).collect();
                records.sort();
                records
            };
            assert_eq!(sorted(&over_tls), sorted(&over_tcp), "{name}");
            assert_eq!(over_tls.authorities, over_tcp.authorities, "{name}");
        }
    }
}

#[tokio::test]
async fn dns_over_tls_connections_close_after_the_tcp_idle_timeout() {
    let pki = Pki::new();
    let server = common::start_https(&pki, |c| c.dns_tcp_idle_timeout = Duration::from_millis(300)).await;
    let dot = server.running.dot_addr.unwrap();
    let mut tls = common::tls_connect(dot, pki.client_config(&[b"dot"])).await.unwrap();
    let reply = common::framed_query(
        &mut tls,
        &common::query_message("service.koder.", RecordType::SOA, None),
    )
    .await;
    assert_eq!(reply.answers.len(), 1);
    let mut byte = [0u8; 1];
    let closed = tokio::time::timeout(Duration::from_secs(5), tls.read(&mut byte)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "the idle connection is closed: {closed:?}"
    );
    // A client that connects and never finishes the handshake is cut at the same timeout.
    let mut silent = tokio::net::TcpStream::connect(dot).await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut byte)).await;
    assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "{closed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs curl and openssl (installed by tests/run.sh)"]
async fn curl_trusting_the_ca_gets_https_and_tls_1_1_is_refused() {
    let curl = tool("curl", "curl");
    let openssl = tool("openssl", "openssl");
    let pki = Pki::new();
    let server = https_server(&pki).await;
    let addr = server.running.http_addr;
    let out = Command::new(&curl)
        .args(["-sS", "--fail", "--cacert"])
        .arg(&pki.ca_path)
        .args(["-H", &format!("X-API-Key: {KEY}")])
        .arg(format!("https://{addr}/api/v1/services"))
        .output()
        .unwrap();
    assert!(out.status.success(), "curl: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout), r#"{"services":[]}"#);
    // TLS 1.3 and 1.2 are served ...
    for version in ["-tls1_3", "-tls1_2"] {
        let out = s_client(&openssl, addr, &pki, &[version]);
        assert!(
            out.status.success(),
            "{version}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    // ... TLS 1.1 is not, even to a client that allows it (security level 0).
    let out = s_client(&openssl, addr, &pki, &["-tls1_1", "-cipher", "DEFAULT:@SECLEVEL=0"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "a TLS 1.1 handshake succeeded:\n{text}");
    // The server's alert (rustls answers a hello without TLS 1.2 or 1.3 with one), not a
    // client that gave up before sending.
    assert!(text.contains("alert"), "{text}");
    // A curl that will speak 1.1 at most fails the same way.
    let out = Command::new(&curl)
        .args([
            "-sS",
            "--tlsv1.0",
            "--tls-max",
            "1.1",
            "--ciphers",
            "DEFAULT:@SECLEVEL=0",
            "--cacert",
        ])
        .arg(&pki.ca_path)
        .arg(format!("https://{addr}/healthz"))
        .output()
        .unwrap();
    assert!(!out.status.success(), "curl --tls-max 1.1 got through");
}

fn s_client(openssl: &std::path::Path, addr: std::net::SocketAddr, pki: &Pki, args: &[&str]) -> std::process::Output {
    Command::new(openssl)
        .args(["s_client", "-connect", &addr.to_string(), "-brief", "-CAfile"])
        .arg(&pki.ca_path)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run openssl s_client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs openssl (installed by tests/run.sh)"]
async fn a_pkcs1_rsa_key_from_openssl_serves_https() {
    let openssl = tool("openssl", "openssl");
    let dir = tempfile::tempdir().unwrap();
    let (key, cert) = (dir.path().join("rsa.key"), dir.path().join("rsa.crt"));
    // -traditional: "BEGIN RSA PRIVATE KEY" (PKCS#1), as older tools and certbot's RSA keys have it.
    let ok = Command::new(&openssl)
        .args(["genrsa", "-traditional", "-out"])
        .arg(&key)
        .arg("2048")
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(
        std::fs::read_to_string(&key)
            .unwrap()
            .starts_with("-----BEGIN RSA PRIVATE KEY-----")
    );
    let ok = Command::new(&openssl)
        .args([
            "req",
            "-new",
            "-x509",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ])
        .args(["-addext", "basicConstraints=critical,CA:FALSE", "-key"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    let server = common::start_with(|c| {
        c.tls_cert = Some(cert.clone());
        c.tls_key = Some(key.clone());
    })
    .await;
    let client = koder_dns::tls::trusting(common::http_builder(), Some(&cert))
        .unwrap()
        .build()
        .unwrap();
    let status = client
        .get(format!("https://{}/healthz", server.running.http_addr))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_is_refused_naming_the_file_for_a_lone_certificate_or_a_key_of_another() {
    let pki = Pki::new();
    let (cert, _) = pki.issue("server", 1);
    let (_, other_key) = pki.issue("other", 2);
    let data = tempfile::tempdir().unwrap();
    let cert = cert.to_str().unwrap();
    let other_key = other_key.to_str().unwrap();
    let missing = pki.dir.path().join("missing.key");
    let cases: [(Vec<&str>, &str); 4] = [
        (vec!["--tls-cert", cert], "without --tls-key"),
        (vec!["--tls-cert", cert, "--tls-key", other_key], "other.key"),
        (
            vec!["--tls-cert", cert, "--tls-key", missing.to_str().unwrap()],
            "missing.key",
        ),
        (vec!["--dot-listen", "127.0.0.1:0"], "--dot-listen"),
    ];
    for (args, named) in cases {
        let (status, stderr) = child::launch_refused(data.path(), &args).await;
        assert_eq!(status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(named), "{args:?} must name {named:?}: {stderr}");
    }
}

/// The operator tools, the conformance checker, the agent and the library client reach an
/// HTTPS registry whose certificate a private CA signed, given the CA with `--ca` (or
/// `KODER_DNS_CA`), and refuse it without.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_client_speaks_https_to_a_private_ca_given_with_ca() {
    let pki = Pki::new();
    let server = common::start_https(&pki, |_| {}).await;
    let ca = pki.ca_path.to_str().unwrap();
    let run = |args: Vec<String>, ca_env: Option<&str>| {
        let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_koder-dns"));
        command.args(&args).env("KODER_DNS_API_KEY", KEY).kill_on_drop(true);
        for var in ["KODER_DNS_CA", "KODER_DNS_URL", "KODER_DNS_DATA_DIR"] {
            command.env_remove(var);
        }
        if let Some(ca) = ca_env {
            command.env("KODER_DNS_CA", ca);
        }
        async move {
            tokio::time::timeout(Duration::from_secs(60), command.output())
                .await
                .expect("the client finished")
                .expect("the client ran")
        }
    };
    let args = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let base = server.base.as_str();

    let export = run(args(&["export", "--url", base, "--ca", ca]), None).await;
    assert!(export.status.success(), "{}", String::from_utf8_lossy(&export.stderr));
    let reference = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(reference.path(), &export.stdout).unwrap();
    let refused = run(args(&["export", "--url", base]), None).await;
    assert_eq!(
        refused.status.code(),
        Some(2),
        "no --ca: the certificate is not trusted"
    );
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains(base), "{stderr}");
    let drift = run(
        args(&[
            "drift",
            "--url",
            base,
            "--reference",
            reference.path().to_str().unwrap(),
        ]),
        Some(ca),
    )
    .await;
    assert_eq!(
        drift.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&drift.stderr)
    );

    let conformance = run(args(&["conformance", "--url", base, "--ca", ca]), None).await;
    assert_eq!(
        conformance.status.code(),
        Some(0),
        "{}{}",
        String::from_utf8_lossy(&conformance.stdout),
        String::from_utf8_lossy(&conformance.stderr)
    );

    let client = koder_dns::client::Client::with_ca(
        vec![server.base.clone()],
        KEY,
        Duration::from_secs(5),
        Some(&pki.ca_path),
    )
    .unwrap();
    assert!(client.services().await.unwrap().is_empty(), "conformance cleans up");

    let agent = std::process::Command::new(env!("CARGO_BIN_EXE_koder-dns"))
        .args([
            "agent",
            "--url",
            base,
            "--ca",
            ca,
            "--name",
            "tls-agent",
            "--address",
            "127.0.0.1",
        ])
        .args(["--port", "7200", "--ttl", "2s"])
        .env("KODER_DNS_API_KEY", KEY)
        .env_remove("KODER_DNS_URL")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while client.services().await.unwrap() != ["tls-agent"] {
        assert!(
            std::time::Instant::now() < deadline,
            "the agent did not register over HTTPS"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ok = Command::new("kill")
        .args(["-TERM", &agent.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
    let mut agent = agent;
    let exit = tokio::task::spawn_blocking(move || agent.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(exit.success(), "{exit}");
    assert!(client.services().await.unwrap().is_empty(), "deregistered on SIGTERM");
}
