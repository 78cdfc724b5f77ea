//! The registry: every instance, its lease, and the per-service views DNS answers from.
//!
//! One process-wide structure shared by the REST API, the DNS authority, the reaper and the
//! health checker. Lock order is always instance entry → protocols index → service view →
//! lease index (a `protocols` entry is read while views are looked up, never the other way),
//! no lock is held across an await, and DNS holds a view's map entry only to read it (see
//! [`Registry::with_view`]), so none of them can block another for long.

pub mod disk;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod lease;
pub mod reaper;
pub mod store;
pub mod view;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use dashmap::DashMap;
use dashmap::mapref::entry::Entry as MapEntry;
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc};
use tracing::{info, warn};

use crate::model::check::{CheckKind, CheckSpec};
use crate::model::clock::{self, Clock, Nanos};
use crate::model::instance::{Instance, Validated};
use crate::zone::records::{InstanceRecords, ZoneNames};
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
    /// Registered, re-registered or restored: said only of what durable storage already
    /// holds (a registration after its commit, a restore from disk), so the durable store
    /// does not write it again.
    Upserted(Arc<str>),
    /// Deregistered or expired.
    Removed(Arc<str>),
    /// Lease renewed by a heartbeat: said once, then not again until the durable store has
    /// read the instance ([`Registry::to_persist`]), so a busy heartbeat costs no message.
    Renewed(Arc<str>),
    /// The health checker flipped the flag here. A flag taken from the shared store (on
    /// etcd every verdict is, the owner's own too) says nothing: it is stored already.
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
    /// as opposed to refreshing a live one: [`Registry::stamp`] keeps a live one's
    /// `registered_at` and stamps a new one with the registration's own time.
    pub fn created(&self) -> bool {
        self.instance.registered_at == self.now
    }
}

/// Which instances a listing keeps.
#[derive(Debug, Default, Clone)]
pub struct Filter {
    pub name: Option<String>,
    /// Healthy and confirmed instances only (what DNS serves).
    pub healthy_only: bool,
    /// Leaves out instances parked by the registry's outage (the export and routes).
    pub confirmed_only: bool,
}

struct Subscriber {
    tx: mpsc::UnboundedSender<Event>,
    /// Also `Renewed` and `HealthChanged`.
    renewals: bool,
}

struct Entry {
    instance: Instance,
    /// Its check settings, parsed once at registration (or when loaded from storage).
    check: Arc<CheckSpec>,
    lease: Arc<Lease>,
    member: Arc<Member>,
    /// A renewal the durable store has not read yet.
    renewal_pending: AtomicBool,
    /// Its lease lapsed while the registry could not see heartbeats (stopped, restarted or
    /// stalled): kept, but not served until a heartbeat, a re-registration or a passing
    /// check confirms it (see [`Registry::observe`]).
    unconfirmed: bool,
}

/// How far the registry's own monotonic clock may jump between two observations (see
/// [`Registry::observe`], every [`reaper::WATCH_TICK`]) before the gap counts as a stall:
/// well above scheduling noise on a busy machine, well below any lease (`--min-ttl` 1s
/// is the floor; a stall shorter than this cannot outlast a heartbeat interval that fits
/// in a lease).
pub const STALL: std::time::Duration = std::time::Duration::from_millis(900);

/// The registry's last look at itself: when (on its clock and the monotonic one) it last
/// knew it was running and able to see heartbeats.
struct Watch {
    wall: Nanos,
    mono: std::time::Instant,
}

/// Periods the registry could not see heartbeats kept for [`Registry::unseen`]; older ones
/// no longer hold any due lease.
const BLIND_KEPT: usize = 16;

impl Entry {
    /// The instance as readers see it: one awaiting confirmation is not healthy.
    fn served(&self) -> Instance {
        let mut instance = self.instance.clone();
        instance.healthy &= !self.unconfirmed;
        instance
    }
}

