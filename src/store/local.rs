//! The local-directory Store: the embedded default, so one machine runs the whole
//! system with no cloud account, with the same semantics as GCS.
//!
//! Layout: the object `a/b/c.json` is the file `<root>/a/b/c.json`, so an
//! operator can read and edit objects with ordinary tools. Bookkeeping lives
//! under `<root>/.sandboxd/` (keys may not start with `.`): temp files for
//! atomic writes and one lock file per key.
//!
//! # Generations
//! An object's generation is its file's modification time in nanoseconds. Every
//! write, under the key's lock, sets it to `max(now, previous + 1)`, so it grows
//! strictly; an operator's edit with an editor moves it too, so a controller's
//! compare-and-swap notices the edit instead of overwriting it.
//!
//! # Concurrency
//! Writers take an exclusive `flock` on the key's lock file, check the
//! precondition, write a temp file, fsync it, and rename it over the object.
//! `flock` works across processes, so several servers may share one directory.
//! Readers take no lock: a rename is atomic, and the generation is read from
//! the same open file as the bytes.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use controllers::store::{
    BlobReader, BlobSource, Generation, ListPage, ObjectInfo, ObjectKey, PutMode, Store,
    StoreError, Versioned, validate_prefix,
};

/// Where the local store keeps its own files, inside the root.
const BOOKKEEPING_DIR: &str = ".sandboxd";
/// Temp files older than this are left over from a crash and removed on open.
const STALE_TEMP_AGE: Duration = Duration::from_secs(3600);

/// A Store in a local directory.
#[derive(Debug, Clone)]
pub struct LocalStore {
    root: PathBuf,
}

