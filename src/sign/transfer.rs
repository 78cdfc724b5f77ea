//! What a signed zone's transfer carries beside the records the journal keeps: the apex's
//! DNSKEY, an RRSIG for every RRset, the NSEC chain, each as last sent, so that an IXFR
//! deletes exactly what the secondary holds; and when signatures must be made again
//! before a secondary serves them expired.
//!
//! Signatures sent to a secondary are not re-made on every change, only those of what
//! changed. Each is made again once it has less than [`super::REFRESH_LEFT`] to live: the
//! journal asks [`SignedZone::refresh_due`] and, when due, the server moves the revision
//! (`Store::touch`), the next cut re-signs what is old and the secondaries take it by IXFR.

use std::collections::HashMap;
use std::net::IpAddr;

use hickory_proto::dnssec::rdata::DNSSECRData;
use hickory_proto::rr::{Name, RData, Record, RecordType};

use super::chain::{self, Chain};
use super::{INCEPTION_BACK, REFRESH_LEFT, Signer, VALIDITY};
use crate::model::clock::{Nanos, SECOND};

/// When the oldest RRSIG of `records` is to be made again: `Nanos::MAX` without any.
pub fn refresh_due<'a>(records: impl IntoIterator<Item = &'a Record>) -> Nanos {
    records
        .into_iter()
        .filter_map(|r| match &r.data {
            RData::DNSSEC(DNSSECRData::RRSIG(sig)) => Some(sig.input().sig_inception.get()),
            _ => None,
        })
        .map(|inception| (i64::from(inception) + i64::from(INCEPTION_BACK + VALIDITY - REFRESH_LEFT)) * SECOND)
        .min()
        .unwrap_or(Nanos::MAX)
}

/// The signed part of the zone as last sent to secondaries.
pub struct SignedZone {
    chain: Chain,
    /// The records of the apex to sign (NS, `ns.`'s address, DNSKEY).
    apex_records: Vec<Record>,
    /// The apex's DNSKEY and the RRSIGs of the apex records.
    apex: Vec<Record>,
    /// The RRSIG of the SOA of the last cut.
    soa: Option<Record>,
    /// Each `<hex>.addr` record's RRSIG.
    addrs: HashMap<IpAddr, Record>,
    /// When the oldest signature sent is to be made again.
    next_refresh: Nanos,
}

/// The records one cut deletes and adds.
pub type Changes = (Vec<Record>, Vec<Record>);

impl SignedZone {
    /// The zone at `origin` with `apex_records` (its NS and the address of `ns.`), NSECs
    /// with TTL `negative_ttl`.
    pub fn new(signer: &Signer, origin: &Name, mut apex_records: Vec<Record>, negative_ttl: u32, now: Nanos) -> Self {
        let mut chain = Chain::new(origin.clone(), negative_ttl);
        apex_records.extend(signer.dnskey_records(origin, crate::zone::records::NS_TTL));
        for (owner, mut types) in chain::owners(&apex_records) {
            if owner == *origin {
                types.push(RecordType::SOA);
            }
            chain.set(&owner, types);
        }
        let apex = Self::sign_apex(signer, &apex_records, now);
        Self {
            chain,
            apex_records,
            next_refresh: refresh_due(&apex),
            apex,
            soa: None,
            addrs: HashMap::new(),
        }
    }

    fn sign_apex(signer: &Signer, records: &[Record], now: Nanos) -> Vec<Record> {
        signer
            .with_rrsigs(records.to_vec(), now)
            .into_iter()
            .filter(|r| matches!(r.record_type(), RecordType::RRSIG | RecordType::DNSKEY))
            .collect()
    }

    /// Whether some signature sent is to be made again by `now`.
    pub fn refresh_due(&self, now: Nanos) -> bool {
        now >= self.next_refresh
    }

    /// Starts a cut at `now`: whether it is a refresh (see [`Self::refresh_due`]), in which
    /// every service whose signatures are old is built again and the journal reports each
    /// kept one ([`Self::kept`]).
    pub fn begin(&mut self, now: Nanos) -> bool {
        let due = self.refresh_due(now);
        if due {
            self.next_refresh = Nanos::MAX;
        }
        due
    }

    /// Whether `records` of a service, as last sent, can be sent again as they are at `now`.
    pub fn fresh(records: &[Record], now: Nanos) -> bool {
        now < refresh_due(records)
    }

