//! The agent channel: the in-sandbox agent (the `sandbox_agent` Python
//! package, PID 1 of every sandbox, embedded by `program`), the messages
//! between it and the host ([`protocol`]), and the host's end of the channel:
//! the connection over the init process's stdio (`connection`), the bounded
//! reading of its lines (`lines`), where each event goes (`routes`), and the
//! delivery gate that lets a resumable execution move with its sandbox
//! (`delivery`).
//!
//! Everything here speaks to one agent; starting sandboxes, checkpoints and
//! images are the business of the modules above it.

mod connection;
pub(crate) mod delivery;
mod lines;
pub(crate) mod program;
pub mod protocol;
mod routes;

pub use connection::{
    AgentConnection, AgentError, DataError, LatestCommand, MAX_QUEUED_COMMAND_BYTES,
    STDIN_WINDOW_BYTES, check_version,
};
pub use lines::MAX_AGENT_PAYLOAD_BYTES;
pub use routes::{ExecEvents, MAX_QUEUED_OUTPUT_BYTES, Sequenced};
