//! The SOA serial and the revision.

use super::*;

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
