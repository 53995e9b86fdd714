//! The sandboxes one `sandboxctl mcp` process created or forked. Their tokens
//! live here and nowhere else, so a model names a sandbox by its id only and
//! can reach no sandbox this process did not make.
//!
//! Each sandbox keeps its connection between tool calls (consecutive calls
//! cost no new attach, and the affinity cookie stays), and calls in progress
//! share it: a file can be read while a program runs (a second program at
//! once is the server's "another process runs" refusal). A connection
//! unused for a while is let go, so the server's idle timeout can checkpoint
//! the sandbox; the next call attaches again, which restores it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::client::{AttachOptions, ClientError, Sandbox};

/// A tool call that could not be done: its message is what the model reads.
#[derive(Debug, thiserror::Error)]
pub(super) enum ToolError {
    #[error("unknown sandbox id {id:?}: {known}")]
    UnknownSandbox { id: String, known: String },
    #[error(
        "sandbox {0} no longer exists (killed, or deleted after its idle timeout); create a new one"
    )]
    Gone(String),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Client(ClientError),
}

impl From<ClientError> for ToolError {
    fn from(err: ClientError) -> Self {
        Self::Client(err)
    }
}

/// The sandboxes, by id.
#[derive(Debug)]
pub(super) struct Sandboxes {
    url: String,
    entries: Mutex<HashMap<String, Arc<Entry>>>,
}

#[derive(Debug)]
struct Entry {
    id: String,
    token: String,
    /// The open connection, if any: shared by the calls in progress (the
    /// client multiplexes file calls beside an execution); the lock is held
    /// only to attach or to let it go.
    connection: tokio::sync::Mutex<Option<Arc<Sandbox>>>,
    last_used: Mutex<Instant>,
}

impl Entry {
    #[allow(
        clippy::disallowed_methods,
        reason = "sandboxctl's MCP server ages its idle connections on the operator's machine, outside any instance"
    )]
    fn touch(&self) {
        *self
            .last_used
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
    }

    #[allow(
        clippy::disallowed_methods,
        reason = "sandboxctl's MCP server ages its idle connections on the operator's machine, outside any instance"
    )]
    fn idle_for(&self) -> Duration {
        self.last_used
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .elapsed()
    }
}

/// One tool call's use of a sandbox: its token, and the connection it got
/// (opened on first use).
#[derive(Debug)]
pub(super) struct Lease {
    entry: Arc<Entry>,
    url: String,
    current: Option<Arc<Sandbox>>,
}

impl Sandboxes {
    pub(super) fn new(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            entries: Mutex::new(HashMap::new()),
        }
    }

    pub(super) fn url(&self) -> &str {
        &self.url
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Entry>>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps a sandbox just created (and its connection).
    pub(super) fn insert(&self, sandbox: Sandbox) -> String {
        let id = sandbox.id().to_owned();
        let entry = Entry {
            id: id.clone(),
            token: sandbox.token().to_owned(),
            connection: tokio::sync::Mutex::new(Some(Arc::new(sandbox))),
            #[allow(
                clippy::disallowed_methods,
                reason = "sandboxctl's MCP server ages its idle connections on the operator's machine, outside any instance"
            )]
            last_used: Mutex::new(Instant::now()),
        };
        self.entries().insert(id.clone(), Arc::new(entry));
        id
    }

    /// The sandbox `id`.
    pub(super) fn lease(&self, id: &str) -> Result<Lease, ToolError> {
        let entry = self.entries().get(id).cloned();
        let Some(entry) = entry else {
            let mut known: Vec<String> = self.entries().keys().cloned().collect();
            known.sort_unstable();
            let known = if known.is_empty() {
                "this MCP server has no sandbox yet (create_sandbox makes one)".to_owned()
            } else {
                format!("the sandboxes of this MCP server are {}", known.join(", "))
            };
            return Err(ToolError::UnknownSandbox {
                id: id.to_owned(),
                known,
            });
        };
        Ok(Lease {
            entry,
            url: self.url.clone(),
            current: None,
        })
    }

    /// Forgets `id` (killed, or found gone).
    pub(super) fn remove(&self, id: &str) {
        self.entries().remove(id);
    }

    /// Lets go of connections unused for `linger` (calls in progress keep theirs).
    pub(super) fn sweep(&self, linger: Duration) {
        let entries: Vec<Arc<Entry>> = self.entries().values().cloned().collect();
        for entry in entries {
            if let Ok(mut connection) = entry.connection.try_lock()
                && connection
                    .as_ref()
                    .is_some_and(|sandbox| Arc::strong_count(sandbox) == 1)
                && entry.idle_for() >= linger
            {
                tracing::debug!(id = %entry.id, "closing an unused connection");
                *connection = None;
            }
        }
    }

    /// Every sandbox's id and token.
    pub(super) fn owned(&self) -> Vec<(String, String)> {
        let mut owned: Vec<(String, String)> = self
            .entries()
            .values()
            .map(|entry| (entry.id.clone(), entry.token.clone()))
            .collect();
        owned.sort_unstable();
        owned
    }
}

impl Lease {
    pub(super) fn id(&self) -> &str {
        &self.entry.id
    }

    pub(super) fn token(&self) -> &str {
        &self.entry.token
    }

    /// The connected sandbox, attaching (and so restoring it, if it was
    /// checkpointed) when there is no connection.
    pub(super) async fn sandbox(&mut self) -> Result<Arc<Sandbox>, ToolError> {
        self.entry.touch();
        let mut connection = self.entry.connection.lock().await;
        if connection.is_none() {
            let attached = Sandbox::attach(
                &self.url,
                &self.entry.id,
                &self.entry.token,
                AttachOptions::default(),
            )
            .await;
            match attached {
                Ok(sandbox) => *connection = Some(Arc::new(sandbox)),
                Err(ClientError::NotFound) => {
                    return Err(ToolError::Gone(self.entry.id.clone()));
                }
                Err(err) => return Err(err.into()),
            }
        }
        let sandbox = connection
            .clone()
            .ok_or_else(|| ToolError::Invalid("no connection".to_owned()))?;
        self.current = Some(Arc::clone(&sandbox));
        Ok(sandbox)
    }

    /// Lets go of the connection this call used (after a checkpoint, which
    /// ends it, or an error that may have left it unusable), unless another
    /// call replaced it meanwhile: the next call attaches again.
    pub(super) async fn disconnect(&mut self) {
        if let Some(used) = self.current.take() {
            let mut connection = self.entry.connection.lock().await;
            if connection
                .as_ref()
                .is_some_and(|open| Arc::ptr_eq(open, &used))
            {
                *connection = None;
            }
        }
    }

    /// `result`, letting go of the connection if the error says it is gone.
    pub(super) async fn check<T>(
        &mut self,
        result: Result<T, ClientError>,
    ) -> Result<T, ToolError> {
        self.entry.touch();
        match result {
            Ok(value) => Ok(value),
            Err(ClientError::NotFound) => {
                self.disconnect().await;
                Err(ToolError::Gone(self.entry.id.clone()))
            }
            Err(err @ (ClientError::Closed(_) | ClientError::Protocol(_))) => {
                self.disconnect().await;
                Err(err.into())
            }
            Err(err) => Err(err.into()),
        }
    }
}
