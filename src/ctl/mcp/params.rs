//! The tools' arguments: their JSON schemas (what `tools/list` shows a
//! model) come from these types and their doc comments.

use rmcp::schemars::JsonSchema;
use serde::Deserialize;

#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(rename_all = "lowercase")]
pub(super) enum Language {
    /// `python3 -c CODE`: a fresh interpreter each time.
    Python,
    /// `bash -c CODE`.
    Bash,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub(super) struct CreateSandbox {
    /// The sandbox image (default: the server's).
    #[serde(default)]
    pub(super) image: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub(super) struct RunCode {
    /// The sandbox's id (from create_sandbox or fork_sandbox).
    pub(super) sandbox_id: String,
    pub(super) language: Language,
    /// The program: Python source or a bash script.
    pub(super) code: String,
    /// Seconds before the program is killed (default 300, at most 3600).
    #[serde(default)]
    pub(super) timeout: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub(super) struct ReadFile {
    pub(super) sandbox_id: String,
    /// The file's path: absolute, or relative to /home/sandbox.
    pub(super) path: String,
    /// The first byte to read (default 0).
    #[serde(default)]
    pub(super) offset: Option<u64>,
    /// Bytes to read (default and most: 1048576).
    #[serde(default)]
    pub(super) length: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub(super) struct WriteFile {
    pub(super) sandbox_id: String,
    /// The file's path: absolute, or relative to /home/sandbox. Missing
    /// parent directories are created; an existing file is replaced.
    pub(super) path: String,
    /// The file's contents (UTF-8 text, or base64 when `base64` is true).
    pub(super) content: String,
    /// `content` is base64 (for binary files).
    #[serde(default)]
    pub(super) base64: bool,
    /// Permission bits in octal, e.g. "755" (default "644").
    #[serde(default)]
    pub(super) mode: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub(super) struct ListFiles {
    pub(super) sandbox_id: String,
    /// The directory: absolute, or relative to /home/sandbox (default: /home/sandbox).
    #[serde(default)]
    pub(super) path: Option<String>,
    /// Levels to descend (default 1: the directory's own entries; at most 8).
    #[serde(default)]
    pub(super) depth: Option<u32>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub(super) struct CheckpointSandbox {
    pub(super) sandbox_id: String,
    /// A name to fork from later (fork_sandbox's `checkpoint`).
    #[serde(default)]
    pub(super) name: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub(super) struct ForkSandbox {
    pub(super) sandbox_id: String,
    /// Fork this named checkpoint (default: checkpoint the sandbox now and
    /// fork that, so the fork starts from its current state).
    #[serde(default)]
    pub(super) checkpoint: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[schemars(crate = "rmcp::schemars")]
#[serde(deny_unknown_fields)]
pub(super) struct SandboxRef {
    pub(super) sandbox_id: String,
}
