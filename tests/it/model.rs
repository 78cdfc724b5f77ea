//! The registry as a state machine, checked against a simple model: random sequences of
//! register / heartbeat / deregister / clock advances / reaps on a Registry with a manual
//! clock. Registry and model must agree on every answer and every listing.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;

use koder_dns::model::clock::ManualClock;
use koder_dns::model::instance::Instance;
use koder_dns::registry::{Filter, Registry};

/// The registry default lease in the runs that have one.
const TTL: i64 = 1_000;
const IDS: [&str; 4] = ["a", "b", "c", "d"];
const NAMES: [&str; 2] = ["alpha", "beta"];
const PORTS: [u16; 2] = [80, 81];
const START: i64 = koder_dns::model::clock::MANUAL_START;

#[derive(Debug, Clone)]
enum Op {
    Register {
        id: usize,
        name: usize,
        port: usize,
        ttl_ns: i64,
        healthy: bool,
    },
    Heartbeat {
        id: usize,
    },
    Deregister {
        id: usize,
    },
    Advance {
        ns: i64,
    },
    /// Moves the clock to an id's deadline plus `offset` (-1, 0 or +1), if that is ahead.
    ToDeadline {
        id: usize,
        offset: i64,
    },
    Reap,
}

fn op() -> impl Strategy<Value = Op> {
    let ttl = prop_oneof![Just(0i64), Just(-1), Just(TTL / 2), Just(TTL), Just(TTL * 3 / 2)];
    prop_oneof![
        4 => (0..IDS.len(), 0..NAMES.len(), 0..PORTS.len(), ttl, prop::bool::weighted(0.8))
            .prop_map(|(id, name, port, ttl_ns, healthy)| Op::Register { id, name, port, ttl_ns, healthy }),
        4 => (0..IDS.len()).prop_map(|id| Op::Heartbeat { id }),
        1 => (0..IDS.len()).prop_map(|id| Op::Deregister { id }),
        3 => prop_oneof![
            Just(1i64), Just(TTL / 2 - 1), Just(TTL / 2), Just(TTL - 1), Just(TTL), Just(TTL + 1), Just(TTL * 3 / 2), Just(TTL * 5)
        ]
        .prop_map(|ns| Op::Advance { ns }),
        2 => (0..IDS.len(), -1i64..=1).prop_map(|(id, offset)| Op::ToDeadline { id, offset }),
        2 => Just(Op::Reap),
    ]
}

#[derive(Debug, Clone)]
struct MInstance {
    name: &'static str,
    port: u16,
    ttl_ns: i64,
    healthy: bool,
    registered_at: i64,
    updated_at: i64,
    /// `i64::MAX` = never.
    deadline: i64,
}

struct Model {
    now: i64,
    default_ttl: i64,
    /// Everything stored, including leases that have ended but were not reaped yet.
    stored: BTreeMap<&'static str, MInstance>,
}

impl Model {
    fn deadline(&self, from: i64, ttl_ns: i64) -> i64 {
        let ttl = if ttl_ns > 0 { ttl_ns } else { self.default_ttl };
        if ttl == 0 { i64::MAX } else { from + ttl }
    }

    fn alive(&self, id: &str) -> Option<&MInstance> {
        self.stored.get(id).filter(|m| self.now < m.deadline)
    }

    /// Live instances sorted by name, then id.
    fn live(&self) -> Vec<(&'static str, &MInstance)> {
        let mut v: Vec<_> = self
            .stored
            .iter()
            .filter(|(_, m)| self.now < m.deadline)
            .map(|(id, m)| (*id, m))
            .collect();
        v.sort_by(|a, b| (a.1.name, a.0).cmp(&(b.1.name, b.0)));
        v
    }
}

fn registry(default_ttl: i64) -> (Registry, Arc<ManualClock>) {
    Registry::on_manual_clock(default_ttl, 1000)
}

fn same(id: &str, m: &MInstance, i: &Instance) -> bool {
    i.id == id
        && i.name == m.name
        && i.address == "10.0.0.1"
        && i.port == m.port
        && i.protocol == "tcp"
        && i.ttl_ns == m.ttl_ns
        && i.healthy == m.healthy
        && i.registered_at == m.registered_at
        && i.updated_at == m.updated_at
}

