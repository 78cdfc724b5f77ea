//! The reaper (R3): the backstop that removes instances whose registrants died.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Registry;

/// How often the registry looks at the monotonic clock to notice it was stopped or not
/// scheduled (see [`Registry::observe`]).
pub const WATCH_TICK: Duration = Duration::from_millis(100);

/// Sweeps every `interval`, and early when a reader met an expired instance, so that the SOA
/// serial moves soon after a lease ends even with a long interval. Watches for stalls every
/// [`WATCH_TICK`].
pub async fn run(registry: Arc<Registry>, interval: Duration, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watch = tokio::time::interval(WATCH_TICK);
    watch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = watch.tick() => {
                registry.observe();
                continue;
            }
            _ = tick.tick() => {}
            _ = registry.wait_expired_seen() => {}
        }
        registry.reap();
    }
}
