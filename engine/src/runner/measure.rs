//! Measurements and self-checks of the device side a build has, for `kiln doctor`, `kiln bench
//! sweep` and `kiln gpu-check`: the CLI asks here and never names a backend. A build without the
//! CUDA side answers each GPU measurement with an error saying so.

use crate::doctor::allreduce::AllReducePoint;

/// How long one sweep may take before it is given up.
const SWEEP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(120);

/// NCCL's all-reduce swept over message sizes on `ranks` GPUs.
pub fn allreduce_sweep(ranks: usize) -> Result<Vec<AllReducePoint>, String> {
    #[cfg(feature = "cuda")]
    {
        crate::backend::cuda::nccl_sweep(ranks, SWEEP_TIMEOUT)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = SWEEP_TIMEOUT;
        Err(format!(
            "this build has no CUDA side, so it cannot drive NCCL over the {ranks} GPUs (build with --features cuda, or use the flake's packages.cuda)"
        ))
    }
}

/// The one-shot peer-to-peer all-reduce kernel swept over message sizes up to 1 MiB on `ranks`
/// GPUs.
pub fn one_shot_sweep(ranks: usize) -> Result<Vec<AllReducePoint>, String> {
    #[cfg(feature = "cuda")]
    {
        crate::backend::cuda::one_shot_sweep(ranks, SWEEP_TIMEOUT)
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(format!(
            "this build has no CUDA side, so it cannot run the one-shot kernel over the {ranks} GPUs (build with --features cuda)"
        ))
    }
}

/// `kiln gpu-check`'s measurements on the GPUs of a CUDA build.
#[cfg(feature = "cuda")]
pub mod gpu {
    use crate::backend::cuda;
    pub use crate::backend::cuda::parity::OpParity;
    use crate::bench::moe_layer::MoeLayerPoint;
    use crate::error::Result;

    /// Every kernel against its CPU reference, then every op of the CUDA backend against the
    /// CPU backend through the op trait, on GPU 0 with inputs drawn from `seed`.
    pub fn parity(seed: u64) -> Result<Vec<OpParity>> {
        let mut results = cuda::parity::run(seed).map_err(crate::error::Error::Device)?;
        results.extend(cuda::op_parity::run(seed)?);
        Ok(results)
    }

    /// GPUs the driver sees (0 when it cannot be asked).
    pub fn count() -> usize {
        cuda::probe().map(|r| r.devices.len()).unwrap_or(0)
    }

    /// The one-shot all-reduce's protocol over `ranks` ranks on the GPUs there are (several a
    /// GPU on one), every sum checked bit for bit; a line saying what ran.
    pub fn one_shot_selftest(
        ranks: usize,
        rounds: usize,
        seed: u64,
    ) -> std::result::Result<String, String> {
        cuda::one_shot_selftest(ranks, rounds, seed)
    }

    /// One Kimi-K2-sized MoE layer timed on GPU 0, with the GPU's peak read bandwidth.
    pub fn kimi_moe_layer(seed: u64) -> Result<(Vec<MoeLayerPoint>, Option<f64>)> {
        cuda::kimi_moe_layer_speed(seed)
    }
}
