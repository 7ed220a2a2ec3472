//! Which kernel multiplies packed weights (INT4 as Q4 rows, FP8 blocks, and experts in bf16) at
//! decode sizes: one warp per row with FMAs (dequant.cu's `kiln_packed_matmul_bf16` and
//! `kiln_moe_matmul_bf16`), or mma.sync on the tensor cores (packed_mma.cu's
//! `kiln_packed_mma_bf16` and `kiln_moe_mma_bf16`).
//!
//! The FMA kernel spends one FMA (and one activation load) per weight and token: at one token
//! it keeps up with the weight bytes, from a few tokens on it is bound by those instructions. The
//! tensor-core kernel spends a fixed unpacking per weight and next to nothing per token. The
//! switch point below is a first choice from those instruction counts, not a measurement:
//! `kiln gpu-check` times a Kimi-K2 MoE layer with each kernel forced, side by side, to set it.

use std::sync::atomic::{AtomicU8, Ordering};

/// A packed-weight kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PackedKernel {
    /// One warp per output row, FMAs, 8 tokens per pass.
    Fma,
    /// mma.sync m16n8k16, 16 rows per thread block (its 8 warps split the rows' blocks), up to
    /// 32 tokens per pass.
    TensorCores,
}

impl PackedKernel {
    /// Threads per block of every packed kernel: 8 warps (dequant.cu's KILN_PACKED_WARPS,
    /// packed_mma.cu's KILN_MMA_WARPS).
    pub const THREADS: usize = 32 * 8;

    /// Output rows per thread block for rows of `cols` values: a row a warp (FMAs), or the 16
    /// rows of mma.sync's operand for every `mma_splits(cols)` warps.
    pub fn rows_per_block(self, cols: usize) -> usize {
        match self {
            PackedKernel::Fma => 8,
            PackedKernel::TensorCores => 16 * 8 / mma_splits(cols),
        }
    }

    /// Positions per tile of the grouped expert kernels (moe.cu's kiln_moe_group runs): as
    /// dequant.cu's KILN_PACKED_TOKENS and packed_mma.cu's KILN_MMA_TOKENS.
    pub fn tile_tokens(self) -> usize {
        match self {
            PackedKernel::Fma => 8,
            PackedKernel::TensorCores => 32,
        }
    }
}

/// Warps of a tensor-core thread block that share 16 rows (packed_mma.cu's `splits`: 1, 2, 4 or
/// 8): as many as leave each warp at least 4 of the rows' 32-value blocks, so a short row (the
/// 256 columns of a column-split expert's down projection) is not cut thinner than the sum in
/// shared memory that joins the pieces costs.
pub fn mma_splits(cols: usize) -> usize {
    let blocks = cols / 32;
    let mut splits = 8;
    while splits > 1 && blocks / splits < 4 {
        splits /= 2;
    }
    splits
}

/// Tokens each matrix read serves from which the tensor cores take over.
const TENSOR_CORES_FROM_TOKENS_PER_READ: f64 = 1.5;

/// The kernel for a matrix whose every read serves `tokens_per_read` tokens on average.
pub fn kernel_for(tokens_per_read: f64) -> PackedKernel {
    if tokens_per_read >= TENSOR_CORES_FROM_TOKENS_PER_READ {
        PackedKernel::TensorCores
    } else {
        PackedKernel::Fma
    }
}

/// Tokens each picked expert serves when `tokens` tokens each pick `top_k` of `n_experts`
/// (uniformly, as a balanced router does): the pairs over the distinct experts they are
/// expected to touch. Kimi-K2 (8 of 384): 1.0 at 1 token, 1.4 at 32, 1.8 at 64, 2.9 at 128.
pub fn tokens_per_picked_expert(tokens: usize, top_k: usize, n_experts: usize) -> f64 {
    if tokens == 0 || top_k == 0 || n_experts == 0 {
        return 0.0;
    }
    let pick = (top_k.min(n_experts) as f64) / n_experts as f64;
    let touched =
        n_experts as f64 * (1.0 - (1.0 - pick).powi(tokens.min(i32::MAX as usize) as i32));
    (tokens * top_k.min(n_experts)) as f64 / touched.max(1.0)
}

/// A kernel forced for every packed matmul (`kiln gpu-check`'s side-by-side timing), or none:
/// the rule above chooses.
#[derive(Default)]
pub struct KernelOverride(AtomicU8);

impl KernelOverride {
    pub fn set(&self, kernel: Option<PackedKernel>) {
        let v = match kernel {
            None => 0,
            Some(PackedKernel::Fma) => 1,
            Some(PackedKernel::TensorCores) => 2,
        };
        self.0.store(v, Ordering::Relaxed);
    }

    /// The forced kernel, else the rule's for `tokens_per_read`.
    pub fn choose(&self, tokens_per_read: f64) -> PackedKernel {
        match self.0.load(Ordering::Relaxed) {
            1 => PackedKernel::Fma,
            2 => PackedKernel::TensorCores,
            _ => kernel_for(tokens_per_read),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_token_reads_with_fmas_and_batches_on_the_tensor_cores() {
        assert_eq!(kernel_for(1.0), PackedKernel::Fma);
        assert_eq!(kernel_for(2.0), PackedKernel::TensorCores);
        assert_eq!(kernel_for(32.0), PackedKernel::TensorCores);
    }

    #[test]
    fn picked_experts_serve_more_tokens_as_the_batch_grows() {
        // Kimi-K2: 8 of 384 experts a token.
        let kimi = |t| tokens_per_picked_expert(t, 8, 384);
        assert!((kimi(1) - 1.0).abs() < 1e-9, "{}", kimi(1));
        assert!((1.3..1.45).contains(&kimi(32)), "{}", kimi(32));
        assert!((2.7..3.0).contains(&kimi(128)), "{}", kimi(128));
        assert_eq!(kernel_for(kimi(4)), PackedKernel::Fma);
        assert_eq!(kernel_for(kimi(128)), PackedKernel::TensorCores);
        // Every expert picked by every token: each serves all of them.
        assert!((tokens_per_picked_expert(24, 4, 4) - 24.0).abs() < 1e-9);
        assert_eq!(tokens_per_picked_expert(0, 8, 384), 0.0);
    }

    #[test]
    fn short_rows_are_split_between_fewer_warps() {
        // Kimi-K2: 7168-wide rows over all 8 warps; a column-split down projection's 256
        // columns (8 blocks) over 2, so the block takes 64 rows.
        assert_eq!(mma_splits(7168), 8);
        assert_eq!(mma_splits(2048), 8);
        assert_eq!(mma_splits(256), 2);
        assert_eq!(PackedKernel::TensorCores.rows_per_block(256), 64);
        assert_eq!(mma_splits(512), 4);
        assert_eq!(mma_splits(160), 1);
        assert_eq!(mma_splits(32), 1);
        assert_eq!(PackedKernel::TensorCores.rows_per_block(32), 128);
        assert_eq!(PackedKernel::Fma.rows_per_block(7168), 8);
    }

    #[test]
    fn a_forced_kernel_overrides_the_rule_until_cleared() {
        let o = KernelOverride::default();
        assert_eq!(o.choose(1.0), PackedKernel::Fma);
        o.set(Some(PackedKernel::TensorCores));
        assert_eq!(o.choose(1.0), PackedKernel::TensorCores);
        o.set(Some(PackedKernel::Fma));
        assert_eq!(o.choose(8.0), PackedKernel::Fma);
        o.set(None);
        assert_eq!(o.choose(8.0), PackedKernel::TensorCores);
    }
}
