//! Tests on real gVisor: runsc, the sandbox images and root.

mod admission;
mod agent_journal;
mod agent_planted;
mod client_library;
mod ctl_verbs;
mod files;
mod files_ctl;
mod fork;
mod frames_honoured;
mod http_execute;
mod images;
mod mcp;
mod network;
mod queued_frames;
mod runtime;
mod serve_binary;
mod server_http;
mod snapshot_ownership;
mod tenant_limits;
mod terminal;
mod warm;
mod workspace_sync;
mod ws_protocol;
