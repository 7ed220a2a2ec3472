//! The EAGLE-3 draft head (Li et al. 2025, arXiv 2503.01840): one Llama decoder layer that reads
//! the target's residual stream at a few layers (fused by `fc`) together with the embedding of the
//! next token, and predicts the token after it over a reduced draft vocabulary (`d2t` maps draft
//! ids to target ids). Its own output hidden state feeds the next draft step.
//!
//! Both public checkpoint layouts load: SGLang/EAGLE (`midlayer.*`, a flat Llama config with
//! `eagle_config`) and vLLM/speculators (`layers.0.*`, a speculators config with a nested
//! `transformer_layer_config`). The forward is tested against speculators' `Eagle3DraftModel`.
//!
//! Under tensor parallelism every rank holds a shard of the head as of the target
//! ([`Eagle3Draft::load_shard`]): `fc` split by its input columns, the layer's heads and MLP
//! columns as the target's layers, the LM head by draft-vocabulary slices. Each draft step then
//! reads 1/world of the head's weights per GPU instead of all of them on rank 0 while the others
//! wait, for three all-reduces (`fc`, attention, MLP) and one gather of the logits.

use std::path::Path;

use serde_json::Value;

use std::ops::Range;

use super::config::ModelConfig;
use super::llama::{gather_vocab_slices, rope_spec};
use crate::backend::{Backend, Precision, RopeSpec, SeqSpan};
use crate::error::{Error, Result};
use crate::parallel::{Communicator, Shard};
use crate::weights::hf::HfDir;

/// Which of the two public layouts a checkpoint uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftLayout {
    /// SGLang / the EAGLE authors: `midlayer.*`.
    Sglang,
    /// vLLM / the `speculators` library: `layers.0.*`.
    Speculators,
}

/// Where the draft reads the target: the residual stream entering these target layers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AuxLayers {
    /// Layer ids given by the checkpoint, already in kiln's "entering layer i" convention
    /// (`n_layers` = the last layer's output).
    Given(Vec<usize>),
    /// Not given: `[2, L/2, L-3]` of the target (both SGLang's and speculators' default).
    Default,
}

impl AuxLayers {
    /// The layer ids for a target of `n_layers` layers, checked against it.
    pub fn resolve(&self, n_layers: usize, path: &Path) -> Result<Vec<usize>> {
        let ids = match self {
            AuxLayers::Given(ids) => ids.clone(),
            AuxLayers::Default if n_layers >= 4 => vec![2, n_layers / 2, n_layers - 3],
            AuxLayers::Default => {
                return Err(Error::config(
                    path,
                    format!(
                        "the target has {n_layers} layers, too few for the default aux layers \
                         [2, L/2, L-3]; set eagle_aux_hidden_state_layer_ids"
                    ),
                ));
            }
        };
        if let Some(bad) = ids.iter().find(|&&i| i > n_layers) {
            return Err(Error::config(
                path,
                format!(
                    "eagle_aux_hidden_state_layer_ids names layer {bad}; the target has {n_layers}"
                ),
            ));
        }
        Ok(ids)
    }
}

/// An EAGLE-3 draft checkpoint's configuration.
#[derive(Clone, Debug)]
pub struct Eagle3Config {
    /// The decoder layer's shape (hidden size, heads, RoPE) as a one-layer Llama config.
    pub layer: ModelConfig,
    pub draft_vocab_size: usize,
    pub aux_layers: AuxLayers,
    /// The attention residual is the normed hidden state instead of the raw one.
    pub norm_before_residual: bool,
    pub layout: DraftLayout,
}

fn field<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.get(name).filter(|x| !x.is_null())
}

fn ids_of(v: &Value, name: &str, path: &Path) -> Result<Option<Vec<usize>>> {
    let Some(list) = field(v, name) else {
        return Ok(None);
    };
    let bad = || Error::config(path, format!("field `{name}` must be a list of layer ids"));
    let items = list.as_array().ok_or_else(bad)?;
    items
        .iter()
        .map(|x| x.as_u64().map(|i| i as usize).ok_or_else(bad))
        .collect::<Result<Vec<_>>>()
        .map(Some)
}

