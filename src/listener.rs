//! A TCP accept loop with a bound on open connections, shared by DNS over TCP and HTTP.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

/// Accepts until `shutdown`, running `handle` for each connection with at most `max` open at
/// once (further clients wait in the listen backlog), then waits for the open ones to end.
/// `handle` is responsible for ending its connection on `shutdown`.
pub async fn serve_bounded<F, Fut>(listener: TcpListener, max: usize, shutdown: CancellationToken, handle: F)
where
    F: Fn(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    serve_bounded_per_client(listener, max, usize::MAX, shutdown, handle).await
}

/// [`serve_bounded`], with at most `per_client` connections open from one client address:
/// beyond it a new connection from that address is closed at once, so one client cannot
/// take every slot and make everyone else wait.
pub async fn serve_bounded_per_client<F, Fut>(
    listener: TcpListener,
    max: usize,
    per_client: usize,
    shutdown: CancellationToken,
    handle: F,
) where
    F: Fn(TcpStream, SocketAddr) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let open: Arc<Mutex<HashMap<IpAddr, usize>>> = Arc::default();
    let mut refused: u64 = 0;
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
        let client = src.ip();
        {
            let mut open = open.lock();
            let count = open.entry(client).or_default();
            if *count >= per_client {
                refused += 1;
                // Counted, and said once per thousand, so a flood cannot flood the log.
                if refused % 1000 == 1 {
                    warn!(%client, per_client, refused, "closed connections beyond the per-client limit");
                }
                continue;
            }
            *count += 1;
        }
        let connection = handle(stream, src);
        let open = open.clone();
        connections.spawn(async move {
            connection.await;
            let mut open = open.lock();
            if let Some(count) = open.get_mut(&client) {
                *count -= 1;
                if *count == 0 {
                    open.remove(&client);
                }
            }
            drop(permit);
        });
    }
    connections.close();
    connections.wait().await;
}
