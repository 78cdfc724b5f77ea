//! Group commit of the writes of instances: registrations, renewals (heartbeats) and health
//! verdicts. Each is a put of the instance's key compared on its `mod_revision` as this
//! node last applied it, answered only once its transaction committed (and this node
//! applied it).
//!
//! The writes that arrive while transactions are in flight go together in the next group
//! (no timer: on an idle node each goes at once), up to [`TXN_WRITES`] per transaction; a
//! group larger than that goes as several transactions at once. etcd's cost is mostly per
//! transaction (a Raft round, an fsync on every member), so a group costs about what one
//! write does: this is what makes a heartbeat that waits for etcd affordable, and what
//! lets registrations through the nodes outrun raw transactions of one write each
//! (README, "Several nodes on etcd").

use std::collections::HashMap;
use std::sync::Arc;

use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use tokio::sync::{mpsc, oneshot};

use super::Etcd;
use crate::model::instance::Instance;
use crate::store::StoreError;

/// Writes per transaction: etcd's `--max-txn-ops` (128) bounds the compares, and the puts
/// with the revision key.
pub(super) const TXN_WRITES: usize = 127;
/// Most writes taken into one group (its transactions go out together).
const GROUP: usize = 16 * TXN_WRITES;

/// A write waiting for its group.
pub(super) struct Write {
    instance: Instance,
    /// The key's `mod_revision` as this node last applied it (0: no key).
    known: i64,
    /// It alters an answer: the revision key goes with it.
    changes: bool,
    /// A heartbeat's: only the stamp differs from what is stored, so two of one id in a
    /// group are one write (the later).
    renewal: bool,
    done: oneshot::Sender<Result<Outcome, StoreError>>,
}

#[derive(Clone, Debug)]
pub(super) enum Outcome {
    /// Committed, and applied here: the instance as stored.
    Taken(Instance),
    /// The key is gone from etcd (expired or deregistered elsewhere), as of this revision.
    Gone(i64),
    /// The key changed since it was read, to this `mod_revision`: catch up, decide again.
    /// 0: it did not, another write of the transaction failed; send it again.
    Changed(i64),
}

/// The writes of one id in a group: the latest is written, all are answered by it (a key
/// twice in one transaction is refused by etcd).
struct Merged {
    latest: Write,
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
    /// Puts `instance` under its key, compared on `known`, with the next group; with the
    /// revision key when it `changes` an answer.
    pub(super) async fn put(
        &self,
        instance: Instance,
        known: i64,
        changes: bool,
        renewal: bool,
    ) -> Result<Outcome, StoreError> {
        let stopping = || StoreError::Unavailable("the server is shutting down".into());
        let (done, outcome) = oneshot::channel();
        let write = Write {
            instance,
            known,
            changes,
            renewal,
            done,
        };
        self.writes.send(write).map_err(|_| stopping())?;
        outcome.await.map_err(|_| stopping())?
    }

    /// Takes every write waiting, sends them (in transactions sent together), answers each
    /// when its transaction commits, and takes the next group: while one group is in
    /// flight the next gathers.
    pub(super) async fn commit_writes(self: Arc<Self>, mut queue: mpsc::UnboundedReceiver<Write>) {
        let mut taken = Vec::with_capacity(GROUP);
        // A second write of an id that is not a renewal waits for the next group, after
        // the first (it then finds the key changed and is decided again).
        let mut deferred: Vec<Write> = Vec::new();
        loop {
            if deferred.is_empty() {
                let received = tokio::select! {
                    biased;
                    _ = self.shutdown.cancelled() => return,
                    received = queue.recv_many(&mut taken, GROUP) => received,
                };
                if received == 0 {
                    return;
                }
            } else {
                taken.append(&mut deferred);
                while let Ok(write) = queue.try_recv() {
                    taken.push(write);
                }
            }
            let mut group: Vec<Merged> = Vec::with_capacity(taken.len());
            let mut index: HashMap<Arc<str>, usize> = HashMap::with_capacity(taken.len());
            for write in taken.drain(..) {
                let id: Arc<str> = write.instance.id.as_str().into();
                match index.get(&id) {
                    Some(&i) if group[i].latest.renewal && write.renewal => {
                        let merged = &mut group[i];
                        let changes = merged.latest.changes || write.changes;
                        let earlier = std::mem::replace(&mut merged.latest, write);
                        merged.latest.changes = changes;
                        merged.earlier.push(earlier.done);
                    }
                    Some(_) => deferred.push(write),
                    None => {
                        index.insert(id, group.len());
                        group.push(Merged {
                            latest: write,
                            earlier: Vec::new(),
                        });
                    }
                }
            }
            let mut sends = tokio::task::JoinSet::new();
            while !group.is_empty() {
                let chunk: Vec<Merged> = group.drain(..group.len().min(TXN_WRITES)).collect();
                sends.spawn(self.clone().commit(chunk));
            }
            while sends.join_next().await.is_some() {}
        }
    }

    /// One transaction: every write of `chunk` if every key is still where this node knows
    /// it, else where each key stands (one round trip to sort them out).
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
        let what = if chunk.iter().all(|m| m.latest.renewal) {
            "renewals"
        } else {
            "writes"
        };
        let answer = match self.txn(what, txn).await {
            Ok(answer) => answer,
            Err(e) => {
                for merged in chunk {
                    merged.answer(Err(e.clone()));
                }
                return;
            }
        };
        let revision = answer.header().map_or(0, |h| h.revision());
        if answer.succeeded() {
            for merged in chunk {
                self.applied_here(&merged.latest.instance, revision);
                let stored = merged.latest.instance.clone();
                merged.answer(Ok(Outcome::Taken(stored)));
            }
            return;
        }
        let standing = answer.op_responses();
        for (i, merged) in chunk.into_iter().enumerate() {
            let known = merged.latest.known;
            let outcome = match standing.get(i) {
                Some(TxnOpResponse::Get(range)) => match range.kvs().first() {
                    // No key, as this write expected: another one failed.
                    None if known == 0 => Outcome::Changed(0),
                    None => Outcome::Gone(revision),
                    Some(kv) if kv.mod_revision() == known => Outcome::Changed(0),
                    Some(kv) => Outcome::Changed(kv.mod_revision()),
                },
                _ => Outcome::Changed(0),
            };
            merged.answer(Ok(outcome));
        }
    }
}
