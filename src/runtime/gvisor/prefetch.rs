//! A handoff's checkpoint image, fetched before the hold arrives, and the
//! image of a checkpoint just taken here, kept for a restore here
//! (`docs/decisions/0024-the-taker-fetches-the-image-before-the-transfer.md`).
//!
//! A taker learns which image a handoff will restore (its id is derived from
//! the sandbox, the holder's epoch and the taker) while it waits. It watches
//! for that object and downloads it the moment the holder's upload lands,
//! while the holder writes the transfer and the taker's next poll finds it:
//! the restore then starts on a local file. The bytes prove nothing by
//! themselves: they are hashed as they arrive, and a restore uses them only
//! when size and digest are the manifest's; otherwise it downloads as before.
//!
//! Bounded: at most [`MAX_PREFETCHES`] at once, each watching for
//! [`WATCH_FOR`] at most, and a download nobody takes is removed after
//! [`KEEP_FOR`]. Files are owner-tagged temporaries in the state directory,
//! so a crashed server's are swept at the next start.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use controllers::api::SandboxId;
use controllers::store::{ObjectKey, Store, StoreError};
use tokio::sync::watch;

use crate::runtime::checkpoint::transfer::write_hashed;

/// Watches and downloads at once, for all sandboxes.
const MAX_PREFETCHES: usize = 8;
/// How often a missing image is looked for (one read each), start to start.
const POLL: Duration = Duration::from_millis(50);
/// How long an image is watched for before the watch gives up.
const WATCH_FOR: Duration = Duration::from_secs(20);
/// How long a downloaded image waits for its restore.
const KEEP_FOR: Duration = Duration::from_secs(60);
/// How long the image of a checkpoint taken here is kept for a restore here.
const KEEP_TAKEN_FOR: Duration = Duration::from_secs(30);
/// The largest image of a checkpoint taken here that is kept (on Cloud Run
/// local files are memory): with [`MAX_PREFETCHES`], 256 MiB at most.
pub(super) const KEEP_TAKEN_MAX: u64 = 32 << 20;
/// Temporary file kind (`Owner::temporary`).
pub(super) const TEMPORARY_KIND: &str = "prefetch";

/// Where one prefetch is.
#[derive(Debug, Clone)]
enum State {
    /// Not in the store yet: looked for every [`POLL`].
    Watching,
    Downloading,
    /// Downloaded, with its SHA-256 (hex) and size.
    Ready(Arc<Downloaded>),
    /// Gave up, failed, or was taken.
    Gone,
}

#[derive(Debug)]
pub(super) struct Downloaded {
    pub path: PathBuf,
    pub sha256: String,
    pub size: u64,
}

#[derive(Debug)]
struct Prefetch {
    sandbox: SandboxId,
    state: watch::Receiver<State>,
    /// Set when a restore took it or gave up on it: the task stops, and a
    /// file it still writes is removed.
    abandoned: Arc<AtomicBool>,
}

/// The prefetches of one runtime, by image key.
#[derive(Debug, Default)]
pub(super) struct Prefetches {
    entries: Arc<Mutex<HashMap<ObjectKey, Prefetch>>>,
}

impl Prefetches {
    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<ObjectKey, Prefetch>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts watching for `image` of `sandbox` unless it is watched already
    /// or [`MAX_PREFETCHES`] are under way; `dest` is where it goes.
    pub(super) fn start(
        &self,
        store: Arc<dyn Store>,
        sandbox: &SandboxId,
        image: &ObjectKey,
        dest: PathBuf,
    ) {
        let Some((state, abandoned)) = self.insert(sandbox, image, State::Watching) else {
            return;
        };
        let entries = self.entries.clone();
        let image = image.clone();
        tracing::debug!(%sandbox, %image, "watching for a handoff's image");
        tokio::spawn(async move {
            let outcome = fetch(store.as_ref(), &image, &dest, &state, &abandoned).await;
            let downloaded = match outcome {
                Some(downloaded) if !abandoned.load(Ordering::Acquire) => downloaded,
                other => {
                    // Given up, failed, or nobody wants it any more.
                    if other.is_some() {
                        let _ = tokio::fs::remove_file(&dest).await;
                    }
                    forget(&entries, &image, &abandoned);
                    state.send_replace(State::Gone);
                    return;
                }
            };
            state.send_replace(State::Ready(downloaded.clone()));
            expire(&entries, &image, &abandoned, &state, &downloaded, KEEP_FOR).await;
        });
    }

