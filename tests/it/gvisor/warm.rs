//! Warm starts against real `runsc` (decision 17): the warm pool (sandboxes
//! booted ahead of demand) and ready templates (an image's start command run
//! once per instance, then restored). Without runsc or the default image
//! these tests fail, they never skip.

use crate::support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use controllers::api::SandboxId;
use controllers::runtime::{
    CheckpointRequest, Command, CreateOptions, ExecEvent, ExecRequest, SandboxRuntime,
};
use controllers::store::Store;
use sandboxd::runtime::images::ready::{ReadyCommand, ReadyLanguage};
use sandboxd::runtime::{GvisorRuntime, ImageCatalog, WarmPoolStats};
use sandboxd::store::LocalStore;
use serde_json::json;

/// Python that prints how many `sleep` processes exist in the sandbox.
const COUNT_SLEEPS: &str = "import os\nprint(sum(1 for p in os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/comm').read().strip() == 'sleep'))";

struct Host {
    runtime: Arc<GvisorRuntime>,
    store: Arc<dyn Store>,
    _cleanup: support::RunscCleanup,
    _dir: tempfile::TempDir,
}

async fn host_on(images: ImageCatalog) -> Host {
    let dir = tempfile::Builder::new()
        .prefix("sandboxd-warm-test-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let store: Arc<dyn Store> = Arc::new(LocalStore::open(dir.path().join("store")).unwrap());
    let runtime = support::runtime_with_images(dir.path(), Arc::clone(&store), images).await;
    Host {
        runtime: Arc::new(runtime),
        store,
        _cleanup: support::RunscCleanup(dir.path().join("runsc")),
        _dir: dir,
    }
}

/// Runs `command`: (stdout, stderr, exit code).
async fn run(runtime: &GvisorRuntime, sandbox: &SandboxId, command: Command) -> (String, i32) {
    let mut execution = runtime
        .exec(sandbox, ExecRequest::new(command))
        .await
        .unwrap();
    let mut output = Vec::new();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(60), execution.events.recv())
            .await
            .expect("execution timed out")
            .expect("event stream ended without Exited");
        match event {
            ExecEvent::Stdout(data) | ExecEvent::Stderr(data) => output.extend_from_slice(&data),
            // The runtime alone runs no after-exec hooks.
            ExecEvent::AfterExecFailed(message) => panic!("after-exec hook failed: {message}"),
            ExecEvent::HoldLost => panic!("a runtime never sends HoldLost"),
            // A forced checkpoint killed it: its exit follows.
            ExecEvent::ForceKilled => {}
            ExecEvent::Result(_) => panic!("no rich results were asked for"),
            ExecEvent::Exited(code) => {
                return (String::from_utf8_lossy(&output).trim().to_owned(), code);
            }
        }
    }
}

async fn bash(runtime: &GvisorRuntime, sandbox: &SandboxId, code: &str) -> String {
    let (output, code) = run(runtime, sandbox, Command::Bash(code.to_owned())).await;
    assert_eq!(code, 0, "{output}");
    output
}

async fn session(runtime: &GvisorRuntime, sandbox: &SandboxId, code: &str) -> String {
    let (output, code) = run(runtime, sandbox, Command::PythonSession(code.to_owned())).await;
    assert_eq!(code, 0, "{output}");
    output
}

