//! Heartbeats, leases and the reaper (R3).

use super::*;

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
    assert_eq!(listed(&r, Some("voice"), false), vec!["b"]);
    assert_eq!(listed(&r, None, true), vec!["b"]);
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
