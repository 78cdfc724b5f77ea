//! TSIG (RFC 8945): which keys we know, whether a request is signed by one of them, and the
//! signatures on our replies. hickory-proto computes the MACs; this module decides what a
//! request's signature means for its answer, the way NSD and Knot do:
//!
//! - no TSIG record: answered as usual (a transfer then needs `--allow-transfer`);
//! - a key we do not know: NOTAUTH with TSIG error BADKEY, unsigned;
//! - a known key with a wrong MAC: NOTAUTH with BADSIG, unsigned;
//! - a known key outside its time window (fudge): NOTAUTH with BADTIME, signed;
//! - otherwise answered, and every reply message signed (each message of a transfer too,
//!   chained to the one before, RFC 8945 §5.3.1).

use std::collections::HashMap;
use std::sync::Arc;

use data_encoding::BASE64;
use hickory_proto::op::{Edns, Header, Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::tsig::{TSIG, TsigAlgorithm, TsigError, make_tsig_record, signed_bitmessage_to_buf};
use hickory_proto::rr::{LowerName, Name, Record, RecordType};
use hickory_proto::rr::{TSigResponseContext, TSigner};
use hickory_proto::serialize::binary::{BinDecodable, BinDecoder, BinEncodable, BinEncoder};

/// Seconds a signature's time may differ from ours, as BIND, NSD and Knot default to.
const FUDGE: u16 = 300;

/// The keys we know, by name; cheap to clone.
#[derive(Clone, Default)]
pub struct Keys(Arc<HashMap<LowerName, TSigner>>);

/// Names and algorithms only: a secret never reaches a log.
impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(
                self.0
                    .values()
                    .map(|k| format!("{}:{}", k.signer_name(), k.algorithm())),
            )
            .finish()
    }
}

/// Parses `tsig_key` (`KODER_DNS_TSIG_KEYS`): comma-separated `NAME:ALGORITHM:BASE64` keys, or `none`.
pub fn parse_keys(text: &str) -> Result<Keys, String> {
    let keys = text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty() && *s != "none")
        .map(parse_key)
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Keys::new(&keys))
}

/// Parses `NAME:ALGORITHM:BASE64` (the form of a `tsig_key`; the algorithm as in BIND's
/// `key` statements: `hmac-sha256`, `hmac-sha384` or `hmac-sha512`).
pub fn parse_key(text: &str) -> Result<TSigner, String> {
    let mut parts = text.trim().splitn(3, ':');
    let (Some(name), Some(algorithm), Some(secret)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(format!(
            "{text:?} is not NAME:ALGORITHM:BASE64 (e.g. transfer.:hmac-sha256:{})",
            BASE64.encode(&[0u8; 32])
        ));
    };
    let name = Name::from_ascii(name).map_err(|e| format!("TSIG key name {name:?}: {e}"))?;
    let algorithm = match algorithm.to_ascii_lowercase().as_str() {
        "hmac-sha256" => TsigAlgorithm::HmacSha256,
        "hmac-sha384" => TsigAlgorithm::HmacSha384,
        "hmac-sha512" => TsigAlgorithm::HmacSha512,
        other => {
            return Err(format!(
                "TSIG algorithm {other:?}: use hmac-sha256, hmac-sha384 or hmac-sha512"
            ));
        }
    };
    let secret = BASE64
        .decode(secret.trim().as_bytes())
        .map_err(|e| format!("TSIG key {name}: the secret is not base64 ({e})"))?;
    if secret.is_empty() {
        return Err(format!("TSIG key {name}: the secret is empty"));
    }
    TSigner::new(secret, algorithm, name, FUDGE).map_err(|e| e.to_string())
}

/// A request's signature, checked.
pub enum Verdict {
    /// No TSIG record.
    Unsigned,
    /// Signed with a key we know, the MAC and the time right: answer, and sign the answer.
    Signed(Signing),
    /// Refused with NOTAUTH: the whole reply, ready to send.
    Rejected(Vec<u8>),
}

/// What signing the replies to one verified request needs: the key, the request's MAC
/// (the first reply's MAC covers it), then each reply's MAC (the next one's covers it).
pub struct Signing {
    signer: TSigner,
    id: u16,
    previous_mac: Vec<u8>,
    first: bool,
}

