//! The API layer's view of the sandboxes this instance serves: who is attached
//! (one socket per sandbox), the current execution and its output, and the
//! idle timer. None of it is durable: it is rebuilt when a sandbox starts here.
//!
//! The idle timer counts from the last client activity or the end of the last
//! execution, never runs out while an execution runs (upstream counted only
//! from create/attach, bug B1), and on expiry writes an intent (checkpointed or
//! deleted) for the controller to carry out.
//!
//! Two limits keep a sandbox from holding its slot forever
//! ([`Lifetimes`]): an execution that runs with no client attached for
//! `max_detached_execution` is killed (a client that walked away from
//! `sleep 100000`), and a sandbox that has run here for `max_lifetime` in
//! one go (also with `idle_timeout: 0`) is checkpointed if it allows
//! checkpoints (it restores at its next attach) and deleted otherwise.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use controllers::api::{DesiredState, SandboxId, SandboxMetadata};
use controllers::clock::Clock;
use controllers::sandboxes::{ControlError, SandboxController, SandboxEvent};
use tokio::sync::broadcast;
use tokio::time::Instant;

use super::output::ExecutionState;

/// What the idle watcher needs of the controller (the unit tests stand in
/// for it to send events at chosen moments).
#[async_trait]
pub trait Lifecycle: Send + Sync + 'static {
    fn subscribe(&self, sandbox: &SandboxId) -> broadcast::Receiver<SandboxEvent>;
    fn is_held_here(&self, sandbox: &SandboxId) -> bool;
    async fn request_state(
        &self,
        sandbox: &SandboxId,
        desired: DesiredState,
    ) -> Result<(), ControlError>;
}

#[async_trait]
impl Lifecycle for SandboxController {
    fn subscribe(&self, sandbox: &SandboxId) -> broadcast::Receiver<SandboxEvent> {
        SandboxController::subscribe(self, sandbox)
    }

    fn is_held_here(&self, sandbox: &SandboxId) -> bool {
        SandboxController::is_held_here(self, sandbox)
    }

    async fn request_state(
        &self,
        sandbox: &SandboxId,
        desired: DesiredState,
    ) -> Result<(), ControlError> {
        SandboxController::request_state(self, sandbox, desired, None).await
    }
}

/// Default of [`Lifetimes::max_lifetime`]: 24 hours.
pub const DEFAULT_MAX_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// Default of [`Lifetimes::max_detached_execution`]: 1 hour.
pub const DEFAULT_MAX_DETACHED_EXECUTION: Duration = Duration::from_secs(3600);

/// How long a sandbox may hold its place here (`--max-sandbox-lifetime-s`,
/// `--max-detached-execution-s`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lifetimes {
    /// Running here in one go (from its start or restore here).
    pub max_lifetime: Duration,
    /// An execution running with no client attached.
    pub max_detached_execution: Duration,
}

impl Default for Lifetimes {
    fn default() -> Self {
        Self {
            max_lifetime: DEFAULT_MAX_LIFETIME,
            max_detached_execution: DEFAULT_MAX_DETACHED_EXECUTION,
        }
    }
}

/// What the session needs to know about the sandbox's options.
#[derive(Debug, Clone, Default)]
pub struct SandboxOptions {
    pub idle_timeout: Option<Duration>,
    pub enable_checkpoint: bool,
    pub auto_checkpoint: bool,
    pub handoff: bool,
    /// Executions move with the sandbox instead of being killed.
    pub keep_executions: bool,
}

impl SandboxOptions {
    pub fn of(metadata: &SandboxMetadata) -> Self {
        Self {
            idle_timeout: metadata.spec.idle_timeout.map(Duration::from_secs),
            enable_checkpoint: metadata.spec.enable_checkpoint,
            auto_checkpoint: metadata.spec.enable_idle_timeout_auto_checkpoint,
            handoff: metadata.spec.enable_sandbox_handoff,
            keep_executions: metadata.spec.keep_executions,
        }
    }
}

