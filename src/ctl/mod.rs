//! `sandboxctl`'s verbs. The logic lives here (library) so tests drive it
//! without spawning the binary: operator verbs over the bucket's documents,
//! user verbs through the client library.

mod checkpoints;
mod files;
mod images;
mod inventory;
mod mcp;
mod operator;
mod shell;
mod user;
mod yaml;

pub use checkpoints::{
    CheckpointRow, delete_checkpoint_entry, list_checkpoints, render_checkpoints, trim_history,
};
pub use files::{CpSide, FilesCommand, download, run_files_command, upload};
pub use images::{ImagesError, fetch_images, http_base, render_images};
pub use inventory::{SandboxRow, describe_json, list_rows, render_table};
pub use mcp::{McpOptions, serve_stdio as serve_mcp};
pub use operator::{
    GcReport, OperatorError, SnapshotGcReport, break_lease, delete, describe, edit, evict, gc,
    gc_snapshots,
};
pub use shell::shell;
pub use user::{UserCommand, run_user_command};
pub use yaml::to_yaml;
