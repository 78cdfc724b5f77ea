//! The fast path (answers prepared once per view, `dns::handle_prepared`) against the full
//! path (hickory's request and response types, `dns::handle_full`): for every query the fast
//! path answers, the full path must give the same response, record for record.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query};
use hickory_proto::rr::{Name, Record, RecordType};
use hickory_server::net::xfer::Protocol;
use koder_dns::dns::answer::ZoneAnswerer;
use koder_dns::dns::{Authority, DEFAULT_UDP_MAX_PAYLOAD, WireSettings, handle_full, handle_prepared};
use koder_dns::model::clock::ManualClock;
use koder_dns::model::instance::Instance;
use koder_dns::registry::Registry;

const SRC: &str = "127.0.0.1:40000";

struct World {
    registry: Arc<Registry>,
    clock: Arc<ManualClock>,
    authority: Authority,
    runtime: tokio::runtime::Runtime,
}

fn reg(id: &str, name: &str, address: &str, port: u16) -> Instance {
    Instance {
        id: id.into(),
        name: name.into(),
        address: address.parse().unwrap(),
        port,
        ..Default::default()
    }
}

fn world() -> World {
    let (registry, clock) = Registry::on_manual_clock(90_000_000_000, 10_000);
    let registry = Arc::new(registry);
    let mut regs = vec![
        reg("voice-1", "voice", "10.0.0.1", 5060),
        reg("voice-2", "voice", "10.0.0.2", 5060),
        reg("voice-3", "voice", "10.0.0.2", 5062),
        reg("voice-6", "voice", "2001:db8::6", 5060),
        Instance {
            protocol: "udp".into(),
            ..reg("voice-udp", "voice", "10.0.0.3", 5061)
        },
        reg("api-host", "api", "API.Internal.Example.", 443),
        // A target in the zone: voice's addresses are its glue.
        reg("inside", "inside", "voice.service.koder.", 443),
        Instance {
            healthy: false,
            ..reg("sick", "sick", "10.0.0.9", 9)
        },
        Instance {
            ttl_ns: 3_500_000_000,
            ..reg("brief", "brief", "10.0.0.10", 10)
        },
        Instance {
            metadata: [
                ("jet.domain".to_owned(), "voice.koder.dev".to_owned()),
                ("long".to_owned(), "x".repeat(500)),
            ]
            .into_iter()
            .collect(),
            ..reg("meta", "meta", "192.0.2.7", 8443)
        },
    ];
    for i in 0..12 {
        regs.push(reg(&format!("mid-{i:02}"), "mid", &format!("10.2.0.{}", i + 1), 7000));
    }
    for i in 0..300 {
        regs.push(reg(
            &format!("big-{i:03}"),
            "big",
            &format!("10.1.{}.{}", i / 250, i % 250 + 1),
            8000 + i,
        ));
    }
    for r in regs {
        registry.register(r.validate().unwrap()).unwrap();
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let answerer = ZoneAnswerer {
        host_addresses: Default::default(),
        registry: registry.clone(),
        dns_ttl: 5,
        negative_ttl: 5,
        ns_address: "127.0.0.1".parse().unwrap(),
        signer: None,
    };
    World {
        registry,
        clock,
        authority: Authority::new(answerer, Default::default(), WireSettings::default()),
        runtime,
    }
}

/// `name` with the letters of every other label in upper case, as 0x20-randomising
/// resolvers send them.
fn mixed_case(name: &str) -> String {
    name.split('.')
        .enumerate()
        .map(|(i, l)| {
            if i % 2 == 0 {
                l.to_ascii_uppercase()
            } else {
                l.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

fn query(id: u16, name: &str, qtype: RecordType, payload: Option<u16>) -> Vec<u8> {
    let mut message = Message::new(id, MessageType::Query, OpCode::Query);
    message.metadata.recursion_desired = id.is_multiple_of(2);
    message.metadata.checking_disabled = id.is_multiple_of(3);
    message.add_query(Query::query(Name::from_ascii(name).unwrap(), qtype));
    if let Some(payload) = payload {
        let mut edns = Edns::new();
        edns.set_max_payload(payload).set_dnssec_ok(id.is_multiple_of(5));
        message.set_edns(edns);
    }
    message.to_vec().unwrap()
}

fn sorted(records: &[Record]) -> Vec<String> {
    let mut out: Vec<String> = records.iter().map(|r| r.to_string().to_ascii_lowercase()).collect();
    out.sort();
    out
}

/// The most a reply to `bytes` may hold.
fn bytes_limit(bytes: &[u8], protocol: Protocol) -> usize {
    match protocol {
        Protocol::Udp => Message::from_vec(bytes)
            .unwrap()
            .edns
            .map_or(512, |e| e.max_payload().clamp(512, DEFAULT_UDP_MAX_PAYLOAD) as usize),
        _ => u16::MAX as usize,
    }
}

/// Asserts that both paths give the same response; returns whether the fast path answered.
fn same_answer(world: &World, bytes: &[u8], protocol: Protocol, what: &str) -> bool {
    let src: SocketAddr = SRC.parse().unwrap();
    let mut fast = Vec::new();
    if !handle_prepared(&world.authority, bytes, src, protocol, &mut fast) {
        return false;
    }
    let mut full = Vec::new();
    assert!(
        world
            .runtime
            .block_on(handle_full(&world.authority, bytes, src, protocol, &mut full)),
        "{what}: the full path did not answer"
    );
    let (f, s) = (Message::from_vec(&fast).unwrap(), Message::from_vec(&full).unwrap());
    let limit = bytes_limit(bytes, protocol);
    assert!(fast.len() <= limit, "{what}: {} bytes over {limit}", fast.len());
    for (path, reply) in [("fast", &f), ("full", &s)] {
        // TC only with an empty answer: never a partial RRset (RFC 2181 §9).
        assert!(
            !reply.metadata.truncation || (reply.answers.is_empty() && reply.additionals.is_empty()),
            "{what}: the {path} path sent TC with records"
        );
    }
    if f.metadata.truncation != s.metadata.truncation {
        // Glue may be cut at different places (the full path compresses more), but whether
        // the answer section fits is the same on both paths.
        panic!("{what}: TC on one path only: fast {f}, full {s}");
    }
    if !f.metadata.truncation && f.additionals.len() != s.additionals.len() {
        // Additional records left out for want of room, without TC, on either path.
        assert_eq!(sorted(&f.answers), sorted(&s.answers), "{what}: answers");
        assert_eq!(f.metadata, s.metadata, "{what}: header");
        return true;
    }
    assert_eq!(f.metadata, s.metadata, "{what}: header");
    // The question is echoed byte for byte as asked.
    let question_len = bytes.len() - 12 - if f.edns.is_some() { 11 } else { 0 };
    assert_eq!(
        fast[12..12 + question_len],
        bytes[12..12 + question_len],
        "{what}: question as asked"
    );
    assert_eq!(f.queries, s.queries, "{what}: question");
    assert_eq!(sorted(&f.answers), sorted(&s.answers), "{what}: answers");
    assert_eq!(sorted(&f.authorities), sorted(&s.authorities), "{what}: authority");
    assert_eq!(sorted(&f.additionals), sorted(&s.additionals), "{what}: additional");
    assert_eq!(
        f.edns.map(|e| (e.max_payload(), e.version(), e.flags().dnssec_ok)),
        s.edns.map(|e| (e.max_payload(), e.version(), e.flags().dnssec_ok)),
        "{what}: OPT"
    );
    // Answer owners point to the question, so they echo its letter case, as the full path's
    // (written out in the question's case) do.
    for (a, b) in f.answers.iter().zip(&s.answers) {
        assert_eq!(a.name.to_string(), b.name.to_string(), "{what}: owner case");
    }
    true
}

const NAMES: [(&str, RecordType); 17] = [
    ("_voice._tcp.service.koder.", RecordType::SRV),
    ("_inside._tcp.service.koder.", RecordType::SRV),
    ("_voice._udp.service.koder.", RecordType::SRV),
    ("voice.service.koder.", RecordType::A),
    ("voice.service.koder.", RecordType::AAAA),
    ("voice.service.koder.", RecordType::TXT),
    ("_voice._tcp.service.koder.", RecordType::TXT),
    ("_api._tcp.service.koder.", RecordType::SRV),
    ("api.service.koder.", RecordType::A),
    ("_mid._tcp.service.koder.", RecordType::SRV),
    ("meta.service.koder.", RecordType::TXT),
    ("_big._tcp.service.koder.", RecordType::SRV),
    ("sick.service.koder.", RecordType::A),
    ("nosuch.service.koder.", RecordType::A),
    ("voice.service.koder.", RecordType::MX),
    ("_voice._sctp.service.koder.", RecordType::SRV),
    ("brief.service.koder.", RecordType::A),
];

#[test]
fn fast_path_answers_as_the_full_path_does() {
    let world = world();
    let mut id = 0u16;
    let mut fast = 0;
    let mut total = 0;
    for (name, qtype) in NAMES {
        for name in [name.to_owned(), mixed_case(name)] {
            for payload in [None, Some(512), Some(1232), Some(4096)] {
                for protocol in [Protocol::Udp, Protocol::Tcp] {
                    id = id.wrapping_add(7919);
                    let what = format!("{qtype} {name} {payload:?} {protocol:?}");
                    total += 1;
                    fast += same_answer(&world, &query(id, &name, qtype, payload), protocol, &what) as usize;
                }
            }
        }
    }
    // Everything is prepared, answers cut to fit a UDP buffer included.
    assert_eq!(fast, total, "queries the fast path answered");
}

/// A prepared answer follows time: TTLs capped by the lease left, instances gone at the
/// end of their lease, and the answer built again when a lease moves.
#[test]
fn prepared_answers_follow_leases() {
    let world = world();
    let check = |step: &str| {
        for (name, qtype) in NAMES {
            for protocol in [Protocol::Udp, Protocol::Tcp] {
                same_answer(
                    &world,
                    &query(1, name, qtype, Some(1232)),
                    protocol,
                    &format!("{step}: {qtype} {name}"),
                );
            }
        }
    };
    check("start");
    // `brief` has 3.5 s: TTL 3, then 2, 1, 0, then it is gone.
    for _ in 0..5 {
        world.clock.advance(Duration::from_millis(900));
        check("brief's lease running out");
    }
    // A re-registration with a shorter lease ends it sooner.
    let voice1 = Instance {
        ttl_ns: 2_000_000_000,
        ..reg("voice-1", "voice", "10.0.0.1", 5060)
    };
    world.registry.register(voice1.validate().unwrap()).unwrap();
    check("voice-1 on a 2 s lease");
    world.clock.advance(Duration::from_millis(1500));
    check("voice-1 with 0.5 s left");
    world.clock.advance(Duration::from_millis(600));
    check("voice-1 expired");
    let mut reply = Vec::new();
    assert!(handle_prepared(
        &world.authority,
        &query(1, "voice.service.koder.", RecordType::A, None),
        SRC.parse().unwrap(),
        Protocol::Udp,
        &mut reply
    ));
    let ips: Vec<String> = Message::from_vec(&reply)
        .unwrap()
        .answers
        .iter()
        .map(|r| r.data.to_string())
        .collect();
    assert!(
        !ips.contains(&"10.0.0.1".to_owned()),
        "voice-1 is dead, yet answered: {ips:?}"
    );
    // Heartbeats keep the rest alive past their first lease.
    for _ in 0..4 {
        world.clock.advance(Duration::from_secs(30));
        for id in ["voice-2", "voice-3", "voice-6", "voice-udp"] {
            world.registry.heartbeat(id).expect("alive");
        }
        check("after heartbeats");
    }
}
