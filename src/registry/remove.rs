//! R4 and expiry: an instance leaves its view, the lease index and the count at once.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tracing::info;

use super::events::Event;
use super::{Entry, Registry};
use crate::model::instance::Instance;

impl Registry {
    /// R4: removes an instance at once. Returns what was removed if it was alive; an
    /// expired one is removed too, but reported as unknown.
    pub fn deregister(&self, id: &str) -> Option<Instance> {
        let now = self.clock.now();
        let (id, entry) = self.instances.remove(id)?;
        let alive = entry.lease.alive(now);
        self.forget(&id, &entry);
        if alive {
            info!(id = %id, service = %entry.instance.name, "instance deregistered");
            Some(entry.instance)
        } else {
            info!(id = %id, service = %entry.instance.name, "instance expired");
            None
        }
    }

    pub(super) fn forget(&self, id: &Arc<str>, entry: &Entry) {
        self.leases.remove(id, entry.lease.deadline());
        self.remove_member(&entry.instance.name, id);
        self.count.fetch_sub(1, Ordering::AcqRel);
        self.bump();
        self.emit(Event::Removed(id.clone()));
    }
}
