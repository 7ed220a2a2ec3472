//! Dot-product kernels, chosen once at run time from the CPU's features: AVX-512 VNNI, AVX2 + FMA +
//! F16C, or portable scalar code. Every SIMD kernel is tested against the scalar one.

use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
use super::x86_rows8;

use super::blocks::{
    BlockQ4_1, BlockQ4_1x8, BlockQ8_0, BlockQ8Act, BlockQ8x8, BlockQ8x16, f16_to_f32,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    Scalar,
    Avx2,
    Avx512Vnni,
}

impl SimdLevel {
    /// The best level this CPU supports.
    pub fn detect() -> SimdLevel {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            if avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
            {
                return SimdLevel::Avx512Vnni;
            }
            if avx2 {
                return SimdLevel::Avx2;
            }
        }
        SimdLevel::Scalar
    }

    /// Every level this CPU can run, lowest first (for tests that compare them).
    pub fn available() -> Vec<SimdLevel> {
        let best = SimdLevel::detect();
        [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512Vnni]
            .into_iter()
            .filter(|l| *l <= best)
            .collect()
    }
}

/// Eight weight rows against `T` two-level activation rows, given as their `hi` and `lo` levels.
pub type Pairs8Fn<W, const T: usize> =
    fn(&[W], [&[BlockQ8Act]; T], [&[BlockQ8Act]; T]) -> [[f32; 8]; T];

/// Two groups of eight weight rows (`g` and `g + 1`) against `T` two-level activation rows.
pub type Pairs16Fn<W, const T: usize> =
    fn(&[W], &[W], [&[BlockQ8Act]; T], [&[BlockQ8Act]; T]) -> [[f32; 16]; T];

/// One eight-row kernel at three activation-row counts (two-level rows).
#[derive(Clone, Copy)]
pub struct Rows8<W: 'static> {
    pub p1: Pairs8Fn<W, 1>,
    pub p2: Pairs8Fn<W, 2>,
    pub p4: Pairs8Fn<W, 4>,
    /// With 512-bit registers: two groups at once, bit-identical to two calls of the above.
    pub wide: Option<Rows16<W>>,
}

#[derive(Clone, Copy)]
pub struct Rows16<W: 'static> {
    pub p1: Pairs16Fn<W, 1>,
    pub p2: Pairs16Fn<W, 2>,
    pub p4: Pairs16Fn<W, 4>,
}

/// The scalar two-level kernels: `hi` and `lo` are ordinary activation rows, so a pair's result is
/// the sum of two single-row dot products.
fn scalar_pairs_q4_1<const T: usize>(
    w: &[BlockQ4_1x8],
    h: [&[BlockQ8Act]; T],
    l: [&[BlockQ8Act]; T],
) -> [[f32; 8]; T] {
    std::array::from_fn(|t| {
        let (a, b) = (scalar::dot8_q4_1(w, h[t]), scalar::dot8_q4_1(w, l[t]));
        std::array::from_fn(|i| a[i] + b[i])
    })
}

fn scalar_pairs_q8<const T: usize>(
    w: &[BlockQ8x8],
    h: [&[BlockQ8Act]; T],
    l: [&[BlockQ8Act]; T],
) -> [[f32; 8]; T] {
    std::array::from_fn(|t| {
        let (a, b) = (scalar::dot8_q8(w, h[t]), scalar::dot8_q8(w, l[t]));
        std::array::from_fn(|i| a[i] + b[i])
    })
}

pub type Dot4x2F32 = fn([&[f32]; 4], [&[f32]; 2]) -> [[f32; 4]; 2];

/// The kernel set of one SIMD level.
#[derive(Clone, Copy)]
pub struct Kernels {
    pub level: SimdLevel,
    pub dot_f32: fn(&[f32], &[f32]) -> f32,
    /// Four f32 weight rows against two input rows: each weight and input vector is loaded once
    /// for eight products (`dot_f32` per pair is bound by its two loads per multiply). Every value
    /// is bit-identical to `dot_f32` on that pair, so a token's result does not depend on how many
    /// tokens share the step (speculative verification must reproduce plain decoding exactly).
    pub dot4x2_f32: Dot4x2F32,
    pub dot_q4_1: fn(&[BlockQ4_1], &[BlockQ8Act]) -> f32,
    pub dot_q8_0: fn(&[BlockQ8_0], &[BlockQ8Act]) -> f32,
    pub dot_q8x16: fn(&[BlockQ8x16], &[BlockQ8Act]) -> f32,
    /// Four weight rows against one activation row: the activation is loaded once per block and the
    /// four accumulator chains hide each other's latency.
    pub dot4_q4_1: fn([&[BlockQ4_1]; 4], &[BlockQ8Act]) -> [f32; 4],
    pub dot4_q8_0: fn([&[BlockQ8_0]; 4], &[BlockQ8Act]) -> [f32; 4],
    pub dot4_q8x16: fn([&[BlockQ8x16]; 4], &[BlockQ8Act]) -> [f32; 4],
    /// Eight interleaved rows against one, two or four two-level activation rows, one SIMD lane per
    /// weight row: no horizontal sums, the eight rows' scales convert in one instruction, and each
    /// weight block is unpacked once for all activation rows.
    pub dot8_q4_1: Rows8<BlockQ4_1x8>,
    pub dot8_q8: Rows8<BlockQ8x8>,
}

