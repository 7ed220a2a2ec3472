//! What crosses between the engine and the runner each step: a backend-free plan in, token ids out.
//!
//! Plain, borrowed data: the plan points into the scheduler's sequences (tokens, block tables)
//! rather than copying them, and the output carries sampled tokens only, never logits, so a
//! device backend returns a few integers per sequence instead of a vocabulary-wide row.

use crate::batching::scheduler::SeqId;
use crate::generate::FinishReason;
use crate::sampling::{Sampled, SamplingParams};
pub use crate::sampling::{TokenGuide, TokenMask};

/// How a sequence is sampled and when it stops, given once when it is admitted.
#[derive(Clone, Debug)]
pub struct SeqParams {
    pub sampling: SamplingParams,
    /// The model's end-of-sequence tokens do not end this sequence.
    pub ignore_eos: bool,
    /// Extra token ids that end it.
    pub stop_token_ids: Vec<u32>,
}

/// One scheduled sequence of a step.
#[derive(Clone, Debug)]
pub struct SeqPlan<'a> {
    pub id: SeqId,
    /// Every token of the sequence so far (prompt and output); the step feeds
    /// `tokens[computed..computed + n_new]`.
    pub tokens: &'a [u32],
    /// Tokens whose keys and values are already in the cache (the first fed token's position).
    pub computed: usize,
    /// Of `computed`, the tokens that came from the prefix cache rather than this sequence's own
    /// steps (0 until prefix caching lands; the runner treats them like any cached token).
    pub cached_prefix: usize,
    /// Tokens this step feeds (a prefill chunk, or the one token a decode step feeds).
    pub n_new: usize,
    /// Physical KV block of each logical block; covers `tokens.len()` plus `draft_room`'s slots.
    pub block_table: &'a [u32],
    /// The sequence is decoding: one token fed, the last one, after its prompt. Only decoding
    /// sequences draft, and the speculation policy counts the rest as plain tokens.
    pub decoding: bool,
    /// Draft tokens this sequence may take (0: none; the engine reserved their KV slots).
    pub draft_room: usize,
    /// Tokens the request may still emit before `max_tokens` ends it.
    pub tokens_left: usize,
    /// Tokens the sequence may still grow by before the context is full.
    pub context_left: usize,
    /// Structured outputs: what each row may sample, drafts' rows included (the runner asks
    /// while the forward runs, and drops drafts it refuses before); `None`: any token.
    pub guide: Option<&'a dyn TokenGuide>,
    /// Overlap scheduling: `tokens`' last entry stands for the token the previous (launched,
    /// not yet collected) step draws for this sequence; the runner feeds that draw where it was
    /// made, never this placeholder.
    pub pending_last: bool,
}

impl SeqPlan<'_> {
    /// Whether this step reaches the end of the sequence, so it samples a token.
    pub fn samples(&self) -> bool {
        self.computed + self.n_new == self.tokens.len()
    }
}

/// One engine step for the runner.
#[derive(Clone, Debug, Default)]
pub struct StepPlan<'a> {
    pub seqs: Vec<SeqPlan<'a>>,
}

impl StepPlan<'_> {
    /// Tokens the step feeds before drafts.
    pub fn tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.n_new).sum()
    }
}

/// What one sequence got from a step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SeqOutput {
    /// The tokens it emits, in order: accepted drafts, then the token sampled after them
    /// (empty for a prefill chunk that does not reach the end).
    pub tokens: Vec<Sampled>,
    /// Why the sequence ends with these tokens, if it does.
    pub finish: Option<FinishReason>,
    /// Draft tokens verified this step.
    pub drafted: usize,
    /// Of those, the ones accepted (their KV entries stay).
    pub accepted: usize,
    /// Draft tokens dropped before verification because the sequence's grammar refused them.
    pub refused: usize,
}

/// What a step produced, a [`SeqOutput`] per planned sequence in plan order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepOutput {
    pub seqs: Vec<SeqOutput>,
    /// The draft length the speculation policy chose, when it chose one this step.
    pub chosen_k: Option<usize>,
    /// The EAGLE-3 draft was parked this step (drafting did not pay).
    pub draft_parked: bool,
    /// Tokens the forward ran, drafts included.
    pub forward_tokens: usize,
    /// The batch-size bucket a plain decode step was padded to (and replayed from a graph when
    /// the backend records them); `None`: an eager step.
    pub graph_bucket: Option<usize>,
}
