//! Zone transfer to secondaries: AXFR (RFC 5936) and IXFR (RFC 1995) over TCP, in as many
//! messages as the zone needs (hickory's own handler sends one message, so a zone over
//! 64 KiB could not be transferred), each signed when the request was (RFC 8945).
//!
//! What the service zone holds in a transfer: its SOA, NS and the address of `ns.`; for
//! each service the records its names answer (SRV and TXT at `_<name>._<protocol>`, A, AAAA
//! and TXT at `<name>`, of its healthy live instances, TTL `--dns-ttl`); and one
//! `<hex>.addr` record for each address an SRV target encodes (TTL 3600, as when asked).
//! Who may transfer: an address in `--allow-transfer`, or anyone whose request is signed
//! with a TSIG key (`tsig_key`); everyone else gets REFUSED.

use std::net::{IpAddr, SocketAddr};

use hickory_proto::op::{Header, HeaderCounts, Message, MessageType, Metadata, OpCode, Query, ResponseCode};
use hickory_proto::rr::{LowerName, RData, Record, RecordType};
use hickory_proto::serialize::binary::{BinEncodable, BinEncoder};
use ipnet::IpNet;

use super::Authority;
use super::journal::{self, Since};
use super::tsig::{self, Signing, Verdict};

/// Where a transfer's messages are cut: a message ends at the first record past this size,
/// so it stays under the 64 KiB a TCP message can hold (a record of ours is at most a few
/// KiB; a TXT of 255-byte strings for the 4 KiB of metadata an instance may carry).
/// Large messages, as NSD and Knot send: the secondary's cost is per message too.
const MESSAGE_TARGET: usize = 56 * 1024;

/// Who may transfer, and the journal IXFR answers from.
#[derive(Clone, Debug)]
pub struct TransferSettings {
    /// `--allow-transfer`: addresses and networks allowed without TSIG.
    pub allow: Vec<IpNet>,
    pub journal: journal::Limits,
}

impl Default for TransferSettings {
    fn default() -> Self {
        Self {
            allow: Vec::new(),
            journal: journal::Limits {
                max_changes: 1024,
                max_bytes: 64 << 20,
            },
        }
    }
}

impl TransferSettings {
    /// Whether `src` may transfer without a signature.
    pub fn allows(&self, src: IpAddr) -> bool {
        let src = match src {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(src, IpAddr::V4),
            v4 => v4,
        };
        self.allow.iter().any(|net| net.contains(&src))
    }
}

/// Parses `--allow-transfer`: comma-separated addresses or CIDRs, or `none`.
pub fn parse_allow(text: &str) -> Result<Vec<IpNet>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty() && *s != "none")
        .map(|s| {
            s.parse::<IpNet>()
                .or_else(|_| s.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| format!("{s:?} is not an address or a CIDR like 10.0.0.0/8"))
        })
        .collect()
}

/// The type of a transfer request (one question of type AXFR or IXFR), read off the header
/// and the question without parsing the rest.
pub fn requested(message: &[u8]) -> Option<RecordType> {
    if message.len() < 12 || message[4..6] != [0, 1] || message[2] & 0x80 != 0 {
        return None;
    }
    let mut at = 12;
    while let Some(&len) = message.get(at) {
        if len == 0 {
            break;
        }
        if len & 0xc0 != 0 {
            return None;
        }
        at += 1 + len as usize;
    }
    let qtype = u16::from_be_bytes([*message.get(at + 1)?, *message.get(at + 2)?]);
    match RecordType::from(qtype) {
        t @ (RecordType::AXFR | RecordType::IXFR) => Some(t),
        _ => None,
    }
}

