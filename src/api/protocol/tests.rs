//! Frame parsing and writing against the contract's exact shapes.

use super::*;

#[test]
fn server_frames_are_compact_json_with_exact_strings() {
    assert_eq!(
        ServerFrame::status(Status::Running).to_text(),
        r#"{"event":"status_update","status":"SANDBOX_RUNNING"}"#
    );
    assert_eq!(
        ServerFrame::status_with(Status::CreationError, "boom").to_text(),
        r#"{"event":"status_update","message":"boom","status":"SANDBOX_CREATION_ERROR"}"#
    );
    assert_eq!(
        ServerFrame::SandboxId {
            sandbox_id: "abc".into(),
            sandbox_token: "tok".into()
        }
        .to_text(),
        r#"{"event":"sandbox_id","sandbox_id":"abc","sandbox_token":"tok"}"#
    );
    assert_eq!(
        ServerFrame::Stdout("hi\n".into()).to_text(),
        r#"{"data":"hi\n","event":"stdout"}"#
    );
    assert_eq!(
        ServerFrame::ExitCode(3).to_text(),
        r#"{"event":"exit_code","exit_code":3}"#
    );
    assert_eq!(Status::LockAcquiring.as_str(), "SANDBOX_LOCK_ACQUIRING");
    assert_eq!(
        Status::ExecutionUnsupportedLanguageError.as_str(),
        "SANDBOX_EXECUTION_UNSUPPORTED_LANGUAGE_ERROR"
    );
}

