//! The ceiling of hickory-server's own `Server` on this machine: a handler that does no work
//! (every query gets an empty authoritative NOERROR, built with hickory's response types)
//! behind `Server` on `THREADS` SO_REUSEPORT sockets and as many tokio workers.
//! `benches/dns-compare.sh` runs it as the peer `hickory` (`PEERS="nsd knot hickory"`), so its
//! QPS sits in the same table as NSD, Knot and koder-dns, which serves UDP on its own worker
//! threads instead (see README, "DNS").
//!
//! Usage: `hickory-ceiling ADDR:PORT THREADS`; serves until killed.

use std::net::SocketAddr;

use hickory_proto::op::{Header, HeaderCounts, Metadata, ResponseCode};
use hickory_server::Server;
use hickory_server::net::runtime::Time;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::zone_handler::MessageResponseBuilder;

struct Trivial;

#[async_trait::async_trait]
impl RequestHandler for Trivial {
    async fn handle_request<R: ResponseHandler, T: Time>(&self, request: &Request, mut response: R) -> ResponseInfo {
        let mut meta = Metadata::response_from_request(&request.metadata);
        meta.authoritative = true;
        let message = MessageResponseBuilder::from_message_request(request).build_no_records(meta);
        response.send_response(message).await.unwrap_or_else(|_| {
            meta.response_code = ResponseCode::ServFail;
            ResponseInfo::from(Header {
                metadata: meta,
                counts: HeaderCounts::default(),
            })
        })
    }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(addr), Some(threads)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: hickory-ceiling ADDR:PORT THREADS (e.g. 127.0.0.1:5300 2)");
    };
    let addr: SocketAddr = addr.parse()?;
    let threads: usize = threads.parse()?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?
        .block_on(async {
            let (udp, tcp) = koder_dns::dns::bind(addr, threads).await?;
            let mut server = Server::new(Trivial);
            for socket in udp {
                server.register_socket(tokio::net::UdpSocket::from_std(socket)?);
            }
            server.register_listener(tcp, std::time::Duration::from_secs(5), 65535);
            println!("hickory-ceiling: trivial handler on {addr}, {threads} sockets and workers");
            server.block_until_done().await?;
            Ok(())
        })
}
