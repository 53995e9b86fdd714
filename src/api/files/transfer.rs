//! Large files in pieces, with memory flat in the file's size: an upload is
//! cut into [`UPLOAD_CHUNK`]-byte agent chunks with at most [`WINDOW`] in flight
//! (each answered, so a slow sandbox slows the sender down), and is renamed
//! into place only once its size and SHA-256 are the announced ones; a
//! download is [`WINDOW`] pipelined reads at offsets, each checked to come
//! from the same file (inode, mtime and size of the first), hashed as it
//! goes so the client can check the digest sent at the end.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use controllers::api::SandboxId;
use controllers::files::{FsEntry, FsError, FsReply, FsRequest, ReadData};
use controllers::sandboxes::SandboxController;
use futures::stream::{FuturesOrdered, StreamExt};
use sha2::{Digest, Sha256};

/// Bytes per agent read of a download (each becomes one binary frame).
pub const CHUNK: usize = 1 << 20;
/// Bytes per agent chunk of an upload: raw after their command line
/// (decision 19), so larger chunks only save round trips; the agent takes
/// up to 8 MiB.
pub const UPLOAD_CHUNK: usize = 2 << 20;
/// Agent chunks in flight per transfer (at most `WINDOW * UPLOAD_CHUNK`
/// bytes of an upload wait for the sandbox).
pub const WINDOW: usize = 4;

/// A finished upload.
#[derive(Debug, Clone)]
pub struct Uploaded {
    pub entry: FsEntry,
    pub size: u64,
    pub sha256: String,
}

/// Where an upload goes and what it must be.
#[derive(Debug, Clone)]
pub struct UploadTarget {
    pub path: String,
    pub mode: Option<u32>,
    pub parents: bool,
    /// The size announced (checked at the end).
    pub size: Option<u64>,
    /// The digest announced (lowercase hex; checked at the end).
    pub sha256: Option<String>,
}

fn unexpected(reply: &FsReply) -> FsError {
    FsError::BadAnswer(format!("an unexpected reply: {reply:?}"))
}

/// Streams `chunks` into `target` in the sandbox. Nothing is left at the
/// target unless the whole upload arrived with the announced size and digest.
pub async fn upload<S, E>(
    controller: &SandboxController,
    sandbox: &SandboxId,
    target: UploadTarget,
    mut chunks: S,
) -> Result<Uploaded, FsError>
where
    S: futures::Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let upload = format!("{:032x}", rand::random::<u128>());
    controller
        .fs(
            sandbox,
            FsRequest::UploadOpen {
                upload: upload.clone(),
                path: target.path.clone(),
                mode: target.mode,
                parents: target.parents,
            },
        )
        .await?;
    let sent = send_chunks(controller, sandbox, &upload, &target, &mut chunks).await;
    let finished = match sent {
        Ok((size, sha256)) => controller
            .fs(
                sandbox,
                FsRequest::UploadCommit {
                    upload: upload.clone(),
                    size,
                },
            )
            .await
            .and_then(|reply| match reply {
                FsReply::Entry(entry) => Ok(Uploaded {
                    entry,
                    size,
                    sha256,
                }),
                other => Err(unexpected(&other)),
            }),
        Err(err) => Err(err),
    };
    if finished.is_err() {
        let _ = controller
            .fs(sandbox, FsRequest::UploadAbort { upload })
            .await;
    }
    finished
}

/// Sends every chunk; returns the size and digest of what was sent, once
/// they are the announced ones.
async fn send_chunks<S, E>(
    controller: &SandboxController,
    sandbox: &SandboxId,
    upload: &str,
    target: &UploadTarget,
    chunks: &mut S,
) -> Result<(u64, String), FsError>
where
    S: futures::Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let mut hasher = Sha256::new();
    let mut total: u64 = 0;
    let mut pending = BytesMut::new();
    let mut in_flight = FuturesOrdered::new();
    let send = |data: Bytes| {
        controller.fs(
            sandbox,
            FsRequest::UploadChunk {
                upload: upload.to_owned(),
                data,
            },
        )
    };
    let mut ended = false;
    loop {
        // Every whole piece goes out while the window has room (the last,
        // shorter one once the client's bytes ended).
        while in_flight.len() < WINDOW
            && (pending.len() >= UPLOAD_CHUNK || (ended && !pending.is_empty()))
        {
            let piece = pending.split_to(pending.len().min(UPLOAD_CHUNK)).freeze();
            in_flight.push_back(send(piece));
        }
        if ended && pending.is_empty() {
            break;
        }
        if ended || in_flight.len() >= WINDOW {
            if let Some(reply) = in_flight.next().await {
                reply?;
            }
            continue;
        }
        // Read on while the chunks in flight are sent and answered (a
        // request goes to the agent when first polled).
        tokio::select! {
            Some(reply) = in_flight.next(), if !in_flight.is_empty() => {
                reply?;
            }
            item = chunks.next() => match item {
                Some(Ok(data)) => {
                    total += data.len() as u64;
                    if target.size.is_some_and(|size| total > size) {
                        return Err(FsError::Invalid(format!(
                            "more than the {} bytes announced arrived",
                            target.size.unwrap_or_default()
                        )));
                    }
                    hasher.update(&data);
                    pending.extend_from_slice(&data);
                }
                Some(Err(err)) => {
                    return Err(FsError::Invalid(format!("the upload broke off: {err}")));
                }
                None => ended = true,
            },
        }
    }
    while let Some(reply) = in_flight.next().await {
        reply?;
    }
    if let Some(size) = target.size
        && size != total
    {
        return Err(FsError::Invalid(format!(
            "{total} bytes arrived, {size} were announced"
        )));
    }
    let sha256 = hex::encode(hasher.finalize());
    if let Some(expected) = &target.sha256
        && *expected != sha256
    {
        return Err(FsError::posix(
            "EIO",
            format!("the upload's SHA-256 is {sha256}, not the {expected} announced"),
        ));
    }
    Ok((total, sha256))
}

