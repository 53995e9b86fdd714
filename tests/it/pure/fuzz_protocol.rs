//! Mutation fuzzing of every input the server takes from someone it does not
//! control (docs/security.md, "Input never panics the server"), each for a time budget:
//! - client frames and init messages (WebSocket), byte mutations and
//!   operator-style field edits of every kind of frame;
//! - agent lines (what a sandbox writes to the host), through a real
//!   [`AgentConnection`] over pipes: after every batch of mutated lines the
//!   connection must still answer a request, so its reader did not die;
//! - the bucket's JSON objects as an operator might edit them (fields set to
//!   extremes, removed, copied), read by a real reconciler on the in-memory
//!   store: every pass ends in `Ok` or an error, never a panic.
//!
//! `FUZZ_SECS` sets each target's budget (default 3 s; `scripts/test.sh`, and
//! so CI, runs 20 s). A longer run is one command:
//! `FUZZ_SECS=3600 cargo test --release --test it pure::fuzz_protocol`.
//! `FUZZ_SEED` replays a run (each target prints its seed).

use std::io::Write as _;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use controllers::api::{InstanceId, SandboxId, SandboxMetadata};
use controllers::clock::Clock as _;
use controllers::layout::{doorbell_key, instance_lease_key, lock_key, metadata_key};
use controllers::leasing::{LeaseConfig, Leases};
use controllers::sandboxes::{Reconciler, ReconcilerConfig, ReconcilerParts, SandboxController};
use controllers::store::{PutMode, Store};
use controllers::testing::{FakeRuntime, ManualClock, MemoryStore, edit_json, mutate};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sandboxd::api::protocol::{ClientFrame, InitMessage};
use sandboxd::runtime::agent::AgentConnection;
use sandboxd::runtime::agent::protocol::{Event, Request, ScanDone};
use serde_json::json;
use tokio::net::unix::pipe;

const FRAMES: [&str; 10] = [
    r#"{"language":"python","code":"print(1)"}"#,
    r#"{"language":"bash","code":"echo hi","session":false}"#,
    r#"{"event":"stdin","data":"line\n"}"#,
    r#"{"action":"kill_process"}"#,
    r#"{"action":"kill_sandbox"}"#,
    r#"{"action":"checkpoint","name":"before-upgrade"}"#,
    r#"{"action":"snapshot_filesystem","name":"snap"}"#,
    r#"{"action":"reconnect"}"#,
    r#"{"idle_timeout": 60, "enable_checkpoint": true, "enable_sandbox_handoff": true, "filesystem_snapshot_name": "x"}"#,
    r#"{"idle_timeout": 0, "network": "egress", "image": "default", "enable_workspace_sync": true, "workspace_id": "w", "workspace_token": "0123456789abcdef", "keep_executions": true, "labels": {"team": "ml"}, "from_checkpoint": {"sandbox_id": "a", "sandbox_token": "b", "name": "c"}}"#,
];

const AGENT_LINES: [&str; 14] = [
    r#"{"ev":"hello","version":1,"pid":1}"#,
    r#"{"ev":"started","id":"e1","pid":7}"#,
    r#"{"ev":"out","id":"e1","fd":1,"data":"aGVsbG8K","seq":1}"#,
    r#"{"ev":"out","id":"e1","fd":2,"data":"/w=="}"#,
    r#"{"ev":"exit","id":"e1","code":0,"seq":2}"#,
    r#"{"ev":"stdin_taken","id":"e2","count":65536}"#,
    r#"{"ev":"chunk","id":"a1","data":"eA=="}"#,
    r#"{"ev":"error","id":"r1","message":"no"}"#,
    r#"{"ev":"pong","id":null,"version":1,"running":["e1"]}"#,
    r#"{"ev":"ready","id":"r2","killed_host_fd_holders":[],"running":[],"kept":["e1"]}"#,
    r#"{"ev":"journals","id":"r3","paused":true,"executions":[{"id":"e1","next_seq":3,"acked":1,"exited":null}]}"#,
    r#"{"ev":"resumed","id":"r4"}"#,
    r#"{"ev":"done","id":"r5","files":[{"path":"a","checksum":"00000000000000000000000000000000","size":1,"modified_at":0}],"refused":[],"hashed":1,"synced":[],"scanned_at":0}"#,
    r#"{"ev":"done","id":"a1","size":10,"entries":1}"#,
];

