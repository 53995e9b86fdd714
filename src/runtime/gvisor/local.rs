//! Everything this runtime holds of one sandbox, in one place: a [`Local`]
//! per sandbox id, all of them behind one lock ([`Locals`]).
//!
//! A sandbox's life on this host (a container booted beside its create's
//! writes, a handoff's restore staged ahead of its transfer, a create or
//! restore under way, running, with the execution a restore brought back)
//! used to be membership in five maps and sets, each behind its own lock: a
//! reader could see one changed and the next not yet, and nothing stopped a
//! resumed execution outliving its sandbox. One entry per sandbox, a typed
//! state with every transition one function returning the next state: a
//! sandbox is never reserved and running at once, a resumed execution is
//! part of the running state, and what was made ready ahead of a create or
//! restore travels with its reservation.
//!
//! Why it is not in the controllers' slot (`reconciler/slots.rs`): the
//! controllers reach the runtime only through the `SandboxRuntime` port (a
//! fake one in simulations) and know nothing of containers, agents or runsc;
//! this is what runs on this host behind that port, the slot what the
//! instance knows of the bucket's objects.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use controllers::api::SandboxId;
use controllers::runtime::Execution;

use super::LocalSandbox;
use super::pool::WarmSandbox;
use super::staged::Stage;

/// Where one sandbox is on this host.
pub(super) enum Local {
    /// A container booted for its create while the create is being
    /// recorded (decision 23, `pool`).
    Prepared(WarmSandbox),
    /// A handoff's restore staged ahead of its transfer, or one that ended
    /// lately and is remembered (`staged`).
    Staged(Stage),
    /// A create or restore runs for it now (the reservation's `ticket`),
    /// with what was made ready ahead for it until it is taken.
    Reserved { ticket: u64, ahead: Option<Ahead> },
    /// Running here; `resumed`: the execution its restore brought back,
    /// until the API takes it.
    Running {
        sandbox: Arc<LocalSandbox>,
        resumed: Option<Execution>,
    },
}

/// What was made ready for a sandbox before its create or restore.
pub(super) enum Ahead {
    Prepared(WarmSandbox),
    Staged(Stage),
}

impl Ahead {
    /// The state it stands for without a reservation.
    fn into_local(self) -> Local {
        match self {
            Self::Prepared(booted) => Local::Prepared(booted),
            Self::Staged(stage) => Local::Staged(stage),
        }
    }
}

/// A transition's next state: `None` forgets the sandbox.
pub(super) type Next = Option<Local>;

impl Local {
    /// A create or restore takes the sandbox: refused while another runs or
    /// it runs here; what was made ready ahead goes with the reservation.
    pub(super) fn reserve(state: Option<Self>, ticket: u64) -> (Next, bool) {
        match state {
            None => (
                Some(Self::Reserved {
                    ticket,
                    ahead: None,
                }),
                true,
            ),
            Some(Self::Prepared(booted)) => (
                Some(Self::Reserved {
                    ticket,
                    ahead: Some(Ahead::Prepared(booted)),
                }),
                true,
            ),
            Some(Self::Staged(stage)) => (
                Some(Self::Reserved {
                    ticket,
                    ahead: Some(Ahead::Staged(stage)),
                }),
                true,
            ),
            busy @ Some(Self::Reserved { .. } | Self::Running { .. }) => (busy, false),
        }
    }

    /// The create or restore ended without running it: back to what was
    /// ready ahead (if nothing took it), or forgotten. Another's state is
    /// left alone.
    pub(super) fn unreserve(state: Option<Self>, ticket: u64) -> (Next, ()) {
        match state {
            Some(Self::Reserved {
                ticket: held,
                ahead,
            }) if held == ticket => (ahead.map(Ahead::into_local), ()),
            other => (other, ()),
        }
    }

    /// The create or restore started it: it runs. Returns what was ready
    /// ahead and not taken (the caller discards it).
    pub(super) fn run(state: Option<Self>, sandbox: Arc<LocalSandbox>) -> (Next, Option<Ahead>) {
        let left = match state {
            Some(Self::Reserved { ahead, .. }) => ahead,
            Some(Self::Prepared(booted)) => Some(Ahead::Prepared(booted)),
            Some(Self::Staged(stage)) => Some(Ahead::Staged(stage)),
            Some(Self::Running { .. }) | None => None,
        };
        (
            Some(Self::Running {
                sandbox,
                resumed: None,
            }),
            left,
        )
    }

