//! Who may do what: API keys and their scopes.
//!
//! A key is a token the caller sends (`X-API-Key`, or `Authorization: Bearer`). The server
//! keeps no token, only its SHA-256: the `--keys-file` holds digests (so the file is no
//! secret), and the admin keys of `KODER_DNS_API_KEY`, `api_keys` and the generated key are
//! hashed as they are loaded. Each key has a scope:
//!
//! - `admin`: every route;
//! - `read`: every `GET` under `/api/v1` and `POST /services/drift` (which only compares);
//! - `register`: every read, and register, heartbeat and deregister of instances whose
//!   service name matches one of its `services` patterns (`voice`, or `sip-*` for a prefix).
//!
//! A request costs one SHA-256 of the presented token and one map lookup in a table that a
//! reload swaps whole ([`Access::replace`]): no file read, no lock. The map is keyed by the
//! digest's first 8 bytes; the whole digest is then compared in constant time, so the time an
//! answer takes tells nothing about how much of a stored digest a guess matched.

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use arc_swap::ArcSwap;
use serde::Deserialize;
use subtle::ConstantTimeEq;

/// Tokens made by `koder-dns keys new` start with this, so that secret scanners can find a
/// leaked one.
pub const TOKEN_PREFIX: &str = "kdns_";

/// Random bytes in a new token (base64url, 43 characters after the prefix).
const TOKEN_BYTES: usize = 32;

/// What a key may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    Admin,
    Read,
    Register,
}

impl Scope {
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Admin => "admin",
            Scope::Read => "read",
            Scope::Register => "register",
        }
    }
}

impl std::str::FromStr for Scope {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "admin" => Ok(Scope::Admin),
            "read" => Ok(Scope::Read),
            "register" => Ok(Scope::Register),
            other => Err(format!("{other:?} is not a scope; use admin, read or register")),
        }
    }
}

/// A service-name pattern of a `register` key: a name, or a prefix ending in `*`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern {
    text: Box<str>,
    prefix: bool,
}

impl Pattern {
    /// Lower-cased; the part before a trailing `*` is letters, digits and `-` only, so that a
    /// pattern can only ever match names a registration could have.
    pub fn parse(text: &str) -> Result<Self, String> {
        let (stem, prefix) = match text.strip_suffix('*') {
            Some(stem) => (stem, true),
            None => (text, false),
        };
        let valid = stem.len() <= 63 && stem.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
        if !valid || (!prefix && stem.is_empty()) {
            return Err(format!(
                "service pattern {text:?}: a service name (letters, digits, -), optionally ending in * for any suffix"
            ));
        }
        Ok(Self {
            text: stem.to_ascii_lowercase().into(),
            prefix,
        })
    }

    /// `service` as stored: lower-case.
    pub fn matches(&self, service: &str) -> bool {
        if self.prefix {
            service.starts_with(&*self.text)
        } else {
            service == &*self.text
        }
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.text, if self.prefix { "*" } else { "" })
    }
}

/// A known key: its name (never the secret), scope and, for `register`, its services.
#[derive(Debug)]
pub struct Key {
    pub id: Box<str>,
    pub scope: Scope,
    pub services: Box<[Pattern]>,
}

impl Key {
    /// May this key change instances of `service`?
    pub fn may_write(&self, service: &str) -> bool {
        match self.scope {
            Scope::Admin => true,
            Scope::Read => false,
            Scope::Register => self.services.iter().any(|p| p.matches(service)),
        }
    }

    /// May this key change instances of every service (admin)?
    pub fn may_write_all(&self) -> bool {
        self.scope == Scope::Admin
    }

    /// May this key change any instance at all (admin, or register with its services)?
    pub fn writes(&self) -> bool {
        self.scope != Scope::Read
    }