/// Each target's time budget.
fn budget() -> Duration {
    let secs = std::env::var("FUZZ_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    Duration::from_secs(secs)
}

fn rng(target: &str) -> StdRng {
    let seed = std::env::var("FUZZ_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random::<u64>);
    println!("{target}: FUZZ_SEED={seed}");
    StdRng::seed_from_u64(seed)
}

/// A byte mutation or an operator-style field edit, half each.
fn variant(rng: &mut StdRng, seed: &str) -> Vec<u8> {
    if rng.random_bool(0.5) {
        mutate(rng, seed.as_bytes())
    } else {
        edit_json(rng, seed.as_bytes())
    }
}

#[test]
fn mutated_client_frames_never_panic_and_every_refusal_says_why() {
    let mut rng = rng("client frames");
    let (mut parsed, mut refused) = (0usize, 0usize);
    let started = Instant::now();
    while started.elapsed() < budget() {
        for seed in FRAMES {
            let bytes = variant(&mut rng, seed);
            let text = String::from_utf8_lossy(&bytes);
            for outcome in [
                ClientFrame::parse(&text).map(|_| ()),
                InitMessage::parse(&text).map(|_| ()),
            ] {
                match outcome {
                    Ok(()) => parsed += 1,
                    Err(err) => {
                        refused += 1;
                        assert!(!err.to_string().is_empty());
                    }
                }
            }
        }
    }
    println!("client frames: {parsed} parsed, {refused} refused");
    assert!(
        parsed > 100 && refused > 100,
        "parsed {parsed}, refused {refused}"
    );
}

/// The agent's end of a connection: the test writes events to the file.
fn agent_pair() -> (Arc<AgentConnection>, std::fs::File, std::io::PipeReader) {
    let (command_reader, command_writer) = std::io::pipe().unwrap();
    let (event_reader, event_writer) = std::io::pipe().unwrap();
    let commands = pipe::Sender::from_owned_fd(OwnedFd::from(command_writer)).unwrap();
    let events = pipe::Receiver::from_owned_fd(OwnedFd::from(event_reader)).unwrap();
    let (connection, _hello) = AgentConnection::start(commands, events);
    (
        connection,
        std::fs::File::from(OwnedFd::from(event_writer)),
        command_reader,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutated_agent_lines_never_stop_the_connection() {
    let mut rng = rng("agent lines");
    let (connection, agent, commands) = agent_pair();
    let agent = Arc::new(std::sync::Mutex::new(agent));
    // The agent's side of a ping: answered once it was read, as the real
    // agent does (other commands are ignored).
    let answering = Arc::clone(&agent);
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(commands).lines() {
            let Ok(line) = line else { return };
            let Ok(command) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            if command["op"] == "ping" {
                let mut pong = serde_json::to_vec(
                    &json!({"ev": "pong", "id": command["id"], "version": 1, "running": []}),
                )
                .unwrap();
                pong.push(b'\n');
                if answering.lock().unwrap().write_all(&pong).is_err() {
                    return;
                }
            }
        }
    });
    let started = Instant::now();
    let (mut lines, mut batches, mut typed) = (0usize, 0usize, 0usize);
    while started.elapsed() < budget() {
        // Routes for the ids the seeds use, read by a drain task; one with
        // a stdin window for `stdin_taken` to fill.
        for (id, window) in [("e1", None), ("e2", Some((1 << 20, 0)))] {
            if let Ok(mut events) = connection.adopt_exec(id, window) {
                tokio::spawn(async move { while events.recv().await.is_some() {} });
            }
        }
        let mut batch = Vec::new();
        for _ in 0..64 {
            let seed = AGENT_LINES[rng.random_range(0..AGENT_LINES.len())];
            let mut line = variant(&mut rng, seed);
            // The typed replies the host reads from `done` and the others.
            if let Ok(event) = serde_json::from_slice::<Event>(&line) {
                typed += 1;
                let _ = event.clone().reply::<ScanDone>();
                let _ = event.id();
            }
            line.retain(|&b| b != b'\n');
            line.push(b'\n');
            batch.extend_from_slice(&line);
            lines += 1;
        }
        let writer = Arc::clone(&agent);
        tokio::task::spawn_blocking(move || writer.lock().unwrap().write_all(&batch).unwrap())
            .await
            .unwrap();
        // The reader must still be alive: a request sent after the batch is
        // answered.
        let reply = connection
            .request(Request::Ping, Duration::from_secs(10))
            .await;
        assert!(
            reply.is_ok(),
            "the connection stopped answering after batch {batches}: {reply:?}"
        );
        batches += 1;
    }
    println!("agent lines: {lines} lines in {batches} batches, {typed} decoded");
    assert!(typed > 100, "mutations must sometimes stay valid ({typed})");
}

/// One instance of a deployment on the in-memory store.
fn instance(store: &Arc<MemoryStore>, clock: &ManualClock, name: &str) -> Arc<SandboxController> {
    let runtime = FakeRuntime::new(store.clone());
    let leases = Leases::new(
        store.clone(),
        Arc::new(clock.clone()),
        InstanceId::parse(name).unwrap(),
        LeaseConfig {
            duration: chrono::Duration::seconds(30),
            skew_tolerance: chrono::Duration::seconds(5),
            intent_ttl: chrono::Duration::seconds(60),
            ring_spacing: std::time::Duration::ZERO,
        },
    );
    let reconciler = Reconciler::new(ReconcilerParts {
        metadata: store.clone(),
        checkpoints: store.clone(),
        checkpoint_bucket: "fuzz".to_owned(),
        snapshot_bucket: "fuzz".to_owned(),
        runtime: Arc::new(runtime),
        leases,
        clock: Arc::new(clock.clone()),
        config: ReconcilerConfig::default(),
    });
    SandboxController::new(reconciler)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_edits_of_the_bucket_never_panic_a_reconciler() {
    let mut rng = rng("bucket objects");
    let started = Instant::now();
    let (mut passes, mut errors) = (0usize, 0usize);
    while started.elapsed() < budget() {
        let store = Arc::new(MemoryStore::new());
        let clock = ManualClock::new();
        let a = instance(&store, &clock, "a");
        let b = instance(&store, &clock, "b");
        let id = SandboxId::random();
        let mut metadata = SandboxMetadata::new(id.clone(), clock.now(), "a".repeat(64));
        metadata.spec.enable_checkpoint = true;
        metadata.spec.idle_timeout = Some(60);
        a.serving(&id, a.create(&metadata)).await.unwrap();
        a.reconciler()
            .leases()
            .instance_lease()
            .renew()
            .await
            .unwrap();
        if rng.random_bool(0.5) {
            b.serving(&id, b.request_here(&id, None, clock.now()))
                .await
                .ok();
        }
        // An operator edits one of the objects by hand.
        let keys = [
            metadata_key(&id),
            lock_key(&id),
            instance_lease_key(&InstanceId::parse("a").unwrap()),
            doorbell_key(&InstanceId::parse("a").unwrap()),
        ];
        for _ in 0..rng.random_range(1..=2) {
            let key = &keys[rng.random_range(0..keys.len())];
            let Ok(object) = store.get(key).await else {
                continue;
            };
            let text = String::from_utf8_lossy(&object.data).into_owned();
            let edited = variant(&mut rng, &text);
            store
                .put(key, edited.into(), PutMode::Overwrite)
                .await
                .unwrap();
        }
        for step in 0..4 {
            for controller in [&a, &b] {
                match controller.reconciler().reconcile(&id).await {
                    Ok(_) => {}
                    Err(err) => {
                        errors += 1;
                        assert!(!err.to_string().is_empty());
                    }
                }
                passes += 1;
            }
            clock.advance(chrono::Duration::seconds([1, 40, 700, 100_000][step]));
            let _ = a.reconciler().leases().instance_lease().renew().await;
        }
    }
    println!("bucket objects: {passes} reconcile passes, {errors} errors");
    assert!(passes > 100, "{passes}");
}
