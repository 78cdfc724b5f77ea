//! Answers for the service zone, computed from the registry's read-only view.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use arc_swap::ArcSwap;
use hickory_proto::op::ResponseCode;
use hickory_proto::rr::rdata::HINFO;
use hickory_proto::rr::{LowerName, Name, RData, Record, RecordType};

use super::message::Below;
use crate::model::clock::Nanos;
use crate::registry::Registry;
use crate::registry::lease::{Lease, NEVER};
use crate::registry::view::{Member, ServiceView};
use crate::sign::Signer;
use crate::zone::prepared::{Asked, Prepared};
use crate::zone::records::{NS_TTL, ZoneNames, address_rdata, parse_addr_label};

/// The outcome of a lookup in the service zone.
#[derive(Debug, PartialEq)]
pub enum Answer {
    /// NOERROR with records.
    Records {
        answers: Vec<Record>,
        additionals: Vec<Record>,
    },
    /// The name exists but has nothing of the asked type: NOERROR, SOA in authority.
    NoData,
    /// The name does not exist: NXDOMAIN, SOA in authority.
    NxDomain,
}

pub struct ZoneAnswerer {
    pub registry: Arc<Registry>,
    /// Upper bound on record TTLs.
    pub dns_ttl: u32,
    pub negative_ttl: u32,
    /// Address of `ns.<zone>`.
    pub ns_address: IpAddr,
    /// The A and AAAA records of names in the static zones, by name: an SRV target that is
    /// a host name in a zone we serve gets its addresses in the additional section, as NSD
    /// and Knot add them. Set by [`super::Authority`] from its zones, and swapped with them
    /// on a reload (which drops the answers prepared with the old ones).
    pub host_addresses: ArcSwap<HashMap<LowerName, Vec<Record>>>,
    /// With `--dnssec`: what signs the answers to DO queries, once per RRset.
    pub signer: Option<Arc<Signer>>,
}

/// RFC 8482: one small synthesised record instead of every RRset at the name.
fn minimal_any(owner: &Name) -> Answer {
    let hinfo = RData::HINFO(HINFO::new("RFC8482".into(), String::new()));
    Answer::Records {
        answers: vec![Record::from_rdata(owner.clone(), 0, hinfo)],
        additionals: vec![],
    }
}

fn records(owner: &Name, ttl: u32, rdatas: impl IntoIterator<Item = RData>) -> Vec<Record> {
    rdatas
        .into_iter()
        .map(|rd| Record::from_rdata(owner.clone(), ttl, rd))
        .collect()
}

/// What a name of the zone is, for one query type: told from the name alone (and, for
/// `_<protocol>`, whether any service answers on it), before any record is built.
enum Shape<'a> {
    NxDomain,
    NoData,
    Soa,
    Ns,
    /// The apex's DNSKEY, in a signed zone.
    Dnskey,
    Any,
    Address(IpAddr),
    /// `<name>` or `_<name>._<protocol>`: the registry answers.
    Service(&'a [u8], Option<&'a [u8]>),
}

