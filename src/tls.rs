//! TLS: reading a PEM certificate chain and its private key, the server's swappable
//! certificate, and the client side's trust (the system's roots plus a private CA).
//!
//! rustls with the ring provider, the crypto hickory's TSIG already links: no OpenSSL, and no
//! aws-lc, whose build needs cmake and a C toolchain. One [`ServerCert`] serves every TLS
//! listener (HTTPS on `--http-listen`, DNS over TLS on `--dot-listen`); a reload puts a new
//! certificate in it, which the next handshake uses, while established connections go on with
//! the one they started with. The same readers load a CA or a client certificate for any
//! client this process runs (the agent, the operator tools, an etcd client).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, ServerSessionMemoryCache};
use rustls::sign::CertifiedKey;

/// TLS sessions each server config remembers for resumption by session id (TLS 1.2) or
/// stateful ticket; stateless tickets (below) need no room at all. 256 is rustls's default;
/// a registry's clients are a few thousand registrants and edge proxies at most.
const SESSION_CACHE: usize = 4096;

/// What went wrong reading a TLS file, always naming the file (and the flag that named it).
#[derive(Debug, thiserror::Error)]
#[error("{flag} {}: {reason}", path.display())]
pub struct FileError {
    pub flag: &'static str,
    pub path: PathBuf,
    pub reason: String,
}

