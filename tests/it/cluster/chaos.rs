//! The chaos run: three real `sandboxd` processes (fast leases: 6 s lease,
//! 1 s skew, 2 s renew and resync) on a disk-backed fake-gcs-server, behind
//! the HAProxy of `deploy/local`, and a dozen clients creating sandboxes,
//! executing, checkpointing, detaching and re-attaching through random
//! instances (directly and through the proxy), while a fault loop SIGKILLs an
//! instance (a replacement with a new instance id takes its port), freezes one
//! with SIGSTOP for longer than a lease, drains one with SIGTERM (and restarts
//! it), restarts the storage emulator, and cuts one instance off the bucket
//! for longer than a lease while its clients stay connected (black-holed or
//! refused, in turn). Every instance reaches the emulator through its own
//! proxy of the storage model (`testkit::storage`) with `gcs-regional`
//! latency (GCS's per-object mutation rate included) and 1 % of requests
//! answered 429 or 503 at random.
//!
//! Checked from what the clients observed, and the test fails on any
//! violation:
//! - (a) no sandbox acknowledged executions on two instances in overlapping
//!   time: an execution's acknowledgement (`SANDBOX_EXECUTION_DONE`) on a
//!   socket that reached `SANDBOX_RUNNING` at `r` is a violation if another
//!   instance acknowledged something for that sandbox after `r`. Sockets
//!   abandoned because their instance froze are drained in the background,
//!   so a late acknowledgement is seen. A `SANDBOX_CHECKPOINTED` is not held
//!   to this rule: the server sends it once the checkpoint is safe (carried
//!   by the hand-back, or recorded) and the hold released (decision 21), so
//!   one that a frozen instance delivers late reports
//!   a checkpoint made before the next instance could acquire the sandbox
//!   (a CI run saw exactly that: the freeze fell between the release and the
//!   frame). Whether it is real is what (b) checks: the acknowledged state
//!   becomes the floor every later state must start with.
//! - (b) no acknowledged checkpoint lost: every execution appends a unique
//!   number to a file and prints it (one that does not run to its end, exit
//!   code 0 and not force-killed by a handoff or a drain, acknowledges
//!   nothing for (b)); every printed file holds only numbers
//!   that were sent, none twice, starts with the file as the socket that
//!   took the last acknowledged checkpoint printed it before (so it holds
//!   every number acknowledged before that checkpoint, in order), and never
//!   again holds a number an earlier file had lost. Executions acknowledged
//!   after the last checkpoint may be lost when the holder is killed or frozen
//!   past its lease (a crash loses what came after the last checkpoint): they
//!   are counted, not failed. After the run every sandbox with an
//!   acknowledged checkpoint is attached once more and checked.
//! - (c) every create or attach ends in `SANDBOX_RUNNING` or a clear error (an
//!   error status, an HTTP refusal, a close frame with a code or reason)
//!   within 60 s; a connection dropped without a word is allowed only when
//!   its instance was killed, frozen or drained meanwhile (not when it was
//!   cut off the bucket: its clients must be told).
//!
//! Also: every drain exits cleanly in time, every replacement starts, and no
//! server log shows a panic. Each violation shows the sandbox's recent
//! history as its client saw it; on failure the server logs are kept in
//! `$TMPDIR/chaos-logs-<seed>`.
//!
//! `CHAOS_SECS` (default 60) sets the length, `CHAOS_SEED` the random
//! choices (timing is not reproducible), `CHAOS_TRACE` prints every
//! execution's outcome; `CHAOS_SECS=600 cargo test --test it cluster::chaos --
//! --nocapture` is the long run. The figures are printed at the end. The
//! tests at the end are the smallest reproductions of the server bugs the run
//! found (fixed: `SandboxController::drain` hands over what another instance
//! asked for; `fence_exit` reports an exit only while the hold is vouched for).

use crate::support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use support::disk_emulator::DiskEmulator;
use support::process::{Launch, ServerProcess, free_port};
use support::proxy::Proxy;
use testkit::storage::{InstanceProxy, Partition, Profile, StorageModel, Tally};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

const CLIENTS: usize = 12;
const SLOTS: usize = 3;
const BUCKET: &str = "chaos";
/// (c): a create or attach ends within this.
const ATTACH_BOUND: Duration = Duration::from_secs(60);
/// An execution not acknowledged within this is abandoned to a drain task
/// and the client moves on: shorter than a freeze, so a frozen holder's
/// socket is abandoned with an execution pending and the sandbox taken over.
const EXEC_WAIT: Duration = Duration::from_secs(8);
/// As [`EXEC_WAIT`], for a checkpoint.
const CHECKPOINT_WAIT: Duration = Duration::from_secs(8);
/// Longer than the fast lease (6 s) plus its skew (1 s).
const FREEZE: Duration = Duration::from_secs(10);
/// How long an instance is cut off the bucket: longer than a lease.
const PARTITION: Duration = Duration::from_secs(10);
/// The share of store requests the model answers 429 or 503 at random.
const TRANSIENT_SHARE: f64 = 0.01;
/// How long a SIGTERM drain may take.
const DRAIN_BOUND: Duration = Duration::from_secs(120);
/// How long the final check tries to reach each sandbox.
const FINAL_BOUND: Duration = Duration::from_secs(150);

type Socket = WebSocketStream<MaybeTlsStream<TcpStream>>;

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the clients know of one port's current process.
#[derive(Clone, Debug)]
struct SlotView {
    instance: String,
    /// Grows on every kill, freeze and drain of this port's process.
    faults: u64,
}

#[derive(Default, Debug)]
struct Stats {
    creates: u64,
    attaches: u64,
    running: u64,
    via_proxy: u64,
    execs: u64,
    checkpoints: u64,
    detaches: u64,
    switches: u64,
    abandoned: u64,
    late_acks: u64,
    handoffs: u64,
    takeovers: u64,
    kills: u64,
    freezes: u64,
    drains: u64,
    emulator_restarts: u64,
    partitions: u64,
    lost_after_checkpoint: u64,
    given_up: u64,
    final_checked: u64,
    slowest_attach: Duration,
    errors: BTreeMap<String, u64>,
}

