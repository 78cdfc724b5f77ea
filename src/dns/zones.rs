//! Static zones: every `*.zone` file of the zones directory, served as its own
//! authoritative zone through hickory's in-memory zone handler.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};
use hickory_proto::rr::{LowerName, Name};
use hickory_proto::serialize::txt::Parser;
use hickory_server::net::runtime::TokioRuntimeProvider;
use hickory_server::store::in_memory::InMemoryZoneHandler;
use hickory_server::zone_handler::{AxfrPolicy, Catalog, ZoneType};
use tracing::{info, warn};

/// Loads every zone file; a broken file stops the start with its name and the parser's
/// account of the line. The file name gives the origin (`koder.dev.zone` → `koder.dev.`)
/// unless the file sets `$ORIGIN`.
pub fn load(dir: &Path, service_zone: &Name) -> anyhow::Result<Catalog> {
    let mut catalog = Catalog::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            warn!(dir = %dir.display(), "zones directory not found; serving the service zone only");
            return Ok(catalog);
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
        let (origin, records) = Parser::new(text, Some(path.clone()), Some(origin))
            .parse()
            .map_err(|e| anyhow::anyhow!("zone file {}: {e}", path.display()))?;
        let origin = origin.to_lowercase();
        if origin == *service_zone {
            bail!("zone file {} is for {origin}, the service zone itself; remove it or change --domain", path.display());
        }
        let count = records.len();
        let handler = InMemoryZoneHandler::<TokioRuntimeProvider>::new(origin.clone(), records, ZoneType::Primary, AxfrPolicy::Deny)
            .map_err(|e| anyhow::anyhow!("zone file {}: {e}", path.display()))?;
        info!(zone = %origin, file = %path.display(), rrsets = count, "static zone loaded");
        catalog.upsert(LowerName::new(&origin), vec![Arc::new(handler)]);
    }
    Ok(catalog)
}
