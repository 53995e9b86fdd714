//! The `.sandbox-state` file (`docs/workspaces.md`): which files a workspace holds, with
//! their md5, size and mtime, and the comparison that turns two of them into
//! a sync plan. Pure data and pure functions, so the rules are unit-tested
//! without a sandbox or a bucket.
//!
//! The same format is kept in two places: `/workspace/.sandbox-state` inside
//! the sandbox (what was last synced from there) and `workspaces/<id>/.sandbox-state`
//! in the bucket (the workspace's committed content). The bucket copy is the
//! commit record: file bytes are uploaded first, under their checksum, and
//! only then does the state name them, so a sync interrupted anywhere leaves
//! the previous state intact and every file it names readable.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::path::{WorkspacePath, is_md5_hex};

/// The only schema version written and read.
pub const STATE_VERSION: &str = "1.0";
/// The state file's name, in the workspace root and under the bucket prefix.
pub const STATE_FILE_NAME: &str = ".sandbox-state";

/// One synced file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    /// Relative to the workspace root, `/`-separated.
    pub path: String,
    /// MD5 of the content, 32 lowercase hex digits (GCS's and S3's ETag format).
    pub checksum: String,
    pub size: u64,
    /// Unix seconds.
    pub modified_at: i64,
}

/// A `.sandbox-state` document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateFile {
    pub version: String,
    /// Unix seconds of the sync that wrote it.
    pub last_synced_at: i64,
    pub files: Vec<FileEntry>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StateError {
    #[error("the state file is not valid JSON for its format: {0}")]
    Malformed(String),
    #[error("unsupported state file version {0:?} (this server reads {STATE_VERSION:?})")]
    Version(String),
    #[error("file entry {path:?}: {reason}")]
    Entry { path: String, reason: String },
}

impl StateFile {
    pub fn new(last_synced_at: i64, mut files: Vec<FileEntry>) -> Self {
        files.sort_by(|a, b| a.path.cmp(&b.path));
        Self {
            version: STATE_VERSION.to_owned(),
            last_synced_at,
            files,
        }
    }

    pub fn empty() -> Self {
        Self::new(0, Vec::new())
    }

    /// Parses and validates: version, paths, checksums, no duplicates, sizes
    /// within `max_file_bytes`. A state edited by hand or written by something
    /// else is refused whole rather than half-applied.
    pub fn parse(bytes: &[u8], max_file_bytes: u64) -> Result<Self, StateError> {
        let state: StateFile =
            serde_json::from_slice(bytes).map_err(|err| StateError::Malformed(err.to_string()))?;
        if state.version != STATE_VERSION {
            return Err(StateError::Version(state.version));
        }
        let mut seen = std::collections::BTreeSet::new();
        for entry in &state.files {
            let bad = |reason: &str| StateError::Entry {
                path: entry.path.clone(),
                reason: reason.to_owned(),
            };
            if let Err(err) = WorkspacePath::new(&entry.path) {
                return Err(bad(&err.to_string()));
            }
            if !is_md5_hex(&entry.checksum) {
                return Err(bad("checksum must be 32 lowercase hex digits (an MD5)"));
            }
            if entry.size > max_file_bytes {
                return Err(bad(&format!(
                    "size {} is over the {max_file_bytes}-byte file limit",
                    entry.size
                )));
            }
            if !seen.insert(entry.path.as_str()) {
                return Err(bad("listed twice"));
            }
        }
        Ok(Self::new(state.last_synced_at, state.files))
    }

    pub fn to_json(&self) -> String {
        // Plain strings and numbers: serialisation cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    pub fn by_path(&self) -> BTreeMap<&str, &FileEntry> {
        self.files.iter().map(|f| (f.path.as_str(), f)).collect()
    }

    /// Same files with the same content (times aside).
    pub fn same_content(&self, other: &StateFile) -> bool {
        self.files.len() == other.files.len()
            && self
                .files
                .iter()
                .zip(&other.files)
                .all(|(a, b)| a.path == b.path && a.checksum == b.checksum)
    }

