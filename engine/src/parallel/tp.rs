//! Tensor-parallel decoding on the CPU: one thread per rank, each with its own backend, its shard
//! of the weights and its part of the KV cache, joined by a [`ThreadComm`] group. This is the
//! layout a GPU box runs with one rank per GPU over NCCL; on the CPU it proves the sharded model
//! computes what the whole one does (the equivalence tests) and runs on any machine.
//!
//! Rank 0 picks each token and shares it with the others through the communicator, so every rank
//! feeds the same token even if float noise ever made their logits differ.

use std::path::Path;
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use super::{CommError, Communicator, Shard, ThreadComm};
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, Precision, SeqSpan};
use crate::error::{Error, Result};
use crate::model::{ForwardBatch, Llama, Workspace};

/// Greedy decoding from rank 0's point of view.
#[derive(Debug, Clone)]
pub struct GreedyRun {
    pub tokens: Vec<u32>,
    /// The logits each token was chosen from (prefill's last row, then one per decode step).
    pub logits: Vec<Vec<f32>>,
}

pub struct TpOptions {
    pub world: usize,
    pub precision: Precision,
    /// Compute threads of each rank's CPU backend.
    pub threads_per_rank: usize,
    /// How long a collective waits for a stalled rank before the group fails.
    pub timeout: Duration,
}

const BLOCK_SIZE: usize = 16;

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn rank_main(
    path: &Path,
    opts: &TpOptions,
    comm: &ThreadComm,
    prompt: &[u32],
    max_new: usize,
) -> Result<GreedyRun> {
    let (store, config) = crate::load::open_weights(path)?;
    let backend = CpuBackend::with_threads(opts.threads_per_rank);
    let shard = Shard {
        rank: comm.rank(),
        world: comm.world(),
    };
    let model = Llama::load_shard(&backend, config, &store, opts.precision, shard, |_, _| {})?;
    let c = &model.config;
    let total = prompt.len() + max_new;
    if prompt.is_empty() || total > c.max_context {
        return Err(Error::InvalidRequest(format!(
            "prompt of {} tokens + {max_new} new must be non-empty and fit the context of {}",
            prompt.len(),
            c.max_context
        )));
    }
    let n_blocks = total.div_ceil(BLOCK_SIZE);
    let mut kv = backend.kv_store(c.n_layers, n_blocks, BLOCK_SIZE, model.local_kv_width());
    let table: Vec<u32> = (0..n_blocks as u32).collect();
    let mut ws = Workspace::new(&backend);
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
        }];
        let batch = ForwardBatch {
            tokens: &step_tokens,
            positions: &positions,
            spans: &spans,
            logit_rows: &[n - 1],
        };
        let logits = model.forward_sharded(&backend, &mut kv, &batch, &mut ws, comm)?;
        // Rank 0's choice, broadcast: every rank gathers each rank's candidate and takes rank 0's.
        let mine = [argmax(&logits) as f32];
        let mut all = vec![0f32; comm.world()];
        comm.all_gather(&mine, &mut all)?;
        let token = all[0] as u32;
        start += n;
        step_tokens = vec![token];
        run.tokens.push(token);
        run.logits.push(logits);
    }
    Ok(run)
}

/// Greedy-decodes `max_new` tokens after `prompt` with the model at `path` split over
/// `opts.world` ranks. Any rank's failure (a load error, a panic, a stall) fails the whole run with
/// that rank's error; no rank is left waiting.
pub fn greedy(path: &Path, opts: TpOptions, prompt: &[u32], max_new: usize) -> Result<GreedyRun> {
    let opts = Arc::new(opts);
    let prompt: Arc<[u32]> = prompt.into();
    let handles: Vec<_> = ThreadComm::group(opts.world, opts.timeout)
        .into_iter()
        .map(|comm| {
            let (path, opts, prompt) = (path.to_path_buf(), opts.clone(), prompt.clone());
            thread::Builder::new()
                .name(format!("kiln-tp-rank{}", comm.rank()))
                .spawn(move || {
                    let out = rank_main(&path, &opts, &comm, &prompt, max_new);
                    if out.is_err() {
                        comm.abort();
                    }
                    out
                })
        })
        .collect();
    let mut results = Vec::new();
    for (rank, h) in handles.into_iter().enumerate() {
        let joined = h
            .map_err(|e| Error::io(path, e))?
            .join()
            .unwrap_or(Err(Error::Parallel(CommError::PeerFailed { rank })));
        results.push(joined);
    }
    // Report the cause, not the ranks that merely saw a peer fail.
    let is_echo = |e: &Error| matches!(e, Error::Parallel(CommError::PeerFailed { .. }));
    if let Some(pos) = results
        .iter()
        .position(|r| r.as_ref().is_err_and(|e| !is_echo(e)))
    {
        return results.swap_remove(pos);
    }
    results.swap_remove(0)
}
