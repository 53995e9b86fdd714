//! Benchmark (not a timed test): handoff latency between two real `sandboxd`
//! processes on fake-gcs-server, from the attach on B to `SANDBOX_RUNNING`,
//! for a small sandbox whose client just left A. Prints median, min and max.
//!
//! `cargo test --release --test bench_handoff -- --ignored --nocapture`
//! (`HANDOFF_RUNS`, default 10).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a benchmark fails by panicking"
)]

mod support;

use std::time::{Duration, Instant};

use serde_json::json;
use support::process::Launch;

#[tokio::test]
#[ignore = "benchmark: cargo test --release --test bench_handoff -- --ignored --nocapture"]
async fn handoff_latency() {
    let runs: usize = std::env::var("HANDOFF_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let a = Launch::new("bench-a", dir.path())
        .on_bucket(&bucket)
        .start()
        .await;
    let b = Launch::new("bench-b", dir.path())
        .on_bucket(&bucket)
        .start()
        .await;
    let mut samples = Vec::with_capacity(runs);
    for run in 0..runs {
        let (from, to) = if run % 2 == 0 { (&a, &b) } else { (&b, &a) };
        let (mut ws, id, token) = from
            .create(json!({"idle_timeout": 300, "enable_checkpoint": true, "enable_sandbox_handoff": true}))
            .await;
        ws.exec("bash", "echo state > /tmp/state").await;
        drop(ws);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        let mut moved = to.attach(&id, &token).await;
        let frames = moved.until_status("SANDBOX_RUNNING").await;
        let took = started.elapsed();
        assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
        samples.push(took);
        moved.send(json!({"action": "kill_sandbox"})).await;
        moved.until_close().await;
    }
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "handoff attach -> SANDBOX_RUNNING over {runs} runs: median {:.0} ms, min {:.0} ms, max {:.0} ms",
        ms(samples[runs / 2]),
        ms(samples[0]),
        ms(samples[runs - 1])
    );
}