/// Waits (60 s at most) until the pool holds `ready` sandboxes.
async fn pool_ready(runtime: &GvisorRuntime, ready: usize) -> WarmPoolStats {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let stats = runtime.warm_pool();
        if stats.ready >= ready {
            return stats;
        }
        assert!(
            Instant::now() < deadline,
            "the pool never got {ready} ready: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn checkpoint_request() -> CheckpointRequest {
    CheckpointRequest {
        checkpoint_id: support::new_id(),
        epoch: 1,
        name: None,
        force: false,
        keep_executions: false,
    }
}

/// A sandbox taken from the pool is a cold one: nothing an earlier pool
/// sandbox wrote (files in /tmp, home and the root filesystem, Python
/// globals, processes) is there, and its checkpoint records what a cold
/// sandbox's records and restores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_sandboxes_are_fresh_isolated_and_checkpoint_like_cold_ones() {
    let h = host_on(support::images()).await;
    h.runtime.start_warm_pool(2);
    let before = pool_ready(&h.runtime, 2).await;
    assert_eq!((before.hits, before.misses), (0, 0));
    assert!(
        before.memory_bytes > 0,
        "the pool reports its memory: {before:?}"
    );

    let first = support::new_id();
    h.runtime
        .create(&first, &CreateOptions::default())
        .await
        .unwrap();
    assert_eq!(h.runtime.warm_pool().hits, 1);
    bash(
        &h.runtime,
        &first,
        "echo mine > /tmp/left && echo mine > ~/left && mkdir -p /var/tmp/x && echo mine > /var/tmp/x/left \
         && (setsid nohup sleep 1000 >/dev/null 2>&1 &) && true",
    )
    .await;
    session(&h.runtime, &first, "left_behind = 41").await;
    assert_eq!(
        session(&h.runtime, &first, "print(left_behind + 1)").await,
        "42"
    );
    assert_eq!(
        run(&h.runtime, &first, Command::Python(COUNT_SLEEPS.into()))
            .await
            .0,
        "1"
    );

    // The next one is taken after the first wrote: by then the refill has
    // booted more (it waits for nothing but the CPU).
    pool_ready(&h.runtime, 2).await;
    let second = support::new_id();
    h.runtime
        .create(&second, &CreateOptions::default())
        .await
        .unwrap();
    assert_eq!(h.runtime.warm_pool().hits, 2);
    assert_eq!(
        bash(
            &h.runtime,
            &second,
            "ls -A /tmp; ls ~/left /var/tmp/x 2>/dev/null; true"
        )
        .await,
        "",
        "a pool sandbox sees nothing of another's files"
    );
    assert_eq!(
        session(&h.runtime, &second, "print('left_behind' in globals())").await,
        "False",
        "a fresh Python session"
    );
    assert_eq!(
        run(&h.runtime, &second, Command::Python(COUNT_SLEEPS.into()))
            .await
            .0,
        "0",
        "no process of another sandbox"
    );

    // Checkpoints: a pool sandbox's records what a cold one's does.
    session(&h.runtime, &second, "kept = 'across the restore'").await;
    let pooled = h
        .runtime
        .checkpoint(&second, checkpoint_request())
        .await
        .unwrap();
    h.runtime.resize_warm_pool(0);
    assert_eq!(h.runtime.warm_pool().ready, 0, "a shrink destroys at once");
    let cold = support::new_id();
    h.runtime
        .create(&cold, &CreateOptions::default())
        .await
        .unwrap();
    assert_eq!(h.runtime.warm_pool().hits, 2, "no pool, a cold boot");
    let cold_manifest = h
        .runtime
        .checkpoint(&cold, checkpoint_request())
        .await
        .unwrap();
    assert_eq!(pooled.sandbox_id, second);
    assert_eq!(pooled.network, cold_manifest.network);
    assert_eq!(pooled.sandbox_image, cold_manifest.sandbox_image);
    assert_eq!(pooled.agent_version, cold_manifest.agent_version);
    assert_eq!(pooled.runsc_version, cold_manifest.runsc_version);
    assert_eq!(pooled.platform, cold_manifest.platform);
    assert_eq!(pooled.cpu_features, cold_manifest.cpu_features);
    let restored = support::new_id();
    h.runtime.restore(&restored, &pooled).await.unwrap();
    assert_eq!(
        session(&h.runtime, &restored, "print(kept)").await,
        "across the restore"
    );
    h.runtime.settle().await;
}

/// A pool sandbox has no sandbox id and nothing in the bucket until a
/// create takes it; the create records it as any create does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_sandbox_holds_nothing_in_the_bucket_until_a_create_takes_it() {
    let h = host_on(support::images()).await;
    h.runtime.start_warm_pool(1);
    let runtime = Arc::clone(&h.runtime);
    let server = support::server_counted(
        "instance-warm",
        Arc::clone(&h.store),
        Some(Arc::clone(&h.runtime) as Arc<dyn SandboxRuntime>),
        Arc::default(),
        |parts| parts.warm_pool = Some(runtime),
    );
    let addr = support::serve(server).await;
    pool_ready(&h.runtime, 1).await;
    let everything = h.store.list_all("").await.unwrap();
    assert!(
        everything.is_empty(),
        "a warm sandbox writes nothing to the bucket: {:?}",
        everything
            .iter()
            .map(|o| o.key.as_str())
            .collect::<Vec<_>>()
    );
    let metrics = support::get_text(format!("http://{addr}/metrics")).await;
    assert!(metrics.contains("sandboxd_warm_pool_ready 1"), "{metrics}");

    let mut ws = support::ws::Ws::connect(&format!("ws://{addr}/create")).await;
    ws.send(json!({})).await;
    let mut id = None;
    loop {
        let frame = ws.next_value().await;
        if frame["event"] == "sandbox_id" {
            id = frame["sandbox_id"].as_str().map(str::to_owned);
        }
        assert_ne!(frame["status"], "SANDBOX_CREATION_ERROR", "{frame}");
        if frame["status"] == "SANDBOX_RUNNING" {
            break;
        }
    }
    let id = id.expect("a sandbox id");
    assert_eq!(
        h.runtime.warm_pool().hits,
        1,
        "the create took the warm one"
    );
    let keys: Vec<String> = h
        .store
        .list_all("sandboxes/")
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key.as_str().to_owned())
        .collect();
    assert!(
        !keys.is_empty()
            && keys
                .iter()
                .all(|key| key.starts_with(&format!("sandboxes/{id}/"))),
        "only the new sandbox is recorded: {keys:?}"
    );
    let frames = ws.exec("bash", "echo taken").await;
    assert!(frames.contains(&"stdout:taken\n".to_owned()), "{frames:?}");
    ws.send(json!({"action": "kill_sandbox"})).await;
    ws.until_close().await;
    h.runtime.settle().await;
}

