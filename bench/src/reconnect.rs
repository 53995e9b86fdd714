//! A mass reconnect (a network blip): N sandboxes held by A, their clients
//! still attached to A, all reconnect through B and C within one second
//! (Python `websockets` clients, alternating B and C, start times spread
//! evenly over the second). Prints the time from the first attach to the
//! last `SANDBOX_RUNNING`, every attach's outcome, and the 429s the storage
//! model answered meanwhile (GCS's per-object mutation rate: rings to one
//! holder's doorbell are writes to one object).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde_json::{Value, json};
use testkit::storage::{StorageModel, Tally};

const RECONNECT_CLIENT: &str = r#"
import asyncio, json, sys, time
import websockets

A, B, C, N, SPREAD = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
OPTIONS = {"idle_timeout": 900, "enable_checkpoint": True, "enable_sandbox_handoff": True}

async def drain(ws):
    try:
        while True:
            await ws.recv()
    except websockets.ConnectionClosed:
        pass

async def create():
    ws = await websockets.connect(A + "/create")
    await ws.send(json.dumps(OPTIONS))
    ident = token = None
    while True:
        frame = json.loads(await ws.recv())
        if frame.get("event") == "sandbox_id":
            ident, token = frame["sandbox_id"], frame["sandbox_token"]
        if frame.get("status") == "SANDBOX_RUNNING":
            return ws, ident, token
        if str(frame.get("status", "")).endswith("ERROR"):
            raise SystemExit(f"create refused: {frame}")

async def reconnect(n, ident, token, began):
    await asyncio.sleep(SPREAD * n / max(N, 1))
    url = B if n % 2 == 0 else C
    start = time.time()
    try:
        ws = await websockets.connect(f"{url}/attach/{ident}?sandbox_token={token}")
        while True:
            frame = json.loads(await asyncio.wait_for(ws.recv(), 120))
            status = str(frame.get("status", ""))
            if status == "SANDBOX_RUNNING":
                return {"n": n, "ok": True, "start": start, "end": time.time(), "ws": ws}
            if status.endswith("ERROR"):
                return {"n": n, "ok": False, "status": status, "detail": frame, "start": start, "end": time.time()}
    except Exception as err:
        return {"n": n, "ok": False, "status": repr(err), "start": start, "end": time.time()}

async def main():
    held = [await create() for _ in range(N)]
    for ws, _, _ in held:
        await ws.send(json.dumps({"language": "bash", "code": "echo state > /tmp/state"}))
    await asyncio.sleep(2)
    drains = [asyncio.create_task(drain(ws)) for ws, _, _ in held]
    began = time.time()
    results = await asyncio.gather(*(reconnect(n, ident, token, began) for n, (_, ident, token) in enumerate(held)))
    done = time.time()
    for r in results:
        ws = r.pop("ws", None)
        if ws is not None:
            await ws.send(json.dumps({"action": "kill_sandbox"}))
            await drain(ws)
        r.pop("detail", None)
    for task in drains:
        task.cancel()
    print(json.dumps({"began": began, "done": done, "results": results}))

asyncio.run(main())
"#;

/// What the mass reconnect showed.
#[derive(Debug, Clone)]
pub struct Reconnect {
    pub sandboxes: usize,
    pub running: usize,
    /// From the first attach to the last `SANDBOX_RUNNING` (or failure).
    pub all_done: Duration,
    /// The median attach, from its connect to its `SANDBOX_RUNNING`.
    pub median: Duration,
    pub slowest: Duration,
    pub failures: Vec<String>,
    /// Store requests while the attaches ran, with the 429s among them.
    pub requests: Tally,
    /// The same requests by instance, kind and object, most first.
    pub breakdown: Vec<(String, usize)>,
}

/// What a request was for: the instance whose proxy it went through, its
/// kind, and its object's last name with the ids left out
/// (`bench-a read lock.json 404`), so a run shows which polls and writes
/// it made.
fn class_of(record: &testkit::storage::RequestRecord) -> String {
    let name = record.object.rsplit('/').next().unwrap_or_default();
    let name = if name.is_empty() { "(listing)" } else { name };
    let status = match record.status {
        200..=299 => String::new(),
        status => format!(" {status}"),
    };
    format!("{} {:?} {name}{status}", record.instance, record.kind).to_lowercase()
}

