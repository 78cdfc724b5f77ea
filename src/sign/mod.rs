//! Signing the service zone online: what is signed, when a signature is made again, and
//! denial of existence. The prepared views (`zone::prepared`) and the zone transfer keep
//! what this makes; the DNS server only copies it. The key comes from [`crate::keystore`].
//!
//! - **One signature per RRset content.** [`Signer::rrsig`] keeps the signature of every
//!   RRset it signed, by the RRset's canonical content (owner, type, original TTL, sorted
//!   RDATA), so an answer built again (its TTL shrinking towards a lease's end, a prepared
//!   answer dropped by another type's change) reuses it, and a registration signs only the
//!   RRsets it changed. The original TTL is the RRset's full TTL (`--dns-ttl` for what leases
//!   shorten): the TTL served may be lower, which validators accept (RFC 4035 §5.3.3).
//! - **Lifetimes.** Inception an hour back (clocks of resolvers run late), expiration
//!   [`VALIDITY`] ahead; a signature with less than [`REFRESH_LEFT`] left is made again the
//!   next time it is asked for, and every prepared answer expires by then too.
//! - **Compact denial** (RFC 9824): a name without the asked type gets one NSEC at the name
//!   itself, its next name `\000.<name>` (nothing else can exist between the two), its type
//!   bitmap the types present (and RRSIG, NSEC); a name that does not exist gets the same
//!   with NXNAME alone in the bitmap. One signature per name, made when first asked, kept.
//! - **The NSEC chain of transfers** ([`chain`]): what a secondary serves needs the classic
//!   chain, kept incrementally as names come and go.

pub mod chain;
pub mod transfer;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use hickory_proto::dnssec::rdata::{DNSSECRData, NSEC, RRSIG, SigInput};
use hickory_proto::dnssec::{TBS, Verifier};
use hickory_proto::rr::{DNSClass, LowerName, Name, RData, Record, RecordType, SerialNumber};
use hickory_proto::serialize::binary::{BinEncodable, BinEncoder, NameEncoding};

use crate::keystore::{ALGORITHM, ZoneKey};
use crate::model::clock::{Nanos, SECOND};

/// How long a signature is valid after it is made.
pub const VALIDITY: u32 = 7 * 86_400;
/// A signature with less than this left is made again: one served is always valid for at
/// least this long.
pub const REFRESH_LEFT: u32 = 86_400;
/// How far back inception lies, for validators whose clock is behind ours.
pub const INCEPTION_BACK: u32 = 3600;

/// Meta-type NXNAME (RFC 9824): in the bitmap of the NSEC of a name that does not exist.
pub const NXNAME: RecordType = RecordType::Unknown(128);

/// Kept signatures past this many are dropped all at once (queries for random names each
/// leave one denial behind); they are made again on demand.
const CACHE_MAX: usize = 200_000;

/// A signature kept for an RRset's content.
struct Kept {
    rrsig: RRSIG,
    /// Unix seconds after which it is made again.
    refresh_at: i64,
}

/// A name's signed NSEC, encoded: both records' owners are a pointer to the question.
struct KeptDenial {
    bytes: Arc<[u8]>,
    refresh_at: i64,
}

/// The signer of one zone: its key, its origin and the signatures made so far.
pub struct Signer {
    key: ZoneKey,
    origin: Name,
    origin_lower: LowerName,
    /// The TTL of records whose served TTL shrinks with leases: their original TTL.
    dns_ttl: u32,
    /// By the SHA-256 of the RRset's canonical content ([`content_key`]): the content of
    /// a 100-instance TXT RRset is kilobytes, its digest 32 bytes.
    kept: DashMap<[u8; 32], Kept>,
    denials: DashMap<(Vec<u8>, Vec<u16>), KeptDenial>,
    /// Signatures made, for tests and metrics: what "signs only what changed" counts.
    made: AtomicU64,
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer")
            .field("origin", &self.origin)
            .field("key", &self.key)
            .finish()
    }
}

fn unix_seconds(now: Nanos) -> i64 {
    now.div_euclid(SECOND)
}

