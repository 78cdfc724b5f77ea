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
//! - The registry's revision is the `mod_revision` of `<prefix>revision`, put by every
//!   transaction that alters an answer (registrations that change something, removals,
//!   expiry deletes, health flips) and by nothing else, so renewals and memberships move
//!   nothing and every node that applied the same events shows the same revision.
//! - A heartbeat is answered 200 only once etcd holds its renewal: renewals are
//!   group-committed (see [`group`]), each a put of the instance with its new
//!   `updated_at`, compared on its `mod_revision`. Every node's lease for an instance ends
//!   at that stored `updated_at` + TTL.
//! - Every node hides an instance at the instant its lease ends, as on redb; one node, the
//!   holder of the `<prefix>leader` key (on an etcd lease), deletes expired keys as their
//!   leases end, each compared on its `mod_revision` (a renewal that raced it wins) and on
//!   the leader key's `create_revision` (a former leader's late delete fails).
//! - Health checks are spread over the live nodes: each node keeps `<prefix>members/<id>`
//!   on an etcd lease of [`MEMBER_TTL_S`] and follows the others' keys (see
//!   the health checker for who probes what). The owner of an instance writes its
//!   verdict at once (`Etcd::set_health`), compared on the key's `mod_revision`, and every
//!   node takes the flag from its watch ([`Registry::renewed_elsewhere`]); renewals carry
//!   the flag the renewing node applied, compared the same way, so none overwrites a newer
//!   one. A node cut off from etcd counts itself out of the live nodes a TTL after its last
//!   renewal and stops probing. A second node with a live node's `--node-id` is refused.
//! - etcd unreachable or without quorum: reads go on from the local copy, writes and
//!   heartbeats get 503, and every lease is held at least one TTL ahead, so nothing
//!   expires because its heartbeats could not be taken; the watch resumes from the last
//!   applied revision (or reloads everything after a compaction).

mod admission;
mod client;
mod follow;
mod group;
mod leader;
mod members;
mod migrate;
mod probe;
mod write;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use std::collections::BTreeSet;

use anyhow::Context;
use dashmap::DashMap;
use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Backend, DiskStatus, IdLock, Membership, StoreError};
use crate::model::clock::Nanos;
use crate::model::instance::{Instance, Validated};
use crate::registry::{Registered, Registry};

use client::{CALL_TIMEOUT, connect, retrying};
pub use members::MEMBER_TTL_S;
pub use migrate::migrate;

pub struct Settings {
    /// The endpoints, TLS and the user.
    pub connection: crate::cluster::Connection,
    pub prefix: String,
    pub node_id: String,
    /// `--reaper-interval`: how often the leader sweeps for what expired before it led.
    pub reaper_interval: Duration,
}

pub struct Etcd {
    client: Client,
    /// `<prefix>`: what the watch follows.
    prefix: String,
    /// `<prefix>instances/`.
    instances: String,
    /// `<prefix>revision`: its `mod_revision` is the registry's revision.
    revision_key: String,
    leader_key: String,
    /// When the expiry leader last ran, on its clock: tells a start after every node was
    /// down how long heartbeats could not be taken (see [`Self::open`]).
    alive_key: String,
    /// `<prefix>outage`: the last time every node was down, as the first node to start
    /// after it found it (see [`Self::blind_while_no_node_ran`]).
    outage_key: String,
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
    /// Asks the probe to look at once (see [`Self::suspect`]).
    suspected: Notify,
    /// Writes of instances waiting for their group (see [`group`]).
    writes: mpsc::UnboundedSender<group::Write>,
    failures: AtomicU64,
    last_error: Mutex<Option<String>>,
    shutdown: CancellationToken,
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// The etcd lease of the leader key while this node holds it.
    leader_lease: Mutex<Option<i64>>,
    /// `<prefix>members/`: one key per live node, on that node's own lease.
    members_prefix: String,
    /// The live nodes' ids as this node last read them from etcd.
    seen_members: Mutex<BTreeSet<Arc<str>>>,
    /// Whether this node counts itself among them: not once its membership lease may
    /// have ended (see `stay_member`).
    counted: AtomicBool,
    /// The live nodes' ids, sorted, as published to the health checker.
    members: watch::Sender<Arc<[Arc<str>]>>,
    /// The etcd lease of this node's membership key.
    member_lease: Mutex<Option<i64>>,
}

/// `<prefix>instances/`: one key per instance, its JSON.
fn instances_key(prefix: &str) -> String {
    format!("{prefix}instances/")
}

/// `<prefix>revision`: its `mod_revision` is the registry's revision.
fn revision_key(prefix: &str) -> String {
    format!("{prefix}revision")
}

