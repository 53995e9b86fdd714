//! The client-facing API: the wire protocol of the earlier server's clients
//! (WebSocket handling on top of it follows with the API work).

pub mod execute;
pub mod protocol;
