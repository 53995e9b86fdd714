//! Checks on the names a workspace sync handles. Paths come from a sandbox
//! (user code chooses them) and from the bucket (an operator or another
//! sandbox wrote them): both are untrusted, so each is checked here before it
//! is used, and again by the agent against the sandbox's real filesystem.

use std::fmt;

/// Longest path accepted, in bytes (Linux's PATH_MAX).
const MAX_PATH_BYTES: usize = 4096;
/// Longest path segment accepted, in bytes (Linux's NAME_MAX).
const MAX_SEGMENT_BYTES: usize = 255;

/// A relative, `/`-separated path that cannot leave the workspace root.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct WorkspacePath(String);

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid workspace path {path:?}: {reason}")]
pub struct InvalidPath {
    pub path: String,
    pub reason: &'static str,
}

impl WorkspacePath {
    pub fn new(path: &str) -> Result<Self, InvalidPath> {
        let invalid = |reason| InvalidPath {
            path: path.chars().take(200).collect(),
            reason,
        };
        if path.is_empty() {
            return Err(invalid("it is empty"));
        }
        if path.len() > MAX_PATH_BYTES {
            return Err(invalid("it is longer than 4096 bytes"));
        }
        if path.starts_with('/') {
            return Err(invalid("it is absolute"));
        }
        if path.contains('\0') {
            return Err(invalid("it contains a NUL byte"));
        }
        for segment in path.split('/') {
            match segment {
                "" => return Err(invalid("it has an empty segment")),
                "." | ".." => return Err(invalid("it has a '.' or '..' segment")),
                _ if segment.len() > MAX_SEGMENT_BYTES => {
                    return Err(invalid("a segment is longer than 255 bytes"));
                }
                _ => {}
            }
        }
        Ok(Self(path.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkspacePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// True for 32 lowercase hex digits.
pub fn is_md5_hex(value: &str) -> bool {
    value.len() == 32
        && value
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_relative_paths() {
        for ok in [
            "a",
            "src/main.py",
            "dir with space/ü.txt",
            ".hidden/x",
            "a..b",
        ] {
            assert!(WorkspacePath::new(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn refuses_paths_that_could_leave_the_root() {
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a/./b",
            "a//b",
            "a/",
            "a\0b",
        ] {
            assert!(WorkspacePath::new(bad).is_err(), "{bad:?}");
        }
        assert!(WorkspacePath::new(&"a".repeat(256)).is_err());
        assert!(WorkspacePath::new(&"a/".repeat(2100)).is_err());
    }

    #[test]
    fn md5_format() {
        assert!(is_md5_hex("d41d8cd98f00b204e9800998ecf8427e"));
        assert!(!is_md5_hex("D41D8CD98F00B204E9800998ECF8427E"));
        assert!(!is_md5_hex("d41d8cd98f00b204e9800998ecf8427"));
        assert!(!is_md5_hex("g41d8cd98f00b204e9800998ecf8427e"));
    }
}