fn file_error(flag: &'static str, path: &Path, reason: impl std::fmt::Display) -> FileError {
    FileError {
        flag,
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

/// The crypto every TLS config of this process uses.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(ring_provider())
}

/// rustls 0.23.48 deprecated its ring provider for lacking post-quantum key exchange (its
/// aws-lc provider has ML-KEM); ring is what this project links already and builds without a
/// C toolchain. Key exchange stays X25519 and the NIST curves.
#[allow(deprecated, reason = "ring on purpose: see above")]
fn ring_provider() -> CryptoProvider {
    rustls::crypto::ring::default_provider()
}

/// Makes ring the process's default rustls provider, which reqwest (built without a
/// provider of its own, to keep aws-lc out) takes for every client it builds, `http://`
/// ones included. Idempotent; call it before building a `reqwest::Client`.
pub fn install_provider() {
    // Err means a provider is installed already: this one, by an earlier call.
    let _ = ring_provider().install_default();
}

/// Every certificate in a PEM file, in order (a chain: the leaf first).
pub fn read_certs(flag: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, FileError> {
    let text = std::fs::read(path).map_err(|e| file_error(flag, path, format!("cannot read it: {e}")))?;
    let certs = CertificateDer::pem_slice_iter(&text)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(flag, path, format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(file_error(
            flag,
            path,
            "holds no certificate (expected PEM blocks \"-----BEGIN CERTIFICATE-----\")",
        ));
    }
    Ok(certs)
}

/// The first private key in a PEM file: PKCS#8 (`PRIVATE KEY`), SEC1 (`EC PRIVATE KEY`) or
/// PKCS#1 (`RSA PRIVATE KEY`).
pub fn read_key(flag: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, FileError> {
    let text = std::fs::read(path).map_err(|e| file_error(flag, path, format!("cannot read it: {e}")))?;
    PrivateKeyDer::from_pem_slice(&text).map_err(|e| {
        file_error(
            flag,
            path,
            format!("no private key in it (PEM PKCS#8, SEC1 or PKCS#1 expected): {e}"),
        )
    })
}

/// A certificate chain with its private key, checked to belong together.
#[derive(Debug, Clone)]
pub struct Credentials {
    pub certified: Arc<CertifiedKey>,
    /// The leaf's not-after, Unix seconds: `koder_dns_tls_cert_not_after_seconds`.
    pub not_after: i64,
    /// The leaf's serial number, hex, for the log line that says which certificate is served.
    pub serial: String,
}

impl Credentials {
    /// Reads `--tls-cert` and `--tls-key`. Each error names the file at fault: an unreadable
    /// or empty file, a certificate that does not parse, a key that does not match it.
    pub fn load(cert: &Path, key: &Path) -> Result<Self, FileError> {
        Self::load_as(["--tls-cert", "--tls-key"], cert, key)
    }

    /// [`Self::load`] for the files that `flags` (the certificate's, the key's) name: a
    /// client certificate (`--etcd-cert`, `--etcd-key`) too.
    pub fn load_as(flags: [&'static str; 2], cert: &Path, key: &Path) -> Result<Self, FileError> {
        let [cert_flag, key_flag] = flags;
        let chain = read_certs(cert_flag, cert)?;
        let private = read_key(key_flag, key)?;
        let (not_after, serial) = {
            let (_, leaf) = x509_parser::parse_x509_certificate(&chain[0])
                .map_err(|e| file_error(cert_flag, cert, format!("the first certificate does not parse: {e}")))?;
            (leaf.validity().not_after.timestamp(), leaf.raw_serial_as_string())
        };
        let signing = provider()
            .key_provider
            .load_private_key(private)
            .map_err(|e| file_error(key_flag, key, format!("unusable private key: {e}")))?;
        let certified = CertifiedKey::new(chain, signing);
        // ring's keys all tell their public key, so "unknown" never passes for a match.
        certified.keys_match().map_err(|e| {
            file_error(
                key_flag,
                key,
                format!("does not belong to the certificate in {} ({e})", cert.display()),
            )
        })?;
        Ok(Self {
            certified: Arc::new(certified),
            not_after,
            serial,
        })
    }
}

/// The certificate every handshake is answered with; [`Self::replace`] swaps it for the
/// handshakes after, without a lock on the way.
#[derive(Debug)]
pub struct ServerCert(ArcSwap<Credentials>);

impl ServerCert {
    pub fn new(credentials: Credentials) -> Arc<Self> {
        Arc::new(Self(ArcSwap::from_pointee(credentials)))
    }

    pub fn replace(&self, credentials: Credentials) {
        self.0.store(Arc::new(credentials));
    }

    pub fn current(&self) -> Arc<Credentials> {
        self.0.load_full()
    }

    /// A server config for one listener: TLS 1.3 and 1.2 only, resumption on (stateless
    /// tickets for both versions, and a session cache for TLS 1.2 session ids), offering the
    /// given ALPN protocols.
    pub fn server_config(self: &Arc<Self>, alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .expect("ring supports TLS 1.2 and 1.3")
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        config.session_storage = ServerSessionMemoryCache::new(SESSION_CACHE);
        config.ticketer = rustls::crypto::ring::Ticketer::new().expect("ring makes ticket keys");
        Arc::new(config)
    }
}

impl ResolvesServerCert for ServerCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.load().certified.clone())
    }
}

/// A reqwest client builder trusting the system's roots. Every `reqwest::Client` of this
/// process is made from one (reqwest needs the provider [`install_provider`] sets).
pub fn client_builder() -> reqwest::ClientBuilder {
    install_provider();
    reqwest::Client::builder()
}

/// `builder`, trusting the CA certificates in the PEM file `ca` too (`--ca`,
/// `KODER_DNS_CA`): for `https://` URLs of a registry whose certificate a private CA signed.
pub fn trusting(builder: reqwest::ClientBuilder, ca: Option<&Path>) -> Result<reqwest::ClientBuilder, FileError> {
    let Some(path) = ca else {
        return Ok(builder);
    };
    let certs = read_certs("--ca", path)?
        .iter()
        .map(|der| reqwest::Certificate::from_der(der))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error("--ca", path, e))?;
    Ok(builder.tls_certs_merge(certs))
}

/// A client certificate, always the same one, for every server that asks.
#[derive(Debug)]
struct ClientCert(Arc<CertifiedKey>);

