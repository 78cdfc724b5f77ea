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

use tokio::sync::Mutex;

use super::disk::{Disk, Stored};
use super::{Registered, Registry, RegistryError};
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
    stripes: Box<[Mutex<()>]>,
    hasher: RandomState,
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
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
            hasher: RandomState::new(),
        }
    }

    fn stripe(&self, id: &str) -> &Mutex<()> {
        &self.stripes[self.hasher.hash_one(id) as usize % STRIPES]
    }

    async fn commit(disk: &Disk, id: &str) -> Result<(), StoreError> {
        disk.write(vec![id.into()]).await.map_err(StoreError::Unavailable)
    }

    /// Durable before visible: the instance is committed first and shown only once the
    /// commit is acknowledged, so no reader (DNS, listings, export, routes, watchers) sees a
    /// registration that a `kill -9` could lose, or one answered 503.
    pub async fn register(&self, new: Validated) -> Result<Registered, StoreError> {
        let _guard = self.stripe(&new.id).lock().await;
        // Without the `etcd` feature the disk is the only backend.
        #[cfg_attr(not(feature = "etcd"), allow(clippy::infallible_destructuring_match))]
        let disk = match &self.backend {
            Backend::Disk(disk) => disk,
            #[cfg(feature = "etcd")]
            Backend::Etcd(etcd) => return etcd.register(new).await,
        };
        let prepared = self.registry.prepare(new)?;
        if let Err(e) = disk.put(Stored::new(&prepared.instance)).await {
            self.registry.cancel(prepared);
            return Err(StoreError::Unavailable(e));
        }
        // The registration becomes visible here, after its commit: the point where a change
        // revision would be taken.
        Ok(self.registry.apply(prepared))
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
