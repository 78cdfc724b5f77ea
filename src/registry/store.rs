//! The store: the registry's narrow write interface. Every mutation that a client is told
//! succeeded goes through here, so durable storage (and later etcd) sits behind one seam.

use std::sync::Arc;

use super::instance::{Instance, Spec};
use super::{Registered, Registry, RegistryError};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Full(#[from] RegistryError),
    #[error("durable storage is unavailable: {0}")]
    Unavailable(String),
}

pub struct Store {
    pub registry: Arc<Registry>,
}

impl Store {
    pub fn in_memory(registry: Arc<Registry>) -> Self {
        Self { registry }
    }

    pub async fn register(&self, spec: Spec) -> Result<Registered, StoreError> {
        Ok(self.registry.register(spec)?)
    }

    pub fn heartbeat(&self, id: &str) -> Option<Instance> {
        self.registry.heartbeat(id)
    }

    pub async fn deregister(&self, id: &str) -> Result<bool, StoreError> {
        Ok(self.registry.deregister(id))
    }
}