#[derive(Debug)]
struct Inner {
    attached: Option<u64>,
    execution: Option<Arc<ExecutionState>>,
    last_activity: Instant,
    options: SandboxOptions,
    started: bool,
    /// When this hold began (the sandbox started or was restored here).
    hold_began: Instant,
    /// When the last client detached (`None` while one is attached).
    detached_since: Option<Instant>,
}

/// One sandbox served by this instance.
#[derive(Debug)]
pub struct LiveSandbox {
    pub id: SandboxId,
    /// The instance's clock: the idle timer and the lifetimes run on it.
    clock: Arc<dyn Clock>,
    inner: Mutex<Inner>,
    /// Told when the last client detaches: the watcher's deadlines change.
    detached: tokio::sync::Notify,
}

impl LiveSandbox {
    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn options(&self) -> SandboxOptions {
        self.inner().options.clone()
    }

    /// The instance's clock (an execution's deadlines run on it too).
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    fn now(&self) -> Instant {
        self.clock.instant()
    }

    /// Records client activity (resets the idle timer).
    pub fn touch(&self) {
        let now = self.now();
        self.inner().last_activity = now;
    }

    /// The current (or last) execution.
    pub fn execution(&self) -> Option<Arc<ExecutionState>> {
        self.inner().execution.clone()
    }

    pub fn execution_running(&self) -> bool {
        self.inner()
            .execution
            .as_ref()
            .is_some_and(|execution| execution.is_running())
    }

    /// Makes `execution`, which the runtime just started, the current one.
    /// The runtime runs one execution at a time and freed its slot when the
    /// previous one exited; that one's end may still be on its way into its
    /// log (its exit held back until the hold is vouched for, say): it is
    /// waited for, [`PREVIOUS_END_WAIT`] at most, so its DONE is not cut off.
    pub async fn begin_execution(&self, execution: Arc<ExecutionState>) {
        let previous = self.inner().execution.clone();
        if let Some(previous) = previous {
            let _ = tokio::time::timeout(PREVIOUS_END_WAIT, previous.ended()).await;
        }
        self.adopt_execution(execution);
    }

    /// Makes `execution` (one that moved here with the sandbox) the current one.
    pub fn adopt_execution(&self, execution: Arc<ExecutionState>) {
        let mut inner = self.inner();
        inner.execution = Some(execution);
        inner.last_activity = self.now();
    }

    /// True while a socket is attached.
    pub fn is_attached(&self) -> bool {
        self.inner().attached.is_some()
    }

    /// True while `attachment` is the attached socket.
    pub fn is_attached_by(&self, attachment: u64) -> bool {
        self.inner().attached == Some(attachment)
    }

    /// The sandbox as admission's eviction sees it; `None` until it runs here.
    pub fn candidate(&self) -> Option<crate::api::admission::Candidate> {
        let inner = self.inner();
        inner.started.then(|| crate::api::admission::Candidate {
            id: self.id.clone(),
            attached: inner.attached.is_some(),
            executing: inner.execution.as_ref().is_some_and(|e| e.is_running()),
            checkpointable: inner.options.enable_checkpoint,
            last_activity: inner.last_activity,
        })
    }
}

/// How long a new execution waits for the previous one's end to reach its
/// log ([`LiveSandbox::begin_execution`]).
const PREVIOUS_END_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Every sandbox served here, by id.
///
/// Not in the controllers' per-sandbox slot (`reconciler/slots.rs`): this
/// is the API layer's own state (a socket's attach slot, the execution it
/// streams, the idle timer), and the API reaches the controllers only
/// through `SandboxController`, which knows nothing of sockets and lends
/// out no slot. One map for the API, as the slots are one for the
/// controllers and `gvisor/local.rs` one for the runtime.
#[derive(Debug)]
pub struct LiveSandboxes {
    sandboxes: Mutex<HashMap<SandboxId, Arc<LiveSandbox>>>,
    next_attachment: AtomicU64,
    lifetimes: Lifetimes,
    clock: Arc<dyn Clock>,
}

