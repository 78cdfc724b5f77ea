//! Calls to etcd: connecting, timeouts, and what a failed call means for a write.

use std::future::Future;
use std::time::{Duration, Instant};

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, Identity, PutOptions, TlsOptions, Txn, TxnOp, TxnResponse,
};

use super::{Etcd, admission};
use crate::cluster::Connection;
use crate::store::StoreError;

/// Longest wait for one etcd call; past it a write's outcome is unknown.
pub(super) const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Connects; etcd-client balances over the endpoints and fails over between them. A
/// setting etcd refuses (its certificate, the client certificate, the user, the permission on
/// `prefix`) is a [`crate::store::Refused`] naming it.
pub(super) async fn connect(connection: &Connection, prefix: &str) -> anyhow::Result<Client> {
    admission::check_tls(connection).await?;
    let mut options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(1))
        .with_timeout(CALL_TIMEOUT)
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
        // A member cut off from the quorum cancels watches instead of going silent.
        .with_require_leader(true)
        // etcd's auth tokens expire (`--auth-token-ttl`, or a JWT's `ttl`) and die with the
        // member that issued them: a call refused for its token authenticates again and is
        // sent once more.
        .with_auto_token_refresh(true);
    if connection.tls() {
        // The files are read and checked by `check_tls`, each error naming its flag.
        let mut tls = TlsOptions::new();
        tls = match &connection.cacert {
            Some(path) => tls.ca_certificate(Certificate::from_pem(std::fs::read(path)?)),
            None => tls.with_native_roots(),
        };
        if let (Some(cert), Some(key)) = (&connection.cert, &connection.key) {
            tls = tls.identity(Identity::from_pem(std::fs::read(cert)?, std::fs::read(key)?));
        }
        options = options.with_tls(tls);
    }
    if let Some((user, password)) = &connection.user {
        options = options.with_user(user, password);
    }
    let client = Client::connect(&connection.endpoints, Some(options))
        .await
        .map_err(|e| admission::explain_connect(connection, e))?;
    admission::check_access(&client, connection, prefix).await?;
    Ok(client)
}

pub(super) fn outcome_unknown(what: &str) -> StoreError {
    StoreError::OutcomeUnknown(format!("etcd did not confirm the {what} in time"))
}

/// A failed call: unknown outcome when the request may have been carried out (cancelled,
/// timed out, or an unknown answer), unavailable when it was refused.
pub(super) fn classify(e: etcd_client::Error, what: &str) -> StoreError {
    match &e {
        // tonic's codes: 1 Cancelled, 2 Unknown, 4 DeadlineExceeded; etcd answers a proposal
        // it could not confirm in time with 14 Unavailable "request timed out".
        etcd_client::Error::GRpcStatus(s)
            if matches!(s.code() as i32, 1 | 2 | 4) || s.message().contains("timed out") =>
        {
            outcome_unknown(what)
        }
        _ => StoreError::Unavailable(format!("etcd refused the {what}: {e}")),
    }
}

/// A call that never reached a member: the connection was refused.
pub(super) fn refused(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => s.code() as i32 == 14 && s.message().contains("connect"),
        etcd_client::Error::TransportError(_) => true,
        _ => false,
    }
}

/// Runs `call` again (a few times, quickly) when the connection was refused. etcd-client
/// balances over every endpoint and keeps sending a share of the calls to a dead member;
/// such a call carried nothing, so trying again reaches a live one.
pub(super) async fn retrying<T, F, Fut>(client: &Client, mut call: F) -> Result<T, etcd_client::Error>
where
    F: FnMut(Client) -> Fut,
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    let mut tries = 0;
    loop {
        match call(client.clone()).await {
            Err(e) if refused(&e) && tries < 8 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(5 * tries)).await;
            }
            result => return result,
        }
    }
}

impl Etcd {
    /// One etcd call under [`CALL_TIMEOUT`] (tried again on a refused connection); a
    /// timeout leaves the outcome unknown.
    pub(super) async fn call<T, F, Fut>(&self, what: &str, call: F) -> Result<T, StoreError>
    where
        F: FnMut(Client) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let started = Instant::now();
        let result = match tokio::time::timeout(CALL_TIMEOUT, retrying(&self.client, call)).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => {
                let gone = refused(&e);
                let error = classify(e, what);
                if gone || matches!(error, StoreError::OutcomeUnknown(_)) {
                    self.suspect();
                }
                Err(error)
            }
            Err(_) => {
                self.suspect();
                Err(outcome_unknown(what))
            }
        };
        // The same series as redb's commits: an operator's dashboard works for both stores.
        crate::metrics::store_commit(result.is_ok(), started.elapsed());
        result
    }

    pub(super) async fn txn(&self, what: &str, txn: Txn) -> Result<TxnResponse, StoreError> {
        self.call(what, |mut client| {
            let txn = txn.clone();
            async move { client.txn(txn).await }
        })
        .await
    }

    /// Puts `key` (this node's id as its value) on a fresh lease of `ttl_s` seconds if no
    /// key is there: the lease and the key's `create_revision`, or `None` (and the lease
    /// revoked) when another holds it.
    pub(super) async fn claim(&self, key: &str, ttl_s: i64) -> Result<Option<(i64, i64)>, etcd_client::Error> {
        let lease = retrying(&self.client, |mut client| async move {
            client.lease_grant(ttl_s, None).await
        })
        .await?
        .id();
        let txn = Txn::new()
            .when([Compare::create_revision(key, CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key,
                self.node_id.clone(),
                Some(PutOptions::new().with_lease(lease)),
            )]);
        let answer = retrying(&self.client, |mut client| {
            let txn = txn.clone();
            async move { client.txn(txn).await }
        })
        .await?;
        if !answer.succeeded() {
            let _ = retrying(
                &self.client,
                |mut client| async move { client.lease_revoke(lease).await },
            )
            .await;
            return Ok(None);
        }
        Ok(Some((lease, answer.header().map_or(0, |h| h.revision()))))
    }
}
