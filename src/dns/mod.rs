//! The authoritative DNS server: the service zone answered from the registry (from answers
//! prepared per view where it can, see [`prepared`], else through hickory's request and
//! response types), and static zone files answered by hickory's Catalog.

pub mod answer;
pub mod cookie;
pub mod journal;
mod message;
pub mod notify;
pub mod rrl;
pub mod tcp;
pub mod transfer;
pub mod tsig;
// recvmmsg/sendmmsg through libc: measured at 17.3 -> 6.5 us CPU per query (README, Performance).
#[allow(unsafe_code)]
pub mod udp;
pub mod zones;

use message::Question;
pub use message::{handle_bytes, handle_full, handle_prepared, slip};

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use arc_swap::ArcSwap;

use hickory_proto::op::{Edns, Header, HeaderCounts, Metadata, OpCode, ResponseCode};
use hickory_proto::rr::rdata::TXT;
use hickory_proto::rr::rdata::opt::{EdnsCode, EdnsOption, NSIDPayload};
use hickory_proto::rr::{DNSClass, LowerName, RData, Record, RecordType};
use hickory_proto::serialize::binary::{BinEncodable, BinEncoder};
use hickory_server::net::runtime::Time;
use hickory_server::net::xfer::Protocol;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::zone_handler::MessageResponseBuilder;
use tokio::net::TcpListener;

use crate::model::clock::Nanos;
use crate::sign::{NXNAME, Signer};
use crate::zone::prepared::{Negative, Opt, SoaTail};
use answer::{Answer, ZoneAnswerer};
use zones::StaticZones;

/// Largest UDP message we read, and the highest `--dns-udp-max-payload`.
pub const MAX_UDP_PAYLOAD: u16 = 4096;

/// The default `--dns-udp-max-payload`: what DNS Flag Day 2020 set, as NSD, Knot and BIND
/// cap it, so that a small query cannot be amplified into a large response.
pub const DEFAULT_UDP_MAX_PAYLOAD: u16 = 1232;

/// What the wire of every response depends on, beside the zones.
#[derive(Debug)]
pub struct WireSettings {
    /// The largest UDP response we send and advertise (`--dns-udp-max-payload`).
    pub udp_max_payload: u16,
    /// What `CH TXT id.server.`/`hostname.bind.` and NSID answer (`--dns-identity`), so
    /// that an operator of several nodes can tell which one answered.
    pub identity: String,
    pub transfer: transfer::TransferSettings,
    /// The secrets of server cookies (`--dns-cookie-secret-file`, else random). A reload
    /// swaps them ([`Authority::replace_cookie_secrets`]); a query that carries no cookie
    /// never reads them.
    pub cookies: ArcSwap<cookie::Secrets>,
    /// `--dns-hide-version`: `CH TXT version.bind.`/`version.server.` get REFUSED.
    pub hide_version: bool,
    /// Response rate limiting over UDP (`--dns-rrl-*`).
    pub rrl: rrl::Settings,
}

impl Default for WireSettings {
    fn default() -> Self {
        Self {
            udp_max_payload: DEFAULT_UDP_MAX_PAYLOAD,
            identity: host_name(),
            transfer: transfer::TransferSettings::default(),
            cookies: ArcSwap::from_pointee(cookie::Secrets::default()),
            hide_version: false,
            rrl: rrl::Settings::default(),
        }
    }
}

/// The machine's host name, the default `--dns-identity`.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_owned())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "koder-dns".into())
}

/// Whether an EDNS request asks for the server's identity (RFC 5001).
fn wants_nsid(edns: &Edns) -> bool {
    edns.option(EdnsCode::NSID).is_some()
}

/// The COOKIE option of an EDNS request; `Err` when it is malformed or repeated, which
/// FORMERR answers (RFC 7873 §5.2.2).
fn request_cookie(edns: &Edns) -> Result<Option<cookie::Sent<'_>>, ()> {
    let mut cookies = edns.options().options.iter().filter_map(|(_, option)| match option {
        EdnsOption::Unknown(cookie::CODE, data) => Some(data),
        _ => None,
    });
    match (cookies.next(), cookies.next()) {
        (None, _) => Ok(None),
        (Some(data), None) => cookie::Sent::parse(data).map(Some).ok_or(()),
        _ => Err(()),
    }
}

