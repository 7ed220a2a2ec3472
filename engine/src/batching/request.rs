//! What crosses the boundary between the HTTP side and the engine thread: a request going in, a
//! stream of events coming out.

use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use crate::generate::FinishReason;
use crate::sampling::{Sampled, SamplingParams};
use crate::structured::Guide;

/// Generation settings of one request, already validated.
#[derive(Clone, Debug)]
pub struct RequestParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub ignore_eos: bool,
    /// Extra token ids that end generation (the model's EOS ids end it unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Structured outputs: the matcher that masks every token this request samples.
    pub guide: Option<Guide>,
    /// The text keeps special tokens (a tool-call format's markers), all but the ones that end
    /// the request.
    pub keep_special: bool,
}

pub struct EngineRequest {
    pub prompt: Vec<u32>,
    pub params: RequestParams,
    pub events: UnboundedSender<Event>,
    pub arrival: Instant,
}

#[derive(Debug)]
pub enum Event {
    /// A new token. `text` is set when the engine decoded it itself (overlap off); otherwise the
    /// receiver detokenizes.
    Token {
        sampled: Sampled,
        text: Option<String>,
    },
    /// How many prompt tokens came from the prefix cache (sent once, when the request is first
    /// scheduled, before its tokens).
    Cached(usize),
    /// The last event of a request that ran to its end.
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    /// The request could not be run (the engine failed); the last event.
    Failed(String),
}