pub struct Registry {
    instances: DashMap<Arc<str>, Entry>,
    services: DashMap<String, Arc<ServiceView>>,
    /// protocol → service → members of that protocol, for `_<protocol>.<zone>`.
    protocols: DashMap<Arc<str>, std::collections::HashMap<String, usize>>,
    leases: LeaseIndex,
    count: AtomicUsize,
    /// The revision: counts every change a reader can see (the SOA serial is its low 32
    /// bits, blocking queries wait for it to pass their index).
    revision: AtomicU64,
    /// Every change to a service's view counts here: an answer that holds another service's
    /// addresses (an SRV target in the zone) is good while this has not moved.
    view_changes: AtomicU64,
    /// Woken at every new revision: held blocking queries wait here, costing no thread and
    /// no polling.
    changed: Notify,
    clock: Arc<dyn Clock>,
    settings: Settings,
    subscribers: Mutex<Vec<Subscriber>>,
    expired_seen: Notify,
    watch: Mutex<Watch>,
    /// `(from, to]` on the registry's clock: downtime before this start, and stalls.
    blind: Mutex<Vec<(Nanos, Nanos)>>,
    /// The revision is an outside store's (etcd's), set by [`Self::follow_revision`] and
    /// [`Self::advance_revision`]: local changes wake waiters but do not count, so every
    /// node sharing the store shows the same revision.
    external_revision: AtomicBool,
}

impl Registry {
    pub fn new(settings: Settings, clock: Arc<dyn Clock>) -> Self {
        // Start at the wall-clock second so that it keeps growing across restarts even if the
        // data file is lost.
        let revision = (clock.now() / clock::SECOND).max(0) as u64;
        Self {
            instances: DashMap::new(),
            services: DashMap::new(),
            protocols: DashMap::new(),
            leases: LeaseIndex::default(),
            count: AtomicUsize::new(0),
            revision: AtomicU64::new(revision),
            view_changes: AtomicU64::new(0),
            changed: Notify::new(),
            settings,
            subscribers: Mutex::new(Vec::new()),
            expired_seen: Notify::new(),
            watch: Mutex::new(Watch {
                wall: clock.now(),
                mono: std::time::Instant::now(),
            }),
            blind: Mutex::new(Vec::new()),
            external_revision: AtomicBool::new(false),
            clock,
        }
    }

    /// The registry of tests, benchmarks and fuzz targets: the zone `service.koder.`, no
    /// default check, on a [`clock::ManualClock`] at [`clock::MANUAL_START`] that only the
    /// caller moves. One constructor, so that a new setting is added in one place.
    pub fn on_manual_clock(default_ttl: Nanos, max_instances: usize) -> (Self, Arc<clock::ManualClock>) {
        let clock = Arc::new(clock::ManualClock::new(clock::MANUAL_START));
        let settings = Settings {
            default_ttl,
            max_instances,
            default_check: CheckKind::None,
            zone: ZoneNames::new("service.koder").expect("a valid zone"),
        };
        (Self::new(settings, clock.clone()), clock)
    }

    /// Records that the registry could not see heartbeats over `(from, to]`: the downtime
    /// before a start (from the time durable storage was last written), or a stall.
    pub fn blind_between(&self, from: Nanos, to: Nanos) {
        if from < to {
            let mut blind = self.blind.lock();
            if blind.len() == BLIND_KEPT {
                blind.remove(0);
            }
            blind.push((from, to));
        }
    }

