//! Durable state: the registry in a redb file under `--data-dir`, written by one thread
//! that groups commits.
//!
//! Memory is the source of truth and the file follows it: a write names the ids to
//! persist, and the writer stores whatever the registry holds for them at commit time
//! (or deletes them). Register and deregister wait for their commit; heartbeats and health
//! flips only mark ids dirty, and the writer flushes those every `--persist-interval`, so
//! a heartbeat costs no fsync.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use redb::{Database, DatabaseError, ReadableDatabase, ReadableTable, StorageError, TableDefinition};
use tokio::sync::{mpsc::UnboundedReceiver, oneshot};
use tracing::{info, warn};

use super::instance::Instance;
use super::{Event, Registry};

const INSTANCES: TableDefinition<&str, &[u8]> = TableDefinition::new("instances");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// Bumped when the stored layout changes incompatibly.
pub const SCHEMA_VERSION: u64 = 1;
pub const FILE_NAME: &str = "registry.redb";
const CACHE_BYTES: usize = 2 << 20;
/// Most writes grouped into one commit.
const MAX_BATCH: usize = 8192;

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(
        "{0}: the registry database is locked by another running koder-dns; stop that one, or give this one its own --data-dir"
    )]
    Locked(PathBuf),
    #[error(
        "{path}: corrupt or not a koder-dns database ({detail}); move the file aside to start empty \
         (registrants re-register after their next heartbeat gets 410) or restore a backup"
    )]
    Corrupt { path: PathBuf, detail: String },
    #[error(
        "{path}: written by a newer koder-dns ({detail}); run that version, or move the file aside to start empty"
    )]
    Newer { path: PathBuf, detail: String },
    #[error("{path}: {detail}; check that --data-dir is writable and has free space")]
    Io { path: PathBuf, detail: String },
}

fn classify(path: &Path, e: DatabaseError) -> OpenError {
    let path = path.to_owned();
    match e {
        DatabaseError::DatabaseAlreadyOpen => OpenError::Locked(path),
        DatabaseError::UpgradeRequired(v) => OpenError::Corrupt { path, detail: format!("old file format {v}") },
        DatabaseError::Storage(StorageError::Corrupted(detail)) if detail.contains("format version") => {
            OpenError::Newer { path, detail }
        }
        DatabaseError::Storage(StorageError::Corrupted(detail)) => OpenError::Corrupt { path, detail },
        DatabaseError::Storage(StorageError::Io(io)) if io.kind() == std::io::ErrorKind::InvalidData => {
            OpenError::Corrupt { path, detail: io.to_string() }
        }
        other => OpenError::Io { path, detail: other.to_string() },
    }
}

fn open_db(path: &Path) -> Result<Database, OpenError> {
    // A file damaged outside redb would otherwise panic on first read; check it up front.
    // redb caches up to 1 GiB by default; memory is the source of truth here and the file
    // is read only at start, so a small cache is enough.
    Database::builder()
        .set_check_integrity_on_open(true)
        .set_cache_size(CACHE_BYTES)
        .create(path)
        .map_err(|e| classify(path, e))
}

/// What the file held at start.
pub struct Loaded {
    pub instances: Vec<Instance>,
    pub serial: u32,
}

/// Opens (or creates) the database, refusing a locked, corrupt or newer file.
pub fn open(dir: &Path) -> Result<(Database, PathBuf, Loaded), OpenError> {
    let io = |path: &Path, e: &dyn std::fmt::Display| OpenError::Io { path: path.to_owned(), detail: e.to_string() };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, &e))?;
    let path = dir.join(FILE_NAME);
    let db = open_db(&path)?;
    let txn = db.begin_write().map_err(|e| io(&path, &e))?;
    {
        let mut meta = txn.open_table(META).map_err(|e| io(&path, &e))?;
        let schema = meta.get("schema").map_err(|e| io(&path, &e))?.map(|v| v.value());
        match schema {
            Some(v) if v > SCHEMA_VERSION => {
                return Err(OpenError::Newer { path, detail: format!("schema {v}; this build reads {SCHEMA_VERSION}") });
            }
            Some(_) => {}
            None => {
                meta.insert("schema", SCHEMA_VERSION).map_err(|e| io(&path, &e))?;
            }
        }
        txn.open_table(INSTANCES).map_err(|e| io(&path, &e))?;
    }
    txn.commit().map_err(|e| io(&path, &e))?;

    let read = db.begin_read().map_err(|e| io(&path, &e))?;
    let table = read.open_table(INSTANCES).map_err(|e| io(&path, &e))?;
    let mut instances = Vec::new();
    for entry in table.iter().map_err(|e| io(&path, &e))? {
        let (id, json) = entry.map_err(|e| io(&path, &e))?;
        let instance: Instance = serde_json::from_slice(json.value())
            .map_err(|e| OpenError::Corrupt { path: path.clone(), detail: format!("instance {:?}: {e}", id.value()) })?;
        instances.push(instance);
    }
    let serial = read
        .open_table(META)
        .ok()
        .and_then(|m| m.get("serial").ok().flatten().map(|v| v.value() as u32))
        .unwrap_or(0);
    drop(table);
    drop(read);
    Ok((db, path, Loaded { instances, serial }))
}

