//! An instance's metadata and labels (R5): the `metadata` map, and the `key=value` tags
//! that stand in for it. Read by the instance's validation, its health check settings,
//! DNS (TXT) and the export.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use compact_str::CompactString;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A label of R5: the metadata entry `key`, else the first `key=value` tag.
pub fn label<'a>(metadata: &'a Metadata, tags: &'a [String], key: &str) -> Option<&'a str> {
    metadata.get(key).or_else(|| {
        tags.iter()
            .find_map(|t| t.split_once('=').filter(|(k, _)| *k == key).map(|(_, v)| v))
    })
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
        Ok(Option::<BTreeMap<String, String>>::deserialize(d)?
            .map(Self::from)
            .unwrap_or_default())
    }
}
