//! `--store redb` (the default): one node, the registry in `<data-dir>/registry.redb`
//! ([`file`]), written by one thread that groups commits ([`writer`]).
//!
//! Durable before visible: a registration is committed first and shown only once the
//! commit is acknowledged, so no reader (DNS, listings, export, routes, watchers) sees a
//! registration that a `kill -9` could lose, or one answered 503. Heartbeats and health
//! flips change memory and are written in batches every `--persist-interval`.

pub mod file;
pub mod writer;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tracing::info;

use self::writer::{Commit, Disk, Stored};
use super::{Backend, DiskStatus, IdLock, Membership, StoreError};
use crate::model::instance::{Instance, Validated};
use crate::registry::{Prepared, Registered, Registry};

/// The redb backend.
pub struct Redb {
    registry: Arc<Registry>,
    disk: Disk,
}

impl Redb {
    /// Opens the database under `data_dir`, restores the instances it holds and starts the
    /// writer.
    ///
    /// A restored lease ends at the stored `updated_at` + TTL + `persist_interval`: the
    /// stored stamp may lag the last heartbeat by one batch, so a registrant that kept
    /// heart-beating never gets 410 for a quick restart, and a dead one is served at most
    /// one batch longer. A lease that ran out while the server was down is parked unserved
    /// for one more TTL (see [`Registry::put_back`]), for a restart longer than the TTL.
    pub async fn open(data_dir: &Path, persist_interval: Duration, registry: &Arc<Registry>) -> anyhow::Result<Self> {
        let dir = data_dir.to_owned();
        let (db, path, loaded) = tokio::task::spawn_blocking(move || file::open(&dir)).await??;
        registry.raise_revision(loaded.revision.saturating_add(1));
        // No heartbeat could arrive while the registry was down: leases that ran out then are
        // kept (unserved) for one more TTL rather than dropped, so registrants that kept
        // heart-beating never get 410 for the restart.
        if let Some(alive_at) = loaded.alive_at {
            registry.blind_between(alive_at, registry.now());
        }
        let grace = persist_interval.as_nanos() as i64;
        let total = loaded.instances.len();
        let mut dead = Vec::new();
        for instance in loaded.instances {
            let id: Arc<str> = instance.id.as_str().into();
            if !registry.put_back(instance, grace) {
                dead.push(id);
            }
        }
        let unconfirmed = registry.unconfirmed();
        info!(path = %path.display(), restored = total - dead.len() - unconfirmed, unconfirmed, expired = dead.len(),
              "registry loaded from disk");
        let events = registry.subscribe();
        let disk = Disk::spawn(db, path, registry.clone(), events, persist_interval);
        if !dead.is_empty() {
            disk.write(dead)
                .await
                .map_err(|e| anyhow::anyhow!("cannot remove expired instances from disk: {e}"))?;
        }
        Ok(Self {
            registry: registry.clone(),
            disk,
        })
    }
}

/// A registration handed to the disk and not yet settled, holding its id's lock. Dropped
/// before then, it hands the wait to a task of its own: the commit goes ahead regardless,
/// and a committed registration must still be shown (or a failed one's slot given back),
/// before the next change to the id.
struct Pending {
    registry: Arc<Registry>,
    waiting: Option<(Prepared, Commit, IdLock)>,
}

impl Pending {
    async fn finish(mut self) -> Result<Registered, StoreError> {
        let (_, commit, _) = self.waiting.as_mut().expect("waiting until settled");
        let committed = commit.await;
        let (prepared, _, _lock) = self.waiting.take().expect("waiting until settled");
        settle(&self.registry, prepared, committed)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some((prepared, commit, lock)) = self.waiting.take() else {
            return;
        };
        let registry = self.registry.clone();
        // Outside a runtime the process is ending: there is nothing left to show it to.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _lock = lock;
                let _ = settle(&registry, prepared, commit.await);
            });
        }
    }
}