/// The OPT record of a response to an EDNS request: version 0, advertising what we send at
/// most, the request's DO bit copied (RFC 3225 §3), NSID when asked for, and the COOKIE
/// option for a request that carried a client cookie (`cookie`, from
/// [`cookie::Secrets::reply`]).
fn response_edns(request: &Edns, wire: &WireSettings, cookie: Option<cookie::ReplyCookie>) -> Edns {
    let mut edns = Edns::new();
    edns.set_max_payload(wire.udp_max_payload)
        .set_version(0)
        .set_dnssec_ok(request.flags().dnssec_ok);
    if compact_ok(request) {
        edns.flags_mut().z |= CO_FLAG;
    }
    if wants_nsid(request)
        && let Ok(nsid) = NSIDPayload::new(wire.identity.as_bytes())
    {
        edns.options_mut().insert(EdnsOption::NSID(nsid));
    }
    if let Some(cookie) = cookie {
        edns.options_mut()
            .insert(EdnsOption::Unknown(cookie::CODE, cookie.to_vec()));
    }
    edns
}

/// The Compact Answers OK flag in the EDNS flags (RFC 9824 §3), after DO.
const CO_FLAG: u16 = 0x4000;

/// Whether a request sets DO and CO: NXDOMAIN wanted with compact denial.
fn compact_ok(edns: &Edns) -> bool {
    edns.flags().dnssec_ok && edns.flags().z & CO_FLAG != 0
}

/// The request handler for every zone we serve; cheap to clone, so the UDP server and the
/// TCP listener share one.
#[derive(Clone)]
pub struct Authority(Arc<Zones>);

struct Zones {
    zone: ZoneAnswerer,
    /// The zone files; a reload swaps them ([`Authority::replace_static_zones`]). A query or a
    /// transfer holds the set it started with.
    static_zones: ArcSwap<StaticZones>,
    /// `tsig_key` (`KODER_DNS_TSIG_KEYS`): requests signed with one are verified and answered signed. A reload
    /// swaps them ([`Authority::replace_tsig_keys`]).
    tsig: ArcSwap<tsig::Keys>,
    soa_tail: SoaTail,
    wire: WireSettings,
    journal: journal::Journal,
    /// `None` with `--dns-rrl-rate 0`.
    rate_limiter: Option<rrl::RateLimiter>,
}

impl Authority {
    /// An authority that knows no TSIG key until [`Self::replace_tsig_keys`] gives it some.
    pub fn new(zone: ZoneAnswerer, static_zones: StaticZones, wire: WireSettings) -> Self {
        zone.host_addresses.store(Arc::new(static_zones.host_addresses()));
        Self(Arc::new(Zones {
            zone,
            static_zones: ArcSwap::from_pointee(static_zones),
            tsig: ArcSwap::default(),
            soa_tail: SoaTail::default(),
            journal: journal::Journal::new(wire.transfer.journal),
            rate_limiter: rrl::RateLimiter::new(&wire.rrl),
            wire,
        }))
    }

    /// Serves `zones` from the next query on, and the service zone's SRV targets inside them
    /// get their addresses from these. Answers prepared with the old addresses are dropped.
    pub async fn replace_static_zones(&self, zones: StaticZones) {
        let this = &self.0;
        this.zone.host_addresses.store(Arc::new(zones.host_addresses()));
        this.static_zones.store(Arc::new(zones));
        this.zone.forget_prepared();
        // A query that read the old addresses just before the swap may keep its answer just
        // after the first sweep; preparing one takes microseconds, so a second sweep a moment
        // later catches it.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        this.zone.forget_prepared();
    }

    /// Verifies and signs with `keys` from the next message on.
    pub fn replace_tsig_keys(&self, keys: tsig::Keys) {
        self.0.tsig.store(Arc::new(keys));
    }

