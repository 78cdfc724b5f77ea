//! `--store etcd`: any number of equal nodes share one registry kept in etcd v3.
//!
//! Each node keeps the same in-memory [`Registry`] as a single node does, and answers DNS
//! and reads from it; etcd is the source of truth it follows:
//!
//! - At start every instance under `<prefix>instances/` is loaded at one etcd revision, then
//!   an etcd watch from the next revision applies every put and delete. The registry's
//!   revision is etcd's ([`Registry::follow_revision`]), the same on every node.
//! - Register and deregister are etcd transactions, answered only once this node shows
//!   them (read-your-writes): a registration applies its own committed write at once, a
//!   deregistration waits for the watch to deliver it. A registration compares the key's
//!   `mod_revision` with the one this node last applied and computed `created` and
//!   `registered_at` from: when another node changed the key meanwhile the compare fails,
//!   the node catches up and decides again; it never reads before writing.
//! - Heartbeats renew in memory, as on redb; the renewals are written every
//!   `--persist-interval` in grouped transactions, one Raft write per batch of 64 renewed
//!   instances rather than one per heartbeat. Other nodes extend the lease when the write
//!   reaches them, so each node's lease for an instance ends at the last renewal written +
//!   TTL + `--persist-interval`.
//! - Every node hides an instance at the instant its lease ends, as on redb; one node, the
//!   holder of the `<prefix>leader` key (on an etcd lease), deletes expired keys, each
//!   compared on its `mod_revision` (a renewal that raced it wins) and on the leader key's
//!   `create_revision` (a former leader's late delete fails).
//! - Health checks are spread over the live nodes: each node keeps `<prefix>members/<id>`
//!   on an etcd lease of [`MEMBER_TTL_S`] and follows the others' keys (see
//!   the health checker for who probes what). The owner of an instance writes its
//!   verdict at once (`Etcd::set_health`), compared on the key's `mod_revision`, and every
//!   node takes the flag from its watch ([`Registry::renewed_elsewhere`]); renewal batches
//!   carry the flag each node applied, compared the same way, so none overwrites a newer one.
//! - etcd unreachable or without quorum: reads go on from the local copy, writes and
//!   heartbeats get 503, and every lease is held at least one TTL ahead, so nothing
//!   expires because its heartbeats could not be taken; the watch resumes from the last
//!   applied revision (or reloads everything after a compaction).

mod admission;
mod client;
mod follow;
mod leader;
mod members;
mod migrate;
mod probe;
mod renewals;
mod write;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use dashmap::DashMap;
use etcd_client::Client;
use parking_lot::Mutex;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Backend, DiskStatus, IdLock, Membership, StoreError};
use crate::model::clock::Nanos;
use crate::model::instance::{Instance, Validated};
use crate::registry::{Registered, Registry};
pub use admission::Refused;
use client::{CALL_TIMEOUT, connect, retrying};
pub use members::MEMBER_TTL_S;
pub use migrate::migrate;

pub struct Settings {
    /// The endpoints, TLS and the user.
    pub connection: crate::cluster::Connection,
    pub prefix: String,
    pub node_id: String,
    /// `--persist-interval`: renewals are written this often, so other nodes' leases get it as grace.
    pub persist_interval: Duration,
    /// `--reaper-interval`: how often the leader deletes what expired.
    pub reaper_interval: Duration,
}

pub struct Etcd {
    client: Client,
    /// `<prefix>instances/`.
    instances: String,
    leader_key: String,
    /// When the expiry leader last ran, on its clock: tells a start after every node was
    /// down how long heartbeats could not be taken (see [`Self::open`]).
    alive_key: String,
    node_id: String,
    registry: Arc<Registry>,
    /// The `mod_revision` of every key this node applied: what a registration compares on.
    /// Updated after the registry, read before it (see [`Self::register`]).
    revisions: DashMap<Arc<str>, i64>,
    /// The last etcd revision this node's watch applied.
    applied: watch::Sender<i64>,
    /// Held while a change is applied, by the watch and by a registration applying its own
    /// committed write ahead of the watch (see [`Self::register`]), so that neither applies
    /// a key's older state over a newer one.
    applying: Mutex<()>,
    /// Asks the watch for a progress report: a revision with no event under the prefix
    /// (another key's, a failed compare's) is only known applied through one.
    progress: Notify,
    reachable: AtomicBool,
    grace: Nanos,
    failures: AtomicU64,
    last_error: Mutex<Option<String>>,
    shutdown: CancellationToken,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// The etcd lease of the leader key while this node holds it.
    leader_lease: Mutex<Option<i64>>,
    /// `<prefix>members/`: one key per live node, on that node's own lease.
    members_prefix: String,
    /// The live nodes' ids, sorted, as this node last saw them.
    members: watch::Sender<Arc<[Arc<str>]>>,
    /// The etcd lease of this node's membership key.
    member_lease: Mutex<Option<i64>>,
}

