//! Whether etcd lets this node in, checked once when connecting, so that a setting etcd
//! refuses fails the start at once (exit 2) saying which, instead of showing later as
//! retries, timeouts and 503s: etcd's certificate against `--etcd-cacert`, this node's client
//! certificate against etcd's `--client-cert-auth`, the user and password, and the user's
//! permission on `--etcd-prefix`.
//!
//! The TLS part is a handshake of its own ([`check_tls`]): through tonic, a client
//! certificate that etcd rejects shows only as "connection closed" (TLS 1.3 rejects it after
//! the handshake has finished on the client's side), without etcd's alert saying why.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use rustls::pki_types::ServerName;
use rustls::{AlertDescription, CertificateError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::cluster::{Connection, PASSWORD_ENV};
use crate::store::Refused;
use crate::tls::Credentials;

/// The longest the TLS check waits on one endpoint for each of its steps; an endpoint that
/// does not answer within it is left to the connection proper (unreachable is not refused).
const STEP: Duration = Duration::from_secs(2);

/// The HTTP/2 client preface and an empty SETTINGS frame: what makes etcd (which tells gRPC
/// from HTTP/1 by the client's first bytes) answer, or send the alert that rejects the
/// client certificate.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";

/// For `https://` endpoints: one TLS handshake with the first endpoint that answers, with
/// the trust and client certificate the etcd client uses, then one read, which brings etcd's
/// rejection of the client certificate if there is one. Endpoints that cannot be reached are
/// skipped; when none answers, the connection proper reports it.
pub(super) async fn check_tls(connection: &Connection) -> anyhow::Result<()> {
    if !connection.tls() {
        return Ok(());
    }
    let identity = match (&connection.cert, &connection.key) {
        (Some(cert), Some(key)) => Some(Credentials::load_as(["--etcd-cert", "--etcd-key"], cert, key)?),
        _ => None,
    };
    let ca = connection.cacert.as_deref().map(|path| ("--etcd-cacert", path));
    let config = Arc::new(crate::tls::client_config(ca, identity.as_ref())?);
    for endpoint in &connection.endpoints {
        let Some((host, port)) = host_port(endpoint) else {
            continue;
        };
        let Ok(Ok(tcp)) = tokio::time::timeout(STEP, tokio::net::TcpStream::connect((host.as_str(), port))).await
        else {
            continue;
        };
        let name = ServerName::try_from(host.clone())
            .map_err(|e| Refused(format!("etcd endpoint {endpoint}: {host:?} is not a host name: {e}")))?;
        let connector = tokio_rustls::TlsConnector::from(config.clone());
        let refused = |e: std::io::Error| Refused(explain_tls(endpoint, connection, &e));
        let mut tls = match tokio::time::timeout(STEP, connector.connect(name, tcp)).await {
            Ok(Ok(tls)) => tls,
            Ok(Err(e)) => return Err(refused(e).into()),
            Err(_) => continue,
        };
        let mut first = [0u8; 9];
        let answered = async {
            tls.write_all(H2_PREFACE).await?;
            tls.flush().await?;
            tls.read(&mut first).await
        };
        return match tokio::time::timeout(STEP, answered).await {
            Ok(Ok(0)) => Err(Refused(closed(endpoint, connection)).into()),
            Ok(Err(e)) if is_tls(&e) => Err(refused(e).into()),
            Ok(Err(e)) if is_closed(&e) => Err(Refused(closed(endpoint, connection)).into()),
            // Answered, or silent, or another failure: for the connection proper to find out.
            _ => Ok(()),
        };
    }
    Ok(())
}

/// An error of TLS itself (an alert, a certificate), not of the connection under it.
fn is_tls(e: &std::io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<rustls::Error>())
}

/// The connection was closed under the client right after the handshake: what a server does
/// that drops a client certificate without saying why.
fn is_closed(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionReset, UnexpectedEof};
    matches!(e.kind(), ConnectionReset | UnexpectedEof | BrokenPipe)
}

/// `https://host:port/...` as the host (without an IPv6 address's brackets) and port.
fn host_port(endpoint: &str) -> Option<(String, u16)> {
    let uri: hyper::Uri = endpoint.parse().ok()?;
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']').to_owned();
    Some((host, uri.port_u16().unwrap_or(443)))
}

/// What a failed handshake or read says, in the operator's terms.
fn explain_tls(endpoint: &str, connection: &Connection, e: &std::io::Error) -> String {
    let Some(tls) = e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) else {
        return format!("etcd at {endpoint}: the TLS handshake failed: {e}");
    };
    let trusted = match &connection.cacert {
        Some(path) => format!("the CA in --etcd-cacert {}", path.display()),
        None => "the system's roots (give the CA that signed it with --etcd-cacert)".to_owned(),
    };
    match tls {
        rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer | CertificateError::BadSignature) => {
            format!("etcd at {endpoint}: its certificate is not signed by {trusted} ({tls})")
        }
        rustls::Error::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => format!(
            "etcd at {endpoint}: its certificate is not valid for that host name ({tls}); name etcd by a \
             host its certificate lists"
        ),
        rustls::Error::InvalidCertificate(_) => {
            format!("etcd at {endpoint}: its certificate is refused ({tls})")
        }
        // Go answers a missing client certificate with `certificate_required` (TLS 1.3, since
        // Go 1.20) or `bad_certificate` (etcd 3.4's Go 1.19, and TLS 1.2).
        rustls::Error::AlertReceived(
            alert @ (AlertDescription::CertificateRequired
            | AlertDescription::BadCertificate
            | AlertDescription::UnsupportedCertificate
            | AlertDescription::CertificateRevoked
            | AlertDescription::CertificateExpired
            | AlertDescription::CertificateUnknown
            | AlertDescription::UnknownCA
            | AlertDescription::AccessDenied
            | AlertDescription::HandshakeFailure),
        ) => match &connection.cert {
            Some(cert) => rejected(endpoint, cert, *alert),
            None => required(endpoint, *alert),
        },
        rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. } => {
            format!("etcd at {endpoint} does not answer TLS ({tls}); if it serves plain HTTP, give an http:// URL")
        }
        _ => format!("etcd at {endpoint}: the TLS handshake failed: {tls}"),
    }
}