    /// Makes server cookies with `secrets` from the next query on, and accepts only the
    /// cookies they validate (the file's second secret keeps the old ones valid meanwhile).
    pub fn replace_cookie_secrets(&self, secrets: cookie::Secrets) {
        self.0.wire.cookies.store(Arc::new(secrets));
    }

    /// The TSIG keys in force.
    fn tsig(&self) -> arc_swap::Guard<Arc<tsig::Keys>> {
        self.0.tsig.load()
    }

    /// Whether the signatures secondaries were sent are to be made again (see
    /// [`journal::Journal::signatures_due`]).
    pub fn signatures_due(&self) -> bool {
        self.0.journal.signatures_due(self.0.zone.registry.now())
    }

    /// The service zone's SOA as of now, for NOTIFY.
    pub fn soa(&self) -> Record {
        self.0.zone.soa()
    }

    /// The service zone's origin.
    pub fn origin(&self) -> hickory_proto::rr::Name {
        self.0.zone.registry.zone().origin.clone()
    }

    /// The response rate limiter, when `--dns-rrl-rate` is on.
    pub(crate) fn rate_limiter(&self) -> Option<&rrl::RateLimiter> {
        self.0.rate_limiter.as_ref()
    }

    /// Whether `message`, from `ip`, carries a server cookie of ours that is valid now:
    /// then its source is not forged, and rate limiting lets it through.
    pub(crate) fn has_valid_cookie(&self, message: &[u8], ip: IpAddr) -> bool {
        let sent = match message::Question::read(message) {
            Some(question) => question.edns.and_then(|e| e.cookie.flatten()),
            None => None,
        };
        sent.is_some_and(|sent| self.0.wire.cookies.load().is_valid(&sent, ip, cookie::now()))
    }
}

/// An upper bound on the encoded size of `rdata`; unknown types force an exact trial.
fn rdata_upper(rdata: &RData) -> usize {
    match rdata {
        RData::A(_) => 4,
        RData::AAAA(_) => 16,
        RData::SRV(srv) => 7 + srv.target.len(),
        RData::TXT(txt) => txt.txt_data.iter().map(|s| s.len() + 1).sum(),
        RData::NS(ns) => ns.0.len() + 1,
        RData::SOA(soa) => soa.mname.len() + soa.rname.len() + 22,
        _ => u16::MAX as usize,
    }
}

/// An upper bound on `record`'s encoded size (uncompressed): by hand for the types we
/// build, by a trial encoding for the rest (a static zone's MX, CNAME, ...).
pub(crate) fn record_upper(record: &Record) -> usize {
    let rdata = match rdata_upper(&record.data) {
        n if n < u16::MAX as usize => n,
        _ => {
            let mut bytes = Vec::new();
            let mut encoder = BinEncoder::new(&mut bytes);
            encoder.set_name_encoding(hickory_proto::serialize::binary::NameEncoding::Uncompressed);
            let _ = record.data.emit(&mut encoder);
            bytes.len()
        }
    };
    record.name.len() + 11 + rdata
}

/// How many of `answers` and `additionals` fit in `limit` bytes, by encoding them the way the
/// response will be encoded (same order, same name compression). Cheap upper bounds skip the
/// trial for the common small answer.
fn fit(
    request: &Request,
    answers: &[Record],
    authorities: &[Record],
    additionals: &[Record],
    limit: usize,
    opt: usize,
) -> (usize, usize) {
    let upper = |r: &Record| r.name.len() + 11 + rdata_upper(&r.data);
    let question = request.queries.as_bytes();
    let bound = 12
        + question.len()
        + opt
        + answers
            .iter()
            .chain(authorities)
            .chain(additionals)
            .map(upper)
            .sum::<usize>();
    if bound <= limit {
        return (answers.len(), additionals.len());
    }
    let mut buf = Vec::with_capacity(limit);
    let mut enc = BinEncoder::new(&mut buf);
    let budget = limit - opt;
    let fits = |enc: &mut BinEncoder<'_>, r: &Record| r.emit(enc).is_ok() && enc.len() <= budget;
    // hickory copies the question as the client sent it, so no later name can point into it.
    let _ = enc.emit_vec(&[0; 12]);
    let _ = enc.emit_vec(question);
    let n_answers = answers.iter().take_while(|r| fits(&mut enc, r)).count();
    if n_answers < answers.len() || !authorities.iter().all(|r| fits(&mut enc, r)) {
        return (n_answers, 0);
    }
    (n_answers, additionals.iter().take_while(|r| fits(&mut enc, r)).count())
}

