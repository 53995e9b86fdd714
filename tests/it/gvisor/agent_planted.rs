//! The in-sandbox agent runs as the same uid as user code (security.md, "The
//! agent and user code"), so user code can plant a symlink or a FIFO under
//! the names the agent opens. End to end on real runsc, through real
//! executions: user code plants a symlink to a victim file as the workspace
//! state file's temporary (`.sandbox-state.tmp`), FIFOs in the synced
//! workspace and among the files a filesystem snapshot archives, and a
//! symlink to the victim among them. The sync after the execution, a
//! filesystem snapshot, a checkpoint and restore, a file API read and a new
//! sandbox from the snapshot all end (none blocks on a FIFO), the victim is
//! untouched, and the sandbox stays usable.
//!
//! Not here: the workspace download temporaries (`.sandbox-sync-<id>`) are
//! named after the host's request id, which carries a random tag per agent
//! connection, so user code cannot plant one ahead of a download; and the
//! snapshot extraction temporary lives in a new sandbox before its user code
//! ever runs. Both are covered by `sandbox_agent/tests/test_planted.py`.

use crate::support;

use std::sync::Arc;
use std::time::Duration;

use controllers::store::{ObjectKey, Store};
use sandboxd::store::LocalStore;
use sandboxd::workspace::SyncLimits;
use serde_json::{Value, json};
use support::ws::{Server, Ws};

const TOKEN: &str = "test-workspace-token-0123456789";

/// Every frame an agent operation answers within this (a FIFO that blocked
/// the agent's only thread would hold it forever).
const ANSWER: Duration = Duration::from_secs(45);

async fn stdout_of(ws: &mut Ws, code: &str) -> String {
    tokio::time::timeout(ANSWER, ws.stdout_of("bash", code))
        .await
        .expect("the execution and the sync after it end")
}

/// What user code plants: a victim file, a symlink to it as the state
/// file's temporary and in /tmp, FIFOs in the workspace and in /tmp.
const PLANT: &str = "echo untouched > /tmp/victim && \
    ln -s /tmp/victim /workspace/.sandbox-state.tmp && \
    mkfifo /workspace/pipe /tmp/fifo && \
    ln -s /tmp/victim /tmp/link && \
    echo kept > /workspace/a.txt && echo planted";

/// The victim's content, and whether the state file is a regular file.
const CHECK: &str = "cat /tmp/victim; \
    if [ -f /workspace/.sandbox-state ] && [ ! -L /workspace/.sandbox-state ]; \
    then echo state-is-a-file; fi";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_symlinks_and_fifos_neither_redirect_nor_block_the_agent() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(LocalStore::open(dir.path().join("store")).unwrap());
    let workspaces: Arc<dyn Store> =
        Arc::new(LocalStore::open(dir.path().join("workspaces")).unwrap());
    let limits = SyncLimits {
        max_file_bytes: 1 << 20,
        max_total_bytes: 4 << 20,
        max_files: 1000,
        timeout: Duration::from_secs(30),
        stale_threshold_s: 3600,
    };
    let server = Server::with_workspaces(
        "planted",
        store,
        Arc::clone(&workspaces),
        Arc::default(),
        limits,
    )
    .await;
    let init = json!({"workspace_id": "planted", "workspace_token": TOKEN,
                      "enable_checkpoint": true, "idle_timeout": 300});
    let (mut ws, id, token) = server.create(init).await;

    // The sync after this execution scans a workspace holding a FIFO and
    // writes its state file through the planted temporary's name.
    assert_eq!(stdout_of(&mut ws, PLANT).await, "planted\n");
    assert_eq!(
        stdout_of(&mut ws, CHECK).await,
        "untouched\nstate-is-a-file\n"
    );
    let path = sandboxd::workspace::owner::owned_path(TOKEN, "planted");
    let key = ObjectKey::new(format!("workspaces/{path}/sandbox-state")).unwrap();
    let stored: Value = serde_json::from_slice(&workspaces.get(&key).await.unwrap().data).unwrap();
    let paths: Vec<&str> = stored["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert_eq!(paths, ["a.txt"], "the FIFO is not synced: {stored}");

    // The file API refuses to read a FIFO instead of blocking on it.
    ws.send(json!({"action": "fs_read", "request_id": "fifo", "path": "/tmp/fifo"}))
        .await;
    let answer = tokio::time::timeout(ANSWER, async {
        loop {
            let frame = ws.next_value().await;
            if frame["request_id"] == "fifo" {
                return frame;
            }
        }
    })
    .await
    .expect("the file API answers a read of a FIFO");
    assert_eq!(answer["event"], "fs_error", "{answer}");

    // A filesystem snapshot archives /tmp with its FIFO and symlink.
    ws.send(json!({"action": "snapshot_filesystem", "name": "planted"}))
        .await;
    let frames = tokio::time::timeout(
        ANSWER,
        ws.until(|f| {
            f.starts_with("SANDBOX_FILESYSTEM_SNAPSHOT_") && f.ends_with("ED")
                || f.ends_with("_ERROR")
        }),
    )
    .await
    .expect("the snapshot ends");
    assert_eq!(
        frames.last().unwrap(),
        "SANDBOX_FILESYSTEM_SNAPSHOT_CREATED",
        "{frames:?}"
    );
    assert_eq!(stdout_of(&mut ws, "cat /tmp/victim").await, "untouched\n");

    // A checkpoint and a restore with all of it in place.
    ws.send(json!({"action": "checkpoint"})).await;
    let frames = tokio::time::timeout(ANSWER, ws.until_close())
        .await
        .expect("the checkpoint ends");
    assert!(
        frames.contains(&"SANDBOX_CHECKPOINTED".to_owned()),
        "{frames:?}"
    );
    let mut ws = server.attach(&id, &token).await;
    let frames = ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
    assert_eq!(
        stdout_of(&mut ws, &format!("{CHECK}; cat /workspace/a.txt")).await,
        "untouched\nstate-is-a-file\nkept\n"
    );

    // A new sandbox from the snapshot: the symlink is a symlink, the victim
    // a file of its own, untouched.
    let (mut from, _, _) = server
        .create(json!({"filesystem_snapshot_name": "planted",
                       "filesystem_snapshot_token": token}))
        .await;
    assert_eq!(
        stdout_of(
            &mut from,
            "readlink /tmp/link; cat /tmp/victim; [ -p /tmp/fifo ] || echo no-fifo-content"
        )
        .await
        .lines()
        .take(2)
        .collect::<Vec<_>>(),
        ["/tmp/victim", "untouched"]
    );
}
