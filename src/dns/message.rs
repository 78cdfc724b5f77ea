//! One raw DNS message in, one reply out: the fast path of prepared answers first, then
//! hickory's request handling, shared by the UDP workers, the TCP listener and the fuzzer.
//! (The UDP workers call the two halves apart, to run only the second on their runtime.)

use std::net::SocketAddr;
use std::sync::Arc;

use hickory_proto::op::{Edns, Header, Message, MessageType, Metadata, OpCode, Query, ResponseCode};
use hickory_proto::rr::Record;
use hickory_proto::serialize::binary::{BinDecodable, BinDecoder, BinEncoder};
use hickory_server::net::NetError;
use hickory_server::net::runtime::TokioTime;
use hickory_server::net::xfer::Protocol;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::zone_handler::MessageResponse;
use parking_lot::Mutex;

use super::cookie;
use super::tsig::{self, Verdict};
use super::{Authority, response_limit};

/// Bytes kept free in a signed reply for its TSIG record: the key name (up to 255), the
/// fixed fields and algorithm name (about 40) and an HMAC-SHA512 MAC (64).
const TSIG_ROOM: usize = 360;

/// Collects the one response the handler sends for a request, encoded within `limit` bytes;
/// the encoder sets TC if anything is cut.
#[derive(Clone)]
struct Reply {
    limit: u16,
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
        encoder.set_max_size(self.limit);
        let info = response.destructive_emit(&mut encoder)?;
        *self.bytes.lock() = Some(bytes);
        Ok(info)
    }
}

/// What the fast path needs of a plain query (opcode aside): its header, its one question
/// and its OPT record if any. Read with hickory's decoders for the header and question, and
/// by hand for the OPT record, without building a `Request` or allocating.
pub(super) struct Question<'a> {
    pub metadata: Metadata,
    pub query: Query,
    /// The question's bytes as the client sent them.
    pub raw: &'a [u8],
    pub edns: Option<QueryOpt<'a>>,
}

/// A query's OPT record (RFC 6891), as far as answering needs it.
#[derive(Clone, Copy, Debug)]
pub(super) struct QueryOpt<'a> {
    /// The client's UDP buffer.
    pub max_payload: u16,
    pub version: u8,
    pub dnssec_ok: bool,
    /// The Compact Answers OK flag (RFC 9824 §3): NXDOMAIN wanted with compact denial.
    pub compact_ok: bool,
    /// Whether it asks for NSID (RFC 5001).
    pub nsid: bool,
    /// The COOKIE option, `Some(None)` when it is malformed (see [`cookie::Sent::parse`])
    /// or there are two.
    pub cookie: Option<Option<cookie::Sent<'a>>>,
}

impl<'a> QueryOpt<'a> {
    /// The OPT record at the start of `record`: root owner, type OPT, then the rest.
    /// `None` for anything else, or options that do not add up to its length.
    fn read(record: &'a [u8]) -> Option<Self> {
        let [0, 0, 41, p0, p1, _rcode, version, flags, _, l0, l1, ref options @ ..] = *record else {
            return None;
        };
        let options = options.get(..usize::from(u16::from_be_bytes([l0, l1])))?;
        let mut opt = Self {
            max_payload: u16::from_be_bytes([p0, p1]),
            version,
            dnssec_ok: flags & 0x80 != 0,
            compact_ok: flags & 0x40 != 0,
            nsid: false,
            cookie: None,
        };
        let mut rest = options;
        while let [c0, c1, n0, n1, ref tail @ ..] = *rest {
            let len = usize::from(u16::from_be_bytes([n0, n1]));
            let data = tail.get(..len)?;
            match u16::from_be_bytes([c0, c1]) {
                3 => opt.nsid = true,
                cookie::CODE => {
                    opt.cookie = Some(match opt.cookie {
                        None => cookie::Sent::parse(data),
                        Some(_) => None,
                    })
                }
                _ => {}
            }
            rest = &tail[len..];
        }
        rest.is_empty().then_some(opt)
    }
}

impl<'a> Question<'a> {
    /// `None` for anything but one question and at most an OPT record: the full parse takes those.
    pub(super) fn read(message: &'a [u8]) -> Option<Self> {
        let mut decoder = BinDecoder::new(message);
        let Header { metadata, counts } = Header::read(&mut decoder).ok()?;
        if metadata.message_type != MessageType::Query
            || (counts.queries, counts.answers, counts.authorities) != (1, 0, 0)
            || counts.additionals > 1
        {
            return None;
        }
        let start = decoder.index();
        let query = Query::read(&mut decoder).ok()?;
        let end = decoder.index();
        let raw = &message[start..end];
        if raw.len() != written_out(query.name().iter()) + 4 {
            return None;
        }
        let edns = match counts.additionals {
            0 => None,
            _ => Some(QueryOpt::read(&message[end..])?),
        };
        Some(Self {
            metadata,
            query,
            raw,
            edns,
        })
    }
}

