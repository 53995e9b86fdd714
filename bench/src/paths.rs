//! The critical paths in round trips: create, checkpoint, attach + restore
//! and handoff in each state its holder can be in, driven by a plain Python
//! `websockets` client (default options), timed from the client's send (or
//! connect) to the status it waits for; and, from the storage model's
//! records (`testkit::storage`), the store requests each one made: the
//! total, how many were sequential, what they cost.
//!
//! Which requests belong to an operation: those that started in its window
//! and touched its sandbox's objects (its `metadata.json` and `lock.json`),
//! any checkpoint's objects, any instance's lease (a taker reads the
//! holder's, an acquirer may renew its own), a doorbell write (a ring), and
//! the first read of the holder's doorbell after the last ring (the read
//! that hears it). Listings and the other doorbell polls are background and
//! left out; "window" counts everything that started in the window.
//!
//! Sequential requests are counted twice: all of them ("seq"), and without
//! the polls that found their object as the same instance's previous read
//! had ("news": a taker polling the lock while the holder checkpoints waits
//! on the holder's transfer and on the one read that sees it, not on the
//! polls before; `testkit::storage::without_repeated_reads`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use serde_json::{Value, json};
use testkit::storage::{RequestKind, RequestRecord, StorageModel, Tally};

use crate::series::Series;

/// The Python client: prints one JSON line per measured operation.
const PATHS_CLIENT: &str = r#"
import asyncio, json, random, sys, time
import websockets

A, B, RUNS, QUIET, WAIT = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
RETRIES = int(sys.argv[6])
OPTIONS = {"idle_timeout": 900, "enable_checkpoint": True, "enable_sandbox_handoff": True}

def note(op, sandbox, start, holder, to):
    print(json.dumps({"op": op, "sandbox": sandbox, "start": start, "end": time.time(), "holder": holder, "to": to}), flush=True)

class Refused(Exception):
    pass

async def until(ws, status):
    seen = []
    while True:
        try:
            frame = json.loads(await ws.recv())
        except websockets.ConnectionClosed as closed:
            raise SystemExit(f"the server closed ({closed}) before {status}; frames: {seen}")
        seen.append(frame)
        if frame.get("status") == status:
            return frame
        if str(frame.get("status", "")).endswith("ERROR"):
            raise Refused(f"the server refused: {frame}")

async def drain(ws):
    try:
        while True:
            await ws.recv()
    except websockets.ConnectionClosed:
        pass

async def create(url):
    start = time.time()
    ws = await websockets.connect(url + "/create")
    await ws.send(json.dumps(OPTIONS))
    ident = token = None
    while True:
        frame = json.loads(await ws.recv())
        if frame.get("event") == "sandbox_id":
            ident, token = frame["sandbox_id"], frame["sandbox_token"]
        if frame.get("status") == "SANDBOX_RUNNING":
            return ws, ident, token, start
        if str(frame.get("status", "")).endswith("ERROR"):
            raise SystemExit(f"the server refused: {frame}")

async def attach(url, ident, token):
    # A refusal that says "attach again" is retried RETRIES times (0 by
    # default: any refusal fails the benchmark), timed from the first connect.
    for attempt in range(RETRIES + 1):
        ws = await websockets.connect(f"{url}/attach/{ident}?sandbox_token={token}")
        try:
            await until(ws, "SANDBOX_RUNNING")
            return ws
        except Refused as refused:
            if attempt == RETRIES or "attach again" not in str(refused):
                raise SystemExit(str(refused))
            print(json.dumps({"retry": str(refused)}), flush=True)
            await drain(ws)

async def run(ws, code):
    await ws.send(json.dumps({"language": "bash", "code": code}))
    await until(ws, "SANDBOX_EXECUTION_DONE")

async def kill(ws):
    await ws.send(json.dumps({"action": "kill_sandbox"}))
    await drain(ws)

