//! Keeps each service's DNS view and the protocol index in step with the instances.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use dashmap::mapref::entry::Entry as MapEntry;

use super::Registry;
use super::lease::Lease;
use super::view::{Member, ServiceView};
use crate::model::instance::Instance;
use crate::zone::records::InstanceRecords;

impl Registry {
    /// The DNS side of an instance stored under `id`; an unconfirmed one is not served.
    pub(super) fn member(&self, id: &Arc<str>, instance: &Instance, lease: Arc<Lease>, confirmed: bool) -> Arc<Member> {
        // The protocol's name is shared with the `protocols` index, which holds every protocol in use.
        let protocol = self
            .protocols
            .get(instance.protocol.as_str())
            .map_or_else(|| instance.protocol.as_str().into(), |e| e.key().clone());
        Arc::new(Member {
            id: id.clone(),
            protocol,
            healthy: instance.healthy && confirmed,
            lease,
            records: InstanceRecords::new(instance),
        })
    }

    pub(super) fn put_member(&self, service: &str, member: Arc<Member>) {
        let replaced = {
            // The owned key is made only for a service's first member.
            let mut view = match self.services.get_mut(service) {
                Some(view) => view,
                None => self.services.entry(service.to_owned()).or_default(),
            };
            ServiceView::change(&mut view, |members| members.insert(member.clone()))
        };
        self.view_changes.fetch_add(1, Ordering::Release);
        if replaced.as_ref().map(|m| &m.protocol) != Some(&member.protocol) {
            if let Some(old) = replaced {
                self.count_protocol(&old.protocol, service, false);
            }
            self.count_protocol(&member.protocol, service, true);
        }
    }

    pub(super) fn remove_member(&self, service: &str, id: &str) {
        let removed = match self.services.entry(service.to_owned()) {
            MapEntry::Occupied(mut view) => {
                let removed = ServiceView::change(view.get_mut(), |members| members.remove(id));
                if view.get().members.is_empty() {
                    view.remove();
                }
                removed
            }
            MapEntry::Vacant(_) => None,
        };
        self.view_changes.fetch_add(1, Ordering::Release);
        if let Some(member) = removed {
            self.count_protocol(&member.protocol, service, false);
        }
    }

    /// Keeps `protocols` in step with the views. Never called while a view entry is locked,
    /// so readers may hold a protocol entry while they look views up.
    pub(super) fn count_protocol(&self, protocol: &Arc<str>, service: &str, add: bool) {
        if add {
            *self
                .protocols
                .entry(protocol.clone())
                .or_default()
                .entry(service.to_owned())
                .or_default() += 1;
        } else if let MapEntry::Occupied(mut services) = self.protocols.entry(protocol.clone()) {
            if let Some(count) = services.get_mut().get_mut(service) {
                *count -= 1;
                if *count == 0 {
                    services.get_mut().remove(service);
                }
            }
            if services.get().is_empty() {
                services.remove();
            }
        }
    }
}