/// The largest response a request may get: over UDP its EDNS buffer (`client_payload`;
/// 512 bytes without EDNS, at most `udp_max_payload`), over TCP what the length prefix allows.
fn response_limit(protocol: Protocol, client_payload: Option<u16>, udp_max_payload: u16) -> usize {
    match protocol {
        Protocol::Udp => client_payload.map_or(512, |p| p.clamp(512, udp_max_payload)) as usize,
        _ => u16::MAX as usize,
    }
}

/// The class a question is answered in: ANY as IN, as NSD and Knot do, and with AA as
/// Knot and BIND answer it.
fn answered_as_in(class: DNSClass) -> bool {
    matches!(class, DNSClass::IN | DNSClass::ANY)
}

/// What a question in class CH asks of the server itself, as NSD and Knot answer it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Chaos {
    /// `id.server.` or `hostname.bind.`: `--dns-identity`.
    Identity,
    /// `version.server.` or `version.bind.`: `koder-dns <version>`.
    Version,
}

/// Which of the server's own names `name` is, in class CH.
fn chaos_name(name: &LowerName) -> Option<Chaos> {
    let mut labels = name.iter();
    let (Some(a), Some(b), None) = (labels.next(), labels.next(), labels.next()) else {
        return None;
    };
    let is = |x: &[u8], y: &str| x.eq_ignore_ascii_case(y.as_bytes());
    match () {
        _ if (is(a, "id") && is(b, "server")) || (is(a, "hostname") && is(b, "bind")) => Some(Chaos::Identity),
        _ if is(a, "version") && (is(b, "server") || is(b, "bind")) => Some(Chaos::Version),
        _ => None,
    }
}

/// What `CH TXT version.bind.` answers.
fn version_text() -> String {
    format!("koder-dns {}", env!("CARGO_PKG_VERSION"))
}

impl Authority {
    /// The OPT record of the reply to a query with `edns` from `src`, for the fast path.
    fn reply_opt(&self, edns: Option<message::QueryOpt<'_>>, src: SocketAddr) -> Option<Opt> {
        let wire = &self.0.wire;
        edns.map(|e| Opt {
            max_payload: wire.udp_max_payload,
            dnssec_ok: e.dnssec_ok,
            compact_ok: e.dnssec_ok && e.compact_ok,
            cookie: e
                .cookie
                .flatten()
                .map(|sent| wire.cookies.load().reply(&sent, src.ip(), cookie::now()).0),
        })
    }

    /// The OPT record of the reply to a request with `edns` from `ip`, for the full path;
    /// and whether its COOKIE option is malformed (FORMERR).
    pub(crate) fn full_reply_edns(&self, edns: Option<&Edns>, ip: IpAddr) -> (Option<Edns>, bool) {
        let wire = &self.0.wire;
        let Some(edns) = edns else {
            return (None, false);
        };
        let cookie = request_cookie(edns);
        let reply = match &cookie {
            Ok(Some(sent)) => Some(wire.cookies.load().reply(sent, ip, cookie::now()).0),
            _ => None,
        };
        (Some(response_edns(edns, wire, reply)), cookie.is_err())
    }

