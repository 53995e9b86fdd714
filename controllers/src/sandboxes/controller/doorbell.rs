//! The instance lease loop (the one renewal keeping every hold here alive) and
//! the doorbell loop (intents written elsewhere for sandboxes held here).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use crate::api::SandboxId;

use super::super::reconciler::Command;
use super::{ControlError, SandboxController};

/// What this instance last read from its doorbell.
#[derive(Debug, Default)]
pub(super) struct DoorbellState {
    generation: Option<crate::store::Generation>,
    /// Rings already answered, by sandbox and time.
    answered: HashSet<(SandboxId, chrono::DateTime<chrono::Utc>)>,
}

/// How often the lease loop looks whether a renewal is due (local only).
const LEASE_TICK: Duration = Duration::from_millis(250);

impl SandboxController {
    /// Renews the instance lease every `renew_interval` while anything is (or
    /// just was) held: the only keeper of holds, never delayed by a checkpoint
    /// or upload. Holds a lapse left unvouched are queued (re-verify or stop).
    pub(super) async fn keep_instance_lease(self: Arc<Self>) {
        let every = chrono::Duration::from_std(self.reconciler.config().renew_interval)
            .unwrap_or(chrono::Duration::MAX);
        let instance_lease = self.reconciler.leases().instance_lease().clone();
        let mut retry_after: Option<tokio::time::Instant> = None;
        loop {
            tokio::time::sleep(LEASE_TICK).await;
            if !self.reconciler.needs_instance_lease() || !instance_lease.renewal_due(every) {
                continue;
            }
            if retry_after.is_some_and(|at| self.reconciler.clock().instant() < at) {
                continue;
            }
            let era = instance_lease.era();
            match instance_lease.renew().await {
                Ok(renewed) => {
                    retry_after = None;
                    if renewed != era {
                        tracing::warn!(
                            era = renewed,
                            "the instance lease had lapsed; re-verifying holds"
                        );
                    }
                }
                Err(err) => {
                    tracing::warn!(%err, "cannot renew the instance lease");
                    retry_after = Some(self.reconciler.clock().instant() + Duration::from_secs(1));
                }
            }
            for sandbox in self.reconciler.unvouched() {
                self.enqueue(&sandbox);
            }
        }
    }

    /// Reads the doorbell every `doorbell_poll` while anything is held (nobody rings otherwise),
    /// `doorbell_poll_active` while a client here is active, start to start (a read adds no wait).
    pub(super) async fn watch_doorbell(self: Arc<Self>) {
        let mut last_read = self.reconciler.clock().instant();
        loop {
            tokio::time::sleep_until(last_read + self.reconciler.doorbell_interval()).await;
            last_read = self.reconciler.clock().instant();
            if !self.reconciler.needs_instance_lease() {
                continue;
            }
            if let Err(err) = self.answer_doorbell().await {
                tracing::warn!(%err, "cannot read the doorbell");
            }
        }
    }

    /// Reads the doorbell once; queues and returns the sandboxes newly rung.
    pub async fn answer_doorbell(&self) -> Result<Vec<SandboxId>, ControlError> {
        let doorbell = self.reconciler.leases().instance_lease().read_doorbell();
        let Some((bell, generation)) = doorbell.await? else {
            return Ok(Vec::new());
        };
        let rung = {
            let mut state = self
                .doorbell
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if state.generation == Some(generation) {
                return Ok(Vec::new());
            }
            state.generation = Some(generation);
            let present: HashSet<_> = bell
                .rings
                .iter()
                .map(|ring| (ring.sandbox.clone(), ring.rung_at))
                .collect();
            state.answered.retain(|ring| present.contains(ring));
            let mut rung = Vec::new();
            for ring in bell.rings {
                if !state.answered.insert((ring.sandbox.clone(), ring.rung_at)) {
                    continue;
                }
                // Its pass hears of a ring-only attach intent (decision 27).
                let intent = ring.intent;
                self.reconciler
                    .send(&ring.sandbox, Command::Rung { intent }, None);
                if !rung.contains(&ring.sandbox) {
                    rung.push(ring.sandbox);
                }
            }
            rung
        };
        for sandbox in &rung {
            tracing::debug!(%sandbox, "doorbell rung");
            self.enqueue(sandbox);
        }
        Ok(rung)
    }
}
