//! Identifiers that end up in object keys and paths: validated at the edge.

use std::fmt;

use serde::{Deserialize, Serialize};

/// An identifier that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what} {value:?}: {rule}")]
pub struct InvalidId {
    pub what: &'static str,
    pub value: String,
    pub rule: &'static str,
}

/// A sandbox id: 32 lowercase hex digits (a UUIDv4 without dashes, 122 random
/// bits). Clients treat it as opaque; it is safe in URLs, keys and paths.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SandboxId(String);

impl SandboxId {
    pub const LEN: usize = 32;

    pub fn parse(value: &str) -> Result<Self, InvalidId> {
        let ok = value.len() == Self::LEN
            && value
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if ok {
            Ok(Self(value.to_owned()))
        } else {
            Err(InvalidId {
                what: "sandbox id",
                value: value.chars().take(80).collect(),
                rule: "expected 32 lowercase hex digits",
            })
        }
    }

    /// The id of a random 128-bit value (a UUIDv4's bits): always valid.
    pub fn from_u128(value: u128) -> Self {
        Self(format!("{value:032x}"))
    }

    /// A fresh id from 128 bits of the OS-seeded CSPRNG.
    pub fn random() -> Self {
        Self::from_u128(rand::random::<u128>())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SandboxId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for SandboxId {
    type Error = InvalidId;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<SandboxId> for String {
    fn from(id: SandboxId) -> Self {
        id.0
    }
}

/// The id of one server instance (a Cloud Run instance, a local process):
/// 1–128 characters of ASCII letters, digits, `-`, `_`, `.`, `:`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct InstanceId(String);

impl InstanceId {
    pub fn parse(value: &str) -> Result<Self, InvalidId> {
        let ok = !value.is_empty()
            && value.len() <= 128
            && value
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'));
        if ok {
            Ok(Self(value.to_owned()))
        } else {
            Err(InvalidId {
                what: "instance id",
                value: value.chars().take(140).collect(),
                rule: "expected 1-128 characters of ASCII letters, digits, '-', '_', '.', ':'",
            })
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for InstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for InstanceId {
    type Error = InvalidId;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        Self::parse(&value)
    }
}

impl From<InstanceId> for String {
    fn from(id: InstanceId) -> Self {
        id.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ids_are_32_lowercase_hex() {
        assert!(SandboxId::parse("0123456789abcdef0123456789abcdef").is_ok());
        for bad in [
            "",
            "sandbox-1a2b",
            "0123456789ABCDEF0123456789ABCDEF",
            "../../../../etc/passwd/aaaaaaaaaa",
            "0123456789abcdef0123456789abcdef0",
        ] {
            assert!(SandboxId::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ids_from_random_values_are_valid() {
        for value in [0, 1, u128::MAX] {
            let id = SandboxId::from_u128(value);
            assert_eq!(SandboxId::parse(id.as_str()).unwrap(), id);
        }
    }

    #[test]
    fn instance_ids_refuse_path_characters() {
        assert!(InstanceId::parse("instance-a:8080").is_ok());
        assert!(InstanceId::parse("a/b").is_err());
        assert!(InstanceId::parse("").is_err());
    }
}
