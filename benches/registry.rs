//! Registry operations at 1k and 100k instances: register (new and refresh), heartbeat,
//! lookup of an instance.

use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use koder_dns::model::check::CheckKind;
use koder_dns::model::clock::SystemClock;
use koder_dns::model::instance::{Instance, Validated};
use koder_dns::registry::{Registry, Settings};
use koder_dns::zone::records::ZoneNames;

pub fn spec(service: usize, instance: usize) -> Validated {
    Instance {
        name: format!("svc{service}").into(),
        address: format!("10.{}.{}.{}", service / 250 % 250, service % 250, instance % 250 + 1)
            .parse()
            .unwrap(),
        port: 8000 + instance as u16,
        ..Default::default()
    }
    .validate()
    .unwrap()
}

/// `total` instances spread over services of 5.
fn populated(total: usize) -> Registry {
    let settings = Settings {
        default_ttl: 90_000_000_000,
        max_instances: 1_000_000,
        default_check: CheckKind::None,
        zone: ZoneNames::new("service.koder").unwrap(),
    };
    let registry = Registry::new(settings, Arc::new(SystemClock));
    for i in 0..total {
        registry.register(spec(i / 5, i % 5)).unwrap();
    }
    registry
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("registry");
    for total in [1_000, 100_000] {
        let registry = populated(total);
        let ids: Vec<String> = (0..total).map(|i| spec(i / 5, i % 5).id.to_string()).collect();
        let mut n = 0;
        group.bench_function(BenchmarkId::new("heartbeat", total), |b| {
            b.iter(|| {
                n = (n + 1) % total;
                // What the REST route does: renew, and write the answer from the entry.
                registry
                    .heartbeat_with(&ids[n], |_| true, |instance| serde_json::to_vec(instance).unwrap())
                    .unwrap()
            })
        });
        group.bench_function(BenchmarkId::new("lookup", total), |b| {
            b.iter(|| {
                n = (n + 1) % total;
                registry.get(&ids[n]).unwrap()
            })
        });
        group.bench_function(BenchmarkId::new("register_refresh", total), |b| {
            b.iter_batched(
                || {
                    n = (n + 1) % total;
                    spec(n / 5, n % 5)
                },
                |s| registry.register(s).unwrap(),
                criterion::BatchSize::SmallInput,
            )
        });
        // A new id each time; the one registered WINDOW times before is removed (unmeasured),
        // so the registry stays at `total` + WINDOW however many iterations criterion runs.
        const WINDOW: usize = 1000;
        let fresh_spec = |k: usize| spec(1_000_000 + k / 5, k % 5);
        let mut fresh = 0;
        group.bench_function(BenchmarkId::new("register_new", total), |b| {
            b.iter_batched(
                || {
                    fresh += 1;
                    if fresh > WINDOW {
                        registry.deregister(&fresh_spec(fresh - WINDOW).id);
                    }
                    fresh_spec(fresh)
                },
                |s| registry.register(s).unwrap(),
                criterion::BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
