//! Structured outputs inside a step: drafts checked against each guided sequence's grammar, and
//! every row's token mask, asked of the sequence's guide while the forward runs.
//!
//! A chain keeps the drafts its grammar admits and drops the rest before the forward (they
//! could never be accepted: their row's mask would refuse them). A tree keeps its shape; a node
//! the grammar refuses gets a row mask allowing nothing, and verification never reaches it
//! because its parent's mask refuses its token. The guide itself never moves here: it answers
//! each path and rolls back, and the engine advances it by the tokens the step emits.

use super::drafter::Drafts;
use super::plan::{StepPlan, TokenMask};

/// Cuts each guided chain to the drafts its grammar admits; returns how many each lost.
pub fn trim_drafts(plan: &StepPlan<'_>, drafts: &mut Drafts) -> Vec<usize> {
    plan.seqs
        .iter()
        .zip(drafts.tokens.iter_mut().zip(&drafts.trees))
        .map(|(s, (chain, tree))| match s.guide {
            Some(g) if tree.is_none() && !chain.is_empty() => {
                let admitted = g.admits(chain);
                let refused = chain.len() - admitted;
                chain.truncate(admitted);
                refused
            }
            _ => 0,
        })
        .collect()
}

/// Whether any sequence that samples this step is guided.
pub fn any(plan: &StepPlan<'_>) -> bool {
    plan.seqs.iter().any(|s| s.guide.is_some() && s.samples())
}

/// Each sampling guided sequence's row masks, in row order: row 0 after its tokens, then one
/// per draft (after the chain up to and including it) or per tree node (after its path).
pub fn row_masks(plan: &StepPlan<'_>, drafts: &Drafts) -> Vec<Option<Vec<TokenMask>>> {
    plan.seqs
        .iter()
        .enumerate()
        .map(|(w, s)| {
            let g = s.guide.filter(|_| s.samples())?;
            let chain = &drafts.tokens[w];
            Some(match &drafts.trees[w] {
                None => (0..=chain.len())
                    .map(|j| g.mask_after(&chain[..j]))
                    .collect(),
                Some(t) => std::iter::once(g.mask_after(&[]))
                    .chain((0..t.len()).map(|n| g.mask_after(&t.path_to(n))))
                    .collect(),
            })
        })
        .collect()
}

/// Every guided sampling sequence has exactly one mask per row: a row without one would be
/// sampled unconstrained, so a miscount fails the step instead.
pub fn check_rows(
    plan: &StepPlan<'_>,
    drafts: &Drafts,
    masks: &[Option<Vec<TokenMask>>],
) -> crate::Result<()> {
    for (w, s) in plan.seqs.iter().enumerate() {
        if s.guide.is_none() || !s.samples() {
            continue;
        }
        let rows = 1 + drafts.trees[w]
            .as_ref()
            .map_or(drafts.tokens[w].len(), |t| t.len());
        let got = masks.get(w).and_then(Option::as_ref).map_or(0, Vec::len);
        if got != rows {
            // A bug, failed like a panicking job: the step's requests fail, the server goes on.
            return Err(crate::Error::Panicked(format!(
                "sequence {}: {got} token masks for {rows} rows",
                s.id
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::plan::{SeqPlan, TokenGuide};
    use crate::speculation::tree::DraftTree;

    /// A grammar over token ids: each token must be one more than the one before it, starting
    /// from `first`.
    #[derive(Debug)]
    struct Counting {
        first: u32,
        vocab: usize,
    }

    impl Counting {
        fn follows(&self, path: &[u32]) -> usize {
            path.iter()
                .enumerate()
                .take_while(|&(i, &t)| t == self.first + i as u32)
                .count()
        }
    }

    impl TokenGuide for Counting {
        fn admits(&self, drafts: &[u32]) -> usize {
            self.follows(drafts)
        }

        fn mask_after(&self, path: &[u32]) -> TokenMask {
            if self.follows(path) < path.len() {
                return TokenMask::allowing(self.vocab, []);
            }
            TokenMask::allowing(self.vocab, [self.first + path.len() as u32])
        }
    }

    fn seq<'a>(tokens: &'a [u32], guide: &'a Counting) -> SeqPlan<'a> {
        SeqPlan {
            id: 1,
            tokens,
            computed: tokens.len() - 1,
            cached_prefix: 0,
            n_new: 1,
            block_table: &[],
            decoding: true,
            draft_room: 4,
            tokens_left: 8,
            context_left: 64,
            guide: Some(guide),
            pending_last: false,
        }
    }

    /// Each row's allowed tokens, of the 16 the tests' vocabulary has.
    fn allowed(rows: &[TokenMask]) -> Vec<Vec<u32>> {
        rows.iter()
            .map(|m| (0..16).filter(|&t| m.allows(t)).collect())
            .collect()
    }

    #[test]
    fn a_chain_keeps_the_drafts_its_grammar_admits_and_each_row_gets_its_mask() {
        let g = Counting {
            first: 3,
            vocab: 16,
        };
        let tokens = [1, 2];
        let plan = StepPlan {
            seqs: vec![seq(&tokens, &g)],
        };
        let mut drafts = Drafts::none(1);
        drafts.tokens[0] = vec![3, 4, 9, 6];
        assert_eq!(trim_drafts(&plan, &mut drafts), [2]);
        assert_eq!(drafts.tokens[0], [3, 4]);
        let masks = row_masks(&plan, &drafts);
        let allowed = allowed(masks[0].as_ref().expect("guided"));
        assert_eq!(allowed, [vec![3], vec![4], vec![5]]);
    }

    #[test]
    fn a_tree_keeps_its_shape_and_a_refused_node_allows_nothing() {
        let g = Counting {
            first: 3,
            vocab: 16,
        };
        let tokens = [1, 2];
        let plan = StepPlan {
            seqs: vec![seq(&tokens, &g)],
        };
        let mut drafts = Drafts::none(1);
        // 3 -> 4 (admitted), 3 -> 7 (refused), 8 at the root (refused).
        let tree = DraftTree {
            tokens: vec![3, 8, 4, 7],
            parents: vec![None, None, Some(0), Some(0)],
        };
        drafts.tokens[0] = tree.tokens.clone();
        drafts.trees[0] = Some(tree);
        assert_eq!(trim_drafts(&plan, &mut drafts), [0]);
        assert_eq!(drafts.tokens[0].len(), 4);
        let masks = row_masks(&plan, &drafts);
        let allowed = allowed(masks[0].as_ref().expect("guided"));
        assert_eq!(allowed, [vec![3], vec![4], vec![], vec![5], vec![]]);
    }

    #[test]
    fn unguided_and_prefilling_sequences_get_no_masks() {
        let g = Counting {
            first: 3,
            vocab: 16,
        };
        let tokens = [1, 2, 3];
        let mut guided_prefill = seq(&tokens, &g);
        guided_prefill.computed = 0;
        guided_prefill.n_new = 2;
        let mut free = seq(&tokens, &g);
        free.guide = None;
        let plan = StepPlan {
            seqs: vec![guided_prefill, free],
        };
        assert!(!any(&plan));
        let drafts = Drafts::none(2);
        assert_eq!(row_masks(&plan, &drafts), [None, None]);
    }
}
