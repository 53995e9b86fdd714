//! [`WorkspaceFiles`] on gVisor: every file operation is an agent command
//! (`ws_*`, `sandbox_agent/workspace.py`), run inside the sandbox as its
//! user, so the host never resolves a path the sandbox controls.

use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use controllers::api::SandboxId;
use controllers::runtime::RuntimeError;
use controllers::store::BlobReader;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::agent::{AgentConnection, AgentError};
use super::bundle::WORKSPACE_DIR;
use super::gvisor::GvisorRuntime;
use crate::runtime::agent::protocol::{DeleteDone, ReadDone, Request, ScanDone};
use crate::workspace::files::{
    Copied, FilesError, LocalScan, Refused, ScanRequest, WorkspaceFiles,
};
use crate::workspace::state::FileEntry;

/// How long one agent file command may take (a scan hashes every changed file).
const FILE_OP_TIMEOUT: Duration = Duration::from_secs(120);
/// Raw bytes per `ws_write_chunk` (base64 makes the line a third larger).
const WRITE_CHUNK: usize = 192 * 1024;

fn agent_error(err: AgentError) -> FilesError {
    match err {
        AgentError::Refused(message) => FilesError::Refused(message),
        other => FilesError::Agent(other.to_string()),
    }
}

impl GvisorRuntime {
    fn workspace_agent(
        &self,
        sandbox: &SandboxId,
    ) -> Result<std::sync::Arc<AgentConnection>, FilesError> {
        self.agent_of(sandbox).map_err(|err| match err {
            RuntimeError::NotFound(id) => FilesError::NotRunning(id),
            other => FilesError::Agent(other.to_string()),
        })
    }
}

/// A valid entry of the sandbox's state file, or `None`.
fn synced_entry(value: Value) -> Option<FileEntry> {
    let entry: FileEntry = serde_json::from_value(value).ok()?;
    let valid = crate::workspace::path::WorkspacePath::new(&entry.path).is_ok()
        && crate::workspace::path::is_md5_hex(&entry.checksum);
    valid.then_some(entry)
}

#[async_trait]
impl WorkspaceFiles for GvisorRuntime {
    async fn scan(
        &self,
        sandbox: &SandboxId,
        request: ScanRequest,
    ) -> Result<LocalScan, FilesError> {
        let agent = self.workspace_agent(sandbox)?;
        let parsed: ScanDone = agent
            .ask(
                Request::WsScan {
                    root: WORKSPACE_DIR.to_owned(),
                    max_file_bytes: Some(request.max_file_bytes),
                    max_total_bytes: Some(request.max_total_bytes),
                    max_files: Some(request.max_files),
                    stale_s: request.stale_threshold_s,
                },
                FILE_OP_TIMEOUT,
            )
            .await
            .map_err(agent_error)?;
        // The agent is inside the sandbox: treat what it reports as untrusted.
        let mut refused = parsed.refused;
        let files = parsed
            .files
            .into_iter()
            .filter(|file| {
                let problem = crate::workspace::path::WorkspacePath::new(&file.path)
                    .err()
                    .map(|err| err.to_string())
                    .or_else(|| {
                        (!crate::workspace::path::is_md5_hex(&file.checksum))
                            .then(|| "not an md5 checksum".to_owned())
                    });
                match problem {
                    Some(reason) => {
                        refused.push(Refused {
                            path: file.path.clone(),
                            reason,
                        });
                        false
                    }
                    None => true,
                }
            })
            .collect();
        LocalScan {
            files,
            refused,
            synced: parsed.synced.into_iter().filter_map(synced_entry).collect(),
            hashed: parsed.hashed,
            scanned_at: parsed.scanned_at,
        }
        .bounded(request.max_files)
    }

