//! Lifecycle hooks: when they run, and a failed cold start hook.

use super::*;

/// Records which hook ran when, and whether the sandbox was running then.
#[derive(Debug, Clone)]
struct Recorder {
    runtime: FakeRuntime,
    calls: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Recorder {
    fn record(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    fn running(&self, sandbox: &SandboxId) -> bool {
        self.runtime.memory(sandbox).is_some()
    }
}

/// The hooks: record the cold start, and fail it if `fail_cold_start`.
#[derive(Debug)]
struct RecordingHooks {
    recorder: Recorder,
    fail_cold_start: bool,
}

/// A sandbox's binding: records the later points and its drop (hold's end).
#[derive(Debug)]
struct RecordingBinding(Recorder);

/// Instance `a` with recording hooks, and what they record.
fn recording(world: &World, fail_cold_start: bool) -> (Instance, Recorder) {
    let mut recorder = None;
    let a = world.instance_hooked("a", ReconcilerConfig::default(), |runtime| {
        let (runtime, calls) = (runtime.clone(), Arc::default());
        let recorder = recorder.insert(Recorder { runtime, calls }).clone();
        Arc::new(RecordingHooks {
            recorder,
            fail_cold_start,
        })
    });
    (a, recorder.unwrap())
}

#[async_trait::async_trait]
impl crate::hooks::LifecycleHooks for RecordingHooks {
    async fn on_cold_start(
        &self,
        sandbox: &SandboxId,
        spec: &crate::api::SandboxSpec,
        start: crate::hooks::ColdStart,
    ) -> Result<Option<crate::hooks::HookBinding>, crate::hooks::HookError> {
        let running = self.recorder.running(sandbox);
        let workspace = spec.workspace.as_ref().map(|w| w.id.clone());
        let call = format!("cold_start {start:?} running={running} workspace={workspace:?}");
        self.recorder.record(call);
        if self.fail_cold_start {
            return Err(crate::hooks::HookError("the bucket is on fire".into()));
        }
        Ok(Some(Arc::new(RecordingBinding(self.recorder.clone()))))
    }
}

#[async_trait::async_trait]
impl crate::hooks::BoundHooks for RecordingBinding {
    fn wants_after_exec(&self) -> bool {
        true
    }

    async fn after_exec(&self, _sandbox: &SandboxId) -> Result<(), crate::hooks::HookError> {
        self.0.record("after_exec".into());
        Ok(())
    }

    async fn on_terminate(&self, sandbox: &SandboxId) {
        let running = self.0.running(sandbox);
        self.0.record(format!("terminate running={running}"));
    }
}

impl Drop for RecordingBinding {
    fn drop(&mut self) {
        self.0.record("forget".into());
    }
}

#[tokio::test]
async fn hooks_run_at_cold_start_after_each_execution_and_on_terminate() {
    let world = World::new();
    let (a, hooks) = recording(&world, false);
    let (id, mut metadata) = world.new_sandbox(false);
    metadata.spec.workspace = Some(crate::api::WorkspaceSpec {
        id: "proj".into(),
        template: "default".into(),
        extra: crate::api::ExtraFields::new(),
    });
    a.create_from(&metadata).await.unwrap();
    a.pass(&id).await;
    let cold_start = "cold_start Created running=true workspace=Some(\"proj\")";
    assert_eq!(hooks.calls(), [cold_start]);

    // The hook has run by the time the exit is reported.
    let mut execution = a.exec(&id, "true").await;
    let mut exited = false;
    while let Some(event) = execution.events.recv().await {
        if let crate::runtime::ExecEvent::Exited(_) = event {
            assert_eq!(hooks.calls().last().unwrap(), "after_exec");
            exited = true;
        }
    }
    assert!(exited, "the execution reported its exit");
    assert_eq!(hooks.calls().len(), 2);

    a.delete(&id).await;
    a.pass(&id).await;
    assert_eq!(&hooks.calls()[2..], ["terminate running=true", "forget"]);
    assert!(!a.runs(&id));
}

#[tokio::test]
async fn a_failed_cold_start_hook_fails_the_create_and_leaves_nothing_running() {
    let world = World::new();
    let (a, _) = recording(&world, true);
    let (id, metadata) = world.new_sandbox(false);
    let mut events = a.controller.subscribe(&id);
    a.create_from(&metadata).await.unwrap();
    let _ = a.reconcile(&id).await;
    let seen = drain(&mut events);
    let failed = heard!(
        seen,
        SandboxEvent::StartFailed {
            kind: StartKind::Create,
            cause: StartFailure::ColdStartHook(detail),
        } if detail.contains("the bucket is on fire")
    );
    assert!(failed, "{seen:?}");
    assert!(!a.runs(&id), "the sandbox still runs");
    assert_ne!(world.metadata(&id).await.status.phase, Phase::Running);
}
