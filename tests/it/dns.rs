//! DNS integration tests (issue #3): the real server in-process, queried over UDP and TCP
//! with hickory messages and hickory's own client. Each row of docs/interface.md "DNS, for the
//! service zone" has a test here; the end-to-end tests with dig and unbound are in tools.rs.

use crate::common;

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{TestServer, query_message, tcp_query, udp_query, udp_raw};
use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::opt::{EdnsCode, EdnsOption, NSIDPayload};
use hickory_proto::rr::rdata::{SOA, SRV};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};
use koder_dns::model::clock::ManualClock;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const ZONE: &str = "service.koder.";
const VOICE_SRV: &str = "_voice._tcp.service.koder.";

// ---------------------------------------------------------------------------------------
// helpers

#[derive(Clone, Copy, Debug)]
enum Via {
    Udp,
    Tcp,
}

const BOTH: [Via; 2] = [Via::Udp, Via::Tcp];

async fn ask(server: &TestServer, via: Via, name: &str, rtype: RecordType) -> Message {
    let reply = match via {
        Via::Udp => server.query(name, rtype).await,
        Via::Tcp => server.query_tcp(name, rtype).await,
    };
    assert_eq!(
        reply.metadata.message_type,
        MessageType::Response,
        "{via:?} {name} {rtype}: QR must be set"
    );
    reply
}

/// A UDP exchange that also returns the size of the reply on the wire.
async fn udp_sized(addr: SocketAddr, message: &Message) -> (usize, Message) {
    let raw = udp_raw(addr, &message.to_vec().unwrap(), Duration::from_secs(5))
        .await
        .expect("UDP reply");
    let reply = Message::from_vec(&raw).expect("decodable reply");
    assert_eq!(reply.metadata.id, message.metadata.id);
    (raw.len(), reply)
}

fn srvs(m: &Message) -> Vec<SRV> {
    m.answers
        .iter()
        .map(|r| match &r.data {
            RData::SRV(srv) => srv.clone(),
            other => panic!("expected SRV in the answer, got {other:?}"),
        })
        .collect()
}

fn ips(records: &[Record]) -> Vec<IpAddr> {
    records
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(IpAddr::V4(a.0)),
            RData::AAAA(a) => Some(IpAddr::V6(a.0)),
            _ => None,
        })
        .collect()
}

fn txts(m: &Message) -> Vec<Vec<String>> {
    let mut out: Vec<Vec<String>> = m.answers.iter().map(common::txt_strings).collect();
    out.sort();
    out
}

fn name(s: &str) -> Name {
    Name::from_str(s).unwrap()
}

fn addr_name(ip: IpAddr) -> Name {
    let label = match ip {
        IpAddr::V4(v4) => format!("{:08x}", u32::from(v4)),
        IpAddr::V6(v6) => format!("{:032x}", u128::from(v6)),
    };
    name(&format!("{label}.addr.{ZONE}"))
}

/// The single SOA of the authority section.
fn authority_soa(m: &Message) -> SOA {
    assert_eq!(m.authorities.len(), 1, "exactly the SOA in authority: {m}");
    let record = &m.authorities[0];
    assert_eq!(record.name, name(ZONE), "the SOA's owner is the zone apex");
    match &record.data {
        RData::SOA(soa) => soa.clone(),
        other => panic!("expected SOA in authority, got {other:?}"),
    }
}

/// Flags every authoritative answer carries.
fn assert_authoritative(m: &Message) {
    assert!(m.metadata.authoritative, "AA must be set: {m}");
    assert!(!m.metadata.recursion_available, "RA must be clear: {m}");
}

fn assert_positive(m: &Message, what: &str) {
    assert_eq!(m.metadata.response_code, ResponseCode::NoError, "{what}: {m}");
    assert_authoritative(m);
    assert!(!m.answers.is_empty(), "{what}: expected answers: {m}");
    assert!(!m.metadata.truncation, "{what}: unexpected TC: {m}");
}

fn assert_nxdomain(m: &Message, what: &str) -> SOA {
    assert_eq!(m.metadata.response_code, ResponseCode::NXDomain, "{what}: {m}");
    assert_authoritative(m);
    assert!(m.answers.is_empty(), "{what}: NXDOMAIN has no answers: {m}");
    authority_soa(m)
}

fn assert_nodata(m: &Message, what: &str) -> SOA {
    assert_eq!(
        m.metadata.response_code,
        ResponseCode::NoError,
        "{what}: NODATA is NOERROR: {m}"
    );
    assert_authoritative(m);
    assert!(m.answers.is_empty(), "{what}: NODATA has no answers: {m}");
    authority_soa(m)
}

/// The serial, read over DNS.
async fn register_all(server: &TestServer, bodies: Vec<Value>) {
    for body in bodies {
        server.register(body).await;
    }
}

fn manifest_path(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(rel)
}

// ---------------------------------------------------------------------------------------
// SRV

#[tokio::test]
async fn srv_answers_each_instance_with_priority_weight_port_and_addr_target() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060, "priority": 1, "weight": 7}))
        .await;
    server
        .register(json!({"name": "voice", "address": "2001:db8::5", "port": 5061}))
        .await;
    for via in BOTH {
        let reply = ask(&server, via, VOICE_SRV, RecordType::SRV).await;
        assert_positive(&reply, "SRV");
        let mut got: Vec<(u16, u16, u16, Name)> = srvs(&reply)
            .into_iter()
            .map(|s| (s.priority, s.weight, s.port, s.target))
            .collect();
        got.sort();
        let v4 = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
        let v6 = IpAddr::V6(Ipv6Addr::from_str("2001:db8::5").unwrap());
        assert_eq!(
            got,
            vec![
                (1, 7, 5060, name("0a000001.addr.service.koder.")),
                (10, 100, 5061, addr_name(v6))
            ],
            "{via:?}: priority, weight, port and the <hex>.addr target (defaults 10/100)"
        );
        for answer in &reply.answers {
            assert_eq!(answer.name, name(VOICE_SRV));
            assert_eq!(answer.dns_class, DNSClass::IN);
        }
        // The glue: A for the IPv4 target, AAAA for the IPv6 one, under the target names.
        let mut glue: Vec<(Name, IpAddr)> = reply
            .additionals
            .iter()
            .map(|r| (r.name.clone(), ips(std::slice::from_ref(r))[0]))
            .collect();
        glue.sort();
        let mut want = vec![(addr_name(v4), v4), (addr_name(v6), v6)];
        want.sort();
        assert_eq!(glue, want, "{via:?}: additional section carries the targets' addresses");
        assert_eq!(reply.queries.len(), 1);
        assert_eq!(reply.queries[0].query_type(), RecordType::SRV);
    }
}

#[tokio::test]
async fn srv_host_name_target_is_kept_without_glue() {
    let server = common::start().await;
    server
        .register(json!({"name": "sip", "address": "sip1.example.net", "port": 5060}))
        .await;
    server
        .register(json!({"name": "sip", "address": "Sip2.Example.NET.", "port": 5060}))
        .await;
    for via in BOTH {
        let reply = ask(&server, via, "_sip._tcp.service.koder.", RecordType::SRV).await;
        assert_positive(&reply, "SRV host names");
        let mut targets: Vec<String> = srvs(&reply)
            .iter()
            .map(|s| s.target.to_string().to_ascii_lowercase())
            .collect();
        targets.sort();
        assert_eq!(targets, vec!["sip1.example.net.", "sip2.example.net."], "{via:?}");
        assert!(reply.additionals.is_empty(), "{via:?}: no glue for host names: {reply}");
        // No address of its own: A at the service name is NODATA, not an invented address.
        let a = ask(&server, via, "sip.service.koder.", RecordType::A).await;
        assert_nodata(&a, "A of a host-name-only service");
    }
}

/// An SRV target that is a host name in a zone we serve gets its A and AAAA in the
/// additional section, as NSD and Knot add them; one outside every zone gets none.
#[tokio::test]
async fn srv_host_name_target_in_a_served_zone_gets_its_addresses() {
    let server = common::start_with(|c| c.zones_dir = manifest_path("zones")).await;
    server
        .register(json!({"name": "web", "address": "WWW.koder.dev", "port": 443}))
        .await;
    server
        .register(json!({"name": "web", "address": "elsewhere.example.net", "port": 443}))
        .await;
    for via in BOTH {
        let reply = ask(&server, via, "_web._tcp.service.koder.", RecordType::SRV).await;
        assert_positive(&reply, "SRV with an in-zone host");
        assert_eq!(reply.answers.len(), 2, "{via:?}: {reply}");
        let mut glue: Vec<(String, IpAddr)> = reply
            .additionals
            .iter()
            .filter_map(|r| match &r.data {
                RData::A(a) => Some((r.name.to_ascii().to_ascii_lowercase(), IpAddr::V4(a.0))),
                RData::AAAA(a) => Some((r.name.to_ascii().to_ascii_lowercase(), IpAddr::V6(a.0))),
                _ => None,
            })
            .collect();
        glue.sort();
        assert_eq!(
            glue,
            vec![
                ("www.koder.dev.".to_owned(), "192.0.2.10".parse().unwrap()),
                ("www.koder.dev.".to_owned(), "2001:db8::10".parse().unwrap()),
            ],
            "{via:?}: {reply}"
        );
    }
}

/// An SRV target that is a name of the service zone (`api` registered with the address
/// `web.service.koder`) gets that service's addresses in the additional section, and they
/// follow the service: asked again (from the prepared answer) after `web` changes, the glue
/// is `web`'s new set.
#[tokio::test]
async fn srv_target_in_the_service_zone_gets_the_services_addresses() {
    let server = common::start().await;
    server
        .register(json!({"name": "api", "address": "web.service.koder", "port": 8443}))
        .await;
    let glue = |reply: &Message| {
        let mut glue: Vec<String> = reply
            .additionals
            .iter()
            .map(|r| format!("{} {}", r.name.to_ascii().to_ascii_lowercase(), r.data))
            .collect();
        glue.sort();
        glue
    };
    const API: &str = "_api._tcp.service.koder.";
    for via in BOTH {
        let reply = ask(&server, via, API, RecordType::SRV).await;
        assert!(glue(&reply).is_empty(), "web has no instance yet: {reply}");
    }
    server
        .register(json!({"name": "web", "id": "web-4", "address": "10.0.1.1", "port": 443}))
        .await;
    server
        .register(json!({"name": "web", "id": "web-6", "address": "2001:db8::1", "port": 443}))
        .await;
    for via in BOTH {
        for _ in 0..2 {
            let reply = ask(&server, via, API, RecordType::SRV).await;
            assert_eq!(
                glue(&reply),
                ["web.service.koder. 10.0.1.1", "web.service.koder. 2001:db8::1"],
                "{via:?}: {reply}"
            );
        }
    }
    server.deregister("web-4").await;
    for via in BOTH {
        let reply = ask(&server, via, API, RecordType::SRV).await;
        assert_eq!(glue(&reply), ["web.service.koder. 2001:db8::1"], "{via:?}: {reply}");
    }
}

