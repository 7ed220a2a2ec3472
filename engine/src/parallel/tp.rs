//! Tensor-parallel greedy decoding on the CPU, outside the server: rank 0 on the calling thread,
//! ranks 1.. as a [`TpGroup`]'s peer threads, each with its own backend, shard and KV cache. The
//! same group the server runs; here it proves the sharded model computes what the whole one does
//! (the equivalence tests) and runs on any machine.

use std::path::Path;
use std::time::Duration;

use super::{PeerConfig, Shard, TpGroup};
use crate::backend::{Backend, Precision, SeqSpan};
use crate::error::{Error, Result};
use crate::model::{ForwardBatch, Llama, Workspace};
use crate::runner::{Device, WithBackend};

/// Greedy decoding from rank 0's point of view.
#[derive(Debug, Clone)]
pub struct GreedyRun {
    pub tokens: Vec<u32>,
    /// The logits each token was chosen from (prefill's last row, then one per decode step).
    pub logits: Vec<Vec<f32>>,
}

pub struct TpOptions {
    /// Every rank's backend runs on this device.
    pub device: Device,
    pub world: usize,
    pub precision: Precision,
    /// Compute threads of each rank's CPU backend.
    pub threads_per_rank: usize,
    /// How long a collective waits for a stalled rank before the group fails.
    pub timeout: Duration,
    /// How the device collectives are set up (GPU ranks).
    pub group: super::GroupOptions,
    /// How the routed experts of an MoE model are split.
    pub moe: super::MoeSplit,
}

const BLOCK_SIZE: usize = 16;

/// Greedy-decodes `max_new` tokens after `prompt` with the model at `path` split over
/// `opts.world` ranks. Any rank's failure (a load error, a panic, a stall) fails the whole run with
/// that rank's error; no rank is left waiting.
pub fn greedy(path: &Path, opts: TpOptions, prompt: &[u32], max_new: usize) -> Result<GreedyRun> {
    opts.device.check(opts.precision)?;
    let job = Greedy {
        path,
        opts: &opts,
        prompt,
        max_new,
    };
    opts.device.with_backend(Some(opts.threads_per_rank), job)?
}

struct Greedy<'a> {
    path: &'a Path,
    opts: &'a TpOptions,
    prompt: &'a [u32],
    max_new: usize,
}

impl WithBackend for Greedy<'_> {
    type Output = Result<GreedyRun>;

    fn run<B: Backend + 'static>(self, backend: B) -> Result<GreedyRun> {
        let Greedy {
            path,
            opts,
            prompt,
            max_new,
        } = self;
        greedy_over(backend, path, opts, prompt, max_new)
    }
}

fn greedy_over<B: Backend>(
    backend: B,
    path: &Path,
    opts: &TpOptions,
    prompt: &[u32],
    max_new: usize,
) -> Result<GreedyRun> {
    let n_blocks = (prompt.len() + max_new).div_ceil(BLOCK_SIZE).max(1);
    let group = if opts.world > 1 {
        let cfg = PeerConfig {
            device: opts.device,
            model: path.to_path_buf(),
            precision: opts.precision,
            threads_per_rank: opts.threads_per_rank,
            block_size: BLOCK_SIZE,
            group: opts.group,
            moe: opts.moe,
            draft_model: None,
        };
        Some(TpGroup::spawn(cfg, opts.world, opts.timeout, &backend)?)
    } else {
        None
    };
    let (store, config) = crate::load::open_weights(path)?;
    let shard = Shard {
        rank: 0,
        world: opts.world,
        moe: opts.moe,
    };
    let model = Llama::load_shard(&backend, config, &store, opts.precision, shard, |_, _| {})?;
    let c = &model.config;
    if prompt.is_empty() || prompt.len() + max_new > c.max_context {
        return Err(Error::InvalidRequest(format!(
            "prompt of {} tokens + {max_new} new must be non-empty and fit the context of {}",
            prompt.len(),
            c.max_context
        )));
    }
    if let Some(g) = &group {
        g.size_caches(n_blocks)?;
    }
    let mut kv = backend.kv_store(
        c.n_layers,
        n_blocks,
        BLOCK_SIZE,
        model.local_kv_width(),
        c.kv_layout(),
        opts.precision,
    )?;
    let table: Vec<u32> = (0..n_blocks as u32).collect();
    let mut ws = Workspace::new(&backend)?;
    let mut run = GreedyRun {
        tokens: Vec::new(),
        logits: Vec::new(),
    };
    let (mut step_tokens, mut start) = (prompt.to_vec(), 0usize);
    for _ in 0..max_new {
        let n = step_tokens.len();
        let positions: Vec<usize> = (start..start + n).collect();
        let spans = [SeqSpan {
            first_token: 0,
            n_tokens: n,
            start_pos: start,
            block_table: &table,
            tree: None,
        }];
        let batch = ForwardBatch {
            tokens: &step_tokens,
            positions: &positions,
            spans: &spans,
            logit_rows: &[n - 1],
            fill: None,
        };
        let logits = match &group {
            Some(g) => g.step(&batch, |comm| {
                model.forward_sharded(&backend, &mut kv, &batch, &mut ws, comm)
            })?,
            None => model.forward(&backend, &mut kv, &batch, &mut ws)?,
        };
        let token = crate::sampling::argmax(&logits);
        start += n;
        step_tokens = vec![token];
        run.tokens.push(token);
        run.logits.push(logits);
    }
    Ok(run)
}
