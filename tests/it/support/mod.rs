//! Test support: a real fake-gcs-server started once per test binary, store
//! fixtures for every backend, and servers built by the composition root
//! (`sandboxd::server::Server::build`). The emulator and the server
//! processes are the `testkit` crate's, which the benchmarks share.
//!
//! The emulator listens on port 80 of a spare loopback address, because the
//! official crate drops the port from the `Host` header and resumable uploads
//! against another port hang (`docs/gcs.md`). If the emulator
//! cannot be found or started, the GCS tests FAIL with a message saying why;
//! they never skip.

use std::net::Ipv4Addr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use controllers::store::Store;
use sandboxd::store::{GcsConfig, GcsStore, LocalStore, RetrySettings};

pub use testkit::{Emulator, RunscCleanup};

/// What `read` answers once `ready` holds of it, or its last answer after
/// 10 s (the caller's assertion then says what was wrong). A sandbox's
/// `status` records a checkpoint or a start just after the client is told,
/// in a task of its own (decision 21): read it with this.
pub async fn eventually<T, F, Fut>(mut read: F, ready: impl Fn(&T) -> bool) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = T>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let answer = read().await;
        if ready(&answer) || tokio::time::Instant::now() >= deadline {
            return answer;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The emulator the tests share: the run's (`$SANDBOXD_TEST_EMULATOR`, which
/// nextest's setup script sets), or else one this process starts on first
/// use (its watchdog stops it when the process exits: `cargo test`).
pub fn emulator() -> &'static Emulator {
    static EMULATOR: OnceLock<Emulator> = OnceLock::new();
    EMULATOR.get_or_init(|| {
        let shared = Emulator::shared().unwrap_or_else(|err| panic!("{err}"));
        shared.unwrap_or_else(|| {
            Emulator::start(3..=120, testkit::Backend::Memory, None)
                .unwrap_or_else(|err| panic!("{err}"))
        })
    })
}

/// A loopback address in `range` (127.0.0.N) with nothing listening on port 80.
pub fn free_loopback(range: std::ops::RangeInclusive<u8>) -> Ipv4Addr {
    testkit::free_loopback(range).unwrap_or_else(|err| panic!("{err}"))
}

/// Creates a fresh bucket on the emulator and returns its name.
pub async fn create_bucket() -> String {
    let name = format!("test-{}", uuid::Uuid::new_v4().simple());
    emulator()
        .create_bucket(&name)
        .await
        .unwrap_or_else(|err| panic!("{err}"));
    name
}

/// `GET url` as JSON (a test's read of `/list`, `/metrics`' neighbours, an
/// object through the emulator); panics with the URL when it fails.
pub async fn get_json(url: impl reqwest::IntoUrl) -> serde_json::Value {
    get(url).await.json().await.expect("a JSON body")
}

/// `GET url` as text.
pub async fn get_text(url: impl reqwest::IntoUrl) -> String {
    get(url).await.text().await.expect("a text body")
}

async fn get(url: impl reqwest::IntoUrl) -> reqwest::Response {
    testkit::http_client()
        .get(url)
        .send()
        .await
        .expect("a GET answered")
}

/// A fresh sandbox id.
pub fn new_id() -> controllers::api::SandboxId {
    controllers::api::SandboxId::parse(&uuid::Uuid::new_v4().simple().to_string())
        .expect("a UUID is a sandbox id")
}

/// The JSON API address of object `key` in `bucket` on the shared emulator.
pub fn object_url(bucket: &str, key: &str) -> String {
    format!(
        "{}/storage/v1/b/{bucket}/o/{}",
        emulator().endpoint(),
        key.replace('/', "%2F")
    )
}

/// Short retries, so a failing test fails in seconds.
pub fn test_retries() -> RetrySettings {
    RetrySettings {
        max_retries: 2,
        min_delay: Duration::from_millis(20),
        max_delay: Duration::from_millis(200),
        attempt_timeout: Duration::from_secs(5),
        deadline: Duration::from_secs(10),
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
    /// Keeps the local store's directory while the store is in use.
    pub _dir: Option<tempfile::TempDir>,
}

pub async fn memory_fixture() -> Fixture {
    Fixture {
        store: Arc::new(controllers::testing::MemoryStore::new()),
        _dir: None,
    }
}

pub async fn local_fixture() -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = LocalStore::open(dir.path()).expect("local store");
    Fixture {
        store: Arc::new(store),
        _dir: Some(dir),
    }
}

