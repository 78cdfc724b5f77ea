//! Health checks (R6): the checker that drives each instance's `healthy` flag.
//!
//! One task per checked instance this node owns, started and stopped by registry events
//! and by changes of the live nodes (see [`owners`]: on etcd the checks are spread over the
//! nodes, on redb every check is the one node's), so there is at most one probe in flight
//! per instance and checks end when the instance goes or moves to another node. A shared
//! semaphore bounds the probes in flight server-wide; jitter spreads them over time.

mod owners;
mod probe;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::model::check::{CheckKind, CheckSpec};
pub use probe::Target;

pub use owners::{Owners, owner};

use crate::registry::{Event, Registry};
use crate::store::Store;

#[derive(Clone, Debug)]
pub struct Settings {
    pub default_check: CheckKind,
    /// Consecutive failures that make a healthy instance unhealthy.
    pub fall: u32,
    /// Consecutive successes that make an unhealthy instance healthy.
    pub rise: u32,
    pub concurrency: usize,
}

/// What an instance's check would be now; `None` when it is not checked.
fn target_of(registry: &Registry, id: &str, default: CheckKind) -> Option<Target> {
    let (instance, check) = registry.get_checked(id)?;
    let kind = check.effective_kind(default);
    (kind != CheckKind::None).then(|| Target::new(&instance, &check, kind))
}

/// A checked instance: its check, and the task running it while this node owns it.
struct Check {
    target: Target,
    running: Option<(CancellationToken, tokio::task::JoinHandle<()>)>,
}

impl Check {
    /// Returns whether a task was running.
    fn stop(&mut self) -> bool {
        let running = self.running.take();
        if let Some((cancel, _)) = &running {
            cancel.cancel();
        }
        running.is_some()
    }
}

/// Runs until `shutdown`. `events` must be subscribed before instances are registered or
/// restored, so that none is missed. Every checked instance is known here; only those
/// `owners` gives this node are probed, and a change of the live nodes moves checks at once.
pub async fn run(
    store: Arc<Store>,
    mut events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    settings: Settings,
    shutdown: CancellationToken,
) {
    let registry = store.registry.clone();
    let mut owners = Owners::new(store.membership());
    let http = crate::tls::client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .pool_max_idle_per_host(0)
        .build()
        .expect("HTTP client");
    let permits = Arc::new(Semaphore::new(settings.concurrency));
    let mut checks: HashMap<Arc<str>, Check> = HashMap::new();
    // How many of `checks` have a task: kept as they start and stop, not counted per event
    // (every registration is an event, and there may be 100k checks).
    let mut running = 0usize;
    let start = |id: &Arc<str>, target: &Target| {
        let cancel = shutdown.child_token();
        let task = tokio::spawn(check_loop(
            store.clone(),
            id.clone(),
            target.clone(),
            settings.clone(),
            http.clone(),
            permits.clone(),
            cancel.clone(),
        ));
        Some((cancel, task))
    };
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = owners.changed() => {
                // Rendezvous hashing: only the checks of the node that left or joined move.
                let (mut started, mut stopped) = (0, 0);
                for (id, check) in &mut checks {
                    match (owners.owns(id), &check.running) {
                        (true, None) => {
                            check.running = start(id, &check.target);
                            started += 1;
                        }
                        (false, Some(_)) => {
                            check.stop();
                            stopped += 1;
                        }
                        _ => {}
                    }
                }
                running = running + started - stopped;
                info!(started, stopped, running, checked = checks.len(), "live nodes changed: health checks re-spread");
                crate::metrics::health_checks_running(running);
                continue;
            }
            event = events.recv() => match event {
                Some(event) => event,
                None => break,
            },
        };
        let target = match &event {
            Event::Upserted(id) => target_of(&registry, id, settings.default_check),
            Event::Removed(_) => None,
            Event::Renewed(_) | Event::HealthChanged(_) => continue,
        };
        let id = event.id().clone();
        let Some(target) = target else {
            if checks.remove(&id).is_some_and(|mut check| check.stop()) {
                running -= 1;
            }
            crate::metrics::health_checks_running(running);
            continue;
        };
        let owned = owners.owns(&id);
        let check = checks.entry(id.clone()).or_insert_with(|| Check {
            target: target.clone(),
            running: None,
        });
        // Unchanged settings keep the running check and its counters. A loop that ended (its
        // instance expired before this re-registration) counts as no check.
        let alive = check.running.as_ref().is_some_and(|(_, task)| !task.is_finished());
        if (check.target != target || !alive || !owned) && check.stop() {
            running -= 1;
        }
        check.target = target;
        if owned && check.running.is_none() {
            check.running = start(&id, &check.target);
            running += 1;
        }
        crate::metrics::health_checks_running(running);
    }
    for check in checks.values_mut() {
        check.stop();
    }
    crate::metrics::health_checks_running(0);
}

/// `interval` give or take 10%, so checks registered together drift apart.
fn jittered(interval: Duration) -> Duration {
    interval.mul_f64(0.9 + fastrand::f64() * 0.2)
}

async fn check_loop(
    store: Arc<Store>,
    id: Arc<str>,
    target: Target,
    settings: Settings,
    http: reqwest::Client,
    permits: Arc<Semaphore>,
    cancel: CancellationToken,
) {
    // The first probe comes within one interval, at a random point of it.
    let mut delay = target.interval.mul_f64(fastrand::f64());
    let (mut failures, mut successes) = (0u32, 0u32);
    let registry = &store.registry;
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = jittered(target.interval);
        let result = {
            let Ok(_permit) = permits.acquire().await else { return };
            let started = std::time::Instant::now();
            let result = tokio::select! {
                _ = cancel.cancelled() => return,
                result = probe::probe(&target, &http) => result,
            };
            crate::metrics::health_check(result.is_ok(), started.elapsed());
            result
        };
        let Some(instance) = registry.get(&id) else { return };
        match result {
            Ok(()) => {
                failures = 0;
                successes = successes.saturating_add(1);
                if !instance.healthy && successes >= settings.rise && store.set_health(&id, true).await {
                    info!(id = %id, service = %instance.name, check = %target.kind, "instance healthy again");
                }
            }
            Err(reason) => {
                successes = 0;
                failures = failures.saturating_add(1);
                if instance.healthy && failures >= settings.fall && store.set_health(&id, false).await {
                    warn!(id = %id, service = %instance.name, check = %target.kind, %reason, "instance unhealthy");
                }
            }
        }
    }
}
