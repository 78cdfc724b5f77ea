//! The live nodes: each node keeps `<prefix>members/<id>` on an etcd lease of its own and
//! follows the others' keys, for spreading the health checks (see `crate::health`).

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{EventType, GetOptions, PutOptions, WatchOptions};
use tracing::{info, warn};

use super::Etcd;
use super::client::{CALL_TIMEOUT, retrying};
use crate::store::Membership;

/// A node's membership lease: a node that stops renewing it (killed, cut off from etcd)
/// leaves the live members this long after its last renewal, and its health checks move.
pub const MEMBER_TTL_S: i64 = 3;

/// How often a node renews its membership lease: three tries within one TTL.
pub(super) const MEMBER_RENEW_EVERY: Duration = Duration::from_secs(1);

impl Etcd {
    /// Puts this node's membership key on a fresh lease of [`MEMBER_TTL_S`]; returns the lease.
    pub(super) async fn join(&self) -> Result<i64, etcd_client::Error> {
        let lease = retrying(&self.client, |mut client| async move {
            client.lease_grant(MEMBER_TTL_S, None).await
        })
        .await?
        .id();
        let key = format!("{}{}", self.members_prefix, self.node_id);
        retrying(&self.client, |mut client| {
            let (key, id) = (key.clone(), self.node_id.clone());
            async move { client.put(key, id, Some(PutOptions::new().with_lease(lease))).await }
        })
        .await?;
        *self.member_lease.lock() = Some(lease);
        info!(node = %self.node_id, ttl_s = MEMBER_TTL_S, "joined the live nodes");
        Ok(lease)
    }

    /// Renews the membership lease every [`MEMBER_RENEW_EVERY`]; joins again when etcd
    /// says the lease ended (this node was cut off from etcd for longer than the TTL, and
    /// the others took its health checks over meanwhile).
    pub(super) async fn stay_member(self: Arc<Self>, mut lease: i64) {
        while !self.shutdown.is_cancelled() {
            let kept = retrying(&self.client, |mut client| async move {
                client.lease_keep_alive(lease).await
            });
            let (mut keeper, mut answers) = match tokio::time::timeout(CALL_TIMEOUT, kept).await {
                Ok(Ok(kept)) => kept,
                _ => {
                    self.pause(MEMBER_RENEW_EVERY).await;
                    continue;
                }
            };
            loop {
                let renewed = async {
                    keeper.keep_alive().await?;
                    answers.message().await
                };
                match tokio::time::timeout(MEMBER_RENEW_EVERY, renewed).await {
                    Ok(Ok(Some(answer))) if answer.ttl() > 0 => {}
                    Ok(Ok(Some(_))) => {
                        warn!(node = %self.node_id, "this node's membership lease ended; joining the live nodes again");
                        self.pause(Duration::from_millis(100)).await;
                        match self.join().await {
                            Ok(fresh) => lease = fresh,
                            Err(e) => self.failed(&format!("cannot join the live nodes: {e}")),
                        }
                        break;
                    }
                    // No answer: a new keeper, on the same lease while it lasts.
                    _ => break,
                }
                self.pause(MEMBER_RENEW_EVERY).await;
                if self.shutdown.is_cancelled() {
                    return;
                }
            }
        }
    }

    /// Reads the live nodes; returns the revision read at.
    pub(super) async fn load_members(&self) -> Result<i64, etcd_client::Error> {
        let answer = retrying(&self.client, |mut client| {
            let key = self.members_prefix.clone();
            async move { client.get(key, Some(GetOptions::new().with_prefix())).await }
        })
        .await?;
        let members = answer
            .kvs()
            .iter()
            .filter_map(|kv| {
                let key = String::from_utf8_lossy(kv.key());
                key.strip_prefix(&self.members_prefix).map(Arc::<str>::from)
            })
            .collect();
        self.set_members(members);
        Ok(answer.header().map_or(0, |h| h.revision()))
    }

    pub(super) fn set_members(&self, members: std::collections::BTreeSet<Arc<str>>) {
        let members: Arc<[Arc<str>]> = members.into_iter().collect();
        self.members.send_if_modified(|known| {
            let changed = *known != members;
            if changed {
                info!(node = %self.node_id, members = ?members.iter().map(|m| &**m).collect::<Vec<_>>(), "live nodes");
                *known = members;
            }
            changed
        });
    }

    /// Follows the live nodes with a watch on `<prefix>members/` from `revision`; after a
    /// break, reads them again and watches on from there.
    pub(super) async fn follow_members(self: Arc<Self>, mut revision: i64) {
        while !self.shutdown.is_cancelled() {
            if revision == 0 {
                match tokio::time::timeout(CALL_TIMEOUT, self.load_members()).await {
                    Ok(Ok(read)) => revision = read,
                    _ => {
                        self.pause(Duration::from_millis(200)).await;
                        continue;
                    }
                }
            }
            let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
            let mut client = self.client.clone();
            let watched = client.watch(self.members_prefix.clone(), Some(options));
            let Ok(Ok(mut stream)) = tokio::time::timeout(CALL_TIMEOUT, watched).await else {
                revision = 0;
                self.pause(Duration::from_millis(200)).await;
                continue;
            };
            loop {
                let message = tokio::select! {
                    _ = self.shutdown.cancelled() => return,
                    message = stream.message() => message,
                };
                let Ok(Some(response)) = message else { break };
                if response.canceled() {
                    break;
                }
                if response.events().is_empty() {
                    continue;
                }
                let mut members: std::collections::BTreeSet<Arc<str>> = self.members.borrow().iter().cloned().collect();
                for event in response.events() {
                    let Some(kv) = event.kv() else { continue };
                    let key = String::from_utf8_lossy(kv.key());
                    let Some(id) = key.strip_prefix(&self.members_prefix) else {
                        continue;
                    };
                    match event.event_type() {
                        EventType::Put => members.insert(id.into()),
                        EventType::Delete => members.remove(id),
                    };
                }
                self.set_members(members);
            }
            // Read again rather than resume: the members are few.
            revision = 0;
            self.pause(Duration::from_millis(100)).await;
        }
    }

    /// This node's id and the live nodes, for spreading the health checks.
    pub(super) fn membership(&self) -> Membership {
        Membership {
            me: self.node_id.as_str().into(),
            members: self.members.subscribe(),
        }
    }
}