impl Keys {
    pub fn new(keys: &[TSigner]) -> Self {
        Self(Arc::new(
            keys.iter()
                .map(|k| (LowerName::new(k.signer_name()), k.clone()))
                .collect(),
        ))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Checks the TSIG record of `message`, if it has one, at `now` (seconds since the epoch).
    /// A refusal carries `edns`, the OPT record of a reply to this request, if any.
    pub fn verify(&self, message: &[u8], now: u64, edns: Option<&Edns>) -> Verdict {
        let Some(record) = tsig_record(message) else {
            return Verdict::Unsigned;
        };
        let id = u16::from_be_bytes([message[0], message[1]]);
        let Some(signer) = self.0.get(&LowerName::new(&record.name)) else {
            let context = TSigResponseContext::unknown_key(id, now, record.name.clone());
            return Verdict::Rejected(rejection(message, context, edns));
        };
        match signer.verify_message_byte(message, None, true) {
            Ok((mac, _, window)) if window.contains(&now) || window.end == now => Verdict::Signed(Signing {
                signer: signer.clone(),
                id,
                previous_mac: mac,
                first: true,
            }),
            Ok((mac, _, _)) => {
                let context = TSigResponseContext::new(id, now, signer.clone(), mac, Some(TsigError::BadTime));
                Verdict::Rejected(rejection(message, context, edns))
            }
            Err(_) => {
                let context = TSigResponseContext::bad_signature(id, now, signer.clone());
                Verdict::Rejected(rejection(message, context, edns))
            }
        }
    }
}

impl Signing {
    /// Appends a TSIG record to the encoded reply in `out`. The first reply's MAC covers the
    /// request's MAC, the reply and all TSIG variables; each later one (a transfer's messages)
    /// the previous MAC, the message and the timers only.
    pub fn sign(&mut self, out: &mut Vec<u8>, now: u64) {
        let stub = TSIG::new(
            self.signer.algorithm().clone(),
            now,
            self.signer.fudge(),
            Vec::new(),
            self.id,
            None,
            Vec::new(),
        );
        let tbs = if self.first {
            self.signer.encode_response_tbs(&self.previous_mac, out, &stub).ok()
        } else {
            let mut tbs = Vec::with_capacity(out.len() + self.previous_mac.len() + 10);
            tbs.extend_from_slice(&(self.previous_mac.len() as u16).to_be_bytes());
            tbs.extend_from_slice(&self.previous_mac);
            tbs.extend_from_slice(out);
            tbs.extend_from_slice(&((now >> 32) as u16).to_be_bytes());
            tbs.extend_from_slice(&(now as u32).to_be_bytes());
            tbs.extend_from_slice(&self.signer.fudge().to_be_bytes());
            Some(tbs)
        };
        let Some(mac) = tbs.and_then(|tbs| self.signer.sign(&tbs).ok()) else {
            return;
        };
        self.first = false;
        self.previous_mac = mac.clone();
        append(
            out,
            &make_tsig_record(self.signer.signer_name().clone(), stub.set_mac(mac)),
        );
    }
}

/// The TSIG record ending `message`'s additional section, if any. Cheap for the common
/// message without additional records beyond OPT: the header says so.
fn tsig_record(message: &[u8]) -> Option<Record<TSIG>> {
    if message.len() < 12 || u16::from_be_bytes([message[10], message[11]]) == 0 {
        return None;
    }
    signed_bitmessage_to_buf(message, None, true)
        .ok()
        .map(|(_, record)| *record)
        .filter(|r| r.record_type() == RecordType::TSIG)
}

/// NOTAUTH for `request`, its question echoed, with `edns` (every reply to a query with an
/// OPT record has one, as Knot's do), ending with the TSIG record `context` gives.
fn rejection(request: &[u8], context: TSigResponseContext, edns: Option<&Edns>) -> Vec<u8> {
    let mut decoder = BinDecoder::new(request);
    let header = Header::read(&mut decoder).ok();
    let (id, op_code) = header.map_or((0, OpCode::Query), |h| (h.metadata.id, h.metadata.op_code));
    let mut reply = Message::error_msg(id, op_code, ResponseCode::NotAuth);
    reply.metadata.message_type = MessageType::Response;
    if let Ok(request) = Message::from_vec(request) {
        reply.queries = request.queries;
    }
    if let Some(edns) = edns {
        reply.set_edns(edns.clone());
    }
    let mut out = reply.to_vec().unwrap_or_default();
    if let Ok(record) = context.sign(&out) {
        append(&mut out, &record);
    }
    out
}

/// Appends `record` to an encoded message and counts it in ARCOUNT.
fn append(out: &mut Vec<u8>, record: &Record<TSIG>) {
    let mut bytes = Vec::with_capacity(128);
    if record.emit(&mut BinEncoder::new(&mut bytes)).is_err() || out.len() < 12 {
        return;
    }
    out.extend_from_slice(&bytes);
    let count = u16::from_be_bytes([out[10], out[11]]).saturating_add(1);
    out[10..12].copy_from_slice(&count.to_be_bytes());
}

/// Seconds since the epoch, the clock TSIG times are on.
pub fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
