//! Test doubles for the ports: an in-memory Store with fault injection and a
//! manual clock. Behind the `testing` feature; never in the server binary.

mod manual_clock;
mod memory_store;
mod mutation;

pub use manual_clock::ManualClock;
pub use memory_store::{Fault, MemoryStore};
pub use mutation::mutate;