async def main():
    background = []
    for _ in range(RUNS):
        ws, ident, token, start = await create(A)
        note("create", ident, start, "a", "a")
        await run(ws, "echo state > /tmp/state")
        start = time.time()
        await ws.send(json.dumps({"action": "checkpoint"}))
        await until(ws, "SANDBOX_CHECKPOINTED")
        note("checkpoint", ident, start, "a", "a")
        await drain(ws)
        start = time.time()
        ws = await attach(A, ident, token)
        note("attach + restore", ident, start, "a", "a")
        await run(ws, "echo active")
        start = time.time()
        moved = await attach(B, ident, token)
        note("handoff: attached and active", ident, start, "a", "b")
        background.append(asyncio.create_task(drain(ws)))
        await moved.close()
        await asyncio.sleep(1.0)
        start = time.time()
        back = await attach(A, ident, token)
        note("handoff: left 1 s ago", ident, start, "b", "a")
        # In use for 2 s (a command every 0.2 s), then moved: the attached
        # and active state without a move or restore just before it.
        until_moved = time.time() + 2.0
        while time.time() < until_moved:
            await run(back, "sleep 0.2")
        start = time.time()
        moved = await attach(B, ident, token)
        note("handoff: attached and active, in use 2 s", ident, start, "a", "b")
        background.append(asyncio.create_task(drain(back)))
        await kill(moved)
        await asyncio.sleep(0.5)
    if QUIET > 0:
        quiet, gone = [], []
        for _ in range(QUIET):
            ws, ident, token, _ = await create(A)
            await run(ws, "echo state > /tmp/state")
            quiet.append((ws, ident, token))
            ws, ident, token, _ = await create(A)
            await run(ws, "echo state > /tmp/state")
            await ws.close()
            gone.append((ident, token))
        await asyncio.sleep(WAIT)
        for ident, token in gone:
            await asyncio.sleep(random.random())
            start = time.time()
            moved = await attach(B, ident, token)
            note("handoff: left >= 90 s ago", ident, start, "a", "b")
            await kill(moved)
        for old, ident, token in quiet:
            await asyncio.sleep(random.random())
            start = time.time()
            moved = await attach(B, ident, token)
            note("handoff: attached and quiet >= 90 s", ident, start, "a", "b")
            background.append(asyncio.create_task(drain(old)))
            await kill(moved)
    for task in background:
        task.cancel()

try:
    asyncio.run(main())
except Refused as refused:
    raise SystemExit(str(refused))
"#;

/// The operations in the order they are printed.
const OPERATIONS: [&str; 7] = [
    "create",
    "checkpoint",
    "attach + restore",
    "handoff: attached and active",
    "handoff: attached and active, in use 2 s",
    "handoff: attached and quiet >= 90 s",
    "handoff: left 1 s ago",
];
const LONG_GONE: &str = "handoff: left >= 90 s ago";

/// One operation's samples: latency and store requests.
#[derive(Debug, Clone)]
pub struct PathSeries {
    pub latency: Series,
    pub requests: Vec<Tally>,
    /// Everything that started in each window, background included.
    pub window: Vec<Tally>,
}

/// One measured operation, as the Python client printed it.
struct Measured {
    op: String,
    sandbox: String,
    start: Instant,
    end: Instant,
    holder: String,
}