impl Etcd {
    /// Connects, loads the registry from etcd and starts following it. Fails when etcd
    /// cannot be read: a node that starts empty would answer NXDOMAIN for everything.
    pub async fn open(settings: Settings, registry: Arc<Registry>) -> anyhow::Result<Arc<Self>> {
        let client = connect(&settings.connection, &settings.prefix).await?;
        let (writes, queue) = mpsc::unbounded_channel();
        let etcd = Arc::new(Self {
            client,
            prefix: settings.prefix.clone(),
            instances: instances_key(&settings.prefix),
            revision_key: revision_key(&settings.prefix),
            leader_key: format!("{}leader", settings.prefix),
            alive_key: format!("{}alive_at", settings.prefix),
            outage_key: format!("{}outage", settings.prefix),
            node_id: settings.node_id,
            registry,
            revisions: DashMap::new(),
            applied: watch::Sender::new(0),
            applying: Mutex::new(()),
            progress: Notify::new(),
            reachable: AtomicBool::new(true),
            suspected: Notify::new(),
            writes,
            failures: AtomicU64::new(0),
            last_error: Mutex::new(None),
            shutdown: CancellationToken::new(),
            tasks: Mutex::new(Vec::new()),
            leader_lease: Mutex::new(None),
            members_prefix: format!("{}members/", settings.prefix),
            seen_members: Mutex::new(BTreeSet::new()),
            counted: AtomicBool::new(true),
            members: watch::Sender::new(Arc::from([])),
            member_lease: Mutex::new(None),
        });
        etcd.blind_while_no_node_ran(settings.reaper_interval).await;
        // Joined before serving, so that this node's share of the health checks is known
        // from its first moment; and before the load, so that the watch starts right after
        // the revision loaded (etcd delivers at once to a watch from its current revision,
        // and catches an older one up only every 100 ms).
        let lease = match tokio::time::timeout(Duration::from_secs(10), etcd.join()).await {
            Ok(Ok(lease)) => lease,
            Ok(Err(e)) if e.is::<super::Refused>() => return Err(e),
            Ok(Err(e)) => return Err(e.context("cannot join the live nodes in etcd")),
            Err(_) => anyhow::bail!("cannot join the live nodes in etcd: etcd did not answer within 10s"),
        };
        // The revision key exists before the first load, so that every node's revision is
        // a key's `mod_revision` from the start (and at least etcd's revision then, above
        // what an older release showed).
        let create = Txn::new()
            .when([Compare::create_revision(etcd.revision_key.clone(), CompareOp::Equal, 0)])
            .and_then([etcd.changed()]);
        tokio::time::timeout(CALL_TIMEOUT, etcd.txn("revision key", create))
            .await
            .map_err(|_| anyhow::anyhow!("etcd did not answer within 2s"))
            .and_then(|r| r.map_err(anyhow::Error::from))
            .context("cannot write the revision key to etcd")?;
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
        let tasks = vec![
            tokio::spawn(etcd.clone().stay_member(lease)),
            tokio::spawn(etcd.clone().follow_members(members_revision)),
            tokio::spawn(etcd.clone().follow()),
            tokio::spawn(etcd.clone().commit_writes(queue)),
            tokio::spawn(etcd.clone().probe()),
            tokio::spawn(etcd.clone().lead(settings.reaper_interval)),
        ];
        *etcd.tasks.lock() = tasks;
        Ok(etcd)
    }

    /// After every node was down, leases that ran out meanwhile are kept unserved until
    /// their registrants are heard from (a heartbeat, a re-registration or the owner's
    /// passing check), as after a single node's restart, instead of being deleted at once
    /// (and every registrant getting 410). The expiry leader stamps `alive_at` every
    /// `reaper_interval`: with other nodes running, it did a moment ago and nothing is
    /// parked. The first node to start after a longer gap stores it as `outage`, so that
    /// the nodes starting after it (which find `alive_at` fresh again) park the same
    /// instances, and the owner's verdict confirms them on every node.
    async fn blind_while_no_node_ran(&self, reaper_interval: Duration) {
        let get = |key: String| async move {
            let read = retrying(&self.client, |mut client| {
                let key = key.clone();
                async move { client.get(key, None).await }
            });
            match tokio::time::timeout(CALL_TIMEOUT, read).await {
                Ok(Ok(answer)) => answer
                    .kvs()
                    .first()
                    .and_then(|kv| kv.value_str().ok().map(str::to_owned)),
                _ => None,
            }
        };
        let now = self.registry.now();
        if let Some(at) = get(self.alive_key.clone()).await.and_then(|v| v.parse::<Nanos>().ok()) {
            self.registry.blind_between(at, now);
            // Longer than a leader leaves it unstamped, failing over included: no node ran.
            let quiet = reaper_interval + Duration::from_secs(leader::LEADER_TTL_S as u64 + 2);
            if now.saturating_sub(at) > quiet.as_nanos() as Nanos {
                let put = TxnOp::put(self.outage_key.clone(), format!("{at} {now}"), None);
                let _ = self.txn("outage stamp", Txn::new().and_then([put])).await;
            }
        }
        if let Some((from, to)) = get(self.outage_key.clone())
            .await
            .and_then(|v| Some((v.split_once(' ')?.0.parse().ok()?, v.split_once(' ')?.1.parse().ok()?)))
        {
            self.registry.blind_between(from, to);
        }
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

    /// Gives up the leader key (another node takes over at
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

    /// Answered once etcd holds the renewal (see [`group`]).
    async fn heartbeat(
        &self,
        id: &str,
        may: &(dyn for<'i> Fn(&'i Instance) -> bool + Send + Sync),
        answer: &mut (dyn for<'i> FnMut(&'i Instance) + Send),
    ) -> Result<bool, StoreError> {
        Etcd::heartbeat(self, id, may, answer).await
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

    /// A transaction that puts the revision key alone: every node's watch moves its
    /// revision to it.
    async fn touch(&self) -> Result<(), StoreError> {
        self.writable()?;
        let op = self.changed();
        self.call("touch the revision", |mut client| {
            let txn = Txn::new().and_then([op.clone()]);
            async move { client.txn(txn).await }
        })
        .await
        .map(|_| ())
    }

    async fn close(&self) -> Result<(), String> {
        Etcd::close(self).await
    }
}
