//! The ServiceInstance of contract R1: its wire shape, and the validation that turns a
//! registration body into something the registry may store.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use compact_str::CompactString;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::clock::{Nanos, parse_rfc3339, rfc3339};

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

/// A registered instance, as stored and as answered. Every field is always present on the
/// wire so consumers never have to guess a default.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Instance {
    #[schema(value_type = String)]
    pub id: CompactString,
    #[schema(value_type = String)]
    pub name: CompactString,
    #[schema(value_type = String)]
    pub address: CompactString,
    pub port: u16,
    #[schema(value_type = String)]
    pub protocol: CompactString,
    pub tags: Vec<String>,
    #[schema(value_type = std::collections::BTreeMap<String, String>)]
    pub metadata: Metadata,
    pub weight: u16,
    pub priority: u16,
    pub healthy: bool,
    pub ttl_ns: i64,
    #[serde(with = "timestamp")]
    #[schema(value_type = String, format = DateTime)]
    pub registered_at: Nanos,
    #[serde(with = "timestamp")]
    #[schema(value_type = String, format = DateTime)]
    pub updated_at: Nanos,
}

impl Instance {
    /// A label of R5: the metadata entry `key`, else the first `key=value` tag. Metadata wins
    /// where both are given, so an explicit map entry can override a tag baked into an image.
    pub fn label(&self, key: &str) -> Option<&str> {
        label(&self.metadata, &self.tags, key)
    }

    /// The address as DNS will serve it.
    pub fn parsed_address(&self) -> Address {
        parse_address(&self.address).expect("stored addresses were validated at registration")
    }
}

pub fn label<'a>(metadata: &'a Metadata, tags: &'a [String], key: &str) -> Option<&'a str> {
    metadata.get(key).or_else(|| {
        tags.iter()
            .find_map(|t| t.split_once('=').filter(|(k, _)| *k == key).map(|(_, v)| v))
    })
}

mod timestamp {
    use super::*;
    use serde::{Deserializer, Serializer, de::Error};

    pub fn serialize<S: Serializer>(ns: &Nanos, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&rfc3339(*ns))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Nanos, D::Error> {
        let s = String::deserialize(d)?;
        parse_rfc3339(&s).ok_or_else(|| D::Error::custom(format!("not an RFC 3339 time: {s}")))
    }
}

/// An instance's metadata (R5): a map from string to string, kept as one shared slice sorted
/// by key. It is set at registration and never changed, and DNS (TXT), the export and the
/// health checker all read it, so copies of an instance share it instead of cloning it
/// (a two-entry `BTreeMap` costs a 544-byte node before its strings).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Metadata(Option<Arc<[(CompactString, CompactString)]>>);

impl Metadata {
    pub fn get(&self, key: &str) -> Option<&str> {
        let entries = self.0.as_deref()?;
        entries
            .binary_search_by(|(k, _)| k.as_str().cmp(key))
            .ok()
            .map(|i| entries[i].1.as_str())
    }

    /// The entries, sorted by key.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0
            .as_deref()
            .unwrap_or_default()
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn len(&self) -> usize {
        self.0.as_deref().map_or(0, <[_]>::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl From<BTreeMap<String, String>> for Metadata {
    fn from(map: BTreeMap<String, String>) -> Self {
        let entries: Vec<(CompactString, CompactString)> = map.into_iter().map(|(k, v)| (k.into(), v.into())).collect();
        Self((!entries.is_empty()).then(|| entries.into()))
    }
}

impl<K: Into<String>, V: Into<String>> FromIterator<(K, V)> for Metadata {
    /// Later entries win over earlier ones with the same key, as in a JSON object.
    fn from_iter<I: IntoIterator<Item = (K, V)>>(entries: I) -> Self {
        entries
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect::<BTreeMap<_, _>>()
            .into()
    }
}

impl fmt::Debug for Metadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Serialize for Metadata {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for Metadata {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        BTreeMap::<String, String>::deserialize(d).map(Self::from)
    }
}

/// Where consumers reach an instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    Ip(IpAddr),
    /// A host name, lower-case, without a trailing dot.
    Host(String),
}

pub fn parse_address(s: &str) -> Option<Address> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(Address::Ip(ip));
    }
    let host = s.strip_suffix('.').unwrap_or(s);
    is_host_name(host).then(|| Address::Host(host.to_ascii_lowercase()))
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

/// A registration body (R1, R2) as a registrant sends it: everything optional, so that a
/// missing field gets a message naming it rather than a serde error.
#[derive(Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct Registration {
    pub id: Option<String>,
    pub name: Option<String>,
    pub address: Option<String>,
    pub port: Option<i64>,
    pub protocol: Option<String>,
    pub tags: Option<Vec<String>>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub weight: Option<i64>,
    pub priority: Option<i64>,
    pub healthy: Option<bool>,
    pub ttl_ns: Option<i64>,
}

