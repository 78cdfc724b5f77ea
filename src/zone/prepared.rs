//! Prepared answers: a service's answers encoded once per view and served by copying bytes.
//!
//! Encoding a response with hickory costs several microseconds a query (records cloned,
//! a compression table of heap-allocated suffixes, bytes written one bounds check at a
//! time), yet an answer only changes when its service's view does. So the first query for a
//! (service, type) encodes each record of the answer with hickory, once, and later queries
//! copy them. Every record is encoded after the question alone, so its names are compressed
//! against the question and nothing else: any order of the records, and any subset of them,
//! is a valid message. A response is the request's own header fields and question (the
//! prepared one up to letter case, so every pointer into it stays valid and the answers
//! echo the client's case), the answers starting at a random one (the order rotates from
//! response to response), the additional records that fit, and an OPT record for EDNS
//! clients; when the answers do not all fit the client's buffer, TC and no records at all.
//! One exception to "compressed against the question only": an additional record whose
//! owner is an SRV answer's target (its address) is written with a pointer to that target,
//! wherever the rotation put it, as NSD and Knot compress glue: 16 bytes instead of 30 for
//! an IPv4 `<hex>.addr` name, so 20 SRV records over UDP at 1232 bytes carry 15 addresses
//! rather than 8.
//!
//! A prepared answer is kept in the view it was built from, so a change to the service
//! (registration, removal, health flip, a lease moved earlier) drops it with the view.
//! Heartbeats only move leases later, which leaves the view alone: a prepared answer is
//! good until the earliest lease it answers for comes within its TTL, and is then built
//! again with the deadlines of the moment. An answer that holds another service's addresses
//! (an SRV target that is a name of the zone) depends on that service's view too: it keeps
//! the registry's count of view changes it was built at, and is built again once any view
//! has changed.
//!
//! Negative answers (NXDOMAIN, NODATA) carry the zone's SOA, which changes with the serial
//! rather than with a view: [`SoaTail`] keeps it encoded for the current serial.

use std::sync::Arc;

use arc_swap::ArcSwapOption;
use compact_str::CompactString;
use hickory_proto::op::{HeaderCounts, MessageType, Metadata, Query, ResponseCode};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use hickory_proto::serialize::binary::{BinEncodable, BinEncoder, NameEncoding};

use crate::model::clock::{Nanos, SECOND};

/// The OPT record of a response to an EDNS request: what we accept over UDP
/// (`--dns-udp-max-payload`), the request's DO bit copied (RFC 3225 §3), and the COOKIE
/// option (client and server cookie) when the request carried a client cookie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Opt {
    pub max_payload: u16,
    pub dnssec_ok: bool,
    /// The Compact Answers OK flag (RFC 9824 §3), echoed with DO.
    pub compact_ok: bool,
    pub cookie: Option<[u8; COOKIE_LEN]>,
}

/// The size of an OPT record without options.
const OPT_LEN: usize = 11;
/// A COOKIE option's data in a reply: an 8-byte client and a 16-byte server cookie.
const COOKIE_LEN: usize = 24;

impl Opt {
    /// The record's size.
    fn len(self) -> usize {
        OPT_LEN + self.cookie.map_or(0, |_| 4 + COOKIE_LEN)
    }

    /// The record written out: root owner, type OPT, the payload as class, extended
    /// RCODE 0, version 0, the DO and CO flags, and the COOKIE option if any.
    fn write(self, out: &mut Vec<u8>) {
        let [p0, p1] = self.max_payload.to_be_bytes();
        let flags = match (self.dnssec_ok, self.compact_ok) {
            (true, true) => 0xc0,
            (true, false) => 0x80,
            _ => 0,
        };
        let [l0, l1] = ((self.len() - OPT_LEN) as u16).to_be_bytes();
        out.extend_from_slice(&[0, 0, 41, p0, p1, 0, 0, flags, 0, l0, l1]);
        if let Some(cookie) = self.cookie {
            out.extend_from_slice(&[0, 10, 0, COOKIE_LEN as u8]);
            out.extend_from_slice(&cookie);
        }
    }
}

