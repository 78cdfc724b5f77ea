//! R3: a heartbeat renews a live lease; it never resurrects a dead instance.

use std::sync::atomic::Ordering;

use tracing::info;

use super::Registry;
use super::events::Event;
use crate::model::instance::Instance;

impl Registry {
    /// R3: renews a live lease. `None` when the id is unknown or its lease has run out, even
    /// if the reaper has not removed it yet: a heartbeat never resurrects a dead instance.
    pub fn heartbeat(&self, id: &str) -> Option<Instance> {
        self.heartbeat_with(id, Instance::clone)
    }

    /// [`Self::heartbeat`], handing the renewed instance to `f` under its entry's lock, so
    /// that the REST answer is written without copying the instance first.
    pub fn heartbeat_with<R>(&self, id: &str, f: impl FnOnce(&Instance) -> R) -> Option<R> {
        let now = self.clock.now();
        let mut entry = self.instances.get_mut(id)?;
        // A lease that ran out while the registry could not see heartbeats is renewed: the
        // registrant kept its side of the contract.
        let lapsed_unseen = !entry.lease.alive(now) && self.unseen(entry.lease.deadline());
        if !entry.lease.alive(now) && !lapsed_unseen {
            drop(entry);
            self.expired_seen.notify_one();
            return None;
        }
        let deadline = self.deadline(now, entry.instance.ttl_ns);
        entry.instance.updated_at = now;
        // Only after a restart's grace, or with the clock stepped back, does a renewal end
        // sooner than the lease it replaces.
        let earlier = self.move_lease(entry.key(), &entry.lease, deadline);
        if lapsed_unseen || entry.unconfirmed {
            // Confirmed: served again, under a new serial.
            entry.unconfirmed = false;
            let member = self.member(entry.key(), &entry.instance, entry.lease.clone(), true);
            self.put_member(&entry.instance.name, member.clone());
            entry.member = member;
            self.bump();
            info!(id = %entry.key(), service = %entry.instance.name, "instance confirmed by a heartbeat after the registry's outage");
        } else if earlier {
            self.put_member(&entry.instance.name, entry.member.clone());
        }
        let out = f(&entry.instance);
        let announce = !entry.renewal_pending.swap(true, Ordering::AcqRel);
        let id = entry.key().clone();
        drop(entry);
        if announce {
            self.emit(Event::Renewed(id));
        }
        Some(out)
    }
}
