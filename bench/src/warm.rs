//! `sandboxd-bench warm`: create latency with warm starts (decision 17), as the
//! plain Python `websockets` client sees it (default socket options, from
//! the send of the init message to `SANDBOX_RUNNING`), on fake-gcs-server
//! and `sandboxd` processes it starts with the tests' fixtures:
//!
//! Each create case runs twice: on the emulator directly (`loopback`) and
//! through the storage model's `gcs-regional` profile (`testkit::storage`).
//!
//! - **pool hit**: a server keeping 2 warm sandboxes, each create made once
//!   the pool is full again;
//! - **pool miss**: a server without a pool (a cold boot);
//! - **ready template**: an image whose start command (imports, then 2 s of
//!   work) runs once per instance: the first create's latency (boot, start
//!   command, checkpoint, restore) and then every later one's (a restore);
//! - **burst**: a pool sized for the burst, then back-to-back creates: how
//!   many were pool hits, and a running sandbox's `echo hi` round trip at
//!   rest and while the pool refills behind the burst.
//!
//! Needs root, runsc, the fake-gcs-server wheel and `pip install websockets`;
//! builds the template `bench-ready` into the image directory (root).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use sandboxd::client::{CreateOptions, Language, Sandbox};
use sandboxd::runtime::images::ready::{ReadyCommand, ReadyLanguage};
use serde_json::json;
use testkit::storage::{Profile, StorageModel};
use testkit::{Backend, Emulator, Launch, ServerProcess};

use crate::series::Series;

/// What to run.
#[derive(Debug, Clone)]
pub struct WarmBench {
    pub runs: usize,
    /// Back-to-back creates in the burst (the pool is sized for them).
    pub burst: usize,
    pub images_dir: PathBuf,
    pub work_dir: PathBuf,
    /// The server binary (default: `sandboxd` beside this one).
    pub sandboxd: Option<PathBuf>,
}

/// Figures that are not one latency series.
#[derive(Debug, Clone, Default)]
pub struct WarmFigures {
    pub burst: usize,
    pub burst_hits: u64,
    /// The first create of the ready template on an instance (loopback,
    /// `gcs-regional`).
    pub ready_first: Duration,
    pub ready_first_regional: Duration,
    pub pool_memory_mb_per_sandbox: Option<f64>,
}

/// Creates `count` sandboxes back to back, killing each once it runs;
/// prints the seconds from the init message to `SANDBOX_RUNNING` as JSON.
const PYTHON_CREATES: &str = r#"
import asyncio, json, sys, time
import websockets

async def create(url, init):
    async with websockets.connect(url + "/create") as ws:
        started = time.perf_counter()
        await ws.send(json.dumps(init))
        while True:
            frame = json.loads(await ws.recv())
            status = str(frame.get("status", ""))
            if status == "SANDBOX_RUNNING":
                took = time.perf_counter() - started
                break
            if status.endswith("ERROR"):
                raise SystemExit(f"the server refused: {frame}")
        await ws.send(json.dumps({"action": "kill_sandbox"}))
        try:
            while True:
                await ws.recv()
        except websockets.ConnectionClosed:
            pass
        return took

async def main(url, count, init):
    print(json.dumps([await create(url, init) for _ in range(count)]))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])))
"#;

/// The Python client's create latencies.
async fn python_creates(
    url: &str,
    count: usize,
    init: &serde_json::Value,
) -> anyhow::Result<Vec<Duration>> {
    let output = tokio::process::Command::new("python3")
        .args([
            "-c",
            PYTHON_CREATES,
            url,
            &count.to_string(),
            &init.to_string(),
        ])
        .output()
        .await
        .context("running python3 for the websockets client")?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    anyhow::ensure!(
        !stderr.contains("No module named 'websockets'"),
        "the Python websockets client is missing: pip install websockets"
    );
    anyhow::ensure!(
        output.status.success(),
        "the Python websockets client failed: {stderr}"
    );
    let times: Vec<f64> =
        serde_json::from_slice(&output.stdout).context("the Python client's output")?;
    Ok(times.into_iter().map(Duration::from_secs_f64).collect())
}

