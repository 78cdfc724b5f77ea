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
//!   verdict at once ([`Etcd::set_health`]), compared on the key's `mod_revision`, and every
//!   node takes the flag from its watch ([`Registry::renewed_elsewhere`]); renewal batches
//!   carry the flag each node applied, compared the same way, so none overwrites a newer one.
//! - etcd unreachable or without quorum: reads go on from the local copy, writes and
//!   heartbeats get 503, and every lease is held at least one TTL ahead, so nothing
//!   expires because its heartbeats could not be taken; the watch resumes from the last
//!   applied revision (or reloads everything after a compaction).

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use dashmap::DashMap;
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, DeleteOptions, EventType, GetOptions, KeyValue, PutOptions, Txn, TxnOp,
    TxnResponse, WatchOptions,
};
use parking_lot::Mutex;
use tokio::sync::{Notify, mpsc::UnboundedReceiver, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::disk::DiskStatus;
use super::store::StoreError;
use super::{Event, Registered, Registry};
use crate::model::clock::Nanos;
use crate::model::instance::{Instance, Validated};

/// Longest wait for one etcd call; past it a write's outcome is unknown.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait for this node's watch to deliver a committed write before answering.
const APPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// How often etcd's reachability (a quorum read) is checked.
const PROBE_EVERY: Duration = Duration::from_millis(500);
/// The expiry leader's etcd lease: a dead leader is replaced within this.
const LEADER_TTL_S: i64 = 3;
/// A node's membership lease: a node that stops renewing it (killed, cut off from etcd)
/// leaves the live members this long after its last renewal, and its health checks move.
pub const MEMBER_TTL_S: i64 = 3;
/// How often a node renews its membership lease: three tries within one TTL.
const MEMBER_RENEW_EVERY: Duration = Duration::from_secs(1);
/// Renewals (a compare and a put each) per transaction: etcd's `--max-txn-ops` is 128.
const TXN_RENEWALS: usize = 64;
/// Instances per page at start and at a reload.
const PAGE: i64 = 5000;
/// A registration decided again this often at most when other nodes keep changing its key.
const RETRIES: usize = 8;

pub struct Settings {
    pub endpoints: Vec<String>,
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

/// Connects; etcd-client balances over the endpoints and fails over between them.
async fn connect(endpoints: &[String]) -> anyhow::Result<Client> {
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_timeout(CALL_TIMEOUT)
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
        // A member cut off from the quorum cancels watches instead of going silent.
        .with_require_leader(true);
    Client::connect(endpoints, Some(options))
        .await
        .with_context(|| format!("cannot connect to etcd at {} (--etcd-endpoints)", endpoints.join(",")))
}

fn outcome_unknown(what: &str) -> StoreError {
    StoreError::OutcomeUnknown(format!("etcd did not confirm the {what} in time"))
}

/// A failed call: unknown outcome when the request may have been carried out (cancelled,
/// timed out, or an unknown answer), unavailable when it was refused.
fn classify(e: etcd_client::Error, what: &str) -> StoreError {
    match &e {
        // tonic's codes: 1 Cancelled, 2 Unknown, 4 DeadlineExceeded; etcd answers a proposal
        // it could not confirm in time with 14 Unavailable "request timed out".
        etcd_client::Error::GRpcStatus(s)
            if matches!(s.code() as i32, 1 | 2 | 4) || s.message().contains("timed out") =>
        {
            outcome_unknown(what)
        }
        _ => StoreError::Unavailable(format!("etcd refused the {what}: {e}")),
    }
}

/// A call that never reached a member: the connection was refused.
fn refused(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => s.code() as i32 == 14 && s.message().contains("connect"),
        etcd_client::Error::TransportError(_) => true,
        _ => false,
    }
}

/// Runs `call` again (a few times, quickly) when the connection was refused. etcd-client
/// balances over every endpoint and keeps sending a share of the calls to a dead member;
/// such a call carried nothing, so trying again reaches a live one.
async fn retrying<T, F, Fut>(client: &Client, mut call: F) -> Result<T, etcd_client::Error>
where
    F: FnMut(Client) -> Fut,
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    let mut tries = 0;
    loop {
        match call(client.clone()).await {
            Err(e) if refused(&e) && tries < 8 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(5 * tries)).await;
            }
            result => return result,
        }
    }
}

