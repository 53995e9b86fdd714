//! The client-facing API: the wire protocol of the earlier server's clients,
//! its WebSocket endpoints (`/create`, `/attach/{id}`) and `POST /execute`.
//! This layer writes intents and waits for the controller; it never creates,
//! checkpoints or restores a sandbox by itself.

pub mod admission;
pub mod caller;
pub mod connect;
pub mod events;
pub mod execute;
pub mod files;
pub mod limits;
pub mod live;
pub mod output;
pub mod protocol;
pub mod session;
pub mod snapshot_owner;
pub mod snapshot_quota;
pub mod state;
pub mod token;
