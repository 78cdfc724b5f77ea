//! The ServiceInstance of contract R1: its wire shape, and the validation that turns a
//! registration body into something the registry may store.

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use compact_str::CompactString;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::FieldError;
use super::check::CheckSpec;
use super::clock::{Nanos, parse_rfc3339, rfc3339};
use super::metadata::{Metadata, label};

pub const DEFAULT_PROTOCOL: &str = "tcp";
pub const DEFAULT_WEIGHT: u16 = 100;
pub const DEFAULT_PRIORITY: u16 = 10;
pub const MAX_ID_LEN: usize = 255;
/// Bounds on what one instance may carry (Consul's limits), so that the 64 KiB body limit
/// is not the only bound on an instance's memory, disk and TXT answer.
pub const MAX_METADATA_ENTRIES: usize = 64;
pub const MAX_METADATA_KEY_LEN: usize = 128;
pub const MAX_METADATA_VALUE_LEN: usize = 512;
pub const MAX_TAGS: usize = 64;
pub const MAX_TAG_LEN: usize = 256;

/// Service names that would shadow the zone's own names (`ns.<zone>`, `addr.<zone>`).
pub const RESERVED_NAMES: [&str; 2] = ["ns", "addr"];

/// Metadata key (or `key=value` tag) that opts an instance into edge routing (R5).
pub const JET_DOMAIN: &str = "jet.domain";

/// An instance: what a registrant sends (`POST /services/register`), what the registry
/// stores and what it answers. One struct, so no field list is written twice.
///
/// On the way in every field may be missing or `null`: it takes its default, and
/// [`Instance::validate`] names what is required. Values are parsed as they are read (the
/// address into an [`Address`], ports and weights into `u16` with messages naming the
/// bounds), so a stored instance carries them typed. `registered_at` and `updated_at` are
/// the registry's stamps: whatever a body carries there is replaced. On the way out every
/// field is always present, so consumers never have to guess a default.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(default)]
pub struct Instance {
    #[schema(value_type = String)]
    #[serde(deserialize_with = "lenient::or_default")]
    pub id: CompactString,
    #[schema(value_type = String)]
    #[serde(deserialize_with = "lenient::or_default")]
    pub name: CompactString,
    #[schema(value_type = String)]
    pub address: Address,
    #[serde(deserialize_with = "lenient::port")]
    pub port: u16,
    #[schema(value_type = String)]
    #[serde(deserialize_with = "lenient::or_default")]
    pub protocol: CompactString,
    #[serde(deserialize_with = "lenient::or_default")]
    pub tags: Vec<String>,
    #[schema(value_type = std::collections::BTreeMap<String, String>)]
    pub metadata: Metadata,
    #[serde(deserialize_with = "lenient::weight")]
    pub weight: u16,
    #[serde(deserialize_with = "lenient::priority")]
    pub priority: u16,
    #[serde(deserialize_with = "lenient::healthy")]
    pub healthy: bool,
    #[serde(deserialize_with = "lenient::or_default")]
    pub ttl_ns: i64,
    // The default written as what it is on the wire (a stamp of 0 is the epoch): utoipa
    // would otherwise write the `Nanos` 0, which no `date-time` string is.
    #[serde(with = "timestamp")]
    #[schema(value_type = String, format = DateTime, default = "1970-01-01T00:00:00Z")]
    pub registered_at: Nanos,
    #[serde(with = "timestamp")]
    #[schema(value_type = String, format = DateTime, default = "1970-01-01T00:00:00Z")]
    pub updated_at: Nanos,
}

impl Default for Instance {
    /// What a registration that says nothing gets: the defaults of R1, no address (which
    /// validation refuses) and no stamps.
    fn default() -> Self {
        Self {
            id: CompactString::default(),
            name: CompactString::default(),
            address: Address::default(),
            port: 0,
            protocol: CompactString::default(),
            tags: Vec::new(),
            metadata: Metadata::default(),
            weight: DEFAULT_WEIGHT,
            priority: DEFAULT_PRIORITY,
            healthy: true,
            ttl_ns: 0,
            registered_at: 0,
            updated_at: 0,
        }
    }
}

