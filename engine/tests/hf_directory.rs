//! Loading a Hugging Face model directory (config.json, tokenizer.json, sharded safetensors with an
//! index): the default model is written out as one, in HF's tensor layout (Q/K rows un-permuted), and
//! must give the same logits as the GGUF it came from.

mod common;

use std::collections::HashMap;
use std::path::Path;

use kiln::backend::Precision;
use kiln::backend::cpu::CpuBackend;
use kiln::generate::{GenerateOptions, SingleSequence};
use kiln::load::load_model;
use kiln::weights::gguf::GgufFile;

/// HF row order of a GGUF Q/K matrix: ggml's converter interleaved each head's two halves.
fn unpermute(w: &[f32], rows: usize, cols: usize, n_heads: usize) -> Vec<f32> {
    let hd = rows / n_heads;
    let mut out = vec![0f32; w.len()];
    for h in 0..n_heads {
        for i in 0..hd / 2 {
            for j in 0..2 {
                let src = h * hd + 2 * i + j;
                let dst = h * hd + j * (hd / 2) + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn hf_name(gguf: &str) -> String {
    if gguf == "token_embd.weight" {
        return "model.embed_tokens.weight".into();
    }
    if gguf == "output_norm.weight" {
        return "model.norm.weight".into();
    }
    let rest = gguf.strip_prefix("blk.").expect("layer tensor");
    let (layer, role) = rest.split_once('.').expect("layer.role");
    let hf = match role {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        other => panic!("unexpected tensor {other}"),
    };
    format!("model.layers.{layer}.{hf}")
}

fn write_hf_dir(gguf_path: &Path, dir: &Path) {
    let g = GgufFile::open(gguf_path).expect("open gguf");
    let cfg = kiln::model::ModelConfig::from_gguf(&g).expect("config");
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for t in &g.tensors {
        let v = g.view(&t.name).expect("view");
        let mut data = v.to_f32();
        if t.name.ends_with("attn_q.weight") || t.name.ends_with("attn_k.weight") {
            let (rows, cols) = v.matrix_shape().expect("matrix");
            let heads = if t.name.ends_with("attn_q.weight") {
                cfg.n_heads
            } else {
                cfg.n_kv_heads
            };
            data = unpermute(&data, rows, cols, heads);
        }
        let bytes: Vec<u8> = data.iter().flat_map(|f| f.to_le_bytes()).collect();
        tensors.push((hf_name(&t.name), v.shape.clone(), bytes));
    }
    // Two shards plus the index, as large checkpoints ship.
    let half = tensors.len() / 2;
    let mut weight_map = HashMap::new();
    for (shard, part) in [(1, &tensors[..half]), (2, &tensors[half..])] {
        let file = format!("model-0000{shard}-of-00002.safetensors");
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = part
            .iter()
            .map(|(n, shape, b)| {
                weight_map.insert(n.clone(), file.clone());
                let view =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                        .expect("tensor view");
                (n.clone(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file)).expect("write shard");
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("index");
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_context,
        "tie_word_embeddings": true,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
    let tok = kiln::tokenizer::Tokenizer::from_gguf(&g).expect("tokenizer");
    std::fs::write(dir.join("tokenizer.json"), tok.to_json().expect("json"))
        .expect("tokenizer.json");
    let tok_config = serde_json::json!({
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "chat_template": g.meta_str("tokenizer.chat_template").expect("template"),
    });
    std::fs::write(dir.join("tokenizer_config.json"), tok_config.to_string())
        .expect("tokenizer_config");
}

#[test]
fn hf_directory_matches_gguf() {
    let gguf = common::smollm2();
    let dir = std::env::temp_dir().join(format!("kiln-hf-dir-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    write_hf_dir(&gguf, &dir);
    let from_gguf =
        load_model(CpuBackend::new(), &gguf, Precision::Exact, |_, _| {}).expect("gguf");
    let from_hf = load_model(CpuBackend::new(), &dir, Precision::Exact, |_, _| {}).expect("hf dir");
    assert_eq!(
        from_hf.config().rope_layout,
        kiln::model::RopeLayout::HalfSplit
    );
    assert_eq!(from_hf.tokenizer.eos_ids, from_gguf.tokenizer.eos_ids);
    let text = "<|im_start|>user\nName three prime numbers.<|im_end|>\n<|im_start|>assistant\n";
    let prompt = from_gguf.tokenizer.encode(text, true).expect("encode");
    assert_eq!(
        from_hf.tokenizer.encode(text, true).expect("encode"),
        prompt
    );
    let opts = GenerateOptions {
        max_tokens: 12,
        ignore_eos: true,
        sampling: kiln::sampling::SamplingParams {
            top_logprobs: 5,
            ..Default::default()
        },
        ..Default::default()
    };
    let a = SingleSequence::new(&from_gguf, 128)
        .expect("sequence")
        .generate(&from_gguf, &prompt, &opts, |_| {})
        .expect("gen");
    let b = SingleSequence::new(&from_hf, 128)
        .expect("sequence")
        .generate(&from_hf, &prompt, &opts, |_| {})
        .expect("gen");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(a.ids(), b.ids());
    for (x, y) in a.output.iter().zip(&b.output) {
        for ((ta, la), (tb, lb)) in x.top.iter().zip(&y.top) {
            assert_eq!(ta, tb);
            assert!((la - lb).abs() < 1e-3, "logprob {la} vs {lb}");
        }
    }
}