    /// True when the state was written more than `threshold_s` before `now`:
    /// checksums it records are then recomputed rather than trusted.
    pub fn is_stale(&self, now: i64, threshold_s: u64) -> bool {
        now.saturating_sub(self.last_synced_at) > i64::try_from(threshold_s).unwrap_or(i64::MAX)
    }
}

/// What a sync down does to the sandbox's workspace.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DownPlan {
    /// Changed remotely since this sandbox last synced them (or never synced
    /// here): fetch these.
    pub download: Vec<FileEntry>,
    /// Synced before, unchanged here since, and gone remotely: delete these.
    pub delete: Vec<String>,
    /// Changed here since the last sync and not remotely: kept as they are
    /// (the next sync up sends them).
    pub kept_local: Vec<String>,
    /// Equal on both sides.
    pub unchanged: usize,
    /// The sandbox's state file once the plan is carried out.
    pub local_after: Vec<FileEntry>,
}

/// A three-way comparison of the bucket's state (`remote`), what the sandbox
/// holds now (`actual`, a fresh scan) and what it last synced (`synced`, its
/// own state file): a file moves only where the other side changed it since
/// the last sync, so a restored sandbox neither loses the files a later
/// execution elsewhere stored nor the ones it changed itself after its last
/// successful sync. When both sides changed a file, the bucket's wins.
pub fn plan_down(remote: &StateFile, synced: &[FileEntry], actual: &StateFile) -> DownPlan {
    let actual_by_path = actual.by_path();
    let remote_by_path = remote.by_path();
    let mut local: BTreeMap<&str, &FileEntry> =
        synced.iter().map(|f| (f.path.as_str(), f)).collect();
    let synced_by_path = local.clone();
    let mut plan = DownPlan::default();
    for entry in &remote.files {
        let have = actual_by_path.get(entry.path.as_str());
        let was = synced_by_path.get(entry.path.as_str());
        match (have, was) {
            (Some(have), _) if have.checksum == entry.checksum => {
                plan.unchanged += 1;
                local.insert(&entry.path, have);
            }
            (_, Some(was)) if was.checksum == entry.checksum => {
                // Not changed remotely since our last sync: ours is newer.
                plan.kept_local.push(entry.path.clone());
            }
            _ => {
                plan.download.push(entry.clone());
                local.insert(&entry.path, entry);
            }
        }
    }
    for was in synced {
        if remote_by_path.contains_key(was.path.as_str()) {
            continue;
        }
        match actual_by_path.get(was.path.as_str()) {
            Some(have) if have.checksum == was.checksum => {
                plan.delete.push(was.path.clone());
                local.remove(was.path.as_str());
            }
            Some(_) => plan.kept_local.push(was.path.clone()),
            None => {
                local.remove(was.path.as_str());
            }
        }
    }
    plan.local_after = local.into_values().cloned().collect();
    plan
}

/// What a sync up does to the bucket.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct UpPlan {
    /// Content the bucket does not hold yet (by checksum): upload these.
    pub upload: Vec<FileEntry>,
    /// The bucket's state after this sync.
    pub next: Vec<FileEntry>,
    /// Paths the bucket lists and this sync removes.
    pub removed: Vec<String>,
    /// Checksums the new state no longer references: their objects can go.
    pub unreferenced: Vec<String>,
    pub unchanged: usize,
    /// True when `next` names the same contents as the bucket's state.
    pub noop: bool,
}

impl UpPlan {
    pub fn is_noop(&self) -> bool {
        self.noop
    }
}

