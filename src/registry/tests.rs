//! Unit tests of the registry on a manual clock.
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::model::clock::ManualClock;
use serde_json::{Value, json};

use crate::model::instance::{FieldError, Metadata};

pub(crate) fn registry(default_ttl: std::time::Duration) -> (Registry, Arc<ManualClock>) {
    registry_max(default_ttl, 1000)
}

fn registry_max(default_ttl: Duration, max_instances: usize) -> (Registry, Arc<ManualClock>) {
    Registry::on_manual_clock(default_ttl.as_nanos() as i64, max_instances)
}

const SEC: Duration = Duration::from_secs(1);
const NS: Duration = Duration::from_nanos(1);

/// A registration body read as the REST API reads it: the field's path names a value that
/// could not be read (an address, a port out of range), then [`Instance::validate`].
trait Read {
    fn validate(self) -> Result<Validated, FieldError>;
}

impl Read for Value {
    fn validate(self) -> Result<Validated, FieldError> {
        let instance: Instance = serde_path_to_error::deserialize(self)
            .map_err(|e| FieldError::new(e.path().to_string(), e.into_inner().to_string()))?;
        instance.validate()
    }
}

/// `base` with the fields of `patch` replaced (`null` reads as missing).
fn with(mut base: Value, patch: Value) -> Value {
    for (k, v) in patch.as_object().expect("a patch is an object") {
        base[k] = v.clone();
    }
    base
}

/// A minimal valid registration.
fn reg(id: &str, name: &str) -> Value {
    json!({"id": id, "name": name, "address": "10.0.0.1", "port": 8080})
}

fn spec(id: &str, name: &str) -> Validated {
    reg(id, name).validate().expect("valid registration")
}

fn spec_ttl(id: &str, name: &str, ttl_ns: i64) -> Validated {
    with(reg(id, name), json!({"ttl_ns": ttl_ns})).validate().unwrap()
}

fn ids(instances: &[Instance]) -> Vec<String> {
    instances.iter().map(|i| i.id.to_string()).collect()
}

fn all(r: &Registry) -> Vec<String> {
    ids(&r.list(&Filter::default()))
}

fn answerable_ids(r: &Registry, service: &str) -> Vec<String> {
    let now = r.now();
    r.view(service)
        .map(|v| v.answerable(now).map(|m| m.id.to_string()).collect())
        .unwrap_or_default()
}