#[tokio::test]
async fn srv_by_protocol() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060, "protocol": "udp"}))
        .await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.2", "port": 5061, "protocol": "TCP"}))
        .await;
    for via in BOTH {
        let udp = ask(&server, via, "_voice._udp.service.koder.", RecordType::SRV).await;
        assert_positive(&udp, "SRV udp");
        assert_eq!(srvs(&udp).iter().map(|s| s.port).collect::<Vec<_>>(), vec![5060]);
        let tcp = ask(&server, via, VOICE_SRV, RecordType::SRV).await;
        assert_positive(&tcp, "SRV tcp");
        assert_eq!(srvs(&tcp).iter().map(|s| s.port).collect::<Vec<_>>(), vec![5061]);
        let sctp = ask(&server, via, "_voice._sctp.service.koder.", RecordType::SRV).await;
        assert_nxdomain(&sctp, "SRV of a protocol with no instance");
    }
}

/// Registration with hickory's own client (UDP and TCP), as the issue asks.
#[tokio::test]
async fn hickory_client_resolves_srv_over_udp_and_tcp() {
    use hickory_server::net::client::{Client, ClientHandle};
    use hickory_server::net::runtime::TokioRuntimeProvider;
    use hickory_server::net::tcp::TcpClientStream;
    use hickory_server::net::udp::UdpClientStream;

    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;

    let conn = UdpClientStream::builder(server.dns(), TokioRuntimeProvider::default()).build();
    let (mut udp_client, bg) = Client::<TokioRuntimeProvider>::from_sender(conn);
    tokio::spawn(bg);
    let (stream, sender) = TcpClientStream::new(
        server.dns(),
        None,
        Some(Duration::from_secs(5)),
        TokioRuntimeProvider::default(),
    );
    let (mut tcp_client, bg) = Client::<TokioRuntimeProvider>::new(stream.await.expect("TCP connect"), sender);
    tokio::spawn(bg);

    for (via, client) in [("udp", &mut udp_client), ("tcp", &mut tcp_client)] {
        let response = client
            .query(name(VOICE_SRV), DNSClass::IN, RecordType::SRV)
            .await
            .expect("SRV response");
        assert_eq!(response.metadata.response_code, ResponseCode::NoError, "{via}");
        assert!(response.metadata.authoritative, "{via}");
        assert_eq!(
            srvs(&response)
                .iter()
                .map(|s| (s.port, s.target.clone()))
                .collect::<Vec<_>>(),
            vec![(5060, name("0a000001.addr.service.koder."))]
        );
        assert_eq!(
            ips(&response.additionals),
            vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))],
            "{via}"
        );

        let response = client
            .query(name("voice.service.koder."), DNSClass::IN, RecordType::A)
            .await
            .expect("A response");
        assert_eq!(
            ips(&response.answers),
            vec![IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1))],
            "{via}"
        );

        match client
            .query(name("_nope._tcp.service.koder."), DNSClass::IN, RecordType::SRV)
            .await
        {
            Ok(response) => assert_eq!(response.metadata.response_code, ResponseCode::NXDomain, "{via}"),
            Err(e) => assert!(
                format!("{e:?}").contains("NXDomain"),
                "{via}: expected NXDOMAIN, got {e:?}"
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------
// A / AAAA / TXT at the service name, the addr names, the apex

#[tokio::test]
async fn a_and_aaaa_are_the_distinct_addresses_of_healthy_live_instances() {
    let server = common::start().await;
    server
        .register(json!({"name": "web", "address": "10.0.0.1", "port": 80}))
        .await;
    server
        .register(json!({"name": "web", "address": "10.0.0.1", "port": 81}))
        .await; // same IP
    server
        .register(json!({"name": "web", "address": "10.0.0.2", "port": 80}))
        .await;
    server
        .register(json!({"name": "web", "address": "2001:db8::1", "port": 80}))
        .await;
    server
        .register(json!({"name": "web", "address": "2001:db8::1", "port": 81}))
        .await;
    server
        .register(json!({"name": "web", "address": "web3.example.net", "port": 80}))
        .await; // no address
    server
        .register(json!({"name": "web", "address": "10.0.0.9", "port": 80, "healthy": false}))
        .await;
    server
        .register(json!({"name": "v6only", "address": "2001:db8::2", "port": 80}))
        .await;
    for via in BOTH {
        let a = ask(&server, via, "web.service.koder.", RecordType::A).await;
        assert_positive(&a, "A");
        let mut got = ips(&a.answers);
        got.sort();
        assert_eq!(
            got,
            vec![IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2])],
            "{via:?}: distinct, healthy only"
        );
        assert!(
            a.answers
                .iter()
                .all(|r| r.record_type() == RecordType::A && r.name == name("web.service.koder."))
        );

        let aaaa = ask(&server, via, "web.service.koder.", RecordType::AAAA).await;
        assert_positive(&aaaa, "AAAA");
        assert_eq!(
            ips(&aaaa.answers),
            vec![IpAddr::from_str("2001:db8::1").unwrap()],
            "{via:?}"
        );

        let a6 = ask(&server, via, "v6only.service.koder.", RecordType::A).await;
        assert_nodata(&a6, "A of an IPv6-only service");
    }
}

#[tokio::test]
async fn txt_at_service_and_srv_names_has_id_then_sorted_metadata() {
    let server = common::start().await;
    server
        .register(
            json!({"name": "voice", "id": "voice-1", "address": "10.0.0.1", "port": 5060,
                         "metadata": {"zone": "eu", "codec": "opus", "b": "2"}}),
        )
        .await;
    server
        .register(json!({"name": "voice", "id": "voice-2", "address": "10.0.0.2", "port": 5060, "protocol": "udp"}))
        .await;
    server
        .register(json!({"name": "voice", "id": "voice-3", "address": "10.0.0.3", "port": 5060, "healthy": false}))
        .await;
    for via in BOTH {
        let all = ask(&server, via, "voice.service.koder.", RecordType::TXT).await;
        assert_positive(&all, "TXT name");
        assert_eq!(
            txts(&all),
            vec![vec!["id=voice-1", "b=2", "codec=opus", "zone=eu"], vec!["id=voice-2"]],
            "{via:?}: one TXT per healthy instance, id first, then metadata sorted by key"
        );
        let tcp = ask(&server, via, VOICE_SRV, RecordType::TXT).await;
        assert_positive(&tcp, "TXT srv name");
        assert_eq!(
            txts(&tcp),
            vec![vec!["id=voice-1", "b=2", "codec=opus", "zone=eu"]],
            "{via:?}: only the tcp ones"
        );
        assert!(tcp.answers.iter().all(|r| r.name == name(VOICE_SRV)));
    }
}

#[tokio::test]
async fn txt_longer_than_255_bytes_is_split_not_cut() {
    let server = common::start().await;
    let long = "x".repeat(500);
    server
        .register(json!({"name": "big", "id": "big-1", "address": "10.0.0.1", "port": 1, "metadata": {"k": long}}))
        .await;
    let reply = server.query_tcp("big.service.koder.", RecordType::TXT).await;
    assert_positive(&reply, "TXT");
    let strings = &txts(&reply)[0];
    assert!(strings.iter().all(|s| s.len() <= 255));
    assert_eq!(strings.concat(), format!("id=big-1k={long}"));
}

#[tokio::test]
async fn addr_names_encode_their_address() {
    let server = common::start().await;
    for via in BOTH {
        let a = ask(&server, via, "0a000001.addr.service.koder.", RecordType::A).await;
        assert_positive(&a, "A addr");
        assert_eq!(ips(&a.answers), vec![IpAddr::from([10, 0, 0, 1])]);
        let a = ask(&server, via, "C0A8FFFE.ADDR.service.koder.", RecordType::A).await;
        assert_eq!(
            ips(&a.answers),
            vec![IpAddr::from([192, 168, 255, 254])],
            "{via:?}: hex is case-insensitive"
        );

        let v6: IpAddr = "2001:db8::abcd".parse().unwrap();
        let aaaa = ask(&server, via, &addr_name(v6).to_string(), RecordType::AAAA).await;
        assert_positive(&aaaa, "AAAA addr");
        assert_eq!(ips(&aaaa.answers), vec![v6]);

        assert_nodata(
            &ask(&server, via, "0a000001.addr.service.koder.", RecordType::AAAA).await,
            "AAAA of a v4 label",
        );
        assert_nodata(
            &ask(&server, via, &addr_name(v6).to_string(), RecordType::A).await,
            "A of a v6 label",
        );
        assert_nodata(
            &ask(&server, via, "0a000001.addr.service.koder.", RecordType::TXT).await,
            "TXT of an addr name",
        );
        assert_nodata(
            &ask(&server, via, "addr.service.koder.", RecordType::A).await,
            "addr. is an empty non-terminal",
        );
        for bad in [
            "0a00001.addr.service.koder.",
            "zz000001.addr.service.koder.",
            "0a000001aa.addr.service.koder.",
            "x.0a000001.addr.service.koder.",
        ] {
            assert_nxdomain(&ask(&server, via, bad, RecordType::A).await, bad);
        }
    }
}

#[tokio::test]
async fn apex_soa_ns_and_the_name_server_address() {
    let server = common::start_with(|c| c.negative_ttl = Duration::from_secs(7)).await;
    for via in BOTH {
        let soa = ask(&server, via, ZONE, RecordType::SOA).await;
        assert_positive(&soa, "SOA");
        assert_eq!(soa.answers.len(), 1);
        let RData::SOA(data) = &soa.answers[0].data else {
            panic!("not a SOA: {soa}")
        };
        assert_eq!(data.mname, name("ns.service.koder."));
        assert_eq!(data.minimum, 7, "SOA minimum = --negative-ttl");
        assert_eq!(data.serial, server.running.registry.serial());

        let ns = ask(&server, via, ZONE, RecordType::NS).await;
        assert_positive(&ns, "NS");
        let targets: Vec<Name> = ns
            .answers
            .iter()
            .map(|r| match &r.data {
                RData::NS(ns) => ns.0.clone(),
                other => panic!("expected NS, got {other:?}"),
            })
            .collect();
        assert_eq!(targets, vec![name("ns.service.koder.")]);
        assert_eq!(
            ips(&ns.additionals),
            vec![IpAddr::from([127, 0, 0, 1])],
            "{via:?}: NS glue"
        );

        let a = ask(&server, via, "ns.service.koder.", RecordType::A).await;
        assert_positive(&a, "A ns");
        assert_eq!(
            ips(&a.answers),
            vec![server.dns().ip()],
            "ns.<domain> is where the server listens"
        );
        assert_nodata(
            &ask(&server, via, "ns.service.koder.", RecordType::AAAA).await,
            "AAAA ns on a v4 listener",
        );
        assert_nodata(&ask(&server, via, ZONE, RecordType::A).await, "A at the apex");
        assert_nodata(&ask(&server, via, ZONE, RecordType::MX).await, "MX at the apex");
    }
}

// ---------------------------------------------------------------------------------------
// Negative answers and error codes

