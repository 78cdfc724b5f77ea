//! A raw DNS message, as the UDP and TCP servers receive it, through
//! `dns::handle_bytes` on an authority with registered instances and the static zones
//! of `zones/`.
//!
//! Checks: no panic; a reply, if any, decodes with `Message::from_vec`, is a response, has
//! the request's id; over UDP it fits the request's EDNS payload (512 without EDNS, clamped
//! to 512..=4096 as the server does); over TCP it fits a 16-bit length prefix; and a UDP
//! reply without TC has as many answers as the TCP reply (nothing dropped silently); and
//! whatever the fast path (prepared answers) answers, the full path answers the same way
//! (a TC=1 fast answer keeps at least as many answers, all of them in the TCP answer).
#![no_main]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use hickory_proto::op::{Message, MessageType};
use hickory_proto::rr::Record;
use hickory_server::net::xfer::Protocol;
use hickory_server::server::Request;
use koder_dns::dns::answer::ZoneAnswerer;
use koder_dns::dns::{Authority, MAX_UDP_PAYLOAD, handle_bytes, handle_full, handle_prepared};
use koder_dns::model::instance::Instance;
use koder_dns::registry::Registry;
use koder_dns::zone::records::ZoneNames;
use libfuzzer_sys::fuzz_target;

struct World {
    runtime: tokio::runtime::Runtime,
    authority: Authority,
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

fn world() -> &'static World {
    static WORLD: OnceLock<World> = OnceLock::new();
    WORLD.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let zone = ZoneNames::new("service.koder").unwrap();
        // A clock that never moves and leases that never end: every input sees the same zone.
        let registry = Arc::new(Registry::on_manual_clock(0, 10_000).0);
        let mut regs = vec![
            reg("voice-1", "voice", "10.0.0.1", 5060),
            reg("voice-2", "voice", "10.0.0.2", 5060),
            reg("voice-6", "voice", "2001:db8::6", 5060),
            reg("api-host", "api", "API.Internal.Example.", 443),
            Instance {
                protocol: "udp".into(),
                ..reg("voice-udp", "voice", "10.0.0.3", 5061)
            },
            Instance {
                healthy: false,
                ..reg("sick", "sick", "10.0.0.9", 9)
            },
            Instance {
                metadata: [
                    ("jet.domain".to_owned(), "voice.koder.dev".to_owned()),
                    ("long".to_owned(), "x".repeat(600)),
                ]
                .into_iter()
                .collect(),
                tags: vec!["service=voice".into(), "container=voice-a".into()],
                ..reg("meta", "meta", "192.0.2.7", 8443)
            },
        ];
        // Big enough to truncate over UDP at any payload size.
        for i in 0..300 {
            regs.push(reg(
                &format!("big-{i:03}"),
                "big",
                &format!("10.1.{}.{}", i / 250, i % 250 + 1),
                8000 + i,
            ));
        }
        for r in regs {
            registry
                .register(r.validate().expect("valid seed registration"))
                .expect("room");
        }
        let zones_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../zones");
        let static_zones = {
            let _guard = runtime.enter();
            koder_dns::dns::zones::load(&zones_dir, &zone.origin).expect("zones/ loads")
        };
        let answerer = ZoneAnswerer {
            host_addresses: Default::default(),
            registry,
            dns_ttl: 5,
            negative_ttl: 5,
            ns_address: "127.0.0.1".parse().unwrap(),
            signer: None,
        };
        World {
            runtime,
            authority: Authority::new(answerer, static_zones, koder_dns::dns::WireSettings::default()),
        }
    })
}

/// The UDP payload the server must respect for this request: what the server's own parser
/// reads from its EDNS, clamped the way `Authority` clamps it.
fn udp_limit(data: &[u8]) -> usize {
    let src: SocketAddr = "127.0.0.1:5353".parse().unwrap();
    match Request::from_bytes(data.to_vec(), src, Protocol::Udp) {
        Ok(request) => request
            .edns
            .as_ref()
            .map_or(512, |e| e.max_payload().clamp(512, MAX_UDP_PAYLOAD)) as usize,
        Err(_) => 512,
    }
}

fn check(data: &[u8], reply: &Option<Vec<u8>>, protocol: Protocol) -> Option<Message> {
    let reply = reply.as_ref()?;
    assert!(data.len() >= 2, "a reply to a message without an id");
    match protocol {
        Protocol::Udp => {
            let limit = udp_limit(data);
            assert!(
                reply.len() <= limit,
                "UDP reply of {} bytes exceeds the payload {limit}\nreply: {reply:02x?}",
                reply.len()
            );
        }
        _ => assert!(reply.len() <= u16::MAX as usize),
    }
    let message = Message::from_vec(reply)
        .unwrap_or_else(|e| panic!("{protocol:?} reply does not decode: {e}\nreply: {reply:02x?}"));
    let id = u16::from_be_bytes([data[0], data[1]]);
    assert_eq!(message.metadata.id, id, "{protocol:?} reply id");
    assert_eq!(
        message.metadata.message_type,
        MessageType::Response,
        "{protocol:?} reply is not a response"
    );
    Some(message)
}

