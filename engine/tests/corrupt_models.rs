//! Broken model files are refused before anything is sized from them, with the file and the
//! field named: a layer count of a billion, epsilons and RoPE bases that are zero, negative or
//! not numbers, and special token ids outside the vocabulary. Each case edits one field of a
//! tiny real model, so the refusal is the field's and nothing else's.

mod common;

use kiln::backend::Precision;
use kiln::backend::cpu::CpuBackend;
use kiln::load::load_model;

/// Loads the tiny Llama 3 with `edit` applied to its config.json (and generation_config.json,
/// when given); returns the error text.
fn refusal(
    edit: impl FnOnce(&mut serde_json::Value),
    generation: Option<serde_json::Value>,
) -> String {
    let dir = common::tiny_with_tokenizer("llama3");
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    edit(&mut config);
    std::fs::write(&path, config.to_string()).expect("write");
    if let Some(g) = generation {
        std::fs::write(dir.join("generation_config.json"), g.to_string()).expect("write");
    }
    match load_model(
        CpuBackend::with_threads(1),
        &dir,
        Precision::Exact,
        |_, _| {},
    ) {
        Ok(_) => panic!("a broken config loaded: {config}"),
        Err(e) => e.to_string(),
    }
}

fn set(field: &'static str, value: serde_json::Value) -> impl FnOnce(&mut serde_json::Value) {
    move |c| c[field] = value
}

#[test]
fn the_unedited_model_loads() {
    let dir = common::tiny_with_tokenizer("llama3");
    load_model(
        CpuBackend::with_threads(1),
        &dir,
        Precision::Exact,
        |_, _| {},
    )
    .expect("load");
}

#[test]
fn absurd_sizes_are_refused_before_any_allocation() {
    let e = refusal(set("num_hidden_layers", 1_000_000_000.into()), None);
    assert!(e.contains("layers") && e.contains("1000000000"), "{e}");
    assert!(e.contains("config.json"), "the file is named: {e}");
    let e = refusal(set("max_position_embeddings", (1u64 << 40).into()), None);
    assert!(e.contains("context length"), "{e}");
}

#[test]
fn hyper_parameters_must_be_finite_and_positive() {
    for (eps, why) in [(0.0, "zero"), (-1e-5, "negative"), (2.0, "one or more")] {
        let e = refusal(set("rms_norm_eps", eps.into()), None);
        assert!(e.contains("rms_norm_eps"), "{why}: {e}");
    }
    let e = refusal(|c| c["rope_parameters"]["rope_theta"] = 0.0.into(), None);
    assert!(e.contains("rope_theta"), "{e}");
}

#[test]
fn special_tokens_outside_the_vocabulary_are_refused() {
    let e = refusal(
        |_| {},
        Some(serde_json::json!({ "eos_token_id": [2, 99999] })),
    );
    assert!(e.contains("eos_token_id 99999") && e.contains("512"), "{e}");
}
