//! DNS over UDP: one thread per worker, each with its own `SO_REUSEPORT` socket, answering
//! datagrams in batches: one blocking `recvmmsg` takes up to [`BATCH`] queued queries, each is
//! answered inline, one `sendmmsg` returns the replies.
//!
//! hickory's `Server` funnels a socket through one task and spawns a task per request;
//! measured here that cost more CPU than answering. Answering inline removes the spawn, the
//! channel and the copies, and keeps DNS on threads of its own, so REST load and churn on
//! the main runtime do not queue in front of queries. Batching the socket calls is what NSD
//! and Knot do too: under load a worker makes two system calls per batch instead of two per
//! query. A worker sleeps in `recvmmsg` itself rather than in an event loop, which saves the
//! `epoll_wait` and the empty read of every wake-up; the few queries the prepared answers do
//! not cover run on a small runtime of the worker's own.
//!
//! With `--dns-rrl-rate`, each query is first charged to its client network (see
//! [`super::rrl`]); one over the rate, unless it carries a valid server cookie, is dropped or
//! slipped before any work is spent on its answer. With the limit off that is one test of
//! an `Option` per datagram.

#[cfg(not(target_os = "linux"))]
compile_error!("koder-dns serves DNS over UDP with recvmmsg/sendmmsg, which need Linux");

