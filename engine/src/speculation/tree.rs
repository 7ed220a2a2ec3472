//! EAGLE token trees (topk > 1): the candidates a drafter grows, the best ones kept for
//! verification, their attention mask, and the walk that accepts the longest path the target
//! agrees with.
//!
//! Growth follows EAGLE-2 / SGLang: each draft step expands the `topk` best frontier nodes by
//! their `topk` best children; scores are cumulative draft log-probabilities, so a child never
//! outranks its parent and the best N-1 candidates always form a tree.

/// One candidate token: where it hangs and how likely the draft thinks its whole path is.
#[derive(Clone, Copy, Debug)]
pub struct Candidate {
    pub token: u32,
    /// Index of the parent candidate; `None` for a child of the sequence's current token.
    pub parent: Option<usize>,
    /// Sum of the draft's log-probabilities along the path to this candidate.
    pub score: f32,
    /// 1 for a child of the current token.
    pub depth: usize,
}

/// The tree a step verifies: nodes in an order where parents precede children.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DraftTree {
    pub tokens: Vec<u32>,
    /// `None`: a child of the current token (the tree's root, not a node itself).
    pub parents: Vec<Option<usize>>,
}

impl DraftTree {
    /// The best `n` candidates (by score, shallower first on ties), parents before children.
    pub fn select(cands: &[Candidate], n: usize) -> DraftTree {
        let mut order: Vec<usize> = (0..cands.len()).collect();
        order.sort_by(|&a, &b| {
            cands[b]
                .score
                .total_cmp(&cands[a].score)
                .then(cands[a].depth.cmp(&cands[b].depth))
                .then(a.cmp(&b))
        });
        order.truncate(n);
        // Candidates are generated depth by depth, so index order puts parents first.
        order.sort_unstable();
        let mut index_of = vec![None; cands.len()];
        let mut tree = DraftTree::default();
        for &c in &order {
            let parent = match cands[c].parent {
                None => None,
                // A parent outside the selection (only with NaN scores) drops the subtree.
                Some(p) => match index_of[p] {
                    Some(i) => Some(i),
                    None => continue,
                },
            };
            index_of[c] = Some(tree.tokens.len());
            tree.tokens.push(cands[c].token);
            tree.parents.push(parent);
        }
        tree
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Depth of each node (1 for children of the current token).
    pub fn depths(&self) -> Vec<usize> {
        let mut d = Vec::with_capacity(self.len());
        for p in &self.parents {
            d.push(p.map_or(1, |p: usize| d[p] + 1));
        }
        d
    }

    /// The verification step's mask rows: row 0 is the current token (itself), row `1 + i` is
    /// node `i` (the current token, its ancestors, itself). Bit `j` is the step's token `j`.
    pub fn verify_mask(&self) -> Vec<u64> {
        let mut rows = vec![1u64];
        for (i, p) in self.parents.iter().enumerate() {
            let inherited = p.map_or(rows[0], |p| rows[1 + p]);
            rows.push(inherited | 1u64 << (1 + i));
        }
        rows
    }

    /// The tokens from the current token's first child down to `node`, inclusive.
    pub fn path_to(&self, node: usize) -> Vec<u32> {
        let mut path = Vec::new();
        let mut at = Some(node);
        while let Some(n) = at {
            path.push(self.tokens[n]);
            at = self.parents[n];
        }
        path.reverse();
        path
    }

    /// The node under `parent` (`None`: the current token) carrying `token`.
    pub fn child(&self, parent: Option<usize>, token: u32) -> Option<usize> {
        (0..self.len()).find(|&i| self.parents[i] == parent && self.tokens[i] == token)
    }

    /// Nodes of the path the target accepts: from the current token, while `next(node)` (the
    /// target's token after `node`, `None` = the current token) has a matching child.
    pub fn accepted_path(&self, mut next: impl FnMut(Option<usize>) -> Option<u32>) -> Vec<usize> {
        let mut path = Vec::new();
        let mut at = None;
        while let Some(t) = next(at) {
            match self.child(at, t) {
                Some(c) => {
                    path.push(c);
                    at = Some(c);
                }
                None => break,
            }
        }
        path
    }
}

/// The `k` best tokens of a log-probability row (index, log-probability), best first.
pub fn top_k(logprobs: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..logprobs.len()).collect();
    let k = k.min(idx.len());
    if k == 0 {
        return Vec::new();
    }
    idx.select_nth_unstable_by(k - 1, |&a, &b| logprobs[b].total_cmp(&logprobs[a]));
    idx.truncate(k);
    idx.sort_by(|&a, &b| logprobs[b].total_cmp(&logprobs[a]).then(a.cmp(&b)));
    idx.into_iter().map(|i| (i, logprobs[i])).collect()
}

