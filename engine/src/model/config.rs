//! One configuration type for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) and the
//! DeepSeek-V3 family (DeepSeek-V3, Kimi-K2: MLA attention and MoE feed-forwards), read either from
//! GGUF metadata or from a Hugging Face `config.json`.

use std::path::Path;

use serde::Deserialize;

use crate::backend::KvLayout;
use crate::error::{Error, Result};
use crate::weights::gguf::GgufFile;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// DeepSeek-V3 and Kimi-K2 (`DeepseekV3ForCausalLM`): multi-head latent attention, MoE.
    DeepseekV3,
}

impl Architecture {
    fn parse(name: &str, path: &Path) -> Result<Architecture> {
        Ok(match name {
            "llama" | "LlamaForCausalLM" => Architecture::Llama,
            "mistral" | "MistralForCausalLM" => Architecture::Mistral,
            "qwen2" | "Qwen2ForCausalLM" => Architecture::Qwen2,
            "qwen3" | "Qwen3ForCausalLM" => Architecture::Qwen3,
            // llama.cpp names the DeepSeek-V2/V3 (and Kimi-K2) architecture `deepseek2`.
            "deepseek_v3" | "kimi_k2" | "DeepseekV3ForCausalLM" | "deepseek2" => {
                Architecture::DeepseekV3
            }
            other => {
                return Err(Error::UnsupportedArchitecture {
                    path: path.to_path_buf(),
                    arch: other.to_string(),
                });
            }
        })
    }
}

/// How RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Pairs (2i, 2i+1): ggml's llama converter permutes Q/K rows into this order.
    Interleaved,
    /// Pairs (i, i + d/2): the Hugging Face (and GPT-NeoX) order.
    HalfSplit,
}

/// Llama 3 frequency-dependent RoPE scaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// YaRN RoPE scaling (`rope_type = "yarn"`, as DeepSeek-V3 and Kimi-K2 ship it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnScaling {
    pub factor: f32,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// Multiplies the rotated dimensions' cos/sin (transformers' `attention_factor`).
    pub attention_factor: f32,
    /// `mscale_all_dim`: MLA multiplies its softmax scale by `yarn_mscale(factor, this)^2`.
    pub mscale_all_dim: f32,
}

/// YaRN's `0.1 * mscale * ln(scale) + 1` (1 for scale <= 1).
pub fn yarn_mscale(scale: f32, mscale: f32) -> f32 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// Multi-head latent attention (DeepSeek-V2/V3): keys and values are one compressed latent per
/// token (`kv_lora_rank` values after their RMSNorm) plus one shared rotary key of
/// `qk_rope_head_dim`; that latent is what the KV cache holds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaConfig {
    /// `None`: queries come from one `q_proj`; otherwise from `q_a_proj` -> RMSNorm -> `q_b_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// The softmax scale transformers uses: `(nope + rope)^-0.5`, times YaRN's mscale squared.
    pub softmax_scale: f32,
}

impl MlaConfig {
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The width of one cached row, `[k_pe | latent]`: the model's single KV head.
    pub fn cache_width(&self) -> usize {
        self.qk_rope_head_dim + self.kv_lora_rank
    }
}

/// DeepSeek-V3's mixture of experts: sigmoid router scores plus a correction bias choose
/// `topk_group` of `n_group` expert groups (by the sum of each group's best two), then
/// `experts_per_token` experts among them; weights are the uncorrected scores, normalised when
/// `norm_topk_prob`, times `routed_scaling_factor`. Shared experts run on every token.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_routed_experts: usize,
    pub n_shared_experts: usize,
    pub experts_per_token: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f32,
    pub norm_topk_prob: bool,
    pub moe_intermediate_size: usize,
    /// Layers before this one have a dense MLP of `intermediate_size`.
    pub first_k_dense_replace: usize,
}

