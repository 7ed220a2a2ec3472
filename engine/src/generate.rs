//! Single-sequence generation over the paged KV cache: the CLI's path and the fidelity tests' path.
//! The server's continuous-batching loop drives the same `Llama::forward` with many sequences.

use std::time::{Duration, Instant};

use crate::backend::{Backend, SeqSpan};
use crate::error::{Error, Result};
use crate::kv_cache::{BlockAllocator, SeqBlocks};
use crate::load::LoadedModel;
use crate::model::{ForwardBatch, Workspace};
use crate::sampling::{Sampled, Sampler, SamplingParams};

pub const DEFAULT_BLOCK_SIZE: usize = 16;

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub ignore_eos: bool,
    /// Prompt tokens per forward pass (chunked prefill); 0 = the whole prompt at once.
    pub prefill_chunk: usize,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 128,
            sampling: SamplingParams::greedy(),
            ignore_eos: false,
            prefill_chunk: 512,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Length,
    Eos,
    /// The model's context window is full.
    ContextFull,
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub output: Vec<Sampled>,
    pub finish: FinishReason,
    pub prefill_time: Duration,
    pub decode_time: Duration,
}

impl Generation {
    pub fn ids(&self) -> Vec<u32> {
        self.output.iter().map(|s| s.token).collect()
    }
}

/// Owns a KV store sized for one sequence of the model's full context (or `max_len`).
pub struct SingleSequence<B: Backend> {
    kv: B::KvStore,
    alloc: BlockAllocator,
    ws: Workspace<B>,
}

impl<B: Backend> SingleSequence<B> {
    pub fn new(m: &LoadedModel<B>, max_len: usize) -> Result<Self> {
        let c = m.config();
        let n_blocks = max_len.div_ceil(DEFAULT_BLOCK_SIZE);
        Ok(SingleSequence {
            kv: m.backend.kv_store(
                c.n_layers,
                n_blocks,
                DEFAULT_BLOCK_SIZE,
                c.kv_width(),
                c.kv_layout(),
                m.model.precision,
            )?,
            alloc: BlockAllocator::new(n_blocks, DEFAULT_BLOCK_SIZE),
            ws: Workspace::new(&m.backend)?,
        })
    }

    /// Generates from `prompt`; `on_token` sees each token as it is sampled.
    pub fn generate(
        &mut self,
        m: &LoadedModel<B>,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(&Sampled),
    ) -> Result<Generation> {
        opts.sampling.validate()?;
        if prompt.is_empty() {
            return Err(Error::InvalidRequest("the prompt is empty".into()));
        }
        let capacity = self.alloc.total() * self.alloc.block_size();
        if prompt.len() >= capacity {
            return Err(Error::InvalidRequest(format!(
                "the prompt has {} tokens; the context holds {capacity}",
                prompt.len()
            )));
        }
        let mut seq = SeqBlocks::default();
        let result = self.run(m, prompt, opts, &mut seq, &mut on_token);
        seq.release(&mut self.alloc);
        result
    }

    fn run(
        &mut self,
        m: &LoadedModel<B>,
        prompt: &[u32],
        opts: &GenerateOptions,
        seq: &mut SeqBlocks,
        on_token: &mut impl FnMut(&Sampled),
    ) -> Result<Generation> {
        let capacity = self.alloc.total() * self.alloc.block_size();
        let mut sampler = Sampler::new(opts.sampling, prompt);
        let t0 = Instant::now();
        let chunk = if opts.prefill_chunk == 0 {
            prompt.len()
        } else {
            opts.prefill_chunk
        };
        let mut logits = Vec::new();
        let mut done = 0;
        while done < prompt.len() {
            let n = chunk.min(prompt.len() - done);
            logits = self.step(m, seq, &prompt[done..done + n], done)?;
            done += n;
        }
        let prefill_time = t0.elapsed();
        let t1 = Instant::now();
        let mut output = Vec::new();
        let mut pos = prompt.len();
        let finish = loop {
            let s = sampler.sample(&mut logits);
            on_token(&s);
            let tok = s.token;
            output.push(s);
            if !opts.ignore_eos && m.tokenizer.is_eos(tok) {
                break FinishReason::Eos;
            }
            if output.len() >= opts.max_tokens {
                break FinishReason::Length;
            }
            if pos + 1 >= capacity {
                break FinishReason::ContextFull;
            }
            logits = self.step(m, seq, &[tok], pos)?;
            pos += 1;
        };
        Ok(Generation {
            output,
            finish,
            prefill_time,
            decode_time: t1.elapsed(),
        })
    }

    /// Runs `tokens` (at positions `start..`) and returns the last token's logits.
    fn step(
        &mut self,
        m: &LoadedModel<B>,
        seq: &mut SeqBlocks,
        tokens: &[u32],
        start: usize,
    ) -> Result<Vec<f32>> {
        seq.reserve(&mut self.alloc, start + tokens.len())?;
        let positions: Vec<usize> = (start..start + tokens.len()).collect();
        let spans = [SeqSpan {
            first_token: 0,
            n_tokens: tokens.len(),
            start_pos: start,
            block_table: &seq.table,
            tree: None,
        }];
        let batch = ForwardBatch {
            tokens,
            positions: &positions,
            spans: &spans,
            logit_rows: &[tokens.len() - 1],
            fill: None,
        };
        m.model
            .forward(&m.backend, &mut self.kv, &batch, &mut self.ws)
    }
}