impl ZoneAnswerer {
    fn shape<'a>(&self, qname: &'a LowerName, qtype: RecordType, now: Nanos) -> Shape<'a> {
        let zone = self.registry.zone();
        let mut labels = qname.iter();
        let depth = zone.depth(qname);
        let first = labels.next();
        let second = labels.next();
        let address = |ip: IpAddr| match qtype {
            RecordType::A if ip.is_ipv4() => Shape::Address(ip),
            RecordType::AAAA if ip.is_ipv6() => Shape::Address(ip),
            RecordType::ANY => Shape::Any,
            _ => Shape::NoData,
        };
        match (depth, first, second) {
            (0, ..) => match qtype {
                RecordType::SOA => Shape::Soa,
                RecordType::NS => Shape::Ns,
                RecordType::DNSKEY if self.signer.is_some() => Shape::Dnskey,
                RecordType::ANY => Shape::Any,
                _ => Shape::NoData,
            },
            (1, Some(b"ns"), _) => address(self.ns_address),
            // `addr.<zone>` is an empty non-terminal: it exists, with nothing of its own.
            (1, Some(b"addr"), _) => Shape::NoData,
            (2, Some(hex), Some(b"addr")) => match parse_addr_label(hex) {
                None => Shape::NxDomain,
                Some(ip) => address(ip),
            },
            // `_<protocol>.<zone>`: the empty non-terminal above `_<name>._<protocol>.<zone>`.
            (1, Some(label), _) if label.starts_with(b"_") => match std::str::from_utf8(&label[1..]) {
                Ok(protocol) if self.registry.protocol_answerable(protocol, now) => Shape::NoData,
                _ => Shape::NxDomain,
            },
            (1, Some(service), _) => Shape::Service(service, None),
            (2, Some(service), Some(protocol)) => match (service.strip_prefix(b"_"), protocol.strip_prefix(b"_")) {
                (Some(service), Some(protocol)) => Shape::Service(service, Some(protocol)),
                _ => Shape::NxDomain,
            },
            _ => Shape::NxDomain,
        }
    }

    /// `qname` must be inside the zone; `owner` is the question's name as asked, so answers
    /// echo the client's letter case (resolvers using 0x20 randomisation check it).
    pub fn answer(&self, qname: &LowerName, owner: &Name, qtype: RecordType) -> Answer {
        let now = self.registry.now();
        match self.shape(qname, qtype, now) {
            Shape::NxDomain => Answer::NxDomain,
            Shape::NoData => Answer::NoData,
            Shape::Soa => Answer::Records {
                answers: vec![self.soa_as(owner)],
                additionals: vec![],
            },
            Shape::Ns => {
                let zone = self.registry.zone();
                Answer::Records {
                    answers: vec![Record::from_rdata(owner.clone(), NS_TTL, zone.ns_record(NS_TTL).data)],
                    additionals: vec![Record::from_rdata(
                        zone.ns.clone(),
                        NS_TTL,
                        address_rdata(self.ns_address),
                    )],
                }
            }
            Shape::Dnskey => Answer::Records {
                answers: self
                    .signer
                    .as_ref()
                    .map_or_else(Vec::new, |signer| signer.dnskey_records(owner, NS_TTL)),
                additionals: vec![],
            },
            Shape::Any => minimal_any(owner),
            Shape::Address(ip) => self.address_answer(owner, ip),
            Shape::Service(service, protocol) => self.service_answer(service, protocol, owner, qtype, now),
        }
    }

    /// The negative answer [`Self::answer`] gives (NXDOMAIN, or NOERROR for NODATA), told
    /// without building a record; `None` when it has records. The fast path answers
    /// negatives itself and leaves the rest to the full path, which builds them once.
    pub fn negative(&self, qname: &LowerName, qtype: RecordType) -> Option<ResponseCode> {
        let now = self.registry.now();
        match self.shape(qname, qtype, now) {
            Shape::NxDomain => Some(ResponseCode::NXDomain),
            Shape::NoData => Some(ResponseCode::NoError),
            Shape::Service(service, protocol) => {
                let alive = std::str::from_utf8(service).ok().and_then(|service| {
                    self.registry.with_view(service, |view| {
                        view.answerable(now)
                            .any(|m| protocol.is_none_or(|p| m.protocol.as_bytes() == p))
                    })
                });
                match alive {
                    Some(true) if service_types(qtype) => None,
                    Some(true) => Some(ResponseCode::NoError),
                    _ => Some(ResponseCode::NXDomain),
                }
            }
            Shape::Soa | Shape::Ns | Shape::Dnskey | Shape::Any | Shape::Address(_) => None,
        }
    }

    /// The types of the RRsets at `qname` (inside the zone), for the NSEC of a denial;
    /// `None` when the name does not exist.
    pub fn types_at(&self, qname: &LowerName) -> Option<Vec<RecordType>> {
        let now = self.registry.now();
        match self.shape(qname, RecordType::ANY, now) {
            Shape::NxDomain => None,
            Shape::NoData => Some(vec![]),
            Shape::Any if self.registry.zone().depth(qname) == 0 => {
                let mut types = vec![RecordType::NS, RecordType::SOA];
                types.extend(self.signer.as_ref().map(|_| RecordType::DNSKEY));
                Some(types)
            }
            Shape::Service(service, protocol) => {
                let view = std::str::from_utf8(service).ok().and_then(|s| self.registry.view(s))?;
                let members = self.answerable(&view, protocol, now);
                if members.is_empty() {
                    return None;
                }
                let mut types = vec![RecordType::TXT];
                if protocol.is_some() {
                    types.push(RecordType::SRV);
                } else {
                    let ips = || members.iter().filter_map(|m| m.records.ip());
                    types.extend(ips().any(|ip| ip.is_ipv4()).then_some(RecordType::A));
                    types.extend(ips().any(|ip| ip.is_ipv6()).then_some(RecordType::AAAA));
                }
                Some(types)
            }
            // `ns.` and `<hex>.addr`: the address record of their family.
            _ => Some(
                [RecordType::A, RecordType::AAAA]
                    .into_iter()
                    .filter(|t| matches!(self.shape(qname, *t, now), Shape::Address(_)))
                    .collect(),
            ),
        }
    }

    fn soa_as(&self, owner: &Name) -> Record {
        let soa = self.soa();
        Record::from_rdata(owner.clone(), soa.ttl, soa.data)
    }

    /// The zone's SOA as of now, for the authority section of negative answers.
    pub fn soa(&self) -> Record {
        self.soa_at(self.registry.current_serial())
    }

    /// The zone's SOA with `serial`.
    pub fn soa_at(&self, serial: u32) -> Record {
        self.registry.zone().soa(serial, self.negative_ttl)
    }

    fn address_answer(&self, owner: &Name, ip: IpAddr) -> Answer {
        Answer::Records {
            answers: vec![Record::from_rdata(owner.clone(), NS_TTL, address_rdata(ip))],
            additionals: vec![],
        }
    }

    /// The members of `view` that DNS may hand out for `protocol` (any when `None`), in view
    /// order. Meeting an expired one wakes the reaper.
    fn answerable(&self, view: &ServiceView, protocol: Option<&[u8]>, now: Nanos) -> Vec<Arc<Member>> {
        let mut expired = false;
        let members = view
            .members
            .iter()
            .filter(|m| protocol.is_none_or(|p| m.protocol.as_bytes() == p))
            .filter(|m| {
                let alive = m.lease.alive(now);
                expired |= !alive;
                alive && m.healthy
            })
            .cloned()
            .collect();
        if expired {
            self.registry.expired_seen();
        }
        members
    }

    fn service_answer(
        &self,
        service: &[u8],
        protocol: Option<&[u8]>,
        owner: &Name,
        qtype: RecordType,
        now: Nanos,
    ) -> Answer {
        let Some(view) = std::str::from_utf8(service).ok().and_then(|s| self.registry.view(s)) else {
            return Answer::NxDomain;
        };
        let mut members = self.answerable(&view, protocol, now);
        if members.is_empty() {
            return Answer::NxDomain;
        }
        // Shuffled so that load spreads.
        fastrand::shuffle(&mut members);
        self.records_of(&members, owner, qtype, protocol.is_some(), now).answer
    }

    /// The records answering `qtype` at a service name from `members` (see
    /// [`service_records`]), with the addresses of SRV targets that are host names in a zone
    /// we serve added to the additional section.
    fn records_of(
        &self,
        members: &[Arc<Member>],
        owner: &Name,
        qtype: RecordType,
        srv_name: bool,
        now: Nanos,
    ) -> Built {
        let zone = self.registry.zone();
        let mut earliest = earliest(members);
        let ttl = Lease::ttl_at(earliest, now, self.dns_ttl);
        let mut in_zone = false;
        // The longest TTL of a record whose lease can end: a prepared answer is good until
        // that TTL would reach past the earliest lease.
        let mut longest = ttl;
        let answer = service_records(zone, members, owner, qtype, srv_name, ttl, &mut |host| {
            let (records, until) = self.host_addresses(host, now);
            in_zone |= zone.origin_lower.zone_of(&LowerName::new(host));
            if until != NEVER {
                earliest = earliest.min(until);
                longest = records.iter().map(|r| r.ttl).fold(longest, u32::max);
            }
            records
        });
        Built {
            answer,
            ttl: longest,
            earliest,
            in_zone,
        }
    }

    /// The addresses of `host`, an SRV target that is a host name, where it is a name in a
    /// zone we serve, as NSD and Knot add them: a static zone's A and AAAA records, or what
    /// the service zone answers for it (another service's instances, `ns.`, a `<hex>.addr`
    /// name). Also the earliest lease they come from.
    fn host_addresses(&self, host: &Name, now: Nanos) -> (Vec<Record>, Nanos) {
        let name = LowerName::new(host);
        if let Some(records) = self.host_addresses.load().get(&name) {
            return (records.clone(), NEVER);
        }
        if !self.registry.zone().origin_lower.zone_of(&name) {
            return (Vec::new(), NEVER);
        }
        let mut out = Vec::new();
        let mut until = NEVER;
        for qtype in [RecordType::A, RecordType::AAAA] {
            match self.shape(&name, qtype, now) {
                Shape::Address(ip) => out.push(Record::from_rdata(host.clone(), NS_TTL, address_rdata(ip))),
                Shape::Service(service, None) => {
                    let Some(view) = std::str::from_utf8(service).ok().and_then(|s| self.registry.view(s)) else {
                        continue;
                    };
                    let members = self.answerable(&view, None, now);
                    let first = earliest(&members);
                    let ttl = Lease::ttl_at(first, now, self.dns_ttl);
                    if let Answer::Records { answers, .. } =
                        service_records(self.registry.zone(), &members, host, qtype, false, ttl, &mut |_| vec![])
                    {
                        out.extend(answers);
                        until = until.min(first);
                    }
                }
                _ => {}
            }
        }
        (out, until)
    }

    /// Drops the answers prepared so far, for what they were prepared with changed (the
    /// static zones' addresses, on a reload).
    pub(super) fn forget_prepared(&self) {
        for (_, view) in self.registry.views() {
            view.prepared.clear();
        }
    }

    /// Calls `f` with the prepared answer for `qtype` at `qname` (inside the zone), when
    /// `qname` is a service name with instances that DNS may hand out (a NODATA answer is
    /// prepared too, without records); `signed` for the one with RRSIGs (a DO query to a
    /// signed zone). Everything else takes [`Self::answer`].
    pub(super) fn prepared<R>(
        &self,
        qname: &Below<'_>,
        qtype: RecordType,
        signed: bool,
        f: impl FnOnce(&Prepared) -> R,
    ) -> Option<R> {
        if !service_types(qtype) || qtype == RecordType::ANY {
            return None;
        }
        let mut labels = qname.labels();
        let (service, protocol) = match qname.depth() {
            1 => (labels.next()?, None),
            2 => (
                labels.next()?.strip_prefix(b"_")?,
                Some(labels.next()?.strip_prefix(b"_")?),
            ),
            _ => return None,
        };
        // Service names are single labels that cannot be `ns` or `addr` or start with `_`,
        // so a view found here is exactly a `[service]` or `[_service, _protocol]` name.
        let service = std::str::from_utf8(service).ok()?;
        let now = self.registry.now();
        let view_changes = || self.registry.view_changes();
        let f = match self.registry.with_view(service, |view| {
            view.prepared.current(qtype, protocol, signed, now, view_changes, f)
        })? {
            Ok(answered) => return Some(answered),
            Err(f) => f,
        };
        // Built outside the map's lock, which registrations need.
        let view = self.registry.view(service)?;
        let signer = self.signer.as_deref().filter(|_| signed);
        let prepared = Arc::new(self.prepare(&view, &qname.lower_name(), qtype, protocol, signer, now)?);
        view.prepared.keep(qtype, protocol, signed, prepared.clone());
        Some(f(&prepared))
    }

    fn prepare(
        &self,
        view: &ServiceView,
        qname: &LowerName,
        qtype: RecordType,
        protocol: Option<&[u8]>,
        signer: Option<&Signer>,
        now: Nanos,
    ) -> Option<Prepared> {
        let members = self.answerable(view, protocol, now);
        if members.is_empty() {
            return None;
        }
        let owner = Name::from(qname);
        // Read first: a change after it makes the answer stale, never the other way round.
        let view_changes = self.registry.view_changes();
        let built = self.records_of(&members, &owner, qtype, protocol.is_some(), now);
        let (answers, additionals) = match built.answer {
            Answer::Records { answers, additionals } => (answers, additionals),
            _ => Default::default(),
        };
        // Signed once per RRset content (the signer keeps each signature), so an answer
        // built again as its TTL shrinks signs nothing.
        let (answers, additionals) = match signer {
            Some(signer) => (signer.with_rrsigs(answers, now), signer.with_rrsigs(additionals, now)),
            None => (answers, additionals),
        };
        Prepared::encode(
            Asked {
                owner,
                qtype,
                ttl: built.ttl,
                earliest: built.earliest,
                view_changes: built.in_zone.then_some(view_changes),
                signed_until: signer.map(|_| Signer::fresh_until(now)),
            },
            &answers,
            &additionals,
        )
    }
}