fn flag(v: &Value, name: &str) -> bool {
    field(v, name).and_then(Value::as_bool).unwrap_or(false)
}

impl Eagle3Config {
    /// Reads `dir/config.json` in either layout.
    pub fn from_dir(dir: &Path) -> Result<Eagle3Config> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Error::config(&path, format!("invalid config.json: {e}")))?;
        Self::from_json(&v, &path)
    }

    pub fn from_json(v: &Value, path: &Path) -> Result<Eagle3Config> {
        // EAGLE 3.1 variants change the recurrence; refuse them by name rather than run them wrong.
        for unsupported in ["norm_before_fc", "fc_norm", "norm_output"] {
            if flag(v, unsupported) {
                return Err(Error::config(
                    path,
                    format!("field `{unsupported}` = true (an EAGLE 3.1 variant) is not supported"),
                ));
            }
        }
        let (layout, mut layer_json, aux_layers) =
            if let Some(inner) = field(v, "transformer_layer_config") {
                let ids = ids_of(v, "eagle_aux_hidden_state_layer_ids", path)?;
                (
                    DraftLayout::Speculators,
                    inner.clone(),
                    ids.map_or(AuxLayers::Default, AuxLayers::Given),
                )
            } else {
                // SGLang captures "the output of layer i", i.e. the residual entering layer i + 1.
                let ids = match field(v, "eagle_config") {
                    Some(e) => ids_of(e, "eagle_aux_hidden_state_layer_ids", path)?,
                    None => None,
                };
                (
                    DraftLayout::Sglang,
                    v.clone(),
                    ids.map_or(AuxLayers::Default, |ids| {
                        AuxLayers::Given(ids.iter().map(|i| i + 1).collect())
                    }),
                )
            };
        // The layer is a plain Llama layer whatever the checkpoint's architecture string says.
        if let Some(obj) = layer_json.as_object_mut() {
            obj.remove("architectures");
            obj.insert("model_type".into(), Value::String("llama".into()));
        }
        let layer = ModelConfig::from_hf_json(layer_json, path)?;
        let draft_vocab_size = match field(v, "draft_vocab_size") {
            None => layer.vocab_size,
            Some(x) => x.as_u64().map(|n| n as usize).ok_or_else(|| {
                Error::config(path, "field `draft_vocab_size` must be a positive integer")
            })?,
        };
        if draft_vocab_size == 0 || draft_vocab_size > layer.vocab_size {
            return Err(Error::config(
                path,
                format!(
                    "field `draft_vocab_size` = {draft_vocab_size} must be in 1..={}",
                    layer.vocab_size
                ),
            ));
        }
        Ok(Eagle3Config {
            layer,
            draft_vocab_size,
            aux_layers,
            norm_before_residual: flag(v, "norm_before_residual"),
            layout,
        })
    }
}

/// The tokens of one draft step and the rows it keeps (see [`Eagle3Draft::forward_batch`]).
#[derive(Clone, Copy)]
pub struct DraftBatch<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [usize],
    pub spans: &'a [SeqSpan<'a>],
    pub rows: &'a [usize],
}