    /// The services it may change, for a 403's message: `voice, sip-*`.
    pub fn services_text(&self) -> String {
        self.services
            .iter()
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// SHA-256 of a token: what the keys file stores and what a request is looked up by.
pub fn digest(token: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, token);
    digest.as_ref().try_into().expect("SHA-256 is 32 bytes")
}

/// A fresh token: the prefix, then 32 random bytes in base64url.
pub fn new_token() -> anyhow::Result<String> {
    let mut raw = [0u8; TOKEN_BYTES];
    getrandom::fill(&mut raw).map_err(|e| anyhow::anyhow!("no randomness for a key: {e}"))?;
    Ok(format!("{TOKEN_PREFIX}{}", data_encoding::BASE64URL_NOPAD.encode(&raw)))
}

/// The keys whose digests share their first 8 bytes: one, but for a 2^-64 chance.
type Bucket = Vec<([u8; 32], Arc<Key>)>;

/// Every key the server accepts, by digest.
#[derive(Debug, Default)]
pub struct Table {
    /// By the digest's first 8 bytes.
    buckets: HashMap<u64, Bucket>,
    len: usize,
}

impl Table {
    /// The admin keys given as tokens (`KODER_DNS_API_KEY`, `api_keys`, the generated key),
    /// named `api-key-1`, `api-key-2`, ... in their order (`generated` for the generated
    /// one), then the keys of the keys file.
    pub fn new(admin_tokens: &[(String, String)], file: &[FileKey]) -> Self {
        let mut table = Self::default();
        for (id, token) in admin_tokens {
            table.insert(
                digest(token.as_bytes()),
                Key {
                    id: id.as_str().into(),
                    scope: Scope::Admin,
                    services: Box::new([]),
                },
            );
        }
        for key in file {
            table.insert(
                key.sha256,
                Key {
                    id: key.id.as_str().into(),
                    scope: key.scope,
                    services: key.services.clone().into(),
                },
            );
        }
        table
    }

    fn insert(&mut self, digest: [u8; 32], key: Key) {
        self.len += 1;
        self.buckets
            .entry(bucket(&digest))
            .or_default()
            .push((digest, Arc::new(key)));
    }

