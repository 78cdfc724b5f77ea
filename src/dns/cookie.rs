//! DNS cookies (RFC 7873), server cookies built as RFC 9018 builds them, so that several
//! nodes given one secret accept each other's cookies.
//!
//! A client sends an 8-byte client cookie, and from its second query on the server cookie
//! we gave it. We answer every query that carries a client cookie with it and a 16-byte
//! server cookie: version 1, three reserved bytes, the time it was made (seconds, serial
//! arithmetic) and SipHash-2-4, keyed with the secret, of the client cookie, those eight
//! bytes and the client's address. A server cookie proves that the client received our
//! earlier reply at its address, so a query carrying a valid one cannot have a forged
//! source: response rate limiting lets it through (see [`super::rrl`]).
//!
//! A server cookie is valid for an hour, up to five minutes in the future (nodes' clocks
//! may differ), with the secret that makes cookies or the one accepted beside it
//! (`--dns-cookie-secret-file`, see [`Secrets::load`]); a valid one younger than half an
//! hour is echoed as it is, an older or invalid one replaced. An invalid server cookie is
//! answered as if only the client cookie had come (RFC 7873 §5.2.3), never with BADCOOKIE.
//! A COOKIE option of a length RFC 7873 does not allow (not 8, nor 16 to 40), or two of
//! them, get FORMERR.

use std::net::IpAddr;
use std::path::Path;

use siphasher::sip::SipHasher24;

/// The EDNS option code of COOKIE.
pub const CODE: u16 = 10;
/// A client cookie's length.
pub const CLIENT_LEN: usize = 8;
/// Our server cookie's length (RFC 9018).
pub const SERVER_LEN: usize = 16;
/// The COOKIE option's data in our replies: the client cookie, then our server cookie.
pub type ReplyCookie = [u8; CLIENT_LEN + SERVER_LEN];

/// How long a server cookie is accepted after it was made (RFC 9018 §4.3).
const LIFETIME: i64 = 3600;
/// How far ahead of our clock a cookie's time may be: another node's clock (RFC 9018 §4.3).
const SKEW: i64 = 300;
/// A valid cookie younger than this is echoed; an older one is replaced (RFC 9018 §4.3).
const RENEW: i64 = 1800;
/// RFC 9018's version.
const VERSION: u8 = 1;

/// The data of a query's COOKIE option, checked for its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sent<'a> {
    pub client: &'a [u8; CLIENT_LEN],
    /// Empty on a first query.
    pub server: &'a [u8],
}

impl<'a> Sent<'a> {
    /// The option's data, or `None` for a length RFC 7873 §5.2.2 answers with FORMERR.
    pub fn parse(data: &'a [u8]) -> Option<Self> {
        if !(data.len() == CLIENT_LEN || (CLIENT_LEN + 8..=CLIENT_LEN + 32).contains(&data.len())) {
            return None;
        }
        let (client, server) = data.split_at(CLIENT_LEN);
        Some(Self {
            client: client.try_into().ok()?,
            server,
        })
    }
}

/// The secret that makes server cookies, and one more accepted beside it while a new
/// secret is rolled out over several nodes. Never printed.
#[derive(Clone)]
pub struct Secrets {
    current: [u8; 16],
    accepted: Option<[u8; 16]>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secrets({} accepted)", 1 + self.accepted.is_some() as usize)
    }
}

impl Default for Secrets {
    /// A random secret: this node's cookies are valid here only, until it restarts.
    fn default() -> Self {
        let mut current = [0u8; 16];
        getrandom::fill(&mut current).expect("the operating system's random numbers");
        Self {
            current,
            accepted: None,
        }
    }
}

impl Secrets {
    pub fn new(current: [u8; 16], accepted: Option<[u8; 16]>) -> Self {
        Self { current, accepted }
    }

