//! Causal attention over the paged KV cache. Each layer stores K and V rows in fixed-size blocks; a
//! sequence's block table maps its logical blocks to physical ones, so sequences of any length share one
//! pool without copying.

use super::CpuBuffer;
use super::simd::Kernels;
use super::team::Team;

thread_local! {
    /// Attention scores of the task this thread runs, reused across tasks.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}
use crate::backend::SeqSpan;

/// K and V of every layer: `[n_blocks * block_size, kv_width]` each.
pub struct CpuKvStore {
    pub block_size: usize,
    pub kv_width: usize,
    pub layers: Vec<(Vec<f32>, Vec<f32>)>,
}

impl CpuKvStore {
    pub fn new(n_layers: usize, n_blocks: usize, block_size: usize, kv_width: usize) -> CpuKvStore {
        let n = n_blocks * block_size * kv_width;
        CpuKvStore {
            block_size,
            kv_width,
            layers: (0..n_layers)
                .map(|_| (vec![0f32; n], vec![0f32; n]))
                .collect(),
        }
    }

    #[inline]
    fn slot(&self, table: &[u32], pos: usize) -> usize {
        table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

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
    for s in spans {
        for i in 0..s.n_tokens {
            let row = &qkv.data[(s.first_token + i) * qkv.cols..(s.first_token + i + 1) * qkv.cols];
            let slot = kv.slot(s.block_table, s.start_pos + i);
            let (kc, vc) = &mut kv.layers[layer];
            kc[slot * kv_width..(slot + 1) * kv_width]
                .copy_from_slice(&row[q_width..q_width + kv_width]);
            vc[slot * kv_width..(slot + 1) * kv_width]
                .copy_from_slice(&row[q_width + kv_width..q_width + 2 * kv_width]);
        }
    }
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
    let (kc, vc) = &kv.layers[layer];
    let out_ptr = OutPtr(out.data.as_mut_ptr());
    let use_avx2 = k.level >= super::SimdLevel::Avx2;
    team.run(n_tokens * n_kv_heads, &|task| {
        let op = out_ptr;
        let (t, kvh) = (task / n_kv_heads, task % n_kv_heads);
        let s = &spans[owner[t]];
        let job = Job {
            q: &qkv.data[t * qkv.cols + kvh * group * head_dim
                ..t * qkv.cols + (kvh + 1) * group * head_dim],
            kc,
            vc,
            kv,
            table: s.block_table,
            kv_width,
            kv_offset: kvh * head_dim,
            head_dim,
            group,
            n_ctx: s.start_pos + (t - s.first_token) + 1,
            scale,
        };
        // SAFETY: each task owns the disjoint `group * head_dim` outputs of (t, kvh).
        let o = unsafe {
            std::slice::from_raw_parts_mut(
                op.0.add(t * q_width + kvh * group * head_dim),
                group * head_dim,
            )
        };
        SCORES.with_borrow_mut(|scores| {
            #[cfg(target_arch = "x86_64")]
            if use_avx2 {
                // SAFETY: the kernel level was chosen from detected CPU features.
                unsafe { attend_avx2(&job, scores, o) };
                return;
            }
            let _ = use_avx2;
            attend(&job, scores, o);
        });
    });
}

/// One (token, KV head) of attention: `group` query heads over `n_ctx` cached positions.
struct Job<'a> {
    q: &'a [f32],
    kc: &'a [f32],
    vc: &'a [f32],
    kv: &'a CpuKvStore,
    table: &'a [u32],
    kv_width: usize,
    kv_offset: usize,
    head_dim: usize,
    group: usize,
    n_ctx: usize,
    scale: f32,
}

/// 16 independent lanes: the compiler turns this into SIMD without reassociating a reduction.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let n = a.len() / 16 * 16;
    for (ca, cb) in a[..n].chunks_exact(16).zip(b[..n].chunks_exact(16)) {
        for l in 0..16 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in n..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// The cache rows of positions `0..n_ctx`, block by block: `(first position, first row offset, rows)`.
/// Walking blocks keeps divisions out of the per-position loops.
#[inline(always)]
fn runs<'a>(j: &'a Job<'_>) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
    let bs = j.kv.block_size;
    j.table
        .iter()
        .enumerate()
        .map(move |(b, &phys)| (b * bs, phys as usize * bs))
        .take_while(move |&(first, _)| first < j.n_ctx)
        .map(move |(first, base)| (first, base, bs.min(j.n_ctx - first)))
}

// Plain loops, no closures: everything here inlines into `attend_avx2` and is compiled for its
// target features (a closure body would be a separate function compiled for the baseline).
#[inline(always)]
fn attend(j: &Job<'_>, scores: &mut Vec<f32>, out: &mut [f32]) {
    let (hd, n) = (j.head_dim, j.n_ctx);
    scores.clear();
    scores.resize(j.group * n, 0.0);
    for (first, base, len) in runs(j) {
        for i in 0..len {
            let off = (base + i) * j.kv_width + j.kv_offset;
            let kr = &j.kc[off..off + hd];
            for g in 0..j.group {
                scores[g * n + first + i] = dot(&j.q[g * hd..(g + 1) * hd], kr) * j.scale;
            }
        }
    }
    for g in 0..j.group {
        let sc = &mut scores[g * n..(g + 1) * n];
        let mut max = f32::NEG_INFINITY;
        for &v in sc.iter() {
            max = max.max(v);
        }
        let mut sum = 0f32;
        for v in sc.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        let inv = 1.0 / sum;
        for v in sc.iter_mut() {
            *v *= inv;
        }
    }
    out.fill(0.0);
    for (first, base, len) in runs(j) {
        for i in 0..len {
            let off = (base + i) * j.kv_width + j.kv_offset;
            let vr = &j.vc[off..off + hd];
            for g in 0..j.group {
                let w = scores[g * n + first + i];
                let o = &mut out[g * hd..(g + 1) * hd];
                for e in 0..hd {
                    o[e] += w * vr[e];
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_avx2(j: &Job<'_>, scores: &mut Vec<f32>, out: &mut [f32]) {
    attend(j, scores, out)
}
