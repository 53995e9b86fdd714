//! Sandbox images: the root filesystems sandboxes run on, named and versioned
//! by content digest. What this host has ([`catalog`]), the copies in the
//! checkpoint store that a host lacking one fetches ([`store`]), templates
//! built from a base image ([`templates`]) and the start command an image may
//! name ([`ready`]).
//!
//! "Image" here always means such a root filesystem; the memory images runsc
//! writes when it checkpoints a sandbox are `super::checkpoint`'s.

pub mod catalog;
pub mod ready;
pub mod store;
pub mod templates;
