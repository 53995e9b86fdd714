//! Hashing a checkpoint image, and pushing it to disk, while `runsc
//! checkpoint` is still writing it.
//!
//! runsc writes the image front to back, at about a third of this disk's
//! speed. Done after it, the sha256 is one more read and the fsync that makes
//! the checkpoint durable waits for every byte (about 0.4 s for 200 MB here,
//! since the kernel starts no writeback of its own below gigabytes of dirty
//! pages). A follower thread reads just behind the writer instead, hashing
//! what it reads, and a flusher thread beside it `fdatasync`s every 16 MB
//! read (so the hashing never waits for the disk), so when runsc exits only
//! the last stretch is left to hash and flush. The follower reads the bytes
//! the store keeps, so the digest is of the file as it is on disk (restores
//! verify it).

use std::fs::File;
use std::io::{self, Read as _};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sha2::{Digest as _, Sha256};

/// How far the follower reads before flushing what it read.
const FLUSH_EVERY: u64 = 16 * 1024 * 1024;
/// How long the follower waits when it has caught up with the writer.
const CAUGHT_UP_WAIT: Duration = Duration::from_millis(2);
const BUFFER: usize = 1024 * 1024;

/// The sha256 (hex) and size of a followed image.
pub type Followed = (String, u64);

/// A follower of one image file being written by another process. Dropped
/// without [`ImageFollower::finish`] (the checkpoint's task was cancelled,
/// e.g. at shutdown), its thread stops at its next read: a blocking task
/// left waiting for a writer that is gone would keep the runtime, and so
/// the process, from ever exiting.
pub struct ImageFollower {
    flags: Arc<Flags>,
    task: tokio::task::JoinHandle<io::Result<Followed>>,
}

/// What the follower's owner tells its thread.
#[derive(Default)]
struct Flags {
    /// The writer has exited: read to the end, then stop.
    writer_done: AtomicBool,
    /// Stop now.
    cancelled: AtomicBool,
}

impl ImageFollower {
    /// Starts following `path`, which need not exist yet. With `durable`,
    /// the follower flushes what it has read as it goes and the file's data
    /// is on disk when [`ImageFollower::finish`] returns.
    pub fn start(path: PathBuf, durable: bool) -> Self {
        let flags = Arc::new(Flags::default());
        let shared = flags.clone();
        let task = tokio::task::spawn_blocking(move || follow(&path, durable, &shared));
        Self { flags, task }
    }

    /// Call once the writer has exited: reads the rest and returns the
    /// digest and size of the whole file.
    pub async fn finish(mut self) -> io::Result<Followed> {
        self.flags.writer_done.store(true, Ordering::Release);
        (&mut self.task).await.map_err(io::Error::other)?
    }

    /// Stops following (the writer failed); waits for the thread so it no
    /// longer holds the file open.
    pub async fn abandon(mut self) {
        self.flags.cancelled.store(true, Ordering::Release);
        let _ = (&mut self.task).await;
    }
}

impl Drop for ImageFollower {
    fn drop(&mut self) {
        self.flags.cancelled.store(true, Ordering::Release);
    }
}

fn cancelled() -> io::Error {
    io::Error::new(io::ErrorKind::Interrupted, "the image follower was stopped")
}

fn follow(path: &std::path::Path, durable: bool, flags: &Flags) -> io::Result<Followed> {
    let writer_done = &flags.writer_done;
    let mut file = open_when_created(path, flags)?;
    // The flushes run on a thread of their own: an fsync waits for the disk,
    // and the hashing must not wait with it.
    let flusher = durable.then(|| Flusher::start(&file)).transpose()?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; BUFFER];
    let mut size = 0u64;
    let mut flushed = 0u64;
    // Set once the writer is known to have exited: the next read that finds
    // nothing has found the true end.
    let mut final_pass = false;
    loop {
        if flags.cancelled.load(Ordering::Acquire) {
            return Err(cancelled());
        }
        let read = file.read(&mut buffer)?;
        if read > 0 {
            hasher.update(&buffer[..read]);
            size += read as u64;
            if let Some(flusher) = &flusher
                && size - flushed >= FLUSH_EVERY
            {
                flusher.flush_soon();
                flushed = size;
            }
            continue;
        }
        if final_pass {
            break;
        }
        // Loaded before the next read: everything the writer wrote before
        // exiting is visible to it.
        if writer_done.load(Ordering::Acquire) {
            final_pass = true;
        } else {
            std::thread::sleep(CAUGHT_UP_WAIT);
        }
    }
    if let Some(flusher) = flusher {
        flusher.finish()?;
        file.sync_data()?;
    }
    Ok((hex::encode(hasher.finalize()), size))
}

