//! The filesystem API on a connected [`Sandbox`] (docs/protocol.md,
//! "Filesystem API"): typed calls over the session's socket. Large files
//! go as uploads and downloads: the bytes as binary frames, checked against
//! their SHA-256 at the end (an upload is renamed into place only if the
//! server's digest of what arrived is the one announced; a download's bytes
//! go to a temporary file renamed into place only if they hash to what the
//! server says it sent).

use std::path::Path;
use std::sync::PoisonError;
use std::sync::atomic::{AtomicU64, Ordering};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::protocol::Message;

use super::super::connection::Event;
use super::super::error::ClientError;
use super::Sandbox;

/// Inline writes up to this size go in one frame; larger ones are uploads.
const INLINE_WRITE: usize = 512 * 1024;
/// Bytes per binary frame of an upload.
const UPLOAD_FRAME: usize = 1 << 20;

static NEXT_REQUEST: AtomicU64 = AtomicU64::new(1);

/// What a file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Directory,
    Symlink,
    Other,
}

/// A file as the sandbox's `lstat` sees it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct FileEntry {
    /// The absolute path (in a listing: the path relative to the directory listed).
    pub path: String,
    pub name: String,
    #[serde(rename = "type")]
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (`0o7777`).
    pub mode: u32,
    pub mtime: f64,
    /// A symlink's target.
    #[serde(default)]
    pub target: Option<String>,
}

/// A directory's entries.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Listing {
    pub entries: Vec<FileEntry>,
    /// More entries existed than were returned.
    pub truncated: bool,
}

/// A finished transfer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transferred {
    pub size: u64,
    pub sha256: String,
    /// The file's permission bits (a download: the sandbox file's).
    pub mode: u32,
}

/// A part of a file ([`Sandbox::read_range`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileRange {
    pub data: Vec<u8>,
    /// The whole file's size.
    pub size: u64,
    /// The part reaches the end of the file.
    pub eof: bool,
}

#[derive(Deserialize)]
struct EntryResult {
    entry: FileEntry,
}

/// A call in flight: its events arrive on `events` until it is dropped.
struct Call<'a> {
    sandbox: &'a Sandbox,
    id: String,
    events: mpsc::UnboundedReceiver<Event>,
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        self.sandbox
            .shared
            .files
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.id);
    }
}

impl Call<'_> {
    /// The next event of this call.
    async fn next(&mut self) -> Result<Event, ClientError> {
        match self.events.recv().await {
            Some(Event::Closed(why)) | Some(Event::Status { status: why, .. }) => {
                Err(ClientError::Closed(why))
            }
            Some(event) => Ok(event),
            None => Err(ClientError::Closed("the connection is gone".into())),
        }
    }

    /// The call's `result` (its `fs_error` as [`ClientError::Fs`]).
    async fn result(&mut self) -> Result<Value, ClientError> {
        loop {
            if let Event::Fs(frame) = self.next().await? {
                return fs_outcome(frame);
            }
        }
    }
}

fn fs_outcome(mut frame: Value) -> Result<Value, ClientError> {
    match frame["event"].as_str() {
        Some("fs_result") => Ok(frame["result"].take()),
        Some("fs_error") => Err(ClientError::Fs {
            code: frame["code"].as_str().unwrap_or("EIO").to_owned(),
            message: frame["message"].as_str().unwrap_or_default().to_owned(),
        }),
        _ => Err(ClientError::Protocol(format!("unexpected {frame}"))),
    }
}

fn parse<T: serde::de::DeserializeOwned>(value: Value) -> Result<T, ClientError> {
    serde_json::from_value(value)
        .map_err(|err| ClientError::Protocol(format!("a filesystem result: {err}")))
}

fn local_io(path: &Path, err: std::io::Error) -> ClientError {
    ClientError::Invalid(format!("{}: {err}", path.display()))
}