fn view_ids(r: &Registry, service: &str) -> Vec<String> {
    r.view(service)
        .map(|v| v.members.iter().map(|m| m.id.to_string()).collect())
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------
// Upsert (R2)
// ---------------------------------------------------------------------------------------

#[test]
fn first_registration_is_created_and_stamped() {
    let (r, clock) = registry(90 * SEC);
    let got = r.register(spec("a", "voice")).unwrap();
    assert!(got.created);
    assert_eq!(got.instance.id, "a");
    assert_eq!(got.instance.name, "voice");
    assert_eq!(got.instance.registered_at, clock.now());
    assert_eq!(got.instance.updated_at, clock.now());
    assert_eq!(r.get("a").unwrap(), got.instance);
    assert_eq!(r.len(), 1);
}

#[test]
fn re_register_is_upsert_keeping_registered_at_and_replacing_mutable_fields() {
    let (r, clock) = registry(90 * SEC);
    let first = r.register(spec("a", "voice")).unwrap();
    clock.advance(5 * SEC);
    let mut metadata = BTreeMap::new();
    metadata.insert("container".to_owned(), "voice-1".to_owned());
    let second = r
        .register(
            with(reg("a", "voice"), json!({"address": "10.0.0.2", "port": 9090, "protocol": "udp", "tags": ["x=y"], "metadata": metadata.clone(), "weight": 7, "priority": 3, "healthy": false, "ttl_ns": 42 * SEC.as_nanos() as i64}))
            .validate()
            .unwrap(),
        )
        .unwrap();
    assert!(!second.created, "re-registering a live id is not a creation");
    let i = r.get("a").unwrap();
    assert_eq!(i, second.instance);
    assert_eq!(i.registered_at, first.instance.registered_at, "registered_at is kept");
    assert_eq!(
        i.updated_at,
        clock.now(),
        "updated_at is the time of the re-registration"
    );
    assert_eq!(i.address, "10.0.0.2");
    assert_eq!(i.port, 9090);
    assert_eq!(i.protocol, "udp");
    assert_eq!(i.tags, vec!["x=y".to_owned()]);
    assert_eq!(i.metadata, Metadata::from(metadata));
    assert_eq!(i.weight, 7);
    assert_eq!(i.priority, 3);
    assert!(!i.healthy);
    assert_eq!(i.ttl_ns, 42_000_000_000);
    assert_eq!(r.len(), 1, "no duplicate entry");
    assert_eq!(all(&r), vec!["a"]);

    // And the fields are replaced, not merged: omitted optional fields go back to defaults.
    clock.advance(SEC);
    let third = r.register(spec("a", "voice")).unwrap();
    assert!(!third.created);
    let i = r.get("a").unwrap();
    assert_eq!(i.tags, Vec::<String>::new());
    assert!(i.metadata.is_empty());
    assert_eq!((i.weight, i.priority, i.healthy, i.ttl_ns), (100, 10, true, 0));
    assert_eq!(i.protocol, "tcp");
    assert_eq!(i.registered_at, first.instance.registered_at);
}

#[test]
fn re_register_renews_the_lease() {
    let (r, clock) = registry(10 * SEC);
    r.register(spec("a", "voice")).unwrap();
    clock.advance(9 * SEC);
    assert!(!r.register(spec("a", "voice")).unwrap().created);
    clock.advance(9 * SEC); // 18s after the first registration, 9s after the second
    assert!(r.get("a").is_some(), "re-registration renewed the lease");
    clock.advance(SEC); // exactly 10s after the second
    assert!(r.get("a").is_none());
}

// ---------------------------------------------------------------------------------------
// Heartbeat and expiry (R3)
// ---------------------------------------------------------------------------------------

#[test]
fn heartbeat_renews_the_lease_and_bumps_updated_at() {
    let (r, clock) = registry(10 * SEC);
    let first = r.register(spec("a", "voice")).unwrap().instance;
    clock.advance(9 * SEC);
    let beat = r.heartbeat("a").expect("live instance renews");
    assert_eq!(beat.updated_at, clock.now());
    assert_eq!(beat.registered_at, first.registered_at);
    assert_eq!(r.get("a").unwrap().updated_at, clock.now());
    clock.advance(9 * SEC);
    assert!(
        r.get("a").is_some(),
        "still alive 18s after registration thanks to the heartbeat"
    );
    assert!(r.heartbeat("a").is_some());
    clock.advance(10 * SEC - NS);
    assert!(r.get("a").is_some());
    clock.advance(NS);
    assert!(r.get("a").is_none());
}

#[test]
fn heartbeat_of_unknown_id_is_none() {
    let (r, _) = registry(10 * SEC);
    assert!(r.heartbeat("nope").is_none());
    r.register(spec("a", "voice")).unwrap();
    assert!(r.heartbeat("b").is_none());
}

#[test]
fn lease_ends_exactly_at_updated_at_plus_ttl() {
    let (r, clock) = registry(10 * SEC);
    let start = clock.now();
    r.register(spec("a", "voice")).unwrap();
    let deadline = start + 10 * SEC.as_nanos() as i64;

    clock.set(deadline - 1);
    assert!(r.get("a").is_some(), "alive 1ns before the deadline");
    assert_eq!(all(&r), vec!["a"]);
    assert_eq!(answerable_ids(&r, "voice"), vec!["a"]);

    clock.set(deadline);
    assert!(r.get("a").is_none(), "dead exactly at the deadline");
    assert!(all(&r).is_empty());
    assert!(answerable_ids(&r, "voice").is_empty());
    assert!(r.heartbeat("a").is_none(), "a heartbeat at the deadline is too late");
}

#[test]
fn heartbeat_one_nanosecond_before_the_deadline_renews() {
    let (r, clock) = registry(10 * SEC);
    let start = clock.now();
    r.register(spec("a", "voice")).unwrap();
    let deadline = start + 10_000_000_000;
    clock.set(deadline - 1);
    assert!(r.heartbeat("a").is_some());
    clock.set(deadline);
    assert!(r.get("a").is_some());
    assert_eq!(r.reap(), 0, "a renewed lease is not reaped at its old deadline");
    clock.set(deadline - 1 + 10_000_000_000 - 1);
    assert!(r.get("a").is_some());
    clock.set(deadline - 1 + 10_000_000_000);
    assert!(r.get("a").is_none());
}

#[test]
fn default_ttl_is_used_when_ttl_ns_is_not_positive() {
    for ttl_ns in [0, -1, -5_000_000_000, i64::MIN] {
        let (r, clock) = registry(10 * SEC);
        let start = clock.now();
        let i = r.register(spec_ttl("a", "voice", ttl_ns)).unwrap().instance;
        assert_eq!(i.ttl_ns, ttl_ns, "ttl_ns is stored as sent");
        assert_eq!(r.effective_ttl(ttl_ns), 10_000_000_000);
        clock.set(start + 10_000_000_000 - 1);
        assert!(r.get("a").is_some(), "ttl_ns={ttl_ns}: alive before the default TTL");
        clock.set(start + 10_000_000_000);
        assert!(r.get("a").is_none(), "ttl_ns={ttl_ns}: dead at the default TTL");
    }
}

#[test]
fn omitted_ttl_ns_uses_the_default() {
    let (r, clock) = registry(3 * SEC);
    let i = r.register(spec("a", "voice")).unwrap().instance;
    assert_eq!(i.ttl_ns, 0);
    clock.advance(3 * SEC - NS);
    assert!(r.get("a").is_some());
    clock.advance(NS);
    assert!(r.get("a").is_none());
}

#[test]
fn default_ttl_zero_means_never_expire() {
    let (r, clock) = registry(Duration::ZERO);
    r.register(spec("static", "voice")).unwrap();
    r.register(spec_ttl("neg", "voice", -1)).unwrap();
    assert_eq!(r.leases.len(), 0, "a never-expiring lease is not in the expiry index");
    clock.advance(Duration::from_secs(100 * 365 * 24 * 3600));
    assert_eq!(all(&r), vec!["neg", "static"]);
    assert_eq!(r.reap(), 0);
    assert_eq!(all(&r), vec!["neg", "static"]);
    assert!(r.heartbeat("static").is_some());
    assert_eq!(answerable_ids(&r, "voice"), vec!["neg", "static"]);
}

#[test]
fn per_instance_ttl_overrides_the_default() {
    let (r, clock) = registry(10 * SEC);
    let start = clock.now();
    r.register(spec_ttl("short", "voice", 2_000_000_000)).unwrap();
    r.register(spec_ttl("long", "voice", 30_000_000_000)).unwrap();
    r.register(spec("default", "voice")).unwrap();

    clock.set(start + 2_000_000_000 - 1);
    assert_eq!(all(&r), vec!["default", "long", "short"]);
    clock.set(start + 2_000_000_000);
    assert_eq!(all(&r), vec!["default", "long"], "short lease ends before the default");
    clock.set(start + 10_000_000_000);
    assert_eq!(all(&r), vec!["long"], "long lease outlives the default");
    clock.set(start + 30_000_000_000 - 1);
    assert_eq!(all(&r), vec!["long"]);
    clock.set(start + 30_000_000_000);
    assert!(all(&r).is_empty());
}

#[test]
fn per_instance_ttl_overrides_a_never_expiring_default() {
    let (r, clock) = registry(Duration::ZERO);
    r.register(spec_ttl("a", "voice", 1_000_000_000)).unwrap();
    r.register(spec("b", "voice")).unwrap();
    clock.advance(SEC);
    assert_eq!(all(&r), vec!["b"]);
    assert_eq!(r.reap(), 1);
    assert_eq!(all(&r), vec!["b"]);
}

#[test]
fn heartbeat_renews_by_the_instance_ttl() {
    let (r, clock) = registry(10 * SEC);
    r.register(spec_ttl("a", "voice", 2_000_000_000)).unwrap();
    clock.advance(SEC);
    let t = clock.now();
    assert!(r.heartbeat("a").is_some());
    clock.set(t + 2_000_000_000 - 1);
    assert!(r.get("a").is_some());
    clock.set(t + 2_000_000_000);
    assert!(r.get("a").is_none(), "the renewal is by ttl_ns, not the default");
}

// ---------------------------------------------------------------------------------------
// Reaper
// ---------------------------------------------------------------------------------------

#[test]
fn reap_removes_expired_instances_and_returns_the_count() {
    let (r, clock) = registry(10 * SEC);
    r.register(spec("a", "voice")).unwrap();
    r.register(spec("b", "voice")).unwrap();
    r.register(spec("c", "chat")).unwrap();
    r.register(spec_ttl("keep", "chat", 60_000_000_000)).unwrap();
    assert_eq!(r.leases.len(), 4);

    clock.advance(10 * SEC - NS);
    assert_eq!(r.reap(), 0, "nothing is due 1ns before the deadline");
    assert_eq!(r.len(), 4);

    clock.advance(NS);
    assert_eq!(r.reap(), 3);
    assert_eq!(r.len(), 1);
    assert_eq!(all(&r), vec!["keep"]);
    for id in ["a", "b", "c"] {
        assert!(r.get(id).is_none());
        assert!(r.heartbeat(id).is_none());
    }
    assert_eq!(r.leases.len(), 1, "the reaped instances left the lease index");
    assert!(r.view("voice").is_none(), "a service with no instance left has no view");
    assert_eq!(view_ids(&r, "chat"), vec!["keep"]);
    assert_eq!(r.reap(), 0, "a second sweep finds nothing");

    clock.advance(60 * SEC);
    assert_eq!(r.reap(), 1);
    assert!(r.is_empty());
    assert!(r.leases.is_empty(), "lease index emptied");
    assert!(r.view("chat").is_none());
}

#[test]
fn reap_spares_a_renewed_instance() {
    let (r, clock) = registry(10 * SEC);
    r.register(spec("a", "voice")).unwrap();
    r.register(spec("b", "voice")).unwrap();
    clock.advance(5 * SEC);
    r.heartbeat("a").unwrap();
    clock.advance(5 * SEC);
    assert_eq!(r.reap(), 1);
    assert_eq!(all(&r), vec!["a"]);
    assert_eq!(r.leases.len(), 1);
    clock.advance(5 * SEC);
    assert_eq!(r.reap(), 1);
    assert!(r.leases.is_empty());
    assert!(r.is_empty());
}

#[test]
fn deregister_removes_at_once_and_unknown_is_false() {
    let (r, _) = registry(10 * SEC);
    r.register(spec("a", "voice")).unwrap();
    r.register(spec("b", "voice")).unwrap();
    assert!(r.deregister("a").is_some());
    assert_eq!(all(&r), vec!["b"]);
    assert!(r.get("a").is_none());
    assert!(r.heartbeat("a").is_none(), "a deregistered instance cannot be renewed");
    assert_eq!(view_ids(&r, "voice"), vec!["b"]);
    assert_eq!(r.leases.len(), 1);
    assert!(r.deregister("a").is_none(), "second deregister: unknown");
    assert!(r.deregister("zzz").is_none());
    assert!(r.deregister("b").is_some());
    assert!(r.is_empty());
    assert!(r.leases.is_empty());
    assert!(r.view("voice").is_none());
}

#[test]
fn expired_but_unreaped_is_invisible() {
    let (r, clock) = registry(10 * SEC);
    r.register(spec("a", "voice")).unwrap();
    r.register(spec_ttl("b", "voice", 60_000_000_000)).unwrap();
    clock.advance(10 * SEC);
    assert_eq!(r.len(), 2, "still stored: the reaper has not run");
    assert_eq!(all(&r), vec!["b"], "not listed");
    assert_eq!(
        ids(&r.list(&Filter {
            name: Some("voice".into()),
            healthy_only: false,
            ..Filter::default()
        })),
        vec!["b"]
    );
    assert_eq!(
        ids(&r.list(&Filter {
            name: None,
            healthy_only: true,
            ..Filter::default()
        })),
        vec!["b"]
    );
    assert!(r.get("a").is_none(), "not gettable");
    assert!(r.heartbeat("a").is_none(), "not renewable");
    assert!(r.get("a").is_none(), "the failed heartbeat did not resurrect it");
    assert_eq!(answerable_ids(&r, "voice"), vec!["b"], "not answerable in DNS");
    let view = r.view("voice").unwrap();
    let a = view
        .members
        .iter()
        .find(|m| &*m.id == "a")
        .expect("still in the view until reaped");
    assert!(!a.answerable(r.now()));

    // Alone in its service: the service disappears from the names as well.
    clock.advance(50 * SEC);
    assert!(r.service_names(&Filter::default()).is_empty());
    assert!(answerable_ids(&r, "voice").is_empty());
}

#[test]
fn registration_after_expiry_is_a_new_registration() {
    let (r, clock) = registry(10 * SEC);
    let first = r.register(spec("a", "voice")).unwrap().instance;
    clock.advance(10 * SEC);
    // Not reaped yet.
    let again = r.register(spec("a", "voice")).unwrap();
    assert!(again.created, "registering an expired id is a creation");
    assert_eq!(again.instance.registered_at, clock.now());
    assert_ne!(again.instance.registered_at, first.registered_at);
    assert_eq!(r.len(), 1);
    assert_eq!(all(&r), vec!["a"]);
    assert_eq!(answerable_ids(&r, "voice"), vec!["a"]);
    assert!(r.heartbeat("a").is_some());
    assert_eq!(r.reap(), 0, "the new lease is not reaped at the old deadline");
    assert_eq!(all(&r), vec!["a"]);

    // And after the reaper removed it.
    clock.advance(10 * SEC);
    assert_eq!(r.reap(), 1);
    clock.advance(SEC);
    let third = r.register(spec("a", "voice")).unwrap();
    assert!(third.created);
    assert_eq!(third.instance.registered_at, clock.now());
    assert_eq!(r.leases.len(), 1);
}

#[test]
fn expired_instance_cannot_be_deregistered() {
    let (r, clock) = registry(10 * SEC);
    r.register(spec("a", "voice")).unwrap();
    clock.advance(10 * SEC);
    assert!(
        r.deregister("a").is_none(),
        "an expired instance is unknown to a registrant"
    );
    assert!(r.is_empty(), "but it is removed all the same");
    assert!(r.leases.is_empty());
    assert_eq!(r.reap(), 0);
}

// ---------------------------------------------------------------------------------------
// SOA serial
// ---------------------------------------------------------------------------------------

#[test]
fn serial_grows_with_changes_but_not_with_a_no_op_re_register_or_heartbeat() {
    let (r, clock) = registry(10 * SEC);
    let s0 = r.serial();
    r.register(spec("a", "voice")).unwrap();
    let s1 = r.serial();
    assert!(s1 > s0, "register bumps");

    clock.advance(SEC);
    r.register(spec("a", "voice")).unwrap();
    assert_eq!(r.serial(), s1, "an identical re-register changes no answer");
    r.heartbeat("a").unwrap();
    assert_eq!(r.serial(), s1, "a heartbeat changes no answer");

    r.register(with(reg("a", "voice"), json!({"port": 9999})).validate().unwrap())
        .unwrap();
    let s2 = r.serial();
    assert!(s2 > s1, "a re-register that changes the SRV bumps");

    r.register(spec("b", "voice")).unwrap();
    let s3 = r.serial();
    assert!(s3 > s2);
    assert!(r.deregister("b").is_some());
    let s4 = r.serial();
    assert!(s4 > s3, "deregister bumps");
    assert!(r.deregister("b").is_none());
    assert_eq!(r.serial(), s4, "a failed deregister changes nothing");

    assert_eq!(r.reap(), 0);
    assert_eq!(r.serial(), s4, "an empty sweep changes nothing");
    clock.advance(10 * SEC);
    assert_eq!(r.reap(), 1);
    assert!(r.serial() > s4, "reap bumps");
}

/// DNS answers prepared from a view count on its leases ending no sooner than when they
/// were prepared (`zone::prepared`): a lease that moves earlier comes with a new view, one
/// that moves later (a heartbeat) leaves the view alone.
#[test]
fn a_lease_moved_earlier_replaces_the_view_and_a_renewal_does_not() {
    let (r, clock) = registry(60 * SEC);
    r.register(spec("a", "voice")).unwrap();
    let view = r.view("voice").unwrap();
    clock.advance(SEC);
    r.heartbeat("a").unwrap();
    assert!(
        Arc::ptr_eq(&view, &r.view("voice").unwrap()),
        "a renewal keeps the view"
    );
    r.register(spec("a", "voice")).unwrap();
    assert!(
        Arc::ptr_eq(&view, &r.view("voice").unwrap()),
        "an identical re-register keeps the view"
    );

    let serial = r.serial();
    r.register(spec_ttl("a", "voice", 5_000_000_000)).unwrap();
    let shorter = r.view("voice").unwrap();
    assert!(!Arc::ptr_eq(&view, &shorter), "a shorter lease comes with a new view");
    assert_eq!(r.serial(), serial, "the answers themselves did not change");

    // Restored with a grace beyond its TTL, a heartbeat right away ends the lease sooner.
    let restored = r.to_persist("a").unwrap();
    assert!(r.put_back(restored, 10_000_000_000));
    let before = r.view("voice").unwrap();
    r.heartbeat("a").unwrap();
    assert!(
        !Arc::ptr_eq(&before, &r.view("voice").unwrap()),
        "a renewal that ends sooner comes with a new view"
    );
}

/// The durable store learns of a renewal once; it reads the latest stamp when it writes.
#[test]
fn renewals_are_announced_once_until_the_store_reads_the_instance() {
    let (r, clock) = registry(60 * SEC);
    let mut events = r.subscribe();
    r.register(spec("a", "voice")).unwrap();
    assert_eq!(events.try_recv().unwrap(), Event::Upserted("a".into()));
    for _ in 0..3 {
        clock.advance(SEC);
        r.heartbeat("a").unwrap();
    }
    assert_eq!(events.try_recv().unwrap(), Event::Renewed("a".into()));
    assert!(
        events.try_recv().is_err(),
        "later renewals are covered by the first announcement"
    );
    assert_eq!(
        r.to_persist("a").unwrap().updated_at,
        r.now(),
        "the store writes the latest renewal"
    );
    clock.advance(SEC);
    r.heartbeat("a").unwrap();
    assert_eq!(
        events.try_recv().unwrap(),
        Event::Renewed("a".into()),
        "announced again after the store read it"
    );
}

#[test]
fn serial_grows_when_an_expired_id_is_registered_again() {
    let (r, clock) = registry(10 * SEC);
    r.register(spec("a", "voice")).unwrap();
    let s = r.serial();
    clock.advance(10 * SEC);
    assert!(r.register(spec("a", "voice")).unwrap().created);
    assert!(r.serial() > s, "the instance is back in the answers");
}

// ---------------------------------------------------------------------------------------
// Limits and renames
// ---------------------------------------------------------------------------------------

#[test]
fn max_instances_refuses_new_ids_with_full() {
    let (r, clock) = registry_max(10 * SEC, 2);
    r.register(spec("a", "voice")).unwrap();
    r.register(spec("b", "voice")).unwrap();
    let serial = r.serial();
    match r.register(spec("c", "voice")) {
        Err(RegistryError::Full { max }) => assert_eq!(max, 2),
        other => panic!("expected Full, got {other:?}"),
    }
    assert_eq!(r.len(), 2);
    assert_eq!(all(&r), vec!["a", "b"], "the refused registration left nothing behind");
    assert_eq!(r.serial(), serial);
    assert!(r.get("c").is_none());

    // Re-registering an existing id is not a new instance.
    assert!(!r.register(spec("a", "voice")).unwrap().created);
    // An expired-but-stored id can be registered again without room.
    clock.advance(10 * SEC);
    assert!(r.register(spec("a", "voice")).unwrap().created);

    assert!(r.deregister("a").is_some());
    assert!(
        r.register(spec("c", "voice")).unwrap().created,
        "room again after a deregister"
    );
    // b expired with a: at the cap, it is reaped before the registration is refused.
    assert!(
        r.register(spec("d", "voice")).unwrap().created,
        "an expired instance does not hold a slot"
    );
    assert_eq!(all(&r), vec!["c", "d"]);
    assert!(matches!(
        r.register(spec("e", "voice")),
        Err(RegistryError::Full { .. })
    ));
}

#[test]
fn re_registering_with_another_name_moves_the_instance() {
    let (r, clock) = registry(10 * SEC);
    r.register(spec("a", "voice")).unwrap();
    r.register(spec("b", "voice")).unwrap();
    let s = r.serial();
    clock.advance(SEC);
    let moved = r.register(spec("a", "chat")).unwrap();
    assert!(!moved.created);
    assert!(r.serial() > s, "a rename changes answers");
    assert_eq!(view_ids(&r, "voice"), vec!["b"]);
    assert_eq!(view_ids(&r, "chat"), vec!["a"]);
    assert_eq!(answerable_ids(&r, "chat"), vec!["a"]);
    assert_eq!(r.get("a").unwrap().name, "chat");
    assert_eq!(
        ids(&r.list(&Filter {
            name: Some("voice".into()),
            healthy_only: false,
            ..Filter::default()
        })),
        vec!["b"]
    );
    assert_eq!(
        ids(&r.list(&Filter {
            name: Some("chat".into()),
            healthy_only: false,
            ..Filter::default()
        })),
        vec!["a"]
    );
    assert_eq!(r.service_names(&Filter::default()), vec!["chat", "voice"]);

    // Moving the last instance of a service removes the service.
    r.register(spec("b", "chat")).unwrap();
    assert!(r.view("voice").is_none());
    assert_eq!(r.service_names(&Filter::default()), vec!["chat"]);
    assert_eq!(view_ids(&r, "chat"), vec!["a", "b"]);

    // The moved instance's lease still works, and deregistering cleans the new view.
    assert!(r.heartbeat("a").is_some());
    assert!(r.deregister("a").is_some());
    assert_eq!(view_ids(&r, "chat"), vec!["b"]);
    clock.advance(10 * SEC);
    assert_eq!(r.reap(), 1);
    assert!(r.view("chat").is_none());
}

#[test]
fn rename_of_an_expired_instance_leaves_no_ghost_in_the_old_view() {
    let (r, clock) = registry(10 * SEC);
    r.register(spec("a", "voice")).unwrap();
    clock.advance(10 * SEC);
    assert!(r.register(spec("a", "chat")).unwrap().created);
    assert!(r.view("voice").is_none());
    assert_eq!(view_ids(&r, "chat"), vec!["a"]);
}

// ---------------------------------------------------------------------------------------
// Listings
// ---------------------------------------------------------------------------------------

#[test]
fn list_is_sorted_by_name_then_id_and_filters() {
    let (r, _) = registry(10 * SEC);
    for (id, name) in [
        ("z", "beta"),
        ("m", "alpha"),
        ("b", "beta"),
        ("a", "gamma"),
        ("c", "alpha"),
    ] {
        r.register(spec(id, name)).unwrap();
    }
    r.register(
        with(reg("sick", "delta"), json!({"healthy": false}))
            .validate()
            .unwrap(),
    )
    .unwrap();
    r.register(with(reg("d", "alpha"), json!({"healthy": false})).validate().unwrap())
        .unwrap();
    let list = r.list(&Filter::default());
    let pairs: Vec<(String, String)> = list.iter().map(|i| (i.name.to_string(), i.id.to_string())).collect();
    let expect: Vec<(String, String)> = [
        ("alpha", "c"),
        ("alpha", "d"),
        ("alpha", "m"),
        ("beta", "b"),
        ("beta", "z"),
        ("delta", "sick"),
        ("gamma", "a"),
    ]
    .iter()
    .map(|(n, i)| (n.to_string(), i.to_string()))
    .collect();
    assert_eq!(pairs, expect);
    assert_eq!(
        r.service_names(&Filter::default()),
        vec!["alpha", "beta", "delta", "gamma"]
    );
    let healthy = Filter {
        name: None,
        healthy_only: true,
        ..Filter::default()
    };
    assert_eq!(ids(&r.list(&healthy)), vec!["c", "m", "b", "z", "a"]);
    assert_eq!(
        r.service_names(&healthy),
        vec!["alpha", "beta", "gamma"],
        "delta has no healthy instance"
    );
    assert_eq!(
        ids(&r.list(&Filter {
            name: Some("alpha".into()),
            healthy_only: false,
            ..Filter::default()
        })),
        vec!["c", "d", "m"]
    );
    assert_eq!(
        ids(&r.list(&Filter {
            name: Some("alpha".into()),
            healthy_only: true,
            ..Filter::default()
        })),
        vec!["c", "m"]
    );
    assert!(
        r.list(&Filter {
            name: Some("nope".into()),
            healthy_only: false,
            ..Filter::default()
        })
        .is_empty()
    );
    assert_eq!(
        answerable_ids(&r, "alpha"),
        vec!["c", "m"],
        "DNS answers healthy instances only"
    );
    assert!(answerable_ids(&r, "delta").is_empty());
}

// ---------------------------------------------------------------------------------------
// Validation: "ServiceInstance on the wire"
// ---------------------------------------------------------------------------------------

fn base() -> Value {
    json!({"name": "voice", "address": "10.0.0.1", "port": 5060})
}

#[track_caller]
fn refused(r: Value, field: &str) -> FieldError {
    match r.validate() {
        Ok(spec) => panic!("expected a failure naming {field}, got {spec:?}"),
        Err(e) => {
            assert_eq!(e.field, field, "wrong field in {e}");
            assert!(!e.message.is_empty());
            assert!(e.to_string().contains(field));
            e
        }
    }
}

#[test]
fn defaults_of_a_minimal_registration() {
    let s = base().validate().unwrap();
    assert_eq!(s.id, "voice-10.0.0.1-5060");
    assert_eq!(s.name, "voice");
    assert_eq!(s.address, "10.0.0.1");
    assert_eq!(s.port, 5060);
    assert_eq!(s.protocol, "tcp");
    assert!(s.tags.is_empty());
    assert!(s.metadata.is_empty());
    assert_eq!(s.weight, 100);
    assert_eq!(s.priority, 10);
    assert!(s.healthy, "healthy defaults to true");
    assert_eq!(s.ttl_ns, 0);
}

#[test]
fn name_is_required() {
    refused(with(base(), json!({"name": null})), "name");
    refused(with(base(), json!({"name": String::new()})), "name");
}

#[test]
fn name_is_one_dns_label_of_at_most_63_characters() {
    let n63 = "a".repeat(63);
    assert_eq!(with(base(), json!({"name": n63.clone()})).validate().unwrap().name, n63);
    refused(with(base(), json!({"name": "a".repeat(64)})), "name");
    assert_eq!(with(base(), json!({"name": "a"})).validate().unwrap().name, "a");
    assert_eq!(with(base(), json!({"name": "a-1-b"})).validate().unwrap().name, "a-1-b");
    assert_eq!(
        with(base(), json!({"name": "9lives"})).validate().unwrap().name,
        "9lives"
    );
    for bad in [
        "-voice",
        "voice-",
        "-",
        "voice.koder",
        "voice_1",
        "voi ce",
        "vöice",
        "_voice",
        "voice/1",
    ] {
        refused(with(base(), json!({"name": bad})), "name");
    }
}

#[test]
fn name_is_stored_lower_case() {
    let s = with(base(), json!({"name": "VoIcE"})).validate().unwrap();
    assert_eq!(s.name, "voice");
    assert_eq!(s.id, "voice-10.0.0.1-5060", "the default id uses the stored name");
    let (r, _) = registry(10 * SEC);
    r.register(s).unwrap();
    assert_eq!(r.service_names(&Filter::default()), vec!["voice"]);
    assert!(r.view("voice").is_some());
}

#[test]
fn address_is_required() {
    refused(with(base(), json!({"address": null})), "address");
    refused(with(base(), json!({"address": String::new()})), "address");
}

#[test]
fn address_accepts_ipv4_ipv6_and_host_names() {
    let addr = |a: &str| {
        with(base(), json!({"address": a}))
            .validate()
            .map(|s| s.address.to_string())
    };
    assert_eq!(addr("192.168.1.20").unwrap(), "192.168.1.20");
    assert_eq!(addr("::1").unwrap(), "::1");
    assert_eq!(addr("2001:db8::10").unwrap(), "2001:db8::10");
    assert_eq!(addr("voice-1.internal.koder").unwrap(), "voice-1.internal.koder");
    assert_eq!(
        addr("Voice-1.Internal.KODER").unwrap(),
        "voice-1.internal.koder",
        "host names are lower-case"
    );
    assert_eq!(addr("localhost").unwrap(), "localhost");
}

#[test]
fn address_refuses_what_is_neither_ip_nor_host_name() {
    for bad in [
        "not an address",
        "10.0.0.300",
        "999.1.1.1",
        "1.2.3",
        "host_name.koder",
        "-bad.koder",
        "bad-.koder",
        "a..b",
        "http://10.0.0.1",
        "10.0.0.1:80",
        "2001:db8::zz",
        "[::1]",
    ] {
        refused(with(base(), json!({"address": bad})), "address");
    }
    refused(
        with(base(), json!({"address": format!("{}.koder", "a".repeat(64))})),
        "address",
    );
}

#[test]
fn port_is_required_and_between_1_and_65535() {
    refused(with(base(), json!({"port": null})), "port");
    refused(with(base(), json!({"port": 0})), "port");
    refused(with(base(), json!({"port": -1})), "port");
    refused(with(base(), json!({"port": 65536})), "port");
    refused(with(base(), json!({"port": i64::MAX})), "port");
    assert_eq!(with(base(), json!({"port": 1})).validate().unwrap().port, 1);
    assert_eq!(with(base(), json!({"port": 65535})).validate().unwrap().port, 65535);
}

#[test]
fn protocol_defaults_to_tcp_and_is_one_label_stored_lower_case() {
    assert_eq!(
        with(base(), json!({"protocol": null})).validate().unwrap().protocol,
        "tcp"
    );
    assert_eq!(
        with(base(), json!({"protocol": String::new()}))
            .validate()
            .unwrap()
            .protocol,
        "tcp"
    );
    assert_eq!(
        with(base(), json!({"protocol": "UDP"})).validate().unwrap().protocol,
        "udp"
    );
    assert_eq!(
        with(base(), json!({"protocol": "sctp"})).validate().unwrap().protocol,
        "sctp"
    );
    for bad in ["_tcp", "t cp", "tcp.udp", "-tcp", "tcp-", &"t".repeat(64)] {
        refused(with(base(), json!({"protocol": bad.to_string()})), "protocol");
    }
}

#[test]
fn weight_and_priority_are_0_to_65535_with_defaults() {
    let s = with(base(), json!({"weight": 0, "priority": 0})).validate().unwrap();
    assert_eq!((s.weight, s.priority), (0, 0));
    let s = with(base(), json!({"weight": 65535, "priority": 65535}))
        .validate()
        .unwrap();
    assert_eq!((s.weight, s.priority), (65535, 65535));
    for bad in [-1, 65536, i64::MIN] {
        refused(with(base(), json!({"weight": bad})), "weight");
        refused(with(base(), json!({"priority": bad})), "priority");
    }
}

#[test]
fn id_defaults_to_name_address_port() {
    assert_eq!(base().validate().unwrap().id, "voice-10.0.0.1-5060");
    let s = with(base(), json!({"address": "2001:db8::1"})).validate().unwrap();
    assert_eq!(s.id, "voice-2001:db8::1-5060");
    let s = with(base(), json!({"address": "Host.Koder"})).validate().unwrap();
    assert_eq!(s.id, "voice-host.koder-5060");
    let s = with(base(), json!({"id": String::new()})).validate().unwrap();
    assert_eq!(s.id, "voice-10.0.0.1-5060", "an empty id is an omitted one");
    let s = with(base(), json!({"id": "My Instance #1"})).validate().unwrap();
    assert_eq!(s.id, "My Instance #1", "an explicit id is kept as sent");
}

#[test]
fn id_is_at_most_255_printable_characters() {
    let s = with(base(), json!({"id": "i".repeat(255)})).validate().unwrap();
    assert_eq!(s.id.len(), 255);
    refused(with(base(), json!({"id": "i".repeat(256)})), "id");
    refused(with(base(), json!({"id": "bad\nid"})), "id");
    refused(with(base(), json!({"id": "bad\u{0}id"})), "id");
    refused(with(base(), json!({"id": "tab\tid"})), "id");
    // A default id can be too long as well: 63 + long host name.
    let long_host = format!("{}.{}.{}.koder", "a".repeat(63), "b".repeat(63), "c".repeat(63));
    refused(
        with(base(), json!({"name": "n".repeat(63), "address": long_host})),
        "id",
    );
}

#[test]
fn healthy_defaults_to_true_and_false_is_kept() {
    assert!(with(base(), json!({"healthy": null})).validate().unwrap().healthy);
    assert!(with(base(), json!({"healthy": true})).validate().unwrap().healthy);
    assert!(!with(base(), json!({"healthy": false})).validate().unwrap().healthy);
}

#[test]
fn jet_domain_must_be_a_public_host_name() {
    let with_meta = |d: &str| with(base(), json!({"metadata": {"jet.domain": d}}));
    let with_tag = |d: &str| with(base(), json!({"tags": [format!("jet.domain={d}")]}));
    assert!(with_meta("voice.koder.dev").validate().is_ok());
    assert!(with_meta("voice.koder.dev.").validate().is_ok());
    assert!(with_tag("voice.koder.dev").validate().is_ok());
    for bad in [
        "",
        "voice",
        "not a domain",
        "voice..koder.dev",
        "-voice.koder.dev",
        "voice.koder.dev/x",
        "10.0.0.1",
    ] {
        let e = with_meta(bad).validate().expect_err(bad);
        assert!(e.field.contains("jet.domain"), "{e}");
        let e = with_tag(bad).validate().expect_err(bad);
        assert!(e.field.contains("jet.domain"), "{e}");
    }
}

#[test]
fn tags_and_metadata_are_kept() {
    let s = with(
        base(),
        json!({"tags": ["a", "container=voice-1"], "metadata": {"service": "voice"}}),
    )
    .validate()
    .unwrap();
    assert_eq!(s.tags, vec!["a".to_owned(), "container=voice-1".to_owned()]);
    assert_eq!(s.metadata.get("service"), Some("voice"));
}

#[test]
fn re_registering_at_a_new_address_resets_a_checked_flag() {
    let (registry, _) = registry(std::time::Duration::from_secs(90));
    let spec = |address: &str| {
        json!({"id": "x", "name": "svc", "address": address, "port": 80, "metadata": {"check": "tcp"}})
            .validate()
            .unwrap()
    };
    registry.register(spec("10.0.0.1")).unwrap();
    assert!(registry.set_health("x", false));
    assert!(
        !registry.register(spec("10.0.0.1")).unwrap().instance.healthy,
        "the same target keeps the checker's verdict"
    );
    assert!(
        registry.register(spec("10.0.0.2")).unwrap().instance.healthy,
        "a new address starts over with the registrant's flag"
    );
}

#[test]
fn metadata_is_a_sorted_map_on_the_wire_and_shared_between_copies() {
    let m: Metadata = serde_json::from_str(r#"{"zone": "eu", "codec": "opus", "zone": "us"}"#).unwrap();
    assert_eq!(m.len(), 2);
    assert_eq!(
        m.get("zone"),
        Some("us"),
        "a later duplicate key wins, as in a JSON object"
    );
    assert_eq!(m.get("codec"), Some("opus"));
    assert_eq!(m.get("missing"), None);
    assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"codec":"opus","zone":"us"}"#);
    assert_eq!(m.iter().collect::<Vec<_>>(), vec![("codec", "opus"), ("zone", "us")]);
    assert_eq!(serde_json::to_string(&Metadata::default()).unwrap(), "{}");
    let none: Metadata = serde_json::from_str("{}").unwrap();
    assert!(none.is_empty() && none == Metadata::default());
    // Instances registered from it keep it as given.
    let (r, _) = registry(60 * SEC);
    let registered = r
        .register(
            with(reg("m", "voice"), json!({"metadata": {"b": "2", "a": "1"}}))
                .validate()
                .unwrap(),
        )
        .unwrap();
    assert_eq!(
        registered.instance.metadata.iter().collect::<Vec<_>>(),
        vec![("a", "1"), ("b", "2")]
    );
}

// ---------------------------------------------------------------------------------------
// What the etcd store relies on (see `registry::etcd`).

#[test]
fn a_followed_revision_is_the_stores_and_local_changes_do_not_move_it() {
    let (r, _) = registry(SEC * 10);
    r.follow_revision(7);
    assert_eq!(r.revision(), 7, "set, not raised over the wall-clock start");
    r.register(spec("a", "web")).unwrap();
    assert_eq!(r.revision(), 7, "a local change does not count");
    r.advance_revision(9);
    r.advance_revision(8);
    assert_eq!(r.revision(), 9, "only ever moves forward");
}

#[test]
fn prepared_says_created_for_a_new_or_dead_id_only() {
    let (r, clock) = registry(SEC * 10);
    let fresh = r.prepare(spec("a", "web")).unwrap();
    assert!(fresh.created());
    r.apply(fresh);
    clock.advance(SEC);
    let again = r.prepare(spec("a", "web")).unwrap();
    assert!(!again.created(), "a live id is refreshed");
    r.cancel(again);
    clock.advance(SEC * 20);
    assert!(
        r.prepare(spec("a", "web")).unwrap().created(),
        "a dead id registers anew"
    );
}

#[test]
fn a_renewal_elsewhere_moves_the_lease_only_and_a_change_is_refused() {
    let (r, clock) = registry(SEC * 10);
    let stored = r.register(spec("a", "web")).unwrap().instance;
    let grace = SEC.as_nanos() as i64;
    clock.advance(SEC * 8);
    let renewed = Instance {
        updated_at: r.now(),
        ..stored.clone()
    };
    assert!(r.renewed_elsewhere(&renewed, grace));
    clock.advance(SEC * 8);
    assert_eq!(
        all(&r),
        ["a"],
        "alive 16s after registering: renewed at 8s for 10s + 1s"
    );
    let changed = Instance { port: 9090, ..renewed };
    assert!(!r.renewed_elsewhere(&changed, grace), "more than the stamp changed");
    clock.advance(SEC * 4);
    assert!(all(&r).is_empty(), "the renewal's lease ended at 19s");
}

#[test]
fn extended_leases_outlive_their_ttl_and_only_move_later() {
    let (r, clock) = registry(SEC * 10);
    r.register(spec("a", "web")).unwrap();
    clock.advance(SEC * 9);
    r.extend_leases((SEC * 2).as_nanos() as i64);
    clock.advance(SEC * 9);
    assert_eq!(all(&r), ["a"], "held one TTL from 9s");
    r.extend_leases(i64::MAX);
    clock.advance(SEC * 9);
    assert_eq!(all(&r), ["a"], "held again, from 18s");
    clock.advance(SEC * 2);
    assert!(all(&r).is_empty());
}

#[test]
fn put_back_replaces_an_instance_in_its_view() {
    let (r, _) = registry(SEC * 10);
    let stored = r.register(spec("a", "web")).unwrap().instance;
    assert_eq!(view_ids(&r, "web"), ["a"]);
    assert!(r.put_back(Instance { port: 9090, ..stored }, 0));
    assert_eq!(view_ids(&r, "web"), ["a"]);
    assert_eq!(r.len(), 1, "replaced, not added");
    assert_eq!(r.get("a").unwrap().port, 9090);
}

#[test]
fn a_health_flag_from_elsewhere_is_taken_in_place_and_said_to_nobody() {
    let (r, _) = registry(SEC * 10);
    let stored = r.register(spec("a", "web")).unwrap().instance;
    let mut events = r.subscribe();
    let healthy_only = Filter {
        healthy_only: true,
        ..Filter::default()
    };
    let flipped = Instance {
        healthy: false,
        ..stored.clone()
    };
    assert!(
        r.renewed_elsewhere(&flipped, 0),
        "only the flag changed: no replacement"
    );
    assert!(!r.get("a").unwrap().healthy);
    assert!(r.list(&healthy_only).is_empty(), "the view has the owner's verdict");
    assert!(answerable_ids(&r, "web").is_empty());
    assert!(r.renewed_elsewhere(&stored, 0));
    assert_eq!(ids(&r.list(&healthy_only)), ["a"]);
    assert!(
        events.try_recv().is_err(),
        "the flag is the store's already: nothing to write back"
    );
}
