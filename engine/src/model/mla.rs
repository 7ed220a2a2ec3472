//! Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2; transformers' `DeepseekV3Attention` is the
//! reference). Each token's keys and values are compressed into one latent of `kv_lora_rank`
//! values (after its RMSNorm) plus one rotary key of `qk_rope_head_dim` shared by all heads; the
//! paged KV cache holds exactly that row, `[k_pe | latent]`, as a single KV head.
//!
//! Attention runs in the absorbed form: the up-projection of the keys (`W_UK`, per head) is folded
//! into the query (`q_latent = W_UK^T q_nope`), so each head scores `[q_pe | q_latent]` against
//! the cached `[k_pe | latent]` rows directly, and the up-projection of the values (`W_UV`) is
//! applied after attention to each head's weighted latent. This is multi-query attention over
//! the compressed cache: the backend's `latent_attention` op computes it (tree masks, KV moves
//! and all; on the CPU through the paged attention op, on the GPU with a kernel for rows of
//! 512 + 64), with the queries pre-scaled to MLA's softmax scale. The model's store is
//! `KvLayout::KeysOnly`: the row is cached once and attention reads its latent part as the
//! value, (rope + rank) values per token per layer. The V part of `qkv` (`[0 | latent]`) is
//! still assembled, for a store of K and V rows (tests compare the two on the CPU).
//!
//! Every per-head step is one backend op over all heads (`matmul_heads`, `copy_head_columns`):
//! a loop of small ops per head would cost a device backend hundreds of launches per layer.

use super::config::MlaConfig;
use crate::backend::{Backend, HeadColumns, KvLayout, Precision, RopeSpec, SeqSpan};
use crate::error::{Error, Result};
use crate::weights::TensorView;

/// The query projection: one matrix, or DeepSeek-V3's low-rank pair with an RMSNorm between.
enum QueryProj<B: Backend> {
    Direct(B::Matrix),
    LowRank {
        a: B::Matrix,
        norm: B::Vector,
        b: B::Matrix,
    },
}

pub struct MlaWeights<B: Backend> {
    q: QueryProj<B>,
    /// `kv_a_proj_with_mqa`: `[latent (rank) | k_pe (rope)]` from the hidden state.
    kv_a: B::Matrix,
    kv_a_norm: B::Vector,
    /// The rank's query heads.
    n_heads: usize,
    /// Per local head, `W_UK^T` as a `[rank, nope]` matrix: `q_latent = q_nope W_UK`.
    uk: B::HeadMatrices,
    /// Per local head, `W_UV` as a `[v_head_dim, rank]` matrix.
    uv: B::HeadMatrices,
    /// `kv_b_proj` whole (the rank's heads): the explicit form decompresses keys and values.
    kv_b: B::Matrix,
    o: B::Matrix,
}

/// One MLA layer's activations, kept across layers and steps: a step allocates nothing once the
/// largest has run (what a recorded graph's replays need).
pub struct MlaScratch<B: Backend> {
    q: B::Buffer,
    qa: B::Buffer,
    qn: B::Buffer,
    ckv: B::Buffer,
    latent: B::Buffer,
    latent_normed: B::Buffer,
    qkv: B::Buffer,
    latents: B::Buffer,
    values: B::Buffer,
}

impl<B: Backend> MlaScratch<B> {
    pub fn new(backend: &B) -> Result<Self> {
        let empty = || backend.buffer(0, 0);
        Ok(MlaScratch {
            q: empty()?,
            qa: empty()?,
            qn: empty()?,
            ckv: empty()?,
            latent: empty()?,
            latent_normed: empty()?,
            qkv: empty()?,
            latents: empty()?,
            values: empty()?,
        })
    }
}

/// Which form a step's attention takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MlaForm {
    /// Explicit for steps whose sequences all start from an empty cache with more than one
    /// token and no tree (prefill), absorbed otherwise (decode, chunked prefill, verification).
    #[default]
    Auto,
    /// Absorbed for every step (tests compare the two forms with it).
    Absorbed,
}

