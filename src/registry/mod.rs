//! The registry: every instance, its lease, and the per-service views DNS answers from.
//!
//! One process-wide structure shared by the REST API, the DNS authority, the reaper and the
//! health checker. Lock order is always instance entry → protocols index → service view →
//! lease index (a `protocols` entry is read while views are looked up, never the other way),
//! no lock is held across an await, and DNS holds a view's map entry only to read it (see
//! [`Registry::with_view`]), so none of them can block another for long.

pub mod clock;
pub mod disk;
pub mod instance;
pub mod lease;
pub mod reaper;
pub mod store;
pub mod view;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry as MapEntry;
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc};
use tracing::info;

use crate::dns::records::{InstanceRecords, ZoneNames};
use crate::health::{CheckKind, CheckSpec};
use clock::{Clock, Nanos};
use instance::{Instance, Spec};
use lease::{Lease, LeaseIndex, NEVER};
use view::{Member, ServiceView};

pub struct Settings {
    /// Lease for instances whose `ttl_ns` is not positive; 0 = never expire.
    pub default_ttl: Nanos,
    /// Upper bound on stored instances, so a misbehaving registrant cannot exhaust memory.
    pub max_instances: usize,
    /// The check for instances that name none.
    pub default_check: CheckKind,
    pub zone: ZoneNames,
}

/// What changed, for subscribers that keep per-instance state (the health checker, the
/// durable store).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Registered, re-registered or restored.
    Upserted(Arc<str>),
    /// Deregistered or expired.
    Removed(Arc<str>),
    /// Lease renewed by a heartbeat: said once, then not again until the durable store has
    /// read the instance ([`Registry::to_persist`]), so a busy heartbeat costs no message.
    Renewed(Arc<str>),
    /// The health checker flipped the flag.
    HealthChanged(Arc<str>),
}

