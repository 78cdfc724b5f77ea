//! DNS answer building and the whole request path (decode, answer, encode) for a service of 5
//! and of 300 instances, in a registry of 1k and of 100k instances. `udp_*` is what a query
//! costs (prepared answers where they apply); `*_full_path` is the same query through
//! hickory's request and response types, as when nothing is prepared.

use std::net::SocketAddr;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query};
use hickory_proto::rr::{LowerName, Name, RecordType};
use hickory_server::net::xfer::Protocol;
use koder_dns::dns::Authority;
use koder_dns::dns::answer::ZoneAnswerer;
use koder_dns::model::check::CheckKind;
use koder_dns::model::clock::SystemClock;
use koder_dns::model::instance::Instance;
use koder_dns::registry::{Registry, Settings};
use koder_dns::zone::records::ZoneNames;

fn register(registry: &Registry, service: &str, n: usize) {
    for i in 0..n {
        let spec = Instance {
            name: service.into(),
            address: format!("10.{}.{}.{}", i / 62500 % 250, i / 250 % 250, i % 250 + 1)
                .parse()
                .unwrap(),
            port: 8000,
            ..Default::default()
        };
        registry.register(spec.validate().unwrap()).unwrap();
    }
}

fn registry(total: usize) -> Arc<Registry> {
    let settings = Settings {
        default_ttl: 90_000_000_000,
        max_instances: 1_000_000,
        default_check: CheckKind::None,
        zone: ZoneNames::new("service.koder").unwrap(),
    };
    let registry = Arc::new(Registry::new(settings, Arc::new(SystemClock)));
    register(&registry, "small", 5);
    register(&registry, "large", 300);
    for s in 0..(total - 305) / 5 {
        register(&registry, &format!("filler{s}"), 5);
    }
    registry
}

fn query(name: &str, rtype: RecordType) -> Vec<u8> {
    let mut message = Message::new(7, MessageType::Query, OpCode::Query);
    message.add_query(Query::query(Name::from_ascii(name).unwrap(), rtype));
    let mut edns = Edns::new();
    edns.set_max_payload(1232);
    message.set_edns(edns);
    message.to_vec().unwrap()
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let src: SocketAddr = "127.0.0.1:5353".parse().unwrap();
    let mut out = Vec::new();
    let mut group = c.benchmark_group("dns");
    for total in [1_000, 100_000] {
        let registry = registry(total);
        let answerer = || ZoneAnswerer {
            host_addresses: Default::default(),
            registry: registry.clone(),
            dns_ttl: 5,
            negative_ttl: 5,
            ns_address: src.ip(),
            signer: None,
        };
        let zone = answerer();
        let authority = Authority::new(answerer(), Default::default(), koder_dns::dns::WireSettings::default());
        for service in ["small", "large"] {
            let owner = Name::from_ascii(format!("_{service}._tcp.service.koder.")).unwrap();
            let lower = LowerName::new(&owner);
            group.bench_function(BenchmarkId::new(format!("answer_srv_{service}"), total), |b| {
                b.iter(|| zone.answer(&lower, &owner, RecordType::SRV))
            });
            let bytes = query(&owner.to_ascii(), RecordType::SRV);
            group.bench_function(BenchmarkId::new(format!("udp_srv_{service}"), total), |b| {
                b.iter(|| {
                    runtime.block_on(koder_dns::dns::handle_bytes(
                        &authority,
                        &bytes,
                        src,
                        Protocol::Udp,
                        &mut out,
                    ))
                })
            });
            group.bench_function(BenchmarkId::new(format!("udp_srv_{service}_full_path"), total), |b| {
                b.iter(|| {
                    runtime.block_on(koder_dns::dns::handle_full(
                        &authority,
                        &bytes,
                        src,
                        Protocol::Udp,
                        &mut out,
                    ))
                })
            });
        }
        let nx = query("missing.service.koder.", RecordType::A);
        group.bench_function(BenchmarkId::new("udp_nxdomain", total), |b| {
            b.iter(|| {
                runtime.block_on(koder_dns::dns::handle_bytes(
                    &authority,
                    &nx,
                    src,
                    Protocol::Udp,
                    &mut out,
                ))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
