//! Decoding, encoding and field preservation of the API objects.

use chrono::{TimeZone, Utc};

use super::*;

const METADATA: &str = r#"{
  "apiVersion": "sandboxd.dev/v1",
  "sandbox_id": "0123456789abcdef0123456789abcdef",
  "created_at": "2026-11-22T03:00:00Z",
  "operator_note": "ticket OPS-42",
  "spec": {
    "desired_state": "running",
    "idle_timeout": 60,
    "enable_checkpoint": true,
    "token_sha256": "abababababababababababababababababababababababababababababababab",
    "labels": {"team": "ml"},
    "x-priority": 7
  },
  "status": {
    "phase": "Running",
    "holder": "instance-a",
    "epoch": 3,
    "latest_checkpoint": {
      "bucket": "ckpts",
      "path": "sandbox_checkpoints/c1/checkpoint.img",
      "epoch": 2,
      "sha256": "cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd",
      "size": 1234,
      "created_at": "2026-11-22T03:01:00Z",
      "checked_by": "ops"
    },
    "debug": {"kept": true}
  }
}"#;

#[test]
fn metadata_round_trips_with_unknown_fields_at_every_level() {
    let mut metadata: SandboxMetadata = decode(METADATA.as_bytes()).unwrap();
    assert_eq!(metadata.spec.desired_state, DesiredState::Running);
    assert_eq!(metadata.spec.idle_timeout, Some(60));
    assert_eq!(metadata.status.epoch, 3);

    // A controller's read-modify-write.
    metadata.status.phase = Phase::Checkpointed;
    metadata.status.set_condition(
        "Ready",
        ConditionStatus::False,
        "Checkpointed",
        "saved",
        Utc.with_ymd_and_hms(2026, 11, 22, 4, 0, 0).unwrap(),
    );
    let written = encode(&metadata);
    let value: serde_json::Value = serde_json::from_slice(&written).unwrap();
    assert_eq!(value["operator_note"], "ticket OPS-42");
    assert_eq!(value["spec"]["x-priority"], 7);
    assert_eq!(value["status"]["debug"]["kept"], true);
    assert_eq!(value["status"]["latest_checkpoint"]["checked_by"], "ops");
    assert_eq!(value["status"]["phase"], "Checkpointed");
    assert_eq!(
        value["status"]["conditions"][0]["lastTransitionTime"],
        "2026-11-22T04:00:00Z"
    );
    assert_eq!(value["status"]["conditions"][0]["type"], "Ready");

    let again: SandboxMetadata = decode(&written).unwrap();
    assert_eq!(again, metadata);
}

#[test]
fn objects_are_pretty_printed_for_people() {
    let metadata: SandboxMetadata = decode(METADATA.as_bytes()).unwrap();
    let text = String::from_utf8(encode(&metadata).to_vec()).unwrap();
    assert!(
        text.starts_with("{\n  \"apiVersion\": \"sandboxd.dev/v1\",\n"),
        "{text}"
    );
    assert!(text.ends_with("}\n"));
    let lease = Lease::unheld(30);
    let text = String::from_utf8(encode(&lease).to_vec()).unwrap();
    assert!(text.contains("\n  \"holder\": null,\n"), "{text}");
}

fn decode_error(text: &str) -> DecodeError {
    decode::<SandboxMetadata>(text.as_bytes()).unwrap_err()
}

#[test]
fn a_bad_enum_value_names_its_field() {
    let err = decode_error(&METADATA.replace(
        "\"desired_state\": \"running\"",
        "\"desired_state\": \"runing\"",
    ));
    assert_eq!(err.field(), Some("spec.desired_state"));
    let message = err.to_string();
    assert!(
        message.contains("spec.desired_state") && message.contains("runing"),
        "{message}"
    );
}

#[test]
fn a_wrong_type_names_its_nested_field() {
    let err = decode_error(&METADATA.replace("\"size\": 1234", "\"size\": \"big\""));
    assert_eq!(err.field(), Some("status.latest_checkpoint.size"), "{err}");
    let err = decode_error(&METADATA.replace("\"epoch\": 3,", "\"epoch\": -1,"));
    assert_eq!(err.field(), Some("status.epoch"), "{err}");
}

#[test]
fn a_missing_required_field_is_named() {
    let err = decode_error(&METADATA.replace("\"desired_state\": \"running\",", ""));
    let message = err.to_string();
    assert!(message.contains("desired_state"), "{message}");
}

#[test]
fn semantic_checks_name_their_field() {
    let err = decode_error(&METADATA.replace("\"idle_timeout\": 60", "\"idle_timeout\": 0"));
    assert_eq!(err.field(), Some("spec.idle_timeout"));
    // An operator's huge value would overflow the idle timer (docs/security.md).
    let err = decode_error(&METADATA.replace(
        "\"idle_timeout\": 60",
        "\"idle_timeout\": 18446744073709551615",
    ));
    assert_eq!(err.field(), Some("spec.idle_timeout"));
    let err = decode_error(&METADATA.replace(
        "abababababababababababababababababababababababababababababababab",
        "secret",
    ));
    assert_eq!(err.field(), Some("spec.token_sha256"));
    let err = decode_error(&METADATA.replace("\"epoch\": 2,", "\"epoch\": 9,"));
    assert_eq!(err.field(), Some("status.latest_checkpoint.epoch"));
    let err = decode_error(
        &METADATA.replace("sandbox_checkpoints/c1/checkpoint.img", "../../etc/passwd"),
    );
    assert_eq!(err.field(), Some("status.latest_checkpoint.path"));
    let err = decode_error(&METADATA.replace("0123456789abcdef0123456789abcdef", "../x"));
    assert_eq!(err.field(), Some("sandbox_id"), "{err}");
}

#[test]
fn syntax_errors_and_other_versions_are_reported() {
    assert!(matches!(
        decode_error("{\"apiVersion\": "),
        DecodeError::Syntax { .. }
    ));
    assert!(matches!(
        decode_error("[]"),
        DecodeError::Syntax { .. } | DecodeError::Field { .. }
    ));
    assert!(matches!(
        decode_error(&format!("{METADATA} trailing")),
        DecodeError::Syntax { .. }
    ));
    let err = decode_error(&METADATA.replace("sandboxd.dev/v1", "sandboxd.dev/v2"));
    assert_eq!(err.field(), Some("apiVersion"));
    assert!(err.to_string().contains("sandboxd.dev/v2"));
}

#[test]
fn lease_validation_names_fields() {
    let text = r#"{"apiVersion": "sandboxd.dev/v1", "holder": "a", "epoch": 1, "lease_duration_s": 0, "renewed_at": "2026-11-22T03:00:00Z"}"#;
    let err = decode::<Lease>(text.as_bytes()).unwrap_err();
    assert_eq!(err.field(), Some("lease_duration_s"));
    let text =
        r#"{"apiVersion": "sandboxd.dev/v1", "holder": "a", "epoch": 1, "lease_duration_s": 30}"#;
    let err = decode::<Lease>(text.as_bytes()).unwrap_err();
    assert_eq!(err.field(), Some("renewed_at"));
    let text =
        r#"{"apiVersion": "sandboxd.dev/v1", "holder": "a/b", "epoch": 1, "lease_duration_s": 30}"#;
    let err = decode::<Lease>(text.as_bytes()).unwrap_err();
    assert_eq!(err.field(), Some("holder"), "{err}");
}
