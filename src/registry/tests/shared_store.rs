//! What the etcd store relies on (see `store::etcd`).

use super::*;

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

/// A held blocking query waits on [`Registry::changed`]: following a store's revision, a
/// local change (applied ahead of the store's watch) must not wake it with the index it
/// holds; the store's revision does.
#[test]
fn following_a_stores_revision_a_local_change_wakes_no_one() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    let (r, _) = registry(SEC * 10);
    r.follow_revision(7);
    let changed = r.changed();
    let mut changed = std::pin::pin!(changed);
    changed.as_mut().enable();
    r.register(spec("a", "web")).unwrap();
    r.deregister("a");
    let mut cx = Context::from_waker(Waker::noop());
    assert!(changed.as_mut().poll(&mut cx).is_pending(), "woken by a local change");
    r.advance_revision(8);
    assert_eq!(
        changed.as_mut().poll(&mut cx),
        Poll::Ready(()),
        "not woken by the store's revision"
    );
}

#[test]
fn a_renewal_is_computed_without_renewing_and_says_when_it_confirms() {
    let (r, clock) = registry(SEC * 10);
    let stored = r.register(spec("a", "web")).unwrap().instance;
    clock.advance(SEC * 4);
    let (renewed, confirms) = r.renewal("a").unwrap();
    assert_eq!(renewed.updated_at, r.now());
    assert_eq!(
        Instance {
            updated_at: stored.updated_at,
            ..renewed
        },
        stored
    );
    assert!(!confirms, "alive: nothing to confirm");
    assert_eq!(r.get("a").unwrap().updated_at, stored.updated_at, "nothing renewed");
    clock.advance(SEC * 6);
    assert!(r.renewal("a").is_none(), "its lease ended at 10s");
    assert!(r.renewal("unknown").is_none());

    // A lease that ran out while the registry could not see heartbeats: renewed, and the
    // renewal confirms it.
    let stored = r.register(spec("b", "web")).unwrap().instance;
    r.blind_between(r.now(), r.now() + (SEC * 20).as_nanos() as i64);
    clock.advance(SEC * 15);
    let (renewed, confirms) = r.renewal("b").unwrap();
    assert!(confirms, "lapsed unseen");
    assert!(renewed.updated_at > stored.updated_at);
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