impl Etcd {
    /// Connects, loads the registry from etcd and starts following it. Fails when etcd
    /// cannot be read: a node that starts empty would answer NXDOMAIN for everything.
    pub async fn open(settings: Settings, registry: Arc<Registry>) -> anyhow::Result<Arc<Self>> {
        let client = connect(&settings.endpoints).await?;
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

    fn key(&self, id: &str) -> String {
        format!("{}{id}", self.instances)
    }

    /// Loads every instance at one revision, paged; ids this node holds that etcd no
    /// longer has are removed (a reload after the watch fell behind a compaction).
    async fn load(&self) -> Result<i64, etcd_client::Error> {
        let end = {
            let mut end = self.instances.clone().into_bytes();
            *end.last_mut().expect("the prefix ends in /") += 1;
            end
        };
        let mut from = self.instances.clone().into_bytes();
        let mut revision = 0;
        let mut seen = HashSet::new();
        loop {
            let mut options = GetOptions::new().with_range(end.clone()).with_limit(PAGE);
            if revision > 0 {
                options = options.with_revision(revision);
            }
            let page = retrying(&self.client, |mut client| {
                let (from, options) = (from.clone(), options.clone());
                async move { client.get(from, Some(options)).await }
            })
            .await?;
            if revision == 0 {
                revision = page.header().map_or(0, |h| h.revision());
            }
            let _applying = self.applying.lock();
            for kv in page.kvs() {
                if let Some(id) = self.apply_put(kv) {
                    seen.insert(id);
                }
            }
            match page.kvs().last() {
                Some(last) if page.more() => {
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => break,
            }
        }
        let _applying = self.applying.lock();
        let gone: Vec<Arc<str>> = self
            .revisions
            .iter()
            .map(|e| e.key().clone())
            .filter(|id| !seen.contains(id))
            .collect();
        for id in gone {
            self.apply_delete(&id, revision);
        }
        self.registry.follow_revision(revision as u64);
        self.applied.send_replace(revision);
        Ok(revision)
    }

    /// Applies a stored instance: a renewal from another node only moves the lease; anything
    /// else replaces what this node holds. Returns its id.
    fn apply_put(&self, kv: &KeyValue) -> Option<Arc<str>> {
        let key = String::from_utf8_lossy(kv.key());
        let id = key.strip_prefix(&self.instances)?;
        let instance: Instance = match serde_json::from_slice(kv.value()) {
            Ok(instance) => instance,
            Err(e) => {
                warn!(key = %key, error = %e, "not a koder-dns instance in etcd; ignored");
                return None;
            }
        };
        if instance.id != id {
            warn!(key = %key, id = %instance.id, "an instance stored under another id's key; ignored");
            return None;
        }
        let id: Arc<str> = id.into();
        self.apply_instance(id.clone(), instance, kv.mod_revision());
        Some(id)
    }

    /// Applies the state of a key at `revision`, unless a newer one is applied already.
    /// Called with [`Self::applying`] held.
    fn apply_instance(&self, id: Arc<str>, instance: Instance, revision: i64) {
        if self.revisions.get(&id).is_some_and(|known| *known >= revision) {
            return;
        }
        if !self.registry.renewed_elsewhere(&instance, self.grace) {
            // One whose lease ended before it arrived is not put back; the leader deletes it.
            self.registry.put_back(instance, self.grace);
        }
        self.revisions.insert(id, revision);
    }

    /// Applies a delete at `revision`, unless the key was written again since (a
    /// registration applied ahead of the watch). Called with [`Self::applying`] held.
    fn apply_delete(&self, id: &str, revision: i64) {
        if self.revisions.get(id).is_some_and(|known| *known > revision) {
            return;
        }
        self.registry.deregister(id);
        self.revisions.remove(id);
    }

    fn applied_to(&self, revision: i64) {
        self.registry.advance_revision(revision as u64);
        self.applied.send_if_modified(|applied| {
            let newer = revision > *applied;
            if newer {
                *applied = revision;
            }
            newer
        });
    }

    /// Follows the watch for as long as the node runs, reconnecting from the last applied
    /// revision after any break.
    async fn follow(self: Arc<Self>) {
        while !self.shutdown.is_cancelled() {
            let from = *self.applied.borrow() + 1;
            let options = WatchOptions::new().with_prefix().with_start_revision(from);
            let mut client = self.client.clone();
            let mut stream =
                match tokio::time::timeout(CALL_TIMEOUT, client.watch(self.instances.clone(), Some(options))).await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(e)) => {
                        self.failed(&format!("cannot watch etcd: {e}"));
                        self.pause(Duration::from_millis(200)).await;
                        continue;
                    }
                    Err(_) => {
                        self.failed("cannot watch etcd: no answer");
                        continue;
                    }
                };
            loop {
                let message = tokio::select! {
                    _ = self.shutdown.cancelled() => return,
                    _ = self.progress.notified() => {
                        let _ = stream.request_progress().await;
                        continue;
                    }
                    message = stream.message() => message,
                };
                let response = match message {
                    Ok(Some(response)) => response,
                    Ok(None) => break,
                    Err(e) => {
                        self.failed(&format!("the etcd watch broke: {e}"));
                        break;
                    }
                };
                if response.canceled() {
                    if response.compact_revision() > 0 {
                        warn!(
                            from,
                            compacted = response.compact_revision(),
                            "etcd compacted past this node's last revision; reloading the whole registry"
                        );
                        if let Err(e) = self.load().await {
                            self.failed(&format!("cannot reload the registry from etcd: {e}"));
                        }
                    }
                    break;
                }
                if response.events().is_empty() {
                    // A progress report: every event up to its revision was delivered.
                    if !response.created()
                        && let Some(header) = response.header()
                    {
                        self.applied_to(header.revision());
                    }
                    continue;
                }
                let mut last = 0;
                let applying = self.applying.lock();
                for event in response.events() {
                    let Some(kv) = event.kv() else { continue };
                    match event.event_type() {
                        EventType::Put => {
                            self.apply_put(kv);
                        }
                        EventType::Delete => {
                            if let Some(id) = String::from_utf8_lossy(kv.key()).strip_prefix(&self.instances) {
                                self.apply_delete(id, kv.mod_revision());
                            }
                        }
                    }
                    last = last.max(kv.mod_revision());
                }
                self.applied_to(last);
                drop(applying);
            }
            self.pause(Duration::from_millis(100)).await;
        }
    }

