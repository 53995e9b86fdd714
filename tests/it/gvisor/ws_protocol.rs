//! The WebSocket protocol of `docs/wire-contract.md` §3, end to end: a real
//! WebSocket client against the real server on real runsc. One test per
//! sequence and error row, and one regression test per earlier-server bug
//! (B1–B9, B13–B16, `docs/wire-contract.md` §8) named after it.

use crate::support;

use std::time::Duration;

use controllers::api::{Phase, SandboxId};
use controllers::layout::metadata_key;
use serde_json::json;
use support::ws::{Server, Ws, metadata};
use tokio_tungstenite::tungstenite::protocol::Message;

fn strings(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| (*s).to_owned()).collect()
}

/// Asserts that `status` records the checkpoint, waiting for it: the
/// record lands just after `SANDBOX_CHECKPOINTED` (decision 21).
async fn checkpoint_recorded(server: &Server, id: &str) {
    let recorded = support::eventually(
        || metadata(server, id),
        |m| m.status.phase == Phase::Checkpointed,
    )
    .await;
    assert_eq!(recorded.status.phase, Phase::Checkpointed);
}

// ---- §3.1 / §3.2 create -------------------------------------------------

#[tokio::test]
async fn create_sends_creating_then_the_id_then_running() {
    let server = Server::start().await;
    let mut ws = server.connect("/create").await;
    ws.send(json!({"idle_timeout": 60})).await;
    assert_eq!(ws.next().await, "SANDBOX_CREATING");
    let frame = ws.next_value().await;
    assert_eq!(frame["event"], "sandbox_id");
    let id = frame["sandbox_id"].as_str().unwrap();
    let token = frame["sandbox_token"].as_str().unwrap();
    assert_eq!(ws.next().await, "SANDBOX_RUNNING");
    // B14: 128 random bits in a fixed charset; the token is 256 bits.
    assert!(SandboxId::parse(id).is_ok(), "{id}");
    assert_eq!(token.len(), 64);
    assert!(token.chars().all(|c| c.is_ascii_hexdigit()));
    let stored = metadata(&server, id).await;
    assert_eq!(stored.spec.idle_timeout, Some(60));
    // The status record follows SANDBOX_RUNNING (decision 18): the hold
    // was fenced by the lock written with the create.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while metadata(&server, id).await.status.phase != Phase::Running {
        assert!(
            std::time::Instant::now() < deadline,
            "the status record never followed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let stored = metadata(&server, id).await;
    assert_eq!(stored.status.epoch, 1);
    assert!(stored.status.holder.is_some());
}

#[tokio::test]
async fn create_with_handoff_reports_the_lock() {
    let server = Server::start().await;
    let mut ws = server.connect("/create").await;
    ws.send(json!({"idle_timeout": 60, "enable_checkpoint": true, "enable_sandbox_handoff": true}))
        .await;
    assert_eq!(
        ws.until_status("SANDBOX_RUNNING").await,
        strings(&[
            "SANDBOX_CREATING",
            "SANDBOX_LOCK_ACQUIRING",
            "SANDBOX_LOCK_ACQUIRED",
            "sandbox_id",
            "SANDBOX_RUNNING"
        ])
    );
}

// ---- §3.3 create errors ---------------------------------------------------

async fn create_error(server: &Server, init: serde_json::Value) -> Vec<String> {
    let mut ws = server.connect("/create").await;
    ws.send(init).await;
    ws.until_close().await
}

fn creation_error(message: &str) -> Vec<String> {
    vec![
        "SANDBOX_CREATING".to_owned(),
        "SANDBOX_CREATION_ERROR".to_owned(),
        format!("error:{message}"),
        "close:4000".to_owned(),
    ]
}

#[tokio::test]
async fn create_errors_name_the_option_at_fault() {
    let server = Server::start().await;
    assert_eq!(
        create_error(&server, json!({"enable_sandbox_handoff": true})).await,
        creation_error("Sandbox handoff requires checkpointing to be enabled.")
    );
    assert_eq!(
        create_error(
            &server,
            json!({"enable_idle_timeout_auto_checkpoint": true})
        )
        .await,
        creation_error("Idle timeout auto checkpoint requires checkpointing to be enabled.")
    );
    let frames = create_error(&server, json!({"filesystem_snapshot_name": "../etc"})).await;
    assert_eq!(frames[1], "SANDBOX_CREATION_ERROR");
    assert!(
        frames[2].contains("invalid filesystem snapshot name"),
        "{frames:?}"
    );
    let frames = create_error(&server, json!({"filesystem_snapshot_name": "never-taken"})).await;
    assert_eq!(frames[1], "SANDBOX_CREATION_ERROR", "{frames:?}");
    assert!(
        frames[2].starts_with("error:Failed to create gVisor container"),
        "{frames:?}"
    );
    assert_eq!(frames.last().unwrap(), "close:4000");
}

#[tokio::test]
async fn create_errors_when_the_server_lacks_a_feature() {
    let dir = tempfile::tempdir().unwrap();
    let store: std::sync::Arc<dyn controllers::store::Store> =
        std::sync::Arc::new(sandboxd::store::LocalStore::open(dir.path()).unwrap());
    let server = Server::sharing("instance-a", store, |parts| {
        parts.features.checkpoint = false;
        parts.features.snapshot = false;
    })
    .await;
    assert_eq!(
        create_error(&server, json!({"enable_checkpoint": true})).await,
        creation_error("Checkpointing is not enabled on the server.")
    );
    assert_eq!(
        create_error(&server, json!({"filesystem_snapshot_name": "snap"})).await,
        creation_error("Filesystem snapshot is not enabled on the server.")
    );
    assert_eq!(
        create_error(&server, json!({"network": "egress"})).await,
        creation_error(
            "Network mode egress is not enabled on the server (SANDBOXD_NETWORK_MODES)."
        )
    );
}

#[tokio::test]
async fn the_network_option_is_checked_and_reaches_the_runtime() {
    let frames = create_error(&Server::start().await, json!({"network": "bridge"})).await;
    assert_eq!(frames[1], "SANDBOX_CREATION_ERROR");
    assert!(
        frames[2].contains("Invalid init message") && frames[2].contains("network"),
        "{frames:?}"
    );
    // Allowed by the server, but this runtime was started without networking:
    // the runtime itself refuses, so the option did reach it.
    let dir = tempfile::tempdir().unwrap();
    let store: std::sync::Arc<dyn controllers::store::Store> =
        std::sync::Arc::new(sandboxd::store::LocalStore::open(dir.path()).unwrap());
    let server = Server::sharing("instance-a", store, |parts| {
        parts.features.network_egress = true;
    })
    .await;
    let frames = create_error(&server, json!({"network": "egress"})).await;
    assert_eq!(frames[1], "SANDBOX_CREATION_ERROR", "{frames:?}");
    assert!(
        frames[2].contains("network mode egress is not enabled on this server"),
        "{frames:?}"
    );
    let (_ws, id, _token) = server.create(json!({"network": "none"})).await;
    assert_eq!(
        metadata(&server, &id).await.spec.network,
        controllers::api::NetworkMode::None
    );
}

#[tokio::test]
async fn a_malformed_init_message_is_a_creation_error_not_a_dropped_socket() {
    let server = Server::start().await;
    let mut ws = server.connect("/create").await;
    ws.send_raw(Message::text("not json")).await;
    let frames = ws.until_close().await;
    assert_eq!(frames[1], "SANDBOX_CREATION_ERROR");
    assert!(frames[2].contains("Invalid init message"), "{frames:?}");
    assert_eq!(frames[3], "close:4000");
}

// ---- §3.4 attach ------------------------------------------------------------

#[tokio::test]
async fn attach_to_a_running_sandbox_sends_running() {
    let server = Server::start().await;
    let (ws, id, token) = server.create(json!({"idle_timeout": 60})).await;
    ws.close().await;
    let mut again = server.attach(&id, &token).await;
    assert_eq!(again.next().await, "SANDBOX_RUNNING");
    assert_eq!(
        again.exec("bash", "echo back").await,
        strings(&[
            "SANDBOX_EXECUTION_RUNNING",
            "stdout:back\n",
            "exit_code:0",
            "SANDBOX_EXECUTION_DONE"
        ])
    );
}

#[tokio::test]
async fn attach_failures_in_upstream_order() {
    let server = Server::start().await;
    // The token parameter missing: the upgrade itself is refused with 403.
    let refused = Ws::try_connect(
        &server.url(&format!("/attach/{}", SandboxId::random())),
        None,
    )
    .await
    .err()
    .expect("the upgrade must fail");
    assert!(refused.to_string().contains("403"), "{refused}");
    // Empty token.
    let mut ws = server
        .connect(&format!("/attach/{}?sandbox_token=", SandboxId::random()))
        .await;
    assert_eq!(
        ws.until_close().await,
        strings(&[
            "SANDBOX_PERMISSION_DENIAL_ERROR",
            "error:Sandbox token is missing.",
            "close:4000"
        ])
    );
    // Unknown id, and an id that is not even ours (B14: never a path).
    for id in [
        SandboxId::random().to_string(),
        "..%2F..%2Fetc".to_owned(),
        "sandbox-9c73".to_owned(),
    ] {
        let mut ws = server.attach(&id, "abc").await;
        assert_eq!(
            ws.until_close().await,
            strings(&["SANDBOX_NOT_FOUND", "close:1011"]),
            "{id}"
        );
    }
}

#[tokio::test]
async fn a_second_attach_is_in_use_and_steals_nothing_b7() {
    let server = Server::start().await;
    let (mut first, id, token) = server.create(json!({"idle_timeout": 60})).await;
    let mut second = server.attach(&id, &token).await;
    assert_eq!(
        second.until_close().await,
        strings(&["SANDBOX_IN_USE", "close:1011"])
    );
    // A wrong token on an attached sandbox is answered as an unknown id.
    let mut wrong = server.attach(&id, "0000").await;
    assert_eq!(
        wrong.until_close().await,
        strings(&["SANDBOX_NOT_FOUND", "close:1011"])
    );
    // The attached client still gets its own notifications.
    first.send(json!({"action": "kill_sandbox"})).await;
    assert_eq!(
        first.until_close().await,
        strings(&[
            "SANDBOX_KILLING",
            "SANDBOX_DELETING",
            "SANDBOX_DELETED",
            "SANDBOX_KILLED",
            "close:1000"
        ])
    );
}

#[tokio::test]
async fn a_wrong_token_restores_nothing_b6() {
    let server = Server::start().await;
    let (mut ws, id, token) = server
        .create(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");
    let before = support::eventually(
        || metadata(&server, &id),
        |m| m.status.phase == Phase::Checkpointed,
    )
    .await;

    let mut wrong = server.attach(&id, &"f".repeat(64)).await;
    assert_eq!(
        wrong.until_close().await,
        strings(&["SANDBOX_NOT_FOUND", "close:1011"])
    );
    let after = metadata(&server, &id).await;
    assert_eq!(after, before, "a rejected attach changes nothing");
    assert!(
        server
            .state
            .controller
            .as_ref()
            .unwrap()
            .held_sandboxes()
            .is_empty()
    );

    // The right token still restores it.
    let mut right = server.attach(&id, &token).await;
    assert_eq!(
        right.until_status("SANDBOX_RUNNING").await,
        strings(&["SANDBOX_RESTORING", "SANDBOX_RUNNING"])
    );
}

#[tokio::test]
async fn the_token_is_stored_only_as_a_hash_and_not_inside_the_sandbox_b8() {
    let server = Server::start().await;
    let (mut ws, id, token) = server.create(json!({"idle_timeout": 60})).await;
    let stored = server
        .store
        .get(&metadata_key(&SandboxId::parse(&id).unwrap()))
        .await
        .unwrap();
    assert!(!String::from_utf8_lossy(&stored.data).contains(&token));
    let frames = ws
        .exec(
            "bash",
            &format!("ls /tmp/sandbox_token 2>/dev/null; grep -rs {token} /tmp /root /etc | head -1; echo end"),
        )
        .await;
    assert_eq!(frames[1], "stdout:end\n", "{frames:?}");
}

// ---- §3.5 execute -------------------------------------------------------------

#[tokio::test]
async fn execute_streams_output_and_reports_the_exit_code_b16() {
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    assert_eq!(
        ws.exec("bash", "echo hi; echo err >&2; exit 3").await,
        strings(&[
            "SANDBOX_EXECUTION_RUNNING",
            "stdout:hi\n",
            "stderr:err\n",
            "exit_code:3",
            "SANDBOX_EXECUTION_DONE"
        ])
    );
    assert_eq!(
        ws.exec("python", "print(1)").await,
        strings(&[
            "SANDBOX_EXECUTION_RUNNING",
            "stdout:1\n",
            "exit_code:0",
            "SANDBOX_EXECUTION_DONE"
        ])
    );
}

#[tokio::test]
async fn rejected_execs_send_no_done_b3() {
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    ws.send(json!({"language": "ruby", "code": "puts 1"})).await;
    assert_eq!(
        ws.next().await,
        "SANDBOX_EXECUTION_UNSUPPORTED_LANGUAGE_ERROR"
    );
    assert_eq!(
        ws.next().await,
        "error:Unsupported language: 'ruby'. Supported languages are: python, bash"
    );
    ws.send(json!({"language": "bash"})).await;
    assert_eq!(ws.next().await, "SANDBOX_EXECUTION_ERROR");
    assert!(ws.next().await.starts_with("error:Invalid message format."));
    // The next execution's first frame is its RUNNING, not a stale DONE.
    assert_eq!(
        ws.exec("bash", "echo ok").await[0],
        "SANDBOX_EXECUTION_RUNNING"
    );
}

#[tokio::test]
async fn a_second_exec_while_one_runs_is_refused_and_the_first_continues() {
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    ws.send(json!({"language": "bash", "code": "sleep 1; echo first"}))
        .await;
    assert_eq!(ws.next().await, "SANDBOX_EXECUTION_RUNNING");
    ws.send(json!({"language": "bash", "code": "echo second"}))
        .await;
    let frames = ws.until_status("SANDBOX_EXECUTION_DONE").await;
    assert_eq!(
        frames,
        strings(&[
            "SANDBOX_EXECUTION_ERROR",
            "error:An execution is already in progress.",
            "stdout:first\n",
            "exit_code:0",
            "SANDBOX_EXECUTION_DONE"
        ])
    );
}

#[tokio::test]
async fn output_split_inside_a_character_arrives_whole_b2() {
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    let frames = ws
        .exec(
            "python",
            "import sys\nsys.stdout.write('a' + 'é' * 5000 + '\\n')",
        )
        .await;
    assert_eq!(frames[1], format!("stdout:a{}\n", "é".repeat(5000)));
}

// ---- §3.6 stdin ---------------------------------------------------------------------

#[tokio::test]
async fn stdin_reaches_the_running_execution() {
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    ws.send(json!({"event": "stdin", "data": "early\n"})).await;
    assert_eq!(ws.next().await, "SANDBOX_EXECUTION_ERROR");
    assert_eq!(
        ws.next().await,
        "error:No process is running in the sandbox."
    );

    ws.send(json!({"language": "bash", "code": "read a; read b; echo \"got $a $b\""}))
        .await;
    assert_eq!(ws.next().await, "SANDBOX_EXECUTION_RUNNING");
    ws.send(json!({"event": "stdin"})).await;
    assert_eq!(ws.next().await, "SANDBOX_STDIN_ERROR");
    assert_eq!(
        ws.next().await,
        "error:Invalid stdin message format. 'data' field is required."
    );
    ws.send(json!({"event": "stdin", "data": "one\n"})).await;
    ws.send(json!({"event": "stdin", "data": "two\n"})).await;
    assert_eq!(
        ws.until_status("SANDBOX_EXECUTION_DONE").await,
        strings(&[
            "stdout:got one two\n",
            "exit_code:0",
            "SANDBOX_EXECUTION_DONE"
        ])
    );
    // After the end, stdin is dropped silently.
    ws.send(json!({"event": "stdin", "data": "late\n"})).await;
    ws.expect_silence(Duration::from_millis(300)).await;
}

// ---- §3.7 kill the execution -------------------------------------------------------

#[tokio::test]
async fn kill_process_reports_force_killed_before_done_b4_and_kills_the_group_b9() {
    let server = Server::start().await;
    let (mut ws, _, _) = server
        .create(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    for _ in 0..3 {
        ws.send(json!({"language": "bash", "code": "sleep 300 & sleep 300 & echo started; wait"}))
            .await;
        assert_eq!(
            ws.until(|f| f.starts_with("stdout:")).await,
            strings(&["SANDBOX_EXECUTION_RUNNING", "stdout:started\n"])
        );
        ws.send(json!({"action": "kill_process"})).await;
        let frames = ws.until_status("SANDBOX_EXECUTION_DONE").await;
        assert_eq!(frames[0], "SANDBOX_EXECUTION_FORCE_KILLED", "{frames:?}");
        assert_eq!(frames.last().unwrap(), "SANDBOX_EXECUTION_DONE");
    }
    // The background children died with it: nothing blocks a checkpoint.
    let frames = ws
        .exec("python", "import os\nprint(sum(1 for p in os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/comm').read().strip() == 'sleep'))")
        .await;
    assert_eq!(frames[1], "stdout:0\n");
    // Nothing running: FORCE_KILLED only.
    ws.send(json!({"action": "kill_process"})).await;
    assert_eq!(ws.next().await, "SANDBOX_EXECUTION_FORCE_KILLED");
    ws.expect_silence(Duration::from_millis(300)).await;
}

// ---- §3.8 kill the sandbox ---------------------------------------------------------

#[tokio::test]
async fn kill_sandbox_deletes_then_kills_then_closes() {
    let server = Server::start().await;
    let (mut ws, id, token) = server.create(json!({})).await;
    ws.send(json!({"action": "kill_sandbox"})).await;
    assert_eq!(
        ws.until_close().await,
        strings(&[
            "SANDBOX_KILLING",
            "SANDBOX_DELETING",
            "SANDBOX_DELETED",
            "SANDBOX_KILLED",
            "close:1000"
        ])
    );
    assert_eq!(metadata(&server, &id).await.status.phase, Phase::Deleted);
    let mut again = server.attach(&id, &token).await;
    assert_eq!(
        again.until_close().await,
        strings(&["SANDBOX_NOT_FOUND", "close:1011"])
    );
}

// ---- §3.9 checkpoint ---------------------------------------------------------------

#[tokio::test]
async fn checkpoint_then_attach_restores_files_and_memory() {
    let server = Server::start().await;
    let (mut ws, id, token) = server
        .create(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    ws.exec("bash", "echo kept > /tmp/file").await;
    ws.exec("python", "x = 41").await;
    ws.send(json!({"language": "python", "code": "y = 1", "session": true}))
        .await;
    ws.until_status("SANDBOX_EXECUTION_DONE").await;
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(
        ws.until_close().await,
        strings(&[
            "SANDBOX_CHECKPOINTING",
            "SANDBOX_DELETING",
            "SANDBOX_DELETED",
            "SANDBOX_CHECKPOINTED",
            "close:1000"
        ])
    );
    let stored = support::eventually(
        || metadata(&server, &id),
        |m| m.status.phase == Phase::Checkpointed,
    )
    .await;
    assert_eq!(stored.status.phase, Phase::Checkpointed);
    assert!(stored.status.latest_checkpoint.is_some());

    let mut ws = server.attach(&id, &token).await;
    assert_eq!(
        ws.until_status("SANDBOX_RUNNING").await,
        strings(&["SANDBOX_RESTORING", "SANDBOX_RUNNING"])
    );
    assert_eq!(ws.exec("bash", "cat /tmp/file").await[1], "stdout:kept\n");
    // The persistent Python session kept its globals across the move.
    ws.send(json!({"language": "python", "code": "print(y + 1)", "session": true}))
        .await;
    assert_eq!(
        support::ws::merge_chunks(ws.until_status("SANDBOX_EXECUTION_DONE").await)[1],
        "stdout:2\n"
    );
}

#[tokio::test]
async fn checkpoint_refusals() {
    let server = Server::start().await;
    // Not created checkpointable: fatal error, as upstream.
    let (mut plain, _, _) = server.create(json!({})).await;
    plain.send(json!({"action": "checkpoint"})).await;
    let frames = plain.until_close().await;
    assert_eq!(
        frames[..2],
        strings(&["SANDBOX_CHECKPOINTING", "SANDBOX_CHECKPOINT_ERROR"])
    );
    assert!(
        frames[2].ends_with("is not configured for checkpointing."),
        "{frames:?}"
    );
    assert_eq!(frames[3], "close:4000");

    // An execution running: refused, the socket and the execution go on.
    let (mut ws, _, _) = server
        .create(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    ws.send(json!({"language": "bash", "code": "sleep 1; echo done"}))
        .await;
    assert_eq!(ws.next().await, "SANDBOX_EXECUTION_RUNNING");
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(
        ws.until_status("SANDBOX_EXECUTION_DONE").await,
        strings(&[
            "SANDBOX_CHECKPOINTING",
            "SANDBOX_EXECUTION_IN_PROGRESS_ERROR",
            "error:Cannot checkpoint while an execution is in progress.",
            "stdout:done\n",
            "exit_code:0",
            "SANDBOX_EXECUTION_DONE"
        ])
    );
    // An invalid name: refused, the sandbox keeps running.
    ws.send(json!({"action": "checkpoint", "name": "../x"}))
        .await;
    assert_eq!(ws.next().await, "SANDBOX_CHECKPOINTING");
    assert_eq!(ws.next().await, "SANDBOX_CHECKPOINT_ERROR");
    assert!(ws.next().await.contains("invalid checkpoint name"));
    assert_eq!(ws.exec("bash", "echo alive").await[1], "stdout:alive\n");
}

#[tokio::test]
async fn a_named_checkpoint_can_be_attached_to_later() {
    let server = Server::start().await;
    let (mut ws, id, token) = server
        .create(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    ws.exec("bash", "echo v1 > /tmp/v").await;
    ws.send(json!({"action": "checkpoint", "name": "first"}))
        .await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");
    let mut ws = server.attach(&id, &token).await;
    ws.until_status("SANDBOX_RUNNING").await;
    ws.exec("bash", "echo v2 > /tmp/v").await;
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");

    let mut named = server
        .connect(&format!(
            "/attach/{id}?sandbox_token={token}&checkpoint=first"
        ))
        .await;
    named.until_status("SANDBOX_RUNNING").await;
    assert_eq!(named.exec("bash", "cat /tmp/v").await[1], "stdout:v1\n");
    named.send(json!({"action": "checkpoint"})).await;
    assert_eq!(named.until_close().await.last().unwrap(), "close:1000");
    let mut unknown_name = server
        .connect(&format!(
            "/attach/{id}?sandbox_token={token}&checkpoint=nope"
        ))
        .await;
    let frames = unknown_name.until_close().await;
    assert_eq!(
        frames[..2],
        strings(&["SANDBOX_RESTORING", "SANDBOX_RESTORE_ERROR"])
    );
    assert!(
        frames[2].contains("no checkpoint named \"nope\""),
        "{frames:?}"
    );
    assert_eq!(frames[3], "close:4000");
}

// ---- §3.10 snapshot ----------------------------------------------------------------

#[tokio::test]
async fn a_filesystem_snapshot_seeds_a_new_sandbox() {
    let server = Server::start().await;
    let (mut ws, id, token) = server.create(json!({})).await;
    ws.exec("bash", "mkdir -p /tmp/data && echo seeded > /tmp/data/f")
        .await;
    ws.send(json!({"action": "snapshot_filesystem", "name": "seed-1"}))
        .await;
    assert_eq!(
        ws.until_status("SANDBOX_FILESYSTEM_SNAPSHOT_CREATED").await,
        strings(&[
            "SANDBOX_FILESYSTEM_SNAPSHOT_CREATING",
            "SANDBOX_FILESYSTEM_SNAPSHOT_CREATED"
        ])
    );
    // Recorded (by the sandbox's own pass) before the client heard it.
    // (Stored under its owner's prefix: `owner.<hash>/seed-1`.)
    let recorded = metadata(&server, &id).await.status.latest_snapshot;
    let name = recorded.map(|s| s.name).unwrap_or_default();
    assert!(name.ends_with("/seed-1"), "{name:?}");
    ws.send(json!({"action": "snapshot_filesystem", "name": "Bad/Name"}))
        .await;
    assert_eq!(ws.next().await, "SANDBOX_FILESYSTEM_SNAPSHOT_CREATING");
    assert_eq!(ws.next().await, "SANDBOX_FILESYSTEM_SNAPSHOT_ERROR");
    assert!(ws.next().await.contains("invalid snapshot name"));

    let (mut seeded, _, _) = server
        // A snapshot is its owner's: the sandbox's token proves it
        // (tests/it/gvisor/snapshot_ownership.rs has the rest).
        .create(json!({"filesystem_snapshot_name": "seed-1", "filesystem_snapshot_token": token}))
        .await;
    assert_eq!(
        seeded.exec("bash", "cat /tmp/data/f").await[1],
        "stdout:seeded\n"
    );
}

// ---- §3.11 reconnect -----------------------------------------------------------------

#[tokio::test]
async fn reconnect_replays_what_was_missed() {
    let server = Server::start().await;
    let (mut ws, id, token) = server.create(json!({"idle_timeout": 60})).await;
    ws.send(json!({"language": "bash", "code": "echo line1; sleep 1; for i in 2 3 4; do echo line$i; done; sleep 0.5; echo line5"}))
        .await;
    assert_eq!(
        ws.until(|f| f.starts_with("stdout:")).await,
        strings(&["SANDBOX_EXECUTION_RUNNING", "stdout:line1\n"])
    );
    ws.close().await;
    // Lines 2-4 are printed while nobody is attached.
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let mut again = server.attach(&id, &token).await;
    assert_eq!(again.next().await, "SANDBOX_RUNNING");
    again.send(json!({"action": "reconnect"})).await;
    let frames = support::ws::merge_chunks(again.until_status("SANDBOX_EXECUTION_DONE").await);
    assert_eq!(
        frames,
        strings(&[
            "SANDBOX_EXECUTION_RUNNING",
            "stdout:line2\nline3\nline4\nline5\n",
            "exit_code:0",
            "SANDBOX_EXECUTION_DONE"
        ])
    );
}

#[tokio::test]
async fn reconnect_with_nothing_to_replay_sends_nothing_and_keeps_the_socket_b5() {
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    ws.send(json!({"action": "reconnect"})).await;
    ws.expect_silence(Duration::from_millis(500)).await;
    ws.exec("bash", "true").await;
    ws.send(json!({"action": "reconnect"})).await;
    ws.expect_silence(Duration::from_millis(500)).await;
    assert_eq!(ws.exec("bash", "echo still").await[1], "stdout:still\n");
}

// ---- bad input (B13) ----------------------------------------------------------------

#[tokio::test]
async fn bad_frames_get_an_error_and_the_connection_stays_b13() {
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    ws.send_raw(Message::binary(vec![1u8, 2, 3])).await;
    assert!(
        ws.next()
            .await
            .starts_with("error:binary frames are not supported")
    );
    ws.send_raw(Message::text("{not json")).await;
    assert!(ws.next().await.starts_with("error:frame is not valid JSON"));
    ws.send_raw(Message::text("[1,2]")).await;
    assert_eq!(ws.next().await, "error:frame must be a JSON object");
    ws.send(json!({"action": "frobnicate"})).await;
    assert!(
        ws.next()
            .await
            .starts_with("error:unknown action \"frobnicate\"")
    );
    ws.send_raw(Message::text(format!("\"{}\"", "x".repeat(2 << 20))))
        .await;
    assert!(ws.next().await.contains("exceeds the"));
    assert_eq!(ws.exec("bash", "echo alive").await[1], "stdout:alive\n");
}

#[tokio::test]
async fn a_cookie_with_attributes_is_tolerated() {
    let server = Server::start().await;
    let (ws, id, token) = server.create(json!({"idle_timeout": 60})).await;
    ws.close().await;
    let mut again = Ws::try_connect(
        &server.url(&format!("/attach/{id}?sandbox_token={token}")),
        Some("GAESA=abc123; expires=Tue, 01 Dec 2026 00:00:00 GMT; path=/"),
    )
    .await
    .unwrap();
    assert_eq!(again.next().await, "SANDBOX_RUNNING");
}

// ---- idle timeout (B1) ----------------------------------------------------------------

#[tokio::test]
async fn activity_and_running_executions_keep_a_sandbox_alive_b1() {
    let server = Server::start().await;
    let (mut ws, id, _) = server.create(json!({"idle_timeout": 2})).await;
    // Activity every second for 4 s: alive.
    for _ in 0..4 {
        ws.exec("bash", "true").await;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    // An execution longer than the timeout: not expired under it.
    assert_eq!(
        ws.exec("bash", "sleep 4; echo survived").await[1],
        "stdout:survived\n"
    );
    // Then idle: deleted and told so.
    assert_eq!(
        ws.until_close().await,
        strings(&["SANDBOX_DELETING", "SANDBOX_DELETED", "close:1000"])
    );
    assert_eq!(metadata(&server, &id).await.status.phase, Phase::Deleted);
}

#[tokio::test]
async fn idle_auto_checkpoint_keeps_the_sandbox_for_a_later_attach() {
    let server = Server::start().await;
    let (mut ws, id, token) = server
        .create(json!({"idle_timeout": 1, "enable_checkpoint": true, "enable_idle_timeout_auto_checkpoint": true}))
        .await;
    ws.exec("bash", "echo saved > /tmp/s").await;
    let frames = ws.until_close().await;
    assert_eq!(frames.last().unwrap(), "close:1000", "{frames:?}");
    assert!(
        frames.contains(&"SANDBOX_CHECKPOINTED".to_owned()),
        "{frames:?}"
    );
    checkpoint_recorded(&server, &id).await;
    let mut ws = server.attach(&id, &token).await;
    ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(ws.exec("bash", "cat /tmp/s").await[1], "stdout:saved\n");
}

// ---- another process sharing the store ------------------------------------------------

#[tokio::test]
async fn a_checkpoint_taken_by_one_server_is_restored_by_another() {
    let dir = tempfile::tempdir().unwrap();
    let store: std::sync::Arc<dyn controllers::store::Store> =
        std::sync::Arc::new(sandboxd::store::LocalStore::open(dir.path()).unwrap());
    let a = Server::sharing("instance-a", std::sync::Arc::clone(&store), |_| {}).await;
    let b = Server::sharing("instance-b", store, |_| {}).await;
    let (mut ws, id, token) = a
        .create(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    ws.exec("python", "open('/tmp/n', 'w').write('41')").await;
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");

    let mut ws = b.attach(&id, &token).await;
    assert_eq!(
        ws.until_status("SANDBOX_RUNNING").await,
        strings(&["SANDBOX_RESTORING", "SANDBOX_RUNNING"])
    );
    assert_eq!(
        ws.exec("python", "print(int(open('/tmp/n').read()) + 1)")
            .await[1],
        "stdout:42\n"
    );
    let stored = metadata(&b, &id).await;
    assert_eq!(stored.status.holder.unwrap().as_str(), "instance-b");
    assert_eq!(stored.status.epoch, 2);
}

// ---- /list (B15) -----------------------------------------------------------------------

#[tokio::test]
async fn list_shows_the_sandboxes_running_here_b15() {
    let server = Server::start().await;
    let (mut ws, id, _) = server.create(json!({})).await;
    ws.send(json!({"language": "bash", "code": "sleep 2"}))
        .await;
    assert_eq!(ws.next().await, "SANDBOX_EXECUTION_RUNNING");
    let listed: serde_json::Value = support::get_json(format!("http://{}/list", server.addr)).await;
    assert!(
        listed["containers"].as_str().unwrap().contains(&id),
        "{listed}"
    );
    assert_eq!(
        listed["sandboxes"],
        json!([{"sandbox_id": id, "attached": true, "execution_running": true,
                "store_operations": listed["sandboxes"][0]["store_operations"]}])
    );
    // At least the create's metadata and lock and the status record.
    assert!(listed["sandboxes"][0]["store_operations"].as_u64().unwrap() >= 3);
    let metrics = support::get_text(format!("http://{}/metrics", server.addr)).await;
    assert!(metrics.contains("sandboxd_sandboxes_held 1"), "{metrics}");
    assert!(
        metrics.contains("sandboxd_store_operations_total{op=\"put\"}"),
        "{metrics}"
    );
}

// ---- §3.4 restore failures ---------------------------------------------------------------

async fn checkpointed(server: &Server) -> (String, String) {
    let (mut ws, id, token) = server
        .create(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");
    (id, token)
}

#[tokio::test]
async fn invalid_json_written_by_an_operator_is_a_clear_restore_error() {
    let server = Server::start().await;
    let (id, token) = checkpointed(&server).await;
    let key = metadata_key(&SandboxId::parse(&id).unwrap());
    server
        .store
        .put(
            &key,
            bytes::Bytes::from_static(b"{\"apiVersion\": \"sandboxd.dev/v1\", \"spec\": "),
            controllers::store::PutMode::Overwrite,
        )
        .await
        .unwrap();
    let mut ws = server.attach(&id, &token).await;
    let frames = ws.until_close().await;
    assert_eq!(frames[0], "SANDBOX_RESTORE_ERROR", "{frames:?}");
    assert!(frames[1].contains("metadata.json"), "{frames:?}");
    assert_eq!(frames[2], "close:4000");
}

#[tokio::test]
async fn a_corrupt_checkpoint_image_is_refused_and_the_record_kept() {
    let server = Server::start().await;
    let (id, token) = checkpointed(&server).await;
    let before = support::eventually(
        || metadata(&server, &id),
        |m| m.status.latest_checkpoint.is_some(),
    )
    .await;
    let image = before.status.latest_checkpoint.clone().unwrap().path;
    let key = controllers::store::ObjectKey::new(image.as_str()).unwrap();
    let mut bytes = server.store.get(&key).await.unwrap().data.to_vec();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    server
        .store
        .put(&key, bytes.into(), controllers::store::PutMode::Overwrite)
        .await
        .unwrap();

    let mut ws = server.attach(&id, &token).await;
    let frames = ws.until_close().await;
    assert_eq!(
        frames[..2],
        strings(&["SANDBOX_RESTORING", "SANDBOX_RESTORE_ERROR"]),
        "{frames:?}"
    );
    assert!(frames[2].contains("corrupt"), "{frames:?}");
    assert_eq!(frames[3], "close:4000");
    let after = metadata(&server, &id).await;
    assert_eq!(after.status.phase, Phase::Checkpointed);
    assert_eq!(
        after.status.latest_checkpoint,
        before.status.latest_checkpoint
    );
    assert!(
        server
            .state
            .controller
            .as_ref()
            .unwrap()
            .held_sandboxes()
            .is_empty()
    );
}

#[tokio::test]
async fn pings_are_answered() {
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({})).await;
    ws.send_raw(Message::Ping(bytes::Bytes::from_static(b"hi")))
        .await;
    assert!(ws.next_pong().await);
}

// ---- /metrics after create, exec, checkpoint, restore ----------------------------------

#[tokio::test]
async fn metrics_expose_operations_durations_and_sizes() {
    let server = Server::start().await;
    let (mut ws, id, token) = server
        .create(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    ws.exec("bash", "echo x").await;
    ws.send(json!({"action": "checkpoint"})).await;
    ws.until_close().await;
    let mut ws = server.attach(&id, &token).await;
    ws.until_status("SANDBOX_RUNNING").await;
    let metrics = support::get_text(format!("http://{}/metrics", server.addr)).await;
    let value = |series: &str| -> f64 {
        metrics
            .lines()
            .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{series} missing in:\n{metrics}"))
    };
    assert_eq!(value("sandboxd_creates_total "), 1.0);
    assert_eq!(value("sandboxd_checkpoint_seconds_count "), 1.0);
    assert_eq!(value("sandboxd_restore_seconds_count "), 1.0);
    assert_eq!(value("sandboxd_handoff_in_seconds_count "), 1.0);
    assert!(value("sandboxd_checkpoint_bytes_total ") > 1000.0);
    assert!(value("sandboxd_checkpoint_seconds_sum ") > 0.0);
    assert_eq!(value("sandboxd_sandboxes{phase=\"running\"} "), 1.0);
    assert!(value("sandboxd_store_operations_total{op=\"put\"} ") >= 5.0);
    assert!(value("sandboxd_store_operations_total{op=\"upload\"} ") >= 1.0);
    assert_eq!(value("sandboxd_reconcile_errors_total "), 0.0);
}

// ---- many clients attaching one sandbox at once -----------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_many_simultaneous_attaches_across_instances_exactly_one_wins() {
    let dir = tempfile::tempdir().unwrap();
    let store: std::sync::Arc<dyn controllers::store::Store> =
        std::sync::Arc::new(sandboxd::store::LocalStore::open(dir.path()).unwrap());
    let a = Server::sharing("instance-a", std::sync::Arc::clone(&store), |_| {}).await;
    let b = Server::sharing("instance-b", std::sync::Arc::clone(&store), |_| {}).await;
    let (mut ws, id, token) = a
        .create(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    ws.send(json!({"action": "checkpoint"})).await;
    ws.until_close().await;

    let mut attempts = Vec::new();
    for i in 0..8 {
        let server_addr = if i % 2 == 0 {
            a.addr.clone()
        } else {
            b.addr.clone()
        };
        let url = format!("ws://{server_addr}/attach/{id}?sandbox_token={token}");
        attempts.push(tokio::spawn(async move {
            let mut ws = Ws::connect(&url).await;
            let frames = ws.until(|f| f == "SANDBOX_RUNNING").await;
            (frames, ws)
        }));
    }
    let mut winners = 0;
    let mut keep = Vec::new();
    for attempt in attempts {
        let (frames, ws) = attempt.await.unwrap();
        if frames.last().unwrap() == "SANDBOX_RUNNING" {
            winners += 1;
            keep.push(ws);
        } else {
            let last = frames.last().unwrap();
            assert!(last == "close:1011" || last == "close:4000", "{frames:?}");
            assert!(
                frames
                    .iter()
                    .any(|f| f == "SANDBOX_IN_USE" || f == "SANDBOX_RESTORE_ERROR"),
                "a clear status: {frames:?}"
            );
        }
    }
    // An attach through another instance moves the sandbox (the previous
    // client's socket may be dead), so more than one may see RUNNING in turn;
    // in the end exactly one client holds it and the others were told.
    assert!(winners >= 1);
    let mut alive = 0;
    for mut ws in keep {
        ws.try_send(json!({"language": "bash", "code": "true"}))
            .await;
        let frames = ws
            .until(|f| f == "SANDBOX_EXECUTION_DONE" || f.starts_with("close:"))
            .await;
        if frames.last().unwrap() == "SANDBOX_EXECUTION_DONE" {
            alive += 1;
        } else {
            assert!(
                frames.contains(&"SANDBOX_CHECKPOINTED".to_owned()),
                "moved away, and told: {frames:?}"
            );
        }
    }
    assert_eq!(alive, 1, "exactly one client holds the sandbox in the end");
    let running = [&a, &b]
        .iter()
        .filter(|s| {
            s.state
                .controller
                .as_ref()
                .unwrap()
                .is_held_here(&SandboxId::parse(&id).unwrap())
        })
        .count();
    assert_eq!(running, 1);
}

// ---- what real clients see --------------------------------------------------

/// The stdout of `frames`, concatenated.
fn stdout_of(frames: &[String]) -> String {
    frames
        .iter()
        .filter_map(|f| f.strip_prefix("stdout:"))
        .collect()
}

/// Frames of one socket take effect in arrival order: each used to be handled
/// in its own task, and a burst of stdin came back reordered (44 inversions in
/// 2,000). Sent without waiting, right behind the execution itself, on the
/// multi-threaded runtime the server binary uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_thousand_stdin_frames_arrive_in_order() {
    const LINES: usize = 5000;
    let server = Server::start().await;
    let (mut ws, _, _) = server.create(json!({"idle_timeout": 120})).await;
    ws.send(json!({"language": "bash", "code": format!("head -n {LINES}")}))
        .await;
    for i in 0..LINES {
        ws.send(json!({"event": "stdin", "data": format!("{i}\n")}))
            .await;
    }
    let frames = ws.until_status("SANDBOX_EXECUTION_DONE").await;
    assert_eq!(frames[0], "SANDBOX_EXECUTION_RUNNING", "{:?}", &frames[..3]);
    assert!(
        !frames.iter().any(|f| f.starts_with("error:")),
        "{:?}",
        frames
            .iter()
            .filter(|f| f.starts_with("error:"))
            .take(3)
            .collect::<Vec<_>>()
    );
    let received: Vec<usize> = stdout_of(&frames)
        .lines()
        .map(|line| line.parse().unwrap())
        .collect();
    let inversions = received.windows(2).filter(|w| w[0] > w[1]).count();
    assert_eq!(
        inversions,
        0,
        "first lines: {:?}",
        &received[..20.min(received.len())]
    );
    assert_eq!(received, (0..LINES).collect::<Vec<_>>());
}

/// A checkpoint sent right before an execution is taken before it: the
/// execution never starts, the socket ends with the checkpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_sent_before_an_execution_is_taken_first() {
    let server = Server::start().await;
    let (mut ws, id, _) = server
        .create(json!({"idle_timeout": 120, "enable_checkpoint": true}))
        .await;
    ws.send(json!({"action": "checkpoint"})).await;
    ws.send(json!({"language": "bash", "code": "sleep 5; echo ran"}))
        .await;
    let frames = ws.until_close().await;
    assert_eq!(
        frames,
        strings(&[
            "SANDBOX_CHECKPOINTING",
            "SANDBOX_DELETING",
            "SANDBOX_DELETED",
            "SANDBOX_CHECKPOINTED",
            "close:1000"
        ])
    );
    checkpoint_recorded(&server, &id).await;
}

/// A message beyond the server's limit closes the socket with 1009 and a
/// reason (it used to drop the TCP connection); the sandbox is untouched and
/// can be attached again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_frame_closes_1009_with_a_reason_and_reattach_works() {
    let server = Server::start().await;
    let (mut ws, id, token) = server.create(json!({"idle_timeout": 120})).await;
    ws.exec("bash", "echo kept > /tmp/file").await;
    let big = "x".repeat(70 << 20);
    // The server may stop reading mid-send; the close frame is what counts.
    let _ = ws.try_send_raw(Message::text(big)).await;
    let (code, reason) = ws
        .close_frame()
        .await
        .expect("a close frame, not a dropped connection");
    assert_eq!(code, 1009, "{reason}");
    assert!(
        reason.contains("too long") || reason.contains("limited"),
        "{reason}"
    );

    let mut again = server.attach(&id, &token).await;
    assert_eq!(again.next().await, "SANDBOX_RUNNING");
    assert_eq!(
        again.exec("bash", "cat /tmp/file").await[1],
        "stdout:kept\n"
    );
}

/// A reconnect while output is queued must not lose what the replaced
/// streamer had taken from the replay log but not yet sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_while_output_streams_loses_nothing() {
    const LINES: usize = 1500;
    let server = Server::start().await;
    let (ws, id, token) = server.create(json!({"idle_timeout": 120})).await;
    ws.close_now().await;
    // A socket whose unread frames back up into the server's writer queue.
    // The create's session ends when the server has read its close: until
    // then an attach is told SANDBOX_IN_USE (CI met it once).
    let url = server.url(&format!("/attach/{id}?sandbox_token={token}"));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut ws = loop {
        let mut ws = support::ws::Ws::connect_small_window(&url).await;
        let first = ws.next().await;
        if first == "SANDBOX_RUNNING" {
            break ws;
        }
        assert!(
            first == "SANDBOX_IN_USE" && std::time::Instant::now() < deadline,
            "attach: {first}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // 6 MB in numbered 4 KiB lines, a few ms apart so that each is a frame
    // of its own: more than the writer's queue of 256 frames holds, less
    // than the replay log keeps.
    let code = format!(
        "import sys, time\nfor i in range({LINES}):\n    sys.stdout.write('%08d' % i + 'x' * 4087 + '\\n')\n    sys.stdout.flush()\n    time.sleep(0.002)\n"
    );
    ws.send(json!({"language": "python", "code": code})).await;
    assert_eq!(ws.next().await, "SANDBOX_EXECUTION_RUNNING");
    // Read nothing for a while: the server's streamer blocks mid-output.
    tokio::time::sleep(Duration::from_secs(10)).await;
    ws.send(json!({"action": "reconnect"})).await;
    let frames = ws.until_status("SANDBOX_EXECUTION_DONE").await;
    assert!(
        !frames.iter().any(|f| f.contains("were dropped")),
        "the replay log overflowed; the test needs less output"
    );
    let numbers: Vec<usize> = stdout_of(&frames)
        .lines()
        .map(|line| line[..8].parse().unwrap())
        .collect();
    let missing: Vec<usize> = (0..LINES).filter(|i| !numbers.contains(i)).collect();
    assert!(
        missing.is_empty(),
        "lost {} lines: {:?}…",
        missing.len(),
        &missing[..missing.len().min(10)]
    );
    assert_eq!(numbers, (0..LINES).collect::<Vec<_>>());
}

/// An unknown id and a known id with a wrong token get the same answer, on
/// the WebSocket attach and on every HTTP route that takes a sandbox token:
/// a token learns nothing about which ids exist.
#[tokio::test]
async fn an_unknown_id_and_a_wrong_token_are_answered_alike() {
    let server = Server::start().await;
    let (_running, running_id, _) = server.create(json!({"idle_timeout": 60})).await;
    let (mut ws, stopped_id, _) = server
        .create(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");
    let unknown = SandboxId::random().to_string();
    let wrong = "f".repeat(64);

    let mut answers = Vec::new();
    for id in [&unknown, &running_id, &stopped_id] {
        let mut attach = server.attach(id, &wrong).await;
        answers.push(attach.until_close().await);
    }
    assert_eq!(
        answers[0],
        strings(&["SANDBOX_NOT_FOUND", "close:1011"]),
        "{answers:?}"
    );
    assert!(answers.iter().all(|a| a == &answers[0]), "{answers:?}");

    let client = testkit::http_client();
    let base = format!("http://{}", server.addr);
    for route in ["files", "files/content", "checkpoints"] {
        let mut answers = Vec::new();
        for id in [&unknown, &running_id, &stopped_id] {
            let url = format!("{base}/sandboxes/{id}/{route}");
            let request = match route {
                "files" => client.post(url).json(&json!({"op": "stat", "path": "a"})),
                "files/content" => client.get(url).query(&[("path", "a")]),
                _ => client.get(url),
            };
            let response = request
                .bearer_auth(&wrong)
                .header("x-sandbox-token", &wrong)
                .send()
                .await
                .unwrap();
            answers.push((response.status().as_u16(), response.text().await.unwrap()));
        }
        assert_eq!(answers[0].0, 404, "{route}: {answers:?}");
        assert!(
            answers.iter().all(|a| a == &answers[0]),
            "{route}: {answers:?}"
        );
    }
}
