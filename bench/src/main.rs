//! `sandboxd-bench`: the benchmarks of `docs/benchmarks.md`, apart from the
//! server's library. `cluster` measures end to end on fake-gcs-server and
//! `sandboxd` processes it starts with the tests' fixtures (`testkit`);
//! `runtime` measures the gVisor runtime alone; `files` the filesystem API;
//! `warm` warm starts (the warm pool and ready templates). Each prints a
//! table (median, p90) and JSON. They need root and runsc.

#![allow(
    clippy::disallowed_methods,
    reason = "a benchmark measures real time with the host's clock"
)]

mod cluster;
mod files;
mod flood;
mod paths;
mod reconnect;
mod runtime;
mod series;
mod warm;

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use sandboxd::config::RuntimeArgs;

#[derive(Debug, Parser)]
#[command(version, about = "Measure sandboxd on this machine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The end-to-end benchmark: starts fake-gcs-server and two sandboxd,
    /// prints create, exec (with our client and with a plain Python
    /// `websockets` client), checkpoint, restore and handoff latencies
    /// (median, p90), storage operations per idle sandbox-hour, checkpoint
    /// and restore of a big sandbox on fake-gcs-server and on the local
    /// store (a third sandboxd) with throughput, and the server's peak RSS.
    /// Needs root, runsc, the fake-gcs-server wheel and `pip install
    /// websockets`.
    #[command(
        after_help = "Examples:\n  sandboxd-bench cluster\n  sandboxd-bench cluster --runs 20 --economy-window-s 0   # skip the slow economy sample\n  sandboxd-bench cluster --storage-profile gcs-regional --paths-only   # critical paths and mass reconnect under GCS's modelled latency"
    )]
    Cluster {
        /// Samples per latency.
        #[arg(long, default_value_t = 10)]
        runs: usize,
        /// Seconds per storage-economy sample (two samples, plus a minute between; 0 skips).
        #[arg(long, default_value_t = 65)]
        economy_window_s: u64,
        /// Memory (MB) of the sandbox whose checkpoint measures upload throughput and RSS (0 skips).
        #[arg(long, default_value_t = 200)]
        big_sandbox_mb: u64,
        /// Where the servers' state and logs go.
        #[arg(long, default_value = "/tmp/sandboxd-bench")]
        work_dir: std::path::PathBuf,
        /// The storage model between the servers and the emulator:
        /// loopback (nothing added), gcs-regional, gcs-slow (docs/benchmarks.md).
        #[arg(long, default_value = "loopback")]
        storage_profile: testkit::storage::Profile,
        /// Only the critical paths and the mass reconnect.
        #[arg(long)]
        paths_only: bool,
        /// Sandboxes per 90-s handoff state (attached and quiet, left >= 90 s ago; 0 skips their 95-s wait).
        #[arg(long, default_value_t = 10)]
        quiet_runs: usize,
        /// Sandboxes of the mass reconnect (0 skips it).
        #[arg(long, default_value_t = 30)]
        mass_reconnect: usize,
        /// Each server's warm pool (`--warm-pool`; the server's default is
        /// 2). 0: every create is a cold boot.
        #[arg(long, default_value_t = 0)]
        warm_pool: usize,
    },
    /// The filesystem API: write and read round trips of a 4 KiB file on an
    /// attached socket, and a large upload and download (MB/s). Starts one
    /// `sandboxd` on the local store. Needs root and runsc.
    #[command(after_help = "Example:\n  sandboxd-bench files --runs 50 --upload-mb 100")]
    Files {
        /// Samples per round trip.
        #[arg(long, default_value_t = 50)]
        runs: usize,
        /// Size of the uploaded and downloaded file.
        #[arg(long, default_value_t = 100)]
        upload_mb: u64,
        /// Where the server's state and the files go.
        #[arg(long, default_value = "/tmp/sandboxd-bench-files")]
        work_dir: std::path::PathBuf,
    },
    /// Warm starts: create → SANDBOX_RUNNING with the plain Python
    /// `websockets` client for a pool hit, a pool miss (cold boot) and a
    /// ready template (and its first create), back-to-back creates on a
    /// pool sized for them (how many hit), and a running sandbox's
    /// `echo hi` at rest and while the pool refills. Needs root, runsc, the
    /// fake-gcs-server wheel and `pip install websockets`; builds the image
    /// `bench-ready` (the default plus a start command).
    #[command(after_help = "Example:\n  sandboxd-bench warm --runs 20 --burst 20")]
    Warm {
        /// Samples per latency.
        #[arg(long, default_value_t = 20)]
        runs: usize,
        /// Back-to-back creates in the burst (the pool is sized for them).
        #[arg(long, default_value_t = 20)]
        burst: usize,
        /// The sandbox images (the template is built here).
        #[arg(
            long,
            env = "SANDBOXD_IMAGES",
            default_value = "/var/lib/sandboxd/images"
        )]
        images_dir: std::path::PathBuf,
        /// Where the servers' state and logs go.
        #[arg(long, default_value = "/tmp/sandboxd-bench-warm")]
        work_dir: std::path::PathBuf,
        /// The server binary (default: `sandboxd` beside this one).
        #[arg(long)]
        sandboxd: Option<std::path::PathBuf>,
    },
    /// Measure the gVisor runtime on this machine: create, exec round trips,
    /// checkpoint and restore; prints medians and JSON. Needs root and runsc.
    #[command(after_help = "Example:\n  sandboxd-bench runtime --runs 20 --sizes-mb 50,500")]
    Runtime {
        /// Samples per operation.
        #[arg(long, default_value_t = 20)]
        runs: usize,
        /// Sandbox memory sizes (MB) for checkpoint and restore.
        #[arg(long, value_delimiter = ',', default_values_t = [50, 500])]
        sizes_mb: Vec<u64>,
        #[command(flatten)]
        runtime: Box<RuntimeArgs>,
    },
    /// Memory under a flood of output: concurrent `POST /execute?format=json`
    /// each printing a lot; prints the server's peak RSS. Needs root and runsc.
    #[command(
        after_help = "Example:\n  sandboxd-bench execute-flood --concurrency 20 --megabytes 400"
    )]
    ExecuteFlood {
        /// Requests at once.
        #[arg(long, default_value_t = 20)]
        concurrency: usize,
        /// What each script prints, in MB.
        #[arg(long, default_value_t = 400)]
        megabytes: u64,
        /// Where the server's state and log go.
        #[arg(long, default_value = "/tmp/sandboxd-bench-flood")]
        work_dir: std::path::PathBuf,
    },
}

