//! Causal attention over the paged KV cache. Each layer stores K and V rows in fixed-size blocks; a
//! sequence's block table maps its logical blocks to physical ones, so sequences of any length share one
//! pool without copying.

use rayon::prelude::*;

use super::CpuBuffer;
use super::simd::Kernels;
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
    // 2. One task per (token, head).
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
    (0..n_tokens * n_heads).into_par_iter().for_each_init(
        Vec::new,
        |scores: &mut Vec<f32>, task| {
            let op = out_ptr;
            let (t, h) = (task / n_heads, task % n_heads);
            let s = &spans[owner[t]];
            let pos = s.start_pos + (t - s.first_token);
            let q = &qkv.data[t * qkv.cols + h * head_dim..t * qkv.cols + (h + 1) * head_dim];
            let kvh = h / group;
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for j in 0..=pos {
                let slot = kv.slot(s.block_table, j);
                let kr =
                    &kc[slot * kv_width + kvh * head_dim..slot * kv_width + (kvh + 1) * head_dim];
                let v = (k.dot_f32)(q, kr) * scale;
                max = max.max(v);
                scores.push(v);
            }
            let mut sum = 0f32;
            for v in scores.iter_mut() {
                *v = (*v - max).exp();
                sum += *v;
            }
            let inv = 1.0 / sum;
            // SAFETY: each task owns the disjoint `head_dim` values of (t, h).
            let o = unsafe {
                std::slice::from_raw_parts_mut(op.0.add(t * q_width + h * head_dim), head_dim)
            };
            o.fill(0.0);
            for (j, p) in scores.iter().enumerate() {
                let slot = kv.slot(s.block_table, j);
                let vr =
                    &vc[slot * kv_width + kvh * head_dim..slot * kv_width + (kvh + 1) * head_dim];
                let w = p * inv;
                for (oi, vi) in o.iter_mut().zip(vr) {
                    *oi += w * vi;
                }
            }
        },
    );
}
