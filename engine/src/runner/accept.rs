//! Turning a sequence's logits rows into the tokens it emits: plain sampling, a verified chain of
//! draft tokens (exact greedy or rejection sampling), or the accepted path through a draft tree.
//! Every token goes through the sequence's token mask first, and emission stops at the token that
//! ends the request, so nothing after it is accepted or counted.

use crate::generate::FinishReason;
use crate::sampling::{Sampled, Sampler};
use crate::speculation::tree::DraftTree;
use crate::tokenizer::Tokenizer;

use super::plan::{SeqOutput, SeqParams, SeqPlan, TokenMask};

/// When a sequence ends, judged token by token as it emits.
pub struct StopRule<'a> {
    pub tokenizer: &'a Tokenizer,
    pub params: &'a SeqParams,
    pub tokens_left: usize,
    pub context_left: usize,
}

impl StopRule<'_> {
    /// Why the sequence ends after emitting `token` as its `emitted`-th token of this step.
    pub fn after(&self, token: u32, emitted: usize) -> Option<FinishReason> {
        let p = self.params;
        if p.stop_token_ids.contains(&token) || (!p.ignore_eos && self.tokenizer.is_eos(token)) {
            Some(FinishReason::Eos)
        } else if emitted >= self.tokens_left {
            Some(FinishReason::Length)
        } else if emitted >= self.context_left {
            Some(FinishReason::ContextFull)
        } else {
            None
        }
    }
}

/// One sequence's logits for this step: `rows[j]` is the row after its `j`-th fed position
/// from the last real token on (row 0: after the real token; row 1 + i: after draft i or tree
/// node i).
pub struct SeqLogits<'a> {
    pub logits: &'a [f32],
    pub first_row: usize,
    pub vocab: usize,
}

impl SeqLogits<'_> {
    fn row(&self, j: usize, mask: Option<&TokenMask>) -> Vec<f32> {
        let r = self.first_row + j;
        let mut row = self.logits[r * self.vocab..(r + 1) * self.vocab].to_vec();
        if let Some(m) = mask {
            m.apply(&mut row);
        }
        row
    }
}

/// A chain: each draft token stands while verification accepts it; the first rejection (or a
/// plain step's only row) samples the token that replaces it.
pub fn chain(
    sampler: &mut Sampler,
    rows: &SeqLogits<'_>,
    plan: &SeqPlan<'_>,
    drafts: &[u32],
    stop: &StopRule<'_>,
) -> SeqOutput {
    let mut out = SeqOutput {
        drafted: drafts.len(),
        ..Default::default()
    };
    for j in 0..=drafts.len() {
        let mut row = rows.row(j, plan.mask);
        let (sampled, is_draft) = match drafts.get(j) {
            Some(&d) => sampler.verify(&mut row, d),
            None => (sampler.sample(&mut row), false),
        };
        if emit(&mut out, sampled, stop) || !is_draft {
            break;
        }
        // An accepted draft's KV entry is already in the cache.
        out.accepted += 1;
    }
    out
}

/// A tree: sample at each node the target reached and follow the child carrying that token, so
/// the tokens are exactly those plain decoding would emit. Returns the output and the accepted
/// path's nodes.
pub fn tree(
    sampler: &mut Sampler,
    rows: &SeqLogits<'_>,
    plan: &SeqPlan<'_>,
    tree: &DraftTree,
    stop: &StopRule<'_>,
) -> (SeqOutput, Vec<usize>) {
    let mut out = SeqOutput {
        drafted: tree.len(),
        ..Default::default()
    };
    let path = tree.accepted_path(|at| {
        let mut row = rows.row(at.map_or(0, |n| n + 1), plan.mask);
        let sampled = sampler.sample(&mut row);
        let token = sampled.token;
        // A token that ends the request stops the walk (as in a chain, it is not accepted).
        (!emit(&mut out, sampled, stop)).then_some(token)
    });
    out.accepted = path.len();
    (out, path)
}

/// Appends one token; `true` when it ends the sequence.
fn emit(out: &mut SeqOutput, sampled: Sampled, stop: &StopRule<'_>) -> bool {
    let token = sampled.token;
    out.tokens.push(sampled);
    out.finish = stop.after(token, out.tokens.len());
    out.finish.is_some()
}
