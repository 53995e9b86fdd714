//! Executions that survive a move (decision 12): two real
//! `sandboxd` on fake-gcs-server, a Python loop moved from A to B by an
//! attach while A's client is still connected, then from B back to A by a
//! SIGTERM drain of B. The clients together get every number once, in order,
//! and the exit code. An operator's eviction keeps the execution paused in
//! the stored checkpoint until the next attach.

use crate::support;

use serde_json::{Value, json};
use support::process::{Launch, ServerProcess};
use support::ws::Ws;

const COUNT: u32 = 600;
const LOOP: &str = "import time\nfor i in range(1, 601):\n    print(i)\n    time.sleep(0.05)\n";

fn kept_init() -> Value {
    json!({
        "idle_timeout": 300,
        "enable_checkpoint": true,
        "enable_sandbox_handoff": true,
        "keep_executions": true
    })
}

async fn servers(names: &[&str]) -> (tempfile::TempDir, Vec<ServerProcess>) {
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
    (dir, started)
}

/// What one client saw: its stdout, and its other frames in order.
#[derive(Debug, Default)]
struct Seen {
    stdout: String,
    frames: Vec<String>,
}

impl Seen {
    fn numbers(&self) -> usize {
        self.stdout.matches('\n').count()
    }
}

/// Reads frames into `seen` until `stop` holds for what was seen (or the
/// socket closes); returns whether `stop` held.
async fn read_until(ws: &mut Ws, seen: &mut Seen, stop: impl Fn(&Seen) -> bool) -> bool {
    loop {
        if stop(seen) {
            return true;
        }
        let frame = ws.next().await;
        match frame.strip_prefix("stdout:") {
            Some(text) => seen.stdout.push_str(text),
            None => seen.frames.push(frame.clone()),
        }
        if frame.starts_with("close:") {
            return stop(seen);
        }
    }
}

