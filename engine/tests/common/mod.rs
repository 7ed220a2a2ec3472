//! Shared helpers for integration tests: where the real models are, and fixture loading.
#![allow(dead_code)]

use std::path::PathBuf;

use kiln::backend::cpu::CpuBackend;
use kiln::backend::{Backend, SeqSpan};
use kiln::catalog::{CatalogEntry, DEFAULT_MODEL, QWEN_CODER};
use kiln::kv_cache::{BlockAllocator, SeqBlocks};
use kiln::load::LoadedModel;
use kiln::model::{ForwardBatch, Workspace};

pub mod cli;
pub mod server;
#[allow(dead_code)]
pub mod steps;

/// Hands `peers` one step: a two-token prefill of one sequence in KV block 0 (what the
/// tensor-parallel failure tests need to bring the peers to their first collective).
pub fn submit_two_token_step(peers: &kiln::parallel::TpPeers) {
    let table = [0u32];
    let spans = [SeqSpan {
        first_token: 0,
        n_tokens: 2,
        start_pos: 0,
        block_table: &table,
        tree: None,
    }];
    let batch = ForwardBatch {
        tokens: &[1, 2],
        positions: &[0, 1],
        spans: &spans,
        logit_rows: &[1],
        fill: None,
    };
    peers.submit(&batch).expect("submit");
}

/// The cached model file; fails with the command that fetches it (these tests need real weights).
pub fn model_path(entry: &CatalogEntry) -> PathBuf {
    let cache = match std::env::var_os("KILN_CACHE_DIR") {
        Some(p) => PathBuf::from(p),
        None => kiln::catalog::cache_dir(
            std::env::var("XDG_CACHE_HOME").ok().as_deref(),
            std::env::var("HOME").ok().as_deref(),
        ),
    };
    match entry.require(&cache) {
        Ok(p) => p,
        Err(e) => {
            panic!("{e}\n(the real-model tests need `cargo run --release -- fetch --model all`)")
        }
    }
}

pub fn smollm2() -> PathBuf {
    model_path(&DEFAULT_MODEL)
}

/// The default model's tokenizer, read from its GGUF file.
pub fn smollm2_tokenizer() -> kiln::tokenizer::Tokenizer {
    let g = kiln::weights::gguf::GgufFile::open(smollm2()).expect("gguf");
    kiln::tokenizer::Tokenizer::from_gguf(&g).expect("tokenizer")
}

pub fn qwen() -> PathBuf {
    model_path(&QWEN_CODER)
}

pub fn fixture(name: &str) -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// A tiny random model written by `tests/reference/make_tiny_models.py`.
pub fn tiny_fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tiny")
        .join(name)
}

/// A copy of a tiny model directory with a tokenizer.json (the tiny models have none; any
/// byte-level tokenizer serves, the tests feed token ids).
pub fn tiny_with_tokenizer(name: &str) -> PathBuf {
    // One directory per call: tests run in parallel threads, and one rewriting a file another
    // is reading would hand it a half-written tokenizer.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dst = std::env::temp_dir().join(format!("kiln-tiny-{}-{call}-{name}", std::process::id()));
    std::fs::create_dir_all(&dst).expect("temp dir");
    for e in std::fs::read_dir(tiny_fixture_dir(name))
        .expect("fixture dir")
        .flatten()
    {
        std::fs::copy(e.path(), dst.join(e.file_name())).expect("copy");
    }
    let g = kiln::weights::gguf::GgufFile::open(smollm2()).expect("gguf");
    let tok = kiln::tokenizer::Tokenizer::from_gguf(&g).expect("tokenizer");
    std::fs::write(dst.join("tokenizer.json"), tok.to_json().expect("json")).expect("write");
    dst
}

/// `n` greedy tokens after `prompt`, through the paged cache (prefill, then one-token steps).
pub fn greedy_ids(m: &LoadedModel<CpuBackend>, prompt: &[u32], n: usize) -> Vec<u32> {
    let opts = kiln::generate::GenerateOptions {
        max_tokens: n,
        ignore_eos: true,
        ..Default::default()
    };
    kiln::generate::SingleSequence::new(m, 64)
        .expect("sequence")
        .generate(m, prompt, &opts, |_| {})
        .expect("generate")
        .ids()
}

/// A minimal GGUF v3 writer for error-path tests: string and u32 metadata, raw tensor bytes.
pub enum Meta<'a> {
    Str(&'a str),
    U32(u32),
}