impl MoeConfig {
    /// Refuses a routing shape the grouped top-k cannot run (naming the numbers).
    fn check_routing(&self, path: &Path) -> Result<()> {
        let routed = self.n_routed_experts;
        let per_group = routed / self.n_group.max(1);
        if !routed.is_multiple_of(self.n_group.max(1))
            || self.topk_group > self.n_group
            || per_group < 2
            || self.experts_per_token > self.topk_group * per_group
        {
            return Err(Error::config(
                path,
                format!(
                    "MoE routing does not fit: {routed} experts in {} groups, {} groups and {} \
                     experts per token",
                    self.n_group, self.topk_group, self.experts_per_token
                ),
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Leading dimensions of each head that RoPE rotates (usually all of them).
    pub rope_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_layout: RopeLayout,
    pub llama3_scaling: Option<Llama3RopeScaling>,
    /// Linear position scaling (`rope_scaling.type = "linear"`): positions are divided by this.
    pub rope_linear_factor: f32,
    pub max_context: usize,
    pub tied_embeddings: bool,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub yarn: Option<YarnScaling>,
    /// DeepSeek-V3 attention. With it, `n_kv_heads` is 1 and `head_dim` is
    /// `qk_rope_head_dim + kv_lora_rank`: the width of one cached latent row, which is also the
    /// per-head width of the absorbed queries (see `model::mla`).
    pub mla: Option<MlaConfig>,
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    pub fn from_gguf(g: &GgufFile) -> Result<ModelConfig> {
        let path = &g.path;
        let arch_name = g
            .meta_str("general.architecture")
            .ok_or_else(|| Error::config(path, "metadata `general.architecture` is missing"))?;
        let arch = Architecture::parse(arch_name, path)?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let req = |k: &str| -> Result<usize> {
            g.meta_u64(&key(k))
                .map(|v| v as usize)
                .filter(|&v| v > 0)
                .ok_or_else(|| {
                    Error::config(path, format!("metadata `{}` is missing or zero", key(k)))
                })
        };
        let hidden_size = req("embedding_length")?;
        let n_heads = req("attention.head_count")?;
        let n_kv_heads = g
            .meta_u64(&key("attention.head_count_kv"))
            .map(|v| v as usize)
            .unwrap_or(n_heads);
        let head_dim = g
            .meta_u64(&key("attention.key_length"))
            .map(|v| v as usize)
            .unwrap_or(hidden_size / n_heads);
        let vocab_size = match g.meta("tokenizer.ggml.tokens").and_then(|v| v.as_array()) {
            Some(t) => t.len(),
            None => g.view("token_embd.weight")?.matrix_shape()?.0,
        };
        let rope_linear_factor = match g.meta_str(&key("rope.scaling.type")) {
            Some("linear") => g.meta_f64(&key("rope.scaling.factor")).unwrap_or(1.0) as f32,
            _ => 1.0,
        };
        let rope_dim = g
            .meta_u64(&key("rope.dimension_count"))
            .map(|v| v as usize)
            .unwrap_or(head_dim);
        let (yarn, mla, moe) = if arch == Architecture::DeepseekV3 {
            gguf_deepseek_parts(g, arch_name, rope_dim)?
        } else {
            (None, None, None)
        };
        // MLA caches one `[k_pe | latent]` row per token: a single KV head of that width.
        let (n_kv_heads, head_dim) = match &mla {
            Some(m) => (1, m.cache_width()),
            None => (n_kv_heads, head_dim),
        };
        let cfg = ModelConfig {
            arch,
            hidden_size,
            intermediate_size: req("feed_forward_length")?,
            n_layers: req("block_count")?,
            n_heads,
            n_kv_heads,
            head_dim,
            rope_dim,
            vocab_size,
            rms_norm_eps: g
                .meta_f64(&key("attention.layer_norm_rms_epsilon"))
                .unwrap_or(1e-5) as f32,
            rope_theta: g.meta_f64(&key("rope.freq_base")).unwrap_or(10_000.0) as f32,
            // ggml's convert script permutes Llama/Mistral Q and K rows; Qwen uses NeoX rope
            // unpermuted; DeepSeek's checkpoints are stored interleaved and converted as they are.
            rope_layout: match arch {
                Architecture::Llama | Architecture::Mistral | Architecture::DeepseekV3 => {
                    RopeLayout::Interleaved
                }
                Architecture::Qwen2 | Architecture::Qwen3 => RopeLayout::HalfSplit,
            },
            // Llama 3 scaling arrives in GGUF as the precomputed `rope_freqs.weight` tensor instead.
            llama3_scaling: None,
            rope_linear_factor,
            max_context: req("context_length")?,
            tied_embeddings: !g.has_tensor("output.weight"),
            qkv_bias: g.has_tensor("blk.0.attn_q.bias"),
            qk_norm: g.has_tensor("blk.0.attn_q_norm.weight"),
            yarn,
            mla,
            moe,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    pub fn from_hf_config(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::config(path, format!("invalid config.json: {e}")))?;
        Self::from_hf_json(value, path)
    }

    /// A Hugging Face config already parsed (e.g. the `transformer_layer_config` inside an
    /// EAGLE-3 draft's config); `path` names the file in errors.
    pub fn from_hf_json(value: serde_json::Value, path: &Path) -> Result<ModelConfig> {
        let c: HfConfig = serde_json::from_value(value)
            .map_err(|e| Error::config(path, format!("invalid config.json: {e}")))?;
        let arch_name = c
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .or(c.model_type.clone())
            .ok_or_else(|| {
                Error::config(path, "field `architectures` (or `model_type`) is missing")
            })?;
        let arch = Architecture::parse(&arch_name, path)?;
        let head_dim = c
            .head_dim
            .unwrap_or(c.hidden_size / c.num_attention_heads.max(1));
        let mut llama3_scaling = None;
        let mut rope_linear_factor = 1.0;
        let rope = c.rope_scaling.as_ref().or(c.rope_parameters.as_ref());
        let rope_theta = c
            .rope_theta
            .or(c.rope_parameters.as_ref().and_then(|p| p.rope_theta))
            .unwrap_or(10_000.0);
        let mut yarn = None;
        if let Some(s) = rope {
            let kind = s
                .rope_type
                .as_deref()
                .or(s.kind.as_deref())
                .unwrap_or("default");
            match kind {
                "llama3" => {
                    llama3_scaling = Some(Llama3RopeScaling {
                        factor: s.factor.unwrap_or(8.0),
                        low_freq_factor: s.low_freq_factor.unwrap_or(1.0),
                        high_freq_factor: s.high_freq_factor.unwrap_or(4.0),
                        original_max_position_embeddings: s
                            .original_max_position_embeddings
                            .unwrap_or(8192),
                    })
                }
                "linear" => rope_linear_factor = s.factor.unwrap_or(1.0),
                "yarn" => {
                    let original = s.original_max_position_embeddings.unwrap_or(4096);
                    let factor = s.factor.unwrap_or_else(|| {
                        c.max_position_embeddings.unwrap_or(original) as f32 / original as f32
                    });
                    let attention_factor =
                        s.attention_factor
                            .unwrap_or_else(|| match (s.mscale, s.mscale_all_dim) {
                                (Some(m), Some(a)) if m != 0.0 && a != 0.0 => {
                                    yarn_mscale(factor, m) / yarn_mscale(factor, a)
                                }
                                _ => yarn_mscale(factor, 1.0),
                            });
                    yarn = Some(YarnScaling {
                        factor,
                        original_max_position_embeddings: original,
                        beta_fast: s.beta_fast.unwrap_or(32.0),
                        beta_slow: s.beta_slow.unwrap_or(1.0),
                        attention_factor,
                        mscale_all_dim: s.mscale_all_dim.unwrap_or(0.0),
                    });
                }
                "default" => {}
                other => {
                    return Err(Error::config(
                        path,
                        format!("rope_scaling type `{other}` is not supported"),
                    ));
                }
            }
        }
        let (mla, moe) = if arch == Architecture::DeepseekV3 {
            deepseek_parts(&c, yarn.as_ref(), path)?
        } else {
            (None, None)
        };
        let (n_kv_heads, head_dim, rope_dim) = match &mla {
            Some(m) => (1, m.cache_width(), m.qk_rope_head_dim),
            None => (
                c.num_key_value_heads.unwrap_or(c.num_attention_heads),
                head_dim,
                head_dim,
            ),
        };
        let rope_layout = if mla.is_some() && c.rope_interleave.unwrap_or(true) {
            RopeLayout::Interleaved
        } else {
            RopeLayout::HalfSplit
        };
        let cfg = ModelConfig {
            arch,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            n_layers: c.num_hidden_layers,
            n_heads: c.num_attention_heads,
            n_kv_heads,
            head_dim,
            rope_dim,
            vocab_size: c.vocab_size,
            rms_norm_eps: c.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_layout,
            llama3_scaling,
            rope_linear_factor,
            max_context: c.max_position_embeddings.unwrap_or(4096),
            tied_embeddings: c.tie_word_embeddings.unwrap_or(false),
            qkv_bias: c.attention_bias.unwrap_or(arch == Architecture::Qwen2),
            qk_norm: arch == Architecture::Qwen3,
            yarn,
            mla,
            moe,
        };
        cfg.validate(path)?;
        Ok(cfg)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |m: String| Err(Error::config(path, m));
        if self.n_heads == 0
            || self.n_kv_heads == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            return bad(format!(
                "{} attention heads are not a multiple of {} KV heads",
                self.n_heads, self.n_kv_heads
            ));
        }
        if self.head_dim == 0
            || !self.head_dim.is_multiple_of(2)
            || self.rope_dim > self.head_dim
            || !self.rope_dim.is_multiple_of(2)
        {
            return bad(format!(
                "head_dim {} / rope dim {} are invalid",
                self.head_dim, self.rope_dim
            ));
        }
        if self.hidden_size == 0
            || self.intermediate_size == 0
            || self.n_layers == 0
            || self.vocab_size == 0
        {
            return bad("hidden size, intermediate size, layers and vocab must be non-zero".into());
        }
        // Far past any real model, and checked before anything is sized from them: a corrupt
        // count must be a clear refusal, not a multi-terabyte allocation.
        for (field, value, limit) in [
            (
                "layers (block_count / num_hidden_layers)",
                self.n_layers,
                1 << 10,
            ),
            ("hidden size", self.hidden_size, 1 << 17),
            ("intermediate size", self.intermediate_size, 1 << 20),
            ("attention heads", self.n_heads, 1 << 12),
            ("head size", self.head_dim, 1 << 12),
            ("vocabulary", self.vocab_size, 1 << 23),
            ("context length", self.max_context, 1 << 25),
        ] {
            if value > limit {
                return bad(format!(
                    "{field} {value} is past any model kiln can serve (at most {limit})"
                ));
            }
        }
        for (field, value) in [
            (
                "rms_norm_eps (attention.layer_norm_rms_epsilon)",
                self.rms_norm_eps,
            ),
            ("rope_theta (rope.freq_base)", self.rope_theta),
            ("the rope scaling factor", self.rope_linear_factor),
        ] {
            if !value.is_finite() || value <= 0.0 {
                return bad(format!(
                    "{field} is {value}; it must be a finite number > 0"
                ));
            }
        }
        if self.rms_norm_eps >= 1.0 {
            return bad(format!(
                "rms_norm_eps (attention.layer_norm_rms_epsilon) is {}; it must be below 1",
                self.rms_norm_eps
            ));
        }
        Ok(())
    }

    pub fn q_width(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// MLA caches its latent once, as keys its attention also reads as values.
    pub fn kv_layout(&self) -> KvLayout {
        if self.mla.is_some() {
            KvLayout::KeysOnly
        } else {
            KvLayout::KeysAndValues
        }
    }
}

/// YaRN, MLA and MoE settings from the metadata llama.cpp's converter writes for `deepseek2`:
/// MLA as one KV head of `kv_lora_rank + rope` (`attention.key_length`) with the per-head sizes in
/// `attention.key_length_mla` / `value_length_mla` (legacy files without them carry the per-head
/// sizes in `key_length` / `value_length`). YaRN's softmax factor follows llama.cpp's deepseek2
/// graph: `(attn_factor * yarn_mscale(factor, yarn_log_multiplier / 0.1))^2`, the rotary factor is
/// `attn_factor` (1 unless the file sets `rope.scaling.attn_factor`).
type DeepseekParts = (Option<YarnScaling>, Option<MlaConfig>, Option<MoeConfig>);

fn gguf_deepseek_parts(g: &GgufFile, arch: &str, rope: usize) -> Result<DeepseekParts> {
    let path = &g.path;
    let key = |k: &str| format!("{arch}.{k}");
    let missing =
        |k: &str| Error::config(path, format!("metadata `{}` is missing or zero", key(k)));
    let req = |k: &str| -> Result<usize> {
        g.meta_u64(&key(k))
            .map(|v| v as usize)
            .filter(|&v| v > 0)
            .ok_or_else(|| missing(k))
    };
    let opt = |k: &str| g.meta_u64(&key(k)).map(|v| v as usize).filter(|&v| v > 0);
    let kv_lora_rank = req("attention.kv_lora_rank")?;
    let (qk_head_dim, v_head_dim) = match opt("attention.key_length_mla") {
        Some(k) => (k, req("attention.value_length_mla")?),
        None => (req("attention.key_length")?, req("attention.value_length")?),
    };
    if qk_head_dim <= rope {
        return Err(Error::config(
            path,
            format!(
                "metadata `{}` ({qk_head_dim}) must exceed the rotary dimensions ({rope})",
                key("attention.key_length_mla")
            ),
        ));
    }
    let yarn = match g.meta_str(&key("rope.scaling.type")) {
        Some("yarn") => {
            let factor = g.meta_f64(&key("rope.scaling.factor")).unwrap_or(1.0) as f32;
            Some(YarnScaling {
                factor,
                original_max_position_embeddings: req("rope.scaling.original_context_length")?,
                beta_fast: g
                    .meta_f64(&key("rope.scaling.yarn_beta_fast"))
                    .unwrap_or(32.0) as f32,
                beta_slow: g
                    .meta_f64(&key("rope.scaling.yarn_beta_slow"))
                    .unwrap_or(1.0) as f32,
                attention_factor: g.meta_f64(&key("rope.scaling.attn_factor")).unwrap_or(1.0)
                    as f32,
                mscale_all_dim: g
                    .meta_f64(&key("rope.scaling.yarn_log_multiplier"))
                    .unwrap_or(0.0) as f32
                    / 0.1,
            })
        }
        None | Some("none") => None,
        Some(other) => {
            return Err(Error::config(
                path,
                format!(
                    "metadata `{}` = `{other}` is not supported for {arch}",
                    key("rope.scaling.type")
                ),
            ));
        }
    };
    let mut softmax_scale = 1.0 / (qk_head_dim as f32).sqrt();
    if let Some(y) = &yarn {
        let m = y.attention_factor * yarn_mscale(y.factor, y.mscale_all_dim);
        softmax_scale *= m * m;
    }
    let mla = MlaConfig {
        q_lora_rank: opt("attention.q_lora_rank"),
        kv_lora_rank,
        qk_nope_head_dim: qk_head_dim - rope,
        qk_rope_head_dim: rope,
        v_head_dim,
        softmax_scale,
    };
    let moe = match opt("expert_count") {
        None => None,
        Some(n_routed_experts) => {
            // llama.cpp reads a missing gating function as softmax (DeepSeek-V2's router).
            const SIGMOID: u64 = 2;
            match g.meta_u64(&key("expert_gating_func")) {
                Some(SIGMOID) => {}
                other => {
                    return Err(Error::config(
                        path,
                        format!(
                            "metadata `{}` is {}: only sigmoid routing (2, DeepSeek-V3's) is \
                             supported",
                            key("expert_gating_func"),
                            other.map_or("missing (softmax)".to_string(), |v| v.to_string())
                        ),
                    ));
                }
            }
            let moe = MoeConfig {
                n_routed_experts,
                n_shared_experts: opt("expert_shared_count").unwrap_or(0),
                experts_per_token: req("expert_used_count")?,
                n_group: opt("expert_group_count").unwrap_or(1),
                topk_group: opt("expert_group_used_count").unwrap_or(1),
                routed_scaling_factor: g.meta_f64(&key("expert_weights_scale")).unwrap_or(1.0)
                    as f32,
                norm_topk_prob: g.meta_bool(&key("expert_weights_norm")).unwrap_or(false),
                moe_intermediate_size: req("expert_feed_forward_length")?,
                first_k_dense_replace: g.meta_u64(&key("leading_dense_block_count")).unwrap_or(0)
                    as usize,
            };
            moe.check_routing(path)?;
            Some(moe)
        }
    };
    Ok((yarn, Some(mla), moe))
}

/// The MLA and MoE settings of a `DeepseekV3ForCausalLM` config.
fn deepseek_parts(
    c: &HfConfig,
    yarn: Option<&YarnScaling>,
    path: &Path,
) -> Result<(Option<MlaConfig>, Option<MoeConfig>)> {
    let need = |v: Option<usize>, field: &str| {
        v.filter(|&v| v > 0).ok_or_else(|| {
            Error::config(
                path,
                format!("field `{field}` is missing or zero (DeepseekV3 needs it)"),
            )
        })
    };
    let nope = need(c.qk_nope_head_dim, "qk_nope_head_dim")?;
    let rope = need(c.qk_rope_head_dim, "qk_rope_head_dim")?;
    let mut softmax_scale = 1.0 / ((nope + rope) as f32).sqrt();
    if let Some(y) = yarn.filter(|y| y.mscale_all_dim != 0.0) {
        let m = yarn_mscale(y.factor, y.mscale_all_dim);
        softmax_scale *= m * m;
    }
    let mla = MlaConfig {
        q_lora_rank: c.q_lora_rank,
        kv_lora_rank: need(c.kv_lora_rank, "kv_lora_rank")?,
        qk_nope_head_dim: nope,
        qk_rope_head_dim: rope,
        v_head_dim: need(c.v_head_dim, "v_head_dim")?,
        softmax_scale,
    };
    let routed = c.n_routed_experts.unwrap_or(0);
    let moe = if routed == 0 {
        None
    } else {
        let moe = MoeConfig {
            n_routed_experts: routed,
            n_shared_experts: c.n_shared_experts.unwrap_or(0),
            experts_per_token: need(c.num_experts_per_tok, "num_experts_per_tok")?,
            n_group: c.n_group.unwrap_or(1).max(1),
            topk_group: c.topk_group.unwrap_or(1).max(1),
            routed_scaling_factor: c.routed_scaling_factor.unwrap_or(1.0),
            norm_topk_prob: c.norm_topk_prob.unwrap_or(true),
            moe_intermediate_size: need(c.moe_intermediate_size, "moe_intermediate_size")?,
            first_k_dense_replace: c.first_k_dense_replace.unwrap_or(0),
        };
        if let Some(t) = &c.topk_method
            && t != "noaux_tc"
        {
            return Err(Error::config(
                path,
                format!("topk_method `{t}` is not supported (DeepSeek-V3 uses `noaux_tc`)"),
            ));
        }
        if let Some(f) = &c.scoring_func
            && f != "sigmoid"
        {
            return Err(Error::config(
                path,
                format!("scoring_func `{f}` is not supported (DeepSeek-V3 uses `sigmoid`)"),
            ));
        }
        moe.check_routing(path)?;
        Some(moe)
    };
    Ok((Some(mla), moe))
}

#[derive(Deserialize)]
struct HfRopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    factor: Option<f32>,
    /// transformers >= 5 nests the base frequency here (`rope_parameters.rope_theta`).
    rope_theta: Option<f32>,
    low_freq_factor: Option<f32>,
    high_freq_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
    beta_fast: Option<f32>,
    beta_slow: Option<f32>,
    mscale: Option<f32>,
    mscale_all_dim: Option<f32>,
    attention_factor: Option<f32>,
}

#[derive(Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    rope_scaling: Option<HfRopeScaling>,
    /// transformers >= 5 writes `rope_parameters` in place of `rope_theta` + `rope_scaling`.
    rope_parameters: Option<HfRopeScaling>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    // DeepSeek-V3 / Kimi-K2.
    q_lora_rank: Option<usize>,
    kv_lora_rank: Option<usize>,
    qk_nope_head_dim: Option<usize>,
    qk_rope_head_dim: Option<usize>,
    v_head_dim: Option<usize>,
    rope_interleave: Option<bool>,
    n_routed_experts: Option<usize>,
    n_shared_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    routed_scaling_factor: Option<f32>,
    norm_topk_prob: Option<bool>,
    moe_intermediate_size: Option<usize>,
    first_k_dense_replace: Option<usize>,
    topk_method: Option<String>,
    scoring_func: Option<String>,
}
