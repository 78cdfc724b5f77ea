//! Whether etcd can take writes: a quorum read every [`PROBE_EVERY`].

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use etcd_client::GetOptions;
use tracing::info;

use super::Etcd;
use super::client::retrying;
use crate::model::clock::Nanos;

/// How often etcd's reachability (a quorum read) is checked.
pub(super) const PROBE_EVERY: Duration = Duration::from_millis(500);

impl Etcd {
    /// Checks etcd with a quorum read every [`PROBE_EVERY`]. While it fails, writes and
    /// heartbeats are refused and leases are held ahead (nothing expires for want of a
    /// heartbeat nobody could take); when it answers again, every lease gets a full TTL.
    pub(super) async fn probe(self: Arc<Self>) {
        let mut down_since: Option<Instant> = None;
        loop {
            self.pause(PROBE_EVERY).await;
            if self.shutdown.is_cancelled() {
                return;
            }
            let read = retrying(&self.client, |mut client| {
                let key = self.leader_key.clone();
                async move { client.get(key, Some(GetOptions::new().with_count_only())).await }
            });
            let ok = matches!(tokio::time::timeout(Duration::from_secs(1), read).await, Ok(Ok(_)));
            if ok {
                if let Some(since) = down_since.take() {
                    self.registry.extend_leases(Nanos::MAX);
                    info!(
                        down_ms = since.elapsed().as_millis() as u64,
                        "etcd reachable again: writes accepted, every lease renewed for one TTL"
                    );
                    *self.last_error.lock() = None;
                }
                self.reachable.store(true, Ordering::Release);
            } else {
                if down_since.is_none() {
                    self.failed("etcd is unreachable or has no quorum: writes get 503, reads go on, nothing expires");
                    down_since = Some(Instant::now());
                }
                self.reachable.store(false, Ordering::Release);
                self.registry
                    .extend_leases(2 * PROBE_EVERY.as_nanos() as Nanos + crate::model::clock::SECOND);
            }
        }
    }
}
