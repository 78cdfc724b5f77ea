//! One raw DNS message in, one reply out: the entry point the UDP workers, the TCP
//! listener and the fuzzer share.

use std::net::SocketAddr;
use std::sync::Arc;

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::Record;
use hickory_proto::serialize::binary::BinEncoder;
use hickory_server::net::NetError;
use hickory_server::net::runtime::TokioTime;
use hickory_server::net::xfer::Protocol;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::zone_handler::MessageResponse;
use parking_lot::Mutex;

use super::Authority;

/// Collects the one response the handler sends for a request, encoded as hickory's own
/// server would for `protocol`: over UDP within the response's EDNS payload (512 without),
/// with TC set by the encoder if anything is cut.
#[derive(Clone)]
struct Reply {
    protocol: Protocol,
    bytes: Arc<Mutex<Option<Vec<u8>>>>,
}

#[async_trait::async_trait]
impl ResponseHandler for Reply {
    async fn send_response<'a>(
        &mut self,
        response: MessageResponse<
            '_,
            'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
        >,
    ) -> Result<ResponseInfo, NetError> {
        let mut bytes = Vec::with_capacity(512);
        let mut encoder = BinEncoder::new(&mut bytes);
        encoder.set_max_size(match self.protocol {
            Protocol::Udp => response.edns().map_or(512, |e| e.max_payload().max(512)),
            _ => u16::MAX,
        });
        let info = response.destructive_emit(&mut encoder)?;
        *self.bytes.lock() = Some(bytes);
        Ok(info)
    }
}

/// Answers one raw DNS message the way the servers do: responses (QR=1) get no reply,
/// undecodable messages with an id get FORMERR, others whatever the authority says.
pub async fn handle_bytes(authority: &Authority, message: Vec<u8>, src: SocketAddr, protocol: Protocol) -> Option<Vec<u8>> {
    let id = u16::from_be_bytes([*message.first()?, *message.get(1)?]);
    match Request::from_bytes(message, src, protocol) {
        Ok(request) if request.metadata.message_type == MessageType::Response => None,
        Ok(request) => {
            let reply = Reply { protocol, bytes: Arc::default() };
            authority.handle_request::<_, TokioTime>(&request, reply.clone()).await;
            reply.bytes.lock().take()
        }
        Err(_) => Message::error_msg(id, OpCode::Query, ResponseCode::FormErr).to_vec().ok(),
    }
}