/// The bytes the OPT record adds to a response: its length for EDNS requests, else none.
fn opt_len(edns: Option<Opt>) -> usize {
    edns.map_or(0, Opt::len)
}

/// A response header on the wire, as hickory's `Header::emit` writes it (a test holds
/// them equal), written by hand: through hickory's encoder, one bounds-checked byte at a
/// time, it was a tenth of koder-dns's own CPU on a UDP worker at 100k queries/s (perf).
fn header_bytes(metadata: &Metadata, counts: HeaderCounts) -> [u8; 12] {
    let [i0, i1] = metadata.id.to_be_bytes();
    let bit = |on: bool, bit: u8| if on { bit } else { 0 };
    let first = bit(metadata.message_type == MessageType::Response, 0x80)
        | u8::from(metadata.op_code) << 3
        | bit(metadata.authoritative, 0x04)
        | bit(metadata.truncation, 0x02)
        | bit(metadata.recursion_desired, 0x01);
    let second = bit(metadata.recursion_available, 0x80)
        | bit(metadata.authentic_data, 0x20)
        | bit(metadata.checking_disabled, 0x10)
        | metadata.response_code.low();
    let [q0, q1] = counts.queries.to_be_bytes();
    let [a0, a1] = counts.answers.to_be_bytes();
    let [n0, n1] = counts.authorities.to_be_bytes();
    let [d0, d1] = counts.additionals.to_be_bytes();
    [i0, i1, first, second, q0, q1, a0, a1, n0, n1, d0, d1]
}

/// `out` holds a response with room for the header and the question at its start: writes
/// them for `metadata` and `counts`, and appends the OPT record when `edns`.
fn finish(out: &mut Vec<u8>, metadata: Metadata, mut counts: HeaderCounts, question: &[u8], edns: Option<Opt>) {
    counts.additionals += edns.is_some() as u16;
    out[..12].copy_from_slice(&header_bytes(&metadata, counts));
    out[12..12 + question.len()].copy_from_slice(question);
    if let Some(opt) = edns {
        opt.write(out);
    }
}

/// Writes a response of `metadata`, the question and the OPT record only, into `out`.
pub fn write_bare(metadata: Metadata, question: &[u8], edns: Option<Opt>, out: &mut Vec<u8>) {
    out.clear();
    out.resize(12 + question.len(), 0);
    let counts = HeaderCounts {
        queries: 1,
        ..HeaderCounts::default()
    };
    finish(out, metadata, counts, question, edns);
}

/// The header of an authoritative response to a request with `request` metadata.
fn authoritative(request: &Metadata, code: ResponseCode) -> Metadata {
    let mut response = Metadata::response_from_request(request);
    response.authoritative = true;
    response.response_code = code;
    response
}

/// Which answer of a service: the record type, and for `_<name>._<protocol>` the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Key {
    qtype: RecordType,
    /// Inline: protocols are short.
    protocol: Option<CompactString>,
    /// With RRSIGs, for DO queries to a signed zone.
    signed: bool,
}

impl Key {
    fn is(&self, qtype: RecordType, protocol: Option<&[u8]>, signed: bool) -> bool {
        self.qtype == qtype && self.signed == signed && self.protocol.as_ref().map(|p| p.as_bytes()) == protocol
    }
}

/// The bytes of `record` as it follows `query` at the start of a message: its names
/// compressed against the question only.
fn encode_record(query: &Query, record: &Record) -> Option<Box<[u8]>> {
    let mut bytes = Vec::with_capacity(64);
    let mut encoder = BinEncoder::new(&mut bytes);
    encoder.emit_vec(&[0; 12]).ok()?;
    query.emit(&mut encoder).ok()?;
    let start = encoder.offset();
    record.emit(&mut encoder).ok()?;
    Some(bytes[start..].into())
}

