//! DNS under load from strangers (issue #29): response rate limiting per client network,
//! and DNS cookies, which prove a source is not forged and so pass the limit. Clients are
//! told apart by the loopback address their socket is bound to: 127.0.0.x and 127.0.1.x are
//! two /24 networks.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, ResponseCode};
use hickory_proto::rr::RecordType;
use hickory_proto::rr::rdata::opt::{EdnsCode, EdnsOption};
use serde_json::json;

use crate::child::launch_ok;
use crate::common::{self, TestServer, query_message, sample, scrape, tcp_query};

const SRV: &str = "_voice._tcp.service.koder.";

async fn voice(server: &TestServer) {
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
}

/// A query for `name` with EDNS and, if given, a COOKIE option of `cookie`'s bytes.
fn with_cookie(name: &str, rtype: RecordType, cookie: Option<&[u8]>) -> Message {
    let mut message = query_message(name, rtype, Some(1232));
    if let Some(cookie) = cookie {
        let mut edns = message.edns.take().unwrap();
        edns.options_mut().insert(EdnsOption::Unknown(10, cookie.to_vec()));
        message.set_edns(edns);
    }
    message
}

/// The COOKIE option's data in a reply.
fn cookie_of(reply: &Message) -> Option<Vec<u8>> {
    match reply.edns.as_ref()?.option(EdnsCode::Cookie)? {
        EdnsOption::Unknown(10, data) => Some(data.clone()),
        _ => None,
    }
}

/// What came back for each of a burst of queries sent from `from` at once.
#[derive(Debug, Default)]
struct Burst {
    answered: usize,
    /// Empty replies with TC and the question: slipped.
    slipped: usize,
    unanswered: usize,
}

