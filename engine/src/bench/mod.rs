//! `kiln bench`: a concurrency sweep against any OpenAI-compatible server (kiln or a peer), with
//! SGLang bench_serving's metrics, JSON results, markdown tables, side-by-side comparisons and plots.

pub mod client;
pub mod moe_layer;
pub mod plot;
pub mod prompts;
pub mod report;
pub mod run;
pub mod stats;

pub use run::{BenchResult, BenchSettings};
pub use stats::{LevelResult, Summary};
