//! End-to-end tests with real tools (issue #3): `dig` against the in-process server, and
//! Debian's `unbound` as a real resolver with a stub zone pointed at it.
//!
//! Run them with `cargo test --test it tools:: -- --ignored` (the README test command installs
//! bind9-dnsutils and unbound first). A missing tool fails the test loudly; nothing here
//! is skipped silently.

use crate::common;

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::TestServer;
use hickory_proto::rr::{DNSClass, RecordType};
use serde_json::json;

// ---------------------------------------------------------------------------------------
// tools

/// The path of an installed tool; panics with what to install when it is missing.
pub(crate) fn tool(name: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let dirs = std::env::split_paths(&path).chain(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from));
    for dir in dirs {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!("`{name}` is not installed (Debian package {package}); these tests need it: apt-get install {package}");
}

fn dig_path() -> PathBuf {
    tool("dig", "bind9-dnsutils")
}

/// dig's output, parsed: status, header flags, and the records of each section as
/// whitespace-separated fields (`name ttl class type rdata...`).
#[derive(Debug, Default)]
pub(crate) struct Dig {
    pub raw: String,
    pub status: String,
    flags: Vec<String>,
    pub answer: Vec<Vec<String>>,
    pub authority: Vec<Vec<String>>,
    pub additional: Vec<Vec<String>>,
    msg_size: Option<usize>,
}

impl Dig {
    fn parse(raw: String) -> Self {
        let mut dig = Dig {
            raw: raw.clone(),
            ..Dig::default()
        };
        let mut section: Option<&str> = None;
        for line in raw.lines() {
            let line = line.trim();
            if let Some(rest) = line.split("status: ").nth(1) {
                dig.status = rest.split(',').next().unwrap_or_default().trim().to_owned();
            }
            if let Some(rest) = line.strip_prefix(";; flags:") {
                dig.flags = rest
                    .split(';')
                    .next()
                    .unwrap_or_default()
                    .split_whitespace()
                    .map(str::to_owned)
                    .collect();
            }
            if let Some(rest) = line.strip_prefix(";; MSG SIZE  rcvd:") {
                dig.msg_size = rest.trim().parse().ok();
            }
            if line.starts_with(";; ANSWER SECTION") {
                section = Some("answer");
                continue;
            }
            if line.starts_with(";; AUTHORITY SECTION") {
                section = Some("authority");
                continue;
            }
            if line.starts_with(";; ADDITIONAL SECTION") {
                section = Some("additional");
                continue;
            }
            if line.is_empty() || line.starts_with(';') {
                if line.is_empty() {
                    section = None;
                }
                continue;
            }
            let fields: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
            match section {
                Some("answer") => dig.answer.push(fields),
                Some("authority") => dig.authority.push(fields),
                Some("additional") => dig.additional.push(fields),
                _ => {}
            }
        }
        dig
    }

    pub(crate) fn of_type<'a>(records: &'a [Vec<String>], rtype: &str) -> Vec<&'a Vec<String>> {
        records
            .iter()
            .filter(|r| r.get(3).is_some_and(|t| t == rtype))
            .collect()
    }

    pub(crate) fn has_flag(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }
}