/// Whether `encoded` (from [`encode_record`]) still reads as `record` when another record
/// comes between it and the question: its names point into the question only.
#[cfg(debug_assertions)]
fn position_independent(query: &Query, encoded: &[u8], record: &Record) -> bool {
    use hickory_proto::op::{Header, Message, OpCode};
    let filler = Record::from_rdata(
        Name::root(),
        0,
        hickory_proto::rr::RData::A(std::net::Ipv4Addr::UNSPECIFIED.into()),
    );
    let mut bytes = Vec::new();
    let mut encoder = BinEncoder::new(&mut bytes);
    let header = Header {
        metadata: Metadata::new(0, MessageType::Response, OpCode::Query),
        counts: HeaderCounts {
            queries: 1,
            answers: 2,
            authorities: 0,
            additionals: 0,
        },
    };
    let written = header
        .emit(&mut encoder)
        .and_then(|()| query.emit(&mut encoder))
        .and_then(|()| filler.emit(&mut encoder));
    written.is_ok() && {
        bytes.extend_from_slice(encoded);
        Message::from_vec(&bytes).is_ok_and(|m| m.answers.get(1) == Some(record))
    }
}

/// One answer, encoded. Three allocations besides itself: it is kept for every service
/// name and type asked about.
#[derive(Debug)]
pub struct Prepared {
    /// The question as prepared (lower case), then every record: the answers, then the
    /// additional records.
    bytes: Box<[u8]>,
    /// Where the question and each record end in `bytes`.
    ends: Box<[u32]>,
    /// How many of the records are answers.
    answers: u32,
    /// For each additional record, where its owner is the target of an SRV answer: then it
    /// is written as a pointer to that target, as NSD and Knot compress glue. Empty when no
    /// owner is.
    glue: Box<[Option<Glue>]>,
    /// Until when (exclusive) this is the answer: then the TTL would have to shrink below
    /// the encoded one, or an instance's lease end.
    expires: Nanos,
    /// The registry's count of view changes when it was built, if it holds the addresses of
    /// another service (an SRV target that is a name of the zone): any change to a view
    /// then rebuilds it.
    view_changes: Option<u64>,
}

/// An additional record whose owner is an SRV answer's target.
#[derive(Clone, Copy, Debug)]
struct Glue {
    /// Which answer.
    answer: u32,
    /// Where the target starts in that answer's bytes (SRV targets are never compressed).
    target_at: u32,
    /// How many bytes the owner takes in the record's own bytes.
    owner_len: u32,
}

/// What to prepare: the question, the records' TTL, the earliest lease deadline of the
/// instances answered, the registry's count of view changes if the answer holds another
/// service's addresses, and for a signed answer when its signatures are to be made again.
pub struct Asked {
    pub owner: Name,
    pub qtype: RecordType,
    pub ttl: u32,
    pub earliest: Nanos,
    pub view_changes: Option<u64>,
    pub signed_until: Option<Nanos>,
}

/// The length of the name at the start of `bytes`: labels up to the root or a pointer.
fn name_len(bytes: &[u8]) -> usize {
    let mut at = 0;
    while let Some(&len) = bytes.get(at) {
        match len {
            0 => return at + 1,
            l if l & 0xc0 == 0xc0 => return at + 2,
            l => at += 1 + l as usize,
        }
    }
    at
}

/// Where in a DNS message a compression pointer can point: the first 16 KiB.
const POINTER_REACH: usize = 0x4000;