impl Event {
    pub fn id(&self) -> &Arc<str> {
        match self {
            Event::Upserted(id) | Event::Removed(id) | Event::Renewed(id) | Event::HealthChanged(id) => id,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("the registry holds its maximum of {max} instances; deregister some or raise --max-instances")]
    Full { max: usize },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registered {
    pub instance: Instance,
    pub created: bool,
    /// What the id held before (possibly expired), so a failed commit can put it back.
    pub previous: Option<Instance>,
}

/// Which instances a listing keeps.
#[derive(Debug, Default, Clone)]
pub struct Filter {
    pub name: Option<String>,
    pub healthy_only: bool,
}

struct Subscriber {
    tx: mpsc::UnboundedSender<Event>,
    /// Also `Renewed` and `HealthChanged`.
    renewals: bool,
}

struct Entry {
    instance: Instance,
    lease: Arc<Lease>,
    member: Arc<Member>,
    /// A renewal the durable store has not read yet.
    renewal_pending: AtomicBool,
}

pub struct Registry {
    instances: DashMap<Arc<str>, Entry>,
    services: DashMap<String, Arc<ServiceView>>,
    /// protocol → service → members of that protocol, for `_<protocol>.<zone>`.
    protocols: DashMap<Arc<str>, std::collections::HashMap<String, usize>>,
    leases: LeaseIndex,
    count: AtomicUsize,
    serial: AtomicU32,
    clock: Arc<dyn Clock>,
    settings: Settings,
    subscribers: Mutex<Vec<Subscriber>>,
    expired_seen: Notify,
}

impl Registry {
    pub fn new(settings: Settings, clock: Arc<dyn Clock>) -> Self {
        // Start the serial at the wall-clock second so that it keeps growing across restarts.
        let serial = (clock.now() / clock::SECOND) as u32;
        Self {
            instances: DashMap::new(),
            services: DashMap::new(),
            protocols: DashMap::new(),
            leases: LeaseIndex::default(),
            count: AtomicUsize::new(0),
            serial: AtomicU32::new(serial),
            clock,
            settings,
            subscribers: Mutex::new(Vec::new()),
            expired_seen: Notify::new(),
        }
    }

    pub fn now(&self) -> Nanos {
        self.clock.now()
    }

    pub fn zone(&self) -> &ZoneNames {
        &self.settings.zone
    }

    /// The SOA serial: grows with every change that alters a DNS answer.
    pub fn serial(&self) -> u32 {
        self.serial.load(Ordering::Acquire)
    }

    /// The serial as of now: leases that have ended are reaped first, so the serial moves
    /// at the instant of expiry rather than at the next sweep. One atomic load when nothing
    /// is due.
    pub fn current_serial(&self) -> u32 {
        if self.leases.any_due(self.clock.now()) {
            self.reap();
        }
        self.serial()
    }

    /// Stored instances, including expired ones the reaper has not removed yet.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every event, renewals and health flips included (the durable store).
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<Event> {
        self.subscribe_to(true)
    }

    /// Registrations and removals only (the health checker), so a heartbeat wakes nobody
    /// who does not care.
    pub fn subscribe_lifecycle(&self) -> mpsc::UnboundedReceiver<Event> {
        self.subscribe_to(false)
    }

    fn subscribe_to(&self, renewals: bool) -> mpsc::UnboundedReceiver<Event> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.subscribers.lock().push(Subscriber { tx, renewals });
        rx
    }

    fn emit(&self, event: Event) {
        let lifecycle = matches!(event, Event::Upserted(_) | Event::Removed(_));
        self.subscribers
            .lock()
            .retain(|s| !(lifecycle || s.renewals) || s.tx.send(event.clone()).is_ok());
    }

    fn bump(&self) {
        self.serial.fetch_add(1, Ordering::AcqRel);
    }

    /// The lease an instance gets: its own TTL, else the default; 0 = never expire.
    pub fn effective_ttl(&self, ttl_ns: i64) -> Nanos {
        if ttl_ns > 0 { ttl_ns } else { self.settings.default_ttl }
    }

    fn deadline(&self, from: Nanos, ttl_ns: i64) -> Nanos {
        match self.effective_ttl(ttl_ns) {
            0 => NEVER,
            ttl => from.saturating_add(ttl),
        }
    }

    /// Moves a lease to `deadline`, in the expiry index too. Returns whether it moved
    /// earlier: the caller then gives the service a new view, because answers prepared from
    /// a view count on its leases ending no sooner than when they were prepared.
    fn move_lease(&self, id: &Arc<str>, lease: &Lease, deadline: Nanos) -> bool {
        let old = lease.deadline();
        lease.set(deadline);
        self.leases.reschedule(id, Some(old), deadline);
        deadline < old
    }

    /// Whether the health checker, not the registrant, owns this instance's `healthy` flag.
    fn checked(&self, spec: &CheckSpec) -> bool {
        spec.effective_kind(self.settings.default_check) != CheckKind::None
    }

    /// The DNS side of an instance stored under `id`.
    fn member(&self, id: &Arc<str>, instance: &Instance, lease: Arc<Lease>) -> Arc<Member> {
        // The protocol's name is shared with the `protocols` index, which holds every protocol in use.
        let protocol = self.protocols.get(instance.protocol.as_str()).map_or_else(|| instance.protocol.as_str().into(), |e| e.key().clone());
        Arc::new(Member { id: id.clone(), protocol, healthy: instance.healthy, lease, records: InstanceRecords::new(instance) })
    }

    fn put_member(&self, service: &str, member: Arc<Member>) {
        let replaced = {
            let mut view = self.services.entry(service.to_owned()).or_default();
            let (next, replaced) = view.with(member.clone());
            *view = Arc::new(next);
            replaced
        };
        if replaced.as_ref().map(|m| &m.protocol) != Some(&member.protocol) {
            if let Some(old) = replaced {
                self.count_protocol(&old.protocol, service, false);
            }
            self.count_protocol(&member.protocol, service, true);
        }
    }

    fn remove_member(&self, service: &str, id: &str) {
        let removed = match self.services.entry(service.to_owned()) {
            MapEntry::Occupied(mut view) => {
                let (rest, removed) = view.get().without(id);
                if rest.members.is_empty() {
                    view.remove();
                } else {
                    view.insert(Arc::new(rest));
                }
                removed
            }
            MapEntry::Vacant(_) => None,
        };
        if let Some(member) = removed {
            self.count_protocol(&member.protocol, service, false);
        }
    }

    /// Keeps `protocols` in step with the views. Never called while a view entry is locked,
    /// so readers may hold a protocol entry while they look views up.
    fn count_protocol(&self, protocol: &Arc<str>, service: &str, add: bool) {
        if add {
            *self.protocols.entry(protocol.clone()).or_default().entry(service.to_owned()).or_default() += 1;
        } else if let MapEntry::Occupied(mut services) = self.protocols.entry(protocol.clone()) {
            if let Some(count) = services.get_mut().get_mut(service) {
                *count -= 1;
                if *count == 0 {
                    services.get_mut().remove(service);
                }
            }
            if services.get().is_empty() {
                services.remove();
            }
        }
    }

    /// Whether any service has an answerable instance of `protocol`: then
    /// `_<protocol>.<zone>` exists as an empty non-terminal.
    pub fn protocol_answerable(&self, protocol: &str, now: Nanos) -> bool {
        self.protocols.get(protocol).is_some_and(|services| {
            services.keys().any(|service| {
                self.view(service).is_some_and(|v| v.answerable(now).any(|m| *m.protocol == *protocol))
            })
        })
    }

    /// R2: an idempotent upsert. Re-registering a live id keeps `registered_at` and, when
    /// the health checker owns the flag and the check settings, address and port are
    /// unchanged, `healthy`;
    /// registering an id whose lease has run out is a new registration.
    pub fn register(&self, spec: Spec) -> Result<Registered, RegistryError> {
        let now = self.clock.now();
        let deadline = self.deadline(now, spec.ttl_ns);
        let id: Arc<str> = spec.id.as_str().into();
        let new_check = CheckSpec::from_labels(&spec.metadata, &spec.tags).expect("validated with the spec");
        let stamp = |registered_at: Nanos, healthy: bool| Instance {
            id: spec.id.clone(),
            name: spec.name.clone(),
            address: spec.address.clone(),
            port: spec.port,
            protocol: spec.protocol.clone(),
            tags: spec.tags.clone(),
            metadata: spec.metadata.clone(),
            weight: spec.weight,
            priority: spec.priority,
            healthy,
            ttl_ns: spec.ttl_ns,
            registered_at,
            updated_at: now,
        };
        let registered = match self.instances.entry(id.clone()) {
            MapEntry::Occupied(mut occupied) => {
                // The stored key, so that the index and the view share its allocation.
                let id = occupied.key().clone();
                let entry = occupied.get_mut();
                let alive = entry.lease.alive(now);
                let old = &entry.instance;
                let old_check = CheckSpec::from_labels(&old.metadata, &old.tags).expect("stored specs are valid");
                // The checker restarts on new settings or a new target; so does the flag.
                let same_check = old_check == new_check && old.address == spec.address && old.port == spec.port;
                let keep_health = alive && self.checked(&new_check) && same_check;
                let instance = stamp(
                    if alive { old.registered_at } else { now },
                    if keep_health { old.healthy } else { spec.healthy },
                );
                let earlier = self.move_lease(&id, &entry.lease, deadline);
                let member = self.member(&id, &instance, entry.lease.clone());
                let renamed = old.name != instance.name;
                if renamed {
                    self.remove_member(&old.name, &id);
                }
                if renamed || !alive || !entry.member.same_answers(&member) {
                    self.put_member(&instance.name, member.clone());
                    entry.member = member;
                    self.bump();
                } else if earlier {
                    self.put_member(&instance.name, entry.member.clone());
                }
                let previous = std::mem::replace(&mut entry.instance, instance.clone());
                Registered { instance, created: !alive, previous: Some(previous) }
            }
            MapEntry::Vacant(vacant) => {
                let max = self.settings.max_instances;
                if self.count.fetch_add(1, Ordering::AcqRel) >= max {
                    self.count.fetch_sub(1, Ordering::AcqRel);
                    return Err(RegistryError::Full { max });
                }
                let instance = stamp(now, spec.healthy);
                let lease = Arc::new(Lease::new(deadline));
                let member = self.member(&id, &instance, lease.clone());
                self.put_member(&instance.name, member.clone());
                self.leases.reschedule(&id, None, deadline);
                vacant.insert(Entry { instance: instance.clone(), lease, member, renewal_pending: AtomicBool::new(false) });
                self.bump();
                Registered { instance, created: true, previous: None }
            }
        };
        let inst = &registered.instance;
        info!(id = %inst.id, service = %inst.name, address = %inst.address, port = inst.port,
              created = registered.created, "instance registered");
        self.emit(Event::Upserted(id));
        Ok(registered)
    }

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
        if !entry.lease.alive(now) {
            drop(entry);
            self.expired_seen.notify_one();
            return None;
        }
        let deadline = self.deadline(now, entry.instance.ttl_ns);
        entry.instance.updated_at = now;
        // Only after a restart's grace, or with the clock stepped back, does a renewal end
        // sooner than the lease it replaces.
        if self.move_lease(entry.key(), &entry.lease, deadline) {
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

    /// Undoes a register whose commit failed: puts back what the id held before.
    pub fn undo_register(&self, registered: Registered) {
        let id: Arc<str> = registered.instance.id.as_str().into();
        if let Some((id, entry)) = self.instances.remove(&id) {
            self.forget(&id, &entry);
        }
        if let Some(previous) = registered.previous {
            self.put_back(previous, 0);
        }
    }

    fn forget(&self, id: &Arc<str>, entry: &Entry) {
        self.leases.remove(id, entry.lease.deadline());
        self.remove_member(&entry.instance.name, id);
        self.count.fetch_sub(1, Ordering::AcqRel);
        self.bump();
        self.emit(Event::Removed(id.clone()));
    }

    /// Removes every instance whose lease has run out; returns how many. Touches only the
    /// instances that are due, found through the lease index.
    pub fn reap(&self) -> usize {
        let now = self.clock.now();
        let mut removed = 0;
        // The serial moves before the due leases leave the index: a reader that no longer
        // finds them due (see `current_serial`) must already see the serial of the zone
        // without them, even while this sweep is still removing them.
        for id in self.leases.take_due(now, || self.bump()) {
            // A heartbeat may have renewed the lease since it was taken from the index; the
            // check under the entry's lock settles the race.
            if let Some((id, entry)) = self.instances.remove_if(&id, |_, e| !e.lease.alive(now)) {
                self.forget(&id, &entry);
                info!(id = %id, service = %entry.instance.name, "instance expired");
                removed += 1;
            }
        }
        removed
    }

    /// Wakes the reaper early: a reader met an instance whose lease has run out.
    pub fn expired_seen(&self) {
        self.expired_seen.notify_one();
    }

    pub(crate) async fn wait_expired_seen(&self) {
        self.expired_seen.notified().await
    }

    /// Sets the health checker's verdict. Returns whether the flag changed.
    pub fn set_health(&self, id: &str, healthy: bool) -> bool {
        let Some(mut entry) = self.instances.get_mut(id) else {
            return false;
        };
        if entry.instance.healthy == healthy {
            return false;
        }
        entry.instance.healthy = healthy;
        let member = self.member(entry.key(), &entry.instance, entry.lease.clone());
        self.put_member(&entry.instance.name, member.clone());
        entry.member = member;
        let id = entry.key().clone();
        drop(entry);
        self.bump();
        self.emit(Event::HealthChanged(id));
        true
    }

    /// Any stored instance, expired or not: what durable storage should hold for `id` now.
    /// Settles the renewals pending for it: the next one is announced again.
    pub fn to_persist(&self, id: &str) -> Option<Instance> {
        self.instances.get(id).map(|e| {
            e.renewal_pending.store(false, Ordering::Release);
            e.instance.clone()
        })
    }

    /// Makes the serial at least `floor`, so it keeps growing across restarts.
    pub fn raise_serial(&self, floor: u32) {
        self.serial.fetch_max(floor, Ordering::AcqRel);
    }

    /// A live instance.
    pub fn get(&self, id: &str) -> Option<Instance> {
        let now = self.clock.now();
        self.instances.get(id).filter(|e| e.lease.alive(now)).map(|e| e.instance.clone())
    }

    /// Live instances matching `filter`, sorted by name, then id.
    pub fn list(&self, filter: &Filter) -> Vec<Instance> {
        let now = self.clock.now();
        let keep = |e: &Entry| e.lease.alive(now) && (!filter.healthy_only || e.instance.healthy);
        let mut out: Vec<Instance> = match &filter.name {
            Some(name) => self
                .view(name)
                .map(|v| {
                    v.members
                        .iter()
                        .filter_map(|m| self.instances.get(&*m.id).filter(|e| keep(e)).map(|e| e.instance.clone()))
                        .collect()
                })
                .unwrap_or_default(),
            None => self.instances.iter().filter(|e| keep(e)).map(|e| e.instance.clone()).collect(),
        };
        out.sort_unstable_by(|a, b| (&a.name, &a.id).cmp(&(&b.name, &b.id)));
        out
    }

    /// Names of the services with at least one instance matching `filter`, sorted.
    pub fn service_names(&self, filter: &Filter) -> Vec<String> {
        let now = self.clock.now();
        let keep = |member: &Member| member.lease.alive(now) && (!filter.healthy_only || member.healthy);
        let mut names: Vec<String> = self
            .services
            .iter()
            .filter(|view| filter.name.as_ref().is_none_or(|n| n == view.key()))
            .filter(|view| view.members.iter().any(|m| keep(m)))
            .map(|view| view.key().clone())
            .collect();
        names.sort_unstable();
        names
    }

    /// The DNS view of one service.
    pub fn view(&self, service: &str) -> Option<Arc<ServiceView>> {
        self.services.get(service).map(|v| v.clone())
    }

    /// Calls `f` with the DNS view of one service, without taking a reference to it: what
    /// every DNS query does, so it saves two atomic read-modify-writes on a shared counter.
    /// `f` runs under the map's read lock, which registrations of the service wait for: it
    /// must be short and must not use the registry's maps.
    pub fn with_view<R>(&self, service: &str, f: impl FnOnce(&ServiceView) -> R) -> Option<R> {
        self.services.get(service).map(|view| f(&view))
    }

    /// Puts back an instance with its stored stamps (from durable storage at start, or to
    /// undo a failed change), its lease extended by `grace`. One already past its lease is
    /// dropped; returns whether it was put back.
    pub fn put_back(&self, instance: Instance, grace: Nanos) -> bool {
        let id: Arc<str> = instance.id.as_str().into();
        let deadline = match self.deadline(instance.updated_at, instance.ttl_ns) {
            NEVER => NEVER,
            d => d.saturating_add(grace),
        };
        if deadline <= self.clock.now() {
            return false;
        }
        if let Some((id, old)) = self.instances.remove(&id) {
            self.forget(&id, &old);
        }
        let lease = Arc::new(Lease::new(deadline));
        let member = self.member(&id, &instance, lease.clone());
        self.put_member(&instance.name, member.clone());
        self.leases.reschedule(&id, None, deadline);
        self.instances.insert(id.clone(), Entry { instance, lease, member, renewal_pending: AtomicBool::new(false) });
        self.count.fetch_add(1, Ordering::AcqRel);
        self.bump();
        self.emit(Event::Upserted(id));
        true
    }
}
