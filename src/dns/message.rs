//! One raw DNS message in, one reply out: the fast path of prepared answers first, then
//! hickory's request handling, shared by the UDP workers, the TCP listener and the fuzzer.
//! (The UDP workers call the two halves apart, to run only the second on their runtime.)

use std::net::SocketAddr;
use std::sync::Arc;

use hickory_proto::op::{Edns, Header, Message, MessageType, Metadata, OpCode, ResponseCode};
use hickory_proto::rr::{DNSClass, LowerName, Name, Record, RecordType};
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
/// and its OPT record if any. The header is read with hickory's decoder, the question and
/// the OPT record by hand, without building a `Request` or allocating.
pub(super) struct Question<'a> {
    pub metadata: Metadata,
    pub name: WireName,
    pub qtype: RecordType,
    pub qclass: DNSClass,
    /// The question's bytes as the client sent them.
    pub raw: &'a [u8],
    pub edns: Option<QueryOpt<'a>>,
}

/// A question's name in lower case, as it is on the wire (each label after its length, up
/// to the root), read into a buffer on the stack. hickory's `Name::read` and
/// `to_lowercase` built two label vectors per query, and its `zone_of` and label iterators
/// walked them again: about a quarter of koder-dns's own CPU on a UDP worker at 100k
/// queries/s (perf), against one pass over the bytes here.
pub(super) struct WireName {
    bytes: [u8; 255],
    len: usize,
}

impl WireName {
    /// The name at the start of `bytes`, and its length there. `None` for a compression
    /// pointer or an extended label type, a name over 255 bytes, or one cut short: the full
    /// parse answers those.
    fn read(bytes: &[u8]) -> Option<Self> {
        let mut len = 0;
        loop {
            let label = usize::from(*bytes.get(len)?);
            if label > 63 {
                return None;
            }
            len += 1 + label;
            if label == 0 {
                break;
            }
        }
        let mut name = Self { bytes: [0; 255], len };
        name.bytes.get_mut(..len)?.copy_from_slice(bytes.get(..len)?);
        // Length bytes are below 64, under every upper-case letter: only letters change.
        name.bytes[..len].make_ascii_lowercase();
        Some(name)
    }

    /// The part of the name above `origin` (a lower-case name in wire form), when the name
    /// is `origin` or below it.
    pub fn below<'n>(&'n self, origin: &[u8]) -> Option<Below<'n>> {
        let mut at = 0;
        // Each step stays on a label's start before the root, as the lengths add up to `len`.
        while self.len - at > origin.len() {
            at += 1 + usize::from(self.bytes[at]);
        }
        (self.bytes[at..self.len] == *origin).then_some(Below { name: self, end: at })
    }
}

/// A name inside the zone, as [`WireName::below`] finds it: the labels before the origin's.
pub(super) struct Below<'n> {
    name: &'n WireName,
    end: usize,
}