/// Where a draft step's hidden-state input comes from.
pub enum DraftInput<'a, B: Backend> {
    /// The target's captured residual streams, one buffer per aux layer, a row per token.
    Target(&'a [B::Buffer]),
    /// The draft's own output hidden states from its previous step, a row per token.
    Own(&'a B::Buffer),
}

/// What one draft forward returns for its requested rows.
pub struct DraftOutput<B: Backend> {
    /// `rows x draft_vocab_size` logits.
    pub logits: Vec<f32>,
    /// `rows x hidden` output hidden states (before the final norm): the next step's input.
    pub hidden: B::Buffer,
}

/// Activation buffers reused across draft steps.
pub struct DraftWorkspace<B: Backend> {
    h: B::Buffer,
    /// This rank's columns of a captured stream (`fc` split by input columns).
    part: B::Buffer,
    tmp: B::Buffer,
    e: B::Buffer,
    en: B::Buffer,
    hn: B::Buffer,
    qkv: B::Buffer,
    attn: B::Buffer,
    x: B::Buffer,
    normed: B::Buffer,
    gate_up: B::Buffer,
    act: B::Buffer,
}

impl<B: Backend> DraftWorkspace<B> {
    pub fn new(b: &B) -> Result<Self> {
        let z = || b.buffer(0, 0);
        Ok(DraftWorkspace {
            h: z()?,
            part: z()?,
            tmp: z()?,
            e: z()?,
            en: z()?,
            hn: z()?,
            qkv: z()?,
            attn: z()?,
            x: z()?,
            normed: z()?,
            gate_up: z()?,
            act: z()?,
        })
    }
}

pub struct Eagle3Draft<B: Backend> {
    pub config: Eagle3Config,
    /// `fc` split by input columns, one part per aux layer: `fc · [a | b | c] = Σ fc_i · x_i`,
    /// so the captured streams never need concatenating. Under tensor parallelism each part is
    /// this rank's `fc_columns` of it (the partial sums meet in an all-reduce).
    fc: Vec<B::Matrix>,
    /// The columns of each captured stream this rank's `fc` parts read; `None`: all of them.
    fc_columns: Option<Range<usize>>,
    /// The draft's own embeddings; `None`: the target's.
    embed: Option<B::Matrix>,
    input_norm: B::Vector,
    hidden_norm: B::Vector,
    /// Q, K and V projections split the same way: the columns reading the normed embedding and
    /// the columns reading the normed hidden state.
    qkv_embed: B::Matrix,
    qkv_hidden: B::Matrix,
    o: B::Matrix,
    post_norm: B::Vector,
    gate_up: B::Matrix,
    down: B::Matrix,
    norm: B::Vector,
    lm_head: B::Matrix,
    /// This rank's slice of the draft vocabulary (its LM head rows); `None`: the whole head.
    vocab_slice: Option<Range<usize>>,
    /// Whether this is one rank's shard (its forward sums over the group); `false`: the whole
    /// head, also under tensor parallelism when the head does not divide across the ranks.
    split: bool,
    /// Query and KV heads this rank's shard of the layer holds.
    local_heads: usize,
    local_kv_heads: usize,
    /// Target id of each draft id.
    draft_to_target: Vec<u32>,
    rope: RopeSpec,
}

impl<B: Backend> Eagle3Draft<B> {
    /// Loads a draft directory for a target with `target` configuration.
    pub fn load(
        backend: &B,
        dir: &Path,
        target: &ModelConfig,
        precision: Precision,
    ) -> Result<Self> {
        Self::load_shard(backend, dir, target, precision, Shard::WHOLE)
    }

    /// Loads one tensor-parallel rank's part of a draft (see the module's note); run it with
    /// [`Eagle3Draft::forward_batch`] and the group's communicator on every rank of the group.
    pub fn load_shard(
        backend: &B,
        dir: &Path,
        target: &ModelConfig,
        precision: Precision,
        shard: Shard,
    ) -> Result<Self> {
        let config = Eagle3Config::from_dir(dir)?;
        let hf = HfDir::open(dir)?;
        let c = &config.layer;
        let h = c.hidden_size;
        let cfg_path = dir.join("config.json");
        if h != target.hidden_size || c.vocab_size != target.vocab_size {
            return Err(Error::config(
                &cfg_path,
                format!(
                    "draft hidden size {h} / vocab {} do not match the target's {} / {}",
                    c.vocab_size, target.hidden_size, target.vocab_size
                ),
            ));
        }
        let prefix = match config.layout {
            DraftLayout::Sglang => "midlayer.",
            DraftLayout::Speculators => "layers.0.",
        };
        let get = |name: &str, shape: &[usize]| -> Result<_> {
            let v = hf.view(name)?;
            v.expect_shape(shape)?;
            Ok(v)
        };
        let l = |role: &str| format!("{prefix}{role}");
        let fc = hf.view("fc.weight")?;
        let (fc_rows, fc_cols) = fc.matrix_shape()?;
        if fc_rows != h || fc_cols == 0 || !fc_cols.is_multiple_of(target.hidden_size) {
            return Err(Error::tensor(
                &fc.path,
                &fc.name,
                format!(
                    "shape [{fc_rows}, {fc_cols}]; expected [{h}, k * {}]",
                    target.hidden_size
                ),
            ));
        }
        let n_aux = fc_cols / target.hidden_size;
        // A head whose heads or MLP do not divide across the ranks runs whole on every rank
        // (each computes the same draft on its own, without collectives): as slow as a head
        // whole on rank 0, but it serves.
        let (shard, plan) = match shard.plan(&config.layer) {
            Ok(plan) => (shard, plan),
            Err(e) if shard.world > 1 => {
                if shard.rank == 0 {
                    tracing::warn!(
                        "{}: the EAGLE-3 head runs whole on every rank ({e})",
                        dir.display()
                    );
                }
                (Shard::WHOLE, Shard::WHOLE.plan(&config.layer)?)
            }
            Err(e) => return Err(Error::config(&cfg_path, e.to_string())),
        };
        let (w, rank) = (shard.world, shard.rank);
        let whole = w == 1;
        // Row and column slices of a stored matrix for this rank (the whole of it on one rank).
        let rows = |v: crate::weights::TensorView, r: Range<usize>| {
            let cols = v.matrix_shape()?.1;
            v.slice(r, 0..cols)
        };
        let th = target.hidden_size;
        let fc_columns =
            (!whole && th.is_multiple_of(w)).then(|| rank * th / w..(rank + 1) * th / w);
        let aux = config.aux_layers.resolve(target.n_layers, &cfg_path)?;
        if aux.len() != n_aux {
            return Err(Error::config(
                &cfg_path,
                format!(
                    "{} aux layers configured, but fc.weight reads {n_aux} hidden states",
                    aux.len()
                ),
            ));
        }
        let own = fc_columns.clone().unwrap_or(0..th);
        let fc = (0..n_aux)
            .map(|i| {
                let cols = i * th + own.start..i * th + own.end;
                backend.draft_matrix(&[fc.slice(0..h, cols)?], precision)
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = if hf.has_tensor("embed_tokens.weight") {
            let v = get("embed_tokens.weight", &[c.vocab_size, h])?;
            Some(backend.embedding(&[v], precision)?)
        } else {
            None
        };
        let (qw, kvw) = (c.q_width(), c.kv_width());
        let d = c.head_dim;
        let q_rows = plan.q_heads.start * d..plan.q_heads.end * d;
        let kv_rows = plan.kv_heads.start * d..plan.kv_heads.end * d;
        let q = get(&l("self_attn.q_proj.weight"), &[qw, 2 * h])?;
        let k = get(&l("self_attn.k_proj.weight"), &[kvw, 2 * h])?;
        let v = get(&l("self_attn.v_proj.weight"), &[kvw, 2 * h])?;
        let half = |cols: Range<usize>| -> Result<B::Matrix> {
            backend.draft_matrix(
                &[
                    q.slice(q_rows.clone(), cols.clone())?,
                    k.slice(kv_rows.clone(), cols.clone())?,
                    v.slice(kv_rows.clone(), cols)?,
                ],
                precision,
            )
        };
        let inter = c.intermediate_size;
        let own_inter = plan.intermediate.clone();
        let dv = config.draft_vocab_size;
        let vocab_slice =
            (!whole && dv.is_multiple_of(w)).then(|| rank * dv / w..(rank + 1) * dv / w);
        let draft_to_target: Vec<u32> = if hf.has_tensor("d2t") {
            let d2t = hf.ints("d2t")?;
            if d2t.len() != dv {
                return Err(Error::tensor(
                    &cfg_path,
                    "d2t",
                    format!("has {} entries; draft_vocab_size is {dv}", d2t.len()),
                ));
            }
            d2t.iter()
                .enumerate()
                .map(|(i, &off)| {
                    let t = i as i64 + off;
                    u32::try_from(t)
                        .ok()
                        .filter(|&t| (t as usize) < c.vocab_size)
                        .ok_or_else(|| {
                            Error::tensor(
                                &cfg_path,
                                "d2t",
                                format!("maps draft id {i} to {t}, outside the target vocabulary"),
                            )
                        })
                })
                .collect::<Result<_>>()?
        } else if dv == c.vocab_size {
            (0..dv as u32).collect()
        } else {
            return Err(Error::tensor(
                &cfg_path,
                "d2t",
                "is required when draft_vocab_size differs from the vocabulary",
            ));
        };
        Ok(Eagle3Draft {
            fc,
            embed,
            input_norm: backend.vector(&get(&l("input_layernorm.weight"), &[h])?)?,
            hidden_norm: backend.vector(&get(&l("hidden_norm.weight"), &[h])?)?,
            qkv_embed: half(0..h)?,
            qkv_hidden: half(h..2 * h)?,
            o: backend.draft_matrix(
                &[get(&l("self_attn.o_proj.weight"), &[h, qw])?.slice(0..h, q_rows.clone())?],
                precision,
            )?,
            post_norm: backend.vector(&get(&l("post_attention_layernorm.weight"), &[h])?)?,
            gate_up: backend.draft_matrix(
                &[
                    rows(
                        get(&l("mlp.gate_proj.weight"), &[inter, h])?,
                        own_inter.clone(),
                    )?,
                    rows(
                        get(&l("mlp.up_proj.weight"), &[inter, h])?,
                        own_inter.clone(),
                    )?,
                ],
                precision,
            )?,
            down: backend.draft_matrix(
                &[get(&l("mlp.down_proj.weight"), &[h, inter])?.slice(0..h, own_inter)?],
                precision,
            )?,
            norm: backend.vector(&get("norm.weight", &[h])?)?,
            lm_head: backend.draft_matrix(
                &[rows(
                    get("lm_head.weight", &[dv, h])?,
                    vocab_slice.clone().unwrap_or(0..dv),
                )?],
                precision,
            )?,
            vocab_slice,
            fc_columns,
            split: !whole,
            local_heads: plan.q_heads.len(),
            local_kv_heads: plan.kv_heads.len(),
            draft_to_target,
            rope: rope_spec(c, None)?,
            config: Eagle3Config {
                aux_layers: AuxLayers::Given(aux),
                ..config
            },
        })
    }

    /// The target layers whose incoming residual stream this draft reads.
    pub fn aux_layers(&self) -> &[usize] {
        match &self.config.aux_layers {
            AuxLayers::Given(ids) => ids,
            AuxLayers::Default => &[],
        }
    }

    /// The KV width this rank stores for the draft's one layer (its KV heads only).
    pub fn kv_width(&self) -> usize {
        self.local_kv_heads * self.config.layer.head_dim
    }

    /// The target id of a draft id.
    pub fn target_id(&self, draft_id: usize) -> u32 {
        self.draft_to_target[draft_id]
    }

    /// One draft step for a batch: `tokens[t]` (target ids) is the token after the one whose
    /// hidden state `input` row t holds; its KV goes to the spans' slots in `kv` (layer 0).
    /// Returns logits and output hidden states for the batch's `rows`. `comm` is the group's when
    /// this draft is one tensor-parallel rank's shard ([`Eagle3Draft::load_shard`]): every rank of
    /// the group calls it with the same step, and every rank returns the whole logits and hidden
    /// states.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_batch(
        &self,
        backend: &B,
        target_embed: &B::Matrix,
        kv: &mut B::KvStore,
        batch: &DraftBatch<'_>,
        input: DraftInput<'_, B>,
        ws: &mut DraftWorkspace<B>,
        comm: Option<&dyn Communicator>,
    ) -> Result<DraftOutput<B>> {
        let DraftBatch {
            tokens,
            positions,
            spans,
            rows,
        } = *batch;
        let comm = comm.filter(|_| self.split);
        let reduce = |x: &mut B::Buffer| -> Result<()> {
            match comm {
                Some(comm) => backend.all_reduce_sum(x, comm),
                None => Ok(()),
            }
        };
        let (n_heads, n_kv_heads) = (self.local_heads, self.local_kv_heads);
        let c = &self.config.layer;
        let eps = c.rms_norm_eps;
        let n = tokens.len();
        if positions.len() != n {
            return Err(Error::InvalidRequest(
                "one position per draft token is required".into(),
            ));
        }
        let all: Vec<usize> = (0..n).collect();
        backend.begin_forward()?;
        match input {
            DraftInput::Target(aux) => {
                if aux.len() != self.fc.len() {
                    return Err(Error::InvalidRequest(format!(
                        "{} hidden-state inputs for a draft reading {}",
                        aux.len(),
                        self.fc.len()
                    )));
                }
                for (i, (x, w)) in aux.iter().zip(&self.fc).enumerate() {
                    let x = match &self.fc_columns {
                        Some(cols) => {
                            backend.reshape(&mut ws.part, n, cols.len())?;
                            backend.copy_columns(x, cols.start, &mut ws.part, 0, cols.len())?;
                            &ws.part
                        }
                        None => x,
                    };
                    if i == 0 {
                        backend.matmul(x, w, &mut ws.h)?;
                    } else {
                        backend.matmul(x, w, &mut ws.tmp)?;
                        backend.add(&mut ws.h, &ws.tmp)?;
                    }
                }
                if self.fc_columns.is_some() {
                    reduce(&mut ws.h)?;
                }
            }
            DraftInput::Own(x) => ws.h = backend.gather_rows(x, &all)?,
        }
        backend.embed(
            self.embed.as_ref().unwrap_or(target_embed),
            tokens,
            None,
            &mut ws.e,
        )?;
        backend.rms_norm(&ws.e, &self.input_norm, eps, &mut ws.en)?;
        backend.rms_norm(&ws.h, &self.hidden_norm, eps, &mut ws.hn)?;
        backend.matmul(&ws.en, &self.qkv_embed, &mut ws.qkv)?;
        backend.matmul(&ws.hn, &self.qkv_hidden, &mut ws.tmp)?;
        backend.add(&mut ws.qkv, &ws.tmp)?;
        let q_width = n_heads * c.head_dim;
        let meta = backend.step_meta(positions, spans)?;
        backend.rope(&mut ws.qkv, 0, n_heads, &meta, &self.rope)?;
        backend.rope(&mut ws.qkv, q_width, n_kv_heads, &meta, &self.rope)?;
        backend.attention(
            &ws.qkv,
            kv,
            0,
            &meta,
            n_heads,
            n_kv_heads,
            c.head_dim,
            &mut ws.attn,
        )?;
        backend.matmul(&ws.attn, &self.o, &mut ws.tmp)?;
        reduce(&mut ws.tmp)?;
        ws.x = if self.config.norm_before_residual {
            backend.gather_rows(&ws.hn, &all)?
        } else {
            backend.gather_rows(&ws.h, &all)?
        };
        backend.add(&mut ws.x, &ws.tmp)?;
        backend.rms_norm(&ws.x, &self.post_norm, eps, &mut ws.normed)?;
        backend.matmul(&ws.normed, &self.gate_up, &mut ws.gate_up)?;
        backend.silu_mul(&ws.gate_up, &mut ws.act)?;
        backend.matmul(&ws.act, &self.down, &mut ws.tmp)?;
        reduce(&mut ws.tmp)?;
        backend.add(&mut ws.x, &ws.tmp)?;
        let hidden = backend.gather_rows(&ws.x, rows)?;
        backend.rms_norm(&hidden, &self.norm, eps, &mut ws.normed)?;
        backend.matmul(&ws.normed, &self.lm_head, &mut ws.tmp)?;
        let local = backend.to_host(&ws.tmp)?;
        let logits = match comm {
            Some(comm) => {
                // The step's collectives have all ended by now; whether they ended well is
                // known here.
                comm.end_step()?;
                match &self.vocab_slice {
                    // No rows kept (an extend where no sequence drafts next): nothing to gather,
                    // on every rank alike.
                    Some(slice) if !rows.is_empty() => {
                        gather_vocab_slices(&local, slice.len(), rows.len(), comm)?
                    }
                    _ => local,
                }
            }
            None => local,
        };
        Ok(DraftOutput { logits, hidden })
    }
}
