//! The intents the API layer writes through the controller: create, fork,
//! ask for a sandbox here (or withdraw), ask for a checkpoint or deletion
//! (ringing the holder elsewhere), and the shutdown drain. Each writes
//! `metadata.json`'s spec, or takes a free lock, or rings the holder (the
//! ring carries the intent; only a free lock another instance wants gets
//! `wanted_by`), and queues a reconcile; none touches the runtime.

use std::sync::Arc;
use std::time::Duration;

use crate::api::{
    DesiredState, ForkOrigin, Phase, RestoreRequest, SandboxId, SandboxMetadata, SandboxSpec,
    decode, encode,
};
use crate::layout::metadata_key;
use crate::leasing::LeaseError;
use crate::store::{Decision, PutMode, RmwError, StoreError, read_modify_write_from};

use super::super::reconciler::{
    AttachRead, ForkPoint, ReadMetadata, ReconcileError, create_options, record_carried,
};
use super::{ControlError, SandboxController};

impl SandboxController {
    /// Records a new sandbox (desired running) and asks for it here.
    ///
    /// A create is its own acquisition (decision 18): `metadata.json` and a
    /// `lock.json` held by this instance at epoch 1 are written at once,
    /// each only if absent, and the pass that starts it decides on what was
    /// written without reading it back. If a lock exists already (nothing
    /// else could have written one for a fresh id but an operator), the
    /// create falls back to an attach intent.
    pub async fn create(&self, metadata: &SandboxMetadata) -> Result<(), ControlError> {
        let sandbox = &metadata.sandbox_id;
        let leases = self.reconciler.leases();
        let writing = self.reconciler.writing_intent(sandbox);
        let key = metadata_key(sandbox);
        // A fresh sandbox's container boots beside the writes (decision
        // 23); a fork restores its checkpoint instead.
        let runtime = self.reconciler.runtime();
        let boots = metadata.status.latest_checkpoint.is_none();
        let options = create_options(&metadata.spec);
        let prepared = async {
            if boots {
                runtime.prepare_create(sandbox, &options).await;
            }
        };
        let (written, held, ()) = tokio::join!(
            self.reconciler
                .metadata_store()
                .put(&key, encode(metadata), PutMode::Create),
            leases.create_held(sandbox),
            prepared
        );
        if !matches!((&written, &held), (Ok(_), Ok(Some(_)))) {
            runtime.forget_prepared(sandbox);
        }
        let generation = match written {
            Ok(generation) => generation,
            Err(err) => {
                if let Ok(Some(held)) = &held
                    && let Err(release) = leases.release(held).await
                {
                    tracing::warn!(%sandbox, %release, "cannot release the lock of a create that failed");
                }
                return Err(match err {
                    StoreError::PreconditionFailed { .. } => {
                        ControlError::AlreadyExists(sandbox.clone())
                    }
                    err => err.into(),
                });
            }
        };
        match held? {
            Some(held) => {
                self.reconciler.mark_waiting(sandbox);
                self.reconciler.prime(
                    sandbox,
                    (metadata.clone(), generation),
                    Some((held.lease, held.generation)),
                );
            }
            None => {
                self.reconciler
                    .remember_metadata(sandbox, metadata, generation);
                leases.request_attach(sandbox).await?;
            }
        }
        drop(writing);
        self.enqueue(sandbox);
        Ok(())
    }

