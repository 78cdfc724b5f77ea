//! DNS over TCP with a bound on open connections and an idle timeout. hickory's own TCP
//! listener spawns a task per connection without limit, so we accept here and feed each
//! framed message to the same [`Authority`] the UDP workers use.

use std::net::SocketAddr;
use std::time::Duration;

use hickory_server::net::xfer::Protocol;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::{Authority, handle_bytes, transfer};
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
        if transfer::requested(&message).is_some() {
            // Built off the runtime's threads (a 100k-instance zone takes a while) and
            // written as each message is ready.
            let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
            let authority = authority.clone();
            tokio::task::spawn_blocking(move || {
                transfer::answer(&authority, &message, src, &mut |reply| {
                    let _ = tx.blocking_send(reply);
                })
            });
            let mut first = true;
            while let Some(reply) = rx.recv().await {
                if std::mem::take(&mut first) {
                    metrics::dns_reply(Transport::Tcp, &reply);
                }
                if !write_framed(&mut stream, &reply, idle).await {
                    return;
                }
            }
            continue;
        }
        if !handle_bytes(&authority, &message, src, Protocol::Tcp, &mut reply).await {
            continue;
        }
        metrics::dns_reply(Transport::Tcp, &reply);
        if !write_framed(&mut stream, &reply, idle).await {
            return;
        }
    }
}

/// Writes one message with its length in front, in one write: with TCP_NODELAY a separate
/// 2-byte write would go out as a packet of its own. False when the client is gone or stalled.
async fn write_framed(stream: &mut TcpStream, reply: &[u8], idle: Duration) -> bool {
    let mut framed = Vec::with_capacity(reply.len() + 2);
    framed.extend_from_slice(&(reply.len() as u16).to_be_bytes());
    framed.extend_from_slice(reply);
    matches!(tokio::time::timeout(idle, stream.write_all(&framed)).await, Ok(Ok(())))
}
