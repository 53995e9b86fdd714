//! The sandbox lifecycle controller: per instance, a level-triggered reconcile
//! loop converging each sandbox (running here, checkpointed, deleted) to the
//! desired state the API and operators write in the bucket (`docs/principles.md`).

mod controller;
mod decision;
mod events;
mod metrics;
mod reconciler;
mod workqueue;

pub use controller::{ControlError, SandboxController};
pub use events::{CheckpointFailure, LossCause, SandboxEvent, StartFailure, StartKind};
pub use metrics::{Census, Histogram, Metrics};
pub use reconciler::{
    AttachRead, ForkError, ForkPoint, HandoffPolicy, ReadMetadata, ReconcileError, Reconciler,
    ReconcilerConfig, ReconcilerParts, Requeue, delete_checkpoint_objects, record_carried,
};

#[cfg(test)]
mod economy;
#[cfg(test)]
mod simulation;
#[cfg(test)]
mod tests;