/// The connection closed after the handshake, without an alert.
fn closed(endpoint: &str, connection: &Connection) -> String {
    match &connection.cert {
        Some(cert) => rejected(endpoint, cert, AlertDescription::BadCertificate),
        None => required(endpoint, AlertDescription::CertificateRequired),
    }
}

fn required(endpoint: &str, alert: AlertDescription) -> String {
    format!(
        "etcd at {endpoint} requires a client certificate (it runs with --client-cert-auth; its alert: \
         {alert:?}): give --etcd-cert and --etcd-key"
    )
}

fn rejected(endpoint: &str, cert: &Path, alert: AlertDescription) -> String {
    format!(
        "etcd at {endpoint} rejected the client certificate --etcd-cert {} (its alert: {alert:?}): is it \
         signed by the CA of etcd's --trusted-ca-file, meant for client authentication, and still valid?",
        cert.display()
    )
}

/// What a refused authentication says: a [`Refused`] when etcd refused the user.
pub(super) fn explain_connect(connection: &Connection, e: etcd_client::Error) -> anyhow::Error {
    let user = connection.user.as_ref().map_or("", |(name, _)| name.as_str());
    match &e {
        etcd_client::Error::GRpcStatus(s) if s.message().contains("authentication failed") => Refused(format!(
            "etcd refused the user {user}: wrong password or no such user (etcd: {}); check --etcd-user \
             and {PASSWORD_ENV}",
            s.message()
        ))
        .into(),
        etcd_client::Error::GRpcStatus(s) if s.message().contains("authentication is not enabled") => Refused(format!(
            "etcd has authentication disabled, yet --etcd-user {user} is given: enable it (etcdctl auth \
                 enable) or give no user"
        ))
        .into(),
        _ => anyhow::Error::new(e).context(format!(
            "cannot connect to etcd at {} (--etcd-endpoints)",
            connection.endpoints.join(",")
        )),
    }
}

/// Checks that this node may read and write under `prefix`, writing nothing: a transaction
/// whose comparison never holds, with a put under the prefix in its success branch (etcd
/// checks the permissions of both branches, and a transaction that changes nothing leaves
/// the revision alone).
pub(super) async fn check_access(client: &Client, connection: &Connection, prefix: &str) -> anyhow::Result<()> {
    let txn = Txn::new()
        .when([Compare::version(prefix, CompareOp::Less, 0)])
        .and_then([TxnOp::put(prefix, "", None)]);
    let checked = super::client::retrying(client, |mut client| {
        let txn = txn.clone();
        async move { client.txn(txn).await }
    });
    let e = match tokio::time::timeout(super::client::CALL_TIMEOUT, checked).await {
        Ok(Ok(_)) => return Ok(()),
        Ok(Err(e)) => e,
        Err(_) => anyhow::bail!("etcd did not answer within {:?}", super::client::CALL_TIMEOUT),
    };
    let who = match (&connection.user, &connection.cert) {
        (Some((user, _)), _) => format!("the user {user}"),
        (None, Some(cert)) => format!("the user named by the CN of --etcd-cert {}", cert.display()),
        (None, None) => "this node".to_owned(),
    };
    Err(match &e {
        etcd_client::Error::GRpcStatus(s) if s.message().contains("permission denied") => Refused(format!(
            "etcd denied {who} read and write under --etcd-prefix {prefix} ({}); grant a role of the user \
             readwrite on it: etcdctl role grant-permission ROLE readwrite {prefix} --prefix=true",
            s.message()
        ))
        .into(),
        etcd_client::Error::GRpcStatus(s) if s.message().contains("user name is empty") => Refused(format!(
            "etcd has authentication enabled, and no user was given ({}): give --etcd-user with \
             {PASSWORD_ENV}, or a client certificate whose CN is an etcd user",
            s.message()
        ))
        .into(),
        _ => anyhow::Error::new(e).context(format!(
            "cannot read etcd under {prefix} (is it up, and is it served over {}, as --etcd-endpoints say?)",
            if connection.tls() { "TLS" } else { "plain HTTP" }
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::host_port;

    #[test]
    fn an_endpoint_is_a_host_without_brackets_and_a_port_443_by_default() {
        assert_eq!(host_port("https://10.0.0.1:2379"), Some(("10.0.0.1".into(), 2379)));
        assert_eq!(host_port("https://[::1]:2379/"), Some(("::1".into(), 2379)));
        assert_eq!(
            host_port("https://etcd.example.net"),
            Some(("etcd.example.net".into(), 443))
        );
        assert_eq!(host_port("not a url"), None);
    }
}
