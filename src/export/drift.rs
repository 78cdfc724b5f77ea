//! The drift check (R8): the live registry against a reference ports file.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{PortEntry, PortsFile};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Owner {
    pub service: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct PortOwner {
    pub port: u16,
    pub protocol: String,
    #[serde(flatten)]
    pub owner: Owner,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Mismatch {
    pub port: u16,
    pub protocol: String,
    pub expected: Owner,
    pub actual: Owner,
}

/// What differs, per port. Empty lists mean no drift.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct DriftReport {
    pub drift: bool,
    /// In the reference, not live.
    pub missing: Vec<PortOwner>,
    /// Live, not in the reference.
    pub extra: Vec<PortOwner>,
    /// The same port, owned by someone else.
    pub owner_mismatch: Vec<Mismatch>,
}

fn owner_of(e: &PortEntry) -> Owner {
    Owner {
        service: e.service.clone(),
        container: e.container.clone(),
    }
}

fn port_owner(e: &PortEntry) -> PortOwner {
    PortOwner {
        port: e.port,
        protocol: e.protocol.clone(),
        owner: owner_of(e),
    }
}

/// Compares `live` with `reference`. A reference entry without a container does not
/// constrain the container.
/// Reads and parses a reference ports file, saying what is wrong with it.
pub fn load_reference(path: &std::path::Path) -> Result<PortsFile, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    PortsFile::parse(&text).map_err(|e| format!("{} is not a ports file: {e}", path.display()))
}

pub fn check(live: &PortsFile, reference: &PortsFile) -> DriftReport {
    let key = |e: &PortEntry| (e.port, e.protocol.to_ascii_lowercase());
    let live: BTreeMap<_, _> = live.ports.iter().map(|e| (key(e), e)).collect();
    let reference: BTreeMap<_, _> = reference.ports.iter().map(|e| (key(e), e)).collect();
    let mut report = DriftReport::default();
    for (k, want) in &reference {
        match live.get(k) {
            None => report.missing.push(port_owner(want)),
            Some(have) => {
                let container_differs = want.container.is_some() && want.container != have.container;
                if want.service != have.service || container_differs {
                    report.owner_mismatch.push(Mismatch {
                        port: want.port,
                        protocol: k.1.clone(),
                        expected: owner_of(want),
                        actual: owner_of(have),
                    });
                }
            }
        }
    }
    report.extra = live
        .iter()
        .filter(|(k, _)| !reference.contains_key(*k))
        .map(|(_, e)| port_owner(e))
        .collect();
    report.drift = !(report.missing.is_empty() && report.extra.is_empty() && report.owner_mismatch.is_empty());
    report
}

impl DriftReport {
    /// The table `koder-dns drift` prints.
    pub fn table(&self) -> String {
        if !self.drift {
            return "no drift: the registry matches the reference\n".into();
        }
        let show = |o: &Owner| match &o.container {
            Some(c) => format!("{} ({c})", o.service),
            None => o.service.clone(),
        };
        let mut rows = vec![(
            "KIND".to_owned(),
            "PORT".to_owned(),
            "REFERENCE".to_owned(),
            "LIVE".to_owned(),
        )];
        for m in &self.missing {
            rows.push((
                "missing".into(),
                format!("{}/{}", m.port, m.protocol),
                show(&m.owner),
                "-".into(),
            ));
        }
        for e in &self.extra {
            rows.push((
                "extra".into(),
                format!("{}/{}", e.port, e.protocol),
                "-".into(),
                show(&e.owner),
            ));
        }
        for m in &self.owner_mismatch {
            rows.push((
                "owner_mismatch".into(),
                format!("{}/{}", m.port, m.protocol),
                show(&m.expected),
                show(&m.actual),
            ));
        }
        let w: [usize; 3] = [
            rows.iter().map(|r| r.0.len()).max().unwrap_or(0),
            rows.iter().map(|r| r.1.len()).max().unwrap_or(0),
            rows.iter().map(|r| r.2.len()).max().unwrap_or(0),
        ];
        let mut out = String::new();
        for (a, b, c, d) in rows {
            out.push_str(&format!("{a:<0$}  {b:<1$}  {c:<2$}  {d}\n", w[0], w[1], w[2]));
        }
        out.push_str(&format!(
            "{} missing, {} extra, {} owner_mismatch\n",
            self.missing.len(),
            self.extra.len(),
            self.owner_mismatch.len()
        ));
        out
    }
}
