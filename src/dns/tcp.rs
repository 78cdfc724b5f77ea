//! DNS over TCP, and over TLS (RFC 7858), with a bound on open connections and an idle
//! timeout. hickory's own TCP listener spawns a task per connection without limit, so we
//! accept here and feed each framed message to the same [`Authority`] the UDP workers use.
//! Both transports frame messages the same way (RFC 7766 §8), so one connection loop serves
//! both, over a plain stream or a TLS one.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hickory_server::net::xfer::Protocol;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::{Authority, handle_bytes, transfer};
use crate::metrics::{self, Transport};

pub struct Limits {
    pub max_connections: usize,
    /// Closes a connection that sends nothing for this long (a TLS handshake included).
    pub idle_timeout: Duration,
}

/// The ALPN protocol of DNS over TLS (RFC 7858, as IANA registered it).
pub const DOT_ALPN: &[u8] = b"dot";

/// Accepts until `shutdown`; connections beyond the limit wait in the listen backlog. With
/// `tls`, each connection is DNS over TLS: the handshake, then the same framed messages.
pub async fn serve(
    listener: TcpListener,
    authority: Authority,
    limits: Limits,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: CancellationToken,
) {
    let idle = limits.idle_timeout;
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    crate::listener::serve_bounded(listener, limits.max_connections, shutdown.clone(), |stream, src| {
        let (authority, shutdown, tls) = (authority.clone(), shutdown.clone(), tls.clone());
        async move {
            let _ = stream.set_nodelay(true);
            let served = async {
                match tls {
                    None => connection(stream, src, authority, idle, Transport::Tcp).await,
                    Some(tls) => {
                        if let Ok(Ok(stream)) = tokio::time::timeout(idle, tls.accept(stream)).await {
                            connection(stream, src, authority, idle, Transport::Tls).await;
                        }
                    }
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => {}
                _ = served => {}
            }
        }
    })
    .await
}

/// Answers framed messages one after another until the client goes quiet or misbehaves.
async fn connection<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    src: SocketAddr,
    authority: Authority,
    idle: Duration,
    transport: Transport,
) {
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
                    metrics::dns_reply(transport, &reply);
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
        metrics::dns_reply(transport, &reply);
        if !write_framed(&mut stream, &reply, idle).await {
            return;
        }
    }
}

/// Writes one message with its length in front, in one write (one TLS record): with
/// TCP_NODELAY a separate 2-byte write would go out as a packet of its own. False when the
/// client is gone or stalled.
async fn write_framed<S: AsyncWrite + Unpin>(stream: &mut S, reply: &[u8], idle: Duration) -> bool {
    let mut framed = Vec::with_capacity(reply.len() + 2);
    framed.extend_from_slice(&(reply.len() as u16).to_be_bytes());
    framed.extend_from_slice(reply);
    let write = async {
        stream.write_all(&framed).await?;
        // A TLS stream holds what it encrypted until flushed; a TCP one sends at once.
        stream.flush().await
    };
    matches!(tokio::time::timeout(idle, write).await, Ok(Ok(())))
}
