//! Outages of the registry itself (stopped, restarted, not scheduled, cut off from a shared
//! store): no heartbeat could arrive, so leases that ran out meanwhile lapsed unseen. They
//! are parked (kept, not served) until their registrants are heard from again, not expired.

use std::sync::Arc;

use tracing::{info, warn};

use super::Registry;
use crate::model::clock::Nanos;

/// How far the registry's own monotonic clock may jump between two observations (see
/// [`Registry::observe`], every [`super::reaper::WATCH_TICK`]) before the gap counts as a stall:
/// well above scheduling noise on a busy machine, well below any lease (`--min-ttl` 1s
/// is the floor; a stall shorter than this cannot outlast a heartbeat interval that fits
/// in a lease).
pub const STALL: std::time::Duration = std::time::Duration::from_millis(900);

/// The registry's last look at itself: when (on its clock and the monotonic one) it last
/// knew it was running and able to see heartbeats.
pub(super) struct Watch {
    pub(super) wall: Nanos,
    pub(super) mono: std::time::Instant,
}

/// Periods the registry could not see heartbeats kept for [`Registry::unseen`]; older ones
/// no longer hold any due lease.
const BLIND_KEPT: usize = 16;

impl Registry {
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

    /// Called every [`super::reaper::WATCH_TICK`]. When the monotonic clock moved more than
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
    pub(super) fn unseen(&self, deadline: Nanos) -> bool {
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

    /// Keeps an instance whose lease lapsed unseen (see [`Self::unseen`]) for one more TTL
    /// from `now`, not served: its registrant may be alive and heart-beating into a registry
    /// that could not hear it. A heartbeat, registration or passing check confirms it; with
    /// none, the next reap after that TTL removes it. Returns whether it was parked.
    ///
    /// No Eureka-style self-preservation beyond this: when many leases lapse while the
    /// registry is running and scheduled, their registrants (or the network to them) failed,
    /// and they expire as their leases say.
    pub(super) fn park(&self, id: &Arc<str>, now: Nanos) -> bool {
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
}
