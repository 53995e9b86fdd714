//! From `sandboxd serve`'s flags to the [`Parts`] of an instance: which
//! stores, whether the gVisor runtime starts (and with which network), which
//! features clients may ask for, workspace sync. The binary's `main` is left
//! with logging, the listener and the signal.
//!
//! It stands above both the flags (`crate::config`) and the composition root
//! (`crate::server`): the configuration builds the lower layers' settings,
//! the server knows nothing of flags, and this module joins the two.

use std::sync::Arc;
use std::time::Duration;

use controllers::api::InstanceId;
use controllers::clock::{Clock, SystemClock};
use controllers::runtime::SandboxRuntime;
use controllers::store::OperationCounts;

use crate::config::{ServeArgs, StoreLocation};
use crate::runtime::GvisorRuntime;
use crate::server::{Features, Parts, counted};
use crate::store;
use crate::workspace::{WorkspaceFiles, WorkspaceHooks, WorkspaceSync};

/// An instance ready to build: its parts, and the runtime to settle once the
/// server has stopped (so no runsc outlives it).
#[derive(Debug)]
pub struct Booted {
    pub parts: Parts,
    pub gvisor: Option<Arc<GvisorRuntime>>,
}

/// Opens the stores and starts the runtime `args` ask for.
pub async fn from_args(args: &ServeArgs) -> anyhow::Result<Booted> {
    args.control.validate()?;
    let instance = match &args.instance_id {
        Some(id) => InstanceId::parse(id)?,
        None => InstanceId::parse(&format!("sandboxd-{}", uuid::Uuid::new_v4().simple()))?,
    };
    // The instance's one clock: the controllers', the API's and the
    // workspace sync's.
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let layout = args.storage.layout();
    // Every storage operation is counted (`/metrics`), the runtime's uploads too.
    let store_operations = Arc::new(OperationCounts::default());
    let metadata_store = store::open(&layout.metadata).await?;
    let checkpoint_store = counted(store::open(&layout.checkpoints).await?, &store_operations);
    let snapshot_store = counted(store::open(&layout.snapshots).await?, &store_operations);
    let bucket_name = |location: &StoreLocation| match location {
        StoreLocation::Bucket { bucket, .. } => bucket.clone(),
        StoreLocation::Directory(path) => path.display().to_string(),
    };
    let checkpoint_bucket = bucket_name(&layout.checkpoints);
    let network = args.network.config().map_err(anyhow::Error::msg)?;
    let images = args.runtime.images();
    let gvisor = match GvisorRuntime::start(
        args.runtime.gvisor(checkpoint_bucket.clone()),
        Arc::clone(&checkpoint_store),
        Arc::clone(&snapshot_store),
    )
    .await
    {
        Ok(runtime) => {
            tracing::info!(runsc = runtime.runsc_version(), "sandbox runtime ready");
            // Egress was asked for: without it the server must not start.
            let runtime = match network.clone() {
                Some(config) => runtime.with_network(config).await?,
                None => runtime,
            };
            let runtime = Arc::new(runtime);
            runtime.start_warm_pool(args.runtime.warm_pool);
            if args.runtime.staged_restores {
                runtime.enable_staged_restores();
            }
            Some(runtime)
        }
        Err(err) => {
            // Sandboxes run on an image of their own, never the host's `/`:
            // with a usable runsc but no image, refuse to start (a host
            // without runsc serves health checks only, as before).
            if let Err(missing) = images.default_image()
                && args
                    .runtime
                    .gvisor(String::new())
                    .runsc
                    .version()
                    .await
                    .is_ok()
            {
                anyhow::bail!("cannot start: {missing}");
            }
            tracing::error!(%err, "the sandbox runtime is unavailable; serving health checks only (install runsc and run as root)");
            None
        }
    };
    let workspace_hooks = match (&gvisor, args.workspace.workspace_sync) {
        (Some(gvisor), true) => {
            let templates = args.workspace.templates().map_err(anyhow::Error::msg)?;
            let store = counted(store::open(&layout.workspaces).await?, &store_operations);
            let sync = WorkspaceSync::new(
                store,
                Arc::clone(gvisor) as Arc<dyn WorkspaceFiles>,
                args.workspace.limits(args.runtime.workspace_size_mb()),
                args.runtime.runtime_dir.clone(),
                Arc::default(),
                Arc::clone(&clock),
            );
            Some(Arc::new(WorkspaceHooks::new(Arc::new(sync), templates)))
        }
        _ => None,
    };
    tracing::info!(%instance, storage = ?layout, "storage and runtime ready");
    let runtime = gvisor
        .clone()
        .map(|runtime| runtime as Arc<dyn SandboxRuntime>);
    let mut parts = Parts::new(instance, metadata_store, runtime);
    parts.clock = clock;
    parts.checkpoint_store = checkpoint_store;
    parts.snapshot_store = Some(Arc::clone(&snapshot_store));
    parts.checkpoint_bucket = checkpoint_bucket;
    parts.snapshot_bucket = bucket_name(&layout.snapshots);
    parts.images = gvisor.as_ref().map(|_| images);
    parts.lease = args.control.lease();
    parts.reconciler = args.control.reconciler();
    parts.features = Features {
        network_egress: network.is_some() && gvisor.is_some(),
        shared_snapshots: args.shared_snapshots,
        max_named_checkpoints: args.admission.max_named_checkpoints,
        snapshot_quota: args.tenant.snapshot_quota(),
        ..Features::default()
    };
    parts.store_operations = store_operations;
    parts.workspace_hooks = workspace_hooks;
    parts.shutdown_grace = Duration::from_secs(args.shutdown_grace_s);
    parts.warm_pool.clone_from(&gvisor);
    parts.execute = crate::api::limits::ExecuteLimits {
        max_output_bytes: args.execute_max_output_bytes,
        timeout: Duration::from_secs(args.execute_timeout_s),
    };
    parts.limits = args.admission.limits();
    parts.socket = args.tenant.socket();
    parts.connection_deadlines = args.tenant.connection_deadlines();
    parts.max_connections = args.tenant.max_connections;
    parts.early_frames_budget_bytes = args.tenant.ws_early_frames_budget_bytes;
    parts.origins = args.tenant.origins();
    parts.lifetimes = args.tenant.lifetimes();
    parts.operator_token = args
        .tenant
        .operator_token
        .clone()
        .filter(|token| !token.is_empty());
    if gvisor.is_some() {
        let buffers = crate::api::admission::session_buffer_bytes(parts.socket.reply_budget_bytes);
        parts.admission = args.admission.settings(
            args.runtime.sandbox_memory_mb,
            buffers,
            args.runtime.warm_pool,
        )?;
    }
    parts.max_sandboxes_per_caller = args.tenant.sandboxes_per_caller(parts.admission.as_ref());
    parts.caller_identity_verified = args.tenant.caller_identity_verified;
    Ok(Booted { parts, gvisor })
}
