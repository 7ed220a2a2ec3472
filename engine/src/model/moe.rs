//! DeepSeek-V3's mixture-of-experts feed-forward (transformers' `DeepseekV3MoE` and
//! `DeepseekV3TopkRouter` are the reference): a router picks experts per token, their SiLU-gated
//! MLPs run on just the tokens routed to them, and shared experts run on every token.
//!
//! Under tensor parallelism the routed experts are split across ranks in contiguous ranges
//! (expert parallelism: each rank holds whole experts, `E / world` of them) and the shared experts
//! by intermediate columns like a dense MLP; every rank routes every token identically (the router
//! is replicated), computes the experts it holds, and the layer's usual all-reduce sums the parts.
//!
//! The routing and the routed experts are the backend's (`Backend::routed_experts`, with
//! `backend::routing` as the reference): the CPU routes on the host, the GPU on the device.

use super::config::MoeConfig;
use crate::backend::{Backend, ExpertTensors, Precision, RouteSpec};
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
    correction_bias: B::Vector,
    /// The routed experts this rank holds.
    experts: B::Experts,
    shared: Option<Expert<B>>,
}

impl<B: Backend> MoeWeights<B> {
    pub fn new(
        backend: &B,
        router: TensorView,
        correction_bias: &[f32],
        experts: Vec<Option<ExpertTensors>>,
        shared: Option<Expert<B>>,
        precision: Precision,
    ) -> Result<Self> {
        Ok(MoeWeights {
            router: backend.matrix(&[router], Precision::Exact)?,
            correction_bias: backend.vector_from_host(correction_bias)?,
            experts: backend.experts(experts, precision)?,
            shared,
        })
    }

    /// `out = shared(h) + sum over routed experts e of weight_e * e(h)`, for the experts this
    /// rank holds. `n` is the number of rows of `h`; `logits`, `gate_up` and `act` are scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        backend: &B,
        cfg: &MoeConfig,
        h: &B::Buffer,
        n: usize,
        hidden: usize,
        logits: &mut B::Buffer,
        (gate_up, act): (&mut B::Buffer, &mut B::Buffer),
        out: &mut B::Buffer,
    ) -> Result<()> {
        backend.matmul(h, &self.router, logits)?;
        match &self.shared {
            Some(s) => s.forward(backend, h, gate_up, act, out)?,
            // (Every DeepSeek-V3 and Kimi-K2 layer has a shared expert; this allocates.)
            None => *out = backend.buffer(n, hidden)?,
        }
        backend.routed_experts(
            &route_spec(cfg),
            &self.correction_bias,
            h,
            logits,
            &self.experts,
            out,
        )
    }
}

/// The router's part of a layer's configuration.
pub fn route_spec(cfg: &MoeConfig) -> RouteSpec {
    RouteSpec {
        n_experts: cfg.n_routed_experts,
        n_group: cfg.n_group,
        topk_group: cfg.topk_group,
        top_k: cfg.experts_per_token,
        norm_topk_prob: cfg.norm_topk_prob,
        scaling: cfg.routed_scaling_factor,
    }
}