impl Instance {
    /// A label of R5: the metadata entry `key`, else the first `key=value` tag. Metadata wins
    /// where both are given, so an explicit map entry can override a tag baked into an image.
    pub fn label(&self, key: &str) -> Option<&str> {
        label(&self.metadata, &self.tags, key)
    }
}

/// How a registration body's fields are read: `null` is the same as missing, and numbers
/// out of range are refused with the bounds (the path of the field is added by the caller's
/// `serde_path_to_error`).
mod lenient {
    use serde::de::{Deserialize, Deserializer, Error};

    pub fn or_default<'de, D: Deserializer<'de>, T: Deserialize<'de> + Default>(d: D) -> Result<T, D::Error> {
        Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
    }

    fn u16_in<'de, D: Deserializer<'de>>(d: D, min: i64, default: u16) -> Result<u16, D::Error> {
        match Option::<i64>::deserialize(d)? {
            None => Ok(default),
            Some(v) if (min..=65535).contains(&v) => Ok(v as u16),
            Some(v) => Err(D::Error::custom(format!("must be between {min} and 65535, got {v}"))),
        }
    }

    /// 0 reads as missing, which validation refuses as "required".
    pub fn port<'de, D: Deserializer<'de>>(d: D) -> Result<u16, D::Error> {
        match Option::<i64>::deserialize(d)? {
            None | Some(0) => Ok(0),
            Some(v) if (1..=65535).contains(&v) => Ok(v as u16),
            Some(v) => Err(D::Error::custom(format!("must be between 1 and 65535, got {v}"))),
        }
    }

    pub fn weight<'de, D: Deserializer<'de>>(d: D) -> Result<u16, D::Error> {
        u16_in(d, 0, super::DEFAULT_WEIGHT)
    }

    pub fn priority<'de, D: Deserializer<'de>>(d: D) -> Result<u16, D::Error> {
        u16_in(d, 0, super::DEFAULT_PRIORITY)
    }

    pub fn healthy<'de, D: Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
        Ok(Option::<bool>::deserialize(d)?.unwrap_or(true))
    }
}

mod timestamp {
    use super::*;
    use serde::{Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(ns: &Nanos, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&rfc3339(*ns))
    }

    /// `null` reads as unstamped, as a missing field does.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Nanos, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(0),
            Some(s) => parse_rfc3339(&s).ok_or_else(|| D::Error::custom(format!("not an RFC 3339 time: {s}"))),
        }
    }
}

/// Where consumers reach an instance: parsed once, when the registration is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    Ip(IpAddr),
    /// A host name, lower-case, without a trailing dot. Empty only in a registration that
    /// gave no address, which validation refuses.
    Host(CompactString),
}

impl Default for Address {
    fn default() -> Self {
        Self::Host(CompactString::default())
    }
}

impl Address {
    /// Whether no address was given.
    pub fn is_empty(&self) -> bool {
        matches!(self, Self::Host(host) if host.is_empty())
    }
}

impl std::str::FromStr for Address {
    type Err = String;

    /// An IP address, or a host name (lower-cased, a trailing dot dropped).
    fn from_str(s: &str) -> Result<Self, String> {
        if let Ok(ip) = s.parse::<IpAddr>() {
            return Ok(Self::Ip(ip));
        }
        let host = s.strip_suffix('.').unwrap_or(s);
        if is_host_name(host) {
            Ok(Self::Host(host.to_ascii_lowercase().into()))
        } else {
            Err(format!("{s:?} is neither an IP address nor a host name"))
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ip(ip) => ip.fmt(f),
            Self::Host(host) => f.write_str(host),
        }
    }
}

