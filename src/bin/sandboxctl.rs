//! `sandboxctl`: user verbs against a server (`run`, `create`, `attach`,
//! `checkpoint`, `snapshot`, `kill`) and operator verbs on the bucket's
//! documents (`list`, `get`, `describe`, `edit`, `evict`, `delete`,
//! `break-lease`, `gc`).
//!
//! Exit codes: user verbs `run`/`attach` pass the process's exit code through;
//! otherwise 0 success, 1 the server refused or failed, 2 invalid input,
//! 3 not found, 4 storage error, 5 conflict (a concurrent change), 6 cancelled.

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use controllers::api::SandboxId;
use sandboxd::client::{ClientError, CreateOptions, Language};
use sandboxd::config::{RuntimeArgs, StorageArgs};
use sandboxd::ctl::{self, OperatorError, UserCommand};
use sandboxd::store;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Use sandboxes through a server, and manage them through their documents in the bucket",
    after_help = "Examples:\n  sandboxctl run python 'print(1)'\n  sandboxctl list\n  sandboxctl --metadata-bucket my-sandboxes describe 3f9c0d4e5a6b7c8d9e0f1a2b3c4d5e6f"
)]
struct Cli {
    #[command(flatten)]
    storage: StorageArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Lang {
    Python,
    Bash,
    /// The sandbox's persistent Python session.
    PythonSession,
}

impl From<Lang> for Language {
    fn from(lang: Lang) -> Self {
        match lang {
            Lang::Python => Self::Python,
            Lang::Bash => Self::Bash,
            Lang::PythonSession => Self::PythonSession,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    Json,
    Yaml,
}

#[derive(Debug, clap::Args)]
struct Server {
    /// The server (ws://, wss://, http:// or https://).
    #[arg(long, env = "SANDBOXD_URL", default_value = "ws://127.0.0.1:8080")]
    url: String,
}

#[derive(Debug, clap::Args)]
struct Target {
    /// The sandbox id.
    id: String,
    /// Its token (as `create` printed it).
    #[arg(long, env = "SANDBOX_TOKEN")]
    token: String,
    #[command(flatten)]
    server: Server,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one script in a fresh sandbox, stream its output, exit with its code.
    #[command(
        after_help = "Examples:\n  sandboxctl run python 'print(1)'\n  sandboxctl run bash 'exit 3'; echo $?   # 3\n  echo 'print(2)' | sandboxctl run python -"
    )]
    Run {
        language: Lang,
        /// The code, or `-` to read it from stdin.
        code: String,
        #[command(flatten)]
        server: Server,
    },
    /// Create a sandbox and print its id and token as JSON (it stays until idle).
    #[command(after_help = "Example:\n  sandboxctl create --checkpoint --idle-timeout 600")]
    Create {
        /// Seconds without activity before it stops (0: never).
        #[arg(long, default_value_t = 300)]
        idle_timeout: u64,
        /// Make it checkpointable (and so movable between instances).
        #[arg(long)]
        checkpoint: bool,
        /// A move (handoff, eviction, drain) takes a running execution along
        /// instead of killing it (needs --checkpoint).
        #[arg(long, requires = "checkpoint")]
        keep_executions: bool,
        /// Start from this filesystem snapshot.
        #[arg(long)]
        snapshot: Option<String>,
        /// Run on this sandbox image (`sandboxctl images`; default: the server's).
        #[arg(long)]
        image: Option<String>,
        /// Sync /workspace with this workspace (shared by name).
        #[arg(long)]
        workspace: Option<String>,
        /// The secret that owns the workspace (16–256 characters).
        #[arg(long, env = "SANDBOXCTL_WORKSPACE_TOKEN", requires = "workspace")]
        workspace_token: Option<String>,
        /// The workspace's hook template (default, download-only, upload-only, …).
        #[arg(long, requires = "workspace")]
        workspace_template: Option<String>,
        #[command(flatten)]
        server: Server,
    },
    /// Start a new, independent sandbox from another one's checkpoint (its
    /// latest, or the one named with --checkpoint): memory, processes, files
    /// and Python session. Prints the fork's id and token as JSON.
    #[command(
        after_help = "Examples:\n  sandboxctl fork ID --token T\n  sandboxctl fork ID --token T --checkpoint before-step-2 --idle-timeout 600"
    )]
    Fork {
        #[command(flatten)]
        target: Target,
        /// Fork this named checkpoint instead of the latest.
        #[arg(long)]
        checkpoint: Option<String>,
        /// Seconds without activity before the fork stops (0: never).
        #[arg(long, default_value_t = 300)]
        idle_timeout: u64,
    },
    /// Run a command in an existing sandbox interactively: stdin passed
    /// through, Ctrl-C kills the command (not the sandbox), its exit code returned.
    #[command(
        after_help = "Examples:\n  sandboxctl attach ID --token T            # an interactive bash\n  sandboxctl attach ID --token T --language python-session 'print(x)'\n  sandboxctl attach ID --token T --checkpoint before-upgrade 'ls /tmp'"
    )]
    Attach {
        #[command(flatten)]
        target: Target,
        /// Restore this named checkpoint instead of the latest.
        #[arg(long)]
        checkpoint: Option<String>,
        #[arg(long, value_enum, default_value_t = Lang::Bash)]
        language: Lang,
        /// What to run (default: an interactive bash).
        #[arg(default_value = "exec bash -i")]
        code: String,
    },
    /// Checkpoint a sandbox (optionally under a name); it is restored on attach.
    #[command(after_help = "Example:\n  sandboxctl checkpoint ID --token T before-upgrade")]
    Checkpoint {
        #[command(flatten)]
        target: Target,
        name: Option<String>,
    },
    /// Save a sandbox's changed files as a named filesystem snapshot.
    #[command(after_help = "Example:\n  sandboxctl snapshot ID --token T base-env")]
    Snapshot {
        #[command(flatten)]
        target: Target,
        name: String,
    },
    /// Destroy a sandbox.
    #[command(after_help = "Example:\n  sandboxctl kill ID --token T")]
    Kill {
        #[command(flatten)]
        target: Target,
    },
    /// Table of every sandbox: id, phase, holder, epoch, wanted_by, age, last checkpoint size.
    #[command(after_help = "Example:\n  sandboxctl --metadata-bucket my-sandboxes list")]
    List,
    /// Both documents of one sandbox with their generations.
    #[command(after_help = "Examples:\n  sandboxctl get ID\n  sandboxctl get ID -o yaml")]
    Get {
        id: String,
        #[arg(short, long, value_enum, default_value_t = Format::Json)]
        output: Format,
    },
    /// Spec beside status, conditions, lease timing, checkpoints.
    #[command(after_help = "Example:\n  sandboxctl describe ID")]
    Describe { id: String },
    /// Edit metadata.json in $EDITOR; validated, written with compare-and-swap.
    #[command(after_help = "Example:\n  EDITOR=nano sandboxctl edit ID")]
    Edit { id: String },
    /// Ask the holder to checkpoint and release the sandbox (desired_state: checkpointed).
    #[command(after_help = "Example:\n  sandboxctl evict ID")]
    Evict { id: String },
    /// Ask for the sandbox to be destroyed (desired_state: deleted).
    #[command(after_help = "Example:\n  sandboxctl delete ID")]
    Delete { id: String },
    /// Free a stuck lease (holder: null): the old holder stops the sandbox.
    #[command(after_help = "Example:\n  sandboxctl break-lease ID --yes")]
    BreakLease {
        id: String,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
    /// A sandbox's checkpoints (latest, superseded ones still kept, named
    /// ones): id, role, name, age, size, epoch, the image each needs.
    #[command(
        after_help = "Examples:\n  sandboxctl checkpoints ID\n  sandboxctl checkpoints ID -o json\n  sandboxctl checkpoints ID --delete before-step-2"
    )]
    Checkpoints {
        id: String,
        /// Delete this checkpoint (a name or a checkpoint id; not the latest).
        #[arg(long)]
        delete: Option<String>,
        #[arg(short, long, value_enum)]
        output: Option<Format>,
    },
    /// Remove old tombstones and checkpoints nothing points at.
    #[command(
        after_help = "Examples:\n  sandboxctl gc --dry-run\n  sandboxctl gc --keep-checkpoints 1   # also trim each sandbox's history"
    )]
    Gc {
        /// Only report what would be removed.
        #[arg(long)]
        dry_run: bool,
        /// Age (seconds) below which nothing is collected.
        #[arg(long, default_value_t = 600)]
        older_than_s: i64,
        /// Also keep only the newest N superseded checkpoints of each sandbox
        /// (besides its latest; named ones always stay), as the servers do
        /// with SANDBOXD_KEEP_CHECKPOINTS.
        #[arg(long)]
        keep_checkpoints: Option<usize>,
    },
    /// The end-to-end benchmark: starts fake-gcs-server and two sandboxd,
    /// prints create, exec (with our client and with a plain Python
    /// `websockets` client), checkpoint, restore and handoff latencies
    /// (median, p90), storage operations per idle sandbox-hour, checkpoint
    /// and restore of a big sandbox on fake-gcs-server and on the local
    /// store (a third sandboxd) with throughput, and the server's peak RSS.
    /// Needs root, runsc, the fake-gcs-server wheel and `pip install
    /// websockets`.
    #[command(
        after_help = "Examples:\n  sandboxctl bench\n  sandboxctl bench --runs 20 --economy-window-s 0   # skip the slow economy sample"
    )]
    Bench {
        /// Samples per latency.
        #[arg(long, default_value_t = 10)]
        runs: usize,
        /// Seconds per storage-economy sample (two samples, plus a minute between; 0 skips).
        #[arg(long, default_value_t = 65)]
        economy_window_s: u64,
        /// Memory (MB) of the sandbox whose checkpoint measures upload throughput and RSS.
        #[arg(long, default_value_t = 200)]
        big_sandbox_mb: u64,
        /// Where the servers' state and logs go.
        #[arg(long, default_value = "/tmp/sandboxd-bench")]
        work_dir: std::path::PathBuf,
    },
    /// List the sandbox images a server has (digest, names, default, packages).
    #[command(after_help = "Example:\n  sandboxctl images --url http://127.0.0.1:8080")]
    Images {
        /// Print the JSON document instead of the table.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        server: Server,
    },
    /// Build a template image from a filesystem snapshot: the image the
    /// snapshot was taken on plus its files. Runs on a server's host (root),
    /// into its image directory.
    #[command(
        after_help = "Example:\n  sandboxctl --snapshot-bucket my-snapshots template my-project --from-snapshot seed-1\n  sandboxctl create --image my-project"
    )]
    Template {
        /// The new image's name.
        name: String,
        /// The filesystem snapshot it starts from.
        #[arg(long)]
        from_snapshot: String,
        /// Build on this image instead of the one the snapshot was taken on.
        #[arg(long)]
        base: Option<String>,
        #[command(flatten)]
        runtime: RuntimeArgs,
    },
    /// Upload a sandbox image of this host to the checkpoint store, so any
    /// instance that needs it for a restore fetches it (once) instead of
    /// refusing. Nothing happens if the store has it already.
    #[command(
        after_help = "Example:\n  sandboxctl --checkpoint-bucket my-checkpoints push-image default"
    )]
    PushImage {
        /// The image (a name or a digest).
        name: String,
        #[command(flatten)]
        runtime: RuntimeArgs,
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

const EXIT_REFUSED: u8 = 1;
const EXIT_USAGE: u8 = 2;
const EXIT_NOT_FOUND: u8 = 3;
const EXIT_STORAGE: u8 = 4;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let user = match &cli.command {
        Command::Run {
            language,
            code,
            server,
        } => {
            let code = if code == "-" {
                let mut text = String::new();
                if let Err(err) = std::io::Read::read_to_string(&mut std::io::stdin(), &mut text) {
                    return fail(
                        EXIT_USAGE,
                        &format!("cannot read the code from stdin: {err}"),
                    );
                }
                text
            } else {
                code.clone()
            };
            Some(UserCommand::Run {
                url: server.url.clone(),
                language: (*language).into(),
                code,
            })
        }
        Command::Create {
            idle_timeout,
            checkpoint,
            keep_executions,
            snapshot,
            image,
            workspace,
            workspace_token,
            workspace_template,
            server,
        } => Some(UserCommand::Create {
            url: server.url.clone(),
            options: CreateOptions {
                idle_timeout_s: (*idle_timeout > 0).then_some(*idle_timeout),
                enable_checkpoint: *checkpoint,
                enable_sandbox_handoff: *checkpoint,
                enable_idle_timeout_auto_checkpoint: false,
                keep_executions: *keep_executions,
                filesystem_snapshot_name: snapshot.clone(),
                image: image.clone(),
                workspace_id: workspace.clone(),
                workspace_token: workspace_token.clone(),
                workspace_template: workspace_template.clone(),
                ..CreateOptions::default()
            },
        }),
        Command::Fork {
            target,
            checkpoint,
            idle_timeout,
        } => Some(UserCommand::Create {
            url: target.server.url.clone(),
            options: CreateOptions {
                idle_timeout_s: (*idle_timeout > 0).then_some(*idle_timeout),
                enable_checkpoint: true,
                enable_sandbox_handoff: true,
                from_checkpoint: Some(sandboxd::client::ForkSource {
                    sandbox_id: target.id.clone(),
                    sandbox_token: target.token.clone(),
                    name: checkpoint.clone(),
                }),
                ..CreateOptions::default()
            },
        }),
        Command::Attach {
            target,
            checkpoint,
            language,
            code,
        } => Some(UserCommand::Attach {
            url: target.server.url.clone(),
            id: target.id.clone(),
            token: target.token.clone(),
            checkpoint: checkpoint.clone(),
            language: (*language).into(),
            code: code.clone(),
        }),
        Command::Checkpoint { target, name } => Some(UserCommand::Checkpoint {
            url: target.server.url.clone(),
            id: target.id.clone(),
            token: target.token.clone(),
            name: name.clone(),
        }),
        Command::Snapshot { target, name } => Some(UserCommand::Snapshot {
            url: target.server.url.clone(),
            id: target.id.clone(),
            token: target.token.clone(),
            name: name.clone(),
        }),
        Command::Kill { target } => Some(UserCommand::Kill {
            url: target.server.url.clone(),
            id: target.id.clone(),
            token: target.token.clone(),
        }),
        _ => None,
    };
    if let Some(user) = user {
        return match ctl::run_user_command(user).await {
            Ok(code) => ExitCode::from(code),
            Err(err @ ClientError::NotFound) => fail(EXIT_NOT_FOUND, &err.to_string()),
            Err(err @ ClientError::Invalid(_)) => fail(EXIT_USAGE, &err.to_string()),
            Err(err) => fail(EXIT_REFUSED, &err.to_string()),
        };
    }
    if let Command::Bench {
        runs,
        economy_window_s,
        big_sandbox_mb,
        work_dir,
    } = &cli.command
    {
        let bench = sandboxd::bench_cluster::ClusterBench {
            runs: (*runs).max(1),
            economy_window: std::time::Duration::from_secs(*economy_window_s),
            big_sandbox_mb: *big_sandbox_mb,
            work_dir: work_dir.clone(),
        };
        return match sandboxd::bench_cluster::run(&bench).await {
            Ok((series, figures)) => {
                print!("{}", sandboxd::bench::render(&series));
                print!("{}", sandboxd::bench_cluster::render_figures(&figures));
                println!(
                    "{}",
                    serde_json::json!({
                        "latencies": sandboxd::bench::to_json(&series),
                        "figures": sandboxd::bench_cluster::figures_json(&figures),
                    })
                );
                ExitCode::SUCCESS
            }
            Err(err) => fail(EXIT_REFUSED, &format!("benchmark failed: {err:#}")),
        };
    }
    if let Command::BenchRuntime {
        runs,
        sizes_mb,
        runtime,
    } = &cli.command
    {
        return bench(*runs, sizes_mb, runtime).await;
    }
    if let Command::Images { json, server } = &cli.command {
        return match ctl::fetch_images(&server.url).await {
            Ok(listing) if *json => {
                println!("{listing:#}");
                ExitCode::SUCCESS
            }
            Ok(listing) => {
                print!("{}", ctl::render_images(&listing));
                ExitCode::SUCCESS
            }
            Err(err) => fail(EXIT_REFUSED, &err.to_string()),
        };
    }
    let layout = cli.storage.layout();
    if let Command::PushImage { name, runtime } = &cli.command {
        let checkpoints = match store::open(&layout.checkpoints).await {
            Ok(store) => store,
            Err(err) => return fail(EXIT_STORAGE, &err.to_string()),
        };
        let catalog = runtime.images();
        let scratch = sandboxd::runtime::image_store::default_scratch(&catalog);
        return match sandboxd::runtime::image_store::push(
            &catalog,
            checkpoints.as_ref(),
            name,
            &scratch,
        )
        .await
        {
            Ok((image, true)) => {
                println!("pushed {name} = {}", image.digest);
                ExitCode::SUCCESS
            }
            Ok((image, false)) => {
                println!("the store has {name} = {} already", image.digest);
                ExitCode::SUCCESS
            }
            Err(err) => fail(EXIT_REFUSED, &err.to_string()),
        };
    }
    if let Command::Template {
        name,
        from_snapshot,
        base,
        runtime,
    } = &cli.command
    {
        let snapshots = match store::open(&layout.snapshots).await {
            Ok(store) => store,
            Err(err) => return fail(EXIT_STORAGE, &err.to_string()),
        };
        let catalog = runtime.images();
        let scratch = sandboxd::runtime::templates::default_scratch(&catalog);
        return match sandboxd::runtime::templates::template_from_snapshot(
            &catalog,
            snapshots.as_ref(),
            from_snapshot,
            name,
            base.as_deref(),
            &scratch,
        )
        .await
        {
            Ok(image) => {
                println!(
                    "image {name} = {} ({})",
                    image.digest,
                    image.rootfs.display()
                );
                ExitCode::SUCCESS
            }
            Err(err @ sandboxd::runtime::templates::TemplateError::NoSnapshot(_)) => {
                fail(EXIT_NOT_FOUND, &err.to_string())
            }
            Err(err) => fail(EXIT_REFUSED, &err.to_string()),
        };
    }
    let store = match store::open(&layout.metadata).await {
        Ok(store) => store,
        Err(err) => return fail(EXIT_STORAGE, &err.to_string()),
    };
    let now = chrono::Utc::now();
    let report = |result: Result<String, OperatorError>| match result {
        Ok(message) => {
            println!("{}", message.trim_end());
            ExitCode::SUCCESS
        }
        Err(err) => fail(err.exit_code(), &err.to_string()),
    };
    match cli.command {
        Command::List => match ctl::list_rows(store.as_ref(), now).await {
            Ok(rows) => {
                print!("{}", ctl::render_table(&rows));
                ExitCode::SUCCESS
            }
            Err(err) => fail(EXIT_STORAGE, &err.to_string()),
        },
        Command::Get { id, output } => {
            let sandbox = match SandboxId::parse(&id) {
                Ok(sandbox) => sandbox,
                Err(err) => return fail(EXIT_USAGE, &err.to_string()),
            };
            match ctl::describe_json(store.as_ref(), &sandbox).await {
                Ok(value) => {
                    match output {
                        Format::Json => println!(
                            "{}",
                            serde_json::to_string_pretty(&value).unwrap_or_default()
                        ),
                        Format::Yaml => print!("{}", ctl::to_yaml(&value)),
                    }
                    ExitCode::SUCCESS
                }
                Err(err @ controllers::store::StoreError::NotFound { .. }) => {
                    fail(EXIT_NOT_FOUND, &format!("no such sandbox: {err}"))
                }
                Err(err) => fail(EXIT_STORAGE, &err.to_string()),
            }
        }
        Command::Describe { id } => report(ctl::describe(store.as_ref(), &id, now).await),
        Command::Edit { id } => {
            let editor = std::env::var("VISUAL")
                .or_else(|_| std::env::var("EDITOR"))
                .unwrap_or_else(|_| "vi".to_owned());
            report(ctl::edit(store.as_ref(), &id, &editor, &std::env::temp_dir()).await)
        }
        Command::Evict { id } => report(ctl::evict(store.as_ref(), &id).await),
        Command::Delete { id } => report(ctl::delete(store.as_ref(), &id).await),
        Command::BreakLease { id, yes } => {
            if !yes && !confirm(&id) {
                return fail(OperatorError::Cancelled.exit_code(), "cancelled");
            }
            report(ctl::break_lease(store.as_ref(), &id).await)
        }
        Command::Checkpoints { id, delete, output } => {
            let checkpoints = match store::open(&layout.checkpoints).await {
                Ok(store) => store,
                Err(err) => return fail(EXIT_STORAGE, &err.to_string()),
            };
            if let Some(target) = delete {
                return report(
                    ctl::delete_checkpoint_entry(
                        store.as_ref(),
                        checkpoints.as_ref(),
                        &id,
                        &target,
                    )
                    .await,
                );
            }
            match ctl::list_checkpoints(store.as_ref(), checkpoints.as_ref(), &id).await {
                Ok(rows) => {
                    match output {
                        None => print!("{}", ctl::render_checkpoints(&rows, now)),
                        Some(Format::Json) => println!(
                            "{}",
                            serde_json::to_string_pretty(&rows).unwrap_or_default()
                        ),
                        Some(Format::Yaml) => print!(
                            "{}",
                            ctl::to_yaml(&serde_json::to_value(&rows).unwrap_or_default())
                        ),
                    }
                    ExitCode::SUCCESS
                }
                Err(err) => fail(err.exit_code(), &err.to_string()),
            }
        }
        Command::Gc {
            dry_run,
            older_than_s,
            keep_checkpoints,
        } => {
            let checkpoints = match store::open(&layout.checkpoints).await {
                Ok(store) => store,
                Err(err) => return fail(EXIT_STORAGE, &err.to_string()),
            };
            match ctl::gc(
                store.as_ref(),
                checkpoints.as_ref(),
                chrono::Duration::seconds(older_than_s),
                now,
                dry_run,
                keep_checkpoints,
            )
            .await
            {
                Ok(found) => {
                    let verb = if dry_run { "would remove" } else { "removed" };
                    for id in &found.tombstones {
                        println!("{verb} deleted sandbox {id}");
                    }
                    for id in &found.trimmed {
                        println!("{verb} superseded checkpoint {id}");
                    }
                    for skipped in &found.skipped {
                        println!("skipped {skipped}");
                    }
                    for id in &found.orphan_checkpoints {
                        println!("{verb} unreferenced checkpoint {id}");
                    }
                    println!(
                        "{} tombstones, {} checkpoints{}",
                        found.tombstones.len(),
                        found.orphan_checkpoints.len() + found.trimmed.len(),
                        if dry_run {
                            " (dry run: nothing removed)"
                        } else {
                            ""
                        }
                    );
                    ExitCode::SUCCESS
                }
                Err(err) => fail(err.exit_code(), &err.to_string()),
            }
        }
        _ => ExitCode::SUCCESS,
    }
}

