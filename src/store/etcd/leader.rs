//! The expiry leader: one node, the holder of `<prefix>leader` (on an etcd lease), deletes
//! expired keys and stamps `<prefix>alive_at`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{Compare, CompareOp, PutOptions, Txn, TxnOp};
use tracing::{info, warn};

use super::Etcd;
use super::client::retrying;

/// The expiry leader's etcd lease: a dead leader is replaced within this.
pub(super) const LEADER_TTL_S: i64 = 3;

impl Etcd {
    /// Campaigns for the leader key; while held, deletes what expired every `every`.
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
        let lease = retrying(&self.client, |mut client| async move {
            client.lease_grant(LEADER_TTL_S, None).await
        })
        .await?
        .id();
        let txn = Txn::new()
            .when([Compare::create_revision(self.leader_key.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                self.leader_key.clone(),
                self.node_id.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let answer = retrying(&self.client, |mut client| {
            let txn = txn.clone();
            async move { client.txn(txn).await }
        })
        .await?;
        if !answer.succeeded() {
            let _ = retrying(
                &self.client,
                |mut client| async move { client.lease_revoke(lease).await },
            )
            .await;
            return Ok(None);
        }
        Ok(Some((lease, answer.header().map_or(0, |h| h.revision()))))
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
        let mut reaped_at = Instant::now();
        loop {
            self.pause(Duration::from_millis(500)).await;
            if self.shutdown.is_cancelled() {
                break;
            }
            let renewed = async {
                keeper.keep_alive().await?;
                answers.message().await
            };
            match tokio::time::timeout(Duration::from_secs(1), renewed).await {
                Ok(Ok(Some(answer))) if answer.ttl() > 0 => {}
                _ => {
                    warn!(node = %self.node_id, "lost the expiry leader's lease; another node takes over");
                    break;
                }
            }
            if reaped_at.elapsed() >= every {
                reaped_at = Instant::now();
                self.delete_expired(created).await;
                let alive = TxnOp::put(self.alive_key.clone(), self.registry.now().to_string(), None);
                let _ = self.txn("alive stamp", Txn::new().and_then([alive])).await;
            }
        }
        self.leader_lease.lock().take();
    }

    /// Deletes every key whose instance this node no longer serves as alive, unless it
    /// changed since (a renewal raced the delete) or this node lost the leadership.
    pub(super) async fn delete_expired(&self, created: i64) {
        let expired: Vec<(Arc<str>, i64)> = self
            .revisions
            .iter()
            .filter(|e| self.registry.get(e.key()).is_none())
            .map(|e| (e.key().clone(), *e.value()))
            .collect();
        let mut deleted = 0;
        for (id, known) in expired {
            let txn = Txn::new()
                .when([
                    Compare::mod_revision(self.key(&id), CompareOp::Equal, known),
                    Compare::create_revision(self.leader_key.clone(), CompareOp::Equal, created),
                ])
                .and_then([TxnOp::delete(self.key(&id), None)]);
            match self.txn("expiry", txn).await {
                Ok(answer) if answer.succeeded() => deleted += 1,
                Ok(_) => {}
                Err(e) => {
                    self.failed(&e.to_string());
                    break;
                }
            }
        }
        if deleted > 0 {
            info!(deleted, "expired instances deleted from etcd");
        }
    }
}
