//! A fake `SandboxRuntime` for the controllers' tests: a sandbox is a list of
//! the Bash commands it ran (its "memory"), a checkpoint stores that list as the
//! image, and a restore brings it back, so tests can see state survive moves.
//!
//! An execution of `hold` keeps running until killed (to test refusals).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use async_trait::async_trait;
use bytes::Bytes;
use chrono::Utc;
use sha2_free::sha256_hex;
use tokio::sync::mpsc;

use crate::api::{
    BlobDigest, CheckpointManifest, ExtraFields, SandboxId, SnapshotManifest, encode,
};
use crate::layout::{checkpoint_image_key, checkpoint_manifest_key};
use crate::runtime::{
    CheckpointRequest, Command, CreateOptions, ExecControl, ExecEvent, ExecRequest, Execution,
    ImageLanded, RuntimeError, SandboxRuntime,
};
use crate::store::{ObjectKey, PutMode, Store};

#[derive(Debug, Default)]
struct FakeSandbox {
    memory: Vec<String>,
    running_exec: Option<mpsc::Sender<ExecEvent>>,
}

#[derive(Debug, Default)]
struct State {
    sandboxes: HashMap<SandboxId, FakeSandbox>,
    creates: u64,
    restores: u64,
    /// Images [`SandboxRuntime::prefetch_checkpoint`] was asked for, in order.
    prefetches: Vec<ObjectKey>,
    /// Sandboxes whose next checkpoint fails and loses them
    /// ([`FakeRuntime::lose_on_checkpoint`]).
    lose_on_checkpoint: Vec<SandboxId>,
    /// Set by [`FakeRuntime::watch_images`]: whether handoff images have
    /// landed (until then `prefetch_checkpoint` says they are awaited).
    image_landing: Option<tokio::sync::watch::Sender<bool>>,
}

/// The fake runtime of one simulated host.
#[derive(Debug, Clone)]
pub struct FakeRuntime {
    checkpoints: Arc<dyn Store>,
    state: Arc<Mutex<State>>,
}

impl FakeRuntime {
    pub fn new(checkpoints: Arc<dyn Store>) -> Self {
        Self {
            checkpoints,
            state: Arc::default(),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the sandbox ran so far, if it runs here.
    pub fn memory(&self, sandbox: &SandboxId) -> Option<Vec<String>> {
        self.state()
            .sandboxes
            .get(sandbox)
            .map(|s| s.memory.clone())
    }

    /// How many sandboxes were created and restored here.
    pub fn counts(&self) -> (u64, u64) {
        let state = self.state();
        (state.creates, state.restores)
    }

    /// The images a taker asked to fetch ahead (decision 24), each once.
    pub fn prefetched(&self) -> Vec<ObjectKey> {
        self.state().prefetches.clone()
    }

    /// From now on `prefetch_checkpoint` watches like the real runtime's:
    /// every image is awaited until [`Self::land_images`].
    pub fn watch_images(&self) {
        self.state().image_landing = Some(tokio::sync::watch::Sender::new(false));
    }

    /// Every watched image is in the store now: the waits complete.
    pub fn land_images(&self) {
        if let Some(landing) = &self.state().image_landing {
            landing.send_replace(true);
        }
    }

    /// The sandbox's next checkpoint fails and takes it down, as runsc's
    /// does when the sentry cannot save it.
    pub fn lose_on_checkpoint(&self, sandbox: &SandboxId) {
        self.state().lose_on_checkpoint.push(sandbox.clone());
    }

    /// Simulates the sandbox dying under the runtime.
    pub fn crash(&self, sandbox: &SandboxId) {
        self.state().sandboxes.remove(sandbox);
    }
}

#[derive(Debug)]
struct FakeControl {
    runtime: FakeRuntime,
    sandbox: SandboxId,
}

#[async_trait]
impl ExecControl for FakeControl {
    async fn write_stdin(&self, _data: Bytes) -> Result<(), RuntimeError> {
        Ok(())
    }
    async fn close_stdin(&self) -> Result<(), RuntimeError> {
        Ok(())
    }
    async fn kill(&self) -> Result<(), RuntimeError> {
        let sender = {
            let mut state = self.runtime.state();
            state
                .sandboxes
                .get_mut(&self.sandbox)
                .and_then(|s| s.running_exec.take())
        };
        if let Some(sender) = sender {
            let _ = sender.send(ExecEvent::Exited(137)).await;
        }
        Ok(())
    }
}

#[async_trait]
impl SandboxRuntime for FakeRuntime {
    async fn create(
        &self,
        sandbox: &SandboxId,
        _options: &CreateOptions,
    ) -> Result<(), RuntimeError> {
        let mut state = self.state();
        if state.sandboxes.contains_key(sandbox) {
            return Err(RuntimeError::AlreadyExists(sandbox.clone()));
        }
        state
            .sandboxes
            .insert(sandbox.clone(), FakeSandbox::default());
        state.creates += 1;
        Ok(())
    }

    async fn exec(
        &self,
        sandbox: &SandboxId,
        request: ExecRequest,
    ) -> Result<Execution, RuntimeError> {
        let code = match request.command {
            Command::Bash(code) | Command::Python(code) | Command::PythonSession(code) => code,
        };
        let (sender, events) = mpsc::channel(16);
        {
            let mut state = self.state();
            let fake = state
                .sandboxes
                .get_mut(sandbox)
                .ok_or_else(|| RuntimeError::NotFound(sandbox.clone()))?;
            if fake.running_exec.is_some() {
                return Err(RuntimeError::ExecutionInProgress(sandbox.clone()));
            }
            fake.memory.push(code.clone());
            if code == "hold" {
                fake.running_exec = Some(sender.clone());
            }
        }
        if code != "hold" {
            let _ = sender.try_send(ExecEvent::Stdout(Bytes::from(format!("{code}\n"))));
            let _ = sender.try_send(ExecEvent::Exited(0));
        }
        Ok(Execution {
            events,
            control: Box::new(FakeControl {
                runtime: self.clone(),
                sandbox: sandbox.clone(),
            }),
        })
    }

    async fn checkpoint(
        &self,
        sandbox: &SandboxId,
        request: CheckpointRequest,
    ) -> Result<CheckpointManifest, RuntimeError> {
        let memory = {
            let mut state = self.state();
            if let Some(at) = state.lose_on_checkpoint.iter().position(|s| s == sandbox) {
                state.lose_on_checkpoint.remove(at);
                state.sandboxes.remove(sandbox);
                return Err(RuntimeError::Lost {
                    sandbox: sandbox.clone(),
                    detail: "checkpoint failed and stopped the sandbox".to_owned(),
                });
            }
            let fake = state
                .sandboxes
                .get(sandbox)
                .ok_or_else(|| RuntimeError::NotFound(sandbox.clone()))?;
            if fake.running_exec.is_some() && !request.force {
                return Err(RuntimeError::ExecutionInProgress(sandbox.clone()));
            }
            fake.memory.clone()
        };
        let image = Bytes::from(memory.join("\n"));
        let image_key = checkpoint_image_key(&request.checkpoint_id);
        let manifest = CheckpointManifest {
            api_version: CheckpointManifest::api_version(),
            checkpoint_id: request.checkpoint_id.to_string(),
            sandbox_id: sandbox.clone(),
            epoch: request.epoch,
            name: request.name,
            #[allow(
                clippy::disallowed_methods,
                reason = "the fake stamps its checkpoints as the real runtime does, with the host's time"
            )]
            created_at: Utc::now(),
            image: BlobDigest {
                key: image_key.to_string(),
                size: image.len() as u64,
                sha256: sha256_hex(&image),
            },
            runsc_version: "fake".to_owned(),
            platform: "fake".to_owned(),
            cpu_features: Vec::new(),
            network: Default::default(),
            sandbox_image: None,
            agent_version: None,
            extra: ExtraFields::new(),
        };
        // Image and manifest at once, as the gVisor runtime stores them.
        let manifest_key = checkpoint_manifest_key(&request.checkpoint_id);
        let (image_put, manifest_put) = tokio::join!(
            self.checkpoints
                .put(&image_key, image.clone(), PutMode::Create),
            self.checkpoints
                .put(&manifest_key, encode(&manifest), PutMode::Create)
        );
        image_put?;
        manifest_put?;
        self.state().sandboxes.remove(sandbox);
        Ok(manifest)
    }

