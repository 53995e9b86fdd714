//! Several real `sandboxd` processes sharing one bucket on fake-gcs-server,
//! each with its own runsc: sandboxes move between them on attach, survive a
//! crash (from the last checkpoint) and a SIGTERM (drained), and follow an
//! operator's edit of the bucket's JSON.

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::process::{Launch, ServerProcess};

const CHECKPOINTABLE: &str =
    r#"{"idle_timeout": 300, "enable_checkpoint": true, "enable_sandbox_handoff": true}"#;

fn init() -> Value {
    serde_json::from_str(CHECKPOINTABLE).unwrap()
}

async fn servers(names: &[&str]) -> (tempfile::TempDir, String, Vec<ServerProcess>) {
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let mut started = Vec::new();
    for name in names {
        started.push(
            Launch::new(name, dir.path())
                .on_bucket(&bucket)
                .fast_leases()
                .start()
                .await,
        );
    }
    (dir, bucket, started)
}

async fn read_object(bucket: &str, key: &str) -> String {
    support::get_text(format!("{}?alt=media", support::object_url(bucket, key))).await
}

/// An operator's overwrite through the emulator's HTTP API (no precondition).
async fn write_object(bucket: &str, key: &str, body: String) {
    let response = testkit::http_client()
        .post(format!(
            "{}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={key}",
            support::emulator().endpoint()
        ))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success(), "{}", response.status());
}

// The counter replaces its file atomically: a reader never sees it half-written.
const START_COUNTER: &str = "setsid nohup bash -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 0.1; done' >/dev/null 2>&1 </dev/null & echo started";

