//! The eight-row interleaved kernels (`BlockQ4_1x8`, `BlockQ8x8`) for AVX2 and AVX-512 VNNI: one i32
//! lane per weight row, so a block costs a few instructions per row and no horizontal sum.

use std::arch::x86_64::*;

use super::blocks::{BlockQ4_1x8, BlockQ8Act, BlockQ8x8, LO_SHIFT};

/// Two-level (hi, lo) activation pairs against one group of eight weight rows, `T` pairs at a time:
/// each weight block is loaded and unpacked once for all of them, and a pair's integer sums combine as
/// `(hi << LO_SHIFT) + lo` (exact: `hi.d == lo.d << LO_SHIFT`), so each pair costs one conversion and
/// one scale instead of two.
macro_rules! rows8_pair_kernels {
    ($feat:literal, $acc:ident, $q4:ident) => {
        #[target_feature(enable = $feat)]
        unsafe fn $q4<const T: usize>(
            w: &[BlockQ4_1x8],
            hi: [&[BlockQ8Act]; T],
            lo: [&[BlockQ8Act]; T],
        ) -> [[f32; 8]; T] {
            let nb = hi[0].len();
            assert!(
                w.len() >= nb && hi.iter().chain(&lo).all(|r| r.len() == nb),
                "weight and activation block counts"
            );
            let mask = _mm256_set1_epi8(0x0f);
            let mut acc = [_mm256_setzero_ps(); T];
            for b in 0..nb {
                unsafe {
                    let wb = w.get_unchecked(b);
                    let qp = wb.qs.as_ptr() as *const __m256i;
                    let mut hsum = [[_mm256_setzero_si256(); 2]; T];
                    let mut lsum = [[_mm256_setzero_si256(); 2]; T];
                    for j in 0..4 {
                        let raw = _mm256_loadu_si256(qp.add(j));
                        let nib = [
                            _mm256_and_si256(raw, mask),
                            _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask),
                        ];
                        for t in 0..T {
                            let hp = hi[t].get_unchecked(b).qs.as_ptr() as *const i32;
                            let lp = lo[t].get_unchecked(b).qs.as_ptr() as *const i32;
                            for h in 0..2 {
                                let k = 2 * j + h;
                                hsum[t][h] = $acc(
                                    hsum[t][h],
                                    nib[h],
                                    _mm256_set1_epi32(hp.add(k).read_unaligned()),
                                );
                                lsum[t][h] = $acc(
                                    lsum[t][h],
                                    nib[h],
                                    _mm256_set1_epi32(lp.add(k).read_unaligned()),
                                );
                            }
                        }
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(wb.d.as_ptr() as *const __m128i));
                    let m = _mm256_cvtph_ps(_mm_loadu_si128(wb.m.as_ptr() as *const __m128i));
                    for t in 0..T {
                        let (hb, lb) = (hi[t].get_unchecked(b), lo[t].get_unchecked(b));
                        let isum = _mm256_add_epi32(
                            _mm256_slli_epi32(_mm256_add_epi32(hsum[t][0], hsum[t][1]), LO_SHIFT),
                            _mm256_add_epi32(lsum[t][0], lsum[t][1]),
                        );
                        let scale = _mm256_mul_ps(d, _mm256_set1_ps(lb.d));
                        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[t]);
                        acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(hb.s + lb.s), acc[t]);
                    }
                }
            }
            let mut out = [[0f32; 8]; T];
            for t in 0..T {
                unsafe { _mm256_storeu_ps(out[t].as_mut_ptr(), acc[t]) };
            }
            out
        }
    };
}

