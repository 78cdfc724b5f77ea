//! The signed service zone (issue #28): real validators (unbound, delv) resolve it with AD,
//! every DO reply verifies with the zone's DNSKEY, replies without DO are what they were, a
//! transferred zone passes `ldns-verify-zone`, and the key is kept.
//!
//! The validator tests share one koder-dns and one unbound between their assertions, with
//! TTLs of one second, to keep the suite's wall time.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use hickory_proto::dnssec::Verifier;
use hickory_proto::dnssec::rdata::{DNSKEY, DNSSECRData};
use hickory_proto::op::{Edns, Message, ResponseCode};
use hickory_proto::rr::{LowerName, RData, Record, RecordType};
use serde_json::json;

use crate::child;
use crate::common::{self, TestServer};
use crate::tools::{Dig, dig, start_validating_unbound, tool};

/// `koder-dns dnssec <what> <args>`: its stdout; panics unless it exits 0.
pub(crate) fn dnssec_tool(what: &str, args: &[&str]) -> String {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_koder-dns"))
        .arg("dnssec")
        .arg(what)
        .args(args)
        .env_remove("KODER_DNS_DATA_DIR")
        .env_remove("KODER_DNS_DNSSEC_KEY")
        .env_remove("KODER_DNS_DOMAIN")
        .output()
        .expect("run koder-dns dnssec");
    assert!(
        output.status.success(),
        "koder-dns dnssec {what} {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// A signed server with one-second TTLs.
async fn signed(tweak: impl FnOnce(&mut koder_dns::config::Config)) -> TestServer {
    common::start_with(|c| {
        c.dnssec = true;
        c.dns_ttl = Duration::from_secs(1);
        c.negative_ttl = Duration::from_secs(1);
        tweak(c);
    })
    .await
}

fn data_dir(server: &TestServer) -> PathBuf {
    server.dir.path().join("data")
}

/// A query with DO (and CO when `compact`), EDNS buffer 1232.
pub(crate) fn do_query(name: &str, rtype: RecordType, compact: bool) -> Message {
    let mut message = common::query_message(name, rtype, Some(1232));
    let mut edns = Edns::new();
    edns.set_max_payload(1232).set_dnssec_ok(true);
    if compact {
        edns.flags_mut().z |= 0x4000;
    }
    message.set_edns(edns);
    message
}

/// The zone's DNSKEYs, asked of the server itself.
pub(crate) async fn dnskeys(server: SocketAddr) -> Vec<DNSKEY> {
    let reply = common::udp_query(server, &do_query("service.koder.", RecordType::DNSKEY, false)).await;
    reply
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::DNSSEC(DNSSECRData::DNSKEY(key)) => Some(key.clone()),
            _ => None,
        })
        .collect()
}

/// Every RRset of `section` but RRSIGs, by owner and type, with the RRSIGs that cover it.
fn rrsets(section: &[Record]) -> Vec<(Vec<&Record>, Vec<&Record>)> {
    let mut sets: Vec<(LowerName, RecordType, Vec<&Record>, Vec<&Record>)> = Vec::new();
    for record in section {
        let (owner, rtype) = match &record.data {
            RData::DNSSEC(DNSSECRData::RRSIG(sig)) => (LowerName::new(&record.name), sig.input().type_covered),
            _ => (LowerName::new(&record.name), record.record_type()),
        };
        let at = match sets.iter().position(|(o, t, ..)| *o == owner && *t == rtype) {
            Some(at) => at,
            None => {
                sets.push((owner, rtype, vec![], vec![]));
                sets.len() - 1
            }
        };
        match record.record_type() {
            RecordType::RRSIG => sets[at].3.push(record),
            _ => sets[at].2.push(record),
        }
    }
    sets.into_iter().map(|(_, _, set, sigs)| (set, sigs)).collect()
}

