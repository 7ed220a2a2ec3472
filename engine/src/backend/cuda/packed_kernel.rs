//! Which kernel multiplies packed weights (INT4 as Q4 rows, FP8 blocks, and experts in bf16) at
//! decode sizes: mma.sync on the tensor cores (packed_mma.cu's `kiln_packed_mma_bf16` and
//! `kiln_moe_mma_bf16`), or one warp per row with FMAs (dequant.cu's `kiln_packed_matmul_bf16`
//! and `kiln_moe_matmul_bf16`).
//!
//! The tensor cores serve every decode size, one token included. Counted in the compiled code
//! (ptxas for sm_90 and sm_120; docs/performance.md, "Packed weights on the tensor cores"), the
//! FMA kernel issues about 18 instructions per INT4 weight byte at one token and 6.6 more per
//! extra token; the tensor-core kernel 7.1 (sm_120) to 9.3 (sm_90), and 1.9 to 2.6 more per 8
//! tokens. An H100 issues about 10 per byte of its memory bandwidth, so at one token only the
//! tensor-core kernel can keep up with the weights there; and one packed kernel at every decode
//! size (up to 32 tokens dense, 1,024 pairs for experts) gives a token the same bits alone or in
//! a batch there. The FMA kernels stay for widths the tensor-core kernel does not take (bf16
//! experts whose rows are no multiple of 32 values) and as the measured alternative: `kiln
//! gpu-check` times a Kimi-K2 MoE layer with each kernel forced, side by side, and compares both
//! with the CPU.

use std::sync::atomic::{AtomicU8, Ordering};

/// A packed-weight kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PackedKernel {
    /// One warp per output row, FMAs, 8 tokens per pass.
    Fma,
    /// mma.sync m16n8k16, 16 to 128 rows per thread block (`rows_per_block`: warps sharing 16
    /// rows split their blocks), up to 32 tokens per pass.
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

/// A kernel forced for every packed matmul (`kiln gpu-check`'s side-by-side timing and its
/// parity cases), or none: the tensor cores.
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

    /// The forced kernel, else the tensor cores.
    pub fn choose(&self) -> PackedKernel {
        match self.0.load(Ordering::Relaxed) {
            1 => PackedKernel::Fma,
            _ => PackedKernel::TensorCores,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_forced_kernel_holds_until_cleared() {
        let o = KernelOverride::default();
        assert_eq!(o.choose(), PackedKernel::TensorCores);
        o.set(Some(PackedKernel::Fma));
        assert_eq!(o.choose(), PackedKernel::Fma);
        o.set(Some(PackedKernel::TensorCores));
        assert_eq!(o.choose(), PackedKernel::TensorCores);
        o.set(None);
        assert_eq!(o.choose(), PackedKernel::TensorCores);
    }
}