/// Where the queries come from: `q_proj` (`[heads * qk_head_dim, hidden]`), or `q_a_proj`,
/// `q_a_layernorm` and `q_b_proj`.
pub enum QueryTensors {
    Direct(TensorView),
    LowRank(Box<[TensorView; 3]>),
}

/// Tensors of one MLA layer as the loader found them (already sliced to the rank's heads).
pub struct MlaTensors {
    pub q: QueryTensors,
    pub kv_a: TensorView,
    pub kv_a_norm: TensorView,
    /// `kv_b_proj` rows of the rank's heads: `[heads * (nope + v), rank]`.
    pub kv_b: TensorView,
    pub o: TensorView,
}

/// `kv_b_proj` (`[heads * (nope + v), rank]`) rebuilt from the two halves llama.cpp's converter
/// writes: `k_b` `[heads, rank, nope]` (each head's `W_UK` transposed) and `v_b`
/// `[heads, v, rank]`. Dequantized to f32: the loader derives the absorbed matrices from it anyway.
pub fn join_kv_b(k_b: &TensorView, v_b: &TensorView) -> Result<TensorView> {
    let (&[heads, rank, nope], &[v_heads, v, v_rank]) =
        (k_b.shape.as_slice(), v_b.shape.as_slice())
    else {
        return Err(Error::tensor(
            &k_b.path,
            &k_b.name,
            format!(
                "expected [heads, rank, nope] and [heads, v, rank], found {:?} and {:?}",
                k_b.shape, v_b.shape
            ),
        ));
    };
    if (v_heads, v_rank) != (heads, rank) {
        return Err(Error::tensor(
            &v_b.path,
            &v_b.name,
            format!("shape {:?} does not pair with {:?}", v_b.shape, k_b.shape),
        ));
    }
    let (k, vv) = (k_b.to_f32(), v_b.to_f32());
    let per_head = nope + v;
    let mut out = vec![0f32; heads * per_head * rank];
    for h in 0..heads {
        let head = &mut out[h * per_head * rank..(h + 1) * per_head * rank];
        for j in 0..rank {
            for i in 0..nope {
                head[i * rank + j] = k[(h * rank + j) * nope + i];
            }
        }
        head[nope * rank..].copy_from_slice(&vv[h * v * rank..(h + 1) * v * rank]);
    }
    let name = k_b.name.replace("attn_k_b", "attn_kv_b");
    TensorView::from_f32(name, k_b.path.clone(), vec![heads * per_head, rank], &out)
}

impl<B: Backend> MlaWeights<B> {
    pub fn load(
        backend: &B,
        m: &MlaConfig,
        t: MlaTensors,
        n_heads: usize,
        precision: Precision,
    ) -> Result<Self> {
        let q = match t.q {
            QueryTensors::LowRank(parts) => {
                let [a, norm, b] = *parts;
                QueryProj::LowRank {
                    a: backend.matrix(&[a], precision)?,
                    norm: backend.vector(&norm)?,
                    b: backend.matrix(&[b], precision)?,
                }
            }
            QueryTensors::Direct(w) => QueryProj::Direct(backend.matrix(&[w], precision)?),
        };
        let (r, nope, v) = (m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim);
        let per_head = nope + v;
        let (mut uk, mut uv) = (Vec::with_capacity(n_heads), Vec::with_capacity(n_heads));
        for h in 0..n_heads {
            // W_UK_h is rows [0, nope) of this head's block of kv_b, [nope, rank]; W_UV_h the
            // next v rows. Both stay in the checkpoint's type where that is lossless (bf16,
            // block FP8), so fast mode holds them at their stored size.
            let first = h * per_head;
            let mut uk_t = t.kv_b.slice(first..first + nope, 0..r)?.transposed()?;
            uk_t.name = format!("{}[head {h} W_UK^T]", t.kv_b.name);
            let mut uv_h = t.kv_b.slice(first + nope..first + per_head, 0..r)?;
            uv_h.name = format!("{}[head {h} W_UV]", t.kv_b.name);
            uk.push(uk_t);
            uv.push(uv_h);
        }
        Ok(MlaWeights {
            q,
            kv_a: backend.matrix(&[t.kv_a], precision)?,
            kv_a_norm: backend.vector(&t.kv_a_norm)?,
            n_heads,
            uk: backend.head_matrices(&uk, precision)?,
            uv: backend.head_matrices(&uv, precision)?,
            kv_b: backend.matrix(&[t.kv_b], precision)?,
            o: backend.matrix(&[t.o], precision)?,
        })
    }

