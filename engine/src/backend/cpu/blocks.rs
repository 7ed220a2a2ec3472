//! Block layouts the CPU kernels compute on. Weight blocks keep ggml's byte layout (f16 scales), so
//! Q4_1 and Q8_0 tensors are copied verbatim from the GGUF file; activation blocks are built per matmul.

/// 32 weights `d * q + m`, `q` in 0..16: element `j` is the low nibble of `qs[j]`, element `j + 16` the
/// high nibble (ggml Q4_1). Q4_0 and Q4_K sub-blocks are repacked into this form.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockQ4_1 {
    pub d: u16,
    pub m: u16,
    pub qs: [u8; 16],
}

/// 32 weights `d * q`, `q` in -128..128 (ggml Q8_0). Q5_0 is repacked into this form.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockQ8_0 {
    pub d: u16,
    pub qs: [i8; 32],
}

/// 32 weights in two halves of 16 with their own scale: `d[j / 16] * q[j]`. Q6_K repacks into this.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockQ8x16 {
    pub d: [u16; 2],
    pub qs: [i8; 32],
}

/// 32 activations quantized to 8 bits: `x ≈ d * q`; `s = d * Σq` serves the `m` term of Q4_1 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockQ8Act {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; 32],
    /// `qs + 128` as unsigned bytes: the unsigned operand of VNNI's u8 x i8 products against signed
    /// 8-bit weights (which then need no sign juggling; the kernel subtracts 128 * Σw).
    pub qu: [u8; 32],
}

pub const QBLOCK: usize = 32;

const ROUND_MAGIC: f32 = 12_582_912.0;

/// `hi.d == lo.d * 2^LO_SHIFT` for two-level activations.
pub const LO_SHIFT: i32 = 7;

/// Quantizes one row (`x.len()` a multiple of 32) the way ggml's `quantize_row_q8_1` does.
pub fn quantize_activations(x: &[f32], out: &mut [BlockQ8Act]) {
    quantize_row(x, out, None);
}

/// The second level of two-level activations: what `hi` (from `quantize_activations`) left out,
/// `x - hi.d * hi.q`, in steps of `lo.d = hi.d / 128` (`LO_SHIFT`). Since `|x - hi.d * hi.q| <=
/// hi.d / 2`, the levels fit in -64..=64, `hi + lo` carries ~15 bits per value for the cost of a
/// second integer dot product, and the power-of-two ratio lets kernels combine the two integer sums
/// exactly as `(hi_sum << 7) + lo_sum` before one conversion to float.
pub fn quantize_two_level(x: &[f32], hi: &mut [BlockQ8Act], lo: &mut [BlockQ8Act]) {
    quantize_row(x, hi, Some(lo));
}

fn quantize_row(x: &[f32], hi: &mut [BlockQ8Act], lo: Option<&mut [BlockQ8Act]>) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        unsafe { quantize_row_avx2(x, hi, lo) };
        return;
    }
    quantize_row_portable(x, hi, lo);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_row_avx2(x: &[f32], hi: &mut [BlockQ8Act], lo: Option<&mut [BlockQ8Act]>) {
    quantize_row_portable(x, hi, lo)
}

