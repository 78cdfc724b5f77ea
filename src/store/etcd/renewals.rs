//! Heartbeats (R3): a heartbeat is answered `200` only once etcd holds its renewal.
//!
//! Renewals are group-committed: the ones that arrive while transactions are in flight go
//! together in the next group (no timer: on an idle node each goes at once), up to
//! [`TXN_RENEWALS`] per transaction, each compared on its key's `mod_revision` as this node
//! last applied it, and each heartbeat is answered when the transaction carrying it commits.
//! A renewal writes the instance's key with the new `updated_at` and nothing else, so it
//! moves no revision and wakes no blocking query; every node's lease then ends at that
//! stored `updated_at` + TTL.

use std::collections::HashMap;
use std::sync::Arc;

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use tokio::sync::{mpsc, oneshot};

use super::Etcd;
use super::write::RETRIES;
use crate::model::instance::Instance;
use crate::store::StoreError;

/// Renewals per transaction: etcd's `--max-txn-ops` (128) bounds the compares, and the puts
/// with the revision key.
pub(super) const TXN_RENEWALS: usize = 127;
/// Most renewals taken into one group (its transactions go out together).
const GROUP: usize = 16 * TXN_RENEWALS;

/// A renewal waiting for its group.
pub(super) struct Renewal {
    instance: Instance,
    /// The key's `mod_revision` as this node last applied it.
    known: i64,
    /// It confirms an instance parked by an outage: an answer changes.
    changes: bool,
    done: oneshot::Sender<Result<Outcome, StoreError>>,
}

#[derive(Clone, Debug)]
enum Outcome {
    /// Committed (and applied here): the instance as stored.
    Taken(Instance),
    /// The key is gone from etcd (expired or deregistered elsewhere).
    Gone,
    /// The key changed since it was read, to this `mod_revision`: catch up, decide again.
    /// 0: it did not, another renewal of the transaction failed; send it again.
    Changed(i64),
}

/// The renewals of one id in a group: the latest is written, all are answered by it (a key
/// twice in one transaction is refused by etcd).
struct Merged {
    latest: Renewal,
    earlier: Vec<oneshot::Sender<Result<Outcome, StoreError>>>,
}

impl Merged {
    fn answer(self, outcome: Result<Outcome, StoreError>) {
        for done in self.earlier {
            let _ = done.send(outcome.clone());
        }
        let _ = self.latest.done.send(outcome);
    }
}

impl Etcd {
    /// R3 on etcd: renews `id` through the next group; `answer` sees the instance as stored.
    pub(super) async fn heartbeat(
        &self,
        id: &str,
        answer: &mut (dyn for<'i> FnMut(&'i Instance) + Send),
    ) -> Result<bool, StoreError> {
        self.writable()?;
        let stopping = || StoreError::Unavailable("the server is shutting down".into());
        for _ in 0..RETRIES {
            // Read before the registry, as a registration does.
            let Some(known) = self.revisions.get(id).map(|r| *r) else {
                return Ok(false);
            };
            let Some((instance, changes)) = self.registry.renewal(id) else {
                return Ok(false);
            };
            let (done, outcome) = oneshot::channel();
            let renewal = Renewal {
                instance,
                known,
                changes,
                done,
            };
            self.renewals.send(renewal).map_err(|_| stopping())?;
            match outcome.await.map_err(|_| stopping())?? {
                Outcome::Taken(stored) => {
                    answer(&stored);
                    return Ok(true);
                }
                Outcome::Gone => return Ok(false),
                Outcome::Changed(revision) => self.wait_applied(revision).await?,
            }
        }
        Err(StoreError::Unavailable(
            "the instance kept changing on other nodes during this heartbeat; retry".into(),
        ))
    }

    /// Takes every renewal waiting, writes them (in transactions sent together), answers
    /// them, and takes the next group: while one group is in flight the next gathers.
    pub(super) async fn commit_renewals(self: Arc<Self>, mut queue: mpsc::UnboundedReceiver<Renewal>) {
        let mut taken = Vec::with_capacity(GROUP);
        loop {
            let received = tokio::select! {
                biased;
                _ = self.shutdown.cancelled() => return,
                received = queue.recv_many(&mut taken, GROUP) => received,
            };
            if received == 0 {
                return;
            }
            let mut group: Vec<Merged> = Vec::with_capacity(taken.len());
            let mut index: HashMap<Arc<str>, usize> = HashMap::with_capacity(taken.len());
            for renewal in taken.drain(..) {
                let id: Arc<str> = renewal.instance.id.as_str().into();
                match index.get(&id) {
                    Some(&i) => {
                        let merged = &mut group[i];
                        let changes = merged.latest.changes || renewal.changes;
                        let earlier = std::mem::replace(&mut merged.latest, renewal);
                        merged.latest.changes = changes;
                        merged.earlier.push(earlier.done);
                    }
                    None => {
                        index.insert(id, group.len());
                        group.push(Merged {
                            latest: renewal,
                            earlier: Vec::new(),
                        });
                    }
                }
            }
            let mut sends = tokio::task::JoinSet::new();
            while !group.is_empty() {
                let chunk: Vec<Merged> = group.drain(..group.len().min(TXN_RENEWALS)).collect();
                sends.spawn(self.clone().commit(chunk));
            }
            while sends.join_next().await.is_some() {}
        }
    }

    /// One transaction: every renewal of `chunk` if every key is still where this node
    /// knows it, else where each key stands (one round trip to sort them out).
    async fn commit(self: Arc<Self>, chunk: Vec<Merged>) {
        let keys: Vec<String> = chunk.iter().map(|m| self.key(&m.latest.instance.id)).collect();
        let compares: Vec<Compare> = chunk
            .iter()
            .zip(&keys)
            .map(|(m, key)| Compare::mod_revision(key.clone(), CompareOp::Equal, m.latest.known))
            .collect();
        let mut puts: Vec<TxnOp> = chunk
            .iter()
            .zip(&keys)
            .map(|(m, key)| {
                let json = serde_json::to_vec(&m.latest.instance).expect("instances serialise");
                TxnOp::put(key.clone(), json, None)
            })
            .collect();
        if chunk.iter().any(|m| m.latest.changes) {
            puts.push(self.changed());
        }
        let gets: Vec<TxnOp> = keys.iter().map(|key| TxnOp::get(key.clone(), None)).collect();
        let txn = Txn::new().when(compares).and_then(puts).or_else(gets);
        let answer = match self.txn("renewals", txn).await {
            Ok(answer) => answer,
            Err(e) => {
                for merged in chunk {
                    merged.answer(Err(e.clone()));
                }
                return;
            }
        };
        if answer.succeeded() {
            let revision = answer.header().map_or(0, |h| h.revision());
            for merged in chunk {
                self.applied_here(&merged.latest.instance, revision);
                let stored = merged.latest.instance.clone();
                merged.answer(Ok(Outcome::Taken(stored)));
            }
            return;
        }
        let standing = answer.op_responses();
        for (i, merged) in chunk.into_iter().enumerate() {
            let outcome = match standing.get(i) {
                Some(TxnOpResponse::Get(range)) => match range.kvs().first() {
                    None => Outcome::Gone,
                    Some(kv) if kv.mod_revision() == merged.latest.known => Outcome::Changed(0),
                    Some(kv) => Outcome::Changed(kv.mod_revision()),
                },
                _ => Outcome::Changed(0),
            };
            merged.answer(Ok(outcome));
        }
    }
}
