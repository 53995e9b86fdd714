//! Which server process owns a container under a shared runsc root.
//!
//! Several servers on one machine may share the default runtime directory
//! (`/run/sandboxd`). Startup removes what a crashed server left there, and
//! used to remove every container under the root, including those of the
//! other servers still running (docs/security.md). Now each runtime takes an owner
//! tag, holds an exclusive `flock` on `owners/<tag>.lock` for as long as it
//! lives, and names its containers `sbx<tag>-…`. Startup removes only the
//! containers whose owner's lock nobody holds (the process is gone: the
//! kernel drops a dead process's locks) and those of the format before tags.

use std::fs::File;
use std::path::{Path, PathBuf};

/// Length of an owner tag (hex digits).
const TAG_LEN: usize = 8;

/// This runtime's ownership: its tag and the held lock.
#[derive(Debug)]
pub struct Owner {
    tag: String,
    /// Held (locked) until the runtime is dropped.
    _lock: File,
    dir: PathBuf,
}

impl Owner {
    /// Takes a fresh tag under `dir` (created if missing) and locks it.
    pub fn claim(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        loop {
            let tag = format!("{:08x}", rand::random::<u32>());
            let path = dir.join(format!("{tag}.lock"));
            let file = match File::options().write(true).create_new(true).open(&path) {
                Ok(file) => file,
                Err(err) if err.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(err) => return Err(err),
            };
            file.try_lock().map_err(std::io::Error::other)?;
            return Ok(Self {
                tag,
                _lock: file,
                dir: dir.to_owned(),
            });
        }
    }

    /// A new container id of this owner (`sbx` + tag + `-` + 24 hex digits,
    /// as long as the untagged ids were).
    pub fn container_id(&self) -> String {
        let unique = uuid::Uuid::new_v4().simple().to_string();
        format!("sbx{}-{}", self.tag, &unique[..24])
    }

    /// True when the container `id` (or its directory name) belongs to no
    /// live server: untagged (an older server), or its owner's lock is free.
    /// A free lock file is removed with the answer.
    pub fn is_orphan(&self, id: &str) -> bool {
        self.owner_gone(tag_of("sbx", id))
    }

    /// A temporary file name of this owner: `KIND-TAG-UUID.EXT`.
    pub fn temporary(&self, kind: &str, ext: &str) -> String {
        format!(
            "{kind}-{}-{}.{ext}",
            self.tag,
            uuid::Uuid::new_v4().simple()
        )
    }

    /// True for a temporary file `name` of `kind` no live server owns (an
    /// untagged one comes from a server before tags).
    pub fn is_orphan_temporary(&self, kind: &str, name: &str) -> bool {
        self.owner_gone(tag_of(&format!("{kind}-"), name))
    }

    fn owner_gone(&self, tag: Option<&str>) -> bool {
        let Some(tag) = tag else {
            return true;
        };
        if tag == self.tag {
            return false;
        }
        let path = self.dir.join(format!("{tag}.lock"));
        let Ok(file) = File::options().write(true).open(&path) else {
            // No lock file: its owner is long gone.
            return true;
        };
        match file.try_lock() {
            Ok(()) => {
                let _ = std::fs::remove_file(&path);
                true
            }
            Err(_) => false,
        }
    }
}

/// The owner tag of a name (`PREFIX` + tag + `-…`), if it has one.
fn tag_of<'a>(prefix: &str, name: &'a str) -> Option<&'a str> {
    let rest = name.strip_prefix(prefix)?;
    let (tag, _) = rest.split_once('-')?;
    (tag.len() == TAG_LEN && tag.bytes().all(|b| b.is_ascii_hexdigit())).then_some(tag)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second server on the same runtime directory must not take
    /// the first one's containers for leftovers; a crashed one's are.
    #[test]
    fn only_containers_of_dead_or_untagged_owners_are_orphans() {
        let dir = tempfile::tempdir().unwrap();
        let first = Owner::claim(dir.path()).unwrap();
        let second = Owner::claim(dir.path()).unwrap();
        let theirs = first.container_id();
        assert!(theirs.starts_with("sbx") && theirs.len() == 36, "{theirs}");
        assert!(!second.is_orphan(&theirs), "a live server's container");
        assert!(!second.is_orphan(&second.container_id()));
        assert!(second.is_orphan("sbx0123456789abcdef0123456789abcdef"));
        drop(first); // the server crashed: its lock is released
        assert!(second.is_orphan(&theirs));
        assert!(second.is_orphan(&theirs), "still an orphan, lock file gone");
        let mine = second.temporary("snapshot", "tar.gz");
        assert!(!second.is_orphan_temporary("snapshot", &mine), "{mine}");
        assert!(second.is_orphan_temporary(
            "snapshot",
            "snapshot-0123456789abcdef0123456789abcdef.tar.gz"
        ));
    }
}
