//! Zone transfer on the wire: AXFR in many messages, IXFR from the journal, who may
//! transfer, TSIG, and NOTIFY; then real Knot and NSD secondaries following koder-dns.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::SOA;
use hickory_proto::rr::rdata::tsig::{TsigAlgorithm, TsigError};
use hickory_proto::rr::{Name, RData, Record, RecordType, TSigner};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::{self, TestServer, query_message, udp_raw};

const ZONE: &str = "service.koder.";
const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef";

fn key_text(name: &str) -> String {
    format!("{name}:hmac-sha256:{}", data_encoding::BASE64.encode(SECRET))
}

pub(crate) fn signer(name: &str, secret: &[u8]) -> TSigner {
    TSigner::new(
        secret.to_vec(),
        TsigAlgorithm::HmacSha256,
        Name::from_ascii(name).unwrap(),
        300,
    )
    .unwrap()
}

pub(crate) fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

async fn transferable(tweak: impl FnOnce(&mut koder_dns::config::Config)) -> TestServer {
    common::start_with(|c| {
        c.allow_transfer = vec!["127.0.0.0/8".parse().unwrap()];
        c.tsig_key = koder_dns::dns::tsig::parse_keys(&key_text("transfer.")).unwrap();
        tweak(c);
    })
    .await
}

pub(crate) fn transfer_request(qtype: RecordType, held: Option<u32>) -> Message {
    let mut message = Message::new(fastrand::u16(..), MessageType::Query, OpCode::Query);
    message.add_query(Query::query(Name::from_ascii(ZONE).unwrap(), qtype));
    if let Some(serial) = held {
        let soa = SOA::new(
            Name::from_ascii("ns.service.koder.").unwrap(),
            Name::from_ascii("hostmaster.service.koder.").unwrap(),
            serial,
            0,
            0,
            0,
            0,
        );
        message.add_authority(Record::from_rdata(Name::from_ascii(ZONE).unwrap(), 0, RData::SOA(soa)));
    }
    message
}

/// Sends `request` over TCP and reads raw reply messages until the transfer is complete
/// (the first SOA seen again at the end, or an error, or a lone SOA).
async fn transfer_raw(server: SocketAddr, request: &[u8]) -> Vec<Vec<u8>> {
    let mut stream = tokio::net::TcpStream::connect(server).await.unwrap();
    stream.write_all(&(request.len() as u16).to_be_bytes()).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut replies = Vec::new();
    let mut first_soa: Option<u32> = None;
    let mut records = 0;
    loop {
        let mut len = [0u8; 2];
        let read = tokio::time::timeout(Duration::from_secs(30), stream.read_exact(&mut len)).await;
        assert!(
            matches!(read, Ok(Ok(_))),
            "transfer cut short after {} messages",
            replies.len()
        );
        let mut bytes = vec![0u8; u16::from_be_bytes(len) as usize];
        stream.read_exact(&mut bytes).await.unwrap();
        let message = Message::from_vec(&bytes).expect("decodable transfer message");
        replies.push(bytes);
        if message.metadata.response_code != ResponseCode::NoError {
            return replies;
        }
        for record in &message.answers {
            records += 1;
            if let RData::SOA(soa) = &record.data {
                match first_soa {
                    None => first_soa = Some(soa.serial),
                    Some(first) if first == soa.serial && records > 1 && is_last(&message, record) => return replies,
                    Some(_) => {}
                }
            }
        }
        if records == 1 && message.answers.len() == 1 {
            // A lone SOA: the secondary is current (IXFR).
            return replies;
        }
    }
}

fn is_last(message: &Message, record: &Record) -> bool {
    std::ptr::eq(message.answers.last().unwrap(), record)
}

pub(crate) async fn transfer(server: SocketAddr, request: &Message) -> Vec<Message> {
    transfer_raw(server, &request.to_vec().unwrap())
        .await
        .iter()
        .map(|b| Message::from_vec(b).unwrap())
        .collect()
}

fn answers(messages: &[Message]) -> Vec<&Record> {
    messages.iter().flat_map(|m| &m.answers).collect()
}

