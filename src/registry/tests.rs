//! Unit tests of the registry on a manual clock.
use std::sync::Arc;

use super::*;
use crate::registry::clock::ManualClock;

pub(crate) fn registry(default_ttl: std::time::Duration) -> (Registry, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(1_800_000_000_000_000_000));
    let settings = Settings {
        default_ttl: default_ttl.as_nanos() as i64,
        max_instances: 1000,
        default_check: CheckKind::None,
        zone: ZoneNames::new("service.koder").unwrap(),
    };
    (Registry::new(settings, clock.clone()), clock)
}
