//! Causal attention over the paged KV cache. Each layer stores K and V rows in fixed-size blocks; a
//! sequence's block table maps its logical blocks to physical ones, so sequences of any length share one
//! pool without copying.

use super::blocks::{f16_to_f32, f32_to_f16};
use super::simd::Kernels;
use super::team::Team;
use super::{CpuBuffer, OutPtr};

thread_local! {
    /// Attention scores of the task this thread runs, reused across tasks.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// For the generic kernels over an f16 cache: the task's KV head's cells of its sequence's
    /// blocks widened to f32 (K, V) and the identity block table over them.
    static WIDE: std::cell::RefCell<(Vec<f32>, Vec<f32>, Vec<u32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}
use crate::backend::{KvLayout, SeqSpan};

/// One layer's K or V cells: f32, or f16 (IEEE half) in fast mode on CPUs with the AVX-512
/// kernel, which halves the bytes attention streams at high concurrency.
pub enum KvCells {
    F32(Vec<f32>),
    F16(Vec<u16>),
}

impl KvCells {
    fn zeros(n: usize, half: bool) -> KvCells {
        if half {
            KvCells::F16(vec![0; n])
        } else {
            KvCells::F32(vec![0.0; n])
        }
    }

    fn bytes(&self) -> usize {
        match self {
            KvCells::F32(c) => 4 * c.len(),
            KvCells::F16(c) => 2 * c.len(),
        }
    }

    #[inline]
    fn set(&mut self, i: usize, v: f32) {
        match self {
            KvCells::F32(c) => c[i] = v,
            KvCells::F16(c) => c[i] = f32_to_f16(v),
        }
    }

    fn copy_cell(&mut self, from: usize, to: usize) {
        match self {
            KvCells::F32(c) => c[to] = c[from],
            KvCells::F16(c) => c[to] = c[from],
        }
    }

    fn copy_within(&mut self, src: std::ops::Range<usize>, dst: usize) {
        match self {
            KvCells::F32(c) => c.copy_within(src, dst),
            KvCells::F16(c) => c.copy_within(src, dst),
        }
    }

    /// Cells `range` as f32, appended to `out`.
    fn widen_into(&self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        match self {
            KvCells::F32(c) => out.extend_from_slice(&c[range]),
            KvCells::F16(c) => out.extend(c[range].iter().map(|&h| f16_to_f32(h))),
        }
    }
}

/// K and V of every layer. V is `[n_blocks * block_size, kv_width]`, one row per cached position. K is
/// transposed inside each block, `[n_blocks][kv_head][head_dim][block_size]`, so the scores of
/// consecutive positions come out of one SIMD multiply-add per dimension, with no horizontal sums.
pub struct CpuKvStore {
    pub block_size: usize,
    pub kv_width: usize,
    /// `KvLayout::KeysOnly`: the V cells are empty and attention reads values from K.
    pub keys_only: bool,
    pub layers: Vec<(KvCells, KvCells)>,
}

impl CpuKvStore {
    /// `half`: store f16 cells (see [`KvCells`]).
    pub fn new(
        n_layers: usize,
        n_blocks: usize,
        block_size: usize,
        kv_width: usize,
        layout: KvLayout,
        half: bool,
    ) -> CpuKvStore {
        let n = n_blocks * block_size * kv_width;
        let keys_only = layout == KvLayout::KeysOnly;
        let v_cells = if keys_only { 0 } else { n };
        CpuKvStore {
            block_size,
            kv_width,
            keys_only,
            layers: (0..n_layers)
                .map(|_| (KvCells::zeros(n, half), KvCells::zeros(v_cells, half)))
                .collect(),
        }
    }

    /// Bytes of cells held (K and V of every layer).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|(k, v)| k.bytes() + v.bytes()).sum()
    }

    /// Writes position `pos`'s K row (`[kv_head][head_dim]`) and V row into their slots.
    fn store(&mut self, layer: usize, table: &[u32], pos: usize, k: &[f32], v: &[f32]) {
        let (bs, w) = (self.block_size, self.kv_width);
        let (phys, i) = (table[pos / bs] as usize, pos % bs);
        let (kc, vc) = &mut self.layers[layer];
        let v0 = (phys * bs + i) * w;
        if !self.keys_only {
            for (c, &x) in v.iter().enumerate() {
                vc.set(v0 + c, x);
            }
        }
        let k0 = phys * bs * w;
        for (c, &x) in k.iter().enumerate() {
            kc.set(k0 + c * bs + i, x);
        }
    }

    /// For each `(from, to)` in order, every layer's position `to` gets position `from`'s K and V.
    pub fn move_positions(&mut self, table: &[u32], moves: &[(usize, usize)]) {
        let (bs, w) = (self.block_size, self.kv_width);
        let slot = |pos: usize| (table[pos / bs] as usize, pos % bs);
        for &(from, to) in moves.iter().filter(|(f, t)| f != t) {
            let ((pf, i_f), (pt, i_t)) = (slot(from), slot(to));
            for (kc, vc) in self.layers.iter_mut() {
                if !self.keys_only {
                    vc.copy_within(
                        (pf * bs + i_f) * w..(pf * bs + i_f + 1) * w,
                        (pt * bs + i_t) * w,
                    );
                }
                for c in 0..w {
                    kc.copy_cell(pf * bs * w + c * bs + i_f, pt * bs * w + c * bs + i_t);
                }
            }
        }
    }
}

