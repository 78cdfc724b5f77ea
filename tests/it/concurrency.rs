//! Concurrency: registrations, heartbeats, deregistrations and the reaper racing each other,
//! over real HTTP and directly on the registry.
use crate::common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::Barrier;

use crate::common::TestServer;
use koder_dns::registry::Filter;

const TASKS: usize = 32;
const OPS: usize = 50;
const SHARED: usize = 8;

fn body(id: &str, name: &str, port: u16) -> Value {
    json!({"id": id, "name": name, "address": "10.0.0.1", "port": port})
}

async fn detail(server: &TestServer) -> Vec<Value> {
    let (status, body) = server.get("/api/v1/services?detail=1").await;
    assert_eq!(status, 200, "{body}");
    body["instances"].as_array().unwrap().clone()
}

/// The REST listing, the name listing and the DNS views all tell the same story.
async fn assert_consistent(server: &TestServer) -> Vec<Value> {
    let instances = detail(server).await;
    let ids: Vec<&str> = instances.iter().map(|i| i["id"].as_str().unwrap()).collect();
    let unique: BTreeSet<&str> = ids.iter().copied().collect();
    assert_eq!(unique.len(), ids.len(), "an id is listed twice: {ids:?}");
    let mut sorted = instances.clone();
    sorted.sort_by(|a, b| (a["name"].as_str(), a["id"].as_str()).cmp(&(b["name"].as_str(), b["id"].as_str())));
    assert_eq!(sorted, instances, "listing sorted by name then id");

    let (_, names) = server.get("/api/v1/services").await;
    let names: Vec<String> = names["services"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap().to_owned())
        .collect();
    let from_instances: Vec<String> = instances
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_owned())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(names, from_instances, "names listing agrees with the instances");

    let registry = &server.running.registry;
    assert_eq!(registry.len(), instances.len(), "stored count agrees with the listing");
    let now = registry.now();
    let mut in_views: HashMap<String, Vec<String>> = HashMap::new();
    for name in &names {
        let view = registry
            .view(name)
            .unwrap_or_else(|| panic!("no DNS view for listed service {name}"));
        for m in view.answerable(now) {
            in_views.entry(m.id.to_string()).or_default().push(name.clone());
        }
    }
    for i in &instances {
        let id = i["id"].as_str().unwrap();
        let name = i["name"].as_str().unwrap();
        assert_eq!(
            in_views.get(id).cloned().unwrap_or_default(),
            vec![name.to_owned()],
            "{id} is answerable in exactly its own service"
        );
    }
    assert_eq!(
        in_views.len(),
        instances.len(),
        "the DNS views hold exactly the listed instances"
    );
    instances
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_registrations_and_heartbeats_stay_consistent() {
    let server = Arc::new(common::start().await);
    let barrier = Arc::new(Barrier::new(TASKS));
    let mut handles = Vec::new();
    for t in 0..TASKS {
        let (server, barrier) = (server.clone(), barrier.clone());
        handles.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(t as u64);
            let mut created: Vec<String> = Vec::new();
            let mut own_registered: BTreeSet<String> = BTreeSet::new();
            // Everybody's first registration of every shared id at once.
            barrier.wait().await;
            for s in 0..SHARED {
                let id = format!("shared-{s}");
                let (status, r) = server
                    .post("/api/v1/services/register", &body(&id, "shared", 1000 + t as u16))
                    .await;
                assert_eq!(status, 200, "{r}");
                if r["created"] == true {
                    created.push(id);
                }
            }
            for _ in 0..OPS {
                let shared = format!("shared-{}", rng.usize(..SHARED));
                let own = format!("own-{t}-{}", rng.usize(..3));
                match rng.u8(..4) {
                    0 => {
                        let (status, r) = server
                            .post("/api/v1/services/register", &body(&shared, "shared", 2000 + t as u16))
                            .await;
                        assert_eq!(status, 200, "{r}");
                        assert_eq!(r["created"], false, "{shared} was registered before the ops began");
                    }
                    1 => {
                        let (status, r) = server.post("/api/v1/services/heartbeat", &json!({"id": shared})).await;
                        assert_eq!(status, 200, "a live shared id renews: {r}");
                        assert_eq!(r["id"], shared.as_str());
                    }
                    2 => {
                        let (status, r) = server
                            .post(
                                "/api/v1/services/register",
                                &body(&own, &format!("svc-{}", t % 4), 3000),
                            )
                            .await;
                        assert_eq!(status, 200, "{r}");
                        let first = own_registered.insert(own.clone());
                        assert_eq!(r["created"], first, "{own}: created only on its first registration");
                        if first {
                            created.push(own);
                        }
                    }
                    _ => {
                        let (status, r) = server.post("/api/v1/services/heartbeat", &json!({"id": own})).await;
                        let expect = if own_registered.contains(&own) { 200 } else { 410 };
                        assert_eq!(status, expect, "{own}: {r}");
                    }
                }
            }
            (created, own_registered)
        }));
    }
    let mut created: BTreeMap<String, usize> = BTreeMap::new();
    let mut expected: BTreeSet<String> = (0..SHARED).map(|s| format!("shared-{s}")).collect();
    for h in handles {
        let (c, own) = h.await.unwrap();
        for id in c {
            *created.entry(id).or_default() += 1;
        }
        expected.extend(own);
    }
    for s in 0..SHARED {
        assert_eq!(
            created.get(&format!("shared-{s}")),
            Some(&1),
            "exactly one created:true for shared-{s}"
        );
    }
    assert!(created.values().all(|&n| n == 1), "{created:?}");
    assert_eq!(created.keys().cloned().collect::<BTreeSet<_>>(), expected);

    let instances = assert_consistent(&server).await;
    let listed: BTreeSet<String> = instances.iter().map(|i| i["id"].as_str().unwrap().to_owned()).collect();
    assert_eq!(listed, expected, "every registered id is listed once, nothing else");
    for i in &instances {
        if i["name"] == "shared" {
            let port = i["port"].as_u64().unwrap();
            assert!(
                (1000..1000 + TASKS as u64).contains(&port) || (2000..2000 + TASKS as u64).contains(&port),
                "{i}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_first_registrations_of_one_id_create_it_once() {
    let server = Arc::new(common::start().await);
    for round in 0..5 {
        let id = format!("race-{round}");
        let barrier = Arc::new(Barrier::new(TASKS));
        let handles: Vec<_> = (0..TASKS)
            .map(|t| {
                let (server, barrier, id) = (server.clone(), barrier.clone(), id.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let (status, r) = server
                        .post("/api/v1/services/register", &body(&id, "race", 1 + t as u16))
                        .await;
                    assert_eq!(status, 200, "{r}");
                    r["created"].as_bool().unwrap()
                })
            })
            .collect();
        let mut n = 0;
        for h in handles {
            n += h.await.unwrap() as usize;
        }
        assert_eq!(
            n, 1,
            "{id}: exactly one of {TASKS} concurrent first registrations is created"
        );
    }
    let instances = assert_consistent(&server).await;
    assert_eq!(instances.len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_renames_leave_the_instance_in_exactly_one_service() {
    let server = Arc::new(common::start().await);
    let barrier = Arc::new(Barrier::new(TASKS));
    let handles: Vec<_> = (0..TASKS)
        .map(|t| {
            let (server, barrier) = (server.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                for k in 0..20 {
                    let id = format!("mover-{}", (t + k) % 4);
                    let name = format!("svc-{}", (t * 7 + k) % 5);
                    let (status, r) = server.post("/api/v1/services/register", &body(&id, &name, 80)).await;
                    assert_eq!(status, 200, "{r}");
                }
            })
        })
        .collect();
    for h in handles {
        h.await.unwrap();
    }
    let instances = assert_consistent(&server).await;
    assert_eq!(instances.len(), 4);
    // No ghost left behind in a service the instance moved away from.
    let registry = &server.running.registry;
    for s in 0..5 {
        let name = format!("svc-{s}");
        let listed: BTreeSet<String> = instances
            .iter()
            .filter(|i| i["name"] == name.as_str())
            .map(|i| i["id"].as_str().unwrap().to_owned())
            .collect();
        let in_view: BTreeSet<String> = registry
            .view(&name)
            .map(|v| v.members.iter().map(|m| m.id.to_string()).collect())
            .unwrap_or_default();
        assert_eq!(in_view, listed, "{name}: its DNS view holds exactly its instances");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_deregistrations_of_one_id_succeed_once() {
    let server = Arc::new(common::start().await);
    for round in 0..5 {
        let id = format!("bye-{round}");
        server.register(body(&id, "bye", 80)).await;
        let barrier = Arc::new(Barrier::new(16));
        let handles: Vec<_> = (0..16)
            .map(|_| {
                let (server, barrier, id) = (server.clone(), barrier.clone(), id.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    let (status, r) = server.post("/api/v1/services/deregister", &json!({"id": id})).await;
                    assert!(status == 200 || status == 404, "{status} {r}");
                    status == 200
                })
            })
            .collect();
        let mut ok = 0;
        for h in handles {
            ok += h.await.unwrap() as usize;
        }
        assert_eq!(ok, 1, "{id}: one 200, the rest 404");
    }
    assert!(assert_consistent(&server).await.is_empty());
}

/// Heartbeats racing the reaper on the real clock with a short TTL: a heartbeat renews a
/// live lease (200) or gets 410, never resurrects a dead one, and a dead id is never listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn heartbeats_racing_the_reaper_never_resurrect() {
    const TTL: Duration = Duration::from_millis(150);
    const IDS: usize = 12;
    const PER_ID: usize = 3;
    let server = Arc::new(
        common::start_with(|c| {
            c.default_ttl = TTL;
            c.reaper_interval = Duration::from_millis(5);
        })
        .await,
    );
    for i in 0..IDS {
        server.register(body(&format!("hb-{i}"), "hb", 80)).await;
    }
    let dead: Arc<Vec<AtomicBool>> = Arc::new((0..IDS).map(|_| AtomicBool::new(false)).collect());
    let renewals = Arc::new(AtomicUsize::new(0));
    let gones = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();

    let mut handles = Vec::new();
    for i in 0..IDS {
        for k in 0..PER_ID {
            let (server, dead, renewals, gones) = (server.clone(), dead.clone(), renewals.clone(), gones.clone());
            handles.push(tokio::spawn(async move {
                let id = format!("hb-{i}");
                let mut rng = fastrand::Rng::with_seed((i * PER_ID + k) as u64);
                let mut last_updated = String::new();
                // Ids with a low number beat often and should mostly live; the others beat
                // around or past the TTL and die at some point.
                let (lo, hi) = if i < 4 { (10, 50) } else { (80, 400) };
                while start.elapsed() < Duration::from_millis(1500) {
                    tokio::time::sleep(Duration::from_millis(rng.u64(lo..hi))).await;
                    let was_dead = dead[i].load(Ordering::SeqCst);
                    let (status, r) = server.post("/api/v1/services/heartbeat", &json!({"id": id})).await;
                    match status {
                        200 => {
                            assert!(!was_dead, "{id} renewed after a 410: a dead lease was resurrected: {r}");
                            let updated = r["updated_at"].as_str().unwrap().to_owned();
                            // RFC 3339 with fixed nanosecond digits in UTC sorts as time.
                            if updated.len() == last_updated.len() {
                                assert!(updated >= last_updated, "{id}: updated_at went back");
                            }
                            last_updated = updated;
                            renewals.fetch_add(1, Ordering::Relaxed);
                        }
                        410 => {
                            dead[i].store(true, Ordering::SeqCst);
                            gones.fetch_add(1, Ordering::Relaxed);
                            // Dead for good, and gone from the listings.
                            for _ in 0..3 {
                                let (status, r) = server.post("/api/v1/services/heartbeat", &json!({"id": id})).await;
                                assert_eq!(status, 410, "{id}: 200 after 410: {r}");
                            }
                            let (_, list) = server.get("/api/v1/services?detail=1&name=hb").await;
                            assert!(
                                list["instances"]
                                    .as_array()
                                    .unwrap()
                                    .iter()
                                    .all(|x| x["id"] != id.as_str()),
                                "{id} listed after its 410"
                            );
                            return;
                        }
                        other => panic!("{id}: heartbeat answered {other}: {r}"),
                    }
                }
            }));
        }
    }
    // Meanwhile: listings never show an instance whose lease has ended, nor a dead id.
    let lister = {
        let (server, dead, stop) = (server.clone(), dead.clone(), stop.clone());
        tokio::spawn(async move {
            let mut checks = 0;
            while !stop.load(Ordering::SeqCst) {
                let dead_before: Vec<bool> = dead.iter().map(|d| d.load(Ordering::SeqCst)).collect();
                let asked_at = chrono::Utc::now();
                let (status, list) = server.get("/api/v1/services?detail=1").await;
                assert_eq!(status, 200);
                for x in list["instances"].as_array().unwrap() {
                    let id = x["id"].as_str().unwrap();
                    let n: usize = id.trim_start_matches("hb-").parse().unwrap();
                    assert!(!dead_before[n], "{id} listed after a heartbeat got 410");
                    let updated = chrono::DateTime::parse_from_rfc3339(x["updated_at"].as_str().unwrap()).unwrap();
                    let end = updated + chrono::Duration::from_std(TTL).unwrap();
                    assert!(
                        end > asked_at,
                        "{id} listed after its lease ended ({end} <= {asked_at})"
                    );
                }
                checks += 1;
                tokio::time::sleep(Duration::from_millis(7)).await;
            }
            checks
        })
    };
    for h in handles {
        h.await.unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    assert!(lister.await.unwrap() > 10);
    assert!(
        renewals.load(Ordering::Relaxed) > 50,
        "the race was exercised: renewals happened"
    );
    assert!(
        gones.load(Ordering::Relaxed) > 0,
        "the race was exercised: some leases ran out"
    );

    // Whatever is listed at the end is live and consistent; dead ids can come back only by
    // registering again, as new registrations.
    tokio::time::sleep(TTL + Duration::from_millis(50)).await;
    assert!(
        assert_consistent(&server).await.is_empty(),
        "everything expired once the heartbeats stopped"
    );
    assert_eq!(server.running.registry.len(), 0, "and the reaper removed it");
    for i in 0..IDS {
        let r = server.register(body(&format!("hb-{i}"), "hb", 80)).await;
        assert_eq!(r["created"], true);
    }
}

/// The same race on the registry itself, with a manual clock ticking one nanosecond at a
/// time through 50 ns leases: "once dead, dead until registered again", at the exact boundary.
#[test]
fn heartbeat_reap_race_at_the_exact_boundary() {
    use koder_dns::model::instance::Instance;
    use koder_dns::registry::Registry;

    const IDS: usize = 4;
    let (registry, clock) = Registry::on_manual_clock(50, 100);
    let registry = Arc::new(registry);
    for i in 0..IDS {
        let spec = Instance {
            id: format!("r-{i}").into(),
            name: "race".into(),
            address: "10.0.0.1".parse().unwrap(),
            port: 80,
            ..Default::default()
        }
        .validate()
        .unwrap();
        registry.register(spec).unwrap();
    }
    let dead: Arc<Vec<AtomicBool>> = Arc::new((0..IDS).map(|_| AtomicBool::new(false)).collect());
    let stop = Arc::new(AtomicBool::new(false));
    let reaped = Arc::new(AtomicUsize::new(0));
    let deadline = Instant::now() + Duration::from_millis(400);

    std::thread::scope(|scope| {
        // The clock.
        {
            let (clock, stop) = (clock.clone(), stop.clone());
            scope.spawn(move || {
                while Instant::now() < deadline {
                    clock.advance(Duration::from_nanos(1));
                    for _ in 0..200 {
                        std::hint::spin_loop();
                    }
                }
                stop.store(true, Ordering::SeqCst);
            });
        }
        // The reaper.
        {
            let (registry, stop, reaped) = (registry.clone(), stop.clone(), reaped.clone());
            scope.spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    reaped.fetch_add(registry.reap(), Ordering::SeqCst);
                    std::thread::yield_now();
                }
            });
        }
        // Heart-beaters, two per id, pausing at random so some leases lapse.
        for t in 0..IDS * 2 {
            let (registry, stop, dead) = (registry.clone(), stop.clone(), dead.clone());
            scope.spawn(move || {
                let i = t % IDS;
                let id = format!("r-{i}");
                let mut rng = fastrand::Rng::with_seed(t as u64);
                while !stop.load(Ordering::SeqCst) {
                    let was_dead = dead[i].load(Ordering::SeqCst);
                    match registry.heartbeat(&id) {
                        Some(instance) => {
                            assert!(!was_dead, "{id}: renewed after a failed heartbeat");
                            assert!(instance.updated_at <= registry.now());
                        }
                        None => {
                            dead[i].store(true, Ordering::SeqCst);
                            assert!(registry.get(&id).is_none(), "{id}: gettable after a failed heartbeat");
                            assert!(
                                registry.list(&Filter::default()).iter().all(|x| x.id != id),
                                "{id}: listed after a failed heartbeat"
                            );
                        }
                    }
                    // Pause between beats: mostly short, sometimes long enough to lapse.
                    let spins = if rng.u8(..50) == 0 {
                        rng.u32(20_000..200_000)
                    } else {
                        rng.u32(10..2_000)
                    };
                    for _ in 0..spins {
                        std::hint::spin_loop();
                    }
                }
            });
        }
    });

    let dead_count = dead.iter().filter(|d| d.load(Ordering::SeqCst)).count();
    assert!(
        dead_count > 0,
        "the race was exercised: some lease lapsed while heartbeats ran"
    );
    let live = registry.list(&Filter::default());
    for x in &live {
        let n: usize = x.id.trim_start_matches("r-").parse().unwrap();
        assert!(
            !dead[n].load(Ordering::SeqCst),
            "{} is listed but a heartbeat saw it dead",
            x.id
        );
    }
    assert!(
        reaped.load(Ordering::SeqCst) <= IDS,
        "an instance is reaped at most once"
    );
    // Everything that is not listed any more is either reaped or awaiting the reaper.
    clock.advance(Duration::from_nanos(1_000));
    reaped.fetch_add(registry.reap(), Ordering::SeqCst);
    assert_eq!(
        reaped.load(Ordering::SeqCst),
        IDS,
        "every lease ended once and was reaped exactly once"
    );
    assert!(registry.is_empty());
}