#[tokio::test]
async fn nxdomain_and_nodata_carry_the_soa_with_the_negative_ttl() {
    let server = common::start_with(|c| c.negative_ttl = Duration::from_secs(9)).await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let serial = server.running.registry.serial();
    for via in BOTH {
        for (qname, qtype) in [
            ("_nosuch._tcp.service.koder.", RecordType::SRV),
            ("nosuch.service.koder.", RecordType::A),
            ("nosuch.service.koder.", RecordType::TXT),
            ("_voice._udp.service.koder.", RecordType::SRV),
            ("a.b._voice._tcp.service.koder.", RecordType::SRV),
            ("voice._tcp.service.koder.", RecordType::SRV), // no underscore on the service label
            ("x.ns.service.koder.", RecordType::A),
            ("_udp.service.koder.", RecordType::A), // no udp instance: nothing below it
        ] {
            let what = format!("{via:?} {qtype} {qname}");
            let soa = assert_nxdomain(&ask(&server, via, qname, qtype).await, &what);
            assert_eq!(soa.minimum, 9, "{what}: SOA minimum = negative TTL");
            assert_eq!(soa.serial, serial, "{what}");
        }
        for (qname, qtype) in [
            ("voice.service.koder.", RecordType::MX),
            ("voice.service.koder.", RecordType::AAAA),
            ("voice.service.koder.", RecordType::SRV), // SRV lives at _voice._tcp
            (VOICE_SRV, RecordType::A),
            (VOICE_SRV, RecordType::AAAA),
        ] {
            let what = format!("{via:?} {qtype} {qname}");
            let reply = ask(&server, via, qname, qtype).await;
            let soa = assert_nodata(&reply, &what);
            assert_eq!(soa.minimum, 9, "{what}");
            assert!(
                reply.authorities[0].ttl <= 9,
                "{what}: SOA TTL must not exceed the negative TTL"
            );
        }
    }
}

/// `_tcp.<zone>` is the empty non-terminal above `_voice._tcp.<zone>`: it exists, so it is
/// NOERROR/NODATA (RFC 8020: an NXDOMAIN there denies every name below it, and resolvers
/// minimising query names ask it first). `_voice.<zone>` is not an ancestor of anything.
#[tokio::test]
async fn empty_non_terminals_follow_the_name_tree() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let mut wrong = Vec::new();
    for via in BOTH {
        for (qname, qtype, want) in [
            ("_tcp.service.koder.", RecordType::A, ResponseCode::NoError),
            ("_tcp.service.koder.", RecordType::SRV, ResponseCode::NoError),
            ("_tcp.service.koder.", RecordType::TXT, ResponseCode::NoError),
            ("addr.service.koder.", RecordType::A, ResponseCode::NoError),
            ("_udp.service.koder.", RecordType::A, ResponseCode::NXDomain),
            ("_voice.service.koder.", RecordType::SRV, ResponseCode::NXDomain),
            ("_voice.service.koder.", RecordType::A, ResponseCode::NXDomain),
            // No wildcards here: `*` is a label like any other, and no such name exists.
            ("*.service.koder.", RecordType::A, ResponseCode::NXDomain),
            ("*.service.koder.", RecordType::SOA, ResponseCode::NXDomain),
            ("*._tcp.service.koder.", RecordType::SRV, ResponseCode::NXDomain),
        ] {
            let reply = ask(&server, via, qname, qtype).await;
            assert_authoritative(&reply);
            assert!(reply.answers.is_empty(), "{qname}: {reply}");
            authority_soa(&reply);
            if reply.metadata.response_code != want {
                wrong.push(format!(
                    "{via:?} {qtype} {qname}: got {}, want {want}",
                    reply.metadata.response_code
                ));
            }
        }
    }
    assert!(wrong.is_empty(), "wrong negative answers:\n{}", wrong.join("\n"));
}

#[tokio::test]
async fn refused_outside_every_zone() {
    let server = common::start().await;
    for via in BOTH {
        for qname in [
            "example.com.",
            "koder.",
            ".",
            "xservice.koder.",
            "service.koder.example.",
        ] {
            let reply = ask(&server, via, qname, RecordType::A).await;
            assert_eq!(
                reply.metadata.response_code,
                ResponseCode::Refused,
                "{via:?} {qname}: {reply}"
            );
            assert!(reply.answers.is_empty());
            assert!(!reply.metadata.recursion_available, "RA clear");
        }
    }
}

#[tokio::test]
async fn other_opcodes_get_notimp() {
    let server = common::start().await;
    for op in [
        OpCode::Status,
        OpCode::Notify,
        OpCode::Update,
        OpCode::Unknown(3),
        OpCode::Unknown(15),
    ] {
        let mut message = Message::new(fastrand::u16(..), MessageType::Query, op);
        message.add_query(Query::query(name(ZONE), RecordType::SOA));
        let udp = udp_query(server.dns(), &message).await;
        assert_eq!(udp.metadata.response_code, ResponseCode::NotImp, "UDP {op:?}: {udp}");
        let tcp = tcp_query(server.dns(), &message).await;
        assert_eq!(tcp.metadata.response_code, ResponseCode::NotImp, "TCP {op:?}: {tcp}");
        assert_eq!(tcp.metadata.id, message.metadata.id);
    }
}

#[tokio::test]
async fn several_questions_or_none_get_formerr() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let mut two = query_message(VOICE_SRV, RecordType::SRV, Some(1232));
    two.add_query(Query::query(name("voice.service.koder."), RecordType::A));
    let mut none = Message::new(fastrand::u16(..), MessageType::Query, OpCode::Query);
    none.set_edns(Edns::new());
    for (what, message) in [("two questions", &two), ("no question", &none)] {
        let udp = udp_query(server.dns(), message).await;
        assert_eq!(udp.metadata.response_code, ResponseCode::FormErr, "UDP {what}: {udp}");
        assert!(udp.answers.is_empty());
        let tcp = tcp_query(server.dns(), message).await;
        assert_eq!(tcp.metadata.response_code, ResponseCode::FormErr, "TCP {what}: {tcp}");
    }
}

#[tokio::test]
async fn any_gets_an_rfc8482_minimal_answer() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060, "metadata": {"a": "b"}}))
        .await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.2", "port": 5060}))
        .await;
    for via in BOTH {
        for qname in [
            ZONE,
            "voice.service.koder.",
            VOICE_SRV,
            "0a000001.addr.service.koder.",
            "ns.service.koder.",
        ] {
            let reply = ask(&server, via, qname, RecordType::ANY).await;
            assert_positive(&reply, qname);
            assert_eq!(
                reply.answers.len(),
                1,
                "{via:?} {qname}: one synthesised record: {reply}"
            );
            let RData::HINFO(hinfo) = &reply.answers[0].data else {
                panic!("{qname}: expected HINFO: {reply}")
            };
            assert_eq!(&*hinfo.cpu, b"RFC8482");
            assert_eq!(reply.answers[0].name, name(qname));
        }
        assert_nxdomain(
            &ask(&server, via, "nosuch.service.koder.", RecordType::ANY).await,
            "ANY of an unknown name",
        );
    }
}

#[tokio::test]
async fn flags_are_aa_set_ra_clear_and_rd_echoed() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    for rd in [false, true] {
        for (qname, qtype) in [
            (VOICE_SRV, RecordType::SRV),
            ("nosuch.service.koder.", RecordType::A),
            (ZONE, RecordType::MX),
        ] {
            let mut message = query_message(qname, qtype, Some(1232));
            message.metadata.recursion_desired = rd;
            for reply in [
                udp_query(server.dns(), &message).await,
                tcp_query(server.dns(), &message).await,
            ] {
                assert_authoritative(&reply);
                assert_eq!(reply.metadata.recursion_desired, rd, "RD copied from the query");
                assert_eq!(reply.metadata.op_code, OpCode::Query);
            }
        }
    }
}