    /// Attention of one layer: `h` is the normed hidden state `[n, hidden]`; `out` gets the output
    /// projection's (partial, under tensor parallelism) result `[n, hidden]`. `rope` rotates the
    /// leading `qk_rope_head_dim` of `qk_rope_head_dim + kv_lora_rank`-wide heads.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        backend: &B,
        m: &MlaConfig,
        eps: f32,
        rope: &RopeSpec,
        h: &B::Buffer,
        positions: &[usize],
        kv: &mut B::KvStore,
        layer: usize,
        spans: &[SeqSpan<'_>],
        meta: &B::StepMeta<'_>,
        form: MlaForm,
        scratch: &mut MlaScratch<B>,
        out: &mut B::Buffer,
    ) -> Result<()> {
        let n = positions.len();
        let n_heads = self.n_heads;
        let (r, p, nope, v) = (
            m.kv_lora_rank,
            m.qk_rope_head_dim,
            m.qk_nope_head_dim,
            m.v_head_dim,
        );
        let head = p + r;
        let q_head = nope + p;
        let MlaScratch {
            q,
            qa,
            qn,
            ckv,
            latent,
            latent_normed,
            qkv,
            latents,
            values,
        } = scratch;
        match &self.q {
            QueryProj::Direct(w) => backend.matmul(h, w, q)?,
            QueryProj::LowRank { a, norm, b } => {
                backend.matmul(h, a, qa)?;
                backend.rms_norm(qa, norm, eps, qn)?;
                backend.matmul(qn, b, q)?;
            }
        }
        backend.matmul(h, &self.kv_a, ckv)?;
        backend.reshape(latent, n, r)?;
        backend.copy_columns(ckv, 0, latent, 0, r)?;
        backend.rms_norm(latent, &self.kv_a_norm, eps, latent_normed)?;

        // [q heads of (pe | latent) | k = (pe | latent) | v = (0 | latent)]; the queries are
        // filled in only for the absorbed form, after the form is chosen.
        let q_width = n_heads * head;
        // (V's rotary columns are never written: zeros, as the buffer grew.)
        backend.reshape(qkv, n, q_width + 2 * head)?;
        backend.copy_columns(ckv, r, qkv, q_width, p)?;
        backend.copy_columns(latent_normed, 0, qkv, q_width + p, r)?;
        backend.copy_columns(latent_normed, 0, qkv, q_width + head + p, r)?;
        backend.rope(qkv, q_width, 1, meta, rope)?;
        let fresh = spans
            .iter()
            .all(|s| s.start_pos == 0 && s.tree.is_none() && s.n_tokens > 1);
        let explicit = form == MlaForm::Auto && fresh && v <= q_head;
        if explicit {
            backend.store_kv(qkv, kv, layer, meta, q_width)?;
            let values = self.explicit(
                backend,
                m,
                rope,
                q,
                latent_normed,
                qkv,
                q_width,
                positions,
                spans,
            )?;
            backend.matmul(&values, &self.o, out)?;
            return Ok(());
        }
        // Each query head's `[q_pe | W_UK^T q_nope]`, from `q`'s `[q_nope | q_pe]` heads.
        let q_heads = HeadColumns::new(0, q_head);
        let qkv_heads = HeadColumns::new(0, head);
        backend.copy_head_columns(
            q,
            HeadColumns::new(nope, q_head),
            qkv,
            qkv_heads,
            p,
            n_heads,
        )?;
        backend.matmul_heads(q, q_heads, &self.uk, qkv, HeadColumns::new(p, head))?;
        backend.rope(qkv, 0, n_heads, meta, rope)?;
        // The attention op scales by 1/sqrt(head width); MLA's scale is over the uncompressed
        // query width (and YaRN's mscale).
        backend.scale_columns(qkv, 0, q_width, m.softmax_scale * (head as f32).sqrt())?;
        backend.reshape(latents, n, n_heads * r)?;
        backend.latent_attention(qkv, kv, layer, meta, n_heads, head, p, latents)?;

        backend.reshape(values, n, n_heads * v)?;
        backend.matmul_heads(
            latents,
            HeadColumns::new(0, r),
            &self.uv,
            values,
            HeadColumns::new(0, v),
        )?;
        backend.matmul(values, &self.o, out)?;
        Ok(())
    }