fn of_type<'a>(records: &[&'a Record], rtype: RecordType) -> Vec<&'a Record> {
    records.iter().copied().filter(|r| r.record_type() == rtype).collect()
}

fn serial_of(record: &Record) -> u32 {
    match &record.data {
        RData::SOA(soa) => soa.serial,
        other => panic!("not a SOA: {other:?}"),
    }
}

async fn register_many(server: &TestServer, bodies: Vec<Value>) {
    for body in bodies {
        server.register(body).await;
    }
}

async fn serial(server: &TestServer) -> u32 {
    let reply = server.query(ZONE, RecordType::SOA).await;
    serial_of(&reply.answers[0])
}

/// A zone far over 64 KiB goes out in many messages, starting and ending with the SOA,
/// holding exactly what queries answer: each instance's SRV and TXT, the service's A, and
/// one `<hex>.addr` record per target address.
#[tokio::test]
async fn axfr_sends_a_large_zone_in_many_messages_with_what_queries_answer() {
    let server = transferable(|_| {}).await;
    register_many(&server, common::instances("big", 1500)).await;
    server
        .register(json!({"name": "web", "address": "10.0.0.1", "port": 80, "metadata": {"team": "edge"}}))
        .await;
    let mut request = transfer_request(RecordType::AXFR, None);
    request.set_edns(hickory_proto::op::Edns::new());
    let messages = transfer(server.dns(), &request).await;
    assert!(messages.len() >= 3, "{} messages", messages.len());
    for (i, m) in messages.iter().enumerate() {
        assert!(m.metadata.authoritative, "message {i} without AA");
        // An EDNS request gets an OPT record in every message, as Knot sends them.
        assert!(m.edns.is_some(), "message {i} without OPT");
        assert_eq!(
            m.queries.len(),
            usize::from(i == 0),
            "the question is in the first message only"
        );
    }
    let records = answers(&messages);
    let (first, last) = (records[0], records[records.len() - 1]);
    assert_eq!(first.record_type(), RecordType::SOA);
    assert_eq!(last.record_type(), RecordType::SOA);
    assert_eq!(serial_of(first), serial(&server).await);
    assert_eq!(of_type(&records, RecordType::SOA).len(), 2);
    let srv_big: Vec<_> = of_type(&records, RecordType::SRV)
        .into_iter()
        .filter(|r| r.name.to_ascii() == "_big._tcp.service.koder.")
        .collect();
    assert_eq!(srv_big.len(), 1500);
    let a_big = of_type(&records, RecordType::A)
        .into_iter()
        .filter(|r| r.name.to_ascii() == "big.service.koder.")
        .count();
    assert_eq!(a_big, 1500);
    let addr = of_type(&records, RecordType::A)
        .into_iter()
        .filter(|r| r.name.to_ascii().ends_with(".addr.service.koder."))
        .count();
    // web's 10.0.0.1 is big's first address too: one record for both.
    assert_eq!(addr, 1500);
    let txt_web: Vec<Vec<String>> = of_type(&records, RecordType::TXT)
        .into_iter()
        .filter(|r| r.name.to_ascii() == "web.service.koder.")
        .map(common::txt_strings)
        .collect();
    assert_eq!(
        txt_web,
        vec![vec!["id=web-10.0.0.1-80".to_owned(), "team=edge".to_owned()]]
    );
    assert_eq!(of_type(&records, RecordType::NS).len(), 1);
    // TTLs: --dns-ttl for service records.
    assert!(srv_big.iter().all(|r| r.ttl == 5));
}