/// Why an attach was refused.
#[derive(Debug, PartialEq, Eq)]
pub struct InUse;

impl LiveSandboxes {
    fn map(&self) -> MutexGuard<'_, HashMap<SandboxId, Arc<LiveSandbox>>> {
        self.sandboxes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A registry whose sandboxes live at most `lifetimes`, timed by
    /// `clock`.
    pub fn new(lifetimes: Lifetimes, clock: Arc<dyn Clock>) -> Self {
        Self {
            sandboxes: Mutex::default(),
            next_attachment: AtomicU64::new(0),
            lifetimes,
            clock,
        }
    }

    pub fn get(&self, id: &SandboxId) -> Option<Arc<LiveSandbox>> {
        self.map().get(id).cloned()
    }

    /// Makes `attachment`'s socket the only one attached to `id` (creating the
    /// entry if needed), or refuses if another socket is attached.
    pub fn attach(&self, id: &SandboxId) -> Result<(Arc<LiveSandbox>, u64), InUse> {
        let attachment = self.next_attachment.fetch_add(1, Ordering::Relaxed) + 1;
        let mut map = self.map();
        let now = self.clock.instant();
        let live = map.entry(id.clone()).or_insert_with(|| {
            Arc::new(LiveSandbox {
                id: id.clone(),
                clock: Arc::clone(&self.clock),
                detached: tokio::sync::Notify::new(),
                inner: Mutex::new(Inner {
                    attached: None,
                    execution: None,
                    last_activity: now,
                    options: SandboxOptions::default(),
                    started: false,
                    hold_began: now,
                    detached_since: None,
                }),
            })
        });
        let mut inner = live.inner();
        if inner.attached.is_some() {
            return Err(InUse);
        }
        inner.attached = Some(attachment);
        inner.last_activity = now;
        inner.detached_since = None;
        drop(inner);
        Ok((Arc::clone(live), attachment))
    }

    /// Detaches `attachment`; forgets the entry if the sandbox never started
    /// here (a failed restore or create).
    pub fn detach(&self, live: &LiveSandbox, attachment: u64) {
        let mut map = self.map();
        let mut inner = live.inner();
        let now = self.clock.instant();
        if inner.attached == Some(attachment) {
            inner.attached = None;
            inner.last_activity = now;
            inner.detached_since = Some(now);
            live.detached.notify_one();
        }
        if !inner.started && inner.attached.is_none() {
            drop(inner);
            if map
                .get(&live.id)
                .is_some_and(|l| std::ptr::eq(l.as_ref(), live))
            {
                map.remove(&live.id);
            }
        }
    }

    /// Marks the sandbox as running here with `options`, and starts the task
    /// that expires it when idle and forgets it when it leaves this instance.
    pub fn started<C: Lifecycle>(
        self: &Arc<Self>,
        live: &Arc<LiveSandbox>,
        options: SandboxOptions,
        controller: &Arc<C>,
    ) {
        {
            let mut inner = live.inner();
            if inner.started {
                inner.options = options;
                return;
            }
            let now = live.now();
            inner.started = true;
            inner.options = options;
            inner.last_activity = now;
            inner.hold_began = now;
        }
        // Subscribe before anything can happen to the sandbox: a `Deleted`
        // sent before the watcher's first poll would otherwise be missed and
        // the entry kept forever.
        let progress = controller.subscribe(&live.id);
        let registry = Arc::clone(self);
        let live = Arc::clone(live);
        let controller = Arc::clone(controller);
        tokio::spawn(async move { registry.watch(live, controller, progress).await });
    }

