//! The sandbox runtime on real gVisor, one folder per concept:
//! - [`agent`]: the agent channel, the in-sandbox agent (the `sandbox_agent`
//!   package), the messages between it and the host, and the host's end;
//! - [`images`]: sandbox images, the root filesystems sandboxes run on;
//! - [`checkpoint`]: checkpoint images, the memory images of checkpointed
//!   sandboxes, and snapshot archives on their way to and from the store;
//! - [`network`]: `egress` sandbox networking;
//! - `gvisor`: [`GvisorRuntime`], which implements the controllers'
//!   `SandboxRuntime` port on all of these;
//!
//! and beside them the `runsc` CLI wrapped ([`runsc`]), the OCI bundle
//! ([`bundle`]), the warm pool's cgroup readings (`cgroup`), and the
//! filesystem API and workspace sync on the agent ([`files_access`],
//! `workspace_access`). `docs/gvisor.md` records the runsc behaviour all of
//! this is built around.

pub mod agent;
pub mod bundle;
mod cgroup;
pub mod checkpoint;
pub mod files_access;
mod gvisor;
pub mod images;
pub mod network;
pub mod runsc;
mod workspace_access;

pub use bundle::{BundleNetwork, BundleSpec};
pub use checkpoint::transfer::host_cpu_features;
pub use gvisor::{DEFAULT_ORPHANED_CHECKPOINTS_BUDGET, GvisorConfig, GvisorRuntime, WarmPoolStats};
pub use images::catalog::{DEFAULT_IMAGE, Image, ImageCatalog, ImageInfo};
pub use network::{NetnsWorkaround, NetworkConfig};
pub use runsc::{LaunchNetwork, Runsc, RunscError, RunscTimeouts};
