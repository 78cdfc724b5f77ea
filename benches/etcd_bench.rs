//! Not a criterion benchmark: koder-dns nodes on etcd, driven by `benches/etcd.sh` (which
//! starts etcd and the nodes). Three measures:
//!
//! - `cluster ETCD_URLS NODE_URLS DNS3 KEY [CLIENTS] [SECONDS] [ROUNDS]`: in one run against
//!   the same etcd, raw etcd transactions from the same client crate of a registration's
//!   shape (a compare on `mod_revision` and a put of an instance's JSON) and registrations
//!   through the nodes' REST API, alternated over ROUNDS rounds; propagation from the `200`
//!   of a registration on node 1 to the SRV answer on node 3.
//! - `heartbeats NODE_URLS KEY CLIENTS SECONDS ROUNDS`: heartbeats/s and their latency
//!   (p50, p99) through the first node of each comma-separated group of NODE_URLS, the
//!   groups separated by `;` (e.g. this build's nodes, then a previous build's): the
//!   groups alternate within each round.
//! - `scale ETCD_URL NODE_URLS KEY INSTANCES PER_SECOND SECONDS PIDS REGISTER`: INSTANCES
//!   registered through the nodes (unless REGISTER is 0: done already), then each
//!   heart-beaten through node 1 (the others only follow), at
//!   PER_SECOND in all, for SECONDS: renewals/s answered 200, their latency, the events
//!   etcd sent to watchers per second (its `etcd_debugging_mvcc_events_total`), and the CPU
//!   and RSS of each process of PIDS (`name=pid,...`) over the renewals.
//!
//! `cargo run --release --features etcd --example etcd-bench -- MEASURE ARGS...`

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use hickory_proto::op::{Message, MessageType, OpCode, Query};
use hickory_proto::rr::{Name, RecordType};
use serde_json::json;

fn body(id: &str, i: u64, ttl_s: i64) -> serde_json::Value {
    json!({
        "id": id,
        "name": format!("bench{}", i % 64),
        "address": format!("10.8.{}.{}", (i / 250) % 250, i % 250 + 1),
        "port": 20000 + (i % 10000),
        "ttl_ns": ttl_s * 1_000_000_000,
    })
}

/// Completed operations per second and the latency of each, from `clients` loops of `op`
/// for `seconds`; `op(client, k)` says whether it succeeded.
struct Rate {
    per_second: f64,
    latencies: Vec<Duration>,
}

impl Rate {
    fn quantile(&mut self, q: f64) -> Duration {
        self.latencies.sort_unstable();
        let last = self.latencies.len().saturating_sub(1);
        self.latencies
            .get(((self.latencies.len() as f64 * q) as usize).min(last))
            .copied()
            .unwrap_or_default()
    }
}