/// The signed-weight pair kernel with the sign trick (`|w|` unsigned, the sign moved onto the
/// activation), for AVX2, whose `maddubs` cannot take unsigned activations near 255.
macro_rules! rows8_pair_sign_kernel {
    ($feat:literal, $acc:ident, $q8:ident) => {
        #[target_feature(enable = $feat)]
        unsafe fn $q8<const T: usize>(
            w: &[BlockQ8x8],
            hi: [&[BlockQ8Act]; T],
            lo: [&[BlockQ8Act]; T],
        ) -> [[f32; 8]; T] {
            let nb = hi[0].len();
            assert!(
                w.len() >= nb && hi.iter().chain(&lo).all(|r| r.len() == nb),
                "weight and activation block counts"
            );
            let mut acc = [_mm256_setzero_ps(); T];
            for b in 0..nb {
                unsafe {
                    let wb = w.get_unchecked(b);
                    let qp = wb.qs.as_ptr() as *const __m256i;
                    let mut hsum = [[_mm256_setzero_si256(); 2]; T];
                    let mut lsum = [[_mm256_setzero_si256(); 2]; T];
                    for k in 0..8 {
                        let wv = _mm256_loadu_si256(qp.add(k));
                        // The unsigned x signed instructions need |w|, and a carrying w's sign.
                        let wabs = _mm256_sign_epi8(wv, wv);
                        for t in 0..T {
                            let hp = hi[t].get_unchecked(b).qs.as_ptr() as *const i32;
                            let lp = lo[t].get_unchecked(b).qs.as_ptr() as *const i32;
                            let hv = _mm256_set1_epi32(hp.add(k).read_unaligned());
                            let lv = _mm256_set1_epi32(lp.add(k).read_unaligned());
                            hsum[t][k / 4] = $acc(hsum[t][k / 4], wabs, _mm256_sign_epi8(hv, wv));
                            lsum[t][k / 4] = $acc(lsum[t][k / 4], wabs, _mm256_sign_epi8(lv, wv));
                        }
                    }
                    let dw = [
                        _mm256_cvtph_ps(_mm_loadu_si128(wb.d[0].as_ptr() as *const __m128i)),
                        _mm256_cvtph_ps(_mm_loadu_si128(wb.d[1].as_ptr() as *const __m128i)),
                    ];
                    for t in 0..T {
                        let da = _mm256_set1_ps(lo[t].get_unchecked(b).d);
                        for h in 0..2 {
                            let isum = _mm256_add_epi32(
                                _mm256_slli_epi32(hsum[t][h], LO_SHIFT),
                                lsum[t][h],
                            );
                            acc[t] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(isum),
                                _mm256_mul_ps(dw[h], da),
                                acc[t],
                            );
                        }
                    }
                }
            }
            let mut out = [[0f32; 8]; T];
            for t in 0..T {
                unsafe { _mm256_storeu_ps(out[t].as_mut_ptr(), acc[t]) };
            }
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

rows8_pair_kernels!("avx2,fma,f16c", acc_u8i8_avx2, dot8_q4_1_pairs_avx2);
rows8_pair_sign_kernel!("avx2,fma,f16c", acc_u8i8_avx2, dot8_q8_pairs_avx2);
rows8_pair_kernels!(
    "avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c",
    acc_u8i8_vnni,
    dot8_q4_1_pairs_vnni
);

/// Safe entry points, `T` pairs at a time: only installed in a `Kernels` after `SimdLevel::detect`
/// saw the features.
macro_rules! safe_pair_entry {
    ($name:ident, $inner:ident, $w:ty, $t:literal) => {
        pub fn $name(w: &[$w], hi: [&[BlockQ8Act]; $t], lo: [&[BlockQ8Act]; $t]) -> [[f32; 8]; $t] {
            unsafe { $inner::<$t>(w, hi, lo) }
        }
    };
}
safe_pair_entry!(dot8_q4_1_avx2_p1, dot8_q4_1_pairs_avx2, BlockQ4_1x8, 1);
safe_pair_entry!(dot8_q4_1_avx2_p2, dot8_q4_1_pairs_avx2, BlockQ4_1x8, 2);
safe_pair_entry!(dot8_q8_avx2_p1, dot8_q8_pairs_avx2, BlockQ8x8, 1);
safe_pair_entry!(dot8_q8_avx2_p2, dot8_q8_pairs_avx2, BlockQ8x8, 2);
safe_pair_entry!(dot8_q4_1_vnni_p1, dot8_q4_1_pairs_vnni, BlockQ4_1x8, 1);
safe_pair_entry!(dot8_q4_1_vnni_p2, dot8_q4_1_pairs_vnni, BlockQ4_1x8, 2);
safe_pair_entry!(dot8_q4_1_vnni_p4, dot8_q4_1_pairs_vnni, BlockQ4_1x8, 4);

/// Two-level pairs against signed 8-bit weights with VNNI only: the activations' unsigned copies
/// (`qu = q + 128`) go straight into `vpdpbusd` against the signed weights, and `128 * Σw` per row
/// and half (one extra `vpdpbusd` against ones per weight vector, shared by every row) comes off
/// afterwards. AVX2's `maddubs` would saturate on these operands, so it keeps the sign trick.
#[target_feature(enable = "avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c")]
unsafe fn dot8_q8_pairs_unsigned_vnni<const T: usize>(
    w: &[BlockQ8x8],
    hi: [&[BlockQ8Act]; T],
    lo: [&[BlockQ8Act]; T],
) -> [[f32; 8]; T] {
    let nb = hi[0].len();
    assert!(
        w.len() >= nb && hi.iter().chain(&lo).all(|r| r.len() == nb),
        "weight and activation block counts"
    );
    let ones = _mm256_set1_epi8(1);
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..nb {
        unsafe {
            let wb = w.get_unchecked(b);
            let qp = wb.qs.as_ptr() as *const __m256i;
            let mut wsum = [_mm256_setzero_si256(); 2];
            let mut hsum = [[_mm256_setzero_si256(); 2]; T];
            let mut lsum = [[_mm256_setzero_si256(); 2]; T];
            for k in 0..8 {
                let wv = _mm256_loadu_si256(qp.add(k));
                wsum[k / 4] = _mm256_dpbusd_epi32(wsum[k / 4], ones, wv);
                for t in 0..T {
                    let hp = hi[t].get_unchecked(b).qu.as_ptr() as *const i32;
                    let lp = lo[t].get_unchecked(b).qu.as_ptr() as *const i32;
                    let hv = _mm256_set1_epi32(hp.add(k).read_unaligned());
                    let lv = _mm256_set1_epi32(lp.add(k).read_unaligned());
                    hsum[t][k / 4] = _mm256_dpbusd_epi32(hsum[t][k / 4], hv, wv);
                    lsum[t][k / 4] = _mm256_dpbusd_epi32(lsum[t][k / 4], lv, wv);
                }
            }
            // (H << 7) + L with H = Σ(h+128)w - 128Σw and L likewise: subtract Σw (128·128 + 128).
            let corr = wsum.map(|s| {
                _mm256_add_epi32(
                    _mm256_slli_epi32(s, 2 * LO_SHIFT),
                    _mm256_slli_epi32(s, LO_SHIFT),
                )
            });
            let dw = [
                _mm256_cvtph_ps(_mm_loadu_si128(wb.d[0].as_ptr() as *const __m128i)),
                _mm256_cvtph_ps(_mm_loadu_si128(wb.d[1].as_ptr() as *const __m128i)),
            ];
            for t in 0..T {
                let da = _mm256_set1_ps(lo[t].get_unchecked(b).d);
                for h in 0..2 {
                    let isum = _mm256_sub_epi32(
                        _mm256_add_epi32(_mm256_slli_epi32(hsum[t][h], LO_SHIFT), lsum[t][h]),
                        corr[h],
                    );
                    acc[t] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dw[h], da), acc[t]);
                }
            }
        }
    }
    let mut out = [[0f32; 8]; T];
    for t in 0..T {
        unsafe { _mm256_storeu_ps(out[t].as_mut_ptr(), acc[t]) };
    }
    out
}
safe_pair_entry!(
    dot8_q8_unsigned_vnni_p1,
    dot8_q8_pairs_unsigned_vnni,
    BlockQ8x8,
    1
);
safe_pair_entry!(
    dot8_q8_unsigned_vnni_p2,
    dot8_q8_pairs_unsigned_vnni,
    BlockQ8x8,
    2
);
safe_pair_entry!(
    dot8_q8_unsigned_vnni_p4,
    dot8_q8_pairs_unsigned_vnni,
    BlockQ8x8,
    4
);

