//! kiln: an inference engine and server for one big model, with a CPU backend that runs real models.
//!
//! Layers, from the bottom: `weights` (GGUF and safetensors readers), `backend` (the op trait and its
//! CPU implementation), `model` (the Llama family over any backend), `kv_cache` (paged block
//! bookkeeping), `tokenizer`, `sampling`, `generate` (a single-sequence driver), `runner` (the one layer
//! between the engine and the model: backend, KV store, drafters and sampling behind a step plan,
//! and the only place `--device` names a backend), `batching` (the continuous-batching
//! scheduler and engine thread, backend-free), `metrics`, `server` (the OpenAI-compatible HTTP server), and the production tooling around it:
//! `parallel` (tensor-parallel collectives: threads on the CPU), `bench` (the concurrency sweep client), `lock` (the frozen configuration and the machine's
//! fingerprint) and `doctor` (preflight and drift checks).

pub mod backend;
pub mod batching;
pub mod bench;
pub mod catalog;
pub mod doc;
pub mod doctor;
pub mod error;
pub mod generate;
pub mod kv_cache;
pub mod load;
pub mod lock;
pub mod metrics;
pub mod migrate;
pub mod model;
pub mod parallel;
pub mod runner;
pub mod sampling;
pub mod server;
pub mod speculation;
pub mod structured;
pub mod tokenizer;
pub mod weights;

pub use error::{Error, Result};
