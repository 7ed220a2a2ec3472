//! Every supported architecture against transformers, on tiny random models written by
//! `tests/reference/make_tiny_models.py`: Llama 3 (llama3 RoPE scaling, untied head), Mistral, Qwen2
//! (QKV bias), Qwen3 (Q/K norm, head_dim != hidden / heads), and a bf16 model in several
//! safetensors shards.

mod common;

use std::path::Path;

use common::tiny_with_tokenizer as with_tokenizer;

use kiln::backend::Precision;
use kiln::backend::cpu::CpuBackend;
use kiln::load::load_model;

fn check(name: &str, dir: &Path, case: &serde_json::Value) {
    let ids = |k: &str| -> Vec<u32> { serde_json::from_value(case[k].clone()).expect("ids") };
    let floats = |k: &str| -> Vec<f32> { serde_json::from_value(case[k].clone()).expect("floats") };
    let prompt = ids("prompt_ids");
    let greedy = ids("greedy_ids");
    let margins = floats("margins");
    let m = load_model(CpuBackend::new(), dir, Precision::Exact, |_, _| {}).expect("load");
    let got = common::logits_at(&m, &prompt, &[10, prompt.len() - 1]);
    let (mid, last) = (
        common::rel_err(&got[0], &floats("mid_logits")),
        common::rel_err(&got[1], &floats("last_logits")),
    );
    assert!(
        mid < 1e-4 && last < 1e-4,
        "{name}: logit errors {mid:e} (pos 10), {last:e} (last)"
    );
    let out = common::greedy_ids(&m, &prompt, greedy.len());
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
