//! EAGLE-3 chain drafting (topk = 1) for the batching engine.
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
//! Extend runs every step even when the policy drafts nothing: skipping it would leave holes in
//! the draft's KV that only the target's hidden states (gone by then) could fill.

use std::collections::HashMap;

use crate::backend::{Backend, SeqSpan};
use crate::batching::scheduler::SeqId;
use crate::error::Result;
use crate::model::{DraftInput, DraftWorkspace, Eagle3Draft};
use crate::sampling::argmax;

/// One sequence's positions confirmed by the target step just run.
pub struct Confirmed<'a> {
    pub id: SeqId,
    /// First confirmed position, and how many.
    pub start: usize,
    pub count: usize,
    /// Row of `start` among the step's tokens (the rows of the captured hidden states).
    pub batch_row: usize,
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

/// The first draft token of a sequence and where its hidden state is.
struct Pending {
    row: usize,
    first: u32,
    len: usize,
}

pub struct EagleDrafter<B: Backend> {
    draft: Eagle3Draft<B>,
    kv: B::KvStore,
    ws: DraftWorkspace<B>,
    /// The last extend's output hidden states, a row per sequence in `pending`.
    hidden: B::Buffer,
    pending: HashMap<SeqId, Pending>,
}

impl<B: Backend> EagleDrafter<B> {
    pub fn new(draft: Eagle3Draft<B>, backend: &B, n_blocks: usize, block_size: usize) -> Self {
        let kv = backend.kv_store(1, n_blocks, block_size, draft.kv_width());
        EagleDrafter {
            draft,
            kv,
            ws: DraftWorkspace::new(backend),
            hidden: backend.buffer(0, 0),
            pending: HashMap::new(),
        }
    }

    /// The target layers the draft reads (the target step must capture them).
    pub fn aux_layers(&self) -> &[usize] {
        self.draft.aux_layers()
    }

    /// Whether `id`, now `len` tokens long, has its first draft token from the last extend.
    pub fn ready(&self, id: SeqId, len: usize) -> bool {
        self.pending.get(&id).is_some_and(|p| p.len == len)
    }

    /// Runs the draft over every confirmed position of the last target step (`captured`: its
    /// aux-layer hidden states, a row per step token) and keeps the first draft token of each
    /// sequence that decodes next.
    pub fn extend(
        &mut self,
        backend: &B,
        target_embed: &B::Matrix,
        captured: &[B::Buffer],
        seqs: &[Confirmed<'_>],
    ) -> Result<()> {
        self.pending.clear();
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut source_rows = Vec::new();
        let mut spans = Vec::new();
        let mut rows = Vec::new();
        let mut owners = Vec::new();
        for s in seqs.iter().filter(|s| s.count > 0) {
            let first = tokens.len();
            for p in s.start..s.start + s.count {
                tokens.push(s.tokens[p + 1]);
                positions.push(p);
            }
            source_rows.extend(s.batch_row..s.batch_row + s.count);
            spans.push(SeqSpan {
                first_token: first,
                n_tokens: s.count,
                start_pos: s.start,
                block_table: s.block_table,
            });
            if s.drafts_next {
                rows.push(tokens.len() - 1);
                owners.push((s.id, s.start + s.count + 1));
            }
        }
        if tokens.is_empty() {
            return Ok(());
        }
        let aux: Vec<B::Buffer> = captured
            .iter()
            .map(|c| backend.gather_rows(c, &source_rows))
            .collect();
        let out = self.draft.forward(
            backend,
            target_embed,
            &mut self.kv,
            &tokens,
            &positions,
            &spans,
            DraftInput::Target(&aux),
            &rows,
            &mut self.ws,
        )?;
        let vocab = self.draft.config.draft_vocab_size;
        for (row, &(id, len)) in owners.iter().enumerate() {
            let first = self
                .draft
                .target_id(argmax(&out.logits[row * vocab..(row + 1) * vocab]) as usize);
            self.pending.insert(id, Pending { row, first, len });
        }
        self.hidden = out.hidden;
        Ok(())
    }

    /// `k` draft tokens for each request (all must be `ready`): the extend's first token, then
    /// chained steps batched across the sequences still drafting.
    pub fn propose(
        &mut self,
        backend: &B,
        target_embed: &B::Matrix,
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
        // Indices into `reqs` of the sequences in `hidden`'s rows, in order.
        let mut active: Vec<usize> = (0..reqs.len()).filter(|&i| !drafts[i].is_empty()).collect();
        let rows: Vec<usize> = active
            .iter()
            .filter_map(|&i| self.pending.get(&reqs[i].id).map(|p| p.row))
            .collect();
        let mut hidden = backend.gather_rows(&self.hidden, &rows);
        for j in 1.. {
            // Those wanting more than j tokens continue; their rows in the current `hidden`.
            let keep: Vec<usize> = (0..active.len())
                .filter(|&a| reqs[active[a]].k > j)
                .collect();
            if keep.is_empty() {
                break;
            }
            let input = backend.gather_rows(&hidden, &keep);
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
                })
                .collect();
            let all: Vec<usize> = (0..active.len()).collect();
            let out = self.draft.forward(
                backend,
                target_embed,
                &mut self.kv,
                &tokens,
                &positions,
                &spans,
                DraftInput::Own(&input),
                &all,
                &mut self.ws,
            )?;
            for (t, &i) in active.iter().enumerate() {
                let id = argmax(&out.logits[t * vocab..(t + 1) * vocab]) as usize;
                drafts[i].push(self.draft.target_id(id));
            }
            hidden = out.hidden;
        }
        Ok(drafts)
    }
}
