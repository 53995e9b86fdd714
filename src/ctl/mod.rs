//! Operator verbs over the bucket, as `sandboxctl` runs them. The logic lives
//! here (library) so tests drive it without spawning the binary.

mod inventory;

pub use inventory::{SandboxRow, describe_json, list_rows, render_table};
