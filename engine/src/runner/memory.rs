//! How big the KV cache is. On the CPU, `--kv-tokens` (32768 by default). On a GPU, SGLang's
//! `--mem-fraction-static`: that fraction of the GPU's total memory holds the weights and the KV
//! pool, so the pool gets the fraction less what the weights took; activations, cuBLASLt's
//! workspace and CUDA graphs live in the rest. An explicit `--kv-tokens` wins on either.

use crate::error::{Error, Result};

/// The CPU's KV cache when `--kv-tokens` is not given.
pub const CPU_KV_TOKENS: usize = 32768;
/// The GPU's `--mem-fraction-static` when neither it nor `--kv-tokens` is given (SGLang picks
/// 0.81 to 0.88 by GPU size; one GPU serving one model leaves little else to keep room for).
pub const GPU_MEM_FRACTION: f64 = 0.85;

/// What sizes the KV cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvSize {
    Tokens(usize),
    /// The fraction of the device's total memory for weights plus KV (a device backend only).
    MemoryFraction(f64),
}

impl KvSize {
    /// From the settings: explicit tokens win; else the device's own default.
    pub fn choose(gpu: bool, tokens: Option<usize>, fraction: Option<f64>) -> Result<KvSize> {
        if let Some(f) = fraction
            && !(f > 0.0 && f < 1.0)
        {
            return Err(Error::InvalidRequest(format!(
                "--mem-fraction-static {f} must lie strictly between 0 and 1"
            )));
        }
        Ok(match (tokens, gpu) {
            (Some(t), _) => KvSize::Tokens(t),
            (None, false) if fraction.is_some() => {
                return Err(Error::InvalidRequest(
                    "--mem-fraction-static sizes a GPU's KV pool; on --device cpu the KV cache \
                     is --kv-tokens"
                        .into(),
                ));
            }
            (None, false) => KvSize::Tokens(CPU_KV_TOKENS),
            (None, true) => KvSize::MemoryFraction(fraction.unwrap_or(GPU_MEM_FRACTION)),
        })
    }
}

/// A device's memory as the budget sees it, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMemory {
    pub free: usize,
    pub total: usize,
}

/// KV tokens (whole blocks) that `fraction` of `total` holds after `weights` bytes, at
/// `bytes_per_token` (every layer's K and V of one token, draft included).
pub fn kv_tokens_for_fraction(
    total: usize,
    fraction: f64,
    weights: usize,
    bytes_per_token: usize,
    block_size: usize,
) -> Result<usize> {
    let budget = (total as f64 * fraction) as usize;
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let room = budget.saturating_sub(weights);
    let tokens = room / bytes_per_token.max(1) / block_size.max(1) * block_size;
    if tokens == 0 {
        return Err(Error::Device(format!(
            "--mem-fraction-static {fraction} of {:.1} GiB is {:.1} GiB, and the weights take \
             {:.1} GiB: no room for one KV block; raise it or give --kv-tokens",
            gib(total),
            gib(budget),
            gib(weights)
        )));
    }
    Ok(tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: usize = 1 << 30;

    #[test]
    fn the_pool_is_the_fraction_less_the_weights_in_whole_blocks() {
        // Llama-3-8B on an 80 GiB H100: 16 GiB of bf16 weights, 32 layers x K,V x 1024 x 2 B.
        let per_token = 32 * 2 * 1024 * 2;
        let t = kv_tokens_for_fraction(80 * GIB, 0.85, 16 * GIB, per_token, 16).expect("fits");
        let want = ((80.0 * 0.85) as usize - 16) * GIB / per_token;
        assert_eq!(t, want / 16 * 16);
        assert_eq!(t % 16, 0);
        // A smaller fraction, a smaller pool; weights beyond the fraction, an error naming both.
        let less = kv_tokens_for_fraction(80 * GIB, 0.5, 16 * GIB, per_token, 16).expect("fits");
        assert!(less < t);
        let e = kv_tokens_for_fraction(80 * GIB, 0.1, 16 * GIB, per_token, 16)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            e.contains("--mem-fraction-static 0.1") && e.contains("16.0 GiB"),
            "{e}"
        );
    }

    #[test]
    fn explicit_tokens_win_and_each_device_has_its_default() {
        assert_eq!(
            KvSize::choose(true, Some(4096), Some(0.5)).ok(),
            Some(KvSize::Tokens(4096))
        );
        assert_eq!(
            KvSize::choose(false, None, None).ok(),
            Some(KvSize::Tokens(CPU_KV_TOKENS))
        );
        assert_eq!(
            KvSize::choose(true, None, None).ok(),
            Some(KvSize::MemoryFraction(GPU_MEM_FRACTION))
        );
        assert!(KvSize::choose(false, None, Some(0.5)).is_err());
        assert!(KvSize::choose(true, None, Some(1.5)).is_err());
        assert!(KvSize::choose(true, None, Some(0.0)).is_err());
    }
}