#[tokio::test]
async fn names_match_case_insensitively_and_the_question_is_echoed_as_asked() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    for via in BOTH {
        for (qname, qtype) in [
            ("_VoIcE._TcP.SeRvIcE.KoDeR.", RecordType::SRV),
            ("VOICE.Service.Koder.", RecordType::A),
            ("vOiCe.SERVICE.koder.", RecordType::TXT),
            ("0A000001.AdDr.SeRvIcE.KoDeR.", RecordType::A),
            ("SeRvIcE.KoDeR.", RecordType::SOA),
            ("NoSuCh.SeRvIcE.KoDeR.", RecordType::A),
        ] {
            // Built with Name::from_ascii: Name::from_str (and so common::query_message) maps
            // names through IDNA, which lower-cases them before they are sent.
            let mut message = Message::new(fastrand::u16(..), MessageType::Query, OpCode::Query);
            message.add_query(Query::query(Name::from_ascii(qname).unwrap(), qtype));
            message.set_edns(Edns::new());
            assert!(
                String::from_utf8_lossy(&message.to_vec().unwrap()).contains(qname.split('.').nth(1).unwrap()),
                "sent as written"
            );
            let reply = match via {
                Via::Udp => udp_query(server.dns(), &message).await,
                Via::Tcp => tcp_query(server.dns(), &message).await,
            };
            assert_eq!(reply.queries.len(), 1);
            assert_eq!(
                reply.queries[0].name().to_string(),
                qname,
                "{via:?}: question echoed with its letter case"
            );
            if qname.starts_with("NoSuCh") {
                assert_nxdomain(&reply, qname);
            } else {
                assert_positive(&reply, qname);
                for answer in &reply.answers {
                    assert_eq!(
                        answer.name.to_string(),
                        qname,
                        "{via:?}: answers owned by the name as asked (0x20)"
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// TTLs

#[tokio::test]
async fn record_ttl_is_dns_ttl() {
    let server = common::start().await; // --dns-ttl default 5s, lease 90s
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    for via in BOTH {
        let srv = ask(&server, via, VOICE_SRV, RecordType::SRV).await;
        let a = ask(&server, via, "voice.service.koder.", RecordType::A).await;
        let txt = ask(&server, via, "voice.service.koder.", RecordType::TXT).await;
        for record in srv.answers.iter().chain(&a.answers).chain(&txt.answers) {
            assert_eq!(record.ttl, 5, "{via:?}: --dns-ttl on {record}");
        }
        // A `<hex>.addr` address never changes: one TTL, in additional sections and asked.
        let target = addr_name("10.0.0.1".parse().unwrap());
        let direct = ask(&server, via, &target.to_string(), RecordType::A).await;
        assert_eq!(srv.additionals.len(), 1, "{via:?}: {srv}");
        assert_eq!(
            srv.additionals[0].ttl, direct.answers[0].ttl,
            "{via:?}: {srv} vs {direct}"
        );
        assert_eq!(direct.answers[0].ttl, 3600, "{via:?}: {direct}");
    }
}

#[tokio::test]
async fn record_ttl_never_exceeds_the_remaining_lease() {
    let (server, clock) = common::start_manual(|c| {
        c.dns_ttl = Duration::from_secs(60);
        c.reaper_interval = Duration::from_secs(3600);
    })
    .await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060, "ttl_ns": 20_000_000_000i64}))
        .await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.2", "port": 5060, "ttl_ns": 300_000_000_000i64}))
        .await;
    let ttls = |m: &Message| m.answers.iter().map(|r| r.ttl).collect::<Vec<_>>();
    let srv = server.query(VOICE_SRV, RecordType::SRV).await;
    assert_eq!(srv.answers.len(), 2);
    assert!(ttls(&srv).iter().all(|&t| t == 20), "capped by the 20 s lease: {srv}");
    clock.advance(Duration::from_secs(15));
    for via in BOTH {
        let srv = ask(&server, via, VOICE_SRV, RecordType::SRV).await;
        assert!(ttls(&srv).iter().all(|&t| t <= 5), "{via:?}: 5 s of lease left: {srv}");
        let a = ask(&server, via, "voice.service.koder.", RecordType::A).await;
        assert!(ttls(&a).iter().all(|&t| t <= 5), "{via:?}: {a}");
        let txt = ask(&server, via, "voice.service.koder.", RecordType::TXT).await;
        assert!(ttls(&txt).iter().all(|&t| t <= 5), "{via:?}: {txt}");
    }
    clock.advance(Duration::from_millis(4_500));
    let srv = server.query(VOICE_SRV, RecordType::SRV).await;
    assert!(ttls(&srv).iter().all(|&t| t == 0), "under a second left: {srv}");
    clock.advance(Duration::from_secs(1));
    let srv = server.query(VOICE_SRV, RecordType::SRV).await;
    assert_eq!(srv.answers.len(), 1, "the short lease is over: {srv}");
    assert!(
        ttls(&srv).iter().all(|&t| t == 60),
        "--dns-ttl again, the long lease has 280 s: {srv}"
    );
}

#[tokio::test]
async fn never_expiring_instances_get_dns_ttl() {
    let server = common::start_with(|c| {
        c.default_ttl = Duration::ZERO;
        c.dns_ttl = Duration::from_secs(42);
    })
    .await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let srv = server.query(VOICE_SRV, RecordType::SRV).await;
    assert_positive(&srv, "SRV");
    assert!(srv.answers.iter().all(|r| r.ttl == 42), "{srv}");
}

// ---------------------------------------------------------------------------------------
// Life cycle: registration, deregistration, expiry, health, and the serial

#[tokio::test]
async fn registration_then_deregistration_changes_answers_and_serial() {
    let server = common::start().await;
    for via in BOTH {
        assert_nxdomain(
            &ask(&server, via, VOICE_SRV, RecordType::SRV).await,
            "before registration",
        );
    }
    let s0 = server.serial().await;
    server
        .register(json!({"name": "voice", "id": "v1", "address": "10.0.0.1", "port": 5060}))
        .await;
    let s1 = server.serial().await;
    assert!(s1 > s0, "registration grows the serial: {s0} -> {s1}");
    for via in BOTH {
        let reply = ask(&server, via, VOICE_SRV, RecordType::SRV).await;
        assert_eq!(srvs(&reply).len(), 1, "{via:?}: answer appears");
    }
    // A change to an instance that alters answers: a new port.
    server
        .register(json!({"name": "voice", "id": "v1", "address": "10.0.0.1", "port": 5070}))
        .await;
    let s2 = server.serial().await;
    assert!(
        s2 > s1,
        "re-registration with a new port grows the serial: {s1} -> {s2}"
    );
    assert_eq!(srvs(&server.query(VOICE_SRV, RecordType::SRV).await)[0].port, 5070);

    server
        .register(json!({"name": "voice", "id": "v2", "address": "10.0.0.2", "port": 5060}))
        .await;
    let s3 = server.serial().await;
    assert!(s3 > s2);
    server.deregister("v1").await;
    let s4 = server.serial().await;
    assert!(s4 > s3, "deregistration grows the serial: {s3} -> {s4}");
    let reply = server.query(VOICE_SRV, RecordType::SRV).await;
    assert_eq!(
        srvs(&reply).iter().map(|s| s.port).collect::<Vec<_>>(),
        vec![5060],
        "only v2 left"
    );

    server.deregister("v2").await;
    let s5 = server.serial().await;
    assert!(s5 > s4);
    for via in BOTH {
        let soa = assert_nxdomain(
            &ask(&server, via, VOICE_SRV, RecordType::SRV).await,
            "after deregistration",
        );
        assert_eq!(soa.serial, s5, "the negative answer's SOA has the new serial");
        assert_nxdomain(
            &ask(&server, via, "voice.service.koder.", RecordType::A).await,
            "A after deregistration",
        );
        assert_nxdomain(
            &ask(&server, via, "voice.service.koder.", RecordType::TXT).await,
            "TXT after deregistration",
        );
    }
}

#[tokio::test]
async fn unhealthy_instance_is_in_no_answer_but_listed_by_rest() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "id": "sick", "address": "10.0.0.9", "port": 5060, "healthy": false}))
        .await;
    for via in BOTH {
        // A service with no healthy instance has no records at all.
        assert_nxdomain(
            &ask(&server, via, VOICE_SRV, RecordType::SRV).await,
            "SRV of an unhealthy-only service",
        );
        assert_nxdomain(&ask(&server, via, "voice.service.koder.", RecordType::A).await, "A");
        assert_nxdomain(&ask(&server, via, "voice.service.koder.", RecordType::TXT).await, "TXT");
        assert_nxdomain(
            &ask(&server, via, "_tcp.service.koder.", RecordType::A).await,
            "the ENT goes too",
        );
    }
    server
        .register(json!({"name": "voice", "id": "well", "address": "10.0.0.1", "port": 5060}))
        .await;
    for via in BOTH {
        let srv = ask(&server, via, VOICE_SRV, RecordType::SRV).await;
        assert_eq!(
            srvs(&srv).iter().map(|s| s.target.clone()).collect::<Vec<_>>(),
            vec![name("0a000001.addr.service.koder.")]
        );
        assert_eq!(
            ips(&srv.additionals),
            vec![IpAddr::from([10, 0, 0, 1])],
            "no glue for the unhealthy one"
        );
        assert_eq!(
            ips(&ask(&server, via, "voice.service.koder.", RecordType::A).await.answers),
            vec![IpAddr::from([10, 0, 0, 1])]
        );
        assert_eq!(
            txts(&ask(&server, via, "voice.service.koder.", RecordType::TXT).await),
            vec![vec!["id=well"]]
        );
    }
    let (status, body) = server.get("/api/v1/services?detail=1").await;
    assert_eq!(status, 200, "{body}");
    let listed: Vec<(String, bool)> = body["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (i["id"].as_str().unwrap().to_owned(), i["healthy"].as_bool().unwrap()))
        .collect();
    assert_eq!(
        listed,
        vec![("sick".to_owned(), false), ("well".to_owned(), true)],
        "REST lists both with their flag"
    );
}

#[tokio::test]
async fn health_flip_removes_and_restores_answers_and_grows_the_serial() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "id": "v1", "address": "10.0.0.1", "port": 5060}))
        .await;
    server
        .register(json!({"name": "voice", "id": "v2", "address": "10.0.0.2", "port": 5060}))
        .await;
    let registry = &server.running.registry;
    let s0 = server.serial().await;
    assert!(registry.set_health("v1", false));
    let s1 = server.serial().await;
    assert!(s1 > s0, "health flip to false grows the serial: {s0} -> {s1}");
    for via in BOTH {
        let srv = ask(&server, via, VOICE_SRV, RecordType::SRV).await;
        assert_eq!(
            srvs(&srv).iter().map(|s| s.target.clone()).collect::<Vec<_>>(),
            vec![name("0a000002.addr.service.koder.")],
            "{via:?}"
        );
        assert_eq!(ips(&srv.additionals), vec![IpAddr::from([10, 0, 0, 2])]);
    }
    assert!(registry.set_health("v2", false));
    let s2 = server.serial().await;
    assert!(s2 > s1);
    for via in BOTH {
        assert_nxdomain(
            &ask(&server, via, VOICE_SRV, RecordType::SRV).await,
            "every instance unhealthy",
        );
    }
    assert!(registry.set_health("v1", true));
    let s3 = server.serial().await;
    assert!(s3 > s2, "health flip back grows the serial: {s2} -> {s3}");
    let srv = server.query_tcp(VOICE_SRV, RecordType::SRV).await;
    assert_eq!(srvs(&srv).len(), 1);
    // Both still listed by REST, with their flags.
    let (_, body) = server.get("/api/v1/services?detail=1&name=voice").await;
    let flags: Vec<bool> = body["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["healthy"].as_bool().unwrap())
        .collect();
    assert_eq!(flags, vec![true, false]);
}

#[tokio::test]
async fn expired_instance_is_in_no_answer_even_before_the_reaper_runs() {
    let (server, clock) = common::start_manual(|c| {
        c.default_ttl = Duration::from_secs(30);
        c.reaper_interval = Duration::from_secs(3600);
    })
    .await;
    server
        .register(
            json!({"name": "voice", "id": "short", "address": "10.0.0.1", "port": 5060, "ttl_ns": 10_000_000_000i64}),
        )
        .await;
    server
        .register(json!({"name": "voice", "id": "long", "address": "10.0.0.2", "port": 5060}))
        .await;
    assert_eq!(srvs(&server.query(VOICE_SRV, RecordType::SRV).await).len(), 2);
    clock.advance(Duration::from_secs(10)); // exactly at the deadline: dead
    assert_eq!(server.running.registry.len(), 2, "nothing has reaped yet");
    let srv = server.query(VOICE_SRV, RecordType::SRV).await;
    assert_eq!(
        srvs(&srv).iter().map(|s| s.target.clone()).collect::<Vec<_>>(),
        vec![name("0a000002.addr.service.koder.")],
        "{srv}"
    );
    assert_eq!(ips(&srv.additionals), vec![IpAddr::from([10, 0, 0, 2])]);
    for via in BOTH {
        let a = ask(&server, via, "voice.service.koder.", RecordType::A).await;
        assert_eq!(ips(&a.answers), vec![IpAddr::from([10, 0, 0, 2])], "{via:?}");
        assert_eq!(
            txts(&ask(&server, via, "voice.service.koder.", RecordType::TXT).await),
            vec![vec!["id=long"]]
        );
    }
    clock.advance(Duration::from_secs(20));
    // Now every instance is dead, reaped or not.
    for via in BOTH {
        assert_nxdomain(&ask(&server, via, VOICE_SRV, RecordType::SRV).await, "all expired");
        assert_nxdomain(
            &ask(&server, via, "voice.service.koder.", RecordType::A).await,
            "all expired (A)",
        );
    }
}

#[tokio::test]
async fn expiry_with_the_real_clock_removes_the_answer() {
    let server = common::start_with(|c| {
        c.default_ttl = Duration::from_millis(800);
        c.reaper_interval = Duration::from_secs(3600);
    })
    .await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let reply = server.query(VOICE_SRV, RecordType::SRV).await;
    assert_eq!(srvs(&reply).len(), 1);
    assert!(
        reply.answers[0].ttl == 0,
        "TTL capped by a lease under a second: {reply}"
    );
    let before = server.serial().await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    for via in BOTH {
        assert_nxdomain(&ask(&server, via, VOICE_SRV, RecordType::SRV).await, "after expiry");
    }
    // Expiry alters answers, so the serial grows (the reaper is woken by the expired read).
    let deadline = Instant::now() + Duration::from_secs(2);
    while server.serial().await <= before {
        assert!(Instant::now() < deadline, "the serial did not grow after expiry");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Expiry changes the answer at the deadline; the SOA that comes with the first answer
/// that no longer has the instance must already carry a larger serial, otherwise the same
/// serial names two different zone contents.
#[tokio::test]
async fn expiry_grows_the_serial_in_the_first_answer_without_the_instance() {
    let (server, clock) = common::start_manual(|c| c.reaper_interval = Duration::from_secs(3600)).await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060, "ttl_ns": 10_000_000_000i64}))
        .await;
    let before = server.serial().await;
    clock.advance(Duration::from_secs(11));
    let reply = server.query(VOICE_SRV, RecordType::SRV).await;
    let soa = assert_nxdomain(&reply, "expired");
    assert!(
        soa.serial > before,
        "serial {} in the NXDOMAIN after expiry should exceed {before}",
        soa.serial
    );
}