pub fn write_gguf(
    path: &std::path::Path,
    meta: &[(&str, Meta<'_>)],
    tensors: &[(&str, &[u64], u32, &[u8])],
) {
    let mut b = Vec::new();
    let put_str = |b: &mut Vec<u8>, s: &str| {
        b.extend_from_slice(&(s.len() as u64).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
    };
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    b.extend_from_slice(&(meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        put_str(&mut b, k);
        match v {
            Meta::Str(s) => {
                b.extend_from_slice(&8u32.to_le_bytes());
                put_str(&mut b, s);
            }
            Meta::U32(x) => {
                b.extend_from_slice(&4u32.to_le_bytes());
                b.extend_from_slice(&x.to_le_bytes());
            }
        }
    }
    let mut offset = 0u64;
    for (name, dims, ty, data) in tensors {
        put_str(&mut b, name);
        b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in *dims {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(&offset.to_le_bytes());
        offset += (data.len() as u64).div_ceil(32) * 32;
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for (_, _, _, data) in tensors {
        b.extend_from_slice(data);
        while b.len() % 32 != 0 {
            b.push(0);
        }
    }
    std::fs::write(path, b).expect("write gguf");
}

/// Blocks of 16 for one sequence of `n` tokens, and a KV store of `layout` holding just them.
pub fn paged_sequence(
    m: &LoadedModel<CpuBackend>,
    n: usize,
    layout: kiln::backend::KvLayout,
) -> (SeqBlocks, kiln::backend::cpu::CpuKvStore) {
    let c = m.config();
    let mut alloc = BlockAllocator::new(n.div_ceil(16), 16);
    let mut seq = SeqBlocks::default();
    seq.reserve(&mut alloc, n).expect("kv");
    let kv = m
        .backend
        .kv_store(
            c.n_layers,
            n.div_ceil(16),
            16,
            c.kv_width(),
            layout,
            m.model.precision,
        )
        .expect("backend op");
    (seq, kv)
}

/// One forward of `tokens` from an empty paged cache; the logits of `rows`.
pub fn logits_at(m: &LoadedModel<CpuBackend>, tokens: &[u32], rows: &[usize]) -> Vec<Vec<f32>> {
    let c = m.config();
    let n = tokens.len();
    let (seq, mut kv) = paged_sequence(m, n, c.kv_layout());
    let positions: Vec<usize> = (0..n).collect();
    let spans = [SeqSpan {
        first_token: 0,
        n_tokens: n,
        start_pos: 0,
        block_table: &seq.table,
        tree: None,
    }];
    let batch = ForwardBatch {
        tokens,
        positions: &positions,
        spans: &spans,
        logit_rows: rows,
        fill: None,
    };
    let out = m
        .model
        .forward(
            &m.backend,
            &mut kv,
            &batch,
            &mut Workspace::new(&m.backend).expect("workspace"),
        )
        .expect("forward");
    out.chunks(c.vocab_size).map(|r| r.to_vec()).collect()
}

/// Largest |ours - reference|, relative to the largest |reference|.
pub fn rel_err(ours: &[f32], reference: &[f32]) -> f32 {
    let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
    ours.iter()
        .zip(reference)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

/// A small-vocabulary EAGLE-3 head ([`write_small_vocab_draft`]) drafting the first token of each
/// of `texts`, in a temporary directory named after `tag` (the caller removes it).
#[allow(dead_code)]
pub fn small_vocab_draft(tag: &str, texts: &[&str]) -> std::path::PathBuf {
    let tok = smollm2_tokenizer();
    let tokens: Vec<u32> = texts
        .iter()
        .map(|t| tok.encode(t, false).expect("encode")[0])
        .collect();
    let dir = std::env::temp_dir().join(format!("kiln-{tag}-{}", std::process::id()));
    write_small_vocab_draft(&dir, &tokens);
    dir
}

/// `kiln serve` flags for EAGLE-3 tree speculation with `draft`: top-3 over 3 steps, 8 nodes.
#[allow(dead_code)]
pub fn eagle3_tree_flags(draft: &str) -> [&str; 10] {
    [
        "--speculative-algorithm",
        "eagle3",
        "--speculative-draft-model-path",
        draft,
        "--speculative-eagle-topk",
        "3",
        "--speculative-num-steps",
        "3",
        "--speculative-num-draft-tokens",
        "8",
    ]
}

/// An EAGLE-3 draft head for SmolLM2 written at test time: random small weights, and a draft
/// vocabulary of just `tokens`, so every draft proposes one of them. With "," and list-like
/// prompts the target often agrees, so drafts are both accepted (the draft-extend then covers
/// several positions) and rejected — what exactness needs exercised.
pub fn write_small_vocab_draft(dir: &std::path::Path, tokens: &[u32]) {
    write_draft(dir, tokens, &DraftShape::SMOLLM2);
}

/// The shape of a test-time EAGLE-3 head: its layer, and the target it reads.
#[allow(dead_code)]
pub struct DraftShape {
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The target's vocabulary.
    pub vocab: usize,
    /// The target layers it reads.
    pub aux_layers: [usize; 3],
}

#[allow(dead_code)]
impl DraftShape {
    /// For SmolLM2-135M.
    pub const SMOLLM2: DraftShape = DraftShape {
        hidden: 576,
        intermediate: 64,
        heads: 9,
        kv_heads: 3,
        head_dim: 64,
        vocab: 49152,
        aux_layers: [2, 15, 27],
    };
    /// For the tiny DeepSeek-V3 fixture (4 heads: it splits over 2 and 4 ranks as its target).
    pub const TINY_DEEPSEEK: DraftShape = DraftShape {
        hidden: 64,
        intermediate: 128,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        vocab: 512,
        aux_layers: [0, 1, 2],
    };
}

/// A [`write_small_vocab_draft`] head of another `shape`.
pub fn write_draft(dir: &std::path::Path, tokens: &[u32], shape: &DraftShape) {
    use safetensors::tensor::{Dtype, TensorView};
    let (h, inter, heads, kv_heads, hd) = (
        shape.hidden,
        shape.intermediate,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
    );
    std::fs::create_dir_all(dir).expect("draft dir");
    let config = serde_json::json!({
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": tokens.len(),
        "eagle_aux_hidden_state_layer_ids": shape.aux_layers,
        "norm_before_residual": false,
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": h, "intermediate_size": inter,
            "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": hd, "vocab_size": shape.vocab, "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0, "max_position_embeddings": 8192
        }
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut random = |n: usize, scale: f32, offset: f32| -> Vec<u8> {
        (0..n)
            .flat_map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                (offset + scale * u).to_le_bytes()
            })
            .collect()
    };
    let (q, kv) = (heads * hd, kv_heads * hd);
    let shapes: Vec<(&str, Vec<usize>, f32, f32)> = vec![
        ("fc.weight", vec![h, 3 * h], 0.05, 0.0),
        ("layers.0.input_layernorm.weight", vec![h], 0.2, 1.0),
        ("layers.0.hidden_norm.weight", vec![h], 0.2, 1.0),
        (
            "layers.0.self_attn.q_proj.weight",
            vec![q, 2 * h],
            0.05,
            0.0,
        ),
        (
            "layers.0.self_attn.k_proj.weight",
            vec![kv, 2 * h],
            0.05,
            0.0,
        ),
        (
            "layers.0.self_attn.v_proj.weight",
            vec![kv, 2 * h],
            0.05,
            0.0,
        ),
        ("layers.0.self_attn.o_proj.weight", vec![h, q], 0.05, 0.0),
        (
            "layers.0.post_attention_layernorm.weight",
            vec![h],
            0.2,
            1.0,
        ),
        ("layers.0.mlp.gate_proj.weight", vec![inter, h], 0.05, 0.0),
        ("layers.0.mlp.up_proj.weight", vec![inter, h], 0.05, 0.0),
        ("layers.0.mlp.down_proj.weight", vec![h, inter], 0.05, 0.0),
        ("norm.weight", vec![h], 0.2, 1.0),
        ("lm_head.weight", vec![tokens.len(), h], 0.05, 0.0),
    ];
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = shapes
        .into_iter()
        .map(|(n, s, scale, off)| {
            let len = s.iter().product();
            (n.to_string(), s, random(len, scale, off))
        })
        .collect();
    // d2t: target id = draft id + d2t[draft id].
    let d2t: Vec<u8> = tokens
        .iter()
        .enumerate()
        .flat_map(|(i, &t)| (t as i64 - i as i64).to_le_bytes())
        .collect();
    let mut views: Vec<(String, TensorView)> = data
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).expect("view"),
            )
        })
        .collect();
    views.push((
        "d2t".into(),
        TensorView::new(Dtype::I64, vec![tokens.len()], &d2t).expect("view"),
    ));
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("write");
}