    /// The explicit form: keys and values decompressed per head (`kv_b_proj` on the latents),
    /// ordinary multi-head attention over this step's own tokens (every span starts at position
    /// 0, so they are all it needs) in a scratch store. Heads are laid out `[pe | nope]` so the
    /// rope op rotates their leading dimensions, and V is zero-padded to the key width.
    #[allow(clippy::too_many_arguments)]
    fn explicit(
        &self,
        backend: &B,
        m: &MlaConfig,
        rope: &RopeSpec,
        q: &B::Buffer,
        latent_normed: &B::Buffer,
        absorbed: &B::Buffer,
        k_col: usize,
        positions: &[usize],
        spans: &[SeqSpan<'_>],
    ) -> Result<B::Buffer> {
        let n = positions.len();
        let n_heads = self.n_heads;
        let (p, nope, v) = (m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim);
        let qd = nope + p;
        let width = n_heads * qd;
        let mut kvd = backend.buffer(0, 0)?;
        backend.matmul(latent_normed, &self.kv_b, &mut kvd)?;
        let mut qkv = backend.buffer(n, 3 * width)?;
        let heads = |first| HeadColumns::new(first, qd);
        let decompressed = |first| HeadColumns::new(first, nope + v);
        backend.copy_head_columns(q, heads(nope), &mut qkv, heads(0), p, n_heads)?;
        backend.copy_head_columns(q, heads(0), &mut qkv, heads(p), nope, n_heads)?;
        // The rotary key, already rotated in the absorbed layout's K, shared by every head.
        let shared_key = HeadColumns::new(k_col, 0);
        backend.copy_head_columns(absorbed, shared_key, &mut qkv, heads(width), p, n_heads)?;
        let k_nope = heads(width + p);
        backend.copy_head_columns(&kvd, decompressed(0), &mut qkv, k_nope, nope, n_heads)?;
        let values_at = heads(2 * width);
        backend.copy_head_columns(&kvd, decompressed(nope), &mut qkv, values_at, v, n_heads)?;
        let spec = RopeSpec {
            head_dim: qd,
            ..rope.clone()
        };
        const BLOCK: usize = 16;
        let tables: Vec<Vec<u32>> = spans
            .iter()
            .scan(0u32, |next, s| {
                let blocks = s.n_tokens.div_ceil(BLOCK) as u32;
                let t = (*next..*next + blocks).collect();
                *next += blocks;
                Some(t)
            })
            .collect();
        let total: usize = tables.iter().map(|t| t.len()).sum();
        // f32 whatever the mode: a per-step scratch for the decompressed keys and values.
        let mut scratch = backend.kv_store(
            1,
            total,
            BLOCK,
            width,
            KvLayout::KeysAndValues,
            Precision::Exact,
        )?;
        let local: Vec<SeqSpan<'_>> = spans
            .iter()
            .zip(&tables)
            .map(|(s, t)| SeqSpan {
                block_table: t,
                ..s.clone()
            })
            .collect();
        // The scratch store's own layout, for this layer's rope and attention.
        let scratch_meta = backend.step_meta(positions, &local)?;
        backend.rope(&mut qkv, 0, n_heads, &scratch_meta, &spec)?;
        backend.scale_columns(&mut qkv, 0, width, m.softmax_scale * (qd as f32).sqrt())?;
        let mut attn = backend.buffer(0, 0)?;
        backend.attention(
            &qkv,
            &mut scratch,
            0,
            &scratch_meta,
            n_heads,
            n_heads,
            qd,
            &mut attn,
        )?;
        let mut values = backend.buffer(n, n_heads * v)?;
        let packed = HeadColumns::new(0, v);
        backend.copy_head_columns(&attn, heads(0), &mut values, packed, v, n_heads)?;
        Ok(values)
    }
}