/// The length of a name of `labels` written out, without compression pointers. A question
/// with a pointer can only point back into the header; echoed as sent (as hickory echoes
/// it, to keep the client's letter case) it would point into our reply's header instead, so
/// such a question gets FORMERR.
fn written_out<'a>(labels: impl Iterator<Item = &'a [u8]>) -> usize {
    labels.map(|label| label.len() + 1).sum::<usize>() + 1
}

/// The fast path alone: answers `message` from prepared bytes into `out` when it can,
/// synchronously (a miss prepares the answer first). False means [`handle_full`] must
/// answer it.
pub fn handle_prepared(
    authority: &Authority,
    message: &[u8],
    src: SocketAddr,
    protocol: Protocol,
    out: &mut Vec<u8>,
) -> bool {
    Question::read(message).is_some_and(|question| authority.write_prepared(&question, src, protocol, out))
}

/// The reply that response rate limiting sends in place of an answer now and then (see
/// [`super::rrl`]): the question, TC set, no records, and the OPT record with a server
/// cookie, so that a real client retries over TCP or with the cookie. False for a message
/// that is not a plain query: that one is dropped.
pub fn slip(authority: &Authority, message: &[u8], src: SocketAddr, out: &mut Vec<u8>) -> bool {
    let Some(question) = Question::read(message) else {
        return false;
    };
    let mut metadata = Metadata::response_from_request(&question.metadata);
    metadata.truncation = true;
    let opt = authority.reply_opt(question.edns, src);
    crate::zone::prepared::write_bare(metadata, question.raw, opt, out)
}

/// Answers one raw DNS message the way the servers do: responses (QR=1) get no reply,
/// undecodable messages with an id get FORMERR, others whatever the authority says.
/// Returns whether there is a reply, which is then in `out`.
pub async fn handle_bytes(
    authority: &Authority,
    message: &[u8],
    src: SocketAddr,
    protocol: Protocol,
    out: &mut Vec<u8>,
) -> bool {
    handle_prepared(authority, message, src, protocol, out) || handle_full(authority, message, src, protocol, out).await
}

/// [`handle_bytes`] without the fast path: the whole request parsed and answered through
/// hickory's handler types.
pub async fn handle_full(
    authority: &Authority,
    message: &[u8],
    src: SocketAddr,
    protocol: Protocol,
    out: &mut Vec<u8>,
) -> bool {
    // Shorter than a header: no reply, as NSD does, so that junk is not answered in kind.
    let [a, b, flags, _, _, _, _, _, _, _, _, _, ..] = *message else {
        return false;
    };
    let formerr = |out: &mut Vec<u8>| {
        let mut reply = Message::error_msg(u16::from_be_bytes([a, b]), OpCode::Query, ResponseCode::FormErr);
        // RD is copied into every response (RFC 1035 §4.1.1), as NSD and Knot do here too.
        reply.metadata.recursion_desired = flags & 1 == 1;
        match reply.to_vec() {
            Ok(bytes) => {
                *out = bytes;
                true
            }
            Err(_) => false,
        }
    };
    match Request::from_bytes(message.to_vec(), src, protocol) {
        Ok(request) if request.metadata.message_type == MessageType::Response => false,
        Ok(request)
            if request.queries.as_bytes().len()
                != request
                    .queries
                    .queries()
                    .iter()
                    .map(|q| written_out(q.name().iter()) + 4)
                    .sum::<usize>() =>
        {
            formerr(out)
        }
        Ok(request) => {
            let now = tsig::now();
            let (edns, _) = authority.full_reply_edns(request.edns.as_ref(), src.ip());
            let mut signing = match authority.tsig().verify(message, now, edns.as_ref()) {
                Verdict::Rejected(reply) => {
                    *out = reply;
                    return true;
                }
                Verdict::Signed(signing) => Some(signing),
                Verdict::Unsigned => None,
            };
            let limit = response_limit(
                request.protocol(),
                request.edns.as_ref().map(Edns::max_payload),
                authority.0.wire.udp_max_payload,
            );
            // Room for the TSIG record a signed reply ends with.
            let limit = limit - if signing.is_some() { TSIG_ROOM } else { 0 };
            let reply = Reply {
                limit: limit as u16,
                bytes: Arc::default(),
            };
            authority.handle_request::<_, TokioTime>(&request, reply.clone()).await;
            let Some(bytes) = reply.bytes.lock().take() else {
                return false;
            };
            *out = bytes;
            if let Some(signing) = &mut signing {
                signing.sign(out, now);
            }
            true
        }
        Err(_) => formerr(out),
    }
}