/// Answers a transfer request over TCP, handing each message to `send` as soon as it is
/// built, so that a large zone's first message leaves at once (a secondary waiting seconds
/// for it gives up: Knot's default is 5 s).
pub fn answer(authority: &Authority, message: &[u8], src: SocketAddr, send: &mut dyn FnMut(Vec<u8>)) {
    let zones = &*authority.0;
    let now = tsig::now();
    let Ok(request) = Message::from_vec(message) else {
        return send(error(message, ResponseCode::FormErr));
    };
    // Every message of the reply to an EDNS request carries an OPT record, as Knot's do.
    let (edns, _) = authority.full_reply_edns(request.edns.as_ref(), src.ip());
    let signing = match authority.tsig().verify(message, now, edns.as_ref()) {
        Verdict::Rejected(reply) => return send(reply),
        Verdict::Signed(signing) => Some(signing),
        Verdict::Unsigned => None,
    };
    let Some(query) = request.queries.first() else {
        return send(error(message, ResponseCode::FormErr));
    };
    let opt = edns.and_then(|e| {
        let mut bytes = Vec::new();
        e.emit(&mut BinEncoder::new(&mut bytes)).ok().map(|()| bytes)
    });
    let mut out = Out::new(&request.metadata, query, signing, opt, now, send);
    if out.signing.is_none() && !zones.wire.transfer.allows(src.ip()) {
        tracing::info!(%src, zone = %query.name(), "transfer refused: not in --allow-transfer and not signed with a TSIG key (KODER_DNS_TSIG_KEYS)");
        return out.refuse(ResponseCode::Refused);
    }
    // The serial the secondary holds, from the SOA in the authority section of an IXFR.
    let held = (query.query_type() == RecordType::IXFR)
        .then(|| {
            request.authorities.iter().find_map(|r| match &r.data {
                RData::SOA(soa) => Some(soa.serial),
                _ => None,
            })
        })
        .flatten();
    let name = LowerName::new(query.name());
    let zone = &zones.zone;
    if zone.registry.zone().origin_lower == name {
        let since = zones.journal.since(zone, held);
        let soa = |serial| zone.soa_at(serial);
        match since {
            Since::Current(serial) => out.records([&soa(serial)]),
            Since::Deltas(serial, deltas) => {
                let current = soa(serial);
                let mut soas = Vec::with_capacity(deltas.len() * 2);
                for delta in &deltas {
                    soas.push((soa(delta.from), soa(delta.to)));
                }
                let steps = deltas.iter().zip(&soas).flat_map(|(delta, (from, to))| {
                    std::iter::once(from)
                        .chain(&delta.deleted)
                        .chain(std::iter::once(to))
                        .chain(&delta.added)
                });
                out.records(std::iter::once(&current).chain(steps).chain(std::iter::once(&current)));
                tracing::info!(%src, serial, from = ?held, changes = deltas.len(), "IXFR sent");
            }
            Since::Whole(version) => {
                let current = soa(version.serial);
                let apex = zone.apex_records();
                let services = version.services.iter().flat_map(|s| s.iter());
                out.records(
                    std::iter::once(&current)
                        .chain(&apex)
                        .chain(services)
                        .chain(&version.addrs)
                        .chain(&version.signed)
                        .chain(std::iter::once(&current)),
                );
                tracing::info!(%src, serial = version.serial, kind = %query.query_type(), messages = out.sent, "whole zone sent");
            }
        }
        return;
    }
    match zones.static_zones.load_full().zone(&name) {
        Some(file) => {
            let serial = match &file.soa.data {
                RData::SOA(soa) => soa.serial,
                _ => 0,
            };
            if held == Some(serial) {
                out.records([&file.soa]);
            } else {
                out.records(
                    std::iter::once(&file.soa)
                        .chain(&file.records)
                        .chain(std::iter::once(&file.soa)),
                );
            }
        }
        // Not a zone we serve (or a name below an apex): as a query outside every zone.
        None => out.refuse(ResponseCode::Refused),
    }
}

/// The reply to an IXFR over UDP (RFC 1995 §2): the current SOA alone, which tells a
/// secondary behind to come over TCP. `None` when it is not for the service zone's apex,
/// or not allowed: those get what any other query gets.
pub fn udp_ixfr(authority: &Authority, name: &LowerName, signed: bool, src: IpAddr) -> Option<Vec<Record>> {
    let zones = &*authority.0;
    let zone = &zones.zone;
    let allowed = signed || zones.wire.transfer.allows(src);
    (allowed && zone.registry.zone().origin_lower == *name).then(|| vec![zone.soa()])
}