/// `logits` as log-probabilities, in place.
pub fn log_softmax(logits: &mut [f32]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&v| (v - max).exp()).sum();
    let log_sum = max + sum.ln();
    for v in logits.iter_mut() {
        *v -= log_sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(token: u32, parent: Option<usize>, score: f32, depth: usize) -> Candidate {
        Candidate {
            token,
            parent,
            score,
            depth,
        }
    }

    /// Root children 10 (-0.1) and 11 (-1.0); under 10: 20 (-0.3), 21 (-2.5); under 11: 22 (-1.2);
    /// under 20: 30 (-0.6).
    fn candidates() -> Vec<Candidate> {
        vec![
            cand(10, None, -0.1, 1),
            cand(11, None, -1.0, 1),
            cand(20, Some(0), -0.3, 2),
            cand(21, Some(0), -2.5, 2),
            cand(22, Some(1), -1.2, 2),
            cand(30, Some(2), -0.6, 3),
        ]
    }

    #[test]
    fn select_keeps_the_best_nodes_with_parents_first() {
        let t = DraftTree::select(&candidates(), 4);
        assert_eq!(t.tokens, vec![10, 11, 20, 30]);
        assert_eq!(t.parents, vec![None, None, Some(0), Some(2)]);
        assert_eq!(t.depths(), vec![1, 1, 2, 3]);
        let all = DraftTree::select(&candidates(), 100);
        assert_eq!(all.len(), 6);
    }

    #[test]
    fn verify_mask_sees_the_current_token_the_ancestors_and_itself() {
        let t = DraftTree::select(&candidates(), 4);
        // Step tokens: 0 = current, 1 = node 0 (10), 2 = node 1 (11), 3 = node 2 (20), 4 = node 3.
        assert_eq!(t.verify_mask(), vec![0b1, 0b11, 0b101, 0b1011, 0b11011]);
    }

    #[test]
    fn the_walk_follows_matching_children_and_stops_at_the_first_miss() {
        let t = DraftTree::select(&candidates(), 6);
        // Target says 10, then 20, then 31 (no such child).
        let path = t.accepted_path(|at| match at {
            None => Some(10),
            Some(0) => Some(20),
            Some(_) => Some(31),
        });
        assert_eq!(
            path.iter().map(|&i| t.tokens[i]).collect::<Vec<_>>(),
            [10, 20]
        );
        // The second-best root child is accepted as well as the first.
        let path = t.accepted_path(|at| if at.is_none() { Some(11) } else { Some(22) });
        assert_eq!(
            path.iter().map(|&i| t.tokens[i]).collect::<Vec<_>>(),
            [11, 22]
        );
        assert!(t.accepted_path(|_| Some(99)).is_empty());
    }

    #[test]
    fn top_k_is_sorted_and_bounded() {
        let mut l = vec![0.5, 2.0, -1.0, 2.0, 1.0];
        log_softmax(&mut l);
        let top = top_k(&l, 3);
        assert_eq!(
            top.iter().map(|&(i, _)| i).collect::<Vec<_>>(),
            vec![1, 3, 4]
        );
        let total: f32 = l.iter().map(|v| v.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
        assert_eq!(top_k(&l, 9).len(), 5);
    }

    /// A target over 4 tokens whose next-token logits depend on the previous token.
    const TABLE: [[f32; 4]; 4] = [
        [1.0, 2.0, 0.5, 1.5],
        [0.2, 1.0, 2.0, 1.0],
        [2.0, 0.1, 1.0, 1.2],
        [1.0, 1.0, 1.0, 0.0],
    ];
    /// The chi-square critical value for 15 degrees of freedom at p = 0.001.
    const CHI2_DF15_P001: f64 = 37.697;
    const SAMPLES: usize = 40_000;

    fn probs(prev: u32) -> [f64; 4] {
        let e = TABLE[prev as usize].map(|x| (x as f64).exp());
        let z: f64 = e.iter().sum();
        e.map(|v| v / z)
    }

    /// Histogram of the first two tokens emitted after token 1 by `walk` (one verification
    /// step through `tree`, then plain sampling if it emitted only one), against their exact
    /// joint probabilities: the chi-square statistic.
    fn two_token_chi_square(
        tree: &DraftTree,
        mut walk: impl FnMut(&mut crate::sampling::Sampler, Option<usize>) -> u32,
    ) -> f64 {
        use crate::sampling::{Sampler, SamplingParams};
        let current = 1u32;
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(5),
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(params, &[]);
        let mut counts = [0u32; 16];
        for _ in 0..SAMPLES {
            let mut emitted = Vec::new();
            tree.accepted_path(|at| {
                let t = walk(&mut s, at);
                emitted.push(t);
                Some(t)
            });
            while emitted.len() < 2 {
                let prev = emitted[emitted.len() - 1] as usize;
                emitted.push(s.sample(&mut TABLE[prev].to_vec()).token);
            }
            counts[emitted[0] as usize * 4 + emitted[1] as usize] += 1;
        }
        let first = probs(current);
        (0..16)
            .map(|i| {
                let e = first[i / 4] * probs((i / 4) as u32)[i % 4] * SAMPLES as f64;
                (counts[i] as f64 - e).powi(2) / e
            })
            .sum()
    }

    #[test]
    fn sampling_along_a_tree_keeps_the_target_distribution_and_a_biased_walk_fails() {
        // Root children 0 and 2; under 0: 1 and 3; under 2: 0.
        let tree = DraftTree {
            tokens: vec![0, 2, 1, 3, 0],
            parents: vec![None, None, Some(0), Some(0), Some(1)],
        };
        let prev_of = |at: Option<usize>| at.map_or(1, |n| tree.tokens[n]);
        // The engine's walk: sample the target at each node reached, follow a matching child.
        let chi = two_token_chi_square(&tree, |s, at| {
            s.sample(&mut TABLE[prev_of(at) as usize].to_vec()).token
        });
        assert!(chi < CHI2_DF15_P001, "tree sampling: chi-square {chi:.1}");
        // A walk that takes a likely-enough draft child without sampling skews the output.
        let chi = two_token_chi_square(&tree, |s, at| {
            let p = probs(prev_of(at));
            let child = (0..tree.len())
                .find(|&c| tree.parents[c] == at && p[tree.tokens[c] as usize] > 0.3);
            match child {
                Some(c) => tree.tokens[c],
                None => s.sample(&mut TABLE[prev_of(at) as usize].to_vec()).token,
            }
        });
        assert!(
            chi > CHI2_DF15_P001,
            "the biased walk passed (chi-square {chi:.1})"
        );
    }
}