impl Etcd {
    /// Connects, loads the registry from etcd and starts following it. Fails when etcd
    /// cannot be read: a node that starts empty would answer NXDOMAIN for everything.
    pub async fn open(settings: Settings, registry: Arc<Registry>) -> anyhow::Result<Arc<Self>> {
        let client = connect(&settings.connection, &settings.prefix).await?;
        let etcd = Arc::new(Self {
            client,
            instances: format!("{}instances/", settings.prefix),
            leader_key: format!("{}leader", settings.prefix),
            alive_key: format!("{}alive_at", settings.prefix),
            node_id: settings.node_id,
            registry,
            revisions: DashMap::new(),
            applied: watch::Sender::new(0),
            applying: Mutex::new(()),
            progress: Notify::new(),
            reachable: AtomicBool::new(true),
            grace: settings.persist_interval.as_nanos() as i64,
            failures: AtomicU64::new(0),
            last_error: Mutex::new(None),
            shutdown: CancellationToken::new(),
            tasks: Mutex::new(Vec::new()),
            leader_lease: Mutex::new(None),
            members_prefix: format!("{}members/", settings.prefix),
            members: watch::Sender::new(Arc::from([])),
            member_lease: Mutex::new(None),
        });
        // After every node was down, leases that ran out meanwhile are kept unserved until
        // their registrants are heard from, as after a single node's restart, instead of
        // being deleted at once (and every registrant getting 410). With other nodes
        // running, the leader wrote this a moment ago and nothing is parked.
        let alive = retrying(&etcd.client, |mut client| {
            let key = etcd.alive_key.clone();
            async move { client.get(key, None).await }
        });
        if let Ok(Ok(alive)) = tokio::time::timeout(CALL_TIMEOUT, alive).await
            && let Some(at) = alive
                .kvs()
                .first()
                .and_then(|kv| kv.value_str().ok()?.parse::<Nanos>().ok())
        {
            etcd.registry.blind_between(at, etcd.registry.now());
        }
        // Joined before serving, so that this node's share of the health checks is known
        // from its first moment; and before the load, so that the watch starts right after
        // the revision loaded (etcd delivers at once to a watch from its current revision,
        // and catches an older one up only every 100 ms).
        let lease = tokio::time::timeout(Duration::from_secs(10), etcd.join())
            .await
            .map_err(|_| anyhow::anyhow!("etcd did not answer within 10s"))
            .and_then(|r| r.map_err(anyhow::Error::from))
            .context("cannot join the live nodes in etcd")?;
        let members_revision = tokio::time::timeout(Duration::from_secs(10), etcd.load_members())
            .await
            .map_err(|_| anyhow::anyhow!("etcd did not answer within 10s"))
            .and_then(|r| r.map_err(anyhow::Error::from))
            .context("cannot read the live nodes from etcd")?;
        let revision = tokio::time::timeout(Duration::from_secs(10), etcd.load())
            .await
            .map_err(|_| anyhow::anyhow!("etcd did not answer within 10s"))
            .and_then(|r| r.map_err(anyhow::Error::from))
            .with_context(|| format!("cannot load the registry from etcd under {}", etcd.instances))?;
        info!(revision, instances = etcd.revisions.len(), node = %etcd.node_id, "registry loaded from etcd");
        let renewals = etcd.registry.subscribe();
        let tasks = vec![
            tokio::spawn(etcd.clone().stay_member(lease)),
            tokio::spawn(etcd.clone().follow_members(members_revision)),
            tokio::spawn(etcd.clone().follow()),
            tokio::spawn(etcd.clone().write_renewals(renewals, settings.persist_interval)),
            tokio::spawn(etcd.clone().probe()),
            tokio::spawn(etcd.clone().lead(settings.reaper_interval)),
        ];
        *etcd.tasks.lock() = tasks;
        Ok(etcd)
    }

    pub(super) fn key(&self, id: &str) -> String {
        format!("{}{id}", self.instances)
    }

    pub(super) async fn pause(&self, d: Duration) {
        tokio::select! {
            _ = self.shutdown.cancelled() => {}
            _ = tokio::time::sleep(d) => {}
        }
    }

    pub(super) fn failed(&self, error: &str) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        let mut last = self.last_error.lock();
        if last.as_deref() != Some(error) {
            warn!(%error, "etcd");
        }
        *last = Some(error.to_owned());
    }

    /// The connection's state for `/healthz`, in the disk's shape: `ok` or `unreachable`.
    fn status(&self) -> DiskStatus {
        DiskStatus {
            state: if self.reachable.load(Ordering::Acquire) {
                "ok"
            } else {
                "unreachable"
            },
            failed_commits: self.failures.load(Ordering::Relaxed),
            last_error: self.last_error.lock().clone(),
        }
    }

    /// Writes the pending renewals, gives up the leader key (another node takes over at
    /// once, not after its lease), leaves the live nodes and stops following.
    async fn close(&self) -> Result<(), String> {
        self.shutdown.cancel();
        let tasks = std::mem::take(&mut *self.tasks.lock());
        for task in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        // Leaving at once rather than after the lease: the other nodes take this node's
        // health checks over now.
        let leases = [self.leader_lease.lock().take(), self.member_lease.lock().take()];
        for lease in leases.into_iter().flatten() {
            let mut client = self.client.clone();
            let _ = tokio::time::timeout(CALL_TIMEOUT, client.lease_revoke(lease)).await;
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl Backend for Etcd {
    async fn register(&self, new: Validated, _lock: IdLock) -> Result<Registered, StoreError> {
        Etcd::register(self, new).await
    }

    /// Renewed in memory; the renewals are written in grouped transactions every
    /// `--persist-interval` (see [`renewals`]). An error when etcd is unreachable: the
    /// renewal could not reach the other nodes.
    async fn heartbeat(
        &self,
        id: &str,
        answer: &mut (dyn for<'i> FnMut(&'i Instance) + Send),
    ) -> Result<bool, StoreError> {
        self.writable()?;
        Ok(self.registry.heartbeat_with(id, |instance| answer(instance)).is_some())
    }

    async fn deregister(&self, id: &str) -> Result<bool, StoreError> {
        Etcd::deregister(self, id).await
    }

    async fn set_health(&self, id: &str, healthy: bool) -> Result<bool, StoreError> {
        Etcd::set_health(self, id, healthy).await
    }

    fn membership(&self) -> Option<Membership> {
        Some(Etcd::membership(self))
    }

    fn status(&self) -> DiskStatus {
        Etcd::status(self)
    }

    async fn close(&self) -> Result<(), String> {
        Etcd::close(self).await
    }
}
