//! Upsert (R2).

use super::*;
use crate::model::metadata::Metadata;

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
fn registered_metadata_is_kept_as_a_sorted_map() {
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

#[test]
fn a_service_is_listed_and_viewed_under_its_lower_case_name() {
    let (r, _) = registry(10 * SEC);
    r.register(with(reg("v", "VoIcE"), json!({})).validate().unwrap())
        .unwrap();
    assert_eq!(r.service_names(&Filter::default()), vec!["voice"]);
    assert!(r.view("voice").is_some());
}