impl Prepared {
    /// Encodes every record with hickory. `owner` must be lower case: queries match it up to
    /// case. `None` when a record does not encode.
    pub fn encode(asked: Asked, answers: &[Record], additionals: &[Record]) -> Option<Self> {
        let Asked {
            owner,
            qtype,
            ttl,
            earliest,
            view_changes,
            signed_until,
        } = asked;
        let query = Query::query(owner, qtype);
        let mut bytes = query.to_bytes().ok()?;
        let mut ends = vec![bytes.len() as u32];
        for record in answers.iter().chain(additionals) {
            let encoded = encode_record(&query, record)?;
            #[cfg(debug_assertions)]
            assert!(
                position_independent(&query, &encoded, record),
                "{record} compresses against more than the question"
            );
            bytes.extend_from_slice(&encoded);
            ends.push(u32::try_from(bytes.len()).ok()?);
        }
        let glue: Vec<Option<Glue>> = additionals
            .iter()
            .enumerate()
            .map(|(j, record)| {
                let answer = answers.iter().position(|a| match &a.data {
                    RData::SRV(srv) => srv.target == record.name,
                    _ => false,
                })?;
                let answer_end = ends[answer + 1];
                let target_len = srv_target_len(&answers[answer])?;
                let start = ends[answers.len() + j] as usize;
                Some(Glue {
                    answer: answer as u32,
                    target_at: answer_end - ends[answer] - target_len,
                    owner_len: name_len(&bytes[start..]) as u32,
                })
            })
            .collect();
        let glue = if glue.iter().any(Option::is_some) {
            glue.into()
        } else {
            Box::default()
        };
        let expires = earliest
            .saturating_sub(ttl as Nanos * SECOND)
            .min(signed_until.unwrap_or(Nanos::MAX));
        Some(Self {
            bytes: bytes.into(),
            ends: ends.into(),
            answers: answers.len() as u32,
            glue,
            expires,
            view_changes,
        })
    }

    /// Whether the name has nothing of this type: a NODATA answer, which carries the SOA.
    pub fn is_empty(&self) -> bool {
        self.answers == 0
    }

    /// Writes the response to a request with `metadata` and `question` (its raw bytes) into
    /// `out`: within `limit` bytes, every answer from a random one on and the additional
    /// records that fit (left out without TC); when not every answer fits, TC and no records.
    /// False, with `out` unspecified, when the question is not the prepared one up to case
    /// and class (the caller answers class ANY as IN).
    pub fn write(
        &self,
        metadata: &Metadata,
        question: &[u8],
        edns: Option<Opt>,
        limit: usize,
        out: &mut Vec<u8>,
    ) -> bool {
        let ends = &self.ends;
        let asked = ends[0] as usize - 2;
        if question.len() != asked + 2 || !question[..asked].eq_ignore_ascii_case(&self.bytes[..asked]) {
            return false;
        }
        let budget = limit - opt_len(edns);
        let base = 12 + question.len();
        out.clear();
        out.resize(base, 0);
        let (n, all) = (self.answers as usize, ends.len() - 1);
        let first = if n > 1 { fastrand::usize(..n) } else { 0 };
        let end = |i: usize| ends[i] as usize;
        // Where answer `i` lands in `out`, the answers being written from `first` on.
        let answer_at = |i: usize| match i >= first {
            true => base + end(i) - end(first),
            false => base + end(n) - end(first) + end(i) - end(0),
        };
        // Record `i` (0-based) is `bytes[ends[i]..ends[i + 1]]`.
        let mut take = |i: usize| {
            let mut record = &self.bytes[end(i)..end(i + 1)];
            let mut pointer = None;
            if let Some(Some(glue)) = i.checked_sub(n).and_then(|j| self.glue.get(j)) {
                let target = answer_at(glue.answer as usize) + glue.target_at as usize;
                if target < POINTER_REACH {
                    pointer = Some((0xc000 | target as u16).to_be_bytes());
                    record = &record[glue.owner_len as usize..];
                }
            }
            let fits = out.len() + record.len() + pointer.map_or(0, |p| p.len()) <= budget;
            if fits {
                out.extend_from_slice(pointer.as_ref().map_or(&[][..], |p| &p[..]));
                out.extend_from_slice(record);
            }
            fits
        };
        let mut answers = (first..n).chain(0..first).take_while(|&i| take(i)).count();
        let mut response = authoritative(metadata, ResponseCode::NoError);
        let additionals = if answers == n {
            (n..all).take_while(|&i| take(i)).count()
        } else {
            // Never a partial RRset: TC and an empty answer, so that the client retries
            // over TCP rather than take a part for the whole (RFC 2181 §9).
            out.truncate(base);
            response.truncation = true;
            answers = 0;
            0
        };
        let counts = HeaderCounts {
            queries: 1,
            answers: answers as u16,
            authorities: 0,
            additionals: additionals as u16,
        };
        finish(out, response, counts, question, edns);
        true
    }
}

