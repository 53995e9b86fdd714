//! Persistent workspaces (`docs/workspaces.md`): `/workspace` in a sandbox, synced
//! incrementally to `workspaces/owner.<scope>/<name>/` in the workspace store, so its files
//! survive the sandbox itself — a new sandbox given the same workspace finds
//! them, and a crash between checkpoints keeps the last finished execution's.
//!
//! - [`state`]: the `.sandbox-state` format and the plans computed from two
//!   states (pure).
//! - [`path`]: checks on untrusted paths.
//! - [`files`]: the port into a sandbox's files (the gVisor runtime's agent).
//! - [`owner`]: the owner scope a workspace token opens.
//! - [`sync`]: one sync down or up against the store, with its limits.
//! - [`hooks`]: which syncs run at which lifecycle point (templates), wired to
//!   the controllers' [`controllers::hooks::LifecycleHooks`].
//! - [`metrics`]: counters for `/metrics`.

pub mod files;
pub mod hooks;
pub mod metrics;
pub mod owner;
pub mod path;
mod spool;
pub mod state;
pub mod sync;

pub use files::WorkspaceFiles;
pub use hooks::{HookAction, HookTemplate, WorkspaceHooks};
pub use metrics::WorkspaceMetrics;
pub use sync::{SyncLimits, WorkspaceSync};
