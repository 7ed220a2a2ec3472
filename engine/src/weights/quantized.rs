//! Quantized Hugging Face checkpoint formats: DeepSeek-V3's block FP8 (`float8_e4m3fn` weights
//! with an f32 `weight_scale_inv` per block) and compressed-tensors' `pack-quantized` integers
//! (Kimi-K2-Thinking's INT4 experts, symmetric, one scale per group). Both are repacked
//! losslessly into a row-blocked type kiln reads packed (`F8Blocks`, `Q4_0`) where their
//! shapes allow, and dequantized to f32 otherwise.

use std::path::Path;

use super::DType;
use super::dtype::e4m3_to_f32;
use crate::error::{Error, Result};

/// What config.json's `quantization_config` says about the stored weights.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scheme {
    /// FP8: `weight_block_size` `[rows, cols]`.
    pub fp8_block: Option<[usize; 2]>,
    /// compressed-tensors: bits per packed integer and the group size of the scales.
    pub int_bits: Option<usize>,
    pub group_size: Option<usize>,
}

impl Scheme {
    /// Reads `quantization_config` from `config` when the file exists (a directory without a
    /// config.json, such as a draft's, has no scheme).
    pub fn from_config(config: &Path) -> Result<Scheme> {
        let Ok(text) = std::fs::read_to_string(config) else {
            return Ok(Scheme::default());
        };
        let Ok(json) = serde_json::from_str::<serde_json::Value>(&text) else {
            // config.json's own parser reports a broken file with its position.
            return Ok(Scheme::default());
        };
        let Some(q) = json.get("quantization_config") else {
            return Ok(Scheme::default());
        };
        let bad = |m: String| Err(Error::config(config, m));
        let mut scheme = Scheme::default();
        match q.get("quant_method").and_then(|m| m.as_str()) {
            Some("fp8") => {
                let block = q.get("weight_block_size").and_then(|b| b.as_array());
                match block.map(|b| b.iter().map(|v| v.as_u64()).collect::<Vec<_>>()) {
                    Some(b) if b.len() == 2 && b.iter().all(|v| v.is_some_and(|v| v > 0)) => {
                        let v: Vec<usize> = b.into_iter().flatten().map(|v| v as usize).collect();
                        scheme.fp8_block = Some([v[0], v[1]]);
                    }
                    _ => {
                        return bad(
                            "quantization_config.weight_block_size must be two positive integers"
                                .into(),
                        );
                    }
                }
            }
            Some("compressed-tensors") => {
                let format = q.get("format").and_then(|f| f.as_str());
                if format != Some("pack-quantized") {
                    return bad(format!(
                        "quantization_config.format {format:?} is not supported (pack-quantized only)"
                    ));
                }
                let groups = q.get("config_groups").and_then(|g| g.as_object());
                for g in groups.into_iter().flat_map(|g| g.values()) {
                    let w = &g["weights"];
                    if w.get("symmetric").and_then(|s| s.as_bool()) == Some(false) {
                        return bad(
                            "quantization_config: asymmetric (zero-point) weights are not supported"
                                .into(),
                        );
                    }
                    scheme.int_bits = w
                        .get("num_bits")
                        .and_then(|b| b.as_u64())
                        .map(|b| b as usize);
                    scheme.group_size = w
                        .get("group_size")
                        .and_then(|b| b.as_u64())
                        .map(|b| b as usize);
                }
            }
            Some(other) => {
                return bad(format!(
                    "quantization_config.quant_method `{other}` is not supported (fp8, \
                     compressed-tensors)"
                ));
            }
            None => return bad("quantization_config.quant_method is missing".into()),
        }
        Ok(scheme)
    }
}

/// `[rows, cols]` FP8 values times their block's scale.
pub fn dequantize_block_fp8(
    bytes: &[u8],
    rows: usize,
    cols: usize,
    block: [usize; 2],
    scales: &[f32],
) -> Vec<f32> {
    let scale_cols = cols.div_ceil(block[1]);
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        let srow = &scales[(r / block[0]) * scale_cols..];
        for c in 0..cols {
            out[r * cols + c] = e4m3_to_f32(bytes[r * cols + c]) * srow[c / block[1]];
        }
    }
    out
}

/// The index of the first e4m3 NaN (S.1111.111) in `bytes`: a checkpoint holding one is broken,
/// and refusing it lets every reader decode without a NaN case.
pub fn first_e4m3_nan(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|&b| b & 0x7f == 0x7f)
}

/// The same FP8 weight kept packed as `DType::F8Blocks(block[1])`: each row's blocks of
/// `block[1]` values, each led by its scale (rows `block[0]` apart share a scale row, so each
/// scale is written once per row it covers: 4 bytes per 128 values at DeepSeek-V3's blocks).
/// Lossless. `None` where a row is not whole blocks, which keeps the dequantized f32 path.
pub fn repack_block_fp8(
    bytes: &[u8],
    rows: usize,
    cols: usize,
    block: [usize; 2],
    scales: &[f32],
) -> Option<Vec<u8>> {
    let width = u16::try_from(block[1]).ok()?;
    if width == 0 || !cols.is_multiple_of(block[1]) {
        return None;
    }
    let blocks = cols / block[1];
    let mut out = Vec::with_capacity(rows * blocks * (4 + block[1]));
    for (r, row) in bytes.chunks_exact(cols).take(rows).enumerate() {
        let srow = &scales[(r / block[0]) * blocks..][..blocks];
        for (values, scale) in row.chunks_exact(block[1]).zip(srow) {
            out.extend_from_slice(&scale.to_le_bytes());
            out.extend_from_slice(values);
        }
    }
    debug_assert_eq!(
        DType::F8Blocks(width).bytes_for(rows * cols),
        Some(out.len())
    );
    Some(out)
}