    /// The fast path: a service-zone answer from prepared bytes, written into `out`. Covers
    /// service names with records of the asked type and every negative answer; false for
    /// everything else, which the full handler answers.
    fn write_prepared(&self, question: &Question<'_>, src: SocketAddr, protocol: Protocol, out: &mut Vec<u8>) -> bool {
        let Question {
            metadata,
            name,
            qtype,
            qclass,
            raw,
            edns,
        } = question;
        let qtype = *qtype;
        if metadata.op_code != OpCode::Query
            || !answered_as_in(*qclass)
            || matches!(qtype, RecordType::AXFR | RecordType::IXFR | NXNAME)
            || edns.is_some_and(|e| e.version > 0 || e.nsid || e.cookie == Some(None))
        {
            return false;
        }
        let Zones {
            zone, soa_tail, wire, ..
        } = &*self.0;
        let Some(below) = name.below(&zone.registry.zone().origin_wire) else {
            return false;
        };
        let limit = response_limit(protocol, edns.map(|e| e.max_payload), wire.udp_max_payload);
        let opt = self.reply_opt(*edns, src);
        let signer = zone.signer.as_deref().filter(|_| opt.is_some_and(|o| o.dnssec_ok));
        // hickory's name, built once and only for what the prepared answers do not cover.
        let mut name = None;
        let code = match zone.prepared(&below, qtype, signer.is_some(), |p| {
            (!p.is_empty()).then(|| p.write(metadata, raw, opt, limit, out))
        }) {
            Some(Some(written)) => return written,
            Some(None) => ResponseCode::NoError,
            // Told without building the records: those that have some are built once, by
            // the full path.
            None => match zone.negative(name.insert(below.lower_name()), qtype) {
                Some(code) => code,
                None => return false,
            },
        };
        let serial = zone.registry.current_serial();
        let Some(signer) = signer else {
            let negative = Negative {
                code,
                denial: None,
                now: 0,
                signed_until: Nanos::MAX,
            };
            let soa = || vec![zone.soa_at(serial)];
            return soa_tail.write(serial, soa, metadata, negative, raw, opt, limit, out);
        };
        // Compact denial: the name's own NSEC, made once per name and kept.
        let now = zone.registry.now();
        let name = name.unwrap_or_else(|| below.lower_name());
        let Some(denial) = signer.denial_bytes(&name, zone.types_at(&name).as_deref(), zone.negative_ttl, now) else {
            return false;
        };
        let negative = Negative {
            code: denial_code(code, opt.is_some_and(|o| o.compact_ok)),
            denial: Some(&denial),
            now,
            signed_until: Signer::fresh_until(now),
        };
        let soa = || signer.with_rrsigs(vec![zone.soa_at(serial)], now);
        soa_tail.write(serial, soa, metadata, negative, raw, opt, limit, out)
    }
}

/// The rcode of a signed negative answer (RFC 9824 §3): a name that does not exist is
/// NOERROR with its NSEC showing NXNAME, unless the query set Compact Answers OK, which asks
/// for NXDOMAIN.
fn denial_code(code: ResponseCode, compact_ok: bool) -> ResponseCode {
    match code {
        ResponseCode::NXDomain if !compact_ok => ResponseCode::NoError,
        code => code,
    }
}

/// A response handler that puts our OPT record (payload size, NSID, server cookie) on a
/// response hickory's `Catalog` built for a static zone, in place of its own, so that every
/// reply to an EDNS request carries the same OPT whichever zone answered.
#[derive(Clone)]
struct WithOpt<R> {
    inner: R,
    edns: Option<Edns>,
}

#[async_trait::async_trait]
impl<R: ResponseHandler> ResponseHandler for WithOpt<R> {
    async fn send_response<'a>(
        &mut self,
        response: hickory_server::zone_handler::MessageResponse<
            '_,
            'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
        >,
    ) -> Result<ResponseInfo, hickory_server::net::NetError> {
        // Moved to a binding of its own so that its borrow of the request's OPT record may
        // shorten to this call's (the type is covariant in it) and take ours instead.
        let mut response = response;
        if let Some(edns) = &self.edns
            && response.edns().is_some()
        {
            response.set_edns(edns);
        }
        self.inner.send_response(response).await
    }
}

