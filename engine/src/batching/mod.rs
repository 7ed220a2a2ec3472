//! Continuous batching: the scheduler (plain integers), the engine thread that runs it against the
//! model, and the request/event types between the engine and the HTTP side.

pub mod engine;
pub mod request;
pub mod scheduler;

pub use engine::{EngineConfig, EngineHandle, spawn};
pub use request::{EngineRequest, Event, RequestParams};
