//! DNS over TCP with a bound on open connections and an idle timeout. hickory's own TCP
//! listener spawns a task per connection without limit, so we accept here and feed each
//! framed message to the same [`Authority`] the UDP workers use.

use std::net::SocketAddr;
use std::time::Duration;

use hickory_server::net::xfer::Protocol;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::{Authority, handle_bytes};
use crate::metrics::{self, Transport};

pub struct Limits {
    pub max_connections: usize,
    /// Closes a connection that sends nothing for this long.
    pub idle_timeout: Duration,
}

/// Accepts until `shutdown`; connections beyond the limit wait in the listen backlog.
pub async fn serve(listener: TcpListener, authority: Authority, limits: Limits, shutdown: CancellationToken) {
    let idle = limits.idle_timeout;
    crate::listener::serve_bounded(listener, limits.max_connections, shutdown.clone(), |stream, src| {
        let (authority, shutdown) = (authority.clone(), shutdown.clone());
        async move {
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = connection(stream, src, authority, idle) => {}
            }
        }
    })
    .await
}

/// Answers framed messages one after another until the client goes quiet or misbehaves.
async fn connection(mut stream: TcpStream, src: SocketAddr, authority: Authority, idle: Duration) {
    let _ = stream.set_nodelay(true);
    let mut reply = Vec::new();
    loop {
        let read = async {
            let mut len = [0u8; 2];
            stream.read_exact(&mut len).await?;
            let mut message = vec![0u8; u16::from_be_bytes(len) as usize];
            stream.read_exact(&mut message).await?;
            std::io::Result::Ok(message)
        };
        let Ok(Ok(message)) = tokio::time::timeout(idle, read).await else {
            return;
        };
        if message.len() < 2 {
            return;
        }
        if !handle_bytes(&authority, &message, src, Protocol::Tcp, &mut reply).await {
            continue;
        }
        metrics::dns_reply(Transport::Tcp, &reply);
        let write = async {
            stream.write_all(&(reply.len() as u16).to_be_bytes()).await?;
            stream.write_all(&reply).await
        };
        if !matches!(tokio::time::timeout(idle, write).await, Ok(Ok(()))) {
            return;
        }
    }
}
