//! Model definitions. One transformer family today: Llama and its close relatives.

pub mod config;
pub mod llama;

pub use config::{Architecture, ModelConfig, RopeLayout};
pub use llama::{ForwardBatch, Llama, Workspace};
