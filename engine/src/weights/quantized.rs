//! Quantized Hugging Face checkpoint formats, dequantized on load: DeepSeek-V3's block FP8
//! (`float8_e4m3fn` weights with an f32 `weight_scale_inv` per block) and compressed-tensors'
//! `pack-quantized` integers (Kimi-K2-Thinking's INT4 experts, symmetric, one scale per group).

use std::path::Path;

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

/// One `float8_e4m3fn` value: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, and
/// S.1111.111 is NaN.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
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
    let table: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
    let scale_cols = cols.div_ceil(block[1]);
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        let srow = &scales[(r / block[0]) * scale_cols..];
        for c in 0..cols {
            out[r * cols + c] = table[bytes[r * cols + c] as usize] * srow[c / block[1]];
        }
    }
    out
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
    fn e4m3_decodes_the_format_s_landmarks() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0); // exponent 7 = bias
        assert_eq!(e4m3_to_f32(0xc0), -2.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0); // the largest finite value
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // the smallest subnormal
        assert!(e4m3_to_f32(0x7f).is_nan());
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