    /// Called every [`reaper::WATCH_TICK`]. When the monotonic clock moved more than
    /// [`STALL`] since the last call, the process was stopped or not scheduled: no heartbeat
    /// could arrive, so leases that ran out meanwhile lapsed unseen. They are parked, not
    /// expired (see [`Self::reap`]). Returns whether a stall was seen.
    pub fn observe(&self) -> bool {
        let now = self.clock.now();
        let mut watch = self.watch.lock();
        let gap = watch.mono.elapsed();
        let stalled = gap > STALL;
        if stalled {
            warn!(
                stalled_ms = gap.as_millis() as u64,
                "the registry was stopped or not scheduled; leases that ran out meanwhile are kept until their registrants are heard from again"
            );
            // Under the watch's lock, so `unseen` finds the stall either in progress or recorded.
            self.blind_between(watch.wall, now);
        }
        *watch = Watch {
            wall: now,
            mono: std::time::Instant::now(),
        };
        drop(watch);
        if stalled {
            self.reap();
        }
        stalled
    }

    /// Whether a lease ending at `deadline` lapsed while the registry could not see
    /// heartbeats: in a recorded blind period, or after the last observation when the
    /// monotonic clock says the current one is overdue (a stall not yet observed, e.g. a
    /// heartbeat handled before the watch's tick after SIGCONT).
    fn unseen(&self, deadline: Nanos) -> bool {
        {
            let watch = self.watch.lock();
            if deadline > watch.wall && watch.mono.elapsed() > STALL {
                return true;
            }
        }
        self.blind
            .lock()
            .iter()
            .any(|&(from, to)| from < deadline && deadline <= to)
    }

    pub fn now(&self) -> Nanos {
        self.clock.now()
    }

    pub fn zone(&self) -> &ZoneNames {
        &self.settings.zone
    }

    /// The SOA serial: the low 32 bits of the revision (RFC 1982 arithmetic wraps).
    pub fn serial(&self) -> u32 {
        self.revision() as u32
    }

    /// How many times a service's view has changed (registrations, removals, health flips,
    /// leases moved earlier), in this process.
    pub fn view_changes(&self) -> u64 {
        self.view_changes.load(Ordering::Acquire)
    }

    /// The revision: a 64-bit count of changes a reader can see; only grows, across
    /// restarts too.
    pub fn revision(&self) -> u64 {
        self.revision.load(Ordering::Acquire)
    }

    /// The revision as of now, leases that have ended reaped first (see [`Self::current_serial`]).
    pub fn current_revision(&self) -> u64 {
        if self.leases.any_due(self.clock.now()) {
            self.reap();
        }
        self.revision()
    }