#[tokio::test]
async fn an_attach_on_another_instance_moves_files_processes_and_memory() {
    let (_dir, _bucket, servers) = servers(&["e2e-a", "e2e-b"]).await;
    let (a, b) = (&servers[0], &servers[1]);
    let (mut ws, id, token) = a.create(init()).await;
    ws.exec("bash", "echo moved > /tmp/file").await;
    assert_eq!(ws.stdout_of("bash", START_COUNTER).await, "started\n");
    ws.session_stdout("answer = 41").await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    drop(ws);

    let started = Instant::now();
    let mut ws = b.attach(&id, &token).await;
    let frames = ws.until_status("SANDBOX_RUNNING").await;
    let took = started.elapsed();
    assert_eq!(
        frames,
        [
            "SANDBOX_RESTORING",
            "SANDBOX_LOCK_ACQUIRING",
            "SANDBOX_LOCK_ACQUIRED",
            "SANDBOX_RUNNING"
        ]
    );
    eprintln!("handoff A -> B took {took:?}");
    assert_eq!(ws.stdout_of("bash", "cat /tmp/file").await, "moved\n");
    assert_eq!(ws.session_stdout("print(answer + 1)").await, "42\n");
    let first: u64 = ws
        .stdout_of("bash", "cat /tmp/counter")
        .await
        .trim()
        .parse()
        .unwrap();
    // Polled, not timed: a loaded host may run the 0.1 s loop late.
    let deadline = Instant::now() + Duration::from_secs(10);
    let second = loop {
        let second: u64 = ws
            .stdout_of("bash", "cat /tmp/counter")
            .await
            .trim()
            .parse()
            .unwrap();
        if second > first || Instant::now() > deadline {
            break second;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        first > 0 && second > first,
        "the counter kept counting: {first} then {second}"
    );

    // And back to A, with A's old client still attached on B this time: it is
    // told the contract's handoff sequence and closed.
    let mut back = a.attach(&id, &token).await;
    let old = ws.until_close().await;
    assert_eq!(
        old,
        [
            "SANDBOX_LOCK_RELEASE_REQUESTED",
            "SANDBOX_CHECKPOINTING",
            "SANDBOX_DELETING",
            "SANDBOX_LOCK_RELEASING",
            "SANDBOX_LOCK_RELEASED",
            "SANDBOX_DELETED",
            "SANDBOX_CHECKPOINTED",
            "close:1000"
        ]
    );
    assert_eq!(
        back.until_status("SANDBOX_RUNNING").await.last().unwrap(),
        "SANDBOX_RUNNING"
    );
    assert_eq!(back.session_stdout("print(answer)").await, "41\n");
}

#[tokio::test]
async fn after_a_crash_the_other_instance_restores_the_last_checkpoint() {
    let (_dir, bucket, mut servers) = servers(&["crash-a", "crash-b"]).await;
    let (mut ws, id, token) = servers[0].create(init()).await;
    ws.exec("bash", "echo v1 > /tmp/v").await;
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");
    let mut ws = servers[0].attach(&id, &token).await;
    ws.until_status("SANDBOX_RUNNING").await;
    ws.exec("bash", "echo v2 > /tmp/v").await;
    // A second sandbox that never had a checkpoint.
    let (_plain_ws, plain_id, plain_token) = servers[0].create(init()).await;

    servers[0].signal("-KILL");
    // The dead holder's lease is still in the bucket: B must wait it out.
    let lock = |bucket: String, id: String| async move {
        serde_json::from_str::<Value>(
            &read_object(&bucket, &format!("sandboxes/{id}/lock.json")).await,
        )
        .unwrap()
    };
    let before = lock(bucket.clone(), id.clone()).await;
    assert_eq!(before["holder"], "crash-a", "{before}");
    let b = &servers[1];
    let mut ws = b.attach(&id, &token).await;
    let frames = ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
    let after = lock(bucket.clone(), id.clone()).await;
    assert_eq!(after["holder"], "crash-b");
    assert_eq!(
        after["epoch"].as_u64(),
        before["epoch"].as_u64().map(|e| e + 1),
        "taken over, not shared"
    );
    let acquired =
        chrono::DateTime::parse_from_rfc3339(after["acquired_at"].as_str().unwrap()).unwrap();
    let renewed =
        chrono::DateTime::parse_from_rfc3339(before["renewed_at"].as_str().unwrap()).unwrap();
    assert!(
        acquired >= renewed + chrono::Duration::seconds(6),
        "acquired only after the dead holder's lease expired ({renewed} + 6 s): {acquired}"
    );
    assert_eq!(ws.stdout_of("bash", "cat /tmp/v").await, "v1\n");

    let mut plain = b.attach(&plain_id, &plain_token).await;
    let frames = plain.until_close().await;
    assert_eq!(frames[0], "SANDBOX_RESTORING");
    assert!(
        frames.contains(&"SANDBOX_RESTORE_ERROR".to_owned()),
        "{frames:?}"
    );
    assert!(
        frames
            .iter()
            .any(|f| f.contains("no checkpoint to restore")),
        "{frames:?}"
    );
}

#[tokio::test]
async fn sigterm_drains_to_a_checkpoint_the_other_instance_restores_at_once() {
    let (_dir, bucket, mut servers) = servers(&["term-a", "term-b"]).await;
    let (mut ws, id, token) = servers[0].create(init()).await;
    ws.exec("bash", "echo drained > /tmp/d").await;
    servers[0].signal("-TERM");
    assert!(
        ws.until_close()
            .await
            .contains(&"SANDBOX_CHECKPOINTED".to_owned())
    );

    // Drained means released: no lease to wait out.
    let lock: Value =
        serde_json::from_str(&read_object(&bucket, &format!("sandboxes/{id}/lock.json")).await)
            .unwrap();
    assert_eq!(lock["holder"], Value::Null, "released at shutdown: {lock}");
    let mut ws = servers[1].attach(&id, &token).await;
    ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(ws.stdout_of("bash", "cat /tmp/d").await, "drained\n");
}

/// As above with the client gone before the SIGTERM: no session waits for CHECKPOINTED, so the
/// process exits once the drain returns, which must be after the checkpoint's hand-back landed.
/// (The drain once returned as soon as the local sandbox was gone, before that lock write, which
/// the exit cut off: the other instance took the lock over with nothing to restore.)
#[tokio::test]
async fn sigterm_with_its_client_gone_exits_only_after_the_hand_back_landed() {
    let (_dir, bucket, mut servers) = servers(&["gone-a", "gone-b"]).await;
    let (mut ws, id, token) = servers[0].create(init()).await;
    ws.exec("bash", "echo drained > /tmp/d").await;
    ws.close().await;
    servers[0].signal("-TERM");
    let lock: Value =
        serde_json::from_str(&read_object(&bucket, &format!("sandboxes/{id}/lock.json")).await)
            .unwrap();
    assert_eq!(lock["holder"], Value::Null, "released at shutdown: {lock}");
    assert!(
        lock["checkpoint"].is_object(),
        "handed back with its checkpoint: {lock}"
    );
    let mut ws = servers[1].attach(&id, &token).await;
    ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(ws.stdout_of("bash", "cat /tmp/d").await, "drained\n");
}

#[tokio::test]
async fn an_operator_edit_in_the_bucket_takes_effect_and_bad_json_is_left_alone() {
    let (_dir, bucket, servers) = servers(&["ops-a"]).await;
    let a = &servers[0];
    let (mut ws, id, token) = a.create(init()).await;
    ws.exec("bash", "echo kept > /tmp/k").await;
    let key = format!("sandboxes/{id}/metadata.json");

    // Invalid JSON: reported, never overwritten, the sandbox keeps running.
    let broken =
        "{\"apiVersion\": \"sandboxd.dev/v1\", \"spec\": {\"desired_state\": \"runing\"".to_owned();
    let original = read_object(&bucket, &key).await;
    write_object(&bucket, &key, broken.clone()).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        read_object(&bucket, &key).await,
        broken,
        "the operator's text stays"
    );
    assert_eq!(ws.stdout_of("bash", "cat /tmp/k").await, "kept\n");

    // A valid edit: desired_state checkpointed.
    let mut metadata: Value = serde_json::from_str(&original).unwrap();
    metadata["spec"]["desired_state"] = json!("checkpointed");
    write_object(
        &bucket,
        &key,
        serde_json::to_string_pretty(&metadata).unwrap(),
    )
    .await;
    let frames = ws.until_close().await;
    assert!(
        frames.contains(&"SANDBOX_CHECKPOINTED".to_owned()),
        "{frames:?}"
    );
    let stored: Value = support::eventually(
        || async { serde_json::from_str(&read_object(&bucket, &key).await).unwrap() },
        |stored: &Value| stored["status"]["phase"] == "Checkpointed",
    )
    .await;
    assert_eq!(stored["status"]["phase"], "Checkpointed");

    let mut ws = a.attach(&id, &token).await;
    ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(ws.stdout_of("bash", "cat /tmp/k").await, "kept\n");
}