/// A template in a catalog of the test's own: the default image plus a
/// ready file naming `command`.
async fn ready_template(command: &ReadyCommand) -> (tempfile::TempDir, ImageCatalog) {
    let real = support::images();
    let default = real.default_image().unwrap();
    let dir = tempfile::Builder::new()
        .prefix("sandboxd-ready-images-")
        .tempdir_in("/var/tmp")
        .unwrap();
    std::os::unix::fs::symlink(
        real.dir.join(&default.digest),
        dir.path().join(&default.digest),
    )
    .unwrap();
    std::os::unix::fs::symlink(&default.digest, dir.path().join("default")).unwrap();
    let catalog = ImageCatalog::new(dir.path(), "default");
    sandboxd::runtime::images::templates::ready_template(
        &catalog,
        "ready",
        None,
        command,
        &dir.path().join(".scratch"),
    )
    .await
    .unwrap();
    (dir, catalog)
}

fn on_image(name: &str) -> CreateOptions {
    CreateOptions {
        image: Some(name.to_owned()),
        ..CreateOptions::default()
    }
}

/// A ready template whose start command takes 2 s: the first create pays
/// it, the second restores the template's checkpoint (well under the 2 s),
/// and both find the command's state: a global of the Python session and
/// the process it started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ready_template_runs_its_start_command_once_and_restores_its_state() {
    let command = ReadyCommand {
        language: ReadyLanguage::Python,
        code: "import json, sqlite3, subprocess, time\n\
               time.sleep(2)\n\
               warmed = json.dumps({'ready': True})\n\
               service = subprocess.Popen(['sleep', '1000'], stdout=subprocess.DEVNULL, \
               stderr=subprocess.DEVNULL, start_new_session=True)\n"
            .to_owned(),
        timeout_s: Some(60),
    };
    let (_images, catalog) = ready_template(&command).await;
    let template = catalog.resolve("ready").unwrap();
    assert_ne!(template.digest, catalog.default_image().unwrap().digest);
    let h = host_on(catalog).await;

    let first = support::new_id();
    let started = Instant::now();
    h.runtime.create(&first, &on_image("ready")).await.unwrap();
    let first_took = started.elapsed();
    let second = support::new_id();
    let started = Instant::now();
    h.runtime.create(&second, &on_image("ready")).await.unwrap();
    let second_took = started.elapsed();
    println!("ready template: first create {first_took:?}, second {second_took:?}");
    assert!(
        first_took >= Duration::from_secs(2),
        "the first create runs the start command: {first_took:?}"
    );
    assert!(
        second_took < Duration::from_secs(2),
        "the second create does not run the 2 s start command again: {second_took:?}"
    );
    for sandbox in [&first, &second] {
        assert_eq!(
            session(&h.runtime, sandbox, "print(json.loads(warmed)['ready'])").await,
            "True",
            "the start command's globals are there"
        );
        assert_eq!(
            session(&h.runtime, sandbox, "print(service.poll())").await,
            "None",
            "the process it started runs"
        );
        assert_eq!(
            run(&h.runtime, sandbox, Command::Python(COUNT_SLEEPS.into()))
                .await
                .0,
            "1"
        );
    }
    // Each is a sandbox of its own.
    bash(&h.runtime, &first, "echo first > /tmp/mine").await;
    assert_eq!(bash(&h.runtime, &second, "ls -A /tmp").await, "");

    // Its checkpoint records the template, and restores with the state.
    let manifest = h
        .runtime
        .checkpoint(&second, checkpoint_request())
        .await
        .unwrap();
    assert_eq!(
        manifest.sandbox_image.as_deref(),
        Some(template.digest.as_str())
    );
    let restored = support::new_id();
    h.runtime.restore(&restored, &manifest).await.unwrap();
    assert_eq!(
        session(&h.runtime, &restored, "print(service.poll(), warmed)").await,
        "None {\"ready\": true}"
    );
    h.runtime.settle().await;
}

