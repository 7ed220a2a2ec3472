//! Decode steps as recorded graphs (CUDA graphs, `--cuda-graph-max-bs`, `--disable-cuda-graph`):
//! a plain decode step (every sequence feeds its one last token, no drafts) is padded to the
//! next batch-size bucket and replayed from the graph recorded for that bucket, so a step is
//! one launch instead of hundreds. Prefill chunks, verification steps and batches past the
//! largest bucket run eagerly.
//!
//! Padding sequences feed token 0 at position 0 into a KV block of their own, past the blocks
//! the scheduler hands out, so they never touch a real sequence's cache; their logits rows are
//! never sampled. Every table is padded to one width (the context bound in blocks), so a
//! replay stages arrays of exactly the sizes the recording did.
//!
//! Everything here is host bookkeeping and is tested on the CPU; [`GraphUse::PadOnly`] runs the
//! padding without graphs on any backend, which is how the tests prove it leaves the tokens as
//! they were.

use crate::backend::{Backend, GraphPhase, SeqSpan};
use crate::error::Result;
use crate::parallel::Communicator;

/// Whether every rank of the group says yes (`mine` from this one): a sum over the group's host
/// communicator, which every rank calls at the same point of the same step.
pub fn all_ranks_agree(host: &dyn Communicator, mine: bool) -> Result<bool> {
    let mut votes = [f32::from(u8::from(mine))];
    host.all_reduce_sum(&mut votes)?;
    Ok(votes[0] as usize == host.world())
}

/// SGLang's default `--cuda-graph-max-bs`-like bound kiln uses: batches up to this size decode
/// from graphs.
pub const DEFAULT_MAX_BS: usize = 128;

/// Whether decode steps use graphs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphUse {
    Off,
    /// Record and replay on a backend that records graphs (the CUDA backend); eager elsewhere.
    Record {
        max_bs: usize,
    },
    /// Pad decode steps to their buckets without graphs, on any backend (tests).
    PadOnly {
        max_bs: usize,
    },
}

impl Default for GraphUse {
    fn default() -> Self {
        GraphUse::Record {
            max_bs: DEFAULT_MAX_BS,
        }
    }
}

/// The batch sizes that get a graph: 1, 2, 4, 8, then every 8 up to `max_bs` (SGLang's
/// capture sizes), and `max_bs` itself.
pub fn buckets(max_bs: usize) -> Vec<usize> {
    let mut b: Vec<usize> = [1, 2, 4, 8]
        .into_iter()
        .chain((16..=max_bs).step_by(8))
        .filter(|&s| s <= max_bs)
        .collect();
    if max_bs > 0 && b.last() != Some(&max_bs) {
        b.push(max_bs);
    }
    b
}

/// The smallest bucket holding `n` sequences.
pub fn bucket_for(buckets: &[usize], n: usize) -> Option<usize> {
    buckets.iter().copied().find(|&b| b >= n)
}

/// The graphs' fixed shape.
#[derive(Clone, Debug)]
pub struct DecodeGraphs {
    pub buckets: Vec<usize>,
    /// The KV block padding sequences write to (one past the scheduler's).
    pub pad_block: u32,
    /// Every padded block table's length.
    pub table_blocks: usize,
    /// The longest context a step may attend over.
    pub context_bound: usize,
    /// Record and replay graphs (`false`: pad only).
    pub record: bool,
}

/// A decode step padded to its bucket, owning what its forward borrows.
#[derive(Clone, Debug, PartialEq)]
pub struct Padded {
    pub bucket: usize,
    pub tokens: Vec<u32>,
    pub positions: Vec<usize>,
    starts: Vec<usize>,
    tables: Vec<Vec<u32>>,
    pub logit_rows: Vec<usize>,
    /// Per token, the previous draw's row it takes its id from (`-1`: its own id; padding
    /// never fills). Always present, so a graph's embedding reads a fill array whether or not
    /// the step it replays fills (overlap scheduling).
    pub fill: Vec<i32>,
}

impl Padded {
    /// One span per sequence (real ones first), one token each.
    pub fn spans(&self) -> Vec<SeqSpan<'_>> {
        self.starts
            .iter()
            .zip(&self.tables)
            .enumerate()
            .map(|(i, (&start_pos, table))| SeqSpan {
                first_token: i,
                n_tokens: 1,
                start_pos,
                block_table: table,
                tree: None,
            })
            .collect()
    }
}

impl DecodeGraphs {
    /// `kv_blocks` blocks of `block_size` tokens serve the scheduler; contexts are at most
    /// `max_context` tokens.
    pub fn new(
        max_bs: usize,
        kv_blocks: usize,
        block_size: usize,
        max_context: usize,
        record: bool,
    ) -> DecodeGraphs {
        let context_bound = max_context.min(kv_blocks * block_size).max(1);
        DecodeGraphs {
            buckets: buckets(max_bs),
            pad_block: kv_blocks as u32,
            // One more block: a table also covers the slots of the token being decoded.
            table_blocks: context_bound.div_ceil(block_size) + 1,
            context_bound,
            record,
        }
    }