/// A registration's commit outcome, made visible: applied once durable (the point where a
/// change revision is taken), given back if the commit failed.
fn settle(registry: &Registry, prepared: Prepared, committed: Result<(), String>) -> Result<Registered, StoreError> {
    match committed {
        Ok(()) => Ok(registry.apply(prepared)),
        Err(e) => {
            registry.cancel(prepared);
            Err(StoreError::Unavailable(e))
        }
    }
}

#[async_trait::async_trait]
impl Backend for Redb {
    /// Once the commit is handed to the disk, [`Pending`] sees it through. The request's
    /// own task awaits it, rather than a task spawned per registration: that spawn and its
    /// extra wake-up cost 3-4 µs of CPU and about 5% of the registrations a second
    /// (`benches/rest-load.sh`, A/B).
    async fn register(&self, new: Validated, lock: IdLock) -> Result<Registered, StoreError> {
        let prepared = self.registry.prepare(new)?;
        let commit = self.disk.put(Stored::new(&prepared.instance));
        Pending {
            registry: self.registry.clone(),
            waiting: Some((prepared, commit, lock)),
        }
        .finish()
        .await
    }

    /// Renewed in memory; the renewals are written in batches (see [`writer`]).
    async fn heartbeat(
        &self,
        id: &str,
        may: &(dyn for<'i> Fn(&'i Instance) -> bool + Send + Sync),
        answer: &mut (dyn for<'i> FnMut(&'i Instance) + Send),
    ) -> Result<bool, StoreError> {
        Ok(self
            .registry
            .heartbeat_with(id, may, |instance| answer(instance))
            .is_some())
    }

    async fn deregister(&self, id: &str) -> Result<bool, StoreError> {
        let Some(removed) = self.registry.deregister(id) else {
            return Ok(false);
        };
        if let Err(e) = self.disk.write(vec![id.into()]).await {
            self.registry.put_back(removed, 0);
            return Err(StoreError::Unavailable(e));
        }
        Ok(true)
    }

    /// Set here and written with the next batch.
    async fn set_health(&self, id: &str, healthy: bool) -> Result<bool, StoreError> {
        Ok(self.registry.set_health(id, healthy))
    }

    fn membership(&self) -> Option<Membership> {
        None
    }

    fn status(&self) -> DiskStatus {
        self.disk.status()
    }

    /// The next revision, written with an empty commit (the file keeps the last revision).
    async fn touch(&self) -> Result<(), StoreError> {
        self.registry.touch();
        self.disk.write(Vec::new()).await.map_err(StoreError::Unavailable)
    }

    async fn close(&self) -> Result<(), String> {
        self.disk.close().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Store;

    fn registration(port: u16) -> Validated {
        let body = serde_json::json!({"id": "a", "name": "voice", "address": "127.0.0.1", "port": port});
        serde_json::from_value::<Instance>(body)
            .expect("a valid body")
            .validate()
            .expect("valid")
    }

    /// A client that goes away drops its request while the commit is on its way to the
    /// disk: the registration is still shown once committed, and before the id's next change.
    #[tokio::test]
    async fn a_registration_dropped_while_committing_is_applied_before_the_next_one() {
        let dir = tempfile::tempdir().unwrap();
        let (registry, _clock) = Registry::on_manual_clock(3_600_000_000_000, 10);
        let registry = Arc::new(registry);
        let redb = Redb::open(dir.path(), Duration::from_secs(1), &registry).await.unwrap();
        let store = Arc::new(Store::new(registry.clone(), Arc::new(redb)));

        // One poll: the commit is handed to the writer, then the request is dropped.
        let mut request = Box::pin(store.register(registration(1)));
        let polled = std::future::poll_fn(|cx| std::task::Poll::Ready(request.as_mut().poll(cx))).await;
        assert!(polled.is_pending(), "a commit is never on disk within one poll");
        drop(request);
        let second = store.register(registration(2)).await.unwrap();
        assert!(!second.created, "the dropped registration was applied first");
        assert_eq!(registry.get("a").map(|i| i.port), Some(2));
        assert_eq!(registry.len(), 1, "one slot for the id, none left behind");
        store.close().await.unwrap();
    }
}
