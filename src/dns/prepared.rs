//! Prepared answers: a service's answers encoded once per view and served by copying bytes.
//!
//! Encoding a response with hickory costs several microseconds a query (records cloned,
//! a compression table of heap-allocated suffixes, bytes written one bounds check at a
//! time), yet an answer only changes when its service's view does. So the first query for a
//! (service, type) encodes the whole response with hickory, question included, in up to
//! [`ROTATIONS`] record orders, and later queries copy one of them. What belongs to the
//! request is written per query: the header (id, RD, CD), the question as the client wrote
//! it, and an OPT record for EDNS clients. The question is the prepared one up to letter
//! case, same length and same labels, so every compression pointer into it stays valid and
//! the answers echo the client's case.
//!
//! A prepared answer is kept in the view it was built from, so a change to the service
//! (registration, removal, health flip, a lease moved earlier) drops it with the view.
//! Heartbeats only move leases later, which leaves the view alone: a prepared answer is
//! good until the earliest lease it answers for comes within its TTL, and is then built
//! again with the deadlines of the moment.
//!
//! Negative answers (NXDOMAIN, NODATA) carry the zone's SOA, which changes with the serial
//! rather than with a view: [`SoaTail`] keeps it encoded for the current serial.

use std::sync::{Arc, LazyLock};

use arc_swap::ArcSwapOption;
use hickory_proto::op::{Edns, Header, HeaderCounts, MessageType, Metadata, OpCode, Query, ResponseCode, emit_message_parts};
use hickory_proto::rr::{Name, Record, RecordType};
use hickory_proto::serialize::binary::{BinEncodable, BinEncoder, NameEncoding};

use super::MAX_UDP_PAYLOAD;
use crate::registry::clock::{Nanos, SECOND};

/// Record orders kept per answer. Each rotation starts at another instance, so that over
/// many responses every instance comes first about equally often.
pub const ROTATIONS: usize = 8;

/// The OPT record of every EDNS response: version 0, no options, advertising what we accept.
static OPT: LazyLock<Vec<u8>> = LazyLock::new(|| {
    let mut edns = Edns::new();
    edns.set_max_payload(MAX_UDP_PAYLOAD).set_version(0);
    let mut bytes = Vec::new();
    edns.emit(&mut BinEncoder::new(&mut bytes)).expect("an OPT record encodes");
    bytes
});

/// The OPT record every EDNS response carries.
pub fn opt_record() -> &'static [u8] {
    &OPT
}

/// `out` holds a response with room for the header and the question at its start: writes
/// them for `metadata` and `counts`, and appends the OPT record when `edns`.
fn finish(out: &mut Vec<u8>, metadata: Metadata, mut counts: HeaderCounts, question: &[u8], edns: bool) -> bool {
    let end = out.len();
    counts.additionals += edns as u16;
    let mut encoder = BinEncoder::new(out);
    let written = Header { metadata, counts }.emit(&mut encoder).and_then(|()| encoder.emit_vec(question));
    encoder.set_offset(end);
    written.and_then(|()| if edns { encoder.emit_vec(opt_record()) } else { Ok(()) }).is_ok()
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
    protocol: Option<Box<str>>,
}

impl Key {
    fn is(&self, qtype: RecordType, protocol: Option<&[u8]>) -> bool {
        self.qtype == qtype && self.protocol.as_deref().map(str::as_bytes) == protocol
    }
}

/// One response, encoded with id 0 and the prepared question.
#[derive(Debug)]
struct Encoded {
    bytes: Box<[u8]>,
    counts: HeaderCounts,
    truncation: bool,
}

impl Encoded {
    /// `None` when even the question does not fit `max` bytes.
    fn new(query: &Query, answers: &[Record], additionals: &[Record], max: u16) -> Option<Self> {
        let mut bytes = Vec::with_capacity(512);
        let mut encoder = BinEncoder::new(&mut bytes);
        encoder.set_max_size(max);
        let metadata = Metadata::new(0, MessageType::Response, OpCode::Query);
        let (mut none_a, mut none_b) = (std::iter::empty::<&Record>(), std::iter::empty::<&Record>());
        let header = if additionals.is_empty() {
            emit_message_parts(&metadata, &mut std::iter::once(query), &mut answers.iter(), &mut none_a, &mut none_b, None, None, &mut encoder)
        } else {
            emit_message_parts(&metadata, &mut std::iter::once(query), &mut answers.iter(), &mut none_a, &mut additionals.iter(), None, None, &mut encoder)
        }
        .ok()?;
        // A record that did not fit is rolled back by offset only; drop what it left.
        encoder.trim();
        Some(Self { bytes: bytes.into(), counts: header.counts, truncation: header.metadata.truncation })
    }
}

