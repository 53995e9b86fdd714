//! The filesystem API on gVisor: each [`FsRequest`] is one agent command
//! (`fs_*`, `sandbox_agent/files.py`), run inside the sandbox as its user,
//! so the host never resolves a path the sandbox controls. The bytes of
//! reads and upload chunks travel raw beside the command (`fs_read_bytes`,
//! `fs_upload_bytes`) to an agent of protocol version 2 on, and as base64 in
//! the JSON (`fs_read`, `fs_upload_chunk`) to one restored from a checkpoint
//! of version 1 (decision 19).
//!
//! The agent is inside the sandbox, so its answers are checked like any
//! input: an error must name an errno (`ENOENT: …`), a read may not return
//! more than was asked for, a listing not more entries (the agent channel
//! bounds a line's length; see `agent.rs`).

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use controllers::api::SandboxId;
use controllers::files::{
    FsEntry, FsError, FsReply, FsRequest, MAX_LIST_DEPTH, MAX_LIST_ENTRIES, MAX_READ_BYTES,
    ReadData, check_path,
};
use controllers::runtime::RuntimeError;
use serde::de::DeserializeOwned;

use super::agent::{AgentConnection, AgentError};
use super::gvisor::GvisorRuntime;
use crate::runtime::agent::protocol::{
    ChunkDone, EntryDone, FsReadBytesDone, FsReadDone, ListDone, Request,
};

/// How long one filesystem command may take (a recursive remove of a big
/// tree is the slowest).
const FS_OP_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest error message kept from the agent.
const MAX_MESSAGE: usize = 1024;

impl GvisorRuntime {
    /// Runs one filesystem request in the sandbox's agent.
    pub(super) async fn fs_request(
        &self,
        sandbox: &SandboxId,
        request: FsRequest,
    ) -> Result<FsReply, FsError> {
        let agent = self.agent_of(sandbox)?;
        fs_on_agent(&agent, sandbox, request).await
    }
}

/// Runs one filesystem request on `agent` (the sandbox's), in the form its
/// protocol version speaks.
pub async fn fs_on_agent(
    agent: &AgentConnection,
    sandbox: &SandboxId,
    request: FsRequest,
) -> Result<FsReply, FsError> {
    let ask = |request: Request| {
        let agent = &agent;
        async move {
            agent
                .request(request, FS_OP_TIMEOUT)
                .await
                .map_err(|err| agent_error(sandbox, err))
        }
    };
    match request {
        FsRequest::Stat { path } => {
            check_path(&path)?;
            entry(ask(Request::FsStat { path }).await?)
        }
        FsRequest::List {
            path,
            depth,
            max_entries,
        } => {
            check_path(&path)?;
            let max_entries = max_entries.clamp(1, MAX_LIST_ENTRIES);
            let done: ListDone = typed(
                ask(Request::FsList {
                    path,
                    depth: depth.clamp(1, MAX_LIST_DEPTH),
                    max_entries,
                })
                .await?,
            )?;
            if done.entries.len() > max_entries as usize {
                return Err(FsError::BadAnswer(format!(
                    "{} entries for a listing of at most {max_entries}",
                    done.entries.len()
                )));
            }
            Ok(FsReply::Entries {
                entries: done.entries,
                truncated: done.truncated,
            })
        }
        FsRequest::Read {
            path,
            offset,
            length,
        } => {
            check_path(&path)?;
            let length = length.min(MAX_READ_BYTES);
            if agent.speaks_raw_bytes() {
                let (event, data) = agent
                    .exchange(
                        Request::FsReadBytes {
                            path,
                            offset,
                            length,
                        },
                        None,
                        FS_OP_TIMEOUT,
                    )
                    .await
                    .map_err(|err| agent_error(sandbox, err))?;
                let done: FsReadBytesDone = typed(event)?;
                if done.bytes != data.len() as u64 || done.bytes > length {
                    return Err(FsError::BadAnswer(format!(
                        "{} bytes (announced: {}) for a read of at most {length}",
                        data.len(),
                        done.bytes
                    )));
                }
                return Ok(FsReply::Data(ReadData {
                    data,
                    size: done.size,
                    mode: done.mode,
                    ino: done.ino,
                    mtime_ns: done.mtime_ns,
                    eof: done.eof,
                }));
            }
            let done: FsReadDone = typed(
                ask(Request::FsRead {
                    path,
                    offset,
                    length,
                })
                .await?,
            )?;
            let data = BASE64
                .decode(done.data.as_bytes())
                .map_err(|err| FsError::BadAnswer(format!("unreadable data: {err}")))?;
            if data.len() as u64 > length {
                return Err(FsError::BadAnswer(format!(
                    "{} bytes for a read of at most {length}",
                    data.len()
                )));
            }
            Ok(FsReply::Data(ReadData {
                data: Bytes::from(data),
                size: done.size,
                mode: done.mode,
                ino: done.ino,
                mtime_ns: done.mtime_ns,
                eof: done.eof,
            }))
        }
        FsRequest::Write {
            path,
            data,
            mode,
            parents,
        } => {
            check_path(&path)?;
            let data = BASE64.encode(&data);
            entry(
                ask(Request::FsWrite {
                    path,
                    data,
                    mode,
                    parents,
                })
                .await?,
            )
        }
        FsRequest::Mkdir {
            path,
            parents,
            mode,
        } => {
            check_path(&path)?;
            entry(
                ask(Request::FsMkdir {
                    path,
                    parents,
                    mode,
                })
                .await?,
            )
        }
        FsRequest::Remove { path, recursive } => {
            check_path(&path)?;
            ask(Request::FsRemove { path, recursive }).await?;
            Ok(FsReply::Done)
        }
        FsRequest::Rename {
            path,
            to,
            overwrite,
        } => {
            check_path(&path)?;
            check_path(&to)?;
            entry(
                ask(Request::FsRename {
                    path,
                    to,
                    overwrite,
                })
                .await?,
            )
        }
        FsRequest::UploadOpen {
            upload,
            path,
            mode,
            parents,
        } => {
            check_path(&path)?;
            ask(Request::FsUploadOpen {
                upload,
                path,
                mode,
                parents,
            })
            .await?;
            Ok(FsReply::Done)
        }
        FsRequest::UploadChunk { upload, data } if agent.speaks_raw_bytes() => {
            let (event, _) = agent
                .exchange(Request::FsUploadBytes { upload }, Some(data), FS_OP_TIMEOUT)
                .await
                .map_err(|err| agent_error(sandbox, err))?;
            let done: ChunkDone = typed(event)?;
            Ok(FsReply::Written(done.size))
        }
        FsRequest::UploadChunk { upload, data } => {
            let data = BASE64.encode(&data);
            let done: ChunkDone = typed(ask(Request::FsUploadChunk { upload, data }).await?)?;
            Ok(FsReply::Written(done.size))
        }
        FsRequest::UploadCommit { upload, size } => {
            entry(ask(Request::FsUploadCommit { upload, size }).await?)
        }
        FsRequest::UploadAbort { upload } => {
            ask(Request::FsUploadAbort { upload }).await?;
            Ok(FsReply::Done)
        }
    }
}