/// Sends `n` copies of `message` (ids 0..n) from a socket bound to `from`, all at once,
/// then collects replies until half a second passes without one.
async fn burst(server: SocketAddr, from: IpAddr, message: &Message, n: u16) -> Burst {
    let socket = tokio::net::UdpSocket::bind((from, 0)).await.unwrap();
    let mut message = message.clone();
    for id in 0..n {
        message.metadata.id = id;
        socket.send_to(&message.to_vec().unwrap(), server).await.unwrap();
    }
    let mut seen = vec![false; n as usize];
    let mut out = Burst::default();
    let mut buf = vec![0u8; 4096];
    while let Ok(Ok(len)) = tokio::time::timeout(Duration::from_millis(500), socket.recv(&mut buf)).await {
        let reply = Message::from_vec(&buf[..len]).expect("a decodable reply");
        let id = reply.metadata.id as usize;
        assert!(id < seen.len() && !seen[id], "an unexpected reply: {reply}");
        seen[id] = true;
        if reply.metadata.truncation {
            assert!(reply.answers.is_empty() && reply.additionals.is_empty(), "{reply}");
            assert_eq!(reply.queries.len(), 1, "a slipped reply keeps the question: {reply}");
            assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
            out.slipped += 1;
        } else {
            assert_eq!(reply.answers.len(), 1, "{reply}");
            out.answered += 1;
        }
    }
    out.unanswered = seen.iter().filter(|s| !**s).count();
    out
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// At 10 responses/s (a burst of 50), 200 queries at once from one /24 get about 50
/// answers; of the rest every second one slips (empty, TC) and the others are dropped;
/// both are counted in the metrics. Another /24, an exempt one, TCP and a query with a
/// valid server cookie from the limited network are all answered.
#[tokio::test]
async fn rrl_limits_one_network_slips_every_second_and_leaves_the_rest_alone() {
    let data = tempfile::tempdir().unwrap();
    let args = [
        "--dns-rrl-rate",
        "10",
        "--dns-rrl-slip",
        "2",
        "--dns-rrl-exempt",
        "127.0.2.0/24",
        "--dns-udp-workers",
        "1",
    ];
    let proc = launch_ok(data.path(), &args).await;
    let client = reqwest::Client::new();
    let status = client
        .post(format!("{}/api/v1/services/register", proc.base()))
        .header("X-API-Key", crate::child::KEY)
        .json(&json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, 200);
    let query = query_message(SRV, RecordType::SRV, Some(1232));

    // A cookie learned before the flood, from the network about to be limited.
    let first = udp_from(
        proc.dns,
        ip("127.0.0.9"),
        &with_cookie(SRV, RecordType::SRV, Some(&[7; 8])),
    )
    .await;
    let full_cookie = cookie_of(&first.expect("answered")).expect("a server cookie");

    let started = Instant::now();
    let limited = burst(proc.dns, ip("127.0.0.5"), &query, 200).await;
    // 50 at once and 10 a second more while the burst lasts (well under a second; a slow
    // machine gets a few more).
    let extra = (started.elapsed().as_secs_f64() * 10.0).ceil() as usize + 1;
    assert!(
        (49..=50 + extra).contains(&limited.answered),
        "{limited:?} in {:?}",
        started.elapsed()
    );
    let over = 200 - limited.answered;
    assert!(
        limited.slipped.abs_diff(over / 2) <= 1,
        "{limited:?}: every second one slips"
    );
    assert_eq!(limited.slipped + limited.unanswered, over, "{limited:?}");

    // Another /24 is untouched, an exempt one is never limited.
    let other = burst(proc.dns, ip("127.0.1.5"), &query, 40).await;
    assert_eq!((other.answered, other.unanswered), (40, 0), "{other:?}");
    let exempt = burst(proc.dns, ip("127.0.2.5"), &query, 200).await;
    assert_eq!((exempt.answered, exempt.unanswered), (200, 0), "{exempt:?}");

    // The limited network still gets everything over TCP, and over UDP with its cookie.
    let tcp = tcp_query(proc.dns, &query).await;
    assert_eq!(tcp.answers.len(), 1, "{tcp}");
    let mut cookie_queries = 0;
    for _ in 0..20 {
        let reply = udp_from(
            proc.dns,
            ip("127.0.0.9"),
            &with_cookie(SRV, RecordType::SRV, Some(&full_cookie)),
        )
        .await;
        let reply = reply.expect("a query with a valid server cookie is answered");
        assert!(!reply.metadata.truncation && reply.answers.len() == 1, "{reply}");
        cookie_queries += 1;
    }
    assert_eq!(cookie_queries, 20);

    let metrics = scrape(&client, &proc.base()).await;
    assert_eq!(
        sample(&metrics, "koder_dns_rrl_dropped_total") as usize,
        limited.unanswered,
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, "koder_dns_rrl_slipped_total") as usize,
        limited.slipped,
        "{metrics}"
    );
}

/// One query from a socket bound to `from`; `None` when nothing comes back within 300 ms.
async fn udp_from(server: SocketAddr, from: IpAddr, message: &Message) -> Option<Message> {
    let socket = tokio::net::UdpSocket::bind((from, 0)).await.unwrap();
    socket.send_to(&message.to_vec().unwrap(), server).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let len = tokio::time::timeout(Duration::from_millis(300), socket.recv(&mut buf))
        .await
        .ok()?
        .unwrap();
    let reply = Message::from_vec(&buf[..len]).unwrap();
    assert_eq!(reply.metadata.id, message.metadata.id);
    Some(reply)
}

