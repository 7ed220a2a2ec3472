//! EAGLE-3 drafting for the batching engine: chains (topk = 1) and trees (topk > 1).
//!
//! The draft head keeps its own one-layer KV cache, paged with the target's block tables (same
//! slots, a separate store), so preemption, trimming and freeing follow the target for free.
//! Each engine step:
//!
//! 1. *propose* (before the target step): for each decoding sequence whose first draft token came
//!    out of the last extend, K-1 chained draft steps, each feeding back the draft's own output
//!    hidden state, give K draft tokens;
//! 2. the target verifies them, capturing its residual stream at the draft's aux layers;
//! 3. *extend* (after): every position the step confirmed (prefill chunks, the real token and the
//!    accepted drafts) goes through the draft with the target's hidden state and the token after
//!    it, rewriting the draft KV the chained steps wrote speculatively; its last row gives the
//!    next step's first draft token.
//!
//! A tree (`propose_tree`) grows the same way, `topk` frontier nodes per step: each step's
//! nodes get draft KV slots after the current token's, and a tree mask lets each see only its
//! ancestors; the extend after verification rewrites the accepted path's slots in place.
//!
//! Extend runs every step even when the policy drafts nothing: skipping it would leave holes in
//! the draft's KV that only the target's hidden states (gone by then) could fill. Only when the
//! adaptive policy parks the draft (drafting does not pay) is it skipped; the sequences running
//! then never draft again, and those admitted after the park draft again.

use std::collections::HashMap;

use super::tree::{self, Candidate, DraftTree};
use crate::backend::{Backend, SeqSpan, TreeMask};
use crate::batching::scheduler::SeqId;
use crate::error::Result;
use crate::model::{DraftSource, DraftState, DraftStep, Eagle3Draft};
use crate::sampling::argmax;

/// Runs one draft step on every rank holding a part of the draft (the one rank without tensor
/// parallelism) and returns its logits: the runner's bridge to the backend, the target's
/// embeddings and captured states, and the tensor-parallel peers. The drafter itself only
/// decides what to run and reads the logits.
pub type RunDraftStep<'a, B> =
    dyn FnMut(&Eagle3Draft<B>, &mut DraftState<B>, &DraftStep<'_>) -> Result<Vec<f32>> + 'a;

/// One sequence's positions confirmed by the target step just run.
pub struct Confirmed<'a> {
    pub id: SeqId,
    /// First confirmed position (the rest follow it).
    pub start: usize,
    /// Row of each confirmed position among the step's tokens (the rows of the captured hidden
    /// states): consecutive for a chain, the current token and the accepted nodes for a tree.
    pub batch_rows: Vec<usize>,
    /// The sequence's tokens, including the one after the last confirmed position.
    pub tokens: &'a [u32],
    pub block_table: &'a [u32],
    /// The sequence decodes next step, so it needs its first draft token.
    pub drafts_next: bool,
}

/// One sequence to draft for.
pub struct ChainRequest<'a> {
    pub id: SeqId,
    /// Tokens in the sequence now (the last one is the target's next input).
    pub len: usize,
    /// Draft tokens wanted (>= 1).
    pub k: usize,
    /// Covers positions up to `len - 1 + k` (the verify step reserves them first).
    pub block_table: &'a [u32],
}

/// One sequence to grow a draft tree for.
pub struct TreeRequest<'a> {
    pub id: SeqId,
    /// Tokens in the sequence now (the last one is the target's next input).
    pub len: usize,
    /// Tree depth wanted (>= 1): depth - 1 draft steps.
    pub depth: usize,
    /// Nodes kept for verification.
    pub nodes: usize,
    /// Covers positions up to `len - 1 + max(nodes, topk * (depth - 1))`.
    pub block_table: &'a [u32],
}

/// The first draft token of a sequence and where its hidden state is.
struct Pending {
    row: usize,
    first: u32,
    /// Trees: the `topk` best first tokens (target ids) with their draft log-probabilities.
    top: Vec<(u32, f32)>,
    len: usize,
}

