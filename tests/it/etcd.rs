//! Several nodes on etcd (`--store etcd`), end to end: a real 3-member etcd cluster
//! (Debian's etcd-server) and 3 koder-dns child processes, all on ephemeral loopback ports,
//! with faults injected by killing processes.
//!
//! The binary under test must be built with `--features etcd` (tests/run.sh does); without
//! it these tests fail at the first node's start with the message telling how to build one.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use serde_json::{Value, json};

use crate::child::{KEY, Proc, Started, launch_ok};
use crate::common;

const ETCD: &str = "/usr/bin/etcd";
const ETCDCTL: &str = "/usr/bin/etcdctl";
const SECOND: i64 = 1_000_000_000;

/// The etcd tests start 3 etcd members and 3 nodes each: one at a time, so that two of them
/// never share the machine's two cores.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Member {
    name: String,
    client: u16,
    peer: u16,
    dir: PathBuf,
    child: Option<Child>,
}

/// A 3-member etcd cluster on loopback, killed when dropped.
struct Cluster {
    members: Vec<Member>,
    initial: String,
    /// Set for a cluster started by [`Cluster::start_secured`].
    secured: Option<Secured>,
    _tmp: tempfile::TempDir,
}

/// How a cluster runs as production ones do: TLS on its client URLs with a certificate from
/// a private CA, client certificates required (`--client-cert-auth`), and auth enabled with
/// a user `koder` whose one role grants readwrite on [`SECURED_PREFIX`] and nothing else.
/// Its auth tokens are JWTs valid for [`TOKEN_TTL`] only, so a test sees them expire.
struct Secured {
    pki: common::Pki,
    /// etcd's own certificate and key.
    server: (PathBuf, PathBuf),
    /// The client certificate of the nodes and of etcdctl. Its CN names no etcd user, so
    /// nothing gets in by the certificate alone.
    client: (PathBuf, PathBuf),
    /// The key pair etcd signs its JWT auth tokens with.
    jwt: (PathBuf, PathBuf),
}

const SECURED_PREFIX: &str = "/koder-dns/";
const ROOT_PASSWORD: &str = "root-pw-of-the-test";
const KODER_PASSWORD: &str = "koder-pw-7b1d3e0f2a";
/// etcd's token TTL in the secured cluster: a node outlives many.
const TOKEN_TTL: &str = "2s";

impl Secured {
    fn new() -> Self {
        let pki = common::Pki::new();
        let server = pki.issue("etcd", 1);
        let client = pki.issue_client("node", "koder-dns-node");
        let jwt_key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let jwt = (pki.dir.path().join("jwt.pub"), pki.dir.path().join("jwt.key"));
        std::fs::write(&jwt.0, jwt_key.public_key_pem()).unwrap();
        std::fs::write(&jwt.1, jwt_key.serialize_pem()).unwrap();
        Self {
            pki,
            server,
            client,
            jwt,
        }
    }

    /// A client of etcd's HTTP endpoints (`/health`) with the client certificate.
    fn http(&self) -> reqwest::Client {
        let mut pem = std::fs::read(&self.client.0).unwrap();
        pem.extend(std::fs::read(&self.client.1).unwrap());
        koder_dns::tls::trusting(crate::common::http_builder(), Some(&self.pki.ca_path))
            .unwrap()
            .identity(reqwest::Identity::from_pem(&pem).unwrap())
            .timeout(Duration::from_secs(1))
            .build()
            .unwrap()
    }
}

impl Cluster {
    async fn start() -> Self {
        Self::start_with(None).await
    }

    /// A [`Secured`] cluster, its user and role made with etcdctl as the README says.
    async fn start_secured() -> Self {
        let cluster = Self::start_with(Some(Secured::new)).await;
        // Before `auth enable`, etcd asks for no user.
        cluster.etcdctl(&[], &["user", "add", "root", "--new-user-password", ROOT_PASSWORD]);
        cluster.etcdctl(&[], &["role", "add", "koder"]);
        cluster.etcdctl(
            &[],
            &[
                "role",
                "grant-permission",
                "koder",
                "readwrite",
                SECURED_PREFIX,
                "--prefix=true",
            ],
        );
        cluster.etcdctl(&[], &["user", "add", "koder", "--new-user-password", KODER_PASSWORD]);
        cluster.etcdctl(&[], &["user", "grant-role", "koder", "koder"]);
        cluster.etcdctl(&[], &["auth", "enable"]);
        cluster
    }

    async fn start_with(secured: Option<fn() -> Secured>) -> Self {
        assert!(
            Path::new(ETCD).exists(),
            "{ETCD} is missing: install Debian's etcd-server (tests/run.sh does)"
        );
        // `free_port` lets its port go before etcd binds it, and a test running in parallel
        // can take it in between: then start again on other ports.
        for attempt in 1.. {
            let cluster = Self::spawn_all(secured.map(|make| make()));
            match cluster.healthy().await {
                Ok(()) => return cluster,
                Err(log) if attempt < 3 && log.contains("address already in use") => continue,
                Err(log) => panic!("{log}"),
            }
        }
        unreachable!()
    }

    /// Runs etcdctl against the cluster (with its CA and client certificate when secured) as
    /// `user` (`["--user", NAME]`, the password from `ETCDCTL_PASSWORD`, or none); returns
    /// its output, panicking unless it succeeded.
    fn etcdctl(&self, user: &[&str], args: &[&str]) -> String {
        let out = self.etcdctl_output(user, args);
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn etcdctl_output(&self, user: &[&str], args: &[&str]) -> std::process::Output {
        let mut cmd = Command::new(ETCDCTL);
        cmd.arg("--endpoints").arg(self.endpoints()).args(user).args(args);
        if let Some(secured) = &self.secured {
            cmd.arg("--cacert")
                .arg(&secured.pki.ca_path)
                .arg("--cert")
                .arg(&secured.client.0)
                .arg("--key")
                .arg(&secured.client.1);
        }
        match user {
            [_, "root"] => cmd.env("ETCDCTL_PASSWORD", ROOT_PASSWORD),
            [_, "koder"] => cmd.env("ETCDCTL_PASSWORD", KODER_PASSWORD),
            _ => cmd.env_remove("ETCDCTL_PASSWORD"),
        };
        cmd.env("ETCDCTL_API", "3")
            .output()
            .expect("run etcdctl (Debian's etcd-client; tests/run.sh installs it)")
    }

    fn spawn_all(secured: Option<Secured>) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let members: Vec<Member> = (0..3)
            .map(|i| Member {
                name: format!("m{i}"),
                client: free_port(),
                peer: free_port(),
                dir: tmp.path().join(format!("m{i}")),
                child: None,
            })
            .collect();
        let initial = members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = Self {
            members,
            initial,
            secured,
            _tmp: tmp,
        };
        for i in 0..3 {
            cluster.spawn(i);
        }
        cluster
    }

    fn spawn(&mut self, i: usize) {
        let m = &self.members[i];
        let client = format!("{}://127.0.0.1:{}", self.scheme(), m.client);
        let peer = format!("http://127.0.0.1:{}", m.peer);
        let log = std::fs::File::create(m.dir.with_extension("log")).unwrap();
        let mut etcd = Command::new(ETCD);
        if let Some(secured) = &self.secured {
            etcd.arg("--cert-file")
                .arg(&secured.server.0)
                .arg("--key-file")
                .arg(&secured.server.1)
                .arg("--trusted-ca-file")
                .arg(&secured.pki.ca_path)
                .arg("--client-cert-auth")
                .arg(format!(
                    "--auth-token=jwt,pub-key={},priv-key={},sign-method=ES256,ttl={TOKEN_TTL}",
                    secured.jwt.0.display(),
                    secured.jwt.1.display()
                ));
        }
        let child = etcd
            .args(["--name", &m.name])
            .arg("--data-dir")
            .arg(&m.dir)
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &self.initial, "--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "koder-dns-test"])
            // Fast elections, so a killed member is replaced within a second.
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--logger", "zap", "--log-outputs", "stderr"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        self.members[i].child = Some(child);
    }

