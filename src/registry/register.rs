//! R2: registration, an idempotent upsert, in two steps (prepare, then apply once the
//! store made it durable) so that nothing is seen before it is durable.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use dashmap::mapref::entry::Entry as MapEntry;
use tracing::{info, warn};

use super::events::Event;
use super::lease::Lease;
use super::{Entry, Registry};
use crate::model::check::CheckSpec;
use crate::model::clock::Nanos;
use crate::model::instance::{Instance, Validated};

#[derive(Clone, Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("the registry holds its maximum of {max} instances; deregister some or raise --max-instances")]
    Full { max: usize },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    pub instance: Instance,
    pub created: bool,
}

/// A registration computed but not yet visible (see [`Registry::prepare`]).
#[derive(Debug)]
pub struct Prepared {
    /// What durable storage must hold for the id once this is applied: the registration,
    /// stamped at `now`.
    pub instance: Instance,
    check: Arc<CheckSpec>,
    /// The `healthy` the registrant sent, which the stamp may have replaced.
    asked_healthy: bool,
    now: Nanos,
    /// Whether a `--max-instances` slot was taken for a new id.
    reserved: bool,
}

impl Prepared {
    /// Whether this registration creates the instance (new, or its old lease had run out),
    /// as opposed to refreshing a live one: `Registry::stamp` keeps a live one's
    /// `registered_at` and stamps a new one with the registration's own time.
    pub fn created(&self) -> bool {
        self.instance.registered_at == self.now
    }
}

impl Registry {
    /// R2: an idempotent upsert, applied at once. The REST path goes through
    /// [`Self::prepare`] and [`Self::apply`] instead, with the commit in between.
    pub fn register(&self, new: Validated) -> Result<Registered, RegistryError> {
        let prepared = self.prepare(new)?;
        Ok(self.apply(prepared))
    }

    /// The instance a registration will store, computed without changing anything a reader
    /// can see, so that it can be made durable first. A new id takes one of the
    /// `--max-instances` slots now (given back by [`Self::cancel`]), so concurrent
    /// registrations never overshoot the cap.
    pub fn prepare(&self, new: Validated) -> Result<Prepared, RegistryError> {
        let now = self.clock.now();
        // Expired instances the reaper has not swept yet must not crowd out a live one:
        // sweep them before the limit is checked. Outside any entry lock, as `reap` takes them.
        if self.len() >= self.settings.max_instances && self.leases.any_due(now) {
            self.reap();
        }
        let Validated { mut instance, check } = new;
        let asked_healthy = instance.healthy;
        let old = self.instances.get(instance.id.as_str());
        self.stamp(
            &mut instance,
            &check,
            asked_healthy,
            now,
            old.as_deref().map(|e| (e, e.lease.alive(now))),
        );
        let existing = old.is_some();
        drop(old);
        instance.updated_at = now;
        if !existing {
            let max = self.settings.max_instances;
            if self.count.fetch_add(1, Ordering::AcqRel) >= max {
                self.count.fetch_sub(1, Ordering::AcqRel);
                return Err(RegistryError::Full { max });
            }
        }
        Ok(Prepared {
            instance,
            check,
            asked_healthy,
            now,
            reserved: !existing,
        })
    }

