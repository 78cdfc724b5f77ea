//! The read-only view DNS answers from: per service, the instances with what DNS needs of
//! them, and the answers prepared from them. Mutations replace a service's view (copy on
//! write); queries read one view and never touch the instance map, so answer cost follows
//! the size of the asked service.

use std::sync::Arc;

use super::lease::Lease;
use crate::model::clock::Nanos;
use crate::zone::prepared::PreparedAnswers;
use crate::zone::records::InstanceRecords;

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
    pub members: Members,
    /// Filled by queries; a new view starts empty, so a change never serves an old answer.
    pub prepared: PreparedAnswers,
}

impl ServiceView {
    pub fn answerable(&self, now: Nanos) -> impl Iterator<Item = &Arc<Member>> {
        self.members.iter().filter(move |m| m.answerable(now))
    }

    /// A copy with `member` put in place of any member of the same id, and that member.
    pub(super) fn with(&self, member: Arc<Member>) -> (Self, Option<Arc<Member>>) {
        let (members, replaced) = self.members.with(member);
        (
            Self {
                members,
                prepared: PreparedAnswers::default(),
            },
            replaced,
        )
    }

    /// A copy without the member `id`, and that member.
    pub(super) fn without(&self, id: &str) -> (Self, Option<Arc<Member>>) {
        let (members, removed) = self.members.without(id);
        (
            Self {
                members,
                prepared: PreparedAnswers::default(),
            },
            removed,
        )
    }
}

/// Most members a chunk holds; a fuller one is split in two.
const CHUNK: usize = 128;

/// Members sorted by id, in chunks that successive views share. A change copies the chunk
/// list and the one chunk it touches, not every member, so registering into a service of
/// 10k instances costs about what it costs in a service of 200 (a flat copy of the members
/// was half the server's CPU with 64 clients registering into services of 6k).
#[derive(Debug, Default, Clone)]
pub struct Members(Vec<Arc<[Arc<Member>]>>);

impl Members {
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Member>> {
        self.0.iter().flat_map(|chunk| chunk.iter())
    }

    pub fn is_empty(&self) -> bool {
        // No chunk is ever empty.
        self.0.is_empty()
    }

    /// The chunk that holds `id`, or where it would go.
    fn chunk_of(&self, id: &str) -> usize {
        let after = self.0.partition_point(|chunk| *chunk[chunk.len() - 1].id < *id);
        after.min(self.0.len() - 1)
    }

    fn with(&self, member: Arc<Member>) -> (Self, Option<Arc<Member>>) {
        if self.0.is_empty() {
            return (Self(vec![Arc::from([member])]), None);
        }
        let at = self.chunk_of(&member.id);
        let mut chunk = Vec::with_capacity(self.0[at].len() + 1);
        chunk.extend_from_slice(&self.0[at]);
        let replaced = match chunk.binary_search_by(|m| m.id.cmp(&member.id)) {
            Ok(i) => Some(std::mem::replace(&mut chunk[i], member)),
            Err(i) => {
                chunk.insert(i, member);
                None
            }
        };
        let mut chunks = self.0.clone();
        if chunk.len() > CHUNK {
            let upper = chunk.split_off(chunk.len() / 2);
            chunks.insert(at + 1, upper.into());
        }
        chunks[at] = chunk.into();
        (Self(chunks), replaced)
    }

    fn without(&self, id: &str) -> (Self, Option<Arc<Member>>) {
        let found = (!self.0.is_empty())
            .then(|| self.chunk_of(id))
            .and_then(|at| Some((at, self.0[at].binary_search_by(|m| (*m.id).cmp(id)).ok()?)));
        let Some((at, i)) = found else {
            return (self.clone(), None);
        };
        let mut chunks = self.0.clone();
        let mut chunk = chunks[at].to_vec();
        let removed = chunk.remove(i);
        // A small chunk joins a neighbour, so removals do not leave many tiny chunks.
        let next = if at + 1 < chunks.len() {
            Some(at + 1)
        } else {
            at.checked_sub(1)
        };
        match next.filter(|&n| chunk.len() < CHUNK / 4 && chunk.len() + chunks[n].len() <= CHUNK) {
            Some(n) => {
                let (low, high) = (at.min(n), at.max(n));
                let merged: Vec<_> = if n > at {
                    chunk.iter().chain(chunks[n].iter()).cloned().collect()
                } else {
                    chunks[n].iter().chain(chunk.iter()).cloned().collect()
                };
                chunks[low] = merged.into();
                chunks.remove(high);
            }
            None if chunk.is_empty() => {
                chunks.remove(at);
            }
            None => chunks[at] = chunk.into(),
        }
        (Self(chunks), Some(removed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::zone::records::Target;
    use std::collections::BTreeSet;

    fn member(id: &str) -> Arc<Member> {
        Arc::new(Member {
            id: id.into(),
            protocol: "tcp".into(),
            healthy: true,
            lease: Arc::new(Lease::new(super::super::lease::NEVER)),
            records: InstanceRecords {
                target: Target::Ip([127, 0, 0, 1].into()),
                priority: 0,
                weight: 0,
                port: 1,
                metadata: Default::default(),
            },
        })
    }

    fn ids(members: &Members) -> Vec<String> {
        members.iter().map(|m| m.id.to_string()).collect()
    }

    /// Random inserts, replacements and removals keep the members sorted, unique, equal to a
    /// model set, in chunks of 1..=CHUNK.
    #[test]
    fn chunks_follow_a_sorted_set() {
        let mut rng = fastrand::Rng::with_seed(7);
        let mut members = Members::default();
        let mut model = BTreeSet::new();
        for step in 0..20_000 {
            let id = format!("i{:05}", rng.usize(..3000));
            let inserting = step < 8_000 || rng.bool();
            let (next, old) = if inserting {
                members.with(member(&id))
            } else {
                members.without(&id)
            };
            let was_there = if inserting {
                !model.insert(id.clone())
            } else {
                model.remove(&id)
            };
            assert_eq!(old.is_some(), was_there, "step {step}: {id}");
            members = next;
            assert!(
                members.0.iter().all(|c| (1..=CHUNK).contains(&c.len())),
                "step {step}: chunk sizes"
            );
        }
        assert_eq!(ids(&members), model.into_iter().collect::<Vec<_>>());
        assert!(members.0.len() > 10, "3000 ids make several chunks");
    }
}
