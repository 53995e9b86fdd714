//! Sandbox images against real `runsc`: a sandbox sees its image and nothing
//! of the host, the tools people and agents type first work, `"image"` picks
//! another image, a template from a snapshot starts with its files, a
//! checkpoint restores only onto its own image (and only with an agent
//! protocol version the server speaks), and the server refuses to start
//! without its image. `scripts/test.sh` builds the images (`default`
//! and `test-jq`, cached); without them these tests fail, they never skip.

use crate::support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use controllers::api::SandboxId;
use controllers::runtime::{
    CheckpointRequest, Command, CreateOptions, ExecEvent, ExecRequest, RuntimeError, SandboxRuntime,
};
use controllers::store::Store;
use sandboxd::runtime::{GvisorRuntime, ImageCatalog};
use sandboxd::store::LocalStore;

/// The second image `scripts/test.sh` builds: the default packages plus jq.
const SECOND_IMAGE: &str = "test-jq";

struct Host {
    runtime: GvisorRuntime,
    _cleanup: support::RunscCleanup,
    _dir: tempfile::TempDir,
}

/// A runtime "host" on `images`, its state under /var/tmp (a host directory
/// that is not a tmpfs in the sandbox, so its absence there means something).
async fn host_on(store: Arc<dyn Store>, images: ImageCatalog) -> Host {
    let dir = tempfile::Builder::new()
        .prefix("sandboxd-images-test-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let runtime = support::runtime_with_images(dir.path(), store, images).await;
    Host {
        runtime,
        _cleanup: support::RunscCleanup(dir.path().join("runsc")),
        _dir: dir,
    }
}

fn store_in(dir: &Path) -> Arc<dyn Store> {
    Arc::new(LocalStore::open(dir).unwrap())
}

/// Runs bash in the sandbox: (stdout, stderr, exit code).
async fn bash(runtime: &GvisorRuntime, sandbox: &SandboxId, code: &str) -> (String, String, i32) {
    let mut execution = runtime
        .exec(sandbox, ExecRequest::new(Command::Bash(code.to_owned())))
        .await
        .unwrap();
    let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
    loop {
        let event = tokio::time::timeout(Duration::from_secs(120), execution.events.recv())
            .await
            .expect("execution timed out")
            .expect("event stream ended without Exited");
        match event {
            ExecEvent::Stdout(data) => stdout.extend_from_slice(&data),
            ExecEvent::Stderr(data) => stderr.extend_from_slice(&data),
            // The runtime alone runs no after-exec hooks.
            ExecEvent::AfterExecFailed(message) => panic!("after-exec hook failed: {message}"),
            ExecEvent::HoldLost => panic!("a runtime never sends HoldLost"),
            // A forced checkpoint killed it: its exit follows.
            ExecEvent::ForceKilled => {}
            ExecEvent::Result(_) => panic!("no rich results were asked for"),
            ExecEvent::Exited(code) => {
                return (
                    String::from_utf8_lossy(&stdout).into_owned(),
                    String::from_utf8_lossy(&stderr).into_owned(),
                    code,
                );
            }
        }
    }
}

fn with_image(image: &str) -> CreateOptions {
    CreateOptions {
        image: Some(image.to_owned()),
        ..CreateOptions::default()
    }
}

/// An image directory of its own whose `default` is the real image `name`
/// (the digest directory linked, not copied).
fn catalog_with_default(name: &str) -> (tempfile::TempDir, ImageCatalog) {
    let real = support::images();
    let image = real.resolve(name).unwrap_or_else(|err| {
        panic!("{err} (scripts/test.sh builds it: scripts/build-image.sh --name {SECOND_IMAGE} --packages jq)")
    });
    let dir = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(real.dir.join(&image.digest), dir.path().join(&image.digest))
        .unwrap();
    std::os::unix::fs::symlink(&image.digest, dir.path().join("default")).unwrap();
    let catalog = ImageCatalog::new(dir.path(), "default");
    (dir, catalog)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_sees_its_image_and_nothing_of_the_host() {
    // A file every host user may read, in a place the image also has (/opt).
    let planted_dir = PathBuf::from(format!(
        "/opt/sandboxd-planted-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&planted_dir).unwrap();
    let planted = planted_dir.join("secret.txt");
    std::fs::write(&planted, "host secret\n").unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let h = host_on(store_in(dir.path()), support::images()).await;
    let id = support::new_id();
    h.runtime
        .create(&id, &CreateOptions::default())
        .await
        .unwrap();
    let server_binary = env!("CARGO_BIN_EXE_sandboxd");
    let checkout_readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let data_dir = h._dir.path();
    for path in [
        planted.as_path(),
        planted_dir.as_path(),
        Path::new(server_binary),
        checkout_readme.as_path(),
        data_dir,
    ] {
        assert!(path.exists(), "{} exists on the host", path.display());
        let (stdout, stderr, code) = bash(
            &h.runtime,
            &id,
            &format!("cat '{0}' 2>&1; ls -d '{0}' 2>&1", path.display()),
        )
        .await;
        assert_eq!(code, 2, "{}: {stdout}{stderr}", path.display());
        assert!(
            stdout.contains("No such file or directory") && !stdout.contains("host secret"),
            "{} is visible in the sandbox: {stdout}",
            path.display()
        );
    }
    // What it sees is the image: Debian with the statx shim preloaded, and
    // none of the build host's identity (its hostname, its nameservers).
    let (stdout, _, code) = bash(
        &h.runtime,
        &id,
        "grep ^ID= /etc/os-release; cat /etc/ld.so.preload; id -un; cat /etc/hostname; grep -c '^nameserver' /etc/resolv.conf",
    )
    .await;
    assert_eq!(
        stdout,
        "ID=debian\n/usr/local/lib/sandboxd/statx-shim.so\nsandbox\nsandbox\n0\n"
    );
    assert_eq!(code, 1, "grep -c found no nameserver: {stdout}");
    h.runtime.destroy(&id).await.unwrap();
    std::fs::remove_dir_all(&planted_dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tools_people_and_agents_type_first_work() {
    let dir = tempfile::tempdir().unwrap();
    let h = host_on(store_in(dir.path()), support::images()).await;
    let id = support::new_id();
    h.runtime
        .create(&id, &CreateOptions::default())
        .await
        .unwrap();
    // A wheel built by hand (no network): pip installs it for the user.
    let script = r#"set -e
cd ~
ls -l / > /dev/null
ls -la /tmp > /dev/null
ls -l /usr/bin/python3 | grep -q python3
stat -c '%U %a' /home/sandbox
du -s /usr/share/doc > /dev/null
python3 - <<'PY'
import zipfile
with zipfile.ZipFile('demo-1.0-py3-none-any.whl', 'w') as w:
    w.writestr('demo.py', 'ANSWER = 42\n')
    w.writestr('demo-1.0.dist-info/METADATA', 'Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n')
    w.writestr('demo-1.0.dist-info/WHEEL', 'Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n')
    w.writestr('demo-1.0.dist-info/RECORD', '')
PY
pip install --quiet --user --no-index ./demo-1.0-py3-none-any.whl
python3 -c 'import demo; print("pip", demo.ANSWER)'
python3 -m venv /tmp/venv
/tmp/venv/bin/pip install --quiet --no-index ./demo-1.0-py3-none-any.whl
/tmp/venv/bin/python -c 'import demo, sys; print("venv", demo.ANSWER, sys.prefix)'
git --version | cut -d' ' -f1-2
curl --version | head -1 | cut -d' ' -f1
ps -e -o comm= | grep -c python3 > /dev/null && echo ps
test -s /etc/ssl/certs/ca-certificates.crt && echo certs
"#;
    let (stdout, stderr, code) = bash(&h.runtime, &id, script).await;
    assert_eq!(code, 0, "stdout: {stdout}\nstderr: {stderr}");
    assert_eq!(
        stdout, "sandbox 755\npip 42\nvenv 42 /tmp/venv\ngit version\ncurl\nps\ncerts\n",
        "stderr: {stderr}"
    );
    h.runtime.destroy(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn image_picks_another_image_and_a_missing_or_bad_one_is_refused() {
    let images = support::images();
    let second = images.resolve(SECOND_IMAGE).unwrap_or_else(|err| {
        panic!("{err} (scripts/test.sh builds it: scripts/build-image.sh --name {SECOND_IMAGE} --packages jq)")
    });
    let default = images.default_image().unwrap();
    assert_ne!(second.digest, default.digest);
    let dir = tempfile::tempdir().unwrap();
    let h = host_on(store_in(dir.path()), images).await;
    let (plain, jq) = (support::new_id(), support::new_id());
    h.runtime
        .create(&plain, &CreateOptions::default())
        .await
        .unwrap();
    h.runtime
        .create(&jq, &with_image(SECOND_IMAGE))
        .await
        .unwrap();
    let probe = "echo '{\"a\": [1, 2]}' | jq -c .a";
    let (stdout, stderr, code) = bash(&h.runtime, &jq, probe).await;
    assert_eq!((stdout.as_str(), code), ("[1,2]\n", 0), "{stderr}");
    let (_, stderr, code) = bash(&h.runtime, &plain, probe).await;
    assert_eq!(code, 127, "the default image has no jq: {stderr}");
    // Also by digest.
    let by_digest = support::new_id();
    h.runtime
        .create(&by_digest, &with_image(&second.digest))
        .await
        .unwrap();
    assert_eq!(bash(&h.runtime, &by_digest, probe).await.2, 0);

    let missing = h
        .runtime
        .create(&support::new_id(), &with_image("never-built"))
        .await
        .expect_err("no such image");
    assert!(
        matches!(&missing, RuntimeError::Invalid(m) if m.contains("no sandbox image \"never-built\"") && m.contains("scripts/build-image.sh --name never-built")),
        "{missing}"
    );
    let bad = h
        .runtime
        .create(&support::new_id(), &with_image("../../etc"))
        .await
        .expect_err("bad name");
    assert!(
        matches!(&bad, RuntimeError::Invalid(m) if m.contains("invalid image name")),
        "{bad}"
    );
    for id in [plain, jq, by_digest] {
        h.runtime.destroy(&id).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_from_a_snapshot_starts_with_the_snapshots_files() {
    let store_dir = tempfile::tempdir().unwrap();
    let store = store_in(store_dir.path());
    // Templates are written into an image directory of the test's own.
    let (_images_dir, images) = catalog_with_default("default");
    let h = host_on(store.clone(), images.clone()).await;
    let source = support::new_id();
    h.runtime
        .create(&source, &CreateOptions::default())
        .await
        .unwrap();
    let (_, stderr, code) = bash(
        &h.runtime,
        &source,
        "mkdir -p ~/project && echo 'from the snapshot' > ~/project/notes.txt && mkdir -p /workspace/data && echo 7 > /workspace/data/n",
    )
    .await;
    assert_eq!(code, 0, "{stderr}");
    let snapshot_name = format!("seed-{}", uuid::Uuid::new_v4().simple());
    let manifest = h
        .runtime
        .snapshot_filesystem(&source, &snapshot_name)
        .await
        .unwrap();
    let default = images.default_image().unwrap();
    assert_eq!(
        manifest.sandbox_image.as_deref(),
        Some(default.digest.as_str()),
        "the snapshot records its image"
    );
    h.runtime.destroy(&source).await.unwrap();

    let scratch = tempfile::tempdir().unwrap();
    let template = sandboxd::runtime::images::templates::template_from_snapshot(
        &images,
        store.as_ref(),
        &snapshot_name,
        "my-project",
        None,
        scratch.path(),
    )
    .await
    .unwrap();
    assert_ne!(template.digest, default.digest);
    let listed = images.list().unwrap();
    let entry = listed
        .iter()
        .find(|image| image.digest == template.digest)
        .expect("the template is listed");
    assert_eq!(entry.names, vec!["my-project".to_owned()]);
    assert_eq!(entry.base.as_deref(), Some(default.digest.as_str()));

    // A sandbox on the template starts with the files: nothing is unpacked
    // at create (no filesystem_snapshot_name).
    let fresh = support::new_id();
    h.runtime
        .create(&fresh, &with_image("my-project"))
        .await
        .unwrap();
    let (stdout, stderr, code) = bash(
        &h.runtime,
        &fresh,
        "cat ~/project/notes.txt /workspace/data/n; stat -c %U ~/project/notes.txt; echo more >> ~/project/notes.txt",
    )
    .await;
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "from the snapshot\n7\nsandbox\n");
    // The template is shared and read-only: a second sandbox sees it unchanged.
    let second = support::new_id();
    h.runtime
        .create(&second, &with_image("my-project"))
        .await
        .unwrap();
    let (stdout, _, _) = bash(&h.runtime, &second, "cat ~/project/notes.txt").await;
    assert_eq!(stdout, "from the snapshot\n");
    // A template that exists already under another name is the same digest;
    // a bad name is refused before anything is built.
    let err = sandboxd::runtime::images::templates::template_from_snapshot(
        &images,
        store.as_ref(),
        &snapshot_name,
        "Bad/Name",
        None,
        scratch.path(),
    )
    .await
    .expect_err("bad name");
    assert!(err.to_string().contains("invalid image name"), "{err}");
    let err = sandboxd::runtime::images::templates::template_from_snapshot(
        &images,
        store.as_ref(),
        "never-taken",
        "x",
        None,
        scratch.path(),
    )
    .await
    .expect_err("no snapshot");
    assert!(
        err.to_string()
            .contains("no filesystem snapshot named \"never-taken\""),
        "{err}"
    );
    for id in [fresh, second] {
        h.runtime.destroy(&id).await.unwrap();
    }
    h.runtime.settle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_restores_only_onto_the_image_it_was_taken_on() {
    let store_dir = tempfile::tempdir().unwrap();
    let store = store_in(store_dir.path());
    let a = host_on(store.clone(), support::images()).await;
    let id = support::new_id();
    a.runtime
        .create(&id, &CreateOptions::default())
        .await
        .unwrap();
    let manifest = a
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
        .await
        .unwrap();
    let taken_on = support::images().default_image().unwrap().digest;
    assert_eq!(manifest.sandbox_image.as_deref(), Some(taken_on.as_str()));

    // Host B's default is another image and it lacks A's.
    let (_images_dir, other) = catalog_with_default(SECOND_IMAGE);
    let b = host_on(store.clone(), other).await;
    let err = b
        .runtime
        .restore(&id, &manifest)
        .await
        .expect_err("another image");
    let message = err.to_string();
    assert!(
        matches!(err, RuntimeError::Incompatible(_))
            && message.contains(&format!("taken on sandbox image {taken_on}"))
            && message.contains("this server does not have"),
        "{message}"
    );
    assert!(!b.runtime.is_running(&id));
    assert!(
        message.contains("the store has no copy") && message.contains("sandboxctl push-image"),
        "{message}"
    );
    // Once pushed to the store, B fetches it (verified against the digest) and restores.
    let scratch = tempfile::tempdir().unwrap();
    let (pushed, uploaded) = sandboxd::runtime::images::store::push(
        &support::images(),
        store.as_ref(),
        "default",
        scratch.path(),
    )
    .await
    .unwrap();
    assert!(uploaded);
    assert_eq!(pushed.digest, taken_on);
    let (_, again) = sandboxd::runtime::images::store::push(
        &support::images(),
        store.as_ref(),
        "default",
        scratch.path(),
    )
    .await
    .unwrap();
    assert!(!again, "a second push uploads nothing");
    b.runtime.restore(&id, &manifest).await.unwrap();
    let (stdout, _, code) = bash(
        &b.runtime,
        &id,
        "echo fetched; test -e /usr/local/lib/sandboxd/statx-shim.so",
    )
    .await;
    assert_eq!((stdout.as_str(), code), ("fetched\n", 0));
    assert!(
        b.runtime
            .images()
            .dir
            .join(&taken_on)
            .join("rootfs")
            .is_dir(),
        "the fetched image is kept for the next restore"
    );
    let manifest = b
        .runtime
        .checkpoint(
            &id,
            CheckpointRequest {
                checkpoint_id: support::new_id(),
                epoch: 2,
                name: None,
                force: false,
                keep_executions: false,
            },
        )
        .await
        .unwrap();
    // A manifest from before images (no digest) is refused with its reason.
    let mut old = manifest.clone();
    old.sandbox_image = None;
    let err = a.runtime.restore(&id, &old).await.expect_err("no digest");
    assert!(
        err.to_string()
            .contains("taken on the host's root filesystem"),
        "{err}"
    );
    // Where the image is, it restores.
    a.runtime.restore(&id, &manifest).await.unwrap();
    let (stdout, _, code) = bash(&a.runtime, &id, "echo back").await;
    assert_eq!((stdout.as_str(), code), ("back\n", 0));
    a.runtime.destroy(&id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_pick_images_with_image_list_them_and_restores_onto_another_image_are_refused() {
    use serde_json::json;
    use support::ws::Server;
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path());
    let a = Server::sharing("instance-a", store.clone(), |_| {}).await;
    let create_error = |init: serde_json::Value| {
        let url = a.url("/create");
        async move {
            let mut ws = support::ws::Ws::connect(&url).await;
            ws.send(init).await;
            ws.until_close().await
        }
    };
    let frames = create_error(json!({"image": "../etc"})).await;
    assert_eq!(frames[1], "SANDBOX_CREATION_ERROR", "{frames:?}");
    assert!(frames[2].contains("invalid image name"), "{frames:?}");
    let frames = create_error(json!({"image": "never-built"})).await;
    assert_eq!(frames[1], "SANDBOX_CREATION_ERROR", "{frames:?}");
    assert!(
        frames[2].contains("no sandbox image \"never-built\"")
            && frames[2].contains("scripts/build-image.sh --name never-built"),
        "{frames:?}"
    );
    let frames = create_error(json!({"image": 7})).await;
    assert_eq!(frames[1], "SANDBOX_CREATION_ERROR", "{frames:?}");

    let (mut jq, _, _) = a.create(json!({"image": SECOND_IMAGE})).await;
    let frames = jq.exec("bash", "echo '[3]' | jq '.[0]'").await;
    assert_eq!(frames[1], "stdout:3\n", "{frames:?}");
    // The earlier server's clients send no "image": the default image.
    let (mut plain, id, token) = a
        .create(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    let frames = plain
        .exec("bash", "command -v jq || echo none; echo 41 > /tmp/n")
        .await;
    assert_eq!(frames[1], "stdout:none\n", "{frames:?}");

    // GET /images and sandboxctl images.
    let listing: serde_json::Value = support::get_json(format!("http://{}/images", a.addr)).await;
    assert_eq!(listing["default"], "default");
    let images = listing["images"].as_array().unwrap();
    let named = |name: &str| {
        images
            .iter()
            .find(|image| image["names"].as_array().unwrap().iter().any(|n| n == name))
            .unwrap_or_else(|| panic!("{name} not listed: {listing}"))
            .clone()
    };
    assert_eq!(named("default")["default"], true);
    assert_eq!(named(SECOND_IMAGE)["default"], false);
    assert!(
        named(SECOND_IMAGE)["packages"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p == "jq")
    );
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_sandboxctl"))
        .args(["images", "--url", &a.url("")])
        .output()
        .await
        .unwrap();
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{table}");
    assert!(table.starts_with("DIGEST"), "{table}");
    assert!(
        table
            .lines()
            .any(|line| line.contains("default") && line.contains("yes")),
        "{table}"
    );
    assert!(table.contains(SECOND_IMAGE), "{table}");

    // A checkpoint taken here, attached on a server whose images differ.
    plain.send(json!({"action": "checkpoint"})).await;
    assert_eq!(plain.until_close().await.last().unwrap(), "close:1000");
    let (_other_images, other) = catalog_with_default(SECOND_IMAGE);
    let b = Server::sharing_on("instance-b", store, other, |_| {}).await;
    let mut ws = b.attach(&id, &token).await;
    let frames = ws.until_close().await;
    let taken_on = support::images().default_image().unwrap().digest;
    assert!(
        frames.iter().any(|f| f == "SANDBOX_RESTORE_ERROR"),
        "{frames:?}"
    );
    assert!(
        frames
            .iter()
            .any(|f| f.contains(&format!("taken on sandbox image {taken_on}"))),
        "the refusal names the image: {frames:?}"
    );
    // Back where the image is, it restores.
    let mut ws = a.attach(&id, &token).await;
    ws.until_status("SANDBOX_RUNNING").await;
    assert_eq!(ws.exec("bash", "cat /tmp/n").await[1], "stdout:41\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_refuses_to_start_without_its_image_and_says_how_to_build_it() {
    let dir = tempfile::tempdir().unwrap();
    let output = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_sandboxd"))
            .args(["serve", "--listen", "127.0.0.1:0", "--runtime-dir"])
            .arg(dir.path().join("run"))
            .arg("--images-dir")
            .arg(dir.path().join("no-images"))
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("sandboxd must exit, not serve")
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("no sandbox image \"default\"")
            && stderr.contains("scripts/build-image.sh --name default"),
        "{stderr}"
    );
}

/// The agent comes back with a checkpoint's image: a checkpoint whose
/// recorded agent protocol version this server does not speak is refused
/// over the wire (`SANDBOX_RESTORE_ERROR`) naming both versions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_of_another_agent_version_is_refused_over_the_wire() {
    use controllers::api::{CheckpointManifest, decode, encode};
    use controllers::store::PutMode;
    use sandboxd::runtime::agent::protocol::{
        AGENT_PROTOCOL_VERSION, OLDEST_AGENT_PROTOCOL_VERSION,
    };
    use serde_json::json;
    use support::ws::Server;
    let dir = tempfile::tempdir().unwrap();
    let store = store_in(dir.path());
    let a = Server::sharing("instance-a", store.clone(), |_| {}).await;
    let (mut ws, id, token) = a
        .create(json!({"idle_timeout": 60, "enable_checkpoint": true}))
        .await;
    ws.exec("bash", "echo 41 > /tmp/n").await;
    ws.send(json!({"action": "checkpoint"})).await;
    assert_eq!(ws.until_close().await.last().unwrap(), "close:1000");

    // The manifest as a host whose agent spoke another version wrote it.
    let listed = store.list_all("sandbox_checkpoints/").await.unwrap();
    let manifests: Vec<_> = listed
        .iter()
        .filter(|object| object.key.as_str().ends_with("/manifest.json"))
        .collect();
    assert_eq!(manifests.len(), 1, "{listed:?}");
    let key = &manifests[0].key;
    let mut manifest: CheckpointManifest = decode(&store.get(key).await.unwrap().data).unwrap();
    assert_eq!(manifest.agent_version, Some(AGENT_PROTOCOL_VERSION));
    let other = AGENT_PROTOCOL_VERSION + 1;
    manifest.agent_version = Some(other);
    store
        .put(key, encode(&manifest), PutMode::Overwrite)
        .await
        .unwrap();
    // That host also carried its manifest in the lock it gave the sandbox
    // back with (decision 18): the restore reads that copy.
    let lock_key = controllers::layout::lock_key(&controllers::api::SandboxId::parse(&id).unwrap());
    let mut lock: controllers::api::Lease =
        decode(&store.get(&lock_key).await.unwrap().data).unwrap();
    let carried = lock
        .checkpoint_manifest
        .as_mut()
        .expect("the lock carries the checkpoint's manifest");
    assert_eq!(carried.image, manifest.image);
    carried.agent_version = Some(other);
    store
        .put(&lock_key, encode(&lock), PutMode::Overwrite)
        .await
        .unwrap();

    let mut ws = a.attach(&id, &token).await;
    let frames = ws.until_close().await;
    assert!(
        frames.iter().any(|f| f == "SANDBOX_RESTORE_ERROR"),
        "{frames:?}"
    );
    assert!(
        frames.iter().any(|f| f.contains(&format!(
            "agent speaks protocol version {other}, and this server speaks versions \
             {OLDEST_AGENT_PROTOCOL_VERSION} to {AGENT_PROTOCOL_VERSION}"
        ))),
        "the refusal names both versions: {frames:?}"
    );
}