#[tokio::test]
async fn expiry_then_reap_grows_the_serial() {
    let (server, clock) = common::start_manual(|c| c.reaper_interval = Duration::from_secs(3600)).await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060, "ttl_ns": 10_000_000_000i64}))
        .await;
    let before = server.serial().await;
    clock.advance(Duration::from_secs(11));
    server.running.registry.reap();
    let after = server.serial().await;
    assert!(after > before, "{before} -> {after}");
    assert_nxdomain(&server.query(VOICE_SRV, RecordType::SRV).await, "reaped");
    assert_eq!(server.running.registry.len(), 0);
}

// ---------------------------------------------------------------------------------------
// Shuffle

#[tokio::test]
async fn record_order_is_shuffled_per_response() {
    let server = common::start().await;
    register_all(&server, common::instances("pool", 5)).await;
    let mut srv_orders = HashSet::new();
    let mut a_orders = HashSet::new();
    for i in 0..30 {
        let via = if i % 2 == 0 { Via::Udp } else { Via::Tcp };
        let srv = ask(&server, via, "_pool._tcp.service.koder.", RecordType::SRV).await;
        assert_eq!(srv.answers.len(), 5);
        srv_orders.insert(srvs(&srv).iter().map(|s| s.target.to_string()).collect::<Vec<_>>());
        let a = ask(&server, via, "pool.service.koder.", RecordType::A).await;
        assert_eq!(a.answers.len(), 5);
        a_orders.insert(ips(&a.answers));
    }
    assert!(srv_orders.len() > 1, "30 SRV answers all in one order");
    assert!(a_orders.len() > 1, "30 A answers all in one order");
}

// ---------------------------------------------------------------------------------------
// EDNS(0) and truncation

/// What every UDP answer to an SRV or A question must satisfy, truncated or not; returns
/// what is wrong with `reply` (empty when nothing is).
fn udp_answer_problems(
    size: usize,
    reply: &Message,
    limit: usize,
    edns: bool,
    answers: usize,
    glue: usize,
) -> Vec<String> {
    let mut problems = Vec::new();
    let mut check = |ok: bool, problem: String| {
        if !ok {
            problems.push(problem)
        }
    };
    check(size <= limit, format!("{size} bytes over the {limit}-byte buffer"));
    check(
        reply.edns.is_some() == edns,
        format!("OPT present: {}, query had EDNS: {edns}", reply.edns.is_some()),
    );
    if let Some(e) = &reply.edns {
        check(
            e.max_payload() >= 512,
            format!("advertised payload {}", e.max_payload()),
        );
    }
    check(
        reply.metadata.response_code == ResponseCode::NoError,
        format!("rcode {}", reply.metadata.response_code),
    );
    check(
        reply.metadata.authoritative && !reply.metadata.recursion_available,
        "AA clear or RA set".into(),
    );
    check(
        reply.answers.len() <= answers && reply.additionals.len() <= glue,
        "more records than exist".into(),
    );
    if reply.metadata.truncation {
        // RFC 2181 §9 as NSD and Knot apply it: never a partial RRset over UDP.
        check(
            reply.answers.is_empty() && reply.additionals.is_empty(),
            format!(
                "TC with {} answers and {} additionals: a partial set a client may take for the whole",
                reply.answers.len(),
                reply.additionals.len()
            ),
        );
    } else {
        check(
            reply.answers.len() == answers,
            format!("{} of {answers} answers without TC", reply.answers.len()),
        );
        // Glue may be left out without TC, but only for want of room: one more record
        // (at most 66 bytes: an AAAA owned by a 32-digit `<hex>.addr` name) would not fit.
        check(
            reply.additionals.len() == glue || size + 66 > limit,
            format!(
                "{} of {glue} glue records in {size} of {limit} bytes",
                reply.additionals.len()
            ),
        );
    }
    // Any glue present belongs to a target in the answer.
    let targets: HashSet<Name> = reply
        .answers
        .iter()
        .filter_map(|r| {
            if let RData::SRV(s) = &r.data {
                Some(s.target.clone())
            } else {
                None
            }
        })
        .collect();
    for g in &reply.additionals {
        check(
            targets.contains(&g.name),
            format!("glue {} for a target not in the answer", g.name),
        );
    }
    problems
}

fn check_udp_answer(what: &str, size: usize, reply: &Message, limit: usize, edns: bool, answers: usize, glue: usize) {
    let problems = udp_answer_problems(size, reply, limit, edns, answers, glue);
    assert!(
        problems.is_empty(),
        "{what}: {} (got {size} bytes, TC={}, {} answers, {} additionals, OPT={})",
        problems.join("; "),
        reply.metadata.truncation,
        reply.answers.len(),
        reply.additionals.len(),
        reply.edns.is_some()
    );
}

#[tokio::test]
async fn three_hundred_instances_truncate_over_udp_and_come_whole_over_tcp() {
    let server = common::start().await;
    register_all(&server, common::instances("big", 300)).await;
    let qname = "_big._tcp.service.koder.";
    for (qtype, glue) in [(RecordType::SRV, 300), (RecordType::A, 0)] {
        let qn = if qtype == RecordType::SRV {
            qname
        } else {
            "big.service.koder."
        };
        for payload in [None, Some(100), Some(512), Some(1232), Some(4096), Some(65535)] {
            let what = format!("{qtype} bufsize {payload:?}");
            let (size, reply) = udp_sized(server.dns(), &query_message(qn, qtype, payload)).await;
            let limit = payload.map_or(512, |p| p.clamp(512, 1232)) as usize;
            check_udp_answer(&what, size, &reply, limit, payload.is_some(), 300, glue);
            assert!(
                reply.metadata.truncation,
                "{what}: 300 records cannot fit, TC must be set"
            );
            assert!(
                reply.answers.is_empty() && reply.additionals.is_empty(),
                "{what}: TC with an empty answer"
            );
        }
        let tcp = server.query_tcp(qn, qtype).await;
        assert_positive(&tcp, &format!("{qtype} over TCP"));
        assert_eq!(tcp.answers.len(), 300, "TCP returns every record");
        assert_eq!(tcp.additionals.len(), glue, "TCP returns every glue record");
        let distinct: HashSet<String> = tcp.answers.iter().map(|r| r.data.to_string()).collect();
        assert_eq!(distinct.len(), 300);
        if qtype == RecordType::SRV {
            let mut glue_ips = ips(&tcp.additionals);
            glue_ips.sort();
            glue_ips.dedup();
            assert_eq!(glue_ips.len(), 300);
            assert!(tcp.additionals.iter().all(|r| r.record_type() == RecordType::A));
        }
    }
}