    /// A container booted for the create: kept unless something else holds
    /// the sandbox. Returns the container to discard (one it replaced, or
    /// this one).
    pub(super) fn prepare(state: Option<Self>, booted: WarmSandbox) -> (Next, Option<WarmSandbox>) {
        match state {
            None => (Some(Self::Prepared(booted)), None),
            Some(Self::Prepared(old)) => (Some(Self::Prepared(booted)), Some(old)),
            other => (other, Some(booted)),
        }
    }

    /// The create under way takes the container booted for it.
    pub(super) fn take_prepared(state: Option<Self>) -> (Next, Option<WarmSandbox>) {
        match state {
            Some(Self::Reserved {
                ticket,
                ahead: Some(Ahead::Prepared(booted)),
            }) => (
                Some(Self::Reserved {
                    ticket,
                    ahead: None,
                }),
                Some(booted),
            ),
            other => (other, None),
        }
    }

    /// The create a container was booted for will not come: the container
    /// to discard, if there is one.
    pub(super) fn forget_prepared(state: Option<Self>) -> (Next, Option<WarmSandbox>) {
        match state {
            Some(Self::Prepared(booted)) => (None, Some(booted)),
            other => Self::take_prepared(other),
        }
    }

    /// The restore under way takes the restore staged for it.
    pub(super) fn take_staged(state: Option<Self>) -> (Next, Option<Stage>) {
        match state {
            Some(Self::Reserved {
                ticket,
                ahead: Some(Ahead::Staged(stage)),
            }) => (
                Some(Self::Reserved {
                    ticket,
                    ahead: None,
                }),
                Some(stage),
            ),
            other => (other, None),
        }
    }

    /// It stops running here (destroyed, or lost): the sandbox that ran.
    pub(super) fn stop(state: Option<Self>) -> (Next, Option<Arc<LocalSandbox>>) {
        match state {
            Some(Self::Running { sandbox, .. }) => (None, Some(sandbox)),
            other => (other, None),
        }
    }

    /// Its restore brought an execution back; kept only while `local` is the
    /// sandbox running (the execution is dropped otherwise).
    pub(super) fn resume(
        state: Option<Self>,
        local: &LocalSandbox,
        execution: Execution,
    ) -> (Next, ()) {
        match state {
            Some(Self::Running { sandbox, .. }) if std::ptr::eq(Arc::as_ptr(&sandbox), local) => (
                Some(Self::Running {
                    sandbox,
                    resumed: Some(execution),
                }),
                (),
            ),
            other => (other, ()),
        }
    }

    /// The API takes the execution the restore brought back (or a
    /// checkpoint went on with it).
    pub(super) fn take_resumed(state: Option<Self>) -> (Next, Option<Execution>) {
        match state {
            Some(Self::Running { sandbox, resumed }) => (
                Some(Self::Running {
                    sandbox,
                    resumed: None,
                }),
                resumed,
            ),
            other => (other, None),
        }
    }

    /// The sandbox running, if it is.
    pub(super) fn running(&self) -> Option<&Arc<LocalSandbox>> {
        match self {
            Self::Running { sandbox, .. } => Some(sandbox),
            _ => None,
        }
    }
}

/// The entries of every sandbox this runtime holds something of, behind one
/// lock, and the tickets of their reservations: the runtime's one
/// per-sandbox map (not the controllers' slot: see the module's doc).
#[derive(Default)]
pub(super) struct Locals {
    entries: Mutex<HashMap<SandboxId, Local>>,
    tickets: AtomicU64,
}

impl std::fmt::Debug for Locals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locals")
            .field("sandboxes", &self.all().len())
            .finish_non_exhaustive()
    }
}

impl Locals {
    /// Every entry at once (for what looks across sandboxes).
    pub(super) fn all(&self) -> MutexGuard<'_, HashMap<SandboxId, Local>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves `sandbox`'s entry on by `transition` (one of [`Local`]'s),
    /// with what the transition says besides. `transition` must not reach
    /// the entries again: the lock is held.
    pub(super) fn step<T>(
        &self,
        sandbox: &SandboxId,
        transition: impl FnOnce(Option<Local>) -> (Next, T),
    ) -> T {
        let mut entries = self.all();
        let (next, outcome) = transition(entries.remove(sandbox));
        if let Some(next) = next {
            entries.insert(sandbox.clone(), next);
        }
        outcome
    }

    /// The sandbox running here under `sandbox`, if any.
    pub(super) fn running(&self, sandbox: &SandboxId) -> Option<Arc<LocalSandbox>> {
        self.all().get(sandbox).and_then(Local::running).cloned()
    }

    /// A fresh reservation ticket.
    pub(super) fn ticket(&self) -> u64 {
        self.tickets.fetch_add(1, Ordering::Relaxed)
    }
}
