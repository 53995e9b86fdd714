//! The client-facing API: the wire protocol of the earlier server's clients,
//! its WebSocket endpoints (`/create`, `/attach/{id}`) and `POST /execute`.
//! The WebSocket endpoints write intents and wait for the controller; they
//! never create, checkpoint or restore a sandbox by themselves. `/execute`
//! is the exception: its one-shot sandbox never enters the bucket, so it
//! creates and destroys it on the runtime directly (`execute`).

pub mod admission;
pub mod caller;
pub mod checkpoints;
pub mod connect;
pub mod events;
pub mod execute;
pub mod features;
pub mod files;
pub mod limits;
pub mod live;
pub mod output;
pub mod protocol;
pub mod session;
pub mod snapshot_owner;
pub mod snapshot_quota;
pub mod state;
