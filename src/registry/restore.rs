//! Instances as durable storage holds them: restored at start, put back when a change could
//! not be committed, and (on a shared store) taken from other nodes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tracing::warn;

use super::events::Event;
use super::lease::{Lease, NEVER};
use super::{Entry, Registry};
use crate::model::check::CheckSpec;
use crate::model::clock::Nanos;
use crate::model::instance::Instance;

impl Registry {
    /// Puts back an instance with its stored stamps (from durable storage at start, or to
    /// undo a failed change), its lease extended by `grace`. One whose lease lapsed while
    /// the registry was down (see [`Self::blind_between`]) is kept unconfirmed for one more
    /// TTL; one already past its lease before that is dropped. Returns whether it was put back.
    pub fn put_back(&self, instance: Instance, grace: Nanos) -> bool {
        let id: Arc<str> = instance.id.as_str().into();
        let now = self.clock.now();
        let mut deadline = match self.deadline(instance.updated_at, instance.ttl_ns) {
            NEVER => NEVER,
            d => d.saturating_add(grace),
        };
        let unconfirmed = deadline <= now && self.unseen(deadline);
        if unconfirmed {
            deadline = self.deadline(now, instance.ttl_ns);
        } else if deadline <= now {
            return false;
        }
        // Replacing one (a change from another node, on etcd): its member is swapped in its
        // view, not removed first, so DNS never answers in between as if it were gone.
        if let Some((id, old)) = self.instances.remove(&id) {
            self.leases.remove(&id, old.lease.deadline());
            if old.instance.name != instance.name {
                self.remove_member(&old.instance.name, &id);
            }
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
        // Stored data was validated when it was registered; it is read here as it comes in
        // from storage, once.
        let check = CheckSpec::from_labels(&instance.metadata, &instance.tags)
            .inspect_err(|e| warn!(id = %id, error = %e, "stored check settings are invalid; the defaults apply"))
            .unwrap_or_default()
            .shared();
        let lease = Arc::new(Lease::new(deadline));
        let member = self.member(&id, &instance, lease.clone(), !unconfirmed);
        self.put_member(&instance.name, member.clone());
        self.leases.reschedule(&id, None, deadline);
        self.instances.insert(
            id.clone(),
            Entry {
                instance,
                check,
                lease,
                member,
                renewal_pending: AtomicBool::new(false),
                unconfirmed,
            },
        );
        self.count.fetch_add(1, Ordering::AcqRel);
        self.bump();
        self.emit(Event::Upserted(id));
        true
    }

    /// An instance another node renewed (its stored `updated_at` moved) or flipped the
    /// health flag of (the node whose checker owns the instance wrote its verdict): extends
    /// the lease here to that renewal's end plus `grace`, and takes the stored flag, without
    /// an event (the flag is the store's already, nothing is to be written back). Returns
    /// false when the id is unknown here or differs in more than the stamp and the flag:
    /// the caller then replaces it.
    pub fn renewed_elsewhere(&self, instance: &Instance, grace: Nanos) -> bool {
        let Some(mut entry) = self.instances.get_mut(instance.id.as_str()) else {
            return false;
        };
        let same = Instance {
            updated_at: entry.instance.updated_at,
            healthy: entry.instance.healthy,
            ..instance.clone()
        } == entry.instance;
        if !same || entry.unconfirmed {
            return false;
        }
        let deadline = match self.deadline(instance.updated_at, instance.ttl_ns) {
            NEVER => NEVER,
            d => d.saturating_add(grace),
        };
        if deadline > entry.lease.deadline() {
            entry.instance.updated_at = entry.instance.updated_at.max(instance.updated_at);
            let id = entry.key().clone();
            self.move_lease(&id, &entry.lease, deadline);
        }
        if entry.instance.healthy != instance.healthy {
            entry.instance.healthy = instance.healthy;
            let member = self.member(entry.key(), &entry.instance, entry.lease.clone(), true);
            self.put_member(&entry.instance.name, member.clone());
            entry.member = member;
            drop(entry);
            self.bump();
        }
        true
    }

    /// Whether the id is stored (expired or not): durable storage keeps a record of it.
    pub fn holds(&self, id: &str) -> bool {
        self.instances.contains_key(id)
    }

    /// Any stored instance, expired or not: what durable storage should hold for `id` now.
    /// Settles the renewals pending for it: the next one is announced again.
    pub fn to_persist(&self, id: &str) -> Option<Instance> {
        self.instances.get(id).map(|e| {
            e.renewal_pending.store(false, Ordering::Release);
            e.instance.clone()
        })
    }
}
