//! `sandboxd`: the sandbox server.

use clap::{Parser, Subcommand};
use sandboxd::boot;
use sandboxd::config::ServeArgs;
use sandboxd::server::Server;
use sandboxd::telemetry;

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

/// How long the process waits, once served, for blocking tasks still
/// running (a file read stuck on a dead disk must not keep it alive).
const BLOCKING_TASKS_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// A worker's stack. Tokio's default (2 MiB) is a thin margin for a debug
/// build, whose futures are unoptimised: a checkpoint's pass overflowed it
/// once. Release builds use a fraction of it; the cost is
/// address space, not memory, until a page is touched.
const WORKER_STACK_BYTES: usize = 8 * 1024 * 1024;

fn main() -> anyhow::Result<()> {
    sandboxd::tls::install_crypto_provider();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(WORKER_STACK_BYTES)
        .build()?;
    let served = runtime.block_on(serve());
    runtime.shutdown_timeout(BLOCKING_TASKS_GRACE);
    served
}

async fn serve() -> anyhow::Result<()> {
    let Command::Serve(args) = Cli::parse().command;
    telemetry::init(&args.log)?;
    let booted = boot::from_args(&args).await?;
    let addr = args.listen_addr();
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|err| anyhow::anyhow!("cannot listen on {addr}: {err}"))?;
    tracing::info!(%addr, instance = %booted.parts.instance, "sandboxd listening");
    // On the signal the server checkpoints what it holds and closes its
    // connections before `run` returns.
    Server::build(booted.parts)
        .run(listener, shutdown_signal())
        .await?;
    if let Some(gvisor) = booted.gvisor {
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