/// Runs the Python client against A (`url_a`, instance `a_name`) and B;
/// `quiet` sandboxes of each 90-s state (0 skips them).
pub async fn measure(
    model: &StorageModel,
    urls: (&str, &str),
    names: (&str, &str),
    runs: usize,
    quiet: usize,
) -> anyhow::Result<Vec<PathSeries>> {
    // `SANDBOXD_BENCH_ATTACH_RETRIES=N`: an attach refused with "attach
    // again" is retried N times, timed from its first connect (for an A/B
    // against a build that refuses so; by default any refusal fails).
    let attach_retries: usize = match std::env::var("SANDBOXD_BENCH_ATTACH_RETRIES") {
        Ok(value) => value
            .parse()
            .context("SANDBOXD_BENCH_ATTACH_RETRIES is not a whole number")?,
        Err(_) => 0,
    };
    // The client prints wall-clock times; the records are `Instant`s.
    let (instant0, wall0) = (Instant::now(), SystemTime::now());
    let wall0 = wall0.duration_since(UNIX_EPOCH)?.as_secs_f64();
    let at = |seconds: f64| {
        let offset = seconds - wall0;
        if offset >= 0.0 {
            instant0 + Duration::from_secs_f64(offset)
        } else {
            instant0 - Duration::from_secs_f64(-offset)
        }
    };
    let output = tokio::process::Command::new("python3")
        .args([
            "-c",
            PATHS_CLIENT,
            urls.0,
            urls.1,
            &runs.to_string(),
            &quiet.to_string(),
            "95",
            &attach_retries.to_string(),
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
        "the Python paths client failed: {stderr}"
    );
    let mut measured = Vec::new();
    let mut retried = 0;
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        let value: Value = serde_json::from_str(line).context("the Python client's output")?;
        if value.get("retry").is_some() {
            retried += 1;
            continue;
        }
        let field = |key: &str| value[key].as_str().unwrap_or_default().to_owned();
        let holder = match field("holder").as_str() {
            "a" => names.0.to_owned(),
            _ => names.1.to_owned(),
        };
        measured.push(Measured {
            op: field("op"),
            sandbox: field("sandbox"),
            start: at(value["start"].as_f64().unwrap_or_default()),
            end: at(value["end"].as_f64().unwrap_or_default()),
            holder,
        });
    }
    if retried > 0 {
        println!("attaches retried after a refusal that said \"attach again\": {retried}");
    }
    let records = model.records();
    let mut by_op: BTreeMap<String, PathSeries> = BTreeMap::new();
    for m in &measured {
        let window: Vec<&RequestRecord> = records
            .iter()
            .filter(|r| r.start >= m.start && r.start < m.end)
            .collect();
        let on_path = on_the_path(&window, &m.sandbox, &m.holder);
        if std::env::var_os("SANDBOXD_BENCH_TRACE_PATHS").is_some() {
            trace(m, &on_path);
        }
        let series = by_op.entry(m.op.clone()).or_insert_with(|| PathSeries {
            latency: Series::named(m.op.clone()),
            requests: Vec::new(),
            window: Vec::new(),
        });
        series.latency.samples.push(m.end.duration_since(m.start));
        series.requests.push(Tally::of(on_path));
        series.window.push(Tally::of(window.iter().copied()));
    }
    let mut ordered = Vec::new();
    for name in OPERATIONS.iter().chain(std::iter::once(&LONG_GONE)) {
        if let Some(series) = by_op.remove(*name) {
            ordered.push(series);
        }
    }
    Ok(ordered)
}

/// Prints one operation's requests on its path, in order of their start
/// (`SANDBOXD_BENCH_TRACE_PATHS=1`): which request made a path long.
fn trace(m: &Measured, on_path: &[&RequestRecord]) {
    let mut ordered = on_path.to_vec();
    ordered.sort_by_key(|r| r.start);
    let ms = |at: Instant| at.saturating_duration_since(m.start).as_millis();
    let news = testkit::storage::without_repeated_reads(&ordered);
    eprintln!(
        "trace {} {} ({} ms, {} sequential, {} without repeated polls):",
        m.op,
        m.sandbox,
        m.end.duration_since(m.start).as_millis(),
        testkit::storage::sequential(&ordered),
        testkit::storage::sequential(&news)
    );
    for r in ordered {
        let repeat = !news.iter().any(|kept| std::ptr::eq(*kept, r));
        eprintln!(
            "  {:>5}-{:<5} {:<10} {:<6} {} {}{}",
            ms(r.start),
            ms(r.end),
            r.instance,
            r.method,
            r.status,
            r.object,
            if repeat { " (repeat)" } else { "" }
        );
    }
}