/// Asserts that every RRset of the zone in `reply` (answer, authority, and additional
/// records inside the zone) carries an RRSIG that verifies with `key`.
pub(crate) fn assert_verifies(reply: &Message, key: &DNSKEY, what: &str) {
    let zone = LowerName::from(hickory_proto::rr::Name::from_ascii("service.koder.").unwrap());
    for section in [&reply.answers, &reply.authorities, &reply.additionals] {
        for (set, sigs) in rrsets(section) {
            let Some(first) = set.first() else {
                panic!("{what}: an RRSIG without its RRset:\n{reply}");
            };
            if first.record_type() == RecordType::OPT || !zone.zone_of(&LowerName::new(&first.name)) {
                continue;
            }
            assert!(
                !sigs.is_empty(),
                "{what}: {} {} unsigned:\n{reply}",
                first.name,
                first.record_type()
            );
            for sig in sigs {
                let RData::DNSSEC(DNSSECRData::RRSIG(rrsig)) = &sig.data else {
                    unreachable!()
                };
                // The RRset a validator checks is canonical (RFC 4034 §6.3): equal records once,
                // which hickory's verifier leaves to its caller.
                let mut canonical = set.clone();
                canonical.sort_by(|a, b| a.data.cmp(&b.data));
                canonical.dedup_by(|a, b| a.data == b.data);
                key.verify_rrsig(&first.name, first.dns_class, rrsig, canonical.into_iter())
                    .unwrap_or_else(|e| {
                        panic!(
                            "{what}: {} {} does not verify: {e}\n{reply}",
                            first.name,
                            first.record_type()
                        )
                    });
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// without tools

/// Registers the same instances, in the same order, into each of `servers`.
async fn register_same(servers: &[&TestServer]) {
    for server in servers {
        server
            .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060, "metadata": {"k": "v"}}))
            .await;
        server
            .register(json!({"name": "web", "address": "2001:db8::1", "port": 443, "protocol": "tcp"}))
            .await;
        server
            .register(json!({"name": "named", "address": "host.example.com", "port": 80}))
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replies_without_do_are_byte_for_byte_those_of_an_unsigned_zone() {
    // One clock for both: the serial starts at the clock's second, so two servers started
    // on either side of a second would differ in every SOA (seen in CI).
    let (plain, _) = common::start_manual(|_| {}).await;
    let (signed, _) = common::start_manual(|c| c.dnssec = true).await;
    register_same(&[&plain, &signed]).await;
    let queries = [
        ("_voice._tcp.service.koder.", RecordType::SRV),
        ("voice.service.koder.", RecordType::A),
        ("voice.service.koder.", RecordType::TXT),
        ("voice.service.koder.", RecordType::AAAA),
        ("web.service.koder.", RecordType::AAAA),
        ("_named._tcp.service.koder.", RecordType::SRV),
        ("nosuch.service.koder.", RecordType::A),
        ("_tcp.service.koder.", RecordType::A),
        ("service.koder.", RecordType::SOA),
        ("service.koder.", RecordType::NS),
        ("service.koder.", RecordType::ANY),
        ("0a000001.addr.service.koder.", RecordType::A),
        ("ns.service.koder.", RecordType::A),
    ];
    for (name, rtype) in queries {
        for edns in [None, Some(1232)] {
            for tcp in [false, true] {
                let mut message = common::query_message(name, rtype, edns);
                message.metadata.id = 4242;
                let bytes = message.to_vec().unwrap();
                let ask = |server: SocketAddr| {
                    let bytes = bytes.clone();
                    async move {
                        match tcp {
                            true => common::tcp_query(server, &Message::from_vec(&bytes).unwrap())
                                .await
                                .to_vec()
                                .unwrap(),
                            false => common::udp_raw(server, &bytes, Duration::from_secs(5)).await.unwrap(),
                        }
                    }
                };
                let (a, b) = (ask(plain.dns()).await, ask(signed.dns()).await);
                assert_eq!(a, b, "{name} {rtype} edns {edns:?} tcp {tcp}");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_do_reply_verifies_with_the_zones_dnskey() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    let server = signed(|_| {}).await;
    let keys = dnskeys(server.dns()).await;
    assert_eq!(keys.len(), 1, "one combined key");
    assert_eq!(keys[0].flags(), 257);
    let key = keys[0].clone();
    let handle = tokio::runtime::Handle::current();
    // A random registry (services, addresses of both families and host names, protocols),
    // then random questions: names that exist, that do not, NODATA, glue, ANY.
    let names = ["a", "b", "c", "voice", "web"];
    let registry = proptest::collection::vec(
        (0..names.len(), 0u8..4, prop_oneof![Just("tcp"), Just("udp")], 1u16..4),
        1..12,
    );
    let questions = proptest::collection::vec((0..names.len() + 2, 0usize..9, any::<bool>()), 1..12);
    let mut runner = TestRunner::new(Config::with_cases(12));
    let round = std::sync::atomic::AtomicU32::new(0);
    let outcome = runner.run(&(registry, questions), |(instances, questions)| {
        let round = round.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        tokio::task::block_in_place(|| {
            handle.block_on(async {
                for (i, (name, address, protocol, port)) in instances.iter().enumerate() {
                    let address = match address {
                        0 => format!("10.{round}.0.{i}"),
                        1 => format!("2001:db8::{round}:{i}"),
                        2 => "host.example.com".to_owned(),
                        _ => format!("{}.service.koder", names[(i + 1) % names.len()]),
                    };
                    server
                        .register(
                            json!({"name": names[*name], "id": format!("{round}-{i}"), "address": address,
                            "port": port, "protocol": protocol, "metadata": {"round": round.to_string()}}),
                        )
                        .await;
                }
                for (name, kind, compact) in questions {
                    let owner = match names.get(name) {
                        Some(n) => *n,
                        None if name == names.len() => "nosuch",
                        None => "addr",
                    };
                    let (qname, rtype) = match kind {
                        0 => (format!("_{owner}._tcp.service.koder."), RecordType::SRV),
                        1 => (format!("_{owner}._udp.service.koder."), RecordType::SRV),
                        2 => (format!("{owner}.service.koder."), RecordType::A),
                        3 => (format!("{owner}.service.koder."), RecordType::AAAA),
                        4 => (format!("{owner}.service.koder."), RecordType::TXT),
                        5 => (format!("{owner}.service.koder."), RecordType::ANY),
                        6 => (format!("{owner}.service.koder."), RecordType::MX),
                        7 => ("service.koder.".to_owned(), RecordType::SOA),
                        _ => ("0a000001.addr.service.koder.".to_owned(), RecordType::A),
                    };
                    let reply = common::tcp_query(server.dns(), &do_query(&qname, rtype, compact)).await;
                    let what = format!("{qname} {rtype} compact {compact}");
                    assert!(
                        matches!(
                            reply.metadata.response_code,
                            ResponseCode::NoError | ResponseCode::NXDomain
                        ),
                        "{what}: {reply}"
                    );
                    if reply.metadata.response_code == ResponseCode::NXDomain {
                        assert!(compact, "{what}: NXDOMAIN only with CO: {reply}");
                    }
                    if reply.answers.is_empty() {
                        assert!(
                            reply.authorities.iter().any(|r| r.record_type() == RecordType::NSEC),
                            "{what}: a denial carries its NSEC: {reply}"
                        );
                    }
                    assert_verifies(&reply, &key, &what);
                }
            })
        });
        Ok(())
    });
    outcome.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compact_denial_is_one_nsec_at_the_name_with_nxname_or_the_present_types() {
    let server = signed(|_| {}).await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let nsec_types = |reply: &Message| -> Vec<RecordType> {
        let nsecs: Vec<_> = reply
            .authorities
            .iter()
            .filter_map(|r| match &r.data {
                RData::DNSSEC(DNSSECRData::NSEC(nsec)) => Some((r.name.clone(), nsec.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(nsecs.len(), 1, "one NSEC: {reply}");
        let (owner, nsec) = &nsecs[0];
        assert_eq!(
            nsec.next_domain_name().to_string(),
            format!("\\000.{}", owner.to_lowercase()),
            "the next name is right after the owner"
        );
        nsec.type_bit_maps().collect()
    };
    // A name that does not exist: NOERROR with NXNAME, or NXDOMAIN when CO is set.
    for compact in [false, true] {
        let reply = common::udp_query(server.dns(), &do_query("nosuch.service.koder.", RecordType::A, compact)).await;
        let code = if compact {
            ResponseCode::NXDomain
        } else {
            ResponseCode::NoError
        };
        assert_eq!(reply.metadata.response_code, code, "{reply}");
        let types = nsec_types(&reply);
        assert!(types.contains(&RecordType::Unknown(128)), "{types:?}");
        assert!(!types.contains(&RecordType::A), "{types:?}");
        let co = reply.edns.as_ref().map(|e| e.flags().z & 0x4000 != 0);
        assert_eq!(co, Some(compact), "CO echoed with DO");
    }
    // NODATA: the types present, not the asked one.
    let reply = common::udp_query(server.dns(), &do_query("voice.service.koder.", RecordType::AAAA, false)).await;
    assert_eq!(reply.metadata.response_code, ResponseCode::NoError);
    let types = nsec_types(&reply);
    for present in [RecordType::A, RecordType::TXT, RecordType::RRSIG, RecordType::NSEC] {
        assert!(types.contains(&present), "{present} in {types:?}");
    }
    assert!(!types.contains(&RecordType::AAAA) && !types.contains(&RecordType::Unknown(128)));
    // Without DO: NXDOMAIN and the SOA alone, as always.
    let plain = server.query("nosuch.service.koder.", RecordType::A).await;
    assert_eq!(plain.metadata.response_code, ResponseCode::NXDomain);
    assert_eq!(plain.authorities.len(), 1);
    // NXNAME asked for: FORMERR.
    let reply = server.query("voice.service.koder.", RecordType::Unknown(128)).await;
    assert_eq!(reply.metadata.response_code, ResponseCode::FormErr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_survives_restarts_and_a_given_key_is_used_as_given() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let start = |key: Option<PathBuf>| {
        let data = data.clone();
        common::start_with(move |c| {
            c.dnssec = true;
            c.data_dir = data;
            c.dnssec_key = key;
        })
    };
    let first = start(None).await;
    let generated = dnskeys(first.dns()).await;
    first.running.shutdown().await.unwrap();
    let again = start(None).await;
    assert_eq!(dnskeys(again.dns()).await, generated, "the kept key after a restart");
    let printed = dnssec_tool("dnskey", &["--data-dir", data.to_str().unwrap()]);
    assert!(printed.contains(&generated[0].to_string()), "{printed}");
    again.running.shutdown().await.unwrap();

    let given = dir.path().join("given.pem");
    dnssec_tool("keygen", &["--out", given.to_str().unwrap()]);
    let server = start(Some(given.clone())).await;
    let keys = dnskeys(server.dns()).await;
    assert_ne!(keys, generated, "the given key, not the kept one");
    let printed = dnssec_tool("dnskey", &["--dnssec-key", given.to_str().unwrap()]);
    assert!(printed.contains(&keys[0].to_string()), "{printed}");
    let ds = dnssec_tool("ds", &["--dnssec-key", given.to_str().unwrap()]);
    let tag = keys[0].calculate_key_tag().unwrap();
    assert!(ds.starts_with(&format!("service.koder. IN DS {tag} 13 2 ")), "{ds}");
}

/// A rollover's first step: a second key is published beside the signing key, which alone
/// signs; `dnssec dnskey` prints both for trust anchors.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_key_is_in_the_dnskey_set_and_the_signing_key_alone_signs() {
    let dir = tempfile::tempdir().unwrap();
    let (old, new) = (dir.path().join("old.pem"), dir.path().join("new.pem"));
    for key in [&old, &new] {
        dnssec_tool("keygen", &["--out", key.to_str().unwrap()]);
    }
    let (old_path, new_path) = (old.clone(), new.clone());
    let server = signed(move |c| {
        c.dnssec_key = Some(old_path);
        c.dnssec_publish_key = Some(new_path);
    })
    .await;
    let reply = common::udp_query(server.dns(), &do_query("service.koder.", RecordType::DNSKEY, false)).await;
    let keys = dnskeys(server.dns()).await;
    assert_eq!(keys.len(), 2, "{reply}");
    let printed = dnssec_tool(
        "dnskey",
        &[
            "--dnssec-key",
            old.to_str().unwrap(),
            "--dnssec-publish-key",
            new.to_str().unwrap(),
        ],
    );
    let signing = keys
        .iter()
        .find(|k| printed.lines().next().unwrap().contains(&k.to_string()))
        .unwrap();
    assert!(
        printed.lines().count() == 2 && keys.iter().all(|k| printed.contains(&k.to_string())),
        "{printed}"
    );
    assert_verifies(&reply, signing, "the DNSKEY set");
    let sigs = reply
        .answers
        .iter()
        .filter(|r| r.record_type() == RecordType::RRSIG)
        .count();
    assert_eq!(sigs, 1, "one signature, by the signing key: {reply}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_node_without_a_given_key_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let (status, stderr) = child::launch_refused(dir.path(), &["--store", "etcd", "--dnssec"]).await;
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--dnssec-key"), "{stderr}");
}

/// The inception (Unix seconds) of every RRSIG in `messages`' answers.
fn inceptions(messages: &[Message]) -> Vec<u32> {
    messages
        .iter()
        .flat_map(|m| &m.answers)
        .filter_map(|r| match &r.data {
            RData::DNSSEC(DNSSECRData::RRSIG(sig)) => Some(sig.input().sig_inception.get()),
            _ => None,
        })
        .collect()
}

/// Six days on (a day before a week's signatures expire), the server moves the serial and
/// the next IXFR carries every signature made again; before that, nothing moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signatures_sent_to_secondaries_are_made_again_a_day_before_they_expire() {
    use crate::transfer::{transfer, transfer_request};
    let (server, clock) = common::start_manual(|c| {
        c.dnssec = true;
        c.allow_transfer = vec!["127.0.0.0/8".parse().unwrap()];
        c.default_ttl = Duration::ZERO;
    })
    .await;
    for i in 1..=3 {
        server
            .register(json!({"name": format!("svc{i}"), "address": format!("10.0.0.{i}"), "port": 80}))
            .await;
    }
    let whole = transfer(server.dns(), &transfer_request(RecordType::AXFR, None)).await;
    let before = inceptions(&whole);
    let first = server.serial().await;
    assert!(before.len() > 20, "RRSIGs in the transfer: {before:?}");
    clock.advance(Duration::from_secs(5 * 86_400));
    assert!(
        !server.running.refresh_signatures().await,
        "five days on: nothing to do"
    );
    assert_eq!(server.serial().await, first);
    clock.advance(Duration::from_secs(86_400));
    assert!(server.running.refresh_signatures().await, "six days on: made again");
    let serial = server.serial().await;
    assert!(serial > first);
    let ixfr = transfer(server.dns(), &transfer_request(RecordType::IXFR, Some(first))).await;
    let renewed = inceptions(&ixfr);
    let old = *before.iter().max().unwrap();
    // Each old signature deleted, a new one added, each new one six days younger.
    assert_eq!(
        renewed.iter().filter(|&&i| i <= old).count(),
        before.len(),
        "{renewed:?}"
    );
    assert_eq!(
        renewed.iter().filter(|&&i| i >= old + 6 * 86_400).count(),
        before.len(),
        "{renewed:?}"
    );
    assert!(!server.running.refresh_signatures().await, "nothing old is left");
    let again = inceptions(&transfer(server.dns(), &transfer_request(RecordType::AXFR, None)).await);
    assert!(again.iter().all(|&i| i >= old + 6 * 86_400), "{again:?}");
}

/// Static zones are served as their files give them, and a file with RRSIG or NSEC records
/// cannot be read by hickory's parser: the start stops, naming the file and saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pre_signed_static_zone_file_is_refused_at_start_saying_why() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("signed.test.zone"),
        "$TTL 60\n@ IN SOA ns hostmaster 1 3600 600 86400 60\n@ IN NS ns\nns IN A 192.0.2.1\n\
         ns IN NSEC signed.test. A RRSIG NSEC\n",
    )
    .unwrap();
    let message = crate::dns::start_error(dir.path().to_path_buf()).await;
    assert!(
        message.contains("signed.test.zone") && message.contains("pre-signed") && message.contains("NSD or Knot"),
        "{message}"
    );
}

// ---------------------------------------------------------------------------------------
// real validators

/// A trust-anchor file for `zone` with the key of the server whose data is `data`.
fn anchors(dir: &Path, data: &Path, zones: &[&str]) -> PathBuf {
    let path = dir.join("anchors");
    let lines: String = zones
        .iter()
        .map(|zone| dnssec_tool("dnskey", &["--data-dir", data.to_str().unwrap(), "--domain", zone]))
        .collect();
    std::fs::write(&path, lines).unwrap();
    path
}

/// The trust-anchor file of `server`'s zone alone.
fn anchors_of(server: &TestServer, dir: &Path) -> PathBuf {
    let dir = dir.join("service.koder");
    std::fs::create_dir_all(&dir).unwrap();
    anchors(&dir, &data_dir(server), &["service.koder"])
}

/// Knot Resolver (`kresd`), validating, forwarding the service zone to `koder`.
struct Kresd {
    child: tokio::process::Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Kresd {
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }
}

impl Drop for Kresd {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

async fn start_kresd(koder: SocketAddr, anchors: &Path) -> Kresd {
    let dir = tempfile::tempdir().unwrap();
    let port = crate::tools::free_port();
    let config = dir.path().join("config");
    std::fs::write(
        &config,
        format!(
            "net.listen('127.0.0.1', {port}, {{ kind = 'dns' }})\n\
             trust_anchors.add_file('{}', true)\n\
             policy.add(policy.suffix(policy.FORWARD({{'{}@{}'}}), {{todname('service.koder.')}}))\n",
            anchors.display(),
            koder.ip(),
            koder.port()
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.path().join("log")).unwrap();
    let child = tokio::process::Command::new(tool("kresd", "knot-resolver"))
        .arg("-n")
        .arg("-c")
        .arg(&config)
        .arg(dir.path())
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .expect("start kresd");
    let kresd = Kresd {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        dir,
    };
    dig_until(
        kresd.addr,
        &["+time=1", "SOA", "service.koder"],
        Duration::from_secs(5),
        |out| !out.status.is_empty(),
    )
    .await;
    kresd
}

/// Asks `resolver` until `check` holds or `within` has passed; returns the last answer.
async fn dig_until(resolver: SocketAddr, args: &[&str], within: Duration, check: impl Fn(&Dig) -> bool) -> Dig {
    let deadline = Instant::now() + within;
    loop {
        let out = dig(resolver, args).await;
        if check(&out) || Instant::now() > deadline {
            return out;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs dig, delv and unbound (installed by tests/run.sh)"]
async fn unbound_and_delv_validate_answers_denials_and_changes() {
    let server = signed(|_| {}).await;
    server
        .register(json!({"name": "voice", "id": "v1", "address": "10.0.0.1", "port": 5060, "metadata": {"k": "v"}}))
        .await;
    // Two instances at one address and port: the SRV and A RRsets hold two equal records,
    // which a validator counts once (RFC 4034 §6.3), and so must the signature.
    for id in ["t1", "t2"] {
        server
            .register(json!({"name": "twin", "id": id, "address": "10.0.0.3", "port": 5060}))
            .await;
    }
    // A second zone signed with another key than its trust anchor says: SERVFAIL.
    let other = signed(|c| c.domain = "bad.koder".into()).await;
    other
        .register(json!({"name": "voice", "address": "10.0.0.2", "port": 5060}))
        .await;
    let dir = tempfile::tempdir().unwrap();
    let anchors = anchors(dir.path(), &data_dir(&server), &["service.koder", "bad.koder"]);
    let stub = format!(
        "    stub-addr: {}@{}\nstub-zone:\n    name: \"bad.koder.\"\n    stub-addr: {}@{}\n",
        server.dns().ip(),
        server.dns().port(),
        other.dns().ip(),
        other.dns().port()
    );
    let unbound = start_validating_unbound(&stub, &anchors, "    cache-max-negative-ttl: 1\n").await;
    let ask = |args: Vec<&'static str>| {
        let mut all = vec!["+dnssec"];
        all.extend(args);
        all
    };
    let validated = |out: &Dig| out.has_flag("ad");
    for (rtype, name) in [
        ("SRV", "_voice._tcp.service.koder"),
        ("A", "voice.service.koder"),
        ("TXT", "voice.service.koder"),
        ("SRV", "_twin._tcp.service.koder"),
        ("A", "twin.service.koder"),
        ("A", "0a000001.addr.service.koder"),
        ("SOA", "service.koder"),
    ] {
        let out = dig(unbound.addr, &ask(vec![rtype, name])).await;
        assert_eq!(out.status, "NOERROR", "{rtype} {name}: {}\n{}", out.raw, unbound.log());
        assert!(
            validated(&out),
            "{rtype} {name} validated: {}\n{}",
            out.raw,
            unbound.log()
        );
        assert!(!Dig::of_type(&out.answer, rtype).is_empty(), "{}", out.raw);
    }
    // Denials: a name that does not exist, and a type the name does not have.
    for (rtype, name) in [
        ("A", "nosuch.service.koder"),
        ("AAAA", "voice.service.koder"),
        ("SRV", "_x._udp.service.koder"),
    ] {
        let out = dig(unbound.addr, &ask(vec![rtype, name])).await;
        assert!(
            matches!(out.status.as_str(), "NOERROR" | "NXDOMAIN") && out.answer.is_empty(),
            "{rtype} {name}: {}",
            out.raw
        );
        assert!(
            validated(&out),
            "{rtype} {name} denial validated: {}\n{}",
            out.raw,
            unbound.log()
        );
    }
    let bad = dig(unbound.addr, &ask(vec!["SRV", "_voice._tcp.bad.koder"])).await;
    assert_eq!(bad.status, "SERVFAIL", "signed with another key: {}", bad.raw);

    // A registration validates within a TTL (one second here), and so does the denial of
    // a deregistered service.
    let before = dig(unbound.addr, &ask(vec!["SRV", "_late._tcp.service.koder"])).await;
    assert!(before.answer.is_empty() && validated(&before), "{}", before.raw);
    server
        .register(json!({"name": "late", "id": "l1", "address": "10.0.0.9", "port": 9}))
        .await;
    let registered = Instant::now();
    let late = dig_until(
        unbound.addr,
        &ask(vec!["SRV", "_late._tcp.service.koder"]),
        Duration::from_secs(3),
        |out| !out.answer.is_empty(),
    )
    .await;
    assert!(
        validated(&late) && !Dig::of_type(&late.answer, "SRV").is_empty(),
        "{}",
        late.raw
    );
    assert!(
        registered.elapsed() < Duration::from_millis(2500),
        "{:?}",
        registered.elapsed()
    );
    server.deregister("v1").await;
    let gone = dig_until(
        unbound.addr,
        &ask(vec!["SRV", "_voice._tcp.service.koder"]),
        Duration::from_secs(3),
        |out| out.answer.is_empty(),
    )
    .await;
    assert!(
        gone.answer.is_empty() && validated(&gone),
        "deregistered: {}\n{}",
        gone.raw,
        unbound.log()
    );

    // Knot Resolver, forwarding the zone to koder-dns with its trust anchor.
    let kresd = start_kresd(server.dns(), &anchors_of(&server, dir.path())).await;
    for (rtype, name) in [
        ("SRV", "_late._tcp.service.koder"),
        ("TXT", "late.service.koder"),
        ("A", "nosuch.service.koder"),
        ("AAAA", "late.service.koder"),
    ] {
        let out = dig(kresd.addr, &ask(vec![rtype, name])).await;
        assert!(validated(&out), "kresd {rtype} {name}: {}\n{}", out.raw, kresd.log());
    }

    // delv, BIND's validating lookup tool, straight at koder-dns with the zone's key.
    let key = dnssec_tool("dnskey", &["--data-dir", data_dir(&server).to_str().unwrap()]);
    let fields: Vec<&str> = key.split_whitespace().collect();
    let bind_keys = dir.path().join("bind.keys");
    std::fs::write(
        &bind_keys,
        format!(
            "trust-anchors {{ service.koder. static-key {} {} {} \"{}\"; }};\n",
            fields[3], fields[4], fields[5], fields[6]
        ),
    )
    .unwrap();
    for (rtype, name) in [("SRV", "_late._tcp.service.koder"), ("A", "nosuch.service.koder")] {
        let output = tokio::process::Command::new(tool("delv", "bind9-dnsutils"))
            .arg(format!("@{}", server.dns().ip()))
            .args(["-p", &server.dns().port().to_string(), "-a"])
            .arg(&bind_keys)
            .args(["+root=service.koder", rtype, name])
            .stdin(Stdio::null())
            .output()
            .await
            .expect("run delv");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(text.contains("fully validated"), "delv {rtype} {name}:\n{text}");
    }
}

/// `ldns-verify-zone` on the zone as `dig AXFR` gets it from `server`: every signature, the
/// NSEC chain complete.
async fn verify_transferred_zone(server: SocketAddr, dir: &Path, name: &str) {
    let axfr = dig(server, &["+nocmd", "+nostats", "+time=5", "AXFR", "service.koder"]).await;
    let records: Vec<String> = axfr
        .raw
        .lines()
        .filter(|l| !l.starts_with(';') && !l.is_empty())
        .map(str::to_owned)
        .collect();
    assert!(
        records.iter().any(|l| l.contains("NSEC")),
        "{name}: a signed zone:\n{}",
        axfr.raw
    );
    let path = dir.join(format!("{name}.zone"));
    std::fs::write(&path, records.join("\n") + "\n").unwrap();
    let output = std::process::Command::new(tool("ldns-verify-zone", "ldnsutils"))
        .arg(&path)
        .output()
        .expect("run ldns-verify-zone");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "{name}: ldns-verify-zone:\n{text}\n{}",
        axfr.raw
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs knotd, nsd, unbound, dig and ldns-verify-zone (installed by tests/run.sh)"]
async fn knot_and_nsd_serve_the_transferred_signed_zone_that_unbound_validates() {
    use crate::tools::free_port;
    use crate::transfer::{Kind, Signing, primary_settings, start_secondary};
    let (knot_port, nsd_port) = (free_port(), free_port());
    let server = signed(|c| {
        primary_settings(c, SocketAddr::from(([127, 0, 0, 1], knot_port)), Signing::Unsigned);
        c.notify.push(SocketAddr::from(([127, 0, 0, 1], nsd_port)));
    })
    .await;
    for i in 1..=3 {
        server
            .register(json!({"name": format!("svc{i}"), "address": format!("10.0.0.{i}"), "port": 5060}))
            .await;
    }
    server
        .register(json!({"name": "web", "address": "2001:db8::5", "port": 443}))
        .await;
    let dir = tempfile::tempdir().unwrap();
    verify_transferred_zone(server.dns(), dir.path(), "primary").await;
    let secondaries = [
        start_secondary(Kind::Knot, knot_port, server.dns(), Signing::Unsigned),
        start_secondary(Kind::Nsd, nsd_port, server.dns(), Signing::Unsigned),
    ];
    let serial = server.serial().await;
    for secondary in &secondaries {
        secondary.until_serial(serial, Duration::from_secs(10)).await;
    }
    // A registration between two names and a deregistration: NOTIFY and IXFR carry the
    // changed records, their RRSIGs and the NSECs around them.
    server
        .register(json!({"name": "svc2b", "id": "new", "address": "10.0.0.7", "port": 7}))
        .await;
    server.deregister("svc3-10.0.0.3-5060").await;
    let serial = server.serial().await;
    let anchors = anchors(dir.path(), &data_dir(&server), &["service.koder"]);
    for (secondary, name) in secondaries.iter().zip(["knot", "nsd"]) {
        secondary.until_serial(serial, Duration::from_secs(10)).await;
        verify_transferred_zone(secondary.addr, dir.path(), name).await;
        let stub = format!("    stub-addr: {}@{}\n", secondary.addr.ip(), secondary.addr.port());
        let unbound = start_validating_unbound(&stub, &anchors, "").await;
        for (rtype, qname) in [
            ("SRV", "_svc2b._tcp.service.koder"),
            ("AAAA", "web.service.koder"),
            ("A", "svc3.service.koder"),
            ("TXT", "nosuch.service.koder"),
        ] {
            let out = dig(unbound.addr, &["+dnssec", rtype, qname]).await;
            assert!(
                out.has_flag("ad"),
                "{name} {rtype} {qname}: {}\n{}\n{}",
                out.raw,
                unbound.log(),
                secondary.log()
            );
        }
    }
}
