//! A reference `koder-service-ports.toml`, as `koder-dns drift --reference` and
//! `POST /api/v1/services/drift` read it.
//!
//! raw bytes → UTF-8 → `PortsFile::parse`; if it parses: `render` parses back to the same
//! file, rendering is stable (render ∘ parse ∘ render = render), the rendered text starts
//! with the generated-file header, and `drift::check` of the file against itself (and
//! against its round trip) reports no drift, and its table says so.
#![no_main]

use koder_dns::export::{HEADER, PortsFile, drift};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let file = match PortsFile::parse(text) {
        Ok(file) => file,
        Err(e) => {
            assert!(!e.is_empty(), "a parse error says something");
            return;
        }
    };
    let rendered = file.render();
    assert!(rendered.starts_with(HEADER));
    let again =
        PortsFile::parse(&rendered).unwrap_or_else(|e| panic!("a rendered file does not parse: {e}\n{rendered}"));
    assert_eq!(again, file, "render/parse round trip\n{rendered}");
    assert_eq!(again.render(), rendered, "rendering is not stable");
    for (live, reference) in [(&file, &file), (&again, &file), (&file, &again)] {
        let report = drift::check(live, reference);
        assert!(!report.drift, "a file drifts from itself: {report:?}\n{rendered}");
        assert!(report.missing.is_empty() && report.extra.is_empty() && report.owner_mismatch.is_empty());
        assert_eq!(report.table(), "no drift: the registry matches the reference\n");
        drop(serde_json::to_string(&report).expect("a report serialises"));
    }
});
