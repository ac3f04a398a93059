use super::record::{Meta, State, collect_expired, decode, encode};
use super::*;
use http::HeaderValue;

#[test]
fn keys_are_structured_field_strings() {
    let k = |s: &str| parse_key(&HeaderValue::from_str(s).unwrap());
    assert_eq!(k("\"abc-123\"").unwrap(), "abc-123");
    assert_eq!(k("\"a\\\"b\"").unwrap(), "a\"b");
    for bad in ["abc", "\"\"", "\"a", "\"a\"b\"", "\"a\\x\""] {
        assert!(k(bad).is_err(), "{bad}");
    }
    assert!(k(&format!("\"{}\"", "x".repeat(256))).is_err());
}

/// Collection goes on while batches come back full, however many there are.
#[tokio::test]
async fn every_expired_record_is_collected_in_one_run() {
    let store =
        MarkStore::open_inline_with_backend(redb::backends::InMemoryBackend::new()).expect("store");
    let record = |expires: u64| encode(expires, &Meta::new(String::new(), State::Released, 0), &[]);
    // 150 full batches of 2 expired records (a run used to stop after 100), and live
    // records that must stay.
    for i in 0..300 {
        let claimed = store.claim(format!("s\0old{i}"), record(1), None, 0).await;
        assert!(claimed.expect("claim").is_none());
    }
    for i in 0..3 {
        let claimed = store
            .claim(format!("s\0live{i}"), record(u64::MAX), None, 0)
            .await;
        assert!(claimed.expect("claim").is_none());
    }
    assert_eq!(collect_expired(&store, 2).await, 300);
    assert_eq!(store.record_count().expect("count"), 3);
}

#[test]
fn records_round_trip() {
    let meta = Meta::new(
        "f".into(),
        State::Completed {
            status: 201,
            headers: vec![("etag".into(), b"\"1\"".to_vec())],
            body_stored: true,
        },
        7,
    );
    let v = encode(99, &meta, b"hello");
    assert_eq!(u64::from_be_bytes(v[..8].try_into().unwrap()), 99);
    let (m, body) = decode(&v).unwrap();
    assert_eq!(body, b"hello");
    assert!(matches!(m.state, State::Completed { status: 201, .. }));
    assert!(decode(&v[..10]).is_none());
    assert!(m.made_for("f"));
    assert!(!m.made_for("g"));
}

/// A record as the version before header fingerprints wrote it (no
/// `fingerprint_version`) still decodes, as version 1, and is made for no request of
/// this version, even one whose fingerprint were equal to its own: its fingerprint
/// covered no header, so a match could be another request (`key_reused`, never
/// `duplicate`).
#[test]
fn a_record_of_the_header_blind_version_matches_nothing() {
    let fingerprint = "ab".repeat(32);
    let json = format!(
        r#"{{"fingerprint":"{fingerprint}","state":{{"Completed":{{"status":201,"headers":[],"body_stored":true}}}},"boot":7}}"#
    );
    let mut v = 99u64.to_be_bytes().to_vec();
    v.extend_from_slice(&(json.len() as u32).to_be_bytes());
    v.extend_from_slice(json.as_bytes());
    v.extend_from_slice(b"moved");
    let (m, body) = decode(&v).expect("an old record decodes");
    assert_eq!(body, b"moved");
    assert_eq!(m.fingerprint_version, 1);
    assert!(matches!(m.state, State::Completed { status: 201, .. }));
    assert!(!m.made_for(&fingerprint));
}