/// The length of an SRV record's target written out (SRV targets are never compressed).
fn srv_target_len(record: &Record) -> Option<u32> {
    match &record.data {
        RData::SRV(srv) => Some((srv.target.iter().map(|l| l.len() + 1).sum::<usize>() + 1) as u32),
        _ => None,
    }
}

/// A view's prepared answers, filled by the first query for each. Readers take no lock and
/// touch no shared counter; a new answer replaces the list (copy on write).
#[derive(Debug, Default)]
pub struct PreparedAnswers(ArcSwapOption<Vec<(Key, Arc<Prepared>)>>);

impl PreparedAnswers {
    /// `f` on the prepared answer for `qtype` (and `protocol`, and `signed`) if one has not
    /// expired at `now`, nor (for one that holds another service's addresses) any view changed
    /// since it was built (`view_changes`, read only then); `f` back if not.
    #[allow(clippy::too_many_arguments)]
    pub fn current<R, F: FnOnce(&Prepared) -> R>(
        &self,
        qtype: RecordType,
        protocol: Option<&[u8]>,
        signed: bool,
        now: Nanos,
        view_changes: impl FnOnce() -> u64,
        f: F,
    ) -> Result<R, F> {
        let answers = self.0.load();
        match answers
            .as_deref()
            .and_then(|a| a.iter().find(|(key, _)| key.is(qtype, protocol, signed)))
        {
            Some((_, prepared))
                if now < prepared.expires && prepared.view_changes.is_none_or(|n| n == view_changes()) =>
            {
                Ok(f(prepared))
            }
            _ => Err(f),
        }
    }

    /// Drops every prepared answer: the next query prepares its own again.
    pub fn clear(&self) {
        self.0.store(None);
    }

    /// Keeps `prepared` for the next queries, in place of any older one.
    pub fn keep(&self, qtype: RecordType, protocol: Option<&[u8]>, signed: bool, prepared: Arc<Prepared>) {
        let key = Key {
            qtype,
            protocol: protocol.map(|p| String::from_utf8_lossy(p).into()),
            signed,
        };
        self.0.rcu(|answers| {
            let mut answers: Vec<_> = answers.as_deref().cloned().unwrap_or_default();
            match answers.iter_mut().find(|(k, _)| *k == key) {
                Some((_, slot)) => *slot = prepared.clone(),
                None => answers.push((key.clone(), prepared.clone())),
            }
            Some(Arc::new(answers))
        });
    }
}

/// The zone's SOA record, encoded for the authority section of negative answers, and for
/// a signed zone the SOA with its RRSIG. Its names are not compressed, so the same bytes
/// follow any question.
#[derive(Default)]
pub struct SoaTail {
    plain: ArcSwapOption<Tail>,
    signed: ArcSwapOption<Tail>,
}

/// The SOA (and its RRSIG) encoded for one serial, good until a time (the signature's
/// refresh).
struct Tail {
    serial: u32,
    until: Nanos,
    bytes: Box<[u8]>,
}