#[tokio::test]
async fn a_running_execution_is_force_killed_by_a_handoff_and_reported() {
    let (_dir, _bucket, servers) = servers(&["kill-a", "kill-b"]).await;
    let (mut ws, id, token) = servers[0].create(init()).await;
    ws.send(json!({"language": "bash", "code": "echo begun; sleep 600"}))
        .await;
    assert_eq!(
        ws.until(|f| f.starts_with("stdout:")).await,
        ["SANDBOX_EXECUTION_RUNNING", "stdout:begun\n"]
    );
    let mut moved = servers[1].attach(&id, &token).await;
    let old = ws.until_close().await;
    let position = |status: &str| old.iter().position(|f| f == status).unwrap_or(usize::MAX);
    assert!(
        position("SANDBOX_LOCK_RELEASE_REQUESTED") < position("SANDBOX_EXECUTION_FORCE_KILLED")
            && position("SANDBOX_EXECUTION_FORCE_KILLED") < position("SANDBOX_EXECUTION_DONE")
            && position("SANDBOX_EXECUTION_DONE") < position("SANDBOX_CHECKPOINTED"),
        "{old:?}"
    );
    assert_eq!(
        moved.until_status("SANDBOX_RUNNING").await.last().unwrap(),
        "SANDBOX_RUNNING"
    );
}

