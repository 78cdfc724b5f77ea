//! The HTTP accept loop. `axum::serve` has neither a connection bound nor a header-read
//! timeout, so we drive hyper ourselves: a slow or idle client holds one of a bounded number
//! of connections, and only for a bounded time.

use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::debug;

pub struct Limits {
    pub max_connections: usize,
    /// Connections one client address may hold open (`--http-max-connections-per-client`).
    pub max_connections_per_client: usize,
    /// Time a client has to send a request's headers (slowloris); the body and the answer
    /// are bounded by the request deadline in the router.
    pub header_timeout: Duration,
}

/// Serves until `shutdown`, then lets in-flight requests finish.
pub async fn serve(listener: TcpListener, router: Router, limits: Limits, shutdown: CancellationToken) {
    let header_timeout = limits.header_timeout;
    crate::listener::serve_bounded_per_client(
        listener,
        limits.max_connections,
        limits.max_connections_per_client,
        shutdown.clone(),
        |stream, _| {
            let service = TowerToHyperService::new(router.clone());
            let shutdown = shutdown.clone();
            async move {
                let mut builder = hyper::server::conn::http1::Builder::new();
                builder.timer(TokioTimer::new()).header_read_timeout(header_timeout);
                let connection = builder.serve_connection(TokioIo::new(stream), service);
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
        },
    )
    .await
}
