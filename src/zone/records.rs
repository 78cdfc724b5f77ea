//! Record building: the naming scheme of the service zone and the records of one instance,
//! built once per registration so that a query only copies them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use hickory_proto::rr::domain::Label;
use hickory_proto::rr::rdata::{A, AAAA, NS, SOA, SRV, TXT};
use hickory_proto::rr::{LowerName, Name, RData, Record};
use hickory_proto::serialize::binary::BinEncodable;

use crate::model::instance::{Address, Instance};
use crate::model::metadata::Metadata;

/// TTL of records that do not churn: NS, the address of `ns.`, `<hex>.addr` addresses (in
/// answers and additional sections alike), and the apex's DNSKEY.
pub const NS_TTL: u32 = 3600;

/// The fixed names of the service zone.
#[derive(Clone, Debug)]
pub struct ZoneNames {
    pub origin: Name,
    pub origin_lower: LowerName,
    /// The origin in lower case as it is on the wire, which the fast path matches the
    /// question's name against.
    pub origin_wire: Box<[u8]>,
    /// `addr.<origin>`: parent of the synthesised address names of SRV targets.
    pub addr: Name,
    /// `ns.<origin>`: the zone's name server.
    pub ns: Name,
    /// `hostmaster.<origin>`: the SOA RNAME.
    pub hostmaster: Name,
    /// The SOA's refresh, retry and expire, in seconds (`--soa-refresh` and the others).
    pub timers: SoaTimers,
}

/// The SOA timers secondaries follow (RFC 1035 §3.3.13).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SoaTimers {
    pub refresh: u32,
    pub retry: u32,
    pub expire: u32,
}

impl Default for SoaTimers {
    fn default() -> Self {
        Self {
            refresh: 3600,
            retry: 600,
            expire: 86400,
        }
    }
}

impl ZoneNames {
    pub fn new(domain: &str) -> Result<Self, String> {
        let mut origin = Name::from_str(domain).map_err(|e| format!("{domain:?} is not a domain name: {e}"))?;
        origin.set_fqdn(true);
        let origin = origin.to_lowercase();
        if origin.is_root() {
            return Err("the service zone cannot be the root".into());
        }
        let child = |label: &str| {
            Name::from_str(label)
                .and_then(|l| l.append_domain(&origin))
                .map_err(|e| e.to_string())
        };
        let addr = child("addr")?;
        // The longest name the zone serves: an IPv6 target's <32 hex digits>.addr.<origin>.
        Label::from_raw_bytes(&[b'0'; 32]).and_then(|l| addr.prepend_label(l)).map_err(|_| {
            format!("{domain:?} is too long: <32 hex digits>.addr.{domain} would exceed 255 bytes; choose a shorter --domain")
        })?;
        let origin_wire = origin
            .to_bytes()
            .map_err(|e| format!("{domain:?} cannot be encoded: {e}"))?;
        Ok(Self {
            origin_lower: LowerName::new(&origin),
            origin_wire: origin_wire.into(),
            addr,
            ns: child("ns")?,
            hostmaster: child("hostmaster")?,
            timers: SoaTimers::default(),
            origin,
        })
    }

    /// How many labels `name` (inside the zone) has below the origin; a `*` label counts.
    pub fn depth(&self, name: &LowerName) -> usize {
        name.iter().len() - self.origin_lower.iter().len()
    }

    /// `<hex>.addr.<origin>`: IPv4 as 8 hex digits, IPv6 as 32. Built from the label's bytes
    /// rather than parsed from text: answers for a large service build hundreds of them.
    pub fn addr_name(&self, ip: IpAddr) -> Name {
        let (value, digits) = match ip {
            IpAddr::V4(v4) => (u32::from(v4) as u128, 8),
            IpAddr::V6(v6) => (u128::from(v6), 32),
        };
        let mut label = [0u8; 32];
        for (i, digit) in label[..digits].iter_mut().enumerate() {
            *digit = b"0123456789abcdef"[(value >> (4 * (digits - 1 - i)) & 0xf) as usize];
        }
        let label = Label::from_raw_bytes(&label[..digits]).expect("8 or 32 hex digits make a label");
        self.addr
            .prepend_label(label)
            .expect("a hex label under addr.<origin> is a valid name")
    }

    pub fn soa(&self, serial: u32, negative_ttl: u32) -> Record {
        let soa = SOA::new(
            self.ns.clone(),
            self.hostmaster.clone(),
            serial,
            self.timers.refresh as i32,
            self.timers.retry as i32,
            self.timers.expire as i32,
            negative_ttl,
        );
        Record::from_rdata(self.origin.clone(), negative_ttl, RData::SOA(soa))
    }