/// A start command that fails fails the create with its output, and the
/// next create tries again (nothing half-made is kept).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_start_command_fails_the_create_with_its_output() {
    let command = ReadyCommand {
        language: ReadyLanguage::Bash,
        code: "echo 'no database here' >&2; exit 3".to_owned(),
        timeout_s: Some(30),
    };
    let (_images, catalog) = ready_template(&command).await;
    let h = host_on(catalog).await;
    for _ in 0..2 {
        let err = h
            .runtime
            .create(&support::new_id(), &on_image("ready"))
            .await
            .expect_err("the start command fails");
        let text = err.to_string();
        assert!(
            text.contains("exited with 3") && text.contains("no database here"),
            "{text}"
        );
    }
    h.runtime.settle().await;
}

/// `runsc list` of a runsc root: the ids of its containers.
fn containers_under(root: &std::path::Path) -> Vec<String> {
    let output = std::process::Command::new("runsc")
        .arg("--root")
        .arg(root)
        .args(["list", "--format", "json"])
        .output()
        .unwrap();
    let listed: Vec<serde_json::Value> = serde_json::from_slice(&output.stdout).unwrap_or_default();
    listed
        .iter()
        .filter_map(|c| c["id"].as_str().map(str::to_owned))
        .collect()
}

/// The server binary with a pool of two: `/metrics` reports it, a create
/// over WebSocket takes one, and SIGTERM leaves no container behind (the
/// refill stops, the warm sandboxes are destroyed with the rest).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_binary_keeps_a_pool_and_leaves_no_container_at_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = support::process::Launch::new("warm", dir.path())
        .with_args(&["--warm-pool", "2"])
        .start()
        .await;
    let metric = |text: &str, name: &str| -> f64 {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} is not on /metrics:\n{text}"))
    };
    let scrape = || async { support::get_text(format!("http://{}/metrics", server.addr)).await };
    let deadline = Instant::now() + Duration::from_secs(60);
    while metric(&scrape().await, "sandboxd_warm_pool_ready") < 2.0 {
        assert!(Instant::now() < deadline, "the pool never filled");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let root = dir.path().join("warm").join("run").join("runsc");
    assert_eq!(containers_under(&root).len(), 2, "two warm containers");
    let (mut ws, _, _) = server.create(json!({})).await;
    assert_eq!(
        metric(&scrape().await, "sandboxd_warm_pool_hits_total"),
        1.0
    );
    assert_eq!(ws.exec("bash", "echo warm").await[1], "stdout:warm\n");
    server.signal("-TERM");
    ws.until_close().await;
    assert_eq!(
        containers_under(&root),
        Vec::<String>::new(),
        "nothing is left running after SIGTERM"
    );
}

/// Decision 23: without a warm sandbox to take, a create's container boots
/// beside the create's store writes (`prepare_create`), and `create` takes
/// it up instead of booting another; a prepared container whose create
/// does not come is destroyed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_takes_the_container_booted_beside_its_writes() {
    let h = host_on(support::images()).await;
    let root = h._dir.path().join("runsc");
    let sandbox = support::new_id();
    let options = CreateOptions::default();
    h.runtime.prepare_create(&sandbox, &options).await;
    let booted = containers_under(&root);
    assert_eq!(booted.len(), 1, "one container booted ahead: {booted:?}");

    h.runtime.create(&sandbox, &options).await.unwrap();
    assert_eq!(
        containers_under(&root),
        booted,
        "the create took the prepared container, booting none"
    );
    assert_eq!(h.runtime.warm_pool().misses, 0);
    assert_eq!(
        bash(&h.runtime, &sandbox, "echo prepared").await,
        "prepared"
    );
    assert_eq!(
        session(&h.runtime, &sandbox, "x = 41\nprint(x + 1)").await,
        "42"
    );

    // Its create never comes (the writes failed): the container goes.
    let other = support::new_id();
    h.runtime.prepare_create(&other, &options).await;
    assert_eq!(containers_under(&root).len(), 2);
    h.runtime.forget_prepared(&other);
    h.runtime.destroy(&sandbox).await.unwrap();
    h.runtime.settle().await;
    let left = containers_under(&root);
    assert!(left.is_empty(), "nothing left running: {left:?}");

    // A create that is not of the kind a warm sandbox serves (egress, a
    // snapshot) prepares nothing.
    let egress = CreateOptions {
        network: controllers::api::NetworkMode::Egress,
        ..CreateOptions::default()
    };
    h.runtime.prepare_create(&support::new_id(), &egress).await;
    assert!(containers_under(&root).is_empty());
}
