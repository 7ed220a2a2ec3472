//! Which part of each layer a tensor-parallel rank holds (Megatron-LM's layout): attention heads
//! and MLP columns split across ranks, the output projections split by their inputs, so each
//! sub-layer ends in one all-reduce. KV heads are split too, or replicated when there are fewer KV
//! heads than ranks (each rank keeps the one its query heads read). Embedding, norms and the LM
//! head stay whole on every rank.

use std::ops::Range;

use crate::error::{Error, Result};
use crate::model::ModelConfig;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub world: usize,
    /// How the routed experts of an MoE model are split.
    pub moe: MoeSplit,
}

/// How tensor parallelism splits an MoE layer's routed experts.
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum MoeSplit {
    /// Expert-parallel: each rank holds whole experts (1/world of them) and computes the tokens
    /// routed to those. Few, large matmuls per rank; at small batch the rank holding the most
    /// picked experts sets the pace.
    #[default]
    Experts,
    /// Every rank holds a 1/world slice of every expert's intermediate columns (Megatron's split
    /// of an MLP, per expert): balanced whatever the routing, one matmul per picked expert per
    /// rank.
    Columns,
}

/// One rank's slice of a model, in heads and intermediate columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardPlan {
    pub q_heads: Range<usize>,
    pub kv_heads: Range<usize>,
    pub intermediate: Range<usize>,
}

impl Shard {
    pub const WHOLE: Shard = Shard {
        rank: 0,
        world: 1,
        moe: MoeSplit::Experts,
    };

    /// Rank `rank` of `world`, experts split expert-parallel.
    pub fn of(rank: usize, world: usize) -> Shard {
        Shard {
            rank,
            world,
            moe: MoeSplit::Experts,
        }
    }

    /// The plan for this rank, or an error naming the dimension that does not divide.
    pub fn plan(&self, c: &ModelConfig) -> Result<ShardPlan> {
        let w = self.world;
        let bad = |what: String| {
            Error::InvalidRequest(format!(
                "tensor parallelism {w} does not fit this model: {what}"
            ))
        };
        if w == 0 || self.rank >= w {
            return Err(bad(format!("rank {} of {w}", self.rank)));
        }
        if !c.n_heads.is_multiple_of(w) {
            return Err(bad(format!("{} attention heads", c.n_heads)));
        }
        if !(c.n_kv_heads.is_multiple_of(w) || w.is_multiple_of(c.n_kv_heads)) {
            return Err(bad(format!(
                "{} KV heads (neither a multiple nor a divisor of {w})",
                c.n_kv_heads
            )));
        }
        if !c.intermediate_size.is_multiple_of(w) {
            return Err(bad(format!("intermediate size {}", c.intermediate_size)));
        }
        let per = |n: usize| n / w;
        let q = per(c.n_heads);
        let kv_heads = if c.n_kv_heads >= w {
            let k = per(c.n_kv_heads);
            self.rank * k..(self.rank + 1) * k
        } else {
            let head = self.rank / (w / c.n_kv_heads);
            head..head + 1
        };
        let inter = per(c.intermediate_size);
        Ok(ShardPlan {
            q_heads: self.rank * q..(self.rank + 1) * q,
            kv_heads,
            intermediate: self.rank * inter..(self.rank + 1) * inter,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(heads: usize, kv: usize, inter: usize) -> ModelConfig {
        ModelConfig {
            arch: crate::model::Architecture::Llama,
            hidden_size: 64 * heads,
            intermediate_size: inter,
            n_layers: 1,
            n_heads: heads,
            n_kv_heads: kv,
            head_dim: 64,
            rope_dim: 64,
            vocab_size: 32,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_layout: crate::model::RopeLayout::HalfSplit,
            llama3_scaling: None,
            rope_linear_factor: 1.0,
            max_context: 128,
            tied_embeddings: true,
            qkv_bias: false,
            qk_norm: false,
            yarn: None,
            mla: None,
            moe: None,
        }
    }

    #[test]
    fn heads_and_columns_split_evenly() {
        let c = config(14, 2, 4864);
        let p = Shard::of(1, 2).plan(&c).unwrap();
        assert_eq!(p.q_heads, 7..14);
        assert_eq!(p.kv_heads, 1..2);
        assert_eq!(p.intermediate, 2432..4864);
    }

    #[test]
    fn kv_heads_are_replicated_when_ranks_outnumber_them() {
        let c = config(4, 2, 128);
        let kv: Vec<_> = (0..4)
            .map(|rank| Shard::of(rank, 4).plan(&c).unwrap().kv_heads)
            .collect();
        // Query heads 0,1 read KV head 0; 2,3 read KV head 1: one query head per rank.
        assert_eq!(kv, [0..1, 0..1, 1..2, 1..2]);
    }

    #[test]
    fn a_world_that_does_not_divide_is_refused_by_name() {
        let e = Shard::of(0, 2).plan(&config(9, 3, 1536)).unwrap_err();
        assert!(e.to_string().contains("9 attention heads"), "{e}");
        let e = Shard::of(0, 4).plan(&config(12, 3, 1536)).unwrap_err();
        assert!(e.to_string().contains("3 KV heads"), "{e}");
    }
}
