//! `sandboxctl bench runtime`: the gVisor runtime's latencies, measured on this
//! machine and printed as medians (a table for people, JSON for tools).
//!
//! Timed tests would be flaky on shared machines; this prints figures instead.

use std::sync::Arc;
use std::time::{Duration, Instant};

use controllers::api::SandboxId;
use controllers::runtime::{
    CheckpointRequest, Command, CreateOptions, ExecEvent, ExecRequest, SandboxRuntime,
};
use serde_json::json;

use crate::runtime::{GvisorConfig, GvisorRuntime};
use crate::store::LocalStore;

/// Samples of one measured operation.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub samples: Vec<Duration>,
}

impl Series {
    /// An empty series called `name`.
    pub fn named(name: impl Into<String>) -> Self {
        Self::new(name)
    }

    fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            samples: Vec::new(),
        }
    }

    fn quantile(&self, q: f64) -> Duration {
        let mut sorted = self.samples.clone();
        sorted.sort();
        if sorted.is_empty() {
            return Duration::ZERO;
        }
        let index = ((sorted.len() - 1) as f64 * q).round() as usize;
        sorted[index]
    }

    pub fn median(&self) -> Duration {
        self.quantile(0.5)
    }

    pub fn p90(&self) -> Duration {
        self.quantile(0.9)
    }
}

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

    let mut create = Series::new("create -> ready");
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
        let mut series = Series::new(name);
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
        let mut checkpoint = Series::new(format!("checkpoint {size} MB (runsc + sha256 + store)"));
        let mut restore = Series::new(format!("restore {size} MB (store + verify + runsc)"));
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

/// A table with median, p90, min and the sample count.
pub fn render(results: &[Series]) -> String {
    let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1000.0);
    let mut out = format!(
        "{:<48} {:>10} {:>10} {:>10} {:>5}\n",
        "operation", "median ms", "p90 ms", "min ms", "n"
    );
    for series in results {
        let min = series.samples.iter().min().copied().unwrap_or_default();
        out.push_str(&format!(
            "{:<48} {:>10} {:>10} {:>10} {:>5}\n",
            series.name,
            ms(series.median()),
            ms(series.p90()),
            ms(min),
            series.samples.len()
        ));
    }
    out
}

/// The same figures as JSON.
pub fn to_json(results: &[Series]) -> serde_json::Value {
    json!(
        results
            .iter()
            .map(|s| json!({
                "operation": s.name,
                "median_ms": s.median().as_secs_f64() * 1000.0,
                "p90_ms": s.p90().as_secs_f64() * 1000.0,
                "samples": s.samples.len(),
            }))
            .collect::<Vec<_>>()
    )
}