#[async_trait::async_trait]
impl RequestHandler for Authority {
    async fn handle_request<R: ResponseHandler, T: Time>(&self, request: &Request, response: R) -> ResponseInfo {
        let this = &self.0;
        let mut meta = Metadata::response_from_request(&request.metadata);
        let (resp_edns, bad_cookie) = self.full_reply_edns(request.edns.as_ref(), request.src().ip());
        let mut builder = MessageResponseBuilder::from_message_request(request);
        if let Some(edns) = &resp_edns {
            builder.edns(edns);
        }
        let queries = request.queries.queries();
        let code = if request.metadata.op_code != OpCode::Query {
            Some(ResponseCode::NotImp)
        } else if queries.len() != 1 || bad_cookie {
            Some(ResponseCode::FormErr)
        } else if request.edns.as_ref().is_some_and(|e| e.version() > 0) {
            Some(ResponseCode::BADVERS)
        } else if queries[0].query_type() == NXNAME {
            // A meta-type: asking for it is an error (RFC 9824 §3.5).
            Some(ResponseCode::FormErr)
        } else {
            None
        };
        if let Some(code) = code {
            return send(response, builder.error_msg(&request.metadata, code)).await;
        }
        let query = &queries[0];
        let qtype = query.query_type();
        // Not zone data: AA clear, as NSD and Knot answer them.
        if query.query_class() == DNSClass::CH
            && let Some(chaos) = chaos_name(query.name())
        {
            let text = match chaos {
                Chaos::Identity => this.wire.identity.clone(),
                Chaos::Version if this.wire.hide_version => {
                    meta.response_code = ResponseCode::Refused;
                    return send(response, builder.build_no_records(meta)).await;
                }
                Chaos::Version => version_text(),
            };
            let answers = match qtype {
                RecordType::TXT | RecordType::ANY => {
                    let mut record =
                        Record::from_rdata(query.original().name().clone(), 0, RData::TXT(TXT::new(vec![text])));
                    record.dns_class = DNSClass::CH;
                    vec![record]
                }
                _ => vec![],
            };
            let message = builder.build(meta, answers.iter(), [].iter(), [].iter(), [].iter());
            return send(response, message).await;
        }
        let in_service_zone = this.zone.registry.zone().origin_lower.zone_of(query.name());
        if !in_service_zone {
            let static_zones = this.static_zones.load_full();
            if static_zones.catalog.find(query.name()).is_some() {
                let response = WithOpt {
                    inner: response,
                    edns: resp_edns,
                };
                return static_zones.catalog.handle_request::<_, T>(request, response).await;
            }
        }
        // IXFR over UDP: the current SOA alone, to those who may transfer (RFC 1995 §2).
        if qtype == RecordType::IXFR
            && request.protocol() == Protocol::Udp
            && let Some(answers) =
                transfer::udp_ixfr(self, query.name(), request.signature.is_some(), request.src().ip())
        {
            meta.authoritative = true;
            let message = builder.build(meta, answers.iter(), [].iter(), [].iter(), [].iter());
            return send(response, message).await;
        }
        // REFUSED, like NOTIMP and FORMERR, is not an answer from the zone: AA stays clear.
        if !in_service_zone
            || !answered_as_in(query.query_class())
            || matches!(qtype, RecordType::AXFR | RecordType::IXFR)
        {
            meta.response_code = ResponseCode::Refused;
            return send(response, builder.build_no_records(meta)).await;
        }
        // QCLASS ANY is answered as IN, with AA, as Knot and BIND answer it (NSD clears AA,
        // after RFC 1035 §6.2; the zone has class IN only, so the answer is complete).
        meta.authoritative = true;
        let negative_soa = vec![this.zone.soa()];
        let (mut answers, mut additionals, mut soa) =
            match this.zone.answer(query.name(), query.original().name(), qtype) {
                Answer::Records { answers, additionals } => (answers, additionals, vec![]),
                Answer::NoData => (vec![], vec![], negative_soa),
                Answer::NxDomain => {
                    meta.response_code = ResponseCode::NXDomain;
                    (vec![], vec![], negative_soa)
                }
            };
        if let Some(signer) = &this.zone.signer
            && request.edns.as_ref().is_some_and(|e| e.flags().dnssec_ok)
        {
            let now = this.zone.registry.now();
            answers = signer.with_rrsigs(answers, now);
            additionals = signer.with_rrsigs(additionals, now);
            if !soa.is_empty() {
                soa = signer.with_rrsigs(soa, now);
                let types = this.zone.types_at(query.name());
                let owner = query.original().name();
                soa.extend(signer.denial_records(owner, types.as_deref(), this.zone.negative_ttl, now));
                let compact = request.edns.as_ref().is_some_and(compact_ok);
                meta.response_code = denial_code(meta.response_code, compact);
            }
        }
        let limit = response_limit(
            request.protocol(),
            request.edns.as_ref().map(Edns::max_payload),
            this.wire.udp_max_payload,
        );
        let opt = resp_edns.as_ref().map_or(0, |e| {
            let mut bytes = Vec::new();
            let _ = e.emit(&mut BinEncoder::new(&mut bytes));
            bytes.len()
        });
        let soa_slice = soa.as_slice();
        let (n_answers, n_additionals) = fit(request, &answers, soa_slice, &additionals, limit, opt);
        // TC only when the answer does not fit (RFC 2181 §9), and then no records at all, as
        // NSD and Knot do: a client never takes part of an RRset for the whole. Additional
        // records that do not fit are left out without TC.
        if n_answers < answers.len() {
            meta.truncation = true;
            answers.clear();
            additionals.clear();
        }
        additionals.truncate(n_additionals);
        let message = builder.build(meta, answers.iter(), [].iter(), soa_slice.iter(), additionals.iter());
        send(response, message).await
    }
}