/// One registration after a transfer is sent by IXFR as one difference: the old and new
/// SOA around exactly the new instance's records. A secondary that is current gets the
/// SOA alone; one older than the journal gets the whole zone.
#[tokio::test]
async fn ixfr_sends_one_change_as_a_difference() {
    let server = transferable(|_| {}).await;
    register_many(&server, common::instances("voice", 20)).await;
    let whole = transfer(server.dns(), &transfer_request(RecordType::AXFR, None)).await;
    let held = serial_of(answers(&whole)[0]);
    server
        .register(json!({"name": "voice", "address": "10.9.9.9", "port": 5060}))
        .await;
    let now = serial(&server).await;
    assert_ne!(now, held);
    let messages = transfer(server.dns(), &transfer_request(RecordType::IXFR, Some(held))).await;
    let records = answers(&messages);
    let soas: Vec<u32> = of_type(&records, RecordType::SOA).into_iter().map(serial_of).collect();
    assert_eq!(soas, vec![now, held, now, now], "{records:#?}");
    let added: Vec<String> = records[3..records.len() - 1].iter().map(|r| r.to_string()).collect();
    // Deletions between the 2nd and 3rd SOA: none. Additions: the instance's SRV, TXT (at
    // both names), A, and its target's address record.
    assert_eq!(records[2].record_type(), RecordType::SOA, "{records:#?}");
    assert_eq!(added.len(), 5, "{added:#?}");
    assert!(
        added.iter().any(|r| r.contains("SRV") && r.contains("0a090909.addr")),
        "{added:#?}"
    );
    assert!(
        added.iter().any(|r| r.starts_with("0a090909.addr.service.koder.")),
        "{added:#?}"
    );

    // Deregistration: the same records, deleted.
    let (status, _) = server
        .post("/api/v1/services/deregister", &json!({"id": "voice-10.9.9.9-5060"}))
        .await;
    assert_eq!(status, 200);
    let after = serial(&server).await;
    let messages = transfer(server.dns(), &transfer_request(RecordType::IXFR, Some(now))).await;
    let records = answers(&messages);
    let soas: Vec<u32> = of_type(&records, RecordType::SOA).into_iter().map(serial_of).collect();
    assert_eq!(soas, vec![after, now, after, after]);
    assert_eq!(records.len(), 4 + 5, "{records:#?}");

    // Current: the SOA alone.
    let current = transfer(server.dns(), &transfer_request(RecordType::IXFR, Some(after))).await;
    assert_eq!(answers(&current).len(), 1);
    // Unknown to the journal: the whole zone, AXFR-style.
    let old = transfer(server.dns(), &transfer_request(RecordType::IXFR, Some(held - 1000))).await;
    let records = answers(&old);
    assert_eq!(of_type(&records, RecordType::SRV).len(), 20);
    assert_eq!(of_type(&records, RecordType::SOA).len(), 2);
}

/// The journal keeps `--journal-max-changes` differences: a secondary further behind gets
/// the whole zone.
#[tokio::test]
async fn ixfr_older_than_the_journal_gets_the_whole_zone() {
    let server = transferable(|c| c.journal_max_changes = 2).await;
    server
        .register(json!({"name": "a", "address": "10.0.0.1", "port": 1}))
        .await;
    let mut serials = Vec::new();
    for i in 2..6 {
        let messages = transfer(server.dns(), &transfer_request(RecordType::AXFR, None)).await;
        serials.push(serial_of(answers(&messages)[0]));
        server
            .register(json!({"name": "a", "address": format!("10.0.0.{i}"), "port": 1}))
            .await;
    }
    // Cuts the newest version: 4 differences made, the last 2 kept.
    let latest = transfer(server.dns(), &transfer_request(RecordType::AXFR, None)).await;
    assert_eq!(of_type(&answers(&latest), RecordType::SRV).len(), 5);
    let recent = transfer(server.dns(), &transfer_request(RecordType::IXFR, Some(serials[2]))).await;
    assert_eq!(of_type(&answers(&recent), RecordType::SOA).len(), 6, "two differences");
    let old = transfer(server.dns(), &transfer_request(RecordType::IXFR, Some(serials[0]))).await;
    let records = answers(&old);
    assert_eq!(of_type(&records, RecordType::SOA).len(), 2, "the whole zone");
    assert_eq!(of_type(&records, RecordType::SRV).len(), 5);
}

