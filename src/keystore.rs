//! The zone's signing key, apart from what is signed with it: read from `--dnssec-key`
//! (PKCS#8 PEM), or generated once into `<data-dir>/dnssec/` and kept, so that a restart
//! signs with the key the parent's DS and the resolvers' trust anchors name.
//!
//! One ECDSAP256SHA256 key (algorithm 13) serves as key and zone signing key at once (a
//! combined signing key, DNSKEY flags 257): one DNSKEY, one signature per RRset, and the
//! smallest signatures of the algorithms every validator supports. A second DNSKEY may be
//! published beside it without signing (`--dnssec-publish-key`), for a rollover.
//!
//! The private key never leaves this module but as the signing object: no log line, error
//! or argument carries it (errors name the file, never its content).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use hickory_proto::dnssec::crypto::EcdsaSigningKey;
use hickory_proto::dnssec::rdata::{DNSKEY, DS};
use hickory_proto::dnssec::{Algorithm, DigestType, SigningKey, TBS};
use hickory_proto::rr::Name;
use rustls::pki_types::PrivatePkcs8KeyDer;
use rustls::pki_types::pem::PemObject;

/// The algorithm of every key we make or read.
pub const ALGORITHM: Algorithm = Algorithm::ECDSAP256SHA256;

/// DNSKEY flags of a combined signing key: Zone Key and Secure Entry Point (RFC 4034 §2.1.1).
pub const FLAGS: u16 = 257;

/// The file a generated key is kept in, under `<data-dir>/dnssec/`.
const GENERATED: &str = "zone-key.pem";

/// Where the signing key comes from.
#[derive(Clone, Debug)]
pub struct KeySource {
    pub data_dir: PathBuf,
    /// `--dnssec-key`: used as given, never written.
    pub key: Option<PathBuf>,
    /// `--dnssec-publish-key`: a second key, published as a DNSKEY but not signed with.
    pub publish: Option<PathBuf>,
}

/// The key the zone is signed with, and the DNSKEY RRset published at the apex.
pub struct ZoneKey {
    signing: EcdsaSigningKey,
    dnskey: DNSKEY,
    key_tag: u16,
    /// Every DNSKEY of the apex: the signing key's first, then a published one.
    published: Vec<DNSKEY>,
}

impl std::fmt::Debug for ZoneKey {
    /// The key tag only: the private key is never printed.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZoneKey").field("key_tag", &self.key_tag).finish()
    }
}

impl ZoneKey {
    /// The key `source` names, generating `<data-dir>/dnssec/zone-key.pem` (mode 0600) if
    /// there is no `--dnssec-key` and no key was generated before; `generate` false refuses
    /// that instead (the `dnssec` tools only read a key).
    pub fn load(source: &KeySource, generate: bool) -> anyhow::Result<Self> {
        let signing = match &source.key {
            Some(path) => read_key(path)?,
            None => {
                let path = generated_path(&source.data_dir);
                if !path.exists() {
                    if !generate {
                        bail!("no DNSSEC key at {} and none given with --dnssec-key", path.display());
                    }
                    write_new_key(&path)?;
                    tracing::info!(path = %path.display(), "generated the zone's DNSSEC key");
                }
                read_key(&path)?
            }
        };
        let public = signing
            .to_public_key()
            .map_err(|e| anyhow::anyhow!("DNSSEC key: no public key: {e}"))?;
        let dnskey = DNSKEY::with_flags(FLAGS, public);
        let key_tag = dnskey
            .calculate_key_tag()
            .map_err(|e| anyhow::anyhow!("DNSSEC key tag: {e}"))?;
        let mut published = vec![dnskey.clone()];
        if let Some(path) = &source.publish {
            let other = read_key(path)?
                .to_public_key()
                .map_err(|e| anyhow::anyhow!("--dnssec-publish-key {}: {e}", path.display()))?;
            let other = DNSKEY::with_flags(FLAGS, other);
            if other != dnskey {
                published.push(other);
            }
        }
        Ok(Self {
            signing,
            dnskey,
            key_tag,
            published,
        })
    }