/// Two eight-row groups side by side in one 512-bit register (group `g` in the low half, `g + 1`
/// in the high half) against the same activation broadcast: half the `vpdpbusd`s and broadcasts of
/// running the 256-bit kernel twice. Every lane does exactly the 256-bit kernel's operations in
/// the same order, so the results are bit-identical to it.
#[target_feature(enable = "avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c")]
unsafe fn dot16_q4_1_pairs_vnni<const T: usize>(
    w0: &[BlockQ4_1x8],
    w1: &[BlockQ4_1x8],
    hi: [&[BlockQ8Act]; T],
    lo: [&[BlockQ8Act]; T],
) -> [[f32; 16]; T] {
    let nb = hi[0].len();
    assert!(
        w0.len() >= nb && w1.len() >= nb && hi.iter().chain(&lo).all(|r| r.len() == nb),
        "weight and activation block counts"
    );
    let mask = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..nb {
        unsafe {
            let (wa, wb) = (w0.get_unchecked(b), w1.get_unchecked(b));
            let (qa, qb) = (
                wa.qs.as_ptr() as *const __m256i,
                wb.qs.as_ptr() as *const __m256i,
            );
            let mut hsum = [[_mm512_setzero_si512(); 2]; T];
            let mut lsum = [[_mm512_setzero_si512(); 2]; T];
            for j in 0..4 {
                let raw = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256(qa.add(j))),
                    _mm256_loadu_si256(qb.add(j)),
                    1,
                );
                let nib = [
                    _mm512_and_si512(raw, mask),
                    _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask),
                ];
                for t in 0..T {
                    let hp = hi[t].get_unchecked(b).qs.as_ptr() as *const i32;
                    let lp = lo[t].get_unchecked(b).qs.as_ptr() as *const i32;
                    for h in 0..2 {
                        let k = 2 * j + h;
                        hsum[t][h] = _mm512_dpbusd_epi32(
                            hsum[t][h],
                            nib[h],
                            _mm512_set1_epi32(hp.add(k).read_unaligned()),
                        );
                        lsum[t][h] = _mm512_dpbusd_epi32(
                            lsum[t][h],
                            nib[h],
                            _mm512_set1_epi32(lp.add(k).read_unaligned()),
                        );
                    }
                }
            }
            let halves = |a: &[u16; 8], b: &[u16; 8]| {
                _mm512_cvtph_ps(_mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128(a.as_ptr() as *const __m128i)),
                    _mm_loadu_si128(b.as_ptr() as *const __m128i),
                    1,
                ))
            };
            let (d, m) = (halves(&wa.d, &wb.d), halves(&wa.m, &wb.m));
            for t in 0..T {
                let (hb, lb) = (hi[t].get_unchecked(b), lo[t].get_unchecked(b));
                let isum = _mm512_add_epi32(
                    _mm512_slli_epi32(_mm512_add_epi32(hsum[t][0], hsum[t][1]), LO_SHIFT as u32),
                    _mm512_add_epi32(lsum[t][0], lsum[t][1]),
                );
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(lb.d));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[t]);
                acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(hb.s + lb.s), acc[t]);
            }
        }
    }
    let mut out = [[0f32; 16]; T];
    for t in 0..T {
        unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]) };
    }
    out
}

