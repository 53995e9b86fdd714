//! This release beside the previous one on one bucket, as Cloud Run runs the
//! old and the new revision side by side during a deploy: a sandbox moves
//! from each to the other with its files and memory, and one that the other
//! release held and checkpointed is taken over after that release crashed.
//! The previous release's `sandboxd` comes from
//! `scripts/build-previous-release.sh` (built once per release, cached outside
//! the clone; `scripts/test.sh` builds it ahead, `SANDBOXD_PREVIOUS_RELEASE`
//! names it).

use crate::support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::process::{Launch, ServerProcess};

fn init() -> Value {
    json!({"idle_timeout": 300, "enable_checkpoint": true, "enable_sandbox_handoff": true})
}

/// The previous release's server binary: `SANDBOXD_PREVIOUS_RELEASE`, else
/// what the script builds (minutes the first time, cached after).
async fn previous_release() -> String {
    if let Ok(path) = std::env::var("SANDBOXD_PREVIOUS_RELEASE") {
        return path;
    }
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/build-previous-release.sh"
    );
    let built = tokio::process::Command::new(script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .await
        .unwrap();
    assert!(built.status.success(), "{script} failed");
    String::from_utf8(built.stdout).unwrap().trim().to_owned()
}

/// Two servers on one new bucket: the previous release's, then this one's.
async fn previous_and_this(
    periodic: Option<&str>,
) -> (tempfile::TempDir, String, ServerProcess, ServerProcess) {
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let mut previous = Launch::new("previous", dir.path())
        .on_bucket(&bucket)
        .fast_leases();
    previous.binary = previous_release().await.into();
    if let Some(seconds) = periodic {
        previous = previous.with_args(&["--checkpoint-interval-s", seconds]);
    }
    let previous = previous.start().await;
    let this = Launch::new("this", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .start()
        .await;
    (dir, bucket, previous, this)
}

/// Attaches on `to` and waits for RUNNING: the sandbox moved there.
async fn moved_to(to: &ServerProcess, id: &str, token: &str) -> support::ws::Ws {
    let mut ws = to.attach(id, token).await;
    let frames = ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
    ws
}

#[tokio::test]
async fn a_sandbox_moves_each_way_between_the_previous_release_and_this_one() {
    let (_dir, _bucket, previous, this) = previous_and_this(None).await;
    let (mut ws, id, token) = previous.create(init()).await;
    ws.exec("bash", "echo from-previous > /tmp/f").await;
    ws.session_stdout("kept = ['previous']").await;
    drop(ws);

    let mut ws = moved_to(&this, &id, &token).await;
    assert_eq!(ws.stdout_of("bash", "cat /tmp/f").await, "from-previous\n");
    ws.session_stdout("kept.append('this')").await;
    drop(ws);

    let mut ws = moved_to(&previous, &id, &token).await;
    assert_eq!(
        ws.session_stdout("print(kept)").await,
        "['previous', 'this']\n"
    );
    drop(ws);

    // Created here this time, and over to the previous release.
    let (mut ws, id, token) = this.create(init()).await;
    ws.exec("bash", "echo from-this > /tmp/f").await;
    drop(ws);
    let mut ws = moved_to(&previous, &id, &token).await;
    assert_eq!(ws.stdout_of("bash", "cat /tmp/f").await, "from-this\n");
}

/// This release hands a sandbox to the previous one (the lock names the
/// checkpoint its new hold took over, a field the previous release keeps
/// unread); that release then records a periodic checkpoint of its own and
/// crashes. This release takes over from that checkpoint: a record of the
/// lock's own epoch always counts.
#[tokio::test]
async fn a_crash_of_the_previous_release_is_taken_over_from_its_last_checkpoint() {
    let (_dir, bucket, mut previous, this) = previous_and_this(Some("2")).await;
    let (ws, id, token) = this.create(init()).await;
    drop(ws);
    let mut ws = moved_to(&previous, &id, &token).await;
    ws.exec("bash", "echo after-the-move > /tmp/p").await;
    let since = chrono::Utc::now();
    let key = format!("sandboxes/{id}/metadata.json");
    let url = format!("{}?alt=media", support::object_url(&bucket, &key));
    let deadline = Instant::now() + Duration::from_secs(60);
    let recorded = loop {
        let metadata: Value = serde_json::from_str(&support::get_text(url.as_str()).await).unwrap();
        let recorded = metadata["status"]["latest_checkpoint"]["created_at"]
            .as_str()
            .and_then(|at| chrono::DateTime::parse_from_rfc3339(at).ok())
            .is_some_and(|at| at > since);
        if recorded || Instant::now() > deadline {
            break recorded;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(
        recorded,
        "the previous release recorded no periodic checkpoint after {since}"
    );
    previous.signal("-KILL");

    let mut ws = moved_to(&this, &id, &token).await;
    assert_eq!(ws.stdout_of("bash", "cat /tmp/p").await, "after-the-move\n");
}
