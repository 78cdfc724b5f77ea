//! `koder-dns migrate --to-etcd`.

use anyhow::Context;
use etcd_client::{DeleteOptions, GetOptions, Txn, TxnOp};
use tracing::info;

use super::client::connect;
use super::group::TXN_WRITES;
use crate::model::instance::Instance;

/// `koder-dns migrate --to-etcd`: copies the redb registry under `--data-dir` into etcd,
/// every instance stamped as renewed now (its registrant could not heart-beat while the
/// registry was being moved: it gets one full lease on the new one). Returns how many.
pub async fn migrate(
    data_dir: &std::path::Path,
    connection: &crate::cluster::Connection,
    prefix: &str,
    force: bool,
) -> anyhow::Result<usize> {
    let dir = data_dir.to_owned();
    let (db, path, loaded) = tokio::task::spawn_blocking(move || crate::store::redb::file::open(&dir)).await??;
    drop(db);
    let mut client = connect(connection, prefix).await?;
    let held = client
        .get(
            prefix.to_owned(),
            Some(GetOptions::new().with_prefix().with_count_only()),
        )
        .await
        .context("cannot read etcd")?
        .count();
    if held > 0 {
        if !force {
            anyhow::bail!(
                "etcd already holds {held} keys under {}: a registry is there; pass --force to replace it",
                prefix
            );
        }
        client
            .delete(prefix.to_owned(), Some(DeleteOptions::new().with_prefix()))
            .await
            .context("cannot clear the prefix")?;
    }
    let now = crate::model::clock::Clock::now(&crate::model::clock::SystemClock);
    let instances = super::instances_key(prefix);
    let total = loaded.instances.len();
    for chunk in loaded.instances.chunks(TXN_WRITES) {
        let puts: Vec<TxnOp> = chunk
            .iter()
            .map(|instance| {
                let instance = Instance {
                    updated_at: now,
                    ..instance.clone()
                };
                let json = serde_json::to_vec(&instance).expect("instances serialise");
                TxnOp::put(format!("{instances}{}", instance.id), json, None)
            })
            .collect();
        client
            .txn(Txn::new().and_then(puts))
            .await
            .context("cannot write to etcd")?;
    }
    // Once, at the end: the revision every node will show, above any they showed before.
    client
        .put(super::revision_key(prefix), "migrate", None)
        .await
        .context("cannot write to etcd")?;
    info!(from = %path.display(), total, "registry copied into etcd");
    Ok(total)
}