    /// Runs while the sandbox is here: expires it when idle, forgets it when
    /// it is checkpointed, deleted or lost.
    async fn watch<C: Lifecycle>(
        &self,
        live: Arc<LiveSandbox>,
        controller: Arc<C>,
        mut events: broadcast::Receiver<SandboxEvent>,
    ) {
        let mut expired = false;
        let mut recheck: Option<Instant> = None;
        let lifetimes = self.lifetimes;
        loop {
            let (deadline, limit) = {
                let inner = live.inner();
                let idle = inner
                    .options
                    .idle_timeout
                    // Checked: an overflowing deadline (a timeout beyond
                    // what `Instant` holds) means never, not a panic.
                    .and_then(|timeout| inner.last_activity.checked_add(timeout));
                let lifetime = inner.hold_began.checked_add(lifetimes.max_lifetime);
                let detached = inner
                    .detached_since
                    .filter(|_| inner.execution.as_ref().is_some_and(|e| e.is_running()))
                    .and_then(|since| since.checked_add(lifetimes.max_detached_execution));
                (idle, earliest(lifetime, detached))
            };
            let wake = earliest(
                earliest(deadline.filter(|_| !expired), recheck),
                limit.filter(|_| !expired),
            );
            let sleep = async {
                match wake {
                    Some(wake) => tokio::time::sleep_until(wake).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                // A client left: the detached limit may now apply.
                () = live.detached.notified() => {}
                event = events.recv() => match event {
                    // A late event of a hold that ended while a new one
                    // began here (an attach right after the checkpoint
                    // restored the sandbox onto this very entry): the new
                    // hold is watched on.
                    Ok(event) if event.ends_hold() => {
                        if self.hold_ended(&live, || controller.is_held_here(&live.id)) {
                            return;
                        }
                        expired = false;
                        // Or the event came just before the hold was
                        // forgotten (a loss is told first): look again.
                        recheck = live.now().checked_add(Duration::from_secs(1));
                    }
                    Ok(_) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                        self.hold_ended(&live, || false);
                        return;
                    }
                },
                () = sleep => {
                    recheck = None;
                    if !controller.is_held_here(&live.id)
                        && self.hold_ended(&live, || controller.is_held_here(&live.id))
                    {
                        return;
                    }
                    if expired {
                        continue;
                    }
                    if let Some(desired) = self.past_limits(&live).await {
                        match controller.request_state(&live.id, desired).await {
                            Ok(()) => expired = true,
                            Err(err) => {
                                tracing::warn!(sandbox = %live.id, %err, "cannot end a sandbox past its lifetime; retrying");
                                tokio::time::sleep(Duration::from_secs(5)).await;
                            }
                        }
                        continue;
                    }
                    let (idle_for, running, options) = {
                        let now = live.now();
                        let inner = live.inner();
                        (now.saturating_duration_since(inner.last_activity), inner.execution.as_ref().is_some_and(|e| e.is_running()), inner.options.clone())
                    };
                    let Some(timeout) = options.idle_timeout else { continue };
                    if running {
                        // Never expire under a running execution; its end counts as activity.
                        live.touch();
                        continue;
                    }
                    if idle_for < timeout {
                        continue;
                    }
                    let desired = if options.auto_checkpoint && options.enable_checkpoint {
                        DesiredState::Checkpointed
                    } else {
                        DesiredState::Deleted
                    };
                    tracing::info!(sandbox = %live.id, ?desired, idle_s = idle_for.as_secs(), "idle timeout");
                    match controller.request_state(&live.id, desired).await {
                        Ok(()) => expired = true,
                        Err(err) => {
                            tracing::warn!(sandbox = %live.id, %err, "cannot record the idle timeout; retrying");
                            tokio::time::sleep(Duration::from_secs(5)).await;
                        }
                    }
                }
            }
        }
    }

