//! `POST /execute?language=python|bash`: run one script in a fresh sandbox and
//! stream its output, as the earlier server did (stdout and stderr merged, in
//! arrival order, `text/plain`). The sandbox is destroyed afterwards, also when
//! the client goes away mid-stream.
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

use crate::server::AppState;

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
    let execution = match runtime.exec(&id, ExecRequest::new(command)).await {
        Ok(execution) => execution,
        Err(err) => {
            destroy(runtime, id);
            return detail(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("Failed to start the script: {err}"),
            );
        }
    };
    if json_format {
        collect(runtime, id, execution).await
    } else {
        stream(runtime, id, execution)
    }
}

fn destroy(runtime: Arc<dyn SandboxRuntime>, id: SandboxId) {
    tokio::spawn(async move {
        if let Err(err) = runtime.destroy(&id).await {
            tracing::warn!(sandbox = %id, %err, "execute: destroying the sandbox failed");
        }
    });
}

async fn collect(
    runtime: Arc<dyn SandboxRuntime>,
    id: SandboxId,
    mut execution: controllers::runtime::Execution,
) -> Response {
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
    destroy(runtime, id);
    Json(json!({
        "stdout": String::from_utf8_lossy(&stdout),
        "stderr": String::from_utf8_lossy(&stderr),
        "exit_code": exit_code,
    }))
    .into_response()
}

fn stream(
    runtime: Arc<dyn SandboxRuntime>,
    id: SandboxId,
    mut execution: controllers::runtime::Execution,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        while let Some(event) = execution.events.recv().await {
            let chunk = match event {
                ExecEvent::Stdout(data) | ExecEvent::Stderr(data) => data,
                ExecEvent::Exited(_) => break,
            };
            if tx.send(Ok(chunk)).await.is_err() {
                // The client went away: stop the script.
                let _ = execution.control.kill().await;
                break;
            }
        }
        destroy(runtime, id);
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