#[test]
fn init_messages_of_both_clients_parse_with_upstream_defaults() {
    // Python client: only truthy keys besides idle_timeout.
    let python = InitMessage::parse(r#"{"idle_timeout": 60, "enable_checkpoint": true}"#).unwrap();
    assert_eq!(python.idle_timeout_s, Some(60));
    assert!(python.enable_checkpoint && !python.enable_sandbox_handoff);
    // JS client: every boolean, snapshot only when given.
    let js = InitMessage::parse(
        r#"{"idle_timeout":60,"enable_checkpoint":false,"enable_sandbox_handoff":false,"filesystem_snapshot_name":"snap","enable_idle_timeout_auto_checkpoint":false}"#,
    )
    .unwrap();
    assert_eq!(js.filesystem_snapshot_name.as_deref(), Some("snap"));
    assert_eq!(js.network, controllers::api::NetworkMode::None);
    assert_eq!(
        InitMessage::parse("{}").unwrap().idle_timeout_s,
        Some(DEFAULT_IDLE_TIMEOUT_S)
    );
    assert_eq!(
        InitMessage::parse(r#"{"idle_timeout": 0}"#)
            .unwrap()
            .idle_timeout_s,
        None
    );
    assert_eq!(
        InitMessage::parse(r#"{"idle_timeout": null}"#)
            .unwrap()
            .idle_timeout_s,
        None
    );
    assert!(matches!(
        InitMessage::parse(r#"{"idle_timeout": "soon"}"#),
        Err(FrameError::WrongType {
            field: "idle_timeout",
            ..
        })
    ));
    assert!(matches!(
        InitMessage::parse("[1,2]"),
        Err(FrameError::NotObject)
    ));
}

/// `idle_timeout: 18446744073709551615` panicked the idle timer's
/// worker (`Instant` overflow) and the sandbox never expired. It is refused
/// at parse time, naming the range, as are negative and fractional values.
#[test]
fn idle_timeout_out_of_range_is_refused_naming_the_range() {
    assert_eq!(
        InitMessage::parse(&format!(r#"{{"idle_timeout": {MAX_IDLE_TIMEOUT_S}}}"#))
            .unwrap()
            .idle_timeout_s,
        Some(MAX_IDLE_TIMEOUT_S)
    );
    for value in [
        "18446744073709551615",
        "18446744073709551616",
        "2592001",
        "-1",
        "1.5",
        "1e300",
    ] {
        let err = InitMessage::parse(&format!(r#"{{"idle_timeout": {value}}}"#))
            .expect_err(value)
            .to_string();
        assert!(
            err.contains("idle_timeout") && err.contains("2592000"),
            "{value}: {err}"
        );
    }
}

#[test]
fn keep_executions_is_an_optional_boolean_off_by_default() {
    assert!(!InitMessage::parse("{}").unwrap().keep_executions);
    assert!(
        InitMessage::parse(r#"{"enable_checkpoint": true, "keep_executions": true}"#)
            .unwrap()
            .keep_executions
    );
    assert!(matches!(
        InitMessage::parse(r#"{"keep_executions": "yes"}"#),
        Err(FrameError::WrongType {
            field: "keep_executions",
            ..
        })
    ));
}

#[test]
fn client_frames_follow_upstream_precedence() {
    assert_eq!(
        ClientFrame::parse(r#"{"action":"checkpoint"}"#).unwrap(),
        ClientFrame::Checkpoint { name: None }
    );
    assert_eq!(
        ClientFrame::parse(r#"{"action":"checkpoint","name":"before-upgrade"}"#).unwrap(),
        ClientFrame::Checkpoint {
            name: Some("before-upgrade".into())
        }
    );
    assert_eq!(
        ClientFrame::parse(r#"{"action":"snapshot_filesystem","name":"s"}"#).unwrap(),
        ClientFrame::SnapshotFilesystem {
            name: "s".into(),
            proof: None
        }
    );
    assert_eq!(
        ClientFrame::parse(r#"{"action":"kill_process"}"#).unwrap(),
        ClientFrame::KillProcess
    );
    assert_eq!(
        ClientFrame::parse(r#"{"action":"kill_sandbox"}"#).unwrap(),
        ClientFrame::KillSandbox
    );
    assert_eq!(
        ClientFrame::parse(r#"{"action":"reconnect"}"#).unwrap(),
        ClientFrame::Reconnect
    );
    assert_eq!(
        ClientFrame::parse(r#"{"event":"stdin","data":"one\n"}"#).unwrap(),
        ClientFrame::Stdin {
            data: "one\n".into()
        }
    );
    // An action wins over everything else in the frame.
    assert_eq!(
        ClientFrame::parse(r#"{"action":"kill_process","language":"bash","code":"x"}"#).unwrap(),
        ClientFrame::KillProcess
    );
    assert_eq!(
        ClientFrame::parse(r#"{"language":"bash","code":"echo hi"}"#).unwrap(),
        ClientFrame::Exec {
            language: Language::Bash,
            code: "echo hi".into(),
            session: false,
            pty: None,
            results: false
        }
    );
    assert_eq!(
        ClientFrame::parse(r#"{"language":"python","code":"x=1","session":true}"#).unwrap(),
        ClientFrame::Exec {
            language: Language::Python,
            code: "x=1".into(),
            session: true,
            pty: None,
            results: false
        }
    );
}

#[test]
fn bad_frames_get_clear_errors_and_the_contract_statuses() {
    let err = ClientFrame::parse(r#"{"language":"ruby","code":"puts 1"}"#).unwrap_err();
    assert_eq!(
        err.to_string(),
        "Unsupported language: 'ruby'. Supported languages are: python, bash"
    );
    assert_eq!(
        err.status(),
        Some(Status::ExecutionUnsupportedLanguageError)
    );
    let err = ClientFrame::parse(r#"{"language":"bash"}"#).unwrap_err();
    assert_eq!(err.status(), Some(Status::ExecutionError));
    assert!(err.to_string().starts_with("Invalid message format."));
    let err = ClientFrame::parse(r#"{"event":"stdin"}"#).unwrap_err();
    assert_eq!(err.status(), Some(Status::StdinError));
    assert_eq!(
        err.to_string(),
        "Invalid stdin message format. 'data' field is required."
    );
    let err = ClientFrame::parse(r#"{"action":"frobnicate"}"#).unwrap_err();
    assert!(matches!(err, FrameError::UnknownAction(ref a) if a == "frobnicate"));
    assert_eq!(err.status(), None);
    assert!(matches!(
        ClientFrame::parse("not json"),
        Err(FrameError::NotJson(_))
    ));
    assert!(matches!(
        ClientFrame::parse("[1,2]"),
        Err(FrameError::NotObject)
    ));
    assert!(matches!(
        ClientFrame::parse("42"),
        Err(FrameError::NotObject)
    ));
    let huge = format!(
        r#"{{"language":"bash","code":"{}"}}"#,
        "x".repeat(MAX_FRAME_BYTES)
    );
    assert!(matches!(
        ClientFrame::parse(&huge),
        Err(FrameError::TooLarge(_))
    ));
    assert!(matches!(
        ClientFrame::parse(r#"{"action":"snapshot_filesystem"}"#),
        Err(FrameError::MissingSnapshotName)
    ));
    assert!(matches!(
        ClientFrame::parse(r#"{"action":7}"#),
        Err(FrameError::WrongType { .. })
    ));
}

#[test]
fn utf8_split_across_chunks_is_kept_and_invalid_bytes_are_replaced() {
    let text = format!("a{}", "é".repeat(600));
    let bytes = text.as_bytes();
    let mut stream = Utf8Stream::default();
    let mut out = String::new();
    for chunk in bytes.chunks(1024).flat_map(|c| c.chunks(7)) {
        out.push_str(&stream.push(chunk));
    }
    out.push_str(&stream.finish());
    assert_eq!(out, text);

    let mut stream = Utf8Stream::default();
    assert_eq!(
        stream.push(b"ok \xff\xfe then \xe2\x82"),
        "ok \u{fffd}\u{fffd} then "
    );
    assert_eq!(stream.push(b"\xac!"), "€!");
    assert_eq!(stream.push(b"\xe2"), "");
    assert_eq!(stream.finish(), "\u{fffd}");
}

#[test]
fn mutated_frames_never_panic() {
    use rand::SeedableRng;
    let seeds = [
        r#"{"language":"python","code":"print(1)","session":true}"#,
        r#"{"event":"stdin","data":"one\n"}"#,
        r#"{"action":"snapshot_filesystem","name":"s"}"#,
        r#"{"action":"checkpoint","name":"n"}"#,
        r#"{"idle_timeout": 60, "enable_checkpoint": true, "filesystem_snapshot_name": "x"}"#,
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut parsed = 0;
    for i in 0..20_000 {
        let input = controllers::testing::mutate(&mut rng, seeds[i % seeds.len()].as_bytes());
        let text = String::from_utf8_lossy(&input);
        if ClientFrame::parse(&text).is_ok() {
            parsed += 1;
        }
        let _ = InitMessage::parse(&text);
    }
    assert!(
        parsed > 100,
        "mutations must sometimes stay valid ({parsed})"
    );
}

#[test]
fn streamed_decoding_equals_decoding_the_whole_for_random_bytes() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for _ in 0..2_000 {
        let len = rng.random_range(0..64);
        // Mostly UTF-8 text with multi-byte characters, with random bytes mixed in.
        let mut bytes = Vec::with_capacity(len * 2);
        for _ in 0..len {
            match rng.random_range(0..4) {
                0 => bytes.extend_from_slice("é".as_bytes()),
                1 => bytes.extend_from_slice("€".as_bytes()),
                2 => bytes.push(rng.random()),
                _ => bytes.push(b'a'),
            }
        }
        let mut stream = Utf8Stream::default();
        let mut out = String::new();
        let mut rest = &bytes[..];
        while !rest.is_empty() {
            let n = rng.random_range(1..=rest.len().min(5));
            out.push_str(&stream.push(&rest[..n]));
            rest = &rest[n..];
        }
        out.push_str(&stream.finish());
        assert_eq!(out, String::from_utf8_lossy(&bytes), "{bytes:?}");
    }
}

#[test]
fn the_init_network_option_is_none_egress_or_an_error() {
    use controllers::api::NetworkMode;
    let parse = |text: &str| InitMessage::parse(text).map(|init| init.network);
    assert_eq!(parse("{}"), Ok(NetworkMode::None));
    assert_eq!(parse(r#"{"network": null}"#), Ok(NetworkMode::None));
    assert_eq!(parse(r#"{"network": "none"}"#), Ok(NetworkMode::None));
    assert_eq!(parse(r#"{"network": "egress"}"#), Ok(NetworkMode::Egress));
    for bad in [r#"{"network": "bridge"}"#, r#"{"network": true}"#] {
        let err = parse(bad).unwrap_err();
        assert!(err.to_string().contains("network"), "{err}");
    }
}

#[test]
fn workspace_options_need_a_token_with_a_name() {
    let parse = |text: &str| InitMessage::parse(text);
    let named = parse(r#"{"workspace_id":"proj","workspace_token":"0123456789abcdef"}"#).unwrap();
    let request = named.workspace.unwrap();
    assert_eq!(request.id.as_deref(), Some("proj"));
    assert_eq!(request.token.as_deref(), Some("0123456789abcdef"));
    assert!(
        parse(r#"{"enable_workspace_sync":true}"#)
            .unwrap()
            .workspace
            .is_some()
    );
    assert!(parse(r#"{}"#).unwrap().workspace.is_none());
    for bad in [
        r#"{"workspace_id":"proj"}"#,
        r#"{"workspace_id":"proj","workspace_token":"short"}"#,
        r#"{"workspace_template":"default"}"#,
        r#"{"enable_workspace_sync":"yes"}"#,
        r#"{"workspace_id":7,"workspace_token":"0123456789abcdef"}"#,
    ] {
        assert!(parse(bad).is_err(), "{bad} was accepted");
    }
}

#[test]
fn from_checkpoint_names_a_source_and_its_token_or_is_an_error() {
    let parse = |text: &str| InitMessage::parse(text).map(|init| init.from_checkpoint);
    assert_eq!(parse("{}"), Ok(None));
    assert_eq!(parse(r#"{"from_checkpoint": null}"#), Ok(None));
    let latest = parse(r#"{"from_checkpoint": {"sandbox_id": "abc", "sandbox_token": "t0k"}}"#)
        .unwrap()
        .unwrap();
    assert_eq!(latest.sandbox_id, "abc");
    assert_eq!(latest.sandbox_token, "t0k");
    assert_eq!(latest.name, None);
    let named = parse(
        r#"{"from_checkpoint": {"sandbox_id": "abc", "sandbox_token": "t0k", "name": "before-step-2"}}"#,
    )
    .unwrap()
    .unwrap();
    assert_eq!(named.name.as_deref(), Some("before-step-2"));
    // The token never reaches a log line through Debug.
    assert!(!format!("{named:?}").contains("t0k"));
    for bad in [
        r#"{"from_checkpoint": "abc"}"#,
        r#"{"from_checkpoint": {"sandbox_id": "abc"}}"#,
        r#"{"from_checkpoint": {"sandbox_token": "t0k"}}"#,
        r#"{"from_checkpoint": {"sandbox_id": 7, "sandbox_token": "t0k"}}"#,
        r#"{"from_checkpoint": {"sandbox_id": "", "sandbox_token": "t0k"}}"#,
        r#"{"from_checkpoint": {"sandbox_id": "abc", "sandbox_token": "t0k", "name": "Bad Name"}}"#,
        r#"{"from_checkpoint": {"sandbox_id": "abc", "sandbox_token": "t0k", "name": 3}}"#,
    ] {
        let err = parse(bad).unwrap_err();
        assert!(err.to_string().contains("from_checkpoint"), "{bad}: {err}");
    }
}

#[test]
fn rich_results_are_asked_for_by_session_cells_only() {
    assert_eq!(
        ClientFrame::parse(r#"{"language":"python","code":"1+1","session":true,"results":true}"#)
            .unwrap(),
        ClientFrame::Exec {
            language: Language::Python,
            code: "1+1".into(),
            session: true,
            pty: None,
            results: true
        }
    );
    for frame in [
        r#"{"language":"python","code":"1","results":true}"#,
        r#"{"language":"bash","code":"1","session":true,"results":true}"#,
    ] {
        let err = ClientFrame::parse(frame).unwrap_err();
        assert!(err.to_string().contains("results"), "{err}");
    }
    let err = ClientFrame::parse(r#"{"language":"python","code":"1","session":true,"results":1}"#)
        .unwrap_err();
    assert!(err.to_string().contains("results"), "{err}");
}

#[test]
fn a_result_is_its_own_event() {
    let result = serde_json::json!({"kind": "execute_result", "data": {"text/plain": "2"}});
    assert_eq!(
        ServerFrame::Result(result, 10).to_text(),
        r#"{"data":{"text/plain":"2"},"event":"result","kind":"execute_result"}"#
    );
}

#[test]
fn labels_are_a_bounded_map_of_strings() {
    assert!(InitMessage::parse("{}").unwrap().labels.is_empty());
    let labels = InitMessage::parse(r#"{"labels": {"team": "ml", "run.id": "7-b_c"}}"#)
        .unwrap()
        .labels;
    assert_eq!(labels["team"], "ml");
    assert_eq!(labels["run.id"], "7-b_c");
    let many: serde_json::Map<String, serde_json::Value> = (0..33)
        .map(|n| (format!("k{n}"), serde_json::Value::from("v")))
        .collect();
    for refused in [
        r#"{"labels": ["team"]}"#.to_owned(),
        r#"{"labels": {"team": 7}}"#.to_owned(),
        r#"{"labels": {"": "x"}}"#.to_owned(),
        r#"{"labels": {"a b": "x"}}"#.to_owned(),
        format!(r#"{{"labels": {{"k": "{}"}}}}"#, "v".repeat(257)),
        serde_json::json!({ "labels": many }).to_string(),
    ] {
        let error = InitMessage::parse(&refused).unwrap_err().to_string();
        assert!(error.contains("labels"), "{refused}: {error}");
    }
}
