//! Register, heartbeat, deregister and the health checker's verdict as etcd transactions,
//! answered only once etcd committed them and this node shows them (read-your-writes). A write that alters an answer also
//! puts `<prefix>revision` in its transaction (one more operation, compared on nothing):
//! its `mod_revision` is the registry's revision on every node (see [`super::follow`]).

use std::sync::atomic::Ordering;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};

use super::Etcd;
use super::group::Outcome;
use crate::model::instance::{Instance, Validated};
use crate::registry::Registered;
use crate::store::StoreError;

/// A write decided again this often at most when other nodes keep changing its key.
pub(super) const RETRIES: usize = 8;

impl Etcd {
    /// Refuses at once while etcd is unreachable (see [`Self::probe`]).
    pub(super) fn writable(&self) -> Result<(), StoreError> {
        if self.reachable.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(StoreError::Unavailable(
                "etcd is unreachable or has no quorum; this node answers reads from its copy".into(),
            ))
        }
    }

    /// The put of the revision key, for a transaction that alters an answer.
    pub(super) fn changed(&self) -> TxnOp {
        TxnOp::put(self.revision_key.clone(), self.node_id.clone(), None)
    }

    /// R2 as an etcd transaction (grouped, see [`super::group`]); see the module's
    /// documentation. A refresh (nothing but `updated_at` differs from what this node
    /// holds) leaves the revision alone.
    pub(super) async fn register(&self, new: Validated) -> Result<Registered, StoreError> {
        self.writable()?;
        for _ in 0..RETRIES {
            // Read before the registry: the registry is updated before the revision, so the
            // state decided from is never older than the revision compared on.
            let known = self.revisions.get(new.id.as_str()).map_or(0, |r| *r);
            let prepared = self.registry.prepare(new.clone())?;
            let created = prepared.created();
            let instance = prepared.instance.clone();
            self.registry.cancel(prepared);
            let changes = created
                || self.registry.get(&instance.id).is_none_or(|held| {
                    held != Instance {
                        updated_at: held.updated_at,
                        ..instance.clone()
                    }
                });
            match self.put(instance, known, changes, false).await? {
                Outcome::Taken(instance) => return Ok(Registered { instance, created }),
                // Another node changed the key: catch up to that change, then decide again.
                Outcome::Changed(revision) | Outcome::Gone(revision) => self.wait_applied(revision).await?,
            }
        }
        Err(StoreError::Unavailable(
            "the instance kept changing on other nodes during this registration; retry".into(),
        ))
    }

    /// R3 on etcd: renews `id` with the next group, answered once etcd holds the renewal;
    /// `answer` sees the instance as stored. A renewal writes the instance with its new
    /// `updated_at` and nothing else, so it moves no revision and wakes no blocking query
    /// (unless it confirms an instance parked by an outage); every node's lease then ends
    /// at that stored `updated_at` + TTL.
    pub(super) async fn heartbeat(
        &self,
        id: &str,
        may: &(dyn for<'i> Fn(&'i Instance) -> bool + Send + Sync),
        answer: &mut (dyn for<'i> FnMut(&'i Instance) + Send),
    ) -> Result<bool, StoreError> {
        self.writable()?;
        for _ in 0..RETRIES {
            // Read before the registry, as a registration does.
            let Some(known) = self.revisions.get(id).map(|r| *r) else {
                return Ok(false);
            };
            let Some((instance, confirms)) = self.registry.renewal(id) else {
                return Ok(false);
            };
            if !may(&instance) {
                return Ok(false);
            }
            match self.put(instance, known, confirms, true).await? {
                Outcome::Taken(stored) => {
                    answer(&stored);
                    return Ok(true);
                }
                Outcome::Gone(_) => return Ok(false),
                Outcome::Changed(revision) => self.wait_applied(revision).await?,
            }
        }
        Err(StoreError::Unavailable(
            "the instance kept changing on other nodes during this heartbeat; retry".into(),
        ))
    }

    /// Applies `instance`, which etcd committed at `revision`, unless the watch did already.
    pub(super) fn applied_here(&self, instance: &Instance, revision: i64) {
        let _applying = self.applying.lock();
        if *self.applied.borrow() < revision {
            self.apply_instance(instance.id.as_str().into(), instance.clone(), revision);
        }
    }

    /// R4 as an etcd transaction: the delete and the revision key, if the key is there.
    /// True when a live instance was removed.
    pub(super) async fn deregister(&self, id: &str) -> Result<bool, StoreError> {
        self.writable()?;
        let alive = self.registry.get(id).is_some();
        let key = self.key(id);
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Greater, 0)])
            .and_then([TxnOp::delete(key, None), self.changed()]);
        let answer = self.txn("deregistration", txn).await?;
        if !answer.succeeded() {
            return Ok(false);
        }
        self.wait_applied(answer.header().map_or(0, |h| h.revision())).await?;
        Ok(alive)
    }

    /// The owner's health verdict as an etcd transaction, compared on the key's
    /// `mod_revision` like a renewal: when the key changed elsewhere meanwhile (a renewal,
    /// a re-registration) this node catches up and decides again on what it then holds; a
    /// deregistration ends it. Applied here at once, on the other nodes through their
    /// watch. A passing verdict on an instance parked after every node was down (see
    /// [`crate::registry::Registry::blind_between`]) confirms it on every node: it is
    /// stored renewed, as a heartbeat would. True when the flag changed or the instance was
    /// confirmed.
    pub(super) async fn set_health(&self, id: &str, healthy: bool) -> Result<bool, StoreError> {
        self.writable()?;
        for _ in 0..RETRIES {
            // Read before the registry, as a registration does.
            let Some(known) = self.revisions.get(id).map(|r| *r) else {
                return Ok(false);
            };
            let Some((mut instance, confirms)) = self.registry.renewal(id) else {
                return Ok(false);
            };
            let confirms = healthy && confirms;
            if instance.healthy == healthy && !confirms {
                return Ok(false);
            }
            if !confirms {
                // Not a renewal: the stamp stays as stored.
                let Some(held) = self.registry.to_persist(id) else {
                    return Ok(false);
                };
                instance.updated_at = held.updated_at;
            }
            instance.healthy = healthy;
            match self.put(instance, known, true, false).await? {
                Outcome::Taken(_) => return Ok(true),
                Outcome::Gone(_) => return Ok(false),
                Outcome::Changed(revision) => self.wait_applied(revision).await?,
            }
        }
        Err(StoreError::Unavailable(
            "the instance kept changing on other nodes; the verdict is decided again after the next probe".into(),
        ))
    }
}