/// Bytes of whole responses kept per answer: small answers get [`ROTATIONS`] orders, a large
/// one fewer (one at 16 KiB), so that a large service costs neither much memory nor, when it
/// changes often, much time to prepare.
const ROTATION_BYTES: usize = 16 << 10;

/// UDP budgets (buffer minus OPT record) that a response cut short is prepared for: 512
/// without EDNS, and 512, 1232 and 4096 with it. A request gets the largest that fits its
/// own budget.
const UDP_BUDGETS: [usize; 4] = [512 - 11, 512, 1232 - 11, MAX_UDP_PAYLOAD as usize - 11];

/// One answer, encoded.
#[derive(Debug)]
pub struct Prepared {
    /// Whole responses, one per record order; empty when the answer does not fit one TCP
    /// message: such queries take the encoding path, which cuts it.
    rotations: Box<[Encoded]>,
    /// For an answer larger than some UDP budgets: the response cut to each, smallest first,
    /// from the first order, TC set: the client retries over TCP.
    cut: Box<[Encoded]>,
    /// Length of the question, which starts right after the 12-byte header.
    question_len: usize,
    /// Until when (exclusive) this is the answer: then the TTL would have to shrink below
    /// the encoded one, or an instance's lease end.
    expires: Nanos,
}

/// What to prepare: the question, the records' TTL and the earliest lease deadline of the
/// instances answered.
pub struct Asked {
    pub owner: Name,
    pub qtype: RecordType,
    pub ttl: u32,
    pub earliest: Nanos,
    /// Instances answered: the orders start at each in turn.
    pub members: usize,
}

impl Prepared {
    /// Encodes the answer with hickory, in as many orders as [`ROTATIONS`] and
    /// [`ROTATION_BYTES`] allow. `records(start)` gives (answers, additionals) in the order
    /// that starts at member `start`. `owner` must be lower case: queries match it up to case.
    pub fn encode(asked: Asked, mut records: impl FnMut(usize) -> (Vec<Record>, Vec<Record>)) -> Self {
        let Asked { owner, qtype, ttl, earliest, members } = asked;
        let query = Query::query(owner, qtype);
        let question_len = query.to_bytes().map_or(0, |q| q.len());
        let (answers, additionals) = records(0);
        let first = Encoded::new(&query, &answers, &additionals, u16::MAX).filter(|e| !e.truncation);
        let Some(first) = first else {
            // Over 64 KiB: nothing to serve until the view changes.
            return Self { rotations: Box::default(), cut: Box::default(), question_len, expires: Nanos::MAX };
        };
        // Cut as the encoding path cuts: the answers that fit, and only when all of them do,
        // the additional records that fit; TC always, for something was left out.
        let cut = UDP_BUDGETS
            .iter()
            .filter(|&&budget| first.bytes.len() > budget)
            .filter_map(|&budget| {
                let answers_only = Encoded::new(&query, &answers, &[], budget as u16)?;
                let mut cut = match answers_only.truncation {
                    true => answers_only,
                    false => Encoded::new(&query, &answers, &additionals, budget as u16)?,
                };
                cut.truncation = true;
                Some(cut)
            })
            .collect();
        let count = members.clamp(1, ROTATIONS).min((ROTATION_BYTES / first.bytes.len()).max(1));
        let mut rotations = Vec::with_capacity(count);
        rotations.push(first);
        for r in 1..count {
            let (answers, additionals) = records(r * members / count);
            rotations.extend(Encoded::new(&query, &answers, &additionals, u16::MAX).filter(|e| !e.truncation));
        }
        let expires = earliest.saturating_sub(ttl as Nanos * SECOND);
        Self { rotations: rotations.into(), cut, question_len, expires }
    }