    /// Gives back what [`Self::prepare`] took: its commit failed, nothing was shown.
    pub fn cancel(&self, prepared: Prepared) {
        if prepared.reserved {
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Sets the `registered_at` and `healthy` that `new` (with its check settings and the
    /// `healthy` its registrant asked for) stores at `now` over `old` (the stored entry and
    /// whether it is alive); true when that changed them. Re-registering a live id keeps
    /// `registered_at` and, when the health checker owns the flag and the check settings,
    /// address and port are unchanged, `healthy`; registering an id whose lease has run out
    /// is a new registration.
    pub(super) fn stamp(
        &self,
        new: &mut Instance,
        check: &Arc<CheckSpec>,
        asked_healthy: bool,
        now: Nanos,
        old: Option<(&Entry, bool)>,
    ) -> bool {
        let stamps = match old {
            Some((old, true)) => {
                // The checker restarts on new settings or a new target; so does the flag.
                let same_check =
                    old.check == *check && old.instance.address == new.address && old.instance.port == new.port;
                let keep_health = self.checked(check) && same_check;
                let healthy = if keep_health {
                    old.instance.healthy
                } else {
                    asked_healthy
                };
                (old.instance.registered_at, healthy)
            }
            _ => (now, asked_healthy),
        };
        let changed = stamps != (new.registered_at, new.healthy);
        (new.registered_at, new.healthy) = stamps;
        changed
    }

    /// Makes a prepared registration visible: DNS, listings, export and the subscribers see
    /// it from here on. Called once the prepared instance is durable.
    ///
    /// The stamps are computed again under the entry's lock, from the same `now`: a health
    /// flip or a reap between [`Self::prepare`] and here is honoured (the durable store
    /// rewrites the instance on a `Renewed` event then).
    pub fn apply(&self, prepared: Prepared) -> Registered {
        let Prepared {
            instance: mut new,
            check,
            asked_healthy,
            now,
            reserved,
        } = prepared;
        let deadline = self.deadline(now, new.ttl_ns);
        let id: Arc<str> = new.id.as_str().into();
        // Whether what is applied differs from what was committed.
        let mut changed = false;
        let registered = match self.instances.entry(id.clone()) {
            MapEntry::Occupied(mut occupied) => {
                if reserved {
                    // Only a restore at start could have put the id here since `prepare`.
                    self.count.fetch_sub(1, Ordering::AcqRel);
                }
                // The stored key, so that the index and the view share its allocation.
                let id = occupied.key().clone();
                let entry = occupied.get_mut();
                let alive = entry.lease.alive(now);
                let old = &entry.instance;
                if alive && old.protocol != new.protocol {
                    // The default id leaves the protocol out (the contract's
                    // `<name>-<address>-<port>`), so one port registered over UDP and then TCP
                    // replaces the first: say so, since the registrant may not have meant it.
                    warn!(id = %id, service = %new.name, from = %old.protocol, to = %new.protocol,
                          "re-registration changed the instance's protocol and replaced it; give explicit ids to register one port over several protocols");
                }
                changed = self.stamp(&mut new, &check, asked_healthy, now, Some((entry, alive)));
                let instance = new;
                let earlier = self.move_lease(&id, &entry.lease, deadline);
                // A registration confirms an instance parked by a stall or a restart.
                let confirmed_now = std::mem::take(&mut entry.unconfirmed);
                let renamed = entry.instance.name != instance.name;
                if renamed {
                    self.remove_member(&entry.instance.name, &id);
                }
                if renamed || !alive || confirmed_now || !entry.member.answers_as(&instance) {
                    let member = self.member(&id, &instance, entry.lease.clone(), true);
                    self.put_member(&instance.name, member.clone());
                    entry.member = member;
                    self.bump();
                } else if earlier {
                    self.put_member(&instance.name, entry.member.clone());
                }
                entry.instance = instance.clone();
                entry.check = check;
                Registered {
                    instance,
                    created: !alive,
                }
            }
            MapEntry::Vacant(vacant) => {
                if !reserved {
                    // Reaped since `prepare`: the slot it held is taken again, so the cap may
                    // be passed by the registrations racing a sweep, at most one each.
                    self.count.fetch_add(1, Ordering::AcqRel);
                    changed = self.stamp(&mut new, &check, asked_healthy, now, None);
                }
                // New when prepared and new now: the very instance that was committed.
                let instance = new;
                let lease = Arc::new(Lease::new(deadline));
                let member = self.member(&id, &instance, lease.clone(), true);
                self.put_member(&instance.name, member.clone());
                self.leases.reschedule(&id, None, deadline);
                vacant.insert(Entry {
                    instance: instance.clone(),
                    check,
                    lease,
                    member,
                    renewal_pending: AtomicBool::new(false),
                    unconfirmed: false,
                });
                self.bump();
                Registered {
                    instance,
                    created: true,
                }
            }
        };
        let inst = &registered.instance;
        info!(id = %inst.id, service = %inst.name, address = %inst.address, port = inst.port,
              created = registered.created, "instance registered");
        self.emit(Event::Upserted(id.clone()));
        if changed {
            // A health flip or a reap since `prepare` made it differ from what was
            // committed: the durable store re-reads it with the next batch, as after a renewal.
            self.emit(Event::Renewed(id));
        }
        registered
    }
}