    async fn read_file(
        &self,
        sandbox: &SandboxId,
        path: &str,
        max_bytes: u64,
        dest: &Path,
    ) -> Result<Copied, FilesError> {
        let agent = self.workspace_agent(sandbox)?;
        let io = |source| FilesError::Io {
            path: dest.display().to_string(),
            source,
        };
        // Owner-only: the bytes are the user's files.
        let mut file = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(dest)
            .await
            .map_err(io)?;
        let (mut chunks, done) = agent
            .start_archive(Request::WsRead {
                root: WORKSPACE_DIR.to_owned(),
                path: path.to_owned(),
                max_file_bytes: max_bytes,
            })
            .await
            .map_err(agent_error)?;
        let mut written: u64 = 0;
        let mut digest = md5::Context::new();
        while let Some(chunk) = chunks.recv().await {
            written += chunk.len() as u64;
            digest.consume(&chunk);
            if written > max_bytes {
                return Err(FilesError::Refused(format!(
                    "{path:?} is larger than the {max_bytes}-byte file limit"
                )));
            }
            file.write_all(&chunk).await.map_err(io)?;
        }
        file.flush().await.map_err(io)?;
        let reply = match tokio::time::timeout(FILE_OP_TIMEOUT, done).await {
            Ok(Ok(Ok((reply, _)))) => reply,
            Ok(Ok(Err(message))) => return Err(FilesError::Refused(message)),
            Ok(Err(_)) => return Err(FilesError::Agent("the sandbox agent is gone".into())),
            Err(_) => return Err(FilesError::Agent("the file read timed out".into())),
        };
        let ReadDone { checksum, size } = reply
            .reply()
            .map_err(|err| FilesError::Agent(err.to_string()))?;
        // The checksum that names the stored content is the host's own.
        let received = format!("{:x}", digest.finalize());
        if size != written || checksum != received {
            return Err(FilesError::Agent(format!(
                "{path:?}: the sandbox reported {size} bytes with md5 {checksum:?}; \
                 {written} bytes with md5 {received} arrived"
            )));
        }
        Ok(Copied {
            checksum: received,
            size,
        })
    }

    async fn write_file(
        &self,
        sandbox: &SandboxId,
        entry: &FileEntry,
        mut data: BlobReader,
    ) -> Result<(), FilesError> {
        let agent = self.workspace_agent(sandbox)?;
        let id = agent.new_id("w");
        let result = send_file(&agent, &id, entry, &mut data).await;
        if result.is_err() {
            // Drop the half-written temporary file in the sandbox.
            let _ = agent
                .request_with_id(&id, Request::WsWriteAbort, FILE_OP_TIMEOUT)
                .await;
        }
        result
    }

    async fn delete_files(&self, sandbox: &SandboxId, paths: &[String]) -> Result<u64, FilesError> {
        let agent = self.workspace_agent(sandbox)?;
        let reply: DeleteDone = agent
            .ask(
                Request::WsDelete {
                    root: WORKSPACE_DIR.to_owned(),
                    paths: paths.to_vec(),
                },
                FILE_OP_TIMEOUT,
            )
            .await
            .map_err(agent_error)?;
        Ok(reply.deleted)
    }

    async fn write_state(&self, sandbox: &SandboxId, content: String) -> Result<(), FilesError> {
        let agent = self.workspace_agent(sandbox)?;
        agent
            .request(
                Request::WsState {
                    root: WORKSPACE_DIR.to_owned(),
                    content,
                },
                FILE_OP_TIMEOUT,
            )
            .await
            .map_err(agent_error)?;
        Ok(())
    }
}

/// Streams one download into the sandbox as `ws_write_chunk`s, then asks the
/// agent to check and rename it.
async fn send_file(
    agent: &AgentConnection,
    id: &str,
    entry: &FileEntry,
    data: &mut BlobReader,
) -> Result<(), FilesError> {
    let mut buffer = vec![0u8; WRITE_CHUNK];
    let mut total: u64 = 0;
    loop {
        let n = data
            .read(&mut buffer)
            .await
            .map_err(|source| FilesError::Io {
                path: entry.path.clone(),
                source,
            })?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if total > entry.size {
            return Err(FilesError::Refused(format!(
                "{:?}: the stored content is larger than the {} bytes its state records",
                entry.path, entry.size
            )));
        }
        agent
            .send(
                &Request::WsWriteChunk {
                    root: WORKSPACE_DIR.to_owned(),
                    data: BASE64.encode(&buffer[..n]),
                }
                .with_id(id),
            )
            .await
            .map_err(agent_error)?;
    }
    agent
        .request_with_id(
            id,
            Request::WsWriteEnd {
                root: WORKSPACE_DIR.to_owned(),
                path: entry.path.clone(),
                checksum: entry.checksum.clone(),
                modified_at: entry.modified_at,
            },
            FILE_OP_TIMEOUT,
        )
        .await
        .map_err(agent_error)?;
    Ok(())
}
