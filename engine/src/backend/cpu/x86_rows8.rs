//! The eight-row interleaved kernels (`BlockQ4_1x8`, `BlockQ8x8`) for AVX2 and AVX-512 VNNI: one i32
//! lane per weight row, so a block costs a few instructions per row and no horizontal sum.

use std::arch::x86_64::*;

use super::blocks::{BlockQ4_1x8, BlockQ8Act, BlockQ8x8};

macro_rules! rows8_kernels {
    ($feat:literal, $acc:ident, $q4:ident, $q8:ident) => {
        #[target_feature(enable = $feat)]
        unsafe fn $q4(w: &[BlockQ4_1x8], a: &[BlockQ8Act]) -> [f32; 8] {
            assert!(w.len() >= a.len(), "weight blocks shorter than activations");
            let mask = _mm256_set1_epi8(0x0f);
            let mut acc = _mm256_setzero_ps();
            for (wb, ab) in w.iter().zip(a) {
                unsafe {
                    let ap = ab.qs.as_ptr() as *const i32;
                    let qp = wb.qs.as_ptr() as *const __m256i;
                    let (mut lo_sum, mut hi_sum) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                    for j in 0..4 {
                        let raw = _mm256_loadu_si256(qp.add(j));
                        let lo = _mm256_and_si256(raw, mask);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
                        lo_sum = $acc(
                            lo_sum,
                            lo,
                            _mm256_set1_epi32(ap.add(2 * j).read_unaligned()),
                        );
                        hi_sum = $acc(
                            hi_sum,
                            hi,
                            _mm256_set1_epi32(ap.add(2 * j + 1).read_unaligned()),
                        );
                    }
                    let isum = _mm256_add_epi32(lo_sum, hi_sum);
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(wb.d.as_ptr() as *const __m128i));
                    let m = _mm256_cvtph_ps(_mm_loadu_si128(wb.m.as_ptr() as *const __m128i));
                    let scale = _mm256_mul_ps(d, _mm256_set1_ps(ab.d));
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc);
                    acc = _mm256_fmadd_ps(m, _mm256_set1_ps(ab.s), acc);
                }
            }
            let mut out = [0f32; 8];
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
            out
        }

        #[target_feature(enable = $feat)]
        unsafe fn $q8(w: &[BlockQ8x8], a: &[BlockQ8Act]) -> [f32; 8] {
            assert!(w.len() >= a.len(), "weight blocks shorter than activations");
            let mut acc = _mm256_setzero_ps();
            for (wb, ab) in w.iter().zip(a) {
                unsafe {
                    let ap = ab.qs.as_ptr() as *const i32;
                    let qp = wb.qs.as_ptr() as *const __m256i;
                    let mut sums = [_mm256_setzero_si256(); 2];
                    for k in 0..8 {
                        let wv = _mm256_loadu_si256(qp.add(k));
                        let av = _mm256_set1_epi32(ap.add(k).read_unaligned());
                        // The unsigned x signed instructions need |w|, and a carrying w's sign.
                        sums[k / 4] = $acc(
                            sums[k / 4],
                            _mm256_sign_epi8(wv, wv),
                            _mm256_sign_epi8(av, wv),
                        );
                    }
                    let da = _mm256_set1_ps(ab.d);
                    for (h, sum) in sums.iter().enumerate() {
                        let d =
                            _mm256_cvtph_ps(_mm_loadu_si128(wb.d[h].as_ptr() as *const __m128i));
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(*sum), _mm256_mul_ps(d, da), acc);
                    }
                }
            }
            let mut out = [0f32; 8];
            unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
            out
        }
    };
}

/// `acc + Σ4 u8 x i8` per i32 lane with AVX2 (no saturation: pair sums stay below 2^15).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn acc_u8i8_avx2(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_add_epi32(
        acc,
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)),
    )
}

#[inline]
#[target_feature(enable = "avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c")]
unsafe fn acc_u8i8_vnni(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, u, s)
}

rows8_kernels!("avx2,fma,f16c", acc_u8i8_avx2, dot8_q4_1_avx2, dot8_q8_avx2);
rows8_kernels!(
    "avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c",
    acc_u8i8_vnni,
    dot8_q4_1_vnni,
    dot8_q8_vnni
);

// Safe entry points: only installed in a `Kernels` after `SimdLevel::detect` saw the features.
pub fn dot8_q4_1_avx2_safe(w: &[BlockQ4_1x8], a: &[BlockQ8Act]) -> [f32; 8] {
    unsafe { dot8_q4_1_avx2(w, a) }
}
pub fn dot8_q8_avx2_safe(w: &[BlockQ8x8], a: &[BlockQ8Act]) -> [f32; 8] {
    unsafe { dot8_q8_avx2(w, a) }
}
pub fn dot8_q4_1_vnni_safe(w: &[BlockQ4_1x8], a: &[BlockQ8Act]) -> [f32; 8] {
    unsafe { dot8_q4_1_vnni(w, a) }
}
pub fn dot8_q8_vnni_safe(w: &[BlockQ8x8], a: &[BlockQ8Act]) -> [f32; 8] {
    unsafe { dot8_q8_vnni(w, a) }
}
