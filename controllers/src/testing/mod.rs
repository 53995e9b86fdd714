//! Test doubles for the ports: an in-memory Store with fault injection, a
//! fake sandbox runtime and a manual clock. Behind the `testing` feature; never in the server binary.

mod fake_runtime;
mod manual_clock;
mod memory_store;
mod mutation;

pub use fake_runtime::FakeRuntime;
pub use manual_clock::{ManualClock, OffsetClock};
pub use memory_store::{Fault, MemoryStore};
pub use mutation::{edit_json, mutate};

use crate::api::SandboxId;
use crate::leasing::{HeldLease, LeaseError, Leases};

/// Takes `sandbox`'s lock for `leases`' instance, as that instance's pass
/// would: for tests that need a held lock in the bucket. Outside this crate
/// only a pass writes a lock, so the acquisition itself is crate-private.
pub async fn hold(leases: &Leases, sandbox: &SandboxId) -> Result<HeldLease, LeaseError> {
    leases.acquire(sandbox).await
}
