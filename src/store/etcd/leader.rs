//! The expiry leader: one node, the holder of `<prefix>leader` (on an etcd lease), deletes
//! expired keys and stamps `<prefix>alive_at`.
//!
//! Every node hides an instance at the end of its lease (the stored `updated_at` + TTL),
//! but the revision moves only when the delete commits: the leader reaps at each lease's
//! end and deletes what it reaped at once, with the revision key, so the serial follows
//! the expiry within a transaction's time. A sweep every `--reaper-interval` catches what
//! expired before this node led.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use tracing::{info, warn};

use super::Etcd;
use super::client::retrying;
use crate::registry::Event;

/// The expiry leader's etcd lease: a dead leader is replaced within this.
pub(super) const LEADER_TTL_S: i64 = 3;
/// How often the leader renews its lease: six tries within one TTL.
const KEEP_ALIVE_EVERY: Duration = Duration::from_millis(500);
/// Expiry deletes per transaction (a compare and a delete each, with the leader's compare
/// and the revision key: within etcd's `--max-txn-ops` of 128).
const TXN_DELETES: usize = 127;

impl Etcd {
    /// Campaigns for the leader key; while held, deletes what expires (see the module's
    /// documentation), and sweeps every `every`.
    pub(super) async fn lead(self: Arc<Self>, every: Duration) {
        while !self.shutdown.is_cancelled() {
            match self.campaign().await {
                Ok(Some((lease, created))) => self.reap_while_leading(lease, created, every).await,
                Ok(None) => {}
                Err(e) => self.failed(&format!("expiry leader campaign: {e}")),
            }
            self.pause(Duration::from_secs(1)).await;
        }
    }

    /// Takes the leader key if it is free: the key's lease and its `create_revision`.
    pub(super) async fn campaign(&self) -> Result<Option<(i64, i64)>, etcd_client::Error> {
        self.claim(&self.leader_key, LEADER_TTL_S).await
    }

    pub(super) async fn reap_while_leading(&self, lease: i64, created: i64, every: Duration) {
        let Ok((mut keeper, mut answers)) = retrying(&self.client, |mut client| async move {
            client.lease_keep_alive(lease).await
        })
        .await
        else {
            return;
        };
        *self.leader_lease.lock() = Some(lease);
        info!(node = %self.node_id, "this node is the expiry leader: it deletes expired instances from etcd");
        // The registry says which instances it removed: those it reaped are deleted at once.
        let mut removed = self.registry.subscribe_lifecycle();
        let mut ids = Vec::new();
        let mut kept_at = Instant::now();
        let mut swept_at = Instant::now();
        loop {
            let keep_at = kept_at + KEEP_ALIVE_EVERY;
            let wake = self
                .registry
                .until_next_expiry()
                .map_or(keep_at, |d| keep_at.min(Instant::now() + d));
            tokio::select! {
                _ = self.shutdown.cancelled() => break,
                _ = tokio::time::sleep_until(wake.into()) => {}
                _ = removed.recv_many(&mut ids, 1024) => {}
            }
            self.registry.reap();
            while let Ok(event) = removed.try_recv() {
                ids.push(event);
            }
            let expired: Vec<Arc<str>> = ids
                .drain(..)
                .filter_map(|event| match event {
                    Event::Removed(id) if !self.registry.holds(&id) => Some(id),
                    _ => None,
                })
                .collect();
            if !expired.is_empty() && !self.delete(created, expired).await {
                break;
            }
            if kept_at.elapsed() >= KEEP_ALIVE_EVERY {
                let renewed = async {
                    keeper.keep_alive().await?;
                    answers.message().await
                };
                match tokio::time::timeout(Duration::from_secs(1), renewed).await {
                    Ok(Ok(Some(answer))) if answer.ttl() > 0 => kept_at = Instant::now(),
                    _ => {
                        warn!(node = %self.node_id, "lost the expiry leader's lease; another node takes over");
                        break;
                    }
                }
            }
            if swept_at.elapsed() >= every {
                swept_at = Instant::now();
                let expired: Vec<Arc<str>> = self
                    .revisions
                    .iter()
                    .filter(|e| !self.registry.holds(e.key()))
                    .map(|e| e.key().clone())
                    .collect();
                if !self.delete(created, expired).await {
                    break;
                }
                let alive = TxnOp::put(self.alive_key.clone(), self.registry.now().to_string(), None);
                let _ = self.txn("alive stamp", Txn::new().and_then([alive])).await;
            }
        }
        self.leader_lease.lock().take();
    }

    /// Deletes the keys of `expired` (ids this node no longer holds), with the revision
    /// key, each unless it changed since this node applied it (a renewal or a registration
    /// raced the delete) and unless this node lost the leadership. False when etcd failed.
    async fn delete(&self, created: i64, expired: Vec<Arc<str>>) -> bool {
        let expired: Vec<(Arc<str>, i64)> = expired
            .into_iter()
            .filter_map(|id| {
                let known = *self.revisions.get(&id)?;
                Some((id, known))
            })
            .collect();
        let txn = |expired: &[(Arc<str>, i64)]| {
            let mut compares = vec![Compare::create_revision(
                self.leader_key.clone(),
                CompareOp::Equal,
                created,
            )];
            compares.extend(
                expired
                    .iter()
                    .map(|(id, known)| Compare::mod_revision(self.key(id), CompareOp::Equal, *known)),
            );
            let mut deletes: Vec<TxnOp> = expired
                .iter()
                .map(|(id, _)| TxnOp::delete(self.key(id), None))
                .collect();
            deletes.push(self.changed());
            Txn::new().when(compares).and_then(deletes)
        };
        let mut deleted = 0;
        for chunk in expired.chunks(TXN_DELETES) {
            match self.txn("expiry", txn(chunk)).await {
                Ok(answer) if answer.succeeded() => deleted += chunk.len(),
                // One of them changed (or leadership moved): the others one by one.
                Ok(_) if chunk.len() > 1 => {
                    for one in chunk.chunks(1) {
                        match self.txn("expiry", txn(one)).await {
                            Ok(answer) if answer.succeeded() => deleted += 1,
                            Ok(_) => {}
                            Err(e) => {
                                self.failed(&e.to_string());
                                return false;
                            }
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    self.failed(&e.to_string());
                    return false;
                }
            }
        }
        if deleted > 0 {
            info!(deleted, "expired instances deleted from etcd");
        }
        true
    }
}
