//! The op trait every compute backend implements. It is deliberately narrow — the handful of ops a
//! Llama-family forward needs — so a CUDA backend can implement the same set with fused kernels, and the
//! model code in `model::llama` stays backend-agnostic.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod routing;

use crate::error::Result;
use crate::sampling::{RowDraw, RowResult};
use crate::weights::TensorView;
pub use routing::{ExpertTensors, RouteSpec};

/// How weights are stored and multiplied.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Weights dequantized to f32, f32 arithmetic throughout: the reference-matching mode.
    Exact,
    /// Weights stay quantized, activations are quantized per 32-value block to two 8-bit levels (the
    /// value and its residual) for integer dot products: llama.cpp's scheme plus a second level.
    #[default]
    Fast,
}

/// What a KV store keeps per cached position.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvLayout {
    /// A K row and a V row (ordinary attention).
    #[default]
    KeysAndValues,
    /// One row, read as both K and V: MLA's `[k_pe | latent]`, whose values are its latent
    /// columns. Half the cells of a separate V; the attention output's columns under `k_pe` are
    /// then weighted rotary keys, which MLA never reads. The V part of `qkv` is not stored.
    KeysOnly,
}

/// Where each head's columns sit in a buffer's rows: head `i` starts at column
/// `first + i * stride`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadColumns {
    pub first: usize,
    pub stride: usize,
}

impl HeadColumns {
    pub fn new(first: usize, stride: usize) -> HeadColumns {
        HeadColumns { first, stride }
    }

    /// Head `i`'s first column.
    pub fn of(self, i: usize) -> usize {
        self.first + i * self.stride
    }
}

impl KvLayout {
    /// Rows of cells one cached position takes.
    pub fn rows_per_position(self) -> usize {
        match self {
            KvLayout::KeysAndValues => 2,
            KvLayout::KeysOnly => 1,
        }
    }
}

/// One sequence's slice of a batch, as the attention op sees it.
#[derive(Clone, Debug)]
pub struct SeqSpan<'a> {
    /// Index of this sequence's first token in the batch's flat token list.
    pub first_token: usize,
    pub n_tokens: usize,
    /// Tokens already in the KV cache before this step (the position of the first new token).
    pub start_pos: usize,
    /// Physical KV block of each logical block of this sequence.
    pub block_table: &'a [u32],
    /// Tree speculation: which of the positions from `tree.base` on each new token sees. `None`:
    /// causal (every earlier position).
    pub tree: Option<TreeMask<'a>>,
}

/// The attention mask of an EAGLE token tree (draft or verification): positions before `base`
/// (the accepted prefix) are visible to every new token; position `base + j` is visible to new
/// token `i` only when bit `j` of `rows[i]` is set (its ancestors and itself). At most 64
/// positions from `base` to the span's last new token.
#[derive(Clone, Copy, Debug)]
pub struct TreeMask<'a> {
    pub base: usize,
    /// One bit row per new token of the span.
    pub rows: &'a [u64],
}

/// Most positions a [`TreeMask`] covers (bits in a row).
pub const TREE_MAX_POSITIONS: usize = 64;

/// What one forward does for a decode graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphPhase {
    /// Runs eagerly shaped as the graph will be (attention split for the context bound), so
    /// every buffer the graph uses reaches its size before recording.
    WarmUp,
    /// Records the ops into the graph instead of running them.
    Record,
    /// Stages this step's inputs where the recording read them; the end launches the graph.
    Replay,
}

/// `ids` with every token whose `fill[t]` is a row `r >= 0` replaced by `drawn[r]` (the host
/// form of [`Backend::embed`]'s `fill`).
pub fn fill_ids(ids: &[u32], fill: &[i32], drawn: &[u32]) -> Result<Vec<u32>> {
    if fill.len() != ids.len() {
        return Err(crate::Error::Device(format!(
            "{} fill entries for {} tokens",
            fill.len(),
            ids.len()
        )));
    }
    ids.iter()
        .zip(fill)
        .map(|(&id, &r)| match usize::try_from(r) {
            Err(_) => Ok(id),
            Ok(r) => drawn.get(r).copied().ok_or_else(|| {
                crate::Error::Device(format!(
                    "a token fills from row {r} of a draw of {} rows",
                    drawn.len()
                ))
            }),
        })
        .collect()
}

