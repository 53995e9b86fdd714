//! The README's first command, for real: the `sandboxd serve` binary on its
//! embedded default (a local directory store), driven by a WebSocket client:
//! create, run `print(1)`, checkpoint, attach, continue. Then SIGTERM with a
//! client attached: the sandbox is checkpointed, not deleted (upstream deleted
//! every sandbox on shutdown, bug B12), and a restarted server restores it.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "tests fail by panicking"
)]

mod support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use support::ws::Ws;

struct ServerProcess {
    child: Child,
    addr: String,
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts the binary in `cwd` (its default data directory lands there) with
/// its runsc state under `runtime_dir`, and waits until it is ready.
async fn start(cwd: &Path, runtime_dir: &Path) -> ServerProcess {
    let addr = format!("127.0.0.1:{}", free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_sandboxd"))
        .args(["serve", "--listen", &addr, "--runtime-dir"])
        .arg(runtime_dir)
        .current_dir(cwd)
        .env("LOG_LEVEL", "warn")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let server = ServerProcess { child, addr };
    let started = Instant::now();
    loop {
        if let Ok(response) = reqwest::get(format!("http://{}/readyz", server.addr)).await
            && response.status().is_success()
        {
            return server;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "sandboxd did not become ready"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_readme_server_creates_checkpoints_restores_and_saves_on_sigterm_b12() {
    let dir = tempfile::tempdir().unwrap();
    let runtime_dir = dir.path().join("run");
    let _cleanup = support::RunscCleanup(runtime_dir.join("runsc"));
    let server = start(dir.path(), &runtime_dir).await;
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
            .join("sandboxd-data/sandboxes")
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
    let pid = server.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let frames = ws.until_close().await;
    assert!(
        frames.contains(&"SANDBOX_CHECKPOINTED".to_owned()),
        "{frames:?}"
    );
    let mut server = server;
    let status = server.child.wait().unwrap();
    assert!(status.success(), "sandboxd exited with {status}");

    let restarted = start(dir.path(), &runtime_dir).await;
    let attach = format!("ws://{}/attach/{id}?sandbox_token={token}", restarted.addr);
    let mut ws = Ws::connect(&attach).await;
    ws.until_status("SANDBOX_RUNNING").await;
    ws.send(json!({"language": "python", "code": "print(n + 1)", "session": true}))
        .await;
    let frames = support::ws::merge_chunks(ws.until_status("SANDBOX_EXECUTION_DONE").await);
    assert_eq!(frames[1], "stdout:3\n");
}
