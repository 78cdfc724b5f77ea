//! What readers see: listings, single instances, and the per-service DNS views. An
//! instance parked by the registry's outage reads as unhealthy: it is not served.

use std::sync::Arc;

use super::view::{Member, ServiceView};
use super::{Entry, Registry};
use crate::model::check::CheckSpec;
use crate::model::clock::Nanos;
use crate::model::instance::Instance;

/// Which instances a listing keeps.
#[derive(Debug, Default, Clone)]
pub struct Filter {
    pub name: Option<String>,
    /// Healthy and confirmed instances only (what DNS serves).
    pub healthy_only: bool,
    /// Leaves out instances parked by the registry's outage (the export and routes).
    pub confirmed_only: bool,
}

impl Registry {
    /// A live instance. An unconfirmed one reads as unhealthy: it is not served.
    pub fn get(&self, id: &str) -> Option<Instance> {
        let now = self.clock.now();
        self.instances
            .get(id)
            .filter(|e| e.lease.alive(now))
            .map(|e| e.served())
    }

    /// The service of a stored instance, expired or not: what a `register` key is checked
    /// against before it may renew, replace or remove the instance.
    pub fn service_of(&self, id: &str) -> Option<compact_str::CompactString> {
        self.instances.get(id).map(|e| e.instance.name.clone())
    }

    /// A live instance as [`Self::get`] reads it, with its check settings (for the health
    /// checker).
    pub fn get_checked(&self, id: &str) -> Option<(Instance, Arc<CheckSpec>)> {
        let now = self.clock.now();
        self.instances
            .get(id)
            .filter(|e| e.lease.alive(now))
            .map(|e| (e.served(), e.check.clone()))
    }

    /// Live instances matching `filter`, sorted by name, then id.
    pub fn list(&self, filter: &Filter) -> Vec<Instance> {
        let now = self.clock.now();
        let keep = |e: &Entry| {
            e.lease.alive(now)
                && (!filter.healthy_only || e.instance.healthy)
                && !((filter.healthy_only || filter.confirmed_only) && e.unconfirmed)
        };
        let mut out: Vec<Instance> = match &filter.name {
            Some(name) => self
                .view(name)
                .map(|v| {
                    v.members
                        .iter()
                        .filter_map(|m| self.instances.get(&*m.id).filter(|e| keep(e)).map(|e| e.served()))
                        .collect()
                })
                .unwrap_or_default(),
            None => self.instances.iter().filter(|e| keep(e)).map(|e| e.served()).collect(),
        };
        out.sort_unstable_by(|a, b| (&a.name, &a.id).cmp(&(&b.name, &b.id)));
        out
    }

    /// Names of the services with at least one instance matching `filter`, sorted.
    pub fn service_names(&self, filter: &Filter) -> Vec<String> {
        let now = self.clock.now();
        let keep = |member: &Member| member.lease.alive(now) && (!filter.healthy_only || member.healthy);
        let mut names: Vec<String> = self
            .services
            .iter()
            .filter(|view| filter.name.as_ref().is_none_or(|n| n == view.key()))
            .filter(|view| view.members.iter().any(|m| keep(m)))
            .map(|view| view.key().clone())
            .collect();
        names.sort_unstable();
        names
    }

    /// Every service's DNS view: what a zone transfer is cut from.
    pub fn views(&self) -> Vec<(String, Arc<ServiceView>)> {
        self.services
            .iter()
            .map(|v| (v.key().clone(), v.value().clone()))
            .collect()
    }

    /// The DNS view of one service.
    pub fn view(&self, service: &str) -> Option<Arc<ServiceView>> {
        self.services.get(service).map(|v| v.clone())
    }

    /// Calls `f` with the DNS view of one service, without taking a reference to it: what
    /// every DNS query does, so it saves two atomic read-modify-writes on a shared counter.
    /// `f` runs under the map's read lock, which registrations of the service wait for: it
    /// must be short and must not use the registry's maps.
    pub fn with_view<R>(&self, service: &str, f: impl FnOnce(&ServiceView) -> R) -> Option<R> {
        self.services.get(service).map(|view| f(&view))
    }

    /// Per service: how many live instances are healthy and how many are not (metrics).
    /// Reads the views, so it costs one pass over the members and no copy of an instance.
    pub fn instance_counts(&self) -> Vec<(String, usize, usize)> {
        let now = self.clock.now();
        let mut counts: Vec<(String, usize, usize)> = self
            .services
            .iter()
            .map(|view| {
                let (healthy, unhealthy) = view
                    .members
                    .iter()
                    .filter(|m| m.lease.alive(now))
                    .fold((0, 0), |(h, u), m| if m.healthy { (h + 1, u) } else { (h, u + 1) });
                (view.key().clone(), healthy, unhealthy)
            })
            .collect();
        counts.sort_unstable();
        counts
    }

    /// Whether any service has an answerable instance of `protocol`: then
    /// `_<protocol>.<zone>` exists as an empty non-terminal.
    pub fn protocol_answerable(&self, protocol: &str, now: Nanos) -> bool {
        self.protocols.get(protocol).is_some_and(|services| {
            services.keys().any(|service| {
                self.view(service)
                    .is_some_and(|v| v.answerable(now).any(|m| *m.protocol == *protocol))
            })
        })
    }

    /// Instances parked by the registry's outage, awaiting confirmation.
    pub fn unconfirmed(&self) -> usize {
        self.instances.iter().filter(|e| e.unconfirmed).count()
    }
}
