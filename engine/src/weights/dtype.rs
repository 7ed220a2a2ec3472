//! Element types of stored weights: the plain floats and the ggml block-quantized formats.

use half::{bf16, f16};

/// A stored tensor's element type. Quantized types pack `block_len()` values into `block_bytes()` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4_K,
    Q5_K,
    Q6_K,
    /// DeepSeek-V3's block FP8 repacked along rows: blocks of `n` e4m3 values (`n` the width of
    /// the checkpoint's scale blocks), each led by its block's f32 scale (`weight_scale_inv`),
    /// so a row reads without the scale grid beside it. About a byte a weight, as stored.
    F8Blocks(u16),
}

/// Values per K-quant super-block.
pub const QK_K: usize = 256;

impl DType {
    /// Maps a ggml type id (the `type` field of a GGUF tensor info); `None` for types kiln cannot read.
    pub fn from_ggml(id: u32) -> Option<DType> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            6 => DType::Q5_0,
            7 => DType::Q5_1,
            8 => DType::Q8_0,
            12 => DType::Q4_K,
            13 => DType::Q5_K,
            14 => DType::Q6_K,
            30 => DType::BF16,
            _ => return None,
        })
    }

    /// The name ggml uses for a type id, for error messages about types we do not read.
    pub fn ggml_name(id: u32) -> &'static str {
        match id {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            16..=23 => "IQ*",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            29 => "IQ1_M",
            30 => "BF16",
            _ => "unknown",
        }
    }

    pub fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => 32,
            DType::Q4_K | DType::Q5_K | DType::Q6_K => QK_K,
            DType::F8Blocks(n) => n as usize,
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q8_0 => 34,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
            DType::F8Blocks(n) => 4 + n as usize,
        }
    }

    /// Bytes needed for `n` values, or `None` when `n` is not a whole number of blocks.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if self.block_len() == 0 || !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }
}

/// One `float8_e4m3fn` value: 1 sign, 4 exponent (bias 7) and 3 mantissa bits. The format has
/// no infinities and its one NaN pattern (S.1111.111) never reaches here: the loader refuses it.
/// Branch-free but for a select, so row decoding vectorizes.
#[inline]
pub fn e4m3_to_f32(b: u8) -> f32 {
    let magnitude = (b & 0x7f) as u32;
    let v = if magnitude < 8 {
        // Subnormal: mantissa / 8 * 2^-6.
        magnitude as f32 * (1.0 / 512.0)
    } else {
        // Re-bias the exponent from 7 to 127 and widen the mantissa from 3 bits to 23.
        f32::from_bits((magnitude << 20) + (120 << 23))
    };
    if b & 0x80 != 0 { -v } else { v }
}

/// One row block of `F8Blocks`: its scale and its values, dequantized.
#[inline]
pub fn decode_f8_block(b: &[u8], y: &mut [f32]) {
    let scale = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (yj, &q) in y.iter_mut().zip(&b[4..]) {
        *yj = e4m3_to_f32(q) * scale;
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantizes `src` (a whole number of blocks of `dtype`) into `dst` (f32, one value per element).
/// The bit layouts follow ggml-quants.c (`dequantize_row_*`).
pub fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) {
    let bl = dtype.block_len();
    let bb = dtype.block_bytes();
    debug_assert_eq!(src.len() / bb * bl, dst.len());
    match dtype {
        DType::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        _ => {
            for (b, y) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(bl)) {
                dequantize_block(dtype, b, y);
            }
        }
    }
}

