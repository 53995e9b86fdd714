//! `sandboxctl`: operator verbs on the bucket (GCS or the local store).

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use controllers::api::SandboxId;
use sandboxd::config::{RuntimeArgs, StorageArgs};
use sandboxd::{ctl, store};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Inspect and manage sandboxes through their documents in the bucket",
    after_help = "Examples:\n  sandboxctl list\n  sandboxctl --metadata-bucket my-sandboxes get 3f9c0d4e5a6b7c8d9e0f1a2b3c4d5e6f"
)]
struct Cli {
    #[command(flatten)]
    storage: StorageArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Table of every sandbox: id, phase, holder, epoch, wanted_by, age, last checkpoint size.
    List,
    /// Both documents of one sandbox (metadata.json and lock.json) with their generations, as JSON.
    Get {
        /// The sandbox id (32 lowercase hex digits).
        id: String,
    },
    /// Measure the gVisor runtime on this machine: create, exec round trips,
    /// checkpoint and restore; prints medians and JSON. Needs root and runsc.
    #[command(after_help = "Example:\n  sandboxctl bench-runtime --runs 20 --sizes-mb 50,500")]
    BenchRuntime {
        /// Samples per operation.
        #[arg(long, default_value_t = 20)]
        runs: usize,
        /// Sandbox memory sizes (MB) for checkpoint and restore.
        #[arg(long, value_delimiter = ',', default_values_t = [50, 500])]
        sizes_mb: Vec<u64>,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
}

/// Exit codes scripts can rely on.
const EXIT_USAGE: u8 = 2;
const EXIT_NOT_FOUND: u8 = 3;
const EXIT_STORAGE: u8 = 4;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::BenchRuntime {
        runs,
        sizes_mb,
        runtime,
    } = &cli.command
    {
        let mut args = runtime.clone();
        if std::env::var_os("SANDBOXD_RUNTIME_DIR").is_none()
            && args.runtime_dir == std::path::Path::new("/run/sandboxd")
        {
            // Never share (and so clean up) a running server's containers.
            args.runtime_dir = "/run/sandboxd-bench".into();
        }
        return match sandboxd::bench::runtime_benchmarks(
            args.gvisor("bench".into()),
            *runs,
            sizes_mb,
        )
        .await
        {
            Ok(results) => {
                print!("{}", sandboxd::bench::render(&results));
                println!("{}", sandboxd::bench::to_json(&results));
                ExitCode::SUCCESS
            }
            Err(err) => fail(EXIT_STORAGE, &format!("benchmark failed: {err:#}")),
        };
    }
    let store = match store::open(&cli.storage.layout().metadata).await {
        Ok(store) => store,
        Err(err) => return fail(EXIT_STORAGE, &err.to_string()),
    };
    match cli.command {
        Command::BenchRuntime { .. } => ExitCode::SUCCESS,
        Command::List => match ctl::list_rows(store.as_ref(), chrono::Utc::now()).await {
            Ok(rows) => {
                print!("{}", ctl::render_table(&rows));
                ExitCode::SUCCESS
            }
            Err(err) => fail(EXIT_STORAGE, &err.to_string()),
        },
        Command::Get { id } => {
            let sandbox = match SandboxId::parse(&id) {
                Ok(sandbox) => sandbox,
                Err(err) => return fail(EXIT_USAGE, &err.to_string()),
            };
            match ctl::describe_json(store.as_ref(), &sandbox).await {
                Ok(value) => {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&value).unwrap_or_default()
                    );
                    ExitCode::SUCCESS
                }
                Err(err @ controllers::store::StoreError::NotFound { .. }) => {
                    fail(EXIT_NOT_FOUND, &format!("no such sandbox: {err}"))
                }
                Err(err) => fail(EXIT_STORAGE, &err.to_string()),
            }
        }
    }
}

fn fail(code: u8, message: &str) -> ExitCode {
    eprintln!("sandboxctl: {message}");
    ExitCode::from(code)
}