fn summary(instances: &[Instance]) -> Vec<(String, String, u16, bool, i64, i64)> {
    instances
        .iter()
        .map(|i| {
            (
                i.name.to_string(),
                i.id.to_string(),
                i.port,
                i.healthy,
                i.registered_at,
                i.updated_at,
            )
        })
        .collect()
}

fn expected(live: &[(&'static str, &MInstance)]) -> Vec<(String, String, u16, bool, i64, i64)> {
    live.iter()
        .map(|(id, m)| {
            (
                m.name.to_owned(),
                id.to_string(),
                m.port,
                m.healthy,
                m.registered_at,
                m.updated_at,
            )
        })
        .collect()
}

/// Every observation the registry offers agrees with the model.
fn check_state(r: &Registry, model: &Model) -> Result<(), TestCaseError> {
    prop_assert_eq!(r.now(), model.now);
    let live = model.live();
    prop_assert_eq!(summary(&r.list(&Filter::default())), expected(&live), "listing");
    let healthy: Vec<_> = live.iter().filter(|(_, m)| m.healthy).cloned().collect();
    prop_assert_eq!(
        summary(&r.list(&Filter {
            name: None,
            healthy_only: true,
            ..Filter::default()
        })),
        expected(&healthy),
        "healthy listing"
    );
    for name in NAMES {
        let of_name: Vec<_> = live.iter().filter(|(_, m)| m.name == name).cloned().collect();
        prop_assert_eq!(
            summary(&r.list(&Filter {
                name: Some(name.to_owned()),
                healthy_only: false,
                ..Filter::default()
            })),
            expected(&of_name),
            "listing of {}",
            name
        );
        let answerable: Vec<String> = of_name
            .iter()
            .filter(|(_, m)| m.healthy)
            .map(|(id, _)| id.to_string())
            .collect();
        let in_view: Vec<String> = r
            .view(name)
            .map(|v| v.answerable(model.now).map(|m| m.id.to_string()).collect())
            .unwrap_or_default();
        prop_assert_eq!(in_view, answerable, "DNS view of {}", name);
    }
    let mut names: Vec<String> = live.iter().map(|(_, m)| m.name.to_owned()).collect();
    names.dedup();
    prop_assert_eq!(r.service_names(&Filter::default()), names, "service names");
    for id in IDS {
        match (r.get(id), model.alive(id)) {
            (None, None) => {}
            (Some(i), Some(m)) => prop_assert!(same(id, m, &i), "get({}) = {:?}, model {:?}", id, i, m),
            (got, want) => prop_assert!(false, "get({}) = {:?}, model {:?}", id, got, want),
        }
    }
    prop_assert_eq!(
        r.len(),
        model.stored.len(),
        "stored instances (live and not yet reaped)"
    );
    Ok(())
}

fn run(default_ttl: i64, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let (r, clock) = registry(default_ttl);
    let mut model = Model {
        now: START,
        default_ttl,
        stored: BTreeMap::new(),
    };
    for op in ops {
        let serial = r.serial();
        match op {
            Op::Register {
                id,
                name,
                port,
                ttl_ns,
                healthy,
            } => {
                let id = IDS[id];
                let spec = Instance {
                    id: id.to_owned().into(),
                    name: NAMES[name].to_owned().into(),
                    address: "10.0.0.1".parse().unwrap(),
                    port: PORTS[port],
                    ttl_ns,
                    healthy,
                    ..Default::default()
                }
                .validate()
                .unwrap();
                let got = r.register(spec).unwrap();
                let previous = model.alive(id).cloned();
                let created = previous.is_none();
                prop_assert_eq!(got.created, created, "register({}) created", id);
                let m = MInstance {
                    name: NAMES[name],
                    port: PORTS[port],
                    ttl_ns,
                    healthy,
                    registered_at: previous.as_ref().map_or(model.now, |p| p.registered_at),
                    updated_at: model.now,
                    deadline: model.deadline(model.now, ttl_ns),
                };
                prop_assert!(
                    same(id, &m, &got.instance),
                    "register({}) = {:?}, model {:?}",
                    id,
                    got.instance,
                    m
                );
                let changes_answers = match &previous {
                    None => true,
                    Some(p) => p.name != m.name || p.port != m.port || p.healthy != m.healthy,
                };
                if changes_answers {
                    prop_assert!(
                        r.serial() > serial,
                        "register({}) changed answers but not the serial",
                        id
                    );
                } else {
                    prop_assert_eq!(r.serial(), serial, "no-op re-register of {} moved the serial", id);
                }
                model.stored.insert(id, m);
            }
            Op::Heartbeat { id } => {
                let id = IDS[id];
                let got = r.heartbeat(id);
                match model.alive(id).cloned() {
                    None => prop_assert!(
                        got.is_none(),
                        "heartbeat({}) renewed a dead or unknown lease: {:?}",
                        id,
                        got
                    ),
                    Some(mut m) => {
                        m.updated_at = model.now;
                        m.deadline = model.deadline(model.now, m.ttl_ns);
                        let Some(got) = got else {
                            return Err(TestCaseError::fail(format!(
                                "heartbeat({id}) of a live lease was refused"
                            )));
                        };
                        prop_assert!(same(id, &m, &got), "heartbeat({}) = {:?}, model {:?}", id, got, m);
                        model.stored.insert(id, m);
                    }
                }
                prop_assert_eq!(r.serial(), serial, "a heartbeat moved the serial");
            }
            Op::Deregister { id } => {
                let id = IDS[id];
                let got = r.deregister(id);
                let alive = model.alive(id).is_some();
                prop_assert_eq!(got.is_some(), alive, "deregister({})", id);
                if alive {
                    prop_assert!(r.serial() > serial, "deregister({}) did not move the serial", id);
                }
                // An expired instance is removed as well, reported as unknown.
                model.stored.remove(id);
            }
            Op::Advance { ns } => {
                clock.advance(Duration::from_nanos(ns as u64));
                model.now += ns;
            }
            Op::ToDeadline { id, offset } => {
                if let Some(m) = model.stored.get(IDS[id])
                    && m.deadline != i64::MAX
                    && m.deadline + offset > model.now
                {
                    model.now = m.deadline + offset;
                    clock.set(model.now);
                }
            }
            Op::Reap => {
                let due: Vec<&'static str> = model
                    .stored
                    .iter()
                    .filter(|(_, m)| model.now >= m.deadline)
                    .map(|(id, _)| *id)
                    .collect();
                prop_assert_eq!(r.reap(), due.len(), "reap() count");
                for id in &due {
                    model.stored.remove(id);
                }
                if due.is_empty() {
                    prop_assert_eq!(r.serial(), serial, "an empty sweep moved the serial");
                } else {
                    prop_assert!(
                        r.serial() > serial,
                        "a sweep removed instances but did not move the serial"
                    );
                }
            }
        }
        prop_assert!(r.serial() >= serial, "the serial went back");
        check_state(&r, &model)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn registry_agrees_with_the_model(ops in prop::collection::vec(op(), 1..80)) {
        run(TTL, ops)?;
    }

    #[test]
    fn registry_agrees_with_the_model_when_the_default_never_expires(ops in prop::collection::vec(op(), 1..80)) {
        run(0, ops)?;
    }
}

/// A fixed sequence through the boundary, so the model itself is known to bite.
#[test]
fn model_sequence_through_the_exact_boundary() {
    let ops = vec![
        Op::Register {
            id: 0,
            name: 0,
            port: 0,
            ttl_ns: 0,
            healthy: true,
        },
        Op::Advance { ns: TTL - 1 },
        Op::Heartbeat { id: 0 },
        Op::Advance { ns: TTL },
        Op::Heartbeat { id: 0 },
        Op::Register {
            id: 1,
            name: 1,
            port: 1,
            ttl_ns: TTL / 2,
            healthy: false,
        },
        Op::ToDeadline { id: 1, offset: 0 },
        Op::Heartbeat { id: 1 },
        Op::Register {
            id: 0,
            name: 1,
            port: 0,
            ttl_ns: -1,
            healthy: true,
        },
        Op::Reap,
        Op::Deregister { id: 0 },
        Op::Deregister { id: 0 },
        Op::Advance { ns: TTL * 5 },
        Op::Reap,
    ];
    run(TTL, ops).unwrap();
}
