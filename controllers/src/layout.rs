//! Where each object lives in the bucket (`DESIGN.md` §3). The only place that
//! spells out key formats; ids are validated types, so every key is valid.

use crate::api::SandboxId;
use crate::store::ObjectKey;

/// Prefix under which every sandbox has its directory.
pub const SANDBOXES_PREFIX: &str = "sandboxes/";

fn key(value: String) -> ObjectKey {
    // Every caller builds the key from validated ids and fixed names, which
    // always form a valid key; an invalid one would be a bug here.
    ObjectKey::new(value).unwrap_or_else(|err| panic!("layout built an invalid key: {err}"))
}

/// `sandboxes/<id>/metadata.json`
pub fn metadata_key(id: &SandboxId) -> ObjectKey {
    key(format!("{SANDBOXES_PREFIX}{id}/metadata.json"))
}

/// `sandboxes/<id>/lock.json`
pub fn lock_key(id: &SandboxId) -> ObjectKey {
    key(format!("{SANDBOXES_PREFIX}{id}/lock.json"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_design_layout() {
        let id = SandboxId::parse("0123456789abcdef0123456789abcdef").unwrap();
        assert_eq!(
            metadata_key(&id).as_str(),
            "sandboxes/0123456789abcdef0123456789abcdef/metadata.json"
        );
        assert_eq!(
            lock_key(&id).as_str(),
            "sandboxes/0123456789abcdef0123456789abcdef/lock.json"
        );
    }
}
