//! What may name a sandbox image: a name (what `scripts/build-image.sh`
//! accepts) or a content digest. The rules are the API's, checked where a
//! client asks for an image, before anything looks for it on a host.

/// The prefix of a digest (`sha256-<64 hex>`).
const DIGEST_PREFIX: &str = "sha256-";

/// What [`is_image_name`] and [`is_digest`] accept, in words.
pub const IMAGE_NAME_RULE: &str = "lower-case letters, digits, '.', '_' and '-', starting with a letter or digit, at most 63 characters (or a digest sha256-<64 hex>)";

/// Whether `name` may name an image (what `scripts/build-image.sh` accepts).
pub fn is_image_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && (bytes[0].is_ascii_lowercase() || bytes[0].is_ascii_digit())
        && bytes.iter().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
        })
        && !name.starts_with(DIGEST_PREFIX)
}

/// Whether `text` is a digest (`sha256-` and 64 lower-case hex digits).
pub fn is_digest(text: &str) -> bool {
    text.strip_prefix(DIGEST_PREFIX).is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}
