//! Unit tests of the model: "ServiceInstance on the wire" (R1), and the helpers that read
//! a registration body as the REST API does, shared with the registry's tests.

use serde_json::{Value, json};

use super::FieldError;
use super::instance::{Instance, Validated};
use super::metadata::Metadata;

/// A registration body read as the REST API reads it: the field's path names a value that
/// could not be read (an address, a port out of range), then [`Instance::validate`].
pub(crate) trait Read {
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
pub(crate) fn with(mut base: Value, patch: Value) -> Value {
    for (k, v) in patch.as_object().expect("a patch is an object") {
        base[k] = v.clone();
    }
    base
}

/// A minimal valid registration.
pub(crate) fn reg(id: &str, name: &str) -> Value {
    json!({"id": id, "name": name, "address": "10.0.0.1", "port": 8080})
}

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
}