    /// Reads `--dns-cookie-secret-file`: one secret of 16 bytes in hex (32 digits) per line,
    /// blank lines and `#` comments aside. The first makes cookies; a second, if any, is
    /// accepted too, so that a secret can be changed on several nodes without refusing
    /// cookies made by the others (see the README, "Facing the internet").
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let mut secrets = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .enumerate()
            .map(|(i, line)| {
                let mut secret = [0u8; 16];
                let decoded = (line.len() == 32)
                    .then(|| data_encoding::HEXLOWER_PERMISSIVE.decode_mut(line.as_bytes(), &mut secret));
                match decoded {
                    Some(Ok(16)) => Ok(secret),
                    _ => Err(format!(
                        "{}: secret {} is not 16 bytes in hex (32 digits, e.g. from `openssl rand -hex 16`)",
                        path.display(),
                        i + 1
                    )),
                }
            });
        let current = secrets
            .next()
            .ok_or_else(|| format!("{}: no secret (one line of 32 hex digits)", path.display()))??;
        let accepted = secrets.next().transpose()?;
        if secrets.next().is_some() {
            return Err(format!(
                "{}: at most two secrets: the one that makes cookies, then one accepted beside it",
                path.display()
            ));
        }
        Ok(Self { current, accepted })
    }

    /// The server cookie for `client` at `ip`, made at `now` (seconds since the epoch).
    pub fn make(&self, client: &[u8; CLIENT_LEN], ip: IpAddr, now: u32) -> [u8; SERVER_LEN] {
        let mut cookie = [0u8; SERVER_LEN];
        cookie[0] = VERSION;
        cookie[4..8].copy_from_slice(&now.to_be_bytes());
        let hash = hash(&self.current, client, &cookie[..8], ip);
        cookie[8..].copy_from_slice(&hash);
        cookie
    }

    /// The age in seconds of `server`, a server cookie for `client` at `ip`, when one of our
    /// secrets made it and it is still valid at `now`.
    fn valid_age(&self, client: &[u8; CLIENT_LEN], server: &[u8], ip: IpAddr, now: u32) -> Option<i64> {
        if server.len() != SERVER_LEN || server[..4] != [VERSION, 0, 0, 0] {
            return None;
        }
        let made = u32::from_be_bytes(server[4..8].try_into().ok()?);
        // Serial number arithmetic (RFC 1982), as RFC 9018 says for the timestamp.
        let age = i64::from(now.wrapping_sub(made) as i32);
        if !(-SKEW..=LIFETIME).contains(&age) {
            return None;
        }
        let ours = |secret: &[u8; 16]| {
            let expected = hash(secret, client, &server[..8], ip);
            subtle::ConstantTimeEq::ct_eq(&expected[..], &server[8..]).into()
        };
        (ours(&self.current) || self.accepted.as_ref().is_some_and(ours)).then_some(age)
    }

    /// Whether `sent` carries a server cookie of ours, valid for `ip` at `now`.
    pub fn is_valid(&self, sent: &Sent<'_>, ip: IpAddr, now: u32) -> bool {
        self.valid_age(sent.client, sent.server, ip, now).is_some()
    }

    /// The COOKIE option of the reply to `sent` from `ip` at `now`: the client cookie, and
    /// the server cookie sent when it is valid and younger than half an hour, else a new
    /// one. Also whether the server cookie sent was valid.
    pub fn reply(&self, sent: &Sent<'_>, ip: IpAddr, now: u32) -> (ReplyCookie, bool) {
        let mut reply = [0u8; CLIENT_LEN + SERVER_LEN];
        reply[..CLIENT_LEN].copy_from_slice(sent.client);
        let age = self.valid_age(sent.client, sent.server, ip, now);
        match age {
            Some(age) if (0..RENEW).contains(&age) => reply[CLIENT_LEN..].copy_from_slice(sent.server),
            _ => reply[CLIENT_LEN..].copy_from_slice(&self.make(sent.client, ip, now)),
        }
        (reply, age.is_some())
    }
}

/// SipHash-2-4 keyed with `secret` of the client cookie, the server cookie's first eight
/// bytes and the client's address (RFC 9018 §4.4), as 8 bytes.
fn hash(secret: &[u8; 16], client: &[u8; CLIENT_LEN], head: &[u8], ip: IpAddr) -> [u8; 8] {
    use std::hash::Hasher;
    let mut hasher = SipHasher24::new_with_key(secret);
    hasher.write(client);
    hasher.write(head);
    match ip {
        IpAddr::V4(v4) => hasher.write(&v4.octets()),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => hasher.write(&v4.octets()),
            None => hasher.write(&v6.octets()),
        },
    }
    hasher.finish().to_le_bytes()
}

