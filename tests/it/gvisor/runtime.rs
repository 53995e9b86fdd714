//! The gVisor runtime against real `runsc` (CI installs it; without it these
//! tests fail, they never skip).

use crate::support;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use controllers::api::{CheckpointManifest, SandboxId};
use controllers::runtime::{
    CheckpointRequest, Command, CreateOptions, ExecEvent, ExecRequest, Execution, RuntimeError,
    SandboxRuntime,
};
use controllers::store::Store;
use sandboxd::runtime::agent::protocol::AGENT_PROTOCOL_VERSION;
use sandboxd::runtime::{BundleSpec, GvisorConfig, GvisorRuntime, Runsc};

/// Python that prints how many `sleep` processes exist in the sandbox.
const COUNT_SLEEPS: &str = "import os\nprint(sum(1 for p in os.listdir('/proc') if p.isdigit() and open(f'/proc/{p}/comm').read().strip() == 'sleep'))";
use sandboxd::store::LocalStore;

/// One runtime "host": its own runsc root and state directory.
struct Host {
    runtime: Arc<GvisorRuntime>,
    _cleanup: support::RunscCleanup,
    _dir: tempfile::TempDir,
}

async fn host(store: Arc<dyn Store>) -> Host {
    let dir = tempfile::tempdir().unwrap();
    let runtime = support::runtime_with_store(dir.path(), store).await;
    Host {
        runtime: Arc::new(runtime),
        _cleanup: support::RunscCleanup(dir.path().join("runsc")),
        _dir: dir,
    }
}

/// A host of its own with one fresh sandbox (the temp dir holds its store).
async fn one_sandbox() -> (tempfile::TempDir, Host, SandboxId) {
    let dir = tempfile::tempdir().unwrap();
    let h = host(shared_store(dir.path())).await;
    let id = support::new_id();
    h.runtime
        .create(&id, &CreateOptions::default())
        .await
        .unwrap();
    (dir, h, id)
}

fn shared_store(dir: &Path) -> Arc<dyn Store> {
    Arc::new(LocalStore::open(dir).unwrap())
}

struct Outcome {
    stdout: String,
    stderr: String,
    code: i32,
    /// When each stdout chunk arrived, relative to the start.
    stdout_times: Vec<Duration>,
    /// The runtime said it killed the execution for a forced checkpoint.
    force_killed: bool,
}

async fn finish(mut execution: Execution) -> Outcome {
    let started = Instant::now();
    let (mut stdout, mut stderr, mut stdout_times) = (Vec::new(), Vec::new(), Vec::new());
    let mut force_killed = false;
    loop {
        let event = tokio::time::timeout(Duration::from_secs(60), execution.events.recv())
            .await
            .expect("execution timed out")
            .expect("event stream ended without Exited");
        match event {
            ExecEvent::Stdout(data) => {
                stdout.extend_from_slice(&data);
                stdout_times.push(started.elapsed());
            }
            ExecEvent::Stderr(data) => stderr.extend_from_slice(&data),
            // The runtime alone runs no after-exec hooks.
            ExecEvent::AfterExecFailed(message) => panic!("after-exec hook failed: {message}"),
            ExecEvent::HoldLost => panic!("a runtime never sends HoldLost"),
            ExecEvent::ForceKilled => force_killed = true,
            ExecEvent::Result(_) => panic!("no rich results were asked for"),
            ExecEvent::Exited(code) => {
                return Outcome {
                    stdout: String::from_utf8_lossy(&stdout).into_owned(),
                    stderr: String::from_utf8_lossy(&stderr).into_owned(),
                    code,
                    stdout_times,
                    force_killed,
                };
            }
        }
    }
}

async fn run(runtime: &GvisorRuntime, sandbox: &SandboxId, command: Command) -> Outcome {
    finish(
        runtime
            .exec(sandbox, ExecRequest::new(command))
            .await
            .unwrap(),
    )
    .await
}

