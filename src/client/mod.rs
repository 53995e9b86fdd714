//! A Rust client for the sandbox server, smarter than the earlier server's
//! Python and TypeScript clients but speaking the same protocol:
//!
//! - it keeps the affinity cookie of every upgrade response (Cloud Run's
//!   `GAESA`) and sends it back, so reconnects reach the same instance;
//! - when a connection drops, it reconnects with back-off, follows
//!   `SANDBOX_RESTORING` → `SANDBOX_RUNNING` (the sandbox may have moved to
//!   another instance meanwhile) and asks for the replay of the execution's
//!   output, so a process's output arrives complete; stdin written meanwhile
//!   is buffered and sent after the reconnect;
//! - every error status becomes a typed [`ClientError`] with the server's
//!   message.
//!
//! ```no_run
//! # async fn demo() -> Result<(), sandboxd::client::ClientError> {
//! use sandboxd::client::{CreateOptions, Language, Sandbox};
//! let sandbox = Sandbox::create("ws://127.0.0.1:8080", CreateOptions::default()).await?;
//! let output = sandbox.exec(Language::Python, "print(1)").await?.output().await?;
//! assert_eq!(output.stdout, "1\n");
//! sandbox.kill().await?;
//! # Ok(()) }
//! ```

mod connection;
mod error;
mod sandbox;

pub use error::ClientError;
pub use sandbox::files::{FileEntry, FileKind, FileRange, Listing, Transferred};
pub use sandbox::{
    AttachOptions, CreateOptions, ExitStatus, ForkSource, Language, Output, OutputChunk, Process,
    ProcessHandle, Progress, Sandbox,
};