use std::io;
use std::net::{SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;

use crate::metrics::{self, Transport};
use hickory_server::net::xfer::Protocol;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::rrl::Verdict;
use super::{Authority, handle_full, handle_prepared, slip};

/// Largest datagram we read.
const RECV_BUFFER: usize = super::MAX_UDP_PAYLOAD as usize;
/// Datagrams taken per `recvmmsg`.
const BATCH: usize = 32;
/// How often a worker waiting for queries looks whether the server is shutting down.
const SHUTDOWN_POLL: Duration = Duration::from_millis(100);

/// A reply is never sent to port 0 or to an unspecified or broadcast address (as hickory's
/// server refuses them too): those sources are forged.
fn answerable(src: SocketAddr) -> bool {
    src.port() != 0
        && match src {
            SocketAddr::V4(v4) => !v4.ip().is_unspecified() && !v4.ip().is_broadcast(),
            SocketAddr::V6(v6) => !v6.ip().is_unspecified(),
        }
}

/// The buffers of one batch: datagrams in, their sources, and the replies out.
struct Batch {
    datagrams: Vec<u8>,
    lens: [usize; BATCH],
    sources: [libc::sockaddr_storage; BATCH],
    source_lens: [libc::socklen_t; BATCH],
    /// The system call's own headers; their pointers are set for every call.
    iovecs: [libc::iovec; BATCH],
    headers: [libc::mmsghdr; BATCH],
    replies: Vec<Vec<u8>>,
    /// Slots with a reply to send, in order.
    outgoing: Vec<usize>,
}

impl Batch {
    fn new() -> Box<Self> {
        Box::new(Self {
            datagrams: vec![0; BATCH * RECV_BUFFER],
            lens: [0; BATCH],
            // SAFETY: sockaddr_storage is plain old data; all zeros is a valid (AF_UNSPEC) value.
            sources: unsafe { std::mem::zeroed() },
            source_lens: [0; BATCH],
            // SAFETY: iovec is plain old data; a null base with length 0 is valid, and aim()
            // points each one at its buffer before any system call reads it.
            iovecs: unsafe { std::mem::zeroed() },
            // SAFETY: mmsghdr is plain old data; null pointers with zero lengths are valid, and
            // aim() fills each header in before any system call reads it.
            headers: unsafe { std::mem::zeroed() },
            replies: (0..BATCH).map(|_| Vec::with_capacity(512)).collect(),
            outgoing: Vec::with_capacity(BATCH),
        })
    }

    /// Waits for datagrams on `fd` (at most the socket's read timeout), then takes those
    /// queued, up to [`BATCH`].
    fn recv(&mut self, fd: RawFd) -> io::Result<usize> {
        let Self {
            datagrams,
            sources,
            iovecs,
            headers,
            ..
        } = self;
        for (i, ((iov, header), source)) in iovecs
            .iter_mut()
            .zip(headers.iter_mut())
            .zip(sources.iter_mut())
            .enumerate()
        {
            let slot = &mut datagrams[i * RECV_BUFFER..(i + 1) * RECV_BUFFER];
            aim(
                header,
                iov,
                slot,
                source,
                size_of::<libc::sockaddr_storage>() as libc::socklen_t,
            );
        }
        // SAFETY: each header points at its own buffer and source slot in this batch, all
        // exclusively borrowed for the call.
        let n = unsafe {
            libc::recvmmsg(
                fd,
                headers.as_mut_ptr(),
                BATCH as libc::c_uint,
                libc::MSG_WAITFORONE,
                std::ptr::null_mut(),
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let n = n as usize;
        for (i, header) in self.headers[..n].iter().enumerate() {
            self.lens[i] = header.msg_len as usize;
            self.source_lens[i] = header.msg_hdr.msg_namelen;
        }
        Ok(n)
    }

    fn datagram(&self, i: usize) -> &[u8] {
        &self.datagrams[i * RECV_BUFFER..i * RECV_BUFFER + self.lens[i]]
    }

    fn source(&self, i: usize) -> Option<SocketAddr> {
        let storage = &self.sources[i];
        let len = self.source_lens[i] as usize;
        match storage.ss_family as libc::c_int {
            libc::AF_INET if len >= size_of::<libc::sockaddr_in>() => {
                // SAFETY: the kernel wrote an AF_INET address of at least sockaddr_in's length
                // (checked above); sockaddr_storage is large and aligned enough for it.
                let a = unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
                Some(SocketAddr::V4(SocketAddrV4::new(
                    u32::from_be(a.sin_addr.s_addr).into(),
                    u16::from_be(a.sin_port),
                )))
            }
            libc::AF_INET6 if len >= size_of::<libc::sockaddr_in6>() => {
                // SAFETY: the kernel wrote an AF_INET6 address of at least sockaddr_in6's length
                // (checked above); sockaddr_storage is large and aligned enough for it.
                let a = unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
                let (ip, port, flow) = (
                    a.sin6_addr.s6_addr.into(),
                    u16::from_be(a.sin6_port),
                    u32::from_be(a.sin6_flowinfo),
                );
                Some(SocketAddr::V6(SocketAddrV6::new(ip, port, flow, a.sin6_scope_id)))
            }
            _ => None,
        }
    }

    /// Sends the replies of `outgoing[from..]`, each to the source of its query; returns
    /// how many went. An error means none did.
    fn send(&mut self, fd: RawFd, from: usize) -> io::Result<usize> {
        let Self {
            sources,
            source_lens,
            iovecs,
            headers,
            replies,
            outgoing,
            ..
        } = self;
        let slots = &outgoing[from..];
        for ((&slot, iov), header) in slots.iter().zip(iovecs.iter_mut()).zip(headers.iter_mut()) {
            aim(header, iov, &mut replies[slot], &mut sources[slot], source_lens[slot]);
        }
        // SAFETY: the first `slots.len()` headers point at replies and addresses of this
        // batch, exclusively borrowed for the call, which only reads them.
        let n = unsafe { libc::sendmmsg(fd, headers.as_mut_ptr(), slots.len() as libc::c_uint, 0) };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
}

/// Points `header` (through `iov`) at one datagram buffer and one peer address of `len`
/// bytes, for the next `recvmmsg` or `sendmmsg`.
fn aim(
    header: &mut libc::mmsghdr,
    iov: &mut libc::iovec,
    buffer: &mut [u8],
    address: &mut libc::sockaddr_storage,
    len: libc::socklen_t,
) {
    iov.iov_base = buffer.as_mut_ptr().cast();
    iov.iov_len = buffer.len();
    header.msg_hdr.msg_iov = iov;
    header.msg_hdr.msg_iovlen = 1;
    header.msg_hdr.msg_name = (address as *mut libc::sockaddr_storage).cast();
    header.msg_hdr.msg_namelen = len;
}

/// One worker: answers until `shutdown`. The socket is blocking with timeouts, so the
/// worker sleeps in `recvmmsg` yet notices a shutdown within [`SHUTDOWN_POLL`], and a full
/// send buffer costs a reply, not the worker.
fn serve(
    socket: &std::net::UdpSocket,
    authority: &Authority,
    runtime: &tokio::runtime::Runtime,
    shutdown: &CancellationToken,
) -> io::Result<()> {
    socket.set_nonblocking(false)?;
    socket.set_read_timeout(Some(SHUTDOWN_POLL))?;
    socket.set_write_timeout(Some(SHUTDOWN_POLL))?;
    let fd = socket.as_raw_fd();
    let mut batch = Batch::new();
    let limiter = authority.rate_limiter();
    // Responses over the rate so far, for every `--dns-rrl-slip`-th to slip.
    let mut limited = 0;
    while !shutdown.is_cancelled() {
        let n = match batch.recv(fd) {
            Ok(n) => n,
            Err(error) if matches!(error.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => continue,
            Err(error) => {
                // Not a query's fault; do not spin on it.
                debug!(%error, "DNS UDP receive failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        batch.outgoing.clear();
        // Over the rate: dropped or slipped before any work on the answer. A datagram that
        // gets no reply anyway (a response, a runt) is not counted.
        let mut over = [false; BATCH];
        if let Some(rrl) = limiter {
            let charged = |i: usize| {
                let query = batch.datagram(i);
                let src = batch.source(i).filter(|&src| answerable(src))?;
                (query.len() >= 12 && query[2] & 0x80 == 0).then_some(src.ip())
            };
            let sources: [Option<std::net::IpAddr>; BATCH] =
                std::array::from_fn(|i| if i < n { charged(i) } else { None });
            rrl.charge_batch(rrl.now(), &sources[..n], &mut over[..n]);
        }
        for (i, &over) in over[..n].iter().enumerate() {
            let Some(src) = batch.source(i).filter(|&src| answerable(src)) else {
                continue;
            };
            let mut reply = std::mem::take(&mut batch.replies[i]);
            let query = batch.datagram(i);
            if let Some(rrl) = limiter
                && over
                && !authority.has_valid_cookie(query, src.ip())
            {
                let slipped = rrl.over_rate(&mut limited) == Verdict::Slip && slip(authority, query, src, &mut reply);
                metrics::rate_limited(slipped);
                if slipped {
                    batch.outgoing.push(i);
                }
                batch.replies[i] = reply;
                continue;
            }
            if handle_prepared(authority, query, src, Protocol::Udp, &mut reply)
                || runtime.block_on(handle_full(authority, query, src, Protocol::Udp, &mut reply))
            {
                metrics::dns_reply(Transport::Udp, &reply);
                batch.outgoing.push(i);
            }
            batch.replies[i] = reply;
        }
        let mut sent = 0;
        while sent < batch.outgoing.len() {
            match batch.send(fd, sent) {
                Ok(n) => sent += n,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => {
                    // That reply is lost, as a failed send_to would lose it; go on with the rest.
                    debug!(%error, dst = ?batch.source(batch.outgoing[sent]), "DNS UDP send failed");
                    sent += 1;
                }
            }
        }
    }
    Ok(())
}

/// Starts one worker thread per socket; the returned task ends when they all have. (The
/// threads report over channels rather than being joined from `spawn_blocking`, which
/// would hold up the drop of a runtime whose server was never shut down.)
pub fn spawn(
    sockets: Vec<std::net::UdpSocket>,
    authority: Authority,
    shutdown: CancellationToken,
) -> io::Result<tokio::task::JoinHandle<()>> {
    let mut done = Vec::with_capacity(sockets.len());
    for (i, socket) in sockets.into_iter().enumerate() {
        let (authority, shutdown) = (authority.clone(), shutdown.clone());
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let (finished, finished_rx) = tokio::sync::oneshot::channel::<()>();
        done.push(finished_rx);
        std::thread::Builder::new()
            .name(format!("koder-dns-udp-{i}"))
            .spawn(move || {
                // A panic answering a query (a bug) must not leave the socket unserved.
                loop {
                    let run = std::panic::AssertUnwindSafe(|| serve(&socket, &authority, &runtime, &shutdown));
                    match std::panic::catch_unwind(run) {
                        Ok(Ok(())) => break,
                        Ok(Err(error)) => {
                            tracing::error!(%error, "cannot use a DNS UDP socket");
                            break;
                        }
                        Err(_) => tracing::error!("a DNS UDP worker panicked; it goes on with a fresh batch"),
                    }
                }
                drop(finished);
            })?;
    }
    Ok(tokio::spawn(async move {
        for finished in done {
            let _ = finished.await;
        }
    }))
}