/// What a zone transfer carries for one service (see [`ZoneAnswerer::transfer_records`]).
#[derive(Default)]
pub struct ServiceRecords {
    /// Sorted and free of duplicates, so that two versions diff by a merge.
    pub records: Vec<Record>,
    /// The addresses its SRV targets encode: each has one `<hex>.addr` record in the zone,
    /// however many services point at it.
    pub ips: Vec<IpAddr>,
}

impl ZoneAnswerer {
    /// The records of `service` in a zone transfer: what the queries at its names answer
    /// (SRV and TXT at `_<name>._<protocol>`, A, AAAA and TXT at `<name>`), built by the
    /// same code, with `--dns-ttl` for a TTL: a secondary cannot shorten it as the lease
    /// runs out, as our own answers do.
    pub fn transfer_records(&self, service: &str, view: &ServiceView, now: Nanos) -> ServiceRecords {
        let zone = self.registry.zone();
        let members: Vec<Arc<Member>> = view.answerable(now).cloned().collect();
        let Ok(owner) = Name::from_ascii(service).and_then(|n| n.append_domain(&zone.origin)) else {
            return ServiceRecords::default();
        };
        let owner = owner.to_lowercase();
        let mut records = Vec::new();
        let mut take = |answer| {
            if let Answer::Records { answers, .. } = answer {
                records.extend(answers);
            }
        };
        for qtype in [RecordType::A, RecordType::AAAA, RecordType::TXT] {
            take(service_records(
                zone,
                &members,
                &owner,
                qtype,
                false,
                self.dns_ttl,
                &mut |_| vec![],
            ));
        }
        let mut protocols: Vec<&str> = members.iter().map(|m| &*m.protocol).collect();
        protocols.sort_unstable();
        protocols.dedup();
        for protocol in protocols {
            let of: Vec<Arc<Member>> = members.iter().filter(|m| &*m.protocol == protocol).cloned().collect();
            let Ok(srv_owner) =
                Name::from_ascii(format!("_{service}._{protocol}")).and_then(|n| n.append_domain(&zone.origin))
            else {
                continue;
            };
            let srv_owner = srv_owner.to_lowercase();
            for qtype in [RecordType::SRV, RecordType::TXT] {
                take(service_records(
                    zone,
                    &of,
                    &srv_owner,
                    qtype,
                    true,
                    self.dns_ttl,
                    &mut |_| vec![],
                ));
            }
        }
        records.sort_unstable();
        records.dedup();
        let mut ips: Vec<IpAddr> = members.iter().filter_map(|m| m.records.ip()).collect();
        ips.sort_unstable();
        ips.dedup();
        ServiceRecords { records, ips }
    }