impl Sandbox {
    /// Sends `fields` as `action` under a fresh request id.
    fn call(&self, action: &str, fields: Value) -> Result<Call<'_>, ClientError> {
        let (call, frame) = self.register(action, fields);
        self.send(frame)?;
        Ok(call)
    }

    /// A call's route and its frame (not sent yet).
    fn register(&self, action: &str, mut fields: Value) -> (Call<'_>, Value) {
        let id = format!("c{}", NEXT_REQUEST.fetch_add(1, Ordering::Relaxed));
        let (sender, events) = mpsc::unbounded_channel();
        self.shared
            .files
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(id.clone(), sender);
        let call = Call {
            sandbox: self,
            id: id.clone(),
            events,
        };
        fields["action"] = json!(action);
        fields["request_id"] = json!(id);
        (call, fields)
    }

    /// Queues a frame of an upload, in order with its bytes.
    async fn send_ordered(&self, message: Message) -> Result<(), ClientError> {
        self.binary
            .send(message)
            .await
            .map_err(|_| ClientError::Closed("the connection is gone".into()))
    }

    async fn simple(&self, action: &str, fields: Value) -> Result<Value, ClientError> {
        self.call(action, fields)?.result().await
    }

    /// The file at `path` (absolute, or relative to the sandbox user's home).
    pub async fn stat(&self, path: &str) -> Result<FileEntry, ClientError> {
        let result: EntryResult = parse(self.simple("fs_stat", json!({"path": path})).await?)?;
        Ok(result.entry)
    }

    /// The entries under a directory, `depth` levels deep (1: its children).
    pub async fn list(&self, path: &str, depth: u32) -> Result<Listing, ClientError> {
        parse(
            self.simple("fs_list", json!({"path": path, "depth": depth}))
                .await?,
        )
    }

    /// A whole file's bytes (any size: a download).
    pub async fn read_file(&self, path: &str) -> Result<Vec<u8>, ClientError> {
        let mut data = Vec::new();
        self.download_to(path, &mut data).await?;
        Ok(data)
    }

    /// At most `length` bytes (the server caps it at 4 MiB) of the file at
    /// `path` from `offset`: one `fs_read`, so memory stays bounded whatever
    /// the file's size.
    pub async fn read_range(
        &self,
        path: &str,
        offset: u64,
        length: u64,
    ) -> Result<FileRange, ClientError> {
        let result = self
            .simple(
                "fs_read",
                json!({"path": path, "offset": offset, "length": length}),
            )
            .await?;
        let data = BASE64
            .decode(result["data"].as_str().unwrap_or_default())
            .map_err(|err| ClientError::Protocol(format!("fs_read data: {err}")))?;
        Ok(FileRange {
            data,
            size: result["size"].as_u64().unwrap_or_default(),
            eof: result["eof"].as_bool().unwrap_or(true),
        })
    }

    /// Writes a whole file (created with `mode`, default 0644, or replaced),
    /// creating its parents.
    pub async fn write_file(
        &self,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
    ) -> Result<FileEntry, ClientError> {
        if data.len() <= INLINE_WRITE {
            let mut fields = json!({"path": path, "data": BASE64.encode(data)});
            if let Some(mode) = mode {
                fields["mode"] = json!(mode);
            }
            let result: EntryResult = parse(self.simple("fs_write", fields).await?)?;
            return Ok(result.entry);
        }
        let digest = hex::encode(Sha256::digest(data));
        let mut reader = data;
        self.upload_from(path, &mut reader, data.len() as u64, &digest, mode)
            .await
            .map(|(entry, _)| entry)
    }

    pub async fn mkdir(&self, path: &str, parents: bool) -> Result<FileEntry, ClientError> {
        self.mkdir_with_mode(path, parents, None).await
    }

    /// [`Self::mkdir`] with the new directory's mode (default 0755; the
    /// sandbox's umask, 022, applies).
    pub async fn mkdir_with_mode(
        &self,
        path: &str,
        parents: bool,
        mode: Option<u32>,
    ) -> Result<FileEntry, ClientError> {
        let mut fields = json!({"path": path, "parents": parents});
        if let Some(mode) = mode {
            fields["mode"] = json!(mode);
        }
        let result: EntryResult = parse(self.simple("fs_mkdir", fields).await?)?;
        Ok(result.entry)
    }

    pub async fn remove(&self, path: &str, recursive: bool) -> Result<(), ClientError> {
        self.simple("fs_remove", json!({"path": path, "recursive": recursive}))
            .await
            .map(drop)
    }

    pub async fn rename(&self, from: &str, to: &str) -> Result<FileEntry, ClientError> {
        let result: EntryResult = parse(
            self.simple("fs_rename", json!({"path": from, "to": to}))
                .await?,
        )?;
        Ok(result.entry)
    }

    /// Uploads the local file `local` to `path`, with `mode` (default: the
    /// local file's permission bits). Read twice: once for the digest the
    /// server checks, once to send.
    pub async fn upload_file(
        &self,
        local: &Path,
        path: &str,
        mode: Option<u32>,
    ) -> Result<Transferred, ClientError> {
        let (size, digest, local_mode) = hash_file(local).await?;
        let mut file = tokio::fs::File::open(local)
            .await
            .map_err(|err| local_io(local, err))?;
        let (entry, sha256) = self
            .upload_from(
                path,
                &mut file,
                size,
                &digest,
                Some(mode.unwrap_or(local_mode)),
            )
            .await?;
        Ok(Transferred {
            size: entry.size,
            sha256,
            mode: entry.mode,
        })
    }

    async fn upload_from<R: tokio::io::AsyncRead + Unpin>(
        &self,
        path: &str,
        reader: &mut R,
        size: u64,
        sha256: &str,
        mode: Option<u32>,
    ) -> Result<(FileEntry, String), ClientError> {
        let mut fields = json!({"path": path, "size": size, "sha256": sha256});
        if let Some(mode) = mode {
            fields["mode"] = json!(mode);
        }
        let (mut call, frame) = self.register("fs_upload", fields);
        self.send_ordered(Message::text(frame.to_string())).await?;
        let mut sent: u64 = 0;
        let mut buffer = vec![0u8; UPLOAD_FRAME];
        while sent < size {
            let want = usize::try_from(size - sent)
                .unwrap_or(UPLOAD_FRAME)
                .min(UPLOAD_FRAME);
            let n = reader
                .read(&mut buffer[..want])
                .await
                .map_err(|err| ClientError::Invalid(format!("reading the upload: {err}")))?;
            if n == 0 {
                return Err(ClientError::Invalid(format!(
                    "the upload's source ended after {sent} of {size} bytes"
                )));
            }
            sent += n as u64;
            self.send_ordered(Message::Binary(Bytes::copy_from_slice(&buffer[..n])))
                .await?;
        }
        let result = call.result().await?;
        let sha256 = result["sha256"].as_str().unwrap_or_default().to_owned();
        let entry: EntryResult = parse(result)?;
        Ok((entry.entry, sha256))
    }

    /// Downloads `path` into the local file `local` (written beside it and
    /// renamed into place once its digest checks), with the sandbox file's
    /// permission bits.
    pub async fn download_file(
        &self,
        path: &str,
        local: &Path,
    ) -> Result<Transferred, ClientError> {
        let file_name = local
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_default();
        let temp = local.with_file_name(format!(".{file_name}.sandboxctl-part"));
        let mut file = tokio::fs::File::create(&temp)
            .await
            .map_err(|err| local_io(&temp, err))?;
        let outcome = self.download_to(path, &mut file).await;
        let done = match outcome {
            Ok(done) => file
                .flush()
                .await
                .map_err(|err| local_io(&temp, err))
                .map(|()| done),
            Err(err) => Err(err),
        };
        drop(file);
        let finished = match done {
            Ok(done) => set_mode(&temp, done.mode)
                .await
                .and(
                    tokio::fs::rename(&temp, local)
                        .await
                        .map_err(|err| local_io(local, err)),
                )
                .map(|()| done),
            Err(err) => Err(err),
        };
        if finished.is_err() {
            let _ = tokio::fs::remove_file(&temp).await;
        }
        finished
    }

    /// Downloads `path` into `sink`; the digest of what arrived must be the
    /// one the server sent.
    async fn download_to<W: tokio::io::AsyncWrite + Unpin>(
        &self,
        path: &str,
        sink: &mut W,
    ) -> Result<Transferred, ClientError> {
        let mut call = self.call("fs_download", json!({"path": path}))?;
        let mut hasher = Sha256::new();
        let mut received: u64 = 0;
        let mut mode = 0;
        loop {
            match call.next().await? {
                Event::Binary(data) => {
                    received += data.len() as u64;
                    hasher.update(&data);
                    sink.write_all(&data)
                        .await
                        .map_err(|err| ClientError::Invalid(format!("writing {path}: {err}")))?;
                }
                Event::Fs(frame) if frame["event"] == "fs_download" => {
                    mode = frame["mode"].as_u64().unwrap_or(0o644) as u32;
                }
                Event::Fs(frame) => {
                    let result = fs_outcome(frame)?;
                    let sha256 = hex::encode(hasher.finalize());
                    if result["sha256"].as_str() != Some(sha256.as_str())
                        || result["size"].as_u64() != Some(received)
                    {
                        return Err(ClientError::Protocol(format!(
                            "{path}: {received} bytes with SHA-256 {sha256} arrived; the server sent {result}"
                        )));
                    }
                    return Ok(Transferred {
                        size: received,
                        sha256,
                        mode,
                    });
                }
                _ => {}
            }
        }
    }
}

/// Size, SHA-256 and permission bits of a local file.
async fn hash_file(local: &Path) -> Result<(u64, String, u32), ClientError> {
    let mut file = tokio::fs::File::open(local)
        .await
        .map_err(|err| local_io(local, err))?;
    let metadata = file.metadata().await.map_err(|err| local_io(local, err))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = file
            .read(&mut buffer)
            .await
            .map_err(|err| local_io(local, err))?;
        if n == 0 {
            break;
        }
        size += n as u64;
        hasher.update(&buffer[..n]);
    }
    use std::os::unix::fs::PermissionsExt as _;
    Ok((
        size,
        hex::encode(hasher.finalize()),
        metadata.permissions().mode() & 0o7777,
    ))
}

async fn set_mode(local: &Path, mode: u32) -> Result<(), ClientError> {
    use std::os::unix::fs::PermissionsExt as _;
    tokio::fs::set_permissions(local, std::fs::Permissions::from_mode(mode & 0o7777))
        .await
        .map_err(|err| local_io(local, err))
}