/// Runs `clients` loops of `op` for `seconds`, each at most `per_client` times a second
/// (unbounded when 0).
async fn rate<F, Fut>(clients: usize, seconds: f64, per_client: f64, op: F) -> Rate
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let done = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..clients {
        let (op, done) = (op.clone(), done.clone());
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            let mut tick = (per_client > 0.0).then(|| {
                let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per_client));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                tick
            });
            // Spread the clients over the first period.
            if per_client > 0.0 {
                tokio::time::sleep(Duration::from_secs_f64(fastrand::f64() / per_client)).await;
            }
            let mut k = 0;
            while Instant::now() < end {
                if let Some(tick) = &mut tick {
                    tick.tick().await;
                }
                let sent = Instant::now();
                if op(c, k).await {
                    latencies.push(sent.elapsed());
                    done.fetch_add(1, Ordering::Relaxed);
                }
                k += 1;
            }
            latencies
        });
    }
    let mut latencies = Vec::new();
    while let Some(l) = tasks.join_next().await {
        latencies.extend(l.unwrap());
    }
    Rate {
        per_second: done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64(),
        latencies,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

async fn srv_answers(dns: SocketAddr, service: &str) -> usize {
    let mut message = Message::new(fastrand::u16(..), MessageType::Query, OpCode::Query);
    let name = Name::from_str(&format!("_{service}._tcp.service.koder.")).unwrap();
    message.add_query(Query::query(name, RecordType::SRV));
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    socket.send_to(&message.to_vec().unwrap(), dns).await.unwrap();
    let mut buf = vec![0u8; 4096];
    match tokio::time::timeout(Duration::from_secs(1), socket.recv(&mut buf)).await {
        Ok(Ok(n)) => Message::from_vec(&buf[..n]).map_or(0, |m| m.answers.len()),
        _ => 0,
    }
}

fn http(clients: usize) -> reqwest::Client {
    koder_dns::tls::client_builder()
        .pool_max_idle_per_host(clients)
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

async fn post(http: &reqwest::Client, url: &str, key: &str, body: &serde_json::Value) -> bool {
    let response = http.post(url).header("X-API-Key", key).json(body).send().await;
    response.is_ok_and(|r| r.status() == 200)
}

/// Registers `ids` (`reg-<i>`) through the nodes, `clients` at a time, node `i % nodes`.
async fn register_all(http: &reqwest::Client, nodes: &Arc<Vec<String>>, key: &Arc<String>, ids: u64, ttl_s: i64) {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..64 {
        let (http, nodes, key, next) = (http.clone(), nodes.clone(), key.clone(), next.clone());
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= ids {
                    return;
                }
                let url = format!("{}/api/v1/services/register", nodes[i as usize % nodes.len()]);
                while !post(&http, &url, &key, &body(&format!("reg-{i}"), i, ttl_s)).await {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// `name=pid,...` → (name, CPU seconds so far, RSS in MiB) of each.
fn processes(pids: &str) -> Vec<(String, f64, f64)> {
    let hz = 100.0; // CLK_TCK on Linux
    pids.split(',')
        .filter_map(|p| p.split_once('='))
        .map(|(name, pid)| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let fields: Vec<&str> = stat
                .rsplit_once(')')
                .map_or("", |(_, r)| r)
                .split_whitespace()
                .collect();
            let ticks: f64 = fields.get(11).and_then(|u| u.parse::<f64>().ok()).unwrap_or(0.0)
                + fields.get(12).and_then(|s| s.parse::<f64>().ok()).unwrap_or(0.0);
            let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
            let rss_kib: f64 = status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(0.0);
            (name.to_owned(), ticks / hz, rss_kib / 1024.0)
        })
        .collect()
}

/// etcd's count of events sent to watchers, from its `/metrics`.
async fn watch_events(http: &reqwest::Client, etcd: &str) -> f64 {
    let text = http
        .get(format!("{etcd}/metrics"))
        .send()
        .await
        .expect("etcd /metrics")
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with("etcd_debugging_mvcc_events_total"))
        .filter_map(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .sum()
}

async fn cluster(args: &[String]) {
    let etcd: Vec<String> = args[0].split(',').map(str::to_owned).collect();
    let nodes: Arc<Vec<String>> = Arc::new(args[1].split(',').map(str::to_owned).collect());
    let dns3: SocketAddr = args[2].parse().expect("DNS address of node 3");
    let key = Arc::new(args[3].clone());
    let clients: usize = args.get(4).map_or(64, |s| s.parse().unwrap());
    let seconds: f64 = args.get(5).map_or(5.0, |s| s.parse().unwrap());
    let rounds: u64 = args.get(6).map_or(3, |s| s.parse().unwrap());
    let client = Client::connect(&etcd, None).await.expect("connect to etcd");
    let http = http(clients);
    let (mut raws, mut regs) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        let client = client.clone();
        let raw = rate(clients, seconds, 0.0, move |c, k| {
            let mut client = client.clone();
            async move {
                let key = format!("/bench-raw/instances/raw-{round}-{c}-{k}");
                let json = serde_json::to_vec(&body(&key, k, 300)).unwrap();
                let txn = Txn::new()
                    .when([Compare::mod_revision(key.clone(), CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(key, json, None)]);
                client.txn(txn).await.is_ok_and(|r| r.succeeded())
            }
        })
        .await;
        raws.push(raw.per_second);
        let (http, nodes, key) = (http.clone(), nodes.clone(), key.clone());
        let reg = rate(clients, seconds, 0.0, move |c, k| {
            let (http, nodes, key) = (http.clone(), nodes.clone(), key.clone());
            async move {
                let url = format!("{}/api/v1/services/register", nodes[c % nodes.len()]);
                post(&http, &url, &key, &body(&format!("reg{round}-{c}-{k}"), k, 300)).await
            }
        })
        .await;
        regs.push(reg.per_second);
        eprintln!(
            "round {round}: raw {:.0}/s, registrations {:.0}/s",
            raw.per_second, reg.per_second
        );
    }
    let (raw, registrations) = (median(raws), median(regs));

    // Propagation from node 1's 200 to node 3's DNS answer, one at a time.
    let mut delays = Vec::new();
    for i in 0..200u64 {
        let service = format!("prop{i}");
        let body = json!({"id": service, "name": service, "address": "10.9.0.1", "port": 1000 + i, "ttl_ns": 300_000_000_000i64});
        assert!(post(&http, &format!("{}/api/v1/services/register", nodes[0]), &key, &body).await);
        let started = Instant::now();
        while srv_answers(dns3, &service).await == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{service} never reached node 3"
            );
        }
        delays.push(started.elapsed());
    }
    let mut propagation = Rate {
        per_second: 0.0,
        latencies: delays,
    };
    println!("| measure ({clients} clients, {seconds} s each; medians of {rounds} alternated rounds) | figure |");
    println!("| --- | --- |");
    println!("| raw etcd txns/s (compare + put, same client crate) | {raw:.0} |");
    println!(
        "| registrations/s through {} nodes | {registrations:.0} ({:.2}x raw) |",
        nodes.len(),
        registrations / raw
    );
    println!(
        "| propagation 200 on node 1 -> SRV on node 3, p50 / p99 / max (200 samples) | {:?} / {:?} / {:?} |",
        propagation.quantile(0.5),
        propagation.quantile(0.99),
        propagation.quantile(1.0)
    );
}

async fn heartbeats(args: &[String]) {
    let groups: Vec<Vec<String>> = args[0]
        .split(';')
        .map(|g| g.split(',').map(str::to_owned).collect())
        .collect();
    let key = Arc::new(args[1].clone());
    let clients: usize = args[2].parse().unwrap();
    let seconds: f64 = args[3].parse().unwrap();
    let rounds: usize = args[4].parse().unwrap();
    let http = http(clients);
    // The instances heart-beaten: 1024 on each group's first node.
    for group in &groups {
        register_all(&http, &Arc::new(vec![group[0].clone()]), &key, 1024, 300).await;
    }
    let mut figures: Vec<(Vec<f64>, Vec<Duration>, Vec<Duration>)> = vec![Default::default(); groups.len()];
    for round in 0..rounds {
        for (g, group) in groups.iter().enumerate() {
            let (http, key, url) = (
                http.clone(),
                key.clone(),
                format!("{}/api/v1/services/heartbeat", group[0]),
            );
            let mut beats = rate(clients, seconds, 0.0, move |c, k| {
                let (http, key, url) = (http.clone(), key.clone(), url.clone());
                async move {
                    let id = format!("reg-{}", (c as u64 * 7919 + k) % 1024);
                    post(&http, &url, &key, &json!({ "id": id })).await
                }
            })
            .await;
            let (p50, p99) = (beats.quantile(0.5), beats.quantile(0.99));
            eprintln!(
                "round {round}, group {g}: {:.0} heartbeats/s, p50 {p50:?}, p99 {p99:?}",
                beats.per_second
            );
            figures[g].0.push(beats.per_second);
            figures[g].1.push(p50);
            figures[g].2.push(p99);
        }
    }
    println!(
        "| nodes ({clients} clients, {seconds} s a round, medians of {rounds} alternated rounds) | heartbeats/s | p50 | p99 |"
    );
    println!("| --- | --- | --- | --- |");
    for (group, (per_second, p50, p99)) in groups.iter().zip(figures) {
        let mid = |mut v: Vec<Duration>| {
            v.sort();
            v[v.len() / 2]
        };
        println!(
            "| {} | {:.0} | {:?} | {:?} |",
            group[0],
            median(per_second),
            mid(p50),
            mid(p99)
        );
    }
}

async fn scale(args: &[String]) {
    let etcd = args[0].clone();
    let nodes: Arc<Vec<String>> = Arc::new(args[1].split(',').map(str::to_owned).collect());
    let key = Arc::new(args[2].clone());
    let instances: u64 = args[3].parse().unwrap();
    let per_second: f64 = args[4].parse().unwrap();
    let seconds: f64 = args[5].parse().unwrap();
    let pids = args[6].clone();
    let http = http(256);
    if args[7] != "0" {
        let started = Instant::now();
        // A TTL long enough that none expires while they are registered and heart-beaten.
        register_all(&http, &nodes, &key, instances, 600).await;
        eprintln!(
            "{instances} registered through {} nodes in {:.1} s",
            nodes.len(),
            started.elapsed().as_secs_f64()
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let clients = 256usize;
    let (events_before, before, started) = (watch_events(&http, &etcd).await, processes(&pids), Instant::now());
    let (http2, nodes2, key2) = (http.clone(), nodes.clone(), key.clone());
    let mut beats = rate(clients, seconds, per_second / clients as f64, move |c, k| {
        let (http, nodes, key) = (http2.clone(), nodes2.clone(), key2.clone());
        async move {
            // Every instance in turn, through node 1: the other nodes only follow, so their
            // CPU is what applying the renewals costs a node.
            let i = (k * clients as u64 + c as u64) % instances;
            let url = format!("{}/api/v1/services/heartbeat", nodes[0]);
            post(&http, &url, &key, &json!({ "id": format!("reg-{i}") })).await
        }
    })
    .await;
    let (events_after, after) = (watch_events(&http, &etcd).await, processes(&pids));
    let elapsed = started.elapsed().as_secs_f64();
    println!(
        "| {instances} instances, {} nodes, {per_second:.0} renewals/s offered for {seconds} s | figure |",
        nodes.len()
    );
    println!("| --- | --- |");
    println!("| renewals answered 200 /s | {:.0} |", beats.per_second);
    println!(
        "| heartbeat p50 / p99 | {:?} / {:?} |",
        beats.quantile(0.5),
        beats.quantile(0.99)
    );
    println!(
        "| events etcd sent to watchers /s | {:.0} |",
        (events_after - events_before) / elapsed
    );
    for ((name, cpu0, _), (_, cpu1, rss)) in before.iter().zip(&after) {
        println!(
            "| {name}: CPU (cores), RSS | {:.2}, {rss:.0} MiB |",
            (cpu1 - cpu0) / elapsed
        );
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("cluster") if args.len() >= 5 => cluster(&args[1..]).await,
        Some("heartbeats") if args.len() >= 6 => heartbeats(&args[1..]).await,
        Some("scale") if args.len() >= 9 => scale(&args[1..]).await,
        _ => {
            eprintln!(
                "usage: etcd-bench cluster ETCD_URLS NODE_URLS DNS_OF_NODE_3 KEY [CLIENTS=64] [SECONDS=5] [ROUNDS=3]\n\
                 \x20      etcd-bench heartbeats NODE_URLS[;NODE_URLS...] KEY CLIENTS SECONDS ROUNDS\n\
                 \x20      etcd-bench scale ETCD_URL NODE_URLS KEY INSTANCES PER_SECOND SECONDS name=pid,... REGISTER"
            );
            std::process::exit(2);
        }
    }
}