/// A three-way comparison of a fresh scan (`actual`) with the bucket's state
/// (`remote`) and what this sandbox last synced (`synced`). A path leaves the
/// bucket only when this sandbox synced it, no longer has it, and nobody
/// changed it remotely since; paths the sandbox never saw (another sandbox's
/// additions, a fresh sandbox's first sync) and paths the scan left out
/// (`refused`: too large, unreadable, a symlink now) stay as they are.
/// Content is stored once per checksum, so a renamed or copied file uploads
/// nothing.
pub fn plan_up(
    actual: &StateFile,
    remote: &StateFile,
    synced: &[FileEntry],
    refused: &std::collections::BTreeSet<String>,
) -> UpPlan {
    use std::collections::BTreeSet;
    let remote_by_path = remote.by_path();
    let actual_by_path = actual.by_path();
    let synced_by_path: BTreeMap<&str, &FileEntry> =
        synced.iter().map(|f| (f.path.as_str(), f)).collect();
    let remote_sums: BTreeSet<&str> = remote.files.iter().map(|f| f.checksum.as_str()).collect();
    let mut plan = UpPlan::default();
    let mut queued = BTreeSet::new();
    let mut next: Vec<FileEntry> = Vec::new();
    for entry in &actual.files {
        let same = remote_by_path
            .get(entry.path.as_str())
            .is_some_and(|r| r.checksum == entry.checksum);
        if same {
            plan.unchanged += 1;
        } else if !remote_sums.contains(entry.checksum.as_str())
            && queued.insert(entry.checksum.as_str())
        {
            plan.upload.push(entry.clone());
        }
        next.push(entry.clone());
    }
    for entry in &remote.files {
        if actual_by_path.contains_key(entry.path.as_str()) {
            continue;
        }
        let deleted_here = !refused.contains(&entry.path)
            && synced_by_path
                .get(entry.path.as_str())
                .is_some_and(|was| was.checksum == entry.checksum);
        if deleted_here {
            plan.removed.push(entry.path.clone());
        } else {
            next.push(entry.clone());
        }
    }
    let next_sums: BTreeSet<&str> = next.iter().map(|f| f.checksum.as_str()).collect();
    plan.unreferenced = remote_sums
        .iter()
        .filter(|sum| !next_sums.contains(*sum))
        .map(|sum| (*sum).to_owned())
        .collect();
    let next = StateFile::new(remote.last_synced_at, next);
    plan.noop = next.same_content(remote);
    plan.next = next.files;
    plan
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(path: &str, sum: char) -> FileEntry {
        FileEntry {
            path: path.to_owned(),
            checksum: sum.to_string().repeat(32),
            size: 3,
            modified_at: 100,
        }
    }

    fn state(files: &[(&str, char)]) -> StateFile {
        StateFile::new(1_000, files.iter().map(|(p, s)| entry(p, *s)).collect())
    }

    fn synced(files: &[(&str, char)]) -> Vec<FileEntry> {
        state(files).files
    }

    fn names(entries: &[FileEntry]) -> Vec<&str> {
        entries.iter().map(|f| f.path.as_str()).collect()
    }

    #[test]
    fn down_fetches_remote_changes_deletes_remote_deletions_and_keeps_local_changes() {
        let remote = state(&[("a", 'a'), ("b", 'c'), ("new", 'e'), ("mine", 'm')]);
        let was = synced(&[
            ("a", 'a'),
            ("b", 'b'),
            ("gone", 'd'),
            ("edited", 'x'),
            ("mine", 'm'),
        ]);
        let actual = state(&[
            ("a", 'a'),
            ("b", 'b'),
            ("gone", 'd'),
            ("edited", 'y'),
            ("mine", 'n'),
            ("fresh", 'f'),
        ]);
        let plan = plan_down(&remote, &was, &actual);
        assert_eq!(
            names(&plan.download),
            ["b", "new"],
            "changed remotely since the last sync"
        );
        assert_eq!(plan.delete, ["gone"], "deleted remotely, unchanged here");
        assert_eq!(
            plan.kept_local,
            ["mine", "edited"],
            "changed here after the last sync: ours is newer"
        );
        assert_eq!(plan.unchanged, 1);
        assert_eq!(
            names(&plan.local_after),
            ["a", "b", "edited", "mine", "new"]
        );
    }

    #[test]
    fn down_into_a_new_sandbox_fetches_everything() {
        let remote = state(&[("a", 'a'), ("d/b", 'b')]);
        let plan = plan_down(&remote, &[], &StateFile::empty());
        assert_eq!(names(&plan.download), ["a", "d/b"]);
        assert!(plan.delete.is_empty());
    }

    #[test]
    fn down_of_an_equal_tree_does_nothing() {
        let tree = state(&[("a", 'a'), ("d/b", 'b')]);
        let plan = plan_down(&tree, &tree.files, &tree);
        assert!(plan.download.is_empty() && plan.delete.is_empty());
        assert_eq!(plan.unchanged, 2);
    }

    #[test]
    fn up_uploads_each_new_content_once_and_removes_what_this_sandbox_deleted() {
        let remote = state(&[("a", 'a'), ("old", 'o'), ("gone", 'g')]);
        let was = synced(&[("a", 'a'), ("old", 'o'), ("gone", 'g')]);
        let actual = state(&[("a", 'a'), ("copy1", 'n'), ("copy2", 'n'), ("renamed", 'o')]);
        let plan = plan_up(&actual, &remote, &was, &Default::default());
        assert_eq!(
            names(&plan.upload),
            ["copy1"],
            "same content twice, and a rename, upload once / nothing"
        );
        assert_eq!(plan.removed, ["gone", "old"]);
        assert_eq!(
            plan.unreferenced,
            ["g".repeat(32)],
            "the renamed file still uses 'o'"
        );
        assert!(!plan.is_noop());
    }

    #[test]
    fn up_keeps_paths_this_sandbox_never_saw_or_left_out() {
        // Another sandbox added "theirs"; "big" was refused by the scan here;
        // "changed" was modified remotely after this sandbox synced it.
        let remote = state(&[("theirs", 't'), ("big", 'b'), ("changed", 'c')]);
        let was = synced(&[("big", 'b'), ("changed", 'x')]);
        let refused = ["big".to_owned()].into_iter().collect();
        let plan = plan_up(&StateFile::empty(), &remote, &was, &refused);
        assert!(plan.removed.is_empty(), "{:?}", plan.removed);
        assert!(plan.is_noop());
        assert!(plan.unreferenced.is_empty());
    }

    #[test]
    fn up_of_an_unchanged_tree_is_a_noop() {
        let tree = state(&[("a", 'a'), ("b", 'b')]);
        let plan = plan_up(&tree, &tree, &tree.files, &Default::default());
        assert!(plan.is_noop());
        assert_eq!(plan.unchanged, 2);
    }

    #[test]
    fn parse_round_trips_and_sorts() {
        let written = state(&[("z", 'a'), ("a/b", 'b')]);
        let parsed = StateFile::parse(written.to_json().as_bytes(), 10).unwrap();
        assert_eq!(parsed, written);
        assert_eq!(parsed.files[0].path, "a/b");
    }

    #[test]
    fn parse_refuses_bad_versions_paths_checksums_sizes_and_duplicates() {
        let with = |files: &str, version: &str| {
            format!(r#"{{"version":"{version}","last_synced_at":1,"files":[{files}]}}"#)
        };
        let ok = r#"{"path":"a","checksum":"0123456789abcdef0123456789abcdef","size":1,"modified_at":1}"#;
        assert!(StateFile::parse(with(ok, "1.0").as_bytes(), 10).is_ok());
        assert!(matches!(
            StateFile::parse(with(ok, "2.0").as_bytes(), 10),
            Err(StateError::Version(_))
        ));
        for bad in [
            ok.replace("\"a\"", "\"../etc/passwd\""),
            ok.replace("\"a\"", "\"/etc/passwd\""),
            ok.replace("\"a\"", "\"a//b\""),
            ok.replace(
                "0123456789abcdef0123456789abcdef",
                "0123456789ABCDEF0123456789ABCDEF",
            ),
            ok.replace("0123456789abcdef0123456789abcdef", "abc"),
            ok.replace("\"size\":1", "\"size\":11"),
            format!("{ok},{ok}"),
        ] {
            assert!(
                matches!(
                    StateFile::parse(with(&bad, "1.0").as_bytes(), 10),
                    Err(StateError::Entry { .. })
                ),
                "{bad} was accepted"
            );
        }
        assert!(matches!(
            StateFile::parse(b"{not json", 10),
            Err(StateError::Malformed(_))
        ));
    }

    #[test]
    fn staleness_follows_the_threshold() {
        let state = StateFile::new(1_000, Vec::new());
        assert!(!state.is_stale(1_500, 600));
        assert!(state.is_stale(1_601, 600));
    }
}
