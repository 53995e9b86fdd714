//! Benchmark (not a timed test): handoff latency between two real `sandboxd`
//! processes on fake-gcs-server at production default settings, from the
//! attach on B to `SANDBOX_RUNNING`, for a small sandbox in each state its
//! holder A can be in when B is asked:
//! - its client is still attached to A and just used it (a client whose
//!   network dropped reconnects through another instance; the earlier
//!   server's own example);
//! - its client left A a second ago;
//! - its client left A longer ago than any fast-path window (95 s);
//! - its client is attached to A but has sent nothing for 95 s (A reads its
//!   doorbell at the idle interval, not the active one);
//!
//! and crash takeover: A is SIGKILLed, the client attaches on B, which restores
//! the last checkpoint once A's instance lease has expired; and, beside the
//! idle sandbox, one created with `keep_executions` whose Python loop runs
//! through the handoff (client still attached to A): attach on B to
//! `SANDBOX_RUNNING`, and to its first output replayed on B.
//! Prints median, min and max of each.
//!
//! `cargo test --release --test it cluster::bench_handoff -- --ignored --nocapture --test-threads 1`
//! (`HANDOFF_RUNS`, default 10; `TAKEOVER_RUNS`, default 3;
//! `TAKEOVER_PROFILE=gcs-regional` puts the takeover's servers behind that
//! storage model, `docs/benchmarks.md`; `BENCH_DIR` keeps
//! the servers' debug logs there). One test at a time: the takeover test's
//! kills and restarts would otherwise load the machine the handoffs are
//! timed on.

use crate::support;

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::process::{Launch, ServerProcess};
use support::ws::Ws;

fn options() -> Value {
    json!({"idle_timeout": 900, "enable_checkpoint": true, "enable_sandbox_handoff": true})
}

