//! The Llama-family decoder (Touvron et al. 2023; Hugging Face `modeling_llama.py` is the reference
//! this code is tested against): pre-norm blocks of grouped-query attention with RoPE and a SiLU-gated
//! MLP. Qwen2 adds Q/K/V biases, Qwen3 a per-head RMSNorm on Q and K.
//!
//! The model owns weights only. KV state and batch layout are passed in, so one forward serves several
//! sequences of different lengths in one step.

use super::config::{ModelConfig, RopeLayout};
use super::mla::{MlaForm, MlaScratch, MlaTensors, MlaWeights, QueryTensors, join_kv_b};
use super::moe::{Expert, MoeWeights};
use crate::backend::{Backend, ExpertTensors, Precision, RopeSpec, SeqSpan};
use crate::error::{Error, Result};
use crate::parallel::{Communicator, Shard};
use crate::weights::{TensorView, WeightStore};
use std::ops::Range;

/// Grouped-query attention (Llama, Mistral, Qwen).
struct GqaWeights<B: Backend> {
    /// Q, K and V projections stacked: one matmul gives `[q | k | v]`.
    qkv: B::Matrix,
    qkv_bias: Option<B::Vector>,
    q_norm: Option<B::Vector>,
    k_norm: Option<B::Vector>,
    o: B::Matrix,
}

enum Attention<B: Backend> {
    Gqa(GqaWeights<B>),
    Mla(MlaWeights<B>),
}

enum FeedForward<B: Backend> {
    /// Gate and up projections stacked (`[gate | up]`), then down.
    Dense(Expert<B>),
    Moe(MoeWeights<B>),
}

struct Layer<B: Backend> {
    attn_norm: B::Vector,
    attention: Attention<B>,
    ffn_norm: B::Vector,
    ffn: FeedForward<B>,
}

pub struct Llama<B: Backend> {
    pub config: ModelConfig,
    pub precision: Precision,
    embed: B::Matrix,
    layers: Vec<Layer<B>>,
    final_norm: B::Vector,
    /// `None` when the LM head is tied to the embedding matrix (and not split).
    lm_head: Option<B::Matrix>,
    /// Under tensor parallelism, the rows of the vocabulary this rank's LM head holds (each rank
    /// computes its slice of the logits, then the ranks gather them): the head is the largest
    /// matrix every step reads (Kimi-K2: 2.3 GB), so each GPU reads 1/world of it. `None`: whole.
    vocab_slice: Option<Range<usize>>,
    rope: RopeSpec,
    /// Attention and KV heads this rank computes (all of them without tensor parallelism).
    local_heads: usize,
    local_kv_heads: usize,
    /// Multi-head latent attention's form (explicit prefill, absorbed decode by default).
    pub mla_form: MlaForm,
}

/// One step's worth of tokens from one or more sequences.
pub struct ForwardBatch<'a> {
    /// All new tokens, sequence after sequence.
    pub tokens: &'a [u32],
    /// Position of each token in its sequence.
    pub positions: &'a [usize],
    /// Which tokens belong to which sequence, and where each sequence's KV lives.
    pub spans: &'a [SeqSpan<'a>],
    /// Indices into `tokens` whose next-token logits are wanted (usually each sequence's last token).
    pub logit_rows: &'a [usize],
    /// Overlap scheduling: per token, the row of the previous sampling launch whose draw
    /// replaces it (`-1`: the token as given); see [`Backend::embed`].
    pub fill: Option<&'a [i32]>,
}

/// Activation buffers reused from step to step.
pub struct Workspace<B: Backend> {
    x: B::Buffer,
    h: B::Buffer,
    qkv: B::Buffer,
    attn: B::Buffer,
    proj: B::Buffer,
    gate_up: B::Buffer,
    act: B::Buffer,
    /// The rows the LM head reads.
    last: B::Buffer,
    /// MLA's activations (made at an MLA model's first step).
    mla: Option<MlaScratch<B>>,
    /// The MoE router's logits.
    router_logits: B::Buffer,
    /// Target layers whose incoming residual stream the step keeps (EAGLE-3's auxiliary hidden
    /// states; `n_layers` names the model's output after the final norm). Empty: none.
    pub capture_layers: Vec<usize>,
    /// After a step: one `[n_tokens, hidden]` buffer per entry of `capture_layers`, every token
    /// of the batch.
    pub captured: Vec<B::Buffer>,
}

