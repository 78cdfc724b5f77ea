//! [`Watcher`]: follows the edge-routing table (R5, R6) with blocking queries.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Client, Error};
use crate::export::routes::Route;

/// The shortest time between two requests whose answers showed no change: a registry that
/// answers blocking queries at once (an old one that ignores `index`, or a revision that
/// moved without changing the routes) is not polled in a tight loop.
const MIN_INTERVAL: Duration = Duration::from_secs(1);

/// Follows `GET /api/v1/routes?index=N&wait=D` and yields each new edge-routing view: one
/// route per `jet.domain`, internal-only instances left out, each instance's `healthy`
/// preserved, and domains claimed by several services flagged as `conflict`.
///
/// While no registry URL answers, the last good view stands (nothing is yielded) and the
/// watcher backs off with jitter; the [`Client`] moves to the next URL on its own.
#[derive(Debug)]
pub struct Watcher {
    client: Arc<Client>,
    wait: Duration,
    index: u64,
    last: Option<Vec<Route>>,
    failures: u32,
}

impl Watcher {
    /// `wait` is how long the registry may hold each request (at most 10m; 5m is usual).
    pub fn new(client: Arc<Client>, wait: Duration) -> Self {
        Self {
            client,
            wait,
            index: 0,
            last: None,
            failures: 0,
        }
    }

    /// The last view yielded, if any.
    pub fn last(&self) -> Option<&[Route]> {
        self.last.as_deref()
    }

    /// Waits until the routing view differs from the last one yielded (the first call answers
    /// at once) and returns it. Errors only for what waiting cannot fix (a refused key).
    pub async fn next(&mut self) -> Result<Vec<Route>, Error> {
        loop {
            let asked = Instant::now();
            match self.client.routes(self.index, self.wait).await {
                Ok((index, routes)) => {
                    self.failures = 0;
                    // A revision that went backwards is another node or a rebuilt registry:
                    // start over rather than wait for a number it may never reach again.
                    self.index = if index < self.index { 0 } else { index };
                    if self.last.as_ref() != Some(&routes) {
                        self.last = Some(routes.clone());
                        return Ok(routes);
                    }
                    let spent = asked.elapsed();
                    if spent < MIN_INTERVAL {
                        tokio::time::sleep(MIN_INTERVAL - spent).await;
                    }
                }
                Err(e) if e.is_transient() || matches!(e, Error::Unexpected { .. }) => {
                    self.failures += 1;
                    tracing::warn!(error = %e, failures = self.failures, "watch failed; keeping the last view");
                    let ceiling = Duration::from_millis(100)
                        .saturating_mul(1 << self.failures.min(16))
                        .min(Duration::from_secs(30));
                    tokio::time::sleep(ceiling.mul_f64(0.5 + fastrand::f64() * 0.5)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}
