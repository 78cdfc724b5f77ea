//! Static zones: every `*.zone` file of the zones directory, served as its own
//! authoritative zone through hickory's in-memory zone handler, and transferred whole
//! (hickory's handler sends a transfer in one message only, which caps a zone at 64 KiB).

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};
use hickory_proto::rr::{LowerName, Name, Record, RecordType};
use hickory_proto::serialize::txt::Parser;
use hickory_server::net::runtime::TokioRuntimeProvider;
use hickory_server::store::in_memory::InMemoryZoneHandler;
use hickory_server::zone_handler::{AxfrPolicy, Catalog, ZoneType};
use tracing::{info, warn};

/// The static zones: hickory's catalog answers queries, and each zone's records are kept
/// for transfers.
#[derive(Default)]
pub struct StaticZones {
    pub catalog: Catalog,
    pub zones: Vec<StaticZone>,
}

/// One zone file's records, for a transfer: its SOA, then the rest.
pub struct StaticZone {
    pub origin: LowerName,
    pub soa: Record,
    pub records: Vec<Record>,
}

impl StaticZones {
    /// The A and AAAA records of every name in the static zones, by name.
    pub fn host_addresses(&self) -> std::collections::HashMap<LowerName, Vec<Record>> {
        let mut out: std::collections::HashMap<LowerName, Vec<Record>> = std::collections::HashMap::new();
        for record in self.zones.iter().flat_map(|z| &z.records) {
            if matches!(record.record_type(), RecordType::A | RecordType::AAAA) {
                out.entry(LowerName::new(&record.name))
                    .or_default()
                    .push(record.clone());
            }
        }
        out
    }

    /// The zone whose apex is `name`, if any.
    pub fn zone(&self, name: &LowerName) -> Option<&StaticZone> {
        self.zones.iter().find(|z| z.origin == *name)
    }
}

/// Loads every zone file; a broken file stops the start with its name and the parser's
/// account of the line. The file name gives the origin (`koder.dev.zone` → `koder.dev.`)
/// unless the file sets `$ORIGIN`.
pub fn load(dir: &Path, service_zone: &Name) -> anyhow::Result<StaticZones> {
    let mut loaded = StaticZones::default();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            warn!(dir = %dir.display(), "zones directory not found; serving the service zone only");
            return Ok(loaded);
        }
        Err(e) => return Err(e).with_context(|| format!("cannot read the zones directory {}", dir.display())),
    };
    let mut paths: Vec<_> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "zone"))
        .collect();
    paths.sort();
    for path in paths {
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
        let origin = Name::from_ascii(format!("{stem}."))
            .with_context(|| format!("{}: the file name does not give a zone origin", path.display()))?;
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let (origin, records) = match Parser::new(text.as_str(), Some(path.clone()), Some(origin.clone())).parse() {
            Ok(parsed) => parsed,
            Err(e) => {
                let line = error_line(&text, &path, &origin, &e.to_string());
                // hickory's parser reads no RRSIG, NSEC or NSEC3 ("should be dynamically
                // generated"): say what that means for the operator.
                let signed = e.to_string().contains("dynamically generated");
                let hint = match signed {
                    true => {
                        " (a pre-signed zone file: koder-dns serves static zones unsigned and cannot read \
                             their RRSIG, NSEC or NSEC3 records; remove them, or serve the signed zone \
                             from NSD or Knot)"
                    }
                    false => "",
                };
                bail!("zone file {}:{line}: {e}{hint}", path.display());
            }
        };
        let origin = origin.to_lowercase();
        if origin == *service_zone {
            bail!(
                "zone file {} is for {origin}, the service zone itself; remove it or change --domain",
                path.display()
            );
        }
        let count = records.len();
        let mut all: Vec<Record> = records
            .values()
            .flat_map(|set| set.records_without_rrsigs().cloned())
            .collect();
        all.sort_unstable();
        let Some(soa) = all.iter().position(|r| r.record_type() == RecordType::SOA) else {
            bail!("zone file {}: no SOA record", path.display());
        };
        let soa = all.remove(soa);
        let handler = InMemoryZoneHandler::<TokioRuntimeProvider>::new(
            origin.clone(),
            records,
            ZoneType::Primary,
            AxfrPolicy::Deny,
        )
        .map_err(|e| anyhow::anyhow!("zone file {}: {e}", path.display()))?;
        info!(zone = %origin, file = %path.display(), rrsets = count, "static zone loaded");
        loaded.catalog.upsert(LowerName::new(&origin), vec![Arc::new(handler)]);
        loaded.zones.push(StaticZone {
            origin: LowerName::new(&origin),
            soa,
            records: all,
        });
    }
    Ok(loaded)
}

/// The line a parse error comes from. hickory's parser does not say, so find the shortest
/// prefix of the file that fails with the same error: once the bad line is in, every longer
/// prefix fails with it too, which makes the search a bisection.
fn error_line(text: &str, path: &Path, origin: &Name, error: &str) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    let fails_at = |n: usize| {
        let prefix = lines[..n].join("\n");
        Parser::new(prefix, Some(path.to_owned()), Some(origin.clone()))
            .parse()
            .is_err_and(|e| e.to_string() == error)
    };
    let (mut low, mut high) = (1, lines.len().max(1));
    if !fails_at(high) {
        return high;
    }
    while low < high {
        let mid = (low + high) / 2;
        if fails_at(mid) { high = mid } else { low = mid + 1 }
    }
    low
}
