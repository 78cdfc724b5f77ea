//! The edge-routing table (R5): every public domain an instance opted into with
//! `jet.domain`, and who serves it.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::model::instance::{Instance, JET_DOMAIN};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct RouteInstance {
    pub id: String,
    pub service: String,
    pub address: String,
    pub port: u16,
    pub healthy: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Route {
    pub domain: String,
    /// More than one service claims this domain: the edge must not mix them silently.
    pub conflict: bool,
    pub services: Vec<String>,
    pub instances: Vec<RouteInstance>,
}

/// The domain an instance asked to be routed on, normalised; `None` = internal-only.
pub fn jet_domain(instance: &Instance) -> Option<String> {
    instance
        .label(JET_DOMAIN)
        .map(|d| d.strip_suffix('.').unwrap_or(d).to_ascii_lowercase())
}

/// Routes sorted by domain, instances by id. Unhealthy instances stay listed with their
/// flag, so the edge can drain them rather than forget them.
pub fn routes(instances: &[Instance]) -> Vec<Route> {
    let mut by_domain: BTreeMap<String, Vec<&Instance>> = BTreeMap::new();
    for i in instances {
        if let Some(domain) = jet_domain(i) {
            by_domain.entry(domain).or_default().push(i);
        }
    }
    by_domain
        .into_iter()
        .map(|(domain, mut members)| {
            members.sort_by(|a, b| a.id.cmp(&b.id));
            let services: Vec<String> = members
                .iter()
                .map(|m| m.name.to_string())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            Route {
                domain,
                conflict: services.len() > 1,
                instances: members
                    .iter()
                    .map(|m| RouteInstance {
                        id: m.id.to_string(),
                        service: m.name.to_string(),
                        address: m.address.to_string(),
                        port: m.port,
                        healthy: m.healthy,
                    })
                    .collect(),
                services,
            }
        })
        .collect()
}