    /// Staging bytes one step of `bucket` takes at most: per token its position, cache
    /// position, sequence, tree base and row, id, fill row, gathered rows (the LM head's and up
    /// to four captured layers'), and its padded table; 256 bytes of alignment per array.
    pub fn staging_bytes(&self, bucket: usize) -> usize {
        bucket * (7 * 4 + 8 + 4 * 4 + 4 * self.table_blocks) + 17 * 256
    }

    /// The step padded to its bucket, when it is a plain decode step that fits one: every span
    /// one causal token with a logits row, in order, within the bound.
    pub fn pad(
        &self,
        tokens: &[u32],
        positions: &[usize],
        spans: &[SeqSpan<'_>],
        logit_rows: &[usize],
    ) -> Option<Padded> {
        let n = spans.len();
        let plain = n > 0
            && tokens.len() == n
            && logit_rows.len() == n
            && spans.iter().enumerate().all(|(i, s)| {
                s.first_token == i
                    && s.n_tokens == 1
                    && s.tree.is_none()
                    && logit_rows[i] == i
                    && positions[i] == s.start_pos
                    && s.start_pos < self.context_bound
                    && s.block_table.len() <= self.table_blocks
            });
        if !plain {
            return None;
        }
        let bucket = bucket_for(&self.buckets, n)?;
        let pad_table = vec![self.pad_block; self.table_blocks];
        let mut p = Padded {
            bucket,
            tokens: tokens.to_vec(),
            positions: positions.to_vec(),
            starts: spans.iter().map(|s| s.start_pos).collect(),
            tables: spans
                .iter()
                .map(|s| {
                    let mut t = s.block_table.to_vec();
                    t.resize(self.table_blocks, self.pad_block);
                    t
                })
                .collect(),
            logit_rows: (0..bucket).collect(),
            fill: vec![-1; bucket],
        };
        for _ in n..bucket {
            p.tokens.push(0);
            p.positions.push(0);
            p.starts.push(0);
            p.tables.push(pad_table.clone());
        }
        Some(p)
    }

    /// An all-padding step of `bucket` (what warm-up records).
    pub fn warm_up_step(&self, bucket: usize) -> Padded {
        Padded {
            bucket,
            tokens: vec![0; bucket],
            positions: vec![0; bucket],
            starts: vec![0; bucket],
            tables: vec![vec![self.pad_block; self.table_blocks]; bucket],
            logit_rows: (0..bucket).collect(),
            fill: vec![-1; bucket],
        }
    }
}

/// One forward of a padded step in a graph phase, as every tensor-parallel rank runs it on its
/// own backend (the arguments of [`Backend::begin_graph`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphStep {
    pub phase: GraphPhase,
    pub bucket: usize,
    pub context_bound: usize,
    pub staging_bytes: usize,
}

impl GraphStep {
    /// Runs `forward` inside the phase: begun, run, ended (launching a replay), or left after a
    /// failure in between. `all_ranks` tells whether every rank of the group says yes (under
    /// tensor parallelism a host collective; alone, the answer itself), so the ranks decide alike:
    /// - a replay runs only if every rank still holds the bucket's graph (one is dropped when a
    ///   buffer grows, which need not happen on every rank at once); otherwise every rank runs
    ///   `forward` eagerly and the call returns `false` (the runner records the bucket again);
    /// - a recording counts only if every rank recorded (`false` otherwise: the runner turns
    ///   graphs off; a recording runs no collective, so one that failed need not take the group
    ///   down).
    pub fn run<B: Backend>(
        self,
        backend: &B,
        mut all_ranks: impl FnMut(bool) -> Result<bool>,
        forward: impl FnOnce() -> Result<()>,
    ) -> Result<bool> {
        if self.phase == GraphPhase::Replay && !all_ranks(backend.has_graph(self.bucket))? {
            return forward().map(|()| false);
        }
        let run = backend
            .begin_graph(
                self.bucket,
                self.phase,
                self.context_bound,
                self.staging_bytes,
            )
            .and_then(|()| {
                let run = forward().and_then(|()| backend.end_graph());
                if run.is_err() {
                    backend.abort_graph();
                }
                run
            });
        match run {
            Err(e) if e.backend_lost() || self.phase != GraphPhase::Record => Err(e),
            Err(e) => {
                tracing::warn!("a decode graph could not be recorded: {e}");
                all_ranks(false).map(|_| false)
            }
            Ok(()) if self.phase == GraphPhase::Record => all_ranks(true),
            Ok(()) => Ok(true),
        }
    }