/// Without --allow-transfer or a signature: REFUSED, AA clear. AXFR over UDP: REFUSED.
/// IXFR over UDP: the SOA alone (RFC 1995 §2), to those who may transfer.
#[tokio::test]
async fn transfer_is_refused_without_permission_and_over_udp() {
    let closed = common::start().await;
    closed
        .register(json!({"name": "a", "address": "10.0.0.1", "port": 1}))
        .await;
    for qtype in [RecordType::AXFR, RecordType::IXFR] {
        let reply = transfer(closed.dns(), &transfer_request(qtype, Some(1))).await;
        assert_eq!(reply.len(), 1);
        assert_eq!(reply[0].metadata.response_code, ResponseCode::Refused, "{qtype}");
        assert!(!reply[0].metadata.authoritative);
        assert!(reply[0].answers.is_empty());
    }
    let reply = closed.query(ZONE, RecordType::AXFR).await;
    assert_eq!(reply.response_code, ResponseCode::Refused);
    let open = transferable(|_| {}).await;
    let reply = open.query(ZONE, RecordType::AXFR).await;
    assert_eq!(reply.response_code, ResponseCode::Refused, "AXFR over UDP");
    assert!(!reply.metadata.authoritative);
    let ixfr = transfer_request(RecordType::IXFR, Some(1));
    let reply = Message::from_vec(
        &udp_raw(open.dns(), &ixfr.to_vec().unwrap(), Duration::from_secs(5))
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(reply.response_code, ResponseCode::NoError);
    assert_eq!(reply.answers.len(), 1);
    assert_eq!(serial_of(&reply.answers[0]), serial(&open).await);
    // A zone we do not serve.
    let mut other = Message::new(7, MessageType::Query, OpCode::Query);
    other.add_query(Query::query(
        Name::from_ascii("example.com.").unwrap(),
        RecordType::AXFR,
    ));
    let reply = transfer(open.dns(), &other).await;
    assert_eq!(reply[0].metadata.response_code, ResponseCode::Refused);
}

/// A transfer signed with a known key is allowed from an address not in --allow-transfer,
/// and every message of it is signed, chained to the one before (RFC 8945 §5.3.1).
/// An unknown key gets NOTAUTH/BADKEY and a wrong secret NOTAUTH/BADSIG, unsigned, for
/// transfers and queries alike.
#[tokio::test]
async fn tsig_signed_transfers_and_queries_are_verified_and_answered_signed() {
    let server = common::start_with(|c| {
        c.tsig_key = koder_dns::dns::tsig::parse_keys(&key_text("transfer.")).unwrap();
    })
    .await;
    register_many(&server, common::instances("big", 800)).await;
    let key = signer("transfer.", SECRET);
    let mut request = transfer_request(RecordType::AXFR, None);
    request.finalize(&key, now()).unwrap();
    let request_mac = request.signature().unwrap().data.mac.clone();
    let replies = transfer_raw(server.dns(), &request.to_vec().unwrap()).await;
    assert!(replies.len() > 2, "{} messages", replies.len());
    let mut previous = request_mac;
    for (i, bytes) in replies.iter().enumerate() {
        let (mac, _, _) = key
            .verify_message_byte(bytes, Some(&previous), i == 0)
            .unwrap_or_else(|e| panic!("message {i} of {}: {e}", replies.len()));
        previous = mac;
    }
    let records: usize = replies
        .iter()
        .map(|b| Message::from_vec(b).unwrap().answers.len())
        .sum();
    assert!(records > 1600);

    for (name, secret, error) in [
        ("unknown.", SECRET, TsigError::BadKey),
        (
            "transfer.",
            &b"another secret entirely.........."[..],
            TsigError::BadSig,
        ),
    ] {
        let mut request = transfer_request(RecordType::AXFR, None);
        request.finalize(&signer(name, secret), now()).unwrap();
        let reply = transfer(server.dns(), &request).await;
        assert_eq!(reply[0].metadata.response_code, ResponseCode::NotAuth, "{name}");
        assert_eq!(reply[0].signature().unwrap().data.error, Some(error), "{name}");
        assert!(reply[0].signature().unwrap().data.mac.is_empty(), "unsigned");
        let mut query = query_message("big.service.koder.", RecordType::A, None);
        query.finalize(&signer(name, secret), now()).unwrap();
        let reply = Message::from_vec(
            &udp_raw(server.dns(), &query.to_vec().unwrap(), Duration::from_secs(5))
                .await
                .unwrap(),
        )
        .unwrap();
        assert_eq!(reply.metadata.response_code, ResponseCode::NotAuth, "query with {name}");
        assert_eq!(reply.signature().unwrap().data.error, Some(error));
    }
    // A signed query: answered, and signed.
    server
        .register(json!({"name": "small", "address": "10.0.0.1", "port": 1}))
        .await;
    let mut query = query_message("small.service.koder.", RecordType::A, Some(1232));
    query.finalize(&key, now()).unwrap();
    let mac = query.signature().unwrap().data.mac.clone();
    let bytes = udp_raw(server.dns(), &query.to_vec().unwrap(), Duration::from_secs(5))
        .await
        .unwrap();
    key.verify_message_byte(&bytes, Some(&mac), true)
        .expect("a signed answer");
    let reply = Message::from_vec(&bytes).unwrap();
    assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
    assert!(!reply.answers.is_empty());
}

/// NOTIFY goes to each --notify address after a change, coalesced: a burst of
/// registrations is a few NOTIFYs, not one each; one not answered is sent again.
#[tokio::test]
async fn notify_is_sent_after_changes_coalesced_and_retried_until_answered() {
    let secondary = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let target = secondary.local_addr().unwrap();
    let server = common::start_with(|c| c.notify = vec![target]).await;
    let mut buf = vec![0u8; 4096];
    // The one at start, answered.
    let (n, from) = tokio::time::timeout(Duration::from_secs(5), secondary.recv_from(&mut buf))
        .await
        .expect("a NOTIFY at start")
        .unwrap();
    let notify = Message::from_vec(&buf[..n]).unwrap();
    assert_eq!(notify.metadata.op_code, OpCode::Notify);
    assert!(notify.metadata.authoritative);
    assert_eq!(notify.queries[0].name().to_ascii(), ZONE);
    assert_eq!(notify.queries[0].query_type(), RecordType::SOA);
    let answer = |notify: &Message| {
        let mut reply = Message::new(notify.metadata.id, MessageType::Response, OpCode::Notify);
        reply.metadata.authoritative = true;
        reply.add_query(notify.queries[0].clone());
        reply.to_vec().unwrap()
    };
    secondary.send_to(&answer(&notify), from).await.unwrap();

    let started = Instant::now();
    register_many(&server, common::instances("burst", 50)).await;
    let current = serial(&server).await;
    let mut seen = 0;
    let mut last_serial = 0;
    // Not answered on purpose until the serial is the current one: retries come.
    while last_serial != current {
        let (n, from) = tokio::time::timeout(Duration::from_secs(5), secondary.recv_from(&mut buf))
            .await
            .expect("NOTIFY after the burst")
            .unwrap();
        let notify = Message::from_vec(&buf[..n]).unwrap();
        seen += 1;
        last_serial = serial_of(&notify.answers[0]);
        if last_serial == current {
            secondary.send_to(&answer(&notify), from).await.unwrap();
        }
    }
    assert!(seen < 25, "{seen} NOTIFYs for 50 registrations");
    assert!(started.elapsed() < Duration::from_secs(5));
    // Not answered: sent again with back-off.
    server
        .register(json!({"name": "late", "address": "10.0.0.1", "port": 1}))
        .await;
    let mut times = Vec::new();
    for _ in 0..2 {
        tokio::time::timeout(Duration::from_secs(5), secondary.recv_from(&mut buf))
            .await
            .expect("NOTIFY retried")
            .unwrap();
        times.push(Instant::now());
    }
    assert!(times[1] - times[0] >= Duration::from_millis(400), "a retry waits");
}

// ---------------------------------------------------------------------------------------
// Real secondaries: Knot DNS and NSD transferring from koder-dns

use crate::tools::{dig, free_port, tool};
use std::path::Path;
use std::process::Stdio;

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Kind {
    Knot,
    Nsd,
}

/// A secondary of the service zone, its primary koder-dns at `primary`.
pub(crate) struct Secondary {
    kind: Kind,
    child: tokio::process::Child,
    pub addr: SocketAddr,
    dir: tempfile::TempDir,
    log: std::path::PathBuf,
}

impl Drop for Secondary {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// The secret a secondary signs its transfers with: ours, or another one.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Signing {
    Unsigned,
    Key,
    WrongKey,
}

fn secondary_conf(kind: Kind, dir: &Path, port: u16, primary: SocketAddr, signing: Signing) -> String {
    let d = dir.display();
    let secret = match signing {
        Signing::WrongKey => data_encoding::BASE64.encode(b"not the secret the primary holds."),
        _ => data_encoding::BASE64.encode(SECRET),
    };
    let (pip, pport) = (primary.ip(), primary.port());
    match kind {
        Kind::Knot => {
            let key_ref = if signing == Signing::Unsigned {
                ""
            } else {
                "\n    key: transfer."
            };
            format!(
                r#"server:
    rundir: "{d}"
    listen: 127.0.0.1@{port}
log:
  - target: "{d}/secondary.log"
    any: debug
database:
    storage: "{d}"
control:
    listen: "{d}/knot.sock"
key:
  - id: transfer.
    algorithm: hmac-sha256
    secret: {secret}
remote:
  - id: primary
    address: {pip}@{pport}{key_ref}
acl:
  - id: notify
    address: 127.0.0.1
    action: notify
  - id: transfer
    address: 127.0.0.1
    action: transfer
zone:
  - domain: service.koder.
    storage: "{d}"
    file: "service.koder.zone"
    master: primary
    acl: [notify, transfer]
    zonefile-sync: -1
"#
            )
        }
        Kind::Nsd => {
            let key = if signing == Signing::Unsigned {
                "NOKEY"
            } else {
                "transfer."
            };
            let server = crate::tools::nsd_server(dir, port, "secondary.log");
            format!(
                r#"{server}
    server-count: 1
    verbosity: 2
remote-control:
    control-enable: no
key:
    name: "transfer."
    algorithm: hmac-sha256
    secret: "{secret}"
zone:
    name: "service.koder."
    zonefile: "service.koder.zone"
    request-xfr: {pip}@{pport} {key}
    allow-notify: 127.0.0.1 NOKEY
    provide-xfr: 127.0.0.1 NOKEY
"#
            )
        }
    }
}

pub(crate) fn start_secondary(kind: Kind, port: u16, primary: SocketAddr, signing: Signing) -> Secondary {
    start_secondary_in(tempfile::tempdir().unwrap(), kind, port, primary, signing)
}

/// Starts a secondary keeping its state in `dir` (a restarted one keeps its zone there).
fn start_secondary_in(
    dir: tempfile::TempDir,
    kind: Kind,
    port: u16,
    primary: SocketAddr,
    signing: Signing,
) -> Secondary {
    let conf = dir.path().join("secondary.conf");
    std::fs::write(&conf, secondary_conf(kind, dir.path(), port, primary, signing)).unwrap();
    let (program, args): (_, Vec<&str>) = match kind {
        Kind::Knot => (tool("knotd", "knot"), vec!["-c"]),
        Kind::Nsd => (tool("nsd", "nsd"), vec!["-d", "-c"]),
    };
    let child = tokio::process::Command::new(program)
        .args(args)
        .arg(&conf)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start the secondary");
    Secondary {
        kind,
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        log: dir.path().join("secondary.log"),
        dir,
    }
}

impl Secondary {
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn serial(&self) -> Option<u32> {
        let reply = dig(self.addr, &["+time=1", "+tries=1", "SOA", ZONE]).await;
        reply.answer.first().and_then(|r| r.get(6)).and_then(|s| s.parse().ok())
    }

    /// Waits until the secondary serves `serial`; returns how long that took.
    pub(crate) async fn until_serial(&self, serial: u32, within: Duration) -> Duration {
        let started = Instant::now();
        loop {
            if self.serial().await == Some(serial) {
                return started.elapsed();
            }
            assert!(
                started.elapsed() < within,
                "{:?} did not reach serial {serial} within {within:?} (it has {:?}):\n{}",
                self.kind,
                self.serial().await,
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn restart(mut self, primary: SocketAddr, signing: Signing) -> Secondary {
        let _ = self.child.kill().await;
        let (port, kind) = (self.addr.port(), self.kind);
        // The same directory: it keeps the zone it had, as a restarted secondary does.
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap());
        start_secondary_in(dir, kind, port, primary, signing)
    }
}

/// The sorted record data `name`/`rtype` answers with, TTLs aside (ours shrink with leases).
async fn rdata(server: SocketAddr, name: &str, rtype: &str) -> Vec<String> {
    let reply = dig(server, &["+time=2", "+tries=1", rtype, name]).await;
    let mut out: Vec<String> = reply
        .answer
        .iter()
        .filter(|r| r.get(3).is_some_and(|t| t == rtype))
        .map(|r| r[4..].join(" "))
        .collect();
    out.sort();
    out
}

pub(crate) fn primary_settings(c: &mut koder_dns::config::Config, notify: SocketAddr, signing: Signing) {
    if signing == Signing::Unsigned {
        c.allow_transfer = vec!["127.0.0.0/8".parse().unwrap()];
    }
    c.tsig_key = koder_dns::dns::tsig::parse_keys(&key_text("transfer.")).unwrap();
    c.notify = vec![notify];
    // An hour: anything faster than that is NOTIFY's doing.
    c.soa_refresh = Duration::from_secs(3600);
}

/// The whole life of a secondary: the first transfer matches what koder-dns answers; a
/// registration and a deregistration reach it within 2 s by NOTIFY and IXFR (the refresh
/// is an hour); restarted, it catches up with what changed while it was down.
async fn secondary_follows_the_registry(kind: Kind, signing: Signing) {
    let port = free_port();
    let notify = SocketAddr::from(([127, 0, 0, 1], port));
    let server = common::start_with(|c| primary_settings(c, notify, signing)).await;
    for i in 1..=3 {
        server
            .register(
                json!({"name": "voice", "address": format!("10.0.0.{i}"), "port": 5060, "metadata": {"zone": "a"}}),
            )
            .await;
    }
    server
        .register(json!({"name": "ldap", "address": "ldap1.example.net", "port": 389, "protocol": "tcp"}))
        .await;
    let secondary = start_secondary(kind, port, server.dns(), signing);
    secondary
        .until_serial(serial(&server).await, Duration::from_secs(15))
        .await;
    for (name, rtype) in [
        ("_voice._tcp.service.koder.", "SRV"),
        ("voice.service.koder.", "A"),
        ("voice.service.koder.", "TXT"),
        ("_voice._tcp.service.koder.", "TXT"),
        ("_ldap._tcp.service.koder.", "SRV"),
        ("0a000002.addr.service.koder.", "A"),
        ("service.koder.", "NS"),
        ("ns.service.koder.", "A"),
    ] {
        let ours = rdata(server.dns(), name, rtype).await;
        assert!(!ours.is_empty(), "{name} {rtype}");
        assert_eq!(
            rdata(secondary.addr, name, rtype).await,
            ours,
            "{kind:?}: {name} {rtype}"
        );
    }

    let mut delays = Vec::new();
    server
        .register(json!({"name": "voice", "address": "10.0.0.4", "port": 5060}))
        .await;
    delays.push(
        secondary
            .until_serial(serial(&server).await, Duration::from_secs(2))
            .await,
    );
    assert_eq!(
        rdata(secondary.addr, "_voice._tcp.service.koder.", "SRV").await.len(),
        4
    );
    let (status, _) = server
        .post("/api/v1/services/deregister", &json!({"id": "voice-10.0.0.1-5060"}))
        .await;
    assert_eq!(status, 200);
    delays.push(
        secondary
            .until_serial(serial(&server).await, Duration::from_secs(2))
            .await,
    );
    assert_eq!(
        rdata(secondary.addr, "_voice._tcp.service.koder.", "SRV").await,
        rdata(server.dns(), "_voice._tcp.service.koder.", "SRV").await
    );
    // The single changes went by IXFR, as the secondary's log says.
    let log = secondary.log();
    let ixfr = match kind {
        Kind::Knot => log.contains("IXFR, incoming") && log.contains("finished"),
        // NSD does not name the kind: the bytes it took say it. The first transfer was the
        // whole (smaller) zone; each single change since is a fraction of it.
        Kind::Nsd => {
            let sizes: Vec<usize> = log
                .lines()
                .filter(|l| l.contains("received update to serial") && l.contains(" of "))
                .filter_map(|l| l.split(" of ").last()?.split(' ').next()?.parse().ok())
                .collect();
            sizes.len() >= 3 && sizes[1..].iter().all(|s| s * 2 < sizes[0])
        }
    };
    assert!(ixfr, "{kind:?} took no IXFR:\n{log}");

    let secondary = secondary.restart(server.dns(), signing).await;
    server
        .register(json!({"name": "while-down", "address": "10.0.0.9", "port": 1}))
        .await;
    secondary
        .until_serial(serial(&server).await, Duration::from_secs(10))
        .await;
    assert_eq!(
        rdata(secondary.addr, "while-down.service.koder.", "A").await,
        vec!["10.0.0.9"]
    );
    eprintln!("{kind:?} {signing:?}: NOTIFY to served in {delays:?}");
}

impl std::fmt::Debug for Signing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Signing::Unsigned => "unsigned",
            Signing::Key => "TSIG",
            Signing::WrongKey => "wrong TSIG",
        })
    }
}