    /// Reads what an attach needs, both objects at once: `metadata.json`
    /// (the token, the options) and `lock.json` (who holds it). `None`: the
    /// sandbox does not exist.
    pub async fn read_for_attach(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Option<AttachRead>, ControlError> {
        let (metadata, lock) = tokio::join!(
            self.reconciler.read_metadata_versioned(sandbox),
            self.reconciler.leases().read(sandbox)
        );
        let Some(metadata) = metadata? else {
            return Ok(None);
        };
        Ok(Some(AttachRead {
            metadata,
            lock: lock?,
        }))
    }

    /// `metadata.json` with the checkpoint `lock.json` carries folded in
    /// (both read at once): what a fork starts from. A client hears
    /// CHECKPOINTED once the hand-back carries the checkpoint, before its
    /// record lands in the metadata (decision 18), and may fork it at once,
    /// on any instance. `None`: the sandbox does not exist.
    pub async fn read_with_carried(
        &self,
        sandbox: &SandboxId,
    ) -> Result<Option<SandboxMetadata>, ControlError> {
        let Some(read) = self.read_for_attach(sandbox).await? else {
            return Ok(None);
        };
        let (mut metadata, _) = read.metadata;
        if let Some(carried) = read
            .lock
            .as_ref()
            .and_then(|(lock, _)| lock.checkpoint.as_ref())
        {
            // A view, not a record: nothing falls off the history.
            record_carried(&mut metadata.status, carried, usize::MAX);
        }
        Ok(Some(metadata))
    }

    /// Records `metadata` (a new sandbox) as a fork of `source` at `point`
    /// and asks for it here: it is restored from its own copy of that
    /// checkpoint, on the image and kind of network the checkpoint needs.
    pub async fn fork(
        &self,
        source: &SandboxMetadata,
        point: &ForkPoint,
        mut metadata: SandboxMetadata,
    ) -> Result<(), ControlError> {
        let forked = self
            .reconciler
            .copy_checkpoint_for_fork(source, point, &metadata.sandbox_id)
            .await?;
        metadata.spec.network = forked.manifest.network;
        metadata.spec.image.clone_from(&source.spec.image);
        metadata.status.phase = Phase::Checkpointed;
        metadata.status.forked_from = Some(ForkOrigin {
            sandbox_id: source.sandbox_id.clone(),
            checkpoint: forked.source_checkpoint,
            name: match point {
                ForkPoint::Latest => None,
                ForkPoint::Named(name) => Some(name.clone()),
            },
        });
        metadata.status.latest_checkpoint = Some(forked.reference);
        tracing::info!(
            fork = %metadata.sandbox_id,
            source = %source.sandbox_id,
            ?point,
            "forking a sandbox"
        );
        self.create(&metadata).await
    }

    /// Asks for `sandbox` to run here, from the checkpoint named `checkpoint`
    /// if given (else the latest).
    pub async fn request_here(
        self: &Arc<Self>,
        sandbox: &SandboxId,
        checkpoint: Option<&str>,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), ControlError> {
        let read = self.read_for_attach(sandbox).await?;
        let read = read.ok_or_else(|| ControlError::NotFound(sandbox.clone()))?;
        self.request_here_from(read, checkpoint, now).await
    }

    /// [`Self::request_here`] from the objects the caller just read (with
    /// [`Self::read_for_attach`]): the spec and the lock are written at
    /// once, each conditional on what was read. A lock nobody holds or
    /// wants is taken in the same write (the intent fulfilled at once: the
    /// pass adopts it); a held lock is left alone and its holder is rung
    /// with the intent.
    ///
    /// A lock taken here while the spec's write is still under way (GCS
    /// holds a write of one object to about one a second, and a client
    /// that attaches right after its checkpoint meets that) does not wait
    /// for it: the pass is primed with the spec as it is being written and
    /// restores at once, while the write goes on (decision 21). The hold is
    /// fenced by the lock alone; should the write fail, the next pass reads
    /// the stored spec and converges to it.
    pub async fn request_here_from(
        self: &Arc<Self>,
        read: AttachRead,
        checkpoint: Option<&str>,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Result<(), ControlError> {
        let sandbox = read.metadata.0.sandbox_id.clone();
        let sandbox = &sandbox;
        let restore_request = checkpoint.map(|name| RestoreRequest {
            checkpoint: name.to_owned(),
            requested_at: now,
        });
        let change = move |spec: &mut SandboxSpec| {
            spec.desired_state = DesiredState::Running;
            if let Some(request) = &restore_request {
                spec.restore_request = Some(request.clone());
            }
        };
        let leases = self.reconciler.leases();
        let me = leases.instance().clone();
        let writing = self.reconciler.writing_intent(sandbox);
        self.reconciler.mark_waiting(sandbox);
        // The spec as read already says so (the usual attach to a running
        // sandbox): the holder may decide on what it knows of it.
        let spec_unchanged = {
            let mut spec = read.metadata.0.spec.clone();
            change(&mut spec);
            spec == read.metadata.0.spec
        };
        let metadata_read = spec_unchanged.then_some(read.metadata.1);
        let free = read.lock.as_ref().is_none_or(|(lease, _)| {
            lease.holder.is_none() && lease.wanted_elsewhere(&me, now).is_none()
        });
        let lock_write = async {
            if free {
                match leases.acquire_from(sandbox, read.lock.clone()).await {
                    Ok(held) => return Ok(Some((held.lease, held.generation))),
                    Err(LeaseError::HeldByOther { .. } | LeaseError::WantedByOther { .. }) => {}
                    Err(err) => return Err(err),
                }
            }
            leases
                .request_attach_from(sandbox, read.lock.clone(), metadata_read)
                .await
                .map(|_| None)
        };
        // This instance is about to hold it: its lease must vouch by then
        // (a no-op when it was renewed lately).
        let lock_and_lease = async {
            let (taken, ensured) = tokio::join!(lock_write, leases.ensure_instance_lease());
            if let Err(err) = ensured {
                tracing::warn!(%sandbox, %err, "cannot renew the instance lease before a start");
            }
            taken
        };
        let spec_write = {
            let this = Arc::clone(self);
            let (sandbox, metadata) = (sandbox.clone(), read.metadata.clone());
            let mut change = change.clone();
            tokio::spawn(async move {
                this.update_spec_from(&sandbox, Some(&metadata), &mut change)
                    .await
            })
        };
        let mut spec_write = spec_write;
        tokio::pin!(lock_and_lease);
        let (spec, taken) = tokio::select! {
            spec = &mut spec_write => (Some(intent_written(spec)), (&mut lock_and_lease).await),
            taken = &mut lock_and_lease => (None, taken),
        };
        let outcome = match (spec, taken) {
            (Some(Ok(written)), Ok(Some(lock))) => {
                self.reconciler.prime(sandbox, written, Some(lock));
                Ok(())
            }
            (Some(Ok(_)), Ok(None)) => Ok(()),
            // A hold taken for a spec that could not be written is released
            // by the pass (an orphan).
            (Some(Err(err)), _) => Err(err),
            (Some(Ok(_)), Err(err)) => Err(err.into()),
            (None, Ok(taken)) => {
                // The lock write landed (the hold taken, or the intent in
                // `wanted_by` and the holder rung); the spec is still on
                // its way to the bucket. Passes count it as written until
                // its write ends (decision 21).
                let ticket = self
                    .reconciler
                    .spec_pending(sandbox, Arc::new(change.clone()));
                if let Some(lock) = taken {
                    let mut intended = read.metadata.clone();
                    change(&mut intended.0.spec);
                    self.reconciler.prime(sandbox, intended, Some(lock));
                }
                drop(writing);
                self.enqueue(sandbox);
                let this = Arc::clone(self);
                let sandbox = sandbox.clone();
                tokio::spawn(async move {
                    let outcome = intent_written(spec_write.await);
                    this.reconciler.spec_written(&sandbox, ticket);
                    if let Err(err) = outcome {
                        tracing::warn!(%sandbox, %err, "the attach intent was not written; the next pass reads the stored spec");
                    }
                    this.enqueue(&sandbox);
                });
                return Ok(());
            }
            (None, Err(err)) => {
                // As when the spec lands first: its outcome, then the lock's.
                intent_written(spec_write.await)?;
                Err(err.into())
            }
        };
        drop(writing);
        self.enqueue(sandbox);
        outcome
    }

    /// Withdraws this instance's wish to run `sandbox` (its client gave up).
    pub async fn withdraw_request(&self, sandbox: &SandboxId) -> Result<(), ControlError> {
        // A hold transferred here after all is then an orphan, released.
        self.reconciler.take_waiting(sandbox);
        self.reconciler.leases().withdraw_attach(sandbox).await?;
        Ok(())
    }

    /// Asks for `sandbox` to be checkpointed (under `name`, if given) or deleted.
    pub async fn request_state(
        &self,
        sandbox: &SandboxId,
        desired: DesiredState,
        checkpoint_name: Option<&str>,
    ) -> Result<(), ControlError> {
        let name = checkpoint_name.map(str::to_owned);
        let change = move |spec: &mut SandboxSpec| {
            spec.desired_state = desired;
            if desired == DesiredState::Checkpointed {
                spec.checkpoint_name.clone_from(&name);
            }
        };
        let writing = self.reconciler.writing_intent(sandbox);
        if desired == DesiredState::Checkpointed
            && let Some(started) = self.checkpoint_while_writing(sandbox, &change)
        {
            drop(writing);
            self.enqueue(sandbox);
            self.finish_checkpoint_intent(sandbox, change, started);
            return Ok(());
        }
        let written = self.update_spec(sandbox, change).await?;
        if let Some(held) = self.reconciler.held(sandbox) {
            // Held here: the pass decides on what was just written and the
            // lock as this instance holds it (a change since fails the
            // precondition of the pass's next write, which then reads it).
            self.reconciler
                .prime(sandbox, written, Some((held.lease, held.generation)));
        }
        drop(writing);
        self.enqueue(sandbox);
        self.ring_holder(sandbox).await;
        Ok(())
    }

    /// A checkpoint of a sandbox held here need not wait for its intent's
    /// write (decision 22): the hold is this instance's, fenced by the
    /// lock, and the checkpoint is acknowledged only once the hand-back
    /// that carries it lands. When this instance knows the stored
    /// metadata, the pass is primed with the change applied and passes
    /// count it as written until the write ends. Returns the pending
    /// write's ticket and the metadata it starts from, or `None` (not held
    /// here, metadata not known: write first).
    fn checkpoint_while_writing(
        &self,
        sandbox: &SandboxId,
        change: &(impl Fn(&mut SandboxSpec) + Clone + Send + Sync + 'static),
    ) -> Option<(u64, ReadMetadata)> {
        let held = self.reconciler.held(sandbox)?;
        let known = self.reconciler.known_metadata(sandbox)?;
        let stored: SandboxMetadata = decode(&known.data)
            .ok()
            .filter(|stored: &SandboxMetadata| !stored.is_deleted())?;
        let mut intended = stored.clone();
        change(&mut intended.spec);
        let ticket = self
            .reconciler
            .spec_pending(sandbox, Arc::new(change.clone()));
        self.reconciler.prime(
            sandbox,
            (intended, known.generation),
            Some((held.lease, held.generation)),
        );
        Some((ticket, (stored, known.generation)))
    }

    /// Writes the checkpoint intent [`Self::checkpoint_while_writing`]
    /// left pending, in a task of its own. Should the write fail before a
    /// pass took the primed change up, whoever waits for the checkpoint is
    /// told so (nothing was checkpointed); a pass that took it up
    /// checkpoints and reports as usual. The write starts from `stored`,
    /// not from what the prime left known here (the change applied, which
    /// would look written already).
    fn finish_checkpoint_intent(
        &self,
        sandbox: &SandboxId,
        change: impl Fn(&mut SandboxSpec) + Send + 'static,
        (ticket, stored): (u64, ReadMetadata),
    ) {
        let Some(this) = self.me.upgrade() else {
            return;
        };
        let sandbox = sandbox.clone();
        drop(self.reconciler.spawn_background(async move {
            let outcome = this.update_spec_from(&sandbox, Some(&stored), change).await;
            this.reconciler.spec_written(&sandbox, ticket);
            if let Err(err) = outcome {
                tracing::warn!(%sandbox, %err, "the checkpoint intent was not written");
                this.reconciler.checkpoint_request_unwritten(&sandbox, &err);
            }
            this.enqueue(&sandbox);
        }));
    }

    /// Rings the doorbell of `sandbox`'s holder when that is another
    /// instance, so an intent written here takes effect there at once.
    /// Failures are logged: the holder's resync catches up.
    async fn ring_holder(&self, sandbox: &SandboxId) {
        if self.is_held_here(sandbox) {
            return;
        }
        let leases = self.reconciler.leases();
        match leases.read(sandbox).await {
            Ok(Some((lease, _))) => leases.ring_holder(sandbox, &lease).await,
            Ok(None) => {}
            Err(err) => tracing::warn!(%sandbox, %err, "cannot read the lock to ring its holder"),
        }
    }

    /// Read-modify-write of the spec under the object's generation,
    /// starting from what this instance last read or wrote of it.
    async fn update_spec(
        &self,
        sandbox: &SandboxId,
        change: impl FnMut(&mut SandboxSpec),
    ) -> Result<ReadMetadata, ControlError> {
        self.update_spec_from(sandbox, None, change).await
    }

    /// [`Self::update_spec`] starting from `read` (else from what this
    /// instance last read or wrote). Returns the metadata as stored after it.
    async fn update_spec_from(
        &self,
        sandbox: &SandboxId,
        read: Option<&ReadMetadata>,
        mut change: impl FnMut(&mut SandboxSpec),
    ) -> Result<ReadMetadata, ControlError> {
        let store = self.reconciler.metadata_store();
        let key = metadata_key(sandbox);
        let _turn = self.reconciler.metadata_write_turn(sandbox).await;
        // The newer of the caller's read and what this instance wrote since
        // (a status write that held the turn before this one): starting
        // from the older costs a refused write and a re-read.
        let written_here = self.reconciler.known_metadata(sandbox);
        let known = match read {
            Some((metadata, generation))
                if written_here
                    .as_ref()
                    .is_none_or(|known| known.generation <= *generation) =>
            {
                Some(crate::store::Versioned {
                    data: encode(metadata),
                    generation: *generation,
                })
            }
            _ => written_here,
        };
        let outcome = read_modify_write_from(store.as_ref(), &key, known, |current| {
            let current = current.ok_or_else(|| ControlError::NotFound(sandbox.clone()))?;
            let mut metadata: SandboxMetadata =
                decode(&current.data).map_err(|err| ReconcileError::Invalid {
                    key: key.to_string(),
                    detail: err.to_string(),
                })?;
            let before = metadata.spec.clone();
            let deleted = metadata.is_deleted();
            change(&mut metadata.spec);
            if metadata.spec == before {
                return Ok(Decision::Keep(metadata));
            }
            if deleted && metadata.spec.desired_state != DesiredState::Deleted {
                // Deletion is final: a checkpoint or attach written after
                // it would bring the sandbox back from its checkpoint.
                return Err(ControlError::Deleted(sandbox.clone()));
            }
            Ok(Decision::Write(encode(&metadata), metadata))
        })
        .await;
        match outcome {
            Ok((metadata, Some(generation))) => {
                self.reconciler
                    .remember_metadata(sandbox, &metadata, generation);
                Ok((metadata, generation))
            }
            Ok((_, None)) => Err(ControlError::NotFound(sandbox.clone())),
            Err(RmwError::Rejected(err)) => Err(err),
            Err(RmwError::Store(err)) => Err(err.into()),
            Err(RmwError::Contended { key, .. }) => Err(ControlError::Contended(key)),
        }
    }

    /// Shutdown: asks for every sandbox held here to be checkpointed (or
    /// deleted, if it cannot be), forcing checkpoints past running executions,
    /// and waits until none is held or `grace` has passed. Returns how many
    /// were still held at the end.
    pub async fn drain(&self, grace: Duration) -> usize {
        self.reconciler.start_draining();
        let deadline = self.reconciler.clock().instant() + grace;
        for sandbox in self.held_sandboxes() {
            let desired = match self.read(&sandbox).await {
                // Being deleted already: its pass finishes that (deletion
                // is final, decision 28).
                Ok(Some(metadata)) if metadata.is_deleted() => {
                    self.enqueue(&sandbox);
                    continue;
                }
                Ok(Some(metadata)) if metadata.spec.enable_checkpoint => DesiredState::Checkpointed,
                _ => DesiredState::Deleted,
            };
            // A client waits for it on another instance: hand it over (the
            // drain forces the checkpoint) rather than overwrite that
            // attach's `running` with `checkpointed`, which would leave it
            // waiting for a start that never comes.
            if desired == DesiredState::Checkpointed && self.wanted_elsewhere(&sandbox).await {
                self.enqueue(&sandbox);
                continue;
            }
            if let Err(err) = self.request_state(&sandbox, desired, None).await {
                tracing::warn!(%sandbox, %err, "cannot ask for the sandbox to stop at shutdown");
            }
        }
        loop {
            let left = self.held_sandboxes().len();
            if left == 0 || self.reconciler.clock().instant() >= deadline {
                // The checkpoints' records still under way land before the
                // process ends (the locks carry them if they cannot).
                let _ =
                    tokio::time::timeout_at(deadline, self.reconciler.background_settled()).await;
                return left;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// True when another instance's live attach intent names `sandbox`.
    async fn wanted_elsewhere(&self, sandbox: &SandboxId) -> bool {
        let leases = self.reconciler.leases();
        match leases.read(sandbox).await {
            Ok(Some((lease, _))) => lease
                .wanted_elsewhere(leases.instance(), self.reconciler.clock().now())
                .is_some(),
            _ => false,
        }
    }
}

/// The outcome of an intent's write that ran in a task of its own.
fn intent_written(
    joined: Result<Result<ReadMetadata, ControlError>, tokio::task::JoinError>,
) -> Result<ReadMetadata, ControlError> {
    joined.unwrap_or_else(|err| {
        Err(ControlError::Internal(format!(
            "the intent's write ended abnormally: {err}"
        )))
    })
}
