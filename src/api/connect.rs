//! `WS /create` and `WS /attach/{id}?sandbox_token=`: the handshakes that end
//! with `SANDBOX_RUNNING` and an attached [`Session`], in the order and with
//! the close codes of `docs/wire-contract.md` §3.1–3.4.
//!
//! Both only write intents (a new `metadata.json`; `desired_state: running`
//! and the lease's `wanted_by`) and wait for the controller's progress. The
//! attach checks the token (hash, constant time) BEFORE anything is restored
//! (upstream restored first, bug B6) and takes the one attach slot before it
//! subscribes to the sandbox's events (a rejected attach steals nothing, B7).

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::ws::{WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use controllers::api::{
    DEFAULT_WORKSPACE_TEMPLATE, DesiredState, SandboxId, SandboxMetadata, WorkspaceSpec,
    is_resource_name,
};
use controllers::sandboxes::{
    AttachRead, ControlError, ForkPoint, SandboxController, SandboxEvent,
};
use tokio::sync::broadcast;
use tracing::Instrument;

use super::admission::{AtCapacity, Claim};
use super::caller::{Caller, CallerQuota, ClientAddr, QuotaExceeded};
use super::events::{NotStarted, await_running};
use super::live::{LiveSandbox, SandboxOptions};
use super::output::ExecutionState;
use super::protocol::{
    ForkRequest, FrameError, InitMessage, MAX_MESSAGE_BYTES, ServerFrame, Status, WorkspaceRequest,
};
use super::session::{
    CLOSE_FATAL, CLOSE_UNAVAILABLE, ClientStream, Out, Session, next_text, refuse_too_big,
};
use super::snapshot_owner::{SnapshotProof, snapshot_token};
use super::state::AppState;
use crate::token;

pub async fn create(
    ws: WebSocketUpgrade,
    headers: axum::http::HeaderMap,
    client: Option<axum::Extension<ClientAddr>>,
    State(state): State<AppState>,
) -> Response {
    let caller = state.callers.caller(&headers, client.as_deref());
    ws.max_message_size(MAX_MESSAGE_BYTES)
        .max_frame_size(MAX_MESSAGE_BYTES)
        .on_upgrade(move |socket| serve_create(socket, state, caller))
}

/// A create counted against its caller's quota; forgotten when dropped
/// unless the sandbox started.
struct Counted {
    quota: Arc<CallerQuota>,
    caller: Caller,
    id: SandboxId,
    started: bool,
}

impl Drop for Counted {
    fn drop(&mut self) {
        if !self.started {
            self.quota.release(&self.caller, &self.id);
        }
    }
}

/// Counts `id`, about to start here, against `caller`'s quota: refused when
/// the caller holds its quota of sandboxes held or live here already.
fn count_against(
    state: &AppState,
    controller: &SandboxController,
    caller: &Caller,
    id: &SandboxId,
) -> Result<Counted, QuotaExceeded> {
    let counted = state
        .callers
        .reserve(caller, id, |held| {
            controller.is_held_here(held) || state.live.get(held).is_some()
        })
        .inspect_err(|refused| {
            tracing::info!(%caller, %refused, sandbox = %id, "start refused: the caller holds its quota");
        })?;
    Ok(Counted {
        quota: Arc::clone(&state.callers),
        caller: caller.clone(),
        id: id.clone(),
        // Counted already: nothing of this start's to take back.
        started: !counted,
    })
}

/// The attach's credential and where the request came from.
#[derive(Debug, Clone)]
struct Credential {
    token: String,
    source: token::TokenSource,
    client: String,
}

pub async fn attach(
    ws: WebSocketUpgrade,
    Path(sandbox_id): Path<String>,
    Query(params): Query<HashMap<String, String>>,
    headers: axum::http::HeaderMap,
    client: Option<axum::Extension<ClientAddr>>,
    State(state): State<AppState>,
) -> Response {
    // The token travels in `X-Sandbox-Token` or (upstream) the query.
    // Upstream rejects the upgrade when it is absent (HTTP 403); a header
    // or parameter present but empty is refused after the upgrade.
    let token = token::of_request(&headers, &params, false);
    let token = match token {
        Some(found) => Some(found),
        None if params.contains_key("sandbox_token") => {
            Some((String::new(), token::TokenSource::Query))
        }
        None => None,
    };
    let Some((token, source)) = token else {
        return (
            StatusCode::FORBIDDEN,
            "the sandbox token is required (X-Sandbox-Token header or sandbox_token query parameter)",
        )
            .into_response();
    };
    let credential = Credential {
        token,
        source,
        client: ClientAddr::describe(client.as_deref()),
    };
    let checkpoint = params.get("checkpoint").cloned();
    let caller = state.callers.caller(&headers, client.as_deref());
    ws.max_message_size(MAX_MESSAGE_BYTES)
        .max_frame_size(MAX_MESSAGE_BYTES)
        .on_upgrade(move |socket| {
            serve_attach(socket, state, sandbox_id, credential, checkpoint, caller)
        })
}

pub(super) fn controller_or_error(state: &AppState) -> Result<Arc<SandboxController>, String> {
    state
        .controller
        .clone()
        .ok_or_else(|| "the sandbox runtime (runsc) is not available on this server".to_owned())
}

async fn serve_create(socket: WebSocket, state: AppState, caller: Caller) {
    let (out, mut stream) = Out::spawn(
        socket,
        state.socket,
        Arc::clone(&state.clock),
        state.early_frames.clone(),
        state.shutdown.subscribe(),
    );
    let limit = state.socket.init_timeout;
    let init = match tokio::time::timeout(limit, next_text(&mut stream)).await {
        Err(_) => {
            let message = format!(
                "no init message within {} s of the connection (--ws-init-timeout-s)",
                limit.as_secs()
            );
            out.error(Status::CreationError, &message).await;
            out.close(CLOSE_FATAL).await;
            return;
        }
        Ok(None) => return,
        Ok(Some(Err(err @ FrameError::MessageTooBig(_)))) => {
            return refuse_too_big(&out, &mut stream, &err).await;
        }
        Ok(Some(text)) => text.and_then(|text| InitMessage::parse(&text)),
    };
    out.status(Status::Creating).await;
    let fail = |message: String| {
        let out = out.clone();
        async move {
            out.error(Status::CreationError, &message).await;
            out.close(CLOSE_FATAL).await;
        }
    };
    let init = match init {
        Ok(init) => init,
        Err(err) => {
            return fail(format!("Invalid init message: {err}")).await;
        }
    };
    if let Err(message) = check_features(&init, &state) {
        return fail(message).await;
    }
    let controller = match controller_or_error(&state) {
        Ok(controller) => controller,
        Err(message) => return fail(message).await,
    };
    let id = SandboxId::random();
    let sandbox_token = token::generate();
    let now = state.clock.now();
    let mut metadata = SandboxMetadata::new(id.clone(), now, token::digest(&sandbox_token));
    metadata.spec.idle_timeout = init.idle_timeout_s;
    metadata.spec.enable_checkpoint = init.enable_checkpoint;
    metadata.spec.enable_sandbox_handoff = init.enable_sandbox_handoff;
    metadata.spec.enable_idle_timeout_auto_checkpoint = init.enable_idle_timeout_auto_checkpoint;
    if let Some(name) = &init.filesystem_snapshot_name {
        metadata.spec.filesystem_snapshot_name =
            Some(snapshot_path(&state, name, init.filesystem_snapshot_proof.as_ref()).await);
    }
    metadata.spec.network = init.network;
    metadata.spec.image = init.image.clone();
    metadata.spec.keep_executions = init.keep_executions;
    metadata.spec.labels = init.labels.clone();
    metadata.spec.workspace = init.workspace.as_ref().map(|request| WorkspaceSpec {
        id: request.id.clone().unwrap_or_else(|| id.to_string()),
        template: request
            .template
            .clone()
            .unwrap_or_else(|| DEFAULT_WORKSPACE_TEMPLATE.to_owned()),
        extra: controllers::api::ExtraFields::new(),
    });

    // What the runtime would refuse is refused before anything is
    // recorded: an unknown image or snapshot leaves no `metadata.json`.
    if init.from_checkpoint.is_none()
        && let Some(runtime) = &state.runtime
    {
        let options = controllers::runtime::CreateOptions {
            snapshot_name: metadata.spec.filesystem_snapshot_name.clone(),
            network: metadata.spec.network,
            image: metadata.spec.image.clone(),
        };
        if let Err(err) = runtime.check_create(&options).await {
            return fail(format!("Failed to create gVisor container {id}: {err}")).await;
        }
    }
    if let (Some(workspace), Some(hooks)) = (&mut metadata.spec.workspace, &state.workspace_hooks) {
        // A named workspace lives under the scope of the token that names
        // it; one named after this sandbox under the sandbox token's.
        let token = init
            .workspace
            .as_ref()
            .and_then(|w| w.token.as_deref())
            .unwrap_or(&sandbox_token);
        match hooks.resolve(&workspace.id, token).await {
            Ok(path) => workspace.id = path,
            Err(message) => {
                return fail(format!("Failed to create gVisor container: {message}")).await;
            }
        }
    }
    let Ok((live, attachment)) = state.live.attach(&id) else {
        return fail(format!("sandbox id {id} is already in use")).await;
    };
    // The caller's quota: what it holds here, and its creates in progress.
    let mut counted = match count_against(&state, &controller, &caller, &id) {
        Ok(counted) => counted,
        Err(refused) => {
            state.live.detach(&live, attachment);
            return fail(format!("Failed to create gVisor container: {refused}")).await;
        }
    };
    let source = match &init.from_checkpoint {
        Some(request) => match fork_source(&controller, request).await {
            Ok(source) => Some(source),
            Err(message) => {
                state.live.detach(&live, attachment);
                return fail(message).await;
            }
        },
        None => None,
    };
    // A fork holds a slot of its own until it runs (or fails).
    let fork_slot = match source.as_ref().map(|_| state.limits.fork_slot()) {
        Some(Err(busy)) => {
            state.live.detach(&live, attachment);
            return fail(format!("Failed to fork: {busy}")).await;
        }
        Some(Ok(slot)) => Some(slot),
        None => None,
    };
    // Its memory is claimed before anything is recorded: a create that
    // does not fit (after the warm pool and idle sandboxes made what room
    // they could) is refused with nothing to undo. The socket is read
    // meanwhile (evictions can take seconds).
    let claim = match stream.while_waiting(admit(&state, &id)).await {
        Ok(claim) => claim,
        Err(refusal) => {
            state.live.detach(&live, attachment);
            return fail(format!("Failed to create gVisor container: {refusal}")).await;
        }
    };
    let mut progress = controller.subscribe(&id);
    let recorded = match &source {
        Some((source, point)) => controller
            .fork(source, point, metadata.clone())
            .await
            .map_err(|err| format!("Failed to fork sandbox {}: {err}", source.sandbox_id)),
        None => controller
            .create(&metadata)
            .await
            .map_err(|err| format!("Failed to create gVisor container: {err}")),
    };
    if let Err(message) = recorded {
        state.live.detach(&live, attachment);
        return fail(message).await;
    }
    // Read meanwhile: the client's pings are answered however long it takes.
    let running = stream
        .while_waiting(await_running(
            &out,
            &mut progress,
            init.enable_sandbox_handoff,
        ))
        .await;
    if let Err(not_started) = running {
        state.live.detach(&live, attachment);
        return fail(not_started.message(&id)).await;
    }
    state
        .live
        .started(&live, SandboxOptions::of(&metadata), &controller);
    // Held here now: the hold counts it.
    drop((claim, fork_slot));
    if source.is_some() {
        // A checkpoint taken with a kept execution resumes it in the fork.
        adopt_resumed_execution(&live, &controller, &id);
    }
    let owner = SnapshotProof::new(snapshot_token(&sandbox_token));
    let sent = out
        .send(ServerFrame::SandboxId {
            sandbox_id: id.to_string(),
            sandbox_token,
        })
        .await
        && out.status(Status::Running).await;
    if !sent {
        // The client left before it learnt the id: nobody can ever attach.
        let _ = controller
            .request_state(&id, DesiredState::Deleted, None)
            .await;
        state.live.detach(&live, attachment);
        return;
    }
    counted.started = true;
    drop(counted);
    tracing::info!(sandbox = %id, "sandbox created");
    run_session(
        state, controller, id, owner, out, stream, live, attachment, progress,
    )
    .await;
}

/// Admits `sandbox` to start here (`None`: admission is off).
pub(super) async fn admit(
    state: &AppState,
    sandbox: &SandboxId,
) -> Result<Option<Claim>, AtCapacity> {
    match &state.admission {
        Some(admission) => admission.admit(sandbox).await.map(Some),
        None => Ok(None),
    }
}

/// Where a create finds snapshot `name`: deployment-wide when snapshots are
/// shared, else under the owner `proof` opens (without one, under nobody's:
/// refused exactly like an unknown name, which is what it is to this client).
/// An owner's proof also opens a snapshot taken before read-only tokens,
/// under the earlier scope, when the current one has no such name.
async fn snapshot_path(state: &AppState, name: &str, proof: Option<&SnapshotProof>) -> String {
    if state.features.shared_snapshots {
        return name.to_owned();
    }
    let proof = proof.cloned().unwrap_or_else(SnapshotProof::nobody);
    let path = proof.path(name);
    let (Some(store), Some(earlier)) = (&state.snapshot_store, proof.earlier_path(name)) else {
        return path;
    };
    let exists = |path: String| async move {
        match controllers::layout::snapshot_manifest_key(&path) {
            Some(key) => !matches!(
                store.get(&key).await,
                Err(controllers::store::StoreError::NotFound { .. })
            ),
            None => false,
        }
    };
    if !exists(path.clone()).await && exists(earlier.clone()).await {
        return earlier;
    }
    path
}

/// The sandbox a fork starts from, once its token is proved, and which of
/// its checkpoints. An unknown id, a wrong token and a deleted sandbox get
/// the same answer: a fork request reveals nothing about sandboxes whose
/// token the client does not have.
async fn fork_source(
    controller: &SandboxController,
    request: &ForkRequest,
) -> Result<(SandboxMetadata, ForkPoint), String> {
    let refused = || {
        format!(
            "Failed to fork: no sandbox {:?} with that sandbox_token",
            request.sandbox_id
        )
    };
    let Ok(source_id) = SandboxId::parse(&request.sandbox_id) else {
        return Err(refused());
    };
    let source = match controller.read_with_carried(&source_id).await {
        Ok(Some(source)) => source,
        Ok(None) => return Err(refused()),
        Err(err) => return Err(format!("Failed to fork sandbox {source_id}: {err}")),
    };
    if !token::matches(&request.sandbox_token, &source.spec.token_sha256) || source.is_deleted() {
        return Err(refused());
    }
    let point = match &request.name {
        Some(name) => ForkPoint::Named(name.clone()),
        None => ForkPoint::Latest,
    };
    Ok((source, point))
}

/// The init message's feature checks, with upstream's messages.
fn check_features(init: &InitMessage, state: &AppState) -> Result<(), String> {
    if init.enable_checkpoint && !state.features.checkpoint {
        return Err("Checkpointing is not enabled on the server.".to_owned());
    }
    if let Some(name) = &init.filesystem_snapshot_name {
        if !state.features.snapshot {
            return Err("Filesystem snapshot is not enabled on the server.".to_owned());
        }
        if !is_resource_name(name) {
            return Err(format!(
                "Failed to create gVisor container: invalid filesystem snapshot name {name:?}: {}",
                controllers::api::RESOURCE_NAME_RULE
            ));
        }
    }
    if let Some(image) = &init.image
        && !controllers::api::is_image_name(image)
        && !controllers::api::is_digest(image)
    {
        return Err(format!(
            "Failed to create gVisor container: invalid image name {image:?}: {}",
            controllers::api::IMAGE_NAME_RULE
        ));
    }
    if init.network == controllers::api::NetworkMode::Egress && !state.features.network_egress {
        return Err(
            "Network mode egress is not enabled on the server (SANDBOXD_NETWORK_MODES).".to_owned(),
        );
    }
    if let Some(workspace) = &init.workspace {
        check_workspace(workspace, state)?;
    }
    if init.from_checkpoint.is_some() {
        if !state.features.checkpoint {
            return Err("Checkpointing is not enabled on the server.".to_owned());
        }
        // A fork runs on the image, files and network of its checkpoint.
        if init.image.is_some() || init.filesystem_snapshot_name.is_some() {
            return Err(
                "from_checkpoint cannot be combined with image or filesystem_snapshot_name: \
                 a fork runs on its checkpoint's image and files"
                    .to_owned(),
            );
        }
    }
    if init.enable_sandbox_handoff && !init.enable_checkpoint {
        return Err("Sandbox handoff requires checkpointing to be enabled.".to_owned());
    }
    if init.keep_executions && !init.enable_checkpoint {
        return Err(
            "Keeping executions (keep_executions) requires checkpointing to be enabled.".to_owned(),
        );
    }
    if init.enable_idle_timeout_auto_checkpoint && !init.enable_checkpoint {
        return Err(
            "Idle timeout auto checkpoint requires checkpointing to be enabled.".to_owned(),
        );
    }
    Ok(())
}

/// A workspace the server can sync, under a template it knows.
fn check_workspace(request: &WorkspaceRequest, state: &AppState) -> Result<(), String> {
    let Some(hooks) = &state.workspace_hooks else {
        return Err("Workspace sync is not enabled on the server.".to_owned());
    };
    if let Some(id) = &request.id
        && !is_resource_name(id)
    {
        return Err(format!(
            "Failed to create gVisor container: invalid workspace_id {id:?}: {}",
            controllers::api::RESOURCE_NAME_RULE
        ));
    }
    if let Some(template) = &request.template
        && !hooks.has_template(template)
    {
        return Err(format!(
            "Failed to create gVisor container: unknown workspace_template {template:?}"
        ));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments, reason = "the parts of one handshake")]
async fn run_session(
    state: AppState,
    controller: Arc<SandboxController>,
    id: SandboxId,
    owner: SnapshotProof,
    out: Out,
    stream: ClientStream,
    live: Arc<LiveSandbox>,
    attachment: u64,
    progress: broadcast::Receiver<SandboxEvent>,
) {
    let session = Session::new(
        id,
        out,
        live,
        attachment,
        controller,
        state.features,
        owner,
        state.snapshot_store.clone(),
    );
    let span =
        tracing::info_span!("session", sandbox = %session.id, attachment = session.attachment);
    session
        .run(stream, progress, Arc::clone(&state.live))
        .instrument(span)
        .await;
}

async fn serve_attach(
    socket: WebSocket,
    state: AppState,
    raw_id: String,
    credential: Credential,
    checkpoint: Option<String>,
    caller: Caller,
) {
    let token = credential.token;
    let (out, mut stream) = Out::spawn(
        socket,
        state.socket,
        Arc::clone(&state.clock),
        state.early_frames.clone(),
        state.shutdown.subscribe(),
    );
    let fatal = |status: Status, message: String| {
        let out = out.clone();
        async move {
            out.error(status, &message).await;
            out.close(CLOSE_FATAL).await;
        }
    };
    let not_found = || {
        let out = out.clone();
        async move {
            out.status(Status::NotFound).await;
            out.close(CLOSE_UNAVAILABLE).await;
        }
    };
    if token.is_empty() {
        return fatal(
            Status::PermissionDenialError,
            "Sandbox token is missing.".to_owned(),
        )
        .await;
    }
    // An id that is not ours cannot exist: never let it near a key or path.
    let Ok(id) = SandboxId::parse(&raw_id) else {
        return not_found().await;
    };
    let controller = match controller_or_error(&state) {
        Ok(controller) => controller,
        Err(message) => return fatal(Status::Error, message).await,
    };
    // Metadata and lock at once: an attach that moves the sandbox here
    // writes both next, conditional on what it read here.
    let read = match controller.read_for_attach(&id).await {
        Ok(Some(read)) => read,
        Ok(None) => return not_found().await,
        Err(err) => {
            return fatal(
                Status::RestoreError,
                format!("Failed to restore sandbox {id}: {err}"),
            )
            .await;
        }
    };
    let metadata = read.metadata.0.clone();
    if !token::matches(&token, &metadata.spec.token_sha256) {
        tracing::warn!(
            sandbox = %id,
            source = %credential.source,
            client = %credential.client,
            "refused an attach: wrong sandbox token"
        );
        // Answered as an unknown id: a wrong token learns nothing about
        // which ids exist (docs/security.md).
        return not_found().await;
    }
    if metadata.is_deleted() {
        return not_found().await;
    }
    if let Some(name) = &checkpoint
        && !is_resource_name(name)
    {
        return fatal(
            Status::RestoreError,
            format!(
                "Failed to restore sandbox {id}: invalid checkpoint name {name:?}: {}",
                controllers::api::RESOURCE_NAME_RULE
            ),
        )
        .await;
    }
    let Ok((live, attachment)) = state.live.attach(&id) else {
        out.status(Status::InUse).await;
        out.close(CLOSE_UNAVAILABLE).await;
        return;
    };
    let mut progress = controller.subscribe(&id);
    let runs_here = controller.is_held_here(&id) && checkpoint.is_none();
    if !runs_here && !metadata.spec.enable_checkpoint {
        // It cannot move here: to this instance it does not exist (upstream).
        state.live.detach(&live, attachment);
        return not_found().await;
    }
    // Read meanwhile: the client's pings are answered however long the
    // restore (or a holder's checkpoint before it) takes.
    if !runs_here
        && let Err(refused) = stream
            .while_waiting(restore(
                &state,
                &controller,
                &out,
                &mut progress,
                read,
                checkpoint.as_deref(),
                &caller,
            ))
            .await
    {
        state.live.detach(&live, attachment);
        return fatal(Status::RestoreError, refused.message(&id)).await;
    }
    state
        .live
        .started(&live, SandboxOptions::of(&metadata), &controller);
    adopt_resumed_execution(&live, &controller, &id);
    if !out.status(Status::Running).await {
        state.live.detach(&live, attachment);
        return;
    }
    tracing::info!(sandbox = %id, restored = !runs_here, "attached");
    let owner = SnapshotProof::new(snapshot_token(&token));
    run_session(
        state, controller, id, owner, out, stream, live, attachment, progress,
    )
    .await;
}

/// Makes the execution a restore brought back with the sandbox (created with
/// `keep_executions`, decision 12) its current one, so `reconnect` streams it.
/// Every path that restores a checkpoint for a client calls this once the
/// sandbox runs here; an execution nobody adopts keeps the slot until it ends.
pub(super) fn adopt_resumed_execution(
    live: &Arc<LiveSandbox>,
    controller: &Arc<SandboxController>,
    id: &SandboxId,
) {
    if let Some(execution) = controller.take_resumed(id) {
        let (touched, poked, sandbox) = (Arc::clone(live), Arc::clone(controller), id.clone());
        let clock = Arc::clone(live.clock());
        live.adopt_execution(ExecutionState::start(execution, clock, move || {
            touched.touch();
            poked.poke(&sandbox);
        }));
    }
}

/// Why an attach could not bring the sandbox here.
#[derive(Debug)]
pub(super) enum RestoreRefused {
    /// It runs here and a named checkpoint was asked for.
    RunningHere,
    CheckpointingDisabled,
    /// This instance has no room for it.
    AtCapacity(AtCapacity),
    /// Its caller holds its quota of sandboxes here.
    Quota(QuotaExceeded),
    /// The intent could not be written.
    Request(ControlError),
    NotStarted(NotStarted),
}

impl RestoreRefused {
    /// The message of `SANDBOX_RESTORE_ERROR`.
    pub(super) fn message(&self, id: &SandboxId) -> String {
        let failed =
            |detail: &dyn std::fmt::Display| format!("Failed to restore sandbox {id}: {detail}");
        match self {
            Self::RunningHere => {
                failed(&"it is running; checkpoint it before restoring a named checkpoint")
            }
            Self::CheckpointingDisabled => failed(&"checkpointing is not enabled on this server"),
            Self::AtCapacity(refusal) => failed(refusal),
            Self::Quota(refusal) => failed(refusal),
            Self::Request(err) => failed(err),
            Self::NotStarted(not_started) => not_started.restore_message(id),
        }
    }
}

/// Asks for the sandbox here and waits until it runs. It counts against
/// `caller`'s quota of sandboxes here as a create does: a caller cannot
/// fill an instance by restoring what it checkpointed.
pub(super) async fn restore(
    state: &AppState,
    controller: &Arc<SandboxController>,
    out: &Out,
    events: &mut broadcast::Receiver<SandboxEvent>,
    read: AttachRead,
    checkpoint: Option<&str>,
    caller: &Caller,
) -> Result<(), RestoreRefused> {
    let id = &read.metadata.0.sandbox_id.clone();
    let handoff = read.metadata.0.spec.enable_sandbox_handoff;
    if controller.is_held_here(id) {
        // A named checkpoint replaces the running sandbox: checkpoint the
        // current state first, like any other move.
        return Err(RestoreRefused::RunningHere);
    }
    if !state.features.checkpoint {
        return Err(RestoreRefused::CheckpointingDisabled);
    }
    out.status(Status::Restoring).await;
    let mut counted =
        count_against(state, controller, caller, id).map_err(RestoreRefused::Quota)?;
    // Claimed until it runs here (then its hold counts it).
    let _claim = admit(state, id).await.map_err(RestoreRefused::AtCapacity)?;
    controller
        .request_here_from(read, checkpoint, state.clock.now())
        .await
        .map_err(RestoreRefused::Request)?;
    // Asked for: it comes here whether this wait ends or is cancelled (its
    // client left), so it stays counted; one that never comes is forgotten
    // by the caller's next count (`CallerQuota::reserve`).
    counted.started = true;
    match await_running(out, events, handoff).await {
        Ok(()) => Ok(()),
        Err(not_started) => {
            let _ = controller.withdraw_request(id).await;
            Err(RestoreRefused::NotStarted(not_started))
        }
    }
}