/// `records` counted by [`class_of`], most first.
fn breakdown(records: &[testkit::storage::RequestRecord]) -> Vec<(String, usize)> {
    let mut counts = std::collections::BTreeMap::<String, usize>::new();
    for record in records {
        *counts.entry(class_of(record)).or_default() += 1;
    }
    let mut counts: Vec<(String, usize)> = counts.into_iter().collect();
    counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    counts
}

pub async fn measure(
    model: &StorageModel,
    urls: [&str; 3],
    sandboxes: usize,
) -> anyhow::Result<Reconnect> {
    let started = Instant::now();
    let output = tokio::process::Command::new("python3")
        .args([
            "-c",
            RECONNECT_CLIENT,
            urls[0],
            urls[1],
            urls[2],
            &sandboxes.to_string(),
            "1.0",
        ])
        .output()
        .await
        .context("running python3 for the websockets clients")?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    anyhow::ensure!(
        output.status.success(),
        "the Python reconnect clients failed: {stderr}"
    );
    let report: Value =
        serde_json::from_slice(&output.stdout).context("the Python clients' output")?;
    let results = report["results"].as_array().cloned().unwrap_or_default();
    let began = report["began"].as_f64().unwrap_or_default();
    let mut all_done = 0.0_f64;
    let mut slowest = 0.0_f64;
    let mut failures = Vec::new();
    let mut running = 0;
    let mut attaches = Vec::new();
    for result in &results {
        let start = result["start"].as_f64().unwrap_or_default();
        let end = result["end"].as_f64().unwrap_or_default();
        all_done = all_done.max(end - began);
        slowest = slowest.max(end - start);
        attaches.push(end - start);
        if result["ok"].as_bool() == Some(true) {
            running += 1;
        } else {
            failures.push(format!("#{}: {}", result["n"], result["status"]));
        }
    }
    // The records of the reconnect: from the first attach (the creates
    // before it started at `started`) to the end.
    let wall_now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs_f64();
    let since_began = Duration::from_secs_f64((wall_now - began).max(0.0));
    let from = Instant::now()
        .checked_sub(since_began)
        .unwrap_or(started)
        .max(started);
    let records = model.records_between(from, Instant::now());
    let requests = Tally::of(&records);
    attaches.sort_by(f64::total_cmp);
    let median = attaches
        .get(attaches.len() / 2)
        .copied()
        .unwrap_or_default();
    Ok(Reconnect {
        sandboxes,
        running,
        all_done: Duration::from_secs_f64(all_done.max(0.0)),
        median: Duration::from_secs_f64(median.max(0.0)),
        slowest: Duration::from_secs_f64(slowest.max(0.0)),
        failures,
        requests,
        breakdown: breakdown(&records),
    })
}

pub fn render(profile: &str, r: &Reconnect) -> String {
    format!(
        "mass reconnect under {profile}: {} sandboxes held by A, clients reconnect through B and C within 1 s: \
         {} SANDBOX_RUNNING, all done {:.2} s after the first attach, median attach {:.2} s, slowest {:.2} s; \
         store requests meanwhile {} ({} answered 429; by instance, kind and object: {}); failures: {}\n",
        r.sandboxes,
        r.running,
        r.all_done.as_secs_f64(),
        r.median.as_secs_f64(),
        r.slowest.as_secs_f64(),
        r.requests.total,
        r.requests.throttled,
        r.breakdown
            .iter()
            .map(|(class, n)| format!("{class} {n}"))
            .collect::<Vec<_>>()
            .join(", "),
        if r.failures.is_empty() {
            "none".to_owned()
        } else {
            r.failures.join("; ")
        }
    )
}

pub fn to_json(profile: &str, r: &Reconnect) -> Value {
    json!({
        "storage_profile": profile,
        "sandboxes": r.sandboxes,
        "running": r.running,
        "all_running_s": r.all_done.as_secs_f64(),
        "median_attach_s": r.median.as_secs_f64(),
        "slowest_attach_s": r.slowest.as_secs_f64(),
        "requests": r.requests.total,
        "throttled_429": r.requests.throttled,
        "requests_by_class": r.breakdown.iter().map(|(class, n)| json!({"class": class, "count": n})).collect::<Vec<_>>(),
        "failures": r.failures,
    })
}
