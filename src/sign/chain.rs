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
            if link.signed.first() == Some(&nsec) && super::transfer::refresh_due(&link.signed) > now {
                continue;
            }
            let rrsig = signer.rrsig(&[&nsec], now);
            let signed: Vec<Record> = std::iter::once(nsec).chain(rrsig).collect();
            deleted.extend(std::mem::replace(&mut link.signed, signed.clone()));
            added.extend(signed);
        }
        (deleted, added)
    }

    /// Marks the names whose NSEC signature is to be made again by `now`, for the next
    /// [`Self::commit`].
    pub fn refresh(&mut self, now: Nanos) {
        for (name, link) in &self.links {
            if super::transfer::refresh_due(&link.signed) <= now {
                self.touched.insert(name.clone());
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keystore::{KeySource, ZoneKey};
    use std::str::FromStr;

    fn signer() -> (Signer, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let source = KeySource {
            data_dir: dir.path().to_owned(),
            key: None,
            publish: None,
        };
        let key = ZoneKey::load(&source, true).unwrap();
        (Signer::new(key, Name::from_str("service.koder.").unwrap(), 5), dir)
    }

    fn name(label: &str) -> Name {
        Name::from_str(&format!("{label}.service.koder.")).unwrap()
    }

    fn srv_set(i: usize) -> Vec<Record> {
        let owner = name(&format!("_s{i}._tcp"));
        let target = name(&format!("{i:08x}.addr"));
        vec![Record::from_rdata(
            owner,
            5,
            RData::SRV(hickory_proto::rr::rdata::SRV::new(10, 100, 80, target)),
        )]
    }

    /// With 2,000 names signed, a new one signs its own RRset, its NSEC and its
    /// predecessor's NSEC: three signatures. RRsets that did not change sign nothing, even
    /// when their answers are built again with a lower TTL.
    #[test]
    fn a_new_name_signs_its_rrset_its_nsec_and_its_neighbours_only() {
        let (signer, _dir) = signer();
        let now = 1_800_000_000 * crate::model::clock::SECOND;
        let mut chain = Chain::new(Name::from_str("service.koder.").unwrap(), 5);
        chain.set(
            &Name::from_str("service.koder.").unwrap(),
            vec![RecordType::SOA, RecordType::NS],
        );
        for i in (0..4000).step_by(2) {
            let set = srv_set(i);
            signer.with_rrsigs(set.clone(), now);
            chain.set(&set[0].name, vec![RecordType::SRV]);
        }
        let (deleted, added) = chain.commit(&signer, now);
        assert!(deleted.is_empty());
        assert_eq!(added.len(), 2 * 2001, "an NSEC and its RRSIG per name");
        let before = signer.signatures_made();

        let set = srv_set(1001);
        let signed = signer.with_rrsigs(set.clone(), now);
        assert_eq!(signed.len(), 2, "the SRV and its RRSIG");
        chain.set(&set[0].name, vec![RecordType::SRV]);
        let (deleted, added) = chain.commit(&signer, now);
        assert_eq!(
            signer.signatures_made() - before,
            3,
            "the RRset, its NSEC, its predecessor's NSEC"
        );
        assert_eq!(deleted.len(), 2, "the predecessor's NSEC and RRSIG as sent before");
        assert_eq!(added.len(), 4);

        // Unchanged RRsets, built again (a lower TTL as a lease runs out): no signature.
        let mut again = srv_set(1002);
        again[0].ttl = 2;
        let before = signer.signatures_made();
        let signed = signer.with_rrsigs(again, now + crate::model::clock::SECOND);
        assert_eq!(signer.signatures_made(), before);
        assert_eq!(signed[1].ttl, 2, "the RRSIG takes the TTL served");

        // The name goes: its NSEC and RRSIG are deleted, its predecessor re-signed.
        chain.set(&set[0].name, vec![]);
        let (deleted, added) = chain.commit(&signer, now);
        assert_eq!((deleted.len(), added.len()), (4, 2));
    }
}