impl<B: Backend> Workspace<B> {
    /// The last step's logits, one row per `logit_rows` entry (after [`Llama::forward_in_place`]).
    pub fn logits(&self) -> &B::Buffer {
        &self.proj
    }

    pub fn new(backend: &B) -> Result<Self> {
        Ok(Workspace {
            x: backend.buffer(0, 0)?,
            h: backend.buffer(0, 0)?,
            qkv: backend.buffer(0, 0)?,
            attn: backend.buffer(0, 0)?,
            proj: backend.buffer(0, 0)?,
            gate_up: backend.buffer(0, 0)?,
            act: backend.buffer(0, 0)?,
            last: backend.buffer(0, 0)?,
            mla: None,
            router_logits: backend.buffer(0, 0)?,
            capture_layers: Vec::new(),
            captured: Vec::new(),
        })
    }
}

#[derive(Clone, Copy)]
enum Naming {
    Gguf,
    Hf,
}

fn global_name(n: Naming, role: &str) -> &'static str {
    match (n, role) {
        (Naming::Gguf, "embed") => "token_embd.weight",
        (Naming::Gguf, "norm") => "output_norm.weight",
        (Naming::Gguf, "lm_head") => "output.weight",
        (Naming::Hf, "embed") => "model.embed_tokens.weight",
        (Naming::Hf, "norm") => "model.norm.weight",
        (Naming::Hf, "lm_head") => "lm_head.weight",
        _ => unreachable!("unknown global tensor role {role}"),
    }
}

fn layer_name(n: Naming, i: usize, role: &str) -> String {
    let (gguf, hf) = match role {
        "attn_norm" => ("attn_norm.weight", "input_layernorm.weight"),
        "q" => ("attn_q.weight", "self_attn.q_proj.weight"),
        "k" => ("attn_k.weight", "self_attn.k_proj.weight"),
        "v" => ("attn_v.weight", "self_attn.v_proj.weight"),
        "q_bias" => ("attn_q.bias", "self_attn.q_proj.bias"),
        "k_bias" => ("attn_k.bias", "self_attn.k_proj.bias"),
        "v_bias" => ("attn_v.bias", "self_attn.v_proj.bias"),
        "q_norm" => ("attn_q_norm.weight", "self_attn.q_norm.weight"),
        "k_norm" => ("attn_k_norm.weight", "self_attn.k_norm.weight"),
        "o" => ("attn_output.weight", "self_attn.o_proj.weight"),
        "ffn_norm" => ("ffn_norm.weight", "post_attention_layernorm.weight"),
        "gate" => ("ffn_gate.weight", "mlp.gate_proj.weight"),
        "up" => ("ffn_up.weight", "mlp.up_proj.weight"),
        "down" => ("ffn_down.weight", "mlp.down_proj.weight"),
        // DeepSeek-V3: GGUF names as llama.cpp's `deepseek2` converter writes them. Newer
        // converters split `kv_b` into `k_b` (transposed per head) and `v_b`; GGUF stacks each
        // projection of all routed experts into one 3-D tensor (`*_exps`).
        "q_a" => ("attn_q_a.weight", "self_attn.q_a_proj.weight"),
        "q_a_norm" => ("attn_q_a_norm.weight", "self_attn.q_a_layernorm.weight"),
        "q_b" => ("attn_q_b.weight", "self_attn.q_b_proj.weight"),
        "kv_a" => (
            "attn_kv_a_mqa.weight",
            "self_attn.kv_a_proj_with_mqa.weight",
        ),
        "kv_a_norm" => ("attn_kv_a_norm.weight", "self_attn.kv_a_layernorm.weight"),
        "kv_b" => ("attn_kv_b.weight", "self_attn.kv_b_proj.weight"),
        "k_b" => ("attn_k_b.weight", ""),
        "v_b" => ("attn_v_b.weight", ""),
        "router" => ("ffn_gate_inp.weight", "mlp.gate.weight"),
        "experts" => ("", "mlp.experts"),
        "experts_gate" => ("ffn_gate_exps.weight", ""),
        "experts_up" => ("ffn_up_exps.weight", ""),
        "experts_down" => ("ffn_down_exps.weight", ""),
        "router_bias" => ("exp_probs_b.bias", "mlp.gate.e_score_correction_bias"),
        "shared_gate" => (
            "ffn_gate_shexp.weight",
            "mlp.shared_experts.gate_proj.weight",
        ),
        "shared_up" => ("ffn_up_shexp.weight", "mlp.shared_experts.up_proj.weight"),
        "shared_down" => (
            "ffn_down_shexp.weight",
            "mlp.shared_experts.down_proj.weight",
        ),
        _ => unreachable!("unknown layer tensor role {role}"),
    };
    match n {
        Naming::Gguf => format!("blk.{i}.{gguf}"),
        Naming::Hf => format!("model.layers.{i}.{hf}"),
    }
}

