//! Health checks (R6): the checker that drives each instance's `healthy` flag.
//!
//! One task per checked instance, started and stopped by registry events, so there is at
//! most one probe in flight per instance and checks end when the instance goes. A shared
//! semaphore bounds the probes in flight server-wide; jitter spreads them over time.

mod probe;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::model::check::{CheckKind, CheckSpec};
pub use probe::Target;

use crate::registry::{Event, Registry};

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

/// Runs until `shutdown`. `events` must be subscribed before instances are registered or
/// restored, so that none is missed.
pub async fn run(
    registry: Arc<Registry>,
    mut events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    settings: Settings,
    shutdown: CancellationToken,
) {
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .pool_max_idle_per_host(0)
        .build()
        .expect("HTTP client");
    let permits = Arc::new(Semaphore::new(settings.concurrency));
    let mut checks: HashMap<Arc<str>, (Target, CancellationToken, tokio::task::JoinHandle<()>)> = HashMap::new();
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => break,
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
        // Unchanged settings keep the running check and its counters. A loop that ended (its
        // instance expired before this re-registration) counts as no check.
        if let Some((running, _, task)) = checks.get(&id)
            && Some(running) == target.as_ref()
            && !task.is_finished()
        {
            continue;
        }
        if let Some((_, cancel, _)) = checks.remove(&id) {
            cancel.cancel();
        }
        if let Some(target) = target {
            let cancel = shutdown.child_token();
            let task = tokio::spawn(check_loop(
                registry.clone(),
                id.clone(),
                target.clone(),
                settings.clone(),
                http.clone(),
                permits.clone(),
                cancel.clone(),
            ));
            checks.insert(id, (target, cancel, task));
        }
    }
    for (_, cancel, _) in checks.into_values() {
        cancel.cancel();
    }
}

/// `interval` give or take 10%, so checks registered together drift apart.
fn jittered(interval: Duration) -> Duration {
    interval.mul_f64(0.9 + fastrand::f64() * 0.2)
}

async fn check_loop(
    registry: Arc<Registry>,
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
                if !instance.healthy && successes >= settings.rise && registry.set_health(&id, true) {
                    info!(id = %id, service = %instance.name, check = %target.kind, "instance healthy again");
                }
            }
            Err(reason) => {
                successes = 0;
                failures = failures.saturating_add(1);
                if instance.healthy && failures >= settings.fall && registry.set_health(&id, false) {
                    warn!(id = %id, service = %instance.name, check = %target.kind, %reason, "instance unhealthy");
                }
            }
        }
    }
}
