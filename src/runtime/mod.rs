//! The sandbox runtime on real gVisor: the `runsc` CLI wrapped ([`runsc`]), the
//! OCI bundle ([`bundle`]), the in-sandbox agent and the host's channel to it
//! ([`agent`], the `sandbox_agent` package and [`agent_protocol`], the
//! messages between them), the delivery gates that let an execution move
//! with its sandbox (`delivery`), sandbox images, the root filesystems sandboxes
//! run on ([`catalog`]), checkpoint images ([`images`]), `egress` sandbox
//! networking ([`network`]), and
//! [`GvisorRuntime`], which implements the controllers' `SandboxRuntime` port.
//! `docs/gvisor.md` records the runsc behaviour all of this
//! is built around.

pub mod agent;
mod agent_lines;
mod agent_program;
pub mod agent_protocol;
mod agent_routes;
pub mod bundle;
pub mod catalog;
mod cgroup;
mod cpu_quota;
mod delivery;
pub mod files_access;
mod gvisor;
mod image_follower;
pub mod image_store;
pub mod images;
pub mod network;
pub mod ready;
pub mod runsc;
pub mod templates;
mod workspace_access;

pub use bundle::{BundleNetwork, BundleSpec};
pub use catalog::{DEFAULT_IMAGE, Image, ImageCatalog, ImageInfo};
pub use gvisor::{DEFAULT_ORPHANED_CHECKPOINTS_BUDGET, GvisorConfig, GvisorRuntime, WarmPoolStats};
pub use images::host_cpu_features;
pub use network::{NetnsWorkaround, NetworkConfig};
pub use runsc::{LaunchNetwork, Runsc, RunscError, RunscTimeouts};