impl LocalStore {
    /// Opens (creating if needed) a store rooted at `root`.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let root = root.into();
        let store = Self { root };
        for dir in [store.temp_dir(), store.locks_dir()] {
            fs::create_dir_all(&dir).map_err(|err| store.io_error(dir.display(), err))?;
        }
        store.remove_stale_temp_files();
        store.check_timestamp_precision()?;
        Ok(store)
    }

    /// Generations need nanosecond modification times; find out at open time,
    /// not after an object was already replaced.
    fn check_timestamp_precision(&self) -> Result<(), StoreError> {
        let probe = self.new_temp_path();
        let wanted = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_123_456_789);
        let result = File::create(&probe)
            .and_then(|file| file.set_modified(wanted))
            .and_then(|()| fs::metadata(&probe))
            .and_then(|metadata| metadata.modified());
        let _ = fs::remove_file(&probe);
        match result {
            Ok(stored) if stored == wanted => Ok(()),
            Ok(_) => Err(StoreError::other(
                self.root.display(),
                "this filesystem does not keep nanosecond modification times, \
                 which the local store needs for generations",
            )),
            Err(err) => Err(self.io_error(self.root.display(), err)),
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn temp_dir(&self) -> PathBuf {
        self.root.join(BOOKKEEPING_DIR).join("tmp")
    }

    fn locks_dir(&self) -> PathBuf {
        self.root.join(BOOKKEEPING_DIR).join("locks")
    }

    fn object_path(&self, key: &ObjectKey) -> PathBuf {
        key.segments()
            .fold(self.root.clone(), |path, s| path.join(s))
    }

    fn lock_path(&self, key: &ObjectKey) -> PathBuf {
        let mut path = key
            .segments()
            .fold(self.locks_dir(), |path, s| path.join(s));
        path.as_mut_os_string().push(".lock");
        path
    }

    fn new_temp_path(&self) -> PathBuf {
        self.temp_dir()
            .join(uuid::Uuid::new_v4().simple().to_string())
    }

    fn io_error(&self, what: impl std::fmt::Display, err: io::Error) -> StoreError {
        StoreError::other(what, err)
    }

    fn remove_stale_temp_files(&self) {
        let Ok(entries) = fs::read_dir(self.temp_dir()) else {
            return;
        };
        #[allow(
            clippy::disallowed_methods,
            reason = "compared with files' modification times on this host"
        )]
        let now = SystemTime::now();
        for entry in entries.flatten() {
            let stale = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|modified| now.duration_since(modified).ok())
                .is_some_and(|age| age > STALE_TEMP_AGE);
            // Directories are checkpoint images a crashed runtime was
            // writing here (`Store::staging_dir`).
            if stale && entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                let _ = fs::remove_dir_all(entry.path());
            } else if stale {
                let _ = fs::remove_file(entry.path());
            }
        }
    }

    /// Moves a finished temp file into place under `key`, if `mode` allows,
    /// holding the key's lock. Removes the temp file on failure.
    fn commit(
        &self,
        key: &ObjectKey,
        temp: &Path,
        mode: PutMode,
    ) -> Result<Generation, StoreError> {
        let result = self.commit_locked(key, temp, mode);
        if result.is_err() {
            let _ = fs::remove_file(temp);
        }
        result
    }

    fn commit_locked(
        &self,
        key: &ObjectKey,
        temp: &Path,
        mode: PutMode,
    ) -> Result<Generation, StoreError> {
        let _lock = self.lock_key(key)?;
        let path = self.object_path(key);
        let current = match fs::metadata(&path) {
            Ok(metadata) => Some(generation_of(&metadata).map_err(|err| self.io_error(key, err))?),
            Err(err) if err.kind() == io::ErrorKind::NotFound => None,
            Err(err) => return Err(self.io_error(key, err)),
        };
        mode.check(key, current)?;

        let generation = next_generation(current);
        let file = OpenOptions::new()
            .write(true)
            .open(temp)
            .map_err(|err| self.io_error(key, err))?;
        file.set_modified(UNIX_EPOCH + Duration::from_nanos(generation.0.unsigned_abs()))
            .and_then(|()| file.sync_all())
            .map_err(|err| self.io_error(key, err))?;
        drop(file);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|err| self.io_error(key, err))?;
        }
        fs::rename(temp, &path).map_err(|err| self.io_error(key, err))?;
        if let Some(parent) = path.parent() {
            // Make the rename durable; failure here loses nothing visible.
            let _ = File::open(parent).and_then(|dir| dir.sync_all());
        }
        let stored = fs::metadata(&path)
            .and_then(|m| generation_of(&m))
            .map_err(|err| self.io_error(key, err))?;
        if stored != generation {
            return Err(StoreError::other(
                key,
                "this filesystem does not keep nanosecond modification times, \
                 which the local store needs for generations",
            ));
        }
        Ok(generation)
    }

    /// Takes the key's exclusive lock (across threads and processes).
    fn lock_key(&self, key: &ObjectKey) -> Result<File, StoreError> {
        let path = self.lock_path(key);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|err| self.io_error(key, err))?;
        }
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|err| self.io_error(key, err))?;
        file.lock().map_err(|err| self.io_error(key, err))?;
        Ok(file)
    }

    fn get_blocking(&self, key: &ObjectKey) -> Result<Versioned, StoreError> {
        let mut file = match File::open(self.object_path(key)) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::not_found(key));
            }
            Err(err) => return Err(self.io_error(key, err)),
        };
        let metadata = file.metadata().map_err(|err| self.io_error(key, err))?;
        if !metadata.is_file() {
            return Err(StoreError::not_found(key));
        }
        let generation = generation_of(&metadata).map_err(|err| self.io_error(key, err))?;
        let mut data = Vec::with_capacity(usize::try_from(metadata.len()).unwrap_or(0));
        file.read_to_end(&mut data)
            .map_err(|err| self.io_error(key, err))?;
        Ok(Versioned {
            data: Bytes::from(data),
            generation,
        })
    }

    fn put_blocking(
        &self,
        key: &ObjectKey,
        data: &[u8],
        mode: PutMode,
    ) -> Result<Generation, StoreError> {
        let temp = self.new_temp_path();
        let written = File::create(&temp).and_then(|mut file| file.write_all(data));
        if let Err(err) = written {
            let _ = fs::remove_file(&temp);
            return Err(self.io_error(key, err));
        }
        self.commit(key, &temp, mode)
    }

    fn delete_blocking(&self, key: &ObjectKey) -> Result<(), StoreError> {
        let _lock = self.lock_key(key)?;
        match fs::remove_file(self.object_path(key)) {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Err(StoreError::not_found(key)),
            Err(err) => Err(self.io_error(key, err)),
        }
    }

    fn list_blocking(
        &self,
        prefix: &str,
        page_token: Option<&str>,
    ) -> Result<ListPage, StoreError> {
        // Walk only the directory the prefix pins down.
        let (dir_part, _) = prefix.rsplit_once('/').unwrap_or(("", prefix));
        let start = dir_part
            .split('/')
            .filter(|s| !s.is_empty())
            .fold(self.root.clone(), |path, s| path.join(s));
        let mut objects = Vec::new();
        let mut pending = vec![(start, dir_part.to_owned())];
        while let Some((dir, key_prefix)) = pending.pop() {
            let entries = match fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
                Err(err) if err.kind() == io::ErrorKind::NotADirectory => continue,
                Err(err) => return Err(self.io_error(prefix, err)),
            };
            for entry in entries {
                let entry = entry.map_err(|err| self.io_error(prefix, err))?;
                let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                    continue;
                };
                let key = if key_prefix.is_empty() {
                    name
                } else {
                    format!("{key_prefix}/{name}")
                };
                // Skips bookkeeping, editor backups and anything not a valid key.
                let Ok(object_key) = ObjectKey::new(key.as_str()) else {
                    continue;
                };
                let file_type = entry.file_type().map_err(|err| self.io_error(&key, err))?;
                if file_type.is_dir() {
                    pending.push((entry.path(), key));
                } else if file_type.is_file() && key.starts_with(prefix) {
                    if page_token.is_some_and(|after| key.as_str() <= after) {
                        continue;
                    }
                    let metadata = entry.metadata().map_err(|err| self.io_error(&key, err))?;
                    objects.push(ObjectInfo {
                        key: object_key,
                        size: metadata.len(),
                        generation: generation_of(&metadata)
                            .map_err(|err| self.io_error(&key, err))?,
                    });
                }
            }
        }
        objects.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(ListPage::from_sorted(objects))
    }

    /// Runs blocking filesystem work off the async runtime.
    async fn blocking<T: Send + 'static>(
        &self,
        what: &ObjectKey,
        work: impl FnOnce(Self) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || work(store))
            .await
            .map_err(|err| StoreError::other(what, format!("filesystem task failed: {err}")))?
    }
}