/// A validated registration: the mutable fields of an instance, without server stamps.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    pub id: CompactString,
    pub name: CompactString,
    pub address: CompactString,
    pub port: u16,
    pub protocol: CompactString,
    pub tags: Vec<String>,
    pub metadata: Metadata,
    pub weight: u16,
    pub priority: u16,
    pub healthy: bool,
    pub ttl_ns: i64,
}

/// A validation failure: which field, and what was wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }
}

fn u16_field(field: &str, value: Option<i64>, default: u16, min: i64) -> Result<u16, FieldError> {
    match value {
        None => Ok(default),
        Some(v) if (min..=65535).contains(&v) => Ok(v as u16),
        Some(v) => Err(FieldError::new(
            field,
            format!("must be between {min} and 65535, got {v}"),
        )),
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

fn check_metadata(metadata: &BTreeMap<String, String>) -> Result<(), FieldError> {
    if metadata.len() > MAX_METADATA_ENTRIES {
        return Err(FieldError::new(
            "metadata",
            format!(
                "has {} entries; at most {MAX_METADATA_ENTRIES} are allowed",
                metadata.len()
            ),
        ));
    }
    for (key, value) in metadata {
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

impl Registration {
    pub fn validate(self) -> Result<Spec, FieldError> {
        let name = self
            .name
            .filter(|n| !n.is_empty())
            .ok_or_else(|| FieldError::new("name", "is required"))?;
        if !is_label(&name) {
            return Err(FieldError::new(
                "name",
                format!("{name:?} is not one DNS label (1-63 letters, digits or '-', not starting or ending with '-')"),
            ));
        }
        let name = name.to_ascii_lowercase();
        if RESERVED_NAMES.contains(&name.as_str()) {
            return Err(FieldError::new(
                "name",
                format!("{name:?} is reserved: <{name}>.<zone> names the zone's own records; choose another name"),
            ));
        }

        let address = self
            .address
            .filter(|a| !a.is_empty())
            .ok_or_else(|| FieldError::new("address", "is required"))?;
        let address = match parse_address(&address) {
            Some(Address::Ip(ip)) => ip.to_string(),
            Some(Address::Host(host)) => host,
            None => {
                return Err(FieldError::new(
                    "address",
                    format!("{address:?} is neither an IP address nor a host name"),
                ));
            }
        };

        let port = match self.port {
            None | Some(0) => return Err(FieldError::new("port", "is required and must be between 1 and 65535")),
            p => u16_field("port", p, 0, 1)?,
        };

        let protocol = match self.protocol.filter(|p| !p.is_empty()) {
            None => DEFAULT_PROTOCOL.to_owned(),
            Some(p) if is_label(&p) => p.to_ascii_lowercase(),
            Some(p) => return Err(FieldError::new("protocol", format!("{p:?} is not one DNS label"))),
        };

        let weight = u16_field("weight", self.weight, DEFAULT_WEIGHT, 0)?;
        let priority = u16_field("priority", self.priority, DEFAULT_PRIORITY, 0)?;

        let id = match self.id.filter(|i| !i.is_empty()) {
            Some(id) => id,
            None => format!("{name}-{address}-{port}"),
        };
        if id.len() > MAX_ID_LEN {
            return Err(FieldError::new(
                "id",
                format!("is {} bytes long; at most {MAX_ID_LEN} are allowed", id.len()),
            ));
        }
        if id.chars().any(char::is_control) {
            return Err(FieldError::new("id", "must contain printable characters only"));
        }

        let tags = self.tags.unwrap_or_default();
        check_tags(&tags)?;
        let metadata = self.metadata.unwrap_or_default();
        check_metadata(&metadata)?;
        let metadata = Metadata::from(metadata);
        if let Some(domain) = label(&metadata, &tags, JET_DOMAIN) {
            let host = domain.strip_suffix('.').unwrap_or(domain);
            if !is_host_name(host) || !host.contains('.') {
                return Err(FieldError::new(
                    "metadata.jet.domain",
                    format!("{domain:?} is not a valid public host name (e.g. voice.koder.dev)"),
                ));
            }
        }
        super::check::CheckSpec::from_labels(&metadata, &tags)?;

        Ok(Spec {
            id: id.into(),
            name: name.into(),
            address: address.into(),
            port,
            protocol: protocol.into(),
            tags,
            metadata,
            weight,
            priority,
            healthy: self.healthy.unwrap_or(true),
            ttl_ns: self.ttl_ns.unwrap_or(0),
        })
    }
}
