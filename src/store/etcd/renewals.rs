//! Lease renewals: heartbeats renew in memory and are written every `--persist-interval`
//! in grouped transactions, each renewal compared on its key's `mod_revision`.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, Txn, TxnOp};
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::warn;

use super::Etcd;
use crate::registry::Event;

/// Renewals (a compare and a put each) per transaction: etcd's `--max-txn-ops` is 128.
pub(super) const TXN_RENEWALS: usize = 64;

impl Etcd {
    /// Writes the renewed leases every `interval`, and once more at shutdown.
    pub(super) async fn write_renewals(self: Arc<Self>, mut events: UnboundedReceiver<Event>, interval: Duration) {
        let mut dirty = HashSet::new();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let closing = tokio::select! {
                _ = self.shutdown.cancelled() => true,
                _ = tick.tick() => false,
            };
            while let Ok(event) = events.try_recv() {
                if let Event::Renewed(id) = event {
                    dirty.insert(id);
                }
            }
            if !dirty.is_empty() && (closing || self.reachable.load(Ordering::Acquire)) {
                dirty = self.write_batch(std::mem::take(&mut dirty)).await;
            }
            if closing {
                if !dirty.is_empty() {
                    warn!(pending = dirty.len(), "renewals not written to etcd at shutdown");
                }
                return;
            }
        }
    }

    /// Writes renewals, each compared on the revision this node knows of its key: a key
    /// re-registered, deregistered or expired elsewhere meanwhile keeps that change.
    /// Returns the ids to try again.
    pub(super) async fn write_batch(&self, ids: HashSet<Arc<str>>) -> HashSet<Arc<str>> {
        let renewals: Vec<(Arc<str>, i64, Vec<u8>)> = ids
            .into_iter()
            .filter_map(|id| {
                let known = *self.revisions.get(&id)?;
                let instance = self.registry.to_persist(&id)?;
                Some((id, known, serde_json::to_vec(&instance).expect("instances serialise")))
            })
            .collect();
        let mut retry = HashSet::new();
        for chunk in renewals.chunks(TXN_RENEWALS) {
            let txn = |renewals: &[(Arc<str>, i64, Vec<u8>)]| {
                let compares: Vec<Compare> = renewals
                    .iter()
                    .map(|(id, known, _)| Compare::mod_revision(self.key(id), CompareOp::Equal, *known))
                    .collect();
                let puts: Vec<TxnOp> = renewals
                    .iter()
                    .map(|(id, _, json)| TxnOp::put(self.key(id), json.clone(), None))
                    .collect();
                Txn::new().when(compares).and_then(puts)
            };
            match self.txn("renewals", txn(chunk)).await {
                Ok(answer) if answer.succeeded() => {}
                Ok(_) => {
                    // One of them changed since this node last applied it: the others still
                    // go, one by one. A failed one is tried again at the next batch with the
                    // revision known then (this node's own previous batch may simply not
                    // have come back through the watch yet); one deleted meanwhile is not.
                    for one in chunk.chunks(1) {
                        match self.txn("renewal", txn(one)).await {
                            Ok(answer) if answer.succeeded() => {}
                            _ => {
                                retry.insert(one[0].0.clone());
                            }
                        }
                    }
                }
                Err(e) => {
                    self.failed(&e.to_string());
                    retry.extend(chunk.iter().map(|(id, _, _)| id.clone()));
                }
            }
        }
        retry
    }
}
