//! The transfer journal: the versions of the service zone that secondaries were sent, and
//! the differences between them, from which IXFR (RFC 1995) answers.
//!
//! A version is cut when a transfer asks for one, at the registry's revision of that moment
//! (its SOA serial is the revision's low 32 bits). Cutting costs a look at every service's
//! view pointer: the journal holds the views of the last cut, and a held view is replaced
//! on a change, never modified, so a service whose view is the one of the last cut keeps
//! its records, and only changed services are built again and compared. The differences
//! are kept oldest first, bounded by count and bytes (`--journal-max-changes`,
//! `--journal-max-bytes`); a secondary whose serial is older than the oldest kept gets the
//! whole zone.
//!
//! Only serials that were cut can be the start of an IXFR; those are exactly the serials a
//! secondary can hold, since it only ever holds what a transfer sent it.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;

use hickory_proto::rr::Record;
use parking_lot::Mutex;

use super::answer::{ServiceRecords, ZoneAnswerer};
use crate::model::clock::Nanos;
use crate::registry::view::ServiceView;
use crate::sign::transfer::SignedZone;

/// The bounds of the journal.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Differences kept at most.
    pub max_changes: usize,
    /// Bytes of records (as encoded, uncompressed) the kept differences hold at most.
    pub max_bytes: usize,
}

/// The change from one cut version to the next.
pub struct Delta {
    pub from: u32,
    pub to: u32,
    pub deleted: Vec<Record>,
    pub added: Vec<Record>,
    bytes: usize,
}

/// A cut version, to send whole: its serial and its records (the apex's aside), and in a
/// signed zone the apex's DNSKEY, its RRSIGs and the NSEC chain.
pub struct Version {
    pub serial: u32,
    pub services: Vec<Arc<[Record]>>,
    pub addrs: Vec<Record>,
    pub signed: Vec<Record>,
}

struct Service {
    view: Arc<ServiceView>,
    records: Arc<[Record]>,
    ips: Vec<IpAddr>,
}

#[derive(Default)]
struct State {
    /// The last version cut, by service, and how many services point at each address.
    revision: Option<u64>,
    services: HashMap<String, Service>,
    ips: HashMap<IpAddr, usize>,
    deltas: VecDeque<Arc<Delta>>,
    bytes: usize,
    /// In a signed zone: its DNSKEY, RRSIGs and NSEC chain as last sent.
    signed: Option<SignedZone>,
}

pub struct Journal {
    limits: Limits,
    state: Mutex<State>,
}

/// What a secondary at some serial needs.
pub enum Since {
    /// Already current.
    Current(u32),
    /// The differences from its serial to the current one, in order.
    Deltas(u32, Vec<Arc<Delta>>),
    /// Its serial is not in the journal: the whole zone.
    Whole(Version),
}

/// `old` and `new` are sorted and free of duplicates: what leaves and what arrives.
fn diff(old: &[Record], new: &[Record], deleted: &mut Vec<Record>, added: &mut Vec<Record>) {
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        match (old.get(i), new.get(j)) {
            (Some(a), Some(b)) if a == b => {
                // Equal as records (RFC 2136: the TTL aside); a changed TTL is a change too.
                if a.ttl != b.ttl {
                    deleted.push(a.clone());
                    added.push(b.clone());
                }
                i += 1;
                j += 1;
            }
            (Some(a), Some(b)) if a < b => {
                deleted.push(a.clone());
                i += 1;
            }
            (Some(_), Some(b)) | (None, Some(b)) => {
                added.push(b.clone());
                j += 1;
            }
            (Some(a), None) => {
                deleted.push(a.clone());
                i += 1;
            }
            (None, None) => unreachable!(),
        }
    }
}

