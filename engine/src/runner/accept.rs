//! Turning a sequence's logits rows into the tokens it emits: plain sampling, a verified chain of
//! draft tokens (exact greedy or rejection sampling), or the accepted path through a draft tree.
//! Every token goes through the sequence's token mask first, and emission stops at the token that
//! ends the request, so nothing after it is accepted or counted.
//!
//! The rows come either from host logits, sampled as the walk reaches them ([`HostRows`]), or
//! from the backend, every row drawn in one pass where the logits are ([`DrawnRows`]).

use crate::generate::FinishReason;
use crate::sampling::{RowDraw, RowResult, Sampled, Sampler};
use crate::speculation::tree::DraftTree;
use crate::tokenizer::Tokenizer;

use super::plan::{SeqOutput, SeqParams, TokenMask};

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

/// Where a sequence's tokens come from, row by row: row 0 is after its last real token, row
/// `1 + i` after draft `i` (or tree node `i`). Every sampled token is recorded by the sampler.
pub trait Rows {
    /// The token row `j` samples.
    fn sample(&mut self, j: usize) -> Sampled;
    /// Row `j` verifying `draft`: the token it yields and whether that is the draft.
    fn verify(&mut self, j: usize, draft: u32) -> (Sampled, bool);
}

/// Rows sampled on the host from a copy of the logits, lazily (a tree walk samples only the
/// nodes it reaches).
pub struct HostRows<'a> {
    pub sampler: &'a mut Sampler,
    pub logits: &'a [f32],
    pub first_row: usize,
    pub vocab: usize,
    /// Each row's token mask (structured outputs), row `j` at `j`.
    pub masks: Option<&'a [TokenMask]>,
}

impl HostRows<'_> {
    fn row(&self, j: usize) -> Vec<f32> {
        let r = self.first_row + j;
        let mut row = self.logits[r * self.vocab..(r + 1) * self.vocab].to_vec();
        if let Some(m) = row_mask(self.masks, j) {
            m.apply(&mut row);
        }
        row
    }
}

/// Row `j`'s mask, when the sequence is guided (one per row, by construction).
fn row_mask(masks: Option<&[TokenMask]>, j: usize) -> Option<&TokenMask> {
    masks.and_then(|m| m.get(j))
}

impl Rows for HostRows<'_> {
    fn sample(&mut self, j: usize) -> Sampled {
        let mut row = self.row(j);
        self.sampler.sample(&mut row)
    }

    fn verify(&mut self, j: usize, draft: u32) -> (Sampled, bool) {
        let mut row = self.row(j);
        self.sampler.verify(&mut row, draft)
    }
}

/// Rows the backend already drew, all at once, from [`DrawnRows::draws`]' draws.
pub struct DrawnRows<'a> {
    pub sampler: &'a mut Sampler,
    pub results: &'a [RowResult],
}

impl DrawnRows<'_> {
    /// The draws of one sequence's rows, in row order: each row's penalties count the tokens
    /// emitted before it on the only path that consults it (the drafts before it in a chain,
    /// the nodes from the root down to it in a tree).
    pub fn draws<'m>(
        sampler: &mut Sampler,
        drafts: &[u32],
        tree: Option<&DraftTree>,
        masks: Option<&'m [TokenMask]>,
    ) -> Vec<RowDraw<'m>> {
        match tree {
            None => (0..=drafts.len())
                .map(|j| sampler.row_draw(&drafts[..j], drafts.get(j).copied(), row_mask(masks, j)))
                .collect(),
            Some(t) => std::iter::once(sampler.row_draw(&[], None, row_mask(masks, 0)))
                .chain((0..t.len()).map(|node| {
                    sampler.row_draw(&t.path_to(node), None, row_mask(masks, node + 1))
                }))
                .collect(),
        }
    }

    fn take(&mut self, j: usize) -> (Sampled, bool) {
        let r = &self.results[j];
        self.sampler.observe(r.sampled.token);
        (r.sampled.clone(), r.accepted)
    }
}

impl Rows for DrawnRows<'_> {
    fn sample(&mut self, j: usize) -> Sampled {
        self.take(j).0
    }

    /// The row was drawn verifying this same draft ([`DrawnRows::draws`]).
    fn verify(&mut self, j: usize, _draft: u32) -> (Sampled, bool) {
        self.take(j)
    }
}

/// A chain: each draft token stands while verification accepts it; the first rejection (or a
/// plain step's only row) samples the token that replaces it.
pub fn chain(rows: &mut dyn Rows, drafts: &[u32], stop: &StopRule<'_>) -> SeqOutput {
    let mut out = SeqOutput {
        drafted: drafts.len(),
        ..Default::default()
    };
    for j in 0..=drafts.len() {
        let (sampled, is_draft) = match drafts.get(j) {
            Some(&d) => rows.verify(j, d),
            None => (rows.sample(j), false),
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
pub fn tree(rows: &mut dyn Rows, tree: &DraftTree, stop: &StopRule<'_>) -> (SeqOutput, Vec<usize>) {
    let mut out = SeqOutput {
        drafted: tree.len(),
        ..Default::default()
    };
    let path = tree.accepted_path(|at| {
        let sampled = rows.sample(at.map_or(0, |n| n + 1));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;

    fn sampler() -> Sampler {
        Sampler::new(
            SamplingParams {
                frequency_penalty: 1.0,
                ..SamplingParams::greedy()
            },
            &[],
        )
    }

    fn penalised(d: &RowDraw<'_>) -> Vec<u32> {
        d.penalties.iter().map(|e| e.token).collect()
    }

    #[test]
    fn each_row_counts_the_tokens_emitted_on_the_path_to_it() {
        let mut s = sampler();
        let chain = DrawnRows::draws(&mut s, &[5, 6, 7], None, None);
        let got: Vec<(Vec<u32>, Option<u32>)> =
            chain.iter().map(|d| (penalised(d), d.draft)).collect();
        assert_eq!(
            got,
            [
                (vec![], Some(5)),
                (vec![5], Some(6)),
                (vec![5, 6], Some(7)),
                (vec![5, 6, 7], None),
            ]
        );
        // Root children 5 and 7; 6 under 5.
        let tree = DraftTree {
            tokens: vec![5, 6, 7],
            parents: vec![None, Some(0), None],
        };
        let rows = DrawnRows::draws(&mut s, &tree.tokens, Some(&tree), None);
        let got: Vec<Vec<u32>> = rows.iter().map(penalised).collect();
        assert_eq!(got, [vec![], vec![5], vec![5, 6], vec![7]]);
        assert!(rows.iter().all(|d| d.draft.is_none()));
    }
}