/// RoPE tables shared by all layers.
#[derive(Clone, Debug)]
pub struct RopeSpec {
    pub head_dim: usize,
    pub rope_dim: usize,
    pub interleaved: bool,
    /// Inverse frequency of each rotated pair (`rope_dim / 2` values), scaling already applied.
    pub inv_freq: Vec<f32>,
    /// Positions are divided by this before rotating (linear scaling; 1 otherwise).
    pub position_scale: f32,
    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    pub attention_factor: f32,
}

/// The compute primitives. Activations are row-major `[n_tokens, width]` buffers. Every op returns
/// a `Result`: a device backend's launch, allocation or transfer can fail, and the failure has to
/// reach the runner (which fails the step's requests) rather than panic the engine thread.
pub trait Backend: Send + Sync {
    /// A weight matrix `[rows (outputs), cols (inputs)]` in whatever layout the backend computes with.
    type Matrix: Send + Sync;
    /// A small float vector (norm weights, biases).
    type Vector: Send + Sync;
    /// One matrix per head, all of one shape, each applied to its own head's columns (MLA's
    /// absorbed `W_UK^T` and `W_UV`): a device backend stacks them for one launch.
    type HeadMatrices: Send + Sync;
    /// One mixture-of-experts layer's routed experts (those this rank holds).
    type Experts: Send + Sync;
    /// An activation buffer.
    type Buffer: Send;
    /// Key/value storage for every layer, in fixed-size blocks.
    type KvStore: Send;
    /// A sampling op's results, possibly still where they were drawn
    /// ([`Backend::sample_launch`]).
    type Drawn: Send;
    /// One forward's metadata in the backend's own form: each token's position, each sequence's
    /// span, block table and tree mask. Made once per forward by [`Backend::step_meta`], so a
    /// device backend uploads it once and every layer's rope and attention read that copy.
    type StepMeta<'a>
    where
        Self: 'a;

    fn name(&self) -> &'static str;
    /// A device backend's memory (free and total bytes), for sizing the KV pool from
    /// `--mem-fraction-static`; `None` on the host.
    fn memory(&self) -> Option<crate::runner::memory::DeviceMemory> {
        None
    }
    /// The backend and what it runs on, for logs and `kiln generate`'s summary line.
    fn describe(&self) -> String {
        self.name().to_string()
    }

    /// Prepares one matrix from one or more stored tensors stacked by rows (e.g. Q, K and V projections
    /// fused into one matrix, so one matmul computes all three).
    fn matrix(&self, parts: &[TensorView], precision: Precision) -> Result<Self::Matrix>;
    /// A matrix for a draft model: as `matrix` in `precision`, except that in fast mode float
    /// weights may be stored at lower precision (8-bit blocks on the CPU), since a draft's
    /// precision moves only its acceptance, never the verified output.
    fn draft_matrix(&self, parts: &[TensorView], precision: Precision) -> Result<Self::Matrix> {
        self.matrix(parts, precision)
    }
    /// A matrix [`Backend::embed`] reads by rows (a model's token embeddings, which also serve
    /// as the LM head when tied): as `matrix`, except where a backend keeps some weights in a
    /// form only its matmul reads (the GPU's packed INT4 and FP8).
    fn embedding(&self, parts: &[TensorView], precision: Precision) -> Result<Self::Matrix> {
        self.matrix(parts, precision)
    }
    /// `heads[i]` is head `i`'s `[rows, cols]` matrix; every head has the same shape.
    fn head_matrices(
        &self,
        heads: &[TensorView],
        precision: Precision,
    ) -> Result<Self::HeadMatrices>;
    /// `held[e]` is routed expert `e`'s weights where this rank holds it, `None` where another
    /// rank does.
    fn experts(
        &self,
        held: Vec<Option<ExpertTensors>>,
        precision: Precision,
    ) -> Result<Self::Experts>;
    fn vector(&self, v: &TensorView) -> Result<Self::Vector>;
    fn vector_from_host(&self, values: &[f32]) -> Result<Self::Vector>;
    /// A buffer of `n_rows * width` zeros.
    fn buffer(&self, n_rows: usize, width: usize) -> Result<Self::Buffer>;
    /// Gives `buf` the shape `[n_rows, width]`, growing its allocation only when it must (new
    /// cells are zeros; what it held stays unspecified): buffers kept across steps allocate
    /// nothing once the largest step has run.
    fn reshape(&self, buf: &mut Self::Buffer, n_rows: usize, width: usize) -> Result<()>;
    /// The paged KV cache. `precision` lets a backend store it narrower in fast mode (the CPU
    /// backend keeps f16 cells where its AVX-512 kernel reads them; exact mode is always f32).
    fn kv_store(
        &self,
        n_layers: usize,
        n_blocks: usize,
        block_size: usize,
        kv_width: usize,
        layout: KvLayout,
        precision: Precision,
    ) -> Result<Self::KvStore>;