    /// Keeps the image of a checkpoint just taken here, for a restore of it
    /// here within [`KEEP_TAKEN_FOR`] (a client that checkpoints and
    /// attaches again): `downloaded` is a link to the file runsc wrote, with
    /// the digest hashed as it was written. Not kept (the file removed) when
    /// [`MAX_PREFETCHES`] are under way or it is over [`KEEP_TAKEN_MAX`].
    pub(super) fn keep(&self, sandbox: &SandboxId, image: &ObjectKey, downloaded: Downloaded) {
        let downloaded = Arc::new(downloaded);
        let kept = if downloaded.size <= KEEP_TAKEN_MAX {
            self.insert(sandbox, image, State::Ready(downloaded.clone()))
        } else {
            None
        };
        let Some((state, abandoned)) = kept else {
            let _ = std::fs::remove_file(&downloaded.path);
            return;
        };
        let entries = self.entries.clone();
        let image = image.clone();
        tokio::spawn(async move {
            expire(
                &entries,
                &image,
                &abandoned,
                &state,
                &downloaded,
                KEEP_TAKEN_FOR,
            )
            .await;
        });
    }

    /// Enters `image` of `sandbox` in `state`, unless it is there already or
    /// [`MAX_PREFETCHES`] are: its state's sender and abandon flag.
    fn insert(
        &self,
        sandbox: &SandboxId,
        image: &ObjectKey,
        state: State,
    ) -> Option<(watch::Sender<State>, Arc<AtomicBool>)> {
        let mut entries = self.entries();
        if entries.contains_key(image) || entries.len() >= MAX_PREFETCHES {
            return None;
        }
        let (state, receiver) = watch::channel(state);
        let abandoned = Arc::new(AtomicBool::new(false));
        entries.insert(
            image.clone(),
            Prefetch {
                sandbox: sandbox.clone(),
                state: receiver,
                abandoned: abandoned.clone(),
            },
        );
        Some((state, abandoned))
    }

    /// While `image` is watched for and not found yet: a future that
    /// completes once it is found or the watch ends.
    pub(super) fn awaited(&self, image: &ObjectKey) -> Option<impl Future<Output = bool> + use<>> {
        let watching = self
            .entries()
            .get(image)
            .is_some_and(|prefetch| matches!(&*prefetch.state.borrow(), State::Watching));
        watching.then(|| self.found(image))
    }

    /// Completes when `image`'s watch has found it (true: it is being or
    /// was downloaded) or ended without it (false; false at once when it is
    /// not watched).
    pub(super) fn found(&self, image: &ObjectKey) -> impl Future<Output = bool> + use<> {
        let state = self
            .entries()
            .get(image)
            .map(|prefetch| prefetch.state.clone());
        async move {
            let Some(mut state) = state else {
                return false;
            };
            loop {
                let seen = match &*state.borrow_and_update() {
                    State::Watching => None,
                    State::Downloading | State::Ready(_) => Some(true),
                    State::Gone => Some(false),
                };
                if let Some(found) = seen {
                    return found;
                }
                if state.changed().await.is_err() {
                    return false;
                }
            }
        }
    }

    /// The downloaded `image`, for a restore of it: waits for a download
    /// under way, never for one not begun (the restore then downloads it
    /// itself). Every other prefetch of `sandbox` is given up. The file is
    /// the caller's.
    pub(super) async fn take(
        &self,
        sandbox: &SandboxId,
        image: &ObjectKey,
    ) -> Option<Arc<Downloaded>> {
        let (wanted, others) = {
            let mut entries = self.entries();
            let wanted = entries.remove(image);
            let others: Vec<ObjectKey> = entries
                .iter()
                .filter(|(_, prefetch)| &prefetch.sandbox == sandbox)
                .map(|(key, _)| key.clone())
                .collect();
            let others: Vec<Prefetch> = others
                .iter()
                .filter_map(|key| entries.remove(key))
                .collect();
            (wanted, others)
        };
        for other in others {
            other.abandoned.store(true, Ordering::Release);
        }
        let mut prefetch = wanted?;
        loop {
            let state = prefetch.state.borrow_and_update().clone();
            match state {
                State::Downloading => {}
                State::Ready(downloaded) => {
                    if prefetch.abandoned.swap(true, Ordering::AcqRel) {
                        return None;
                    }
                    return Some(downloaded);
                }
                State::Watching | State::Gone => {
                    prefetch.abandoned.store(true, Ordering::Release);
                    return None;
                }
            }
            if prefetch.state.changed().await.is_err() {
                return None;
            }
        }
    }
}

