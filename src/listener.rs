//! A TCP accept loop with a bound on open connections, shared by DNS over TCP and HTTP.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

/// Accepts until `shutdown`, running `handle` for each connection with at most `max` open at
/// once (further clients wait in the listen backlog), then waits for the open ones to end.
/// `handle` is responsible for ending its connection on `shutdown`.
pub async fn serve_bounded<F, Fut>(listener: TcpListener, max: usize, shutdown: CancellationToken, handle: F)
where
    F: Fn(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let permits = Arc::new(Semaphore::new(max));
    let connections = TaskTracker::new();
    loop {
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break,
            permit = permits.clone().acquire_owned() => permit.expect("the semaphore is never closed"),
        };
        let (stream, src) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    debug!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        let connection = handle(stream, src);
        connections.spawn(async move {
            connection.await;
            drop(permit);
        });
    }
    connections.close();
    connections.wait().await;
}