    fn scheme(&self) -> &'static str {
        if self.secured.is_some() { "https" } else { "http" }
    }

    fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}://127.0.0.1:{}", self.scheme(), m.client))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The endpoint of member `i` alone (a node given only it is cut off when it stops).
    fn endpoint(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[i].client)
    }

    /// Every put under `prefix` since the cluster started, as (key, value), in order: its
    /// history as etcd keeps it (`etcdctl watch` from revision 1).
    fn history_of_puts(&self, prefix: &str) -> Vec<(String, String)> {
        assert!(
            Path::new(ETCDCTL).exists(),
            "{ETCDCTL} is missing: install Debian's etcd-client (tests/run.sh does)"
        );
        let out = Command::new("timeout")
            .args([
                "3",
                ETCDCTL,
                "--endpoints",
                &self.endpoints(),
                "watch",
                "--prefix",
                prefix,
                "--rev",
                "1",
            ])
            .output()
            .expect("run etcdctl");
        let text = String::from_utf8(out.stdout).unwrap();
        assert!(
            !text.is_empty(),
            "etcdctl watch printed nothing: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut lines = text.lines();
        let mut puts = Vec::new();
        while let Some(line) = lines.next() {
            if line == "PUT"
                && let (Some(key), Some(value)) = (lines.next(), lines.next())
            {
                puts.push((key.to_owned(), value.to_owned()));
            }
        }
        puts
    }

    /// The member that leads the Raft group now, as the running members say.
    async fn leader(&self) -> usize {
        let client = reqwest::Client::new();
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            let url = format!("http://127.0.0.1:{}/v3/maintenance/status", m.client);
            let Ok(response) = client.post(&url).body("{}").send().await else {
                continue;
            };
            let status: Value = response.json().await.unwrap_or_default();
            let id = |v: &Value| v.as_str().unwrap_or_default().to_owned();
            if id(&status["leader"]) == id(&status["header"]["member_id"]) && !id(&status["leader"]).is_empty() {
                return self.members.iter().position(|n| n.name == m.name).unwrap();
            }
        }
        panic!("no etcd member says it leads");
    }

    fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }

    /// Every running member healthy (it has a leader) within 20 s, or the log of the first
    /// that is not.
    async fn healthy(&self) -> Result<(), String> {
        let client = match &self.secured {
            Some(secured) => secured.http(),
            None => crate::common::http_builder()
                .timeout(Duration::from_secs(1))
                .build()
                .unwrap(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        for m in self.members.iter().filter(|m| m.child.is_some()) {
            loop {
                let url = format!("{}://127.0.0.1:{}/health", self.scheme(), m.client);
                if let Ok(r) = client.get(&url).send().await
                    && r.text().await.unwrap_or_default().contains("true")
                {
                    break;
                }
                if Instant::now() >= deadline {
                    return Err(format!(
                        "etcd member {} not healthy within 20s; its log:\n{}",
                        m.name,
                        std::fs::read_to_string(m.dir.with_extension("log")).unwrap_or_default()
                    ));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(())
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}

/// The settings every node of a test runs with: short leases and batches, so expiry and
/// renewals show within seconds.
fn node_args<'a>(endpoints: &'a str, prefix: &'a str) -> Vec<&'a str> {
    vec![
        "--store",
        "etcd",
        "--etcd-endpoints",
        endpoints,
        "--etcd-prefix",
        prefix,
        "--persist-interval",
        "200ms",
        "--reaper-interval",
        "300ms",
        "--min-ttl",
        "1s",
    ]
}

async fn node(dir: &Path, endpoints: &str, prefix: &str) -> Proc {
    launch_ok(dir, &node_args(endpoints, prefix)).await
}

fn client() -> reqwest::Client {
    crate::common::http_builder()
        .timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(128)
        .build()
        .unwrap()
}

/// POSTs `body` to `/api/v1/services/<route>` of the node at `base`, as a registrant does.
async fn send(client: &reqwest::Client, base: &str, route: &str, body: &Value) -> reqwest::Result<reqwest::Response> {
    client
        .post(format!("{base}/api/v1/services/{route}"))
        .header("X-API-Key", KEY)
        .json(body)
        .send()
        .await
}

async fn post(client: &reqwest::Client, node: &Proc, path: &str, body: &Value) -> (u16, Value) {
    let route = path.strip_prefix("/services/").expect("a /services/ route");
    let response = send(client, &node.base(), route, body)
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// `GET /api/v1/services<query>` of a node, answered 200.
async fn services(client: &reqwest::Client, node: &Proc, query: &str) -> reqwest::Response {
    let response = client
        .get(format!("{}/api/v1/services{query}", node.base()))
        .header("X-API-Key", KEY)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response
}

async fn listed(client: &reqwest::Client, node: &Proc) -> BTreeMap<String, Value> {
    let body: Value = services(client, node, "?detail=1").await.json().await.unwrap();
    body["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (i["id"].as_str().unwrap().to_owned(), i.clone()))
        .collect()
}

async fn healthz(client: &reqwest::Client, node: &Proc) -> Value {
    client
        .get(format!("{}/healthz", node.base()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// SRV answers for `_<service>._tcp`.
async fn srv(dns: SocketAddr, service: &str) -> usize {
    let name = format!("_{service}._tcp.service.koder.");
    let reply = common::tcp_query(dns, &common::query_message(&name, RecordType::SRV, Some(1232))).await;
    match reply.metadata.response_code {
        ResponseCode::NoError => reply.answers.len(),
        _ => 0,
    }
}

/// Polls until `cond` holds; returns how long that took, or panics naming `what`.
async fn until<F: AsyncFn() -> bool>(what: &str, within: Duration, cond: F) -> Duration {
    let started = Instant::now();
    loop {
        if cond().await {
            return started.elapsed();
        }
        assert!(started.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn instance(id: &str, service: &str, i: usize, ttl_ns: i64) -> Value {
    json!({
        "id": id,
        "name": service,
        "address": format!("10.7.{}.{}", i / 250, i % 250 + 1),
        "port": 9000 + i % 1000,
        "ttl_ns": ttl_ns,
    })
}

/// What most tests start with: their turn (see [`ONE_AT_A_TIME`]), a 3-member etcd, 3
/// nodes on `prefix`, and a client.
async fn three_nodes(prefix: &str) -> (tokio::sync::MutexGuard<'static, ()>, Cluster, Nodes, reqwest::Client) {
    let turn = ONE_AT_A_TIME.lock().await;
    let cluster = Cluster::start().await;
    let nodes = nodes(&cluster, prefix).await;
    (turn, cluster, nodes, client())
}

struct Nodes {
    procs: Vec<Proc>,
    dirs: Vec<PathBuf>,
    _tmp: tempfile::TempDir,
}

async fn nodes(cluster: &Cluster, prefix: &str) -> Nodes {
    let tmp = tempfile::tempdir().unwrap();
    let dirs: Vec<PathBuf> = (0..3).map(|i| tmp.path().join(format!("n{i}"))).collect();
    let endpoints = cluster.endpoints();
    let mut procs = Vec::new();
    for dir in &dirs {
        procs.push(node(dir, &endpoints, prefix).await);
    }
    Nodes { procs, dirs, _tmp: tmp }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn a_registration_on_one_node_is_served_by_every_node_and_changes_through_any() {
    let (_turn, _cluster, n, client) = three_nodes("/t1/").await;
    let (a, b, c) = (&n.procs[0], &n.procs[1], &n.procs[2]);

    // Propagation: 200 on node 1, then the DNS answer on nodes 2 and 3.
    let mut delays = Vec::new();
    for i in 0..20 {
        let service = format!("prop{i}");
        let (status, body) = post(
            &client,
            a,
            "/services/register",
            &instance(&service, &service, i, 60 * SECOND),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["created"], true);
        // Read-your-writes on the node that answered.
        assert_eq!(
            srv(a.dns, &service).await,
            1,
            "node 1 answers its own registration at once"
        );
        let started = Instant::now();
        until("node 3 answers", Duration::from_secs(2), async || {
            srv(c.dns, &service).await == 1
        })
        .await;
        delays.push(started.elapsed());
        until("node 2 answers", Duration::from_secs(2), async || {
            srv(b.dns, &service).await == 1
        })
        .await;
    }
    delays.sort();
    eprintln!(
        "propagation 200 on node 1 -> DNS on node 3: p50 {:?}, max {:?}",
        delays[delays.len() / 2],
        delays[delays.len() - 1]
    );

    // Re-registration through another node keeps registered_at and says created: false.
    let first = listed(&client, a).await["prop0"].clone();
    let (status, body) = post(
        &client,
        b,
        "/services/register",
        &instance("prop0", "prop0", 0, 60 * SECOND),
    )
    .await;
    assert_eq!((status, body["created"].clone()), (200, json!(false)), "{body}");
    let again = listed(&client, c).await;
    until("node 3 sees the re-registration", Duration::from_secs(2), async || {
        listed(&client, c).await["prop0"]["updated_at"] != first["updated_at"]
    })
    .await;
    assert_eq!(again["prop0"]["registered_at"], first["registered_at"]);

    // Heartbeat through node 2 of an instance registered on node 1.
    let (status, body) = post(&client, b, "/services/heartbeat", &json!({"id": "prop1"})).await;
    assert_eq!(status, 200, "{body}");
    // Deregistration through node 3; gone from node 3 at once, from the others soon.
    let (status, body) = post(&client, c, "/services/deregister", &json!({"id": "prop1"})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        srv(c.dns, "prop1").await,
        0,
        "node 3 no longer answers what it deregistered"
    );
    for node in [a, b] {
        until(
            "the deregistration reaches every node",
            Duration::from_secs(2),
            async || srv(node.dns, "prop1").await == 0,
        )
        .await;
    }
    let (status, _) = post(&client, a, "/services/heartbeat", &json!({"id": "prop1"})).await;
    assert_eq!(
        status, 410,
        "a heartbeat after the deregistration is gone on every node"
    );

    // The revision is etcd's: the same SOA serial on every node once the watches caught up.
    until("the same serial everywhere", Duration::from_secs(2), async || {
        let mut serials = BTreeSet::new();
        for node in [a, b, c] {
            serials.insert(soa_serial(node.dns).await);
        }
        serials.len() == 1
    })
    .await;
}

/// The `X-Koder-Index` of a node's listing.
async fn index(client: &reqwest::Client, node: &Proc) -> u64 {
    let response = services(client, node, "").await;
    response.headers()["x-koder-index"].to_str().unwrap().parse().unwrap()
}

/// Waits until every node shows the same `X-Koder-Index` and SOA serial (the serial being
/// the index's low 32 bits); asserts that this holds within 1 s of `since` (the last
/// write's answer); returns the index.
async fn one_index_everywhere(what: &str, client: &reqwest::Client, nodes: &[&Proc], since: Instant) -> u64 {
    let mut seen = Vec::new();
    loop {
        seen.clear();
        for node in nodes {
            seen.push((index(client, node).await, soa_serial(node.dns).await));
        }
        let (first, serial) = seen[0];
        if seen.iter().all(|s| *s == (first, serial)) && serial == first as u32 {
            eprintln!(
                "{what}: index {first} on every node {:?} after the last write",
                since.elapsed()
            );
            return first;
        }
        assert!(
            since.elapsed() < Duration::from_secs(1),
            "{what}: (index, serial) per node {seen:?} still differ 1 s after the last write"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Registrations from `clients` tasks through the given nodes until `stop`; returns how
/// many were answered 200 and when the last one was.
fn load(
    client: &reqwest::Client,
    bases: Vec<String>,
    clients: usize,
    tag: &'static str,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> tokio::task::JoinSet<(usize, Option<Instant>)> {
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..clients {
        let (client, base, stop) = (client.clone(), bases[t % bases.len()].clone(), stop.clone());
        tasks.spawn(async move {
            let (mut acked, mut last) = (0, None);
            let mut k = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let body = instance(&format!("{tag}-{t}-{k}"), tag, t * 1000 + k, 120 * SECOND);
                let sent = send(&client, &base, "register", &body).await;
                match sent {
                    Ok(r) if r.status() == 200 => {
                        acked += 1;
                        last = Some(Instant::now());
                    }
                    Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                    // A killed node: its clients stop.
                    Err(_) => return (acked, last),
                }
                k += 1;
            }
            (acked, last)
        });
    }
    tasks
}

/// Stops `load` and returns when its last registration was answered.
async fn last_write(
    stop: &std::sync::atomic::AtomicBool,
    mut tasks: tokio::task::JoinSet<(usize, Option<Instant>)>,
) -> (usize, Instant) {
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut acked, mut last) = (0, None::<Instant>);
    while let Some(r) = tasks.join_next().await {
        let (n, at) = r.unwrap();
        acked += n;
        last = last.max(at);
    }
    (acked, last.expect("some registrations were answered"))
}

async fn soa_serial(dns: SocketAddr) -> u32 {
    let reply = common::tcp_query(
        dns,
        &common::query_message("service.koder.", RecordType::SOA, Some(1232)),
    )
    .await;
    match reply.answers.first().map(|r| &r.data) {
        Some(hickory_proto::rr::RData::SOA(soa)) => soa.serial,
        other => panic!("expected the SOA, got {other:?}"),
    }
}

/// Nodes given one `--dnssec-key` publish one DNSKEY, and what each answers a DO query
/// verifies with it, whichever node took the registration.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn nodes_given_one_dnssec_key_publish_one_dnskey_and_sign_with_it() {
    use crate::dnssec::{assert_verifies, dnskeys, dnssec_tool, do_query};
    let _turn = ONE_AT_A_TIME.lock().await;
    let cluster = Cluster::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let key = tmp.path().join("zone.pem");
    dnssec_tool("keygen", &["--out", key.to_str().unwrap()]);
    let endpoints = cluster.endpoints();
    let mut args = node_args(&endpoints, "/dnssec/");
    args.extend(["--dnssec", "--dnssec-key", key.to_str().unwrap()]);
    let a = launch_ok(&tmp.path().join("a"), &args).await;
    let b = launch_ok(&tmp.path().join("b"), &args).await;
    let (status, body) = post(
        &client(),
        &a,
        "/services/register",
        &instance("v1", "voice", 1, 60 * SECOND),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    until("b serves the registration", Duration::from_secs(5), async || {
        srv(b.dns, "voice").await == 1
    })
    .await;
    let keys = dnskeys(a.dns).await;
    assert_eq!(keys.len(), 1);
    assert_eq!(dnskeys(b.dns).await, keys, "one DNSKEY on every node");
    for node in [&a, &b] {
        for (name, rtype) in [
            ("_voice._tcp.service.koder.", RecordType::SRV),
            ("nosuch.service.koder.", RecordType::A),
        ] {
            let reply = common::tcp_query(node.dns, &do_query(name, rtype, false)).await;
            assert_verifies(&reply, &keys[0], &format!("{name} {rtype} from {}", node.dns));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn an_expired_instance_is_hidden_everywhere_and_deleted_once() {
    let (_turn, _cluster, n, client) = three_nodes("/t2/").await;
    let sent = Instant::now();
    let (status, body) = post(
        &client,
        &n.procs[0],
        "/services/register",
        &instance("short", "short", 0, SECOND),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let all: Vec<&Proc> = n.procs.iter().collect();
    let registered = one_index_everywhere("after the registration", &client, &all, Instant::now()).await;
    // Its lease (1 s from the registration's stamp) ends at the same moment on every node;
    // the expiry leader deletes it then, and every index moves with the delete.
    for node in &n.procs {
        until("every node hides it", Duration::from_secs(3), async || {
            srv(node.dns, "short").await == 0
        })
        .await;
    }
    let lease_end = sent + Duration::from_secs(1);
    until(
        "every node's index moves past the expiry",
        Duration::from_secs(3),
        async || {
            for node in &n.procs {
                if index(&client, node).await == registered {
                    return false;
                }
            }
            true
        },
    )
    .await;
    let moved = lease_end.elapsed();
    one_index_everywhere("after the expiry", &client, &all, Instant::now()).await;
    eprintln!("lease end -> every node's index past the expiry: at most {moved:?}");
    assert!(
        moved < Duration::from_secs(1),
        "the index moved {moved:?} after the lease ended"
    );
    // One node deletes the key; the delete reaches every node: the log of each says so.
    until("one delete from etcd", Duration::from_secs(5), async || {
        n.procs
            .iter()
            .map(|p| p.stderr().matches("expired instances deleted from etcd").count())
            .sum::<usize>()
            == 1
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let deletes: usize = n
        .procs
        .iter()
        .map(|p| p.stderr().matches("expired instances deleted from etcd").count())
        .sum();
    assert_eq!(deletes, 1, "exactly one delete across the nodes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn kill_9_of_a_node_under_concurrent_registrations_loses_no_acknowledged_one() {
    let (_turn, cluster, mut n, client) = three_nodes("/t3/").await;
    let bases: Vec<String> = n.procs.iter().map(|p| p.base()).collect();
    // 64 clients, spread over nodes 1 and 2; node 1 is killed mid-way.
    let acked = Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..64 {
        let (client, acked, base) = (client.clone(), acked.clone(), bases[t % 2].clone());
        tasks.spawn(async move {
            for k in 0..1000 {
                let id = format!("load-{t}-{k}");
                let body = instance(&id, &format!("load{}", t % 8), t * 1000 + k, 120 * SECOND);
                let sent = send(&client, &base, "register", &body).await;
                match sent {
                    Ok(r) if r.status() == 200 => {
                        acked.lock().unwrap().insert(id);
                    }
                    // The killed node: connection errors from then on.
                    _ if t % 2 == 0 => return,
                    Ok(r) => panic!("node 2 answered {} during node 1's death", r.status()),
                    Err(e) => panic!("node 2: {e}"),
                }
                if k >= 30 && t % 2 == 1 {
                    return;
                }
            }
        });
    }
    until("some registrations", Duration::from_secs(20), async || {
        acked.lock().unwrap().len() >= 300
    })
    .await;
    n.procs.remove(0).kill9();
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    eprintln!("{} registrations acknowledged", acked.len());
    // The restarted node loads everything from etcd; the survivors hold it too.
    let restarted = node(&n.dirs[0], &cluster.endpoints(), "/t3/").await;
    for node in [&restarted, &n.procs[0], &n.procs[1]] {
        let listed = listed(&client, node).await;
        let missing: Vec<&String> = acked.iter().filter(|id| !listed.contains_key(*id)).collect();
        assert!(
            missing.is_empty(),
            "{} acknowledged registrations missing: {:?}",
            missing.len(),
            &missing[..missing.len().min(5)]
        );
    }
    // And it follows changes made after its start.
    let (status, _) = post(
        &client,
        &n.procs[1],
        "/services/register",
        &instance("after", "after", 0, 60 * SECOND),
    )
    .await;
    assert_eq!(status, 200);
    until("the restarted node follows", Duration::from_secs(2), async || {
        srv(restarted.dns, "after").await == 1
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn one_etcd_member_killed_writes_go_on() {
    let (_turn, mut cluster, n, client) = three_nodes("/t4/").await;
    cluster.kill(0);
    // A leader election may be under way for up to a second: retry 503s for a while.
    for (i, node) in n.procs.iter().enumerate() {
        let id = format!("survivor{i}");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let (status, body) = post(
                &client,
                node,
                "/services/register",
                &instance(&id, "survivor", i, 60 * SECOND),
            )
            .await;
            if status == 200 {
                break;
            }
            assert!(status == 503 && Instant::now() < deadline, "node {i}: {status} {body}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for node in &n.procs {
        until("every node serves all three", Duration::from_secs(3), async || {
            srv(node.dns, "survivor").await == 3
        })
        .await;
    }
}

/// etcd without quorum (two members of three stopped): no heartbeat or write is answered
/// 200 (none can be taken), every node answers them 503 within 5 s, reads go on, nothing
/// expires for want of a heartbeat nobody could take; with the members back, all is 200
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn quorum_lost_heartbeats_and_writes_get_503_within_5s_nothing_expires_and_all_recovers() {
    let (_turn, mut cluster, n, client) = three_nodes("/t5/").await;
    // A registrant heart-beats at a third of its TTL: at the loss, its lease has at least
    // 2 s to run, more than etcd's loss takes to be seen (under a second; see probe.rs).
    let ttl = 3 * SECOND;
    for (i, node) in n.procs.iter().enumerate() {
        let (status, body) = post(
            &client,
            node,
            "/services/register",
            &instance(&format!("kept{i}"), "kept", i, ttl),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    for node in &n.procs {
        until("every node serves all three", Duration::from_secs(3), async || {
            srv(node.dns, "kept").await == 3
        })
        .await;
    }
    for (i, node) in n.procs.iter().enumerate() {
        let (status, body) = post(&client, node, "/services/heartbeat", &json!({"id": format!("kept{i}")})).await;
        assert_eq!(status, 200, "{body}");
    }
    cluster.kill(0);
    cluster.kill(1);
    let lost = Instant::now();
    // Heartbeats and writes on every node: 503 within 5 s of the loss (those sent at once
    // wait for etcd's answer, up to its 2 s call timeout).
    let mut refused = tokio::task::JoinSet::new();
    for (i, node) in n.procs.iter().enumerate() {
        let (client, base) = (client.clone(), node.base());
        refused.spawn(async move {
            let post = |route: &'static str, body: Value| {
                let (client, base) = (client.clone(), base.clone());
                async move { send(&client, &base, route, &body).await }
            };
            loop {
                let beat = post("heartbeat", json!({"id": format!("kept{i}")})).await.unwrap();
                assert_ne!(beat.status(), 200, "node {i}: a heartbeat taken without quorum");
                // Its outcome is unknown (it may take effect once quorum is back): its own service.
                let write = post("register", instance(&format!("during{i}"), "during", i, ttl))
                    .await
                    .unwrap();
                assert_ne!(write.status(), 200, "node {i}: a write taken without quorum");
                if beat.status() == 503 && write.status() == 503 {
                    return (i, lost.elapsed());
                }
                assert!(
                    lost.elapsed() < Duration::from_secs(5),
                    "node {i}: heartbeat {}, write {} 5 s after the loss",
                    beat.status(),
                    write.status()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
    }
    while let Some(done) = refused.join_next().await {
        let (i, took) = done.unwrap();
        eprintln!("node {i}: heartbeat and write 503 {took:?} after quorum was lost");
    }
    for node in &n.procs {
        until(
            "/healthz says etcd is unreachable",
            Duration::from_secs(5),
            async || healthz(&client, node).await["disk"]["state"] == "unreachable",
        )
        .await;
    }
    let (status, _) = post(&client, &n.procs[2], "/services/deregister", &json!({"id": "during2"})).await;
    assert_eq!(status, 503);
    // Reads go on, for twice the TTL and more: nothing expires.
    let until_at = Instant::now() + Duration::from_nanos(2 * ttl as u64 + 500_000_000);
    while Instant::now() < until_at {
        for node in &n.procs {
            assert_eq!(
                srv(node.dns, "kept").await,
                3,
                "nothing expires while etcd has no quorum"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.spawn(0);
    cluster.spawn(1);
    cluster.healthy().await.unwrap_or_else(|log| panic!("{log}"));
    for (i, node) in n.procs.iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (status, body) = post(&client, node, "/services/heartbeat", &json!({"id": format!("kept{i}")})).await;
            if status == 200 {
                break;
            }
            assert!(
                status == 503 && Instant::now() < deadline,
                "node {i} after etcd came back: {status} {body}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let (status, body) = post(
        &client,
        &n.procs[0],
        "/services/register",
        &instance("new", "new", 0, ttl),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    for node in &n.procs {
        until("the new one everywhere", Duration::from_secs(3), async || {
            srv(node.dns, "new").await == 1
        })
        .await;
        assert_eq!(srv(node.dns, "kept").await, 3);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn migrate_copies_a_redb_registry_and_refuses_a_used_prefix() {
    let _one = ONE_AT_A_TIME.lock().await;
    let cluster = Cluster::start().await;
    let client = client();
    let tmp = tempfile::tempdir().unwrap();
    let redb = tmp.path().join("redb");
    let single = launch_ok(&redb, &[]).await;
    for i in 0..3 {
        let (status, _) = post(
            &client,
            &single,
            "/services/register",
            &instance(&format!("m{i}"), "moved", i, 60 * SECOND),
        )
        .await;
        assert_eq!(status, 200);
    }
    let (status, _) = single.terminate().await;
    assert!(status.success());
    let migrate = |force: bool| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_koder-dns"));
        cmd.args(["migrate", "--to-etcd", "--etcd-prefix", "/t6/", "--etcd-endpoints"])
            .arg(cluster.endpoints())
            .arg("--data-dir")
            .arg(&redb)
            .env_remove("KODER_DNS_ETCD_ENDPOINTS");
        if force {
            cmd.arg("--force");
        }
        cmd.output().expect("run migrate")
    };
    let out = migrate(false);
    assert!(
        out.status.success(),
        "migrate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("copied 3 instances"));
    let again = migrate(false);
    assert_eq!(again.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("--force"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    let forced = migrate(true);
    assert!(forced.status.success(), "{}", String::from_utf8_lossy(&forced.stderr));
    // Nodes started one after another on the migrated registry show one index (the
    // migrate's), not each its own load's.
    let mut procs = Vec::new();
    for i in 0..3 {
        procs.push(node(&tmp.path().join(format!("node{i}")), &cluster.endpoints(), "/t6/").await);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    for node in &procs {
        let listed = listed(&client, node).await;
        assert_eq!(listed.keys().cloned().collect::<Vec<_>>(), ["m0", "m1", "m2"]);
        assert_eq!(srv(node.dns, "moved").await, 3);
    }
    // Nothing was written after the migrate (joining, leading and stamping move nothing).
    let all: Vec<&Proc> = procs.iter().collect();
    let index = one_index_everywhere("nodes started after a migrate", &client, &all, Instant::now()).await;
    assert!(index > 0);
}

/// A build without the feature refuses `--store etcd` at start, saying how to build a
/// cluster node (tests/run.sh runs this one in a default build).
#[cfg(not(feature = "etcd"))]
#[tokio::test]
async fn without_the_feature_store_etcd_is_refused_with_the_build_command() {
    let tmp = tempfile::tempdir().unwrap();
    let (status, stderr) = crate::child::launch_refused(tmp.path(), &node_args("http://127.0.0.1:1", "/x/")).await;
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--features etcd"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn heartbeats_on_one_node_keep_the_instance_alive_on_every_node() {
    let (_turn, _cluster, n, client) = three_nodes("/t7/").await;
    let (status, body) = post(
        &client,
        &n.procs[0],
        "/services/register",
        &instance("beating", "beating", 0, 2 * SECOND),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    // Heart-beat through node 2 only, for more than twice the TTL: every node keeps serving it.
    let until_at = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until_at {
        let (status, body) = post(&client, &n.procs[1], "/services/heartbeat", &json!({"id": "beating"})).await;
        assert_eq!(status, 200, "{body}");
        for node in &n.procs {
            assert_eq!(
                srv(node.dns, "beating").await,
                1,
                "served everywhere while heart-beaten elsewhere"
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Silence: every node hides it within TTL + one batch (+ slack), and it is deleted once.
    for node in &n.procs {
        until("hidden after its lease", Duration::from_secs(4), async || {
            srv(node.dns, "beating").await == 0
        })
        .await;
    }
}

/// A key limited to its services renews their instances on a cluster node, and is refused
/// (403 naming the service) another service's, which is then not renewed: the check is made
/// in the renewal's own lookup, on etcd as on redb (tests/it/access.rs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn a_scoped_key_renews_only_its_services_instances_on_a_cluster_node() {
    let _turn = ONE_AT_A_TIME.lock().await;
    let cluster = Cluster::start().await;
    let dir = tempfile::tempdir().unwrap();
    let token = koder_dns::access::new_token().unwrap();
    let pattern = koder_dns::access::Pattern::parse("voice").unwrap();
    let keys = dir.path().join("keys.toml");
    let table = koder_dns::access::file_entry("voice-agent", &token, koder_dns::access::Scope::Register, &[pattern]);
    std::fs::write(&keys, table).unwrap();
    let endpoints = cluster.endpoints();
    let mut args = node_args(&endpoints, "/scoped/");
    args.extend(["--keys-file", keys.to_str().unwrap()]);
    let node = launch_ok(&dir.path().join("n"), &args).await;
    let client = client();
    for (id, service) in [("voice-1", "voice"), ("db-1", "db")] {
        let (status, body) = post(
            &client,
            &node,
            "/services/register",
            &instance(id, service, 0, 60 * SECOND),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    let updated_at = |listed: &BTreeMap<String, Value>, id: &str| listed[id]["updated_at"].clone();
    let before = listed(&client, &node).await;
    let beat = async |id: &str| {
        let response = client
            .post(format!("{}/api/v1/services/heartbeat", node.base()))
            .header("X-API-Key", &token)
            .json(&json!({ "id": id }))
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.json::<Value>().await.unwrap())
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (status, body) = beat("voice-1").await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = beat("db-1").await;
    assert_eq!(status, 403, "{body}");
    let message = body["message"].as_str().unwrap();
    assert!(
        message.contains("\"voice-agent\"") && message.contains("service \"db\""),
        "{message}"
    );
    let after = listed(&client, &node).await;
    assert_ne!(updated_at(&after, "voice-1"), updated_at(&before, "voice-1"), "renewed");
    assert_eq!(
        updated_at(&after, "db-1"),
        updated_at(&before, "db-1"),
        "a refused heartbeat renewed"
    );
}

/// The history checker: clients each own a few ids and change them (register, deregister,
/// re-register) and heart-beat them through random nodes while a koder-dns node is killed
/// and an etcd member is killed; every acknowledged operation is then checked against the
/// final state on every node (no acknowledged write lost, no acknowledged deregistration
/// resurrected) and every heartbeat answered 200 against etcd's history: the renewal it
/// answered (its `updated_at`) is a put of that instance there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn history_of_acknowledged_operations_holds_on_every_node_through_faults() {
    let (_turn, mut cluster, mut n, client) = three_nodes("/t8/").await;
    let bases: Arc<Vec<String>> = Arc::new(n.procs.iter().map(|p| p.base()).collect());
    /// Per id: the last acknowledged operation (true = registered), and whether an
    /// unacknowledged one came after it (then either state is allowed).
    type History = BTreeMap<String, (Option<bool>, bool)>;
    /// Heartbeats answered 200: the id and the `updated_at` of the renewal answered.
    type Renewals = Vec<(String, String)>;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..16 {
        let (client, bases, stop) = (client.clone(), bases.clone(), stop.clone());
        tasks.spawn(async move {
            let (mut history, mut renewals) = (History::new(), Renewals::new());
            let mut step = 0usize;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let id = format!("h-{t}-{}", fastrand::usize(..4));
                let base = &bases[fastrand::usize(..bases.len())];
                let (path, body) = match fastrand::usize(..5) {
                    0 | 1 => ("register", instance(&id, "hist", t * 4 + step % 4, 120 * SECOND)),
                    2 => ("deregister", json!({ "id": id })),
                    _ => ("heartbeat", json!({ "id": id })),
                };
                let register = path == "register";
                step += 1;
                let sent = send(&client, base, path, &body).await;
                if path == "heartbeat" {
                    // Changes no registration: only its renewal is checked.
                    if let Ok(answer) = sent
                        && answer.status() == 200
                    {
                        let renewed: Value = answer.json().await.unwrap();
                        renewals.push((id, renewed["updated_at"].as_str().unwrap().to_owned()));
                    }
                    continue;
                }
                let entry = history.entry(id).or_insert((None, false));
                match sent.map(|r| r.status().as_u16()) {
                    Ok(200) => *entry = (Some(register), false),
                    // Deregistering what is not there: it is not there (acknowledged).
                    Ok(404) if !register => *entry = (Some(false), false),
                    // The killed node: a refused connection carried nothing.
                    Err(e) if e.is_connect() => {}
                    // A 503 or an unknown outcome: either state may follow.
                    _ => entry.1 = true,
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (history, renewals)
        });
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    n.procs.remove(2).kill9();
    tokio::time::sleep(Duration::from_secs(1)).await;
    cluster.kill(1);
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (mut history, mut renewals) = (History::new(), Renewals::new());
    while let Some(r) = tasks.join_next().await {
        let (h, r) = r.unwrap();
        history.extend(h);
        renewals.extend(r);
    }
    // Every heartbeat answered 200 is a renewal etcd took: a put of that instance with the
    // `updated_at` answered, in its history (nothing is compacted in these tests).
    let taken = cluster.history_of_puts("/t8/instances/");
    let stamps: BTreeSet<(String, String)> = taken
        .iter()
        .filter_map(|(key, value)| {
            let stored: Value = serde_json::from_str(value).ok()?;
            Some((
                key.strip_prefix("/t8/instances/")?.to_owned(),
                stored["updated_at"].as_str()?.to_owned(),
            ))
        })
        .collect();
    assert!(
        renewals.len() >= 32,
        "too few heartbeats answered 200 to check: {}",
        renewals.len()
    );
    let missing: Vec<&(String, String)> = renewals.iter().filter(|r| !stamps.contains(*r)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} heartbeats answered 200 have no renewal in etcd's history, e.g. {:?}",
        missing.len(),
        renewals.len(),
        &missing[..missing.len().min(5)]
    );
    eprintln!(
        "{} heartbeats answered 200, each a put in etcd's history",
        renewals.len()
    );
    let restarted = node(&n.dirs[2], &cluster.endpoints(), "/t8/").await;
    n.procs.push(restarted);
    let checked = history
        .values()
        .filter(|(acked, unknown)| acked.is_some() && !unknown)
        .count();
    assert!(checked >= 32, "too few acknowledged operations to check: {checked}");
    // Every node's watch catches up: a marker written last is seen everywhere first.
    let (status, body) = post(
        &client,
        &n.procs[0],
        "/services/register",
        &instance("marker", "marker", 0, 60 * SECOND),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    for node in &n.procs {
        until("the marker everywhere", Duration::from_secs(3), async || {
            srv(node.dns, "marker").await == 1
        })
        .await;
        let listed = listed(&client, node).await;
        for (id, (acked, unknown)) in &history {
            if *unknown {
                continue;
            }
            if let Some(registered) = acked {
                assert_eq!(
                    listed.contains_key(id),
                    *registered,
                    "{id}: last acknowledged operation was {}, node {} disagrees",
                    if *registered { "register" } else { "deregister" },
                    node.base()
                );
            }
        }
    }
}

/// Every node down for longer than the leases: on restart, the leases that ran out while
/// no node could take a heartbeat are parked (unserved), not deleted, so a registrant that
/// kept heart-beating gets 200, not 410, and is served again at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn every_node_down_longer_than_the_ttl_is_no_410_storm() {
    let (_turn, cluster, mut n, client) = three_nodes("/t9/").await;
    let (status, body) = post(
        &client,
        &n.procs[0],
        "/services/register",
        &instance("patient", "patient", 0, 2 * SECOND),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    // Let the leader stamp its last run after the registration.
    tokio::time::sleep(Duration::from_millis(800)).await;
    for proc in n.procs.drain(..) {
        proc.kill9();
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let first = node(&n.dirs[0], &cluster.endpoints(), "/t9/").await;
    let (status, body) = post(&client, &first, "/services/heartbeat", &json!({"id": "patient"})).await;
    assert_eq!(
        status, 200,
        "a heartbeat after a cluster-wide outage is not 410: {body}"
    );
    assert_eq!(
        srv(first.dns, "patient").await,
        1,
        "confirmed by its heartbeat, served again"
    );
    let second = node(&n.dirs[1], &cluster.endpoints(), "/t9/").await;
    until("the other node serves it too", Duration::from_secs(2), async || {
        srv(second.dns, "patient").await == 1
    })
    .await;
}

/// A loopback HTTP check target: records when each path was probed; answers 503 while
/// `failing` is set, 200 otherwise.
struct Target {
    port: u16,
    probes: Arc<std::sync::Mutex<Vec<(String, Instant)>>>,
    failing: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Target {
    async fn start() -> Self {
        let probes: Arc<std::sync::Mutex<Vec<(String, Instant)>>> = Arc::default();
        let failing: Arc<std::sync::atomic::AtomicBool> = Arc::default();
        let (seen, fails) = (probes.clone(), failing.clone());
        let app = axum::Router::new().fallback(move |uri: axum::http::Uri| {
            let (seen, fails) = (seen.clone(), fails.clone());
            async move {
                seen.lock().unwrap().push((uri.path().to_owned(), Instant::now()));
                if fails.load(std::sync::atomic::Ordering::SeqCst) {
                    axum::http::StatusCode::SERVICE_UNAVAILABLE
                } else {
                    axum::http::StatusCode::OK
                }
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self {
            port,
            probes,
            failing,
            task,
        }
    }

    fn fail(&self, failing: bool) {
        self.failing.store(failing, std::sync::atomic::Ordering::SeqCst);
    }

    /// Probes of `path` at or after `from` (and before `to`).
    fn probes(&self, path: &str, from: Instant, to: Instant) -> Vec<Instant> {
        self.probes
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, at)| p == path && *at >= from && *at < to)
            .map(|(_, at)| *at)
            .collect()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An instance on the target, checked over HTTP at `path` every `interval`.
fn checked(id: &str, port: u16, path: &str, interval: &str) -> Value {
    json!({
        "id": id,
        "name": "checked",
        "address": "127.0.0.1",
        "port": port,
        "ttl_ns": 60 * SECOND,
        "metadata": {"check": "http", "check_path": path, "check_interval": interval, "check_timeout": "200ms"},
    })
}

/// `koder_dns_health_checks_running` of a node: how many checks it runs.
async fn checks_running(client: &reqwest::Client, node: &Proc) -> u64 {
    let text = common::scrape(client, &node.base()).await;
    assert!(text.contains("koder_dns_health_checks_running "), "{text}");
    common::sample(&text, "koder_dns_health_checks_running") as u64
}

/// Whether `node` lists every one of `ids` with `healthy` = `want`.
async fn all_flagged(client: &reqwest::Client, node: &Proc, ids: &[String], want: bool) -> bool {
    let listed = listed(client, node).await;
    ids.iter()
        .all(|id| listed.get(id).is_some_and(|i| i["healthy"] == want))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn each_checked_instance_is_probed_by_one_node_and_every_node_serves_its_verdict() {
    let (_turn, _cluster, n, client) = three_nodes("/t10/").await;
    let target = Target::start().await;
    let ids: Vec<String> = (0..6).map(|i| format!("chk{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        let body = checked(id, target.port, &format!("/{id}"), "300ms");
        let (status, answer) = post(&client, &n.procs[i % 3], "/services/register", &body).await;
        assert_eq!(status, 200, "{answer}");
    }
    // Every check runs on exactly one node.
    until("6 checks running over the nodes", Duration::from_secs(5), async || {
        let mut total = 0;
        for node in &n.procs {
            total += checks_running(&client, node).await;
        }
        total == 6
    })
    .await;
    let mut shares = Vec::new();
    for node in &n.procs {
        shares.push(checks_running(&client, node).await);
    }
    // One prober per instance: about 10 probes in 3s at 300ms (±10% jitter), not 30 (the
    // bounds leave room for a loaded machine).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let from = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let to = Instant::now();
    let mut counts = Vec::new();
    for id in &ids {
        let probes = target.probes(&format!("/{id}"), from, to);
        assert!(
            (5..=15).contains(&probes.len()),
            "{id} probed {} times in 3s at a 300ms interval: not one prober",
            probes.len()
        );
        counts.push(probes.len());
    }
    eprintln!("checks per node {shares:?}; probes per instance in 3s at 300ms: {counts:?}");
    for node in &n.procs {
        assert!(all_flagged(&client, node, &ids, true).await);
        assert_eq!(srv(node.dns, "checked").await, 6);
    }

    // The target fails: the owners' verdicts reach every node, listings and DNS alike.
    target.fail(true);
    let failed_at = Instant::now();
    for node in &n.procs {
        until("every node lists them unhealthy", Duration::from_secs(4), async || {
            all_flagged(&client, node, &ids, false).await
        })
        .await;
        assert_eq!(srv(node.dns, "checked").await, 0, "unhealthy: out of DNS on every node");
    }
    eprintln!(
        "target failing -> unhealthy on all 3 nodes (fall 2, interval 300ms): {:?}",
        failed_at.elapsed()
    );
    target.fail(false);
    for node in &n.procs {
        until(
            "every node lists them healthy again",
            Duration::from_secs(4),
            async || all_flagged(&client, node, &ids, true).await,
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn health_checks_move_off_a_killed_node_within_its_membership_lease_and_one_interval() {
    let (_turn, _cluster, mut n, client) = three_nodes("/t11/").await;
    let target = Target::start().await;
    let body = checked("moving", target.port, "/moving", "500ms");
    let (status, answer) = post(&client, &n.procs[0], "/services/register", &body).await;
    assert_eq!(status, 200, "{answer}");
    let ids = vec!["moving".to_owned()];
    // The owner: the one node that runs the check.
    until("one node runs the check", Duration::from_secs(5), async || {
        let mut total = 0;
        for node in &n.procs {
            total += checks_running(&client, node).await;
        }
        total == 1
    })
    .await;
    let mut owner = None;
    for (i, node) in n.procs.iter().enumerate() {
        if checks_running(&client, node).await == 1 {
            owner = Some(i);
        }
    }
    let owner = owner.expect("an owner");
    for node in &n.procs {
        let health = healthz(&client, node).await;
        let members = health["members"].as_array().expect("/healthz lists the live nodes");
        assert_eq!(members.len(), 3, "{health}");
        assert!(members.contains(&health["node"]), "{health}");
    }
    until("probed", Duration::from_secs(2), async || {
        target
            .probes("/moving", Instant::now() - Duration::from_secs(10), Instant::now())
            .len()
            >= 2
    })
    .await;

    n.procs.remove(owner).kill9();
    let killed = Instant::now();
    // A probe the killed node had under way may land just after the kill; any later one is a
    // survivor's. Bound: membership TTL (3s) + one check interval (0.5s) + slack (etcd
    // checks for ended leases every 0.5s; a loaded machine).
    let after = killed + Duration::from_millis(300);
    until("probes resume from a survivor", Duration::from_secs(8), async || {
        !target
            .probes("/moving", after, Instant::now() + Duration::from_secs(1))
            .is_empty()
    })
    .await;
    let moved = target.probes("/moving", after, Instant::now() + Duration::from_secs(1))[0] - killed;
    eprintln!("kill -9 of the owner -> first probe from a survivor: {moved:?}");
    for node in &n.procs {
        let health = healthz(&client, node).await;
        assert_eq!(
            health["members"].as_array().unwrap().len(),
            2,
            "the killed node left: {health}"
        );
    }
    assert!(
        moved <= Duration::from_millis(3000 + 500 + 2000),
        "the check moved in {moved:?}: more than the membership TTL + one interval + slack"
    );
    let mut running = Vec::new();
    for node in &n.procs {
        running.push(checks_running(&client, node).await);
    }
    assert_eq!(running.iter().sum::<u64>(), 1, "one survivor took it over: {running:?}");
    // One prober still: about 4 probes in 2s at 500ms.
    let from = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let count = target.probes("/moving", from, Instant::now()).len();
    assert!((2..=6).contains(&count), "{count} probes in 2s at 500ms");

    // The survivor's verdict reaches both survivors.
    target.fail(true);
    for node in &n.procs {
        until("the survivors list it unhealthy", Duration::from_secs(4), async || {
            all_flagged(&client, node, &ids, false).await
        })
        .await;
        assert_eq!(srv(node.dns, "checked").await, 0);
    }

    // A node stopped cleanly leaves at once (its membership lease is revoked): the last node
    // takes the check over well within the lease's 3s, and its verdict rises.
    let mut owner = None;
    for (i, node) in n.procs.iter().enumerate() {
        if checks_running(&client, node).await == 1 {
            owner = Some(i);
        }
    }
    let stopping = Instant::now();
    let (status, _) = n.procs.remove(owner.expect("an owner")).terminate().await;
    assert_eq!(status.code(), Some(0));
    let after = Instant::now();
    until("probes resume from the last node", Duration::from_secs(5), async || {
        !target
            .probes("/moving", after, Instant::now() + Duration::from_secs(1))
            .is_empty()
    })
    .await;
    let moved = target.probes("/moving", after, Instant::now() + Duration::from_secs(1))[0] - stopping;
    eprintln!("SIGTERM of the owner -> first probe from the last node: {moved:?}");
    assert!(moved < Duration::from_millis(2500), "{moved:?}: not at once");
    assert_eq!(checks_running(&client, &n.procs[0]).await, 1);
    target.fail(false);
    until("healthy again on the last node", Duration::from_secs(3), async || {
        all_flagged(&client, &n.procs[0], &ids, true).await
    })
    .await;
}

/// The client library's watcher, given two nodes of a cluster: it sees a change made
/// through a third node; when the node it follows is killed, it goes on from the other one
/// (every node shows etcd's revision, so its index holds there) and sees the next change.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn the_watcher_follows_a_cluster_through_the_loss_of_its_node() {
    use koder_dns::client::{Client, Route, Watcher};

    let (_turn, _cluster, mut n, client) = three_nodes("/t-watcher/").await;
    let routed = |name: &str, port: usize| {
        json!({"name": name, "address": "127.0.0.1", "port": port,
               "metadata": {"jet.domain": format!("{name}.koder.dev")}})
    };
    let domains = |view: &[Route]| view.iter().map(|r| r.domain.clone()).collect::<BTreeSet<_>>();
    let (status, body) = post(&client, &n.procs[2], "/services/register", &routed("voice", 7001)).await;
    assert_eq!(status, 200, "{body}");
    let followed = Client::new(vec![n.procs[0].base(), n.procs[1].base()], KEY, Duration::from_secs(2)).unwrap();
    let mut watcher = Watcher::new(Arc::new(followed), Duration::from_secs(5));
    async fn until_domain(watcher: &mut Watcher, domain: &str, within: Duration) -> Vec<Route> {
        tokio::time::timeout(within, async {
            loop {
                let view = watcher.next().await.expect("a view");
                if view.iter().any(|r| r.domain == domain) {
                    return view;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{domain} not seen within {within:?}"))
    }
    until_domain(&mut watcher, "voice.koder.dev", Duration::from_secs(5)).await;

    // A change through node 3 reaches the watcher held on node 1.
    let (status, _) = post(&client, &n.procs[2], "/services/register", &routed("video", 7002)).await;
    assert_eq!(status, 200);
    let changed = Instant::now();
    let view = until_domain(&mut watcher, "video.koder.dev", Duration::from_secs(5)).await;
    assert!(
        changed.elapsed() < Duration::from_secs(1),
        "seen after {:?}",
        changed.elapsed()
    );
    assert_eq!(
        domains(&view),
        BTreeSet::from(["video.koder.dev".to_owned(), "voice.koder.dev".to_owned()])
    );

    // Node 1 dies while the watcher is held on it: the last view stands, and the next change
    // comes from node 2.
    let pending = tokio::spawn(async move {
        let view = until_domain(&mut watcher, "chat.koder.dev", Duration::from_secs(15)).await;
        (watcher, view)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    n.procs.remove(0).kill9();
    let (status, _) = post(&client, &n.procs[1], "/services/register", &routed("chat", 7003)).await;
    assert_eq!(status, 200);
    let (watcher, view) = pending.await.unwrap();
    assert_eq!(domains(&view).len(), 3, "{view:?}");
    assert_eq!(watcher.last(), Some(&view[..]));
}

/// What etcd's members logged so far.
impl Cluster {
    fn logs(&self) -> String {
        self.members
            .iter()
            .map(|m| std::fs::read_to_string(m.dir.with_extension("log")).unwrap_or_default())
            .collect()
    }
}

fn path_text(path: &Path) -> String {
    path.to_str().expect("a UTF-8 temporary path").to_owned()
}

/// A node of the secured cluster: the TLS files and the user as flags (`how` 0), as
/// `KODER_DNS_ETCD_*` variables (1) or as config-file keys (2); the password from
/// `KODER_DNS_ETCD_PASSWORD` always; under `prefix`. `extra` comes after.
fn secured_node(cluster: &Cluster, dir: &Path, how: usize, prefix: &str, extra: &[&str]) -> Command {
    let secured = cluster.secured.as_ref().expect("a secured cluster");
    let settings = [
        ("cacert", path_text(&secured.pki.ca_path)),
        ("cert", path_text(&secured.client.0)),
        ("key", path_text(&secured.client.1)),
        ("user", "koder".to_owned()),
    ];
    let endpoints = cluster.endpoints();
    let mut args: Vec<String> = node_args(&endpoints, prefix).into_iter().map(str::to_owned).collect();
    std::fs::create_dir_all(dir).unwrap();
    match how {
        0 => {
            for (name, value) in &settings {
                args.extend([format!("--etcd-{name}"), value.clone()]);
            }
        }
        2 => {
            let config = dir.join("koder-dns.toml");
            let text: String = settings
                .iter()
                .map(|(name, value)| format!("etcd_{name} = {value:?}\n"))
                .collect();
            std::fs::write(&config, text).unwrap();
            args.extend(["--config".to_owned(), path_text(&config)]);
        }
        _ => {}
    }
    args.extend(extra.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = crate::child::command(dir, &args);
    cmd.env("KODER_DNS_ETCD_PASSWORD", KODER_PASSWORD);
    if how == 1 {
        for (name, value) in &settings {
            cmd.env(format!("KODER_DNS_ETCD_{}", name.to_uppercase()), value);
        }
    }
    cmd
}

/// Neither the arguments nor the log of `node` hold the etcd password.
fn assert_no_password(node: &Proc) {
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", node.child.id())).unwrap();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains(KODER_PASSWORD),
        "the password is in /proc/PID/cmdline"
    );
    assert!(!node.stderr().contains(KODER_PASSWORD), "the password is in the log");
}

/// etcd as production runs it: TLS with a private CA, client certificates required, auth on,
/// and a user whose role grants readwrite on the prefix alone (etcdctl refuses that user
/// anything else). Three nodes, given the TLS files and the user by flags, by environment
/// variables and by the config file, register, answer and follow each other through it, and
/// go on after etcd's auth tokens expire (JWTs of 2 s; a simple token's TTL is renewed by every
/// use, so a node, which calls etcd every 500 ms, never outlives one). The password is in no
/// node's arguments or log.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd and etcdctl (tests/run.sh installs etcd-server and etcd-client)"]
async fn three_nodes_work_through_etcd_with_tls_client_certificates_and_a_role_limited_to_the_prefix() {
    let _one = ONE_AT_A_TIME.lock().await;
    let cluster = Cluster::start_secured().await;
    let outside = cluster.etcdctl_output(&["--user", "koder"], &["get", "/elsewhere"]);
    assert!(
        !outside.status.success() && String::from_utf8_lossy(&outside.stderr).contains("permission denied"),
        "the role must grant nothing outside {SECURED_PREFIX}: {outside:?}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let mut procs = Vec::new();
    for how in 0..3 {
        let cmd = secured_node(&cluster, &tmp.path().join(format!("n{how}")), how, SECURED_PREFIX, &[]);
        procs.push(match crate::child::launch_command(cmd).await {
            Started::Up(proc) => proc,
            Started::Exited { status, stderr } => panic!("node {how} exited at start with {status}:\n{stderr}"),
        });
    }
    let client = client();
    let everywhere = async |service: &str, want: usize| {
        for node in &procs {
            until(
                &format!("{service}: {want} SRV answers from {}", node.dns),
                Duration::from_secs(5),
                async || srv(node.dns, service).await == want,
            )
            .await;
        }
    };
    // Each node registers a service of its own, which every node then answers.
    let register_on_each = async |prefix: &str| {
        for (i, node) in procs.iter().enumerate() {
            let service = format!("{prefix}{i}");
            let (status, body) = post(
                &client,
                node,
                "/services/register",
                &instance(&service, &service, i, 60 * SECOND),
            )
            .await;
            assert_eq!(status, 200, "{body}");
            everywhere(&service, 1).await;
        }
    };
    register_on_each("tls").await;

    // etcd refuses a node's expired token at least once; the node authenticates again and
    // every operation goes on: registrations, heartbeats, deregistrations, and the watches
    // that carry each to the other nodes.
    until("etcd refuses an expired token", Duration::from_secs(15), async || {
        tokio::time::sleep(Duration::from_millis(100)).await;
        cluster.logs().contains("invalid auth token")
    })
    .await;
    // One TOKEN_TTL more: every token a node got at its start has expired by now.
    tokio::time::sleep(Duration::from_secs(2)).await;
    register_on_each("later").await;
    let (status, body) = post(&client, &procs[2], "/services/heartbeat", &json!({"id": "tls0"})).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = post(&client, &procs[0], "/services/deregister", &json!({"id": "tls1"})).await;
    assert_eq!(status, 200, "{body}");
    everywhere("tls1", 0).await;

    // Every key the nodes wrote is under the prefix, and none was refused to them.
    let keys = cluster.etcdctl(&["--user", "root"], &["get", "", "--from-key", "--keys-only"]);
    let keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
    assert!(
        keys.iter()
            .any(|k| k.starts_with(&format!("{SECURED_PREFIX}instances/"))),
        "{keys:?}"
    );
    assert!(
        keys.iter().all(|k| k.starts_with(SECURED_PREFIX)),
        "keys outside the prefix: {keys:?}"
    );
    for node in &procs {
        assert_eq!(healthz(&client, node).await["disk"]["state"], "ok");
        assert!(!node.stderr().contains("permission denied"), "{}", node.stderr());
        assert_no_password(node);
    }
}

/// etcd refuses the node: a CA that did not sign etcd's certificate, no client certificate
/// or one from another CA, a wrong password, a role without the prefix. Each start fails
/// within 10 s with exit 2, naming etcd and what it refused, and no password in the message.
/// `migrate --to-etcd` takes the same settings (here from the environment) and refuses alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd and etcdctl (tests/run.sh installs etcd-server and etcd-client)"]
async fn a_wrong_ca_client_certificate_password_or_role_fails_the_start_within_10s_saying_which() {
    let _one = ONE_AT_A_TIME.lock().await;
    let cluster = Cluster::start_secured().await;
    let stranger = common::Pki::new();
    let (foreign_cert, foreign_key) = stranger.issue_client("foreign", "koder");
    let (other_ca, foreign_cert, foreign_key) = (
        path_text(&stranger.ca_path),
        path_text(&foreign_cert),
        path_text(&foreign_key),
    );
    let tmp = tempfile::tempdir().unwrap();
    /// A start etcd refuses: under `prefix`, with `extra` flags (over the settings from the
    /// environment) and `password`; its message must hold every one of `reasons`.
    struct Refusal<'a> {
        case: &'a str,
        prefix: &'a str,
        extra: Vec<&'a str>,
        password: &'a str,
        reasons: &'a [&'a str],
    }
    let refusal = |case, extra, reasons| Refusal {
        case,
        prefix: SECURED_PREFIX,
        extra,
        password: KODER_PASSWORD,
        reasons,
    };
    let cases = [
        Refusal {
            password: "not-the-password",
            ..refusal(
                "wrong password",
                vec![],
                &["etcd refused the user koder", "wrong password"],
            )
        },
        refusal(
            "wrong CA",
            vec!["--etcd-cacert", &other_ca],
            &[
                "etcd at https://127.0.0.1:",
                "its certificate is not signed by the CA in --etcd-cacert",
            ],
        ),
        refusal(
            "no client certificate",
            vec!["--etcd-cert", "none", "--etcd-key", "none"],
            &[
                "etcd at https://127.0.0.1:",
                "requires a client certificate",
                "--etcd-cert",
            ],
        ),
        refusal(
            "client certificate of another CA",
            vec!["--etcd-cert", &foreign_cert, "--etcd-key", &foreign_key],
            &[
                "etcd at https://127.0.0.1:",
                "rejected the client certificate --etcd-cert",
            ],
        ),
        Refusal {
            prefix: "/elsewhere/",
            ..refusal(
                "role without the prefix",
                vec![],
                &["etcd denied the user koder", "/elsewhere/", "permission denied"],
            )
        },
    ];
    for (i, refused) in cases.into_iter().enumerate() {
        let Refusal {
            case,
            prefix,
            extra,
            password,
            reasons,
        } = refused;
        // The settings from the environment, so that a flag can take one back.
        let mut cmd = secured_node(&cluster, &tmp.path().join(format!("r{i}")), 1, prefix, &extra);
        cmd.env("KODER_DNS_ETCD_PASSWORD", password);
        let started = Instant::now();
        let (status, stderr) = match crate::child::launch_command(cmd).await {
            Started::Up(proc) => panic!("{case}: the node started:\n{}", proc.stderr()),
            Started::Exited { status, stderr } => (status, stderr),
        };
        let took = started.elapsed();
        assert_eq!(status.code(), Some(2), "{case}: {stderr}");
        assert!(took < Duration::from_secs(10), "{case}: refused after {took:?}");
        for reason in reasons {
            assert!(stderr.contains(reason), "{case}: {reason:?} not in:\n{stderr}");
        }
        assert!(
            !stderr.contains(KODER_PASSWORD) && !stderr.contains("not-the-password"),
            "{case}: a password in the log:\n{stderr}"
        );
    }

    let secured = cluster.secured.as_ref().unwrap();
    let migrate = |password: &str| {
        Command::new(env!("CARGO_BIN_EXE_koder-dns"))
            .args(["migrate", "--to-etcd", "--etcd-prefix", SECURED_PREFIX])
            .arg("--data-dir")
            .arg(tmp.path().join("redb"))
            .env("KODER_DNS_ETCD_ENDPOINTS", cluster.endpoints())
            .env("KODER_DNS_ETCD_CACERT", &secured.pki.ca_path)
            .env("KODER_DNS_ETCD_CERT", &secured.client.0)
            .env("KODER_DNS_ETCD_KEY", &secured.client.1)
            .env("KODER_DNS_ETCD_USER", "koder")
            .env("KODER_DNS_ETCD_PASSWORD", password)
            .output()
            .expect("run migrate")
    };
    let refused = migrate("not-the-password");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("etcd refused the user koder"), "{stderr}");
    let copied = migrate(KODER_PASSWORD);
    assert!(
        copied.status.success(),
        "migrate: {}",
        String::from_utf8_lossy(&copied.stderr)
    );
    assert!(String::from_utf8_lossy(&copied.stdout).contains("copied 0 instances"));
}

/// One revision on every node (INTERFACE.md, "Several nodes: etcd"): after a burst of
/// registrations, after a node is killed under load and started again, and after etcd's
/// leader is killed under load, every node shows the same `X-Koder-Index` and SOA serial
/// within a second of the last write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn every_node_shows_one_index_within_a_second_after_a_burst_a_kill_9_and_a_leader_change() {
    use std::sync::atomic::AtomicBool;

    let (_turn, mut cluster, mut n, client) = three_nodes("/t-index/").await;
    let bases = |n: &Nodes| n.procs.iter().map(|p| p.base()).collect::<Vec<_>>();

    // A burst through every node, heartbeats among it.
    let stop = Arc::new(AtomicBool::new(false));
    let burst = load(&client, bases(&n), 24, "burst", stop.clone());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (status, body) = post(&client, &n.procs[2], "/services/heartbeat", &json!({"id": "burst-0-0"})).await;
    assert_eq!(status, 200, "{body}");
    let (acked, last) = last_write(&stop, burst).await;
    assert!(acked >= 100, "{acked} registrations in the burst");
    let all: Vec<&Proc> = n.procs.iter().collect();
    let after_burst = one_index_everywhere("after a burst", &client, &all, last).await;

    // kill -9 of node 1 while registrations go through nodes 1 and 2; started again.
    let stop = Arc::new(AtomicBool::new(false));
    let under_load = load(&client, bases(&n)[..2].to_vec(), 16, "killed", stop.clone());
    tokio::time::sleep(Duration::from_millis(1000)).await;
    n.procs.remove(0).kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (_, last) = last_write(&stop, under_load).await;
    let restarted = node(&n.dirs[0], &cluster.endpoints(), "/t-index/").await;
    n.procs.insert(0, restarted);
    let all: Vec<&Proc> = n.procs.iter().collect();
    // The restarted node loaded the registry after the last write: from its start on.
    let after_kill =
        one_index_everywhere("after a kill -9 and a restart", &client, &all, last.max(Instant::now())).await;
    assert!(after_kill > after_burst);

    // etcd's leader killed while registrations go on (503s during the election are retried).
    let stop = Arc::new(AtomicBool::new(false));
    let under_load = load(&client, bases(&n), 16, "leader", stop.clone());
    tokio::time::sleep(Duration::from_millis(700)).await;
    let leader = cluster.leader().await;
    cluster.kill(leader);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let (acked, last) = last_write(&stop, under_load).await;
    assert!(acked > 0);
    let all: Vec<&Proc> = n.procs.iter().collect();
    let after_leader = one_index_everywhere("after etcd's leader was killed", &client, &all, last).await;
    assert!(after_leader > after_kill);
}

/// Renewals change no answer: heart-beating through every node for longer than the TTL
/// moves no node's index or serial, and a blocking query held on each node meanwhile is
/// answered only at its wait's end, with the index it was given. Other nodes still see
/// each renewal (the lease holds everywhere, `updated_at` follows).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn a_renewal_only_period_moves_no_index_and_wakes_no_held_request() {
    let (_turn, _cluster, n, client) = three_nodes("/t-renewals/").await;
    for i in 0..6 {
        let (status, body) = post(
            &client,
            &n.procs[i % 3],
            "/services/register",
            &instance(&format!("beat{i}"), "beat", i, 2 * SECOND),
        )
        .await;
        assert_eq!(status, 200, "{body}");
    }
    let all: Vec<&Proc> = n.procs.iter().collect();
    let before = one_index_everywhere("after the registrations", &client, &all, Instant::now()).await;
    let stamped = listed(&client, &n.procs[0]).await["beat0"]["updated_at"].clone();

    // A blocking query on each node, held for 3 s.
    let wait = Duration::from_secs(3);
    let mut held = tokio::task::JoinSet::new();
    for node in &n.procs {
        let (client, url) = (
            client.clone(),
            format!("{}/api/v1/services?index={before}&wait=3s", node.base()),
        );
        held.spawn(async move {
            let started = Instant::now();
            let response = client.get(url).header("X-API-Key", KEY).send().await.unwrap();
            let index: u64 = response.headers()["x-koder-index"].to_str().unwrap().parse().unwrap();
            (index, started.elapsed())
        });
    }
    // Heartbeats through every node, each instance through another node than it was
    // registered on, for 1.5 TTLs.
    let until_at = Instant::now() + wait - Duration::from_millis(200);
    let mut beats = 0;
    while Instant::now() < until_at {
        for i in 0..6 {
            let (status, body) = post(
                &client,
                &n.procs[(i + 1) % 3],
                "/services/heartbeat",
                &json!({"id": format!("beat{i}")}),
            )
            .await;
            assert_eq!(status, 200, "{body}");
            beats += 1;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    while let Some(answer) = held.join_next().await {
        let (index, took) = answer.unwrap();
        assert_eq!(index, before, "a held request was answered with another index");
        assert!(
            took >= wait,
            "a held request was answered after {took:?}, before its wait of {wait:?}"
        );
    }
    for node in &n.procs {
        assert_eq!(index(&client, node).await, before, "{beats} heartbeats moved an index");
        assert_eq!(soa_serial(node.dns).await, before as u32);
        assert_eq!(
            srv(node.dns, "beat").await,
            6,
            "renewed on every node, past the 2 s TTL"
        );
    }
    assert_ne!(
        listed(&client, &n.procs[0]).await["beat0"]["updated_at"],
        stamped,
        "node 1 shows the renewals taken by node 2"
    );
}

/// One node cut off from etcd (its only endpoint is a member that stops) while the other
/// two keep quorum: it answers heartbeats 503 within 5 s while the others answer theirs
/// 200; the others expire the instances its registrants could only renew through it
/// once their TTL has passed; and it stops probing its share of the health checks once
/// its membership lease may have ended, so a survivor takes each over without two nodes
/// probing one instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn a_node_cut_off_from_etcd_refuses_heartbeats_stops_probing_and_the_others_expire_its_registrants() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut cluster = Cluster::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let prefix = "/t-cut/";
    let mut procs = Vec::new();
    for i in 0..2 {
        procs.push(node(&tmp.path().join(format!("n{i}")), &cluster.endpoints(), prefix).await);
    }
    // Cut off through a member that does not lead: no election follows its stop.
    let leader = cluster.leader().await;
    let victim = (leader + 1) % 3;
    let cut = node(&tmp.path().join("cut"), &cluster.endpoint(victim), prefix).await;
    let client = client();
    let target = Target::start().await;
    let mut members: Vec<Arc<str>> = Vec::new();
    for node in procs.iter().chain([&cut]) {
        members.push(healthz(&client, node).await["node"].as_str().unwrap().into());
    }
    // A checked instance the cut-off node probes.
    let probed = (0..)
        .map(|i| format!("probed{i}"))
        .find(|id| koder_dns::health::owner(&members, id).is_some_and(|o| *o == members[2]))
        .unwrap();
    let path = format!("/{probed}");
    let (status, body) = post(
        &client,
        &cut,
        "/services/register",
        &checked(&probed, target.port, &path, "500ms"),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    for (id, node) in [("kept", &procs[0]), ("cut", &cut)] {
        let (status, body) = post(&client, node, "/services/register", &instance(id, id, 0, 2 * SECOND)).await;
        assert_eq!(status, 200, "{body}");
    }
    for node in procs.iter().chain([&cut]) {
        until("every node serves both", Duration::from_secs(3), async || {
            srv(node.dns, "kept").await == 1 && srv(node.dns, "cut").await == 1
        })
        .await;
    }
    until(
        "the cut-off node probes its share",
        Duration::from_secs(5),
        async || checks_running(&client, &cut).await == 1,
    )
    .await;

    cluster.kill(victim);
    let cut_at = Instant::now();
    let mut refused_after = None;
    let mut stopped_after = None;
    // Each registrant heart-beats its own node every 300 ms.
    while cut_at.elapsed() < Duration::from_secs(6) {
        let (status, body) = post(&client, &procs[0], "/services/heartbeat", &json!({"id": "kept"})).await;
        assert_eq!(status, 200, "the nodes with quorum take heartbeats: {body}");
        let (status, _) = post(&client, &cut, "/services/heartbeat", &json!({"id": "cut"})).await;
        match status {
            503 => {
                refused_after.get_or_insert(cut_at.elapsed());
            }
            200 => assert!(
                refused_after.is_none(),
                "a heartbeat 200 on the cut-off node after a 503"
            ),
            other => panic!("the cut-off node answered a heartbeat {other}"),
        }
        if stopped_after.is_none() && checks_running(&client, &cut).await == 0 {
            stopped_after = Some(cut_at.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let refused_after = refused_after.expect("the cut-off node never answered 503");
    assert!(
        refused_after < Duration::from_secs(5),
        "503 only {refused_after:?} after the cut"
    );
    // Its registrant's lease (2 s) ended, renewed nowhere: the others expire it.
    for node in &procs {
        assert_eq!(srv(node.dns, "cut").await, 0, "expired on the nodes with quorum");
        assert_eq!(srv(node.dns, "kept").await, 1);
    }
    let stopped_after = stopped_after.expect("the cut-off node kept probing");
    assert!(
        stopped_after <= Duration::from_millis(3000 + 1500),
        "stopped probing {stopped_after:?} after the cut: more than its membership lease and slack"
    );
    until("a survivor probes it", Duration::from_secs(3), async || {
        let mut running = 0;
        for node in &procs {
            running += checks_running(&client, node).await;
        }
        running == 1
    })
    .await;
    // One prober: about 4 probes in 2 s at 500 ms, not 8.
    let from = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let count = target.probes(&path, from, Instant::now()).len();
    assert!((2..=6).contains(&count), "{count} probes in 2 s at 500 ms");
    eprintln!("cut off: heartbeats 503 after {refused_after:?}, probing stopped after {stopped_after:?}");
}

/// Two nodes with one `--node-id` would share one membership key and one share of the
/// health checks: the second is refused at start (exit 2, naming the id) while the first
/// lives. A node started with the id of one just killed (its membership lease not ended
/// yet) waits that lease out and starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn a_second_node_with_a_live_nodes_id_is_refused_and_a_killed_ones_id_is_taken_over() {
    let _one = ONE_AT_A_TIME.lock().await;
    let cluster = Cluster::start().await;
    let tmp = tempfile::tempdir().unwrap();
    let endpoints = cluster.endpoints();
    let mut args = node_args(&endpoints, "/t-ids/");
    args.extend(["--node-id", "edge-1"]);
    let first = launch_ok(&tmp.path().join("a"), &args).await;
    let started = Instant::now();
    let (status, stderr) = crate::child::launch_refused(&tmp.path().join("b"), &args).await;
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--node-id edge-1"), "{stderr}");
    eprintln!(
        "refused after {:?}: {}",
        started.elapsed(),
        stderr.lines().last().unwrap_or_default()
    );
    assert_eq!(
        healthz(&client(), &first).await["node"],
        "edge-1",
        "the first one runs on"
    );

    first.kill9();
    let killed = Instant::now();
    let second = launch_ok(&tmp.path().join("c"), &args).await;
    eprintln!("the killed node's id taken over after {:?}", killed.elapsed());
    let health = healthz(&client(), &second).await;
    assert_eq!(health["node"], "edge-1");
    assert_eq!(health["members"], json!(["edge-1"]), "{health}");
}

/// Every node down for longer than a checked instance's lease, then started again one
/// after another: each parks the instance (kept, not served) until its registrant or its
/// check is heard from. No heartbeat comes; the owner's check fails, then passes: the
/// passing verdict confirms it on every node, not only on the node that probes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs etcd (tests/run.sh installs etcd-server)"]
async fn a_parked_instance_is_confirmed_on_every_node_by_its_owners_passing_check() {
    let (_turn, cluster, mut n, client) = three_nodes("/t-parked/").await;
    let target = Target::start().await;
    let ttl = 8 * SECOND;
    let mut body = checked("parked", target.port, "/parked", "300ms");
    body["ttl_ns"] = ttl.into();
    let (status, answer) = post(&client, &n.procs[0], "/services/register", &body).await;
    assert_eq!(status, 200, "{answer}");
    // Let the expiry leader stamp its last run after the registration.
    tokio::time::sleep(Duration::from_millis(800)).await;
    for proc in n.procs.drain(..) {
        proc.kill9();
    }
    tokio::time::sleep(Duration::from_nanos(ttl as u64 + SECOND as u64)).await;
    target.fail(true);
    for dir in &n.dirs {
        n.procs.push(node(dir, &cluster.endpoints(), "/t-parked/").await);
    }
    // Parked on every node: listed, not served, while its check fails.
    for _ in 0..5 {
        for node in &n.procs {
            assert!(
                listed(&client, node).await.contains_key("parked"),
                "kept on {}",
                node.base()
            );
            assert_eq!(
                srv(node.dns, "checked").await,
                0,
                "served unconfirmed on {}",
                node.base()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    target.fail(false);
    let passing = Instant::now();
    for node in &n.procs {
        until("confirmed on every node", Duration::from_secs(3), async || {
            srv(node.dns, "checked").await == 1
        })
        .await;
    }
    eprintln!("check passing -> served on all 3 nodes: {:?}", passing.elapsed());
}
