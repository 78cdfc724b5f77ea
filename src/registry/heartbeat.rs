//! R3: a heartbeat renews a live lease; it never resurrects a dead instance.

use std::sync::atomic::Ordering;

use tracing::info;

use super::events::Event;
use super::{Entry, Registry};
use crate::model::clock::Nanos;
use crate::model::instance::Instance;

impl Registry {
    /// R3: renews a live lease. `None` when the id is unknown or its lease has run out, even
    /// if the reaper has not removed it yet: a heartbeat never resurrects a dead instance.
    pub fn heartbeat(&self, id: &str) -> Option<Instance> {
        self.heartbeat_with(id, |_| true, Instance::clone)
    }

    /// [`Self::heartbeat`], handing the renewed instance to `f` under its entry's lock, so
    /// that the REST answer is written without copying the instance first; `None` too when
    /// `may` refuses the instance, which it sees before anything is renewed.
    pub fn heartbeat_with<R>(
        &self,
        id: &str,
        may: impl FnOnce(&Instance) -> bool,
        f: impl FnOnce(&Instance) -> R,
    ) -> Option<R> {
        let now = self.clock.now();
        let mut entry = self.instances.get_mut(id)?;
        if !may(&entry.instance) {
            return None;
        }
        let Some(lapsed_unseen) = self.renewable(&entry, now) else {
            drop(entry);
            self.expired_seen.notify_one();
            return None;
        };
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

impl Registry {
    /// What a heartbeat now would store for `id` (its `updated_at` now), without renewing
    /// anything: for a shared store, which renews once its write is taken (then applied as
    /// stored, see [`Self::renewed_elsewhere`]). The flag says the renewal confirms an
    /// instance parked by, or lapsed during, the registry's outage: it changes answers.
    /// `None` when the id is unknown or its lease has run out.
    pub fn renewal(&self, id: &str) -> Option<(Instance, bool)> {
        let now = self.clock.now();
        let entry = self.instances.get(id)?;
        let Some(lapsed_unseen) = self.renewable(&entry, now) else {
            drop(entry);
            self.expired_seen.notify_one();
            return None;
        };
        let instance = Instance {
            updated_at: now,
            ..entry.instance.clone()
        };
        Some((instance, lapsed_unseen || entry.unconfirmed))
    }

    /// Whether a heartbeat at `now` renews `entry`: `Some(true)` when its lease ran out
    /// while the registry could not see heartbeats (the registrant kept its side of the
    /// contract), `Some(false)` when it is alive, `None` when it is dead.
    fn renewable(&self, entry: &Entry, now: Nanos) -> Option<bool> {
        let lapsed_unseen = !entry.lease.alive(now) && self.unseen(entry.lease.deadline());
        (entry.lease.alive(now) || lapsed_unseen).then_some(lapsed_unseen)
    }
}