impl rustls::client::ResolvesClientCert for ClientCert {
    fn resolve(&self, _: &[&[u8]], _: &[rustls::SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// A TLS client config (TLS 1.2 and 1.3) trusting only the CA certificates in the PEM file
/// `ca` (with the flag that named it), or the system's roots without one, and presenting
/// `identity` (checked to match its key, see [`Credentials::load_as`]) to a server that asks
/// for a client certificate. The trust the etcd client (tonic) builds from the same files.
pub fn client_config(
    ca: Option<(&'static str, &Path)>,
    identity: Option<&Credentials>,
) -> Result<rustls::ClientConfig, FileError> {
    let mut roots = rustls::RootCertStore::empty();
    match ca {
        Some((flag, path)) => {
            for cert in read_certs(flag, path)? {
                roots
                    .add(cert)
                    .map_err(|e| file_error(flag, path, format!("not a usable CA certificate: {e}")))?;
            }
        }
        None => {
            roots.add_parsable_certificates(rustls_native_certs::load_native_certs().certs);
        }
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .expect("ring supports TLS 1.2 and 1.3")
        .with_root_certificates(roots);
    Ok(match identity {
        Some(credentials) => builder.with_client_cert_resolver(Arc::new(ClientCert(credentials.certified.clone()))),
        None => builder.with_no_client_auth(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(dir: &Path, name: &str) -> (PathBuf, PathBuf, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let (cert_path, key_path) = (dir.join(format!("{name}.crt")), dir.join(format!("{name}.key")));
        std::fs::write(&cert_path, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        (cert_path, key_path, key)
    }

    #[test]
    fn a_matching_chain_and_key_load_with_the_leafs_expiry() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key, _) = pair(dir.path(), "a");
        let loaded = Credentials::load(&cert, &key).unwrap();
        // rcgen's default validity ends in 4096.
        assert!(loaded.not_after > 4_000_000_000, "{}", loaded.not_after);
        assert!(!loaded.serial.is_empty());
    }

    #[test]
    fn a_key_of_another_certificate_is_refused_naming_the_key_file() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, _, _) = pair(dir.path(), "a");
        let (_, other_key, _) = pair(dir.path(), "b");
        let error = Credentials::load(&cert, &other_key).unwrap_err().to_string();
        assert!(error.starts_with("--tls-key "), "{error}");
        assert!(error.contains("b.key") && error.contains("does not belong"), "{error}");
    }

    /// SEC1 (`EC PRIVATE KEY`, what `openssl ecparam -genkey` writes) loads as PKCS#8 does;
    /// PKCS#1 RSA keys have an integration test (`tls::`), since ring cannot make RSA keys.
    #[test]
    fn a_sec1_key_loads_as_its_pkcs8_form_does() {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let cert_path = dir.path().join("c.crt");
        std::fs::write(&cert_path, cert.pem()).unwrap();
        // The PKCS#8 wrapper's inner OCTET STRING is the SEC1 ECPrivateKey.
        let pkcs8 = key.serialize_der();
        let (_, info) = x509_parser::der_parser::der::parse_der_sequence(&pkcs8).unwrap();
        let sec1 = info.as_sequence().unwrap()[2].as_slice().unwrap().to_vec();
        let key_path = dir.path().join("c.key");
        std::fs::write(&key_path, pem_block("EC PRIVATE KEY", &sec1)).unwrap();
        let loaded = Credentials::load(&cert_path, &key_path).unwrap();
        let pkcs8_path = dir.path().join("p8.key");
        std::fs::write(&pkcs8_path, key.serialize_pem()).unwrap();
        assert_eq!(
            loaded.serial,
            Credentials::load(&cert_path, &pkcs8_path).unwrap().serial
        );
    }

    fn pem_block(label: &str, der: &[u8]) -> String {
        use data_encoding::BASE64;
        let body = BASE64.encode(der);
        let lines: Vec<&str> = body
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect();
        format!("-----BEGIN {label}-----\n{}\n-----END {label}-----\n", lines.join("\n"))
    }

    #[test]
    fn missing_and_empty_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, _, _) = pair(dir.path(), "a");
        let missing = dir.path().join("missing.key");
        let error = Credentials::load(&cert, &missing).unwrap_err().to_string();
        assert!(
            error.contains("missing.key") && error.contains("cannot read"),
            "{error}"
        );
        let empty = dir.path().join("empty.crt");
        std::fs::write(&empty, "").unwrap();
        let error = Credentials::load(&empty, &missing).unwrap_err().to_string();
        assert!(
            error.starts_with("--tls-cert ") && error.contains("empty.crt"),
            "{error}"
        );
    }

    #[test]
    fn a_replaced_certificate_is_what_the_next_resolution_hands_out() {
        let dir = tempfile::tempdir().unwrap();
        let (a, a_key, _) = pair(dir.path(), "a");
        let (b, b_key, _) = pair(dir.path(), "b");
        let first = Credentials::load(&a, &a_key).unwrap();
        let second = Credentials::load(&b, &b_key).unwrap();
        let store = ServerCert::new(first.clone());
        assert_eq!(store.current().serial, first.serial);
        store.replace(second.clone());
        assert_eq!(store.current().serial, second.serial);
        assert!(Arc::ptr_eq(&store.0.load().certified, &second.certified));
    }
}
