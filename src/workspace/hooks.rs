//! Which workspace syncs run at which lifecycle point: templates of hook
//! actions, chosen per sandbox (`spec.workspace.template`), wired to the
//! controllers' [`LifecycleHooks`].
//!
//! A template lists actions per point; actions run in order and compose (a
//! template can sync down and never up, or up only). Criticality is the
//! point's: a cold-start failure fails the start, the others are logged and
//! counted (`sandboxd_workspace_hook_failures_total`).
//!
//! Built-in templates:
//! - `default`: cold start syncs down; after each execution and on terminate,
//!   sync up.
//! - `download-only`: cold start syncs down; nothing is ever written back.
//! - `upload-only`: nothing is fetched; every execution's files are sent.
//!
//! More can be configured (`SANDBOXD_WORKSPACE_TEMPLATES`, JSON).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use controllers::api::{SandboxId, SandboxSpec};
use controllers::hooks::{BoundHooks, ColdStart, HookBinding, HookError, LifecycleHooks};
use serde::Deserialize;

use super::metrics::WorkspaceMetrics;
use super::sync::{RemoteState, WorkspaceSync};

/// One step a hook takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HookAction {
    /// Bring the store's files into the sandbox.
    SyncDown,
    /// Send the sandbox's changes to the store.
    SyncUp,
}

/// The actions run at each lifecycle point.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HookTemplate {
    #[serde(default)]
    pub cold_start: Vec<HookAction>,
    #[serde(default)]
    pub after_exec: Vec<HookAction>,
    #[serde(default)]
    pub terminate: Vec<HookAction>,
}

/// The built-in templates (see the module doc).
pub fn builtin_templates() -> BTreeMap<String, HookTemplate> {
    use HookAction::{SyncDown, SyncUp};
    BTreeMap::from([
        (
            "default".to_owned(),
            HookTemplate {
                cold_start: vec![SyncDown],
                after_exec: vec![SyncUp],
                terminate: vec![SyncUp],
            },
        ),
        (
            "download-only".to_owned(),
            HookTemplate {
                cold_start: vec![SyncDown],
                ..HookTemplate::default()
            },
        ),
        (
            "upload-only".to_owned(),
            HookTemplate {
                after_exec: vec![SyncUp],
                terminate: vec![SyncUp],
                ..HookTemplate::default()
            },
        ),
    ])
}

/// Parses `SANDBOXD_WORKSPACE_TEMPLATES` (`{"name": {"cold_start": ["sync_down"], …}}`)
/// and adds it to the built-ins (a configured name replaces a built-in one).
pub fn templates_with(config: Option<&str>) -> Result<BTreeMap<String, HookTemplate>, String> {
    let mut templates = builtin_templates();
    if let Some(json) = config.filter(|c| !c.trim().is_empty()) {
        let extra: BTreeMap<String, HookTemplate> = serde_json::from_str(json)
            .map_err(|err| format!("invalid workspace templates JSON: {err}"))?;
        for name in extra.keys() {
            if !controllers::api::is_resource_name(name) {
                return Err(format!(
                    "invalid workspace template name {name:?}: {}",
                    controllers::api::RESOURCE_NAME_RULE
                ));
            }
        }
        templates.extend(extra);
    }
    Ok(templates)
}

/// A sandbox with a synced workspace, as this instance runs it: the
/// binding its cold start returns, which the reconciler keeps with its hold.
#[derive(Debug)]
struct Binding {
    sync: Arc<WorkspaceSync>,
    workspace: String,
    template: HookTemplate,
    /// The store's state as last seen, so an unchanged sync up costs nothing.
    /// The async mutex also keeps one sandbox's syncs from overlapping.
    known: tokio::sync::Mutex<Option<RemoteState>>,
}

impl Binding {
    async fn run(
        &self,
        sandbox: &SandboxId,
        actions: &[HookAction],
    ) -> Result<(), super::sync::SyncError> {
        let mut known = self.known.lock().await;
        for action in actions {
            let (state, _report) = match action {
                HookAction::SyncDown => self.sync.sync_down(sandbox, &self.workspace).await?,
                HookAction::SyncUp => {
                    self.sync
                        .sync_up(sandbox, &self.workspace, known.clone())
                        .await?
                }
            };
            *known = Some(state);
        }
        Ok(())
    }