/// Growing a service one instance at a time: at every size and buffer, either everything is
/// there or TC is set, OPT is kept, and glue never outlives a cut answer section. IPv4 only,
/// so every SRV and every glue record has the same size and the outcome is deterministic.
#[tokio::test]
async fn nothing_is_trimmed_silently_at_any_size() {
    let server = common::start().await;
    let mut failures = Vec::new();
    for (n, body) in common::instances("grow", 40).into_iter().enumerate() {
        server.register(body).await;
        let n = n + 1;
        for payload in [None, Some(512), Some(700), Some(1232)] {
            let limit = payload.map_or(512, |p| p as usize);
            for (qname, qtype, glue) in [
                ("_grow._tcp.service.koder.", RecordType::SRV, n),
                ("grow.service.koder.", RecordType::A, 0),
            ] {
                let what = format!("{qtype} {qname} with {n} instances, bufsize {payload:?}");
                let (size, reply) = udp_sized(server.dns(), &query_message(qname, qtype, payload)).await;
                let problems = udp_answer_problems(size, &reply, limit, payload.is_some(), n, glue);
                if !problems.is_empty() {
                    failures.push(format!(
                        "{what}: {} (got {size} bytes, TC={}, {} answers, {} additionals, OPT={})",
                        problems.join("; "),
                        reply.metadata.truncation,
                        reply.answers.len(),
                        reply.additionals.len(),
                        reply.edns.is_some()
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} bad UDP answers:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// The same with IPv4 and IPv6 members mixed in random order, so glue sizes differ.
#[tokio::test]
async fn nothing_is_trimmed_silently_with_mixed_glue() {
    let server = common::start().await;
    let mut all = common::instances("mix", 30);
    all.extend((1..=10).map(|i| json!({"name": "mix", "address": format!("2001:db8::{i}"), "port": 9000})));
    fastrand::shuffle(&mut all);
    for (n, body) in all.into_iter().enumerate() {
        server.register(body).await;
        let n = n + 1;
        for payload in [None, Some(512), Some(1232)] {
            let limit = payload.map_or(512, |p| p as usize);
            let what = format!("SRV with {n} instances, bufsize {payload:?}");
            let (size, reply) = udp_sized(
                server.dns(),
                &query_message("_mix._tcp.service.koder.", RecordType::SRV, payload),
            )
            .await;
            check_udp_answer(&what, size, &reply, limit, payload.is_some(), n, n);
        }
    }
}

#[tokio::test]
async fn small_answers_fit_without_tc_and_keep_opt() {
    let server = common::start().await;
    register_all(&server, common::instances("small", 3)).await;
    for payload in [None, Some(512), Some(1232)] {
        let (size, reply) = udp_sized(
            server.dns(),
            &query_message("_small._tcp.service.koder.", RecordType::SRV, payload),
        )
        .await;
        check_udp_answer("small", size, &reply, 512, payload.is_some(), 3, 3);
        assert!(!reply.metadata.truncation);
    }
    // Negative answers too carry OPT when asked with EDNS.
    let (_, reply) = udp_sized(
        server.dns(),
        &query_message("nosuch.service.koder.", RecordType::A, Some(1232)),
    )
    .await;
    assert!(reply.edns.is_some());
    assert_nxdomain(&reply, "nosuch with EDNS");
}

// ---------------------------------------------------------------------------------------
// Static zones

async fn start_with_zones(dir: PathBuf) -> TestServer {
    common::start_with(move |c| c.zones_dir = dir).await
}

#[tokio::test]
async fn the_shipped_example_zone_is_served_authoritatively() {
    let server = start_with_zones(manifest_path("zones")).await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    for via in BOTH {
        let a = ask(&server, via, "www.koder.dev.", RecordType::A).await;
        assert_positive(&a, "A www.koder.dev");
        assert_eq!(ips(&a.answers), vec![IpAddr::from([192, 0, 2, 10])]);
        let aaaa = ask(&server, via, "WWW.Koder.DEV.", RecordType::AAAA).await;
        assert_positive(&aaaa, "AAAA www.koder.dev, mixed case");
        assert_eq!(ips(&aaaa.answers), vec!["2001:db8::10".parse::<IpAddr>().unwrap()]);

        let mx = ask(&server, via, "koder.dev.", RecordType::MX).await;
        assert_positive(&mx, "MX");
        let RData::MX(m) = &mx.answers[0].data else {
            panic!("{mx}")
        };
        assert_eq!((m.preference, m.exchange.clone()), (10, name("mail.koder.dev.")));

        let txt = ask(&server, via, "koder.dev.", RecordType::TXT).await;
        assert_positive(&txt, "TXT");
        assert_eq!(txts(&txt), vec![vec!["v=spf1 mx -all"]]);

        let cname = ask(&server, via, "api.koder.dev.", RecordType::CNAME).await;
        assert_positive(&cname, "CNAME");
        let RData::CNAME(target) = &cname.answers[0].data else {
            panic!("{cname}")
        };
        assert_eq!(target.0, name("www.koder.dev."));
        let chased = ask(&server, via, "api.koder.dev.", RecordType::A).await;
        assert_positive(&chased, "A through the CNAME");
        assert!(
            chased.answers.iter().any(|r| r.record_type() == RecordType::CNAME),
            "{chased}"
        );

        let soa = ask(&server, via, "koder.dev.", RecordType::SOA).await;
        assert_positive(&soa, "SOA koder.dev");
        let RData::SOA(s) = &soa.answers[0].data else {
            panic!("{soa}")
        };
        assert_eq!(s.serial, 2026120201);
        let ns = ask(&server, via, "koder.dev.", RecordType::NS).await;
        assert_positive(&ns, "NS koder.dev");

        let nx = ask(&server, via, "nosuch.koder.dev.", RecordType::A).await;
        assert_eq!(nx.metadata.response_code, ResponseCode::NXDomain, "{nx}");
        assert!(nx.metadata.authoritative, "{nx}");
        assert!(
            nx.authorities.iter().any(|r| r.record_type() == RecordType::SOA),
            "SOA in authority: {nx}"
        );
        let nodata = ask(&server, via, "www.koder.dev.", RecordType::MX).await;
        assert_eq!(nodata.metadata.response_code, ResponseCode::NoError, "{nodata}");
        assert!(nodata.answers.is_empty());
        assert!(
            nodata.authorities.iter().any(|r| r.record_type() == RecordType::SOA),
            "SOA in authority: {nodata}"
        );

        // The service zone still works beside it, and outside both is still REFUSED.
        assert_positive(
            &ask(&server, via, VOICE_SRV, RecordType::SRV).await,
            "service zone beside static ones",
        );
        assert_eq!(
            ask(&server, via, "example.com.", RecordType::A)
                .await
                .metadata
                .response_code,
            ResponseCode::Refused
        );
    }
}

#[tokio::test]
async fn every_zone_file_is_its_own_zone() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(manifest_path("zones/koder.dev.zone"), dir.path().join("koder.dev.zone")).unwrap();
    std::fs::copy(
        manifest_path("tests/data/zones-ok/example.test.zone"),
        dir.path().join("example.test.zone"),
    )
    .unwrap();
    std::fs::write(dir.path().join("README.txt"), "not a zone file, ignored").unwrap();
    let server = start_with_zones(dir.path().to_path_buf()).await;
    for via in BOTH {
        assert_eq!(
            ips(&ask(&server, via, "host.example.test.", RecordType::A).await.answers),
            vec![IpAddr::from([198, 51, 100, 1])]
        );
        assert_eq!(
            ips(&ask(&server, via, "www.koder.dev.", RecordType::A).await.answers),
            vec![IpAddr::from([192, 0, 2, 10])]
        );
        let soa = ask(&server, via, "nosuch.example.test.", RecordType::A).await;
        assert_eq!(soa.metadata.response_code, ResponseCode::NXDomain);
        let RData::SOA(s) = &soa.authorities[0].data else {
            panic!("{soa}")
        };
        assert_eq!(s.serial, 7, "the NXDOMAIN carries its own zone's SOA");
    }
}

pub(crate) async fn start_error(zones_dir: PathBuf) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut config = common::test_config(dir.path());
    config.zones_dir = zones_dir;
    match koder_dns::server::start_with_clock(
        config,
        Arc::new(ManualClock::new(koder_dns::model::clock::MANUAL_START)),
    )
    .await
    {
        Ok(_) => panic!("a broken zone file must stop the start"),
        Err(e) => format!("{e:#}"),
    }
}

fn mentions_line(message: &str, line: u32) -> bool {
    let m = message.to_ascii_lowercase();
    [
        format!("line {line}"),
        format!("line: {line}"),
        format!("line={line}"),
        format!(":{line}:"),
        format!(":{line} "),
    ]
    .iter()
    .any(|p| m.contains(p))
        || m.ends_with(&format!(":{line}"))
}

#[tokio::test]
async fn a_broken_zone_file_is_refused_at_start_with_file_and_line() {
    let mut wrong = Vec::new();
    for (dir, file, line) in [
        ("tests/data/zones-broken", "broken.test.zone", 6),
        ("tests/data/zones-broken-rdata", "syntax.test.zone", 5),
    ] {
        let message = start_error(manifest_path(dir)).await;
        assert!(message.contains(file), "the error names the file {file}: {message}");
        if !mentions_line(&message, line) {
            wrong.push(format!("no line {line} for {file} in: {message}"));
        }
    }
    assert!(wrong.is_empty(), "the error must name the line:\n{}", wrong.join("\n"));
}

#[tokio::test]
async fn a_zone_file_without_soa_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("nosoa.test.zone"),
        "$TTL 60\n@ IN NS ns.nosoa.test.\nns IN A 192.0.2.1\n",
    )
    .unwrap();
    let message = start_error(dir.path().to_path_buf()).await;
    assert!(message.contains("nosoa.test.zone"), "{message}");
}

// ---------------------------------------------------------------------------------------
// Robustness: malformed packets, stalled TCP clients, idle timeouts

async fn assert_still_answers(server: &TestServer, what: &str) {
    let reply = tokio::time::timeout(Duration::from_secs(2), server.query(VOICE_SRV, RecordType::SRV))
        .await
        .unwrap_or_else(|_| panic!("after {what}: no answer within 2 s"));
    assert_eq!(srvs(&reply).len(), 1, "after {what}");
}

fn header(id: u16, flags: u16, qd: u16, an: u16, ns: u16, ar: u16) -> Vec<u8> {
    [id, flags, qd, an, ns, ar]
        .iter()
        .flat_map(|v| v.to_be_bytes())
        .collect()
}

#[tokio::test]
async fn malformed_packets_never_crash_the_server() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let good = query_message(VOICE_SRV, RecordType::SRV, None).to_vec().unwrap();
    let question = good[12..].to_vec();
    let mut cases: Vec<(String, Vec<u8>)> = vec![
        ("empty".into(), vec![]),
        ("one byte".into(), vec![0x42]),
        (
            "truncated header".into(),
            header(0x1234, 0x0100, 1, 0, 0, 0)[..7].to_vec(),
        ),
        ("header only, qdcount 1".into(), header(0x1234, 0x0100, 1, 0, 0, 0)),
        ("header, qdcount 65535".into(), header(0x1235, 0x0100, 65535, 0, 0, 0)),
        (
            "question, bogus counts".into(),
            [header(0x1236, 0x0100, 1, 65535, 65535, 65535), question.clone()].concat(),
        ),
        (
            "question cut in the middle".into(),
            [header(0x1237, 0x0100, 1, 0, 0, 0), question[..9].to_vec()].concat(),
        ),
        (
            "question without type/class".into(),
            [
                header(0x1238, 0x0100, 1, 0, 0, 0),
                question[..question.len() - 4].to_vec(),
            ]
            .concat(),
        ),
        (
            "label longer than the packet".into(),
            [header(0x1239, 0x0100, 1, 0, 0, 0), vec![63, b'a', b'b']].concat(),
        ),
        (
            "compression pointer loop".into(),
            [header(0x123a, 0x0100, 1, 0, 0, 0), vec![0xc0, 12, 0, 1, 0, 1]].concat(),
        ),
        // Found by the fuzzer: a name that ends in a pointer into the header (which reads
        // as a label there) used to be echoed as sent, pointing into the reply's header.
        (
            "question pointing into the header".into(),
            [
                header(0x0005, 0x0100, 1, 0, 0, 0),
                b"\x08\x07service\xc0\x02\x00\x00\x01\x00\x01".to_vec(),
            ]
            .concat(),
        ),
        (
            "forward pointer".into(),
            [header(0x123b, 0x0100, 1, 0, 0, 0), vec![0xc0, 0xff, 0, 1, 0, 1]].concat(),
        ),
        (
            "bad label type".into(),
            [header(0x123c, 0x0100, 1, 0, 0, 0), vec![0x80, 1, 2, 0, 0, 1, 0, 1]].concat(),
        ),
        (
            "bogus OPT".into(),
            [
                header(0x123d, 0x0100, 1, 0, 0, 1),
                question.clone(),
                vec![0, 0, 41, 2, 0, 0, 0, 0, 0, 0, 50, 1],
            ]
            .concat(),
        ),
        (
            "trailing garbage".into(),
            [good.clone(), vec![0xde, 0xad, 0xbe, 0xef]].concat(),
        ),
        ("oversized".into(), [good.clone(), vec![0xaa; 4000]].concat()),
    ];
    let mut rng = fastrand::Rng::with_seed(3);
    for i in 0..60 {
        let len = rng.usize(0..600);
        cases.push((
            format!("random {i}"),
            std::iter::repeat_with(|| rng.u8(..)).take(len).collect(),
        ));
    }
    for i in 0..40 {
        // Valid header and question, then one flipped byte.
        let mut bytes = good.clone();
        let at = rng.usize(2..bytes.len());
        bytes[at] ^= rng.u8(1..);
        cases.push((format!("flipped byte {i} at {at}"), bytes));
    }
    for (what, bytes) in &cases {
        if let Some(reply) = udp_raw(server.dns(), bytes, Duration::from_millis(300)).await {
            assert!(reply.len() >= 12, "{what}: a reply shorter than a header");
            assert!(reply[2] & 0x80 != 0, "{what}: a reply must have QR set");
            if bytes.len() >= 2 {
                assert_eq!(reply[..2], bytes[..2], "{what}: reply id");
            }
            let rcode = reply[3] & 0x0f;
            // FORMERR for what cannot be parsed; a flipped byte may still leave a parsable
            // query (another name, type, opcode...), which gets a normal answer code.
            assert!(
                what.starts_with("flipped")
                    || what.starts_with("random")
                    || what == "trailing garbage"
                    || what == "oversized"
                    || rcode == 1,
                "{what}: expected FORMERR, got rcode {rcode}"
            );
        }
        assert_still_answers(&server, what).await;
    }
    // Over TCP too: garbage behind a valid length prefix, then a normal query on a new connection.
    for (what, bytes) in cases.iter().filter(|(_, b)| !b.is_empty() && b.len() < 65535).take(20) {
        let mut stream = tokio::net::TcpStream::connect(server.dns()).await.unwrap();
        stream.write_all(&(bytes.len() as u16).to_be_bytes()).await.unwrap();
        stream.write_all(bytes).await.unwrap();
        let mut buf = [0u8; 2];
        let _ = tokio::time::timeout(Duration::from_millis(300), stream.read(&mut buf)).await;
        drop(stream);
        let reply = tokio::time::timeout(Duration::from_secs(2), server.query_tcp(VOICE_SRV, RecordType::SRV))
            .await
            .unwrap_or_else(|_| panic!("TCP after {what}: no answer"));
        assert_eq!(srvs(&reply).len(), 1, "TCP after {what}");
    }
}

#[tokio::test]
async fn a_response_packet_is_not_answered() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let mut message = query_message(VOICE_SRV, RecordType::SRV, None);
    message.metadata.message_type = MessageType::Response;
    let reply = udp_raw(server.dns(), &message.to_vec().unwrap(), Duration::from_millis(500)).await;
    assert!(
        reply.is_none(),
        "answering a response invites reflection loops: {reply:?}"
    );
    assert_still_answers(&server, "a QR=1 packet").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_tcp_clients_do_not_stall_others() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let mut stalled = Vec::new();
    for i in 0..20 {
        let mut stream = tokio::net::TcpStream::connect(server.dns()).await.unwrap();
        match i % 4 {
            0 => {}                                                          // says nothing
            1 => stream.write_all(&[0x00]).await.unwrap(),                   // half a length prefix
            2 => stream.write_all(&[0x01, 0x00, 0xab, 0xcd]).await.unwrap(), // 256 announced, 2 sent
            _ => stream.write_all(&[0xff, 0xff]).await.unwrap(),             // 65535 announced, none sent
        }
        stalled.push(stream);
    }
    let started = Instant::now();
    for _ in 0..10 {
        assert_still_answers(&server, "stalled TCP clients (UDP)").await;
        let reply = tokio::time::timeout(Duration::from_secs(2), server.query_tcp(VOICE_SRV, RecordType::SRV))
            .await
            .expect("a TCP query beside stalled connections");
        assert_eq!(srvs(&reply).len(), 1);
    }
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "queries were slowed by stalled clients: {:?}",
        started.elapsed()
    );
    drop(stalled);
}

