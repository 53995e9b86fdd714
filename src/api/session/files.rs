//! The filesystem API on the attached session: `fs_*` actions answered with
//! `fs_result` / `fs_error`, in order with the session's other frames (a
//! file written before an execution is there when it runs). They work while
//! an execution runs: the agent serves files beside it.
//!
//! Bytes travel as binary frames, which the earlier server's clients never
//! send nor receive (they never ask for uploads or downloads):
//! - `fs_upload` announces `size`; exactly that many bytes follow as binary
//!   frames (each at most 1 MiB). The socket's reader hands them to the
//!   upload through a small channel ([`UploadIntake`]), so a client sending
//!   faster than the sandbox writes is slowed by TCP, not buffered here.
//! - `fs_download` answers `fs_download` (size, mode), the file as binary
//!   frames (at most [`WINDOW`] queued for the socket), then `fs_result`
//!   with the size and SHA-256 of what was sent.

use std::sync::Arc;

use bytes::Bytes;
use serde_json::json;
use tokio::sync::{Semaphore, mpsc};

use super::Session;
use crate::api::files::transfer::{Download, UploadTarget, WINDOW, upload};
pub(super) use crate::api::files::{FsCall, FsOp};
use crate::api::files::{error_frame, error_parts, result_frame, run_simple};
use crate::api::protocol::{FrameError, ServerFrame};

/// Binary frames of an upload waiting for the sandbox (each ≤ 1 MiB).
const UPLOAD_QUEUE: usize = 8;

/// How long an upload waits for its next bytes before it fails.
pub(super) const UPLOAD_IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// An upload whose bytes stopped coming.
#[derive(Debug, thiserror::Error)]
#[error("no bytes arrived for {} s", UPLOAD_IDLE.as_secs())]
struct UploadStalled;

/// The socket reader's side of uploads: where the binary frames of the
/// upload announced last go, and how many bytes it still expects.
#[derive(Debug, Default)]
pub(super) struct UploadIntake {
    current: Option<(mpsc::Sender<Bytes>, u64)>,
}

impl UploadIntake {
    /// An upload of `size` bytes was announced: its bytes go to the
    /// returned receiver. An upload still expecting bytes ends short.
    pub(super) fn expect(&mut self, size: u64) -> mpsc::Receiver<Bytes> {
        let (sender, receiver) = mpsc::channel(UPLOAD_QUEUE);
        self.current = (size > 0).then_some((sender, size));
        receiver
    }

    /// Ends the upload expecting bytes short (its `fs_error` says how many
    /// arrived); bytes sent for it afterwards are refused as unexpected.
    pub(super) fn abandon(&mut self) {
        self.current = None;
    }

    /// Hands a binary frame to the upload expecting it. `Err`: no upload
    /// expects bytes, or more than it announced arrived (it then fails).
    pub(super) async fn bytes(&mut self, data: Bytes) -> Result<(), FrameError> {
        let Some((sender, remaining)) = &mut self.current else {
            return Err(FrameError::Binary);
        };
        let length = data.len() as u64;
        if length > *remaining {
            self.current = None;
            return Err(FrameError::WrongType {
                field: "size",
                expected: "the number of bytes the upload's binary frames carry",
            });
        }
        *remaining -= length;
        // A failed upload dropped its receiver: what it was sent is dropped.
        let _ = sender.send(data).await;
        if *remaining == 0 {
            self.current = None;
        }
        Ok(())
    }
}

impl Session {
    /// Answers one filesystem call.
    pub(super) async fn fs(self: &Arc<Self>, call: FsCall, bytes: Option<mpsc::Receiver<Bytes>>) {
        let FsCall { request_id, op } = call;
        let name = op.name();
        let request_id = request_id.as_deref();
        let outcome = match op {
            FsOp::Upload {
                path,
                size,
                sha256,
                mode,
                parents,
            } => {
                let Some(bytes) = bytes else {
                    return self
                        .fs_failed(request_id, name, "EINVAL", "no bytes for this upload")
                        .await;
                };
                // Bytes that stop coming end the upload (the session takes
                // no other frame meanwhile).
                let chunks = Box::pin(futures::stream::unfold(bytes, |mut bytes| async move {
                    match tokio::time::timeout(UPLOAD_IDLE, bytes.recv()).await {
                        Ok(Some(data)) => Some((Ok(data), bytes)),
                        Ok(None) => None,
                        Err(_) => Some((Err(UploadStalled), bytes)),
                    }
                }));
                let target = UploadTarget {
                    path,
                    mode,
                    parents,
                    size: Some(size),
                    sha256,
                };
                upload(&self.controller, &self.id, target, chunks)
                    .await
                    .map(|done| json!({"entry": done.entry, "size": done.size, "sha256": done.sha256}))
            }
            FsOp::Download { path } => return self.download(request_id, path).await,
            other => run_simple(&self.controller, &self.id, other).await,
        };
        self.live.touch();
        match outcome {
            Ok(result) => {
                self.out.send(result_frame(request_id, name, result)).await;
            }
            Err(err) => {
                let (code, message) = error_parts(&self.id, &err);
                self.fs_failed(request_id, name, &code, &message).await;
            }
        }
    }

    async fn fs_failed(&self, request_id: Option<&str>, op: &str, code: &str, message: &str) {
        self.out
            .send(error_frame(request_id, op, code, message))
            .await;
    }

    async fn download(self: &Arc<Self>, request_id: Option<&str>, path: String) {
        let failed = |err: &controllers::files::FsError| error_parts(&self.id, err);
        let mut download =
            match Download::start(Arc::clone(&self.controller), self.id.clone(), path).await {
                Ok(download) => download,
                Err(err) => {
                    let (code, message) = failed(&err);
                    return self
                        .fs_failed(request_id, "download", &code, &message)
                        .await;
                }
            };
        let head = json!({
            "event": "fs_download",
            "request_id": request_id,
            "size": download.size,
            "mode": download.mode,
        });
        if !self.out.send(ServerFrame::Event(head)).await {
            return;
        }
        let window = Arc::new(Semaphore::new(WINDOW));
        while let Some(piece) = download.next().await {
            match piece {
                Ok(data) => {
                    let Ok(permit) = Arc::clone(&window).acquire_owned().await else {
                        return;
                    };
                    if !self.out.binary(data, Some(permit)).await {
                        return;
                    }
                    self.live.touch();
                }
                Err(err) => {
                    let (code, message) = failed(&err);
                    return self
                        .fs_failed(request_id, "download", &code, &message)
                        .await;
                }
            }
        }
        let result = json!({"size": download.sent(), "sha256": download.sha256()});
        self.out
            .send(result_frame(request_id, "download", result))
            .await;
    }
}