/// `dot8_q8_pairs_unsigned_vnni` for two groups side by side, as `dot16_q4_1_pairs_vnni`.
#[target_feature(enable = "avx512vnni,avx512vl,avx512bw,avx512f,avx2,fma,f16c")]
unsafe fn dot16_q8_pairs_unsigned_vnni<const T: usize>(
    w0: &[BlockQ8x8],
    w1: &[BlockQ8x8],
    hi: [&[BlockQ8Act]; T],
    lo: [&[BlockQ8Act]; T],
) -> [[f32; 16]; T] {
    let nb = hi[0].len();
    assert!(
        w0.len() >= nb && w1.len() >= nb && hi.iter().chain(&lo).all(|r| r.len() == nb),
        "weight and activation block counts"
    );
    let ones = _mm512_set1_epi8(1);
    let mut acc = [_mm512_setzero_ps(); T];
    for b in 0..nb {
        unsafe {
            let (wa, wb) = (w0.get_unchecked(b), w1.get_unchecked(b));
            let (qa, qb) = (
                wa.qs.as_ptr() as *const __m256i,
                wb.qs.as_ptr() as *const __m256i,
            );
            let mut wsum = [_mm512_setzero_si512(); 2];
            let mut hsum = [[_mm512_setzero_si512(); 2]; T];
            let mut lsum = [[_mm512_setzero_si512(); 2]; T];
            for k in 0..8 {
                let wv = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256(qa.add(k))),
                    _mm256_loadu_si256(qb.add(k)),
                    1,
                );
                wsum[k / 4] = _mm512_dpbusd_epi32(wsum[k / 4], ones, wv);
                for t in 0..T {
                    let hp = hi[t].get_unchecked(b).qu.as_ptr() as *const i32;
                    let lp = lo[t].get_unchecked(b).qu.as_ptr() as *const i32;
                    let hv = _mm512_set1_epi32(hp.add(k).read_unaligned());
                    let lv = _mm512_set1_epi32(lp.add(k).read_unaligned());
                    hsum[t][k / 4] = _mm512_dpbusd_epi32(hsum[t][k / 4], hv, wv);
                    lsum[t][k / 4] = _mm512_dpbusd_epi32(lsum[t][k / 4], lv, wv);
                }
            }
            let corr = wsum.map(|s| {
                _mm512_add_epi32(
                    _mm512_slli_epi32(s, 2 * LO_SHIFT as u32),
                    _mm512_slli_epi32(s, LO_SHIFT as u32),
                )
            });
            let dw = [0, 1].map(|h| {
                _mm512_cvtph_ps(_mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128(wa.d[h].as_ptr() as *const __m128i)),
                    _mm_loadu_si128(wb.d[h].as_ptr() as *const __m128i),
                    1,
                ))
            });
            for t in 0..T {
                let da = _mm512_set1_ps(lo[t].get_unchecked(b).d);
                for h in 0..2 {
                    let isum = _mm512_sub_epi32(
                        _mm512_add_epi32(
                            _mm512_slli_epi32(hsum[t][h], LO_SHIFT as u32),
                            lsum[t][h],
                        ),
                        corr[h],
                    );
                    acc[t] =
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw[h], da), acc[t]);
                }
            }
        }
    }
    let mut out = [[0f32; 16]; T];
    for t in 0..T {
        unsafe { _mm512_storeu_ps(out[t].as_mut_ptr(), acc[t]) };
    }
    out
}