#[tokio::test]
async fn several_queries_on_one_tcp_connection() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let mut stream = tokio::net::TcpStream::connect(server.dns()).await.unwrap();
    let messages: Vec<Message> = (0..5)
        .map(|_| query_message(VOICE_SRV, RecordType::SRV, Some(1232)))
        .collect();
    // Pipelined: all written before any reply is read.
    for m in &messages {
        let bytes = m.to_vec().unwrap();
        stream.write_all(&(bytes.len() as u16).to_be_bytes()).await.unwrap();
        stream.write_all(&bytes).await.unwrap();
    }
    let mut ids = HashSet::new();
    for _ in &messages {
        let reply = read_framed(&mut stream).await;
        assert_eq!(srvs(&reply).len(), 1);
        ids.insert(reply.metadata.id);
    }
    assert_eq!(ids, messages.iter().map(|m| m.metadata.id).collect());
}

/// The next reply on a DNS TCP connection, which must come within 2 s.
async fn read_framed(stream: &mut tokio::net::TcpStream) -> Message {
    let mut len = [0u8; 2];
    tokio::time::timeout(Duration::from_secs(2), stream.read_exact(&mut len))
        .await
        .expect("a reply in time")
        .unwrap();
    let mut reply = vec![0u8; u16::from_be_bytes(len) as usize];
    stream.read_exact(&mut reply).await.unwrap();
    Message::from_vec(&reply).unwrap()
}

/// A client that pipelines (RFC 7766 §6.2.1.1) gets every reply, in order, though they are
/// read and written in batches; and no reply waits for a query that has only partly arrived.
#[tokio::test]
async fn pipelined_tcp_queries_are_answered_in_order_and_none_waits_for_the_next() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let mut stream = tokio::net::TcpStream::connect(server.dns()).await.unwrap();
    let framed = |id: u16| {
        let (name, rtype) = match id % 3 {
            0 => (VOICE_SRV, RecordType::SRV),
            1 => ("voice.service.koder.", RecordType::A),
            _ => ("nosuch.service.koder.", RecordType::A),
        };
        let mut message = query_message(name, rtype, id.is_multiple_of(2).then_some(1232));
        message.metadata.id = id;
        let bytes = message.to_vec().unwrap();
        [&(bytes.len() as u16).to_be_bytes()[..], &bytes].concat()
    };
    // 300 queries in one write (more than the server reads at once), then 3 bytes of one more.
    let mut burst: Vec<u8> = (0..300).flat_map(framed).collect();
    let last = framed(300);
    burst.extend_from_slice(&last[..3]);
    stream.write_all(&burst).await.unwrap();
    for id in 0..300u16 {
        let reply = read_framed(&mut stream).await;
        assert_eq!(reply.metadata.id, id, "replies in the order of the queries");
        match id % 3 {
            0 => assert_eq!(srvs(&reply).len(), 1, "query {id}"),
            1 => assert_eq!(reply.answers.len(), 1, "query {id}"),
            _ => assert_eq!(reply.metadata.response_code, ResponseCode::NXDomain, "query {id}"),
        }
        assert_eq!(reply.edns.is_some(), id.is_multiple_of(2), "query {id}: OPT as asked");
    }
    stream.write_all(&last[3..]).await.unwrap();
    assert_eq!(read_framed(&mut stream).await.metadata.id, 300);
}

/// A frame too short to be a message ends the connection, but not before the replies to the
/// queries that came before it in the same segment.
#[tokio::test]
async fn replies_answered_before_a_bad_frame_still_go_out() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    for tail in [&[0u8, 0][..], &[0, 1, 0xab]] {
        let mut stream = tokio::net::TcpStream::connect(server.dns()).await.unwrap();
        let bytes = query_message(VOICE_SRV, RecordType::SRV, None).to_vec().unwrap();
        let segment = [&(bytes.len() as u16).to_be_bytes()[..], &bytes, tail].concat();
        stream.write_all(&segment).await.unwrap();
        assert_eq!(srvs(&read_framed(&mut stream).await).len(), 1, "after {tail:?}");
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut rest)).await;
        assert!(matches!(closed, Ok(Ok(0))), "closed after {tail:?}: {closed:?}");
    }
}

#[tokio::test]
async fn idle_tcp_connections_are_closed() {
    let server = common::start_with(|c| c.dns_tcp_idle_timeout = Duration::from_millis(500)).await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    // A connection that never sends anything.
    let mut silent = tokio::net::TcpStream::connect(server.dns()).await.unwrap();
    // A connection that asks once and then goes quiet.
    let mut once = tokio::net::TcpStream::connect(server.dns()).await.unwrap();
    let bytes = query_message(VOICE_SRV, RecordType::SRV, None).to_vec().unwrap();
    once.write_all(&(bytes.len() as u16).to_be_bytes()).await.unwrap();
    once.write_all(&bytes).await.unwrap();
    let mut len = [0u8; 2];
    once.read_exact(&mut len).await.unwrap();
    let mut reply = vec![0u8; u16::from_be_bytes(len) as usize];
    once.read_exact(&mut reply).await.unwrap();
    let started = Instant::now();
    for (what, stream) in [("silent", &mut silent), ("after one query", &mut once)] {
        let mut buf = [0u8; 16];
        match tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {}
            Ok(Ok(n)) => panic!("{what}: unexpected {n} bytes on an idle connection"),
            Err(_) => panic!("{what}: idle TCP connection still open after {:?}", started.elapsed()),
        }
    }
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_still_answers(&server, "idle timeouts").await;
}

// ---------------------------------------------------------------------------------------
// The wire as NSD and Knot answer it (issue #12)

/// A query for `name`/`rtype` in `class`, with EDNS (payload 1232) and the DO bit as given.
fn query_in(name: &str, rtype: RecordType, class: DNSClass, dnssec_ok: Option<bool>) -> Message {
    let mut message = Message::new(fastrand::u16(..), MessageType::Query, OpCode::Query);
    let mut query = Query::query(Name::from_str(name).unwrap(), rtype);
    query.set_query_class(class);
    message.add_query(query);
    if let Some(dnssec_ok) = dnssec_ok {
        let mut edns = Edns::new();
        edns.set_max_payload(1232).set_dnssec_ok(dnssec_ok);
        message.set_edns(edns);
    }
    message
}

async fn exchange(server: &TestServer, via: Via, message: &Message) -> Message {
    match via {
        Via::Udp => udp_query(server.dns(), message).await,
        Via::Tcp => tcp_query(server.dns(), message).await,
    }
}

/// RFC 3225 §3: the DO bit of the query comes back on every path: answers (asked twice, so
/// the second comes from the prepared bytes), NODATA, NXDOMAIN, REFUSED.
#[tokio::test]
async fn do_bit_is_copied_into_every_response() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let cases = [
        (VOICE_SRV, RecordType::SRV, ResponseCode::NoError),
        (VOICE_SRV, RecordType::SRV, ResponseCode::NoError),
        ("voice.service.koder.", RecordType::A, ResponseCode::NoError),
        ("voice.service.koder.", RecordType::MX, ResponseCode::NoError),
        ("nope.service.koder.", RecordType::A, ResponseCode::NXDomain),
        ("example.org.", RecordType::A, ResponseCode::Refused),
    ];
    for via in BOTH {
        for dnssec_ok in [true, false] {
            for (name, rtype, code) in cases {
                let reply = exchange(&server, via, &query_in(name, rtype, DNSClass::IN, Some(dnssec_ok))).await;
                assert_eq!(reply.metadata.response_code, code, "{via:?} {name} {rtype}: {reply}");
                let edns = reply.edns.as_ref().expect("OPT in the reply");
                assert_eq!(edns.flags().dnssec_ok, dnssec_ok, "{via:?} {name} {rtype} DO: {reply}");
            }
        }
    }
}

/// RFC 2181 §9: glue that does not fit is left out without TC; when the answer section does
/// not fit, TC and nothing else (HAProxy took partial sets as whole backends and flapped).
#[tokio::test]
async fn tc_only_when_the_answer_does_not_fit_and_then_an_empty_answer() {
    let server = common::start().await;
    register_all(&server, common::instances("mid", 20)).await;
    register_all(&server, common::instances("big", 60)).await;
    for round in 0..2 {
        // 20 SRV (47 bytes each: SRV targets are not compressed) fit 1232 bytes, their 20
        // addresses (30 bytes each) do not all.
        let (size, mid) = udp_sized(
            server.dns(),
            &query_message("_mid._tcp.service.koder.", RecordType::SRV, Some(1232)),
        )
        .await;
        assert!(!mid.metadata.truncation, "round {round}: only glue left out: {mid}");
        assert_eq!(mid.answers.len(), 20, "round {round}: the whole RRset");
        assert!(mid.additionals.len() < 20, "round {round}: some glue left out");
        assert!(size <= 1232, "round {round}: {size} bytes");
        // 60 SRV do not fit: TC, no answers, no glue, the question and OPT kept.
        let (size, big) = udp_sized(
            server.dns(),
            &query_message("_big._tcp.service.koder.", RecordType::SRV, Some(1232)),
        )
        .await;
        assert!(big.metadata.truncation, "round {round}: {big}");
        assert!(
            big.answers.is_empty() && big.additionals.is_empty(),
            "round {round}: {big}"
        );
        assert_eq!(big.queries.len(), 1);
        assert!(big.edns.is_some());
        assert!(
            size < 100,
            "round {round}: an empty TC reply is small, got {size} bytes"
        );
        let tcp = server.query_tcp("_big._tcp.service.koder.", RecordType::SRV).await;
        assert_eq!((tcp.answers.len(), tcp.additionals.len()), (60, 60), "TCP has it all");
    }
}

