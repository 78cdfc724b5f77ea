//! The live nodes: each node keeps `<prefix>members/<id>` on an etcd lease of its own and
//! follows the others' keys, for spreading the health checks (see `crate::health`).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use etcd_client::{EventType, GetOptions, WatchOptions};
use tracing::{info, warn};

use super::Etcd;
use super::client::{CALL_TIMEOUT, retrying};
use crate::store::{Membership, Refused};

/// A node's membership lease: a node that stops renewing it (killed, cut off from etcd)
/// leaves the live members this long after its last renewal, and its health checks move.
pub const MEMBER_TTL_S: i64 = 3;

/// How often a node renews its membership lease: three tries within one TTL.
pub(super) const MEMBER_RENEW_EVERY: Duration = Duration::from_secs(1);

impl Etcd {
    /// Puts this node's membership key on a fresh lease of [`MEMBER_TTL_S`], if no live
    /// node holds it; returns the lease. A node killed a moment ago may still hold it until
    /// its lease ends: the key is waited for that long (and a second more), then the id is
    /// refused ([`Refused`]): two nodes with one id would share one membership key and one
    /// share of the health checks.
    pub(super) async fn join(&self) -> anyhow::Result<i64> {
        let key = format!("{}{}", self.members_prefix, self.node_id);
        let deadline = Instant::now() + Duration::from_secs(MEMBER_TTL_S as u64 + 1);
        let lease = loop {
            let held = retrying(&self.client, |mut client| {
                let key = key.clone();
                async move { client.get(key, Some(GetOptions::new().with_count_only())).await }
            })
            .await?
            .count()
                > 0;
            // Taken in between (claimed by another node): by a live node, as far as this
            // one can tell.
            if !held && let Some((lease, _)) = self.claim(&key, MEMBER_TTL_S).await? {
                break lease;
            }
            if Instant::now() >= deadline {
                return Err(Refused(format!(
                    "--node-id {}: a live node holds this id (etcd key {key}); give each node its own --node-id",
                    self.node_id
                ))
                .into());
            }
            self.pause(Duration::from_millis(200)).await;
        };
        *self.member_lease.lock() = Some(lease);
        info!(node = %self.node_id, ttl_s = MEMBER_TTL_S, "joined the live nodes");
        Ok(lease)
    }

    /// Renews the membership lease every [`MEMBER_RENEW_EVERY`]; joins again when etcd
    /// says the lease ended. Cut off from etcd, this node counts itself out of the live
    /// nodes (and so stops probing its share) once its lease may have ended: a TTL after
    /// the last renewal etcd answered was sent, never later than the others take its share
    /// over.
    pub(super) async fn stay_member(self: Arc<Self>, mut lease: i64) {
        let ttl = Duration::from_secs(MEMBER_TTL_S as u64);
        let mut lasts_until = Instant::now() + ttl;
        let mut keeper = None;
        while !self.shutdown.is_cancelled() {
            if Instant::now() >= lasts_until {
                self.count_me(false);
            }
            let sent = Instant::now();
            let renewed = async {
                let (keeper, answers) = match &mut keeper {
                    Some(kept) => kept,
                    None => keeper.insert(self.client.clone().lease_keep_alive(lease).await?),
                };
                keeper.keep_alive().await?;
                answers.message().await
            };
            match tokio::time::timeout(MEMBER_RENEW_EVERY, renewed).await {
                Ok(Ok(Some(answer))) if answer.ttl() > 0 => {
                    lasts_until = sent + Duration::from_secs(answer.ttl() as u64);
                    self.count_me(true);
                }
                Ok(Ok(Some(_))) => {
                    warn!(node = %self.node_id, "this node's membership lease ended; joining the live nodes again");
                    self.count_me(false);
                    keeper = None;
                    match self.join().await {
                        Ok(fresh) => {
                            lease = fresh;
                            lasts_until = Instant::now() + ttl;
                            self.count_me(true);
                        }
                        Err(e) => self.failed(&format!("cannot join the live nodes: {e:#}")),
                    }
                }
                // No answer: a new keeper, on the same lease while it lasts.
                _ => keeper = None,
            }
            let next = (sent + MEMBER_RENEW_EVERY).min(lasts_until);
            tokio::select! {
                _ = self.shutdown.cancelled() => return,
                _ = tokio::time::sleep_until(next.into()) => {}
            }
        }
    }

    /// Whether this node counts itself among the live nodes it publishes.
    fn count_me(&self, live: bool) {
        if self.counted.swap(live, Ordering::AcqRel) != live {
            if !live {
                warn!(node = %self.node_id, "this node's membership lease may have ended (etcd did not renew it): it stops probing its share of the health checks");
            }
            self.publish_members();
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

    pub(super) fn set_members(&self, members: BTreeSet<Arc<str>>) {
        *self.seen_members.lock() = members;
        self.publish_members();
    }

    /// The live nodes as etcd says, without this node while it counts itself out.
    fn publish_members(&self) {
        let mut members = self.seen_members.lock().clone();
        if !self.counted.load(Ordering::Acquire) {
            members.remove(self.node_id.as_str());
        }
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
                let mut members = self.seen_members.lock().clone();
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