/// Runs dig with `args` against `server`, and parses what it prints.
pub(crate) async fn dig(server: SocketAddr, args: &[&str]) -> Dig {
    let output = tokio::process::Command::new(dig_path())
        .arg(format!("@{}", server.ip()))
        .arg("-p")
        .arg(server.port().to_string())
        .args(["+time=2", "+tries=1"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .expect("run dig");
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success() || !text.is_empty(),
        "dig {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Dig::parse(text)
}

/// dig as an operator would run it against an authoritative server: no recursion asked.
async fn dig_auth(server: &TestServer, args: &[&str]) -> Dig {
    let mut all = vec!["+norec"];
    all.extend_from_slice(args);
    dig(server.dns(), &all).await
}

// ---------------------------------------------------------------------------------------
// dig against koder-dns

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs dig and unbound (installed by the README test command)"]
async fn dig_srv_shows_the_registered_instance() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060, "priority": 5, "weight": 20}))
        .await;
    for transport in [None, Some("+tcp")] {
        let mut args = vec!["SRV", "_voice._tcp.service.koder"];
        args.extend(transport);
        let out = dig_auth(&server, &args).await;
        assert_eq!(out.status, "NOERROR", "{args:?}:\n{}", out.raw);
        assert!(out.has_flag("aa"), "{args:?}: aa flag:\n{}", out.raw);
        assert!(!out.has_flag("ra"), "{args:?}: no ra flag:\n{}", out.raw);
        let srv = Dig::of_type(&out.answer, "SRV");
        assert_eq!(srv.len(), 1, "{args:?}:\n{}", out.raw);
        assert_eq!(srv[0][0], "_voice._tcp.service.koder.");
        assert_eq!(srv[0][1], "5", "TTL = --dns-ttl");
        assert_eq!(
            srv[0][4..],
            ["5", "20", "5060", "0a000001.addr.service.koder."],
            "{args:?}:\n{}",
            out.raw
        );
        let glue = Dig::of_type(&out.additional, "A");
        assert_eq!(glue.len(), 1, "{args:?}: glue:\n{}", out.raw);
        assert_eq!(
            (glue[0][0].as_str(), glue[0][4].as_str()),
            ("0a000001.addr.service.koder.", "10.0.0.1")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs dig and unbound (installed by the README test command)"]
async fn dig_shows_a_txt_soa_ns_and_negative_answers() {
    let server = common::start().await;
    server
        .register(
            json!({"name": "voice", "id": "v1", "address": "10.0.0.1", "port": 5060, "metadata": {"codec": "opus"}}),
        )
        .await;
    let a = dig_auth(&server, &["A", "voice.service.koder"]).await;
    assert_eq!(a.status, "NOERROR", "{}", a.raw);
    assert_eq!(
        Dig::of_type(&a.answer, "A")
            .iter()
            .map(|r| r[4].as_str())
            .collect::<Vec<_>>(),
        ["10.0.0.1"],
        "{}",
        a.raw
    );

    let txt = dig_auth(&server, &["TXT", "voice.service.koder"]).await;
    assert_eq!(txt.answer.len(), 1, "{}", txt.raw);
    assert_eq!(txt.answer[0][4..], ["\"id=v1\"", "\"codec=opus\""], "{}", txt.raw);

    let soa = dig_auth(&server, &["SOA", "service.koder"]).await;
    assert!(soa.has_flag("aa"), "{}", soa.raw);
    assert_eq!(
        Dig::of_type(&soa.answer, "SOA")[0][4],
        "ns.service.koder.",
        "{}",
        soa.raw
    );
    let ns = dig_auth(&server, &["NS", "service.koder"]).await;
    assert_eq!(Dig::of_type(&ns.answer, "NS")[0][4], "ns.service.koder.", "{}", ns.raw);

    let nx = dig_auth(&server, &["SRV", "_nosuch._tcp.service.koder"]).await;
    assert_eq!(nx.status, "NXDOMAIN", "{}", nx.raw);
    assert!(nx.has_flag("aa"), "{}", nx.raw);
    let soa = Dig::of_type(&nx.authority, "SOA");
    assert_eq!(soa.len(), 1, "SOA in authority:\n{}", nx.raw);
    assert_eq!(soa[0].last().unwrap(), "5", "SOA minimum = --negative-ttl:\n{}", nx.raw);

    let nodata = dig_auth(&server, &["MX", "voice.service.koder"]).await;
    assert_eq!(nodata.status, "NOERROR", "{}", nodata.raw);
    assert!(nodata.answer.is_empty(), "{}", nodata.raw);
    assert_eq!(Dig::of_type(&nodata.authority, "SOA").len(), 1, "{}", nodata.raw);

    let refused = dig_auth(&server, &["A", "example.com"]).await;
    assert_eq!(refused.status, "REFUSED", "{}", refused.raw);

    let any = dig_auth(&server, &["ANY", "voice.service.koder"]).await;
    assert_eq!(any.status, "NOERROR", "{}", any.raw);
    assert_eq!(any.answer.len(), 1, "RFC 8482 minimal answer:\n{}", any.raw);
    assert_eq!(any.answer[0][3], "HINFO", "{}", any.raw);

    let notify = dig_auth(&server, &["+opcode=notify", "SOA", "service.koder"]).await;
    assert_eq!(notify.status, "NOTIMP", "{}", notify.raw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs dig and unbound (installed by the README test command)"]
async fn dig_on_a_large_service_shows_tc_then_the_full_answer_over_tcp() {
    let server = common::start().await;
    for body in common::instances("big", 300) {
        server.register(body).await;
    }
    let name = "_big._tcp.service.koder";
    for bufsize in ["+bufsize=512", "+noedns"] {
        // +ignore: show the truncated UDP reply instead of retrying.
        let udp = dig_auth(&server, &["+ignore", bufsize, "SRV", name]).await;
        assert_eq!(udp.status, "NOERROR", "{bufsize}:\n{}", udp.raw);
        assert!(udp.has_flag("tc"), "{bufsize}: TC over UDP:\n{}", udp.raw);
        assert!(
            udp.msg_size.is_some_and(|s| s <= 512),
            "{bufsize}: at most 512 bytes:\n{}",
            udp.raw
        );
        // As NSD and Knot: an empty answer, never a partial set (RFC 2181 §9).
        assert!(
            udp.answer.is_empty(),
            "{bufsize}: an empty answer, not a partial one:\n{}",
            udp.raw
        );
        assert!(
            Dig::of_type(&udp.additional, "A").is_empty(),
            "{bufsize}: no glue without the answer:\n{}",
            udp.raw
        );

        // Plain dig retries over TCP by itself and gets everything.
        let retried = dig_auth(&server, &[bufsize, "SRV", name]).await;
        assert!(
            retried.raw.contains("Truncated, retrying in TCP mode"),
            "{bufsize}: dig retries over TCP:\n{}",
            retried.raw
        );
        assert_eq!(
            Dig::of_type(&retried.answer, "SRV").len(),
            300,
            "{bufsize}: all 300 over TCP"
        );
        assert_eq!(
            Dig::of_type(&retried.additional, "A").len(),
            300,
            "{bufsize}: all 300 glue records over TCP"
        );
        assert!(!retried.has_flag("tc"));
    }
    let tcp = dig_auth(&server, &["+tcp", "SRV", name]).await;
    assert_eq!(tcp.status, "NOERROR", "{}", tcp.raw);
    assert!(!tcp.has_flag("tc"));
    assert_eq!(Dig::of_type(&tcp.answer, "SRV").len(), 300);
    assert_eq!(Dig::of_type(&tcp.additional, "A").len(), 300);

    let udp = dig_auth(&server, &["+ignore", "+bufsize=1232", "SRV", name]).await;
    assert!(udp.has_flag("tc"), "{}", udp.raw);
    assert!(udp.msg_size.is_some_and(|s| s <= 1232), "{}", udp.raw);
    assert!(
        udp.raw.contains("OPT PSEUDOSECTION"),
        "EDNS answered with OPT:\n{}",
        udp.raw
    );
    let a = dig_auth(&server, &["+tcp", "A", "big.service.koder"]).await;
    assert_eq!(Dig::of_type(&a.answer, "A").len(), 300, "A over TCP");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs dig and unbound (installed by the README test command)"]
async fn dig_shows_the_shipped_static_zone() {
    let zones = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("zones");
    let server = common::start_with(move |c| c.zones_dir = zones).await;
    let www = dig_auth(&server, &["A", "www.koder.dev"]).await;
    assert_eq!(www.status, "NOERROR", "{}", www.raw);
    assert!(www.has_flag("aa"), "{}", www.raw);
    assert_eq!(Dig::of_type(&www.answer, "A")[0][4], "192.0.2.10", "{}", www.raw);
    let mx = dig_auth(&server, &["+tcp", "MX", "koder.dev"]).await;
    assert_eq!(mx.answer[0][4..], ["10", "mail.koder.dev."], "{}", mx.raw);
    let nx = dig_auth(&server, &["A", "nosuch.koder.dev"]).await;
    assert_eq!(nx.status, "NXDOMAIN", "{}", nx.raw);
}

// ---------------------------------------------------------------------------------------
// unbound, a real resolver, with a stub zone pointed at koder-dns

/// A port free for both UDP and TCP on loopback.
pub(crate) fn free_port() -> u16 {
    for _ in 0..50 {
        let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = udp.local_addr().unwrap().port();
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port for both UDP and TCP");
}

pub(crate) struct Unbound {
    child: tokio::process::Child,
    pub addr: SocketAddr,
    _dir: tempfile::TempDir,
    log: PathBuf,
}

impl Drop for Unbound {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

impl Unbound {
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// How unbound treats the service zone: unsigned, as most tests serve it.
const INSECURE: &str = "    module-config: \"iterator\"\n    domain-insecure: \"service.koder.\"\n";

/// `stub` is the stub zone's own lines (`stub-addr: ...`, and `stub-tls-upstream: yes` for
/// DNS over TLS), and any further zone clauses; `security` says whether unbound validates
/// (see [`INSECURE`]); `extra` goes into the server section.
fn unbound_conf(dir: &Path, port: u16, stub: &str, security: &str, extra: &str) -> String {
    let d = dir.display();
    format!(
        r#"server:
    interface: 127.0.0.1
    port: {port}
    do-ip4: yes
    do-ip6: no
    do-udp: yes
    do-tcp: yes
    do-daemonize: no
    username: ""
    chroot: ""
    directory: "{d}"
    pidfile: "{d}/unbound.pid"
    use-syslog: no
    logfile: "{d}/unbound.log"
    verbosity: 1
    num-threads: 1
    so-reuseport: no
    do-not-query-localhost: no
    access-control: 127.0.0.0/8 allow
{security}    local-zone: "service.koder." transparent
{extra}
remote-control:
    control-enable: no

stub-zone:
    name: "service.koder."
{stub}
"#,
    )
}

/// Starts unbound on a free loopback port, resolving `service.koder.` through `koder`.
async fn start_unbound(koder: SocketAddr, extra: &str) -> Unbound {
    start_unbound_with(&format!("    stub-addr: {}@{}", koder.ip(), koder.port()), extra).await
}

/// [`start_unbound`] with the stub zone's lines given.
async fn start_unbound_with(stub: &str, extra: &str) -> Unbound {
    start_unbound_conf(stub, INSECURE, extra).await
}

/// Starts unbound validating with the DNSKEYs of `anchors` (a zone file of DNSKEY lines, as
/// `koder-dns dnssec dnskey` prints them), its `stub` lines and zone clauses given.
pub(crate) async fn start_validating_unbound(stub: &str, anchors: &Path, extra: &str) -> Unbound {
    let security = format!(
        "    module-config: \"validator iterator\"\n    trust-anchor-file: \"{}\"\n    val-log-level: 2\n",
        anchors.display()
    );
    start_unbound_conf(stub, &security, extra).await
}

async fn start_unbound_conf(stub: &str, security: &str, extra: &str) -> Unbound {
    let unbound = tool("unbound", "unbound");
    let checkconf = tool("unbound-checkconf", "unbound");
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let conf = dir.path().join("unbound.conf");
    std::fs::write(&conf, unbound_conf(dir.path(), port, stub, security, extra)).unwrap();
    let check = tokio::process::Command::new(checkconf)
        .arg(&conf)
        .output()
        .await
        .expect("run unbound-checkconf");
    assert!(
        check.status.success(),
        "unbound-checkconf rejects the test config: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let child = tokio::process::Command::new(unbound)
        .arg("-d")
        .arg("-c")
        .arg(&conf)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start unbound");
    let mut server = Unbound {
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        log: dir.path().join("unbound.log"),
        _dir: dir,
    };
    // Wait until it answers (anything at all, even SERVFAIL, means it is up).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            panic!("unbound exited at start with {status}:\n{}", server.log());
        }
        let probe = dig(server.addr, &["+time=1", "+tries=1", "SOA", "service.koder"]).await;
        if !probe.status.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "unbound did not answer within 5 s:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs dig and unbound (installed by the README test command)"]
async fn unbound_resolves_srv_and_a_through_a_stub_zone() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.2", "port": 5061}))
        .await;
    let unbound = start_unbound(server.dns(), "").await;

    // Normal dig: RD set, as a stub resolver would ask.
    let srv = dig(unbound.addr, &["SRV", "_voice._tcp.service.koder"]).await;
    assert_eq!(srv.status, "NOERROR", "{}\n{}", srv.raw, unbound.log());
    assert!(srv.has_flag("ra"), "a recursive answer: {}", srv.raw);
    assert!(!srv.has_flag("aa"), "unbound is not authoritative: {}", srv.raw);
    let mut got: Vec<String> = Dig::of_type(&srv.answer, "SRV")
        .iter()
        .map(|r| r[4..].join(" "))
        .collect();
    got.sort();
    assert_eq!(
        got,
        [
            "10 100 5060 0a000001.addr.service.koder.",
            "10 100 5061 0a000002.addr.service.koder."
        ],
        "{}",
        srv.raw
    );

    let a = dig(unbound.addr, &["A", "voice.service.koder"]).await;
    assert_eq!(a.status, "NOERROR", "{}", a.raw);
    let mut addrs: Vec<&str> = Dig::of_type(&a.answer, "A").iter().map(|r| r[4].as_str()).collect();
    addrs.sort();
    assert_eq!(addrs, ["10.0.0.1", "10.0.0.2"], "{}", a.raw);

    // The SRV target resolves too.
    let target = dig(unbound.addr, &["A", "0a000001.addr.service.koder"]).await;
    assert_eq!(
        Dig::of_type(&target.answer, "A")
            .iter()
            .map(|r| r[4].as_str())
            .collect::<Vec<_>>(),
        ["10.0.0.1"],
        "{}",
        target.raw
    );

    let nx = dig(unbound.addr, &["SRV", "_unknown._tcp.service.koder"]).await;
    assert_eq!(nx.status, "NXDOMAIN", "{}\n{}", nx.raw, unbound.log());
    assert_eq!(
        Dig::of_type(&nx.authority, "SOA").len(),
        1,
        "the SOA comes through the resolver:\n{}",
        nx.raw
    );

    let nx = dig(unbound.addr, &["A", "unknown.service.koder"]).await;
    assert_eq!(nx.status, "NXDOMAIN", "{}", nx.raw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs dig and unbound (installed by the README test command)"]
async fn unbound_sees_an_instance_go_after_its_ttl() {
    let server = common::start_with(|c| c.dns_ttl = std::time::Duration::from_secs(1)).await;
    server
        .register(json!({"name": "voice", "id": "v1", "address": "10.0.0.1", "port": 5060}))
        .await;
    let unbound = start_unbound(server.dns(), "    cache-min-ttl: 0\n    serve-expired: no\n").await;
    let srv = dig(unbound.addr, &["SRV", "_voice._tcp.service.koder"]).await;
    assert_eq!(Dig::of_type(&srv.answer, "SRV").len(), 1, "{}", srv.raw);
    let (status, body) = server.post("/api/v1/services/deregister", &json!({"id": "v1"})).await;
    assert_eq!(status, 200, "{body}");
    // The record TTL was 1 s; the negative answer's SOA minimum is --negative-ttl (5 s).
    tokio::time::sleep(Duration::from_millis(2500)).await; // unbound counts whole seconds
    let gone = dig(unbound.addr, &["SRV", "_voice._tcp.service.koder"]).await;
    assert_eq!(gone.status, "NXDOMAIN", "{}\n{}", gone.raw, unbound.log());
}

/// A resolver that minimises query names strictly (RFC 9156) asks `_tcp.service.koder.`
/// before `_voice._tcp.service.koder.`; that empty non-terminal must be NOERROR/NODATA,
/// because an NXDOMAIN there means nothing below it exists (RFC 8020).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs dig and unbound (installed by the README test command)"]
async fn unbound_with_strict_qname_minimisation_resolves_srv() {
    let server = common::start().await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let unbound = start_unbound(
        server.dns(),
        "    qname-minimisation: yes\n    qname-minimisation-strict: yes\n",
    )
    .await;
    let srv = dig(unbound.addr, &["SRV", "_voice._tcp.service.koder"]).await;
    assert_eq!(srv.status, "NOERROR", "{}\n{}", srv.raw, unbound.log());
    assert_eq!(Dig::of_type(&srv.answer, "SRV").len(), 1, "{}", srv.raw);
    let target = dig(unbound.addr, &["A", "0a000001.addr.service.koder"]).await;
    assert_eq!(target.status, "NOERROR", "{}", target.raw);
}

// ---------------------------------------------------------------------------------------
// NSD, the reference: the same names served by both, the same queries to both

/// A reference server, NSD or Knot, serving `zone` (a zone file's text) for
/// `service.koder.` on a free loopback port, answering `CH TXT version.bind.` as koder-dns
/// does and transferring to loopback.
struct Reference {
    name: &'static str,
    child: tokio::process::Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Drop for Reference {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// The `server:` section of an NSD on `port` keeping everything in `dir`, as root, in the
/// foreground, logging to `dir/<log>`.
pub(crate) fn nsd_server(dir: &Path, port: u16, log: &str) -> String {
    let d = dir.display();
    format!(
        r#"server:
    ip-address: 127.0.0.1@{port}
    do-ip6: no
    username: ""
    chroot: ""
    zonesdir: "{d}"
    database: ""
    zonelistfile: "{d}/zone.list"
    xfrdfile: "{d}/xfrd.state"
    xfrdir: "{d}"
    pidfile: "{d}/nsd.pid"
    logfile: "{d}/{log}""#
    )
}

/// `koder-dns <version>`, what `CH TXT version.bind.` answers.
fn version_text() -> String {
    format!("koder-dns {}", env!("CARGO_PKG_VERSION"))
}

async fn start_reference(name: &'static str, zone: &str, identity: &str) -> Reference {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let d = dir.path().display();
    std::fs::write(dir.path().join("service.koder.zone"), zone).unwrap();
    let version = version_text();
    let (program, args, conf) = match name {
        // minimal-responses: no NS in authority of positive answers, as koder-dns answers.
        "nsd" => (
            tool("nsd", "nsd"),
            vec!["-d", "-c"],
            format!(
                r#"{server}
    identity: "{identity}"
    version: "{version}"
    hide-version: no
    minimal-responses: yes
    refuse-any: no
    server-count: 1
    verbosity: 1
remote-control:
    control-enable: no
zone:
    name: "service.koder."
    zonefile: "service.koder.zone"
    provide-xfr: 127.0.0.0/8 NOKEY
"#,
                server = nsd_server(dir.path(), port, "reference.log")
            ),
        ),
        _ => (
            tool("knotd", "knot"),
            vec!["-c"],
            format!(
                r#"server:
    rundir: "{d}"
    listen: 127.0.0.1@{port}
    identity: "{identity}"
    version: "{version}"
    udp-workers: 1
    tcp-workers: 1
    background-workers: 1
log:
  - target: "{d}/reference.log"
    any: info
database:
    storage: "{d}/db"
control:
    listen: "{d}/knot.sock"
acl:
  - id: transfer
    address: 127.0.0.0/8
    action: transfer
zone:
  - domain: service.koder.
    storage: "{d}"
    file: "service.koder.zone"
    semantic-checks: off
    journal-content: none
    zonefile-sync: -1
    acl: transfer
"#
            ),
        ),
    };
    let conf_path = dir.path().join("reference.conf");
    std::fs::write(&conf_path, conf).unwrap();
    let child = tokio::process::Command::new(program)
        .args(args)
        .arg(&conf_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("start {name}: {e}"));
    let mut server = Reference {
        name,
        child,
        addr: SocketAddr::from(([127, 0, 0, 1], port)),
        dir,
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            panic!("{name} exited at start with {status}:\n{}", server.log());
        }
        let probe = dig(server.addr, &["+time=1", "+tries=1", "SOA", "service.koder"]).await;
        if probe.status == "NOERROR" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{name} did not answer within 10 s:\n{}",
            server.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server
}

impl Reference {
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("reference.log")).unwrap_or_default()
    }
}

/// What a reply says, for comparison: rcode, flags, the OPT record (payload, DO, version,
/// whether it has a cookie), the question, and each section sorted (record order rotates by
/// design). CD is left out: NSD 4.6 clears it, Knot and RFC 6840 §5.9 copy it, so do we.
#[derive(Debug, Clone, PartialEq)]
struct Wire {
    rcode: String,
    aa: bool,
    tc: bool,
    rd: bool,
    ra: bool,
    ad: bool,
    edns: Option<(u16, bool, u8)>,
    question: Vec<String>,
    answer: Vec<String>,
    authority: Vec<String>,
    additional: Vec<String>,
}

impl Wire {
    /// `None` for no reply.
    fn of(reply: Option<Vec<u8>>) -> Option<Result<Self, String>> {
        use hickory_proto::op::Message;
        let bytes = reply?;
        let Ok(m) = Message::from_vec(&bytes) else {
            return Some(Err(format!("undecodable {} bytes", bytes.len())));
        };
        let section = |records: &[hickory_proto::rr::Record]| {
            let mut out: Vec<String> = records.iter().map(|r| r.to_string().to_ascii_lowercase()).collect();
            out.sort();
            out
        };
        let h = &m.metadata;
        Some(Ok(Self {
            rcode: h.response_code.to_string(),
            aa: h.authoritative,
            tc: h.truncation,
            rd: h.recursion_desired,
            ra: h.recursion_available,
            ad: h.authentic_data,
            edns: m
                .edns
                .as_ref()
                .map(|e| (e.max_payload(), e.flags().dnssec_ok, e.version())),
            question: m.queries.iter().map(|q| q.to_string()).collect(),
            answer: section(&m.answers),
            authority: section(&m.authorities),
            additional: section(&m.additionals),
        }))
    }
}

/// Whether koder-dns's reply (`ours`) differs from the `reference`'s only as the allow-list
/// says, each entry with its reason:
/// - NOTIMP: NSD echoes neither the question nor the OPT record; we keep both, as Knot does,
///   so only the rcode and flags are compared.
/// - ANY: each server answers RFC 8482 its own way (NSD every RRset, Knot one, both with TC
///   over UDP when those do not fit; we one synthesised HINFO, which always fits), so TC and
///   the answer and additional sections are not compared.
/// - A header without a question: Knot sends no reply; NSD and we send FORMERR.
/// - QCLASS ANY against NSD: NSD clears AA and leaves the SOA out of negative answers (RFC
///   1035 §6.2); we answer it as IN with AA, as Knot and BIND do.
/// - Additional records of SRV answers against NSD: with `minimal-responses` NSD leaves some
///   targets' addresses out; ours must hold at least NSD's.
/// - Additional records of SRV answers cut to fit: the records rotate, so which glue is cut
///   differs; as many must fit as Knot fits.
fn explained(
    reference: &str,
    what: &str,
    rtype: RecordType,
    class: DNSClass,
    ours: &Option<Result<Wire, String>>,
    theirs: &Option<Result<Wire, String>>,
) -> bool {
    let (mut ours, mut theirs) = match (ours, theirs) {
        (Some(Ok(ours)), Some(Ok(theirs))) => (ours.clone(), theirs.clone()),
        (Some(Ok(ours)), None) if reference == "knot" && what == "a header without a question" => {
            return ours.rcode == "Form Error";
        }
        (ours, theirs) => return ours == theirs,
    };
    if ours.rcode == "Not Implemented" {
        for wire in [&mut ours, &mut theirs] {
            (wire.edns, wire.question) = (None, Vec::new());
        }
    }
    if rtype == RecordType::ANY {
        for wire in [&mut ours, &mut theirs] {
            (wire.tc, wire.answer, wire.additional) = (false, Vec::new(), Vec::new());
        }
    }
    if reference == "nsd" && class == DNSClass::ANY {
        theirs.aa = ours.aa;
        theirs.authority.clone_from(&ours.authority);
    }
    if rtype == RecordType::SRV && ours.additional != theirs.additional {
        let holds_theirs = theirs.additional.iter().all(|g| ours.additional.contains(g));
        let as_many = ours.additional.len() == theirs.additional.len();
        if (reference == "nsd" && holds_theirs) || (reference == "knot" && as_many) {
            theirs.additional.clone_from(&ours.additional);
        }
    }
    ours == theirs
}

/// A few hundred generated queries (names in, below and beside the zone's, types, classes,
/// EDNS sizes, DO/CD/RD, malformed headers, the server's own CH names) go to NSD, to Knot
/// and to koder-dns serving the same names; every difference from either fails the test but
/// those [`explained`] allows, each with its reason. Seeded, so a failure reproduces. Then
/// the replies every query with an OPT record gets carry one on all three (a TSIG key none
/// knows, AXFR), and the glue of 20 SRV records over UDP fits as Knot fits it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs dig, nsd and knotd (installed by tests/run.sh)"]
async fn koder_dns_answers_as_nsd_and_knot_do() {
    use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query};
    use hickory_proto::rr::Name;
    use std::str::FromStr;

    let server = common::start_with(|c| {
        c.dns_identity = "node-a".into();
        c.allow_transfer = vec!["127.0.0.0/8".parse().unwrap()];
    })
    .await;
    let mut instances: Vec<(String, String, String, u16, String)> = [
        ("voice", "voice-1", "10.0.0.1", 5060, "tcp"),
        ("voice", "voice-2", "10.0.0.2", 5061, "tcp"),
        ("voice", "voice-u", "10.0.0.3", 5060, "udp"),
        ("web", "web-6", "2001:db8::1", 443, "tcp"),
        ("web", "web-4", "10.0.1.1", 443, "tcp"),
        // An SRV target that is a name of the zone: its addresses are glue.
        ("api", "api-1", "web.service.koder", 8443, "tcp"),
    ]
    .iter()
    .map(|(n, i, a, p, pr)| (n.to_string(), i.to_string(), a.to_string(), *p, pr.to_string()))
    .collect();
    // 40 instances: a set that does not fit 512 bytes, and its glue not 1232; 20: a set
    // that fits 1232 bytes with as much of its glue as compression allows.
    for (name, n) in [("big", 40), ("mid", 20)] {
        for i in 1..=n {
            let subnet = if name == "big" { 2 } else { 4 };
            instances.push((
                name.into(),
                format!("{name}-{i}"),
                format!("10.0.{subnet}.{i}"),
                8000,
                "tcp".into(),
            ));
        }
    }
    for (name, id, address, port, protocol) in &instances {
        server
            .register(json!({"name": name, "id": id, "address": address, "port": port, "protocol": protocol}))
            .await;
    }
    server
        .register(json!({"name": "sick", "id": "sick-1", "address": "10.0.3.1", "port": 1, "healthy": false}))
        .await;

    // The zone file: the same records, written from the registrations, not read back.
    let soa = server.query_tcp("service.koder.", RecordType::SOA).await;
    let soa = soa.answers[0].to_string();
    let ns = server.query_tcp("service.koder.", RecordType::NS).await;
    let mut zone = format!("{soa}\n{}\nns.service.koder. 3600 IN A 127.0.0.1\n", ns.answers[0]);
    let hex = |ip: std::net::IpAddr| match ip {
        std::net::IpAddr::V4(v4) => v4.octets().iter().map(|b| format!("{b:02x}")).collect::<String>(),
        std::net::IpAddr::V6(v6) => v6.octets().iter().map(|b| format!("{b:02x}")).collect::<String>(),
    };
    for (name, id, address, port, protocol) in &instances {
        let srv_owner = format!("_{name}._{protocol}.service.koder.");
        zone += &format!("{name}.service.koder. 5 IN TXT \"id={id}\"\n");
        zone += &format!("{srv_owner} 5 IN TXT \"id={id}\"\n");
        let Ok(ip) = address.parse::<std::net::IpAddr>() else {
            zone += &format!("{srv_owner} 5 IN SRV 10 100 {port} {address}.\n");
            continue;
        };
        let rtype = if ip.is_ipv4() { "A" } else { "AAAA" };
        let target = format!("{}.addr.service.koder.", hex(ip));
        zone += &format!("{srv_owner} 5 IN SRV 10 100 {port} {target}\n");
        zone += &format!("{target} 3600 IN {rtype} {address}\n");
        zone += &format!("{name}.service.koder. 5 IN {rtype} {address}\n");
    }
    let references = [
        start_reference("nsd", &zone, "node-a").await,
        start_reference("knot", &zone, "node-a").await,
    ];

    let names = [
        "service.koder.",
        "ns.service.koder.",
        "voice.service.koder.",
        "VOICE.service.KODER.",
        "_voice._tcp.service.koder.",
        "_voice._udp.service.koder.",
        "_web._tcp.service.koder.",
        "web.service.koder.",
        "_api._tcp.service.koder.",
        "api.service.koder.",
        "_big._tcp.service.koder.",
        "big.service.koder.",
        "_mid._tcp.service.koder.",
        "_tcp.service.koder.",
        "_udp.service.koder.",
        "addr.service.koder.",
        "0a000001.addr.service.koder.",
        "20010db8000000000000000000000001.addr.service.koder.",
        "sick.service.koder.",
        "nosuch.service.koder.",
        "below.voice.service.koder.",
        "x._voice._tcp.service.koder.",
        "voice2.service.koder.",
        "_voice._sctp.service.koder.",
        "example.org.",
        "koder.",
        "id.server.",
        "hostname.bind.",
        "version.bind.",
        "version.server.",
    ];
    let types = [
        RecordType::A,
        RecordType::AAAA,
        RecordType::SRV,
        RecordType::TXT,
        RecordType::SOA,
        RecordType::NS,
        RecordType::MX,
        RecordType::CNAME,
        RecordType::PTR,
        RecordType::ANY,
    ];
    let mut rng = fastrand::Rng::with_seed(12);
    let started = Instant::now();
    let mut differences = Vec::new();
    let mut compared = 0;
    for i in 0..500u16 {
        let name = names[rng.usize(..names.len())];
        let chaos = name.ends_with(".server.") || name.ends_with(".bind.");
        let rtype = if chaos {
            RecordType::TXT
        } else {
            types[rng.usize(..types.len())]
        };
        let class = match (chaos, rng.u8(..10)) {
            (true, _) => DNSClass::CH,
            (false, 0 | 1) => DNSClass::ANY,
            (false, 2) => DNSClass::CH,
            _ => DNSClass::IN,
        };
        let mut message = Message::new(i, MessageType::Query, OpCode::Query);
        message.metadata.recursion_desired = rng.bool();
        message.metadata.checking_disabled = rng.bool();
        let mut query = Query::query(Name::from_str(name).unwrap(), rtype);
        query.set_query_class(class);
        message.add_query(query);
        if let Some(payload) = [None, Some(512u16), Some(1232), Some(4096)][rng.usize(..4)] {
            let mut edns = Edns::new();
            edns.set_max_payload(payload).set_dnssec_ok(rng.bool());
            message.set_edns(edns);
        }
        let mut bytes = message.to_vec().unwrap();
        let what = match rng.u8(..20) {
            0 => {
                bytes.truncate(rng.usize(..12));
                "a datagram shorter than a header"
            }
            1 => {
                bytes[5] = 0; // no question
                bytes.truncate(12);
                "a header without a question"
            }
            2 => {
                bytes[2] = (bytes[2] & 0x87) | (2 << 3); // opcode STATUS
                "opcode STATUS"
            }
            3 => {
                bytes[2] |= 0x80; // QR: a response
                "a response"
            }
            _ => "a query",
        };
        let wait = Duration::from_millis(500);
        let (ours, nsd, knot) = tokio::join!(
            common::udp_raw(server.dns(), &bytes, wait),
            common::udp_raw(references[0].addr, &bytes, wait),
            common::udp_raw(references[1].addr, &bytes, wait),
        );
        let ours = Wire::of(ours);
        for (reference, theirs) in [("nsd", nsd), ("knot", knot)] {
            let theirs = Wire::of(theirs);
            compared += 1;
            if !explained(reference, what, rtype, class, &ours, &theirs) {
                differences.push(format!(
                    "#{i} {what}: {name} {class} {rtype}\n koder-dns: {ours:?}\n {reference}: {theirs:?}"
                ));
            }
        }
    }
    assert!(
        started.elapsed() < Duration::from_secs(75),
        "took {:?}",
        started.elapsed()
    );
    assert!(
        differences.is_empty(),
        "{} of {compared} comparisons differ:\n{}",
        differences.len(),
        differences.join("\n")
    );

    // Glue packing: 20 SRV over UDP at 1232 bytes, and as many of their addresses as fit;
    // Knot compresses each address's owner into its SRV target, and so must we.
    let mid = dig(
        server.dns(),
        &["+nocookie", "+bufsize=1232", "SRV", "_mid._tcp.service.koder"],
    )
    .await;
    let knot_mid = dig(
        references[1].addr,
        &["+nocookie", "+bufsize=1232", "SRV", "_mid._tcp.service.koder"],
    )
    .await;
    assert_eq!(mid.answer.len(), 20, "{}", mid.raw);
    assert_eq!(
        mid.additional.len(),
        knot_mid.additional.len(),
        "{}\n{}",
        mid.raw,
        knot_mid.raw
    );
    assert!(mid.additional.len() >= 14, "{}", mid.raw);
    // An SRV target in the zone: its A and AAAA, as both give them (NSD with
    // minimal-responses too).
    let api = dig(server.dns(), &["SRV", "_api._tcp.service.koder"]).await;
    for reference in &references {
        let theirs = dig(reference.addr, &["SRV", "_api._tcp.service.koder"]).await;
        let strip = |d: &Dig| {
            let mut glue: Vec<String> = d.additional.iter().map(|r| r.join(" ")).collect();
            glue.sort();
            glue
        };
        if reference.name == "knot" {
            assert_eq!(strip(&api), strip(&theirs), "{}\n{}", api.raw, theirs.raw);
        } else {
            assert!(
                strip(&theirs).iter().all(|g| strip(&api).contains(g)),
                "{}\n{}",
                api.raw,
                theirs.raw
            );
        }
    }
    assert_eq!(Dig::of_type(&api.additional, "A").len(), 1, "{}", api.raw);
    assert_eq!(Dig::of_type(&api.additional, "AAAA").len(), 1, "{}", api.raw);

    // An OPT record in every reply to a query with one: NOTAUTH/BADKEY for a key nobody
    // knows, and the AXFR messages.
    let unknown_key = "hmac-sha256:nobody.:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    let mut servers = vec![("koder-dns", server.dns())];
    servers.extend(references.iter().map(|r| (r.name, r.addr)));
    for (who, addr) in servers {
        let badkey = dig(addr, &["-y", unknown_key, "+nocookie", "A", "voice.service.koder"]).await;
        assert_eq!(badkey.status, "NOTAUTH", "{who}: {}", badkey.raw);
        assert!(
            badkey.raw.contains("; EDNS: version: 0"),
            "{who}: no OPT in\n{}",
            badkey.raw
        );
        let mut axfr = crate::transfer::transfer_request(RecordType::AXFR, None);
        axfr.set_edns(hickory_proto::op::Edns::new());
        let messages = crate::transfer::transfer(addr, &axfr).await;
        assert!(
            messages.len() == 1 && messages[0].answers.len() > 100,
            "{who}: {messages:?}"
        );
        assert!(
            messages.iter().all(|m| m.edns.is_some()),
            "{who}: no OPT in {messages:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// HAProxy 2.6 over SRV: a partial SRV set must never become the backend

/// What HAProxy's stats socket answers to `command`.
async fn haproxy_cli(socket: &Path, command: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::UnixStream::connect(socket).await.ok()?;
    stream.write_all(format!("{command}\n").as_bytes()).await.ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await.ok()?;
    Some(text)
}

/// The addresses HAProxy's servers hold now, from `show servers state` on its stats socket.
async fn haproxy_addresses(socket: &Path) -> Option<Vec<String>> {
    let text = haproxy_cli(socket, "show servers state be").await?;
    // Columns: be_id be_name srv_id srv_name srv_addr ...; a server without an address
    // holds 0.0.0.0 (init-addr none).
    let mut addresses: Vec<String> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty() && l.split(' ').count() > 5)
        .filter_map(|l| l.split(' ').nth(4).map(str::to_owned))
        .filter(|a| a != "0.0.0.0" && a != "-")
        .collect();
    addresses.sort();
    Some(addresses)
}

/// HAProxy 2.6 with `server-template` over SRV and default resolver settings (it asks
/// with a 512-byte EDNS buffer and ignores TC) against a 35-instance service: a partial
/// set taken for the whole made it change servers hundreds of times. Now the server set
/// is either whole and stable, or empty with an error in its log, never partial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs haproxy (installed by tests/run.sh)"]
async fn haproxy_server_template_gets_a_stable_set_or_a_loud_error() {
    let haproxy = tool("haproxy", "haproxy");
    let server = common::start().await;
    for i in 1..=35 {
        server
            .register(json!({"name": "big", "id": format!("big-{i}"), "address": format!("10.0.2.{i}"), "port": 8000}))
            .await;
    }
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("stats.sock");
    let conf = format!(
        r#"global
    log stderr format raw local0 info
    stats socket {socket} mode 600 level admin
defaults
    mode tcp
    log global
    timeout connect 1s
    timeout client 5s
    timeout server 5s
resolvers koder
    nameserver koder {dns}
backend be
    server-template srv 40 _big._tcp.service.koder resolvers koder init-addr none
frontend fe
    bind 127.0.0.1:{port}
    default_backend be
"#,
        socket = socket.display(),
        dns = server.dns(),
        port = free_port(),
    );
    let conf_path = dir.path().join("haproxy.cfg");
    std::fs::write(&conf_path, conf).unwrap();
    let log_path = dir.path().join("haproxy.log");
    let mut child = tokio::process::Command::new(haproxy)
        .arg("-db")
        .arg("-f")
        .arg(&conf_path)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(dir.path().join("haproxy.out")).unwrap())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .kill_on_drop(true)
        .spawn()
        .expect("start haproxy");
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    // Default resolver settings resolve every second: eight seconds see several rounds.
    let mut seen = Vec::new();
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(8) {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("haproxy exited with {status}:\n{}", log());
        }
        if let Some(addresses) = haproxy_addresses(&socket).await {
            seen.push(addresses);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let resolvers = haproxy_cli(&socket, "show resolvers koder").await.unwrap_or_default();
    let _ = child.start_kill();
    let log = format!("{}\nshow resolvers koder:\n{resolvers}", log());
    assert!(
        seen.len() > 10,
        "the stats socket answered {} times:\n{log}",
        seen.len()
    );
    let partial: Vec<usize> = seen.iter().map(Vec::len).filter(|&n| n != 0 && n != 35).collect();
    assert!(partial.is_empty(), "partial server sets {partial:?}:\n{log}");
    let whole = seen.iter().filter(|s| s.len() == 35).count();
    if whole > 0 {
        // Once whole, it stays so, with the same addresses.
        let first = seen.iter().position(|s| s.len() == 35).unwrap();
        assert!(
            seen[first..].iter().all(|s| *s == seen[first]),
            "the set changed:\n{log}"
        );
    } else {
        // No server at all: the resolver's error counters say why (the TC reply with an
        // empty answer counts as `any_err` in HAProxy 2.6), and no answer counted as valid.
        let counter = |name: &str| -> u64 {
            resolvers
                .lines()
                .find_map(|l| l.trim().strip_prefix(&format!("{name}:")))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        let errors: u64 = ["any_err", "truncated", "invalid", "too_big", "other"]
            .iter()
            .map(|c| counter(c))
            .sum();
        assert!(
            errors > 0 && counter("valid") == 0,
            "no server and no resolver error:\n{log}"
        );
    }
    eprintln!(
        "haproxy: {} samples, {whole} with the whole set; log:\n{log}",
        seen.len()
    );
}

/// unbound stubbing the service zone to `dot` over TLS, trusting the CA in `ca` for the name
/// `localhost`.
async fn start_unbound_over_tls(dot: SocketAddr, ca: &Path) -> Unbound {
    start_unbound_with(
        &format!(
            "    stub-addr: {}@{}#localhost\n    stub-tls-upstream: yes",
            dot.ip(),
            dot.port()
        ),
        &format!("    tls-cert-bundle: \"{}\"", ca.display()),
    )
    .await
}

/// RFC 7858 end to end: unbound forwards the service zone to `--dot-listen` over TLS,
/// checking the certificate against a private CA (`tls-cert-bundle`) and the name it was
/// issued for, and resolves what was registered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs dig and unbound (installed by the README test command)"]
async fn unbound_resolves_the_service_zone_over_dns_over_tls() {
    let pki = common::Pki::new();
    let server = common::start_https(&pki, |_| {}).await;
    server
        .register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060}))
        .await;
    let dot = server.running.dot_addr.expect("DNS over TLS is on");
    let unbound = start_unbound_over_tls(dot, &pki.ca_path).await;
    let srv = dig(unbound.addr, &["SRV", "_voice._tcp.service.koder"]).await;
    assert_eq!(srv.status, "NOERROR", "{}\n{}", srv.raw, unbound.log());
    let got: Vec<String> = Dig::of_type(&srv.answer, "SRV")
        .iter()
        .map(|r| r[4..].join(" "))
        .collect();
    assert_eq!(got, ["10 100 5060 0a000001.addr.service.koder."], "{}", srv.raw);
    let scrape = common::scrape(&server.http, &server.base).await;
    assert!(
        common::sample(
            &scrape,
            r#"koder_dns_dns_queries_total{qtype="SRV",rcode="NOERROR",transport="tls"}"#
        ) >= 1.0,
        "the answer went over TLS: {scrape}"
    );
    // The same resolver refuses a server whose certificate its CA did not sign.
    let stranger = common::Pki::new();
    let other = common::start_https(&stranger, |_| {}).await;
    other
        .register(json!({"name": "voice", "address": "10.9.9.9", "port": 5060}))
        .await;
    let dot = other.running.dot_addr.unwrap();
    let refusing = start_unbound_over_tls(dot, &pki.ca_path).await;
    let srv = dig(refusing.addr, &["SRV", "_voice._tcp.service.koder"]).await;
    assert_eq!(
        srv.status, "SERVFAIL",
        "an unverified upstream is not used: {}",
        srv.raw
    );
}
