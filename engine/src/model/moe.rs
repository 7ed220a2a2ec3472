//! DeepSeek-V3's mixture-of-experts feed-forward (transformers' `DeepseekV3MoE` and
//! `DeepseekV3TopkRouter` are the reference): a router picks experts per token, their SiLU-gated
//! MLPs run on just the tokens routed to them, and shared experts run on every token.
//!
//! Under tensor parallelism the routed experts are split across ranks in contiguous ranges
//! (expert parallelism: each rank holds whole experts, `E / world` of them) and the shared experts
//! by intermediate columns like a dense MLP; every rank routes every token identically (the router
//! is replicated), computes the experts it holds, and the layer's usual all-reduce sums the parts.

use super::config::MoeConfig;
use crate::backend::{Backend, Precision};
use crate::error::Result;
use crate::weights::TensorView;

/// One SiLU-gated MLP: `down(silu(gate x) * up x)`.
pub struct Expert<B: Backend> {
    gate_up: B::Matrix,
    down: B::Matrix,
}

impl<B: Backend> Expert<B> {
    pub fn load(
        backend: &B,
        gate: TensorView,
        up: TensorView,
        down: TensorView,
        precision: Precision,
    ) -> Result<Self> {
        Ok(Expert {
            gate_up: backend.matrix(&[gate, up], precision)?,
            down: backend.matrix(&[down], precision)?,
        })
    }

    /// `out = down(silu(gate x) * up x)`; `gate_up` and `act` are scratch buffers.
    pub fn forward(
        &self,
        backend: &B,
        x: &B::Buffer,
        gate_up: &mut B::Buffer,
        act: &mut B::Buffer,
        out: &mut B::Buffer,
    ) -> Result<()> {
        backend.matmul(x, &self.gate_up, gate_up)?;
        backend.silu_mul(gate_up, act)?;
        backend.matmul(act, &self.down, out)?;
        Ok(())
    }
}

pub struct MoeWeights<B: Backend> {
    /// `mlp.gate.weight` `[experts, hidden]`, always in f32: transformers routes in f32, and a
    /// quantized router would move decisions.
    router: B::Matrix,
    /// `e_score_correction_bias`: added to the scores for choosing, not for weighting.
    correction_bias: Vec<f32>,
    /// Every routed expert, `None` where another rank holds it.
    experts: Vec<Option<Expert<B>>>,
    shared: Option<Expert<B>>,
}

impl<B: Backend> MoeWeights<B> {
    pub fn new(
        backend: &B,
        router: TensorView,
        correction_bias: Vec<f32>,
        experts: Vec<Option<Expert<B>>>,
        shared: Option<Expert<B>>,
    ) -> Result<Self> {
        Ok(MoeWeights {
            router: backend.matrix(&[router], Precision::Exact)?,
            correction_bias,
            experts,
            shared,
        })
    }

    /// `out = shared(h) + sum over routed experts e of weight_e * e(h)`, for the experts this
    /// rank holds. `n` is the number of rows of `h`.
    pub fn forward(
        &self,
        backend: &B,
        cfg: &MoeConfig,
        h: &B::Buffer,
        n: usize,
        hidden: usize,
        out: &mut B::Buffer,
    ) -> Result<()> {
        let mut logits = backend.buffer(0, 0)?;
        backend.matmul(h, &self.router, &mut logits)?;
        let logits = backend.to_host(&logits)?;
        let e = cfg.n_routed_experts;
        let mut tokens: Vec<(Vec<usize>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); e];
        for t in 0..n {
            for (expert, w) in route(cfg, &logits[t * e..(t + 1) * e], &self.correction_bias) {
                tokens[expert].0.push(t);
                tokens[expert].1.push(w);
            }
        }
        let (mut gu, mut act, mut y) = (
            backend.buffer(0, 0)?,
            backend.buffer(0, 0)?,
            backend.buffer(0, 0)?,
        );
        match &self.shared {
            Some(s) => s.forward(backend, h, &mut gu, &mut act, out)?,
            None => *out = backend.buffer(n, hidden)?,
        }
        for (expert, (rows, weights)) in self.experts.iter().zip(&tokens) {
            let Some(expert) = expert else { continue };
            if rows.is_empty() {
                continue;
            }
            let x = backend.gather_rows(h, rows)?;
            expert.forward(backend, &x, &mut gu, &mut act, &mut y)?;
            backend.scatter_add_rows(out, rows, &y, weights)?;
        }
        Ok(())
    }
}

/// The experts one token goes to and their weights, from its router logits: DeepSeek-V3's
/// `noaux_tc` routing exactly as transformers computes it (ties go to the lower index).
pub fn route(cfg: &MoeConfig, logits: &[f32], correction_bias: &[f32]) -> Vec<(usize, f32)> {
    let scores: Vec<f32> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let choice: Vec<f32> = scores
        .iter()
        .zip(correction_bias)
        .map(|(s, b)| s + b)
        .collect();
    let per_group = cfg.n_routed_experts / cfg.n_group;
    let group_scores: Vec<f32> = choice
        .chunks(per_group)
        .map(|g| {
            let top = top_indices(g, 2);
            top.iter().map(|&i| g[i]).sum()
        })
        .collect();
    let groups = top_indices(&group_scores, cfg.topk_group);
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
    let chosen = top_indices(&masked, cfg.experts_per_token);
    let mut weights: Vec<f32> = chosen.iter().map(|&i| scores[i]).collect();
    if cfg.norm_topk_prob {
        let sum: f32 = weights.iter().sum::<f32>() + 1e-20;
        for w in &mut weights {
            *w /= sum;
        }
    }
    chosen
        .into_iter()
        .zip(weights)
        .map(|(i, w)| (i, w * cfg.routed_scaling_factor))
        .collect()
}

/// Indices of the `k` largest values, largest first (stable: equal values by index).
fn top_indices(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> MoeConfig {
        MoeConfig {
            n_routed_experts: 8,
            n_shared_experts: 1,
            experts_per_token: 2,
            n_group: 4,
            topk_group: 2,
            routed_scaling_factor: 2.5,
            norm_topk_prob: true,
            moe_intermediate_size: 32,
            first_k_dense_replace: 1,
        }
    }

    #[test]
    fn groups_are_chosen_by_their_best_two_and_the_bias_only_chooses() {
        // Expert 0 alone is the best, but group 0's second expert is poor, so group 0 loses to
        // groups 1 and 2 whose two experts are both good.
        let logits = [4.0, -4.0, 2.0, 2.0, 1.5, 1.5, -3.0, -3.0];
        let bias = [0.0; 8];
        let r = route(&cfg(), &logits, &bias);
        let experts: Vec<usize> = r.iter().map(|x| x.0).collect();
        assert_eq!(experts, [2, 3]);
        // Weights: the sigmoid scores normalised, times the scaling factor.
        assert!((r[0].1 - 1.25).abs() < 1e-6 && (r[1].1 - 1.25).abs() < 1e-6);
        // A bias moves the choice but not the weight: expert 5 chosen, weighted by its score.
        let mut bias = [0.0; 8];
        bias[5] = 1.0;
        let r = route(&cfg(), &logits, &bias);
        assert_eq!(r[0].0, 5);
        let s = |l: f32| 1.0 / (1.0 + (-l).exp());
        let want = s(1.5) / (s(1.5) + s(2.0)) * 2.5;
        assert!((r[0].1 - want).abs() < 1e-6, "{r:?}");
    }
}
