//! `sandboxd`: the sandbox server.

use clap::{Parser, Subcommand};
use controllers::api::InstanceId;
use std::sync::Arc;

use controllers::runtime::SandboxRuntime;
use controllers::store::OperationCounts;
use sandboxd::config::{ServeArgs, StoreLocation};
use sandboxd::runtime::GvisorRuntime;
use sandboxd::server::{self, AppState, Parts, counted};
use sandboxd::workspace::{WorkspaceFiles, WorkspaceHooks, WorkspaceSync};
use sandboxd::{store, telemetry};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Stateful gVisor code sandboxes, coordinated through a bucket"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the server.
    Serve(ServeArgs),
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let Command::Serve(args) = Cli::parse().command;
    telemetry::init(&args.log)?;
    args.control.validate()?;
    let instance = match &args.instance_id {
        Some(id) => InstanceId::parse(id)?,
        None => InstanceId::parse(&format!("sandboxd-{}", uuid::Uuid::new_v4().simple()))?,
    };
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
        snapshot_store,
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
            Some(Arc::new(runtime))
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
    let runtime = gvisor
        .clone()
        .map(|runtime| runtime as Arc<dyn SandboxRuntime>);
    let workspace_hooks = match (&gvisor, args.workspace.workspace_sync) {
        (Some(gvisor), true) => {
            let templates = args.workspace.templates().map_err(anyhow::Error::msg)?;
            let store = counted(store::open(&layout.workspaces).await?, &store_operations);
            let sync = WorkspaceSync::new(
                store,
                Arc::clone(gvisor) as Arc<dyn WorkspaceFiles>,
                args.workspace.limits(),
                args.runtime.runtime_dir.clone(),
                Arc::default(),
            );
            Some(Arc::new(WorkspaceHooks::new(Arc::new(sync), templates)))
        }
        _ => None,
    };
    let addr = args.listen_addr();
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|err| anyhow::anyhow!("cannot listen on {addr}: {err}"))?;
    tracing::info!(%addr, %instance, storage = ?layout, "sandboxd listening");
    let mut state = AppState::assemble(Parts {
        instance,
        metadata_store,
        checkpoint_store,
        checkpoint_bucket,
        snapshot_bucket: bucket_name(&layout.snapshots),
        runtime,
        lease: args.control.lease(),
        reconciler: args.control.reconciler(),
        store_operations,
        workspace_hooks,
    });
    state.features.network_egress = network.is_some() && gvisor.is_some();
    state.images = gvisor.as_ref().map(|_| images);
    let controller = state.controller.clone();
    // WebSocket sessions outlive `run` (upgraded connections are detached);
    // the drain below ends them with the sandboxes they serve.
    server::run(listener, state, shutdown_signal()).await?;
    if let Some(controller) = controller {
        let grace = std::time::Duration::from_secs(args.shutdown_grace_s);
        let held = controller.held_sandboxes().len();
        tracing::info!(
            held,
            grace_s = grace.as_secs(),
            "shutting down: checkpointing the sandboxes held here"
        );
        let left = controller.drain(grace).await;
        if left > 0 {
            tracing::warn!(
                left,
                "shutdown grace ran out; these sandboxes are lost since their last checkpoint"
            );
        }
    }
    if let Some(gvisor) = gvisor {
        // Remove what is left (ephemeral /execute sandboxes, any the drain
        // could not save) and wait for runsc, so none outlives the server.
        gvisor.settle().await;
    }
    tracing::info!("sandboxd stopped");
    Ok(())
}

/// Completes on SIGTERM (Cloud Run's shutdown) or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = ctrl_c => {}
                    _ = term.recv() => {}
                }
            }
            Err(err) => {
                tracing::warn!(%err, "cannot watch SIGTERM; only Ctrl-C stops the server");
                let _ = ctrl_c.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
