//! Test harness: the real server in-process on ephemeral ports, with HTTP and DNS clients.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query};
use hickory_proto::rr::{Name, RecordType};
use koder_dns::config::Config;
use koder_dns::model::clock::{Clock, ManualClock, SystemClock};
use koder_dns::server::{self, Running};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub const KEY: &str = "test-key-0123456789abcdef";

pub struct TestServer {
    pub running: Running,
    pub http: reqwest::Client,
    pub base: String,
    pub dir: tempfile::TempDir,
}

/// An HTTP client. reqwest takes its TLS provider from the process, which must have one
/// before any client is built, `http://` ones included.
pub fn http() -> reqwest::Client {
    http_builder().build().unwrap()
}

pub fn http_builder() -> reqwest::ClientBuilder {
    koder_dns::tls::client_builder()
}

/// A config on ephemeral loopback ports with a private data directory and no zones.
pub fn test_config(dir: &std::path::Path) -> Config {
    Config {
        dns_listen: "127.0.0.1:0".parse().unwrap(),
        http_listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: dir.join("data"),
        zones_dir: dir.join("zones"),
        api_keys: vec![KEY.to_owned()],
        // Every test client connects from 127.0.0.1, some with hundreds of requests in
        // flight; the per-client limit has its own test.
        http_max_connections_per_client: usize::MAX,
        ..Config::default()
    }
}

pub async fn start() -> TestServer {
    start_with(|_| {}).await
}

pub async fn start_with(tweak: impl FnOnce(&mut Config)) -> TestServer {
    start_with_clock(tweak, Arc::new(SystemClock)).await
}

/// The server on a clock the test moves. Returns the clock too.
pub async fn start_manual(tweak: impl FnOnce(&mut Config)) -> (TestServer, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(koder_dns::model::clock::MANUAL_START));
    (start_with_clock(tweak, clock.clone()).await, clock)
}

pub async fn start_with_clock(tweak: impl FnOnce(&mut Config), clock: Arc<dyn Clock>) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    let mut config = test_config(dir.path());
    tweak(&mut config);
    let running = server::start_with_clock(config, clock).await.expect("server starts");
    let base = format!("http://{}", running.http_addr);
    TestServer {
        running,
        http: http(),
        base,
        dir,
    }
}

impl TestServer {
    pub fn dns(&self) -> SocketAddr {
        self.running.dns_addr
    }

