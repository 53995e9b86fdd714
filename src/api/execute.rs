//! `POST /execute?language=python|bash`: run one script in a fresh sandbox and
//! stream its output, as the earlier server did (stdout and stderr merged, in
//! arrival order, `text/plain`). The sandbox is destroyed afterwards, also when
//! the client goes away: a guard destroys it when the handler (JSON mode) or
//! the streaming task is dropped, and the streaming task stops as soon as the
//! response body is gone, even for a script that prints nothing.
//!
//! Extension: `&format=json` waits for the end and answers
//! `{"stdout": …, "stderr": …, "exit_code": N}`.

use std::sync::Arc;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use controllers::api::SandboxId;
use controllers::runtime::{Command, CreateOptions, ExecEvent, ExecRequest, SandboxRuntime};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;

use super::state::AppState;

#[derive(Debug, Deserialize)]
pub struct ExecuteParams {
    language: Option<String>,
    format: Option<String>,
}

fn detail(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({"detail": message.into()}))).into_response()
}

/// The handler.
pub async fn execute(
    State(state): State<AppState>,
    Query(params): Query<ExecuteParams>,
    body: Bytes,
) -> Response {
    let Some(runtime) = state.runtime.clone() else {
        return detail(
            StatusCode::SERVICE_UNAVAILABLE,
            "the sandbox runtime is not available on this server",
        );
    };
    let language = params.language.as_deref().unwrap_or("python");
    let json_format = match params.format.as_deref() {
        None | Some("text") => false,
        Some("json") => true,
        Some(other) => {
            return detail(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("unknown format {other:?}; use text or json"),
            );
        }
    };
    if body.is_empty() {
        return detail(
            StatusCode::UNPROCESSABLE_ENTITY,
            "the request body (the script) is empty",
        );
    }
    let Ok(script) = String::from_utf8(body.to_vec()) else {
        return detail(
            StatusCode::UNPROCESSABLE_ENTITY,
            "the script is not valid UTF-8",
        );
    };
    let command = match language {
        "python" => Command::Python(script),
        "bash" => Command::Bash(script),
        other => {
            return detail(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("Unsupported language: '{other}'. Supported languages are: python, bash"),
            );
        }
    };
    let id = SandboxId::from_u128(uuid::Uuid::new_v4().as_u128());
    if let Err(err) = runtime.create(&id, &CreateOptions::default()).await {
        tracing::error!(sandbox = %id, %err, "execute: cannot create a sandbox");
        return detail(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("Failed to create a sandbox: {err}"),
        );
    }
    let sandbox = Disposable {
        runtime: Arc::clone(&runtime),
        id: Some(id.clone()),
    };
    let execution = match runtime.exec(&id, ExecRequest::new(command)).await {
        Ok(execution) => execution,
        Err(err) => {
            drop(sandbox);
            return detail(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("Failed to start the script: {err}"),
            );
        }
    };
    if json_format {
        collect(sandbox, execution).await
    } else {
        stream(sandbox, execution)
    }
}

/// The one-shot sandbox: destroyed when this is dropped, whether the script
/// ended or the client left and its handler was dropped mid-wait.
struct Disposable {
    runtime: Arc<dyn SandboxRuntime>,
    id: Option<SandboxId>,
}

impl Drop for Disposable {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else { return };
        let runtime = Arc::clone(&self.runtime);
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(sandbox = %id, "execute: no runtime left to destroy the sandbox");
            return;
        };
        handle.spawn(async move {
            if let Err(err) = runtime.destroy(&id).await {
                tracing::warn!(sandbox = %id, %err, "execute: destroying the sandbox failed");
            }
        });
    }
}

async fn collect(sandbox: Disposable, mut execution: controllers::runtime::Execution) -> Response {
    let (mut stdout, mut stderr, mut exit_code) = (Vec::new(), Vec::new(), None);
    while let Some(event) = execution.events.recv().await {
        match event {
            ExecEvent::Stdout(data) => stdout.extend_from_slice(&data),
            ExecEvent::Stderr(data) => stderr.extend_from_slice(&data),
            ExecEvent::Exited(code) => {
                exit_code = Some(code);
                break;
            }
        }
    }
    drop(sandbox);
    Json(json!({
        "stdout": String::from_utf8_lossy(&stdout),
        "stderr": String::from_utf8_lossy(&stderr),
        "exit_code": exit_code,
    }))
    .into_response()
}

fn stream(sandbox: Disposable, mut execution: controllers::runtime::Execution) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let _sandbox = sandbox;
        loop {
            let event = tokio::select! {
                event = execution.events.recv() => event,
                // The client went away (its body was dropped): stop at once,
                // also for a script that prints nothing.
                () = tx.closed() => break,
            };
            let chunk = match event {
                Some(ExecEvent::Stdout(data) | ExecEvent::Stderr(data)) => data,
                Some(ExecEvent::Exited(_)) | None => break,
            };
            if tx.send(Ok(chunk)).await.is_err() {
                break;
            }
        }
    });
    let body = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        Body::from_stream(body),
    )
        .into_response()
}
