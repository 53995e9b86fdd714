//! Admission against real `runsc` (docs/decisions/0020-admission.md): an instance with room for two
//! sandboxes. A third create evicts the least recently used idle sandbox
//! (checkpointed and released by the reconcile loop) and runs; with every
//! sandbox attached, a create and a restore are refused with a status that
//! names capacity; the evicted sandbox restores with its state once a
//! client leaves another. Without runsc or the default image this fails,
//! it never skips.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use controllers::api::{DesiredState, Phase, SandboxId};
use controllers::store::Store;
use sandboxd::api::admission::AdmissionSettings;
use sandboxd::store::LocalStore;
use serde_json::{Value, json};
use support::ws::{Server, Ws};

/// The tests' runtime gives each sandbox 1 GiB (`support::runtime_with_images`).
const SANDBOX: u64 = 1 << 30;

async fn server_with_room_for_two() -> (Server, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(LocalStore::open(dir.path().join("store")).unwrap());
    let server = Server::sharing("instance-a", store, |parts| {
        parts.admission = Some(AdmissionSettings {
            capacity_bytes: 2 * SANDBOX,
            sandbox_bytes: SANDBOX,
            // A checkpoint on a loaded 2-core machine can take seconds.
            wait: Duration::from_secs(60),
            warm_pool: 0,
        });
    })
    .await;
    (server, dir)
}

fn init() -> Value {
    json!({"enable_checkpoint": true, "idle_timeout": 600})
}

async fn session(ws: &mut Ws, code: &str) -> Vec<String> {
    ws.send(json!({"language": "python", "code": code, "session": true}))
        .await;
    support::ws::merge_chunks(ws.until_status("SANDBOX_EXECUTION_DONE").await)
}