#[tokio::test]
#[ignore = "needs knotd and dig (installed by tests/run.sh)"]
async fn knot_secondary_follows_by_notify_and_ixfr() {
    secondary_follows_the_registry(Kind::Knot, Signing::Unsigned).await;
}

#[tokio::test]
#[ignore = "needs nsd and dig (installed by tests/run.sh)"]
async fn nsd_secondary_follows_by_notify_and_ixfr() {
    secondary_follows_the_registry(Kind::Nsd, Signing::Unsigned).await;
}

#[tokio::test]
#[ignore = "needs knotd and dig (installed by tests/run.sh)"]
async fn knot_secondary_follows_with_tsig() {
    secondary_follows_the_registry(Kind::Knot, Signing::Key).await;
}

#[tokio::test]
#[ignore = "needs nsd and dig (installed by tests/run.sh)"]
async fn nsd_secondary_follows_with_tsig() {
    secondary_follows_the_registry(Kind::Nsd, Signing::Key).await;
}

/// A secondary with the wrong secret (and none allowed by address) gets nothing: it has no
/// zone to serve, and koder-dns's answers to it were NOTAUTH.
#[tokio::test]
#[ignore = "needs knotd, nsd and dig (installed by tests/run.sh)"]
async fn secondaries_with_a_wrong_key_get_no_zone() {
    for kind in [Kind::Knot, Kind::Nsd] {
        let port = free_port();
        let notify = SocketAddr::from(([127, 0, 0, 1], port));
        let server = common::start_with(|c| primary_settings(c, notify, Signing::WrongKey)).await;
        server
            .register(json!({"name": "a", "address": "10.0.0.1", "port": 1}))
            .await;
        let secondary = start_secondary(kind, port, server.dns(), Signing::WrongKey);
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert_eq!(
            secondary.serial().await,
            None,
            "{kind:?} got a zone:\n{}",
            secondary.log()
        );
        assert!(rdata(secondary.addr, "a.service.koder.", "A").await.is_empty());
    }
}