struct Cluster {
    ports: Vec<u16>,
    proxy_port: u16,
    slots: Mutex<Vec<SlotView>>,
    /// When each instance was last killed or frozen.
    faulted: Mutex<HashMap<String, Instant>>,
    stats: Mutex<Stats>,
    violations: Mutex<Vec<String>>,
    next_number: AtomicU64,
    /// The instance that acknowledged the last execution: the faults aim at
    /// it, so they hit an instance with clients at work.
    busiest: Mutex<String>,
    stop: AtomicBool,
    started: Instant,
}

impl Cluster {
    fn secs(&self, at: Instant) -> f64 {
        at.duration_since(self.started).as_secs_f64()
    }

    fn violation(&self, text: String) {
        eprintln!("VIOLATION at {:.1} s: {text}", self.secs(Instant::now()));
        lock(&self.violations).push(text);
    }

    fn error(&self, kind: &str) {
        *lock(&self.stats).errors.entry(kind.to_owned()).or_default() += 1;
    }

    fn slot(&self, slot: usize) -> SlotView {
        lock(&self.slots)[slot].clone()
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
}

/// What one client knows of its sandbox.
#[derive(Default)]
struct Record {
    id: String,
    token: String,
    /// Number → when it was sent.
    sent: HashMap<u64, Instant>,
    /// Numbers acknowledged, in the order they were.
    acked: Vec<u64>,
    /// Every acknowledgement: instance, when.
    acks: Vec<(String, Instant)>,
    /// The file as of the last acknowledged checkpoint.
    floor: Vec<u64>,
    /// Acknowledged numbers a printed file no longer had.
    lost: HashSet<u64>,
    last_running: Option<(String, Instant)>,
    has_checkpoint: bool,
    /// What the client saw, for the violation reports.
    history: Vec<String>,
}

impl Record {
    fn saw(&mut self, cluster: &Cluster, what: String) {
        self.history
            .push(format!("{:.1} s {what}", cluster.secs(Instant::now())));
    }

