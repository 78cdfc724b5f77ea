//! The store: the registry's narrow write interface. Every mutation a client is told
//! succeeded goes through here, so durable storage (redb, or etcd with `--store etcd`) sits
//! behind one seam.
//!
//! Register and deregister hold a per-id stripe lock. A registration is committed first and
//! applied in memory after (nothing is seen before it is durable); a deregistration hides
//! the instance first and puts it back if its commit fails. A 2xx is durable, an error
//! changed nothing a reader can see.

use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use tokio::sync::{Mutex, OwnedMutexGuard};

use super::disk::{Commit, Disk, Stored};
use super::{Prepared, Registered, Registry, RegistryError};
use crate::model::instance::{Instance, Validated};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Full(#[from] RegistryError),
    #[error("durable storage is unavailable: {0}")]
    Unavailable(String),
    /// The write was sent but its result never came back (a timeout): it may still take
    /// effect. Registering again is safe (R2).
    #[error("the outcome is unknown: {0}")]
    OutcomeUnknown(String),
}

/// The live nodes sharing the registry (on etcd), for spreading the health checks over
/// them: this node's id and the ids of every node whose membership lease is alive, sorted.
#[derive(Clone, Debug)]
pub struct Membership {
    pub me: Arc<str>,
    pub members: tokio::sync::watch::Receiver<Arc<[Arc<str>]>>,
}

/// Where the registry is kept.
enum Backend {
    Disk(Disk),
    #[cfg(feature = "etcd")]
    Etcd(Arc<super::etcd::Etcd>),
}

const STRIPES: usize = 1024;

pub struct Store {
    pub registry: Arc<Registry>,
    backend: Backend,
    /// Serialises register/deregister per id so an undo never overwrites a later change.
    stripes: Box<[Arc<Mutex<()>>]>,
    hasher: RandomState,
}

/// A registration handed to the disk and not yet settled, holding its id's lock. Dropped
/// before then, it hands the wait to a task of its own: the commit goes ahead regardless,
/// and a committed registration must still be shown (or a failed one's slot given back),
/// before the next change to the id.
struct Pending {
    store: Arc<Store>,
    waiting: Option<(Prepared, Commit, OwnedMutexGuard<()>)>,
}

impl Pending {
    async fn finish(mut self) -> Result<Registered, StoreError> {
        let (_, commit, _) = self.waiting.as_mut().expect("waiting until settled");
        let committed = commit.await;
        let (prepared, _, _guard) = self.waiting.take().expect("waiting until settled");
        self.store.settle(prepared, committed)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some((prepared, commit, guard)) = self.waiting.take() else {
            return;
        };
        let store = self.store.clone();
        // Outside a runtime the process is ending: there is nothing left to show it to.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                let _guard = guard;
                let _ = store.settle(prepared, commit.await);
            });
        }
    }
}

impl Store {
    pub fn new(registry: Arc<Registry>, disk: Disk) -> Self {
        Self::with_backend(registry, Backend::Disk(disk))
    }

    /// Registrations, renewals and removals go through etcd (see [`super::etcd`]).
    #[cfg(feature = "etcd")]
    pub fn etcd(registry: Arc<Registry>, etcd: Arc<super::etcd::Etcd>) -> Self {
        Self::with_backend(registry, Backend::Etcd(etcd))
    }

    fn with_backend(registry: Arc<Registry>, backend: Backend) -> Self {
        Self {
            registry,
            backend,
            stripes: (0..STRIPES).map(|_| Arc::new(Mutex::new(()))).collect(),
            hasher: RandomState::new(),
        }
    }

    fn stripe(&self, id: &str) -> &Arc<Mutex<()>> {
        &self.stripes[self.hasher.hash_one(id) as usize % STRIPES]
    }

    async fn commit(disk: &Disk, id: &str) -> Result<(), StoreError> {
        disk.write(vec![id.into()]).await.map_err(StoreError::Unavailable)
    }

    /// Durable before visible: the instance is committed first and shown only once the
    /// commit is acknowledged, so no reader (DNS, listings, export, routes, watchers) sees a
    /// registration that a `kill -9` could lose, or one answered 503.
    ///
    /// Safe to drop at any point (a client that goes away drops its request): once the
    /// commit is handed to the disk, [`Pending`] sees it through. The request's own task
    /// awaits it, rather than a task spawned per registration: that spawn and its extra
    /// wake-up cost 3-4 µs of CPU and about 5% of the registrations a second
    /// (`benches/rest-load.sh`, A/B).
    pub async fn register(self: &Arc<Self>, new: Validated) -> Result<Registered, StoreError> {
        let guard = self.stripe(&new.id).clone().lock_owned().await;
        // Without the `etcd` feature the disk is the only backend.
        #[cfg_attr(not(feature = "etcd"), allow(clippy::infallible_destructuring_match))]
        let disk = match &self.backend {
            Backend::Disk(disk) => disk,
            #[cfg(feature = "etcd")]
            Backend::Etcd(etcd) => return etcd.register(new).await,
        };
        let prepared = self.registry.prepare(new)?;
        let commit = disk.put(Stored::new(&prepared.instance));
        Pending {
            store: self.clone(),
            waiting: Some((prepared, commit, guard)),
        }
        .finish()
        .await
    }

