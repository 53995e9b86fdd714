//! What a session asked the controller for and has not yet seen the end of:
//! a checkpoint (`checkpoint`) and the sandbox's deletion (`kill_sandbox`).
//! The relay reads them to answer the requester in the wire's words (a
//! deletion the session asked for ends with `SANDBOX_KILLED`; a checkpoint
//! refused for a running execution is an error only for the session that
//! asked). Both can be pending at once: `kill_sandbox` acts ahead of a
//! queued checkpoint.

use std::sync::{Mutex, MutexGuard, PoisonError};

#[derive(Debug, Default, Clone, Copy)]
struct Requested {
    checkpoint: bool,
    kill: bool,
}

#[derive(Debug, Default)]
pub(super) struct Pending(Mutex<Requested>);

impl Pending {
    fn lock(&self) -> MutexGuard<'_, Requested> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn set_checkpoint(&self, pending: bool) {
        self.lock().checkpoint = pending;
    }

    pub(super) fn checkpoint(&self) -> bool {
        self.lock().checkpoint
    }

    /// Whether a checkpoint was pending; it no longer is.
    pub(super) fn take_checkpoint(&self) -> bool {
        std::mem::take(&mut self.lock().checkpoint)
    }

    pub(super) fn set_kill(&self, pending: bool) {
        self.lock().kill = pending;
    }

    pub(super) fn kill(&self) -> bool {
        self.lock().kill
    }

    /// Whether a kill was pending; it no longer is.
    pub(super) fn take_kill(&self) -> bool {
        std::mem::take(&mut self.lock().kill)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_taken_request_is_no_longer_pending_and_the_other_stays() {
        let pending = Pending::default();
        pending.set_checkpoint(true);
        pending.set_kill(true);
        assert!(pending.take_checkpoint());
        assert!(!pending.checkpoint());
        assert!(!pending.take_checkpoint());
        assert!(pending.kill());
        assert!(pending.take_kill());
        assert!(!pending.kill());
    }
}