impl Kernels {
    pub fn for_level(level: SimdLevel) -> Kernels {
        match level {
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512Vnni => Kernels {
                level,
                dot_f32: x86::dot_f32_avx512_safe,
                dot4x2_f32: x86::dot4x2_f32_avx512_safe,
                dot_q4_1: x86::dot_q4_1_vnni_safe,
                dot_q8_0: x86::dot_q8_0_vnni_safe,
                dot_q8x16: x86::dot_q8x16_vnni_safe,
                dot4_q4_1: x86::dot4_q4_1_vnni_safe,
                dot4_q8_0: x86::dot4_q8_0_vnni_safe,
                dot4_q8x16: x86::dot4_q8x16_vnni_safe,
                dot8_q4_1: Rows8 {
                    p1: x86_rows8::dot8_q4_1_vnni_p1,
                    p2: x86_rows8::dot8_q4_1_vnni_p2,
                    p4: x86_rows8::dot8_q4_1_vnni_p4,
                    wide: Some(Rows16 {
                        p1: x86_rows8::dot16_q4_1_vnni_p1,
                        p2: x86_rows8::dot16_q4_1_vnni_p2,
                        p4: x86_rows8::dot16_q4_1_vnni_p4,
                    }),
                },
                dot8_q8: Rows8 {
                    p1: x86_rows8::dot8_q8_unsigned_vnni_p1,
                    p2: x86_rows8::dot8_q8_unsigned_vnni_p2,
                    p4: x86_rows8::dot8_q8_unsigned_vnni_p4,
                    wide: Some(Rows16 {
                        p1: x86_rows8::dot16_q8_unsigned_vnni_p1,
                        p2: x86_rows8::dot16_q8_unsigned_vnni_p2,
                        p4: x86_rows8::dot16_q8_unsigned_vnni_p4,
                    }),
                },
            },
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => Kernels {
                level,
                dot_f32: x86::dot_f32_avx2_safe,
                // Four accumulators per pair (bit-identity with `dot_f32_avx2`) times eight pairs
                // would not fit in AVX2's sixteen registers: pair by pair, from L1.
                dot4x2_f32: |w, x| x.map(|xt| w.map(|r| x86::dot_f32_avx2_safe(r, xt))),
                dot_q4_1: x86::dot_q4_1_avx2_safe,
                dot_q8_0: x86::dot_q8_0_avx2_safe,
                dot_q8x16: x86::dot_q8x16_avx2_safe,
                dot4_q4_1: x86::dot4_q4_1_avx2_safe,
                dot4_q8_0: x86::dot4_q8_0_avx2_safe,
                dot4_q8x16: x86::dot4_q8x16_avx2_safe,
                dot8_q4_1: Rows8 {
                    p1: x86_rows8::dot8_q4_1_avx2_p1,
                    p2: x86_rows8::dot8_q4_1_avx2_p2,
                    p4: |w, h, l| {
                        let a = x86_rows8::dot8_q4_1_avx2_p2(w, [h[0], h[1]], [l[0], l[1]]);
                        let b = x86_rows8::dot8_q4_1_avx2_p2(w, [h[2], h[3]], [l[2], l[3]]);
                        [a[0], a[1], b[0], b[1]]
                    },
                    wide: None,
                },
                dot8_q8: Rows8 {
                    p1: x86_rows8::dot8_q8_avx2_p1,
                    p2: x86_rows8::dot8_q8_avx2_p2,
                    p4: |w, h, l| {
                        let a = x86_rows8::dot8_q8_avx2_p2(w, [h[0], h[1]], [l[0], l[1]]);
                        let b = x86_rows8::dot8_q8_avx2_p2(w, [h[2], h[3]], [l[2], l[3]]);
                        [a[0], a[1], b[0], b[1]]
                    },
                    wide: None,
                },
            },
            _ => Kernels {
                level: SimdLevel::Scalar,
                dot_f32: scalar::dot_f32,
                dot4x2_f32: |w, x| x.map(|xt| w.map(|r| scalar::dot_f32(r, xt))),
                dot_q4_1: scalar::dot_q4_1,
                dot_q8_0: scalar::dot_q8_0,
                dot_q8x16: scalar::dot_q8x16,
                dot4_q4_1: |w, a| w.map(|r| scalar::dot_q4_1(r, a)),
                dot4_q8_0: |w, a| w.map(|r| scalar::dot_q8_0(r, a)),
                dot4_q8x16: |w, a| w.map(|r| scalar::dot_q8x16(r, a)),
                dot8_q4_1: Rows8 {
                    p1: scalar_pairs_q4_1::<1>,
                    p2: scalar_pairs_q4_1::<2>,
                    p4: scalar_pairs_q4_1::<4>,
                    wide: None,
                },
                dot8_q8: Rows8 {
                    p1: scalar_pairs_q8::<1>,
                    p2: scalar_pairs_q8::<2>,
                    p4: scalar_pairs_q8::<4>,
                    wide: None,
                },
            },
        }
    }