/// A read running on a task of its own (so that [`WINDOW`] of them
/// proceed while the caller sends what came before).
type Pending = tokio::task::JoinHandle<Result<FsReply, FsError>>;

/// A download in progress: [`Self::next`] gives the file's bytes in order.
pub struct Download {
    controller: Arc<SandboxController>,
    sandbox: SandboxId,
    path: String,
    /// The file as the first read saw it.
    pub size: u64,
    pub mode: u32,
    identity: (u64, i64),
    first: Option<Bytes>,
    next_offset: u64,
    in_flight: VecDeque<Pending>,
    sent: u64,
    hasher: Sha256,
    done: bool,
}

impl Drop for Download {
    fn drop(&mut self) {
        for read in &self.in_flight {
            read.abort();
        }
    }
}

impl std::fmt::Debug for Download {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Download")
            .field("sandbox", &self.sandbox)
            .field("path", &self.path)
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

async fn read_at(
    controller: &SandboxController,
    sandbox: &SandboxId,
    path: &str,
    offset: u64,
) -> Result<ReadData, FsError> {
    match controller
        .fs(
            sandbox,
            FsRequest::Read {
                path: path.to_owned(),
                offset,
                length: CHUNK as u64,
            },
        )
        .await?
    {
        FsReply::Data(data) => Ok(data),
        other => Err(unexpected(&other)),
    }
}

impl Download {
    /// Opens a download with its first read.
    pub async fn start(
        controller: Arc<SandboxController>,
        sandbox: SandboxId,
        path: String,
    ) -> Result<Self, FsError> {
        let first = read_at(&controller, &sandbox, &path, 0).await?;
        let mut download = Self {
            next_offset: first.data.len() as u64,
            size: first.size,
            mode: first.mode,
            identity: (first.ino, first.mtime_ns),
            done: false,
            first: Some(first.data.clone()),
            controller,
            sandbox,
            path,
            in_flight: VecDeque::new(),
            sent: 0,
            hasher: Sha256::new(),
        };
        if first.eof {
            download.next_offset = download.size.max(download.next_offset);
        }
        download.fill();
        Ok(download)
    }

    /// Keeps [`WINDOW`] reads in flight, up to the size the first read saw.
    fn fill(&mut self) {
        while self.in_flight.len() < WINDOW && self.next_offset < self.size {
            let (controller, sandbox, path) = (
                Arc::clone(&self.controller),
                self.sandbox.clone(),
                self.path.clone(),
            );
            let offset = self.next_offset;
            self.in_flight.push_back(tokio::spawn(async move {
                read_at(&controller, &sandbox, &path, offset)
                    .await
                    .map(FsReply::Data)
            }));
            self.next_offset += CHUNK as u64;
        }
    }

    /// The next piece of the file; `None` once all of it was given.
    pub async fn next(&mut self) -> Option<Result<Bytes, FsError>> {
        if self.done {
            return None;
        }
        let piece = match self.first.take() {
            Some(first) => Ok(first),
            None => match self.in_flight.pop_front() {
                None => {
                    self.done = true;
                    return None;
                }
                Some(read) => match read.await {
                    Ok(reply) => reply.and_then(|reply| self.checked(reply)),
                    Err(err) => Err(FsError::BadAnswer(format!("a read failed: {err}"))),
                },
            },
        };
        match piece {
            Ok(data) => {
                self.sent += data.len() as u64;
                self.hasher.update(&data);
                if self.sent > self.size {
                    self.done = true;
                    return Some(Err(changed(&self.path)));
                }
                self.fill();
                Some(Ok(data))
            }
            Err(err) => {
                self.done = true;
                for read in self.in_flight.drain(..) {
                    read.abort();
                }
                Some(Err(err))
            }
        }
    }

    fn checked(&self, reply: FsReply) -> Result<Bytes, FsError> {
        let FsReply::Data(read) = reply else {
            return Err(unexpected(&reply));
        };
        let expected = (self.size - self.sent).min(CHUNK as u64);
        if (read.ino, read.mtime_ns) != self.identity
            || read.size != self.size
            || read.data.len() as u64 != expected
        {
            return Err(changed(&self.path));
        }
        Ok(read.data)
    }

    /// The SHA-256 of what was given (complete once [`Self::next`] said
    /// `None`).
    pub fn sha256(&self) -> String {
        hex::encode(self.hasher.clone().finalize())
    }

    /// Bytes given so far.
    pub fn sent(&self) -> u64 {
        self.sent
    }
}

fn changed(path: &str) -> FsError {
    FsError::posix(
        "ESTALE",
        format!("{path:?} changed while it was downloaded; download it again"),
    )
}
