//! What changed, said to the subscribers that keep per-instance state (the health checker,
//! the durable store).

use std::sync::Arc;

use tokio::sync::mpsc;

use super::Registry;

/// What changed, for subscribers that keep per-instance state (the health checker, the
/// durable store).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// Registered, re-registered or restored: said only of what durable storage already
    /// holds (a registration after its commit, a restore from disk), so the durable store
    /// does not write it again.
    Upserted(Arc<str>),
    /// Deregistered or expired.
    Removed(Arc<str>),
    /// Lease renewed by a heartbeat: said once, then not again until the durable store has
    /// read the instance ([`Registry::to_persist`]), so a busy heartbeat costs no message.
    Renewed(Arc<str>),
    /// The health checker flipped the flag here. A flag taken from the shared store (on
    /// etcd every verdict is, the owner's own too) says nothing: it is stored already.
    HealthChanged(Arc<str>),
}

impl Event {
    pub fn id(&self) -> &Arc<str> {
        match self {
            Event::Upserted(id) | Event::Removed(id) | Event::Renewed(id) | Event::HealthChanged(id) => id,
        }
    }
}

pub(super) struct Subscriber {
    tx: mpsc::UnboundedSender<Event>,
    /// Also `Renewed` and `HealthChanged`.
    renewals: bool,
}

impl Registry {
    /// Every event, renewals and health flips included (the durable store).
    pub fn subscribe(&self) -> mpsc::UnboundedReceiver<Event> {
        self.subscribe_to(true)
    }

    /// Registrations and removals only (the health checker), so a heartbeat wakes nobody
    /// who does not care.
    pub fn subscribe_lifecycle(&self) -> mpsc::UnboundedReceiver<Event> {
        self.subscribe_to(false)
    }

    pub(super) fn subscribe_to(&self, renewals: bool) -> mpsc::UnboundedReceiver<Event> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.subscribers.lock().push(Subscriber { tx, renewals });
        rx
    }

    pub(super) fn emit(&self, event: Event) {
        let lifecycle = matches!(event, Event::Upserted(_) | Event::Removed(_));
        self.subscribers
            .lock()
            .retain(|s| !(lifecycle || s.renewals) || s.tx.send(event.clone()).is_ok());
    }
}
