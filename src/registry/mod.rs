//! The registry: every instance, its lease, and the per-service views DNS answers from.
//!
//! One process-wide structure shared by the REST API, the DNS authority, the reaper and the
//! health checker. Lock order is always instance entry → protocols index → service view →
//! lease index (a `protocols` entry is read while views are looked up, never the other way),
//! no lock is held across an await, and DNS holds a view's map entry only to read it (see
//! [`Registry::with_view`]), so none of them can block another for long.

mod events;
mod heartbeat;
pub mod lease;
mod members;
mod outage;
mod read;
pub mod reaper;
mod register;
mod remove;
mod restore;
mod revision;
mod verdict;
pub mod view;

#[cfg(test)]
mod tests;

pub use events::Event;
pub use outage::STALL;
pub use read::Filter;
pub use register::{Prepared, Registered, RegistryError};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use dashmap::DashMap;
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::model::check::{CheckKind, CheckSpec};
use crate::model::clock::{self, Clock, Nanos};
use crate::model::instance::Instance;
use crate::zone::records::ZoneNames;
use events::Subscriber;
use lease::{Lease, LeaseIndex, NEVER};
use outage::Watch;
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

    pub fn now(&self) -> Nanos {
        self.clock.now()
    }

    pub fn zone(&self) -> &ZoneNames {
        &self.settings.zone
    }

    /// Stored instances, including expired ones the reaper has not removed yet.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
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
}
