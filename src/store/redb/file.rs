//! The redb file under `--data-dir`: its tables, opening it (refusing a locked, corrupt or
//! newer file) and reading what it holds.
//!
//! `instances` holds id → JSON; `changes` is a log keyed by commit order of changes not yet
//! folded into `instances` (see [`super::writer`] for why new ids are appended), folded at
//! every open; `meta` holds the schema, the last revision written and when the registry
//! that wrote it was last known running.

use std::path::{Path, PathBuf};

use redb::{Database, DatabaseError, ReadableDatabase, ReadableTable, StorageError, Table, TableDefinition};

use crate::model::clock::Nanos;
use crate::model::instance::Instance;

pub(super) const INSTANCES: TableDefinition<&str, &[u8]> = TableDefinition::new("instances");
pub(super) const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
/// Changes not yet folded into `instances`, in commit order: an id and its JSON, or an
/// empty JSON for a removal.
pub(super) const CHANGES: TableDefinition<u64, (&str, &[u8])> = TableDefinition::new("changes");
/// Bumped when the stored layout changes incompatibly. 2: the `changes` table, which an
/// older build would ignore and so lose what it holds.
pub const SCHEMA_VERSION: u64 = 2;
pub const FILE_NAME: &str = "registry.redb";
const CACHE_BYTES: usize = 2 << 20;

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
    #[error("{path}: written by a newer koder-dns ({detail}); run that version, or move the file aside to start empty")]
    Newer { path: PathBuf, detail: String },
    #[error("{path}: {detail}; check that --data-dir is writable and has free space")]
    Io { path: PathBuf, detail: String },
}

fn classify(path: &Path, e: DatabaseError) -> OpenError {
    let path = path.to_owned();
    match e {
        DatabaseError::DatabaseAlreadyOpen => OpenError::Locked(path),
        DatabaseError::UpgradeRequired(v) => OpenError::Corrupt {
            path,
            detail: format!("old file format {v}"),
        },
        DatabaseError::Storage(StorageError::Corrupted(detail)) if detail.contains("format version") => {
            OpenError::Newer { path, detail }
        }
        DatabaseError::Storage(StorageError::Corrupted(detail)) => OpenError::Corrupt { path, detail },
        DatabaseError::Storage(StorageError::Io(io)) if io.kind() == std::io::ErrorKind::InvalidData => {
            OpenError::Corrupt {
                path,
                detail: io.to_string(),
            }
        }
        other => OpenError::Io {
            path,
            detail: other.to_string(),
        },
    }
}

/// `check`: verify the whole file (at start). A reopen after a failed commit skips it:
/// redb repairs what its own failed commit left, and a full check per failure made every
/// refused request cost a scan of the file.
pub(super) fn open_db(path: &Path, check: bool) -> Result<Database, OpenError> {
    // A file damaged outside redb would otherwise panic on first read; check it up front.
    // redb caches up to 1 GiB by default; memory is the source of truth here and the file
    // is read only at start, so a small cache is enough.
    Database::builder()
        .set_check_integrity_on_open(check)
        .set_cache_size(CACHE_BYTES)
        .create(path)
        .map_err(|e| classify(path, e))
}

/// Applies the changes to `instances` in commit order, then empties `changes`.
pub(super) fn fold(
    changes: &mut Table<u64, (&str, &[u8])>,
    instances: &mut Table<&str, &[u8]>,
) -> Result<(), redb::Error> {
    for entry in changes.iter()? {
        let (_, change) = entry?;
        match change.value() {
            (id, []) => instances.remove(id)?,
            (id, json) => instances.insert(id, json)?,
        };
    }
    changes.retain(|_, _| false)?;
    Ok(())
}

/// What the file held at start.
pub struct Loaded {
    pub instances: Vec<Instance>,
    /// The last revision written.
    pub revision: u64,
    /// When the registry that wrote the file was last known running (its last commit; the
    /// writer commits at least every `--persist-interval`). `None` in files from before
    /// this was stored.
    pub alive_at: Option<Nanos>,
}

