//! The health checker's verdict: the `healthy` flag of a checked instance.

use super::Registry;
use super::events::Event;

impl Registry {
    /// Sets the health checker's verdict. Returns whether the flag changed.
    pub fn set_health(&self, id: &str, healthy: bool) -> bool {
        let Some(mut entry) = self.instances.get_mut(id) else {
            return false;
        };
        // A passing check confirms an instance parked by the registry's outage.
        let confirms = healthy && entry.unconfirmed;
        if entry.instance.healthy == healthy && !confirms {
            return false;
        }
        entry.instance.healthy = healthy;
        entry.unconfirmed &= !healthy;
        let confirmed = !entry.unconfirmed;
        let member = self.member(entry.key(), &entry.instance, entry.lease.clone(), confirmed);
        self.put_member(&entry.instance.name, member.clone());
        entry.member = member;
        let id = entry.key().clone();
        drop(entry);
        self.bump();
        self.emit(Event::HealthChanged(id));
        true
    }
}
