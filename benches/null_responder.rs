//! A DNS responder that does nothing: the floor of what serving a query costs on this machine.
//! Each reply is the query's header and question sent back with QR and AA set, NOERROR and
//! no records (no lookup, no EDNS, no allocation). Over UDP, `THREADS` SO_REUSEPORT sockets,
//! each on a thread that takes queries with one `recvmmsg` and sends the replies with one
//! `sendmmsg`, in batches of 32 as koder-dns's own UDP workers do; over TCP, a thread per
//! connection that reads through a buffer and writes the replies to queries that arrived
//! together at once, as koder-dns does. `benches/dns-compare.sh` runs it as the peer `null`,
//! and reports koder-dns's QPS and answers per server core-second against it: what is left
//! to win is the lookup, the answer and koder-dns's bookkeeping, not the kernel's part.
//!
//! Usage: `null-responder ADDR:PORT THREADS [PAD]`; serves until killed. `PAD` bytes of zeros
//! after the question make each UDP reply as long as a real answer (`NULL_PAD` in
//! dns-compare.sh), so that what the kernel spends on a reply's size is on both sides.

use std::io::{BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;

use socket2::{Domain, Protocol, Socket, Type};

/// Datagrams per `recvmmsg`/`sendmmsg`.
const BATCH: usize = 32;
/// Room for one query: a longer one is truncated by the kernel and then ignored.
const MAX_QUERY: usize = 512;

/// Turns a query (the first `len` bytes of `msg`) into its reply in place, `pad` zero bytes
/// after the question; returns the reply's length, or `None` for a datagram that is not a
/// query with one well-formed question (it gets no reply).
fn reply_in_place(msg: &mut [u8], len: usize, pad: usize) -> Option<usize> {
    if len < 12 || msg[2] & 0x80 != 0 || msg[4..6] != [0, 1] {
        return None;
    }
    let mut at = 12;
    loop {
        let len = *msg.get(at)? as usize;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None;
        }
        at += 1 + len;
    }
    let end = at + 1 + 4;
    if end > len || end + pad > msg.len() {
        return None;
    }
    // QR and AA, opcode and RD kept; RA, Z, AD, CD and the rcode cleared; one question.
    msg[2] = 0x80 | (msg[2] & 0x79) | 0x04;
    msg[3] = 0;
    msg[6..12].fill(0);
    msg[end..end + pad].fill(0);
    Some(end + pad)
}

fn serve_udp(socket: std::net::UdpSocket, pad: usize) -> std::io::Result<()> {
    let fd = socket.as_raw_fd();
    let mut buffers = vec![[0u8; MAX_QUERY]; BATCH];
    // SAFETY: all-zero bytes are valid values of these plain C structs.
    let mut sources: Vec<libc::sockaddr_storage> = vec![unsafe { std::mem::zeroed() }; BATCH];
    // SAFETY: as above.
    let mut headers: Vec<libc::mmsghdr> = vec![unsafe { std::mem::zeroed() }; BATCH];
    let mut iovecs: Vec<libc::iovec> = vec![
        libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0
        };
        BATCH
    ];
    let mut lens = [0usize; BATCH];
    loop {
        for i in 0..BATCH {
            iovecs[i] = libc::iovec {
                iov_base: buffers[i].as_mut_ptr().cast(),
                iov_len: MAX_QUERY,
            };
            headers[i].msg_hdr.msg_iov = &mut iovecs[i];
            headers[i].msg_hdr.msg_iovlen = 1;
            headers[i].msg_hdr.msg_name = (&mut sources[i] as *mut libc::sockaddr_storage).cast();
            headers[i].msg_hdr.msg_namelen = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        }
        // SAFETY: every header points at its own buffer and address slot, exclusively
        // borrowed for the call.
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
            return Err(std::io::Error::last_os_error());
        }
        let mut out = 0;
        for i in 0..n as usize {
            let len = headers[i].msg_len as usize;
            if let Some(reply) = reply_in_place(&mut buffers[i], len, pad) {
                lens[out] = reply;
                if out != i {
                    buffers.swap(out, i);
                    sources.swap(out, i);
                    headers[out].msg_hdr.msg_namelen = headers[i].msg_hdr.msg_namelen;
                }
                out += 1;
            }
        }
        for i in 0..out {
            iovecs[i] = libc::iovec {
                iov_base: buffers[i].as_mut_ptr().cast(),
                iov_len: lens[i],
            };
            headers[i].msg_hdr.msg_iov = &mut iovecs[i];
            headers[i].msg_hdr.msg_name = (&mut sources[i] as *mut libc::sockaddr_storage).cast();
        }
        let mut sent = 0;
        while sent < out {
            // SAFETY: the headers from `sent` to `out` point at this batch's replies and
            // source addresses, exclusively borrowed for the call, which only reads them.
            let n = unsafe { libc::sendmmsg(fd, headers[sent..].as_mut_ptr(), (out - sent) as libc::c_uint, 0) };
            if n <= 0 {
                break; // a full send buffer drops the rest, as a loaded server does
            }
            sent += n as usize;
        }
    }
}

/// Whether `buffered` starts with a whole framed message.
fn holds_message(buffered: &[u8]) -> bool {
    match *buffered {
        [l0, l1, ref rest @ ..] => rest.len() >= usize::from(u16::from_be_bytes([l0, l1])),
        _ => false,
    }
}

/// Reads through a 4 KiB buffer and writes the replies to queries that arrived together in
/// one write, as koder-dns's TCP connections do, so that the two do the same system calls.
fn serve_tcp(stream: TcpStream) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::with_capacity(4096, stream.try_clone()?);
    let mut writer = stream;
    let mut message = vec![0u8; 65535];
    let mut out = Vec::new();
    loop {
        if !out.is_empty() && (out.len() >= 65536 || !holds_message(reader.buffer())) {
            writer.write_all(&out)?;
            out.clear();
        }
        let mut len = [0u8; 2];
        reader.read_exact(&mut len)?;
        let len = usize::from(u16::from_be_bytes(len));
        reader.read_exact(&mut message[..len])?;
        let Some(reply) = reply_in_place(&mut message, len, 0) else {
            return writer.write_all(&out);
        };
        out.extend_from_slice(&(reply as u16).to_be_bytes());
        out.extend_from_slice(&message[..reply]);
    }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(addr), Some(threads)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: null-responder ADDR:PORT THREADS [PAD] (e.g. 127.0.0.1:5300 2)");
    };
    let addr: SocketAddr = addr.parse()?;
    let threads: usize = threads.parse()?;
    let pad: usize = args.next().map_or(Ok(0), |p| p.parse())?;
    let mut workers = Vec::new();
    for _ in 0..threads.max(1) {
        let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
        socket.set_reuse_port(true)?;
        socket.bind(&addr.into())?;
        let socket: std::net::UdpSocket = socket.into();
        workers.push(std::thread::spawn(move || serve_udp(socket, pad)));
    }
    let listener = TcpListener::bind(addr)?;
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || serve_tcp(stream));
        }
    });
    for worker in workers {
        worker.join().expect("a UDP worker panicked")?;
    }
    Ok(())
}