fn sorted(records: &[Record]) -> Vec<String> {
    let mut out: Vec<String> = records.iter().map(|r| r.to_string().to_ascii_lowercase()).collect();
    out.sort();
    out
}

/// Whatever the fast path answers, the full path answers the same way.
fn same_as_full_path(world: &World, data: &[u8], src: SocketAddr, protocol: Protocol) {
    let mut fast = Vec::new();
    if !handle_prepared(&world.authority, data, src, protocol, &mut fast) {
        return;
    }
    let mut full = Vec::new();
    assert!(
        world
            .runtime
            .block_on(handle_full(&world.authority, data, src, protocol, &mut full)),
        "only the fast path answered"
    );
    let (f, s) = (
        Message::from_vec(&fast).expect("fast reply decodes"),
        Message::from_vec(&full).expect("full reply decodes"),
    );
    if f.metadata.truncation {
        // Cut to fit a UDP buffer (as in tests/prepared.rs): both paths keep answers that
        // fit, with TC set; the fast path compresses owners into the question, so it may
        // keep more, and the two may keep different ones of a rotated/shuffled set.
        assert!(s.metadata.truncation, "{protocol:?}: only the fast path cut the answer");
        let limit = match protocol {
            Protocol::Udp => udp_limit(data),
            _ => u16::MAX as usize,
        };
        assert!(
            fast.len() <= limit,
            "{protocol:?}: fast reply of {} bytes over {limit}",
            fast.len()
        );
        assert!(
            f.answers.len() >= s.answers.len(),
            "{protocol:?}: {} answers, full path {}",
            f.answers.len(),
            s.answers.len()
        );
        assert!(
            f.additionals.is_empty(),
            "{protocol:?}: additional records without all their answers"
        );
        let mut tcp = Vec::new();
        assert!(
            handle_prepared(&world.authority, data, src, Protocol::Tcp, &mut tcp),
            "{protocol:?}: a cut fast answer without a whole one"
        );
        let whole = sorted(&Message::from_vec(&tcp).expect("fast TCP reply decodes").answers);
        assert!(
            sorted(&f.answers).iter().all(|a| whole.contains(a)),
            "{protocol:?}: an answer that TCP does not give"
        );
        let (mut header, mut full_header) = (f.metadata, s.metadata);
        header.truncation = false;
        full_header.truncation = false;
        assert_eq!(header, full_header, "{protocol:?} header");
        assert_eq!(f.queries, s.queries, "{protocol:?} question");
        assert_eq!(f.edns.is_some(), s.edns.is_some(), "{protocol:?} OPT");
        return;
    }
    assert_eq!(f.metadata, s.metadata, "{protocol:?} header");
    assert_eq!(f.queries, s.queries, "{protocol:?} question");
    assert_eq!(sorted(&f.answers), sorted(&s.answers), "{protocol:?} answers");
    assert_eq!(sorted(&f.authorities), sorted(&s.authorities), "{protocol:?} authority");
    assert_eq!(
        sorted(&f.additionals),
        sorted(&s.additionals),
        "{protocol:?} additional"
    );
    assert_eq!(f.edns.is_some(), s.edns.is_some(), "{protocol:?} OPT");
}

fuzz_target!(|data: &[u8]| {
    let world = world();
    let src: SocketAddr = "127.0.0.1:40000".parse().unwrap();
    let (udp, tcp) = world.runtime.block_on(async {
        let (mut udp, mut tcp) = (Vec::new(), Vec::new());
        let udp = handle_bytes(&world.authority, data, src, Protocol::Udp, &mut udp)
            .await
            .then_some(udp);
        let tcp = handle_bytes(&world.authority, data, src, Protocol::Tcp, &mut tcp)
            .await
            .then_some(tcp);
        (udp, tcp)
    });
    assert_eq!(udp.is_some(), tcp.is_some(), "UDP and TCP disagree on whether to reply");
    let udp = check(data, &udp, Protocol::Udp);
    let tcp = check(data, &tcp, Protocol::Tcp);
    if let (Some(udp), Some(tcp)) = (udp, tcp) {
        assert_eq!(
            udp.metadata.response_code, tcp.metadata.response_code,
            "UDP and TCP response codes"
        );
        if !udp.metadata.truncation {
            assert_eq!(
                udp.answers.len(),
                tcp.answers.len(),
                "a UDP reply without TC dropped answers"
            );
        }
    }
    same_as_full_path(world, data, src, Protocol::Udp);
    same_as_full_path(world, data, src, Protocol::Tcp);
});
