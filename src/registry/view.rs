//! The read-only view DNS answers from: per service, the instances with what DNS needs of
//! them, and the answers prepared from them. Mutations replace a service's view (copy on
//! write); queries read one view and never touch the instance map, so answer cost follows
//! the size of the asked service.

use std::sync::Arc;

use super::clock::Nanos;
use super::lease::Lease;
use crate::dns::prepared::PreparedAnswers;
use crate::dns::records::InstanceRecords;

#[derive(Debug)]
pub struct Member {
    /// The registry's key, shared.
    pub id: Arc<str>,
    /// Interned: one allocation per protocol, not per instance.
    pub protocol: Arc<str>,
    pub healthy: bool,
    pub lease: Arc<Lease>,
    pub records: InstanceRecords,
}

impl Member {
    /// In DNS answers: healthy and within its lease.
    pub fn answerable(&self, now: Nanos) -> bool {
        self.healthy && self.lease.alive(now)
    }

    /// Whether replacing `self` by `other` changes any answer.
    pub fn same_answers(&self, other: &Member) -> bool {
        self.protocol == other.protocol && self.healthy == other.healthy && self.records == other.records
    }
}

/// One service's members, sorted by id, and the answers encoded from them.
#[derive(Debug, Default)]
pub struct ServiceView {
    pub members: Vec<Arc<Member>>,
    /// Filled by queries; a new view starts empty, so a change never serves an old answer.
    pub prepared: PreparedAnswers,
}

impl ServiceView {
    pub fn answerable(&self, now: Nanos) -> impl Iterator<Item = &Arc<Member>> {
        self.members.iter().filter(move |m| m.answerable(now))
    }

    /// A copy with `member` put in place of any member of the same id, and that member.
    pub(super) fn with(&self, member: Arc<Member>) -> (Self, Option<Arc<Member>>) {
        // Sized for one more, so an insert does not double the allocation.
        let mut members = Vec::with_capacity(self.members.len() + 1);
        members.extend_from_slice(&self.members);
        let replaced = match members.binary_search_by(|m| m.id.cmp(&member.id)) {
            Ok(i) => Some(std::mem::replace(&mut members[i], member)),
            Err(i) => {
                members.insert(i, member);
                None
            }
        };
        (Self { members, prepared: PreparedAnswers::default() }, replaced)
    }

    /// A copy without the member `id`, and that member.
    pub(super) fn without(&self, id: &str) -> (Self, Option<Arc<Member>>) {
        let mut members = self.members.clone();
        let removed = members.binary_search_by(|m| (*m.id).cmp(id)).ok().map(|i| members.remove(i));
        (Self { members, prepared: PreparedAnswers::default() }, removed)
    }
}
