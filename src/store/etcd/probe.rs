//! Whether etcd can take writes: a quorum read every [`PROBE_EVERY`], and at once when a
//! call timed out or found no member.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use etcd_client::GetOptions;
use tracing::info;

use super::Etcd;
use super::client::retrying;
use crate::model::clock::Nanos;

/// How often etcd's reachability (a quorum read) is checked.
pub(super) const PROBE_EVERY: Duration = Duration::from_millis(250);
/// A quorum read not answered within this: etcd is unreachable or has no quorum. With
/// [`PROBE_EVERY`], a loss is seen within a second.
const PROBE_TIMEOUT: Duration = Duration::from_millis(750);
/// While etcd cannot be reached, leases ending within this are held one TTL ahead: longer
/// than a probe's round, on a loaded machine too.
const HOLD_AHEAD: Duration = Duration::from_secs(3);

impl Etcd {
    /// Checks etcd with a quorum read every [`PROBE_EVERY`], or at once when a call
    /// suspected it (see [`Self::suspect`]). While it fails, writes and heartbeats are
    /// refused and leases are held ahead (nothing expires for want of a heartbeat nobody
    /// could take); when it answers again, every lease gets a full TTL.
    pub(super) async fn probe(self: Arc<Self>) {
        let mut down_since: Option<Instant> = None;
        loop {
            tokio::select! {
                _ = self.pause(PROBE_EVERY) => {}
                _ = self.suspected.notified() => {}
            }
            if self.shutdown.is_cancelled() {
                return;
            }
            let read = retrying(&self.client, |mut client| {
                let key = self.leader_key.clone();
                async move { client.get(key, Some(GetOptions::new().with_count_only())).await }
            });
            if matches!(tokio::time::timeout(PROBE_TIMEOUT, read).await, Ok(Ok(_))) {
                if !self.reachable.swap(true, Ordering::AcqRel) {
                    self.registry.extend_leases(Nanos::MAX);
                    info!(
                        down_ms = down_since.take().map_or(0, |since| since.elapsed().as_millis() as u64),
                        "etcd reachable again: writes accepted, every lease renewed for one TTL"
                    );
                    *self.last_error.lock() = None;
                }
            } else {
                down_since.get_or_insert_with(Instant::now);
                self.unreachable();
            }
        }
    }

    /// A call timed out or reached no member: etcd may be gone. Writes are refused and
    /// leases held from now until the probe, asked to look at once, says otherwise.
    pub(super) fn suspect(&self) {
        self.unreachable();
        self.suspected.notify_one();
    }

    fn unreachable(&self) {
        if self.reachable.swap(false, Ordering::AcqRel) {
            self.failed("etcd is unreachable or has no quorum: writes get 503, reads go on, nothing expires");
        }
        self.registry.extend_leases(HOLD_AHEAD.as_nanos() as Nanos);
    }
}