    /// The kernels for the best level of this CPU, detected once.
    pub fn best() -> &'static Kernels {
        static K: OnceLock<Kernels> = OnceLock::new();
        K.get_or_init(|| Kernels::for_level(SimdLevel::detect()))
    }
}

pub mod scalar {
    use super::*;

    pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        // Eight partial sums, like the SIMD kernels, so results agree closely.
        let mut acc = [0f32; 8];
        let chunks = a.len() / 8;
        for c in 0..chunks {
            for l in 0..8 {
                acc[l] += a[c * 8 + l] * b[c * 8 + l];
            }
        }
        let mut s: f32 = acc.iter().sum();
        for i in chunks * 8..a.len() {
            s += a[i] * b[i];
        }
        s
    }

    pub fn dot_q4_1(w: &[BlockQ4_1], a: &[BlockQ8Act]) -> f32 {
        let mut s = 0f32;
        for (wb, ab) in w.iter().zip(a) {
            let mut isum = 0i32;
            for j in 0..16 {
                isum += (wb.qs[j] & 0x0f) as i32 * ab.qs[j] as i32;
                isum += (wb.qs[j] >> 4) as i32 * ab.qs[j + 16] as i32;
            }
            s += f16_to_f32(wb.d) * ab.d * isum as f32 + f16_to_f32(wb.m) * ab.s;
        }
        s
    }

    pub fn dot_q8_0(w: &[BlockQ8_0], a: &[BlockQ8Act]) -> f32 {
        let mut s = 0f32;
        for (wb, ab) in w.iter().zip(a) {
            let isum: i32 = wb
                .qs
                .iter()
                .zip(&ab.qs)
                .map(|(&x, &y)| x as i32 * y as i32)
                .sum();
            s += f16_to_f32(wb.d) * ab.d * isum as f32;
        }
        s
    }

    pub fn dot_q8x16(w: &[BlockQ8x16], a: &[BlockQ8Act]) -> f32 {
        let mut s = 0f32;
        for (wb, ab) in w.iter().zip(a) {
            for h in 0..2 {
                let isum: i32 = (h * 16..h * 16 + 16)
                    .map(|j| wb.qs[j] as i32 * ab.qs[j] as i32)
                    .sum();
                s += f16_to_f32(wb.d[h]) * ab.d * isum as f32;
            }
        }
        s
    }

    pub fn dot8_q4_1(w: &[BlockQ4_1x8], a: &[BlockQ8Act]) -> [f32; 8] {
        let mut out = [0f32; 8];
        for (wb, ab) in w.iter().zip(a) {
            for (i, o) in out.iter_mut().enumerate() {
                let isum: i32 = (0..32)
                    .map(|e| wb.level(i, e) as i32 * ab.qs[e] as i32)
                    .sum();
                *o += f16_to_f32(wb.d[i]) * ab.d * isum as f32 + f16_to_f32(wb.m[i]) * ab.s;
            }
        }
        out
    }

    pub fn dot8_q8(w: &[BlockQ8x8], a: &[BlockQ8Act]) -> [f32; 8] {
        let mut out = [0f32; 8];
        for (wb, ab) in w.iter().zip(a) {
            for (i, o) in out.iter_mut().enumerate() {
                for h in 0..2 {
                    let isum: i32 = (16 * h..16 * h + 16)
                        .map(|e| wb.level(i, e) as i32 * ab.qs[e] as i32)
                        .sum();
                    *o += f16_to_f32(wb.d[h][i]) * ab.d * isum as f32;
                }
            }
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum256(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// One f16 (raw bits) to f32 with the F16C instruction.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn h2f(x: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(x as i32)))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_q4(qs: &[u8; 16]) -> __m256i {
        let raw = unsafe { _mm_loadu_si128(qs.as_ptr() as *const __m128i) };
        let hi = _mm_srli_epi16(raw, 4);
        _mm256_and_si256(_mm256_set_m128i(hi, raw), _mm256_set1_epi8(0x0f))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_i8(qs: &[i8; 32]) -> __m256i {
        unsafe { _mm256_loadu_si256(qs.as_ptr() as *const __m256i) }
    }

    /// Unsigned x signed byte dot products summed into eight i32 lanes (lane i = bytes 4i..4i+4).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_u8i8_avx2(u: __m256i, s: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_f32_avx2(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        unsafe {
            while i + 32 <= n {
                for (k, acc_k) in acc.iter_mut().enumerate() {
                    let o = i + 8 * k;
                    *acc_k = _mm256_fmadd_ps(
                        _mm256_loadu_ps(pa.add(o)),
                        _mm256_loadu_ps(pb.add(o)),
                        *acc_k,
                    );
                }
                i += 32;
            }
            while i + 8 <= n {
                acc[0] = _mm256_fmadd_ps(
                    _mm256_loadu_ps(pa.add(i)),
                    _mm256_loadu_ps(pb.add(i)),
                    acc[0],
                );
                i += 8;
            }
            let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
            let mut s = hsum256(v);
            while i < n {
                s += a[i] * b[i];
                i += 1;
            }
            s
        }
    }

    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn dot_f32_avx512(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm512_setzero_ps();
        let mut acc1 = _mm512_setzero_ps();
        let mut i = 0;
        unsafe {
            while i + 32 <= n {
                acc0 =
                    _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
                acc1 = _mm512_fmadd_ps(
                    _mm512_loadu_ps(pa.add(i + 16)),
                    _mm512_loadu_ps(pb.add(i + 16)),
                    acc1,
                );
                i += 32;
            }
            while i + 16 <= n {
                acc0 =
                    _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
                i += 16;
            }
            let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
            while i < n {
                s += a[i] * b[i];
                i += 1;
            }
            s
        }
    }

    /// `dot_f32_avx512` for the eight (row, input) pairs of four rows and two inputs at once: the
    /// same two accumulators per pair, the same tail and reduction, so each value is bit-identical
    /// to it. 16 accumulators + 12 loaded vectors fit in the 32 registers.
    #[target_feature(enable = "avx512f,avx2,fma")]
    unsafe fn dot4x2_f32_avx512(w: [&[f32]; 4], x: [&[f32]; 2]) -> [[f32; 4]; 2] {
        let n = w[0].len();
        if w.iter().chain(x.iter()).any(|s| s.len() != n) {
            // `dot_f32` takes the shorter length per pair; only equal lengths share one loop.
            return x.map(|xt| w.map(|r| unsafe { dot_f32_avx512(r, xt) }));
        }
        let (pw, px) = (w.map(|r| r.as_ptr()), x.map(|r| r.as_ptr()));
        let mut acc0 = [[_mm512_setzero_ps(); 4]; 2];
        let mut acc1 = [[_mm512_setzero_ps(); 4]; 2];
        let mut i = 0;
        // SAFETY: every load reads 16 floats at i or i + 16 < n of a slice of length n.
        unsafe {
            while i + 32 <= n {
                let wa = pw.map(|p| _mm512_loadu_ps(p.add(i)));
                let xa = px.map(|p| _mm512_loadu_ps(p.add(i)));
                let wb = pw.map(|p| _mm512_loadu_ps(p.add(i + 16)));
                let xb = px.map(|p| _mm512_loadu_ps(p.add(i + 16)));
                for t in 0..2 {
                    for r in 0..4 {
                        acc0[t][r] = _mm512_fmadd_ps(wa[r], xa[t], acc0[t][r]);
                        acc1[t][r] = _mm512_fmadd_ps(wb[r], xb[t], acc1[t][r]);
                    }
                }
                i += 32;
            }
            while i + 16 <= n {
                let wa = pw.map(|p| _mm512_loadu_ps(p.add(i)));
                let xa = px.map(|p| _mm512_loadu_ps(p.add(i)));
                for t in 0..2 {
                    for r in 0..4 {
                        acc0[t][r] = _mm512_fmadd_ps(wa[r], xa[t], acc0[t][r]);
                    }
                }
                i += 16;
            }
        }
        std::array::from_fn(|t| {
            std::array::from_fn(|r| {
                let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t][r], acc1[t][r]));
                for j in i..n {
                    s += w[r][j] * x[t][j];
                }
                s
            })
        })
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q4_1_avx2(w: &[BlockQ4_1], a: &[BlockQ8Act]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut summ = 0f32;
        for (wb, ab) in w.iter().zip(a) {
            unsafe {
                let p = dot_u8i8_avx2(load_q4(&wb.qs), load_i8(&ab.qs));
                let scale = _mm256_set1_ps(h2f(wb.d) * ab.d);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc);
                summ += h2f(wb.m) * ab.s;
            }
        }
        unsafe { hsum256(acc) + summ }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q8_0_avx2(w: &[BlockQ8_0], a: &[BlockQ8Act]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (wb, ab) in w.iter().zip(a) {
            unsafe {
                let wv = load_i8(&wb.qs);
                let av = load_i8(&ab.qs);
                // maddubs needs an unsigned operand: move w's sign onto a.
                let p = dot_u8i8_avx2(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv));
                let scale = _mm256_set1_ps(h2f(wb.d) * ab.d);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc);
            }
        }
        unsafe { hsum256(acc) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_q8x16_avx2(w: &[BlockQ8x16], a: &[BlockQ8Act]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (wb, ab) in w.iter().zip(a) {
            unsafe {
                let wv = load_i8(&wb.qs);
                let av = load_i8(&ab.qs);
                let p = dot_u8i8_avx2(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv));
                let scale = _mm256_mul_ps(
                    _mm256_set_m128(_mm_set1_ps(h2f(wb.d[1])), _mm_set1_ps(h2f(wb.d[0]))),
                    _mm256_set1_ps(ab.d),
                );
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc);
            }
        }
        unsafe { hsum256(acc) }
    }

    #[target_feature(enable = "avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c")]
    unsafe fn dot_q4_1_vnni(w: &[BlockQ4_1], a: &[BlockQ8Act]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut summ = 0f32;
        for (wb, ab) in w.iter().zip(a) {
            unsafe {
                let p =
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), load_q4(&wb.qs), load_i8(&ab.qs));
                let scale = _mm256_set1_ps(h2f(wb.d) * ab.d);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc);
                summ += h2f(wb.m) * ab.s;
            }
        }
        unsafe { hsum256(acc) + summ }
    }

    #[target_feature(enable = "avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c")]
    unsafe fn dot_q8_0_vnni(w: &[BlockQ8_0], a: &[BlockQ8Act]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (wb, ab) in w.iter().zip(a) {
            unsafe {
                let wv = load_i8(&wb.qs);
                let av = load_i8(&ab.qs);
                let p = _mm256_dpbusd_epi32(
                    _mm256_setzero_si256(),
                    _mm256_sign_epi8(wv, wv),
                    _mm256_sign_epi8(av, wv),
                );
                let scale = _mm256_set1_ps(h2f(wb.d) * ab.d);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc);
            }
        }
        unsafe { hsum256(acc) }
    }

    #[target_feature(enable = "avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c")]
    unsafe fn dot_q8x16_vnni(w: &[BlockQ8x16], a: &[BlockQ8Act]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (wb, ab) in w.iter().zip(a) {
            unsafe {
                let wv = load_i8(&wb.qs);
                let av = load_i8(&ab.qs);
                let p = _mm256_dpbusd_epi32(
                    _mm256_setzero_si256(),
                    _mm256_sign_epi8(wv, wv),
                    _mm256_sign_epi8(av, wv),
                );
                let scale = _mm256_mul_ps(
                    _mm256_set_m128(_mm_set1_ps(h2f(wb.d[1])), _mm_set1_ps(h2f(wb.d[0]))),
                    _mm256_set1_ps(ab.d),
                );
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc);
            }
        }
        unsafe { hsum256(acc) }
    }

    #[inline]
    #[target_feature(enable = "avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c")]
    unsafe fn dot_u8i8_vnni(u: __m256i, s: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
    }

    macro_rules! rows4_kernels {
        ($feat:literal, $idot:ident, $q4:ident, $q8:ident, $q8x16:ident) => {
            #[target_feature(enable = $feat)]
            unsafe fn $q4(w: [&[BlockQ4_1]; 4], a: &[BlockQ8Act]) -> [f32; 4] {
                assert!(
                    w.iter().all(|r| r.len() >= a.len()),
                    "weight rows shorter than activations"
                );
                let mut acc = [_mm256_setzero_ps(); 4];
                let mut summ = [0f32; 4];
                for (b, ab) in a.iter().enumerate() {
                    unsafe {
                        let av = load_i8(&ab.qs);
                        for r in 0..4 {
                            let wb = w[r].get_unchecked(b);
                            let p = $idot(load_q4(&wb.qs), av);
                            let scale = _mm256_set1_ps(h2f(wb.d) * ab.d);
                            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r]);
                            summ[r] += h2f(wb.m) * ab.s;
                        }
                    }
                }
                unsafe { std::array::from_fn(|r| hsum256(acc[r]) + summ[r]) }
            }

            #[target_feature(enable = $feat)]
            unsafe fn $q8(w: [&[BlockQ8_0]; 4], a: &[BlockQ8Act]) -> [f32; 4] {
                assert!(
                    w.iter().all(|r| r.len() >= a.len()),
                    "weight rows shorter than activations"
                );
                let mut acc = [_mm256_setzero_ps(); 4];
                for (b, ab) in a.iter().enumerate() {
                    unsafe {
                        let av = load_i8(&ab.qs);
                        for r in 0..4 {
                            let wb = w[r].get_unchecked(b);
                            let wv = load_i8(&wb.qs);
                            let p = $idot(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv));
                            let scale = _mm256_set1_ps(h2f(wb.d) * ab.d);
                            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r]);
                        }
                    }
                }
                unsafe { std::array::from_fn(|r| hsum256(acc[r])) }
            }

            #[target_feature(enable = $feat)]
            unsafe fn $q8x16(w: [&[BlockQ8x16]; 4], a: &[BlockQ8Act]) -> [f32; 4] {
                assert!(
                    w.iter().all(|r| r.len() >= a.len()),
                    "weight rows shorter than activations"
                );
                let mut acc = [_mm256_setzero_ps(); 4];
                for (b, ab) in a.iter().enumerate() {
                    unsafe {
                        let av = load_i8(&ab.qs);
                        let da = _mm256_set1_ps(ab.d);
                        for r in 0..4 {
                            let wb = w[r].get_unchecked(b);
                            let wv = load_i8(&wb.qs);
                            let p = $idot(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(av, wv));
                            let scale = _mm256_mul_ps(
                                _mm256_set_m128(
                                    _mm_set1_ps(h2f(wb.d[1])),
                                    _mm_set1_ps(h2f(wb.d[0])),
                                ),
                                da,
                            );
                            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r]);
                        }
                    }
                }
                unsafe { std::array::from_fn(|r| hsum256(acc[r])) }
            }
        };
    }

    rows4_kernels!(
        "avx2,fma,f16c",
        dot_u8i8_avx2,
        dot4_q4_1_avx2,
        dot4_q8_0_avx2,
        dot4_q8x16_avx2
    );
    rows4_kernels!(
        "avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c",
        dot_u8i8_vnni,
        dot4_q4_1_vnni,
        dot4_q8_0_vnni,
        dot4_q8x16_vnni
    );

    pub fn dot4_q4_1_avx2_safe(w: [&[BlockQ4_1]; 4], a: &[BlockQ8Act]) -> [f32; 4] {
        unsafe { dot4_q4_1_avx2(w, a) }
    }
    pub fn dot4_q8_0_avx2_safe(w: [&[BlockQ8_0]; 4], a: &[BlockQ8Act]) -> [f32; 4] {
        unsafe { dot4_q8_0_avx2(w, a) }
    }
    pub fn dot4_q8x16_avx2_safe(w: [&[BlockQ8x16]; 4], a: &[BlockQ8Act]) -> [f32; 4] {
        unsafe { dot4_q8x16_avx2(w, a) }
    }
    pub fn dot4_q4_1_vnni_safe(w: [&[BlockQ4_1]; 4], a: &[BlockQ8Act]) -> [f32; 4] {
        unsafe { dot4_q4_1_vnni(w, a) }
    }
    pub fn dot4_q8_0_vnni_safe(w: [&[BlockQ8_0]; 4], a: &[BlockQ8Act]) -> [f32; 4] {
        unsafe { dot4_q8_0_vnni(w, a) }
    }
    pub fn dot4_q8x16_vnni_safe(w: [&[BlockQ8x16]; 4], a: &[BlockQ8Act]) -> [f32; 4] {
        unsafe { dot4_q8x16_vnni(w, a) }
    }

    // Safe entry points: only installed in a `Kernels` after `SimdLevel::detect` saw the features.
    pub fn dot_f32_avx2_safe(a: &[f32], b: &[f32]) -> f32 {
        unsafe { dot_f32_avx2(a, b) }
    }
    pub fn dot_f32_avx512_safe(a: &[f32], b: &[f32]) -> f32 {
        unsafe { dot_f32_avx512(a, b) }
    }
    pub fn dot4x2_f32_avx512_safe(w: [&[f32]; 4], x: [&[f32]; 2]) -> [[f32; 4]; 2] {
        unsafe { dot4x2_f32_avx512(w, x) }
    }
    pub fn dot_q4_1_avx2_safe(w: &[BlockQ4_1], a: &[BlockQ8Act]) -> f32 {
        unsafe { dot_q4_1_avx2(w, a) }
    }
    pub fn dot_q8_0_avx2_safe(w: &[BlockQ8_0], a: &[BlockQ8Act]) -> f32 {
        unsafe { dot_q8_0_avx2(w, a) }
    }
    pub fn dot_q8x16_avx2_safe(w: &[BlockQ8x16], a: &[BlockQ8Act]) -> f32 {
        unsafe { dot_q8x16_avx2(w, a) }
    }
    pub fn dot_q4_1_vnni_safe(w: &[BlockQ4_1], a: &[BlockQ8Act]) -> f32 {
        unsafe { dot_q4_1_vnni(w, a) }
    }
    pub fn dot_q8_0_vnni_safe(w: &[BlockQ8_0], a: &[BlockQ8Act]) -> f32 {
        unsafe { dot_q8_0_vnni(w, a) }
    }
    pub fn dot_q8x16_vnni_safe(w: &[BlockQ8x16], a: &[BlockQ8Act]) -> f32 {
        unsafe { dot_q8x16_vnni(w, a) }
    }
}