/// The SHA-256 of an RRset's canonical content (RFC 4034 §6.2, §6.3): owner in lower case,
/// type, original TTL, then the RDATA of each record in canonical form, sorted.
fn content_key(owner: &Name, rtype: RecordType, original_ttl: u32, records: &[&Record]) -> Option<[u8; 32]> {
    let mut rdatas = Vec::with_capacity(records.len());
    for record in records {
        let mut bytes = Vec::new();
        let mut encoder = BinEncoder::new(&mut bytes);
        encoder.set_canonical_form(true);
        encoder.set_name_encoding(NameEncoding::UncompressedLowercase);
        record.data.emit(&mut encoder).ok()?;
        rdatas.push(bytes);
    }
    rdatas.sort_unstable();
    rdatas.dedup();
    let mut key = owner.to_lowercase().to_bytes().ok()?;
    key.extend_from_slice(&u16::from(rtype).to_be_bytes());
    key.extend_from_slice(&original_ttl.to_be_bytes());
    for rdata in rdatas {
        key.extend_from_slice(&(rdata.len() as u16).to_be_bytes());
        key.extend_from_slice(&rdata);
    }
    ring::digest::digest(&ring::digest::SHA256, &key)
        .as_ref()
        .try_into()
        .ok()
}

impl Signer {
    pub fn new(key: ZoneKey, origin: Name, dns_ttl: u32) -> Self {
        Self {
            key,
            origin_lower: LowerName::new(&origin),
            origin,
            dns_ttl,
            kept: DashMap::new(),
            denials: DashMap::new(),
            made: AtomicU64::new(0),
        }
    }

    /// How many signatures were made so far.
    pub fn signatures_made(&self) -> u64 {
        self.made.load(Ordering::Relaxed)
    }

    /// Whether `name` is ours to sign: inside the service zone.
    pub fn signs(&self, name: &Name) -> bool {
        self.origin_lower.zone_of(&LowerName::new(name))
    }

    /// The apex's DNSKEY records, with `ttl`.
    pub fn dnskey_records(&self, owner: &Name, ttl: u32) -> Vec<Record> {
        self.key
            .published()
            .iter()
            .map(|key| Record::from_rdata(owner.clone(), ttl, RData::DNSSEC(DNSSECRData::DNSKEY(key.clone()))))
            .collect()
    }

    /// The signing key's DNSKEY.
    pub fn key(&self) -> &ZoneKey {
        &self.key
    }

    /// The RRSIG of `rrset` (records of one owner and type, TTLs as served), made once per
    /// content and kept. `None` when a record does not encode.
    pub fn rrsig(&self, rrset: &[&Record], now: Nanos) -> Option<Record> {
        let first = rrset.first()?;
        let ttl = rrset.iter().map(|r| r.ttl).max()?;
        let original_ttl = ttl.max(self.dns_ttl);
        let rtype = first.record_type();
        let key = content_key(&first.name, rtype, original_ttl, rrset)?;
        let now_s = unix_seconds(now);
        // The map's guard is dropped before any insert below: DashMap's shard lock is not
        // reentrant.
        let fresh = self
            .kept
            .get(&key)
            .filter(|kept| now_s < kept.refresh_at)
            .map(|kept| kept.rrsig.clone());
        let rrsig = match fresh {
            Some(rrsig) => rrsig,
            None => {
                let input = SigInput {
                    type_covered: rtype,
                    algorithm: ALGORITHM,
                    num_labels: first.name.num_labels(),
                    original_ttl,
                    sig_expiration: SerialNumber::new((now_s + i64::from(VALIDITY)) as u32),
                    sig_inception: SerialNumber::new((now_s - i64::from(INCEPTION_BACK)) as u32),
                    key_tag: self.key.key_tag(),
                    signer_name: self.origin.clone(),
                };
                // Two instances with one target and port give two equal SRV records; the
                // canonical RRset that validators check a signature against holds one (RFC
                // 4034 §6.3), as `content_key` does, but hickory's TBS keeps every record given.
                let mut canonical = rrset.to_vec();
                canonical.sort_by(|a, b| a.data.cmp(&b.data));
                canonical.dedup_by(|a, b| a.data == b.data);
                let tbs = TBS::from_input(&first.name, DNSClass::IN, &input, canonical.into_iter()).ok()?;
                let signature = self.key.sign(&tbs).ok()?;
                self.made.fetch_add(1, Ordering::Relaxed);
                let rrsig = RRSIG::from_sig(input, signature);
                if self.kept.len() >= CACHE_MAX {
                    self.kept.clear();
                }
                let refresh_at = now_s + i64::from(VALIDITY - REFRESH_LEFT);
                self.kept.insert(
                    key,
                    Kept {
                        rrsig: rrsig.clone(),
                        refresh_at,
                    },
                );
                rrsig
            }
        };
        Some(Record::from_rdata(
            first.name.clone(),
            ttl,
            RData::DNSSEC(DNSSECRData::RRSIG(rrsig)),
        ))
    }

    /// Until when (Unix nanoseconds) a signature made now is served: an answer that holds
    /// one is built again by then.
    pub fn fresh_until(now: Nanos) -> Nanos {
        now + i64::from(VALIDITY - REFRESH_LEFT) * SECOND
    }