fn has(seen: &Seen, frame: &str) -> bool {
    seen.frames.iter().any(|f| f == frame)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_running_execution_moves_twice_and_its_output_arrives_exactly_once_in_order() {
    let (dir, mut servers) = servers(&["keep-a", "keep-b"]).await;
    let (mut first, id, token) = servers[0].create(kept_init()).await;
    first
        .send(json!({"language": "python", "code": LOOP}))
        .await;
    let mut on_a = Seen::default();
    read_until(&mut first, &mut on_a, |s| s.numbers() >= 60).await;

    // An attach on B moves the sandbox while A's client still reads.
    let mut second = servers[1].attach(&id, &token).await;
    second.send(json!({"action": "reconnect"})).await;
    read_until(&mut first, &mut on_a, |_| false).await;
    assert!(
        has(&on_a, "SANDBOX_CHECKPOINTED") && has(&on_a, "close:1000"),
        "A's client was not told of the move: {:?}",
        on_a.frames
    );
    for never in ["SANDBOX_EXECUTION_FORCE_KILLED", "SANDBOX_EXECUTION_DONE"] {
        assert!(
            !has(&on_a, never),
            "a kept execution was reported ended on A: {:?}",
            on_a.frames
        );
    }
    let mut on_b = Seen::default();
    read_until(&mut second, &mut on_b, |s| {
        s.numbers() >= 240 || has(s, "SANDBOX_EXECUTION_DONE")
    })
    .await;
    assert!(
        has(&on_b, "SANDBOX_RUNNING") && has(&on_b, "SANDBOX_EXECUTION_RUNNING"),
        "{:?}",
        on_b.frames
    );
    assert!(
        !has(&on_b, "SANDBOX_EXECUTION_DONE"),
        "the loop ended before the second move could be tried: {:?} after {} numbers on B",
        on_b.frames,
        on_b.numbers()
    );

    // A SIGTERM drains B: the execution is checkpointed with the sandbox
    // (the drain forces the checkpoint) and goes on on A.
    tokio::task::block_in_place(|| servers[1].signal("-TERM"));
    read_until(&mut second, &mut on_b, |_| false).await;
    assert!(
        has(&on_b, "SANDBOX_CHECKPOINTED"),
        "B's client was not told of the drain: {:?}",
        on_b.frames
    );
    assert!(!has(&on_b, "SANDBOX_EXECUTION_DONE"), "{:?}", on_b.frames);

    let mut third = servers[0].attach(&id, &token).await;
    third.send(json!({"action": "reconnect"})).await;
    let mut back_on_a = Seen::default();
    read_until(&mut third, &mut back_on_a, |s| {
        has(s, "SANDBOX_EXECUTION_DONE")
    })
    .await;
    let frames = &back_on_a.frames;
    let exit = frames.iter().position(|f| f == "exit_code:0");
    let done = frames.iter().position(|f| f == "SANDBOX_EXECUTION_DONE");
    assert!(
        exit.is_some() && exit < done,
        "no exit code 0 before DONE: {frames:?}"
    );

    let all = format!("{}{}{}", on_a.stdout, on_b.stdout, back_on_a.stdout);
    let expected: String = (1..=COUNT).map(|i| format!("{i}\n")).collect();
    if all != expected {
        let got: Vec<&str> = all.lines().collect();
        let first_wrong = got
            .iter()
            .enumerate()
            .find(|(i, line)| line.parse::<usize>().ok() != Some(i + 1))
            .map(|(i, line)| format!("line {} is {line:?}", i + 1));
        panic!(
            "the three clients did not get 1..={COUNT} exactly once in order: {} lines ({} on A, {} on B, {} back on A); first wrong: {first_wrong:?}",
            got.len(),
            on_a.numbers(),
            on_b.numbers(),
            back_on_a.numbers()
        );
    }
    eprintln!(
        "numbers delivered: {} on A, {} on B, {} back on A",
        on_a.numbers(),
        on_b.numbers(),
        back_on_a.numbers()
    );
    // The runtime numbered every event as the agent did (the API counts
    // events; a gap would acknowledge the wrong ones).
    for name in ["keep-a", "keep-b"] {
        let log = std::fs::read_to_string(dir.path().join(name).join("sandboxd.log")).unwrap();
        assert!(
            log.contains("execution resumed with the sandbox"),
            "{name} never resumed the execution"
        );
        assert!(!log.contains("out of sequence"), "{name}: {log}");
    }
}

#[tokio::test]
async fn keep_executions_without_checkpointing_is_refused_with_a_reason() {
    let server = support::ws::Server::start().await;
    let mut ws = server.connect("/create").await;
    ws.send(json!({"keep_executions": true})).await;
    let frames = ws.until_close().await;
    assert_eq!(frames[0], "SANDBOX_CREATING", "{frames:?}");
    assert!(
        frames.contains(&"SANDBOX_CREATION_ERROR".to_owned())
            && frames
                .iter()
                .any(|f| f.contains("keep_executions") && f.contains("checkpointing")),
        "{frames:?}"
    );
    let mut ws = server.connect("/create").await;
    ws.send(json!({"enable_checkpoint": true, "keep_executions": 1}))
        .await;
    let frames = ws.until_close().await;
    assert!(
        frames
            .iter()
            .any(|f| f.contains("keep_executions") && f.contains("boolean")),
        "{frames:?}"
    );
}

/// An operator's edit of `metadata.json` through the emulator's HTTP API.
async fn edit_metadata(bucket: &str, id: &str, edit: impl FnOnce(&mut Value)) {
    let key = format!("sandboxes/{id}/metadata.json");
    let mut metadata: Value =
        support::get_json(format!("{}?alt=media", support::object_url(bucket, &key))).await;
    edit(&mut metadata);
    let response = testkit::http_client()
        .post(format!(
            "{}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={key}",
            support::emulator().endpoint()
        ))
        .header("content-type", "application/json")
        .body(serde_json::to_string_pretty(&metadata).unwrap())
        .send()
        .await
        .unwrap();
    assert!(response.status().is_success(), "{}", response.status());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_evicted_execution_waits_in_its_checkpoint_and_goes_on_at_the_next_attach() {
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let a = Launch::new("evict-a", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .start()
        .await;
    let (mut ws, id, token) = a.create(kept_init()).await;
    ws.send(json!({
        "language": "python",
        "code": "import time\nfor i in range(1, 101):\n    print(i)\n    time.sleep(0.05)\n"
    }))
    .await;
    let mut before = Seen::default();
    read_until(&mut ws, &mut before, |s| s.numbers() >= 10).await;
    edit_metadata(&bucket, &id, |m| {
        m["spec"]["desired_state"] = json!("checkpointed");
    })
    .await;
    read_until(&mut ws, &mut before, |_| false).await;
    assert!(
        has(&before, "SANDBOX_CHECKPOINTED"),
        "not evicted: {:?}",
        before.frames
    );
    assert!(
        !has(&before, "SANDBOX_EXECUTION_DONE"),
        "{:?}",
        before.frames
    );
    // Longer than the rest of the loop would take if it ran on.
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;

    let mut ws = a.attach(&id, &token).await;
    ws.send(json!({"action": "reconnect"})).await;
    let mut after = Seen::default();
    read_until(&mut ws, &mut after, |s| has(s, "SANDBOX_EXECUTION_DONE")).await;
    assert!(has(&after, "exit_code:0"), "{:?}", after.frames);
    let all = before.stdout + &after.stdout;
    let expected: String = (1..=100).map(|i| format!("{i}\n")).collect();
    assert_eq!(all, expected);
    // The execution slot is free again: the sandbox takes new work.
    ws.send(json!({"language": "bash", "code": "echo next"}))
        .await;
    let mut next = Seen::default();
    read_until(&mut ws, &mut next, |s| has(s, "SANDBOX_EXECUTION_DONE")).await;
    assert_eq!(next.stdout, "next\n", "{:?}", next.frames);
}

/// An attach that waits for a restore still reads its socket: the client's
/// pings are answered before `SANDBOX_RUNNING` (the Python client closes
/// after about 40 s of unanswered pings), and a frame the client sent during
/// the wait is kept and served once the sandbox runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attach_waiting_for_a_restore_answers_pings_and_keeps_early_frames() {
    use tokio_tungstenite::tungstenite::Message;
    let dir = tempfile::tempdir().unwrap();
    let store: std::sync::Arc<dyn controllers::store::Store> =
        std::sync::Arc::new(sandboxd::store::LocalStore::open(dir.path()).unwrap());
    let a = support::ws::Server::sharing("instance-a", std::sync::Arc::clone(&store), |_| {}).await;
    let b = support::ws::Server::sharing("instance-b", store, |_| {}).await;
    let (mut on_a, id, token) = a
        .create(json!({"idle_timeout": 300, "enable_checkpoint": true,
                       "enable_sandbox_handoff": true}))
        .await;
    on_a.exec("bash", "echo 41 > /tmp/x").await;

    let mut on_b = b.attach(&id, &token).await;
    on_b.send_raw(Message::Ping(b"are you there".to_vec().into()))
        .await;
    on_b.send(json!({"language": "python", "code": "print(int(open('/tmp/x').read()) + 1)"}))
        .await;
    let mut before_running = Vec::new();
    loop {
        match on_b.next_raw().await.expect("the socket stays open") {
            Message::Pong(_) => before_running.push("pong".to_owned()),
            Message::Text(text) => {
                let frame: Value = serde_json::from_str(text.as_str()).unwrap();
                if frame["status"] == "SANDBOX_RUNNING" {
                    break;
                }
                before_running.push(text.as_str().to_owned());
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    // Answered while A still checkpoints: before the lock is B's (without
    // reading during the wait, the pong came only once the session started).
    let pong = before_running.iter().position(|f| f == "pong");
    let acquired = before_running
        .iter()
        .position(|f| f.contains("SANDBOX_LOCK_ACQUIRED"));
    assert!(
        pong.is_some() && acquired.is_some() && pong < acquired,
        "the ping was not answered during the restore: {before_running:?}"
    );
    let frames = support::ws::merge_chunks(on_b.until_status("SANDBOX_EXECUTION_DONE").await);
    assert!(frames.contains(&"stdout:42\n".to_owned()), "{frames:?}");
    drop(on_a);
}