    /// Applies the lifetimes: kills an execution that ran detached too
    /// long (the sandbox stays); the state to ask for when the sandbox has
    /// run here too long (checkpointed if it allows it, else deleted).
    async fn past_limits(&self, live: &LiveSandbox) -> Option<DesiredState> {
        let lifetimes = self.lifetimes;
        let (held_for, detached_for, execution, options) = {
            let now = live.now();
            let inner = live.inner();
            (
                now.saturating_duration_since(inner.hold_began),
                inner
                    .detached_since
                    .map(|since| now.saturating_duration_since(since)),
                inner.execution.clone().filter(|e| e.is_running()),
                inner.options.clone(),
            )
        };
        if held_for >= lifetimes.max_lifetime {
            let desired = if options.enable_checkpoint {
                DesiredState::Checkpointed
            } else {
                DesiredState::Deleted
            };
            tracing::info!(
                sandbox = %live.id,
                ?desired,
                held_s = held_for.as_secs(),
                "the sandbox ran for its maximum lifetime here (--max-sandbox-lifetime-s)"
            );
            return Some(desired);
        }
        if let (Some(detached_for), Some(execution)) = (detached_for, execution)
            && detached_for >= lifetimes.max_detached_execution
        {
            tracing::info!(
                sandbox = %live.id,
                detached_s = detached_for.as_secs(),
                "killing an execution that ran with no client attached for the most allowed (--max-detached-execution-s)"
            );
            execution.kill().await;
            live.touch();
            // The next detached limit counts from now (the kill may take a
            // moment to end the execution).
            let mut inner = live.inner();
            if inner.detached_since.is_some() {
                inner.detached_since = Some(live.now());
            }
        }
        None
    }

    /// The sandbox's hold here ended, unless `held_here` says a new one
    /// began (checked under the entry's lock, so an attach's
    /// [`Self::started`] either sees the entry stopped and watches the new
    /// hold itself, or is already watched here). A stopped entry is
    /// forgotten once no socket is attached to it; an attached one stays
    /// (a new attach may have taken it: another attach is refused as in use
    /// until it detaches, which forgets it). True when the hold ended.
    fn hold_ended(&self, live: &LiveSandbox, held_here: impl FnOnce() -> bool) -> bool {
        let mut map = self.map();
        let mut inner = live.inner();
        if held_here() {
            return false;
        }
        inner.started = false;
        if inner.attached.is_none()
            && map
                .get(&live.id)
                .is_some_and(|l| std::ptr::eq(l.as_ref(), live))
        {
            map.remove(&live.id);
        }
        true
    }
}

