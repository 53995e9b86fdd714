//! The production [`Residents`]: the controller says what is held here, the
//! sessions (`LiveSandboxes`) say which of those are idle, and an eviction
//! is the intent `desired_state: checkpointed` written through the
//! controller, as `sandboxctl evict` and the idle timeout write it.

use std::sync::Arc;

use async_trait::async_trait;
use controllers::api::{DesiredState, SandboxId};
use controllers::sandboxes::SandboxController;

use super::{Candidate, Residents};
use crate::api::live::LiveSandboxes;

#[derive(Debug)]
pub struct LocalResidents {
    pub controller: Arc<SandboxController>,
    pub live: Arc<LiveSandboxes>,
}

#[async_trait]
impl Residents for LocalResidents {
    fn held(&self) -> Vec<SandboxId> {
        self.controller.held_sandboxes()
    }

    fn candidates(&self) -> Vec<Candidate> {
        // A held sandbox no session knows yet (starting) is not a candidate.
        self.controller
            .held_sandboxes()
            .iter()
            .filter_map(|id| self.live.get(id)?.candidate())
            .collect()
    }

    async fn evict(&self, sandbox: &SandboxId) -> Result<(), String> {
        self.controller
            .request_state(sandbox, DesiredState::Checkpointed, None)
            .await
            .map_err(|err| err.to_string())
    }
}
