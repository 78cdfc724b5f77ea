//! NOTIFY (RFC 1996): tells each `--notify` secondary that the service zone's serial moved,
//! so it transfers at once rather than at its next SOA refresh.
//!
//! At most one NOTIFY per [`COALESCE`]: the first change after a quiet spell is told at
//! once, and the changes that follow within the window go out together when it ends, with
//! the serial of that moment. So a lone registration reaches the secondaries without delay,
//! and a burst is a few NOTIFYs (and IXFRs) per secondary, not one per change. (Waiting a
//! window before every NOTIFY put 100 ms into every propagation: Knot's p50 was 124 ms.)
//! Each secondary is retried with doubling back-off until it answers; a newer serial
//! replaces a pending one.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::RecordType;
use tokio::net::UdpSocket;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::Authority;
use crate::registry::Registry;

/// The shortest time between two NOTIFYs: changes within it are gathered into one.
pub const COALESCE: Duration = Duration::from_millis(100);

/// The first wait for an answer; doubled at each retry up to [`MAX_BACKOFF`].
const FIRST_WAIT: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Sends NOTIFY to `targets` at start and after every serial change, until `shutdown`.
pub async fn run(registry: Arc<Registry>, authority: Authority, targets: Vec<SocketAddr>, shutdown: CancellationToken) {
    if targets.is_empty() {
        return;
    }
    let (tx, _) = tokio::sync::watch::channel(registry.current_serial());
    for target in targets {
        let rx = tx.subscribe();
        tokio::spawn(notify_one(authority.clone(), target, rx, shutdown.clone()));
    }
    loop {
        let changed = registry.changed();
        let serial = registry.current_serial();
        if *tx.borrow() != serial {
            tx.send_replace(serial);
            // Changes from here on wait for the window to end, then go out together.
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(COALESCE) => {}
            }
            continue;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = changed => {}
            // Leases that end move the serial without a write: look when the next one is due.
            _ = tokio::time::sleep(registry.until_next_expiry().unwrap_or(Duration::from_secs(3600))) => {}
        }
    }
}

/// One secondary: NOTIFY for the latest serial, retried until answered.
async fn notify_one(
    authority: Authority,
    target: SocketAddr,
    mut serials: tokio::sync::watch::Receiver<u32>,
    shutdown: CancellationToken,
) {
    let bind: SocketAddr = if target.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }
        .parse()
        .expect("an address");
    let socket = match UdpSocket::bind(bind).await {
        Ok(socket) => socket,
        Err(error) => {
            warn!(%target, %error, "cannot open a socket for NOTIFY; the secondary will follow its SOA refresh");
            return;
        }
    };
    // The serial at start is sent too: it may have moved while we were down.
    serials.mark_changed();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = serials.changed() => if changed.is_err() { return },
        }
        let serial = *serials.borrow_and_update();
        let mut wait = FIRST_WAIT;
        let mut tries = 0u32;
        loop {
            tries += 1;
            let started = tokio::time::Instant::now();
            // Waiting `wait` for the answer is the back-off; a newer serial replaces this
            // one, and shutdown ends the retries.
            let outcome = tokio::select! {
                _ = shutdown.cancelled() => return,
                outcome = send(&authority, &socket, target, wait) => outcome,
                changed = serials.changed() => {
                    if changed.is_err() { return }
                    serials.mark_changed();
                    break;
                }
            };
            match outcome {
                Ok(()) => {
                    debug!(%target, serial, tries, "NOTIFY answered");
                    break;
                }
                Err(reason) => {
                    if tries == 3 {
                        info!(%target, serial, %reason, "NOTIFY not answered yet; retrying with back-off");
                    }
                    // An error back at once (an ICMP refusal, a REFUSED): wait out the rest.
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep_until(started + wait) => {}
                    }
                }
            }
            wait = (wait * 2).min(MAX_BACKOFF);
        }
    }
}

/// One NOTIFY and the wait for its answer.
async fn send(authority: &Authority, socket: &UdpSocket, target: SocketAddr, wait: Duration) -> Result<(), String> {
    let id = fastrand::u16(..);
    let mut message = Message::new(id, MessageType::Query, OpCode::Notify);
    message.metadata.authoritative = true;
    message.add_query(Query::query(authority.origin(), RecordType::SOA));
    message.add_answer(authority.soa());
    let bytes = message.to_vec().map_err(|e| e.to_string())?;
    socket.send_to(&bytes, target).await.map_err(|e| e.to_string())?;
    let mut buf = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let (len, from) = tokio::time::timeout_at(deadline, socket.recv_from(&mut buf))
            .await
            .map_err(|_| "no answer".to_owned())?
            .map_err(|e| e.to_string())?;
        let Ok(reply) = Message::from_vec(&buf[..len]) else {
            continue;
        };
        if from == target && reply.metadata.id == id && reply.metadata.message_type == MessageType::Response {
            return match reply.metadata.response_code {
                ResponseCode::NoError => Ok(()),
                code => Err(format!("answered {code}")),
            };
        }
    }
}
