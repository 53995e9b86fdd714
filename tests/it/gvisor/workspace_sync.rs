//! Workspace sync (`docs/workspaces.md`) end to end on real runsc: a real WebSocket client
//! creates sandboxes with `workspace_id`, the server syncs `/workspace` into a
//! store after every execution and back into new or restored sandboxes.

use crate::support;

use std::sync::Arc;

use controllers::store::{ObjectKey, Operation, OperationCounts, Store};
use sandboxd::server::counted;
use sandboxd::store::LocalStore;
use sandboxd::workspace::owner::owned_path;
use sandboxd::workspace::{SyncLimits, WorkspaceMetrics};
use serde_json::{Value, json};
use support::ws::{Server, Ws};

/// A server whose workspace store is counted on its own.
struct Fixture {
    server: Server,
    workspaces: Arc<dyn Store>,
    workspace_ops: Arc<OperationCounts>,
    _dir: tempfile::TempDir,
}

/// The secret that owns the tests' named workspaces.
const TOKEN: &str = "test-workspace-token-0123456789";

/// Small limits, so the tests can cross them.
const LIMITS: SyncLimits = SyncLimits {
    max_file_bytes: 1 << 20,
    max_total_bytes: 4 << 20,
    max_files: 1000,
    timeout: std::time::Duration::from_secs(60),
    stale_threshold_s: 3600,
};

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(LocalStore::open(dir.path().join("store")).unwrap());
    let raw: Arc<dyn Store> = Arc::new(LocalStore::open(dir.path().join("workspaces")).unwrap());
    let workspace_ops = Arc::new(OperationCounts::default());
    let workspaces = counted(Arc::clone(&raw), &workspace_ops);
    let server = Server::with_workspaces("ws-a", store, workspaces, Arc::default(), LIMITS).await;
    Fixture {
        server,
        workspaces: raw,
        workspace_ops,
        _dir: dir,
    }
}

impl Fixture {
    fn metrics(&self) -> &WorkspaceMetrics {
        self.server
            .state
            .workspace_hooks
            .as_ref()
            .expect("workspace sync configured")
            .metrics()
    }

    fn operations(&self) -> u64 {
        Operation::ALL
            .iter()
            .map(|op| self.workspace_ops.count(*op))
            .sum()
    }

    /// The stored state of workspace `name` owned by [`TOKEN`].
    async fn remote_state(&self, name: &str) -> Value {
        self.remote_state_at(&owned_path(TOKEN, name)).await
    }

    async fn remote_state_at(&self, path: &str) -> Value {
        let key = ObjectKey::new(format!("workspaces/{path}/sandbox-state")).unwrap();
        serde_json::from_slice(&self.workspaces.get(&key).await.unwrap().data).unwrap()
    }

    async fn create(&self, init: Value) -> (Ws, String, String) {
        self.server.create(init).await
    }

    /// `/create` with `init`, read to the close.
    async fn create_frames(&self, init: Value) -> Vec<String> {
        let mut create = self.server.connect("/create").await;
        create.send(init).await;
        create.until_close().await
    }

    /// Overwrites a workspace's stored state, as an operator could.
    async fn write_state(&self, name: &str, state: &Value) {
        let path = owned_path(TOKEN, name);
        let key = ObjectKey::new(format!("workspaces/{path}/sandbox-state")).unwrap();
        self.workspaces
            .put(
                &key,
                state.to_string().into(),
                controllers::store::PutMode::Overwrite,
            )
            .await
            .unwrap();
    }
}