#[tokio::test]
async fn with_periodic_checkpoints_a_crash_loses_at_most_one_interval() {
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let mut a = Launch::new("periodic-a", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .with_args(&["--checkpoint-interval-s", "2"])
        .start()
        .await;
    let b = Launch::new("periodic-b", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .start()
        .await;
    let (mut ws, id, token) = a.create(init()).await;
    ws.exec("bash", "echo periodic > /tmp/p").await;
    ws.session_stdout("kept = 'memory too'").await;
    // A checkpoint made after this holds the file and the variable: none
    // overlaps an execution (a periodic one is skipped during one).
    let since = chrono::Utc::now();
    let key = format!("sandboxes/{id}/metadata.json");
    let deadline = Instant::now() + Duration::from_secs(60);
    let recorded = loop {
        let metadata: Value = serde_json::from_str(&read_object(&bucket, &key).await).unwrap();
        let recorded = metadata["status"]["latest_checkpoint"]["created_at"]
            .as_str()
            .and_then(|at| chrono::DateTime::parse_from_rfc3339(at).ok())
            .map(|at| at.with_timezone(&chrono::Utc));
        if recorded.is_some_and(|at| at > since) || Instant::now() > deadline {
            break recorded;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        recorded.is_some_and(|at| at > since),
        "no periodic checkpoint recorded after {since} (the latest: {recorded:?})"
    );
    assert_eq!(
        ws.stdout_of("bash", "cat /tmp/p").await,
        "periodic\n",
        "still serving"
    );
    a.signal("-KILL");

    let mut ws = b.attach(&id, &token).await;
    let frames = ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
    assert_eq!(ws.stdout_of("bash", "cat /tmp/p").await, "periodic\n");
    assert_eq!(ws.session_stdout("print(kept)").await, "memory too\n");
}

#[tokio::test]
async fn after_a_crash_between_checkpoints_the_workspace_has_the_last_finished_executions_files() {
    let (_dir, bucket, mut servers) = servers(&["wcrash-a", "wcrash-b"]).await;
    let mut init = init();
    init["workspace_id"] = json!("crash-proof");
    init["workspace_token"] = json!("crash-proof-token-0123456789");
    let (mut ws, id, token) = servers[0].create(init).await;
    ws.exec("bash", "echo v1 > /workspace/v && echo v1 > /tmp/v")
        .await;
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");
    let mut ws = servers[0].attach(&id, &token).await;
    ws.until_status("SANDBOX_RUNNING").await;
    // Finished after the checkpoint, then the instance dies without another.
    ws.exec(
        "bash",
        "echo v2 > /workspace/v && echo v2 > /tmp/v && mkdir -p /workspace/out && echo new > /workspace/out/result",
    )
    .await;
    let path =
        sandboxd::workspace::owner::owned_path("crash-proof-token-0123456789", "crash-proof");
    let state: Value = serde_json::from_str(
        &read_object(&bucket, &format!("workspaces/{path}/sandbox-state")).await,
    )
    .unwrap();
    assert_eq!(state["files"].as_array().unwrap().len(), 2, "{state}");
    servers[0].signal("-KILL");

    let mut ws = servers[1].attach(&id, &token).await;
    let frames = ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
    // The checkpoint's memory and /tmp are from before; /workspace is not.
    assert_eq!(ws.stdout_of("bash", "cat /tmp/v").await, "v1\n");
    assert_eq!(
        ws.stdout_of("bash", "cat /workspace/v /workspace/out/result")
            .await,
        "v2\nnew\n"
    );
}