/// Writes the K and V rows of every span's tokens (`[q (q_width) | k | v]` rows) to the cache.
pub fn store_kv(
    qkv: &CpuBuffer,
    kv: &mut CpuKvStore,
    layer: usize,
    spans: &[SeqSpan<'_>],
    q_width: usize,
) {
    let kv_width = kv.kv_width;
    for s in spans {
        for i in 0..s.n_tokens {
            let row = &qkv.data[(s.first_token + i) * qkv.cols..(s.first_token + i + 1) * qkv.cols];
            // Keys only: rows may end after K.
            let v = if kv.keys_only {
                &[][..]
            } else {
                &row[q_width + kv_width..q_width + 2 * kv_width]
            };
            kv.store(
                layer,
                s.block_table,
                s.start_pos + i,
                &row[q_width..q_width + kv_width],
                v,
            );
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub fn attention(
    k: &Kernels,
    team: &Team,
    qkv: &CpuBuffer,
    kv: &mut CpuKvStore,
    layer: usize,
    spans: &[SeqSpan<'_>],
    n_heads: usize,
    n_kv_heads: usize,
    head_dim: usize,
    out: &mut CpuBuffer,
) {
    let q_width = n_heads * head_dim;
    let kv_width = n_kv_heads * head_dim;
    debug_assert_eq!(kv.kv_width, kv_width);
    // 1. Store this step's K and V rows.
    store_kv(qkv, kv, layer, spans, q_width);
    // 2. One task per (token, KV head): the query heads sharing a KV head read each K/V row once.
    let n_tokens = qkv.rows;
    out.resize(n_tokens, q_width);
    let mut owner = vec![0usize; n_tokens];
    for (si, s) in spans.iter().enumerate() {
        owner[s.first_token..s.first_token + s.n_tokens].fill(si);
    }
    let group = n_heads / n_kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let kv = &*kv;
    let (kcells, vcells) = &kv.layers[layer];
    let out_ptr = OutPtr(out.data.as_mut_ptr());
    let use_avx2 = k.level >= super::SimdLevel::Avx2;
    let use_avx512 = k.level >= super::SimdLevel::Avx512Vnni;
    team.run(n_tokens * n_kv_heads, &|task| {
        let op = out_ptr;
        let (t, kvh) = (task / n_kv_heads, task % n_kv_heads);
        let s = &spans[owner[t]];
        // Cells `$kc` / `$vc` with rows `$width` wide, this KV head's at `$offset`.
        macro_rules! job {
            ($kc:expr, $vc:expr, $table:expr, $width:expr, $offset:expr) => {
                Job {
                    q: &qkv.data[t * qkv.cols + kvh * group * head_dim
                        ..t * qkv.cols + (kvh + 1) * group * head_dim],
                    kc: $kc,
                    vc: $vc,
                    kv,
                    table: $table,
                    kv_width: $width,
                    kv_offset: $offset,
                    head_dim,
                    group,
                    n_ctx: s.start_pos + (t - s.first_token) + 1,
                    scale,
                    mask: s.tree.map(|m| (m.base, m.rows[t - s.first_token])),
                    values_in_keys: kv.keys_only,
                }
            };
        }
        // SAFETY: each task owns the disjoint `group * head_dim` outputs of (t, kvh).
        let o = unsafe {
            std::slice::from_raw_parts_mut(
                op.0.add(t * q_width + kvh * group * head_dim),
                group * head_dim,
            )
        };
        SCORES.with_borrow_mut(|scores| match (kcells, vcells) {
            (KvCells::F32(kc), KvCells::F32(vc)) => {
                let j = job!(kc, vc, s.block_table, kv_width, kvh * head_dim);
                #[cfg(target_arch = "x86_64")]
                if use_avx512 && !kv.keys_only {
                    let cells = super::attention_x86::Cells::F32(kc, vc);
                    // SAFETY: this level implies AVX-512 F.
                    if unsafe { super::attention_x86::attend_hd64(&j, cells, scores, o) } {
                        return;
                    }
                }
                attend_any(&j, use_avx2, use_avx512, scores, o);
            }
            (KvCells::F16(kc), KvCells::F16(vc)) => {
                #[cfg(target_arch = "x86_64")]
                if use_avx512 && !kv.keys_only {
                    let j = job!(&[], &[], s.block_table, kv_width, kvh * head_dim);
                    let cells = super::attention_x86::Cells::F16(kc, vc);
                    // SAFETY: this level implies AVX-512 F.
                    if unsafe { super::attention_x86::attend_hd64(&j, cells, scores, o) } {
                        return;
                    }
                }
                // The generic kernels read f32: widen this KV head's part of the sequence's
                // blocks into a store one head wide (K transposed per block as in the cache).
                WIDE.with_borrow_mut(|(wk, wv, table)| {
                    let bs = kv.block_size;
                    let n_ctx = s.start_pos + (t - s.first_token) + 1;
                    wk.clear();
                    wv.clear();
                    table.clear();
                    for (b, &phys) in s.block_table[..n_ctx.div_ceil(bs)].iter().enumerate() {
                        let block = phys as usize * bs * kv_width;
                        let k0 = block + kvh * head_dim * bs;
                        kcells.widen_into(k0..k0 + head_dim * bs, wk);
                        for i in (0..bs).filter(|_| !kv.keys_only) {
                            let v0 = block + i * kv_width + kvh * head_dim;
                            vcells.widen_into(v0..v0 + head_dim, wv);
                        }
                        table.push(b as u32);
                    }
                    let j = job!(wk, wv, table, head_dim, 0);
                    attend_any(&j, use_avx2, use_avx512, scores, o);
                });
            }
            _ => unreachable!("K and V cells share one type"),
        });
    });
}

/// The generic loops, compiled for the best level the CPU has.
fn attend_any(j: &Job<'_>, use_avx2: bool, use_avx512: bool, scores: &mut Vec<f32>, o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if use_avx512 {
        // SAFETY: the kernel level was chosen from detected CPU features.
        unsafe { attend_avx512(j, scores, o) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if use_avx2 {
        // SAFETY: as above.
        unsafe { attend_avx2(j, scores, o) };
        return;
    }
    let _ = (use_avx2, use_avx512);
    attend(j, scores, o);
}

/// One (token, KV head) of attention: `group` query heads over `n_ctx` cached positions.
pub(super) struct Job<'a> {
    pub q: &'a [f32],
    pub kc: &'a [f32],
    pub vc: &'a [f32],
    pub kv: &'a CpuKvStore,
    pub table: &'a [u32],
    pub kv_width: usize,
    pub kv_offset: usize,
    pub head_dim: usize,
    pub group: usize,
    pub n_ctx: usize,
    pub scale: f32,
    /// Tree speculation: `(base, bits)` — position `base + j` is visible only if bit `j` is set.
    pub mask: Option<(usize, u64)>,
    /// `KvLayout::KeysOnly`: the values are the K cells (`vc` is empty).
    pub values_in_keys: bool,
}

/// The cache rows of positions `0..n_ctx`, block by block: `(first position, physical block, rows)`.
/// Walking blocks keeps divisions out of the per-position loops.
#[inline(always)]
pub(super) fn runs<'a>(j: &'a Job<'_>) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
    let bs = j.kv.block_size;
    j.table
        .iter()
        .enumerate()
        .map(move |(b, &phys)| (b * bs, phys as usize))
        .take_while(move |&(first, _)| first < j.n_ctx)
        .map(move |(first, phys)| (first, phys, bs.min(j.n_ctx - first)))
}

/// Softmax of each of `rows` rows of `n` scores, in place.
#[inline(always)]
pub(super) fn softmax_rows(scores: &mut [f32], rows: usize, n: usize) {
    for g in 0..rows {
        let sc = &mut scores[g * n..(g + 1) * n];
        let mut max = f32::NEG_INFINITY;
        for &v in sc.iter() {
            max = max.max(v);
        }
        let mut sum = 0f32;
        for v in sc.iter_mut() {
            *v = super::exp::exp(*v - max);
            sum += *v;
        }
        let inv = 1.0 / sum;
        for v in sc.iter_mut() {
            *v *= inv;
        }
    }
}

/// Positions per score lane group and dimensions per output lane group: two 256-bit registers.
const LANES: usize = 16;
/// Independent accumulators per lane group, so the multiply-adds do not wait on each other.
const SPLIT: usize = 4;

// Plain loops over fixed-size arrays, no closures: everything here inlines into `attend_avx2` and
// is compiled for its target features (a closure body would be compiled for the baseline).
// Index loops over fixed-size arrays are what vectorizes here.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn attend(j: &Job<'_>, scores: &mut Vec<f32>, out: &mut [f32]) {
    let (hd, n, bs) = (j.head_dim, j.n_ctx, j.kv.block_size);
    scores.clear();
    scores.resize(j.group * n, 0.0);
    // Scores: K is transposed per block, so LANES positions accumulate side by side. A block's
    // unused tail slots hold stale (finite) values; their lanes are computed and dropped.
    let lanes_fit = bs.is_multiple_of(LANES) && hd.is_multiple_of(SPLIT);
    for (first, phys, len) in runs(j) {
        let kt = &j.kc[(phys * j.kv_width + j.kv_offset) * bs..][..hd * bs];
        for g in 0..j.group {
            let q = &j.q[g * hd..(g + 1) * hd];
            let sc = &mut scores[g * n + first..g * n + first + len];
            let mut c0 = 0;
            while lanes_fit && c0 < len {
                let mut acc = [[0f32; LANES]; SPLIT];
                for e0 in (0..hd).step_by(SPLIT) {
                    for (u, a) in acc.iter_mut().enumerate() {
                        let qe = q[e0 + u];
                        let kr: &[f32; LANES] = kt[(e0 + u) * bs + c0..][..LANES]
                            .try_into()
                            .expect("LANES-wide slice");
                        for l in 0..LANES {
                            a[l] += qe * kr[l];
                        }
                    }
                }
                let take = LANES.min(len - c0);
                for l in 0..take {
                    sc[c0 + l] = (acc[0][l] + acc[1][l] + acc[2][l] + acc[3][l]) * j.scale;
                }
                c0 += LANES;
            }
            for (i, s) in sc.iter_mut().enumerate().skip(c0) {
                let mut acc = 0f32;
                for (e, &qe) in q.iter().enumerate() {
                    acc += qe * kt[e * bs + i];
                }
                *s = acc * j.scale;
            }
        }
    }
    if let Some((base, bits)) = j.mask {
        for p in base..n {
            if bits.checked_shr((p - base) as u32).unwrap_or(0) & 1 == 0 {
                for g in 0..j.group {
                    scores[g * n + p] = f32::NEG_INFINITY;
                }
            }
        }
    }
    softmax_rows(scores, j.group, n);
    if j.values_in_keys {
        weigh_keys(j, scores, out);
        return;
    }
    // Weighted V rows: 2 * LANES output dimensions stay in registers while the positions stream
    // by, even and odd positions in separate accumulators.
    const WIDE: usize = 2 * LANES;
    for g in 0..j.group {
        let sc = &scores[g * n..(g + 1) * n];
        let o = &mut out[g * hd..(g + 1) * hd];
        let mut d0 = 0;
        while d0 + WIDE <= hd {
            let mut acc = [[0f32; WIDE]; 2];
            for (first, phys, len) in runs(j) {
                let row = |i: usize| -> &[f32; WIDE] {
                    let off = (phys * bs + i) * j.kv_width + j.kv_offset + d0;
                    j.vc[off..off + WIDE].try_into().expect("WIDE slice")
                };
                let mut i = 0;
                while i + 2 <= len {
                    let (w0, w1) = (sc[first + i], sc[first + i + 1]);
                    let (v0, v1) = (row(i), row(i + 1));
                    for l in 0..WIDE {
                        acc[0][l] += w0 * v0[l];
                        acc[1][l] += w1 * v1[l];
                    }
                    i += 2;
                }
                if i < len {
                    let (w0, v0) = (sc[first + i], row(i));
                    for l in 0..WIDE {
                        acc[0][l] += w0 * v0[l];
                    }
                }
            }
            for l in 0..WIDE {
                o[d0 + l] = acc[0][l] + acc[1][l];
            }
            d0 += WIDE;
        }
        // Dimensions past the last full WIDE group (head sizes not a multiple of 32).
        for d in d0..hd {
            let mut acc = 0f32;
            for (first, phys, len) in runs(j) {
                for i in 0..len {
                    acc += sc[first + i] * j.vc[(phys * bs + i) * j.kv_width + j.kv_offset + d];
                }
            }
            o[d] = acc;
        }
    }
}

/// The output when the values are the keys (MLA's latent cached once): K is transposed per block,
/// so each output dimension is a dot product of the weights with one contiguous run of K cells.
#[allow(clippy::needless_range_loop)]
#[inline(always)]
fn weigh_keys(j: &Job<'_>, scores: &[f32], out: &mut [f32]) {
    let (hd, n, bs) = (j.head_dim, j.n_ctx, j.kv.block_size);
    for g in 0..j.group {
        let sc = &scores[g * n..(g + 1) * n];
        let o = &mut out[g * hd..(g + 1) * hd];
        o.fill(0.0);
        for (first, phys, len) in runs(j) {
            let kt = &j.kc[(phys * j.kv_width + j.kv_offset) * bs..][..hd * bs];
            let w = &sc[first..first + len];
            for (d, od) in o.iter_mut().enumerate() {
                let k = &kt[d * bs..d * bs + len];
                // Lane-wise partial sums, so the loop vectorizes.
                let mut acc = [0f32; LANES];
                let (wc, kc) = (w.chunks_exact(LANES), k.chunks_exact(LANES));
                let (wr, kr) = (wc.remainder(), kc.remainder());
                for (wl, kl) in wc.zip(kc) {
                    for l in 0..LANES {
                        acc[l] += wl[l] * kl[l];
                    }
                }
                let mut sum: f32 = acc.iter().sum();
                for (a, b) in wr.iter().zip(kr) {
                    sum += a * b;
                }
                *od += sum;
            }
        }
    }
}

/// The same loops with AVX-512's 32 vector registers: the accumulators no longer spill.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn attend_avx512(j: &Job<'_>, scores: &mut Vec<f32>, out: &mut [f32]) {
    attend(j, scores, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(j: &Job<'_>, scores: &mut Vec<f32>, out: &mut [f32]) {
    attend(j, scores, out)
}