/// The earlier of two optional instants.
fn earliest(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A controller whose events the test sends itself.
    struct Events(
        broadcast::Sender<SandboxEvent>,
        std::sync::atomic::AtomicBool,
    );

    impl Events {
        fn new() -> Self {
            Self(
                broadcast::channel(16).0,
                std::sync::atomic::AtomicBool::new(true),
            )
        }

        /// The hold ends: no longer held here, then `event`.
        fn end_hold(&self, event: SandboxEvent) {
            self.1.store(false, Ordering::Release);
            self.0.send(event).ok();
        }
    }

    #[async_trait]
    impl Lifecycle for Events {
        fn subscribe(&self, _sandbox: &SandboxId) -> broadcast::Receiver<SandboxEvent> {
            self.0.subscribe()
        }
        fn is_held_here(&self, _sandbox: &SandboxId) -> bool {
            self.1.load(Ordering::Acquire)
        }
        async fn request_state(
            &self,
            _sandbox: &SandboxId,
            _desired: DesiredState,
        ) -> Result<(), ControlError> {
            Ok(())
        }
    }

    /// A `Deleted` sent right after the sandbox is marked started, before
    /// the watcher task first runs, still ends the watch and forgets the
    /// sandbox (the watcher used to subscribe inside its task and miss it).
    #[tokio::test(flavor = "current_thread")]
    async fn the_idle_watcher_sees_a_deleted_sent_before_it_first_runs() {
        let registry = Arc::new(LiveSandboxes::new(
            Lifetimes::default(),
            Arc::new(controllers::clock::SystemClock),
        ));
        let id = SandboxId::random();
        let (live, attachment) = registry.attach(&id).unwrap();
        let controller = Arc::new(Events::new());
        registry.started(&live, SandboxOptions::default(), &controller);
        // Nothing has yielded yet: the watcher task has not run.
        controller.end_hold(SandboxEvent::Deleted);
        registry.detach(&live, attachment);
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(
            registry.get(&id).is_none(),
            "the watcher missed the Deleted and keeps the sandbox forever"
        );
    }

    /// An idle timeout beyond what `Instant` holds (an operator's
    /// or an older server's `idle_timeout`) panicked the watcher, which then
    /// never expired or forgot the sandbox. It now means "never expires" and
    /// the watcher still ends on `Deleted`.
    #[tokio::test(flavor = "current_thread")]
    async fn an_idle_timeout_too_large_for_the_clock_does_not_kill_the_watcher() {
        let registry = Arc::new(LiveSandboxes::new(
            Lifetimes::default(),
            Arc::new(controllers::clock::SystemClock),
        ));
        let id = SandboxId::random();
        let (live, attachment) = registry.attach(&id).unwrap();
        let controller = Arc::new(Events::new());
        let options = SandboxOptions {
            idle_timeout: Some(Duration::from_secs(u64::MAX)),
            ..SandboxOptions::default()
        };
        registry.started(&live, options, &controller);
        registry.detach(&live, attachment);
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        controller.end_hold(SandboxEvent::Deleted);
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(
            registry.get(&id).is_none(),
            "the watcher died on the idle deadline and keeps the sandbox forever"
        );
    }
    async fn settle() {
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
    }

    /// The race behind the test clients' `SendAfterClosing`: a client
    /// attached right after its checkpoint closed the socket, and the
    /// restore took the entry before the watcher read the `Checkpointed`.
    /// The watcher then forgot the entry the new session was attached to,
    /// and nothing watched the new hold: a second attach was let in beside
    /// the first. It now watches the new hold, and the entry stays.
    #[tokio::test(flavor = "current_thread")]
    async fn a_hold_that_ends_while_an_attach_restores_onto_the_entry_is_watched_on() {
        let registry = Arc::new(LiveSandboxes::new(
            Lifetimes::default(),
            Arc::new(controllers::clock::SystemClock),
        ));
        let id = SandboxId::random();
        let controller = Arc::new(Events::new());
        let (live, first) = registry.attach(&id).unwrap();
        registry.started(&live, SandboxOptions::default(), &controller);
        settle().await;

        // Restored before the watcher reads the end of the old hold.
        controller.end_hold(SandboxEvent::Checkpointed { image: "i".into() });
        registry.detach(&live, first);
        let (again, second) = registry.attach(&id).unwrap();
        assert!(Arc::ptr_eq(&live, &again));
        controller.1.store(true, Ordering::Release);
        registry.started(&again, SandboxOptions::default(), &controller);
        settle().await;
        assert_eq!(registry.attach(&id).err(), Some(InUse));

        // The new hold ends: forgotten once its socket goes.
        controller.end_hold(SandboxEvent::Deleted);
        settle().await;
        registry.detach(&again, second);
        assert!(registry.get(&id).is_none());

        // Restoring when the watcher reads the end: the entry stays
        // (attached), and the attach's start watches the new hold.
        let (live, first) = registry.attach(&id).unwrap();
        controller.1.store(true, Ordering::Release);
        registry.started(&live, SandboxOptions::default(), &controller);
        settle().await;
        controller.end_hold(SandboxEvent::Checkpointed { image: "i".into() });
        registry.detach(&live, first);
        let (again, second) = registry.attach(&id).unwrap();
        settle().await;
        assert_eq!(registry.attach(&id).err(), Some(InUse));
        controller.1.store(true, Ordering::Release);
        registry.started(&again, SandboxOptions::default(), &controller);
        settle().await;
        controller.end_hold(SandboxEvent::Deleted);
        settle().await;
        registry.detach(&again, second);
        assert!(registry.get(&id).is_none(), "the new hold had no watcher");
    }
}