/// Inverse RoPE frequencies, computed in f32 the way transformers computes them.
fn rope_inv_freq(cfg: &ModelConfig, store: Option<&WeightStore>) -> Result<Vec<f32>> {
    let d = cfg.rope_dim;
    let mut inv: Vec<f32> = (0..d / 2)
        .map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f32 / d as f32))
        .collect();
    if let Some(y) = cfg.yarn {
        inv = yarn_inv_freq(cfg.rope_theta, d, &y);
    }
    if let Some(s) = cfg.llama3_scaling {
        let old = s.original_max_position_embeddings as f32;
        let low_wavelen = old / s.low_freq_factor;
        let high_wavelen = old / s.high_freq_factor;
        for f in inv.iter_mut() {
            let wavelen = 2.0 * std::f32::consts::PI / *f;
            if wavelen > low_wavelen {
                *f /= s.factor;
            } else if wavelen >= high_wavelen {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                *f = (1.0 - smooth) * *f / s.factor + smooth * *f;
            }
        }
    }
    // GGUF carries Llama 3 scaling as per-frequency divisors.
    if let Some(store) = store.filter(|s| s.has("rope_freqs.weight")) {
        let t = store.get("rope_freqs.weight")?;
        t.expect_shape(&[d / 2])?;
        for (f, factor) in inv.iter_mut().zip(t.to_f32()) {
            *f /= factor;
        }
    }
    Ok(inv)
}

/// YaRN's frequencies as transformers' `_compute_yarn_parameters` computes them: the low
/// frequencies interpolated (divided by the factor), the high ones kept, a linear ramp between
/// the correction dimensions of `beta_fast` and `beta_slow` rotations.
fn yarn_inv_freq(base: f32, dim: usize, y: &super::config::YarnScaling) -> Vec<f32> {
    let correction_dim = |rotations: f32| -> f64 {
        let (b, orig) = (base as f64, y.original_max_position_embeddings as f64);
        dim as f64 * (orig / (rotations as f64 * 2.0 * std::f64::consts::PI)).ln() / (2.0 * b.ln())
    };
    let low = correction_dim(y.beta_fast).floor().max(0.0) as f32;
    let mut high = correction_dim(y.beta_slow).ceil().min(dim as f64 - 1.0) as f32;
    if low == high {
        high += 0.001;
    }
    (0..dim / 2)
        .map(|i| {
            let pos_freq = base.powf((2 * i) as f32 / dim as f32);
            let (extrapolation, interpolation) = (1.0 / pos_freq, 1.0 / (y.factor * pos_freq));
            let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            interpolation * (1.0 - keep) + extrapolation * keep
        })
        .collect()
}

/// The RoPE tables of a model with this configuration (shared by every layer); `store` may hold
/// GGUF's per-frequency divisors.
pub fn rope_spec(c: &ModelConfig, store: Option<&WeightStore>) -> Result<RopeSpec> {
    Ok(RopeSpec {
        head_dim: c.head_dim,
        rope_dim: c.rope_dim,
        interleaved: c.rope_layout == RopeLayout::Interleaved,
        inv_freq: rope_inv_freq(c, store)?,
        position_scale: c.rope_linear_factor,
        attention_factor: c.yarn.map_or(1.0, |y| y.attention_factor),
    })
}

impl<B: Backend> Llama<B> {
    /// The token embedding matrix (an EAGLE-3 draft without its own embeds uses the target's).
    pub fn embedding(&self) -> &B::Matrix {
        &self.embed
    }

    /// Loads every weight through `backend`; `progress(done, total)` is called once per layer.
    pub fn load(
        backend: &B,
        config: ModelConfig,
        store: &WeightStore,
        precision: Precision,
        progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        Self::load_shard(backend, config, store, precision, Shard::WHOLE, progress)
    }

