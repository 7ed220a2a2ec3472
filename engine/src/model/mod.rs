//! Model definitions: the Llama-family decoder (`llama`), whose layers take multi-head latent
//! attention (`mla`) and mixture-of-experts feed-forwards (`moe`) for the DeepSeek-V3 family, and
//! EAGLE-3 draft heads (`eagle3`) and one draft step as every tensor-parallel rank runs it
//! (`draft_step`).

pub mod config;
pub mod draft_step;
pub mod eagle3;
pub mod llama;
pub mod mla;
pub mod moe;

pub use config::{Architecture, ModelConfig, RopeLayout};
pub use draft_step::{DraftSource, DraftState, DraftStep};
pub use eagle3::{DraftBatch, DraftInput, DraftOutput, DraftWorkspace, Eagle3Config, Eagle3Draft};
pub use llama::{ForwardBatch, Llama, Workspace};
