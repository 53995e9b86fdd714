//! `sandboxctl`'s command line: the verbs, their flags and help. What each
//! verb does is in `main.rs` and, for the logic, `sandboxd::ctl`.

use clap::{Parser, Subcommand, ValueEnum};
use sandboxd::client::Language;
use sandboxd::config::{RuntimeArgs, StorageArgs};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Use sandboxes through a server, and manage them through their documents in the bucket",
    after_help = "Examples:\n  sandboxctl run python 'print(1)'\n  sandboxctl list\n  sandboxctl --metadata-bucket my-sandboxes describe 3f9c0d4e5a6b7c8d9e0f1a2b3c4d5e6f"
)]
pub(crate) struct Cli {
    #[command(flatten)]
    pub(crate) storage: StorageArgs,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Lang {
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
pub(crate) enum Format {
    Json,
    Yaml,
}

#[derive(Debug, clap::Args)]
pub(crate) struct Server {
    /// The server (ws://, wss://, http:// or https://).
    #[arg(long, env = "SANDBOXD_URL", default_value = "ws://127.0.0.1:8080")]
    pub(crate) url: String,
}

#[derive(Debug, clap::Args)]
pub(crate) struct Target {
    /// The sandbox id.
    pub(crate) id: String,
    /// Its token (as `create` printed it).
    #[arg(long, env = "SANDBOX_TOKEN")]
    pub(crate) token: String,
    #[command(flatten)]
    pub(crate) server: Server,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
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
        /// Its owner's proof: the token of the sandbox that made it, or the
        /// snapshot token `sandboxctl snapshot` printed.
        #[arg(long, env = "SANDBOXCTL_SNAPSHOT_TOKEN", requires = "snapshot")]
        snapshot_token: Option<String>,
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
    /// Copy files and directories between this machine and a sandbox, as
    /// `kubectl cp` does: one side is ID:PATH (a path in the sandbox,
    /// absolute or relative to /home/sandbox), the other a local path.
    /// Permission bits are kept; symlinks are skipped.
    #[command(
        after_help = "Examples:\n  sandboxctl cp ./data ID:/home/sandbox/data --token T\n  sandboxctl cp ID:/tmp/report.csv . --token T"
    )]
    Cp {
        from: String,
        to: String,
        #[arg(long, env = "SANDBOX_TOKEN")]
        token: String,
        #[command(flatten)]
        server: Server,
    },
    /// List a directory (or show a file) in a sandbox.
    #[command(
        after_help = "Examples:\n  sandboxctl ls ID /tmp --token T\n  sandboxctl ls ID . --depth 3 --token T"
    )]
    Ls {
        #[command(flatten)]
        target: Target,
        #[arg(default_value = ".")]
        path: String,
        /// Levels to descend (1: the directory's own entries).
        #[arg(long, default_value_t = 1)]
        depth: u32,
    },
    /// An interactive terminal in a sandbox (like `kubectl exec -it`): raw
    /// keystrokes, the window's size followed; the command's exit code.
    #[command(
        after_help = "Examples:\n  sandboxctl shell ID --token T\n  sandboxctl shell ID --token T 'python3 -i'"
    )]
    Shell {
        #[command(flatten)]
        target: Target,
        #[arg(default_value = "exec bash -il")]
        command: String,
    },
    /// Serve sandboxes to an agent as Model Context Protocol tools over
    /// stdio (create_sandbox, run_code, read_file, write_file, list_files,
    /// checkpoint_sandbox, fork_sandbox, kill_sandbox). The sandboxes' tokens
    /// stay in this process; when the client goes away, the sandboxes it
    /// made are killed (unless --keep-sandboxes). See docs/mcp.md.
    #[command(
        after_help = "Examples:\n  claude mcp add sandboxd -- sandboxctl mcp --url https://sandboxd.example.com\n  SANDBOXD_URL=ws://127.0.0.1:8080 sandboxctl mcp"
    )]
    Mcp {
        /// Seconds without activity before a sandbox is checkpointed (the
        /// next call restores it); 0: never.
        #[arg(long, default_value_t = 600)]
        idle_timeout: u64,
        /// Leave the sandboxes when the client goes away (their ids and
        /// tokens are printed on stderr) instead of killing them.
        #[arg(long)]
        keep_sandboxes: bool,
        #[command(flatten)]
        server: Server,
    },
    /// Print a file of a sandbox.
    #[command(after_help = "Example:\n  sandboxctl cat ID /etc/os-release --token T")]
    Cat {
        #[command(flatten)]
        target: Target,
        path: String,
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
    /// Remove old tombstones, sandboxes that failed without ever being
    /// checkpointed (creates that never ran), and checkpoints nothing points at.
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
        /// Filesystem snapshots older than this many days are removed (by
        /// their creation time); 0 keeps them forever. Archives no snapshot
        /// names any more are removed whatever this says.
        #[arg(long, default_value_t = 90)]
        snapshot_retention_days: i64,
    },
    /// List the sandbox images a server has (digest, names, default, packages).
    #[command(after_help = "Example:\n  sandboxctl images --url http://127.0.0.1:8080")]
    Images {
        /// Print the JSON document instead of the table.
        #[arg(long)]
        json: bool,
        /// The server's operator credential (`--operator-token` of `sandboxd
        /// serve`), needed unless on the server's machine.
        #[arg(long, env = "SANDBOXD_OPERATOR_TOKEN", hide_env_values = true)]
        operator_token: Option<String>,
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
    /// Build a ready template: an image (the default, or --base) whose start
    /// command runs once per instance, is checkpointed there, and is
    /// restored by every create of the image (its imports, globals and
    /// processes already there). The command is ready when it exits 0.
    /// Runs on a server's host (root), into its image directory.
    #[command(
        after_help = "Examples:\n  sandboxctl ready-template py-data --python 'import json, sqlite3'\n  sandboxctl ready-template web --bash 'setsid nohup python3 -m http.server 8000 >/dev/null 2>&1 & until curl -s localhost:8000 >/dev/null; do sleep 0.1; done'\n  sandboxctl create --image py-data"
    )]
    ReadyTemplate {
        /// The new image's name.
        name: String,
        /// Python run as a cell of the sandbox's persistent session (its
        /// globals stay for the user's cells).
        #[arg(long, conflicts_with = "bash", required_unless_present = "bash")]
        python: Option<String>,
        /// Bash run with `bash -c` (start services detached, output redirected).
        #[arg(long)]
        bash: Option<String>,
        /// Longest the command may take to report ready (default 300).
        #[arg(long)]
        timeout_s: Option<u64>,
        /// Build on this image instead of the default.
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
}
