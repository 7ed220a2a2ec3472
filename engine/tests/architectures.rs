//! Every supported architecture against transformers, on tiny random models written by
//! `tests/reference/make_tiny_models.py`: Llama 3 (llama3 RoPE scaling, untied head), Mistral, Qwen2
//! (QKV bias), Qwen3 (Q/K norm, head_dim != hidden / heads), and a bf16 model in several
//! safetensors shards.

mod common;

use std::path::Path;

use common::tiny_with_tokenizer as with_tokenizer;

use kiln::backend::cpu::CpuBackend;
use kiln::backend::{Backend, Precision, SeqSpan};
use kiln::generate::{GenerateOptions, SingleSequence};
use kiln::kv_cache::{BlockAllocator, SeqBlocks};
use kiln::load::{LoadedModel, load_model};
use kiln::model::{ForwardBatch, Workspace};

fn logits_at(m: &LoadedModel<CpuBackend>, tokens: &[u32], rows: &[usize]) -> Vec<Vec<f32>> {
    let c = m.config();
    let n = tokens.len();
    let mut alloc = BlockAllocator::new(n.div_ceil(16), 16);
    let mut seq = SeqBlocks::default();
    seq.reserve(&mut alloc, n).expect("kv");
    let mut kv = m
        .backend
        .kv_store(c.n_layers, n.div_ceil(16), 16, c.kv_width());
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
    };
    let out = m
        .model
        .forward(&m.backend, &mut kv, &batch, &mut Workspace::new(&m.backend))
        .expect("forward");
    out.chunks(c.vocab_size).map(|r| r.to_vec()).collect()
}

fn rel_err(ours: &[f32], reference: &[f32]) -> f32 {
    let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
    ours.iter()
        .zip(reference)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

fn check(name: &str, dir: &Path, case: &serde_json::Value) {
    let ids = |k: &str| -> Vec<u32> { serde_json::from_value(case[k].clone()).expect("ids") };
    let floats = |k: &str| -> Vec<f32> { serde_json::from_value(case[k].clone()).expect("floats") };
    let prompt = ids("prompt_ids");
    let greedy = ids("greedy_ids");
    let margins = floats("margins");
    let m = load_model(CpuBackend::new(), dir, Precision::Exact, |_, _| {}).expect("load");
    let got = logits_at(&m, &prompt, &[10, prompt.len() - 1]);
    let (mid, last) = (
        rel_err(&got[0], &floats("mid_logits")),
        rel_err(&got[1], &floats("last_logits")),
    );
    assert!(
        mid < 1e-4 && last < 1e-4,
        "{name}: logit errors {mid:e} (pos 10), {last:e} (last)"
    );
    let opts = GenerateOptions {
        max_tokens: greedy.len(),
        ignore_eos: true,
        ..Default::default()
    };
    let out = SingleSequence::new(&m, 64)
        .generate(&m, &prompt, &opts, |_| {})
        .expect("generate")
        .ids();
    let trusted = margins.iter().take_while(|&&g| g > 1e-3).count();
    assert_eq!(out[..trusted], greedy[..trusted], "{name}: greedy");
}

#[test]
fn tiny_models_match_transformers() {
    let f = common::fixture("tiny-models.json");
    let models = f["models"].as_array().expect("models");
    assert!(models.len() >= 5);
    for case in models {
        let name = case["name"].as_str().expect("name");
        let dir = with_tokenizer(name);
        check(name, &dir, case);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