    /// A registration's commit outcome, made visible: applied once durable (the point where
    /// a change revision is taken), given back if the commit failed.
    fn settle(&self, prepared: Prepared, committed: Result<(), String>) -> Result<Registered, StoreError> {
        match committed {
            Ok(()) => Ok(self.registry.apply(prepared)),
            Err(e) => {
                self.registry.cancel(prepared);
                Err(StoreError::Unavailable(e))
            }
        }
    }

    /// Lease renewals are persisted in batches (see [`super::disk`]), never one by one, on
    /// etcd too. `f` sees the renewed instance. An error when etcd is unreachable: the
    /// renewal could not reach the other nodes.
    pub fn heartbeat<R>(&self, id: &str, f: impl FnOnce(&Instance) -> R) -> Result<Option<R>, StoreError> {
        #[cfg(feature = "etcd")]
        if let Backend::Etcd(etcd) = &self.backend {
            etcd.writable()?;
        }
        Ok(self.registry.heartbeat_with(id, f))
    }

    /// True when a live instance was removed.
    pub async fn deregister(&self, id: &str) -> Result<bool, StoreError> {
        let _guard = self.stripe(id).lock().await;
        // Without the `etcd` feature the disk is the only backend.
        #[cfg_attr(not(feature = "etcd"), allow(clippy::infallible_destructuring_match))]
        let disk = match &self.backend {
            Backend::Disk(disk) => disk,
            #[cfg(feature = "etcd")]
            Backend::Etcd(etcd) => return etcd.deregister(id).await,
        };
        let Some(removed) = self.registry.deregister(id) else {
            return Ok(false);
        };
        if let Err(e) = Self::commit(disk, id).await {
            self.registry.put_back(removed, 0);
            return Err(e);
        }
        Ok(true)
    }

    /// Sets the health checker's verdict; true when the flag changed. On redb the flag is
    /// set here and written with the next batch; on etcd it is written at once, compared on
    /// the key's revision (a change made elsewhere meanwhile is caught up with first), and
    /// every node takes it from its watch. A failed write changes nothing: the checker
    /// tries again after its next probe.
    pub async fn set_health(&self, id: &str, healthy: bool) -> bool {
        match &self.backend {
            Backend::Disk(_) => self.registry.set_health(id, healthy),
            #[cfg(feature = "etcd")]
            Backend::Etcd(etcd) => match etcd.set_health(id, healthy).await {
                Ok(changed) => changed,
                Err(e) => {
                    tracing::warn!(id, healthy, error = %e, "health verdict not written to etcd; tried again after the next probe");
                    false
                }
            },
        }
    }

    /// The live nodes, on etcd; `None` on redb (one node: every check is its own).
    pub fn membership(&self) -> Option<Membership> {
        match &self.backend {
            Backend::Disk(_) => None,
            #[cfg(feature = "etcd")]
            Backend::Etcd(etcd) => Some(etcd.membership()),
        }
    }

    /// The disk's state, for `/healthz`; on etcd, the state of the connection to it.
    pub fn disk_status(&self) -> super::disk::DiskStatus {
        match &self.backend {
            Backend::Disk(disk) => disk.status(),
            #[cfg(feature = "etcd")]
            Backend::Etcd(etcd) => etcd.status(),
        }
    }

    /// Writes everything still pending and stops the writer; an error if that failed.
    pub async fn close(&self) -> Result<(), String> {
        match &self.backend {
            Backend::Disk(disk) => disk.close().await,
            #[cfg(feature = "etcd")]
            Backend::Etcd(etcd) => etcd.close().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::instance::Instance;
    use std::time::Duration;

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
        let (db, path, _) = super::super::disk::open(dir.path()).unwrap();
        let (registry, _clock) = Registry::on_manual_clock(3_600_000_000_000, 10);
        let registry = Arc::new(registry);
        let disk = Disk::spawn(db, path, registry.clone(), registry.subscribe(), Duration::from_secs(1));
        let store = Arc::new(Store::new(registry.clone(), disk));

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