#[async_trait]
impl Store for LocalStore {
    async fn get(&self, key: &ObjectKey) -> Result<Versioned, StoreError> {
        let owned = key.clone();
        self.blocking(key, move |store| store.get_blocking(&owned))
            .await
    }

    async fn put(
        &self,
        key: &ObjectKey,
        data: Bytes,
        mode: PutMode,
    ) -> Result<Generation, StoreError> {
        let owned = key.clone();
        self.blocking(key, move |store| store.put_blocking(&owned, &data, mode))
            .await
    }

    async fn list_page(
        &self,
        prefix: &str,
        page_token: Option<String>,
    ) -> Result<ListPage, StoreError> {
        validate_prefix(prefix)?;
        let store = self.clone();
        let prefix = prefix.to_owned();
        tokio::task::spawn_blocking(move || store.list_blocking(&prefix, page_token.as_deref()))
            .await
            .map_err(|err| StoreError::other("list", format!("filesystem task failed: {err}")))?
    }

    async fn delete(&self, key: &ObjectKey) -> Result<(), StoreError> {
        let owned = key.clone();
        self.blocking(key, move |store| store.delete_blocking(&owned))
            .await
    }

    async fn upload_blob(
        &self,
        key: &ObjectKey,
        source: BlobSource,
    ) -> Result<ObjectInfo, StoreError> {
        let temp = self.new_temp_path();
        let copied = match source {
            BlobSource::File(path) => tokio::fs::copy(&path, &temp).await,
            BlobSource::Reader(mut reader) => match tokio::fs::File::create(&temp).await {
                Ok(mut file) => tokio::io::copy(&mut reader, &mut file).await,
                Err(err) => Err(err),
            },
        };
        let size = match copied {
            Ok(size) => size,
            Err(err) => {
                let _ = tokio::fs::remove_file(&temp).await;
                return Err(self.io_error(key, err));
            }
        };
        let owned = key.clone();
        let generation = self
            .blocking(key, move |store| {
                store.commit(&owned, &temp, PutMode::Overwrite)
            })
            .await?;
        Ok(ObjectInfo {
            key: key.clone(),
            size,
            generation,
        })
    }