    /// The records of the zone's apex and name server, which every transfer carries.
    pub fn apex_records(&self) -> Vec<Record> {
        let zone = self.registry.zone();
        vec![
            zone.ns_record(NS_TTL),
            Record::from_rdata(zone.ns.clone(), NS_TTL, address_rdata(self.ns_address)),
        ]
    }

    /// The `<hex>.addr` record of an SRV target's address, as a query for it answers.
    pub fn addr_record(&self, ip: IpAddr) -> Record {
        Record::from_rdata(self.registry.zone().addr_name(ip), NS_TTL, address_rdata(ip))
    }
}

/// The earliest lease deadline of `members`.
fn earliest(members: &[Arc<Member>]) -> Nanos {
    members.iter().map(|m| m.lease.deadline()).min().unwrap_or(NEVER)
}

/// What [`ZoneAnswerer::records_of`] built: the answer, the longest TTL of its records that
/// follow leases, the earliest lease it depends on, and whether it holds addresses of names
/// in the service zone.
struct Built {
    answer: Answer,
    ttl: u32,
    earliest: Nanos,
    in_zone: bool,
}

/// Whether a live service name may have records of `qtype`.
fn service_types(qtype: RecordType) -> bool {
    matches!(
        qtype,
        RecordType::SRV | RecordType::A | RecordType::AAAA | RecordType::TXT | RecordType::ANY
    )
}