#[tokio::main]
async fn main() -> ExitCode {
    sandboxd::tls::install_crypto_provider();
    let result = match Cli::parse().command {
        Command::Cluster {
            runs,
            economy_window_s,
            big_sandbox_mb,
            work_dir,
            storage_profile,
            paths_only,
            quiet_runs,
            mass_reconnect,
            warm_pool,
        } => {
            let bench = cluster::ClusterBench {
                runs: runs.max(1),
                economy_window: Duration::from_secs(economy_window_s),
                big_sandbox_mb,
                work_dir,
                profile: storage_profile,
                paths_only,
                quiet_runs,
                mass_reconnect,
                warm_pool,
            };
            cluster::run(&bench).await.map(|(series, figures)| {
                print!("{}", series::render(&series));
                print!("{}", cluster::render_figures(&figures));
                println!(
                    "{}",
                    serde_json::json!({
                        "latencies": series::to_json(&series),
                        "figures": cluster::figures_json(&figures),
                    })
                );
            })
        }
        Command::Files {
            runs,
            upload_mb,
            work_dir,
        } => {
            let bench = files::FilesBench {
                runs: runs.max(1),
                upload_mb: upload_mb.max(1),
                work_dir,
            };
            files::run(&bench).await.map(|figures| {
                print!("{}", files::render(&figures));
                println!("{}", files::to_json(&figures));
            })
        }
        Command::Warm {
            runs,
            burst,
            images_dir,
            work_dir,
            sandboxd,
        } => {
            let bench = warm::WarmBench {
                runs: runs.max(1),
                burst: burst.max(1),
                images_dir,
                work_dir,
                sandboxd,
            };
            warm::run(&bench).await.map(|(series, figures)| {
                print!("{}", series::render(&series));
                print!("{}", warm::render_figures(&figures));
                println!(
                    "{}",
                    serde_json::json!({
                        "latencies": series::to_json(&series),
                        "figures": warm::figures_json(&figures),
                    })
                );
            })
        }
        Command::Runtime {
            runs,
            sizes_mb,
            mut runtime,
        } => {
            if std::env::var_os("SANDBOXD_RUNTIME_DIR").is_none()
                && runtime.runtime_dir == std::path::Path::new("/run/sandboxd")
            {
                // Never share (and so clean up) a running server's containers.
                runtime.runtime_dir = "/run/sandboxd-bench".into();
            }
            runtime::runtime_benchmarks(runtime.gvisor("bench".into()), runs, &sizes_mb)
                .await
                .map(|results| {
                    print!("{}", series::render(&results));
                    println!("{}", series::to_json(&results));
                })
        }
        Command::ExecuteFlood {
            concurrency,
            megabytes,
            work_dir,
        } => {
            let bench = flood::FloodBench {
                concurrency: concurrency.max(1),
                megabytes,
                work_dir,
            };
            flood::run(&bench)
                .await
                .map(|figures| print!("{}", flood::render(&bench, &figures)))
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("sandboxd-bench: benchmark failed: {err:#}");
            ExitCode::FAILURE
        }
    }
}