/// The same weight as GGUF's Q4_0 blocks, kept packed (4.5 bits a weight instead of 32): each
/// group of 32 becomes one block of its scale as f16 and the 32 stored nibbles (value + 8, the
/// stored form already), element `j` in byte `j`'s low half and element `j + 16` in its high
/// half. Lossless, so only where it is: groups of exactly 32 along whole rows, and every scale
/// an f16 can hold exactly (bf16 scales are, in f16's normal range). `None` otherwise.
pub fn repack_int4_as_q4_0(
    packed: &[i32],
    rows: usize,
    cols: usize,
    group: usize,
    scales: &[f32],
) -> Option<Vec<u8>> {
    if group != 32 || !cols.is_multiple_of(32) {
        return None;
    }
    let (words, groups) = (cols / 8, cols / 32);
    let mut out = Vec::with_capacity(rows * groups * 18);
    for r in 0..rows {
        for g in 0..groups {
            let scale = scales[r * groups + g];
            let d = half::f16::from_f32(scale);
            if d.to_f32() != scale {
                return None;
            }
            out.extend_from_slice(&d.to_bits().to_le_bytes());
            let nibble = |c: usize| {
                let word = packed[r * words + (g * 32 + c) / 8] as u32;
                ((word >> (4 * (c % 8))) & 0xf) as u8
            };
            out.extend((0..16).map(|j| nibble(j) | nibble(j + 16) << 4));
        }
    }
    Some(out)
}

/// `[rows, cols]` 4-bit values packed eight per int32 (element `j` of a word in bits
/// `4j..4j+4`, stored as value + 8), times their group's scale.
pub fn dequantize_packed_int4(
    packed: &[i32],
    rows: usize,
    cols: usize,
    group: usize,
    scales: &[f32],
) -> Vec<f32> {
    let (words, groups) = (cols.div_ceil(8), cols.div_ceil(group));
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let word = packed[r * words + c / 8] as u32;
            let q = ((word >> (4 * (c % 8))) & 0xf) as i32 - 8;
            out[r * cols + c] = q as f32 * scales[r * groups + c / group];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_fp8_repacked_reads_back_exactly_the_dequantized_weight() {
        // 5 rows (a partial last row block) of 8 columns in blocks of [2, 4].
        let (rows, cols, block) = (5, 8, [2, 4]);
        let bytes: Vec<u8> = (0..rows * cols)
            .map(|i| (i * 37 % 255) as u8)
            .map(|b| if b & 0x7f == 0x7f { 0 } else { b })
            .collect();
        let scales: Vec<f32> = (0..3 * 2).map(|i| 0.25 * (i as f32 + 1.0)).collect();
        let want = dequantize_block_fp8(&bytes, rows, cols, block, &scales);
        let packed = repack_block_fp8(&bytes, rows, cols, block, &scales).expect("whole blocks");
        let mut got = vec![0f32; rows * cols];
        crate::weights::dtype::dequantize(DType::F8Blocks(4), &packed, &mut got);
        assert_eq!(got, want);
        // Rows that are not whole blocks stay on the f32 path.
        assert!(repack_block_fp8(&bytes, rows, cols, [2, 3], &scales).is_none());
        assert_eq!(first_e4m3_nan(&[0x00, 0x7e, 0xff]), Some(2));
        assert_eq!(first_e4m3_nan(&bytes), None);
    }

    #[test]
    fn int4_words_unpack_low_nibble_first_with_offset_eight() {
        // Values 0, 1, -1, 7, -8, 2, 3, -2 (+8: 8, 9, 7, 15, 0, 10, 11, 6).
        let nibbles = [8u32, 9, 7, 15, 0, 10, 11, 6];
        let word = nibbles
            .iter()
            .enumerate()
            .fold(0u32, |w, (j, &n)| w | (n << (4 * j)));
        let out = dequantize_packed_int4(&[word as i32], 1, 8, 4, &[0.5, 2.0]);
        assert_eq!(out, [0.0, 0.5, -0.5, 3.5, -16.0, 4.0, 6.0, -4.0]);
    }

    #[test]
    fn int4_repacked_as_q4_0_reads_back_exactly_the_dequantized_weight() {
        let (rows, cols) = (3, 64);
        // Every nibble value, in an order that differs word to word.
        let packed: Vec<i32> = (0..rows * cols / 8)
            .map(|w| {
                (0..8).fold(0u32, |acc, j| {
                    acc | (((w * 5 + j * 3) % 16) as u32) << (4 * j)
                }) as i32
            })
            .collect();
        // bf16-like scales (8 significant bits) of different magnitudes.
        let scales: Vec<f32> = (0..rows * 2)
            .map(|i| (1.0 + i as f32 / 128.0) * 2f32.powi(-(i as i32) - 3))
            .collect();
        let want = dequantize_packed_int4(&packed, rows, cols, 32, &scales);
        let q4_0 = repack_int4_as_q4_0(&packed, rows, cols, 32, &scales).expect("lossless");
        assert_eq!(q4_0.len(), rows * 2 * 18);
        let mut got = vec![0f32; rows * cols];
        crate::weights::dtype::dequantize(crate::weights::DType::Q4_0, &q4_0, &mut got);
        assert_eq!(got, want);
        // A scale f16 cannot hold, or groups other than 32: kept as f32 instead.
        let mut tiny = scales.clone();
        tiny[1] = 1e-9;
        assert!(repack_int4_as_q4_0(&packed, rows, cols, 32, &tiny).is_none());
        assert!(repack_int4_as_q4_0(&packed, rows, cols, 64, &scales[..rows]).is_none());
    }
}