fn dequantize_block(dtype: DType, b: &[u8], y: &mut [f32]) {
    match dtype {
        DType::Q4_0 => {
            let d = f16_at(b, 0);
            let qs = &b[2..18];
            for j in 0..16 {
                y[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
                y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
            }
        }
        DType::Q4_1 => {
            let d = f16_at(b, 0);
            let m = f16_at(b, 2);
            let qs = &b[4..20];
            for j in 0..16 {
                y[j] = (qs[j] & 0x0f) as f32 * d + m;
                y[j + 16] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        DType::Q5_0 => {
            let d = f16_at(b, 0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let qs = &b[6..22];
            for j in 0..16 {
                let xh0 = (((qh >> j) << 4) & 0x10) as u8;
                let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
                y[j] = (((qs[j] & 0x0f) | xh0) as i32 - 16) as f32 * d;
                y[j + 16] = (((qs[j] >> 4) | xh1) as i32 - 16) as f32 * d;
            }
        }
        DType::Q5_1 => {
            let d = f16_at(b, 0);
            let m = f16_at(b, 2);
            let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
            let qs = &b[8..24];
            for j in 0..16 {
                let xh0 = (((qh >> j) << 4) & 0x10) as u8;
                let xh1 = ((qh >> (j + 12)) & 0x10) as u8;
                y[j] = ((qs[j] & 0x0f) | xh0) as f32 * d + m;
                y[j + 16] = ((qs[j] >> 4) | xh1) as f32 * d + m;
            }
        }
        DType::Q8_0 => {
            let d = f16_at(b, 0);
            for j in 0..32 {
                y[j] = (b[2 + j] as i8) as f32 * d;
            }
        }
        DType::Q4_K => {
            let d = f16_at(b, 0);
            let dmin = f16_at(b, 2);
            let scales = &b[4..16];
            let qs = &b[16..144];
            for (chunk, (q, out)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
                let (sc1, m1) = k_scale_min(2 * chunk, scales);
                let (sc2, m2) = k_scale_min(2 * chunk + 1, scales);
                let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                for l in 0..32 {
                    out[l] = d1 * (q[l] & 0x0f) as f32 - m1;
                    out[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
                }
            }
        }
        DType::Q5_K => {
            let d = f16_at(b, 0);
            let dmin = f16_at(b, 2);
            let scales = &b[4..16];
            let qh = &b[16..48];
            let qs = &b[48..176];
            for (chunk, (q, out)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
                let (sc1, m1) = k_scale_min(2 * chunk, scales);
                let (sc2, m2) = k_scale_min(2 * chunk + 1, scales);
                let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                let u1 = 1u8 << (2 * chunk);
                let u2 = 2u8 << (2 * chunk);
                for l in 0..32 {
                    let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                    let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                    out[l] = d1 * ((q[l] & 0x0f) + h1) as f32 - m1;
                    out[l + 32] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
                }
            }
        }
        DType::Q6_K => {
            let d = f16_at(b, 208);
            for half in 0..2 {
                let ql = &b[half * 64..half * 64 + 64];
                let qh = &b[128 + half * 32..128 + half * 32 + 32];
                let sc = &b[192 + half * 8..192 + half * 8 + 8];
                let out = &mut y[half * 128..half * 128 + 128];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    out[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                    out[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                    out[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                    out[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                }
            }
        }
        DType::F8Blocks(_) => decode_f8_block(b, y),
        DType::F32 | DType::F16 | DType::BF16 => {
            unreachable!("plain floats are handled by dequantize")
        }
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K / Q5_K super-block (`get_scale_min_k4`).
#[inline]
pub fn k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_round_trip() {
        let mut b = vec![0u8; 34];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        for j in 0..32 {
            b[2 + j] = (j as i8 - 16) as u8;
        }
        let mut y = vec![0f32; 32];
        dequantize(DType::Q8_0, &b, &mut y);
        for (j, v) in y.iter().enumerate() {
            assert_eq!(*v, (j as f32 - 16.0) * 0.5);
        }
    }

    #[test]
    fn q4_1_layout_low_nibbles_first() {
        let mut b = vec![0u8; 20];
        b[0..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(-2.0).to_le_bytes());
        b[4] = 0x3a; // element 0 = 0xa, element 16 = 0x3
        let mut y = vec![0f32; 32];
        dequantize(DType::Q4_1, &b, &mut y);
        assert_eq!(y[0], 8.0);
        assert_eq!(y[16], 1.0);
        assert_eq!(y[1], -2.0);
    }

    #[test]
    fn e4m3_decodes_the_format_s_landmarks() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0); // exponent 7 = bias
        assert_eq!(e4m3_to_f32(0xc0), -2.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0); // the largest finite value
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // the smallest subnormal
        assert_eq!(e4m3_to_f32(0x87), -7.0 * 2f32.powi(-9)); // the largest negative subnormal
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // the smallest normal
    }

    #[test]
    fn e4m3_matches_the_format_s_definition_for_every_finite_byte() {
        for b in (0..=255u8).filter(|b| b & 0x7f != 0x7f) {
            let (exp, man) = (((b >> 3) & 0x0f) as i32, (b & 0x07) as f32);
            let magnitude = if exp == 0 {
                man / 8.0 * 2f32.powi(-6)
            } else {
                (1.0 + man / 8.0) * 2f32.powi(exp - 7)
            };
            let want = if b & 0x80 != 0 { -magnitude } else { magnitude };
            assert_eq!(e4m3_to_f32(b).to_bits(), want.to_bits(), "byte {b:#04x}");
        }
    }

    #[test]
    fn f8_blocks_scale_each_block_by_its_own_scale() {
        let mut b = Vec::new();
        for (scale, byte) in [(0.5f32, 0x38u8), (-3.0, 0xc0)] {
            b.extend_from_slice(&scale.to_le_bytes());
            b.extend_from_slice(&[byte; 16]);
        }
        assert_eq!(DType::F8Blocks(16).bytes_for(32), Some(b.len()));
        let mut y = vec![0f32; 32];
        dequantize(DType::F8Blocks(16), &b, &mut y);
        assert!(y[..16].iter().all(|&v| v == 0.5));
        assert!(y[16..].iter().all(|&v| v == 6.0));
    }

    #[test]
    fn sizes_reject_partial_blocks() {
        assert_eq!(DType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(DType::Q4_K.bytes_for(100), None);
        assert_eq!(DType::F16.bytes_for(3), Some(6));
    }
}