    /// Moves the file into place (a rename when it is on this filesystem,
    /// else a copy): a checkpoint image is never copied within one disk. On
    /// failure the file is put back where it was.
    async fn adopt_blob(&self, key: &ObjectKey, path: PathBuf) -> Result<ObjectInfo, StoreError> {
        let temp = self.new_temp_path();
        let moved = match tokio::fs::rename(&path, &temp).await {
            Ok(()) => Ok(()),
            Err(err) if err.kind() == io::ErrorKind::CrossesDevices => {
                tokio::fs::copy(&path, &temp).await.map(drop)
            }
            Err(err) => Err(err),
        };
        if let Err(err) = moved {
            let _ = tokio::fs::remove_file(&temp).await;
            return Err(self.io_error(key, err));
        }
        let size = match tokio::fs::metadata(&temp).await {
            Ok(metadata) => metadata.len(),
            Err(err) => return Err(self.io_error(key, err)),
        };
        let owned = key.clone();
        let staged = temp.clone();
        let generation = self
            .blocking(key, move |store| {
                store.commit_locked(&owned, &staged, PutMode::Overwrite)
            })
            .await;
        match generation {
            Ok(generation) => {
                // A copy across filesystems leaves the original behind.
                let _ = tokio::fs::remove_file(&path).await;
                Ok(ObjectInfo {
                    key: key.clone(),
                    size,
                    generation,
                })
            }
            Err(err) => {
                if tokio::fs::rename(&temp, &path).await.is_err() {
                    let _ = tokio::fs::remove_file(&temp).await;
                }
                Err(err)
            }
        }
    }

    fn local_path(&self, key: &ObjectKey) -> Option<PathBuf> {
        Some(self.object_path(key))
    }

    fn staging_dir(&self) -> Option<PathBuf> {
        Some(self.temp_dir())
    }

    /// A file copy (`copy_file_range`: a reflink where the filesystem has
    /// them), not a hard link: committing sets the new key's generation as
    /// its modification time, which a shared inode would change for both.
    async fn copy_blob(&self, from: &ObjectKey, to: &ObjectKey) -> Result<ObjectInfo, StoreError> {
        let source = self.object_path(from);
        match tokio::fs::metadata(&source).await {
            Ok(_) => self.upload_blob(to, BlobSource::File(source)).await,
            Err(err) if err.kind() == io::ErrorKind::NotFound => Err(StoreError::not_found(from)),
            Err(err) => Err(self.io_error(from, err)),
        }
    }

    async fn download_blob(&self, key: &ObjectKey) -> Result<BlobReader, StoreError> {
        match tokio::fs::File::open(self.object_path(key)).await {
            Ok(file) => Ok(Box::pin(file)),
            Err(err) if err.kind() == io::ErrorKind::NotFound => Err(StoreError::not_found(key)),
            Err(err) => Err(self.io_error(key, err)),
        }
    }
}

/// A file's generation: its modification time in nanoseconds since the epoch.
fn generation_of(metadata: &fs::Metadata) -> io::Result<Generation> {
    let since_epoch = metadata
        .modified()?
        .duration_since(UNIX_EPOCH)
        .map_err(|_| io::Error::other("modification time before 1970"))?;
    i64::try_from(since_epoch.as_nanos())
        .map(Generation)
        .map_err(|_| io::Error::other("modification time out of range"))
}

/// The next generation: the current time, but always above the previous one.
fn next_generation(previous: Option<Generation>) -> Generation {
    #[allow(
        clippy::disallowed_methods,
        reason = "the local store's generations are host time, like GCS's (and its files' mtimes)"
    )]
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .ok()
        .and_then(|d| i64::try_from(d.as_nanos()).ok())
        .unwrap_or(1);
    Generation(previous.map_or(now, |previous| now.max(previous.0 + 1)))
}