impl PartialEq<str> for Address {
    fn eq(&self, other: &str) -> bool {
        match self {
            Self::Ip(ip) => other.parse::<IpAddr>().is_ok_and(|o| o == *ip),
            Self::Host(host) => host == other,
        }
    }
}

impl PartialEq<&str> for Address {
    fn eq(&self, other: &&str) -> bool {
        *self == **other
    }
}

impl Serialize for Address {
    /// Every reply to a heartbeat or registration carries the instance, so its address is
    /// written on the hottest REST path. Through `Display` an IPv4 address costs about
    /// 1,200 instructions (four integer formats and the JSON writer's escaping of each
    /// piece, measured with callgrind: 2.6% of a heartbeat); written by hand into a stack
    /// buffer and handed over whole, a few dozen.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Ip(IpAddr::V4(ip)) => s.serialize_str(dotted_quad(ip, &mut [0; 15])),
            Self::Ip(ip) => s.collect_str(ip),
            Self::Host(host) => s.serialize_str(host),
        }
    }
}

/// `ip` as `a.b.c.d`, written into `buf`.
fn dotted_quad<'a>(ip: &std::net::Ipv4Addr, buf: &'a mut [u8; 15]) -> &'a str {
    let mut len = 0;
    for (i, octet) in ip.octets().into_iter().enumerate() {
        if i > 0 {
            buf[len] = b'.';
            len += 1;
        }
        if octet >= 100 {
            buf[len] = b'0' + octet / 100;
            len += 1;
        }
        if octet >= 10 {
            buf[len] = b'0' + octet / 10 % 10;
            len += 1;
        }
        buf[len] = b'0' + octet % 10;
        len += 1;
    }
    std::str::from_utf8(&buf[..len]).expect("digits and dots")
}

impl<'de> Deserialize<'de> for Address {
    /// `null` and `""` read as missing.
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(Self::default()),
            Some(s) if s.is_empty() => Ok(Self::default()),
            Some(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// One DNS label of letters, digits and `-`, 1–63 long, not starting or ending with `-`.
pub fn is_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A host name of RFC 1123 labels, at most 253 characters, whose last label is not all
/// digits (so `10.0.0.300` is refused rather than read as a name).
pub fn is_host_name(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(is_label)
        && s.rsplit('.')
            .next()
            .is_some_and(|tld| !tld.bytes().all(|b| b.is_ascii_digit()))
}

/// A registration that passed [`Instance::validate`]: the instance to store (the registry
/// stamps it) and its check settings, parsed here once and carried to the registry and the
/// health checker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Validated {
    pub instance: Instance,
    pub check: Arc<CheckSpec>,
}

impl std::ops::Deref for Validated {
    type Target = Instance;