/// A `sandboxd` beside this binary on the emulator's bucket.
async fn server(
    bench: &WarmBench,
    name: &str,
    endpoint: &str,
    pool: usize,
) -> anyhow::Result<ServerProcess> {
    let binary = match &bench.sandboxd {
        Some(binary) => binary.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("the directory of sandboxd-bench")?
            .join("sandboxd"),
    };
    let images = bench.images_dir.display().to_string();
    Ok(Launch::new(binary, name, &bench.work_dir)
        .on_emulator(endpoint, "warm")
        .warm_pool(pool)
        .with_args(&["--images-dir", &images])
        .start()
        .await?)
}

/// The value of an unlabelled series on the server's `/metrics`.
async fn metric(server: &ServerProcess, name: &str) -> anyhow::Result<f64> {
    let text = testkit::http_client()
        .get(format!("http://{}/metrics", server.addr))
        .send()
        .await?
        .text()
        .await?;
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .with_context(|| format!("{name} is not on /metrics"))
}

/// Waits until the server's pool holds `ready` sandboxes.
async fn pool_full(server: &ServerProcess, ready: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while metric(server, "sandboxd_warm_pool_ready").await? < ready as f64 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the warm pool never held {ready}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// The ready template the benchmark creates on: the default image plus a
/// start command that imports and then works for 2 s.
async fn build_template(images_dir: &Path, work_dir: &Path) -> anyhow::Result<()> {
    let catalog = sandboxd::runtime::ImageCatalog::new(images_dir, "default");
    let base = catalog.default_image()?;
    let command = ReadyCommand {
        language: ReadyLanguage::Python,
        code: "import json, sqlite3, time\ntime.sleep(2)\nDB = sqlite3.connect(':memory:')\n"
            .to_owned(),
        timeout_s: Some(60),
    };
    sandboxd::runtime::images::templates::ready_template(
        &catalog,
        "bench-ready",
        Some(&base.digest),
        &command,
        &work_dir.join("scratch"),
    )
    .await?;
    Ok(())
}

async fn echo_round_trip(sandbox: &Sandbox) -> anyhow::Result<Duration> {
    let started = Instant::now();
    sandbox
        .exec(Language::Bash, "echo hi")
        .await?
        .wait()
        .await?;
    Ok(started.elapsed())
}

/// Pool hit, pool miss and ready template creates on servers that reach
/// the bucket at `endpoint` (`profile` names how).
async fn creates(
    bench: &WarmBench,
    profile: &str,
    endpoint: &str,
    figures: &mut WarmFigures,
) -> anyhow::Result<Vec<Series>> {
    let plain = json!({});
    // Pool hits: each create on a full pool of two.
    let mut hit = Series::named(format!("create, pool hit ({profile})"));
    {
        let pooled = server(bench, &format!("warm-a-{profile}"), endpoint, 2).await?;
        let url = format!("ws://{}", pooled.addr);
        for _ in 0..bench.runs {
            pool_full(&pooled, 2).await?;
            hit.samples.extend(python_creates(&url, 1, &plain).await?);
        }
        pool_full(&pooled, 2).await?;
        let memory = metric(&pooled, "sandboxd_warm_pool_memory_bytes").await?;
        figures.pool_memory_mb_per_sandbox = Some(memory / 2.0 / f64::from(1 << 20));
        let hits = metric(&pooled, "sandboxd_warm_pool_hits_total").await?;
        anyhow::ensure!(
            hits as usize == bench.runs,
            "{hits} of {} creates were pool hits",
            bench.runs
        );
    }
    // Pool misses and the ready template, on a server without a pool.
    let mut miss = Series::named(format!("create, pool miss: cold boot ({profile})"));
    let mut ready = Series::named(format!("create, ready template ({profile})"));
    {
        let cold = server(bench, &format!("warm-b-{profile}"), endpoint, 0).await?;
        let url = format!("ws://{}", cold.addr);
        for _ in 0..bench.runs {
            miss.samples.extend(python_creates(&url, 1, &plain).await?);
            // The killed sandbox's teardown runs in the background.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let template = json!({"image": "bench-ready"});
        figures.ready_first = python_creates(&url, 1, &template)
            .await?
            .first()
            .copied()
            .unwrap_or_default();
        for _ in 0..bench.runs {
            ready
                .samples
                .extend(python_creates(&url, 1, &template).await?);
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    Ok(vec![hit, miss, ready])
}

/// Runs every case.
pub async fn run(bench: &WarmBench) -> anyhow::Result<(Vec<Series>, WarmFigures)> {
    std::fs::create_dir_all(&bench.work_dir)?;
    let emulator = Emulator::start(
        201..=250,
        Backend::Memory,
        Some(&bench.work_dir.join("emulator.log")),
    )?;
    emulator.create_bucket("warm").await?;
    let endpoint = emulator.endpoint();
    let mut figures = WarmFigures {
        burst: bench.burst,
        ..WarmFigures::default()
    };
    build_template(&bench.images_dir, &bench.work_dir)
        .await
        .context("building the template bench-ready")?;
    let mut series = creates(bench, "loopback", &endpoint, &mut figures).await?;
    // The same through the storage model's `gcs-regional` profile: each
    // server reaches the emulator through a proxy of its own.
    let model = StorageModel::new(emulator.socket_addr(), Profile::gcs_regional());
    let proxy = model.proxy("warm-regional").await?;
    let mut regional = WarmFigures::default();
    series.extend(creates(bench, "gcs-regional", &proxy.endpoint(), &mut regional).await?);
    figures.ready_first_regional = regional.ready_first;
    drop(proxy);
    let plain = json!({});
    // The burst: a pool sized for it, a neighbour running executions.
    let mut at_rest = Series::named("neighbour's echo hi, pool full (at rest)");
    let mut refilling = Series::named("neighbour's echo hi, pool refilling");
    let mut burst = Series::named("create, back to back (loopback)");
    {
        let size = bench.burst;
        let pooled = server(bench, "warm-c", &endpoint, size).await?;
        let url = format!("ws://{}", pooled.addr);
        let neighbour = Sandbox::create(&url, CreateOptions::default()).await?;
        pool_full(&pooled, size).await?;
        for _ in 0..bench.runs {
            at_rest.samples.push(echo_round_trip(&neighbour).await?);
        }
        let before = metric(&pooled, "sandboxd_warm_pool_hits_total").await?;
        burst
            .samples
            .extend(python_creates(&url, size, &plain).await?);
        figures.burst_hits =
            (metric(&pooled, "sandboxd_warm_pool_hits_total").await? - before) as u64;
        // The refill boots one at a time behind the burst: the neighbour's
        // round trips meanwhile.
        while metric(&pooled, "sandboxd_warm_pool_ready").await? < size as f64 {
            refilling.samples.push(echo_round_trip(&neighbour).await?);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        neighbour.kill().await?;
    }
    series.extend([burst, at_rest, refilling]);
    Ok((series, figures))
}

pub fn render_figures(figures: &WarmFigures) -> String {
    format!(
        "burst: {} of {} back-to-back creates were pool hits\n\
         ready template: first create on the instance (boot, start command, checkpoint, restore) {:.2} s (gcs-regional {:.2} s)\n\
         warm pool memory: {} per ready sandbox\n",
        figures.burst_hits,
        figures.burst,
        figures.ready_first.as_secs_f64(),
        figures.ready_first_regional.as_secs_f64(),
        figures
            .pool_memory_mb_per_sandbox
            .map_or_else(|| "unknown".to_owned(), |mb| format!("{mb:.0} MB")),
    )
}

pub fn figures_json(figures: &WarmFigures) -> serde_json::Value {
    json!({
        "burst": figures.burst,
        "burst_hits": figures.burst_hits,
        "ready_first_create_s": figures.ready_first.as_secs_f64(),
        "ready_first_create_gcs_regional_s": figures.ready_first_regional.as_secs_f64(),
        "pool_memory_mb_per_sandbox": figures.pool_memory_mb_per_sandbox,
    })
}