/// Flag Day 2020: whatever buffer the client advertises, a UDP reply is at most
/// `--dns-udp-max-payload` (default 1232) and our OPT advertises that value.
#[tokio::test]
async fn udp_replies_are_capped_by_dns_udp_max_payload() {
    for (setting, expected) in [(None, 1232u16), (Some(4096u16), 4096), (Some(512), 512)] {
        let server = common::start_with(|c| {
            if let Some(bytes) = setting {
                c.dns_udp_max_payload = bytes;
            }
        })
        .await;
        register_all(&server, common::instances("big", 50)).await;
        // 50 SRV and their glue are about 3.9 KB: they fit 4096, not 1232.
        let (size, reply) = udp_sized(
            server.dns(),
            &query_message("_big._tcp.service.koder.", RecordType::SRV, Some(4096)),
        )
        .await;
        assert!(size <= expected as usize, "{setting:?}: {size} bytes");
        assert_eq!(
            reply.edns.as_ref().unwrap().max_payload(),
            expected,
            "{setting:?}: {reply}"
        );
        assert_eq!(reply.metadata.truncation, expected < 4096, "{setting:?}: {reply}");
        if expected == 4096 {
            assert_eq!((reply.answers.len(), reply.additionals.len()), (50, 50));
        }
        let negative = server.query("nope.service.koder.", RecordType::A).await;
        assert_eq!(negative.edns.as_ref().unwrap().max_payload(), expected, "{negative}");
    }
}

/// AA only on answers from a zone we serve: REFUSED (another class, AXFR over UDP, a name
/// outside), NOTIMP and FORMERR carry it clear.
#[tokio::test]
async fn aa_is_clear_on_refused_notimp_and_formerr() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let mut notify = Message::new(fastrand::u16(..), MessageType::Query, OpCode::Notify);
    notify.add_query(Query::query(name(ZONE), RecordType::SOA));
    let mut two = query_message(VOICE_SRV, RecordType::SRV, Some(1232));
    two.add_query(Query::query(name(VOICE_SRV), RecordType::TXT));
    let cases = [
        (
            query_in(VOICE_SRV, RecordType::SRV, DNSClass::CH, Some(false)),
            ResponseCode::Refused,
        ),
        (
            query_in(VOICE_SRV, RecordType::SRV, DNSClass::HS, None),
            ResponseCode::Refused,
        ),
        (query_message(ZONE, RecordType::AXFR, None), ResponseCode::Refused),
        (
            query_message("example.org.", RecordType::A, None),
            ResponseCode::Refused,
        ),
        (notify, ResponseCode::NotImp),
        (two, ResponseCode::FormErr),
    ];
    for (message, code) in &cases {
        let reply = udp_query(server.dns(), message).await;
        assert_eq!(reply.metadata.response_code, *code, "{message}: {reply}");
        assert!(!reply.metadata.authoritative, "AA on {code}: {reply}");
    }
    let answer = server.query(VOICE_SRV, RecordType::SRV).await;
    assert!(answer.metadata.authoritative, "AA on an answer: {answer}");
}

/// Junk shorter than a DNS header gets no reply (no 12-byte FORMERR to reflect at a
/// spoofed source), and the server goes on answering.
#[tokio::test]
async fn datagrams_shorter_than_a_header_get_no_reply() {
    let server = common::start().await;
    for len in 0..12 {
        let junk: Vec<u8> = (0..len).map(|_| fastrand::u8(..)).collect();
        let reply = udp_raw(server.dns(), &junk, Duration::from_millis(200)).await;
        assert_eq!(reply, None, "{len}-byte datagram answered");
    }
    // A whole header with no question is a malformed query: FORMERR, as before.
    let mut header = vec![0u8; 12];
    header[0] = 0x12;
    let reply = udp_raw(server.dns(), &header, Duration::from_secs(5))
        .await
        .expect("a reply to a 12-byte header");
    assert_eq!(Message::from_vec(&reply).unwrap().metadata.id, 0x1200);
    let soa = server.query(ZONE, RecordType::SOA).await;
    assert_eq!(soa.answers.len(), 1);
}

/// QCLASS ANY is answered as IN, with AA and the SOA in negative answers as Knot and BIND
/// answer it, the question echoed as asked; asked twice, so the second comes from the
/// prepared bytes.
#[tokio::test]
async fn qclass_any_is_answered_as_in() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    for via in BOTH {
        for (qname, rtype, code, answers) in [
            (VOICE_SRV, RecordType::SRV, ResponseCode::NoError, 1),
            (VOICE_SRV, RecordType::SRV, ResponseCode::NoError, 1),
            ("voice.service.koder.", RecordType::A, ResponseCode::NoError, 1),
            ("voice.service.koder.", RecordType::MX, ResponseCode::NoError, 0),
            ("nope.service.koder.", RecordType::A, ResponseCode::NXDomain, 0),
            (ZONE, RecordType::ANY, ResponseCode::NoError, 1),
            (ZONE, RecordType::SOA, ResponseCode::NoError, 1),
        ] {
            let reply = exchange(&server, via, &query_in(qname, rtype, DNSClass::ANY, Some(false))).await;
            assert_eq!(reply.metadata.response_code, code, "{via:?} {qname}: {reply}");
            assert!(reply.metadata.authoritative, "{via:?} {qname}: {reply}");
            assert_eq!(reply.answers.len(), answers, "{via:?} {qname}: {reply}");
            assert_eq!(
                reply.authorities.len(),
                usize::from(answers == 0),
                "SOA when negative: {reply}"
            );
            assert_eq!(reply.queries[0].query_class(), DNSClass::ANY, "echoed as asked");
            assert!(reply.answers.iter().all(|r| r.dns_class == DNSClass::IN), "{reply}");
        }
    }
}

/// `CH TXT id.server.` / `hostname.bind.` and NSID tell which node answered.
#[tokio::test]
async fn identity_answers_ch_txt_and_nsid() {
    let server = common::start_with(|c| c.dns_identity = "node-7.example".into()).await;
    for via in BOTH {
        for qname in ["id.server.", "HOSTNAME.bind."] {
            let reply = exchange(
                &server,
                via,
                &query_in(qname, RecordType::TXT, DNSClass::CH, Some(false)),
            )
            .await;
            assert_eq!(reply.metadata.response_code, ResponseCode::NoError, "{reply}");
            assert_eq!(reply.answers.len(), 1, "{via:?} {qname}: {reply}");
            assert_eq!(reply.answers[0].dns_class, DNSClass::CH);
            assert_eq!(txts(&reply), vec![vec!["node-7.example".to_string()]], "{reply}");
        }
        let other = exchange(
            &server,
            via,
            &query_in("other.server.", RecordType::TXT, DNSClass::CH, None),
        )
        .await;
        assert_eq!(other.metadata.response_code, ResponseCode::Refused, "{other}");
        // NSID on both the prepared and the full path.
        for (qname, rtype) in [(VOICE_SRV, RecordType::SRV), (ZONE, RecordType::SOA)] {
            let mut message = query_in(qname, rtype, DNSClass::IN, Some(false));
            let mut edns = message.edns.take().unwrap();
            edns.options_mut()
                .insert(EdnsOption::NSID(NSIDPayload::new(Vec::new()).unwrap()));
            message.set_edns(edns);
            let reply = exchange(&server, via, &message).await;
            let nsid = match reply.edns.as_ref().and_then(|e| e.option(EdnsCode::NSID)) {
                Some(EdnsOption::NSID(payload)) => Some(payload.as_ref().to_vec()),
                _ => None,
            };
            assert_eq!(nsid, Some(b"node-7.example".to_vec()), "{via:?} {qname}: {reply}");
            let plain = exchange(&server, via, &query_in(qname, rtype, DNSClass::IN, Some(false))).await;
            assert!(
                plain.edns.unwrap().option(EdnsCode::NSID).is_none(),
                "NSID only when asked"
            );
        }
    }
}

/// `CH TXT version.bind.` and `version.server.` answer `koder-dns <version>`, as NSD and
/// Knot name themselves, AA clear; `--dns-hide-version` refuses them.
#[tokio::test]
async fn version_bind_answers_the_version_unless_hidden() {
    let shown = common::start().await;
    let hidden = common::start_with(|c| c.dns_hide_version = true).await;
    for via in BOTH {
        for qname in ["version.bind.", "VERSION.server."] {
            let message = query_in(qname, RecordType::TXT, DNSClass::CH, Some(false));
            let reply = exchange(&shown, via, &message).await;
            assert_eq!(reply.metadata.response_code, ResponseCode::NoError, "{reply}");
            assert!(!reply.metadata.authoritative, "{reply}");
            assert_eq!(
                txts(&reply),
                vec![vec![format!("koder-dns {}", env!("CARGO_PKG_VERSION"))]],
                "{via:?} {qname}: {reply}"
            );
            assert_eq!(reply.answers[0].dns_class, DNSClass::CH);
            let reply = exchange(&hidden, via, &message).await;
            assert_eq!(reply.metadata.response_code, ResponseCode::Refused, "{reply}");
            assert!(reply.answers.is_empty() && reply.edns.is_some(), "{reply}");
        }
    }
}

/// A server dropped without a shutdown lets go of its DNS port: its UDP workers are
/// threads that would otherwise keep their `SO_REUSEPORT` sockets, and a later server given
/// that port would share its queries with the dead one (seen in CI as answers from another
/// test's registry).
#[tokio::test]
async fn a_dropped_server_releases_its_dns_port() {
    let server = common::start().await;
    let addr = server.dns();
    drop(server);
    let deadline = Instant::now() + Duration::from_secs(2);
    // A socket without SO_REUSEPORT binds only a port no one holds.
    while std::net::UdpSocket::bind(addr).is_err() {
        assert!(
            Instant::now() < deadline,
            "{addr} still held 2 s after the server was dropped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Servers started side by side, as the test suite starts them, each get a UDP port of
/// their own: a query is always answered by the registry it was sent to.
#[tokio::test]
async fn servers_started_together_never_share_a_dns_port() {
    let mut servers = Vec::new();
    for _ in 0..8 {
        servers.push(common::start().await);
    }
    let ports: HashSet<u16> = servers.iter().map(|s| s.dns().port()).collect();
    assert_eq!(ports.len(), servers.len());
    for (i, server) in servers.iter().enumerate() {
        server
            .register(json!({"name": format!("own{i}"), "address": "10.0.0.1", "port": 80}))
            .await;
    }
    for (i, server) in servers.iter().enumerate() {
        for _ in 0..8 {
            let reply = server.query(&format!("own{i}.service.koder."), RecordType::A).await;
            assert_eq!(reply.response_code, ResponseCode::NoError, "server {i}: {reply}");
        }
    }
}