struct Job {
    /// Ids to persist now; empty for "flush everything dirty".
    ids: Vec<Arc<str>>,
    ack: oneshot::Sender<Result<(), String>>,
}

/// The writer thread's handle.
pub struct Disk {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Disk {
    /// Starts the writer. `events` marks ids dirty for the batched flush.
    pub fn spawn(db: Database, path: PathBuf, registry: Arc<Registry>, events: UnboundedReceiver<Event>, interval: Duration) -> Self {
        let (tx, rx) = mpsc::channel();
        let writer = Writer { db: Some(db), path, registry, events, dirty: HashSet::new(), interval };
        let thread = std::thread::Builder::new()
            .name("koder-dns-disk".into())
            .spawn(move || writer.run(rx))
            .expect("spawn the disk writer");
        Self { tx: Mutex::new(Some(tx)), thread: Mutex::new(Some(thread)) }
    }

    /// Persists what the registry holds for `ids`; returns once it is on disk.
    pub async fn write(&self, ids: Vec<Arc<str>>) -> Result<(), String> {
        let (ack, done) = oneshot::channel();
        let sent = self.tx.lock().as_ref().map(|tx| tx.send(Job { ids, ack }).is_ok());
        if sent != Some(true) {
            return Err("the server is shutting down".into());
        }
        done.await.unwrap_or_else(|_| Err("the disk writer stopped".into()))
    }

    /// Flushes everything dirty and stops the writer.
    pub async fn close(&self) {
        let _ = self.write(Vec::new()).await;
        self.tx.lock().take();
        let thread = self.thread.lock().take();
        if let Some(thread) = thread {
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

struct Writer {
    /// `None` after a failed commit: redb must be reopened before the next one.
    db: Option<Database>,
    path: PathBuf,
    registry: Arc<Registry>,
    events: UnboundedReceiver<Event>,
    dirty: HashSet<Arc<str>>,
    interval: Duration,
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Job>) {
        let mut next_flush = Instant::now() + self.interval;
        let mut closing = false;
        while !closing {
            let mut jobs = Vec::new();
            match rx.recv_timeout(next_flush.saturating_duration_since(Instant::now())) {
                Ok(job) => jobs.push(job),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => closing = true,
            }
            while jobs.len() < MAX_BATCH {
                match rx.try_recv() {
                    Ok(job) => jobs.push(job),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        closing = true;
                        break;
                    }
                }
            }
            while let Ok(event) = self.events.try_recv() {
                self.dirty.insert(event.id().clone());
            }
            let flush_all = closing || Instant::now() >= next_flush || jobs.iter().any(|j| j.ids.is_empty());
            let mut ids: Vec<Arc<str>> = jobs.iter().flat_map(|j| j.ids.iter().cloned()).collect();
            if flush_all {
                ids.extend(self.dirty.drain());
                next_flush = Instant::now() + self.interval;
            } else {
                // The commit stores the current state of these ids, which covers their dirt.
                for id in &ids {
                    self.dirty.remove(id);
                }
            }
            ids.sort_unstable();
            ids.dedup();
            let result = if ids.is_empty() { Ok(()) } else { self.commit(&ids) };
            if let Err(error) = &result {
                warn!(%error, pending = ids.len(), "could not write the registry to disk; will retry");
                self.dirty.extend(ids);
            }
            for job in jobs {
                let _ = job.ack.send(result.clone());
            }
        }
        info!(path = %self.path.display(), "registry flushed to disk");
    }

    fn commit(&mut self, ids: &[Arc<str>]) -> Result<(), String> {
        if self.db.is_none() {
            // After an I/O error redb refuses further writes until reopened; reopening
            // repairs whatever the failed commit left.
            self.db = Some(open_db(&self.path).map_err(|e| e.to_string())?);
            info!(path = %self.path.display(), "registry database reopened");
        }
        let db = self.db.as_ref().expect("opened above");
        let result = (|| -> Result<(), redb::Error> {
            let txn = db.begin_write()?;
            {
                let mut table = txn.open_table(INSTANCES)?;
                for id in ids {
                    match self.registry.to_persist(id) {
                        Some(instance) => {
                            let json = serde_json::to_vec(&instance).expect("instances serialise");
                            table.insert(&**id, json.as_slice())?;
                        }
                        None => {
                            table.remove(&**id)?;
                        }
                    }
                }
                txn.open_table(META)?.insert("serial", self.registry.serial() as u64)?;
            }
            txn.commit()?;
            Ok(())
        })();
        result.map_err(|e| {
            self.db = None;
            e.to_string()
        })
    }
}
