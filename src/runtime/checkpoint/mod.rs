//! Checkpoint images: the memory images runsc writes when it checkpoints a
//! sandbox, and snapshot archives, on their way to and from the store. Their
//! hashing and verified downloads ([`transfer`]), the hashing and flushing of
//! an image while runsc still writes it (`follower`), and the CPU quota and
//! memory headroom a sandbox gets while it is checkpointed or restored
//! (`cpu_quota`).
//!
//! Sandbox root filesystems, the other kind of image, are `super::images`'s.

pub(crate) mod cpu_quota;
pub(crate) mod follower;
pub mod transfer;
