//! Mixture-of-experts routing (DeepSeek-V3's `noaux_tc`, as transformers' `DeepseekV3TopkRouter`
//! computes it) and the routed experts held as separate matrices and routed on the host: the
//! reference every backend's `routed_experts` agrees with, and the CPU backend's own form.

use super::{Backend, Precision};
use crate::error::Result;
use crate::weights::TensorView;

/// How a layer's router picks experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouteSpec {
    pub n_experts: usize,
    /// Experts are chosen from the `topk_group` best of `n_group` equal groups.
    pub n_group: usize,
    pub topk_group: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Whether the chosen experts' weights are normalized to sum to one.
    pub norm_topk_prob: bool,
    /// Multiplies every weight.
    pub scaling: f32,
}

/// One routed expert's stored weights: `gate` and `up` `[inter, hidden]`, `down` `[hidden, inter]`.
pub struct ExpertTensors {
    pub gate: TensorView,
    pub up: TensorView,
    pub down: TensorView,
}

/// The experts one token goes to and their weights, from its router logits, best first (ties go
/// to the lower index): the sigmoid scores plus the correction bias choose the groups (each by its
/// best two) and then the experts inside them; the weights are the scores without the bias.
pub fn route(spec: &RouteSpec, logits: &[f32], correction_bias: &[f32]) -> Vec<(usize, f32)> {
    let scores: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let choice: Vec<f32> = scores
        .iter()
        .zip(correction_bias)
        .map(|(s, b)| s + b)
        .collect();
    let per_group = spec.n_experts / spec.n_group;
    let group_scores: Vec<f32> = choice
        .chunks(per_group)
        .map(|g| {
            let top = top_indices(g, 2);
            top.iter().map(|&i| g[i]).sum()
        })
        .collect();
    let groups = top_indices(&group_scores, spec.topk_group);
    let masked: Vec<f32> = choice
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            if groups.contains(&(i / per_group)) {
                s
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    let chosen = top_indices(&masked, spec.top_k);
    let mut weights: Vec<f32> = chosen.iter().map(|&i| scores[i]).collect();
    if spec.norm_topk_prob {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        for w in &mut weights {
            *w /= sum;
        }
    }
    chosen
        .into_iter()
        .zip(weights)
        .map(|(i, w)| (i, w * spec.scaling))
        .collect()
}

/// Indices of the `k` largest values, largest first (stable: equal values by index).
fn top_indices(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// A layer's routed experts as one matrix pair each (`[gate | up]` and `down`), `None` where
/// another rank holds the expert.
pub struct HostExperts<B: Backend> {
    experts: Vec<Option<(B::Matrix, B::Matrix)>>,
}

impl<B: Backend> HostExperts<B> {
    pub fn load(
        backend: &B,
        held: Vec<Option<ExpertTensors>>,
        precision: Precision,
    ) -> Result<Self> {
        let experts = held
            .into_iter()
            .map(|e| {
                e.map(|t| {
                    Ok((
                        backend.matrix(&[t.gate, t.up], precision)?,
                        backend.matrix(&[t.down], precision)?,
                    ))
                })
                .transpose()
            })
            .collect::<Result<_>>()?;
        Ok(HostExperts { experts })
    }

    /// `out += weight * expert(h)` for every token's chosen experts that are held here: the
    /// logits come to the host, each expert runs on the rows routed to it.
    pub fn forward(
        &self,
        backend: &B,
        spec: &RouteSpec,
        correction_bias: &[f32],
        h: &B::Buffer,
        logits: &B::Buffer,
        out: &mut B::Buffer,
    ) -> Result<()> {
        let logits = backend.to_host(logits)?;
        let e = spec.n_experts;
        let n = logits.len() / e.max(1);
        let mut tokens: Vec<(Vec<usize>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); e];
        for t in 0..n {
            for (expert, w) in route(spec, &logits[t * e..(t + 1) * e], correction_bias) {
                tokens[expert].0.push(t);
                tokens[expert].1.push(w);
            }
        }
        let (mut gu, mut act, mut y) = (
            backend.buffer(0, 0)?,
            backend.buffer(0, 0)?,
            backend.buffer(0, 0)?,
        );
        for (expert, (rows, weights)) in self.experts.iter().zip(&tokens) {
            let Some((gate_up, down)) = expert else {
                continue;
            };
            if rows.is_empty() {
                continue;
            }
            let x = backend.gather_rows(h, rows)?;
            backend.matmul(&x, gate_up, &mut gu)?;
            backend.silu_mul(&gu, &mut act)?;
            backend.matmul(&act, down, &mut y)?;
            backend.scatter_add_rows(out, rows, &y, weights)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> RouteSpec {
        RouteSpec {
            n_experts: 8,
            n_group: 4,
            topk_group: 2,
            top_k: 2,
            norm_topk_prob: true,
            scaling: 2.5,
        }
    }

    #[test]
    fn groups_are_chosen_by_their_best_two_and_the_bias_only_chooses() {
        // Expert 0 alone is the best, but group 0's second expert is poor, so group 0 loses to
        // groups 1 and 2 whose two experts are both good.
        let logits = [4.0, -4.0, 2.0, 2.0, 1.5, 1.5, -3.0, -3.0];
        let bias = [0.0; 8];
        let r = route(&spec(), &logits, &bias);
        let experts: Vec<usize> = r.iter().map(|x| x.0).collect();
        assert_eq!(experts, [2, 3]);
        // Weights: the sigmoid scores normalised, times the scaling factor.
        assert!((r[0].1 - 1.25).abs() < 1e-6 && (r[1].1 - 1.25).abs() < 1e-6);
        // A bias moves the choice but not the weight: expert 5 chosen, weighted by its score.
        let mut bias = [0.0; 8];
        bias[5] = 1.0;
        let r = route(&spec(), &logits, &bias);
        assert_eq!(r[0].0, 5);
        let s = |l: f32| 1.0 / (1.0 + (-l).exp());
        let want = s(1.5) / (s(1.5) + s(2.0)) * 2.5;
        assert!((r[0].1 - want).abs() < 1e-6, "{r:?}");
    }
}