pub async fn gcs_fixture() -> Fixture {
    Fixture {
        store: gcs_store().await,
        _dir: None,
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
/// Sandboxes get 1 GiB (`SANDBOX_MEMORY_BYTES`), one CPU and 64 processes.
pub async fn runtime_with_store(
    dir: &std::path::Path,
    store: Arc<dyn Store>,
) -> sandboxd::runtime::GvisorRuntime {
    runtime_with_images(dir, store, images()).await
}

thread_local! {
    /// The memory limit of the sandboxes of runtimes this thread starts
    /// (a test body runs on its own thread; 1 GiB unless it says otherwise).
    pub static SANDBOX_MEMORY_BYTES: std::cell::Cell<u64> = const { std::cell::Cell::new(1 << 30) };
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
            memory_limit_bytes: Some(SANDBOX_MEMORY_BYTES.with(std::cell::Cell::get)),
            cpu_limit: Some(1.0),
            max_processes: 64,
            tmp_size_mb: 256,
            disk_size_mb: sandboxd::runtime::bundle::default_disk_size_mb(Some(
                SANDBOX_MEMORY_BYTES.with(std::cell::Cell::get),
            )),
            cpu_features: None,
        },
        checkpoint_bucket: "local".into(),
        orphaned_checkpoints_budget: sandboxd::runtime::DEFAULT_ORPHANED_CHECKPOINTS_BUDGET,
    };
    GvisorRuntime::start(config, store.clone(), store)
        .await
        .expect("runsc must be installed (apt-get install -y runsc) and usable (root)")
}

/// An instance built by the composition root: `store` holds metadata,
/// checkpoints and snapshots; `runtime` is `None` to play a host without runsc.
pub fn server(
    instance: &str,
    store: Arc<dyn Store>,
    runtime: Option<Arc<dyn controllers::runtime::SandboxRuntime>>,
) -> sandboxd::server::Server {
    server_counted(instance, store, runtime, Arc::default(), |_| {})
}

/// As [`server`], with storage operations counted into `counts` (give the
/// runtime's store the same counts to include its uploads) and `adjust`
/// applied to the parts before the server is built.
pub fn server_counted(
    instance: &str,
    store: Arc<dyn Store>,
    runtime: Option<Arc<dyn controllers::runtime::SandboxRuntime>>,
    counts: Arc<controllers::store::OperationCounts>,
    adjust: impl FnOnce(&mut sandboxd::server::Parts),
) -> sandboxd::server::Server {
    let mut parts = parts(instance, store, runtime, counts);
    adjust(&mut parts);
    sandboxd::server::Server::build(parts)
}

/// As [`server_counted`] on a real gVisor runtime with workspace sync into
/// `workspaces` under the built-in templates.
pub fn server_with_workspaces(
    instance: &str,
    store: Arc<dyn Store>,
    gvisor: Arc<sandboxd::runtime::GvisorRuntime>,
    workspaces: Arc<dyn Store>,
    counts: Arc<controllers::store::OperationCounts>,
    spool: std::path::PathBuf,
    limits: sandboxd::workspace::SyncLimits,
) -> sandboxd::server::Server {
    let sync = sandboxd::workspace::WorkspaceSync::new(
        workspaces,
        Arc::clone(&gvisor) as Arc<dyn sandboxd::workspace::WorkspaceFiles>,
        limits,
        spool,
        Arc::default(),
        Arc::new(controllers::clock::SystemClock),
    );
    let templates = sandboxd::workspace::hooks::templates_with(None).expect("templates");
    let hooks = sandboxd::workspace::WorkspaceHooks::new(Arc::new(sync), templates);
    let mut parts = parts(instance, store, Some(gvisor), counts);
    parts.workspace_hooks = Some(Arc::new(hooks));
    sandboxd::server::Server::build(parts)
}

/// The tests' parts: one store for everything (checkpoints counted), the
/// test images when there is a runtime.
fn parts(
    instance: &str,
    store: Arc<dyn Store>,
    runtime: Option<Arc<dyn controllers::runtime::SandboxRuntime>>,
    counts: Arc<controllers::store::OperationCounts>,
) -> sandboxd::server::Parts {
    let instance = controllers::api::InstanceId::parse(instance).expect("instance id");
    let mut parts = sandboxd::server::Parts::new(instance, Arc::clone(&store), runtime);
    parts.checkpoint_store = sandboxd::server::counted(store, &counts);
    parts.checkpoint_bucket = "test".to_owned();
    parts.snapshot_bucket = "test".to_owned();
    parts.store_operations = counts;
    parts.images = parts.runtime.is_some().then(images);
    parts
}

/// Serves `server` on a free loopback port until the test ends; returns
/// `127.0.0.1:PORT`.
pub async fn serve(server: sandboxd::server::Server) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(server.run(listener, std::future::pending()));
    addr.to_string()
}

pub mod conformance;
pub mod cutter;
pub mod disk_emulator;
pub mod process;
pub mod proxy;
pub mod ws;