    async fn restore(
        &self,
        sandbox: &SandboxId,
        manifest: &CheckpointManifest,
    ) -> Result<(), RuntimeError> {
        let key = crate::store::ObjectKey::new(manifest.image.key.as_str())
            .map_err(|err| RuntimeError::Invalid(err.to_string()))?;
        let image = self.checkpoints.get(&key).await?.data;
        if sha256_hex(&image) != manifest.image.sha256 {
            return Err(RuntimeError::CorruptImage {
                key: key.to_string(),
                detail: "sha256 mismatch".to_owned(),
            });
        }
        let text = String::from_utf8_lossy(&image);
        let memory = if text.is_empty() {
            Vec::new()
        } else {
            text.split('\n').map(str::to_owned).collect()
        };
        let mut state = self.state();
        if state.sandboxes.contains_key(sandbox) {
            return Err(RuntimeError::AlreadyExists(sandbox.clone()));
        }
        state.sandboxes.insert(
            sandbox.clone(),
            FakeSandbox {
                memory,
                running_exec: None,
            },
        );
        state.restores += 1;
        Ok(())
    }

    async fn snapshot_filesystem(
        &self,
        sandbox: &SandboxId,
        _name: &str,
    ) -> Result<SnapshotManifest, RuntimeError> {
        Err(RuntimeError::Invalid(format!(
            "the fake runtime takes no snapshots ({sandbox})"
        )))
    }

    async fn destroy(&self, sandbox: &SandboxId) -> Result<(), RuntimeError> {
        match self.state().sandboxes.remove(sandbox) {
            Some(_) => Ok(()),
            None => Err(RuntimeError::NotFound(sandbox.clone())),
        }
    }

    fn is_running(&self, sandbox: &SandboxId) -> bool {
        self.state().sandboxes.contains_key(sandbox)
    }

    fn prefetch_checkpoint(&self, _sandbox: &SandboxId, image: &ObjectKey) -> Option<ImageLanded> {
        let mut state = self.state();
        if !state.prefetches.contains(image) {
            state.prefetches.push(image.clone());
        }
        let landing = state
            .image_landing
            .as_ref()
            .filter(|landing| !*landing.borrow())?;
        let mut landed = landing.subscribe();
        Some(Box::pin(async move {
            let _ = landed.wait_for(|landed| *landed).await;
        }))
    }
}

/// A dependency-free digest is not worth it here: the fake only needs a
/// stable fingerprint with the right shape (64 lowercase hex digits).
mod sha2_free {
    use std::hash::{DefaultHasher, Hash, Hasher};

    pub fn sha256_hex(data: &[u8]) -> String {
        let mut out = String::with_capacity(64);
        for round in 0u8..4 {
            let mut hasher = DefaultHasher::new();
            round.hash(&mut hasher);
            data.hash(&mut hasher);
            out.push_str(&format!("{:016x}", hasher.finish()));
        }
        out
    }
}
