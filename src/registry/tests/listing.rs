//! Listings.

use super::*;

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
    assert_eq!(listed(&r, Some("alpha"), false), vec!["c", "d", "m"]);
    assert_eq!(listed(&r, Some("alpha"), true), vec!["c", "m"]);
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