impl Journal {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            state: Mutex::new(State::default()),
        }
    }

    /// Whether signatures sent to secondaries are to be made again by `now`: then a new
    /// revision (`Store::touch`) makes the next transfer carry them.
    pub fn signatures_due(&self, now: Nanos) -> bool {
        self.state
            .lock()
            .signed
            .as_ref()
            .is_some_and(|signed| signed.refresh_due(now))
    }

    /// Cuts a version at the registry's current revision (if it moved since the last cut)
    /// and answers a secondary at `serial`, or one that wants the whole zone (`None`).
    pub fn since(&self, zone: &ZoneAnswerer, serial: Option<u32>) -> Since {
        let mut state = self.state.lock();
        let current = self.cut(&mut state, zone);
        match serial {
            Some(serial) if serial == current => Since::Current(current),
            Some(serial) => match state.deltas.iter().position(|d| d.from == serial) {
                Some(start) => Since::Deltas(current, state.deltas.iter().skip(start).cloned().collect()),
                None => Since::Whole(whole(&state, zone, current)),
            },
            None => Since::Whole(whole(&state, zone, current)),
        }
    }

    /// Brings `state` to the registry's revision; returns its serial.
    fn cut(&self, state: &mut State, zone: &ZoneAnswerer) -> u32 {
        let registry = &zone.registry;
        // A consistent set of views: none changed while they were read.
        let (revision, views) = loop {
            let revision = registry.current_revision();
            let views = registry.views();
            if registry.revision() == revision {
                break (revision, views);
            }
        };
        let serial = revision as u32;
        if state.revision == Some(revision) {
            return serial;
        }
        let now = registry.now();
        let signer = zone.signer.as_deref();
        if let (Some(signer), None) = (signer, &state.signed) {
            let origin = &registry.zone().origin;
            state.signed = Some(SignedZone::new(
                signer,
                origin,
                zone.apex_records(),
                zone.negative_ttl,
                now,
            ));
        }
        // A refresh builds again every service whose signatures are getting old.
        let refresh = state.signed.as_mut().is_some_and(|signed| signed.begin(now));
        let mut old = std::mem::take(&mut state.services);
        let mut deleted = Vec::new();
        let mut added = Vec::new();
        let mut moved: HashMap<IpAddr, usize> = HashMap::new();
        let mut count = |ips: &mut HashMap<IpAddr, usize>, ip: IpAddr, up: bool| {
            let n = ips.entry(ip).or_insert(0);
            moved.entry(ip).or_insert(*n);
            if up {
                *n += 1;
            } else {
                *n -= 1;
            }
        };
        for (name, view) in views {
            let previous = old.remove(&name);
            let unchanged =
                |p: &&Service| Arc::ptr_eq(&p.view, &view) && (!refresh || SignedZone::fresh(&p.records, now));
            if let Some(previous) = previous.as_ref().filter(unchanged) {
                if let Some(signed) = state.signed.as_mut().filter(|_| refresh) {
                    signed.kept(&previous.records);
                }
                let kept = Service {
                    view,
                    records: previous.records.clone(),
                    ips: previous.ips.clone(),
                };
                state.services.insert(name, kept);
                continue;
            }
            let ServiceRecords { mut records, ips } = zone.transfer_records(&name, &view, now);
            let (old_records, old_ips) = previous.map_or((Arc::from([]), Vec::new()), |p| (p.records, p.ips));
            if let (Some(signer), Some(signed)) = (signer, state.signed.as_mut()) {
                records = signed.service(signer, &old_records, records, now);
            }
            diff(&old_records, &records, &mut deleted, &mut added);
            for ip in &old_ips {
                count(&mut state.ips, *ip, false);
            }
            for ip in &ips {
                count(&mut state.ips, *ip, true);
            }
            state.services.insert(
                name,
                Service {
                    view,
                    records: records.into(),
                    ips,
                },
            );
        }
        for (_, gone) in old {
            if let Some(signed) = state.signed.as_mut() {
                signed.service_gone(&gone.records);
            }
            deleted.extend(gone.records.iter().cloned());
            for ip in &gone.ips {
                count(&mut state.ips, *ip, false);
            }
        }
        for (ip, before) in moved {
            let after = state.ips.get(&ip).copied().unwrap_or(0);
            let record = zone.addr_record(ip);
            let signed = signer.zip(state.signed.as_mut());
            match (before, after) {
                (0, 1..) => {
                    if let Some((signer, signed)) = signed {
                        added.extend(signed.addr_added(signer, ip, &record, now));
                    }
                    added.push(record);
                }
                (1.., 0) => {
                    if let Some((_, signed)) = signed {
                        deleted.extend(signed.addr_removed(ip, &record));
                    }
                    deleted.push(record);
                }
                _ => {}
            }
            if after == 0 {
                state.ips.remove(&ip);
            }
        }
        if let (Some(signer), Some(signed)) = (signer, state.signed.as_mut()) {
            let (gone, new) = signed.finish(signer, &zone.soa_at(serial), refresh, |ip| zone.addr_record(ip), now);
            deleted.extend(gone);
            added.extend(new);
        }
        if let Some(from) = state.revision {
            let bytes = deleted.iter().chain(&added).map(super::record_upper).sum();
            state.deltas.push_back(Arc::new(Delta {
                from: from as u32,
                to: serial,
                deleted,
                added,
                bytes,
            }));
            state.bytes += bytes;
            while state.deltas.len() > self.limits.max_changes
                || (state.bytes > self.limits.max_bytes && !state.deltas.is_empty())
            {
                let dropped = state.deltas.pop_front().expect("not empty");
                state.bytes -= dropped.bytes;
            }
        }
        state.revision = Some(revision);
        serial
    }
}

/// The whole zone of the last cut.
fn whole(state: &State, zone: &ZoneAnswerer, serial: u32) -> Version {
    let mut ips: Vec<IpAddr> = state.ips.keys().copied().collect();
    ips.sort_unstable();
    let signed = state
        .signed
        .as_ref()
        .map_or_else(Vec::new, |signed| signed.records(&ips).cloned().collect());
    Version {
        serial,
        services: state.services.values().map(|s| s.records.clone()).collect(),
        addrs: ips.into_iter().map(|ip| zone.addr_record(ip)).collect(),
        signed,
    }
}
