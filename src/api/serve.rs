//! The HTTP accept loop. `axum::serve` has neither a connection bound nor a header-read
//! timeout, so we drive hyper ourselves: a slow or idle client holds one of a bounded number
//! of connections, and only for a bounded time.
//!
//! HTTPS is served here too, by tokio-rustls inside the same loop: the connection bound, the
//! per-client bound and the header timeout then hold for TLS connections unchanged, with the
//! handshake bounded by the same timeout, and the certificate comes from the swappable
//! [`crate::tls::ServerCert`] each handshake reads. (axum-server's rustls acceptor would
//! bring its own accept loop, without our bounds, beside this one.)

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::auth::Connection;

pub struct Limits {
    pub max_connections: usize,
    /// Connections one client address may hold open (`--http-max-connections-per-client`).
    pub max_connections_per_client: usize,
    /// Time a client has to finish the TLS handshake, and to send a request's headers
    /// (slowloris); the body and the answer are bounded by the request deadline in the router.
    pub header_timeout: Duration,
}

/// The ALPN protocol HTTPS offers: HTTP/1.1 is all this loop speaks.
pub const HTTPS_ALPN: &[u8] = b"http/1.1";

/// Serves until `shutdown`, then lets in-flight requests finish. With `tls`, every
/// connection is HTTPS: a client that does not complete a TLS handshake gets no HTTP answer.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: CancellationToken,
) {
    let header_timeout = limits.header_timeout;
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    crate::listener::serve_bounded_per_client(
        listener,
        limits.max_connections,
        limits.max_connections_per_client,
        shutdown.clone(),
        |stream, client| {
            let service = WithClient {
                router: router.clone(),
                connection: Connection {
                    client,
                    last_key: Default::default(),
                },
            };
            let (shutdown, tls) = (shutdown.clone(), tls.clone());
            async move {
                let Some(tls) = tls else {
                    return connection(TokioIo::new(stream), service, header_timeout, shutdown).await;
                };
                let handshake = tokio::time::timeout(header_timeout, tls.accept(stream));
                let stream = tokio::select! {
                    accepted = handshake => match accepted {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(error)) => return debug!(%client, %error, "TLS handshake failed"),
                        Err(_) => return debug!(%client, "TLS handshake not finished within the header timeout"),
                    },
                    _ = shutdown.cancelled() => return,
                };
                connection(TokioIo::new(stream), service, header_timeout, shutdown).await
            }
        },
    )
    .await
}

/// One HTTP/1.1 connection, over TCP or TLS, until the client leaves or `shutdown`.
async fn connection<I>(io: I, service: WithClient, header_timeout: Duration, shutdown: CancellationToken)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(header_timeout);
    let connection = builder.serve_connection(io, service);
    tokio::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => {
            if let Err(error) = result {
                debug!(%error, "HTTP connection ended with an error");
            }
        }
        _ = shutdown.cancelled() => {
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        }
    }
}

/// The router, with what is known of the connection put on each request ([`Connection`]).
#[derive(Clone)]
struct WithClient {
    router: Router,
    connection: Connection,
}

impl hyper::service::Service<hyper::Request<Incoming>> for WithClient {
    type Response = axum::response::Response;
    type Error = Infallible;
    type Future = axum::routing::future::RouteFuture<Infallible>;

    fn call(&self, mut request: hyper::Request<Incoming>) -> Self::Future {
        request.extensions_mut().insert(self.connection.clone());
        tower_service::Service::call(&mut self.router.clone(), request)
    }
}
