//! Decoding and encoding of API objects, with errors that name the field.

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::API_VERSION;

/// An object stored in the bucket as JSON.
pub trait ApiObject: Serialize + DeserializeOwned {
    /// The object's name in messages (`metadata.json`, `lock.json`).
    const KIND: &'static str;

    /// The `apiVersion` the object carries.
    fn api_version(&self) -> &str;

    /// Checks constraints JSON types cannot express. On failure, returns the
    /// dotted path of the offending field and what is wrong with it.
    fn validate(&self) -> Result<(), (String, String)>;
}

/// Why stored JSON could not be used. Every variant names the object and, where
/// one is to blame, the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("{kind} is not valid JSON: {message}")]
    Syntax { kind: &'static str, message: String },
    #[error("{kind}: field `{field}`: {message}")]
    Field {
        kind: &'static str,
        field: String,
        message: String,
    },
    #[error("{kind}: apiVersion {found:?} is not supported (expected {API_VERSION:?})")]
    UnsupportedVersion { kind: &'static str, found: String },
}

impl DecodeError {
    /// The dotted path of the field at fault, if one is.
    pub fn field(&self) -> Option<&str> {
        match self {
            Self::Field { field, .. } => Some(field),
            Self::UnsupportedVersion { .. } => Some("apiVersion"),
            Self::Syntax { .. } => None,
        }
    }
}

/// Parses and validates an API object.
pub fn decode<T: ApiObject>(bytes: &[u8]) -> Result<T, DecodeError> {
    let kind = T::KIND;
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let object: T = match serde_path_to_error::deserialize(&mut deserializer) {
        Ok(object) => object,
        Err(err) => {
            let field = err.path().to_string();
            let inner = err.into_inner();
            return Err(if inner.is_syntax() || inner.is_eof() || field == "." {
                DecodeError::Syntax {
                    kind,
                    message: inner.to_string(),
                }
            } else {
                DecodeError::Field {
                    kind,
                    field,
                    message: strip_position(&inner.to_string()),
                }
            });
        }
    };
    if let Err(err) = deserializer.end() {
        return Err(DecodeError::Syntax {
            kind,
            message: err.to_string(),
        });
    }
    if object.api_version() != API_VERSION {
        return Err(DecodeError::UnsupportedVersion {
            kind,
            found: object.api_version().to_owned(),
        });
    }
    object
        .validate()
        .map_err(|(field, message)| DecodeError::Field {
            kind,
            field,
            message,
        })?;
    Ok(object)
}

/// Serializes an API object pretty-printed, with a final newline.
pub fn encode<T: ApiObject>(object: &T) -> Bytes {
    // Serializing these types cannot fail: they hold only strings, numbers,
    // timestamps and JSON maps with string keys.
    let mut out = serde_json::to_vec_pretty(object).unwrap_or_else(|err| {
        tracing::error!(kind = T::KIND, %err, "serializing an API object failed");
        Vec::new()
    });
    out.push(b'\n');
    Bytes::from(out)
}

/// serde_json appends " at line L column C" to data errors; the field path is
/// more useful to an operator, so drop the position.
fn strip_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(at) => message[..at].to_owned(),
        None => message.to_owned(),
    }
}
