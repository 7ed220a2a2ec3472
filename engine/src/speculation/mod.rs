//! Speculative decoding: draft tokens proposed cheaply, verified by the target model in one
//! forward, accepted exactly (greedy) or by rejection sampling (temperature > 0).
//!
//! - `ngram`: prompt-lookup drafts (no draft model);
//! - `policy`: how many draft tokens each step verifies, from measured step costs and acceptance.

pub mod ngram;
pub mod policy;

pub use ngram::propose;
pub use policy::{Policy, SpecConfig, SpecMethod, SpecPolicy};