fn typed<T: DeserializeOwned>(event: crate::runtime::agent::protocol::Event) -> Result<T, FsError> {
    event
        .reply()
        .map_err(|err| FsError::BadAnswer(err.to_string()))
}

fn entry(event: crate::runtime::agent::protocol::Event) -> Result<FsReply, FsError> {
    let done: EntryDone = typed(event)?;
    Ok(FsReply::Entry(checked_entry(done.entry)?))
}

fn checked_entry(entry: FsEntry) -> Result<FsEntry, FsError> {
    if entry.path.len() > 2 * controllers::files::MAX_PATH_BYTES {
        return Err(FsError::BadAnswer("a path longer than any path".into()));
    }
    Ok(entry)
}

/// The agent's failure as an [`FsError`]: a refusal that names an errno is
/// the sandbox kernel's answer; a sandbox gone is one that is not here.
fn agent_error(sandbox: &SandboxId, err: AgentError) -> FsError {
    match err {
        AgentError::Refused(message) => posix(&message),
        AgentError::Gone => FsError::Runtime(RuntimeError::NotFound(sandbox.clone())),
        other => FsError::Runtime(RuntimeError::Failed(other.to_string())),
    }
}

/// `ENOENT: No such file or directory: '/x'` as a typed error; anything
/// else the agent says is not trusted to be one.
fn posix(message: &str) -> FsError {
    let message: String = message.chars().take(MAX_MESSAGE).collect();
    match message.split_once(": ") {
        Some((code, rest)) if is_errno_name(code) => FsError::posix(code, rest),
        _ => FsError::BadAnswer(message),
    }
}

fn is_errno_name(code: &str) -> bool {
    code.len() >= 3
        && code.len() <= 16
        && code.starts_with('E')
        && code
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_errno_named_refusal_is_posix_and_anything_else_is_not() {
        match posix("ENOENT: No such file or directory: '/x'") {
            FsError::Posix { code, message } => {
                assert_eq!(code, "ENOENT");
                assert_eq!(message, "No such file or directory: '/x'");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(posix("KeyError: 'x'"), FsError::BadAnswer(_)));
        assert!(matches!(posix("Enoent: x"), FsError::BadAnswer(_)));
        let long = format!("EIO: {}", "x".repeat(10_000));
        assert!(posix(&long).to_string().len() <= MAX_MESSAGE + 8);
    }
}
