//! The store: where the registry is kept, behind one narrow seam. Every mutation a client
//! is told succeeded goes through [`Store`], which hands it to one [`Backend`]: redb
//! embedded in one node ([`redb`]), or etcd shared by several ([`etcd`], with the cargo
//! feature `etcd`). The registry (`crate::registry`) holds the map, the leases, the views
//! and the reaper and knows nothing of either.
//!
//! Register and deregister hold a per-id stripe lock. A registration is committed first and
//! applied in memory after (nothing is seen before it is durable); a deregistration hides
//! the instance first and puts it back if its commit fails. A 2xx is durable, an error
//! changed nothing a reader can see.

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod redb;

use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::model::instance::{Instance, Validated};
use crate::registry::{Registered, Registry, RegistryError};

/// What a heartbeat came to ([`Store::heartbeat`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Renewal<R> {
    /// Renewed; what the caller made of the renewed instance.
    Renewed(R),
    /// The id is unknown or its lease has run out.
    Gone,
    /// The caller may not renew instances of this service; nothing was renewed.
    Refused { service: compact_str::CompactString },
}

#[derive(Clone, Debug, thiserror::Error)]
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

/// The store refused this node's settings at start (`koder-dns serve` exits 2, as for a bad
/// flag): etcd refused its certificate, its user or its role (the message starts with "etcd",
/// says which, and never holds the password), or a live node holds its `--node-id`.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// The live nodes sharing the registry (on etcd), for spreading the health checks over
/// them: this node's id and the ids of every node whose membership lease is alive, sorted.
#[derive(Clone, Debug)]
pub struct Membership {
    pub me: Arc<str>,
    pub members: tokio::sync::watch::Receiver<Arc<[Arc<str>]>>,
}

/// The store's state, for `/healthz` (under `"disk"`, on etcd too).
#[derive(Clone, Debug, serde::Serialize)]
pub struct DiskStatus {
    /// `ok`; on redb `failing` (commits fail and are retried) or `nospace` (a commit
    /// failed, the reserve was released: only removals are written until space comes
    /// back); on etcd `unreachable`.
    pub state: &'static str,
    /// Failed commits since start.
    pub failed_commits: u64,
    pub last_error: Option<String>,
}

/// The lock of one id's changes, held by a registration until it is settled.
pub type IdLock = OwnedMutexGuard<()>;

/// Where the registry is kept: what each backend does with the registry's changes.
#[async_trait::async_trait]
pub trait Backend: Send + Sync {
    /// R2, durable before visible: answered once the backend holds the registration and
    /// the registry shows it. `lock` serialises the changes of its id; hold it until then.
    async fn register(&self, new: Validated, lock: IdLock) -> Result<Registered, StoreError>;

    /// R3: renews a live lease; `Ok(false)` when the id is unknown or its lease has run out,
    /// or when `may` refuses the instance (asked before anything is renewed or written).
    /// `answer` sees the renewed instance, once, when the renewal is taken.
    async fn heartbeat(
        &self,
        id: &str,
        may: &(dyn for<'i> Fn(&'i Instance) -> bool + Send + Sync),
        answer: &mut (dyn for<'i> FnMut(&'i Instance) + Send),
    ) -> Result<bool, StoreError>;

    /// R4; true when a live instance was removed. Called with the id's lock held.
    async fn deregister(&self, id: &str) -> Result<bool, StoreError>;

    /// The health checker's verdict; true when the flag changed.
    async fn set_health(&self, id: &str, healthy: bool) -> Result<bool, StoreError>;

    /// The live nodes sharing the registry; `None` for one node (every check is its own).
    fn membership(&self) -> Option<Membership>;

    /// For `/healthz`.
    fn status(&self) -> DiskStatus;

    /// A new revision with nothing else changed, on every node sharing the store: what a
    /// signed zone's secondaries need to transfer signatures made again before they expire.
    async fn touch(&self) -> Result<(), StoreError>;

    /// Writes everything still pending and stops; an error if that failed.
    async fn close(&self) -> Result<(), String>;
}

const STRIPES: usize = 1024;

pub struct Store {
    pub registry: Arc<Registry>,
    backend: Arc<dyn Backend>,
    /// Serialises register/deregister per id so an undo never overwrites a later change.
    stripes: Box<[Arc<Mutex<()>>]>,
    hasher: RandomState,
}

impl Store {
    pub fn new(registry: Arc<Registry>, backend: Arc<dyn Backend>) -> Self {
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

    /// R2 (see [`Backend::register`]). Safe to drop at any point (a client that goes away
    /// drops its request): what the backend was handed is seen through.
    pub async fn register(&self, new: Validated) -> Result<Registered, StoreError> {
        let lock = self.stripe(&new.id).clone().lock_owned().await;
        self.backend.register(new, lock).await
    }

    /// R3 for a caller that `may` renew instances of some services only; `f` sees the
    /// renewed instance. The service is checked in the same lookup that renews, so a key
    /// limited to its services costs no second lookup of the instance.
    pub async fn heartbeat<R: Send>(
        &self,
        id: &str,
        may: impl Fn(&str) -> bool + Send + Sync,
        f: impl FnOnce(&Instance) -> R + Send,
    ) -> Result<Renewal<R>, StoreError> {
        let refused = parking_lot::Mutex::new(None);
        let check = |instance: &Instance| {
            may(&instance.name) || {
                *refused.lock() = Some(instance.name.clone());
                false
            }
        };
        let (mut f, mut out) = (Some(f), None);
        self.backend
            .heartbeat(id, &check, &mut |instance| out = f.take().map(|f| f(instance)))
            .await?;
        Ok(match (out, refused.into_inner()) {
            (Some(out), _) => Renewal::Renewed(out),
            (None, Some(service)) => Renewal::Refused { service },
            (None, None) => Renewal::Gone,
        })
    }

    /// R4; true when a live instance was removed.
    pub async fn deregister(&self, id: &str) -> Result<bool, StoreError> {
        let _lock = self.stripe(id).lock().await;
        self.backend.deregister(id).await
    }

    /// Sets the health checker's verdict; true when the flag changed. A failed write
    /// changes nothing: the checker tries again after its next probe.
    pub async fn set_health(&self, id: &str, healthy: bool) -> bool {
        match self.backend.set_health(id, healthy).await {
            Ok(changed) => changed,
            Err(e) => {
                tracing::warn!(id, healthy, error = %e, "health verdict not stored; tried again after the next probe");
                false
            }
        }
    }

    /// The live nodes, on etcd; `None` on redb (one node: every check is its own).
    pub fn membership(&self) -> Option<Membership> {
        self.backend.membership()
    }

    /// The store's state, for `/healthz`.
    pub fn disk_status(&self) -> DiskStatus {
        self.backend.status()
    }

    /// Writes everything still pending and stops the backend; an error if that failed.
    /// See [`Backend::touch`].
    pub async fn touch(&self) -> Result<(), StoreError> {
        self.backend.touch().await
    }

    pub async fn close(&self) -> Result<(), String> {
        self.backend.close().await
    }
}
