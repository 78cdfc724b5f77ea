//! Unit tests of the registry on a manual clock, one file per concern; the helpers they
//! share are here.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::model::clock::ManualClock;
use crate::model::instance::Validated;
use crate::model::tests::{Read, reg, with};
use serde_json::json;

mod expiry;
mod limits;
mod listing;
mod serial;
mod shared_store;
mod upsert;

pub(super) fn registry(default_ttl: std::time::Duration) -> (Registry, Arc<ManualClock>) {
    registry_max(default_ttl, 1000)
}

pub(super) fn registry_max(default_ttl: Duration, max_instances: usize) -> (Registry, Arc<ManualClock>) {
    Registry::on_manual_clock(default_ttl.as_nanos() as i64, max_instances)
}

pub(super) const SEC: Duration = Duration::from_secs(1);
pub(super) const NS: Duration = Duration::from_nanos(1);

pub(super) fn spec(id: &str, name: &str) -> Validated {
    reg(id, name).validate().expect("valid registration")
}

pub(super) fn spec_ttl(id: &str, name: &str, ttl_ns: i64) -> Validated {
    with(reg(id, name), json!({"ttl_ns": ttl_ns})).validate().unwrap()
}

pub(super) fn ids(instances: &[Instance]) -> Vec<String> {
    instances.iter().map(|i| i.id.to_string()).collect()
}

/// The ids a listing of `name` (every service with `None`) shows.
pub(super) fn listed(r: &Registry, name: Option<&str>, healthy_only: bool) -> Vec<String> {
    ids(&r.list(&Filter {
        name: name.map(str::to_owned),
        healthy_only,
        ..Filter::default()
    }))
}

pub(super) fn all(r: &Registry) -> Vec<String> {
    ids(&r.list(&Filter::default()))
}

pub(super) fn answerable_ids(r: &Registry, service: &str) -> Vec<String> {
    let now = r.now();
    r.view(service)
        .map(|v| v.answerable(now).map(|m| m.id.to_string()).collect())
        .unwrap_or_default()
}

pub(super) fn view_ids(r: &Registry, service: &str) -> Vec<String> {
    r.view(service)
        .map(|v| v.members.iter().map(|m| m.id.to_string()).collect())
        .unwrap_or_default()
}
