//! Model definitions. One transformer family today: Llama and its close relatives.

pub mod config;
pub mod eagle3;
pub mod llama;

pub use config::{Architecture, ModelConfig, RopeLayout};
pub use eagle3::{DraftInput, DraftOutput, DraftWorkspace, Eagle3Config, Eagle3Draft};
pub use llama::{ForwardBatch, Llama, Workspace};
