//! Object keys, validated once where they are made.
//!
//! Keys become GCS object names and, in the local backend, file paths, and parts
//! of them (sandbox ids, snapshot names) come from users. So a key is a
//! `/`-separated path of segments drawn from a fixed, URL- and path-safe charset,
//! with no empty, `.` or `..` segment and no segment starting with `.` (which the
//! local backend reserves for its own bookkeeping). Anything else is refused
//! before it reaches a backend.

use std::fmt;

/// Longest key accepted; GCS allows 1024 bytes.
pub const MAX_KEY_LEN: usize = 1024;

/// A key that failed validation, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid object key {key:?}: {reason}")]
pub struct InvalidKey {
    pub key: String,
    pub reason: &'static str,
}

/// A validated object key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ObjectKey(String);

impl ObjectKey {
    /// Validates `key`.
    pub fn new(key: impl Into<String>) -> Result<Self, InvalidKey> {
        let key = key.into();
        match validate(&key) {
            Ok(()) => Ok(Self(key)),
            Err(reason) => Err(InvalidKey { key, reason }),
        }
    }

    /// Joins validated segments with `/`.
    pub fn join(segments: &[&str]) -> Result<Self, InvalidKey> {
        Self::new(segments.join("/"))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The key's segments, in order.
    pub fn segments(&self) -> impl Iterator<Item = &str> {
        self.0.split('/')
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for ObjectKey {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// True for the characters a key segment may contain.
pub fn is_key_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')
}

fn validate(key: &str) -> Result<(), &'static str> {
    if key.is_empty() {
        return Err("it is empty");
    }
    if key.len() > MAX_KEY_LEN {
        return Err("it is longer than 1024 bytes");
    }
    for segment in key.split('/') {
        if segment.is_empty() {
            return Err("it has an empty segment (leading, trailing or double '/')");
        }
        if segment.starts_with('.') {
            return Err("a segment starts with '.' ('.', '..' and hidden names are reserved)");
        }
        if !segment.chars().all(is_key_char) {
            return Err("only ASCII letters, digits, '-', '_', '.' and '/' are allowed");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_bucket_layout_keys() {
        for key in [
            "sandboxes/3f9c/metadata.json",
            "sandbox_checkpoints/ckpt-1/checkpoint.img",
            "a",
        ] {
            assert_eq!(ObjectKey::new(key).unwrap().as_str(), key);
        }
    }

    #[test]
    fn rejects_traversal_and_odd_characters() {
        for key in [
            "",
            "/abs",
            "trailing/",
            "a//b",
            "../etc/passwd",
            "a/../b",
            "a/./b",
            "a/.hidden",
            "sp ace",
            "uni/cödé",
            "back\\slash",
            "nul\0",
        ] {
            let err = ObjectKey::new(key).unwrap_err();
            assert_eq!(err.key, key);
        }
        assert!(ObjectKey::new("a".repeat(MAX_KEY_LEN + 1)).is_err());
    }
}