    pub fn ns_record(&self, ttl: u32) -> Record {
        Record::from_rdata(self.origin.clone(), ttl, RData::NS(NS(self.ns.clone())))
    }
}

/// The address a `<hex>` label of `addr.<origin>` encodes.
pub fn parse_addr_label(label: &[u8]) -> Option<IpAddr> {
    let text = std::str::from_utf8(label).ok()?;
    if !text.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    match text.len() {
        8 => u32::from_str_radix(text, 16)
            .ok()
            .map(|v| IpAddr::V4(Ipv4Addr::from(v))),
        32 => u128::from_str_radix(text, 16)
            .ok()
            .map(|v| IpAddr::V6(Ipv6Addr::from(v))),
        _ => None,
    }
}

pub fn address_rdata(ip: IpAddr) -> RData {
    match ip {
        IpAddr::V4(v4) => RData::A(A(v4)),
        IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
    }
}

/// Where an SRV record of an instance points.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// `<hex>.addr.<origin>`, with the address as glue; the name is derived when an answer
    /// is built.
    Ip(IpAddr),
    /// A host name as registered, fully qualified (boxed: rare, and a `Name` is 80 bytes).
    Host(Box<Name>),
}

/// What DNS needs of one instance, built once per registration and kept as long as the
/// instance, so kept small: names are derived when an answer is built (an IP target's from
/// the address, the TXT strings from the metadata, which the instance shares) rather than
/// stored. Answers are built once per view and type (see `zone::prepared`), so deriving them
/// costs nothing per query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceRecords {
    pub target: Target,
    pub priority: u16,
    pub weight: u16,
    pub port: u16,
    pub metadata: Metadata,
}

/// TXT character-strings hold at most 255 bytes; longer entries are split, never cut.
fn txt_strings(entries: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    for entry in entries {
        let mut rest = entry.as_str();
        while rest.len() > 255 {
            let mut cut = 255;
            while !rest.is_char_boundary(cut) {
                cut -= 1;
            }
            out.push(rest[..cut].to_owned());
            rest = &rest[cut..];
        }
        out.push(rest.to_owned());
    }
    out
}

impl InstanceRecords {
    pub fn new(instance: &Instance) -> Self {
        let target = match &instance.address {
            Address::Ip(ip) => Target::Ip(*ip),
            Address::Host(host) => {
                let mut name = Name::from_str(host).expect("validated host name");
                name.set_fqdn(true);
                Target::Host(Box::new(name))
            }
        };
        Self {
            target,
            priority: instance.priority,
            weight: instance.weight,
            port: instance.port,
            metadata: instance.metadata.clone(),
        }
    }

    /// The address of an IP target.
    pub fn ip(&self) -> Option<IpAddr> {
        match self.target {
            Target::Ip(ip) => Some(ip),
            Target::Host(_) => None,
        }
    }

    /// The SRV target: `<hex>.addr.<origin>` or the host name.
    pub fn target_name(&self, zone: &ZoneNames) -> Name {
        match &self.target {
            Target::Ip(ip) => zone.addr_name(*ip),
            Target::Host(name) => (**name).clone(),
        }
    }

    pub fn srv(&self, target: Name) -> RData {
        RData::SRV(SRV::new(self.priority, self.weight, self.port, target))
    }

    /// `id=<id>`, then `key=value` per metadata entry, sorted by key.
    pub fn txt(&self, id: &str) -> RData {
        let entries = std::iter::once(format!("id={id}")).chain(self.metadata.iter().map(|(k, v)| format!("{k}={v}")));
        RData::TXT(TXT::new(txt_strings(entries)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_zone_too_long_for_ipv6_target_names_is_refused() {
        let long = format!(
            "{}.koder",
            ["a".repeat(60), "b".repeat(60), "c".repeat(60), "d".repeat(30)].join(".")
        );
        let error = ZoneNames::new(&long).unwrap_err();
        assert!(error.contains("too long") && error.contains("--domain"), "{error}");
        let zone = ZoneNames::new("service.koder").unwrap();
        let v6 = zone.addr_name("2001:db8::1".parse().unwrap());
        assert_eq!(v6.to_string(), "20010db8000000000000000000000001.addr.service.koder.");
        assert_eq!(
            zone.addr_name("10.0.0.1".parse().unwrap()).to_string(),
            "0a000001.addr.service.koder."
        );
    }
}
