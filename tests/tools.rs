//! End-to-end tests with real tools (issue #3): `dig` against the in-process server, and
//! Debian's `unbound` as a real resolver with a stub zone pointed at it.
//!
//! Run them with `cargo test --test tools -- --ignored` (the README test command installs
//! bind9-dnsutils and unbound first). A missing tool fails the test loudly; nothing here
//! is skipped silently.

mod common;

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::TestServer;
use serde_json::json;

// ---------------------------------------------------------------------------------------
// tools

/// The path of an installed tool; panics with what to install when it is missing.
fn tool(name: &str, package: &str) -> PathBuf {
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
struct Dig {
    raw: String,
    status: String,
    flags: Vec<String>,
    answer: Vec<Vec<String>>,
    authority: Vec<Vec<String>>,
    additional: Vec<Vec<String>>,
    msg_size: Option<usize>,
}

impl Dig {
    fn parse(raw: String) -> Self {
        let mut dig = Dig { raw: raw.clone(), ..Dig::default() };
        let mut section: Option<&str> = None;
        for line in raw.lines() {
            let line = line.trim();
            if let Some(rest) = line.split("status: ").nth(1) {
                dig.status = rest.split(',').next().unwrap_or_default().trim().to_owned();
            }
            if let Some(rest) = line.strip_prefix(";; flags:") {
                dig.flags = rest.split(';').next().unwrap_or_default().split_whitespace().map(str::to_owned).collect();
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

    fn of_type<'a>(records: &'a [Vec<String>], rtype: &str) -> Vec<&'a Vec<String>> {
        records.iter().filter(|r| r.get(3).is_some_and(|t| t == rtype)).collect()
    }

    fn has_flag(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }
}

/// Runs dig with `args` against `server`, and parses what it prints.
async fn dig(server: SocketAddr, args: &[&str]) -> Dig {
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
    assert!(output.status.success() || !text.is_empty(), "dig {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
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
    server.register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060, "priority": 5, "weight": 20})).await;
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
        assert_eq!(srv[0][4..], ["5", "20", "5060", "0a000001.addr.service.koder."], "{args:?}:\n{}", out.raw);
        let glue = Dig::of_type(&out.additional, "A");
        assert_eq!(glue.len(), 1, "{args:?}: glue:\n{}", out.raw);
        assert_eq!((glue[0][0].as_str(), glue[0][4].as_str()), ("0a000001.addr.service.koder.", "10.0.0.1"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs dig and unbound (installed by the README test command)"]
async fn dig_shows_a_txt_soa_ns_and_negative_answers() {
    let server = common::start().await;
    server.register(json!({"name": "voice", "id": "v1", "address": "10.0.0.1", "port": 5060, "metadata": {"codec": "opus"}})).await;
    let a = dig_auth(&server, &["A", "voice.service.koder"]).await;
    assert_eq!(a.status, "NOERROR", "{}", a.raw);
    assert_eq!(Dig::of_type(&a.answer, "A").iter().map(|r| r[4].as_str()).collect::<Vec<_>>(), ["10.0.0.1"], "{}", a.raw);

    let txt = dig_auth(&server, &["TXT", "voice.service.koder"]).await;
    assert_eq!(txt.answer.len(), 1, "{}", txt.raw);
    assert_eq!(txt.answer[0][4..], ["\"id=v1\"", "\"codec=opus\""], "{}", txt.raw);

    let soa = dig_auth(&server, &["SOA", "service.koder"]).await;
    assert!(soa.has_flag("aa"), "{}", soa.raw);
    assert_eq!(Dig::of_type(&soa.answer, "SOA")[0][4], "ns.service.koder.", "{}", soa.raw);
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
        assert!(udp.msg_size.is_some_and(|s| s <= 512), "{bufsize}: at most 512 bytes:\n{}", udp.raw);
        assert!(!udp.answer.is_empty(), "{bufsize}: a partial answer, not an empty one:\n{}", udp.raw);
        assert!(udp.answer.len() < 300);
        assert!(Dig::of_type(&udp.additional, "A").is_empty(), "{bufsize}: no glue when answers were cut:\n{}", udp.raw);

        // Plain dig retries over TCP by itself and gets everything.
        let retried = dig_auth(&server, &[bufsize, "SRV", name]).await;
        assert!(retried.raw.contains("Truncated, retrying in TCP mode"), "{bufsize}: dig retries over TCP:\n{}", retried.raw);
        assert_eq!(Dig::of_type(&retried.answer, "SRV").len(), 300, "{bufsize}: all 300 over TCP");
        assert_eq!(Dig::of_type(&retried.additional, "A").len(), 300, "{bufsize}: all 300 glue records over TCP");
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
    assert!(udp.raw.contains("OPT PSEUDOSECTION"), "EDNS answered with OPT:\n{}", udp.raw);
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
fn free_port() -> u16 {
    for _ in 0..50 {
        let udp = UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = udp.local_addr().unwrap().port();
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port for both UDP and TCP");
}

struct Unbound {
    child: tokio::process::Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
    log: PathBuf,
}

impl Drop for Unbound {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

impl Unbound {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

fn unbound_conf(dir: &Path, port: u16, koder: SocketAddr, extra: &str) -> String {
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
    module-config: "iterator"
    domain-insecure: "service.koder."
    local-zone: "service.koder." transparent
{extra}
remote-control:
    control-enable: no

stub-zone:
    name: "service.koder."
    stub-addr: {ip}@{kport}
"#,
        ip = koder.ip(),
        kport = koder.port(),
    )
}

/// Starts unbound on a free loopback port, resolving `service.koder.` through `koder`.
async fn start_unbound(koder: SocketAddr, extra: &str) -> Unbound {
    let unbound = tool("unbound", "unbound");
    let checkconf = tool("unbound-checkconf", "unbound");
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let conf = dir.path().join("unbound.conf");
    std::fs::write(&conf, unbound_conf(dir.path(), port, koder, extra)).unwrap();
    let check = tokio::process::Command::new(checkconf).arg(&conf).output().await.expect("run unbound-checkconf");
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
    let mut server = Unbound { child, addr: SocketAddr::from(([127, 0, 0, 1], port)), log: dir.path().join("unbound.log"), _dir: dir };
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
        assert!(Instant::now() < deadline, "unbound did not answer within 5 s:\n{}", server.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    server
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs dig and unbound (installed by the README test command)"]
async fn unbound_resolves_srv_and_a_through_a_stub_zone() {
    let server = common::start().await;
    server.register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060})).await;
    server.register(json!({"name": "voice", "address": "10.0.0.2", "port": 5061})).await;
    let unbound = start_unbound(server.dns(), "").await;

    // Normal dig: RD set, as a stub resolver would ask.
    let srv = dig(unbound.addr, &["SRV", "_voice._tcp.service.koder"]).await;
    assert_eq!(srv.status, "NOERROR", "{}\n{}", srv.raw, unbound.log());
    assert!(srv.has_flag("ra"), "a recursive answer: {}", srv.raw);
    assert!(!srv.has_flag("aa"), "unbound is not authoritative: {}", srv.raw);
    let mut got: Vec<String> = Dig::of_type(&srv.answer, "SRV").iter().map(|r| r[4..].join(" ")).collect();
    got.sort();
    assert_eq!(got, ["10 100 5060 0a000001.addr.service.koder.", "10 100 5061 0a000002.addr.service.koder."], "{}", srv.raw);

    let a = dig(unbound.addr, &["A", "voice.service.koder"]).await;
    assert_eq!(a.status, "NOERROR", "{}", a.raw);
    let mut addrs: Vec<&str> = Dig::of_type(&a.answer, "A").iter().map(|r| r[4].as_str()).collect();
    addrs.sort();
    assert_eq!(addrs, ["10.0.0.1", "10.0.0.2"], "{}", a.raw);

    // The SRV target resolves too.
    let target = dig(unbound.addr, &["A", "0a000001.addr.service.koder"]).await;
    assert_eq!(Dig::of_type(&target.answer, "A").iter().map(|r| r[4].as_str()).collect::<Vec<_>>(), ["10.0.0.1"], "{}", target.raw);

    let nx = dig(unbound.addr, &["SRV", "_unknown._tcp.service.koder"]).await;
    assert_eq!(nx.status, "NXDOMAIN", "{}\n{}", nx.raw, unbound.log());
    assert_eq!(Dig::of_type(&nx.authority, "SOA").len(), 1, "the SOA comes through the resolver:\n{}", nx.raw);

    let nx = dig(unbound.addr, &["A", "unknown.service.koder"]).await;
    assert_eq!(nx.status, "NXDOMAIN", "{}", nx.raw);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs dig and unbound (installed by the README test command)"]
async fn unbound_sees_an_instance_go_after_its_ttl() {
    let server = common::start_with(|c| c.dns_ttl = std::time::Duration::from_secs(1)).await;
    server.register(json!({"name": "voice", "id": "v1", "address": "10.0.0.1", "port": 5060})).await;
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
    server.register(json!({"name": "voice", "address": "10.0.0.1", "port": 5060})).await;
    let unbound = start_unbound(server.dns(), "    qname-minimisation: yes\n    qname-minimisation-strict: yes\n").await;
    let srv = dig(unbound.addr, &["SRV", "_voice._tcp.service.koder"]).await;
    assert_eq!(srv.status, "NOERROR", "{}\n{}", srv.raw, unbound.log());
    assert_eq!(Dig::of_type(&srv.answer, "SRV").len(), 1, "{}", srv.raw);
    let target = dig(unbound.addr, &["A", "0a000001.addr.service.koder"]).await;
    assert_eq!(target.status, "NOERROR", "{}", target.raw);
}
