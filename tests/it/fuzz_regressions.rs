//! Inputs the fuzzers found interesting (fuzz/regressions/<target>/), replayed on every
//! `cargo test` with the checks of their fuzz target that hold on stable Rust.

use std::sync::Arc;

use koder_dns::model::instance::Instance;
use koder_dns::registry::{Filter, Registry};

fn inputs(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/regressions")
        .join(target);
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| {
                    (
                        e.file_name().to_string_lossy().into_owned(),
                        std::fs::read(e.path()).unwrap(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

#[test]
fn rest_register_regressions() {
    let cases = inputs("rest_register");
    assert!(
        !cases.is_empty(),
        "fuzz/regressions/rest_register holds the seeds that found bugs"
    );
    for (file, bytes) in cases {
        let (registry, _) = Registry::on_manual_clock(90_000_000_000, 100);
        let Ok(body) = koder_dns::api::body::parse::<Instance>(&bytes) else {
            continue;
        };
        let Ok(spec) = body.validate() else { continue };
        let registered = registry.register(spec).unwrap_or_else(|e| panic!("{file}: {e}"));
        let listed = registry.list(&Filter::default());
        assert_eq!(listed, vec![registered.instance.clone()], "{file}");
        let ports = koder_dns::export::PortsFile::from_instances(&listed);
        assert_eq!(
            koder_dns::export::PortsFile::parse(&ports.render()).unwrap(),
            ports,
            "{file}"
        );
        assert!(registry.view(&registered.instance.name).is_some(), "{file}");
    }
}

#[test]
fn dns_request_regressions() {
    use hickory_proto::op::{Message, MessageType};
    use hickory_server::net::xfer::Protocol;
    use koder_dns::dns::answer::ZoneAnswerer;
    use koder_dns::dns::{Authority, WireSettings, handle_bytes};

    let cases = inputs("dns_request");
    assert!(
        !cases.is_empty(),
        "fuzz/regressions/dns_request holds the inputs that found bugs"
    );
    let registry = Arc::new(Registry::on_manual_clock(0, 100).0);
    for (id, address) in [("voice-1", "10.0.0.1"), ("voice-6", "2001:db8::6")] {
        let spec = Instance {
            id: id.into(),
            name: "voice".into(),
            address: address.parse().unwrap(),
            port: 5060,
            ..Default::default()
        };
        registry.register(spec.validate().unwrap()).unwrap();
    }
    let answerer = ZoneAnswerer {
        host_addresses: Default::default(),
        registry,
        dns_ttl: 5,
        negative_ttl: 5,
        ns_address: "127.0.0.1".parse().unwrap(),
        signer: None,
    };
    let authority = Authority::new(answerer, Default::default(), WireSettings::default());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for (file, bytes) in cases {
        for protocol in [Protocol::Udp, Protocol::Tcp] {
            let mut reply = Vec::new();
            if runtime.block_on(handle_bytes(
                &authority,
                &bytes,
                "127.0.0.1:40000".parse().unwrap(),
                protocol,
                &mut reply,
            )) {
                let message = Message::from_vec(&reply)
                    .unwrap_or_else(|e| panic!("{file} over {protocol:?}: the reply does not decode: {e}"));
                assert_eq!(message.metadata.message_type, MessageType::Response, "{file}");
                assert_eq!(message.metadata.id.to_be_bytes(), bytes[..2], "{file}: reply id");
            }
        }
    }
}