fn paths(state: &Value) -> Vec<String> {
    state["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap().to_owned())
        .collect()
}

fn counter(value: &std::sync::atomic::AtomicU64) -> u64 {
    WorkspaceMetrics::get(value)
}

#[tokio::test]
async fn files_written_in_one_sandbox_appear_in_a_new_sandbox_with_the_same_workspace() {
    let fx = fixture().await;
    let (mut first, _, _) = fx
        .create(json!({"workspace_id": "project-1", "workspace_token": TOKEN}))
        .await;
    first
        .stdout_of(
            "bash",
            "mkdir -p /workspace/src/deep && echo hello > /workspace/src/main.py \
         && head -c 300000 /dev/urandom > /workspace/src/deep/blob.bin \
         && echo 'with space' > '/workspace/a file ü.txt' && md5sum /workspace/src/deep/blob.bin",
        )
        .await;
    let blob_md5 = first
        .stdout_of("bash", "md5sum < /workspace/src/deep/blob.bin")
        .await;
    let state = fx.remote_state("project-1").await;
    assert_eq!(state["version"], "1.0");
    assert_eq!(
        paths(&state),
        ["a file ü.txt", "src/deep/blob.bin", "src/main.py"]
    );
    let blob = state["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["path"] == "src/deep/blob.bin")
        .unwrap();
    assert_eq!(blob["size"], 300_000);
    assert_eq!(
        blob["checksum"].as_str().unwrap(),
        blob_md5.split_whitespace().next().unwrap()
    );
    assert_eq!(counter(&fx.metrics().files_uploaded), 3);

    // A brand-new sandbox given the same workspace finds the files.
    let (mut second, _, _) = fx
        .create(json!({"workspace_id": "project-1", "workspace_token": TOKEN}))
        .await;
    assert_eq!(
        second.stdout_of("bash", "cat /workspace/src/main.py").await,
        "hello\n"
    );
    assert_eq!(
        second
            .stdout_of("bash", "md5sum < /workspace/src/deep/blob.bin")
            .await,
        blob_md5
    );
    assert_eq!(
        second
            .stdout_of("bash", "cat '/workspace/a file ü.txt'")
            .await,
        "with space\n"
    );
    assert_eq!(counter(&fx.metrics().files_downloaded), 3);
    // The sandbox's own state file records what it synced.
    let local: Value = serde_json::from_str(
        &second
            .stdout_of("bash", "cat /workspace/.sandbox-state")
            .await,
    )
    .unwrap();
    assert_eq!(paths(&local), paths(&state));

    // Another workspace name starts empty; no workspace means no /workspace sync.
    let (mut other, _, _) = fx
        .create(json!({"workspace_id": "project-2", "workspace_token": TOKEN}))
        .await;
    // (`ls` cannot stat paths under this old runsc: `find` can.)
    assert_eq!(
        other.stdout_of("bash", "find /workspace -mindepth 1").await,
        "/workspace/.sandbox-state\n"
    );
    let (mut plain, _, _) = fx.create(json!({})).await;
    plain
        .stdout_of("bash", "echo x > /workspace/not-synced")
        .await;
    assert_eq!(counter(&fx.metrics().files_uploaded), 3);
}

#[tokio::test]
async fn a_second_sync_of_an_unchanged_tree_uploads_nothing() {
    let fx = fixture().await;
    let (mut ws, _, _) = fx
        .create(json!({"workspace_id": "steady", "workspace_token": TOKEN}))
        .await;
    ws.stdout_of(
        "bash",
        "for i in 1 2 3 4 5; do echo $i > /workspace/f$i; done",
    )
    .await;
    assert_eq!(counter(&fx.metrics().files_uploaded), 5);
    let ops_before = fx.operations();
    let unchanged_before = counter(&fx.metrics().syncs_unchanged);

    // Executions that change nothing in /workspace: no upload, no request.
    ws.stdout_of(
        "bash",
        "cat /workspace/f1 > /dev/null; echo outside > /tmp/x",
    )
    .await;
    ws.stdout_of("bash", "touch /workspace/f2").await; // mtime only: same content
    assert_eq!(counter(&fx.metrics().files_uploaded), 5);
    assert_eq!(counter(&fx.metrics().syncs_unchanged), unchanged_before + 2);
    assert_eq!(
        fx.operations(),
        ops_before,
        "an unchanged sync made storage requests"
    );

    // One changed file: exactly one upload; a copy of existing content: none.
    ws.stdout_of(
        "bash",
        "echo changed > /workspace/f3 && cp /workspace/f1 /workspace/f1-copy",
    )
    .await;
    assert_eq!(counter(&fx.metrics().files_uploaded), 6);
    let state = fx.remote_state("steady").await;
    assert_eq!(paths(&state), ["f1", "f1-copy", "f2", "f3", "f4", "f5"]);
}

#[tokio::test]
async fn a_deleted_file_is_deleted_on_the_other_side() {
    let fx = fixture().await;
    let init =
        json!({"workspace_id": "shared", "workspace_token": TOKEN, "enable_checkpoint": true});
    let (mut a, a_id, a_token) = fx.create(init.clone()).await;
    a.stdout_of(
        "bash",
        "echo keep > /workspace/keep && mkdir /workspace/d && echo bye > /workspace/d/gone",
    )
    .await;
    // A leaves (checkpointed with both files in its image).
    a.send(json!({"action": "checkpoint"})).await;
    assert_eq!(a.until_close().await.last().unwrap(), "close:1000");

    // B deletes one of them: the bucket's state drops it and its content goes.
    let (mut b, _, _) = fx
        .create(json!({"workspace_id": "shared", "workspace_token": TOKEN}))
        .await;
    b.stdout_of("bash", "rm /workspace/d/gone && rmdir /workspace/d")
        .await;
    assert_eq!(paths(&fx.remote_state("shared").await), ["keep"]);
    let contents = fx
        .workspaces
        .list_all(&format!(
            "workspaces/{}/files/",
            owned_path(TOKEN, "shared")
        ))
        .await
        .unwrap();
    assert_eq!(
        contents.len(),
        1,
        "the deleted file's content was not released: {contents:?}"
    );

    // A comes back from its checkpoint (which still holds the file): the cold
    // start sync deletes it there too, and keeps the other.
    let mut a = fx.server.attach(&a_id, &a_token).await;
    a.until_status("SANDBOX_RUNNING").await;
    assert_eq!(
        a.stdout_of(
            "bash",
            "find /workspace -mindepth 1 -not -name .sandbox-state"
        )
        .await,
        "/workspace/keep\n"
    );
    assert!(counter(&fx.metrics().files_deleted) >= 1);
}

#[tokio::test]
async fn symlinks_escaping_the_workspace_and_oversized_or_bad_state_are_refused() {
    let fx = fixture().await;
    let (mut ws, _, _) = fx
        .create(json!({"workspace_id": "safety", "workspace_token": TOKEN}))
        .await;
    ws.stdout_of("bash",
        "ln -s /etc/passwd /workspace/passwd && ln -s / /workspace/root && echo ok > /workspace/real",
    )
    .await;
    assert_eq!(paths(&fx.remote_state("safety").await), ["real"]);
    assert!(counter(&fx.metrics().files_refused) >= 2);

    // An operator (or anything) writes a state that points outside: the
    // cold start fails with a clear error, and nothing is changed.
    let evil = json!({"version": "1.0", "last_synced_at": 1, "files": [
        {"path": "../../etc/cron.d/x", "checksum": "d41d8cd98f00b204e9800998ecf8427e", "size": 0, "modified_at": 1}
    ]});
    fx.write_state("evil", &evil).await;
    let frames = fx
        .create_frames(json!({"workspace_id": "evil", "workspace_token": TOKEN}))
        .await;
    assert!(
        frames.contains(&"SANDBOX_CREATION_ERROR".to_owned()),
        "{frames:?}"
    );
    assert!(
        frames
            .iter()
            .any(|f| f.contains("invalid") && f.contains("/evil/sandbox-state")),
        "{frames:?}"
    );
    let bad_md5 = json!({"version": "1.0", "last_synced_at": 1, "files": [
        {"path": "x", "checksum": "not-an-md5", "size": 0, "modified_at": 1}
    ]});
    fx.write_state("evil", &bad_md5).await;
    let frames = fx
        .create_frames(json!({"workspace_id": "evil", "workspace_token": TOKEN}))
        .await;
    assert!(frames.iter().any(|f| f.contains("(an MD5)")), "{frames:?}");
    assert!(counter(&fx.metrics().cold_start_failures) >= 2);

    // Bad options are refused before anything is created.
    for (init, needle) in [
        (
            json!({"workspace_id": "../x", "workspace_token": TOKEN}),
            "invalid workspace_id",
        ),
        (
            json!({"workspace_id": "ok", "workspace_token": TOKEN, "workspace_template": "nope"}),
            "unknown workspace_template",
        ),
        (
            json!({"workspace_template": "default"}),
            "workspace_template",
        ),
        (
            json!({"enable_workspace_sync": "yes"}),
            "enable_workspace_sync",
        ),
    ] {
        let frames = fx.create_frames(init.clone()).await;
        assert!(
            frames.iter().any(|f| f.contains(needle)),
            "{init}: {frames:?}"
        );
    }
}

#[tokio::test]
async fn enable_workspace_sync_without_a_name_uses_the_sandbox_id() {
    let fx = fixture().await;
    let (mut ws, id, token) = fx.create(json!({"enable_workspace_sync": true})).await;
    ws.stdout_of("bash", "echo mine > /workspace/f").await;
    assert_eq!(
        paths(&fx.remote_state_at(&owned_path(&token, &id)).await),
        ["f"]
    );
    // The sandbox token opens it by name, as a workspace token.
    let (mut again, _, _) = fx
        .create(json!({"workspace_id": id, "workspace_token": token}))
        .await;
    assert_eq!(again.stdout_of("bash", "cat /workspace/f").await, "mine\n");
}

#[tokio::test]
async fn size_limits_leave_large_files_out_and_a_failed_sync_is_counted_not_fatal() {
    let fx = fixture().await;
    let (mut ws, _, _) = fx
        .create(json!({"workspace_id": "limits", "workspace_token": TOKEN}))
        .await;
    ws.stdout_of(
        "bash",
        "head -c 2000000 /dev/zero > /workspace/too-big && echo small > /workspace/small",
    )
    .await;
    assert_eq!(paths(&fx.remote_state("limits").await), ["small"]);
    assert!(counter(&fx.metrics().files_refused) >= 1);

    // Over the workspace limit: the sync fails and the client hears it
    // before DONE (an execution error: the clients end the process with
    // it, so nobody takes DONE for "stored"); the failure is counted and
    // the bucket keeps its last state.
    let frames = ws
        .exec(
            "bash",
            "for i in 1 2 3 4 5; do head -c 900000 /dev/urandom > /workspace/part$i; done; echo written",
        )
        .await;
    assert!(
        frames.contains(&"stdout:written\n".to_owned()),
        "{frames:?}"
    );
    assert_eq!(frames.last().unwrap(), "SANDBOX_EXECUTION_DONE");
    let error = frames
        .iter()
        .position(|f| f == "SANDBOX_EXECUTION_ERROR")
        .unwrap_or_else(|| panic!("no execution error before DONE: {frames:?}"));
    assert!(
        frames[error + 1].starts_with("error:syncing workspace \"limits\" to the store failed")
            && frames[error + 1].contains("not stored"),
        "{frames:?}"
    );
    assert_eq!(counter(&fx.metrics().after_exec_failures), 1);
    assert_eq!(paths(&fx.remote_state("limits").await), ["small"]);

    // Back under the limit: the next execution's sync succeeds.
    ws.stdout_of("bash", "rm /workspace/part4 /workspace/part5")
        .await;
    assert_eq!(
        paths(&fx.remote_state("limits").await),
        ["part1", "part2", "part3", "small"]
    );
}

#[tokio::test]
async fn a_sync_up_never_removes_what_this_sandbox_did_not_delete() {
    let fx = fixture().await;
    let (mut first, _, _) = fx
        .create(json!({"workspace_id": "keep", "workspace_token": TOKEN}))
        .await;
    first
        .stdout_of("bash", "echo a > /workspace/a && echo b > /workspace/b")
        .await;

    // An upload-only sandbox never fetched them: its syncs must not delete them.
    let (mut writer, _, _) = fx
        .create(json!({"workspace_id": "keep", "workspace_token": TOKEN, "workspace_template": "upload-only"}))
        .await;
    assert_eq!(
        writer.stdout_of("bash", "find /workspace -name a").await,
        ""
    );
    writer.stdout_of("bash", "echo c > /workspace/c").await;
    assert_eq!(paths(&fx.remote_state("keep").await), ["a", "b", "c"]);

    // A file the scan leaves out (grown past the file limit) is not a deletion:
    // the stored version stays.
    first
        .stdout_of("bash", "head -c 2000000 /dev/zero >> /workspace/b")
        .await;
    assert_eq!(paths(&fx.remote_state("keep").await), ["a", "b", "c"]);
    let (mut reader, _, _) = fx
        .create(json!({"workspace_id": "keep", "workspace_token": TOKEN}))
        .await;
    assert_eq!(reader.stdout_of("bash", "cat /workspace/b").await, "b\n");
}

#[tokio::test]
async fn a_restore_follows_a_file_that_became_a_directory() {
    let fx = fixture().await;
    let init =
        json!({"workspace_id": "shape", "workspace_token": TOKEN, "enable_checkpoint": true});
    let (mut a, a_id, a_token) = fx.create(init).await;
    a.stdout_of("bash", "echo file > /workspace/x").await;
    a.send(json!({"action": "checkpoint"})).await;
    assert_eq!(a.until_close().await.last().unwrap(), "close:1000");

    let (mut b, _, _) = fx
        .create(json!({"workspace_id": "shape", "workspace_token": TOKEN}))
        .await;
    b.stdout_of(
        "bash",
        "rm /workspace/x && mkdir /workspace/x && echo inside > /workspace/x/y",
    )
    .await;
    assert_eq!(paths(&fx.remote_state("shape").await), ["x/y"]);

    let mut a = fx.server.attach(&a_id, &a_token).await;
    let frames = a.until_status("SANDBOX_RUNNING").await;
    assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
    assert_eq!(a.stdout_of("bash", "cat /workspace/x/y").await, "inside\n");
}

#[tokio::test]
async fn a_named_workspace_is_scoped_by_its_token_and_a_wrong_token_finds_no_workspace() {
    let fx = fixture().await;
    let (mut owner, _, _) = fx
        .create(json!({"workspace_id": "team-main", "workspace_token": TOKEN}))
        .await;
    owner.stdout_of("bash", "echo secret > /workspace/s").await;

    // Another tenant naming the same workspace with its own token is not
    // refused: it gets a workspace of its own, empty, and learns nothing.
    let other_token = "someone-else-entirely";
    let (mut other, _, _) = fx
        .create(json!({"workspace_id": "team-main", "workspace_token": other_token}))
        .await;
    assert_eq!(other.stdout_of("bash", "ls /workspace").await, "");
    other.stdout_of("bash", "echo theirs > /workspace/t").await;
    assert_eq!(owner.stdout_of("bash", "ls /workspace").await, "s\n");
    assert_eq!(paths(&fx.remote_state("team-main").await), ["s"]);
    assert_eq!(
        paths(
            &fx.remote_state_at(&owned_path(other_token, "team-main"))
                .await
        ),
        ["t"]
    );
    let (mut again, _, _) = fx
        .create(json!({"workspace_id": "team-main", "workspace_token": TOKEN}))
        .await;
    assert_eq!(
        again.stdout_of("bash", "cat /workspace/s").await,
        "secret\n"
    );

    // The bucket holds no token, and no owner record.
    let listed = fx.workspaces.list_all("workspaces/").await.unwrap();
    for object in &listed {
        let key = object.key.as_str();
        assert!(!key.contains(TOKEN) && !key.contains(other_token), "{key}");
        assert!(!key.ends_with("owner.json"), "{key}");
    }

    // Still refused: no token, a short one.
    for init in [
        json!({"workspace_id": "team-main"}),
        json!({"workspace_id": "team-main", "workspace_token": "short"}),
    ] {
        let frames = fx.create_frames(init.clone()).await;
        assert!(
            frames.contains(&"SANDBOX_CREATION_ERROR".to_owned()),
            "{init}: {frames:?}"
        );
        assert!(
            frames.iter().any(|f| f.contains("workspace_token")),
            "{init}: {frames:?}"
        );
    }
}

#[tokio::test]
async fn a_workspace_of_the_earlier_layout_stays_its_owners() {
    let fx = fixture().await;
    // What the earlier server left: `workspaces/legacy/` and its owner record.
    let (mut seed, _, _) = fx
        .create(json!({"workspace_id": "seed", "workspace_token": TOKEN}))
        .await;
    seed.stdout_of("bash", "echo old > /workspace/o").await;
    let seeded = fx.workspaces.list_all("workspaces/").await.unwrap();
    for object in &seeded {
        let key = object.key.as_str();
        let suffix = key.rsplit_once("/seed/").unwrap().1;
        let data = fx.workspaces.get(&object.key).await.unwrap().data;
        let legacy = ObjectKey::new(format!("workspaces/legacy/{suffix}")).unwrap();
        fx.workspaces
            .put(&legacy, data, controllers::store::PutMode::Overwrite)
            .await
            .unwrap();
    }
    let owner = json!({"token_sha256": sandboxd::token::digest(TOKEN)});
    fx.workspaces
        .put(
            &ObjectKey::new("workspaces/legacy/owner.json").unwrap(),
            owner.to_string().into(),
            controllers::store::PutMode::Create,
        )
        .await
        .unwrap();

    let (mut owner, _, _) = fx
        .create(json!({"workspace_id": "legacy", "workspace_token": TOKEN}))
        .await;
    assert_eq!(owner.stdout_of("bash", "cat /workspace/o").await, "old\n");
    owner.stdout_of("bash", "echo new > /workspace/n").await;
    assert_eq!(paths(&fx.remote_state_at("legacy").await), ["n", "o"]);

    let (mut other, _, _) = fx
        .create(json!({"workspace_id": "legacy", "workspace_token": "someone-else-entirely"}))
        .await;
    assert_eq!(other.stdout_of("bash", "ls /workspace").await, "");
}
