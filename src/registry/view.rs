//! The read-only view DNS answers from: per service, the instances with what DNS needs of
//! them, and the answers prepared from them. Mutations change a view nobody holds in place
//! and replace a held one (copy on write); queries read one view and never touch the
//! instance map, so answer cost follows the size of the asked service.

use std::sync::Arc;

use super::lease::Lease;
use crate::model::clock::Nanos;
use crate::model::instance::Instance;
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

    /// Whether a member of `instance` (confirmed, so healthy as flagged) in place of `self`
    /// would answer as `self` does: then a re-registration leaves the view alone.
    pub fn answers_as(&self, instance: &Instance) -> bool {
        *self.protocol == *instance.protocol
            && self.healthy == instance.healthy
            && self.records == InstanceRecords::new(instance)
    }
}

/// One service's members, sorted by id, and the answers encoded from them.
#[derive(Debug, Default)]
pub struct ServiceView {
    pub members: Members,
    /// Filled by queries; emptied by every change, so a change never serves an old answer.
    pub prepared: PreparedAnswers,
}

impl ServiceView {
    pub fn answerable(&self, now: Nanos) -> impl Iterator<Item = &Arc<Member>> {
        self.members.iter().filter(move |m| m.answerable(now))
    }

    /// Runs `f` on the members of `view`, the registry's entry for one service, under the
    /// map's write lock. A view that nobody else holds (no query, zone transfer or journal
    /// cut) is changed in place; one that is held is copied first and the copy replaces it,
    /// so a holder never sees it change. Either way the prepared answers start empty.
    ///
    /// Copying on every change cost a new-id registration into a service of 800 about 4 µs
    /// of its 26 µs on the HTTP threads (cloning and then dropping up to 128 `Arc<Member>`,
    /// each a cache miss on a member far away): the view is almost never held when it changes.
    pub(super) fn change<R>(view: &mut Arc<Self>, f: impl FnOnce(&mut Members) -> R) -> R {
        if Arc::get_mut(view).is_none() {
            *view = Arc::new(Self {
                members: view.members.clone(),
                prepared: PreparedAnswers::default(),
            });
        }
        let unique = Arc::get_mut(view).expect("no other holder: either it had none or it is a fresh copy");
        unique.prepared = PreparedAnswers::default();
        f(&mut unique.members)
    }
}

/// Most members a chunk holds; a fuller one is split in two.
const CHUNK: usize = 128;

/// Members sorted by id, in chunks that successive views share. A change to a view that is
/// held elsewhere copies the chunk list and the one chunk it touches, not every member, so
/// registering into a service of 10k instances costs about what it costs in a service of
/// 200 (a flat copy of the members was half the server's CPU with 64 clients registering
/// into services of 6k). A chunk that no other view holds is changed in place.
#[derive(Debug, Default, Clone)]
pub struct Members {
    chunks: Vec<Arc<Vec<Arc<Member>>>>,
    /// The last id of each chunk. Finding the chunk of an id reads this list, not four
    /// pointers deep into every chunk it passes: with 160k instances those reads missed the
    /// cache and were 60% of the cost of putting a member in.
    last: Vec<Arc<str>>,
}

impl Members {
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Member>> {
        self.chunks.iter().flat_map(|chunk| chunk.iter())
    }

    pub fn is_empty(&self) -> bool {
        // No chunk is ever empty.
        self.chunks.is_empty()
    }

    /// The chunk that holds `id`, or where it would go.
    fn chunk_of(&self, id: &str) -> usize {
        let after = self.last.partition_point(|last| **last < *id);
        after.min(self.chunks.len() - 1)
    }

    /// Puts `member` in place of any member of the same id; returns that member.
    pub(super) fn insert(&mut self, member: Arc<Member>) -> Option<Arc<Member>> {
        if self.chunks.is_empty() {
            self.last.push(member.id.clone());
            self.chunks.push(Arc::new(vec![member]));
            return None;
        }
        let at = self.chunk_of(&member.id);
        let chunk = Arc::make_mut(&mut self.chunks[at]);
        let replaced = match chunk.binary_search_by(|m| m.id.cmp(&member.id)) {
            Ok(i) => Some(std::mem::replace(&mut chunk[i], member)),
            Err(i) => {
                chunk.insert(i, member);
                None
            }
        };
        if chunk.len() > CHUNK {
            let upper = chunk.split_off(chunk.len() / 2);
            self.last.insert(at + 1, upper[upper.len() - 1].id.clone());
            self.chunks.insert(at + 1, Arc::new(upper));
        }
        self.last[at] = self.chunks[at][self.chunks[at].len() - 1].id.clone();
        replaced
    }

    /// Takes out the member `id`.
    pub(super) fn remove(&mut self, id: &str) -> Option<Arc<Member>> {
        if self.chunks.is_empty() {
            return None;
        }
        let at = self.chunk_of(id);
        let i = self.chunks[at].binary_search_by(|m| (*m.id).cmp(id)).ok()?;
        let chunk = Arc::make_mut(&mut self.chunks[at]);
        let removed = chunk.remove(i);
        let len = chunk.len();
        // A small chunk joins a neighbour, so removals do not leave many tiny chunks.
        let next = if at + 1 < self.chunks.len() {
            Some(at + 1)
        } else {
            at.checked_sub(1)
        };
        match next.filter(|&n| len < CHUNK / 4 && len + self.chunks[n].len() <= CHUNK) {
            Some(n) => {
                let (low, high) = (at.min(n), at.max(n));
                let upper = self.chunks.remove(high);
                Arc::make_mut(&mut self.chunks[low]).extend(upper.iter().cloned());
                // The merged chunk ends where the upper one did.
                self.last.remove(low);
            }
            None if len == 0 => {
                self.chunks.remove(at);
                self.last.remove(at);
            }
            None => {
                let chunk = &self.chunks[at];
                self.last[at] = chunk[chunk.len() - 1].id.clone();
            }
        }
        Some(removed)
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
            // Every few steps an older version is kept, as a held view would be: changes
            // must copy what it shares and leave it as it was.
            let held = (step % 53 == 0).then(|| (members.clone(), ids(&members)));
            let old = if inserting {
                members.insert(member(&id))
            } else {
                members.remove(&id)
            };
            if let Some((held, before)) = held {
                assert_eq!(ids(&held), before, "step {step}: a held version changed");
            }
            let was_there = if inserting {
                !model.insert(id.clone())
            } else {
                model.remove(&id)
            };
            assert_eq!(old.is_some(), was_there, "step {step}: {id}");
            assert!(
                members.chunks.iter().all(|c| (1..=CHUNK).contains(&c.len())),
                "step {step}: chunk sizes"
            );
            let last: Vec<&str> = members.chunks.iter().map(|c| &*c[c.len() - 1].id).collect();
            assert!(
                members.last.iter().map(|l| &**l).eq(last),
                "step {step}: the last ids follow the chunks"
            );
        }
        assert_eq!(ids(&members), model.into_iter().collect::<Vec<_>>());
        assert!(members.chunks.len() > 10, "3000 ids make several chunks");
    }
}