/// Seconds since the epoch, the clock cookies are stamped with.
pub fn now() -> u32 {
    super::tsig::now() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex<const N: usize>(text: &str) -> [u8; N] {
        data_encoding::HEXLOWER_PERMISSIVE
            .decode(text.as_bytes())
            .unwrap()
            .try_into()
            .unwrap()
    }

    /// RFC 9018 Appendix A.1: the server cookie a server with this secret gives this client.
    #[test]
    fn server_cookie_matches_rfc_9018_test_vector() {
        let secrets = Secrets::new(hex("e5e973e5a6b2a43f48e7dc849e37bfcf"), None);
        let client = hex::<8>("2464c4abcf10c957");
        let ip: IpAddr = "198.51.100.100".parse().unwrap();
        let cookie = secrets.make(&client, ip, 1559731985);
        assert_eq!(cookie, hex::<16>("010000005cf79f111f8130c3eee29480"));
    }

    /// Two nodes with one secret: a cookie one made (here for an IPv6 client) is valid on
    /// the other for an hour, echoed within half an hour, renewed after.
    #[test]
    fn a_cookie_made_by_another_node_with_the_secret_is_valid() {
        let secret = hex("dd3bdf9344b678b185a6f5cb60fca715");
        let (a, b) = (Secrets::new(secret, None), Secrets::new(secret, None));
        let client = hex::<8>("22681ab97d52c298");
        let ip: IpAddr = "2001:db8:220:1:59de:d0f4:8769:82b8".parse().unwrap();
        let made = 1559731985;
        let server = a.make(&client, ip, made);
        let sent = Sent {
            client: &client,
            server: &server,
        };
        assert!(b.is_valid(&sent, ip, made + 60));
        assert!(
            b.is_valid(&sent, ip, made - 60),
            "a node whose clock is a minute behind"
        );
        let (reply, valid) = b.reply(&sent, ip, made + 60);
        assert!(valid);
        assert_eq!(reply[8..], server);
        let (renewed, valid) = b.reply(&sent, ip, made + 1900);
        assert!(valid);
        assert_ne!(renewed[8..], server);
        assert!(!b.is_valid(&sent, ip, made + 3700), "an hour old");
        assert!(
            !b.is_valid(&sent, "2001:db8::1".parse().unwrap(), made),
            "another client address"
        );
        assert!(!Secrets::default().is_valid(&sent, ip, made), "another secret");
    }

    #[test]
    fn the_accepted_secret_validates_but_does_not_make_cookies() {
        let (old, new) = ([1u8; 16], [2u8; 16]);
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let client = [7u8; 8];
        let by_old = Secrets::new(old, None).make(&client, ip, 1000);
        let rolling = Secrets::new(new, Some(old));
        let sent = Sent {
            client: &client,
            server: &by_old,
        };
        assert!(rolling.is_valid(&sent, ip, 1000));
        assert_ne!(rolling.make(&client, ip, 1000), by_old);
        assert!(!Secrets::new(new, None).is_valid(&sent, ip, 1000));
    }

    #[test]
    fn option_lengths_are_those_rfc_7873_allows() {
        for len in 0..50 {
            let data = vec![0u8; len];
            assert_eq!(
                Sent::parse(&data).is_some(),
                len == 8 || (16..=40).contains(&len),
                "{len} bytes"
            );
        }
    }

    #[test]
    fn the_secret_file_holds_one_or_two_hex_secrets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        let write = |text: &str| std::fs::write(&path, text).unwrap();
        write("# made with openssl rand -hex 16\n000102030405060708090a0b0c0d0e0f\n");
        let one = Secrets::load(&path).unwrap();
        assert_eq!(one.current, hex::<16>("000102030405060708090a0b0c0d0e0f"));
        assert!(one.accepted.is_none());
        write("000102030405060708090A0B0C0D0E0F\n\nffeeddccbbaa99887766554433221100\n");
        assert!(Secrets::load(&path).unwrap().accepted.is_some());
        for bad in ["", "0011", "zz0102030405060708090a0b0c0d0e0f"] {
            write(bad);
            assert!(Secrets::load(&path).is_err(), "{bad:?}");
        }
        write(&"000102030405060708090a0b0c0d0e0f\n".repeat(3));
        assert!(Secrets::load(&path).unwrap_err().contains("at most two"));
        assert!(format!("{one:?}").contains("1 accepted"), "no secret in Debug");
    }
}