/// A negative answer to write: its code, and for a DO query to a signed zone the NSEC of
/// compact denial with its RRSIG, encoded to follow the question (see
/// `sign::Signer::denial_bytes`).
pub struct Negative<'a> {
    pub code: ResponseCode,
    pub denial: Option<&'a [u8]>,
    /// Now, and until when signatures made now are served.
    pub now: Nanos,
    pub signed_until: Nanos,
}

impl SoaTail {
    /// Writes a negative answer (`negative.code` NXDOMAIN, or NOERROR for NODATA) to a
    /// request with `metadata` and `question`: the question, then `soa` (built for `serial`
    /// when the kept one is older: the SOA, and its RRSIG with a denial) in authority, and
    /// the denial's NSEC and RRSIG. False when that would exceed `limit`, which only a very
    /// long zone name makes happen; the encoding path compresses.
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &self,
        serial: u32,
        soa: impl FnOnce() -> Vec<Record>,
        metadata: &Metadata,
        negative: Negative<'_>,
        question: &[u8],
        edns: Option<Opt>,
        limit: usize,
        out: &mut Vec<u8>,
    ) -> bool {
        let slot = match negative.denial {
            Some(_) => &self.signed,
            None => &self.plain,
        };
        let kept = slot.load();
        let fresh;
        let tail: &[u8] = match kept.as_deref() {
            Some(tail) if tail.serial == serial && negative.now < tail.until => &tail.bytes,
            _ => {
                let mut bytes = Vec::new();
                let mut encoder = BinEncoder::new(&mut bytes);
                encoder.set_name_encoding(NameEncoding::Uncompressed);
                if soa().iter().any(|record| record.emit(&mut encoder).is_err()) {
                    return false;
                }
                fresh = Arc::new(Tail {
                    serial,
                    until: negative.signed_until,
                    bytes: bytes.into_boxed_slice(),
                });
                slot.store(Some(fresh.clone()));
                &fresh.bytes
            }
        };
        let denial = negative.denial.unwrap_or_default();
        if 12 + question.len() + tail.len() + denial.len() + opt_len(edns) > limit {
            return false;
        }
        out.clear();
        out.resize(12 + question.len(), 0);
        out.extend_from_slice(tail);
        out.extend_from_slice(denial);
        let signed = negative.denial.is_some();
        let counts = HeaderCounts {
            queries: 1,
            answers: 0,
            authorities: if signed { 4 } else { 1 },
            additionals: 0,
        };
        finish(out, authoritative(metadata, negative.code), counts, question, edns);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::{Header, OpCode};

    #[test]
    fn a_header_is_written_as_hickory_writes_it() {
        let counts = HeaderCounts {
            queries: 1,
            answers: 0x1234,
            authorities: 4,
            additionals: 0xfffe,
        };
        for flags in 0..1u32 << 7 {
            for op_code in [OpCode::Query, OpCode::Notify, OpCode::Update, OpCode::Status] {
                for response_code in [
                    ResponseCode::NoError,
                    ResponseCode::NXDomain,
                    ResponseCode::Refused,
                    ResponseCode::BADCOOKIE,
                ] {
                    let on = |bit: u32| flags & 1 << bit != 0;
                    let mut metadata = Metadata::new(0xbeef, MessageType::Query, op_code);
                    metadata.message_type = if on(0) {
                        MessageType::Response
                    } else {
                        MessageType::Query
                    };
                    metadata.authoritative = on(1);
                    metadata.truncation = on(2);
                    metadata.recursion_desired = on(3);
                    metadata.recursion_available = on(4);
                    metadata.authentic_data = on(5);
                    metadata.checking_disabled = on(6);
                    metadata.response_code = response_code;
                    let mut hickory = Vec::new();
                    Header { metadata, counts }
                        .emit(&mut BinEncoder::new(&mut hickory))
                        .unwrap();
                    assert_eq!(header_bytes(&metadata, counts)[..], hickory[..], "{metadata:?}");
                }
            }
        }
    }
}
