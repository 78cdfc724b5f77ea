//! Following etcd: every instance loaded at one revision at start, then an etcd watch from
//! the next revision applies every put and delete.
//!
//! The registry's revision is the `mod_revision` of `<prefix>revision`, which every write
//! that alters an answer puts in its transaction (see [`super::write`]) and nothing else
//! does: renewals and memberships leave it, and every node that applied the same events
//! shows the same revision.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{EventType, GetOptions, KeyValue, WatchOptions};
use tracing::warn;

use super::Etcd;
use super::client::{CALL_TIMEOUT, retrying};
use crate::model::instance::Instance;
use crate::store::StoreError;

/// Longest wait for this node's watch to deliver a committed write before answering.
pub(super) const APPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// Instances per page at start and at a reload.
pub(super) const PAGE: i64 = 5000;

impl Etcd {
    /// Loads every instance at one revision, paged, and the revision key at that revision;
    /// ids this node holds that etcd no longer has are removed (a reload after the watch
    /// fell behind a compaction).
    pub(super) async fn load(&self) -> Result<i64, etcd_client::Error> {
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
        let changed = retrying(&self.client, |mut client| {
            let key = self.revision_key.clone();
            async move { client.get(key, Some(GetOptions::new().with_revision(revision))).await }
        })
        .await?
        .kvs()
        .first()
        .map_or(0, KeyValue::mod_revision);
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
        self.registry.follow_revision(changed as u64);
        self.applied.send_replace(revision);
        Ok(revision)
    }

    /// Applies a stored instance: a renewal from another node only moves the lease; anything
    /// else replaces what this node holds. Returns its id.
    pub(super) fn apply_put(&self, kv: &KeyValue) -> Option<Arc<str>> {
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
    pub(super) fn apply_instance(&self, id: Arc<str>, instance: Instance, revision: i64) {
        if self.revisions.get(&id).is_some_and(|known| *known >= revision) {
            return;
        }
        // Every node's lease ends at the stored `updated_at` + TTL: a renewal is stored
        // before it is answered, so no grace is needed for one not yet written.
        if !self.registry.renewed_elsewhere(&instance, 0) {
            // One whose lease ended before it arrived is not put back; the leader deletes it.
            self.registry.put_back(instance, 0);
        }
        self.revisions.insert(id, revision);
    }

    /// Applies a delete at `revision`, unless the key was written again since (a
    /// registration applied ahead of the watch). Called with [`Self::applying`] held.
    pub(super) fn apply_delete(&self, id: &str, revision: i64) {
        if self.revisions.get(id).is_some_and(|known| *known > revision) {
            return;
        }
        self.registry.deregister(id);
        self.revisions.remove(id);
    }

    /// The watch delivered everything up to `revision` (events or a progress report).
    pub(super) fn applied_to(&self, revision: i64) {
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
    pub(super) async fn follow(self: Arc<Self>) {
        while !self.shutdown.is_cancelled() {
            let from = *self.applied.borrow() + 1;
            // The whole prefix: the instances and the revision key (the few other keys'
            // events are skipped).
            let options = WatchOptions::new().with_prefix().with_start_revision(from);
            let mut client = self.client.clone();
            let mut stream =
                match tokio::time::timeout(CALL_TIMEOUT, client.watch(self.prefix.clone(), Some(options))).await {
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
                let (mut last, mut changed) = (0, 0);
                let applying = self.applying.lock();
                for event in response.events() {
                    let Some(kv) = event.kv() else { continue };
                    last = last.max(kv.mod_revision());
                    if kv.key() == self.revision_key.as_bytes() {
                        changed = changed.max(kv.mod_revision());
                        continue;
                    }
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
                }
                self.applied_to(last);
                drop(applying);
                // After the events of its transaction (a response holds whole revisions):
                // a watcher woken by it sees the change.
                if changed > 0 {
                    self.registry.advance_revision(changed as u64);
                }
            }
            self.pause(Duration::from_millis(100)).await;
        }
    }

    /// Returns once this node applied `revision`, asking the watch for progress if no
    /// event brings it there.
    pub(super) async fn wait_applied(&self, revision: i64) -> Result<(), StoreError> {
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
}