    async fn pause(&self, d: Duration) {
        tokio::select! {
            _ = self.shutdown.cancelled() => {}
            _ = tokio::time::sleep(d) => {}
        }
    }

    fn failed(&self, error: &str) {
        self.failures.fetch_add(1, Ordering::Relaxed);
        let mut last = self.last_error.lock();
        if last.as_deref() != Some(error) {
            warn!(%error, "etcd");
        }
        *last = Some(error.to_owned());
    }

    /// Returns once this node applied `revision`, asking the watch for progress if no
    /// event brings it there.
    async fn wait_applied(&self, revision: i64) -> Result<(), StoreError> {
        let mut applied = self.applied.subscribe();
        let deadline = Instant::now() + APPLY_TIMEOUT;
        let mut wait = Duration::from_millis(50);
        loop {
            if *applied.borrow_and_update() >= revision {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(StoreError::Unavailable(format!(
                    "etcd committed revision {revision} but this node's watch has not delivered it within 5s; \
                     other nodes may show it already"
                )));
            }
            if tokio::time::timeout(wait, applied.changed()).await.is_err() {
                self.progress.notify_one();
                wait = Duration::from_millis(200);
            }
        }
    }

    /// One etcd call under [`CALL_TIMEOUT`] (tried again on a refused connection); a
    /// timeout leaves the outcome unknown.
    async fn call<T, F, Fut>(&self, what: &str, call: F) -> Result<T, StoreError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let started = Instant::now();
        let result = match tokio::time::timeout(CALL_TIMEOUT, retrying(&self.client, call)).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(classify(e, what)),
            Err(_) => Err(outcome_unknown(what)),
        };
        // The same series as redb's commits: an operator's dashboard works for both stores.
        crate::metrics::store_commit(result.is_ok(), started.elapsed());
        result
    }

    async fn txn(&self, what: &str, txn: Txn) -> Result<TxnResponse, StoreError> {
        self.call(what, |mut client| {
            let txn = txn.clone();
            async move { client.txn(txn).await }
        })
        .await
    }

    /// Refuses at once while etcd is unreachable (see [`Self::probe`]).
    pub fn writable(&self) -> Result<(), StoreError> {
        if self.reachable.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(StoreError::Unavailable(
                "etcd is unreachable or has no quorum; this node answers reads from its copy".into(),
            ))
        }
    }

    /// R2 as an etcd transaction; see the module's documentation.
    pub async fn register(&self, new: Validated) -> Result<Registered, StoreError> {
        self.writable()?;
        for _ in 0..RETRIES {
            // Read before the registry: the registry is updated before the revision, so the
            // state decided from is never older than the revision compared on.
            let known = self.revisions.get(new.id.as_str()).map_or(0, |r| *r);
            let prepared = self.registry.prepare(new.clone())?;
            let created = prepared.created();
            let instance = prepared.instance.clone();
            self.registry.cancel(prepared);
            match self.put_compared("registration", &instance, known).await? {
                Ok(()) => return Ok(Registered { instance, created }),
                // Another node changed the key: catch up to that change, then decide again.
                Err(revision) => self.wait_applied(revision).await?,
            }
        }
        Err(StoreError::Unavailable(
            "the instance kept changing on other nodes during this registration; retry".into(),
        ))
    }

    /// Puts `instance` under its key if the key is still at `known` (its `mod_revision` as
    /// this node last applied it). On success this node applies it at once: read-your-writes
    /// without waiting for the watch, since etcd says the key holds this instance at the
    /// answer's revision; the watch's later delivery of that revision is then a no-op, and
    /// anything newer still wins (see `apply_instance`). Only the registry's revision waits
    /// for the watch, so it stays etcd's everywhere. `Err(revision)`: another node changed
    /// the key; catch up to `revision` before deciding again.
    async fn put_compared(&self, what: &str, instance: &Instance, known: i64) -> Result<Result<(), i64>, StoreError> {
        let key = self.key(&instance.id);
        let json = serde_json::to_vec(instance).expect("instances serialise");
        let txn = Txn::new()
            .when([Compare::mod_revision(key.clone(), CompareOp::Equal, known)])
            .and_then([TxnOp::put(key, json, None)]);
        let answer = self.txn(what, txn).await?;
        let revision = answer.header().map_or(0, |h| h.revision());
        if !answer.succeeded() {
            return Ok(Err(revision));
        }
        let _applying = self.applying.lock();
        if *self.applied.borrow() < revision {
            self.apply_instance(instance.id.as_str().into(), instance.clone(), revision);
        }
        Ok(Ok(()))
    }

    /// R4 as an etcd delete. True when a live instance was removed.
    pub async fn deregister(&self, id: &str) -> Result<bool, StoreError> {
        self.writable()?;
        let alive = self.registry.get(id).is_some();
        let key = self.key(id);
        let answer = self
            .call("deregistration", |mut client| {
                let key = key.clone();
                async move { client.delete(key, None).await }
            })
            .await?;
        if answer.deleted() == 0 {
            return Ok(false);
        }
        self.wait_applied(answer.header().map_or(0, |h| h.revision())).await?;
        Ok(alive)
    }

    /// Writes the renewed leases every `interval`, and once more at shutdown.
    async fn write_renewals(self: Arc<Self>, mut events: UnboundedReceiver<Event>, interval: Duration) {
        let mut dirty = HashSet::new();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let closing = tokio::select! {
                _ = self.shutdown.cancelled() => true,
                _ = tick.tick() => false,
            };
            while let Ok(event) = events.try_recv() {
                if let Event::Renewed(id) = event {
                    dirty.insert(id);
                }
            }
            if !dirty.is_empty() && (closing || self.reachable.load(Ordering::Acquire)) {
                dirty = self.write_batch(std::mem::take(&mut dirty)).await;
            }
            if closing {
                if !dirty.is_empty() {
                    warn!(pending = dirty.len(), "renewals not written to etcd at shutdown");
                }
                return;
            }
        }
    }

    /// Writes renewals, each compared on the revision this node knows of its key: a key
    /// re-registered, deregistered or expired elsewhere meanwhile keeps that change.
    /// Returns the ids to try again.
    async fn write_batch(&self, ids: HashSet<Arc<str>>) -> HashSet<Arc<str>> {
        let renewals: Vec<(Arc<str>, i64, Vec<u8>)> = ids
            .into_iter()
            .filter_map(|id| {
                let known = *self.revisions.get(&id)?;
                let instance = self.registry.to_persist(&id)?;
                Some((id, known, serde_json::to_vec(&instance).expect("instances serialise")))
            })
            .collect();
        let mut retry = HashSet::new();
        for chunk in renewals.chunks(TXN_RENEWALS) {
            let txn = |renewals: &[(Arc<str>, i64, Vec<u8>)]| {
                let compares: Vec<Compare> = renewals
                    .iter()
                    .map(|(id, known, _)| Compare::mod_revision(self.key(id), CompareOp::Equal, *known))
                    .collect();
                let puts: Vec<TxnOp> = renewals
                    .iter()
                    .map(|(id, _, json)| TxnOp::put(self.key(id), json.clone(), None))
                    .collect();
                Txn::new().when(compares).and_then(puts)
            };
            match self.txn("renewals", txn(chunk)).await {
                Ok(answer) if answer.succeeded() => {}
                Ok(_) => {
                    // One of them changed since this node last applied it: the others still
                    // go, one by one. A failed one is tried again at the next batch with the
                    // revision known then (this node's own previous batch may simply not
                    // have come back through the watch yet); one deleted meanwhile is not.
                    for one in chunk.chunks(1) {
                        match self.txn("renewal", txn(one)).await {
                            Ok(answer) if answer.succeeded() => {}
                            _ => {
                                retry.insert(one[0].0.clone());
                            }
                        }
                    }
                }
                Err(e) => {
                    self.failed(&e.to_string());
                    retry.extend(chunk.iter().map(|(id, _, _)| id.clone()));
                }
            }
        }
        retry
    }

    /// Checks etcd with a quorum read every [`PROBE_EVERY`]. While it fails, writes and
    /// heartbeats are refused and leases are held ahead (nothing expires for want of a
    /// heartbeat nobody could take); when it answers again, every lease gets a full TTL.
    async fn probe(self: Arc<Self>) {
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

    /// Campaigns for the leader key; while held, deletes what expired every `every`.
    async fn lead(self: Arc<Self>, every: Duration) {
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
    async fn campaign(&self) -> Result<Option<(i64, i64)>, etcd_client::Error> {
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

    async fn reap_while_leading(&self, lease: i64, created: i64, every: Duration) {
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
    async fn delete_expired(&self, created: i64) {
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

    /// Puts this node's membership key on a fresh lease of [`MEMBER_TTL_S`]; returns the lease.
    async fn join(&self) -> Result<i64, etcd_client::Error> {
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
    async fn stay_member(self: Arc<Self>, mut lease: i64) {
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
    async fn load_members(&self) -> Result<i64, etcd_client::Error> {
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

    fn set_members(&self, members: std::collections::BTreeSet<Arc<str>>) {
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
    async fn follow_members(self: Arc<Self>, mut revision: i64) {
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
    pub fn membership(&self) -> super::store::Membership {
        super::store::Membership {
            me: self.node_id.as_str().into(),
            members: self.members.subscribe(),
        }
    }

    /// The owner's health verdict as an etcd transaction, compared on the key's
    /// `mod_revision` like a renewal: when the key changed elsewhere meanwhile (a renewal
    /// batch, a re-registration) this node catches up and decides again on what it then
    /// holds; a deregistration ends it. Applied here at once, on the other nodes through
    /// their watch. True when the flag changed.
    pub async fn set_health(&self, id: &str, healthy: bool) -> Result<bool, StoreError> {
        self.writable()?;
        for _ in 0..RETRIES {
            // Read before the registry, as a registration does.
            let Some(known) = self.revisions.get(id).map(|r| *r) else {
                return Ok(false);
            };
            let Some(mut instance) = self.registry.to_persist(id) else {
                return Ok(false);
            };
            if instance.healthy == healthy {
                // Stored already; a passing check still confirms an instance parked after
                // every node was down (see [`Registry::blind_between`]), here.
                return Ok(self.registry.set_health(id, healthy));
            }
            instance.healthy = healthy;
            match self.put_compared("health verdict", &instance, known).await? {
                Ok(()) => {
                    self.registry.set_health(id, healthy);
                    return Ok(true);
                }
                Err(revision) => self.wait_applied(revision).await?,
            }
        }
        Err(StoreError::Unavailable(
            "the instance kept changing on other nodes; the verdict is decided again after the next probe".into(),
        ))
    }

    /// The connection's state for `/healthz`, in the disk's shape: `ok` or `unreachable`.
    pub fn status(&self) -> DiskStatus {
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
    pub async fn close(&self) -> Result<(), String> {
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

/// `koder-dns migrate --to-etcd`: copies the redb registry under `--data-dir` into etcd,
/// every instance stamped as renewed now (its registrant could not heart-beat while the
/// registry was being moved: it gets one full lease on the new one). Returns how many.
pub async fn migrate(
    data_dir: &std::path::Path,
    endpoints: &[String],
    prefix: &str,
    force: bool,
) -> anyhow::Result<usize> {
    let dir = data_dir.to_owned();
    let (db, path, loaded) = tokio::task::spawn_blocking(move || super::disk::open(&dir)).await??;
    drop(db);
    let mut client = connect(endpoints).await?;
    let held = client
        .get(
            prefix.to_owned(),
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .context("cannot read etcd")?
        .count();
    if held > 0 {
        if !force {
            anyhow::bail!(
                "etcd already holds {held} keys under {}: a registry is there; pass --force to replace it",
                prefix
            );
        }
        client
            .delete(prefix.to_owned(), Some(DeleteOptions::new().with_prefix()))
            .await
            .context("cannot clear the prefix")?;
    }
    let now = crate::model::clock::Clock::now(&crate::model::clock::SystemClock);
    let instances = format!("{}instances/", prefix);
    let total = loaded.instances.len();
    for chunk in loaded.instances.chunks(TXN_RENEWALS) {
        let puts: Vec<TxnOp> = chunk
            .iter()
            .map(|instance| {
                let instance = Instance {
                    updated_at: now,
                    ..instance.clone()
                };
                let json = serde_json::to_vec(&instance).expect("instances serialise");
                TxnOp::put(format!("{instances}{}", instance.id), json, None)
            })
            .collect();
        client
            .txn(Txn::new().and_then(puts))
            .await
            .context("cannot write to etcd")?;
    }
    info!(from = %path.display(), total, "registry copied into etcd");
    Ok(total)
}
