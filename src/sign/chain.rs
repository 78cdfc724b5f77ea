//! The NSEC chain a secondary serves (RFC 4034 §4): one NSEC per name that holds records,
//! in canonical order, the last pointing back to the apex. Compact denial is for our own
//! online answers; a secondary signs nothing, so a transfer must carry the chain whole.
//!
//! The chain is kept incrementally in an ordered map of owner names: a name that comes
//! (or goes, or whose types change) re-signs its own NSEC and its predecessor's, whose
//! next name changed, and nothing else. A registration among 100k instances signs a
//! handful of records, never the chain.

use std::collections::{BTreeMap, BTreeSet};

use hickory_proto::dnssec::rdata::{DNSSECRData, NSEC};
use hickory_proto::rr::{Name, RData, Record, RecordType};

use super::Signer;
use crate::model::clock::Nanos;

/// A name of the chain: its types, and the NSEC and RRSIG last sent for it.
struct Link {
    types: Vec<RecordType>,
    signed: Vec<Record>,
}

/// The chain of one zone.
pub struct Chain {
    apex: Name,
    ttl: u32,
    links: BTreeMap<Name, Link>,
    /// Names whose NSEC may have changed since the last [`Chain::commit`].
    touched: BTreeSet<Name>,
    /// The signed NSECs of names gone since the last commit.
    gone: Vec<Record>,
}

impl Chain {
    /// An empty chain of the zone at `apex`; its NSECs have TTL `ttl` (the SOA minimum).
    pub fn new(apex: Name, ttl: u32) -> Self {
        Self {
            apex,
            ttl,
            links: BTreeMap::new(),
            touched: BTreeSet::new(),
            gone: Vec::new(),
        }
    }

    /// The name before `name` in the chain (wrapping to the last).
    fn predecessor(&self, name: &Name) -> Option<Name> {
        self.links
            .range(..name.clone())
            .next_back()
            .or_else(|| self.links.iter().next_back())
            .map(|(n, _)| n.clone())
    }

    /// `name` holds `types` (its RRsets besides RRSIG and NSEC); no types takes it out.
    pub fn set(&mut self, name: &Name, mut types: Vec<RecordType>) {
        let name = name.to_lowercase();
        types.sort_unstable();
        types.dedup();
        if types.is_empty() {
            if let Some(link) = self.links.remove(&name) {
                self.gone.extend(link.signed);
                self.touched.remove(&name);
                if let Some(before) = self.predecessor(&name) {
                    self.touched.insert(before);
                }
            }
            return;
        }
        match self.links.get_mut(&name) {
            Some(link) if link.types == types => {}
            Some(link) => {
                link.types = types;
                self.touched.insert(name);
            }
            None => {
                if let Some(before) = self.predecessor(&name) {
                    self.touched.insert(before);
                }
                self.links.insert(name.clone(), Link { types, signed: vec![] });
                self.touched.insert(name);
            }
        }
    }

    /// Signs the NSECs that changed since the last commit: returns the records to delete
    /// (NSECs and RRSIGs as last sent) and to add.
    pub fn commit(&mut self, signer: &Signer, now: Nanos) -> (Vec<Record>, Vec<Record>) {
        let mut deleted = std::mem::take(&mut self.gone);
        let mut added = Vec::new();
        for name in std::mem::take(&mut self.touched) {
            let next = self
                .links
                .range((std::ops::Bound::Excluded(name.clone()), std::ops::Bound::Unbounded))
                .next()
                .map_or_else(|| self.apex.clone(), |(n, _)| n.clone());
            let Some(link) = self.links.get_mut(&name) else {
                continue;
            };
            let nsec = Record::from_rdata(
                name.clone(),
                self.ttl,
                RData::DNSSEC(DNSSECRData::NSEC(NSEC::new_cover_self(
                    next,
                    link.types.iter().copied(),
                ))),
            );
            if link.signed.first() == Some(&nsec) {
                continue;
            }
            let rrsig = signer.rrsig(&[&nsec], now);
            let signed: Vec<Record> = std::iter::once(nsec).chain(rrsig).collect();
            deleted.extend(std::mem::replace(&mut link.signed, signed.clone()));
            added.extend(signed);
        }
        (deleted, added)
    }

    /// Every signed NSEC of the chain, in order.
    pub fn records(&self) -> impl Iterator<Item = &Record> {
        self.links.values().flat_map(|link| &link.signed)
    }
}

/// The names of `records` and the types each holds, in order.
pub fn owners(records: &[Record]) -> BTreeMap<Name, Vec<RecordType>> {
    let mut owners: BTreeMap<Name, Vec<RecordType>> = BTreeMap::new();
    for record in records {
        let rtype = record.record_type();
        if rtype != RecordType::RRSIG && rtype != RecordType::NSEC {
            owners.entry(record.name.to_lowercase()).or_default().push(rtype);
        }
    }
    owners
}