/// 100,000 instances (1,000 services of 100) reach Knot whole by AXFR.
#[tokio::test]
#[ignore = "needs knotd and dig (installed by tests/run.sh)"]
async fn a_100k_instance_zone_transfers_whole_to_knot() {
    let port = free_port();
    let notify = SocketAddr::from(([127, 0, 0, 1], port));
    let server = common::start_with(|c| primary_settings(c, notify, Signing::Unsigned)).await;
    let registry = &server.running.registry;
    for i in 0..100_000u32 {
        let registration: koder_dns::model::instance::Instance = serde_json::from_value(json!({
            "name": format!("svc{}", i / 100),
            "address": format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255),
            "port": 8000,
        }))
        .unwrap();
        registry.register(registration.validate().unwrap()).unwrap();
    }
    let started = Instant::now();
    let secondary = start_secondary(Kind::Knot, port, server.dns(), Signing::Unsigned);
    secondary
        .until_serial(serial(&server).await, Duration::from_secs(120))
        .await;
    eprintln!("100k instances transferred to Knot in {:?}", started.elapsed());
    for service in ["svc0", "svc500", "svc999"] {
        let owner = format!("_{service}._tcp.service.koder.");
        let reply = dig(secondary.addr, &["+tcp", "SRV", &owner]).await;
        assert_eq!(reply.answer.len(), 100, "{owner}");
    }
}