    /// POST with the test key; returns status and JSON body (Null when not JSON).
    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.send(self.http.post(self.url(path)).header("X-API-Key", KEY).json(body))
            .await
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.send(self.http.get(self.url(path)).header("X-API-Key", KEY)).await
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    pub async fn send(&self, request: reqwest::RequestBuilder) -> (u16, Value) {
        let response = request.send().await.expect("HTTP request");
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    /// Registers and asserts 200; returns the response body.
    pub async fn register(&self, body: Value) -> Value {
        let (status, response) = self.post("/api/v1/services/register", &body).await;
        assert_eq!(status, 200, "register {body}: {response}");
        response
    }

    /// A UDP query with EDNS (1232-byte buffer).
    /// `POST /services/deregister`, asserting `200`.
    pub async fn deregister(&self, id: &str) {
        let (status, body) = self.post("/api/v1/services/deregister", &json!({ "id": id })).await;
        assert_eq!(status, 200, "deregister {id}: {body}");
    }

    /// `GET /services?detail=1`, asserting `200`.
    pub async fn detail(&self) -> Value {
        let (status, body) = self.get("/api/v1/services?detail=1").await;
        assert_eq!(status, 200, "{body}");
        body
    }

    /// The service zone's SOA serial, asked over UDP.
    pub async fn serial(&self) -> u32 {
        let reply = self.query("service.koder.", RecordType::SOA).await;
        match reply.answers.first().map(|r| &r.data) {
            Some(hickory_proto::rr::RData::SOA(soa)) => soa.serial,
            other => panic!("expected the SOA in the answer, got {other:?}: {reply}"),
        }
    }

    pub async fn query(&self, name: &str, rtype: RecordType) -> Message {
        udp_query(self.dns(), &query_message(name, rtype, Some(1232))).await
    }

    pub async fn query_tcp(&self, name: &str, rtype: RecordType) -> Message {
        tcp_query(self.dns(), &query_message(name, rtype, Some(1232))).await
    }
}

pub fn query_message(name: &str, rtype: RecordType, edns_payload: Option<u16>) -> Message {
    let mut message = Message::new(fastrand::u16(..), MessageType::Query, OpCode::Query);
    message.add_query(Query::query(Name::from_str(name).unwrap(), rtype));
    if let Some(payload) = edns_payload {
        let mut edns = Edns::new();
        edns.set_max_payload(payload);
        message.set_edns(edns);
    }
    message
}

/// Sends raw bytes over UDP; returns the raw reply (or None after a timeout).
pub async fn udp_raw(server: SocketAddr, bytes: &[u8], wait: Duration) -> Option<Vec<u8>> {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    socket.send_to(bytes, server).await.unwrap();
    let mut buf = vec![0u8; 65535];
    match tokio::time::timeout(wait, socket.recv(&mut buf)).await {
        Ok(Ok(n)) => Some(buf[..n].to_vec()),
        _ => None,
    }
}

pub async fn udp_query(server: SocketAddr, message: &Message) -> Message {
    let reply = udp_raw(server, &message.to_vec().unwrap(), Duration::from_secs(5))
        .await
        .expect("UDP reply");
    let reply = Message::from_vec(&reply).expect("decodable reply");
    assert_eq!(reply.metadata.id, message.metadata.id);
    reply
}

pub async fn tcp_query(server: SocketAddr, message: &Message) -> Message {
    let mut stream = tokio::net::TcpStream::connect(server).await.unwrap();
    framed_query(&mut stream, message).await
}

/// `n` instances of one service at 10.0.x.y, port 8000.
pub fn instances(name: &str, n: usize) -> Vec<Value> {
    (0..n)
        .map(|i| serde_json::json!({ "name": name, "address": format!("10.0.{}.{}", i / 250, i % 250 + 1), "port": 8000 }))
        .collect()
}

/// The character-strings of a TXT record, as text.
pub fn txt_strings(record: &hickory_proto::rr::Record) -> Vec<String> {
    match &record.data {
        hickory_proto::rr::RData::TXT(txt) => txt
            .txt_data
            .iter()
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .collect(),
        other => panic!("expected TXT, got {other:?}"),
    }
}

/// `GET <base>/metrics`, checked to be the Prometheus text format.
pub async fn scrape(client: &reqwest::Client, base: &str) -> String {
    let response = client.get(format!("{base}/metrics")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let content_type = response.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(content_type.starts_with("text/plain; version=0.0.4"), "{content_type}");
    response.text().await.unwrap()
}

/// The value of the sample written exactly as `series` (name and labels), 0 when absent.
pub fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// A private CA made by the test as it runs (no key is ever stored in the repository), and
/// the server certificates it issues, for 127.0.0.1 and localhost.
pub struct Pki {
    pub dir: tempfile::TempDir,
    ca: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
    /// The CA certificate, PEM: what clients are told to trust (`--ca`).
    pub ca_path: std::path::PathBuf,
}

impl Pki {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "koder-dns test CA");
        let ca = rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap()).unwrap();
        let ca_path = dir.path().join("ca.pem");
        std::fs::write(&ca_path, ca.pem()).unwrap();
        Self { dir, ca, ca_path }
    }

    /// A server certificate with serial `serial` and its key (PKCS#8), written as
    /// `<name>.crt` and `<name>.key`; returns their paths.
    pub fn issue(&self, name: &str, serial: u8) -> (std::path::PathBuf, std::path::PathBuf) {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
        params.serial_number = Some(rcgen::SerialNumber::from(vec![0x4b, serial]));
        self.sign(name, params)
    }

    /// A client certificate (extended key usage: client authentication) whose subject's CN is
    /// `cn`, and its key, written as `<name>.crt` and `<name>.key`; returns their paths.
    pub fn issue_client(&self, name: &str, cn: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, cn);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(name, params)
    }

    fn sign(&self, name: &str, params: rcgen::CertificateParams) -> (std::path::PathBuf, std::path::PathBuf) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.ca).unwrap();
        let (cert_path, key_path) = (
            self.dir.path().join(format!("{name}.crt")),
            self.dir.path().join(format!("{name}.key")),
        );
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        (cert_path, key_path)
    }

    /// An HTTP client trusting this CA (and the system's roots), as `--ca` makes one.
    pub fn http(&self) -> reqwest::Client {
        koder_dns::tls::trusting(http_builder(), Some(&self.ca_path))
            .unwrap()
            .build()
            .unwrap()
    }

    /// A TLS client config trusting this CA only, offering `alpn`.
    pub fn client_config(&self, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(self.ca.der().clone()).unwrap();
        let mut config = rustls::ClientConfig::builder_with_provider(koder_dns::tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }
}

/// The server with a certificate from `pki` (serial 1): HTTPS on its REST address, DNS over
/// TLS on a port of its own; `http` and `base` speak HTTPS, trusting `pki`'s CA.
pub async fn start_https(pki: &Pki, tweak: impl FnOnce(&mut Config)) -> TestServer {
    let (cert, key) = pki.issue("server", 1);
    let mut server = start_with(|c| {
        c.tls_cert = Some(cert);
        c.tls_key = Some(key);
        c.dot_listen = Some("127.0.0.1:0".parse().unwrap());
        tweak(c);
    })
    .await;
    server.http = pki.http();
    server.base = format!("https://{}", server.running.http_addr);
    server
}

/// A TLS connection to `addr` as 127.0.0.1, checked against `config`'s roots.
pub async fn tls_connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::IpAddress(std::net::Ipv4Addr::LOCALHOST.into());
    tokio_rustls::TlsConnector::from(config).connect(name, tcp).await
}

/// The serial number's last byte of the certificate a TLS connection was answered with (the
/// `serial` given to [`Pki::issue`]).
pub fn peer_serial(stream: &tokio_rustls::client::TlsStream<tokio::net::TcpStream>) -> u8 {
    let chain = stream.get_ref().1.peer_certificates().expect("a certificate");
    let (_, leaf) = x509_parser::parse_x509_certificate(&chain[0]).unwrap();
    *leaf.raw_serial().last().unwrap()
}

/// One DNS message over a framed stream (TCP, or TLS for DNS over TLS).
pub async fn framed_query<S>(stream: &mut S, message: &Message) -> Message
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let bytes = message.to_vec().unwrap();
    let mut framed = (bytes.len() as u16).to_be_bytes().to_vec();
    framed.extend_from_slice(&bytes);
    stream.write_all(&framed).await.unwrap();
    stream.flush().await.unwrap();
    let mut len = [0u8; 2];
    stream.read_exact(&mut len).await.unwrap();
    let mut reply = vec![0u8; u16::from_be_bytes(len) as usize];
    stream.read_exact(&mut reply).await.unwrap();
    Message::from_vec(&reply).expect("decodable reply")
}
