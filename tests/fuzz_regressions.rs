//! Inputs the fuzzers found interesting (fuzz/regressions/<target>/), replayed on every
//! `cargo test` with the checks of their fuzz target that hold on stable Rust.

use std::sync::Arc;

use koder_dns::dns::records::ZoneNames;
use koder_dns::health::CheckKind;
use koder_dns::registry::clock::ManualClock;
use koder_dns::registry::instance::Registration;
use koder_dns::registry::{Filter, Registry, Settings};

fn inputs(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions").join(target);
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap()))
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

#[test]
fn rest_register_regressions() {
    let cases = inputs("rest_register");
    assert!(!cases.is_empty(), "fuzz/regressions/rest_register holds the seeds that found bugs");
    for (file, bytes) in cases {
        let settings = Settings {
            default_ttl: 90_000_000_000,
            max_instances: 100,
            default_check: CheckKind::None,
            zone: ZoneNames::new("service.koder").unwrap(),
        };
        let registry = Registry::new(settings, Arc::new(ManualClock::new(1_800_000_000_000_000_000)));
        let Ok(body) = koder_dns::api::body::parse::<Registration>(&bytes) else { continue };
        let Ok(spec) = body.validate() else { continue };
        let registered = registry.register(spec).unwrap_or_else(|e| panic!("{file}: {e}"));
        let listed = registry.list(&Filter::default());
        assert_eq!(listed, vec![registered.instance.clone()], "{file}");
        let ports = koder_dns::export::PortsFile::from_instances(&listed);
        assert_eq!(koder_dns::export::PortsFile::parse(&ports.render()).unwrap(), ports, "{file}");
        assert!(registry.view(&registered.instance.name).is_some(), "{file}");
    }
}