// Fixed-size arrays and lane-wise maxima, so the same code vectorizes at each target level.
// Index loops over fixed-size arrays are what vectorizes here.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn quantize_row_portable(x: &[f32], hi: &mut [BlockQ8Act], mut lo: Option<&mut [BlockQ8Act]>) {
    for (b, (xb, hb)) in x.chunks_exact(QBLOCK).zip(hi.iter_mut()).enumerate() {
        let xb: &[f32; QBLOCK] = xb.try_into().expect("32-value block");
        let mut lane_max = [0f32; 8];
        for c in xb.chunks_exact(8) {
            for l in 0..8 {
                lane_max[l] = lane_max[l].max(c[l].abs());
            }
        }
        let amax = lane_max.iter().fold(0f32, |m, &v| m.max(v));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut q = [0i32; QBLOCK];
        for l in 0..QBLOCK {
            // Round to nearest (ties to even) by the 1.5 * 2^23 trick: plain arithmetic that compiles
            // to SIMD, where `f32::round` is a libm call. |v * id| <= 127, far inside its range.
            q[l] = ((xb[l] * id + ROUND_MAGIC) - ROUND_MAGIC) as i32;
        }
        for l in 0..QBLOCK {
            hb.qs[l] = q[l] as i8;
            hb.qu[l] = (q[l] + 128) as u8;
        }
        hb.d = d;
        hb.s = d * q.iter().sum::<i32>() as f32;
        if let Some(lo) = lo.as_deref_mut() {
            let lb = &mut lo[b];
            let dl = d / (1 << LO_SHIFT) as f32;
            let idl = if d != 0.0 {
                (1 << LO_SHIFT) as f32 / d
            } else {
                0.0
            };
            let mut r = [0i32; QBLOCK];
            for l in 0..QBLOCK {
                let v = (xb[l] - d * q[l] as f32) * idl;
                r[l] = (((v + ROUND_MAGIC) - ROUND_MAGIC) as i32).clamp(-64, 64);
            }
            for l in 0..QBLOCK {
                lb.qs[l] = r[l] as i8;
                lb.qu[l] = (r[l] + 128) as u8;
            }
            lb.d = dl;
            lb.s = dl * r.iter().sum::<i32>() as f32;
        }
    }
}

#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

#[inline]
pub fn f32_to_f16(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}

/// Eight rows' block `b`, interleaved so one SIMD lane accumulates one row: chunk `k` (elements
/// `4k..4k+4`) of row `i` sits at bytes `4i..4i+4` of a 32-byte group. Group `j` of `qs` holds chunk
/// `2j` in its low nibbles and chunk `2j + 1` in its high nibbles. Values `d[i] * q + m[i]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ4_1x8 {
    pub d: [u16; 8],
    pub m: [u16; 8],
    pub qs: [u8; 128],
}

/// Eight rows' block of signed 8-bit weights, same interleaving (group `k` = chunk `k`, 32 bytes):
/// `d[h][i]` scales row `i`'s elements `16h..16h+16` (Q8_0 repeats one scale in both halves).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BlockQ8x8 {
    pub d: [[u16; 8]; 2],
    pub qs: [i8; 256],
}

impl BlockQ4_1x8 {
    pub fn pack(rows: [&BlockQ4_1; 8]) -> Self {
        let q = |i: usize, e: usize| -> u8 {
            let b = rows[i];
            if e < 16 {
                b.qs[e] & 0x0f
            } else {
                b.qs[e - 16] >> 4
            }
        };
        let mut qs = [0u8; 128];
        for j in 0..4 {
            for i in 0..8 {
                for t in 0..4 {
                    qs[j * 32 + 4 * i + t] = q(i, 8 * j + t) | (q(i, 8 * j + 4 + t) << 4);
                }
            }
        }
        BlockQ4_1x8 {
            d: rows.map(|r| r.d),
            m: rows.map(|r| r.m),
            qs,
        }
    }

    /// The 4-bit level of row `i`, element `e`.
    #[inline]
    pub fn level(&self, i: usize, e: usize) -> u8 {
        let (k, t) = (e / 4, e % 4);
        let byte = self.qs[(k / 2) * 32 + 4 * i + t];
        if k % 2 == 0 { byte & 0x0f } else { byte >> 4 }
    }
}

impl BlockQ8x8 {
    pub fn pack(values: [&[i8; 32]; 8], d: [[u16; 8]; 2]) -> Self {
        let mut qs = [0i8; 256];
        for k in 0..8 {
            for i in 0..8 {
                for t in 0..4 {
                    qs[k * 32 + 4 * i + t] = values[i][4 * k + t];
                }
            }
        }
        BlockQ8x8 { d, qs }
    }

    #[inline]
    pub fn level(&self, i: usize, e: usize) -> i8 {
        self.qs[(e / 4) * 32 + 4 * i + e % 4]
    }
}