fn runs(variable: &str, default: usize) -> usize {
    std::env::var(variable)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn report(label: &str, samples: &mut [Duration]) {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let n = samples.len();
    println!(
        "{label}: median {:.0} ms, min {:.0} ms, max {:.0} ms (n={n})",
        ms(samples[n / 2]),
        ms(samples[0]),
        ms(samples[n - 1])
    );
}

/// Attaches on `to` and times it until `SANDBOX_RUNNING`; then deletes the
/// sandbox.
async fn timed_attach(to: &ServerProcess, id: &str, token: &str) -> Duration {
    let started = Instant::now();
    let mut moved = to.attach(id, token).await;
    let frames = moved.until_status("SANDBOX_RUNNING").await;
    let took = started.elapsed();
    assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
    let state = moved.exec("bash", "cat /tmp/state").await;
    assert!(state.iter().any(|f| f.contains("state")), "{state:?}");
    moved.send(json!({"action": "kill_sandbox"})).await;
    moved.until_close().await;
    took
}

/// Where the servers keep their state and debug logs: `BENCH_DIR` if set
/// (kept, to read where the time went), else a temporary directory.
fn bench_dir() -> tempfile::TempDir {
    match std::env::var_os("BENCH_DIR") {
        Some(dir) => {
            std::fs::create_dir_all(&dir).unwrap();
            let mut kept = tempfile::Builder::new().tempdir_in(dir).unwrap();
            kept.disable_cleanup(true);
            kept
        }
        None => tempfile::tempdir().unwrap(),
    }
}

/// Waits 0–1 s at random before the next attach of a back-to-back series.
/// Without it each attach would start one handoff's length after the
/// previous one, which began at a doorbell read of A: the attaches would
/// lock onto one phase of A's doorbell period (a CI-less run measured every
/// wait at 310–340 ms of a 400 ms period) instead of meeting it at random,
/// as independent clients do.
async fn at_a_random_moment() {
    tokio::time::sleep(Duration::from_millis(rand::random_range(0..1000))).await;
}

async fn created(on: &ServerProcess) -> (Ws, String, String) {
    let (mut ws, id, token) = on.create(options()).await;
    ws.exec("bash", "echo state > /tmp/state").await;
    (ws, id, token)
}

async fn pair(dir: &Path, bucket: &str) -> (ServerProcess, ServerProcess) {
    let a = Launch::new("bench-a", dir).on_bucket(bucket).start().await;
    let b = Launch::new("bench-b", dir).on_bucket(bucket).start().await;
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark (prints figures, asserts no timing): cargo test --release --test it cluster::bench_handoff -- --ignored --nocapture --test-threads 1"]
async fn handoff_latency() {
    let runs = runs("HANDOFF_RUNS", 10);
    let dir = bench_dir();
    let bucket = support::create_bucket().await;
    let (a, b) = pair(dir.path(), &bucket).await;

    let mut attached = Vec::new();
    for run in 0..runs {
        let (from, to) = if run % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let (mut old, id, token) = created(from).await;
        let took = timed_attach(to, &id, &token).await;
        // The old client got the contract's handoff sequence and a close.
        let seen = old.until_close().await;
        assert!(
            seen.iter()
                .any(|f| f.contains("SANDBOX_LOCK_RELEASE_REQUESTED")),
            "{seen:?}"
        );
        attached.push(took);
    }
    report("handoff, client still attached to A", &mut attached);

    let mut just_left = Vec::new();
    for run in 0..runs {
        let (from, to) = if run % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let (ws, id, token) = created(from).await;
        drop(ws);
        tokio::time::sleep(Duration::from_secs(1)).await;
        just_left.push(timed_attach(to, &id, &token).await);
    }
    report("handoff, client left A 1 s ago", &mut just_left);

    // Every sandbox of this round is created first, then all wait out the
    // fast-path window together.
    let mut idle = Vec::new();
    for _ in 0..runs {
        let (ws, id, token) = created(&a).await;
        drop(ws);
        idle.push((id, token));
    }
    tokio::time::sleep(Duration::from_secs(95)).await;
    let mut long_gone = Vec::new();
    for (id, token) in &idle {
        at_a_random_moment().await;
        long_gone.push(timed_attach(&b, id, token).await);
    }
    report("handoff, client left A 95 s ago", &mut long_gone);

    // Clients still attached to A but quiet for longer than the active
    // window: A reads its doorbell at the idle interval again.
    let mut quiet = Vec::new();
    for _ in 0..runs {
        let (ws, id, token) = created(&a).await;
        quiet.push((ws, id, token));
    }
    tokio::time::sleep(Duration::from_secs(95)).await;
    let mut attached_quiet = Vec::new();
    for (old, id, token) in &mut quiet {
        at_a_random_moment().await;
        attached_quiet.push(timed_attach(&b, id, token).await);
        let seen = old.until_close().await;
        assert!(
            seen.iter()
                .any(|f| f.contains("SANDBOX_LOCK_RELEASE_REQUESTED")),
            "{seen:?}"
        );
    }
    report(
        "handoff, client attached to A but quiet for 95 s",
        &mut attached_quiet,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark (prints figures, asserts no timing): cargo test --release --test it cluster::bench_handoff -- --ignored --nocapture --test-threads 1"]
async fn crash_takeover_latency() {
    let runs = runs("TAKEOVER_RUNS", 3);
    // `TAKEOVER_PROFILE=gcs-regional`: each server reaches the emulator
    // through its own proxy of that storage model (`docs/benchmarks.md`).
    let profile: Option<testkit::storage::Profile> = std::env::var("TAKEOVER_PROFILE")
        .ok()
        .map(|name| name.parse().expect("TAKEOVER_PROFILE: a storage profile"));
    let model = profile.clone().map(|profile| {
        testkit::storage::StorageModel::new(support::emulator().socket_addr(), profile)
    });
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let mut proxies = Vec::new();
    let mut on_bucket = async |launch: Launch, name: &str| match &model {
        Some(model) => {
            let proxy = model.proxy(name).await.unwrap();
            let launch = launch.on_emulator(&proxy.endpoint(), &bucket);
            proxies.push(proxy);
            launch
        }
        None => launch.on_bucket(&bucket),
    };
    let b = on_bucket(Launch::new("takeover-b", dir.path()), "takeover-b")
        .await
        .start()
        .await;
    let mut samples = Vec::new();
    for run in 0..runs {
        let name = format!("takeover-a{run}");
        let mut a = on_bucket(Launch::new(&name, dir.path()), &name)
            .await
            .start()
            .await;
        let (mut ws, id, token) = created(&a).await;
        // A checkpoint to take over from, then the sandbox back on A.
        ws.send(json!({"action": "checkpoint"})).await;
        ws.until_close().await;
        let mut back = a.attach(&id, &token).await;
        back.until_status("SANDBOX_RUNNING").await;
        drop(back);
        a.signal("-KILL");
        let killed = Instant::now();
        let mut moved = b.attach(&id, &token).await;
        let frames = moved.until_status("SANDBOX_RUNNING").await;
        let took = killed.elapsed();
        assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
        samples.push(took);
        moved.send(json!({"action": "kill_sandbox"})).await;
        moved.until_close().await;
    }
    let label = match &profile {
        Some(profile) => format!(
            "crash takeover under {}, SIGKILL of A -> SANDBOX_RUNNING on B",
            profile.name
        ),
        None => "crash takeover, SIGKILL of A -> SANDBOX_RUNNING on B".to_owned(),
    };
    report(&label, &mut samples);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark (prints figures, asserts no timing): cargo test --release --test it cluster::bench_handoff -- --ignored --nocapture --test-threads 1"]
async fn handoff_latency_with_a_running_execution() {
    let runs = runs("HANDOFF_RUNS", 10);
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let (a, b) = pair(dir.path(), &bucket).await;
    let mut options = options();
    options["keep_executions"] = json!(true);
    let mut running = Vec::new();
    let mut first_output = Vec::new();
    for run in 0..runs {
        let (from, to) = if run % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let (mut old, id, token) = from.create(options.clone()).await;
        old.send(json!({
            "language": "python",
            "code": "import time\nfor i in range(100000):\n    print(i, flush=True)\n    time.sleep(0.05)\n"
        }))
        .await;
        old.until(|f| f.starts_with("stdout:")).await;
        let started = Instant::now();
        let mut moved = to.attach(&id, &token).await;
        moved.send(json!({"action": "reconnect"})).await;
        let frames = moved.until_status("SANDBOX_RUNNING").await;
        running.push(started.elapsed());
        assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
        let frames = moved.until(|f| f.starts_with("stdout:")).await;
        first_output.push(started.elapsed());
        assert!(
            !frames.iter().any(|f| f == "SANDBOX_EXECUTION_DONE"),
            "the execution did not survive: {frames:?}"
        );
        let seen = old.until_close().await;
        assert!(
            !seen.iter().any(|f| f == "SANDBOX_EXECUTION_FORCE_KILLED"),
            "{seen:?}"
        );
        moved.send(json!({"action": "kill_sandbox"})).await;
        moved.until_close().await;
    }
    report(
        "handoff with a running execution (keep_executions), client still attached to A",
        &mut running,
    );
    report(
        "  ... to its first output on B after reconnect",
        &mut first_output,
    );
}
