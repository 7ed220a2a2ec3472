//! Attention for 64-wide heads with AVX-512, one (token, KV head) job at a time: the scores of 16
//! cached positions per register from the per-block transposed K, and the weighted V sum with every
//! query head's 64 outputs held in registers (four per head) while the positions stream by. The
//! generic loops in `attention.rs` spill at this size; these do not.

use std::arch::x86_64::*;

use super::attention::{Job, runs, softmax_rows};

/// The layer's K and V cells as the kernel reads them.
#[derive(Clone, Copy)]
pub enum Cells<'a> {
    F32(&'a [f32], &'a [f32]),
    /// IEEE half cells, widened by `vcvtph2ps` as they load.
    F16(&'a [u16], &'a [u16]),
}

/// Handles the job when its shape fits (head_dim 64, 1..=4 query heads per KV head, blocks of a
/// multiple of 16 positions), tree mask or not; `false` leaves it to the generic loops. `cells`
/// replaces the job's `kc` / `vc`. Plain decoding, chain verification and tree verification all
/// run this one kernel, so speculative greedy output equals plain greedy output bit for bit.
///
/// # Safety
/// The CPU must have AVX-512 F.
pub unsafe fn attend_hd64(
    j: &Job<'_>,
    cells: Cells<'_>,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) -> bool {
    if j.head_dim != 64 || !j.kv.block_size.is_multiple_of(16) || !(1..=4).contains(&j.group) {
        return false;
    }
    macro_rules! go {
        ($half:literal, $k:expr, $v:expr) => {{
            let (k, v) = ($k, $v);
            let (kp, vp) = (k.as_ptr() as *const u8, v.as_ptr() as *const u8);
            let lens = (k.len(), v.len());
            unsafe {
                match j.group {
                    1 => attend::<1, $half>(j, kp, vp, lens, scores, out),
                    2 => attend::<2, $half>(j, kp, vp, lens, scores, out),
                    3 => attend::<3, $half>(j, kp, vp, lens, scores, out),
                    _ => attend::<4, $half>(j, kp, vp, lens, scores, out),
                }
            }
        }};
    }
    match cells {
        Cells::F32(k, v) => go!(false, k, v),
        Cells::F16(k, v) => go!(true, k, v),
    }
    true
}

/// `kc` / `vc`: the cells (f32, or f16 when `HALF`) with their lengths in cells.
#[target_feature(enable = "avx512f")]
unsafe fn attend<const G: usize, const HALF: bool>(
    j: &Job<'_>,
    kc: *const u8,
    vc: *const u8,
    (kc_len, vc_len): (usize, usize),
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    const HD: usize = 64;
    // Sixteen cells from cell index `i` as f32.
    macro_rules! load16 {
        ($p:expr, $i:expr) => {
            if HALF {
                _mm512_cvtph_ps(_mm256_loadu_si256(
                    ($p as *const u16).add($i) as *const __m256i
                ))
            } else {
                _mm512_loadu_ps(($p as *const f32).add($i))
            }
        };
    }
    let (n, bs) = (j.n_ctx, j.kv.block_size);
    scores.clear();
    scores.resize(G * n, 0.0);
    assert!(j.q.len() >= G * HD && out.len() >= G * HD, "job buffers");
    let qp = j.q.as_ptr();
    for (first, phys, len) in runs(j) {
        let base = (phys * j.kv_width + j.kv_offset) * bs;
        assert!(base + HD * bs <= kc_len, "K block inside the cache");
        let mut c0 = 0;
        while c0 < len {
            unsafe {
                // Two accumulators per head (even and odd dimensions) halve the dependency chains.
                let mut acc = [[_mm512_setzero_ps(); 2]; G];
                for e in (0..HD).step_by(2) {
                    let k0 = load16!(kc, base + e * bs + c0);
                    let k1 = load16!(kc, base + (e + 1) * bs + c0);
                    for (g, a) in acc.iter_mut().enumerate() {
                        a[0] = _mm512_fmadd_ps(_mm512_set1_ps(*qp.add(g * HD + e)), k0, a[0]);
                        a[1] = _mm512_fmadd_ps(_mm512_set1_ps(*qp.add(g * HD + e + 1)), k1, a[1]);
                    }
                }
                // Lanes past the sequence's last position hold stale cache slots: not stored.
                let take = 16.min(len - c0);
                let mask: __mmask16 = if take == 16 {
                    0xffff
                } else {
                    (1u16 << take) - 1
                };
                let scale = _mm512_set1_ps(j.scale);
                for (g, a) in acc.iter().enumerate() {
                    let s = _mm512_mul_ps(_mm512_add_ps(a[0], a[1]), scale);
                    let dst = scores.as_mut_ptr().add(g * n + first + c0);
                    _mm512_mask_storeu_ps(dst, mask, s);
                }
            }
            c0 += 16;
        }
    }
    // Tree verification: invisible positions drop out exactly (exp(-inf) = 0 adds nothing), so a
    // tree token's attention equals what plain decoding of the same path computes here.
    if let Some((base, bits)) = j.mask {
        for p in base..n {
            if bits.checked_shr((p - base) as u32).unwrap_or(0) & 1 == 0 {
                for g in 0..G {
                    scores[g * n + p] = f32::NEG_INFINITY;
                }
            }
        }
    }
    softmax_rows(scores, G, n);
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); 4]; G];
        let sp = scores.as_ptr();
        for (first, phys, len) in runs(j) {
            let row0 = (phys * bs) * j.kv_width + j.kv_offset;
            assert!(
                row0 + (len - 1) * j.kv_width + HD <= vc_len,
                "V rows inside the cache"
            );
            for i in 0..len {
                let r = row0 + i * j.kv_width;
                let v = [
                    load16!(vc, r),
                    load16!(vc, r + 16),
                    load16!(vc, r + 32),
                    load16!(vc, r + 48),
                ];
                for (g, a) in acc.iter_mut().enumerate() {
                    let w = _mm512_set1_ps(*sp.add(g * n + first + i));
                    for d in 0..4 {
                        a[d] = _mm512_fmadd_ps(w, v[d], a[d]);
                    }
                }
            }
        }
        for (g, a) in acc.iter().enumerate() {
            for (d, v) in a.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add(g * HD + 16 * d), *v);
            }
        }
    }
}