/// The requests of `window` that belong to the operation (module docs).
fn on_the_path<'a>(
    window: &[&'a RequestRecord],
    sandbox: &str,
    holder: &str,
) -> Vec<&'a RequestRecord> {
    let is_doorbell = |r: &RequestRecord| r.object.ends_with("/doorbell.json");
    let last_ring = window
        .iter()
        .filter(|r| is_doorbell(r) && r.kind == RequestKind::Write)
        .map(|r| r.end)
        .max();
    let heard = last_ring.and_then(|rung| {
        window
            .iter()
            .filter(|r| {
                is_doorbell(r)
                    && r.kind == RequestKind::Read
                    && r.instance == holder
                    && r.start >= rung
            })
            .min_by_key(|r| r.start)
            .map(|r| r.start)
    });
    window
        .iter()
        .copied()
        .filter(|r| {
            (!sandbox.is_empty() && r.object.contains(sandbox))
                || r.object.starts_with("sandbox_checkpoints/")
                || r.object.ends_with("/lease.json")
                || (is_doorbell(r) && r.kind == RequestKind::Write)
                || (is_doorbell(r)
                    && r.kind == RequestKind::Read
                    && r.instance == holder
                    && Some(r.start) == heard)
        })
        .collect()
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or_default()
}

/// The table: latency (median, p90, max), store requests on the path
/// (sequential median and max, total, reads/writes), the window's total,
/// and the dollars per 1,000 operations.
pub fn render(profile: &str, all: &[PathSeries]) -> String {
    let mut out = format!(
        "critical paths under storage profile {profile} (Python websockets client)\n{:<38} {:>8} {:>8} {:>8} {:>9} {:>6} {:>9} {:>6} {:>7} {:>7} {:>7} {:>9} {:>3}\n",
        "operation",
        "med ms",
        "p90 ms",
        "max ms",
        "seq med",
        "max",
        "news med",
        "max",
        "total",
        "reads",
        "writes",
        "$/1000",
        "n"
    );
    for series in all {
        let pick = |f: fn(&Tally) -> usize| -> f64 {
            median(
                &mut series
                    .requests
                    .iter()
                    .map(|t| f(t) as f64)
                    .collect::<Vec<_>>(),
            )
        };
        let most = |f: fn(&Tally) -> usize| series.requests.iter().map(f).max().unwrap_or(0);
        let dollars = median(
            &mut series
                .requests
                .iter()
                .map(Tally::dollars)
                .collect::<Vec<_>>(),
        );
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let max = series
            .latency
            .samples
            .iter()
            .max()
            .copied()
            .unwrap_or_default();
        out.push_str(&format!(
            "{:<38} {:>8.0} {:>8.0} {:>8.0} {:>9.0} {:>6} {:>9.0} {:>6} {:>7.0} {:>7.0} {:>7.0} {:>9.4} {:>3}\n",
            series.latency.name,
            ms(series.latency.median()),
            ms(series.latency.p90()),
            ms(max),
            pick(|t| t.sequential),
            most(|t| t.sequential),
            pick(|t| t.sequential_news),
            most(|t| t.sequential_news),
            pick(|t| t.total),
            pick(|t| t.reads),
            pick(|t| t.writes + t.lists),
            dollars * 1000.0,
            series.latency.samples.len(),
        ));
    }
    let throttled: usize = all
        .iter()
        .flat_map(|s| &s.window)
        .map(|t| t.throttled)
        .sum();
    out.push_str(&format!(
        "(seq/total: store requests on the operation's path, medians; news: seq without the polls that found nothing new; $/1000: their GCS price per 1,000 operations; 429s in all windows: {throttled})\n"
    ));
    out
}

pub fn to_json(profile: &str, all: &[PathSeries]) -> Value {
    json!({
        "storage_profile": profile,
        "paths": all.iter().map(|series| json!({
            "operation": series.latency.name,
            "median_ms": series.latency.median().as_secs_f64() * 1000.0,
            "p90_ms": series.latency.p90().as_secs_f64() * 1000.0,
            "max_ms": series.latency.samples.iter().max().copied().unwrap_or_default().as_secs_f64() * 1000.0,
            "sequential": series.requests.iter().map(|t| t.sequential).collect::<Vec<_>>(),
            "sequential_news": series.requests.iter().map(|t| t.sequential_news).collect::<Vec<_>>(),
            "total": series.requests.iter().map(|t| t.total).collect::<Vec<_>>(),
            "window_total": series.window.iter().map(|t| t.total).collect::<Vec<_>>(),
            "dollars": series.requests.iter().map(Tally::dollars).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}