/// Asks the operator to type the id back.
fn confirm(id: &str) -> bool {
    eprint!(
        "Breaking the lease of {id} makes its holder stop it; the next attach restores its latest checkpoint.\nType the sandbox id to confirm: "
    );
    let mut answer = String::new();
    std::io::stdin().read_line(&mut answer).is_ok() && answer.trim() == id
}

async fn bench(runs: usize, sizes_mb: &[u64], runtime: &RuntimeArgs) -> ExitCode {
    let mut args = runtime.clone();
    if std::env::var_os("SANDBOXD_RUNTIME_DIR").is_none()
        && args.runtime_dir == std::path::Path::new("/run/sandboxd")
    {
        // Never share (and so clean up) a running server's containers.
        args.runtime_dir = "/run/sandboxd-bench".into();
    }
    match sandboxd::bench::runtime_benchmarks(args.gvisor("bench".into()), runs, sizes_mb).await {
        Ok(results) => {
            print!("{}", sandboxd::bench::render(&results));
            println!("{}", sandboxd::bench::to_json(&results));
            ExitCode::SUCCESS
        }
        Err(err) => fail(EXIT_STORAGE, &format!("benchmark failed: {err:#}")),
    }
}

fn fail(code: u8, message: &str) -> ExitCode {
    eprintln!("sandboxctl: {message}");
    ExitCode::from(code)
}