/// A transfer's messages as they are built.
struct Out<'a> {
    metadata: Metadata,
    query: Query,
    signing: Option<Signing>,
    /// The OPT record each message ends with (before its TSIG record), if the request had one.
    opt: Option<Vec<u8>>,
    now: u64,
    send: &'a mut dyn FnMut(Vec<u8>),
    sent: usize,
}

impl<'a> Out<'a> {
    fn new(
        request: &Metadata,
        query: &Query,
        signing: Option<Signing>,
        opt: Option<Vec<u8>>,
        now: u64,
        send: &'a mut dyn FnMut(Vec<u8>),
    ) -> Self {
        let mut metadata = Metadata::response_from_request(request);
        metadata.authoritative = true;
        Self {
            metadata,
            query: query.clone(),
            signing,
            opt,
            now,
            send,
            sent: 0,
        }
    }

    fn refuse(mut self, code: ResponseCode) {
        self.metadata.authoritative = false;
        self.metadata.response_code = code;
        self.records(std::iter::empty::<&Record>());
    }

    /// Packs `records` into messages; the question goes in the first only (RFC 5936 §2.2).
    fn records<'r>(&mut self, records: impl IntoIterator<Item = &'r Record>) {
        let mut records = records.into_iter().peekable();
        loop {
            let first = self.sent == 0;
            let mut buf = Vec::with_capacity(MESSAGE_TARGET + 1024);
            let mut count = 0u16;
            let mut encoder = BinEncoder::new(&mut buf);
            let header = Header {
                metadata: self.metadata,
                counts: HeaderCounts::default(),
            };
            let mut ok = header.emit(&mut encoder).is_ok() && (!first || self.query.emit(&mut encoder).is_ok());
            while ok && encoder.len() < MESSAGE_TARGET && count < u16::MAX {
                // Compression only shrinks a record: the bound keeps the message within 64 KiB.
                let fits = records
                    .peek()
                    .is_some_and(|r| encoder.len() + super::record_upper(r) <= u16::MAX as usize);
                if !fits && count > 0 {
                    break;
                }
                let Some(record) = records.next() else { break };
                ok = record.emit(&mut encoder).is_ok();
                count += 1;
            }
            drop(encoder);
            if !ok {
                // A record that cannot be written: SERVFAIL if nothing went out yet, else the
                // connection closes mid-transfer and the secondary keeps its copy.
                if first {
                    (self.send)(error_for(&self.metadata, &self.query, ResponseCode::ServFail));
                }
                return;
            }
            buf[4..6].copy_from_slice(&u16::from(first).to_be_bytes());
            buf[6..8].copy_from_slice(&count.to_be_bytes());
            if let Some(opt) = &self.opt {
                buf.extend_from_slice(opt);
                buf[10..12].copy_from_slice(&1u16.to_be_bytes());
            }
            if let Some(signing) = &mut self.signing {
                signing.sign(&mut buf, self.now);
            }
            (self.send)(buf);
            self.sent += 1;
            if records.peek().is_none() {
                return;
            }
        }
    }
}

/// An error reply echoing the question, AA clear.
fn error_for(metadata: &Metadata, query: &Query, code: ResponseCode) -> Vec<u8> {
    let mut reply = Message::new(metadata.id, MessageType::Response, metadata.op_code);
    reply.metadata.response_code = code;
    reply.metadata.recursion_desired = metadata.recursion_desired;
    reply.add_query(query.clone());
    reply.to_vec().unwrap_or_default()
}

/// An error reply to a request we could not parse: the id and opcode of its header.
fn error(message: &[u8], code: ResponseCode) -> Vec<u8> {
    let id = u16::from_be_bytes([message[0], message[1]]);
    let op = OpCode::from_u8((message[2] >> 3) & 0xf);
    let mut reply = Message::error_msg(id, op, code);
    reply.metadata.recursion_desired = message[2] & 1 == 1;
    reply.to_vec().unwrap_or_default()
}