async fn send<'a, R: ResponseHandler>(
    mut response: R,
    message: hickory_server::zone_handler::MessageResponse<
        '_,
        'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
        impl Iterator<Item = &'a Record> + Send + 'a,
    >,
) -> ResponseInfo {
    let metadata = *message.metadata();
    match response.send_response(message).await {
        Ok(info) => info,
        Err(error) => {
            tracing::debug!(%error, "could not send a DNS response");
            let mut metadata = metadata;
            metadata.response_code = ResponseCode::ServFail;
            ResponseInfo::from(Header {
                metadata,
                counts: HeaderCounts::default(),
            })
        }
    }
}

fn udp_socket(addr: SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(socket2::Protocol::UDP))?;
    // Several sockets on one port, one per worker; the kernel spreads clients over them.
    socket.set_reuse_port(true)?;
    // Room for bursts while a worker is busy; the kernel caps it at net.core.rmem_max.
    let _ = socket.set_recv_buffer_size(4 << 20);
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    Ok(socket.into())
}

/// Binds `udp_workers` UDP sockets and one TCP listener on one address. With port 0, all
/// get the same free port.
///
/// Port 0 is resolved by an exclusive probe first: Linux hands a port-0 `SO_REUSEPORT` bind a
/// port that other reuse-port sockets of the same user already hold, so a second server (or
/// one not yet stopped) could otherwise join our group and answer half our queries. A probe
/// without `SO_REUSEPORT` only gets a port nobody holds; the group takes it a moment later.
pub async fn bind(addr: SocketAddr, udp_workers: usize) -> std::io::Result<(Vec<std::net::UdpSocket>, TcpListener)> {
    let mut attempts = 0;
    loop {
        let local = if addr.port() == 0 {
            std::net::UdpSocket::bind(addr)?.local_addr()?
        } else {
            addr
        };
        let bound = async { Ok::<_, std::io::Error>((udp_socket(local)?, TcpListener::bind(local).await?)) };
        match bound.await {
            Ok((first, tcp)) => {
                let mut sockets = vec![first];
                for _ in 1..udp_workers {
                    sockets.push(udp_socket(local)?);
                }
                return Ok((sockets, tcp));
            }
            Err(e) if addr.port() != 0 || attempts == 32 => return Err(e),
            Err(_) => attempts += 1,
        }
    }
}

/// The address `ns.<zone>` resolves to: where we listen, or loopback when listening on all.
pub fn ns_address(listen: SocketAddr) -> IpAddr {
    match listen.ip() {
        ip if ip.is_unspecified() && ip.is_ipv6() => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
        ip if ip.is_unspecified() => IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        ip => ip,
    }
}
