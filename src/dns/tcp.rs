//! DNS over TCP, and over TLS (RFC 7858), with a bound on open connections and an idle
//! timeout. hickory's own TCP listener spawns a task per connection without limit, so we
//! accept here and feed each framed message to the same [`Authority`] the UDP workers use.
//! Both transports frame messages the same way (RFC 7766 §8), so one connection loop serves
//! both, over a plain stream or a TLS one.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hickory_server::net::xfer::Protocol;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
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

/// How much of a connection is read at once. A client that pipelines queries (RFC 7766
/// §6.2.1.1) sends several per segment: read through this buffer they cost one system call
/// between them, where a read of the length and one of the message cost two each.
const READ_BUFFER: usize = 4 * 1024;

/// Replies held back while more queries are already read, at most: then they go out.
const WRITE_BATCH: usize = 64 * 1024;

/// Answers framed messages one after another until the client goes quiet or misbehaves.
/// Replies to queries that arrived together leave together, in one write: each is sent
/// once no further complete query is waiting in the read buffer (or [`WRITE_BATCH`] is
/// reached), so none waits on a query that has not arrived. dnsperf over 8 connections with
/// 200 queries outstanding got 159k answers/s from one core before, 361k-386k after
/// (`PIN=1 DNSPERF_MODE=tcp benches/dns-compare.sh`, medians of 5 rounds, 5 runs).
async fn connection<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    src: SocketAddr,
    authority: Authority,
    idle: Duration,
    transport: Transport,
) {
    let mut stream = BufReader::with_capacity(READ_BUFFER, stream);
    let (mut message, mut reply, mut out) = (Vec::new(), Vec::new(), Vec::new());
    loop {
        if !holds_message(stream.buffer()) && !write_out(&mut stream, &mut out, idle).await {
            return;
        }
        let read = async {
            let mut len = [0u8; 2];
            stream.read_exact(&mut len).await?;
            // A rare long query does not leave its room behind on an idle connection.
            message.clear();
            message.shrink_to(READ_BUFFER);
            message.resize(usize::from(u16::from_be_bytes(len)), 0);
            stream.read_exact(&mut message).await
        };
        let Ok(Ok(_)) = tokio::time::timeout(idle, read).await else {
            return;
        };
        if message.len() < 2 {
            // Not a DNS message: the connection ends, after the replies already answered.
            write_out(&mut stream, &mut out, idle).await;
            return;
        }
        if transfer::requested(&message).is_some() {
            // What was answered before goes first.
            if !write_out(&mut stream, &mut out, idle).await {
                return;
            }
            // Built off the runtime's threads (a 100k-instance zone takes a while) and
            // written as each message is ready.
            let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
            let (authority, message) = (authority.clone(), message.clone());
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
                frame(&mut out, &reply);
                if !write_out(&mut stream, &mut out, idle).await {
                    return;
                }
            }
            continue;
        }
        if !handle_bytes(&authority, &message, src, Protocol::Tcp, &mut reply).await {
            continue;
        }
        metrics::dns_reply(transport, &reply);
        // At most WRITE_BATCH held, or one long reply.
        if out.len() + 2 + reply.len() > WRITE_BATCH && !write_out(&mut stream, &mut out, idle).await {
            return;
        }
        frame(&mut out, &reply);
    }
}

/// Whether `buffered` starts with a whole framed message.
fn holds_message(buffered: &[u8]) -> bool {
    match *buffered {
        [l0, l1, ref rest @ ..] => rest.len() >= usize::from(u16::from_be_bytes([l0, l1])),
        _ => false,
    }
}

/// Appends `reply` to `out` with its length in front (RFC 7766 §8).
fn frame(out: &mut Vec<u8>, reply: &[u8]) {
    out.extend_from_slice(&(reply.len() as u16).to_be_bytes());
    out.extend_from_slice(reply);
}

/// Writes the framed replies in `out` in one write (over TLS, a record per 16 KiB), and
/// empties it: with TCP_NODELAY a separate 2-byte length would go out as a packet of its
/// own. False when the client is gone or stalled.
async fn write_out<S: AsyncWrite + Unpin>(stream: &mut S, out: &mut Vec<u8>, idle: Duration) -> bool {
    if out.is_empty() {
        return true;
    }
    let write = async {
        stream.write_all(out).await?;
        // A TLS stream holds what it encrypted until flushed; a TCP one sends at once.
        stream.flush().await
    };
    let written = matches!(tokio::time::timeout(idle, write).await, Ok(Ok(())));
    out.clear();
    out.shrink_to(WRITE_BATCH);
    written
}