    /// A model forward begins (before its first op): a device backend may reuse what it staged
    /// for earlier forwards. Nested metadata (MLA's per-layer scratch) does not call it.
    fn begin_forward(&self) -> Result<()> {
        Ok(())
    }
    /// A forward's metadata (see [`Backend::StepMeta`]), made once before its first layer.
    fn step_meta<'a>(
        &self,
        positions: &'a [usize],
        spans: &'a [SeqSpan<'a>],
    ) -> Result<Self::StepMeta<'a>>;
    /// `out[t] = table[ids[t]]` (rows of an embedding matrix, dequantized). With `fill`, a
    /// token whose `fill[t]` is a row `r >= 0` takes instead the token the latest
    /// [`Backend::sample_launch`] drew for row `r`, read where it was drawn: overlap scheduling
    /// feeds a step the previous step's tokens before the host has them.
    fn embed(
        &self,
        table: &Self::Matrix,
        ids: &[u32],
        fill: Option<&[i32]>,
        out: &mut Self::Buffer,
    ) -> Result<()>;
    /// `out = x * w^T`: `x` is `[n, cols]`, `out` is `[n, rows]`.
    fn matmul(&self, x: &Self::Buffer, w: &Self::Matrix, out: &mut Self::Buffer) -> Result<()>;
    /// Adds `bias[cols_range]` to every row of `x[.., cols_range]`.
    fn add_bias(&self, x: &mut Self::Buffer, bias: &Self::Vector, col_offset: usize) -> Result<()>;
    /// Row-wise RMSNorm: `out[t] = x[t] / rms(x[t]) * w`.
    fn rms_norm(
        &self,
        x: &Self::Buffer,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Buffer,
    ) -> Result<()>;
    /// RMSNorm of each of `n_heads` heads of `head_dim` columns starting at `col_offset`, in place
    /// (Qwen3's Q/K norm).
    fn head_rms_norm(
        &self,
        x: &mut Self::Buffer,
        w: &Self::Vector,
        eps: f32,
        col_offset: usize,
        n_heads: usize,
        head_dim: usize,
    ) -> Result<()>;
    /// Rotates `n_heads` heads starting at column `col_offset` of each row, token `t` at the
    /// step's `positions[t]`.
    fn rope(
        &self,
        x: &mut Self::Buffer,
        col_offset: usize,
        n_heads: usize,
        meta: &Self::StepMeta<'_>,
        spec: &RopeSpec,
    ) -> Result<()>;
    /// Stores the K and V rows of this batch into their slots, then computes causal attention for every
    /// token of every span. `qkv` holds `[q | k | v]` per token; `out` gets `[n, n_heads * head_dim]`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        qkv: &Self::Buffer,
        kv: &mut Self::KvStore,
        layer: usize,
        meta: &Self::StepMeta<'_>,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        out: &mut Self::Buffer,
    ) -> Result<()>;
    /// MLA's absorbed attention: stores this batch's cached rows (`qkv` holds `[q | k | v]` per
    /// token, `n_heads` query heads and one K row of `head_width`, `[rope | latent]`, in a
    /// [`KvLayout::KeysOnly`] store), then every query head attends over its sequence's cached
    /// rows as keys and their latent columns as values. `out` (shaped `[n, n_heads * latent]` by
    /// the caller) gets each head's weighted latent. The scale is `1 / sqrt(head_width)`, as
    /// [`Backend::attention`]'s.
    #[allow(clippy::too_many_arguments)]
    fn latent_attention(
        &self,
        qkv: &Self::Buffer,
        kv: &mut Self::KvStore,
        layer: usize,
        meta: &Self::StepMeta<'_>,
        n_heads: usize,
        head_width: usize,
        rope_dim: usize,
        out: &mut Self::Buffer,
    ) -> Result<()> {
        let mut full = self.buffer(0, 0)?;
        self.attention(qkv, kv, layer, meta, n_heads, 1, head_width, &mut full)?;
        let latent = head_width - rope_dim;
        self.copy_head_columns(
            &full,
            HeadColumns::new(rope_dim, head_width),
            out,
            HeadColumns::new(0, latent),
            latent,
            n_heads,
        )
    }
    /// Stores the K and V rows of this batch (`qkv` holds `[q (q_width) | k | v]` per token, K
    /// and V as wide as the store's rows) into their slots, without attending: MLA's explicit
    /// prefill attends over decompressed keys but caches the latent.
    fn store_kv(
        &self,
        qkv: &Self::Buffer,
        kv: &mut Self::KvStore,
        layer: usize,
        meta: &Self::StepMeta<'_>,
        q_width: usize,
    ) -> Result<()>;
    /// Moves cached K/V entries of one sequence in every layer: for each `(from, to)`, in order,
    /// position `to` gets what position `from` held (tree verification keeps the accepted path).
    fn move_kv(
        &self,
        kv: &mut Self::KvStore,
        block_table: &[u32],
        moves: &[(usize, usize)],
    ) -> Result<()>;
    /// `out[t] = silu(gu[t][..h]) * gu[t][h..]` where `gu` holds `[gate | up]`.
    fn silu_mul(&self, gu: &Self::Buffer, out: &mut Self::Buffer) -> Result<()>;
    /// `x += y`.
    fn add(&self, x: &mut Self::Buffer, y: &Self::Buffer) -> Result<()>;
    /// `dst[t][dst_col..dst_col + width] = src[t][src_col..src_col + width]` for every row `t`
    /// (both buffers have the same rows; `dst` keeps its shape). MLA assembles its per-head
    /// layouts with it.
    fn copy_columns(
        &self,
        src: &Self::Buffer,
        src_col: usize,
        dst: &mut Self::Buffer,
        dst_col: usize,
        width: usize,
    ) -> Result<()>;
    /// [`Backend::copy_columns`] for `count` heads at once: head `i`'s `width` columns at
    /// `src_cols.of(i)` go to `dst_cols.of(i)` (MLA moves every head's rotary and latent parts).
    #[allow(clippy::too_many_arguments)]
    fn copy_head_columns(
        &self,
        src: &Self::Buffer,
        src_cols: HeadColumns,
        dst: &mut Self::Buffer,
        dst_cols: HeadColumns,
        width: usize,
        count: usize,
    ) -> Result<()> {
        for i in 0..count {
            self.copy_columns(src, src_cols.of(i), dst, dst_cols.of(i), width)?;
        }
        Ok(())
    }
    /// For each head `i` of `w`: `out[t][out_cols.of(i)..][..rows] = W_i x[t][x_cols.of(i)..][..cols]`
    /// for every row `t` (`out` has `x`'s rows and keeps its shape).
    fn matmul_heads(
        &self,
        x: &Self::Buffer,
        x_cols: HeadColumns,
        w: &Self::HeadMatrices,
        out: &mut Self::Buffer,
        out_cols: HeadColumns,
    ) -> Result<()>;
    /// A mixture-of-experts layer's routed part: each token's experts are chosen from its row of
    /// `logits` (`[n, n_experts]`, the router's output) as [`routing::route`] chooses them, and
    /// `out[t] += weight * down(silu(gate h[t]) * up h[t])` for each chosen expert held here.
    /// A device backend keeps the choice on the device.
    #[allow(clippy::too_many_arguments)]
    fn routed_experts(
        &self,
        spec: &RouteSpec,
        correction_bias: &Self::Vector,
        h: &Self::Buffer,
        logits: &Self::Buffer,
        experts: &Self::Experts,
        out: &mut Self::Buffer,
    ) -> Result<()>;
    /// `x[t][col..col + width] *= factor` for every row.
    fn scale_columns(
        &self,
        x: &mut Self::Buffer,
        col: usize,
        width: usize,
        factor: f32,
    ) -> Result<()>;
    /// `dst[rows[i]] += weights[i] * src[i]`: a routed expert's outputs added back to its tokens.
    fn scatter_add_rows(
        &self,
        dst: &mut Self::Buffer,
        rows: &[usize],
        src: &Self::Buffer,
        weights: &[f32],
    ) -> Result<()>;
    /// Keeps only the listed rows of `x`, in order, in `out` (before the LM head, which needs
    /// few of them).
    fn gather_rows_into(
        &self,
        x: &Self::Buffer,
        rows: &[usize],
        out: &mut Self::Buffer,
    ) -> Result<()>;
    /// [`Backend::gather_rows_into`] a new buffer.
    fn gather_rows(&self, x: &Self::Buffer, rows: &[usize]) -> Result<Self::Buffer> {
        let mut out = self.buffer(0, 0)?;
        self.gather_rows_into(x, rows, &mut out)?;
        Ok(out)
    }
    /// Copies a buffer to host f32 values.
    fn to_host(&self, x: &Self::Buffer) -> Result<Vec<f32>>;
    /// Draws one token per row of `logits` (`draws.len()` rows of vocabulary width, the LM
    /// head's output) where the logits are, agreeing with [`crate::sampling::sample_row`]; only
    /// token ids and the logprobs asked for come back.
    fn sample(&self, logits: &Self::Buffer, draws: &[RowDraw<'_>]) -> Result<Vec<RowResult>> {
        let drawn = self.sample_launch(logits, draws)?;
        self.sample_read(drawn)
    }
    /// [`Backend::sample`]'s first half: the draws are made (a device backend enqueues them and
    /// returns at once) and their tokens become what [`Backend::embed`]'s `fill` reads, until
    /// the next launch. At most two launches may be unread at a time.
    fn sample_launch(&self, logits: &Self::Buffer, draws: &[RowDraw<'_>]) -> Result<Self::Drawn>;
    /// The second half: waits for a launch's results and brings them to the host.
    fn sample_read(&self, drawn: Self::Drawn) -> Result<Vec<RowResult>>;
    /// Whether the runner should give its rows to [`Backend::sample`] instead of copying the
    /// logits to the host (a device backend, where that copy is a vocabulary-wide row per
    /// token). The host samples host logits lazily, so a tree walk draws only the nodes it
    /// reaches.
    fn samples_in_place(&self) -> bool {
        false
    }

    /// Whether this backend records decode steps into graphs and replays them (CUDA graphs).
    fn records_graphs(&self) -> bool {
        false
    }
    /// Starts a phase of the graph of batch size `bucket` (see [`GraphPhase`]) that lasts one
    /// forward, until [`Backend::end_graph`]. `context_bound` is the longest context any of its
    /// steps attends over; `staging_bytes` what its inputs take at most.
    fn begin_graph(
        &self,
        _bucket: usize,
        _phase: GraphPhase,
        _context_bound: usize,
        _staging_bytes: usize,
    ) -> Result<()> {
        Err(crate::Error::Device(format!(
            "the {} backend records no graphs",
            self.name()
        )))
    }
    /// Whether the graph of batch size `bucket` is recorded (and not dropped since).
    fn has_graph(&self, _bucket: usize) -> bool {
        false
    }
    /// Ends the phase: keeps the recorded graph, or launches the replayed one.
    fn end_graph(&self) -> Result<()> {
        Err(crate::Error::Device(format!(
            "the {} backend records no graphs",
            self.name()
        )))
    }
    /// Leaves graph mode after a failure between begin and end.
    fn abort_graph(&self) {}
    /// Joins the tensor-parallel group whose ranks are the threads behind `host`: every rank
    /// calls it at once, before loading its shard. Returns the communicator this backend's
    /// collectives run over (CUDA: an NCCL communicator on its GPU), or `None` when the host one
    /// serves (the CPU, whose buffers are host memory).
    fn group_communicator(
        &self,
        host: &crate::parallel::ThreadComm,
        opts: &crate::parallel::GroupOptions,
    ) -> Result<Option<Box<dyn crate::parallel::Communicator>>> {
        let _ = (host, opts);
        Ok(None)
    }
    /// Sums `x` across the tensor-parallel group in place (CPU: threads; CUDA: NCCL).
    fn all_reduce_sum(
        &self,
        x: &mut Self::Buffer,
        comm: &dyn crate::parallel::Communicator,
    ) -> Result<()>;
}
