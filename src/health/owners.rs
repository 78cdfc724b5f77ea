//! Which node probes which instance. On one node (redb) every check is its own. On etcd the
//! checks are spread over the live nodes by rendezvous (highest-random-weight) hashing of
//! the instance id: each node weighs every (node, instance) pair with the same stable hash
//! and the heaviest node owns the instance, so every node agrees without asking, and when a
//! node joins or leaves only the instances it owned, or comes to own, move.

use std::hash::Hasher;
use std::sync::Arc;

use crate::store::Membership;

/// Who runs which check; see the module's documentation.
#[derive(Clone, Debug)]
pub enum Owners {
    /// One node: every check.
    Alone,
    /// Several nodes: this node's share.
    Shared(Membership),
}

impl Owners {
    pub fn new(membership: Option<Membership>) -> Self {
        membership.map_or(Owners::Alone, Owners::Shared)
    }

    /// Whether this node probes `id`. A node that is not among the live members (its
    /// membership lease ended) owns nothing: the others have taken its share over.
    pub fn owns(&self, id: &str) -> bool {
        match self {
            Owners::Alone => true,
            Owners::Shared(m) => owner(&m.members.borrow(), id).is_some_and(|owner| *owner == m.me),
        }
    }

    /// Returns when the live members change; never on one node.
    pub async fn changed(&mut self) {
        if let Owners::Shared(m) = self
            && m.members.changed().await.is_ok()
        {
            return;
        }
        std::future::pending().await
    }
}

/// The member that probes `id`: the heaviest; ties (which a 64-bit hash all but never
/// has) go to the greater id, so that every node still agrees.
pub fn owner<'a>(members: &'a [Arc<str>], id: &str) -> Option<&'a Arc<str>> {
    members.iter().max_by_key(|node| (weight(node, id), *node))
}

/// FNV-1a of the node's id, a separator and the instance's id, mixed by MurmurHash3's
/// finalizer (FNV alone spreads a last byte's change only to higher bits). Fixed, unlike
/// Rust's `RandomState`: every node and every release computes the same weights.
fn weight(node: &str, id: &str) -> u64 {
    let mut fnv = fnv::FnvHasher::default();
    fnv.write(node.as_bytes());
    fnv.write(&[0xff]);
    fnv.write(id.as_bytes());
    let mut h = fnv.finish();
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(names: &[&str]) -> Vec<Arc<str>> {
        names.iter().map(|n| Arc::from(*n)).collect()
    }

    #[test]
    fn weights_are_fixed_across_processes() {
        // A changed hash would make nodes of two releases disagree during a rolling upgrade.
        // FNV-1a 64 of b"node-a\xffweb-1", then fmix64 (computed apart, in Python).
        assert_eq!(weight("node-a", "web-1"), 0x560e_5ce6_a59a_f710);
    }

    #[test]
    fn checks_spread_evenly_and_only_a_leaving_nodes_share_moves() {
        let three = nodes(&["host-a:8053", "host-b:8053", "host-c:8053"]);
        let ids: Vec<String> = (0..3000).map(|i| format!("voice-{i}")).collect();
        let mut counts = std::collections::HashMap::new();
        for id in &ids {
            *counts.entry(owner(&three, id).unwrap().clone()).or_insert(0) += 1;
        }
        for node in &three {
            let n = counts[node];
            assert!((850..=1150).contains(&n), "{node} owns {n} of 3000");
        }
        let two = nodes(&["host-a:8053", "host-c:8053"]);
        for id in &ids {
            let before = owner(&three, id).unwrap();
            let after = owner(&two, id).unwrap();
            if **before != *"host-b:8053" {
                assert_eq!(before, after, "{id} moved although its owner stayed");
            }
        }
        assert!(owner(&[], "x").is_none());
    }

    #[test]
    fn a_single_node_owns_everything() {
        assert!(Owners::Alone.owns("anything"));
        let (_tx, members) = tokio::sync::watch::channel::<Arc<[Arc<str>]>>(nodes(&["b", "a"]).into());
        let a = Owners::new(Some(Membership {
            me: "a".into(),
            members: members.clone(),
        }));
        let b = Owners::new(Some(Membership {
            me: "b".into(),
            members: members.clone(),
        }));
        let c = Owners::new(Some(Membership {
            me: "c".into(),
            members,
        }));
        for i in 0..100 {
            let id = format!("i{i}");
            assert!(a.owns(&id) ^ b.owns(&id), "exactly one owner of {id}");
            assert!(!c.owns(&id), "not a member: owns nothing");
        }
    }
}
