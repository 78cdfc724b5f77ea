//! Limits and renames.

use super::*;

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
    assert_eq!(listed(&r, Some("voice"), false), vec!["b"]);
    assert_eq!(listed(&r, Some("chat"), false), vec!["a"]);
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