    /// Runs the hook point's actions; a failure is counted, logged and
    /// returned (the after-exec one reaches the execution's client).
    async fn run_noncritical(&self, sandbox: &SandboxId, point: &str) -> Result<(), HookError> {
        let metrics = self.sync.metrics();
        let (actions, failures) = match point {
            "after_exec" => (&self.template.after_exec, &metrics.after_exec_failures),
            _ => (&self.template.terminate, &metrics.terminate_failures),
        };
        if actions.is_empty() {
            return Ok(());
        }
        if let Err(err) = self.run(sandbox, actions).await {
            WorkspaceMetrics::add(failures, 1);
            // The store's state may have moved (or be unknown): read it next time.
            *self.known.lock().await = None;
            tracing::warn!(%sandbox, workspace = %self.workspace, point, %err, "workspace hook failed");
            return Err(HookError(format!(
                "syncing workspace {:?} to the store failed: {err}; \
                 what this execution changed in /workspace is not stored \
                 (the next execution's sync tries again)",
                controllers::api::workspace_name_of(&self.workspace)
            )));
        }
        Ok(())
    }
}

#[async_trait]
impl BoundHooks for Binding {
    fn wants_after_exec(&self) -> bool {
        !self.template.after_exec.is_empty()
    }

    async fn after_exec(&self, sandbox: &SandboxId) -> Result<(), HookError> {
        self.run_noncritical(sandbox, "after_exec").await
    }

    async fn on_terminate(&self, sandbox: &SandboxId) {
        let _ = self.run_noncritical(sandbox, "terminate").await;
    }
}

/// The workspace hooks of one instance.
#[derive(Debug)]
pub struct WorkspaceHooks {
    sync: Arc<WorkspaceSync>,
    templates: BTreeMap<String, HookTemplate>,
}

impl WorkspaceHooks {
    pub fn new(sync: Arc<WorkspaceSync>, templates: BTreeMap<String, HookTemplate>) -> Self {
        Self { sync, templates }
    }

    pub fn metrics(&self) -> &Arc<WorkspaceMetrics> {
        self.sync.metrics()
    }

    /// The path of workspace `name` as `token` opens it
    /// ([`WorkspaceSync::resolve`]).
    pub async fn resolve(&self, name: &str, token: &str) -> Result<String, super::sync::SyncError> {
        self.sync.resolve(name, token).await
    }

    /// Whether `name` is a template this instance knows (checked at create).
    pub fn has_template(&self, name: &str) -> bool {
        self.templates.contains_key(name)
    }
}

#[async_trait]
impl LifecycleHooks for WorkspaceHooks {
    async fn on_cold_start(
        &self,
        sandbox: &SandboxId,
        spec: &SandboxSpec,
        start: ColdStart,
    ) -> Result<Option<HookBinding>, HookError> {
        let Some(workspace) = &spec.workspace else {
            return Ok(None);
        };
        let Some(template) = self.templates.get(&workspace.template) else {
            WorkspaceMetrics::add(&self.metrics().cold_start_failures, 1);
            return Err(HookError(format!(
                "unknown workspace template {:?} (this server knows {})",
                workspace.template,
                self.templates
                    .keys()
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        };
        let binding = Arc::new(Binding {
            sync: Arc::clone(&self.sync),
            workspace: workspace.id.clone(),
            template: template.clone(),
            known: tokio::sync::Mutex::new(None),
        });
        if let Err(err) = binding.run(sandbox, &template.cold_start).await {
            WorkspaceMetrics::add(&self.metrics().cold_start_failures, 1);
            let message = format!(
                "syncing workspace {:?} into the sandbox: {err}",
                controllers::api::workspace_name_of(&workspace.id)
            );
            if start == ColdStart::Created {
                return Err(HookError(message));
            }
            // A restored sandbox has its own files (as of its checkpoint):
            // failing it would lock its user out for as long as the store's
            // side stays broken. It runs; later syncs up carry on.
            tracing::warn!(%sandbox, %message, "workspace sync on restore failed; the sandbox runs with its checkpoint's files");
            *binding.known.lock().await = None;
        }
        Ok(Some(binding))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_templates_extend_and_replace_builtins() {
        let templates = templates_with(Some(
            r#"{"readonly": {"cold_start": ["sync_down"]}, "default": {"after_exec": ["sync_up"]}}"#,
        ))
        .unwrap();
        assert_eq!(templates["readonly"].cold_start, [HookAction::SyncDown]);
        assert!(templates["readonly"].after_exec.is_empty());
        assert!(templates["default"].cold_start.is_empty());
        assert!(templates.contains_key("upload-only"));
    }

    #[test]
    fn invalid_template_config_is_refused_with_the_reason() {
        for bad in [
            r#"{"x": {"cold_start": ["format_disk"]}}"#,
            r#"{"x": {"on_boot": []}}"#,
            r#"{"Bad Name": {}}"#,
            "[1",
        ] {
            let err = templates_with(Some(bad)).unwrap_err();
            assert!(err.contains("invalid workspace template"), "{bad}: {err}");
        }
    }
}