/// The records answering `qtype` at a service name from `members`, in their order:
/// `srv_name` tells `_<name>._<protocol>` from `<name>`. An SRV target that is a host name
/// gets what `host_glue` gives for it in the additional section.
fn service_records(
    zone: &ZoneNames,
    members: &[Arc<Member>],
    owner: &Name,
    qtype: RecordType,
    srv_name: bool,
    ttl: u32,
    host_glue: &mut dyn FnMut(&Name) -> Vec<Record>,
) -> Answer {
    let answers = match (qtype, srv_name) {
        (RecordType::SRV, true) => {
            // An IP target's address goes to the additional section, once per address, with
            // the TTL it has when asked directly: the name encodes it, so it never changes.
            let mut seen = HashSet::new();
            let mut hosts = HashSet::new();
            let mut additionals = Vec::new();
            let srvs = members.iter().map(|m| {
                let target = m.records.target_name(zone);
                match m.records.ip() {
                    Some(ip) => {
                        if seen.insert(ip) {
                            additionals.push(Record::from_rdata(target.clone(), NS_TTL, address_rdata(ip)));
                        }
                    }
                    None => {
                        if hosts.insert(LowerName::new(&target)) {
                            additionals.extend(host_glue(&target));
                        }
                    }
                }
                m.records.srv(target)
            });
            let answers = records(owner, ttl, srvs);
            return Answer::Records { answers, additionals };
        }
        (RecordType::TXT, _) => records(owner, ttl, members.iter().map(|m| m.records.txt(&m.id))),
        (RecordType::A | RecordType::AAAA, false) => {
            let want_v4 = qtype == RecordType::A;
            let mut seen = HashSet::new();
            let ips = members
                .iter()
                .filter_map(|m| m.records.ip())
                .filter(|ip| ip.is_ipv4() == want_v4 && seen.insert(*ip));
            records(owner, ttl, ips.map(address_rdata))
        }
        (RecordType::ANY, _) => return minimal_any(owner),
        _ => Vec::new(),
    };
    if answers.is_empty() {
        Answer::NoData
    } else {
        Answer::Records {
            answers,
            additionals: vec![],
        }
    }
}