    /// Whether the phase computes anything (a recording only records: no logits to read).
    pub fn computes(self) -> bool {
        self.phase != GraphPhase::Record
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_follow_sglang_s_sizes_and_end_at_the_maximum() {
        assert_eq!(buckets(1), [1]);
        assert_eq!(buckets(6), [1, 2, 4, 6]);
        assert_eq!(buckets(32), [1, 2, 4, 8, 16, 24, 32]);
        assert_eq!(buckets(20), [1, 2, 4, 8, 16, 20]);
        assert!(buckets(0).is_empty());
        let b = buckets(128);
        assert_eq!(bucket_for(&b, 1), Some(1));
        assert_eq!(bucket_for(&b, 3), Some(4));
        assert_eq!(bucket_for(&b, 9), Some(16));
        assert_eq!(bucket_for(&b, 128), Some(128));
        assert_eq!(bucket_for(&b, 129), None);
    }

    fn graphs() -> DecodeGraphs {
        // 10 blocks of 4 for the scheduler, contexts up to 64 tokens (bounded by the pool: 40).
        DecodeGraphs::new(8, 10, 4, 64, true)
    }

    #[test]
    fn the_pool_bounds_the_context_and_the_pad_block_is_past_it() {
        let g = graphs();
        assert_eq!(g.context_bound, 40);
        assert_eq!(g.table_blocks, 11);
        assert_eq!(g.pad_block, 10);
    }

    #[test]
    fn a_decode_step_pads_to_its_bucket_with_sequences_of_its_own() {
        let g = graphs();
        let (t0, t1, t2) = ([3u32, 4], [5u32], [6u32, 7, 8]);
        let spans = [
            SeqSpan {
                first_token: 0,
                n_tokens: 1,
                start_pos: 5,
                block_table: &t0,
                tree: None,
            },
            SeqSpan {
                first_token: 1,
                n_tokens: 1,
                start_pos: 0,
                block_table: &t1,
                tree: None,
            },
            SeqSpan {
                first_token: 2,
                n_tokens: 1,
                start_pos: 9,
                block_table: &t2,
                tree: None,
            },
        ];
        let p = g
            .pad(&[11, 12, 13], &[5, 0, 9], &spans, &[0, 1, 2])
            .expect("a plain decode step");
        assert_eq!(p.bucket, 4);
        assert_eq!(p.fill, [-1; 4], "nothing fills until the runner says so");
        assert_eq!(p.tokens, [11, 12, 13, 0]);
        assert_eq!(p.positions, [5, 0, 9, 0]);
        assert_eq!(p.logit_rows, [0, 1, 2, 3]);
        let s = p.spans();
        assert_eq!(s.len(), 4);
        assert_eq!(s[0].block_table[..3], [3, 4, 10]);
        assert!(
            s.iter()
                .all(|s| s.block_table.len() == 11 && s.n_tokens == 1)
        );
        assert_eq!((s[3].start_pos, s[3].first_token), (0, 3));
        assert!(s[3].block_table.iter().all(|&b| b == 10));
        // The warm-up step has the same shape: a replay stages what the recording staged.
        let w = g.warm_up_step(4);
        assert_eq!(w.tokens.len(), p.tokens.len());
        assert_eq!(
            w.spans().iter().map(|s| s.block_table.len()).sum::<usize>(),
            s.iter().map(|s| s.block_table.len()).sum::<usize>()
        );
    }

    #[test]
    fn prefill_drafts_trees_and_oversized_batches_stay_eager() {
        let g = graphs();
        let t = [1u32];
        let span = |first_token, n_tokens, start_pos| SeqSpan {
            first_token,
            n_tokens,
            start_pos,
            block_table: &t,
            tree: None,
        };
        // A prefill chunk of two tokens.
        assert!(g.pad(&[1, 2], &[0, 1], &[span(0, 2, 0)], &[1]).is_none());
        // A sequence that does not sample this step.
        assert!(g.pad(&[1], &[3], &[span(0, 1, 3)], &[]).is_none());
        // A tree.
        let rows = [1u64];
        let mut tree = span(0, 1, 3);
        tree.tree = Some(crate::backend::TreeMask {
            base: 3,
            rows: &rows,
        });
        assert!(g.pad(&[1], &[3], &[tree], &[0]).is_none());
        // Past the context bound.
        assert!(g.pad(&[1], &[40], &[span(0, 1, 40)], &[0]).is_none());
        // More sequences than the largest bucket.
        let many: Vec<SeqSpan> = (0..9).map(|i| span(i, 1, 0)).collect();
        let ids = vec![1u32; 9];
        let rows: Vec<usize> = (0..9).collect();
        assert!(g.pad(&ids, &[0; 9], &many, &rows).is_none());
        assert!(g.pad(&ids[..8], &[0; 8], &many[..8], &rows[..8]).is_some());
    }
}