    /// Loads one tensor-parallel rank's part of the weights (`parallel::Shard`): its query and KV
    /// heads' rows of Q/K/V, the matching input columns of the output projection, its slice of the
    /// MLP's intermediate columns; embedding, norms and LM head whole. Run it with
    /// [`Llama::forward_sharded`] and the group's communicator.
    pub fn load_shard(
        backend: &B,
        config: ModelConfig,
        store: &WeightStore,
        precision: Precision,
        shard: Shard,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Self> {
        let plan = shard.plan(&config)?;
        let whole = shard.world == 1;
        let d = config.head_dim;
        let rows = |v: TensorView, r: std::ops::Range<usize>| -> Result<TensorView> {
            if whole {
                Ok(v)
            } else {
                let cols = v.matrix_shape()?.1;
                v.slice(r, 0..cols)
            }
        };
        let cols = |v: TensorView, c: std::ops::Range<usize>| -> Result<TensorView> {
            if whole {
                Ok(v)
            } else {
                let n = v.matrix_shape()?.0;
                v.slice(0..n, c)
            }
        };
        let q_rows = plan.q_heads.start * d..plan.q_heads.end * d;
        let kv_rows = plan.kv_heads.start * d..plan.kv_heads.end * d;
        let inter = plan.intermediate.clone();
        let naming = match store {
            WeightStore::Gguf(_) => Naming::Gguf,
            WeightStore::Hf(_) => Naming::Hf,
        };
        let c = &config;
        let get = |name: &str, shape: &[usize]| -> Result<TensorView> {
            let v = store.get(name)?;
            v.expect_shape(shape)?;
            Ok(v)
        };
        let h = c.hidden_size;
        let embed_view = get(global_name(naming, "embed"), &[c.vocab_size, h])?;
        let embed = backend.embedding(std::slice::from_ref(&embed_view), precision)?;
        let w = shard.world;
        let vocab_slice = (w > 1 && c.vocab_size.is_multiple_of(w)).then(|| {
            let per = c.vocab_size / w;
            shard.rank * per..(shard.rank + 1) * per
        });
        let head_view = if c.tied_embeddings {
            embed_view.clone()
        } else {
            get(global_name(naming, "lm_head"), &[c.vocab_size, h])?
        };
        let lm_head = match &vocab_slice {
            Some(r) => Some(backend.matrix(&[rows(head_view, r.clone())?], precision)?),
            None if c.tied_embeddings => None,
            None => Some(backend.matrix(&[head_view], precision)?),
        };
        let final_norm = backend.vector(&get(global_name(naming, "norm"), &[h])?)?;
        let total = c.n_layers;
        progress(0, total);
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let n = |role: &str| layer_name(naming, i, role);
            let attention = match &c.mla {
                Some(m) => {
                    let qh = m.qk_head_dim();
                    let q_rows = plan.q_heads.start * qh..plan.q_heads.end * qh;
                    let q_out = c.n_heads * qh;
                    let q = match m.q_lora_rank {
                        Some(rank) => QueryTensors::LowRank(Box::new([
                            get(&n("q_a"), &[rank, h])?,
                            get(&n("q_a_norm"), &[rank])?,
                            rows(get(&n("q_b"), &[q_out, rank])?, q_rows)?,
                        ])),
                        None => QueryTensors::Direct(rows(get(&n("q"), &[q_out, h])?, q_rows)?),
                    };
                    let kvb = m.qk_nope_head_dim + m.v_head_dim;
                    let v_cols = plan.q_heads.start * m.v_head_dim..plan.q_heads.end * m.v_head_dim;
                    let (rank, nope) = (m.kv_lora_rank, m.qk_nope_head_dim);
                    let kv_b = if store.has(&n("kv_b")) {
                        get(&n("kv_b"), &[c.n_heads * kvb, rank])?
                    } else {
                        join_kv_b(
                            &get(&n("k_b"), &[c.n_heads, rank, nope])?,
                            &get(&n("v_b"), &[c.n_heads, m.v_head_dim, rank])?,
                        )?
                    };
                    let t = MlaTensors {
                        q,
                        kv_a: get(&n("kv_a"), &[rank + m.qk_rope_head_dim, h])?,
                        kv_a_norm: get(&n("kv_a_norm"), &[rank])?,
                        kv_b: rows(kv_b, plan.q_heads.start * kvb..plan.q_heads.end * kvb)?,
                        o: cols(get(&n("o"), &[h, c.n_heads * m.v_head_dim])?, v_cols)?,
                    };
                    Attention::Mla(MlaWeights::load(
                        backend,
                        m,
                        t,
                        plan.q_heads.len(),
                        precision,
                    )?)
                }
                None => Attention::Gqa(Self::load_gqa(
                    backend, c, &get, &n, &rows, &cols, &q_rows, &kv_rows, precision,
                )?),
            };
            let ffn = match &c.moe {
                Some(moe) if i >= moe.first_k_dense_replace => FeedForward::Moe(Self::load_moe(
                    backend, c, moe, store, &get, &n, &rows, &cols, shard, precision,
                )?),
                _ => FeedForward::Dense(Expert::load(
                    backend,
                    rows(get(&n("gate"), &[c.intermediate_size, h])?, inter.clone())?,
                    rows(get(&n("up"), &[c.intermediate_size, h])?, inter.clone())?,
                    cols(get(&n("down"), &[h, c.intermediate_size])?, inter.clone())?,
                    precision,
                )?),
            };
            layers.push(Layer {
                attn_norm: backend.vector(&get(&n("attn_norm"), &[h])?)?,
                attention,
                ffn_norm: backend.vector(&get(&n("ffn_norm"), &[h])?)?,
                ffn,
            });
            progress(i + 1, total);
        }
        let rope = rope_spec(c, Some(store))?;
        Ok(Llama {
            config,
            precision,
            embed,
            layers,
            final_norm,
            lm_head,
            vocab_slice,
            rope,
            local_heads: plan.q_heads.len(),
            local_kv_heads: plan.kv_heads.len(),
            mla_form: MlaForm::Auto,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn load_gqa(
        backend: &B,
        c: &ModelConfig,
        get: &dyn Fn(&str, &[usize]) -> Result<TensorView>,
        n: &dyn Fn(&str) -> String,
        rows: &dyn Fn(TensorView, Range<usize>) -> Result<TensorView>,
        cols: &dyn Fn(TensorView, Range<usize>) -> Result<TensorView>,
        q_rows: &Range<usize>,
        kv_rows: &Range<usize>,
        precision: Precision,
    ) -> Result<GqaWeights<B>> {
        let h = c.hidden_size;
        let local = |b: Vec<f32>, r: &Range<usize>| b[r.clone()].to_vec();
        let qkv = backend.matrix(
            &[
                rows(get(&n("q"), &[c.q_width(), h])?, q_rows.clone())?,
                rows(get(&n("k"), &[c.kv_width(), h])?, kv_rows.clone())?,
                rows(get(&n("v"), &[c.kv_width(), h])?, kv_rows.clone())?,
            ],
            precision,
        )?;
        let qkv_bias = if c.qkv_bias {
            let mut b = local(get(&n("q_bias"), &[c.q_width()])?.to_f32(), q_rows);
            b.extend(local(get(&n("k_bias"), &[c.kv_width()])?.to_f32(), kv_rows));
            b.extend(local(get(&n("v_bias"), &[c.kv_width()])?.to_f32(), kv_rows));
            Some(backend.vector_from_host(&b)?)
        } else {
            None
        };
        let (q_norm, k_norm) = if c.qk_norm {
            (
                Some(backend.vector(&get(&n("q_norm"), &[c.head_dim])?)?),
                Some(backend.vector(&get(&n("k_norm"), &[c.head_dim])?)?),
            )
        } else {
            (None, None)
        };
        Ok(GqaWeights {
            qkv,
            qkv_bias,
            q_norm,
            k_norm,
            o: backend.matrix(
                &[cols(get(&n("o"), &[h, c.q_width()])?, q_rows.clone())?],
                precision,
            )?,
        })
    }

    /// A MoE layer: the router whole, this rank's contiguous range of routed experts, and its
    /// columns of the shared experts.
    #[allow(clippy::too_many_arguments)]
    fn load_moe(
        backend: &B,
        c: &ModelConfig,
        moe: &super::config::MoeConfig,
        store: &WeightStore,
        get: &dyn Fn(&str, &[usize]) -> Result<TensorView>,
        n: &dyn Fn(&str) -> String,
        rows: &dyn Fn(TensorView, Range<usize>) -> Result<TensorView>,
        cols: &dyn Fn(TensorView, Range<usize>) -> Result<TensorView>,
        shard: Shard,
        precision: Precision,
    ) -> Result<MoeWeights<B>> {
        let (h, e, w) = (c.hidden_size, moe.n_routed_experts, shard.world);
        let shared_inter = moe.moe_intermediate_size * moe.n_shared_experts;
        if !e.is_multiple_of(w) || !shared_inter.is_multiple_of(w) {
            return Err(Error::InvalidRequest(format!(
                "tensor parallelism {w} does not fit this model: {e} routed experts, shared \
                 expert width {shared_inter}"
            )));
        }
        let mi = moe.moe_intermediate_size;
        let columns = shard.moe == crate::parallel::MoeSplit::Columns && w > 1;
        if columns && !mi.is_multiple_of(w) {
            return Err(Error::InvalidRequest(format!(
                "tensor parallelism {w} cannot split the experts by columns: expert width {mi}"
            )));
        }
        // Expert-parallel: this rank's whole experts. By columns: a slice of every expert.
        let mine = if columns {
            0..e
        } else {
            shard.rank * e / w..(shard.rank + 1) * e / w
        };
        let slice = shard.rank * mi / w..(shard.rank + 1) * mi / w;
        // GGUF stacks each projection of every expert into one `[experts, rows, cols]` tensor.
        let stacked = match store {
            WeightStore::Gguf(_) => Some([
                get(&n("experts_gate"), &[e, mi, h])?,
                get(&n("experts_up"), &[e, mi, h])?,
                get(&n("experts_down"), &[e, h, mi])?,
            ]),
            WeightStore::Hf(_) => None,
        };
        let mut experts = Vec::with_capacity(e);
        for x in 0..e {
            if !mine.contains(&x) {
                experts.push(None);
                continue;
            }
            let [gate, up, down] = match &stacked {
                Some([g, u, d]) => [g.slab(x)?, u.slab(x)?, d.slab(x)?],
                None => {
                    let name = |p: &str| format!("{}.{x}.{p}_proj.weight", n("experts"));
                    [
                        get(&name("gate"), &[mi, h])?,
                        get(&name("up"), &[mi, h])?,
                        get(&name("down"), &[h, mi])?,
                    ]
                }
            };
            let [gate, up, down] = if columns {
                [
                    rows(gate, slice.clone())?,
                    rows(up, slice.clone())?,
                    cols(down, slice.clone())?,
                ]
            } else {
                [gate, up, down]
            };
            experts.push(Some(ExpertTensors { gate, up, down }));
        }
        let shared = if shared_inter == 0 {
            None
        } else {
            let part = shard.rank * shared_inter / w..(shard.rank + 1) * shared_inter / w;
            Some(Expert::load(
                backend,
                rows(get(&n("shared_gate"), &[shared_inter, h])?, part.clone())?,
                rows(get(&n("shared_up"), &[shared_inter, h])?, part.clone())?,
                cols(get(&n("shared_down"), &[h, shared_inter])?, part)?,
                precision,
            )?)
        };
        let bias_name = n("router_bias");
        let bias = if store.has(&bias_name) {
            get(&bias_name, &[e])?.to_f32()
        } else {
            vec![0.0; e]
        };
        let router = get(&n("router"), &[e, h])?;
        MoeWeights::new(backend, router, &bias, experts, shared, precision)
    }

    /// A workspace sized up front for steps of up to `max_tokens` tokens: every activation buffer
    /// of the dense path at its full width, so the steps that follow reuse them instead of growing
    /// them (a device backend cannot afford an allocation per op). Only the LM head's logits rows
    /// grow `proj` past its size, once, at the first step that samples that many rows.
    pub fn workspace(&self, backend: &B, max_tokens: usize) -> Result<Workspace<B>> {
        let c = &self.config;
        let (q, kv) = (
            self.local_heads * c.head_dim,
            self.local_kv_heads * c.head_dim,
        );
        let ffn = c.intermediate_size;
        Ok(Workspace {
            x: backend.buffer(max_tokens, c.hidden_size)?,
            h: backend.buffer(max_tokens, c.hidden_size)?,
            qkv: backend.buffer(max_tokens, q + 2 * kv)?,
            attn: backend.buffer(max_tokens, q)?,
            proj: backend.buffer(max_tokens, c.hidden_size)?,
            gate_up: backend.buffer(max_tokens, 2 * ffn)?,
            act: backend.buffer(max_tokens, ffn)?,
            last: backend.buffer(max_tokens, c.hidden_size)?,
            mla: c
                .mla
                .as_ref()
                .map(|_| MlaScratch::new(backend))
                .transpose()?,
            router_logits: backend.buffer(0, 0)?,
            capture_layers: Vec::new(),
            captured: Vec::new(),
        })
    }

    /// The KV width this rank stores per token (all KV heads without tensor parallelism).
    pub fn local_kv_width(&self) -> usize {
        self.local_kv_heads * self.config.head_dim
    }

    /// Runs one step. Returns `logit_rows.len()` rows of `vocab_size` logits.
    pub fn forward(
        &self,
        backend: &B,
        kv: &mut B::KvStore,
        batch: &ForwardBatch<'_>,
        ws: &mut Workspace<B>,
    ) -> Result<Vec<f32>> {
        self.forward_inner(backend, kv, batch, ws, None)?;
        backend.to_host(&ws.proj)
    }

    /// Runs one step and leaves its logits where the backend computed them
    /// ([`Workspace::logits`]), for sampling there.
    pub fn forward_in_place(
        &self,
        backend: &B,
        kv: &mut B::KvStore,
        batch: &ForwardBatch<'_>,
        ws: &mut Workspace<B>,
    ) -> Result<()> {
        self.forward_inner(backend, kv, batch, ws, None)
    }

    /// One step of one tensor-parallel rank (a model from [`Llama::load_shard`]): every rank of
    /// the group calls it with the same batch; the partial outputs of the attention and MLP output
    /// projections are summed across ranks, so every rank returns the same logits.
    pub fn forward_sharded(
        &self,
        backend: &B,
        kv: &mut B::KvStore,
        batch: &ForwardBatch<'_>,
        ws: &mut Workspace<B>,
        comm: &dyn Communicator,
    ) -> Result<Vec<f32>> {
        self.forward_sharded_in_place(backend, kv, batch, ws, comm)?;
        self.sharded_logits(backend, ws, batch.logit_rows.len(), comm)
    }

    /// [`Llama::forward_sharded`] up to its logits, which stay in the workspace: the part of a
    /// step a graph records (its collectives included).
    pub fn forward_sharded_in_place(
        &self,
        backend: &B,
        kv: &mut B::KvStore,
        batch: &ForwardBatch<'_>,
        ws: &mut Workspace<B>,
        comm: &dyn Communicator,
    ) -> Result<()> {
        self.forward_inner(backend, kv, batch, ws, Some(comm))
    }

    /// The rest of [`Llama::forward_sharded`]: this rank's logits (`rows` rows) to the host,
    /// the verdict on the step's collectives, and every rank's vocabulary slice gathered.
    pub fn sharded_logits(
        &self,
        backend: &B,
        ws: &Workspace<B>,
        rows: usize,
        comm: &dyn Communicator,
    ) -> Result<Vec<f32>> {
        let local = backend.to_host(&ws.proj)?;
        // The step's collectives have all ended by now; whether they ended well is known here.
        comm.end_step()?;
        match &self.vocab_slice {
            Some(slice) => gather_vocab_slices(&local, slice.len(), rows, comm),
            None => Ok(local),
        }
    }

    fn forward_inner(
        &self,
        backend: &B,
        kv: &mut B::KvStore,
        batch: &ForwardBatch<'_>,
        ws: &mut Workspace<B>,
        comm: Option<&dyn Communicator>,
    ) -> Result<()> {
        let c = &self.config;
        let (n_heads, n_kv_heads) = (self.local_heads, self.local_kv_heads);
        let n = batch.tokens.len();
        if batch.positions.len() != n {
            return Err(Error::InvalidRequest(
                "one position per token is required".into(),
            ));
        }
        let _span = tracing::trace_span!("forward", tokens = n).entered();
        backend.begin_forward()?;
        backend.embed(&self.embed, batch.tokens, batch.fill, &mut ws.x)?;
        let q_width = n_heads * c.head_dim;
        let reduce = |ws: &mut Workspace<B>| -> Result<()> {
            match comm {
                Some(comm) => backend.all_reduce_sum(&mut ws.proj, comm),
                None => Ok(()),
            }
        };
        // Kept from step to step (a graph replay writes into the buffers it recorded).
        if ws.captured.len() != ws.capture_layers.len() {
            ws.captured = (0..ws.capture_layers.len())
                .map(|_| backend.buffer(0, 0))
                .collect::<Result<_>>()?;
        }
        let all_rows: Vec<usize> = if ws.capture_layers.is_empty() {
            Vec::new()
        } else {
            (0..n).collect()
        };
        let capture = |ws: &mut Workspace<B>, layer: usize| -> Result<()> {
            for j in 0..ws.capture_layers.len() {
                if ws.capture_layers[j] == layer {
                    backend.gather_rows_into(&ws.x, &all_rows, &mut ws.captured[j])?;
                }
            }
            Ok(())
        };
        // Positions, spans, block tables and tree masks reach the backend once for all layers.
        let meta = backend.step_meta(batch.positions, batch.spans)?;
        for (li, l) in self.layers.iter().enumerate() {
            capture(ws, li)?;
            backend.rms_norm(&ws.x, &l.attn_norm, c.rms_norm_eps, &mut ws.h)?;
            match &l.attention {
                Attention::Gqa(g) => {
                    backend.matmul(&ws.h, &g.qkv, &mut ws.qkv)?;
                    if let Some(b) = &g.qkv_bias {
                        backend.add_bias(&mut ws.qkv, b, 0)?;
                    }
                    if let (Some(qn), Some(kn)) = (&g.q_norm, &g.k_norm) {
                        backend.head_rms_norm(
                            &mut ws.qkv,
                            qn,
                            c.rms_norm_eps,
                            0,
                            n_heads,
                            c.head_dim,
                        )?;
                        backend.head_rms_norm(
                            &mut ws.qkv,
                            kn,
                            c.rms_norm_eps,
                            q_width,
                            n_kv_heads,
                            c.head_dim,
                        )?;
                    }
                    backend.rope(&mut ws.qkv, 0, n_heads, &meta, &self.rope)?;
                    backend.rope(&mut ws.qkv, q_width, n_kv_heads, &meta, &self.rope)?;
                    backend.attention(
                        &ws.qkv,
                        kv,
                        li,
                        &meta,
                        n_heads,
                        n_kv_heads,
                        c.head_dim,
                        &mut ws.attn,
                    )?;
                    backend.matmul(&ws.attn, &g.o, &mut ws.proj)?;
                }
                Attention::Mla(m) => {
                    let mla = c.mla.as_ref().ok_or_else(|| {
                        Error::InvalidRequest("an MLA layer without an MLA config".into())
                    })?;
                    let scratch = match &mut ws.mla {
                        Some(s) => s,
                        none => none.insert(MlaScratch::new(backend)?),
                    };
                    m.forward(
                        backend,
                        mla,
                        c.rms_norm_eps,
                        &self.rope,
                        &ws.h,
                        batch.positions,
                        kv,
                        li,
                        batch.spans,
                        &meta,
                        self.mla_form,
                        scratch,
                        &mut ws.proj,
                    )?;
                }
            }
            reduce(ws)?;
            backend.add(&mut ws.x, &ws.proj)?;
            backend.rms_norm(&ws.x, &l.ffn_norm, c.rms_norm_eps, &mut ws.h)?;
            match &l.ffn {
                FeedForward::Dense(mlp) => {
                    mlp.forward(backend, &ws.h, &mut ws.gate_up, &mut ws.act, &mut ws.proj)?
                }
                FeedForward::Moe(moe) => {
                    let cfg = c.moe.as_ref().ok_or_else(|| {
                        Error::InvalidRequest("a MoE layer without a MoE config".into())
                    })?;
                    moe.forward(
                        backend,
                        cfg,
                        &ws.h,
                        n,
                        c.hidden_size,
                        &mut ws.router_logits,
                        (&mut ws.gate_up, &mut ws.act),
                        &mut ws.proj,
                    )?;
                }
            }
            reduce(ws)?;
            backend.add(&mut ws.x, &ws.proj)?;
        }
        // Layer id `n_layers` is the model's output after the final norm, as transformers'
        // `hidden_states[n_layers]` (what EAGLE-3 trainers read) holds it.
        for j in 0..ws.capture_layers.len() {
            if ws.capture_layers[j] == self.layers.len() {
                backend.rms_norm(&ws.x, &self.final_norm, c.rms_norm_eps, &mut ws.captured[j])?;
            }
        }
        backend.gather_rows_into(&ws.x, batch.logit_rows, &mut ws.last)?;
        backend.rms_norm(&ws.last, &self.final_norm, c.rms_norm_eps, &mut ws.h)?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        backend.matmul(&ws.h, head, &mut ws.proj)
    }
}

/// Whole logits rows from every rank's `local` rows of its `width`-wide vocabulary slice (an LM
/// head split by rows across the group): every rank's slice of every row, rank after rank, put
/// back together row by row.
pub(super) fn gather_vocab_slices(
    local: &[f32],
    width: usize,
    rows: usize,
    comm: &dyn Communicator,
) -> Result<Vec<f32>> {
    let world = comm.world();
    let mut all = vec![0f32; local.len() * world];
    comm.all_gather(local, &mut all)?;
    let vocab = width * world;
    let mut logits = vec![0f32; rows * vocab];
    for (r, part) in all.chunks_exact(local.len().max(1)).enumerate() {
        for (i, row) in part.chunks_exact(width).enumerate() {
            logits[i * vocab + r * width..i * vocab + (r + 1) * width].copy_from_slice(row);
        }
    }
    Ok(logits)
}