/// Closes the client's socket and waits until the server sees it gone.
async fn leave(server: &Server, ws: Ws, id: &str) {
    ws.close_now().await;
    let id = SandboxId::parse(id).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while server
        .state
        .live
        .get(&id)
        .is_some_and(|live| live.is_attached())
    {
        assert!(Instant::now() < deadline, "the session never ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn metadata(server: &Server, id: &str) -> controllers::api::SandboxMetadata {
    let controller = server.state.controller.as_ref().unwrap();
    controller
        .reconciler()
        .read_metadata(&SandboxId::parse(id).unwrap())
        .await
        .unwrap()
        .unwrap()
        .0
}

/// Waits (60 s at most) until the warm pool's stats satisfy `done`.
async fn pool_until(
    runtime: &sandboxd::runtime::GvisorRuntime,
    what: &str,
    done: impl Fn(&sandboxd::runtime::WarmPoolStats) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stats = runtime.warm_pool();
        if done(&stats) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: {stats:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn get_json(url: &str) -> Value {
    support::get_json(url).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_instance_evicts_its_least_recently_used_idle_sandbox_and_refuses_when_none_is_idle()
{
    let (server, _dir) = server_with_room_for_two().await;

    // A: state in its Python session, then its client leaves.
    let (mut a, a_id, a_token) = server.create(init()).await;
    assert!(
        session(&mut a, "x = 41")
            .await
            .contains(&"SANDBOX_EXECUTION_DONE".to_owned())
    );
    leave(&server, a, &a_id).await;
    // B: attached throughout. The instance is now full.
    let (b, _b_id, _) = server.create(init()).await;
    let ready = get_json(&format!("http://{}/readyz", server.addr)).await;
    assert_eq!(ready["memory"]["free_bytes"], 0, "{ready}");
    assert_eq!(ready["memory"]["capacity_bytes"], 2 * SANDBOX, "{ready}");

    // C fits only once A, idle, was checkpointed and released.
    let (mut c, c_id, c_token) = server.create(init()).await;
    let evicted = support::eventually(
        || metadata(&server, &a_id),
        |m| m.status.phase == Phase::Checkpointed,
    )
    .await;
    assert_eq!(evicted.spec.desired_state, DesiredState::Checkpointed);
    assert_eq!(evicted.status.phase, Phase::Checkpointed);
    assert!(evicted.status.latest_checkpoint.is_some());
    assert!(
        !server
            .state
            .controller
            .as_ref()
            .unwrap()
            .is_held_here(&SandboxId::parse(&a_id).unwrap())
    );
    assert_eq!(session(&mut c, "print(2 + 2)").await[1], "stdout:4\n");

    // B and C attached: nothing to evict. A create is refused, naming capacity.
    let mut d = server.connect("/create").await;
    d.send(init()).await;
    let frames = d.until_close().await;
    assert_eq!(frames[0], "SANDBOX_CREATING", "{frames:?}");
    assert_eq!(frames[1], "SANDBOX_CREATION_ERROR", "{frames:?}");
    assert!(frames[2].contains("at capacity"), "{frames:?}");
    assert_eq!(frames.last().unwrap(), "close:4000", "{frames:?}");
    // So is the restore of A.
    let mut refused = server.attach(&a_id, &a_token).await;
    let frames = refused.until_close().await;
    assert_eq!(frames[0], "SANDBOX_RESTORING", "{frames:?}");
    assert_eq!(frames[1], "SANDBOX_RESTORE_ERROR", "{frames:?}");
    assert!(frames[2].contains("at capacity"), "{frames:?}");
    assert_eq!(frames.last().unwrap(), "close:4000", "{frames:?}");
    assert_eq!(
        metadata(&server, &a_id).await.status.phase,
        Phase::Checkpointed,
        "a refused restore changes nothing"
    );

    // C's client leaves: A's restore evicts C and A comes back with its state.
    leave(&server, c, &c_id).await;
    let mut a = server.attach(&a_id, &a_token).await;
    let frames = a.until_status("SANDBOX_RUNNING").await;
    assert_eq!(frames[0], "SANDBOX_RESTORING", "{frames:?}");
    assert_eq!(session(&mut a, "print(x + 1)").await[1], "stdout:42\n");
    assert_eq!(
        support::eventually(
            || metadata(&server, &c_id),
            |m| m.status.phase == Phase::Checkpointed
        )
        .await
        .status
        .phase,
        Phase::Checkpointed
    );
    let metrics = support::get_text(format!("http://{}/metrics", server.addr)).await;
    for series in [
        "sandboxd_admission_evictions_total 2",
        "sandboxd_admission_refusals_total 2",
        "sandboxd_memory_free_bytes 0",
    ] {
        assert!(metrics.contains(series), "{series} missing in:\n{metrics}");
    }

    // Sandboxes that are deleted free their room for the next start.
    for mut ws in [a, b] {
        ws.send(json!({"action": "kill_sandbox"})).await;
        ws.until_close().await;
    }
    let mut c = server.attach(&c_id, &c_token).await;
    c.until_status("SANDBOX_RUNNING").await;
    assert_eq!(session(&mut c, "print('back')").await[1], "stdout:back\n");
    c.send(json!({"action": "kill_sandbox"})).await;
    c.until_close().await;
}

/// Forks, named checkpoints and `POST /execute` have caps of their own,
/// each refused with a message naming its flag, and a freed slot works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_named_checkpoints_and_executes_have_caps_of_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(LocalStore::open(dir.path().join("store")).unwrap());
    let server = Server::sharing("instance-b", store, |parts| {
        parts.limits = sandboxd::api::limits::LimitSettings {
            max_concurrent_executes: 1,
            max_concurrent_forks: 1,
        };
        parts.features.max_named_checkpoints = 1;
    })
    .await;

    // One named checkpoint allowed: a second name is refused, the socket
    // stays, and the first name can be taken again.
    let (mut ws, id, token) = server.create(init()).await;
    let frames = session(&mut ws, "y = 7").await;
    assert_eq!(
        frames.last().unwrap(),
        "SANDBOX_EXECUTION_DONE",
        "{frames:?}"
    );
    ws.send(json!({"action": "checkpoint", "name": "first"}))
        .await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");
    let mut ws = server.attach(&id, &token).await;
    let frames = ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
    ws.send(json!({"action": "checkpoint", "name": "second"}))
        .await;
    let frames = ws.until_status("SANDBOX_CHECKPOINT_ERROR").await;
    assert_eq!(
        frames.last().unwrap(),
        "SANDBOX_CHECKPOINT_ERROR",
        "{frames:?}"
    );
    let error = ws.next().await;
    assert!(error.contains("--max-named-checkpoints 1"), "{error}");
    ws.send(json!({"action": "checkpoint", "name": "first"}))
        .await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");

    // The one fork slot taken: a fork is refused naming the cap; freed, it runs.
    let fork_init = json!({"from_checkpoint": {"sandbox_id": id, "sandbox_token": token}});
    let slot = server.state.limits.fork_slot().unwrap();
    let mut fork = server.connect("/create").await;
    fork.send(fork_init.clone()).await;
    let frames = fork.until_close().await;
    assert_eq!(frames[1], "SANDBOX_CREATION_ERROR", "{frames:?}");
    assert!(frames[2].contains("--max-concurrent-forks"), "{frames:?}");
    assert_eq!(frames.last().unwrap(), "close:4000", "{frames:?}");
    drop(slot);
    let (mut fork, _, _) = server.create(fork_init).await;
    assert_eq!(session(&mut fork, "print(y)").await[1], "stdout:7\n");
    fork.send(json!({"action": "kill_sandbox"})).await;
    fork.until_close().await;

    // The one `/execute` slot taken: 429 naming the cap; freed, it runs.
    let execute = || {
        testkit::http_client()
            .post(format!("http://{}/execute?language=bash", server.addr))
            .body("echo hi")
            .send()
    };
    let slot = server.state.limits.execute_slot().unwrap();
    let refused = execute().await.unwrap();
    assert_eq!(refused.status(), 429);
    let body: Value = refused.json().await.unwrap();
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("--max-concurrent-executes"),
        "{body}"
    );
    drop(slot);
    let ran = execute().await.unwrap();
    assert_eq!(ran.status(), 200);
    assert_eq!(ran.text().await.unwrap(), "hi\n");
}

/// The warm pool counts against capacity with the memory it uses and gives
/// way first (decision 17): on room for one sandbox and one warm one, a create
/// shrinks the pool instead of evicting or refusing, and the pool grows back
/// into the room the sandbox frees when it goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_warm_pool_counts_against_capacity_and_gives_way_first() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(LocalStore::open(dir.path().join("store")).unwrap());
    let _cleanup = support::RunscCleanup(dir.path().join("runsc"));
    let runtime = Arc::new(support::runtime_with_store(dir.path(), Arc::clone(&store)).await);
    runtime.start_warm_pool(2);
    let pool = Arc::clone(&runtime);
    let server = support::server_counted(
        "instance-c",
        store,
        Some(Arc::clone(&runtime) as Arc<dyn controllers::runtime::SandboxRuntime>),
        Arc::default(),
        |parts| {
            parts.warm_pool = Some(pool);
            parts.admission = Some(AdmissionSettings {
                capacity_bytes: SANDBOX + (30 << 20),
                sandbox_bytes: SANDBOX,
                wait: Duration::from_secs(60),
                warm_pool: 2,
            });
        },
    );
    let addr = support::serve(server).await;
    pool_until(&runtime, "the pool fills", |stats| stats.ready == 2).await;
    let ready = get_json(&format!("http://{addr}/readyz")).await;
    let pool_bytes = ready["memory"]["warm_pool_bytes"].as_u64().unwrap();
    assert!(pool_bytes > 0, "the pool's memory is counted: {ready}");
    assert_eq!(ready["memory"]["committed_bytes"], pool_bytes, "{ready}");

    // A sandbox fits only beside at most one warm sandbox: the pool shrinks.
    let mut ws = Ws::connect(&format!("ws://{addr}/create")).await;
    ws.send(init()).await;
    let frames = ws.until_status("SANDBOX_RUNNING").await;
    assert!(!frames.iter().any(|f| f.ends_with("_ERROR")), "{frames:?}");
    let stats = runtime.warm_pool();
    assert!(stats.target <= 1, "the pool gave way: {stats:?}");
    let ready = get_json(&format!("http://{addr}/readyz")).await;
    assert!(
        ready["memory"]["committed_bytes"].as_u64().unwrap() <= SANDBOX + (30 << 20),
        "{ready}"
    );
    // The sandbox goes: the pool grows back to its size.
    ws.send(json!({"action": "kill_sandbox"})).await;
    ws.until_close().await;
    pool_until(&runtime, "the pool grows back", |stats| stats.target == 2).await;
    runtime.settle().await;
}

/// Memory each sandbox of the memory test may use (its real cgroup limit
/// and what admission counts for it).
const SMALL_SANDBOX: u64 = 256 << 20;
/// What each of them fills and touches: 72 % of its limit. Before the
/// checkpoint and restore got memory headroom (`runtime::checkpoint::cpu_quota`) the
/// sandbox's memcg OOM-killed gVisor's sentry in the restore at 62–72 %
/// (`SANDBOX_RESTORE_ERROR` "containerManager.Restore failed: EOF"); with
/// the headroom taken away this test fails so.
const BUFFER_MIB: u64 = 184;

/// [`BUFFER_MIB`], or `ADMISSION_BUFFER_MIB` (to probe other fills).
fn buffer_mib() -> u64 {
    std::env::var("ADMISSION_BUFFER_MIB")
        .ok()
        .and_then(|mib| mib.parse().ok())
        .unwrap_or(BUFFER_MIB)
}

/// Fills a buffer of pseudo-random bytes (every page written) in the
/// sandbox's Python session and prints its pid and checksum.
const FILL: &str = "import hashlib, os\n\
    buf = bytearray(os.urandom(1 << 20)) * BUFFER_MIB\n\
    buf[::4096] = os.urandom(len(buf[::4096]))\n\
    print(os.getpid(), hashlib.sha256(buf).hexdigest(), len(buf) >> 20)\n";
const SAME: &str = "print(os.getpid(), hashlib.sha256(buf).hexdigest(), len(buf) >> 20)\n";

/// The one line a session execution printed; panics on any other frame
/// (an error, a lost sandbox) before its DONE.
async fn printed(ws: &mut Ws, code: &str) -> String {
    let frames = session(ws, code).await;
    assert_eq!(frames.len(), 4, "{frames:?}");
    assert_eq!(frames[0], "SANDBOX_EXECUTION_RUNNING", "{frames:?}");
    assert_eq!(frames[2], "exit_code:0", "{frames:?}");
    frames[1].strip_prefix("stdout:").unwrap().to_owned()
}

/// "Filling an instance past capacity" (docs/security.md), with
/// sandboxes that really use their memory: room for three of 256 MiB, each
/// filling 184 MiB. Six creates: each ends in `SANDBOX_RUNNING` (evicting
/// an idle one) or the capacity refusal; the sandboxes that kept running
/// still hold their buffer in the same process; the evicted ones restore
/// with their buffer's checksum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filling_an_instance_with_sandboxes_that_use_their_memory_kills_none() {
    support::SANDBOX_MEMORY_BYTES.with(|limit| limit.set(SMALL_SANDBOX));
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Store> = Arc::new(LocalStore::open(dir.path().join("store")).unwrap());
    let server = Server::sharing("instance-m", store, |parts| {
        parts.admission = Some(AdmissionSettings {
            capacity_bytes: 3 * SMALL_SANDBOX,
            sandbox_bytes: SMALL_SANDBOX,
            wait: Duration::from_secs(60),
            warm_pool: 0,
        });
    })
    .await;
    let buffer_mib = buffer_mib();
    let fill = FILL.replace("BUFFER_MIB", &buffer_mib.to_string());
    let started = Instant::now();

    // Two sandboxes fill their buffer and are left idle; three more fill
    // theirs and stay attached: the fourth and fifth creates evict the
    // first two.
    let mut idle = Vec::new();
    let mut attached = Vec::new();
    for n in 0..5 {
        let (mut ws, id, token) = server.create(init()).await;
        let seen = printed(&mut ws, &fill).await;
        assert!(seen.ends_with(&format!(" {buffer_mib}\n")), "{seen}");
        if n < 2 {
            leave(&server, ws, &id).await;
            idle.push((id, token, seen));
        } else {
            attached.push((ws, id, seen));
        }
    }
    for (id, _, _) in &idle {
        let evicted = support::eventually(
            || metadata(&server, id),
            |m| m.status.phase == Phase::Checkpointed,
        )
        .await;
        assert_eq!(evicted.status.phase, Phase::Checkpointed, "{id}");
    }
    // The sixth finds nothing idle to evict: refused, naming capacity.
    let mut refused = server.connect("/create").await;
    refused.send(init()).await;
    let frames = refused.until_close().await;
    assert_eq!(frames[1], "SANDBOX_CREATION_ERROR", "{frames:?}");
    assert!(frames[2].contains("at capacity"), "{frames:?}");

    // The running ones were never killed: the same process, the same bytes.
    for (ws, id, seen) in &mut attached {
        assert_eq!(&printed(ws, SAME).await, seen, "{id}");
    }
    // Each evicted one restores (evicting an attached one its client left)
    // with the same buffer.
    let leaving: Vec<_> = attached.drain(..2).collect();
    for ((id, token, seen), (ws, left_id, _)) in idle.iter().zip(leaving) {
        leave(&server, ws, &left_id).await;
        let mut back = server.attach(id, token).await;
        let frames = back.until_status("SANDBOX_RUNNING").await;
        assert_eq!(frames[0], "SANDBOX_RESTORING", "{frames:?}");
        assert_eq!(frames.last().unwrap(), "SANDBOX_RUNNING", "{frames:?}");
        assert_eq!(
            &printed(&mut back, SAME).await,
            seen,
            "{id} after its restore"
        );
        attached.push((back, id.clone(), seen.clone()));
    }
    eprintln!(
        "6 creates, 4 evictions, 2 restores of {buffer_mib} MiB buffers: {:?}",
        started.elapsed()
    );
    for (mut ws, _, _) in attached {
        ws.send(json!({"action": "kill_sandbox"})).await;
        ws.until_close().await;
    }
}