    /// Resolves at the next new revision. Create it, then check the revision, then await
    /// it, so that a change between the check and the await is not missed.
    pub fn changed(&self) -> tokio::sync::futures::Notified<'_> {
        self.changed.notified()
    }

    /// How long until the earliest lease ends: a blocking query wakes then, because an
    /// expiry changes what it would answer. `None` when no lease is due to end.
    pub fn until_next_expiry(&self) -> Option<std::time::Duration> {
        let earliest = self.leases.earliest();
        (earliest != NEVER)
            .then(|| std::time::Duration::from_nanos(earliest.saturating_sub(self.clock.now()).max(0) as u64))
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

    /// Instances parked by the registry's outage, awaiting confirmation.
    pub fn unconfirmed(&self) -> usize {
        self.instances.iter().filter(|e| e.unconfirmed).count()
    }

    /// Stored instances, including expired ones the reaper has not removed yet.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    /// Per service: how many live instances are healthy and how many are not (metrics).
    /// Reads the views, so it costs one pass over the members and no copy of an instance.
    pub fn instance_counts(&self) -> Vec<(String, usize, usize)> {
        let now = self.clock.now();
        let mut counts: Vec<(String, usize, usize)> = self
            .services
            .iter()
            .map(|view| {
                let (healthy, unhealthy) = view
                    .members
                    .iter()
                    .filter(|m| m.lease.alive(now))
                    .fold((0, 0), |(h, u), m| if m.healthy { (h + 1, u) } else { (h, u + 1) });
                (view.key().clone(), healthy, unhealthy)
            })
            .collect();
        counts.sort_unstable();
        counts
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
        if !self.external_revision.load(Ordering::Acquire) {
            self.revision.fetch_add(1, Ordering::AcqRel);
        }
        self.changed.notify_waiters();
    }

    /// From now on the revision is the shared store's, starting at `revision`: set, not
    /// raised, because the wall-clock start of [`Self::new`] is far above etcd's counter.
    pub fn follow_revision(&self, revision: u64) {
        self.external_revision.store(true, Ordering::Release);
        self.revision.store(revision, Ordering::Release);
        self.changed.notify_waiters();
    }

    /// The shared store applied `revision` here (see [`Self::follow_revision`]).
    pub fn advance_revision(&self, revision: u64) {
        if self.revision.fetch_max(revision, Ordering::AcqRel) < revision {
            self.changed.notify_waiters();
        }
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

    /// Gives every lease ending within `within` from now one more TTL from now. While the
    /// shared store is unreachable no heartbeat can be taken or seen, so nothing may expire
    /// for want of one; called through the outage (leases about to end) and once when it
    /// ends (all of them), so registrants have a full lease to be heard again. Only ever
    /// moves leases later, so views stay valid.
    pub fn extend_leases(&self, within: Nanos) {
        let now = self.clock.now();
        let horizon = now.saturating_add(within);
        for entry in self.instances.iter() {
            let deadline = self.deadline(now, entry.instance.ttl_ns);
            if entry.lease.deadline() < horizon && deadline > entry.lease.deadline() {
                self.move_lease(entry.key(), &entry.lease, deadline);
            }
        }
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

    /// The DNS side of an instance stored under `id`; an unconfirmed one is not served.
    fn member(&self, id: &Arc<str>, instance: &Instance, lease: Arc<Lease>, confirmed: bool) -> Arc<Member> {
        // The protocol's name is shared with the `protocols` index, which holds every protocol in use.
        let protocol = self
            .protocols
            .get(instance.protocol.as_str())
            .map_or_else(|| instance.protocol.as_str().into(), |e| e.key().clone());
        Arc::new(Member {
            id: id.clone(),
            protocol,
            healthy: instance.healthy && confirmed,
            lease,
            records: InstanceRecords::new(instance),
        })
    }

    fn put_member(&self, service: &str, member: Arc<Member>) {
        let replaced = {
            // The owned key is made only for a service's first member.
            let mut view = match self.services.get_mut(service) {
                Some(view) => view,
                None => self.services.entry(service.to_owned()).or_default(),
            };
            ServiceView::change(&mut view, |members| members.insert(member.clone()))
        };
        self.view_changes.fetch_add(1, Ordering::Release);
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
                let removed = ServiceView::change(view.get_mut(), |members| members.remove(id));
                if view.get().members.is_empty() {
                    view.remove();
                }
                removed
            }
            MapEntry::Vacant(_) => None,
        };
        self.view_changes.fetch_add(1, Ordering::Release);
        if let Some(member) = removed {
            self.count_protocol(&member.protocol, service, false);
        }
    }

    /// Keeps `protocols` in step with the views. Never called while a view entry is locked,
    /// so readers may hold a protocol entry while they look views up.
    fn count_protocol(&self, protocol: &Arc<str>, service: &str, add: bool) {
        if add {
            *self
                .protocols
                .entry(protocol.clone())
                .or_default()
                .entry(service.to_owned())
                .or_default() += 1;
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
                self.view(service)
                    .is_some_and(|v| v.answerable(now).any(|m| *m.protocol == *protocol))
            })
        })
    }

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
    fn stamp(
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
            if self.park(&id, now) {
                continue;
            }
            // A heartbeat may have renewed the lease since it was taken from the index; the
            // check under the entry's lock settles the race.
            if let Some((id, entry)) = self.instances.remove_if(&id, |_, e| !e.lease.alive(now)) {
                self.forget(&id, &entry);
                info!(id = %id, service = %entry.instance.name, "instance expired");
                crate::metrics::expiry();
                removed += 1;
            }
        }
        removed
    }

    /// Keeps an instance whose lease lapsed unseen (see [`Self::unseen`]) for one more TTL
    /// from `now`, not served: its registrant may be alive and heart-beating into a registry
    /// that could not hear it. A heartbeat, registration or passing check confirms it; with
    /// none, the next reap after that TTL removes it. Returns whether it was parked.
    ///
    /// No Eureka-style self-preservation beyond this: when many leases lapse while the
    /// registry is running and scheduled, their registrants (or the network to them) failed,
    /// and they expire as their leases say.
    fn park(&self, id: &Arc<str>, now: Nanos) -> bool {
        let Some(mut entry) = self.instances.get_mut(id) else {
            return false;
        };
        let lapsed = entry.lease.deadline();
        // An unconfirmed one is parked again if its extension, too, ran out unseen.
        if entry.lease.alive(now) || !self.unseen(lapsed) {
            return false;
        }
        let deadline = self.deadline(now, entry.instance.ttl_ns);
        entry.lease.set(deadline);
        self.leases.reschedule(id, None, deadline);
        entry.unconfirmed = true;
        let member = self.member(id, &entry.instance, entry.lease.clone(), false);
        self.put_member(&entry.instance.name, member.clone());
        entry.member = member;
        info!(id = %id, service = %entry.instance.name,
              "lease lapsed while the registry could not see heartbeats; kept unserved until confirmed");
        true
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
        // A passing check confirms an instance parked by the registry's outage.
        let confirms = healthy && entry.unconfirmed;
        if entry.instance.healthy == healthy && !confirms {
            return false;
        }
        entry.instance.healthy = healthy;
        entry.unconfirmed &= !healthy;
        let confirmed = !entry.unconfirmed;
        let member = self.member(entry.key(), &entry.instance, entry.lease.clone(), confirmed);
        self.put_member(&entry.instance.name, member.clone());
        entry.member = member;
        let id = entry.key().clone();
        drop(entry);
        self.bump();
        self.emit(Event::HealthChanged(id));
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

    /// Makes the revision at least `floor`, so it keeps growing across restarts.
    pub fn raise_revision(&self, floor: u64) {
        self.revision.fetch_max(floor, Ordering::AcqRel);
    }

    /// A live instance. An unconfirmed one reads as unhealthy: it is not served.
    pub fn get(&self, id: &str) -> Option<Instance> {
        let now = self.clock.now();
        self.instances
            .get(id)
            .filter(|e| e.lease.alive(now))
            .map(|e| e.served())
    }

    /// A live instance as [`Self::get`] reads it, with its check settings (for the health
    /// checker).
    pub fn get_checked(&self, id: &str) -> Option<(Instance, Arc<CheckSpec>)> {
        let now = self.clock.now();
        self.instances
            .get(id)
            .filter(|e| e.lease.alive(now))
            .map(|e| (e.served(), e.check.clone()))
    }

    /// Live instances matching `filter`, sorted by name, then id.
    pub fn list(&self, filter: &Filter) -> Vec<Instance> {
        let now = self.clock.now();
        let keep = |e: &Entry| {
            e.lease.alive(now)
                && (!filter.healthy_only || e.instance.healthy)
                && !((filter.healthy_only || filter.confirmed_only) && e.unconfirmed)
        };
        let mut out: Vec<Instance> = match &filter.name {
            Some(name) => self
                .view(name)
                .map(|v| {
                    v.members
                        .iter()
                        .filter_map(|m| self.instances.get(&*m.id).filter(|e| keep(e)).map(|e| e.served()))
                        .collect()
                })
                .unwrap_or_default(),
            None => self.instances.iter().filter(|e| keep(e)).map(|e| e.served()).collect(),
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

    /// Every service's DNS view: what a zone transfer is cut from.
    pub fn views(&self) -> Vec<(String, Arc<ServiceView>)> {
        self.services
            .iter()
            .map(|v| (v.key().clone(), v.value().clone()))
            .collect()
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
}