    fn deref(&self) -> &Instance {
        &self.instance
    }
}

fn check_tags(tags: &[String]) -> Result<(), FieldError> {
    if tags.len() > MAX_TAGS {
        return Err(FieldError::new(
            "tags",
            format!("has {} entries; at most {MAX_TAGS} are allowed", tags.len()),
        ));
    }
    if let Some((i, tag)) = tags.iter().enumerate().find(|(_, t)| t.len() > MAX_TAG_LEN) {
        return Err(FieldError::new(
            format!("tags[{i}]"),
            format!("is {} bytes long; at most {MAX_TAG_LEN} are allowed", tag.len()),
        ));
    }
    Ok(())
}

fn check_metadata(metadata: &Metadata) -> Result<(), FieldError> {
    if metadata.len() > MAX_METADATA_ENTRIES {
        return Err(FieldError::new(
            "metadata",
            format!(
                "has {} entries; at most {MAX_METADATA_ENTRIES} are allowed",
                metadata.len()
            ),
        ));
    }
    for (key, value) in metadata.iter() {
        if key.is_empty() || key.len() > MAX_METADATA_KEY_LEN {
            return Err(FieldError::new(
                "metadata",
                format!(
                    "key {:?} is {} bytes long; keys must be 1 to {MAX_METADATA_KEY_LEN} bytes",
                    key.chars().take(32).collect::<String>(),
                    key.len()
                ),
            ));
        }
        if value.len() > MAX_METADATA_VALUE_LEN {
            return Err(FieldError::new(
                format!("metadata.{key}"),
                format!(
                    "is {} bytes long; at most {MAX_METADATA_VALUE_LEN} are allowed",
                    value.len()
                ),
            ));
        }
    }
    Ok(())
}

impl Instance {
    /// R1's rules beyond what reading the body already checked: required fields, names,
    /// the default id and protocol, label and size bounds, the check settings. Returns the
    /// instance normalised (lower-case names, the default id) with its parsed check.
    pub fn validate(mut self) -> Result<Validated, FieldError> {
        if self.name.is_empty() {
            return Err(FieldError::new("name", "is required"));
        }
        if !is_label(&self.name) {
            return Err(FieldError::new(
                "name",
                format!(
                    "{:?} is not one DNS label (1-63 letters, digits or '-', not starting or ending with '-')",
                    self.name
                ),
            ));
        }
        self.name = self.name.to_ascii_lowercase();
        if RESERVED_NAMES.contains(&self.name.as_str()) {
            return Err(FieldError::new(
                "name",
                format!(
                    "{:?} is reserved: <{}>.<zone> names the zone's own records; choose another name",
                    self.name, self.name
                ),
            ));
        }
        if self.address.is_empty() {
            return Err(FieldError::new("address", "is required"));
        }
        if self.port == 0 {
            return Err(FieldError::new("port", "is required and must be between 1 and 65535"));
        }
        if self.protocol.is_empty() {
            self.protocol = DEFAULT_PROTOCOL.into();
        } else if is_label(&self.protocol) {
            self.protocol = self.protocol.to_ascii_lowercase();
        } else {
            return Err(FieldError::new(
                "protocol",
                format!("{:?} is not one DNS label", self.protocol),
            ));
        }
        if self.id.is_empty() {
            self.id = compact_str::format_compact!("{}-{}-{}", self.name, self.address, self.port);
        }
        if self.id.len() > MAX_ID_LEN {
            return Err(FieldError::new(
                "id",
                format!("is {} bytes long; at most {MAX_ID_LEN} are allowed", self.id.len()),
            ));
        }
        if self.id.chars().any(char::is_control) {
            return Err(FieldError::new("id", "must contain printable characters only"));
        }
        check_tags(&self.tags)?;
        check_metadata(&self.metadata)?;
        if let Some(domain) = self.label(JET_DOMAIN) {
            let host = domain.strip_suffix('.').unwrap_or(domain);
            if !is_host_name(host) || !host.contains('.') {
                return Err(FieldError::new(
                    "metadata.jet.domain",
                    format!("{domain:?} is not a valid public host name (e.g. voice.koder.dev)"),
                ));
            }
        }
        let check = CheckSpec::from_labels(&self.metadata, &self.tags)?.shared();
        Ok(Validated { instance: self, check })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hand-written IPv4 form is `Display`'s, for every octet value in every place.
    #[test]
    fn an_ipv4_address_serializes_as_display_writes_it() {
        for octet in 0..=255u8 {
            for ip in [
                [octet, 0, 0, 0],
                [1, octet, 99, 100],
                [255, 10, octet, 9],
                [0, 255, 1, octet],
            ] {
                let ip = std::net::Ipv4Addr::from(ip);
                let json = serde_json::to_string(&Address::Ip(ip.into())).unwrap();
                assert_eq!(json, format!("\"{ip}\""));
            }
        }
        let v6: IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(serde_json::to_string(&Address::Ip(v6)).unwrap(), "\"2001:db8::1\"");
        let host = Address::Host("web.example".into());
        assert_eq!(serde_json::to_string(&host).unwrap(), "\"web.example\"");
    }
}
