//! Not a criterion benchmark: a 3-node koder-dns cluster on etcd, driven by `benches/etcd.sh`
//! (which starts etcd and the nodes). In one run, against the same etcd:
//!
//! 1. raw etcd transactions from the same client crate, the shape of a registration (a
//!    compare on `mod_revision` and a put of an instance's JSON), `CLIENTS` at once;
//! 2. registrations/s through the nodes' REST API, `CLIENTS` at once, spread over the nodes;
//! 3. propagation: from the `200` of a registration on node 1 to the SRV answer on node 3;
//! 4. heartbeats/s on one node.
//!
//! `cargo run --release --features etcd --example etcd-bench -- ETCD_URLS NODE_URLS DNS3 KEY [CLIENTS] [SECONDS]`

use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, Txn, TxnOp};
use hickory_proto::op::{Message, MessageType, OpCode, Query};
use hickory_proto::rr::{Name, RecordType};
use serde_json::json;

fn body(id: &str, i: u64) -> serde_json::Value {
    json!({
        "id": id,
        "name": format!("bench{}", i % 64),
        "address": format!("10.8.{}.{}", (i / 250) % 250, i % 250 + 1),
        "port": 20000 + (i % 10000),
        "ttl_ns": 300_000_000_000i64,
    })
}

/// Runs `clients` loops of `op` for `seconds`; returns completed operations per second.
async fn rate<F, Fut>(clients: usize, seconds: u64, op: F) -> f64
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let done = Arc::new(AtomicU64::new(0));
    let end = Instant::now() + Duration::from_secs(seconds);
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for c in 0..clients {
        let (op, done) = (op.clone(), done.clone());
        tasks.spawn(async move {
            let mut k = 0;
            while Instant::now() < end {
                if op(c, k).await {
                    done.fetch_add(1, Ordering::Relaxed);
                }
                k += 1;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
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

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 5 {
        eprintln!("usage: etcd-bench ETCD_URLS NODE_URLS DNS_OF_NODE_3 KEY [CLIENTS=64] [SECONDS=5]");
        std::process::exit(2);
    }
    let etcd: Vec<String> = args[1].split(',').map(str::to_owned).collect();
    let nodes: Arc<Vec<String>> = Arc::new(args[2].split(',').map(str::to_owned).collect());
    let dns3: SocketAddr = args[3].parse().expect("DNS address of node 3");
    let key = Arc::new(args[4].clone());
    let clients: usize = args.get(5).map_or(64, |s| s.parse().unwrap());
    let seconds: u64 = args.get(6).map_or(5, |s| s.parse().unwrap());

    // 1 and 2, alternated over three rounds (the machine's disk and CPU drift between
    // runs): raw etcd transactions of a registration's shape, then registrations through
    // the nodes. The medians are reported.
    let client = Client::connect(&etcd, None).await.expect("connect to etcd");
    let http = koder_dns::tls::client_builder()
        .pool_max_idle_per_host(clients)
        .build()
        .unwrap();
    let (mut raws, mut regs) = (Vec::new(), Vec::new());
    for round in 0..3u64 {
        let client = client.clone();
        raws.push(
            rate(clients, seconds, move |c, k| {
                let mut client = client.clone();
                async move {
                    let key = format!("/bench-raw/instances/raw-{round}-{c}-{k}");
                    let json = serde_json::to_vec(&body(&key, k)).unwrap();
                    let txn = Txn::new()
                        .when([Compare::mod_revision(key.clone(), CompareOp::Equal, 0)])
                        .and_then([TxnOp::put(key, json, None)]);
                    client.txn(txn).await.is_ok_and(|r| r.succeeded())
                }
            })
            .await,
        );
        let (http, nodes, key) = (http.clone(), nodes.clone(), key.clone());
        regs.push(
            rate(clients, seconds, move |c, k| {
                let (http, nodes, key) = (http.clone(), nodes.clone(), key.clone());
                async move {
                    // Round 0's ids are the ones heart-beaten in step 4.
                    let id = if round == 0 {
                        format!("reg-{c}-{k}")
                    } else {
                        format!("reg{round}-{c}-{k}")
                    };
                    let response = http
                        .post(format!("{}/api/v1/services/register", nodes[c % nodes.len()]))
                        .header("X-API-Key", key.as_str())
                        .json(&body(&id, k))
                        .send()
                        .await;
                    response.is_ok_and(|r| r.status() == 200)
                }
            })
            .await,
        );
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[1]
    };
    let (raw, registrations) = (median(&mut raws), median(&mut regs));

    // 3. Propagation from node 1's 200 to node 3's DNS answer, one at a time.
    let mut delays = Vec::new();
    for i in 0..200u64 {
        let service = format!("prop{i}");
        let response = http
            .post(format!("{}/api/v1/services/register", nodes[0]))
            .header("X-API-Key", key.as_str())
            .json(&json!({"id": service, "name": service, "address": "10.9.0.1", "port": 1000 + i, "ttl_ns": 300_000_000_000i64}))
            .send()
            .await
            .expect("register");
        assert_eq!(response.status(), 200);
        let started = Instant::now();
        while srv_answers(dns3, &service).await == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{service} never reached node 3"
            );
        }
        delays.push(started.elapsed());
    }
    delays.sort();
    let p = |q: f64| delays[((delays.len() as f64 * q) as usize).min(delays.len() - 1)];

    // 4. Heartbeats on node 1, for the instances registered there in step 2.
    let heartbeats = {
        let (http, nodes, key) = (http.clone(), nodes.clone(), key.clone());
        rate(clients, seconds, move |c, k| {
            let (http, nodes, key) = (http.clone(), nodes.clone(), key.clone());
            async move {
                // Client c registered reg-c-* on node c % 3; take the ones of node 1's clients.
                let owner = c - c % nodes.len();
                let id = format!("reg-{owner}-{}", k % 16);
                let response = http
                    .post(format!("{}/api/v1/services/heartbeat", nodes[0]))
                    .header("X-API-Key", key.as_str())
                    .json(&json!({ "id": id }))
                    .send()
                    .await;
                response.is_ok_and(|r| r.status() == 200)
            }
        })
        .await
    };

    println!("| measure ({clients} clients, {seconds} s each; 1 and 2: medians of 3 alternated rounds) | figure |");
    println!("| --- | --- |");
    println!("| raw etcd txns/s (compare + put, same client crate) | {raw:.0} |");
    println!(
        "| registrations/s through 3 nodes | {registrations:.0} ({:.2}x raw) |",
        registrations / raw
    );
    println!(
        "| propagation 200 on node 1 -> SRV on node 3, p50 / p99 / max (200 samples) | {:?} / {:?} / {:?} |",
        p(0.5),
        p(0.99),
        delays[delays.len() - 1]
    );
    println!("| heartbeats/s on node 1 | {heartbeats:.0} |");
}