/// After `after`, removes `downloaded` if no restore took it meanwhile.
async fn expire(
    entries: &Mutex<HashMap<ObjectKey, Prefetch>>,
    image: &ObjectKey,
    abandoned: &Arc<AtomicBool>,
    state: &watch::Sender<State>,
    downloaded: &Downloaded,
    after: Duration,
) {
    tokio::time::sleep(after).await;
    if !abandoned.swap(true, Ordering::AcqRel) {
        tracing::debug!(%image, "an image kept for a restore was not restored; removed");
        forget(entries, image, abandoned);
        state.send_replace(State::Gone);
        let _ = tokio::fs::remove_file(&downloaded.path).await;
    }
}

/// Removes `image`'s entry if it is still the one `abandoned` belongs to.
fn forget(
    entries: &Mutex<HashMap<ObjectKey, Prefetch>>,
    image: &ObjectKey,
    abandoned: &Arc<AtomicBool>,
) {
    let mut entries = entries.lock().unwrap_or_else(PoisonError::into_inner);
    if entries
        .get(image)
        .is_some_and(|prefetch| Arc::ptr_eq(&prefetch.abandoned, abandoned))
    {
        entries.remove(image);
    }
}

/// Watches for `image` and downloads it to `dest` once it exists; `None`
/// when it never came within [`WATCH_FOR`], the download failed (the file
/// is then removed), or the prefetch was abandoned while watching.
async fn fetch(
    store: &dyn Store,
    image: &ObjectKey,
    dest: &Path,
    state: &watch::Sender<State>,
    abandoned: &AtomicBool,
) -> Option<Arc<Downloaded>> {
    #[allow(
        clippy::disallowed_methods,
        reason = "waits on runsc and the store on this host for a bounded time (tokio's clock, which a paused runtime moves); no simulation runs the gVisor runtime"
    )]
    let deadline = tokio::time::Instant::now() + WATCH_FOR;
    // Each look is the download itself: found, it streams at once. Looks
    // start every POLL (not POLL after the last answer): the image lands
    // at a random moment, and the wait for the next look is the restore's.
    let reader = loop {
        #[allow(
            clippy::disallowed_methods,
            reason = "waits on runsc and the store on this host for a bounded time (tokio's clock, which a paused runtime moves); no simulation runs the gVisor runtime"
        )]
        let look = tokio::time::Instant::now();
        if abandoned.load(Ordering::Acquire) || look >= deadline {
            return None;
        }
        match store.download_blob(image).await {
            Ok(reader) => break reader,
            Err(StoreError::NotFound { .. }) => {}
            Err(err) => tracing::debug!(%image, %err, "looking for a handoff's image"),
        }
        tokio::time::sleep_until(look + POLL).await;
    };
    state.send_replace(State::Downloading);
    match write_hashed(reader, image, dest).await {
        Ok((sha256, size)) => Some(Arc::new(Downloaded {
            path: dest.to_owned(),
            sha256,
            size,
        })),
        Err(err) => {
            tracing::debug!(%image, %err, "prefetching a handoff's image failed");
            let _ = tokio::fs::remove_file(dest).await;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use controllers::store::PutMode;
    use controllers::testing::MemoryStore;
    use sha2::{Digest, Sha256};

    use super::*;

    fn key(name: &str) -> ObjectKey {
        ObjectKey::new(format!("sandbox_checkpoints/{name}/checkpoint.img")).unwrap()
    }

    fn sandbox(n: u128) -> SandboxId {
        SandboxId::from_u128(n)
    }

    /// Waits (real time, bounded) until `done` holds.
    async fn eventually(mut done: impl FnMut() -> bool) {
        for _ in 0..200 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("not within 2 s");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_image_that_appears_later_is_downloaded_hashed_and_taken_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(MemoryStore::new());
        let prefetches = Prefetches::default();
        let image = key("a");
        prefetches.start(store.clone(), &sandbox(1), &image, dir.path().join("a.img"));
        // Watching: looked for, not there.
        let before = store.operations();
        eventually(|| store.operations() >= before + 2).await;
        let bytes = Bytes::from_static(b"the memory of a sandbox");
        store
            .put(&image, bytes.clone(), PutMode::Overwrite)
            .await
            .unwrap();
        eventually(|| dir.path().join("a.img").exists()).await;
        // Give the download its moment to finish, then take it.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let taken = prefetches.take(&sandbox(1), &image).await.unwrap();
        assert_eq!(taken.size, bytes.len() as u64);
        assert_eq!(taken.sha256, hex::encode(Sha256::digest(&bytes)));
        assert_eq!(std::fs::read(&taken.path).unwrap(), bytes);
        assert!(prefetches.take(&sandbox(1), &image).await.is_none(), "once");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_restore_before_the_image_exists_stops_the_watch_and_its_siblings() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(MemoryStore::new());
        let prefetches = Prefetches::default();
        let (one, two) = (key("b"), key("c"));
        prefetches.start(store.clone(), &sandbox(2), &one, dir.path().join("b.img"));
        prefetches.start(store.clone(), &sandbox(2), &two, dir.path().join("c.img"));
        // Asked again while watched: nothing new starts.
        prefetches.start(store.clone(), &sandbox(2), &one, dir.path().join("b2.img"));
        assert_eq!(prefetches.entries().len(), 2);
        eventually(|| store.operations() >= 4).await;
        assert!(prefetches.take(&sandbox(2), &one).await.is_none());
        assert!(
            prefetches.entries().is_empty(),
            "the other image of the sandbox too"
        );
        // Both watches stop: no more reads.
        tokio::time::sleep(POLL * 3).await;
        let settled = store.operations();
        tokio::time::sleep(POLL * 4).await;
        assert_eq!(store.operations(), settled);
        // Appearing now, nobody downloads it.
        store
            .put(&one, Bytes::from_static(b"late"), PutMode::Overwrite)
            .await
            .unwrap();
        tokio::time::sleep(POLL * 4).await;
        assert!(std::fs::read_dir(dir.path()).unwrap().next().is_none());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_image_taken_here_is_kept_for_one_restore_unless_too_big() {
        let dir = tempfile::tempdir().unwrap();
        let prefetches = Prefetches::default();
        let (small, big) = (dir.path().join("small.img"), dir.path().join("big.img"));
        std::fs::write(&small, b"image").unwrap();
        std::fs::write(&big, b"image").unwrap();
        let kept = |path: &Path, size| Downloaded {
            path: path.to_owned(),
            sha256: "digest".to_owned(),
            size,
        };
        prefetches.keep(&sandbox(3), &key("small"), kept(&small, 5));
        prefetches.keep(&sandbox(3), &key("big"), kept(&big, KEEP_TAKEN_MAX + 1));
        assert!(!big.exists(), "too big to keep: removed at once");
        let taken = prefetches.take(&sandbox(3), &key("small")).await.unwrap();
        assert_eq!((taken.path.as_path(), taken.size), (small.as_path(), 5));
        assert!(prefetches.take(&sandbox(3), &key("small")).await.is_none());
        assert!(prefetches.take(&sandbox(3), &key("big")).await.is_none());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_more_than_the_bound_watch_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(MemoryStore::new());
        let prefetches = Prefetches::default();
        for n in 0..(MAX_PREFETCHES as u128 + 3) {
            let image = key(&format!("{n:032x}"));
            prefetches.start(
                store.clone(),
                &sandbox(n),
                &image,
                dir.path().join(format!("{n}.img")),
            );
        }
        assert_eq!(prefetches.entries().len(), MAX_PREFETCHES);
    }
}
