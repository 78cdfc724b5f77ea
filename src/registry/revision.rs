//! The revision: one number that counts every change a reader can see. The SOA serial is
//! its low 32 bits, blocking queries wait for it to pass their index, and the zone
//! transfer's journal is cut at it. On a shared store (etcd) it is the store's.

use std::sync::atomic::Ordering;

use super::Registry;
use super::lease::NEVER;

impl Registry {
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

    /// A change a reader can see. Following a shared store's revision, a local change
    /// neither counts nor wakes anyone: held blocking queries wake when the store's revision
    /// of that change arrives (see [`Self::advance_revision`]), on every node alike.
    pub(super) fn bump(&self) {
        if !self.external_revision.load(Ordering::Acquire) {
            self.revision.fetch_add(1, Ordering::AcqRel);
            self.changed.notify_waiters();
        }
    }

    /// A new revision with nothing changed (see `store::Backend::touch`); on a shared
    /// store the store's own revision moves instead.
    pub fn touch(&self) {
        self.bump();
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

    /// Makes the revision at least `floor`, so it keeps growing across restarts.
    pub fn raise_revision(&self, floor: u64) {
        self.revision.fetch_max(floor, Ordering::AcqRel);
    }
}