    /// The key whose token this is.
    pub fn identify(&self, token: &[u8]) -> Option<&Arc<Key>> {
        let presented = digest(token);
        self.buckets
            .get(&bucket(&presented))?
            .iter()
            .find(|(stored, _)| bool::from(stored.ct_eq(&presented)))
            .map(|(_, key)| key)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

fn bucket(digest: &[u8; 32]) -> u64 {
    u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"))
}

/// The last key one connection presented and was let in with (see [`Access::identify_on`]).
/// Never printed: it holds the token.
#[derive(Default)]
pub struct LastKey(parking_lot::Mutex<Option<Remembered>>);

struct Remembered {
    token: Box<[u8]>,
    /// The table the key was found in, held so that its address is not reused.
    table: Arc<Table>,
    key: Arc<Key>,
}

/// The keys in force; [`Self::replace`] swaps in a new table for the requests after.
#[derive(Debug, Default)]
pub struct Access(ArcSwap<Table>);

impl Access {
    pub fn new(table: Table) -> Self {
        Self(ArcSwap::from_pointee(table))
    }

    /// The key whose token this is, under the table in force now.
    pub fn identify(&self, token: &[u8]) -> Option<Arc<Key>> {
        self.0.load().identify(token).cloned()
    }

    /// [`Self::identify`] for a request on a connection that remembers the last key it
    /// presented: a client on a keep-alive connection sends the same token with every
    /// request, and comparing it with the one remembered (in constant time) costs a tenth
    /// of hashing it again (SHA-256 was 2,100 of a heartbeat's 46,000 instructions,
    /// measured with callgrind). What is remembered holds only while the table it was found
    /// in is in force, so a reload that removes the key is obeyed from the next request on.
    pub fn identify_on(&self, token: &[u8], connection: &LastKey) -> Option<Arc<Key>> {
        let table = self.0.load();
        let mut last = connection.0.lock();
        if let Some(last) = last.as_ref()
            && Arc::ptr_eq(&last.table, &table)
            && bool::from(last.token.ct_eq(token))
        {
            return Some(last.key.clone());
        }
        let key = table.identify(token)?.clone();
        *last = Some(Remembered {
            token: token.into(),
            table: Arc::clone(&table),
            key: key.clone(),
        });
        Some(key)
    }

    pub fn replace(&self, table: Table) {
        self.0.store(Arc::new(table));
    }

    /// How many keys are in force.
    pub fn len(&self) -> usize {
        self.0.load().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// ---------------------------------------------------------------------------------------
// The keys file.

/// One `[[key]]` table of the keys file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileKey {
    pub id: String,
    pub sha256: [u8; 32],
    pub scope: Scope,
    pub services: Vec<Pattern>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    #[serde(default)]
    key: Vec<RawKey>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKey {
    id: toml::Spanned<String>,
    sha256: toml::Spanned<String>,
    scope: toml::Spanned<String>,
    services: Option<toml::Spanned<Vec<toml::Spanned<String>>>>,
}

/// Reads a keys file (`--keys-file`). Every error names the file and the line: an unknown
/// field, a digest that is not 64 hex digits, an unknown scope, a duplicate id or digest.
pub fn load_file(path: &Path) -> anyhow::Result<Vec<FileKey>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read the keys file {}: {e}", path.display()))?;
    parse_file(&text).map_err(|(line, message)| anyhow::anyhow!("keys file {}:{line}: {message}", path.display()))
}

/// A keys file's keys, or the line of the first error and what is wrong there.
fn parse_file(text: &str) -> Result<Vec<FileKey>, (usize, String)> {
    let line_of = |offset: usize| text[..offset.min(text.len())].matches('\n').count() + 1;
    let at = |span: std::ops::Range<usize>, message: String| (line_of(span.start), message);
    let file: KeysFile = toml::from_str(text).map_err(|e| {
        let line = e.span().map_or(1, |s| line_of(s.start));
        (line, e.message().to_owned())
    })?;
    let mut keys: Vec<FileKey> = Vec::with_capacity(file.key.len());
    for raw in file.key {
        let id = raw.id.get_ref().trim();
        if id.is_empty() || id.len() > 64 || id.chars().any(|c| c.is_control()) {
            return Err(at(raw.id.span(), format!("id {id:?}: 1-64 printable characters")));
        }
        if keys.iter().any(|k| k.id == id) {
            return Err(at(raw.id.span(), format!("id {id:?} is given twice")));
        }
        let sha256 = parse_digest(raw.sha256.get_ref()).map_err(|m| at(raw.sha256.span(), m))?;
        if let Some(other) = keys.iter().find(|k| k.sha256 == sha256) {
            return Err(at(
                raw.sha256.span(),
                format!("the digest of key {id:?} is that of key {:?} too", other.id),
            ));
        }
        let scope: Scope = raw.scope.get_ref().parse().map_err(|m| at(raw.scope.span(), m))?;
        let services = match (&raw.services, scope) {
            (None, Scope::Register) => {
                return Err(at(
                    raw.scope.span(),
                    format!("key {id:?}: a register key needs services = [\"name\", \"prefix-*\", ...]"),
                ));
            }
            (None, _) => Vec::new(),
            (Some(list), Scope::Register) => {
                if list.get_ref().is_empty() {
                    return Err(at(list.span(), format!("key {id:?}: services is empty")));
                }
                list.get_ref()
                    .iter()
                    .map(|p| Pattern::parse(p.get_ref()).map_err(|m| at(p.span(), m)))
                    .collect::<Result<_, _>>()?
            }
            (Some(list), _) => {
                return Err(at(
                    list.span(),
                    format!("key {id:?}: services belong to register keys only (this one is {scope:?})"),
                ));
            }
        };
        keys.push(FileKey {
            id: id.to_owned(),
            sha256,
            scope,
            services,
        });
    }
    Ok(keys)
}

fn parse_digest(text: &str) -> Result<[u8; 32], String> {
    let text = text.trim();
    let bytes = (text.len() == 64)
        .then(|| data_encoding::HEXLOWER_PERMISSIVE.decode(text.as_bytes()).ok())
        .flatten();
    bytes.and_then(|b| b.try_into().ok()).ok_or_else(|| {
        format!(
            "sha256 must be 64 hex digits (the SHA-256 of the token, as `koder-dns keys new` prints it), got {text:?}"
        )
    })
}

/// The `[[key]]` table for a key, as `koder-dns keys new` prints it.
pub fn file_entry(id: &str, token: &str, scope: Scope, services: &[Pattern]) -> String {
    let quote = |s: &str| toml::Value::String(s.to_owned()).to_string();
    let mut out = format!(
        "[[key]]\nid = {}\nsha256 = \"{}\"\nscope = \"{}\"\n",
        quote(id),
        data_encoding::HEXLOWER.encode(&digest(token.as_bytes())),
        scope.as_str()
    );
    if !services.is_empty() {
        let list: Vec<String> = services.iter().map(|p| quote(&p.to_string())).collect();
        out.push_str(&format!("services = [{}]\n", list.join(", ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(token: &str) -> String {
        data_encoding::HEXLOWER.encode(&digest(token.as_bytes()))
    }

    #[test]
    fn a_printed_entry_parses_back_and_identifies_its_token() {
        let token = new_token().unwrap();
        assert!(token.starts_with("kdns_") && token.len() == 5 + 43, "{token}");
        let services = [Pattern::parse("voice").unwrap(), Pattern::parse("sip-*").unwrap()];
        let entry = file_entry("voice-reg", &token, Scope::Register, &services);
        let keys = parse_file(&entry).unwrap();
        assert_eq!(keys[0].id, "voice-reg");
        assert_eq!(keys[0].services, services);
        let table = Table::new(&[("api-key-1".into(), "admin-token".into())], &keys);
        let key = table.identify(token.as_bytes()).unwrap();
        assert_eq!((&*key.id, key.scope), ("voice-reg", Scope::Register));
        assert_eq!(&*table.identify(b"admin-token").unwrap().id, "api-key-1");
        assert!(table.identify(b"admin-token ").is_none());
        assert!(table.identify(b"").is_none());
    }

    #[test]
    fn patterns_match_a_name_or_a_prefix() {
        let key = Key {
            id: "k".into(),
            scope: Scope::Register,
            services: vec![Pattern::parse("voice").unwrap(), Pattern::parse("SIP-*").unwrap()].into(),
        };
        assert!(key.may_write("voice"));
        assert!(!key.may_write("voice2"));
        assert!(key.may_write("sip-edge"));
        assert!(key.may_write("sip-"));
        assert!(!key.may_write("sip"));
        let all = Pattern::parse("*").unwrap();
        assert!(all.matches("anything"));
        assert!(Pattern::parse("").is_err());
        assert!(Pattern::parse("a*b").is_err());
        assert!(Pattern::parse("a.b").is_err());
    }

    #[test]
    fn each_kind_of_bad_file_is_refused_at_its_line() {
        let good = hex("t");
        let cases = [
            (
                format!("[[key]]\nid = \"a\"\nsha256 = \"{good}\"\nscope = \"read\"\ncolour = \"red\"\n"),
                5,
                "unknown field",
            ),
            (
                "[[key]]\nid = \"a\"\nsha256 = \"abc\"\nscope = \"read\"\n".to_owned(),
                3,
                "64 hex digits",
            ),
            (
                format!("[[key]]\nid = \"a\"\nsha256 = \"{good}\"\nscope = \"root\"\n"),
                4,
                "not a scope",
            ),
            (
                format!("[[key]]\nid = \"a\"\nsha256 = \"{good}\"\nscope = \"register\"\n"),
                4,
                "needs services",
            ),
            (
                format!("[[key]]\nid = \"a\"\nsha256 = \"{good}\"\nscope = \"read\"\nservices = [\"x\"]\n"),
                5,
                "register keys only",
            ),
            (
                format!(
                    "[[key]]\nid = \"a\"\nsha256 = \"{good}\"\nscope = \"read\"\n\n[[key]]\nid = \"a\"\nsha256 = \"{}\"\nscope = \"read\"\n",
                    hex("u")
                ),
                7,
                "twice",
            ),
            (
                format!(
                    "[[key]]\nid = \"a\"\nsha256 = \"{good}\"\nscope = \"read\"\n[[key]]\nid = \"b\"\nsha256 = \"{good}\"\nscope = \"admin\"\n"
                ),
                7,
                "too",
            ),
            (
                format!(
                    "[[key]]\nid = \"a\"\nsha256 = \"{good}\"\nscope = \"register\"\nservices = [\"ok\", \"not ok\"]\n"
                ),
                5,
                "service pattern",
            ),
            ("[[key]]\nid = \"a\"\n".to_owned(), 1, "missing field"),
            ("[key\n".to_owned(), 1, ""),
        ];
        for (text, line, wanted) in cases {
            let (at, message) = parse_file(&text).expect_err(&text);
            assert_eq!(at, line, "{text}: {message}");
            assert!(message.contains(wanted), "{text}: {message}");
        }
    }

    #[test]
    fn an_empty_file_has_no_keys() {
        assert_eq!(parse_file("").unwrap(), vec![]);
    }

    #[test]
    fn a_replaced_table_answers_the_next_lookup() {
        let access = Access::new(Table::new(&[("api-key-1".into(), "old".into())], &[]));
        assert!(access.identify(b"old").is_some());
        access.replace(Table::new(&[("api-key-1".into(), "new".into())], &[]));
        assert!(access.identify(b"old").is_none());
        assert!(access.identify(b"new").is_some());
        assert_eq!(access.len(), 1);
    }

    /// What a connection remembers answers only the same token under the same table: another
    /// token on the connection is looked up afresh (a wrong one refused), and a key removed
    /// by a reload is refused on the next request although the connection remembered it.
    #[test]
    fn a_remembered_key_holds_only_for_its_token_and_its_table() {
        let tokens = [("api-key-1".into(), "one".into()), ("api-key-2".into(), "two".into())];
        let access = Access::new(Table::new(&tokens, &[]));
        let connection = LastKey::default();
        for _ in 0..2 {
            assert_eq!(&*access.identify_on(b"one", &connection).unwrap().id, "api-key-1");
        }
        assert_eq!(&*access.identify_on(b"two", &connection).unwrap().id, "api-key-2");
        assert!(access.identify_on(b"tw", &connection).is_none());
        assert!(access.identify_on(b"two!", &connection).is_none());
        assert_eq!(&*access.identify_on(b"two", &connection).unwrap().id, "api-key-2");
        access.replace(Table::new(&tokens[..1], &[]));
        assert!(access.identify_on(b"two", &connection).is_none());
        assert_eq!(&*access.identify_on(b"one", &connection).unwrap().id, "api-key-1");
    }
}