fn bash(code: &str) -> Command {
    Command::Bash(code.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_streams_separately_and_in_order_as_produced() {
    let (_dir, h, id) = one_sandbox().await;
    let code = "import sys, time\nfor i in range(5):\n    print('out', i, flush=True)\n    print('err', i, file=sys.stderr, flush=True)\n    time.sleep(0.2)\n";
    let outcome = run(&h.runtime, &id, Command::Python(code.into())).await;
    assert_eq!(outcome.code, 0, "{}", outcome.stderr);
    assert_eq!(outcome.stdout, "out 0\nout 1\nout 2\nout 3\nout 4\n");
    assert_eq!(outcome.stderr, "err 0\nerr 1\nerr 2\nerr 3\nerr 4\n");
    let first = outcome.stdout_times[0];
    let last = *outcome.stdout_times.last().unwrap();
    assert!(
        last - first >= Duration::from_millis(600),
        "output must stream, not arrive at the end: {:?}",
        outcome.stdout_times
    );
    h.runtime.destroy(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stdin_is_written_as_it_arrives_and_eof_is_delivered() {
    let (_dir, h, id) = one_sandbox().await;

    let mut execution = h
        .runtime
        .exec(
            &id,
            ExecRequest::new(Command::Python(
                "while True:\n    line = input()\n    print(line[::-1], flush=True)\n".into(),
            )),
        )
        .await
        .unwrap();
    for word in ["hello", "sandbox"] {
        execution
            .control
            .write_stdin(Bytes::from(format!("{word}\n")))
            .await
            .unwrap();
        // print() may arrive as two writes ("olleh", "\n"): read up to the newline.
        let mut line = Vec::new();
        while !line.ends_with(b"\n") {
            let event = tokio::time::timeout(Duration::from_secs(10), execution.events.recv())
                .await
                .unwrap()
                .unwrap();
            match event {
                ExecEvent::Stdout(data) => line.extend_from_slice(&data),
                other => panic!("expected stdout, got {other:?}"),
            }
        }
        let expected: String = word.chars().rev().collect();
        assert_eq!(
            String::from_utf8(line).unwrap(),
            format!("{expected}\n"),
            "echo of {word}"
        );
    }
    execution.control.close_stdin().await.unwrap();
    let outcome = finish(execution).await;
    assert_eq!(
        outcome.code, 1,
        "input() raises EOFError at end of stdin: {}",
        outcome.stderr
    );
    assert!(outcome.stderr.contains("EOFError"), "{}", outcome.stderr);

    // cat copies stdin to stdout and exits 0 at EOF.
    let execution = h
        .runtime
        .exec(&id, ExecRequest::new(bash("cat")))
        .await
        .unwrap();
    execution
        .control
        .write_stdin(Bytes::from_static(b"piped through\n"))
        .await
        .unwrap();
    execution.control.close_stdin().await.unwrap();
    let outcome = finish(execution).await;
    assert_eq!(
        (outcome.code, outcome.stdout.as_str()),
        (0, "piped through\n")
    );
    h.runtime.destroy(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_codes_pass_through() {
    let (_dir, h, id) = one_sandbox().await;
    assert_eq!(run(&h.runtime, &id, bash("true")).await.code, 0);
    assert_eq!(
        run(
            &h.runtime,
            &id,
            Command::Python("import sys; sys.exit(3)".into())
        )
        .await
        .code,
        3
    );
    assert_eq!(run(&h.runtime, &id, bash("kill -9 $$")).await.code, 137);
    assert_eq!(run(&h.runtime, &id, bash("exit 7")).await.code, 7);
    let outcome = run(&h.runtime, &id, bash("id -u; echo $HOME; pwd")).await;
    assert_eq!(
        outcome.stdout, "1000\n/home/sandbox\n/home/sandbox\n",
        "user code runs unprivileged in its home"
    );
    h.runtime.destroy(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_ends_the_whole_process_tree_and_one_execution_runs_at_a_time() {
    let (_dir, h, id) = one_sandbox().await;
    let mut execution = h
        .runtime
        .exec(
            &id,
            ExecRequest::new(bash("sleep 1000 & sleep 1001 & echo started; wait")),
        )
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(10), execution.events.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first, ExecEvent::Stdout(Bytes::from_static(b"started\n")));

    let second = h.runtime.exec(&id, ExecRequest::new(bash("true"))).await;
    assert!(
        matches!(second, Err(RuntimeError::ExecutionInProgress(_))),
        "{second:?}"
    );
    let refused = h
        .runtime
        .checkpoint(
            &id,
            CheckpointRequest {
                checkpoint_id: support::new_id(),
                epoch: 1,
                name: None,
                force: false,
                keep_executions: false,
            },
        )
        .await;
    assert!(
        matches!(refused, Err(RuntimeError::ExecutionInProgress(_))),
        "{refused:?}"
    );

    let killed_at = Instant::now();
    execution.control.kill().await.unwrap();
    let outcome = finish(execution).await;
    assert_eq!(outcome.code, 137);
    assert!(killed_at.elapsed() < Duration::from_secs(5));
    let left = run(&h.runtime, &id, Command::Python(COUNT_SLEEPS.into())).await;
    assert_eq!(
        left.stdout.trim(),
        "0",
        "no sleep survives the kill: {}",
        left.stderr
    );
    h.runtime.destroy(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_count_is_limited_for_user_code() {
    let (_dir, h, id) = one_sandbox().await;
    // The limit is 64 processes; try to fork 100 and see where it stops.
    let code = "import os, signal, time\npids, error = [], None\nfor _ in range(100):\n    try:\n        pid = os.fork()\n    except OSError as e:\n        error = e.errno\n        break\n    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    pids.append(pid)\nprint(len(pids), error)\nfor pid in pids:\n    os.kill(pid, signal.SIGKILL)\n    os.waitpid(pid, 0)\n";
    let outcome = run(&h.runtime, &id, Command::Python(code.into())).await;
    let fields: Vec<&str> = outcome.stdout.split_whitespace().collect();
    assert_eq!(fields.len(), 2, "{} {}", outcome.stdout, outcome.stderr);
    let forked: u64 = fields[0].parse().unwrap();
    assert!(
        forked <= 64,
        "RLIMIT_NPROC must stop user code at 64 processes, forked {forked}"
    );
    assert_eq!(fields[1], "11", "fork fails with EAGAIN");
    h.runtime.destroy(&id).await.unwrap();
}

async fn checkpoint(h: &Host, id: &SandboxId) -> CheckpointManifest {
    h.runtime
        .checkpoint(
            id,
            CheckpointRequest {
                checkpoint_id: support::new_id(),
                epoch: 4,
                name: Some("before-move".into()),
                force: false,
                keep_executions: false,
            },
        )
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_restores_on_another_host_with_processes_files_and_python_state() {
    let dir = tempfile::tempdir().unwrap();
    let store = shared_store(dir.path());
    let a = host(store.clone()).await;
    let b = host(store.clone()).await;
    let id = support::new_id();
    a.runtime
        .create(&id, &CreateOptions::default())
        .await
        .unwrap();

    // The counter replaces its file atomically: a reader (here or on the
    // other host, if the checkpoint fell between truncate and write) never
    // sees it empty.
    let setup = run(&a.runtime, &id, bash(
        "echo kept > ~/notes.txt; head -c 1000000 /dev/urandom > /tmp/blob; sha256sum /tmp/blob | cut -d' ' -f1; \
         nohup bash -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 0.1; done' >/dev/null 2>&1 &",
    ))
    .await;
    assert_eq!(setup.code, 0, "{}", setup.stderr);
    let blob_sha = setup.stdout.trim().to_owned();
    assert_eq!(
        run(
            &a.runtime,
            &id,
            Command::PythonSession("x = 41\nimport math".into())
        )
        .await
        .code,
        0
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before: u64 = run(&a.runtime, &id, bash("cat /tmp/counter"))
        .await
        .stdout
        .trim()
        .parse()
        .unwrap();

    let manifest = checkpoint(&a, &id).await;
    assert!(!a.runtime.is_running(&id));
    // runsc wrote the image into the store's staging directory and the store
    // took it by a rename: nothing is left there.
    let staging = store.staging_dir().expect("a directory store stages");
    let left: Vec<_> = std::fs::read_dir(&staging).unwrap().flatten().collect();
    assert!(left.is_empty(), "left in {}: {left:?}", staging.display());
    // The digest taken while runsc wrote is the stored file's.
    let stored = store
        .local_path(&controllers::store::ObjectKey::new(&manifest.image.key).unwrap())
        .unwrap();
    let bytes = std::fs::read(&stored).unwrap();
    assert_eq!(bytes.len() as u64, manifest.image.size);
    assert_eq!(
        hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&bytes)),
        manifest.image.sha256
    );
    assert_eq!(manifest.epoch, 4);
    assert_eq!(manifest.name.as_deref(), Some("before-move"));
    assert_eq!(manifest.image.sha256.len(), 64);
    assert!(
        manifest.runsc_version.starts_with("runsc version"),
        "{}",
        manifest.runsc_version
    );
    assert!(!manifest.cpu_features.is_empty());

    // Another "host": another runsc root, state directory and container id.
    b.runtime.restore(&id, &manifest).await.unwrap();
    assert!(b.runtime.is_running(&id));
    // The quota lifted while runsc restored is back (`runtime/checkpoint/cpu_quota.rs`).
    assert_eq!(cpu_quota_of_only_container(&b), "100000");
    let python = run(
        &b.runtime,
        &id,
        Command::PythonSession("print(x + 1, math.pi > 3)".into()),
    )
    .await;
    assert_eq!(python.stdout, "42 True\n", "{}", python.stderr);
    let files = run(
        &b.runtime,
        &id,
        bash("cat ~/notes.txt; sha256sum /tmp/blob | cut -d' ' -f1"),
    )
    .await;
    assert_eq!(files.stdout, format!("kept\n{blob_sha}\n"));
    let after: u64 = run(&b.runtime, &id, bash("cat /tmp/counter"))
        .await
        .stdout
        .trim()
        .parse()
        .unwrap();
    assert!(
        after >= before,
        "the counter continues from where it was ({before} -> {after})"
    );
    // Polled, not timed: a loaded host may run the loop late.
    let counter = || async {
        let out = run(&b.runtime, &id, bash("cat /tmp/counter")).await;
        out.stdout.trim().parse::<u64>().unwrap()
    };
    let later = support::eventually(counter, |later| *later > after).await;
    assert!(
        later > after,
        "the background process keeps running after restore ({after} -> {later})"
    );
    b.runtime.destroy(&id).await.unwrap();
}

/// The CPU quota (cgroup v1 `cpu.cfs_quota_us`, or v2 `cpu.max`) of the one
/// container under a host's runsc root.
fn cpu_quota_of_only_container(h: &Host) -> String {
    let root = h._dir.path().join("runsc");
    let listed = std::process::Command::new("runsc")
        .arg("--root")
        .arg(&root)
        .args(["list", "--format", "json"])
        .output()
        .unwrap();
    let containers: Vec<serde_json::Value> = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(containers.len(), 1, "{containers:?}");
    let id = containers[0]["id"].as_str().unwrap();
    let cgroups = Path::new("/sys/fs/cgroup");
    [
        cgroups.join("cpu").join(id).join("cpu.cfs_quota_us"),
        cgroups.join(id).join("cpu.max"),
    ]
    .iter()
    .find_map(|file| std::fs::read_to_string(file).ok())
    .unwrap_or_else(|| panic!("no CPU cgroup for container {id}"))
    .trim()
    .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_checkpoint_kills_the_running_execution_first() {
    let (_dir, h, id) = one_sandbox().await;
    let execution = h
        .runtime
        .exec(&id, ExecRequest::new(bash("sleep 500 & sleep 600")))
        .await
        .unwrap();
    let manifest = h
        .runtime
        .checkpoint(
            &id,
            CheckpointRequest {
                checkpoint_id: support::new_id(),
                epoch: 1,
                name: None,
                force: true,
                keep_executions: false,
            },
        )
        .await
        .unwrap();
    let killed = finish(execution).await;
    assert_eq!(killed.code, 137);
    assert!(
        killed.force_killed,
        "the runtime says it killed it, before the exit"
    );
    h.runtime.restore(&id, &manifest).await.unwrap();
    let left = run(&h.runtime, &id, Command::Python(COUNT_SLEEPS.into())).await;
    assert_eq!(left.stdout.trim(), "0");
    h.runtime.destroy(&id).await.unwrap();
}

/// A truncated image is refused before runsc starts; flipped bytes (same
/// size) are found by the hash that runs beside `runsc restore` on a directory
/// store, and the restored container is destroyed before anyone can use it.
/// With a store that is not a directory (GCS), a checkpoint's image stays
/// on the host that took it for a restore there, and a taker told the
/// image's key fetches it before it restores (decision 24): neither restore
/// downloads anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restores_use_the_image_kept_where_it_was_taken_or_fetched_ahead_by_the_taker() {
    let memory = Arc::new(controllers::testing::MemoryStore::new());
    let store: Arc<dyn Store> = memory.clone();
    let a = host(store.clone()).await;
    let b = host(store.clone()).await;
    let id = support::new_id();
    a.runtime
        .create(&id, &CreateOptions::default())
        .await
        .unwrap();
    run(&a.runtime, &id, bash("echo kept > ~/notes.txt")).await;

    // Checkpointed and restored on A: no request to the store.
    let manifest = checkpoint(&a, &id).await;
    let before = memory.operations();
    a.runtime.restore(&id, &manifest).await.unwrap();
    assert_eq!(
        memory.operations(),
        before,
        "restored from the image kept here"
    );
    assert_eq!(
        run(&a.runtime, &id, bash("cat ~/notes.txt")).await.stdout,
        "kept\n"
    );

    // B is told the key of the next image before A takes it.
    let handoff_id = support::new_id();
    let key = controllers::layout::checkpoint_image_key(&handoff_id);
    let landed = b
        .runtime
        .prefetch_checkpoint(&id, &key)
        .expect("not in the store yet: watched for");
    let manifest = a
        .runtime
        .checkpoint(
            &id,
            CheckpointRequest {
                checkpoint_id: handoff_id,
                epoch: 5,
                name: None,
                force: false,
                keep_executions: false,
            },
        )
        .await
        .unwrap();
    // B's watch finds it within a few polls: its last request is the one
    // that found it, and the restore waits for the download under way.
    tokio::time::timeout(Duration::from_secs(10), landed)
        .await
        .expect("B's watch never ended");
    let settled = memory.operations();
    b.runtime.restore(&id, &manifest).await.unwrap();
    assert_eq!(
        memory.operations(),
        settled,
        "restored from the image fetched ahead"
    );
    assert_eq!(
        run(&b.runtime, &id, bash("cat ~/notes.txt")).await.stdout,
        "kept\n"
    );
    b.runtime.destroy(&id).await.unwrap();
}

fn handoff_request(checkpoint_id: SandboxId, epoch: u64) -> CheckpointRequest {
    CheckpointRequest {
        checkpoint_id,
        epoch,
        name: None,
        force: false,
        keep_executions: false,
    }
}

/// Waits (bounded) until `host` has a restore staged ahead of its transfer.
async fn until_staged(host: &Host) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while host.runtime.staged_restores().0 == 0 {
        assert!(Instant::now() < deadline, "nothing was staged");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A taker that fetches a handoff's image ahead also restores it before
/// the transfer lands (decision 26): the restore under the hold takes that
/// container up, with no request to the store and no runsc restore, and
/// it is the checkpoint's state. A container staged for another checkpoint
/// of the sandbox is never taken for it: destroyed, and the asked-for
/// checkpoint restored as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taker_restores_ahead_of_the_transfer_only_the_checkpoint_it_is_given() {
    let memory = Arc::new(controllers::testing::MemoryStore::new());
    let store: Arc<dyn Store> = memory.clone();
    let a = host(store.clone()).await;
    let b = host(store.clone()).await;
    a.runtime.enable_staged_restores();
    b.runtime.enable_staged_restores();
    let id = support::new_id();
    a.runtime
        .create(&id, &CreateOptions::default())
        .await
        .unwrap();
    run(&a.runtime, &id, bash("echo kept > ~/notes.txt")).await;

    // A hands over to B: B stages the restore once image and manifest land.
    let first = support::new_id();
    b.runtime
        .prefetch_checkpoint(&id, &controllers::layout::checkpoint_image_key(&first));
    let handed = a
        .runtime
        .checkpoint(&id, handoff_request(first.clone(), 5))
        .await
        .unwrap();
    until_staged(&b).await;
    let before = memory.operations();
    // The waiting taker's next pass asks again: nothing is fetched twice.
    b.runtime
        .prefetch_checkpoint(&id, &controllers::layout::checkpoint_image_key(&first));
    tokio::time::sleep(Duration::from_millis(300)).await;
    b.runtime.restore(&id, &handed).await.unwrap();
    assert_eq!(b.runtime.staged_restores(), (0, 1), "taken up");
    assert_eq!(
        memory.operations(),
        before,
        "nothing read again, nor at the restore"
    );
    assert_eq!(
        run(&b.runtime, &id, bash("cat ~/notes.txt")).await.stdout,
        "kept\n"
    );

    // B checkpoints (kept), goes on, and hands over a later state while A
    // waits for it; then A is asked to restore the earlier checkpoint.
    let kept = checkpoint(&b, &id).await;
    b.runtime.restore(&id, &kept).await.unwrap();
    run(&b.runtime, &id, bash("echo later > ~/notes.txt")).await;
    let second = support::new_id();
    a.runtime
        .prefetch_checkpoint(&id, &controllers::layout::checkpoint_image_key(&second));
    b.runtime
        .checkpoint(&id, handoff_request(second, 6))
        .await
        .unwrap();
    until_staged(&a).await;
    a.runtime.restore(&id, &kept).await.unwrap();
    assert_eq!(a.runtime.staged_restores(), (0, 0), "not taken, destroyed");
    assert_eq!(
        run(&a.runtime, &id, bash("cat ~/notes.txt")).await.stdout,
        "kept\n",
        "the checkpoint asked for, not the staged one"
    );
    a.runtime.destroy(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupted_or_truncated_image_is_refused() {
    let (dir, h, id) = one_sandbox().await;
    let manifest = checkpoint(&h, &id).await;
    let image_path = dir.path().join(&manifest.image.key);
    let original = std::fs::read(&image_path).unwrap();

    // Flip bytes in the middle: runsc itself would restore this silently.
    let mut corrupted = original.clone();
    let middle = corrupted.len() / 2;
    for byte in &mut corrupted[middle..middle + 64] {
        *byte ^= 0xff;
    }
    std::fs::write(&image_path, &corrupted).unwrap();
    let err = h.runtime.restore(&id, &manifest).await.unwrap_err();
    assert!(matches!(err, RuntimeError::CorruptImage { .. }), "{err}");
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
    assert!(!h.runtime.is_running(&id), "nothing half-restored");

    std::fs::write(&image_path, &original[..original.len() / 2]).unwrap();
    let err = h.runtime.restore(&id, &manifest).await.unwrap_err();
    assert!(err.to_string().contains("size mismatch"), "{err}");

    std::fs::remove_file(&image_path).unwrap();
    let err = h.runtime.restore(&id, &manifest).await.unwrap_err();
    assert!(err.to_string().contains("not found"), "{err}");

    // Intact again: it restores.
    std::fs::write(&image_path, &original).unwrap();
    h.runtime.restore(&id, &manifest).await.unwrap();
    assert_eq!(
        run(&h.runtime, &id, bash("echo alive")).await.stdout,
        "alive\n"
    );
    h.runtime.destroy(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_from_a_host_with_other_cpu_features_is_refused_by_name() {
    let (_dir, h, id) = one_sandbox().await;
    let mut manifest = checkpoint(&h, &id).await;
    manifest.cpu_features.push("imaginary_feature".into());
    let err = h.runtime.restore(&id, &manifest).await.unwrap_err();
    assert!(matches!(err, RuntimeError::Incompatible(_)), "{err}");
    assert!(err.to_string().contains("imaginary_feature"), "{err}");
}

/// The agent comes back with the image: a checkpoint whose agent speaks
/// another protocol version is refused before anything starts, naming both;
/// one from before the version was recorded counts as version 1 and restores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_another_agent_version_is_refused_naming_both() {
    let (_dir, h, id) = one_sandbox().await;
    run(&h.runtime, &id, bash("echo 5 > /tmp/kept")).await;
    let mut manifest = checkpoint(&h, &id).await;
    assert_eq!(
        manifest.agent_version,
        Some(AGENT_PROTOCOL_VERSION),
        "the checkpoint records its agent's protocol version"
    );
    let other = AGENT_PROTOCOL_VERSION + 1;
    manifest.agent_version = Some(other);
    let err = h.runtime.restore(&id, &manifest).await.unwrap_err();
    assert!(matches!(err, RuntimeError::Incompatible(_)), "{err}");
    let text = err.to_string();
    assert!(
        text.contains(&format!("protocol version {other}")),
        "{text}"
    );
    assert!(
        text.contains(&format!("versions 1 to {AGENT_PROTOCOL_VERSION}")),
        "{text}"
    );
    assert!(!h.runtime.is_running(&id), "nothing half-restored");

    manifest.agent_version = None;
    h.runtime.restore(&id, &manifest).await.unwrap();
    assert_eq!(
        run(&h.runtime, &id, bash("cat /tmp/kept")).await.stdout,
        "5\n"
    );
    h.runtime.destroy(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filesystem_snapshot_seeds_a_new_sandbox() {
    let dir = tempfile::tempdir().unwrap();
    let store = shared_store(dir.path());
    let h = host(store.clone()).await;
    let source = support::new_id();
    h.runtime
        .create(&source, &CreateOptions::default())
        .await
        .unwrap();
    let made = run(&h.runtime, &source, bash("mkdir -p ~/project/src && echo 'print(6*7)' > ~/project/src/main.py && echo scratch > /tmp/scratch.txt")).await;
    assert_eq!(made.code, 0, "{}", made.stderr);
    let manifest = h
        .runtime
        .snapshot_filesystem(&source, "my-project")
        .await
        .unwrap();
    assert!(manifest.entries >= 3, "{manifest:?}");

    for bad in ["../escape", "UPPER", "", "a/b"] {
        let err = h
            .runtime
            .snapshot_filesystem(&source, bad)
            .await
            .unwrap_err();
        assert!(matches!(err, RuntimeError::Invalid(_)), "{bad:?}: {err}");
    }

    let copy = support::new_id();
    h.runtime
        .create(
            &copy,
            &CreateOptions {
                snapshot_name: Some("my-project".into()),
                ..CreateOptions::default()
            },
        )
        .await
        .unwrap();
    let outcome = run(&h.runtime, &copy, bash("python3 ~/project/src/main.py; cat /tmp/scratch.txt; python3 -c 'import os; print(os.stat(os.path.expanduser(\"~/project/src/main.py\")).st_uid)'")).await;
    assert_eq!(outcome.stdout, "42\nscratch\n1000\n", "{}", outcome.stderr);

    let err = h
        .runtime
        .create(
            &support::new_id(),
            &CreateOptions {
                snapshot_name: Some("no-such-snapshot".into()),
                ..CreateOptions::default()
            },
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no-such-snapshot"), "{err}");
    h.runtime.destroy(&source).await.unwrap();
    h.runtime.destroy(&copy).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_removes_containers_a_crashed_server_left() {
    let dir = tempfile::tempdir().unwrap();
    let store = shared_store(dir.path());
    let root = tempfile::tempdir().unwrap();
    let _cleanup = support::RunscCleanup(root.path().join("runsc"));
    let config = |state: &str| GvisorConfig {
        runsc: Runsc {
            binary: "runsc".into(),
            root: root.path().join("runsc"),
            platform: "ptrace".into(),
            timeouts: sandboxd::runtime::RunscTimeouts::default(),
        },
        state_dir: root.path().join(state),
        images: support::images(),
        bundle: BundleSpec {
            python: "/usr/bin/python3".into(),
            memory_limit_bytes: None,
            cpu_limit: None,
            max_processes: 64,
            tmp_size_mb: 64,
            disk_size_mb: 256,
            cpu_features: None,
        },
        checkpoint_bucket: "local".into(),
        orphaned_checkpoints_budget: sandboxd::runtime::DEFAULT_ORPHANED_CHECKPOINTS_BUDGET,
    };
    let crashed = GvisorRuntime::start(config("state"), store.clone(), store.clone())
        .await
        .unwrap();
    crashed
        .create(&support::new_id(), &CreateOptions::default())
        .await
        .unwrap();
    // The server "crashes": its runtime is dropped without destroying anything.
    drop(crashed);
    let runsc = config("state").runsc;
    assert_eq!(
        runsc.list().await.unwrap().len(),
        1,
        "the container outlives the crashed server"
    );

    let restarted = GvisorRuntime::start(config("state"), store.clone(), store.clone())
        .await
        .unwrap();
    assert!(
        runsc.list().await.unwrap().is_empty(),
        "startup deleted the leftover container"
    );

    // A second server on the same root (the default
    // /run/sandboxd) must not take the running one's containers for
    // leftovers.
    let id = support::new_id();
    restarted
        .create(&id, &CreateOptions::default())
        .await
        .unwrap();
    let _second = GvisorRuntime::start(config("state"), store.clone(), store)
        .await
        .unwrap();
    assert_eq!(
        runsc.list().await.unwrap().len(),
        1,
        "the second server deleted the first one's container"
    );
    let outcome = run(&restarted, &id, bash("echo alive")).await;
    assert_eq!(outcome.stdout, "alive\n");
    restarted.destroy(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_limit_from_config_applies_inside_the_sandbox() {
    let dir = tempfile::tempdir().unwrap();
    let h = host(shared_store(dir.path())).await; // configured with 1 GiB
    let id = support::new_id();
    h.runtime
        .create(&id, &CreateOptions::default())
        .await
        .unwrap();
    let outcome = run(&h.runtime, &id, bash("grep MemTotal /proc/meminfo")).await;
    let kib: u64 = outcome
        .stdout
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{}", outcome.stdout));
    assert_eq!(kib, 1 << 20, "MemTotal shows the 1 GiB limit");
    h.runtime.destroy(&id).await.unwrap();
}

fn pinned_config(root: &Path, features: Vec<String>) -> GvisorConfig {
    GvisorConfig {
        runsc: Runsc {
            binary: "runsc".into(),
            root: root.join("runsc"),
            platform: "ptrace".into(),
            timeouts: sandboxd::runtime::RunscTimeouts::default(),
        },
        state_dir: root.join("state"),
        images: support::images(),
        bundle: BundleSpec {
            python: "/usr/bin/python3".into(),
            memory_limit_bytes: None,
            cpu_limit: None,
            max_processes: 64,
            tmp_size_mb: 64,
            disk_size_mb: 256,
            cpu_features: Some(features),
        },
        checkpoint_bucket: "local".into(),
        orphaned_checkpoints_budget: sandboxd::runtime::DEFAULT_ORPHANED_CHECKPOINTS_BUDGET,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_cpu_features_are_recorded_and_must_exist_on_the_host() {
    let dir = tempfile::tempdir().unwrap();
    let store = shared_store(dir.path());
    let root = tempfile::tempdir().unwrap();
    let _cleanup = support::RunscCleanup(root.path().join("runsc"));
    let host = sandboxd::runtime::host_cpu_features();
    let pinned: Vec<String> = host.iter().take(6).cloned().collect();
    let runtime = GvisorRuntime::start(
        pinned_config(root.path(), pinned.clone()),
        store.clone(),
        store.clone(),
    )
    .await
    .unwrap();
    let id = support::new_id();
    runtime
        .create(&id, &CreateOptions::default())
        .await
        .unwrap();
    let manifest = runtime
        .checkpoint(
            &id,
            CheckpointRequest {
                checkpoint_id: support::new_id(),
                epoch: 1,
                name: None,
                force: false,
                keep_executions: false,
            },
        )
        .await
        .unwrap();
    let mut expected = pinned;
    expected.sort();
    assert_eq!(
        manifest.cpu_features, expected,
        "the pinned set, not the host's"
    );
    runtime.settle().await;

    let err = GvisorRuntime::start(
        pinned_config(root.path(), vec!["imaginary_feature".into()]),
        store.clone(),
        store,
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("imaginary_feature"), "{err}");
}

/// An execution asked for while a checkpoint is being taken is refused. It
/// used to be accepted between the agent's preparation and `runsc
/// checkpoint`, and frozen half-way into the image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_execution_cannot_start_while_a_checkpoint_is_taken() {
    let (_dir, h, id) = one_sandbox().await;
    let checkpointing = h.runtime.checkpoint(
        &id,
        CheckpointRequest {
            checkpoint_id: support::new_id(),
            epoch: 4,
            name: None,
            force: false,
            keep_executions: false,
        },
    );
    // `join!` polls the checkpoint first: it has taken its first steps (the
    // runtime's checks, the agent's preparation asked for) when the first
    // execution is asked for.
    let executions = async {
        tokio::task::yield_now().await;
        let mut refused = 0;
        loop {
            match h
                .runtime
                .exec(&id, ExecRequest::new(bash("sleep 3; echo late")))
                .await
            {
                Ok(execution) => return (Some(execution), refused),
                Err(RuntimeError::NotFound(_)) => return (None, refused),
                Err(err) => {
                    assert!(err.to_string().contains("being checkpointed"), "{err}");
                    refused += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }
        }
    };
    let (checkpointed, (accepted, refused)) = tokio::join!(checkpointing, executions);
    assert!(
        accepted.is_none() || checkpointed.is_err(),
        "an execution started during a checkpoint that then succeeded: it is frozen in the image"
    );
    checkpointed.unwrap();
    assert!(refused > 0, "no execution was tried during the checkpoint");
}

/// A runsc call that hangs is killed after its timeout and reported, instead
/// of holding its sandbox's work-queue slot forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_runsc_call_is_killed_after_its_timeout() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    // The real runsc, except that `state` hangs.
    let wrapper = dir.path().join("runsc-hanging-state");
    std::fs::write(
        &wrapper,
        "#!/bin/sh\nfor arg; do [ \"$arg\" = state ] && exec sleep 600; done\nexec runsc \"$@\"\n",
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir_all(dir.path().join("runsc")).unwrap();
    let runsc = Runsc {
        binary: wrapper,
        root: dir.path().join("runsc"),
        platform: "ptrace".into(),
        timeouts: sandboxd::runtime::RunscTimeouts {
            command: Duration::from_secs(2),
            image: Duration::from_secs(60),
        },
    };
    assert!(
        runsc.list().await.unwrap().is_empty(),
        "the wrapper runs runsc"
    );
    let started = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(30), runsc.state("sbxmissing"))
        .await
        .expect("the runsc call hung past 30 s: it has no timeout");
    let err = outcome.unwrap_err();
    assert!(
        matches!(err, sandboxd::runtime::RunscError::Timeout { .. }),
        "{err}"
    );
    assert!(err.to_string().contains("did not finish within"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10));
}