/// A thread that flushes the followed file's data to disk when asked,
/// while the follower goes on hashing.
struct Flusher {
    ask: std::sync::mpsc::Sender<()>,
    thread: std::thread::JoinHandle<io::Result<()>>,
}

impl Flusher {
    fn start(file: &File) -> io::Result<Self> {
        let file = file.try_clone()?;
        let (ask, asked) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("image-flusher".to_owned())
            .spawn(move || {
                while asked.recv().is_ok() {
                    // Requests that came in meanwhile are covered by one flush.
                    while asked.try_recv().is_ok() {}
                    file.sync_data()?;
                }
                Ok(())
            })?;
        Ok(Self { ask, thread })
    }

    fn flush_soon(&self) {
        // The thread only stops once `ask` is dropped, or on an error that
        // `finish` reports.
        let _ = self.ask.send(());
    }

    /// Waits for the flushes asked for so far.
    fn finish(self) -> io::Result<()> {
        drop(self.ask);
        self.thread
            .join()
            .map_err(|_| io::Error::other("the image flusher panicked"))?
    }
}

/// Opens `path` as soon as the writer has created it; `NotFound` if the
/// writer exits without creating it.
fn open_when_created(path: &std::path::Path, flags: &Flags) -> io::Result<File> {
    loop {
        if flags.cancelled.load(Ordering::Acquire) {
            return Err(cancelled());
        }
        let finished = flags.writer_done.load(Ordering::Acquire);
        match File::open(path) {
            Ok(file) => return Ok(file),
            Err(err) if err.kind() == io::ErrorKind::NotFound && !finished => {
                std::thread::sleep(CAUGHT_UP_WAIT);
            }
            Err(err) => return Err(err),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    fn sha256_hex(bytes: &[u8]) -> String {
        hex::encode(Sha256::digest(bytes))
    }

    /// A writer that creates the file late and writes in uneven pieces with
    /// pauses: the follower's digest is the whole file's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn digest_of_a_file_written_while_followed_is_the_whole_files() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("checkpoint.img");
        let content: Vec<u8> = (0..(40 * 1024 * 1024 + 12_345))
            .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        let follower = ImageFollower::start(path.clone(), true);
        let written = content.clone();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            let mut file = File::create(&path).expect("create");
            for (index, piece) in written.chunks(3 * 1024 * 1024 + 17).enumerate() {
                file.write_all(piece).expect("write");
                if index % 3 == 0 {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        });
        tokio::task::spawn_blocking(move || writer.join().expect("writer"))
            .await
            .expect("join");
        let (sha256, size) = follower.finish().await.expect("followed");
        assert_eq!(size, content.len() as u64);
        assert_eq!(sha256, sha256_hex(&content));
    }

    /// A follower dropped while its writer has not even created the file
    /// (its checkpoint cancelled) lets the runtime shut down: a blocking task
    /// that never ends would hang the process at exit.
    #[test]
    fn a_dropped_follower_lets_the_runtime_shut_down() {
        let dir = tempfile::tempdir().expect("temp dir");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .expect("runtime");
        let follower = {
            let _entered = runtime.enter();
            ImageFollower::start(dir.path().join("never.img"), true)
        };
        drop(follower);
        let started = std::time::Instant::now();
        drop(runtime);
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the runtime waited {:?} for the follower",
            started.elapsed()
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_writer_that_never_creates_the_file_is_not_found() {
        let dir = tempfile::tempdir().expect("temp dir");
        let follower = ImageFollower::start(dir.path().join("never.img"), false);
        let err = follower.finish().await.expect_err("no file");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}