/// Opens (or creates) the database, refusing a locked, corrupt or newer file.
pub fn open(dir: &Path) -> Result<(Database, PathBuf, Loaded), OpenError> {
    let io = |path: &Path, e: &dyn std::fmt::Display| OpenError::Io {
        path: path.to_owned(),
        detail: e.to_string(),
    };
    std::fs::create_dir_all(dir).map_err(|e| io(dir, &e))?;
    let path = dir.join(FILE_NAME);
    let db = open_db(&path, true)?;
    let txn = db.begin_write().map_err(|e| io(&path, &e))?;
    {
        let mut meta = txn.open_table(META).map_err(|e| io(&path, &e))?;
        let schema = meta.get("schema").map_err(|e| io(&path, &e))?.map(|v| v.value());
        match schema {
            Some(v) if v > SCHEMA_VERSION => {
                return Err(OpenError::Newer {
                    path,
                    detail: format!("schema {v}; this build reads {SCHEMA_VERSION}"),
                });
            }
            Some(SCHEMA_VERSION) => {}
            _ => {
                meta.insert("schema", SCHEMA_VERSION).map_err(|e| io(&path, &e))?;
            }
        }
        let mut instances = txn.open_table(INSTANCES).map_err(|e| io(&path, &e))?;
        let mut changes = txn.open_table(CHANGES).map_err(|e| io(&path, &e))?;
        fold(&mut changes, &mut instances).map_err(|e| io(&path, &e))?;
    }
    txn.commit().map_err(|e| io(&path, &e))?;

    let read = db.begin_read().map_err(|e| io(&path, &e))?;
    let table = read.open_table(INSTANCES).map_err(|e| io(&path, &e))?;
    let mut instances = Vec::new();
    for entry in table.iter().map_err(|e| io(&path, &e))? {
        let (id, json) = entry.map_err(|e| io(&path, &e))?;
        let instance: Instance = serde_json::from_slice(json.value()).map_err(|e| OpenError::Corrupt {
            path: path.clone(),
            detail: format!("instance {:?}: {e}", id.value()),
        })?;
        instances.push(instance);
    }
    let meta = |key: &str| {
        read.open_table(META)
            .ok()
            .and_then(|m| m.get(key).ok().flatten().map(|v| v.value()))
    };
    // Kept under its first name: files written before the revision hold the 32-bit serial.
    let revision = meta("serial").unwrap_or(0);
    let alive_at = meta("alive_at").map(|v| v as Nanos);
    drop(table);
    drop(read);
    Ok((
        db,
        path,
        Loaded {
            instances,
            revision,
            alive_at,
        },
    ))
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use redb::ReadableTableMetadata;

    pub(in crate::store::redb) fn json(id: &str, port: u16) -> Vec<u8> {
        let body = serde_json::json!({"id": id, "name": "voice", "address": "127.0.0.1", "port": port});
        let instance: Instance = serde_json::from_value(body).expect("a valid body");
        serde_json::to_vec(&instance).unwrap()
    }

    /// Reopens the file and lists what it holds, as (id, port), sorted.
    pub(in crate::store::redb) fn held_after_open(dir: &Path) -> Vec<(String, u16)> {
        let (_, _, loaded) = open(dir).unwrap();
        let mut held: Vec<(String, u16)> = loaded.instances.iter().map(|i| (i.id.to_string(), i.port)).collect();
        held.sort();
        held
    }

    /// What a SIGKILL leaves: changes appended, never folded. The next start applies them
    /// over what `instances` held, in commit order, a removal included.
    #[test]
    fn changes_left_unfolded_are_applied_in_commit_order_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let (db, _, loaded) = open(dir.path()).unwrap();
        assert!(loaded.instances.is_empty());
        let txn = db.begin_write().unwrap();
        {
            let mut instances = txn.open_table(INSTANCES).unwrap();
            instances.insert("kept", json("kept", 1).as_slice()).unwrap();
            instances.insert("gone", json("gone", 2).as_slice()).unwrap();
            let mut changes = txn.open_table(CHANGES).unwrap();
            let a1 = json("a", 10);
            let a2 = json("a", 11);
            let b = json("b", 20);
            let log: [(&str, &[u8]); 5] = [("a", &a1), ("gone", &[]), ("b", &b), ("a", &a2), ("b", &[])];
            for (key, change) in log.into_iter().enumerate() {
                changes.insert(key as u64, change).unwrap();
            }
        }
        txn.commit().unwrap();
        drop(db);

        assert_eq!(
            held_after_open(dir.path()),
            [("a".to_owned(), 11), ("kept".to_owned(), 1)]
        );
        let (db, _, _) = open(dir.path()).unwrap();
        let read = db.begin_read().unwrap();
        assert_eq!(
            read.open_table(CHANGES).unwrap().len().unwrap(),
            0,
            "open folds every change"
        );
    }
}