impl Below<'_> {
    /// The labels above the origin, from the leftmost.
    pub fn labels(&self) -> impl Iterator<Item = &[u8]> {
        let mut rest = &self.name.bytes[..self.end];
        std::iter::from_fn(move || {
            let (&len, tail) = rest.split_first()?;
            let (label, tail) = tail.split_at(usize::from(len));
            rest = tail;
            Some(label)
        })
    }

    /// How many labels the name has below the origin; a `*` label counts.
    pub fn depth(&self) -> usize {
        self.labels().count()
    }

    /// The whole name as hickory's, for the answers that are built rather than copied.
    pub fn lower_name(&self) -> LowerName {
        let mut decoder = BinDecoder::new(&self.name.bytes[..self.name.len]);
        LowerName::new(&Name::read(&mut decoder).expect("a name read by WireName::read decodes"))
    }
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
    /// `None` for anything but one question and at most an OPT record: the full parse takes
    /// those, and names [`WireName::read`] leaves to it.
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
        let name = WireName::read(&message[start..])?;
        let end = start + name.len + 4;
        let raw = message.get(start..end)?;
        let [t0, t1, c0, c1] = raw[name.len..] else {
            return None;
        };
        let edns = match counts.additionals {
            0 => None,
            _ => Some(QueryOpt::read(&message[end..])?),
        };
        Some(Self {
            metadata,
            name,
            qtype: RecordType::from(u16::from_be_bytes([t0, t1])),
            qclass: DNSClass::from(u16::from_be_bytes([c0, c1])),
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
    crate::zone::prepared::write_bare(metadata, question.raw, opt, out);
    true
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ORIGIN: &[u8] = b"\x07service\x05koder\x00";

    /// The name's labels, each after its length, then the root.
    fn wire_of<'a>(labels: impl Iterator<Item = &'a [u8]>) -> Vec<u8> {
        let mut bytes = Vec::new();
        for label in labels {
            bytes.push(label.len() as u8);
            bytes.extend_from_slice(label);
        }
        bytes.push(0);
        bytes
    }

    fn wire(name: &str) -> Vec<u8> {
        wire_of(Name::from_ascii(name).unwrap().iter())
    }

    /// What hickory says of the same bytes: the name, in lower case, and whether it is in
    /// the zone.
    fn hickory(bytes: &[u8]) -> Option<(LowerName, bool)> {
        let name = LowerName::new(&Name::read(&mut BinDecoder::new(bytes)).ok()?);
        let origin = LowerName::new(&Name::read(&mut BinDecoder::new(ORIGIN)).unwrap());
        let inside = origin.zone_of(&name);
        Some((name, inside))
    }

    #[test]
    fn a_name_is_lowered_and_placed_under_the_origin_at_a_label_boundary() {
        let name = WireName::read(&wire("_Voice._TCP.Service.KODER.")).unwrap();
        let below = name.below(ORIGIN).expect("inside the zone");
        assert_eq!(below.labels().collect::<Vec<_>>(), [&b"_voice"[..], b"_tcp"]);
        assert_eq!(below.depth(), 2);
        assert_eq!(below.lower_name().to_string(), "_voice._tcp.service.koder.");
        let apex = WireName::read(&wire("service.koder.")).unwrap();
        assert_eq!(apex.below(ORIGIN).map(|b| b.depth()), Some(0));
        // The zone's name as the tail of a label is not the zone.
        for outside in ["xservice.koder.", "koder.", "service.koder.example.", "."] {
            let name = WireName::read(&wire(outside)).unwrap();
            assert!(name.below(ORIGIN).is_none(), "{outside}");
        }
    }

    #[test]
    fn names_the_full_parse_must_judge_are_left_to_it() {
        // A compression pointer, an extended label type, a name cut short, one over 255 bytes.
        assert!(WireName::read(b"\x05voice\xc0\x0c").is_none());
        assert!(WireName::read(b"\x45voice\x00").is_none());
        assert!(WireName::read(b"\x05voi").is_none());
        assert!(WireName::read(b"\x05voice").is_none());
        let long: Vec<u8> = std::iter::repeat_n(
            &b"\x3fabcdefghijabcdefghijabcdefghijabcdefghijabcdefghijabcdefghijabc"[..],
            4,
        )
        .flatten()
        .copied()
        .chain([0])
        .collect();
        assert_eq!(long.len(), 257);
        assert!(WireName::read(&long).is_none());
        assert!(WireName::read(&long[64..]).is_some());
    }

    proptest! {
        /// On any bytes, the name read by hand is hickory's name in lower case, in the zone
        /// exactly when hickory says so; what hickory cannot read is not read by hand either.
        #[test]
        fn wire_names_agree_with_hickory(
            labels in proptest::collection::vec(
                prop_oneof![
                    Just(b"service".to_vec()),
                    Just(b"KODER".to_vec()),
                    Just(b"Koder".to_vec()),
                    Just(b"xservice".to_vec()),
                    proptest::collection::vec(any::<u8>(), 1..70),
                ],
                0..6,
            ),
            pointer in any::<bool>(),
        ) {
            let mut bytes = wire_of(labels.iter().map(Vec::as_slice));
            if pointer {
                bytes.pop();
                bytes.extend_from_slice(&[0xc0, 0x0c]);
            }
            let ours = WireName::read(&bytes);
            match hickory(&bytes) {
                Some((name, inside)) if !pointer => {
                    let ours = ours.expect("hickory read it");
                    prop_assert_eq!(&ours.bytes[..ours.len], &wire_of(name.iter())[..]);
                    let below = ours.below(ORIGIN);
                    prop_assert_eq!(below.is_some(), inside);
                    if let Some(below) = below {
                        prop_assert_eq!(below.lower_name(), name);
                    }
                }
                _ => prop_assert!(ours.is_none()),
            }
        }
    }
}
