//! Speculative decoding: draft tokens proposed cheaply, verified by the target model in one
//! forward, accepted exactly (greedy) or by rejection sampling (temperature > 0).
//!
//! - `ngram`: prompt-lookup drafts (no draft model);
//! - `eagle`: EAGLE-3 chain and tree drafts from a trained draft head reading the target's hidden
//!   states;
//! - `tree`: draft trees (topk > 1): selection, attention mask, the accepting walk;
//! - `policy`: how many draft tokens each step verifies, from measured step costs and acceptance.

pub mod eagle;
pub mod ngram;
pub mod policy;
pub mod tree;

pub use eagle::EagleDrafter;
pub use ngram::propose;
pub use policy::{Policy, SpecConfig, SpecMethod, SpecPolicy};