/// A client cookie gets itself back with a 16-byte server cookie (version 1); the full
/// cookie sent again gets the same server cookie back, on the prepared path (SRV, asked
/// twice), the full path (the apex's NS), a negative answer and a static zone's answers,
/// over UDP and TCP.
#[tokio::test]
async fn cookies_round_trip_on_every_path() {
    let zones = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("zones");
    let server = common::start_with(|c| c.zones_dir = zones).await;
    voice(&server).await;
    let client = [1, 2, 3, 4, 5, 6, 7, 8];
    for (name, rtype) in [
        (SRV, RecordType::SRV),
        (SRV, RecordType::SRV),
        ("service.koder.", RecordType::NS),
        ("nope.service.koder.", RecordType::A),
        // A static zone, answered by hickory's handler.
        ("www.koder.dev.", RecordType::A),
        ("nope.koder.dev.", RecordType::A),
    ] {
        for tcp in [false, true] {
            let dns = server.dns();
            let exchange = |message: Message| async move {
                match tcp {
                    false => common::udp_query(dns, &message).await,
                    true => tcp_query(dns, &message).await,
                }
            };
            let reply = exchange(with_cookie(name, rtype, Some(&client))).await;
            let cookie = cookie_of(&reply).unwrap_or_else(|| panic!("no cookie: {reply}"));
            assert_eq!(cookie.len(), 24, "{reply}");
            assert_eq!(cookie[..8], client, "the client cookie is echoed");
            assert_eq!(cookie[8..12], [1, 0, 0, 0], "version 1, reserved 0");
            let again = exchange(with_cookie(name, rtype, Some(&cookie))).await;
            assert_eq!(cookie_of(&again), Some(cookie), "{name} {rtype} tcp={tcp}: {again}");
            let none = exchange(with_cookie(name, rtype, None)).await;
            assert_eq!(cookie_of(&none), None, "no cookie without one asked: {none}");
        }
    }
}

/// A COOKIE option of a length RFC 7873 does not allow, or two of them, get FORMERR with
/// an OPT record, on every transport.
#[tokio::test]
async fn malformed_cookies_get_formerr() {
    let server = common::start().await;
    voice(&server).await;
    for len in [0usize, 1, 7, 9, 15, 41, 64] {
        let message = with_cookie(SRV, RecordType::SRV, Some(&vec![9; len]));
        for reply in [
            common::udp_query(server.dns(), &message).await,
            tcp_query(server.dns(), &message).await,
        ] {
            assert_eq!(
                reply.metadata.response_code,
                ResponseCode::FormErr,
                "{len} bytes: {reply}"
            );
            assert!(reply.edns.is_some(), "{reply}");
        }
    }
    for len in [8usize, 16, 40] {
        let reply = common::udp_query(server.dns(), &with_cookie(SRV, RecordType::SRV, Some(&vec![9; len]))).await;
        assert_eq!(
            reply.metadata.response_code,
            ResponseCode::NoError,
            "{len} bytes: {reply}"
        );
    }
    // Two COOKIE options in one query.
    let mut bytes = query_message(SRV, RecordType::SRV, Some(1232)).to_vec().unwrap();
    let opt_at = bytes.len() - 11;
    assert_eq!(bytes[opt_at..opt_at + 3], [0, 0, 41]);
    let option = [0u8, 10, 0, 8, 1, 2, 3, 4, 5, 6, 7, 8];
    bytes.extend_from_slice(&option);
    bytes.extend_from_slice(&option);
    bytes[opt_at + 9..opt_at + 11].copy_from_slice(&24u16.to_be_bytes());
    let reply = common::udp_raw(server.dns(), &bytes, Duration::from_secs(5))
        .await
        .unwrap();
    let reply = Message::from_vec(&reply).unwrap();
    assert_eq!(reply.metadata.response_code, ResponseCode::FormErr, "{reply}");
    assert!(reply.edns.is_some());
}

/// A server with `--dns-cookie-secret-file` holding `secrets`, a rate of one response a
/// second and no slips, so that a limited client gets an answer only with a valid cookie.
async fn node(dir: &std::path::Path, name: &str, secrets: &[&str]) -> TestServer {
    let path = dir.join(name);
    std::fs::write(&path, secrets.join("\n")).unwrap();
    let server = common::start_with(|c| {
        c.dns_cookie_secret_file = Some(path);
        c.dns_rrl_rate = 1;
        c.dns_rrl_slip = 0;
    })
    .await;
    voice(&server).await;
    server
}

/// The server cookie `server` gives a client at `from`.
async fn learn_cookie(server: &TestServer, from: IpAddr) -> Vec<u8> {
    let reply = udp_from(server.dns(), from, &with_cookie(SRV, RecordType::SRV, Some(&[3; 8])))
        .await
        .expect("answered");
    cookie_of(&reply).expect("a server cookie")
}