    /// Writes the response to a request with `metadata` and `question` (its raw bytes) into
    /// `out`. False, with `out` unspecified, when this request needs the encoding path: the
    /// question is not the prepared one up to case, or the answer is not prepared.
    pub fn write(&self, metadata: &Metadata, question: &[u8], edns: bool, limit: usize, out: &mut Vec<u8>) -> bool {
        let whole = match self.rotations.len() {
            0 => return false,
            1 => &self.rotations[0],
            n => &self.rotations[fastrand::usize(..n)],
        };
        let budget = limit - if edns { opt_record().len() } else { 0 };
        let fitting = if whole.bytes.len() <= budget {
            Some(whole)
        } else {
            self.cut.iter().rev().find(|cut| cut.bytes.len() <= budget)
        };
        let Some(encoded) = fitting else { return false };
        if question.len() != self.question_len || !question.eq_ignore_ascii_case(&encoded.bytes[12..12 + self.question_len]) {
            return false;
        }
        out.clear();
        out.extend_from_slice(&encoded.bytes);
        let mut response = authoritative(metadata, ResponseCode::NoError);
        response.truncation = encoded.truncation;
        finish(out, response, encoded.counts, question, edns)
    }
}

/// A view's prepared answers, filled by the first query for each. Readers take no lock and
/// touch no shared counter; a new answer replaces the list (copy on write).
#[derive(Debug, Default)]
pub struct PreparedAnswers(ArcSwapOption<Vec<(Key, Arc<Prepared>)>>);

impl PreparedAnswers {
    /// Calls `f` with the prepared answer for `qtype` (and `protocol`) if it has not expired
    /// at `now`, else with `build()`'s, which is kept for the next queries. `None` when
    /// `build` has nothing to prepare.
    pub fn with<R>(
        &self,
        qtype: RecordType,
        protocol: Option<&[u8]>,
        now: Nanos,
        build: impl FnOnce() -> Option<Prepared>,
        f: impl FnOnce(&Prepared) -> R,
    ) -> Option<R> {
        {
            let answers = self.0.load();
            let found = answers.as_deref().and_then(|a| a.iter().find(|(key, _)| key.is(qtype, protocol)));
            if let Some((_, prepared)) = found.filter(|(_, p)| now < p.expires) {
                return Some(f(prepared));
            }
        }
        let prepared = Arc::new(build()?);
        let key = Key { qtype, protocol: protocol.map(|p| String::from_utf8_lossy(p).into()) };
        self.0.rcu(|answers| {
            let mut answers: Vec<_> = answers.as_deref().cloned().unwrap_or_default();
            match answers.iter_mut().find(|(k, _)| *k == key) {
                Some((_, slot)) => *slot = prepared.clone(),
                None => answers.push((key.clone(), prepared.clone())),
            }
            Some(Arc::new(answers))
        });
        Some(f(&prepared))
    }
}

/// The zone's SOA record, encoded for the authority section of negative answers. Its names
/// are not compressed, so the same bytes follow any question.
#[derive(Default)]
pub struct SoaTail(ArcSwapOption<(u32, Box<[u8]>)>);

impl SoaTail {
    /// Writes a negative answer (`code` NXDOMAIN, or NOERROR for NODATA) to a request with
    /// `metadata` and `question`: the question, then `soa` (built for `serial` when the kept
    /// one is older) in authority. False when that would exceed `limit`, which only a very
    /// long zone name makes happen; the encoding path compresses.
    #[allow(clippy::too_many_arguments)]
    pub fn write(
        &self,
        serial: u32,
        soa: impl FnOnce() -> Record,
        metadata: &Metadata,
        code: ResponseCode,
        question: &[u8],
        edns: bool,
        limit: usize,
        out: &mut Vec<u8>,
    ) -> bool {
        let kept = self.0.load();
        let fresh;
        let tail: &[u8] = match kept.as_deref() {
            Some((kept_serial, bytes)) if *kept_serial == serial => bytes,
            _ => {
                let mut bytes = Vec::new();
                let mut encoder = BinEncoder::new(&mut bytes);
                encoder.set_name_encoding(NameEncoding::Uncompressed);
                if soa().emit(&mut encoder).is_err() {
                    return false;
                }
                fresh = Arc::new((serial, bytes.into_boxed_slice()));
                self.0.store(Some(fresh.clone()));
                &fresh.1
            }
        };
        let opt = if edns { opt_record().len() } else { 0 };
        if 12 + question.len() + tail.len() + opt > limit {
            return false;
        }
        out.clear();
        out.resize(12 + question.len(), 0);
        out.extend_from_slice(tail);
        let counts = HeaderCounts { queries: 1, answers: 0, authorities: 1, additionals: 0 };
        finish(out, authoritative(metadata, code), counts, question, edns)
    }
}