    /// `records` with the RRSIG of each RRset of the zone after its last record: RRsets are
    /// the records of one owner and type, in the order they first appear. Records outside
    /// the zone (a static zone's addresses as glue) stay unsigned.
    pub fn with_rrsigs(&self, records: Vec<Record>, now: Nanos) -> Vec<Record> {
        let mut sets: Vec<(LowerName, RecordType, Vec<Record>)> = Vec::new();
        for record in records {
            let owner = LowerName::new(&record.name);
            let rtype = record.record_type();
            match sets.iter_mut().find(|(o, t, _)| *o == owner && *t == rtype) {
                Some((_, _, set)) => set.push(record),
                None => sets.push((owner, rtype, vec![record])),
            }
        }
        let mut out = Vec::new();
        for (owner, _, set) in sets {
            let rrsig = self
                .origin_lower
                .zone_of(&owner)
                .then(|| self.rrsig(&set.iter().collect::<Vec<_>>(), now))
                .flatten();
            out.extend(set);
            out.extend(rrsig);
        }
        out
    }

    /// The NSEC of compact denial at `owner` and its RRSIG (RFC 9824): `types` are those
    /// present there, `None` for a name that does not exist (NXNAME). TTL `ttl` (the SOA
    /// minimum, as for any negative answer).
    pub fn denial_records(&self, owner: &Name, types: Option<&[RecordType]>, ttl: u32, now: Nanos) -> Vec<Record> {
        let nsec = Record::from_rdata(owner.clone(), ttl, denial_nsec(owner, types));
        let rrsig = self.rrsig(&[&nsec], now);
        std::iter::once(nsec).chain(rrsig).collect()
    }

    /// [`Self::denial_records`] encoded, both owners a pointer to the question (offset 12),
    /// so the bytes follow any question of that name; made once per name and types, kept.
    pub fn denial_bytes(
        &self,
        owner: &LowerName,
        types: Option<&[RecordType]>,
        ttl: u32,
        now: Nanos,
    ) -> Option<Arc<[u8]>> {
        let codes: Vec<u16> = match types {
            Some(types) => types.iter().map(|t| u16::from(*t)).collect(),
            None => vec![u16::from(NXNAME)],
        };
        let key = (owner.to_bytes().ok()?, codes);
        let now_s = unix_seconds(now);
        let fresh = self
            .denials
            .get(&key)
            .filter(|kept| now_s < kept.refresh_at)
            .map(|kept| kept.bytes.clone());
        if fresh.is_some() {
            return fresh;
        }
        let records = self.denial_records(&Name::from(owner), types, ttl, now);
        let mut bytes = Vec::new();
        for record in &records {
            let mut pointed = record.clone();
            pointed.name = Name::root();
            let mut one = Vec::new();
            let mut encoder = BinEncoder::new(&mut one);
            encoder.set_name_encoding(NameEncoding::Uncompressed);
            pointed.emit(&mut encoder).ok()?;
            // The root owner (one zero byte) becomes a pointer to the question's name.
            bytes.extend_from_slice(&[0xc0, 12]);
            bytes.extend_from_slice(&one[1..]);
        }
        let bytes: Arc<[u8]> = bytes.into();
        if self.denials.len() >= CACHE_MAX {
            self.denials.clear();
        }
        self.denials.insert(
            key,
            KeptDenial {
                bytes: bytes.clone(),
                refresh_at: now_s + i64::from(VALIDITY - REFRESH_LEFT),
            },
        );
        Some(bytes)
    }

    /// Whether `rrsig` over `rrset` verifies with the signing key: for tests.
    pub fn verifies(&self, rrsig: &RRSIG, rrset: &[&Record]) -> bool {
        let Some(first) = rrset.first() else { return false };
        self.key
            .dnskey()
            .verify_rrsig(&first.name, DNSClass::IN, rrsig, rrset.iter().copied())
            .is_ok()
    }
}

/// The NSEC RDATA of compact denial at `owner`: next name `\000.<owner>`, the types present
/// with RRSIG and NSEC, or RRSIG, NSEC and NXNAME for a name that does not exist.
fn denial_nsec(owner: &Name, types: Option<&[RecordType]>) -> RData {
    let next = Name::from_labels([&b"\0"[..]])
        .and_then(|zero| zero.append_domain(&owner.to_lowercase()))
        .unwrap_or_else(|_| owner.to_lowercase());
    let present: Vec<RecordType> = match types {
        Some(types) => types.to_vec(),
        None => vec![NXNAME],
    };
    RData::DNSSEC(DNSSECRData::NSEC(NSEC::new_cover_self(next, present)))
}