/// Whether `server` answers `from`, already over the rate, a query carrying `cookie`. The
/// burst that takes `from` over the rate, a query without a cookie (which must go
/// unanswered) and the one with it leave within milliseconds from one socket, so the
/// limit (one response a second) frees nothing in between, however busy the machine.
async fn accepts(server: &TestServer, from: IpAddr, cookie: &[u8]) -> bool {
    const PLAIN: u16 = 100;
    const WITH_COOKIE: u16 = 101;
    let socket = tokio::net::UdpSocket::bind((from, 0)).await.unwrap();
    let mut plain = query_message(SRV, RecordType::SRV, Some(1232));
    for id in (0..20).chain([PLAIN]) {
        plain.metadata.id = id;
        socket.send_to(&plain.to_vec().unwrap(), server.dns()).await.unwrap();
    }
    let mut with = with_cookie(SRV, RecordType::SRV, Some(cookie));
    with.metadata.id = WITH_COOKIE;
    socket.send_to(&with.to_vec().unwrap(), server.dns()).await.unwrap();
    let mut answered = Vec::new();
    let mut buf = vec![0u8; 4096];
    while let Ok(Ok(len)) = tokio::time::timeout(Duration::from_millis(300), socket.recv(&mut buf)).await {
        answered.push(Message::from_vec(&buf[..len]).unwrap().metadata.id);
    }
    assert!(!answered.contains(&PLAIN), "not limited: {answered:?}");
    answered.contains(&WITH_COOKIE)
}

const OLD: &str = "000102030405060708090a0b0c0d0e0f";
const NEW: &str = "f0e0d0c0b0a090807060504030201000";

/// Two nodes with one secret file accept each other's cookies; one with another secret
/// does not. A rollover by reload (SIGHUP's path): a node whose file now holds the new
/// secret and then the old one accepts cookies made with either and makes new ones with
/// the new secret; once the old one is removed and the file reloaded again, its cookies are
/// refused; a broken file changes nothing.
#[tokio::test]
async fn nodes_with_one_secret_accept_each_others_cookies_and_a_reload_rolls_the_secret_over() {
    let dir = tempfile::tempdir().unwrap();
    let a = node(dir.path(), "a", &[OLD]).await;
    let b = node(dir.path(), "b", &[OLD]).await;
    let other = node(dir.path(), "other", &[NEW]).await;

    let from_a = learn_cookie(&a, ip("127.0.3.1")).await;
    assert!(accepts(&b, ip("127.0.3.1"), &from_a).await, "b refused a's cookie");
    assert!(
        !accepts(&other, ip("127.0.3.1"), &from_a).await,
        "another secret accepted it"
    );
    // The cookie is bound to the client's address.
    assert!(
        !accepts(&b, ip("127.0.4.1"), &from_a).await,
        "valid from another address"
    );

    // b rolls over: the new secret first, the old one still accepted.
    std::fs::write(dir.path().join("b"), [NEW, OLD].join("\n")).unwrap();
    b.running.reload().await.unwrap();
    assert!(
        accepts(&b, ip("127.0.3.1"), &from_a).await,
        "the old secret is still accepted"
    );
    let from_b = learn_cookie(&b, ip("127.0.5.1")).await;
    assert!(
        accepts(&other, ip("127.0.5.1"), &from_b).await,
        "made with the new secret"
    );
    assert!(!accepts(&a, ip("127.0.5.1"), &from_b).await, "made with the old secret");

    // A broken file: the reload fails naming it, the secrets in force stay.
    std::fs::write(dir.path().join("b"), "not hex\n").unwrap();
    let message = format!("{:#}", b.running.reload().await.unwrap_err());
    assert!(message.contains("--dns-cookie-secret-file"), "{message}");
    assert!(
        accepts(&b, ip("127.0.3.1"), &from_a).await,
        "the secrets in force changed on a failed reload"
    );

    // The old secret removed: its cookies are refused, the new one's still taken.
    std::fs::write(dir.path().join("b"), NEW).unwrap();
    b.running.reload().await.unwrap();
    assert!(
        !accepts(&b, ip("127.0.3.1"), &from_a).await,
        "a removed secret is still accepted"
    );
    assert!(accepts(&b, ip("127.0.5.1"), &from_b).await);
}