#[cfg(test)]
mod tests {
    use super::super::blocks::{f32_to_f16, quantize_activations, quantize_two_level};
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rng() -> rand_chacha::ChaCha8Rng {
        rand_chacha::ChaCha8Rng::seed_from_u64(7)
    }

    fn acts(n_blocks: usize) -> Vec<BlockQ8Act> {
        let mut r = rng();
        let x: Vec<f32> = (0..n_blocks * 32)
            .map(|_| r.random_range(-3.0..3.0))
            .collect();
        let mut a = vec![BlockQ8Act::default(); n_blocks];
        quantize_activations(&x, &mut a);
        a
    }

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() <= 1e-4 * (1.0 + a.abs().max(b.abs()))
    }

    #[test]
    fn every_level_matches_scalar() {
        let mut r = rng();
        let n = 18;
        let a = acts(n);
        let q4: Vec<BlockQ4_1> = (0..n)
            .map(|_| BlockQ4_1 {
                d: f32_to_f16(r.random_range(0.001..0.1)),
                m: f32_to_f16(r.random_range(-0.5..0.0)),
                qs: std::array::from_fn(|_| r.random()),
            })
            .collect();
        let q8: Vec<BlockQ8_0> = (0..n)
            .map(|_| BlockQ8_0 {
                d: f32_to_f16(r.random_range(0.001..0.1)),
                qs: std::array::from_fn(|_| r.random()),
            })
            .collect();
        let q8x16: Vec<BlockQ8x16> = (0..n)
            .map(|_| BlockQ8x16 {
                d: [
                    f32_to_f16(r.random_range(0.001..0.1)),
                    f32_to_f16(r.random_range(-0.1..0.1)),
                ],
                qs: std::array::from_fn(|_| r.random_range(-32..32)),
            })
            .collect();
        let fa: Vec<f32> = (0..583).map(|_| r.random_range(-1.0..1.0)).collect();
        let fb: Vec<f32> = (0..583).map(|_| r.random_range(-1.0..1.0)).collect();
        let s = Kernels::for_level(SimdLevel::Scalar);
        for level in SimdLevel::available() {
            let k = Kernels::for_level(level);
            assert!(
                close((k.dot_q4_1)(&q4, &a), (s.dot_q4_1)(&q4, &a)),
                "{level:?} q4_1"
            );
            assert!(
                close((k.dot_q8_0)(&q8, &a), (s.dot_q8_0)(&q8, &a)),
                "{level:?} q8_0"
            );
            assert!(
                close((k.dot_q8x16)(&q8x16, &a), (s.dot_q8x16)(&q8x16, &a)),
                "{level:?} q8x16"
            );
            assert!(
                close((k.dot_f32)(&fa, &fb), (s.dot_f32)(&fa, &fb)),
                "{level:?} f32"
            );
        }
    }

    /// Four rows against two inputs, bit for bit against `dot_f32` per pair, at lengths with
    /// and without each tail (the 16-float step, the scalar remainder).
    #[test]
    fn four_rows_by_two_inputs_equal_single_dots() {
        let mut r = rng();
        for len in [576, 583, 16, 7, 48] {
            let mut vec =
                |n: usize| -> Vec<f32> { (0..n).map(|_| r.random_range(-1.0..1.0)).collect() };
            let w: Vec<Vec<f32>> = (0..4).map(|_| vec(len)).collect();
            let x: Vec<Vec<f32>> = (0..2).map(|_| vec(len)).collect();
            let wr = [0, 1, 2, 3].map(|i| &w[i][..]);
            let xr = [0, 1].map(|i| &x[i][..]);
            for level in SimdLevel::available() {
                let k = Kernels::for_level(level);
                let got = (k.dot4x2_f32)(wr, xr);
                for t in 0..2 {
                    for i in 0..4 {
                        assert_eq!(
                            got[t][i].to_bits(),
                            (k.dot_f32)(wr[i], xr[t]).to_bits(),
                            "{level:?} len {len} input {t} row {i}"
                        );
                    }
                }
            }
        }
    }

    /// `kern.wide` at 1, 2 and 4 activation rows, bit for bit against `kern`'s eight-row forms
    /// on each of the two groups.
    fn wide_equals_two_narrow<W>(
        kern: &Rows8<W>,
        a: &[W],
        b: &[W],
        h4: [&[BlockQ8Act]; 4],
        l4: [&[BlockQ8Act]; 4],
        what: &str,
    ) {
        let wide = kern.wide.as_ref().expect("a 512-bit form");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let check = |got: &[[f32; 16]], ga: &[[f32; 8]], gb: &[[f32; 8]], rows: &str| {
            for t in 0..got.len() {
                assert_eq!(
                    bits(&got[t][..8]),
                    bits(&ga[t]),
                    "{what} wide {rows}, group 0"
                );
                assert_eq!(
                    bits(&got[t][8..]),
                    bits(&gb[t]),
                    "{what} wide {rows}, group 1"
                );
            }
        };
        let (h1, l1) = ([h4[0]], [l4[0]]);
        let (h2, l2) = ([h4[0], h4[1]], [l4[0], l4[1]]);
        check(
            &(wide.p1)(a, b, h1, l1),
            &(kern.p1)(a, h1, l1),
            &(kern.p1)(b, h1, l1),
            "p1",
        );
        check(
            &(wide.p2)(a, b, h2, l2),
            &(kern.p2)(a, h2, l2),
            &(kern.p2)(b, h2, l2),
            "p2",
        );
        check(
            &(wide.p4)(a, b, h4, l4),
            &(kern.p4)(a, h4, l4),
            &(kern.p4)(b, h4, l4),
            "p4",
        );
    }

    #[test]
    fn eight_row_kernels_match_scalar_at_every_row_count() {
        let mut r = rng();
        let n = 18;
        let q4: Vec<BlockQ4_1x8> = (0..n)
            .map(|_| {
                let rows: [BlockQ4_1; 8] = std::array::from_fn(|_| BlockQ4_1 {
                    d: f32_to_f16(r.random_range(0.001..0.1)),
                    m: f32_to_f16(r.random_range(-0.5..0.0)),
                    qs: std::array::from_fn(|_| r.random()),
                });
                BlockQ4_1x8::pack(std::array::from_fn(|i| &rows[i]))
            })
            .collect();
        let q8: Vec<BlockQ8x8> = (0..n)
            .map(|_| {
                let vals: [[i8; 32]; 8] =
                    std::array::from_fn(|_| std::array::from_fn(|_| r.random()));
                let d =
                    [0, 1].map(|_| std::array::from_fn(|_| f32_to_f16(r.random_range(-0.1..0.1))));
                BlockQ8x8::pack(std::array::from_fn(|i| &vals[i]), d)
            })
            .collect();
        // Four two-level rows: hi and lo from one row of values each.
        let (h, l): (Vec<_>, Vec<_>) = (0..4)
            .map(|_| {
                let x: Vec<f32> = (0..n * 32).map(|_| r.random_range(-3.0..3.0)).collect();
                let mut h = vec![BlockQ8Act::default(); n];
                let mut l = vec![BlockQ8Act::default(); n];
                quantize_two_level(&x, &mut h, &mut l);
                (h, l)
            })
            .unzip();
        // The reference: each level an ordinary activation row, their results summed.
        let want4: Vec<[f32; 8]> = (0..4)
            .map(|t| {
                let (a, b) = (scalar::dot8_q4_1(&q4, &h[t]), scalar::dot8_q4_1(&q4, &l[t]));
                std::array::from_fn(|i| a[i] + b[i])
            })
            .collect();
        let want8: Vec<[f32; 8]> = (0..4)
            .map(|t| {
                let (a, b) = (scalar::dot8_q8(&q8, &h[t]), scalar::dot8_q8(&q8, &l[t]));
                std::array::from_fn(|i| a[i] + b[i])
            })
            .collect();
        let same = |got: &[[f32; 8]], want: &[[f32; 8]], what: &str| {
            for (g, w) in got.iter().zip(want) {
                for (x, y) in g.iter().zip(w) {
                    assert!(close(*x, *y), "{what}: {x} vs {y}");
                }
            }
        };
        let (h4, l4) = ([&h[0], &h[1], &h[2], &h[3]], [&l[0], &l[1], &l[2], &l[3]]);
        let (h4, l4) = (h4.map(|v| &v[..]), l4.map(|v| &v[..]));
        for level in SimdLevel::available() {
            let k = Kernels::for_level(level);
            let kern = &k.dot8_q4_1;
            same(
                &(kern.p1)(&q4, [h4[0]], [l4[0]]),
                &want4[..1],
                &format!("{level:?} q4_1 p1"),
            );
            same(
                &(kern.p2)(&q4, [h4[0], h4[1]], [l4[0], l4[1]]),
                &want4[..2],
                &format!("{level:?} q4_1 p2"),
            );
            same(
                &(kern.p4)(&q4, h4, l4),
                &want4,
                &format!("{level:?} q4_1 p4"),
            );
            let kern = &k.dot8_q8;
            same(
                &(kern.p1)(&q8, [h4[0]], [l4[0]]),
                &want8[..1],
                &format!("{level:?} q8 p1"),
            );
            same(
                &(kern.p2)(&q8, [h4[0], h4[1]], [l4[0], l4[1]]),
                &want8[..2],
                &format!("{level:?} q8 p2"),
            );
            same(&(kern.p4)(&q8, h4, l4), &want8, &format!("{level:?} q8 p4"));
        }
        // The 512-bit two-group kernels: bit-identical to the eight-row kernel on each group
        // (the second group is the first's blocks in reverse order).
        let q4b: Vec<BlockQ4_1x8> = q4.iter().rev().copied().collect();
        let q8b: Vec<BlockQ8x8> = q8.iter().rev().copied().collect();
        let mut checked = 0;
        for level in SimdLevel::available() {
            let k = Kernels::for_level(level);
            if k.dot8_q4_1.wide.is_some() {
                wide_equals_two_narrow(&k.dot8_q4_1, &q4, &q4b, h4, l4, &format!("{level:?} q4_1"));
                checked += 1;
            }
            if k.dot8_q8.wide.is_some() {
                wide_equals_two_narrow(&k.dot8_q8, &q8, &q8b, h4, l4, &format!("{level:?} q8"));
            }
        }
        eprintln!("wide kernels checked at {checked} level(s)");
    }

    #[test]
    fn two_level_activations_carry_about_sixteen_bits() {
        let mut r = rng();
        let x: Vec<f32> = (0..64 * 32)
            .map(|i| r.random_range(-3.0..3.0) * if i % 97 == 0 { 40.0 } else { 1.0 })
            .collect();
        let mut hi = vec![BlockQ8Act::default(); 64];
        let mut lo = vec![BlockQ8Act::default(); 64];
        quantize_two_level(&x, &mut hi, &mut lo);
        for (b, (h, l)) in hi.iter().zip(&lo).enumerate() {
            assert_eq!(l.d * 128.0, h.d);
            let mut sum = 0f32;
            for j in 0..32 {
                let v = h.d * h.qs[j] as f32 + l.d * l.qs[j] as f32;
                let e = (v - x[b * 32 + j]).abs();
                assert!(
                    e <= l.d * 0.51,
                    "block {b} elem {j}: error {e}, step {}",
                    l.d
                );
                sum += l.d * l.qs[j] as f32;
            }
            assert!((l.s - sum).abs() <= 1e-3 * (1.0 + sum.abs()));
        }
    }
}