    /// The signature of `tbs` (hickory's canonical form of an RRset and its RRSIG fields).
    pub fn sign(&self, tbs: &TBS) -> anyhow::Result<Vec<u8>> {
        self.signing
            .sign(tbs)
            .map_err(|e| anyhow::anyhow!("DNSSEC signing failed: {e}"))
    }

    /// The signing key's tag, which every RRSIG names.
    pub fn key_tag(&self) -> u16 {
        self.key_tag
    }

    /// The signing key's DNSKEY.
    pub fn dnskey(&self) -> &DNSKEY {
        &self.dnskey
    }

    /// The apex's DNSKEY RRset: the signing key, and the published one if any.
    pub fn published(&self) -> &[DNSKEY] {
        &self.published
    }

    /// The DS record of the signing key for `zone`, digest type 2 (SHA-256), as the parent
    /// publishes it.
    pub fn ds(&self, zone: &Name) -> anyhow::Result<DS> {
        let digest = self
            .dnskey
            .to_digest(zone, DigestType::SHA256)
            .map_err(|e| anyhow::anyhow!("DS digest: {e}"))?;
        Ok(DS::new(
            self.key_tag,
            ALGORITHM,
            DigestType::SHA256,
            digest.as_ref().to_vec(),
        ))
    }
}

fn generated_path(data_dir: &Path) -> PathBuf {
    data_dir.join("dnssec").join(GENERATED)
}

/// A PKCS#8 PEM private key for ECDSAP256SHA256; the error names the file, not its content.
fn read_key(path: &Path) -> anyhow::Result<EcdsaSigningKey> {
    let text = std::fs::read(path).with_context(|| format!("cannot read the DNSSEC key {}", path.display()))?;
    let der = PrivatePkcs8KeyDer::from_pem_slice(&text).map_err(|_| {
        anyhow::anyhow!(
            "the DNSSEC key {} is not a PKCS#8 PEM private key (BEGIN PRIVATE KEY)",
            path.display()
        )
    })?;
    EcdsaSigningKey::from_pkcs8(&der, ALGORITHM).map_err(|_| {
        anyhow::anyhow!(
            "the DNSSEC key {} is not an ECDSA P-256 key (algorithm 13, ECDSAP256SHA256)",
            path.display()
        )
    })
}

/// A new ECDSA P-256 key as PKCS#8 PEM.
pub fn new_key_pem() -> anyhow::Result<String> {
    let der = EcdsaSigningKey::generate_pkcs8(ALGORITHM).map_err(|e| anyhow::anyhow!("key generation: {e}"))?;
    let body = data_encoding::BASE64.encode(der.secret_pkcs8_der());
    let mut pem = String::from("-----BEGIN PRIVATE KEY-----\n");
    for line in body.as_bytes().chunks(64) {
        pem.push_str(std::str::from_utf8(line).expect("base64 is ASCII"));
        pem.push('\n');
    }
    pem.push_str("-----END PRIVATE KEY-----\n");
    Ok(pem)
}

/// Writes a new key to `path`, readable by the owner only, refusing to replace a file.
pub fn write_new_key(path: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let pem = new_key_pem()?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot create the DNSSEC key {}", path.display()))?;
    file.write_all(pem.as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write the DNSSEC key {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_key_is_kept_private_and_read_back_the_same() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let source = KeySource {
            data_dir: dir.path().to_owned(),
            key: None,
            publish: None,
        };
        assert!(ZoneKey::load(&source, false).is_err(), "no key and no generation");
        let first = ZoneKey::load(&source, true).unwrap();
        let mode = std::fs::metadata(generated_path(dir.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let again = ZoneKey::load(&source, false).unwrap();
        assert_eq!(first.dnskey(), again.dnskey(), "the kept key, not a new one");
        assert_eq!(first.published().len(), 1);
    }

    #[test]
    fn a_key_that_is_not_pkcs8_p256_is_refused_without_showing_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k.pem");
        std::fs::write(
            &path,
            "-----BEGIN PRIVATE KEY-----\nc2VjcmV0LXNlY3JldA==\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        let source = KeySource {
            data_dir: dir.path().to_owned(),
            key: Some(path),
            publish: None,
        };
        let error = format!("{:#}", ZoneKey::load(&source, true).unwrap_err());
        assert!(error.contains("k.pem") && !error.contains("c2VjcmV0"), "{error}");
    }
}
