//! The model runner: the one layer between the engine and the model. It owns the backend, the
//! model's weights, the KV store, the activation workspace, the tensor-parallel group, the drafter
//! and every sequence's sampler; the engine hands it a backend-free [`StepPlan`] and gets token
//! ids back ([`StepOutput`]), never logits.
//!
//! - `plan`: what crosses each step (plan in, output out), with room for prefix caching
//!   (`cached_prefix`) and structured outputs (`guide`);
//! - `device`: `--device cpu|cuda` to a backend, the only place one is named (with `measure`,
//!   the device's sweeps and self-checks the CLI asks for);
//! - `load`: a model path and settings to a runner and the [`ModelInfo`] the server shows;
//! - `model_runner`: [`Runner`], the step itself (drafts, batch, forward, acceptance);
//! - `drafter`: n-gram and EAGLE-3 (chain and tree) drafting behind one interface;
//! - `graphs`: decode steps padded to batch-size buckets and replayed from recorded graphs;
//! - `accept`: logits rows to emitted tokens (sampling, verification, tree walks, stop rules);
//! - `guided`: drafts checked against grammars, and each row's token mask (structured outputs).

mod accept;
pub mod device;
mod drafter;
pub mod graphs;
mod guided;
pub mod load;
pub mod measure;
pub mod memory;
mod model_runner;
pub mod plan;

use std::sync::Arc;

pub use device::{Device, WithBackend};
pub use graphs::{GraphStep, GraphUse, all_ranks_agree};
pub use load::{LoadSpec, load};
pub use memory::KvSize;
pub use model_runner::Runner;
pub use plan::{SeqOutput, SeqParams, SeqPlan, StepOutput, StepPlan, TokenGuide, TokenMask};

use crate::backend::Precision;
use crate::batching::scheduler::SeqId;
use crate::error::Result;
use crate::model::ModelConfig;
use crate::speculation::SpecConfig;
use crate::tokenizer::Tokenizer;

/// What the layers above the runner know of the model: enough to encode, validate and report,
/// nothing to compute with.
pub struct ModelInfo {
    /// A short name (the file or directory name).
    pub name: String,
    pub config: ModelConfig,
    pub tokenizer: Arc<Tokenizer>,
    pub precision: Precision,
    pub device: Device,
    /// The backend and what it runs on (`Backend::describe`).
    pub backend: String,
}

impl ModelInfo {
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
}

/// The runner's share of the serving settings.
#[derive(Clone, Copy, Debug)]
pub struct RunnerConfig {
    /// KV cache size in tokens (rounded up to whole blocks).
    pub kv_tokens: usize,
    pub block_size: usize,
    /// Tokens in one step, at most, drafts included.
    pub max_step_tokens: usize,
    pub spec: SpecConfig,
    /// Where tokens are drawn from the logits.
    pub sampling: SamplingSite,
    /// Decode steps from recorded graphs (`--cuda-graph-max-bs`, `--disable-cuda-graph`).
    pub graphs: GraphUse,
    /// Steps may launch ahead of the previous step's results (overlap scheduling; off with
    /// `--disable-overlap-schedule`). Only where sampling is on the backend.
    pub overlap: bool,
}

/// Where a step's tokens are drawn from its logits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SamplingSite {
    /// Where the backend prefers ([`crate::backend::Backend::samples_in_place`]): on the
    /// device for a GPU, from host copies on the CPU.
    #[default]
    Auto,
    /// Every row through the backend's sampling op, also on the CPU (how the device path is
    /// tested without a device).
    Backend,
}

impl RunnerConfig {
    pub fn n_blocks(&self) -> usize {
        self.kv_tokens.div_ceil(self.block_size)
    }
}

/// A model ready to run steps, whatever its backend. The engine thread owns one.
pub trait ModelRunner: Send {
    fn info(&self) -> &Arc<ModelInfo>;
    /// Blocks in the KV store and tokens per block (the scheduler allocates them).
    fn kv_layout(&self) -> (usize, usize);
    /// A new sequence: its sampler and stop rule (`prompt` seeds the repetition penalty).
    fn admit(&mut self, id: SeqId, params: SeqParams, prompt: &[u32]);
    /// A sequence that finished or was dropped.
    fn release(&mut self, id: SeqId);
    /// KV slots past a decoding sequence's tokens that a draft of at most `room` tokens may
    /// write this step (0: this runner does not draft). The engine reserves them before planning.
    fn draft_slots(&self, room: usize) -> usize;
    /// Runs one step. An error fails the plan's sequences; [`crate::Error::backend_lost`] says
    /// whether the runner can go on at all. Nothing may be launched and uncollected.
    fn execute(&mut self, plan: &StepPlan<'_>) -> Result<StepOutput>;

    /// Whether the KV blocks sequence `id` has computed may go to the prefix cache: with an
    /// EAGLE-3 draft, only while its draft has extended every position (the draft's KV in
    /// those blocks is valid, so a sequence that takes them may draft).
    fn kv_shareable(&self, _id: SeqId) -> bool {
        true
    }
    /// Whether a sequence with `params` may run in steps launched ahead of their results
    /// (overlap scheduling): every draw is made where the logits are and needs nothing the host
    /// learns from the step before (no penalties, no drafts, no tensor parallelism).
    fn overlaps(&self, _params: &SeqParams) -> bool {
        false
    }
    /// Overlap scheduling's first half of a step: the forward and the draws are enqueued and
    /// the call returns without their tokens, which stay where they were drawn for the next
    /// launch to feed ([`SeqPlan::pending_last`]). At most two launches wait uncollected.
    fn launch(&mut self, _plan: &StepPlan<'_>) -> Result<()> {
        Err(crate::Error::Device(
            "this runner does not launch steps ahead".into(),
        ))
    }
    /// The oldest launched step's output, waiting for its tokens.
    fn collect(&mut self) -> Result<StepOutput> {
        Err(crate::Error::Device(
            "this runner does not launch steps ahead".into(),
        ))
    }
}
