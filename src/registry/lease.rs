//! Leases (R3) and the expiry index the reaper sweeps.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use parking_lot::Mutex;

use crate::model::clock::Nanos;

/// Deadline of a lease that never ends (a default TTL of 0).
pub const NEVER: Nanos = Nanos::MAX;

/// The end of one instance's lease. Shared between the registry entry and the DNS view, so a
/// heartbeat moves the deadline without rebuilding any view.
#[derive(Debug)]
pub struct Lease(AtomicI64);

impl Lease {
    pub fn new(deadline: Nanos) -> Self {
        Self(AtomicI64::new(deadline))
    }

    pub fn deadline(&self) -> Nanos {
        self.0.load(Ordering::Acquire)
    }

    pub(super) fn set(&self, deadline: Nanos) {
        self.0.store(deadline, Ordering::Release)
    }

    /// Alive strictly before the deadline: at `updated_at + ttl` the instance is dead.
    pub fn alive(&self, now: Nanos) -> bool {
        now < self.deadline()
    }

    /// The TTL of records whose earliest lease ends at `earliest`: `dns_ttl`, capped by the
    /// whole seconds left, so no resolver keeps an instance past its lease.
    pub fn ttl_at(earliest: Nanos, now: Nanos, dns_ttl: u32) -> u32 {
        match earliest {
            NEVER => dns_ttl,
            d => (d.saturating_sub(now).max(0) / crate::model::clock::SECOND).min(dns_ttl as i64) as u32,
        }
    }
}

/// Ordered `(deadline, id)` pairs, so the reaper touches only what is due instead of
/// scanning every instance. A BTreeSet under one mutex costs O(log n) per renewal, about a
/// microsecond at 100k instances, and keeps exactly one entry per leased instance.
pub struct LeaseIndex {
    set: Mutex<BTreeSet<(Nanos, Arc<str>)>>,
    /// The first deadline in `set`, readable without the lock: lets readers see in one atomic
    /// load whether anything has expired.
    earliest: AtomicI64,
}

impl Default for LeaseIndex {
    fn default() -> Self {
        Self {
            set: Mutex::default(),
            earliest: AtomicI64::new(NEVER),
        }
    }
}

impl LeaseIndex {
    fn update_earliest(&self, set: &BTreeSet<(Nanos, Arc<str>)>) {
        self.earliest
            .store(set.first().map_or(NEVER, |(d, _)| *d), Ordering::Release);
    }

    /// Moves `id` from `old` to `new`; either may be [`NEVER`] (not indexed).
    pub fn reschedule(&self, id: &Arc<str>, old: Option<Nanos>, new: Nanos) {
        let mut set = self.set.lock();
        if let Some(old) = old.filter(|&d| d != NEVER) {
            set.remove(&(old, id.clone()));
        }
        if new != NEVER {
            set.insert((new, id.clone()));
        }
        self.update_earliest(&set);
    }

    pub fn remove(&self, id: &Arc<str>, deadline: Nanos) {
        if deadline != NEVER {
            let mut set = self.set.lock();
            set.remove(&(deadline, id.clone()));
            self.update_earliest(&set);
        }
    }

    /// Takes every entry due at `now` out of the index. `on_due` runs first if there are
    /// any, before readers of [`Self::any_due`] can see them gone.
    pub fn take_due(&self, now: Nanos, on_due: impl FnOnce()) -> Vec<Arc<str>> {
        let mut set = self.set.lock();
        let rest = set.split_off(&(now.saturating_add(1), Arc::from("")));
        let due = std::mem::replace(&mut *set, rest);
        if !due.is_empty() {
            on_due();
        }
        self.update_earliest(&set);
        due.into_iter().map(|(_, id)| id).collect()
    }

    /// When the earliest indexed lease ends ([`NEVER`] when none does).
    pub fn earliest(&self) -> Nanos {
        self.earliest.load(Ordering::Acquire)
    }

    /// Whether some lease has ended by `now`.
    pub fn any_due(&self, now: Nanos) -> bool {
        self.earliest.load(Ordering::Acquire) <= now
    }

    pub fn len(&self) -> usize {
        self.set.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
