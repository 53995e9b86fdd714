//! Fault tests with real processes: the holder is killed (the process aborts
//! at a failpoint, as a crash would) at each step of a handoff. The attaching
//! instance waits out the lease and restores the last recorded checkpoint:
//! nothing acknowledged is lost, nothing half-written is used. Also: the
//! storage emulator killed and restarted mid-run.

use crate::support;

use std::time::Duration;

use serde_json::{Value, json};
use support::process::Launch;

fn init() -> Value {
    json!({"idle_timeout": 300, "enable_checkpoint": true, "enable_sandbox_handoff": true})
}

/// A holds a sandbox whose last checkpoint has /tmp/v = v1 and whose live
/// state has v2; its client leaves and a client attaches on B. A dies at
/// `failpoint`. Returns what B's restored sandbox has in /tmp/v.
async fn crash_during_handoff(failpoint: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let mut a = Launch::new("fault-a", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .with_args(&["--failpoint", failpoint])
        .start()
        .await;
    let b = Launch::new("fault-b", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .start()
        .await;
    let (mut ws, id, token) = a.create(init()).await;
    ws.exec("bash", "echo v1 > /tmp/v").await;
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");
    let mut ws = a.attach(&id, &token).await;
    // Asserted: an attach that ended in an error and a close showed only as
    // the next send's `SendAfterClosing` (docs/security.md).
    let frames = ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(
        frames.last().unwrap(),
        "SANDBOX_RUNNING",
        "{failpoint}: {frames:?}"
    );
    ws.exec("bash", "echo v2 > /tmp/v").await;
    ws.close().await;

    let mut moved = b.attach(&id, &token).await;
    let frames = moved.until_status("SANDBOX_RUNNING").await;
    assert_eq!(
        frames.last().unwrap(),
        "SANDBOX_RUNNING",
        "{failpoint}: {frames:?}"
    );
    let status = a.child.wait().unwrap();
    assert!(!status.success(), "{failpoint}: A aborted ({status})");
    let out = moved.exec("bash", "cat /tmp/v").await;
    out.iter()
        .find_map(|f| f.strip_prefix("stdout:"))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

#[tokio::test]
async fn holder_dies_before_checkpointing() {
    assert_eq!(
        crash_during_handoff("handoff:before-checkpoint").await,
        "v1"
    );
}

#[tokio::test]
async fn holder_dies_after_uploading_before_recording() {
    // The new image exists but was never recorded: the last recorded one is used.
    assert_eq!(crash_during_handoff("handoff:after-upload").await, "v1");
}

#[tokio::test]
async fn holder_dies_after_recording_before_releasing() {
    // Recorded means acknowledged: the new state survives; B only waits out the lease.
    assert_eq!(crash_during_handoff("handoff:after-record").await, "v2");
}

#[tokio::test]
async fn the_storage_emulator_restarting_mid_run_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut emulator = support::disk_emulator::DiskEmulator::start(&dir.path().join("gcs")).await;
    let endpoint = format!("http://{}", emulator.host);
    let created = testkit::http_client()
        .post(format!("{endpoint}/storage/v1/b?project=test"))
        .json(&json!({"name": "faults"}))
        .send()
        .await
        .unwrap();
    assert!(created.status().is_success());
    let mut launch = Launch::new("outage", dir.path()).fast_leases();
    for variable in [
        "SANDBOX_METADATA_BUCKET",
        "SANDBOX_CHECKPOINT_BUCKET",
        "FILESYSTEM_SNAPSHOT_BUCKET",
    ] {
        launch.env.push((variable.into(), "faults".into()));
    }
    launch
        .env
        .push(("STORAGE_EMULATOR_HOST".into(), endpoint.clone()));
    let server = launch.start().await;

    // A held sandbox with its client attached survives a short outage (under
    // the lease): renewals fail, are retried, and succeed once storage is back.
    let (mut ws, id, token) = server.create(init()).await;
    ws.exec("bash", "echo kept > /tmp/k").await;
    emulator.kill().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    emulator.restart();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let frames = ws.exec("bash", "cat /tmp/k").await;
    assert_eq!(frames[1], "stdout:kept\n", "{frames:?}");

    // A checkpoint taken before the outage is intact after it; an attach
    // during the outage gets a clear error, not a hang or a crash.
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");
    emulator.kill().await;
    let mut during = server.attach(&id, &token).await;
    let frames = during.until_close().await;
    assert!(
        frames.iter().any(|f| f == "SANDBOX_RESTORE_ERROR"),
        "{frames:?}"
    );
    emulator.restart();
    let mut after = server.attach(&id, &token).await;
    let frames = after.until_status("SANDBOX_RUNNING").await;
    assert_eq!(
        frames.last().map(String::as_str),
        Some("SANDBOX_RUNNING"),
        "{frames:?}"
    );
    let frames = after.exec("bash", "cat /tmp/k").await;
    assert_eq!(frames[1], "stdout:kept\n");
}
