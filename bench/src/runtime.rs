//! `sandboxd-bench runtime`: the gVisor runtime's latencies, measured on
//! this machine without a server: create, exec round trips, checkpoint and
//! restore of sandboxes of several sizes.
//!
//! Timed tests would be flaky on shared machines; this prints figures instead.

use std::sync::Arc;
use std::time::{Duration, Instant};

use controllers::api::SandboxId;
use controllers::runtime::{
    CheckpointRequest, Command, CreateOptions, ExecEvent, ExecRequest, SandboxRuntime,
};
use sandboxd::runtime::{GvisorConfig, GvisorRuntime};
use sandboxd::store::LocalStore;

use crate::series::Series;

fn new_id() -> SandboxId {
    SandboxId::from_u128(uuid::Uuid::new_v4().as_u128())
}

async fn timed_exec(
    runtime: &GvisorRuntime,
    sandbox: &SandboxId,
    command: Command,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let mut execution = runtime.exec(sandbox, ExecRequest::new(command)).await?;
    while let Some(event) = execution.events.recv().await {
        if let ExecEvent::Exited(code) = event {
            anyhow::ensure!(code == 0, "benchmark command exited with {code}");
            return Ok(started.elapsed());
        }
    }
    anyhow::bail!("execution ended without an exit code")
}

/// Runs every runtime benchmark `runs` times; `sizes_mb` are the sandbox memory
/// sizes for checkpoint and restore.
pub async fn runtime_benchmarks(
    config: GvisorConfig,
    runs: usize,
    sizes_mb: &[u64],
) -> anyhow::Result<Vec<Series>> {
    let store_dir = config.state_dir.join("bench-store");
    let store = Arc::new(LocalStore::open(&store_dir)?);
    let runtime = GvisorRuntime::start(config, store.clone(), store).await?;
    let mut results = Vec::new();

    let mut create = Series::named("create -> ready");
    for _ in 0..runs {
        let id = new_id();
        let started = Instant::now();
        runtime.create(&id, &CreateOptions::default()).await?;
        create.samples.push(started.elapsed());
        runtime.destroy(&id).await?;
        // Let the background delete finish so it does not skew the next sample.
        tokio::time::sleep(Duration::from_millis(2500)).await;
    }
    results.push(create);

    let id = new_id();
    runtime.create(&id, &CreateOptions::default()).await?;
    let cases = [
        ("exec bash -c 'echo hi'", Command::Bash("echo hi".into())),
        (
            "exec python3 -c 'print(1)'",
            Command::Python("print(1)".into()),
        ),
        (
            "exec persistent python 'print(1)'",
            Command::PythonSession("print(1)".into()),
        ),
    ];
    for (name, command) in cases {
        let mut series = Series::named(name);
        timed_exec(&runtime, &id, command.clone()).await?; // warm-up
        for _ in 0..runs {
            series
                .samples
                .push(timed_exec(&runtime, &id, command.clone()).await?);
        }
        results.push(series);
    }
    runtime.destroy(&id).await?;

    for &size in sizes_mb {
        let id = new_id();
        runtime.create(&id, &CreateOptions::default()).await?;
        let allocate = format!("import os\nheld = bytearray(os.urandom(1 << 20)) * {size}\n");
        timed_exec(&runtime, &id, Command::PythonSession(allocate)).await?;
        let mut checkpoint =
            Series::named(format!("checkpoint {size} MB (runsc + sha256 + store)"));
        let mut restore = Series::named(format!("restore {size} MB (store + verify + runsc)"));
        for _ in 0..runs {
            let request = CheckpointRequest {
                checkpoint_id: new_id(),
                epoch: 1,
                name: None,
                force: false,
                keep_executions: false,
            };
            let started = Instant::now();
            let manifest = runtime.checkpoint(&id, request).await?;
            checkpoint.samples.push(started.elapsed());
            let started = Instant::now();
            runtime.restore(&id, &manifest).await?;
            restore.samples.push(started.elapsed());
        }
        timed_exec(
            &runtime,
            &id,
            Command::PythonSession(format!("assert len(held) == {size} << 20")),
        )
        .await?;
        runtime.destroy(&id).await?;
        results.push(checkpoint);
        results.push(restore);
    }
    runtime.settle().await;
    let _ = tokio::fs::remove_dir_all(&store_dir).await;
    Ok(results)
}