    /// The last things the client saw of this sandbox.
    fn recent(&self) -> String {
        let from = self.history.len().saturating_sub(12);
        self.history[from..].join("\n        ")
    }
}

type Shared = Arc<Mutex<Record>>;

/// An attached socket.
struct Conn {
    ws: Socket,
    instance: String,
    running_at: Instant,
    /// The file as the last execution acknowledged on this socket printed it.
    last_file: Option<Vec<u64>>,
}

/// What a socket is waiting for.
enum Pending {
    /// An execution: its stdout so far, its exit code, and whether it was
    /// force-killed (a handoff's or a drain's checkpoint).
    Exec {
        number: u64,
        stdout: String,
        exit: Option<i64>,
        killed: bool,
    },
    Checkpoint,
    Nothing,
}

#[derive(Debug)]
enum Outcome {
    Acked,
    Error(String),
    Closed(String),
    TimedOut,
}

#[derive(Clone, Copy)]
enum Target {
    Slot(usize),
    Proxy,
}

fn init() -> Value {
    json!({"idle_timeout": 3600, "enable_checkpoint": true, "enable_sandbox_handoff": true})
}

fn slot_name(slot: usize) -> String {
    format!("slot{slot}")
}

/// A status that ends a create, attach, execution or checkpoint in failure.
/// (`SANDBOX_DELETED` is not one: a checkpoint's sequence ends with it.)
fn is_error_status(status: &str) -> bool {
    status.ends_with("_ERROR") || matches!(status, "SANDBOX_NOT_FOUND" | "SANDBOX_IN_USE")
}

/// Records an acknowledgement on `conn` and checks (a) and, for an
/// execution that ran to its end (exit code 0, not force-killed), (b).
/// Returns false for an execution that did not: an acknowledgement for (a),
/// but its number is not acknowledged and its output not a whole file.
fn acknowledge(cluster: &Cluster, record: &Shared, conn: &mut Conn, pending: &Pending) -> bool {
    let now = Instant::now();
    let instance = conn.instance.as_str();
    let mut r = lock(record);
    let overlapping = r
        .acks
        .iter()
        .find(|(other, at)| other != instance && *at > conn.running_at)
        .filter(|_| !matches!(pending, Pending::Checkpoint));
    if let Some((other, at)) = overlapping {
        let what = match pending {
            Pending::Exec { number, .. } => format!("execution {number}"),
            _ => "something".to_owned(),
        };
        let text = format!(
            "(a) sandbox {}: {instance} acknowledged {what} at {:.1} s on a socket RUNNING since \
             {:.1} s, but {other} acknowledged for it at {:.1} s; before:\n        {}",
            r.id,
            cluster.secs(now),
            cluster.secs(conn.running_at),
            cluster.secs(*at),
            r.recent()
        );
        cluster.violation(text);
    }
    r.acks.push((instance.to_owned(), now));
    match pending {
        Pending::Exec {
            number,
            exit,
            killed,
            ..
        } if *killed || *exit != Some(0) => {
            r.saw(
                cluster,
                format!("{instance} ended {number}: exit {exit:?}, force-killed {killed}"),
            );
            return false;
        }
        Pending::Exec { number, stdout, .. } => {
            r.acked.push(*number);
            lock(&cluster.stats).execs += 1;
            instance.clone_into(&mut lock(&cluster.busiest));
            let file = check_file(cluster, &mut r, stdout, instance);
            r.saw(
                cluster,
                format!("{instance} acknowledged {number}: {file:?}"),
            );
            conn.last_file = Some(file);
        }
        Pending::Checkpoint => {
            // The checkpoint holds the state this socket last printed; with
            // no execution on it, at least the previous checkpoint's.
            if let Some(file) = &conn.last_file {
                r.floor.clone_from(file);
            }
            r.has_checkpoint = true;
            lock(&cluster.stats).checkpoints += 1;
            let floor = r.floor.clone();
            r.saw(
                cluster,
                format!("{instance} acknowledged a checkpoint of {floor:?}"),
            );
        }
        Pending::Nothing => {}
    }
    true
}

/// (b) on a printed file; returns its numbers.
fn check_file(cluster: &Cluster, r: &mut Record, stdout: &str, instance: &str) -> Vec<u64> {
    let mut file = Vec::new();
    let mut seen = HashSet::new();
    let mut bad = Vec::new();
    for line in stdout.lines() {
        let Ok(number) = line.trim().parse::<u64>() else {
            bad.push(format!("unknown line {line:?}"));
            continue;
        };
        if !r.sent.contains_key(&number) {
            bad.push(format!("{number} was never sent"));
        }
        if !seen.insert(number) {
            bad.push(format!("{number} twice"));
        }
        file.push(number);
    }
    // Every later state grows from the last acknowledged checkpoint's.
    if !file.starts_with(&r.floor) {
        bad.push(format!(
            "does not start with the last acknowledged checkpoint's file {:?}",
            r.floor
        ));
    }
    let back: Vec<u64> = r
        .acked
        .iter()
        .copied()
        .filter(|n| r.lost.contains(n) && seen.contains(n))
        .collect();
    for number in back {
        // Reported once: it counts as kept again from here.
        r.lost.remove(&number);
        bad.push(format!("{number}, lost earlier, is back"));
    }
    let newly_lost: Vec<u64> = r
        .acked
        .iter()
        .copied()
        .filter(|n| !seen.contains(n) && !r.lost.contains(n))
        .collect();
    lock(&cluster.stats).lost_after_checkpoint += newly_lost.len() as u64;
    r.lost.extend(newly_lost);
    if !bad.is_empty() {
        cluster.violation(format!(
            "(b) sandbox {} on {instance}: {}; file {file:?}; before:\n        {}",
            r.id,
            bad.join("; "),
            r.recent()
        ));
    }
    file
}

/// Reads frames until what `pending` waits for, an error status, the close
/// or `deadline`; records an acknowledgement.
async fn wait_ack(
    cluster: &Cluster,
    record: &Shared,
    conn: &mut Conn,
    pending: &mut Pending,
    deadline: Option<tokio::time::Instant>,
) -> Outcome {
    loop {
        let next = match deadline {
            Some(at) => match tokio::time::timeout_at(at, conn.ws.next()).await {
                Ok(next) => next,
                Err(_) => return Outcome::TimedOut,
            },
            None => conn.ws.next().await,
        };
        let text = match next {
            Some(Ok(Message::Text(text))) => text,
            Some(Ok(Message::Close(frame))) => {
                return Outcome::Closed(frame.map_or("close".to_owned(), |f| {
                    format!("close {} {}", u16::from(f.code), f.reason)
                }));
            }
            Some(Ok(_)) => continue,
            Some(Err(err)) => return Outcome::Closed(format!("dropped: {err}")),
            None => return Outcome::Closed("dropped".to_owned()),
        };
        let Ok(frame) = serde_json::from_str::<Value>(text.as_str()) else {
            cluster.violation(format!("a frame that is not JSON: {text}"));
            continue;
        };
        match frame["event"].as_str() {
            Some("stdout") => {
                if let Pending::Exec { stdout, .. } = pending {
                    stdout.push_str(frame["data"].as_str().unwrap_or_default());
                }
            }
            Some("exit_code") => {
                if let Pending::Exec { exit, .. } = pending {
                    *exit = frame["exit_code"].as_i64();
                }
            }
            Some("status_update") => {
                let status = frame["status"].as_str().unwrap_or_default();
                let done = match pending {
                    Pending::Exec { .. } => status == "SANDBOX_EXECUTION_DONE",
                    Pending::Checkpoint => status == "SANDBOX_CHECKPOINTED",
                    Pending::Nothing => false,
                };
                if status == "SANDBOX_EXECUTION_FORCE_KILLED"
                    && let Pending::Exec { killed, .. } = pending
                {
                    *killed = true;
                }
                if done {
                    let whole = acknowledge(cluster, record, conn, pending);
                    *pending = Pending::Nothing;
                    return if whole {
                        Outcome::Acked
                    } else {
                        Outcome::Error("execution killed or failed".to_owned())
                    };
                }
                if is_error_status(status) && !matches!(pending, Pending::Nothing) {
                    return Outcome::Error(status.to_owned());
                }
            }
            _ => {}
        }
    }
}

/// Keeps reading an abandoned socket until it closes, recording late
/// acknowledgements (the run's end aborts it).
fn drain(cluster: Arc<Cluster>, record: Shared, mut conn: Conn, mut pending: Pending) {
    tokio::spawn(async move {
        loop {
            let waiting = !matches!(pending, Pending::Nothing);
            match wait_ack(&cluster, &record, &mut conn, &mut pending, None).await {
                Outcome::Acked if waiting => lock(&cluster.stats).late_acks += 1,
                Outcome::Acked | Outcome::Error(_) => {}
                Outcome::Closed(_) | Outcome::TimedOut => return,
            }
        }
    });
}

/// Opens `path` on `target`: the socket, the slot it reached, and that
/// slot's fault count when the attempt began.
async fn open(
    cluster: &Cluster,
    target: Target,
    path: &str,
) -> Result<(Socket, usize, u64), String> {
    let (port, before) = match target {
        Target::Slot(slot) => (cluster.ports[slot], Some(cluster.slot(slot).faults)),
        Target::Proxy => (cluster.proxy_port, None),
    };
    let faults_at_start: Vec<u64> = lock(&cluster.slots).iter().map(|s| s.faults).collect();
    let url = format!("ws://127.0.0.1:{port}{path}");
    match tokio_tungstenite::connect_async(url.as_str()).await {
        Ok((ws, response)) => {
            let slot = match target {
                Target::Slot(slot) => slot,
                Target::Proxy => {
                    let cookie = response
                        .headers()
                        .get("set-cookie")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default();
                    let Some(slot) = (0..SLOTS)
                        .find(|s| cookie.starts_with(&format!("GAESA={};", slot_name(*s))))
                    else {
                        return Err(format!("proxy: no affinity cookie ({cookie:?})"));
                    };
                    lock(&cluster.stats).via_proxy += 1;
                    slot
                }
            };
            Ok((ws, slot, before.unwrap_or(faults_at_start[slot])))
        }
        Err(tokio_tungstenite::tungstenite::Error::Http(response)) => {
            Err(format!("http {}", response.status().as_u16()))
        }
        Err(tokio_tungstenite::tungstenite::Error::Io(err)) => Err(format!("io {:?}", err.kind())),
        Err(err) => Err(format!("handshake: {err}")),
    }
}

/// `/create` (with `init`) or `/attach`: frames until RUNNING, an error or
/// the close, bounded by (c). Returns the socket and, for `/create`, the id
/// and token.
async fn reach_running(
    cluster: &Cluster,
    target: Target,
    path: &str,
    create: bool,
    what: &str,
) -> Result<(Conn, Option<(String, String)>), String> {
    let started = Instant::now();
    let mut seen: Vec<String> = Vec::new();
    let attempt = async {
        let (mut ws, slot, faults_before) = open(cluster, target, path).await?;
        let connected = cluster.slot(slot).instance;
        seen.push(format!("connected to {connected}"));
        if create {
            ws.send(Message::text(init().to_string()))
                .await
                .map_err(|err| format!("send init: {err}"))?;
        }
        let mut ids = None;
        let mut error = None;
        let end = loop {
            let text = match ws.next().await {
                Some(Ok(Message::Text(text))) => text,
                Some(Ok(Message::Close(frame))) => {
                    break frame.map(|f| (u16::from(f.code), f.reason.to_string()));
                }
                Some(Ok(_)) => continue,
                Some(Err(_)) | None => break None,
            };
            let frame: Value = serde_json::from_str(text.as_str())
                .map_err(|_| format!("a frame that is not JSON: {text}"))?;
            if frame["event"] == "sandbox_id" {
                ids = Some((
                    frame["sandbox_id"].as_str().unwrap_or_default().to_owned(),
                    frame["sandbox_token"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned(),
                ));
            }
            let status = frame["status"].as_str().unwrap_or_default();
            seen.push(format!(
                "{:.1} s {}{}",
                cluster.secs(Instant::now()),
                frame["event"].as_str().unwrap_or_default(),
                if status.is_empty() {
                    String::new()
                } else {
                    format!(" {status}")
                }
            ));
            if status == "SANDBOX_RUNNING" {
                let view = cluster.slot(slot);
                let conn = Conn {
                    ws,
                    instance: view.instance,
                    running_at: Instant::now(),
                    last_file: None,
                };
                return Ok((conn, ids));
            }
            if is_error_status(status) {
                error = Some(status.to_owned());
                // The error frame and the close follow; the status is the answer.
                break Some((0, String::new()));
            }
        };
        if let Some(status) = error {
            return Err(status);
        }
        match end {
            Some((code, reason)) if code != 1000 || !reason.is_empty() => {
                Err(format!("close {code}"))
            }
            _ => {
                // Faulted since the attempt began, or just before it: a
                // kill is recorded before its signal, and a process being
                // killed may still accept a connection for a moment.
                let faulted_around_start = lock(&cluster.faulted)
                    .get(&connected)
                    .is_some_and(|at| *at + Duration::from_secs(1) >= started);
                if cluster.slot(slot).faults != faults_before || faulted_around_start {
                    Err("dropped: instance faulted".to_owned())
                } else {
                    cluster.violation(format!(
                        "(c) {what} on {} ended without RUNNING or a clear error ({end:?}) \
                         after {seen:?}",
                        slot_name(slot)
                    ));
                    Err("unclear end".to_owned())
                }
            }
        }
    };
    let outcome = tokio::time::timeout(ATTACH_BOUND, attempt).await;
    let result = match outcome {
        Ok(result) => result,
        Err(_) => {
            cluster.violation(format!(
                "(c) {what} through {} begun at {:.1} s hung for {ATTACH_BOUND:?}; frames: {seen:?}",
                match target {
                    Target::Slot(slot) => slot_name(slot),
                    Target::Proxy => "the proxy".to_owned(),
                },
                cluster.secs(started)
            ));
            Err("hung".to_owned())
        }
    };
    let mut stats = lock(&cluster.stats);
    stats.slowest_attach = stats.slowest_attach.max(started.elapsed());
    result
}

/// Marks a RUNNING: counts handoffs (another instance than the last) and
/// takeovers (the last one was killed or frozen since).
fn note_running(cluster: &Cluster, record: &Shared, conn: &Conn) {
    let mut r = lock(record);
    let mut stats = lock(&cluster.stats);
    stats.running += 1;
    if let Some((last, at)) = &r.last_running
        && *last != conn.instance
    {
        stats.handoffs += 1;
        if lock(&cluster.faulted)
            .get(last)
            .is_some_and(|fault| fault > at)
        {
            stats.takeovers += 1;
        }
    }
    r.last_running = Some((conn.instance.clone(), conn.running_at));
    let line = format!("RUNNING on {}", conn.instance);
    r.saw(cluster, line);
}

fn pick_target(rng: &mut StdRng) -> Target {
    match rng.random_range(0..=SLOTS) {
        SLOTS => Target::Proxy,
        slot => Target::Slot(slot),
    }
}

async fn send(conn: &mut Conn, frame: Value) -> bool {
    matches!(
        tokio::time::timeout(
            Duration::from_secs(5),
            conn.ws.send(Message::text(frame.to_string()))
        )
        .await,
        Ok(Ok(()))
    )
}

/// One client: one sandbox at a time, random operations until the stop.
async fn client(cluster: Arc<Cluster>, seed: u64) -> Vec<Shared> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut sandboxes: Vec<Shared> = Vec::new();
    let mut record: Option<Shared> = None;
    let mut conn: Option<Conn> = None;
    let mut failures = 0;
    while !cluster.stopping() {
        tokio::time::sleep(Duration::from_millis(rng.random_range(0..300))).await;
        let Some(current) = record.clone() else {
            lock(&cluster.stats).creates += 1;
            match reach_running(&cluster, pick_target(&mut rng), "/create", true, "create").await {
                Ok((created, Some((id, token)))) => {
                    let shared = Arc::new(Mutex::new(Record {
                        id,
                        token,
                        ..Record::default()
                    }));
                    note_running(&cluster, &shared, &created);
                    sandboxes.push(Arc::clone(&shared));
                    record = Some(shared);
                    conn = Some(created);
                }
                Ok((_, None)) => cluster.violation("create: RUNNING without a sandbox_id".into()),
                Err(kind) => {
                    cluster.error(&format!("create: {kind}"));
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
            continue;
        };
        let Some(mut attached) = conn.take() else {
            let path = {
                let r = lock(&current);
                format!("/attach/{}?sandbox_token={}", r.id, r.token)
            };
            lock(&cluster.stats).attaches += 1;
            let what = format!("attach of {}", lock(&current).id);
            match reach_running(&cluster, pick_target(&mut rng), &path, false, &what).await {
                Ok((reached, _)) => {
                    failures = 0;
                    note_running(&cluster, &current, &reached);
                    conn = Some(reached);
                }
                Err(kind) => {
                    cluster.error(&format!("attach: {kind}"));
                    lock(&current).saw(&cluster, format!("attach failed: {kind}"));
                    failures += 1;
                    // A sandbox never checkpointed is gone with a killed holder.
                    let gone = !lock(&current).has_checkpoint
                        && (kind == "SANDBOX_RESTORE_ERROR" || kind == "SANDBOX_NOT_FOUND");
                    if gone && failures >= 5 {
                        lock(&cluster.stats).given_up += 1;
                        record = None;
                        failures = 0;
                    }
                    tokio::time::sleep(Duration::from_millis(rng.random_range(300..1500))).await;
                }
            }
            continue;
        };
        let roll: f64 = rng.random();
        if roll < 0.55 {
            let number = cluster.next_number.fetch_add(1, Ordering::SeqCst);
            lock(&current).sent.insert(number, Instant::now());
            let code = format!("echo {number} >> /tmp/chaos; cat /tmp/chaos");
            if !send(&mut attached, json!({"language": "bash", "code": code})).await {
                cluster.error("exec: send failed");
                continue;
            }
            let mut pending = Pending::Exec {
                number,
                stdout: String::new(),
                exit: None,
                killed: false,
            };
            let deadline = tokio::time::Instant::now() + EXEC_WAIT;
            let outcome = wait_ack(
                &cluster,
                &current,
                &mut attached,
                &mut pending,
                Some(deadline),
            )
            .await;
            trace(
                &cluster,
                &current,
                &attached,
                &format!("exec {number}: {outcome:?}"),
            );
            match outcome {
                Outcome::Acked => conn = Some(attached),
                Outcome::Error(status) => {
                    cluster.error(&format!("exec: {status}"));
                    let _ =
                        tokio::time::timeout(Duration::from_secs(2), attached.ws.close(None)).await;
                }
                Outcome::Closed(how) => cluster.error(&format!("exec: {}", short(&how))),
                Outcome::TimedOut => {
                    lock(&cluster.stats).abandoned += 1;
                    drain(Arc::clone(&cluster), current, attached, pending);
                }
            }
        } else if roll < 0.70 {
            if !send(&mut attached, json!({"action": "checkpoint"})).await {
                cluster.error("checkpoint: send failed");
                continue;
            }
            let mut pending = Pending::Checkpoint;
            let deadline = tokio::time::Instant::now() + CHECKPOINT_WAIT;
            let outcome = wait_ack(
                &cluster,
                &current,
                &mut attached,
                &mut pending,
                Some(deadline),
            )
            .await;
            trace(
                &cluster,
                &current,
                &attached,
                &format!("checkpoint: {outcome:?}"),
            );
            match outcome {
                Outcome::Acked => drain(Arc::clone(&cluster), current, attached, Pending::Nothing),
                Outcome::Error(status) => {
                    cluster.error(&format!("checkpoint: {status}"));
                    let _ =
                        tokio::time::timeout(Duration::from_secs(2), attached.ws.close(None)).await;
                }
                Outcome::Closed(how) => cluster.error(&format!("checkpoint: {}", short(&how))),
                Outcome::TimedOut => {
                    lock(&cluster.stats).abandoned += 1;
                    drain(Arc::clone(&cluster), current, attached, pending);
                }
            }
        } else if roll < 0.85 {
            lock(&cluster.stats).detaches += 1;
            lock(&current).saw(&cluster, format!("detached from {}", attached.instance));
            let _ = tokio::time::timeout(Duration::from_secs(2), attached.ws.close(None)).await;
        } else {
            // Attach elsewhere while still attached here: the holder hands
            // over with its client connected.
            lock(&cluster.stats).switches += 1;
            lock(&current).saw(&cluster, format!("left {} attached", attached.instance));
            drain(Arc::clone(&cluster), current, attached, Pending::Nothing);
        }
    }
    if let Some(mut attached) = conn {
        let _ = tokio::time::timeout(Duration::from_secs(2), attached.ws.close(None)).await;
    }
    sandboxes
}

/// Notes an operation's outcome in the sandbox's history and, with
/// `CHAOS_TRACE` set, prints it.
fn trace(cluster: &Cluster, record: &Shared, conn: &Conn, what: &str) {
    if !what.ends_with("Acked") {
        lock(record).saw(cluster, format!("{}: {what}", conn.instance));
    }
    if std::env::var_os("CHAOS_TRACE").is_some() {
        let id = lock(record).id.chars().take(8).collect::<String>();
        eprintln!(
            "{:.1} s {id} on {}: {what}",
            cluster.secs(Instant::now()),
            conn.instance
        );
    }
}

/// A close description without the per-connection details.
fn short(how: &str) -> String {
    if how.starts_with("dropped") {
        "dropped".to_owned()
    } else {
        how.to_owned()
    }
}

/// After the run: every sandbox that had an acknowledged checkpoint is
/// attached once more and its file checked.
async fn final_check(cluster: Arc<Cluster>, record: Shared, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let (path, has_checkpoint, id) = {
        let r = lock(&record);
        (
            format!("/attach/{}?sandbox_token={}", r.id, r.token),
            r.has_checkpoint,
            r.id.clone(),
        )
    };
    if !has_checkpoint {
        return;
    }
    let started = Instant::now();
    let mut last = String::new();
    while started.elapsed() < FINAL_BOUND {
        let target = Target::Slot(rng.random_range(0..SLOTS));
        match reach_running(
            &cluster,
            target,
            &path,
            false,
            &format!("final attach of {id}"),
        )
        .await
        {
            Ok((mut conn, _)) => {
                note_running(&cluster, &record, &conn);
                let number = cluster.next_number.fetch_add(1, Ordering::SeqCst);
                lock(&record).sent.insert(number, Instant::now());
                let code = format!("echo {number} >> /tmp/chaos; cat /tmp/chaos");
                if send(&mut conn, json!({"language": "bash", "code": code})).await {
                    let mut pending = Pending::Exec {
                        number,
                        stdout: String::new(),
                        exit: None,
                        killed: false,
                    };
                    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
                    match wait_ack(&cluster, &record, &mut conn, &mut pending, Some(deadline)).await
                    {
                        Outcome::Acked => {
                            lock(&cluster.stats).final_checked += 1;
                            let _ = conn.ws.close(None).await;
                            return;
                        }
                        Outcome::Error(how) | Outcome::Closed(how) => last = how,
                        Outcome::TimedOut => last = "final exec timed out".to_owned(),
                    }
                }
            }
            Err(kind) => last = kind,
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    cluster.violation(format!(
        "(b) sandbox {id} had an acknowledged checkpoint but could not be attached and checked \
         within {FINAL_BOUND:?} after the run (last: {last})"
    ));
}

/// Starts the process for `slot`, incarnation `generation` and up: a start
/// that fails is a violation (with the end of its log), then retried under
/// the next incarnation.
async fn start_instance(
    cluster: Option<&Cluster>,
    dir: &std::path::Path,
    endpoints: &[String],
    port: u16,
    slot: usize,
    generation: &mut u64,
) -> ServerProcess {
    loop {
        let name = format!("chaos-{slot}-{generation}");
        *generation += 1;
        let mut launch = Launch::new(&name, dir)
            .on_emulator(&endpoints[slot], BUCKET)
            .fast_leases()
            .frozen_by_tests();
        launch.port = Some(port);
        match launch.try_start().await {
            Ok(server) => return server,
            Err(err) => match cluster {
                Some(cluster) => cluster.violation(format!("start: {err}")),
                None => panic!("{err}"),
            },
        }
    }
}

fn signal(server: &ServerProcess, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &server.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill {signal} {}", server.name);
}

/// Drops (and so SIGKILLs and cleans up) a server off the async threads.
async fn discard(server: ServerProcess) {
    tokio::task::spawn_blocking(move || drop(server))
        .await
        .expect("discard");
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    Kill,
    Freeze,
    Drain,
    Emulator,
    Partition,
}

/// The fault loop: one fault at a time, each kind in turn, until the run's
/// end and at least one of each; then sets the stop.
async fn faults(
    cluster: Arc<Cluster>,
    dir: std::path::PathBuf,
    mut servers: Vec<ServerProcess>,
    mut emulator: DiskEmulator,
    proxies: &[InstanceProxy],
    run: Duration,
    seed: u64,
) -> (Vec<ServerProcess>, DiskEmulator) {
    let mut rng = StdRng::seed_from_u64(seed);
    let endpoints: Vec<String> = proxies.iter().map(InstanceProxy::endpoint).collect();
    let endpoint = endpoints.as_slice();
    let mut generation = SLOTS as u64;
    let order = [
        Fault::Kill,
        Fault::Freeze,
        Fault::Drain,
        Fault::Emulator,
        Fault::Partition,
    ];
    let mut done = 0;
    tokio::time::sleep(Duration::from_secs(8)).await;
    while cluster.started.elapsed() < run || done < order.len() {
        let fault = order[done % order.len()];
        let busiest = lock(&cluster.busiest).clone();
        let slot = lock(&cluster.slots)
            .iter()
            .position(|view| view.instance == busiest)
            .unwrap_or_else(|| rng.random_range(0..SLOTS));
        let at = cluster.secs(Instant::now());
        match fault {
            Fault::Kill => {
                let instance = servers[slot].name.clone();
                // Recorded before the signal: a client whose socket drops the
                // instant the process dies must already see the fault.
                lock(&cluster.faulted).insert(instance.clone(), Instant::now());
                lock(&cluster.slots)[slot].faults += 1;
                signal(&servers[slot], "-KILL");
                // Gone before its replacement binds the port: a killed
                // process may hold its listener for a moment.
                tokio::task::block_in_place(|| {
                    let _ = servers[slot].child.wait();
                });
                let port = cluster.ports[slot];
                let replacement =
                    start_instance(Some(&cluster), &dir, endpoint, port, slot, &mut generation)
                        .await;
                let killed = std::mem::replace(&mut servers[slot], replacement);
                {
                    let mut slots = lock(&cluster.slots);
                    slots[slot].instance = servers[slot].name.clone();
                    slots[slot].faults += 1;
                }
                discard(killed).await;
                lock(&cluster.stats).kills += 1;
                eprintln!(
                    "{at:.1} s: SIGKILL {instance}, replaced by {}",
                    servers[slot].name
                );
            }
            Fault::Freeze => {
                let instance = servers[slot].name.clone();
                lock(&cluster.slots)[slot].faults += 1;
                lock(&cluster.faulted).insert(instance.clone(), Instant::now());
                signal(&servers[slot], "-STOP");
                tokio::time::sleep(FREEZE).await;
                lock(&cluster.faulted).insert(instance.clone(), Instant::now());
                signal(&servers[slot], "-CONT");
                lock(&cluster.slots)[slot].faults += 1;
                lock(&cluster.stats).freezes += 1;
                eprintln!("{at:.1} s: SIGSTOP {instance} for {FREEZE:?}, then SIGCONT");
            }
            Fault::Drain => {
                let instance = servers[slot].name.clone();
                lock(&cluster.slots)[slot].faults += 1;
                signal(&servers[slot], "-TERM");
                let began = Instant::now();
                let status = loop {
                    if let Some(status) = servers[slot].child.try_wait().expect("try_wait") {
                        break Some(status);
                    }
                    if began.elapsed() > DRAIN_BOUND {
                        break None;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                };
                match status {
                    Some(status) if status.success() => {}
                    Some(status) => {
                        cluster.violation(format!("drain: {instance} exited with {status}"));
                    }
                    None => cluster.violation(format!(
                        "drain: {instance} still running {DRAIN_BOUND:?} after SIGTERM"
                    )),
                }
                let port = cluster.ports[slot];
                let replacement =
                    start_instance(Some(&cluster), &dir, endpoint, port, slot, &mut generation)
                        .await;
                let drained = std::mem::replace(&mut servers[slot], replacement);
                {
                    let mut slots = lock(&cluster.slots);
                    slots[slot].instance = servers[slot].name.clone();
                    slots[slot].faults += 1;
                }
                discard(drained).await;
                lock(&cluster.stats).drains += 1;
                eprintln!(
                    "{at:.1} s: SIGTERM {instance}, drained in {:.1} s, replaced by {}",
                    began.elapsed().as_secs_f64(),
                    servers[slot].name
                );
            }
            Fault::Emulator => {
                emulator.kill().await;
                tokio::time::sleep(Duration::from_secs(2)).await;
                tokio::task::block_in_place(|| emulator.restart());
                lock(&cluster.stats).emulator_restarts += 1;
                eprintln!("{at:.1} s: storage emulator down for 2 s");
            }
            Fault::Partition => {
                let instance = servers[slot].name.clone();
                let how = if lock(&cluster.stats).partitions.is_multiple_of(2) {
                    Partition::BlackHole
                } else {
                    Partition::Refuse
                };
                // Its clients stay connected and must be told: the slot's
                // fault count stays, so a silent drop is a violation.
                lock(&cluster.faulted).insert(instance.clone(), Instant::now());
                proxies[slot].set_partition(how);
                tokio::time::sleep(PARTITION).await;
                proxies[slot].set_partition(Partition::Connected);
                lock(&cluster.faulted).insert(instance.clone(), Instant::now());
                lock(&cluster.stats).partitions += 1;
                eprintln!("{at:.1} s: {instance} cut off the bucket ({how:?}) for {PARTITION:?}");
            }
        }
        done += 1;
        let pause = Duration::from_millis(rng.random_range(2000..5000));
        tokio::time::sleep(pause).await;
    }
    cluster.stop.store(true, Ordering::SeqCst);
    (servers, emulator)
}

/// Copies the servers' logs out of the run's temp dir when the run fails (a
/// violation or a panic), to `$TMPDIR/chaos-logs-<seed>`.
struct KeepLogs {
    dir: std::path::PathBuf,
    seed: u64,
    keep: bool,
}

impl Drop for KeepLogs {
    fn drop(&mut self) {
        if !self.keep && !std::thread::panicking() {
            return;
        }
        let keep = std::env::temp_dir().join(format!("chaos-logs-{}", self.seed));
        let _ = std::fs::create_dir_all(&keep);
        for entry in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let log = entry.path().join("sandboxd.log");
            if log.exists() {
                let _ = std::fs::copy(&log, keep.join(entry.file_name()).with_extension("log"));
            }
        }
        eprintln!("server logs kept in {}", keep.display());
    }
}

/// The figures at the end of the run.
fn report(
    stats: &Stats,
    violations: &[String],
    seed: u64,
    elapsed: Duration,
    lost_lines: usize,
) -> String {
    let mut report = String::new();
    let operations = stats.creates
        + stats.attaches
        + stats.execs
        + stats.checkpoints
        + stats.detaches
        + stats.switches;
    writeln!(
        report,
        "chaos run: {:.0} s, seed {seed}, {CLIENTS} clients, {SLOTS} instances",
        elapsed.as_secs_f64()
    )
    .unwrap();
    writeln!(report, "  operations {operations}: creates {}, attaches {} (via proxy {}), RUNNING {}, executions acknowledged {}, checkpoints acknowledged {}, detaches {}, switches while attached {}", stats.creates, stats.attaches, stats.via_proxy, stats.running, stats.execs, stats.checkpoints, stats.detaches, stats.switches).unwrap();
    writeln!(
        report,
        "  faults: kills {}, freezes {}, drains {}, emulator restarts {}, partitions {}",
        stats.kills, stats.freezes, stats.drains, stats.emulator_restarts, stats.partitions
    )
    .unwrap();
    writeln!(report, "  handoffs {} (RUNNING on another instance than the last), takeovers {} (from a killed or frozen holder); sandboxes stopped as lost by their old holder (server logs) {lost_lines}", stats.handoffs, stats.takeovers).unwrap();
    writeln!(report, "  abandoned sockets {} (late acknowledgements on them {}), executions acknowledged after the last checkpoint and lost {}, sandboxes given up (never checkpointed) {}, checked after the run {}", stats.abandoned, stats.late_acks, stats.lost_after_checkpoint, stats.given_up, stats.final_checked).unwrap();
    writeln!(
        report,
        "  slowest create/attach {:.1} s",
        stats.slowest_attach.as_secs_f64()
    )
    .unwrap();
    writeln!(report, "  errors by kind:").unwrap();
    for (kind, count) in &stats.errors {
        writeln!(report, "    {count:>5}  {kind}").unwrap();
    }
    writeln!(report, "  violations {}", violations.len()).unwrap();
    for violation in violations {
        writeln!(report, "    {violation}").unwrap();
    }
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos() {
    let run = Duration::from_secs(
        std::env::var("CHAOS_SECS")
            .ok()
            .map(|s| s.parse().expect("CHAOS_SECS is a number of seconds"))
            .unwrap_or(60),
    );
    let seed: u64 = std::env::var("CHAOS_SEED")
        .ok()
        .map(|s| s.parse().expect("CHAOS_SEED is a number"))
        .unwrap_or_else(rand::random);
    eprintln!("chaos: {run:?}, CHAOS_SEED={seed}");

    let dir = tempfile::tempdir().unwrap();
    let mut keep_logs = KeepLogs {
        dir: dir.path().to_owned(),
        seed,
        keep: false,
    };
    let emulator = DiskEmulator::start(&dir.path().join("gcs")).await;
    emulator.create_bucket(BUCKET).await;
    let model = StorageModel::new(
        std::net::SocketAddr::from((emulator.host, 80)),
        Profile::gcs_regional(),
    );
    model.set_transient_faults(TRANSIENT_SHARE);
    let mut proxies = Vec::new();
    for slot in 0..SLOTS {
        proxies.push(
            model
                .proxy(&slot_name(slot))
                .await
                .expect("a storage proxy"),
        );
    }
    let endpoints: Vec<String> = proxies.iter().map(InstanceProxy::endpoint).collect();
    let ports: Vec<u16> = (0..SLOTS).map(|_| free_port()).collect();
    let mut servers = Vec::new();
    let mut generation = 0;
    for (slot, port) in ports.iter().enumerate() {
        servers
            .push(start_instance(None, dir.path(), &endpoints, *port, slot, &mut generation).await);
    }
    let named: Vec<(String, String)> = ports
        .iter()
        .enumerate()
        .map(|(slot, port)| (slot_name(slot), format!("127.0.0.1:{port}")))
        .collect();
    let proxy = Proxy::start_named(dir.path(), &named).await;
    let cluster = Arc::new(Cluster {
        ports,
        proxy_port: proxy.port,
        slots: Mutex::new(
            servers
                .iter()
                .map(|s| SlotView {
                    instance: s.name.clone(),
                    faults: 0,
                })
                .collect(),
        ),
        faulted: Mutex::default(),
        stats: Mutex::default(),
        violations: Mutex::default(),
        next_number: AtomicU64::new(1),
        busiest: Mutex::default(),
        stop: AtomicBool::new(false),
        started: Instant::now(),
    });

    let clients: Vec<_> = (0..CLIENTS)
        .map(|n| tokio::spawn(client(Arc::clone(&cluster), seed ^ (n as u64 + 1))))
        .collect();
    let (servers, emulator) = faults(
        Arc::clone(&cluster),
        dir.path().to_owned(),
        servers,
        emulator,
        &proxies,
        run,
        seed,
    )
    .await;
    let mut records = Vec::new();
    for client in clients {
        records.extend(client.await.expect("a client panicked"));
    }
    let elapsed = cluster.started.elapsed();
    let checks: Vec<_> = records
        .iter()
        .enumerate()
        .map(|(n, record)| {
            tokio::spawn(final_check(
                Arc::clone(&cluster),
                Arc::clone(record),
                seed ^ (n as u64 + 1000),
            ))
        })
        .collect();
    for check in checks {
        check.await.expect("a final check panicked");
    }

    let logs: Vec<std::path::PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|entry| {
            let path = entry.ok()?.path().join("sandboxd.log");
            path.exists().then_some(path)
        })
        .collect();
    let mut lost_lines = 0;
    for log in &logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains("panicked")) {
            cluster.violation(format!("{}: {line}", log.display()));
        }
        lost_lines += text
            .lines()
            .filter(|l| l.contains("stopping a sandbox this instance lost"))
            .count();
    }

    let violations = lock(&cluster.violations).clone();
    let report = report(
        &lock(&cluster.stats),
        &violations,
        seed,
        elapsed,
        lost_lines,
    );
    eprintln!("{report}");
    let requests = Tally::of(&model.records());
    eprintln!(
        "  storage model {}: {} requests ({} reads, {} writes, {} lists), {} answered 429, {} faults injected (429/503 at {}%)",
        model.profile(),
        requests.total,
        requests.reads,
        requests.writes,
        requests.lists,
        requests.throttled,
        requests.injected,
        TRANSIENT_SHARE * 100.0
    );

    keep_logs.keep = !violations.is_empty();
    drop(proxy);
    for server in servers {
        discard(server).await;
    }
    drop(emulator);
    let kinds_ran = {
        let stats = lock(&cluster.stats);
        stats.kills > 0
            && stats.freezes > 0
            && stats.drains > 0
            && stats.emulator_restarts > 0
            && stats.partitions > 0
    };
    assert!(kinds_ran, "every kind of fault ran");
    assert!(
        violations.is_empty(),
        "{} violations:\n{report}",
        violations.len()
    );
    let stats = lock(&cluster.stats);
    assert!(
        stats.execs > 0 && stats.checkpoints > 0 && stats.handoffs > 0,
        "the run did nothing worth checking:\n{report}"
    );
}

/// The smallest reproduction of what the chaos run found: A holds a sandbox
/// (its client attached), a client attaches on B, and A is drained (SIGTERM)
/// before it hands the sandbox over. `SandboxController::drain` writes
/// `desired_state: checkpointed` over B's `running` for every sandbox A holds,
/// and B's reconciler, seeing `checkpointed`, stops (`full_pass`:
/// `DesiredState::Checkpointed => Requeue::Never`) without failing the attach
/// that waits on it: B's client gets neither RUNNING nor an error, ever.
/// (A is frozen for one second so that B's intent is surely written first.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attach_on_another_instance_during_a_drain_is_answered() {
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let mut a = Launch::new("drain-a", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .frozen_by_tests()
        .start()
        .await;
    let b = Launch::new("drain-b", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .start()
        .await;
    let (mut on_a, id, token) = a.create(init()).await;
    on_a.exec("bash", "echo kept > /tmp/k").await;
    signal(&a, "-STOP");
    let mut on_b = b.attach(&id, &token).await;
    let answer = tokio::spawn(async move {
        tokio::time::timeout(
            ATTACH_BOUND,
            on_b.until(|f| f == "SANDBOX_RUNNING" || f.ends_with("_ERROR")),
        )
        .await
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    signal(&a, "-TERM");
    signal(&a, "-CONT");
    let answer = answer.await.unwrap();
    let _ = a.child.wait();
    assert!(
        answer.is_ok(),
        "the attach on B got no RUNNING, error or close within {ATTACH_BOUND:?} \
         after A was drained"
    );
}

/// The smallest reproduction of the overlap the chaos run found: A holds a
/// sandbox and runs an execution when it freezes (SIGSTOP) for longer than
/// its lease; the runsc sandbox is not frozen and finishes the execution. B
/// takes the sandbox over (from its last checkpoint) and acknowledges an
/// execution of its own. When A resumes, it acknowledges its execution
/// (`SANDBOX_EXECUTION_DONE`) on its old socket although B holds the sandbox:
/// `SandboxController::exec` and the output pump (`src/api/output.rs`) look
/// only at the local held map, not at whether the hold is still vouched for
/// (`Leases::is_safe`), and A notices the loss only at its next pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_frozen_past_its_lease_acknowledges_nothing_after_the_taker() {
    let dir = tempfile::tempdir().unwrap();
    let bucket = support::create_bucket().await;
    let a = Launch::new("frozen-a", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .frozen_by_tests()
        .start()
        .await;
    let b = Launch::new("frozen-b", dir.path())
        .on_bucket(&bucket)
        .fast_leases()
        .start()
        .await;
    let (mut on_a, id, token) = a.create(init()).await;
    on_a.exec("bash", "echo 1 >> /tmp/f").await;
    on_a.send(json!({"action": "checkpoint"})).await;
    on_a.until_close().await;
    let mut on_a = a.attach(&id, &token).await;
    on_a.until_status("SANDBOX_RUNNING").await;
    on_a.send(json!({"language": "bash", "code": "sleep 2; echo 2 >> /tmp/f"}))
        .await;
    on_a.until_status("SANDBOX_EXECUTION_RUNNING").await;
    signal(&a, "-STOP");
    let mut on_b = b.attach(&id, &token).await;
    let frames = on_b.until_status("SANDBOX_RUNNING").await;
    assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
    let out = on_b.exec("bash", "echo 3 >> /tmp/f; cat /tmp/f").await;
    assert!(
        out.contains(&"SANDBOX_EXECUTION_DONE".to_owned()),
        "{out:?}"
    );
    signal(&a, "-CONT");
    let late = tokio::time::timeout(
        Duration::from_secs(10),
        on_a.until(|f| f == "SANDBOX_EXECUTION_DONE" || f.ends_with("_ERROR")),
    )
    .await;
    assert!(
        !matches!(&late, Ok(frames) if frames.iter().any(|f| f == "SANDBOX_EXECUTION_DONE")),
        "A acknowledged its execution after B took the sandbox over and acknowledged one: \
         {late:?}"
    );
}
