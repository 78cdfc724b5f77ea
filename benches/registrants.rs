//! Not a criterion benchmark: N `Registrant`s against an in-process koder-dns, behind a
//! counting pass-through so every request they send is counted in 100 ms buckets.
//!
//! Measures (1) the steady heartbeat rate of N agents, and (2) after the registry is restarted
//! with an empty data directory on the same port, the peak request rate of their reconnection
//! and the time until all N are registered again.
//!
//! `cargo run --release --example registrants-bench -- [N=1000] [TTL_MS=3000]`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use koder_dns::client::{Client, Instance, Registrant};
use koder_dns::config::Config;

const KEY: &str = "bench-key-0123456789abcdef";

fn config(dir: &std::path::Path, http: std::net::SocketAddr) -> Config {
    Config {
        dns_listen: "127.0.0.1:0".parse().unwrap(),
        http_listen: http,
        data_dir: dir.join("data"),
        zones_dir: dir.join("zones"),
        api_keys: vec![KEY.to_owned()],
        ..Config::default()
    }
}

/// Requests seen, per 100 ms bucket since `start`.
struct Counter {
    start: Instant,
    buckets: Vec<AtomicU64>,
}

impl Counter {
    fn hit(&self) {
        let bucket = (self.start.elapsed().as_millis() / 100) as usize;
        if let Some(b) = self.buckets.get(bucket) {
            b.fetch_add(1, Ordering::Relaxed);
        }
    }
    /// Total and peak-per-second (best 100 ms bucket x 10) over [from, to).
    fn between(&self, from: Duration, to: Duration) -> (u64, u64) {
        let range = (from.as_millis() / 100) as usize..(to.as_millis() / 100) as usize;
        let counts: Vec<u64> = self.buckets[range].iter().map(|b| b.load(Ordering::Relaxed)).collect();
        (counts.iter().sum(), counts.iter().max().copied().unwrap_or(0) * 10)
    }
}

async fn proxy(upstream: String, counter: Arc<Counter>) -> String {
    use axum::body::Bytes;
    use axum::http::{HeaderMap, Method, StatusCode, Uri};
    let http = koder_dns::tls::client_builder().build().unwrap();
    let app = axum::Router::new().fallback(move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
        let (http, upstream, counter) = (http.clone(), upstream.clone(), counter.clone());
        async move {
            counter.hit();
            let mut request = http.request(method, format!("{upstream}{uri}")).body(body);
            if let Some(key) = headers.get("X-API-Key") {
                request = request.header("X-API-Key", key);
            }
            match request.send().await {
                Ok(r) => (
                    StatusCode::from_u16(r.status().as_u16()).unwrap(),
                    r.bytes().await.unwrap_or_default(),
                ),
                Err(_) => (StatusCode::BAD_GATEWAY, Bytes::new()),
            }
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

async fn live(base: &str, n: usize) -> bool {
    let client = Client::new(vec![base.to_owned()], KEY, Duration::from_secs(5)).unwrap();
    client
        .instances(Some("bench"))
        .await
        .map(|l| l.len() >= n)
        .unwrap_or(false)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().map_or(Ok(1000), |a| a.parse())?;
    let ttl = Duration::from_millis(args.next().map_or(Ok(3000), |a| a.parse())?);
    let dir = tempfile::tempdir()?;
    let first = koder_dns::server::start(config(&dir.path().join("a"), "127.0.0.1:0".parse()?)).await?;
    let http = first.http_addr;
    let upstream = format!("http://{http}");
    let counter = Arc::new(Counter {
        start: Instant::now(),
        buckets: (0..6000).map(|_| AtomicU64::new(0)).collect(),
    });
    let front = proxy(upstream.clone(), counter.clone()).await;
    let client = Arc::new(Client::new(vec![front], KEY, Duration::from_secs(5))?);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    for i in 0..n {
        let registration = Instance {
            id: format!("bench-{i}").into(),
            name: "bench".into(),
            address: "127.0.0.1".parse().unwrap(),
            port: 1 + (i % 65000) as u16,
            ..Instance::default()
        };
        let mut stopped = stopped.clone();
        tasks.push(tokio::spawn(Registrant::new(client.clone(), registration, ttl).run(
            async move {
                let _ = stopped.wait_for(|s| *s).await;
            },
        )));
    }
    while !live(&upstream, n).await {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Steady state: three TTLs of heartbeats.
    let from = counter.start.elapsed() + Duration::from_millis(200);
    tokio::time::sleep(ttl * 3).await;
    let to = counter.start.elapsed();
    let (total, _) = counter.between(from, to);
    println!(
        "steady: {n} agents, ttl {ttl:?}: {:.0} requests/s (expected {:.0} = N / (TTL/3))",
        total as f64 / (to - from).as_secs_f64(),
        n as f64 / (ttl.as_secs_f64() / 3.0)
    );

    // Restart empty on the same port.
    first.shutdown().await.expect("the registry flushed");
    let down = counter.start.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let second = koder_dns::server::start(config(&dir.path().join("b"), http)).await?;
    let up = counter.start.elapsed();
    while !live(&upstream, n).await {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let back = counter.start.elapsed();
    let (during_outage, peak_down) = counter.between(down, up);
    let (reconnect, peak_up) = counter.between(up, back + Duration::from_millis(100));
    println!(
        "restart: down 500 ms: {during_outage} requests while down (peak {peak_down}/s); \
         all {n} back {:?} after the registry came up; {reconnect} requests meanwhile, peak {peak_up}/s",
        back - up
    );
    stop.send(true)?;
    for task in tasks {
        let _ = task.await;
    }
    second.shutdown().await.expect("the registry flushed");
    Ok(())
}
