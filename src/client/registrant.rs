//! [`Registrant`]: keeps one instance registered while its process lives.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::{Client, Error, Instance};

/// Registers on start, heart-beats at a third of the TTL (with jitter, so a fleet started
/// together does not beat together), registers again after `410` (the registry lost or
/// expired the lease, e.g. restarted with an empty data directory or deregistered behind our
/// back), backs off with jitter while no registry URL answers, and deregisters on shutdown.
#[derive(Debug, Clone)]
pub struct Registrant {
    client: Arc<Client>,
    registration: Instance,
    ttl: Duration,
}

impl Registrant {
    /// `ttl` is the lease asked for; it is sent as `ttl_ns` and paces the heartbeats.
    pub fn new(client: Arc<Client>, mut registration: Instance, ttl: Duration) -> Self {
        registration.ttl_ns = i64::try_from(ttl.as_nanos()).unwrap_or(i64::MAX);
        Self {
            client,
            registration,
            ttl,
        }
    }

    /// Runs until `shutdown` completes, then deregisters. Returns an error only for what
    /// retrying cannot fix: a refused key or an invalid registration.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        tokio::pin!(shutdown);
        let mut id: Option<String> = None;
        let mut failures = 0u32;
        loop {
            let outcome = match &id {
                None => self.client.register(&self.registration).await.map(|r| {
                    tracing::info!(id = %r.id, created = r.created, "registered");
                    id = Some(r.id);
                }),
                Some(current) => match self.client.heartbeat(current).await {
                    // 404 is not what the contract says (R3: 410), but it means the same to a
                    // registrant: the registry does not know the instance.
                    Err(e @ (Error::Gone | Error::NotFound(_))) => {
                        tracing::warn!(id = %current, error = %e, "lease gone; registering again");
                        id = None;
                        continue;
                    }
                    other => other.map(drop),
                },
            };
            let pause = match outcome {
                Ok(()) => {
                    failures = 0;
                    jitter(self.ttl / 3, 0.1)
                }
                Err(e) if e.is_transient() || matches!(e, Error::Unexpected { .. }) => {
                    failures += 1;
                    tracing::warn!(error = %e, failures, "registry unreachable; backing off");
                    self.backoff(failures)
                }
                Err(e) => return Err(e),
            };
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = &mut shutdown => break,
            }
        }
        if let Some(id) = id {
            match self.client.deregister(&id).await {
                Ok(()) | Err(Error::NotFound(_) | Error::Gone) => tracing::info!(%id, "deregistered"),
                Err(e) => tracing::warn!(%id, error = %e, "could not deregister; the lease will expire"),
            }
        }
        Ok(())
    }

    /// Exponential from 100 ms, capped at a sixth of the TTL so a registry that comes back sees
    /// the instance again well within one TTL; full jitter spreads a fleet's reconnections.
    fn backoff(&self, failures: u32) -> Duration {
        let cap = (self.ttl / 6).max(Duration::from_millis(100));
        let exp = Duration::from_millis(100).saturating_mul(1 << failures.min(16));
        let ceiling = exp.min(cap);
        ceiling.mul_f64(0.5 + fastrand::f64() * 0.5)
    }
}

/// `base` moved by up to `±fraction` of itself.
fn jitter(base: Duration, fraction: f64) -> Duration {
    base.mul_f64(1.0 + fraction * (fastrand::f64() * 2.0 - 1.0))
}
