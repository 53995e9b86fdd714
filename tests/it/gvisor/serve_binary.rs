//! The README's first command, for real: the `sandboxd serve` binary on its
//! embedded default (a local directory store), driven by a WebSocket client:
//! create, run `print(1)`, checkpoint, attach, continue. Then SIGTERM with a
//! client attached: the sandbox is checkpointed, not deleted (upstream deleted
//! every sandbox on shutdown, bug B12), and a restarted server restores it.

use crate::support;

use serde_json::json;
use support::process::{Launch, ServerProcess};
use support::ws::Ws;

/// The binary in `dir/readme` with no storage flags: its embedded default.
async fn start(dir: &std::path::Path) -> ServerProcess {
    Launch::new("readme", dir).start().await
}

#[tokio::test]
async fn the_readme_server_creates_checkpoints_restores_and_saves_on_sigterm_b12() {
    let dir = tempfile::tempdir().unwrap();
    let server = start(dir.path()).await;
    let url = |path: &str| format!("ws://{}{path}", server.addr);

    let mut ws = Ws::connect(&url("/create")).await;
    ws.send(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    assert_eq!(ws.next().await, "SANDBOX_CREATING");
    let id_frame = ws.next_value().await;
    let id = id_frame["sandbox_id"].as_str().unwrap().to_owned();
    let token = id_frame["sandbox_token"].as_str().unwrap().to_owned();
    assert_eq!(ws.next().await, "SANDBOX_RUNNING");
    assert_eq!(ws.exec("python", "print(1)").await[1], "stdout:1\n");
    ws.send(json!({"language": "python", "code": "n = 1", "session": true}))
        .await;
    ws.until_status("SANDBOX_EXECUTION_DONE").await;
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");
    assert!(
        dir.path()
            .join("readme/sandboxd-data/sandboxes")
            .join(&id)
            .join("metadata.json")
            .exists(),
        "the embedded store lives under the working directory"
    );

    let attach = url(&format!("/attach/{id}?sandbox_token={token}"));
    let mut ws = Ws::connect(&attach).await;
    assert_eq!(
        ws.until_status("SANDBOX_RUNNING").await[0],
        "SANDBOX_RESTORING"
    );
    ws.send(json!({"language": "python", "code": "n += 1\nprint(n)", "session": true}))
        .await;
    let frames = support::ws::merge_chunks(ws.until_status("SANDBOX_EXECUTION_DONE").await);
    assert_eq!(frames[1], "stdout:2\n");

    // SIGTERM with the client attached: checkpointed and told so.
    let mut server = server;
    server.signal("-TERM");
    let frames = ws.until_close().await;
    assert!(
        frames.contains(&"SANDBOX_CHECKPOINTED".to_owned()),
        "{frames:?}"
    );

    let restarted = start(dir.path()).await;
    let attach = format!("ws://{}/attach/{id}?sandbox_token={token}", restarted.addr);
    let mut ws = Ws::connect(&attach).await;
    ws.until_status("SANDBOX_RUNNING").await;
    ws.send(json!({"language": "python", "code": "print(n + 1)", "session": true}))
        .await;
    let frames = support::ws::merge_chunks(ws.until_status("SANDBOX_EXECUTION_DONE").await);
    assert_eq!(frames[1], "stdout:3\n");
}

#[tokio::test]
async fn json_logs_carry_severity_and_the_sandbox_id() {
    let dir = tempfile::tempdir().unwrap();
    let server = Launch::new("json-logs", dir.path())
        .with_args(&["--log-format", "json", "--log-level", "info"])
        .start()
        .await;
    let (mut ws, id, _) = server.create(json!({"idle_timeout": 60})).await;
    ws.exec("bash", "true").await;
    drop(server);
    let log = std::fs::read_to_string(dir.path().join("json-logs/sandboxd.log")).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|err| panic!("not JSON ({err}): {line}"))
        })
        .collect();
    assert!(!lines.is_empty());
    for line in &lines {
        let severity = line["severity"].as_str().unwrap_or_default();
        assert!(
            ["DEBUG", "INFO", "WARNING", "ERROR"].contains(&severity),
            "{line}"
        );
    }
    assert!(
        lines.iter().any(|line| line["sandbox"] == id.as_str()),
        "a line about the sandbox names it:\n{log}"
    );
}