pub struct EagleDrafter<B: Backend> {
    draft: Eagle3Draft<B>,
    /// Rank 0's draft KV and states (the last extend's outputs hold a row per sequence in
    /// `pending`, at its `row`).
    state: DraftState<B>,
    pending: HashMap<SeqId, Pending>,
    /// Candidates per draft step (1: chains).
    topk: usize,
}

impl<B: Backend> EagleDrafter<B> {
    pub fn new(
        draft: Eagle3Draft<B>,
        backend: &B,
        n_blocks: usize,
        block_size: usize,
        topk: usize,
    ) -> Result<Self> {
        Ok(EagleDrafter {
            topk: topk.max(1),
            state: DraftState::new(backend, &draft, n_blocks, block_size)?,
            draft,
            pending: HashMap::new(),
        })
    }

    /// The target layers the draft reads (the target step must capture them).
    pub fn aux_layers(&self) -> &[usize] {
        self.draft.aux_layers()
    }

    /// Whether `id`, now `len` tokens long, has its first draft token from the last extend.
    pub fn ready(&self, id: SeqId, len: usize) -> bool {
        self.pending.get(&id).is_some_and(|p| p.len == len)
    }

    /// Runs the draft over every confirmed position of the last target step (`run` reads its
    /// captured aux-layer states, a row per step token) and keeps the first draft token of each
    /// sequence that decodes next.
    pub fn extend(&mut self, run: &mut RunDraftStep<'_, B>, seqs: &[Confirmed<'_>]) -> Result<()> {
        self.pending.clear();
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut source_rows = Vec::new();
        let mut spans = Vec::new();
        let mut rows = Vec::new();
        let mut owners = Vec::new();
        for s in seqs.iter().filter(|s| !s.batch_rows.is_empty()) {
            let first = tokens.len();
            let count = s.batch_rows.len();
            for p in s.start..s.start + count {
                tokens.push(s.tokens[p + 1]);
                positions.push(p);
            }
            source_rows.extend_from_slice(&s.batch_rows);
            spans.push(SeqSpan {
                first_token: first,
                n_tokens: count,
                start_pos: s.start,
                block_table: s.block_table,
                tree: None,
            });
            if s.drafts_next {
                rows.push(tokens.len() - 1);
                owners.push((s.id, s.start + count + 1));
            }
        }
        if tokens.is_empty() {
            return Ok(());
        }
        let step = DraftStep {
            tokens: &tokens,
            positions: &positions,
            spans: &spans,
            source: DraftSource::Captured,
            input_rows: &source_rows,
            rows: &rows,
        };
        let logits = run(&self.draft, &mut self.state, &step)?;
        let vocab = self.draft.config.draft_vocab_size;
        for (row, &(id, len)) in owners.iter().enumerate() {
            let logits = &logits[row * vocab..(row + 1) * vocab];
            let first = self.draft.target_id(argmax(logits) as usize);
            let top = if self.topk > 1 {
                self.top_tokens(logits)
            } else {
                Vec::new()
            };
            self.pending.insert(
                id,
                Pending {
                    row,
                    first,
                    top,
                    len,
                },
            );
        }
        Ok(())
    }

    /// `k` draft tokens for each request (all must be `ready`): the extend's first token, then
    /// chained steps batched across the sequences still drafting.
    pub fn propose(
        &mut self,
        run: &mut RunDraftStep<'_, B>,
        reqs: &[ChainRequest<'_>],
    ) -> Result<Vec<Vec<u32>>> {
        let mut drafts: Vec<Vec<u32>> = reqs
            .iter()
            .map(|r| {
                self.pending
                    .get(&r.id)
                    .map(|p| vec![p.first])
                    .unwrap_or_default()
            })
            .collect();
        let vocab = self.draft.config.draft_vocab_size;
        // Indices into `reqs` of the sequences drafting, in order, and the row of each one's
        // input state in `source`.
        let mut active: Vec<usize> = (0..reqs.len()).filter(|&i| !drafts[i].is_empty()).collect();
        let mut source = DraftSource::Extended;
        let mut source_rows: Vec<usize> = active
            .iter()
            .filter_map(|&i| self.pending.get(&reqs[i].id).map(|p| p.row))
            .collect();
        for j in 1.. {
            // Those wanting more than j tokens continue.
            let keep: Vec<usize> = (0..active.len())
                .filter(|&a| reqs[active[a]].k > j)
                .collect();
            if keep.is_empty() {
                break;
            }
            let input_rows: Vec<usize> = keep.iter().map(|&a| source_rows[a]).collect();
            active = keep.iter().map(|&a| active[a]).collect();
            let tokens: Vec<u32> = active
                .iter()
                .map(|&i| drafts[i].last().copied().unwrap_or_default())
                .collect();
            // Draft token j belongs at position len - 1 + j. Step j feeds it at the position
            // before (len - 2 + j), where the target's hidden state is not known yet, so the
            // draft's own output from the position before that stands in.
            let positions: Vec<usize> = active.iter().map(|&i| reqs[i].len - 2 + j).collect();
            let spans: Vec<SeqSpan> = active
                .iter()
                .enumerate()
                .map(|(t, &i)| SeqSpan {
                    first_token: t,
                    n_tokens: 1,
                    start_pos: positions[t],
                    block_table: reqs[i].block_table,
                    tree: None,
                })
                .collect();
            let all: Vec<usize> = (0..active.len()).collect();
            let step = DraftStep {
                tokens: &tokens,
                positions: &positions,
                spans: &spans,
                source,
                input_rows: &input_rows,
                rows: &all,
            };
            let logits = run(&self.draft, &mut self.state, &step)?;
            for (t, &i) in active.iter().enumerate() {
                let id = argmax(&logits[t * vocab..(t + 1) * vocab]) as usize;
                drafts[i].push(self.draft.target_id(id));
            }
            // The next step reads this one's outputs, a row per active sequence.
            source = DraftSource::Previous;
            source_rows = all;
        }
        Ok(drafts)
    }

    /// The `topk` best draft tokens of a logits row, as target ids with log-probabilities.
    fn top_tokens(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let mut lp = logits.to_vec();
        tree::log_softmax(&mut lp);
        tree::top_k(&lp, self.topk)
            .into_iter()
            .map(|(i, l)| (self.draft.target_id(i), l))
            .collect()
    }

    /// A draft tree for each request (all must be `ready`): the extend's `topk` best first
    /// tokens, then `depth - 1` draft steps, each expanding the `topk` best frontier nodes of
    /// every request in one batch; the best `nodes` candidates are kept.
    pub fn propose_tree(
        &mut self,
        run: &mut RunDraftStep<'_, B>,
        reqs: &[TreeRequest<'_>],
    ) -> Result<Vec<DraftTree>> {
        let k = self.topk;
        let vocab = self.draft.config.draft_vocab_size;
        let mut cands: Vec<Vec<Candidate>> = Vec::with_capacity(reqs.len());
        // Per request: frontier candidates, and each one's input state: a row of `rows` (the
        // extend's outputs) at depth 1, of the previous step's outputs after that.
        let mut frontier: Vec<Vec<(usize, usize)>> = Vec::with_capacity(reqs.len());
        // Per request: the draft KV slot (relative to the current token's) of each candidate
        // already run through the draft, and the next free one.
        let mut slot_of: Vec<Vec<Option<usize>>> = Vec::with_capacity(reqs.len());
        let mut next_slot = vec![0usize; reqs.len()];
        let mut rows = Vec::new();
        for r in reqs {
            let (c, f) = match self.pending.get(&r.id) {
                Some(p) => {
                    let c: Vec<Candidate> = p
                        .top
                        .iter()
                        .map(|&(token, score)| Candidate {
                            token,
                            parent: None,
                            score,
                            depth: 1,
                        })
                        .collect();
                    let f = (0..c.len()).map(|i| (i, rows.len())).collect();
                    rows.push(p.row);
                    (c, f)
                }
                None => (Vec::new(), Vec::new()),
            };
            slot_of.push(vec![None; c.len()]);
            cands.push(c);
            frontier.push(f);
        }
        let mut source = DraftSource::Extended;
        for d in 1.. {
            // Frontier nodes at depth d of requests wanting depth > d run through the draft.
            let mut tokens = Vec::new();
            let mut positions = Vec::new();
            let mut input_rows = Vec::new();
            let mut masks: Vec<Vec<u64>> = Vec::new();
            // (request, candidate) of each batch row.
            let mut owner = Vec::new();
            let mut span_of = Vec::new();
            for (ri, r) in reqs.iter().enumerate() {
                if r.depth <= d || frontier[ri].is_empty() {
                    continue;
                }
                let mut mask = Vec::new();
                for &(c, h) in &frontier[ri] {
                    let slot = next_slot[ri];
                    next_slot[ri] += 1;
                    slot_of[ri][c] = Some(slot);
                    let mut bits = 1u64 << slot;
                    let mut up = cands[ri][c].parent;
                    while let Some(p) = up {
                        if let Some(s) = slot_of[ri][p] {
                            bits |= 1u64 << s;
                        }
                        up = cands[ri][p].parent;
                    }
                    mask.push(bits);
                    tokens.push(cands[ri][c].token);
                    // Depth-d nodes sit at position len - 1 + d; the draft step feeding one runs
                    // at the position before (as in a chain).
                    positions.push(r.len - 2 + d);
                    input_rows.push(match source {
                        DraftSource::Extended => rows[h],
                        _ => h,
                    });
                    owner.push((ri, c));
                }
                span_of.push((
                    ri,
                    tokens.len() - mask.len(),
                    mask.len(),
                    next_slot[ri] - mask.len(),
                ));
                masks.push(mask);
            }
            if tokens.is_empty() {
                break;
            }
            let spans: Vec<SeqSpan> = span_of
                .iter()
                .zip(&masks)
                .map(|(&(ri, first, n, slot0), mask)| SeqSpan {
                    first_token: first,
                    n_tokens: n,
                    start_pos: reqs[ri].len - 1 + slot0,
                    block_table: reqs[ri].block_table,
                    tree: Some(TreeMask {
                        base: reqs[ri].len - 1,
                        rows: mask,
                    }),
                })
                .collect();
            let all: Vec<usize> = (0..tokens.len()).collect();
            let step = DraftStep {
                tokens: &tokens,
                positions: &positions,
                spans: &spans,
                source,
                input_rows: &input_rows,
                rows: &all,
            };
            let logits = run(&self.draft, &mut self.state, &step)?;
            drop(spans);
            // Children of every expanded node; the best `topk` of each request form its frontier.
            let mut children: Vec<Vec<(usize, usize)>> = vec![Vec::new(); reqs.len()];
            for (t, &(ri, c)) in owner.iter().enumerate() {
                let parent = cands[ri][c];
                for (token, lp) in self.top_tokens(&logits[t * vocab..(t + 1) * vocab]) {
                    cands[ri].push(Candidate {
                        token,
                        parent: Some(c),
                        score: parent.score + lp,
                        depth: d + 1,
                    });
                    slot_of[ri].push(None);
                    children[ri].push((cands[ri].len() - 1, t));
                }
            }
            for (ri, mut ch) in children.into_iter().enumerate() {
                if ch.is_empty() {
                    frontier[ri].clear();
                    continue;
                }
                ch.sort_by(|a, b| cands[ri][b.0].score.total_cmp(&cands[ri][a.0].score));
                ch.truncate(k);
                frontier[ri] = ch;
            }
            source = DraftSource::Previous;
        }
        Ok(reqs
            .iter()
            .zip(&cands)
            .map(|(r, c)| DraftTree::select(c, r.nodes))
            .collect())
    }
}
