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
        let (origin, records) = match Parser::new(text.as_str(), Some(path.clone()), Some(origin.clone())).parse() {
            Ok(parsed) => parsed,
            Err(e) => {
                let line = error_line(&text, &path, &origin, &e.to_string());
                bail!("zone file {}:{line}: {e}", path.display());
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
        let handler = InMemoryZoneHandler::<TokioRuntimeProvider>::new(
            origin.clone(),
            records,
            ZoneType::Primary,
            AxfrPolicy::Deny,
        )
        .map_err(|e| anyhow::anyhow!("zone file {}: {e}", path.display()))?;
        info!(zone = %origin, file = %path.display(), rrsets = count, "static zone loaded");
        catalog.upsert(LowerName::new(&origin), vec![Arc::new(handler)]);
    }
    Ok(catalog)
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