macro_rules! safe_pair16_entry {
    ($name:ident, $inner:ident, $w:ty, $t:literal) => {
        pub fn $name(
            w0: &[$w],
            w1: &[$w],
            hi: [&[BlockQ8Act]; $t],
            lo: [&[BlockQ8Act]; $t],
        ) -> [[f32; 16]; $t] {
            unsafe { $inner::<$t>(w0, w1, hi, lo) }
        }
    };
}
safe_pair16_entry!(dot16_q4_1_vnni_p1, dot16_q4_1_pairs_vnni, BlockQ4_1x8, 1);
safe_pair16_entry!(dot16_q4_1_vnni_p2, dot16_q4_1_pairs_vnni, BlockQ4_1x8, 2);
safe_pair16_entry!(dot16_q4_1_vnni_p4, dot16_q4_1_pairs_vnni, BlockQ4_1x8, 4);
safe_pair16_entry!(
    dot16_q8_unsigned_vnni_p1,
    dot16_q8_pairs_unsigned_vnni,
    BlockQ8x8,
    1
);
safe_pair16_entry!(
    dot16_q8_unsigned_vnni_p2,
    dot16_q8_pairs_unsigned_vnni,
    BlockQ8x8,
    2
);
safe_pair16_entry!(
    dot16_q8_unsigned_vnni_p4,
    dot16_q8_pairs_unsigned_vnni,
    BlockQ8x8,
    4
);