    /// A service's records changed from `old` (signed, as last sent) to `records`: the
    /// chain follows its names; returns `records` with their RRSIGs, sorted.
    pub fn service(&mut self, signer: &Signer, old: &[Record], records: Vec<Record>, now: Nanos) -> Vec<Record> {
        let owners = chain::owners(&records);
        for gone in chain::owners(old).into_keys().filter(|o| !owners.contains_key(o)) {
            self.chain.set(&gone, vec![]);
        }
        for (owner, types) in owners {
            self.chain.set(&owner, types);
        }
        let mut records = signer.with_rrsigs(records, now);
        records.sort_unstable();
        records.dedup();
        self.next_refresh = self.next_refresh.min(refresh_due(&records));
        records
    }

    /// A service is gone: its names leave the chain.
    pub fn service_gone(&mut self, records: &[Record]) {
        for owner in chain::owners(records).into_keys() {
            self.chain.set(&owner, vec![]);
        }
    }

    /// The address record `record` of `ip` comes: its RRSIG, to add.
    pub fn addr_added(&mut self, signer: &Signer, ip: IpAddr, record: &Record, now: Nanos) -> Option<Record> {
        self.chain.set(&record.name, vec![record.record_type()]);
        let rrsig = signer.rrsig(&[record], now)?;
        self.next_refresh = self.next_refresh.min(refresh_due([&rrsig]));
        self.addrs.insert(ip, rrsig.clone());
        Some(rrsig)
    }

    /// The address record `record` of `ip` goes: its RRSIG as sent, to delete.
    pub fn addr_removed(&mut self, ip: IpAddr, record: &Record) -> Option<Record> {
        self.chain.set(&record.name, vec![]);
        self.addrs.remove(&ip)
    }

    /// Ends a cut at `soa`: the NSECs that changed, the SOA's RRSIG, and on a refresh
    /// (`refresh`, see [`Self::refresh_due`]) every old signature of the apex, the
    /// addresses and the chain, made again. `addr_record` builds an address's record.
    pub fn finish(
        &mut self,
        signer: &Signer,
        soa: &Record,
        refresh: bool,
        addr_record: impl Fn(IpAddr) -> Record,
        now: Nanos,
    ) -> Changes {
        let (mut deleted, mut added) = (Vec::new(), Vec::new());
        if refresh {
            self.chain.refresh(now);
            let apex = Self::sign_apex(signer, &self.apex_records, now);
            if apex != self.apex {
                deleted.extend(std::mem::replace(&mut self.apex, apex.clone()));
                added.extend(apex);
            }
            for (ip, rrsig) in self.addrs.iter_mut() {
                if !Self::fresh(std::slice::from_ref(rrsig), now)
                    && let Some(new) = signer.rrsig(&[&addr_record(*ip)], now)
                {
                    deleted.push(std::mem::replace(rrsig, new.clone()));
                    added.push(new);
                }
            }
        }
        let (gone, new) = self.chain.commit(signer, now);
        deleted.extend(gone);
        added.extend(new);
        let soa = signer.rrsig(&[soa], now);
        deleted.extend(std::mem::replace(&mut self.soa, soa.clone()));
        added.extend(soa);
        let due = match refresh {
            true => refresh_due(
                self.apex
                    .iter()
                    .chain(self.addrs.values())
                    .chain(&self.soa)
                    .chain(self.chain.records()),
            ),
            false => refresh_due(&added),
        };
        self.next_refresh = self.next_refresh.min(due);
        (deleted, added)
    }

    /// In a refresh, a service kept as it was sent: its signatures' refresh counts.
    pub fn kept(&mut self, records: &[Record]) {
        self.next_refresh = self.next_refresh.min(refresh_due(records));
    }

    /// Everything signed a whole transfer carries besides the records: the apex's DNSKEY
    /// and RRSIGs, the SOA's RRSIG, the chain, and the RRSIGs of the addresses `ips`.
    pub fn records<'a>(&'a self, ips: &'a [IpAddr]) -> impl Iterator<Item = &'a Record> {
        self.apex
            .iter()
            .chain(&self.soa)
            .chain(self.chain.records())
            .chain(ips.iter().filter_map(|ip| self.addrs.get(ip)))
    }
}
