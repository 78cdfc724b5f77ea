//! The reaper (R3): the backstop that removes instances whose registrants died.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::info;

use super::Registry;

/// How often the registry looks at the monotonic clock to notice it was stopped or not
/// scheduled (see [`Registry::observe`]).
pub const WATCH_TICK: Duration = Duration::from_millis(100);

/// Sweeps every `interval`, and early when a reader met an expired instance, so that the SOA
/// serial moves soon after a lease ends even with a long interval. Watches for stalls every
/// [`WATCH_TICK`].
pub async fn run(registry: Arc<Registry>, interval: Duration, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watch = tokio::time::interval(WATCH_TICK);
    watch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = watch.tick() => {
                registry.observe();
                continue;
            }
            _ = tick.tick() => {}
            _ = registry.wait_expired_seen() => {}
        }
        registry.reap();
    }
}

impl Registry {
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

    /// Wakes the reaper early: a reader met an instance whose lease has run out.
    pub fn expired_seen(&self) {
        self.expired_seen.notify_one();
    }

    pub(crate) async fn wait_expired_seen(&self) {
        self.expired_seen.notified().await
    }
}
