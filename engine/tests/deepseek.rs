//! The DeepSeek-V3 architecture (multi-head latent attention + mixture of experts, as DeepSeek-V3
//! and Kimi-K2 use it) against transformers' `DeepseekV3ForCausalLM`, on the tiny random models
//! written by `tests/reference/make_tiny_deepseek.py`: float32, block-FP8 (DeepSeek-V3's
//! checkpoint layout) and compressed-tensors INT4 experts (Kimi-K2-Thinking's). Logits at two
//! prompt positions, the greedy continuation through the paged cache (prefill, then one-token
//! decode steps over the cached latents), the router's decisions, and tensor parallelism
//! (heads and experts split over 2 and 4 rank threads, and over 8 on the 8-head pair) against the
//! whole model and transformers.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use kiln::backend::cpu::CpuBackend;
use kiln::backend::routing::route;
use kiln::backend::{KvLayout, Precision, SeqSpan};
use kiln::load::{LoadedModel, load_model, open_weights};
use kiln::model::mla::MlaForm;
use kiln::model::moe::route_spec;
use kiln::model::{ForwardBatch, Workspace};
use kiln::parallel::MoeSplit;
use kiln::parallel::tp::{GreedyRun, TpOptions, greedy};
use kiln::runner::Device;

fn fixture_dir(case: &serde_json::Value) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(case["dir"].as_str().expect("dir"))
}

fn ids(case: &serde_json::Value, k: &str) -> Vec<u32> {
    serde_json::from_value(case[k].clone()).expect("ids")
}

fn floats(case: &serde_json::Value, k: &str) -> Vec<f32> {
    serde_json::from_value(case[k].clone()).expect("floats")
}

fn models() -> Vec<serde_json::Value> {
    let f = common::fixture("tiny-deepseek.json");
    let models = f["models"].as_array().expect("models").clone();
    assert_eq!(models.len(), 3);
    models
}

/// Logits at position 10 and at the last prompt position within 1e-4 of the case's reference, and
/// its greedy tokens through the paged cache.
fn matches_reference(m: &LoadedModel<CpuBackend>, case: &serde_json::Value, name: &str) {
    let prompt = ids(case, "prompt_ids");
    let got = common::logits_at(m, &prompt, &[10, prompt.len() - 1]);
    let (mid, last) = (
        common::rel_err(&got[0], &floats(case, "mid_logits")),
        common::rel_err(&got[1], &floats(case, "last_logits")),
    );
    assert!(
        mid < 1e-4 && last < 1e-4,
        "{name}: logit errors {mid:e} (pos 10), {last:e} (last)"
    );
    let greedy = ids(case, "greedy_ids");
    let out = common::greedy_ids(m, &prompt, greedy.len());
    assert_eq!(out, greedy, "{name}: greedy tokens");
    eprintln!(
        "{name}: logits within {mid:.1e} / {last:.1e}, {} greedy tokens equal",
        out.len()
    );
}

#[test]
fn logits_and_greedy_tokens_match_transformers() {
    for case in models() {
        let name = case["name"].as_str().expect("name");
        let dir = common::tiny_with_tokenizer(name);
        let m = load_model(CpuBackend::new(), &dir, Precision::Exact, |_, _| {}).expect("load");
        matches_reference(&m, &case, name);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn int4_experts_stay_packed_and_fast_mode_reads_them_close_to_transformers() {
    // Kimi-K2-Thinking's experts (compressed-tensors INT4, groups of 32) load as Q4_0 blocks:
    // 18 bytes per 32 weights instead of 128 as f32. Exact mode dequantizes them (the test above
    // holds it to 1e-4); fast mode reads them packed, with activations quantized to 8 bits, so
    // its logits stay close rather than equal (1e-4 on an AVX-512 machine).
    let case = models()
        .into_iter()
        .find(|c| c["name"] == "kimi-k2-int4")
        .expect("the INT4 case");
    let dir = common::tiny_with_tokenizer("kimi-k2-int4");
    let hf = kiln::weights::hf::HfDir::open(&dir).expect("open");
    for p in ["gate_proj", "up_proj", "down_proj"] {
        let v = hf
            .view(&format!("model.layers.1.mlp.experts.0.{p}.weight"))
            .expect("view");
        assert_eq!(v.dtype, kiln::weights::DType::Q4_0, "{p}");
        assert_eq!(v.bytes().len(), v.n_elements() / 32 * 18, "{p}");
    }
    let m = load_model(CpuBackend::new(), &dir, Precision::Fast, |_, _| {}).expect("load");
    let prompt = ids(&case, "prompt_ids");
    let got = common::logits_at(&m, &prompt, &[prompt.len() - 1]);
    let err = common::rel_err(&got[0], &floats(&case, "last_logits"));
    eprintln!("kimi-k2-int4, fast mode: last logits within {err:.1e}");
    assert!(err < 0.05, "fast mode's logits are {err:e} off");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fp8_weights_stay_packed_and_fast_mode_reads_them_as_exact_mode_does() {
    // DeepSeek-V3's block FP8 loads as F8Blocks: its e4m3 bytes with each row block's scale
    // (20 bytes per 16 weights at this model's [16, 16] blocks; 132 per 128 at DeepSeek-V3's),
    // not f32. Fast mode widens them as it reads, exactly, so it keeps the greedy tokens and
    // its logits stay within rounding of exact mode's.
    let case = models()
        .into_iter()
        .find(|c| c["name"] == "deepseek-v3-fp8")
        .expect("the FP8 case");
    let dir = common::tiny_with_tokenizer("deepseek-v3-fp8");
    let hf = kiln::weights::hf::HfDir::open(&dir).expect("open");
    for name in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.kv_b_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.1.mlp.experts.0.down_proj.weight",
    ] {
        let v = hf.view(name).expect("view");
        assert_eq!(v.dtype, kiln::weights::DType::F8Blocks(16), "{name}");
        assert_eq!(v.bytes().len(), v.n_elements() / 16 * 20, "{name}");
    }
    let exact = load_model(CpuBackend::new(), &dir, Precision::Exact, |_, _| {}).expect("load");
    let fast = load_model(CpuBackend::new(), &dir, Precision::Fast, |_, _| {}).expect("load");
    let prompt = ids(&case, "prompt_ids");
    let rows = [10, prompt.len() - 1];
    let (e, f) = (
        common::logits_at(&exact, &prompt, &rows),
        common::logits_at(&fast, &prompt, &rows),
    );
    let err = common::rel_err(&f[1], &e[1]).max(common::rel_err(&f[0], &e[0]));
    eprintln!("deepseek-v3-fp8, fast mode: logits within {err:.1e} of exact mode");
    assert!(
        err < 1e-4,
        "fast mode's logits are {err:e} off exact mode's"
    );
    let greedy = ids(&case, "greedy_ids");
    assert_eq!(
        common::greedy_ids(&fast, &prompt, greedy.len()),
        greedy,
        "fast mode's greedy tokens"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A prefill of all but the last four prompt tokens, then four one-token steps, in the absorbed
/// form (which reads the cache) over a store of `layout`: every step's last logits, and the
/// store's bytes.
fn absorbed_steps(
    m: &LoadedModel<CpuBackend>,
    prompt: &[u32],
    layout: KvLayout,
) -> (Vec<Vec<f32>>, usize) {
    let n = prompt.len();
    let (seq, mut kv) = common::paged_sequence(m, n, layout);
    let mut ws = Workspace::new(&m.backend).expect("workspace");
    let mut logits = Vec::new();
    let mut start = 0;
    for end in [n - 4, n - 3, n - 2, n - 1, n] {
        let positions: Vec<usize> = (start..end).collect();
        let spans = [SeqSpan {
            first_token: 0,
            n_tokens: end - start,
            start_pos: start,
            block_table: &seq.table,
            tree: None,
        }];
        let batch = ForwardBatch {
            tokens: &prompt[start..end],
            positions: &positions,
            spans: &spans,
            logit_rows: &[end - start - 1],
            fill: None,
        };
        logits.push(
            m.model
                .forward(&m.backend, &mut kv, &batch, &mut ws)
                .expect("forward"),
        );
        start = end;
    }
    (logits, kv.bytes())
}

#[test]
fn the_mla_cache_holds_each_latent_once() {
    // MLA's cached row [k_pe | latent] is both its key and (its latent part) its value: the
    // store keeps it once, half the cells of a separate V, and attention reads the values from
    // the keys. The absorbed form over such a store gives what it gives over K and V rows.
    for case in models() {
        let name = case["name"].as_str().expect("name");
        let dir = common::tiny_with_tokenizer(name);
        for precision in [Precision::Exact, Precision::Fast] {
            let mut m = load_model(CpuBackend::new(), &dir, precision, |_, _| {}).expect("load");
            assert_eq!(m.config().kv_layout(), KvLayout::KeysOnly, "{name}");
            m.model.mla_form = MlaForm::Absorbed;
            let prompt = ids(&case, "prompt_ids");
            let (once, once_bytes) = absorbed_steps(&m, &prompt, KvLayout::KeysOnly);
            let (twice, twice_bytes) = absorbed_steps(&m, &prompt, KvLayout::KeysAndValues);
            assert_eq!(2 * once_bytes, twice_bytes, "{name}: store bytes");
            // Summation order differs; fast mode's 8-bit activations can round it apart a
            // little further.
            let bound = if precision == Precision::Exact {
                1e-5
            } else {
                1e-4
            };
            for (step, (a, b)) in once.iter().zip(&twice).enumerate() {
                let err = common::rel_err(a, b);
                assert!(
                    err < bound,
                    "{name} {precision:?}: step {step}: {err:e} apart"
                );
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn explicit_prefill_equals_absorbed_attention() {
    for case in models() {
        let name = case["name"].as_str().expect("name");
        let dir = common::tiny_with_tokenizer(name);
        let mut m = load_model(CpuBackend::new(), &dir, Precision::Exact, |_, _| {}).expect("load");
        let prompt = ids(&case, "prompt_ids");
        let rows: Vec<usize> = (0..prompt.len()).collect();
        // Auto takes the explicit form for a prefill from an empty cache.
        m.model.mla_form = MlaForm::Auto;
        let explicit = common::logits_at(&m, &prompt, &rows);
        m.model.mla_form = MlaForm::Absorbed;
        let absorbed = common::logits_at(&m, &prompt, &rows);
        for (t, (e, a)) in explicit.iter().zip(&absorbed).enumerate() {
            let err = common::rel_err(e, a);
            assert!(
                err < 1e-5,
                "{name}: position {t}: explicit vs absorbed {err:e}"
            );
        }
        let last = common::rel_err(&explicit[prompt.len() - 1], &floats(&case, "last_logits"));
        assert!(last < 1e-4, "{name}: explicit vs transformers {last:e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn router_choices_and_weights_match_transformers() {
    for case in models() {
        let name = case["name"].as_str().expect("name");
        let r = &case["routing"];
        let layer = r["layer"].as_u64().expect("layer");
        let (store, config) = open_weights(&fixture_dir(&case)).expect("open");
        let moe = config.moe.expect("a MoE config");
        let w = store
            .get(&format!("model.layers.{layer}.mlp.gate.weight"))
            .expect("router")
            .to_f32();
        let bias = store
            .get(&format!(
                "model.layers.{layer}.mlp.gate.e_score_correction_bias"
            ))
            .expect("bias")
            .to_f32();
        let hidden: Vec<Vec<f32>> = serde_json::from_value(r["hidden"].clone()).expect("hidden");
        let experts: Vec<Vec<usize>> =
            serde_json::from_value(r["experts"].clone()).expect("experts");
        let weights: Vec<Vec<f32>> = serde_json::from_value(r["weights"].clone()).expect("weights");
        let h = config.hidden_size;
        for (t, x) in hidden.iter().enumerate() {
            let logits: Vec<f32> = w
                .chunks(h)
                .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
                .collect();
            let mut got = route(&route_spec(&moe), &logits, &bias);
            got.sort_by_key(|g| g.0);
            let got_experts: Vec<usize> = got.iter().map(|g| g.0).collect();
            assert_eq!(got_experts, experts[t], "{name}: token {t} experts");
            for (g, want) in got.iter().zip(&weights[t]) {
                assert!(
                    (g.1 - want).abs() < 1e-5,
                    "{name}: token {t} weights {got:?} vs {:?}",
                    weights[t]
                );
            }
        }
    }
}

/// `n` greedy tokens over `world` rank threads, exact mode, experts split expert-parallel.
fn tp_greedy(
    path: &std::path::Path,
    world: usize,
    prompt: &[u32],
    n: usize,
    name: &str,
) -> GreedyRun {
    tp_greedy_split(path, world, MoeSplit::Experts, prompt, n, name)
}

fn tp_greedy_split(
    path: &std::path::Path,
    world: usize,
    moe: MoeSplit,
    prompt: &[u32],
    n: usize,
    name: &str,
) -> GreedyRun {
    let opts = TpOptions {
        device: Device::Cpu,
        world,
        precision: Precision::Exact,
        threads_per_rank: 1,
        timeout: Duration::from_secs(300),
        group: Default::default(),
        moe,
    };
    greedy(path, opts, prompt, n).unwrap_or_else(|e| panic!("{name}, TP={world}: {e}"))
}

/// Greedy over `world` ranks with the experts split as `moe`: the whole model's tokens (which the
/// caller checked against transformers') and its logits within 1e-4 at every step. Returns the
/// run for further checks.
fn split_matches(
    path: &std::path::Path,
    world: usize,
    moe: MoeSplit,
    prompt: &[u32],
    whole: &GreedyRun,
    name: &str,
) -> GreedyRun {
    let n = whole.tokens.len();
    let split = tp_greedy_split(path, world, moe, prompt, n, name);
    assert_eq!(
        split.tokens, whole.tokens,
        "{name}: {moe:?} TP={world} vs TP=1"
    );
    for (a, b) in split.logits.iter().zip(&whole.logits) {
        let e = common::rel_err(a, b);
        assert!(
            e < 1e-4,
            "{name}: {moe:?} TP={world} logits differ by {e:e}"
        );
    }
    split
}

#[test]
fn heads_and_experts_split_over_2_and_4_ranks_match_the_whole_model() {
    for case in models() {
        let name = case["name"].as_str().expect("name");
        let path = fixture_dir(&case);
        let prompt = ids(&case, "prompt_ids");
        let reference = ids(&case, "greedy_ids");
        let run = |world| tp_greedy(&path, world, &prompt, reference.len(), name);
        let whole = run(1);
        assert_eq!(whole.tokens, reference, "{name}: TP=1 vs transformers");
        for world in [2, 4] {
            split_matches(&path, world, MoeSplit::Experts, &prompt, &whole, name);
        }
    }
}

#[test]
fn eight_head_models_split_over_2_4_and_8_ranks_match_the_whole_model_and_transformers() {
    // One query head and one routed expert per rank at TP = 8, as Kimi-K2 on the reference box
    // holds 8 of its 64 heads and 48 of its 384 experts per GPU.
    let f = common::fixture("tiny-deepseek-8h.json");
    let models = f["models"].as_array().expect("models");
    assert_eq!(models.len(), 2);
    for case in models {
        let name = case["name"].as_str().expect("name");
        let path = fixture_dir(case);
        let prompt = ids(case, "prompt_ids");
        let reference = ids(case, "greedy_ids");
        let last = floats(case, "last_logits");
        let run = |world| tp_greedy(&path, world, &prompt, reference.len(), name);
        let whole = run(1);
        assert_eq!(whole.tokens, reference, "{name}: TP=1 vs transformers");
        for world in [2, 4, 8] {
            let split = split_matches(&path, world, MoeSplit::Experts, &prompt, &whole, name);
            let e = common::rel_err(&split.logits[0], &last);
            assert!(
                e < 1e-4,
                "{name}: TP={world} prompt logits vs transformers: {e:e}"
            );
        }
    }
}

#[test]
fn experts_split_by_columns_match_the_whole_model_and_transformers() {
    // Every rank a slice of every expert: the routing is the same on every rank and each picked
    // expert's output is summed across ranks by the MLP's all-reduce.
    let four = common::fixture("tiny-deepseek.json");
    let eight = common::fixture("tiny-deepseek-8h.json");
    let cases = [
        (&four, "deepseek-v3", &[2, 4][..]),
        (&eight, "deepseek-v3-8h", &[2, 4, 8][..]),
        (&eight, "kimi-k2-int4-8h", &[2, 4, 8][..]),
    ];
    for (f, name, worlds) in cases {
        let case = f["models"]
            .as_array()
            .expect("models")
            .iter()
            .find(|m| m["name"] == name)
            .expect("model in fixture");
        let path = fixture_dir(case);
        let prompt = ids(case, "prompt_ids");
        let reference = ids(case, "greedy_ids");
        let whole = tp_greedy(&path, 1, &prompt, reference.len(), name);
        assert_eq!(whole.tokens, reference, "{name}: TP=1 vs transformers");
        for &world in worlds {
            split_matches(&path, world, MoeSplit::Columns, &prompt, &whole, name);
        }
    }
}

#[test]
fn a_quantized_checkpoint_with_a_broken_scale_is_refused_by_name() {
    // The FP8 model's config without its block size: the first FP8 weight must say what is
    // missing, naming the tensor.
    let case = &models()[1];
    let src = fixture_dir(case);
    let dst = std::env::temp_dir().join(format!("kiln-fp8-noblock-{}", std::process::id()));
    std::fs::create_dir_all(&dst).expect("dir");
    std::fs::copy(src.join("model.safetensors"), dst.join("model.safetensors")).expect("copy");
    let mut conf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).expect("read"))
            .expect("json");
    conf["quantization_config"]
        .as_object_mut()
        .expect("quantization_config")
        .remove("weight_block_size");
    std::fs::write(dst.join("config.json"), conf.to_string()).expect("write");
    let err = match open_weights(&dst) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a config without weight_block_size was accepted"),
    };
    assert!(err.contains("weight_block_size"), "{err}");
    let _ = std::fs::remove_dir_all(&dst);
}

/// The deepseek-v3 model converted to GGUF by llama.cpp's `convert_hf_to_gguf.py`
/// (`tests/reference/make_tiny_deepseek_gguf.py`), f32 and Q8_0, with transformers' numbers on the
/// weights as each file stores them.
fn gguf_files() -> Vec<(PathBuf, serde_json::Value)> {
    let f = common::fixture("tiny-deepseek-gguf.json");
    let files = f["files"].as_array().expect("files").clone();
    assert_eq!(files.len(), 2);
    files
        .into_iter()
        .map(|case| {
            let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures")
                .join(case["file"].as_str().expect("file"));
            (path, case)
        })
        .collect()
}

#[test]
fn gguf_files_from_llama_cpps_converter_match_transformers() {
    for (path, case) in gguf_files() {
        let name = case["file"].as_str().expect("file");
        // The GGUF carries its own tokenizer (the loader reads it) and llama.cpp's layout: the
        // split k_b / v_b, stacked experts, exp_probs_b, MLA and MoE metadata.
        let m = load_model(CpuBackend::new(), &path, Precision::Exact, |_, _| {}).expect("load");
        let c = m.config();
        assert_eq!(
            (c.n_kv_heads, c.head_dim),
            (1, 8 + 32),
            "{name}: one latent KV head"
        );
        let moe = c.moe.expect("MoE");
        assert_eq!(
            (moe.n_group, moe.topk_group, moe.first_k_dense_replace),
            (4, 2, 1)
        );
        assert!(moe.norm_topk_prob && moe.routed_scaling_factor == 2.5);
        matches_reference(&m, &case, name);
    }
}

#[test]
fn a_gguf_split_over_2_ranks_matches_the_whole_model() {
    let (path, case) = gguf_files().remove(0);
    let prompt = ids(&case, "prompt_ids");
    let run = |world| tp_greedy(&path, world, &prompt, 8, "f32 GGUF");
    let (whole, split) = (run(1), run(2));
    assert_eq!(whole.tokens, ids(&case, "greedy_ids")[..8], "TP=1");
    assert_eq!(split.tokens, whole.tokens, "TP=2 vs TP=1");
}

#[test]
fn a_deepseek2_gguf_with_softmax_routing_is_refused_by_name() {
    use common::Meta::{Str, U32};
    // DeepSeek-V2's router (softmax; llama.cpp's reading of a missing gating function) is not
    // DeepSeek-V3's: the file must be refused naming the field, not run with the wrong routing.
    let dir = std::env::temp_dir().join(format!("kiln-ds2-softmax-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("softmax.gguf");
    let meta = [
        ("general.architecture", Str("deepseek2")),
        ("deepseek2.embedding_length", U32(64)),
        ("deepseek2.attention.head_count", U32(4)),
        ("deepseek2.attention.head_count_kv", U32(1)),
        ("deepseek2.attention.key_length", U32(40)),
        ("deepseek2.attention.key_length_mla", U32(24)),
        ("deepseek2.attention.value_length_mla", U32(16)),
        ("deepseek2.attention.kv_lora_rank", U32(32)),
        ("deepseek2.rope.dimension_count", U32(8)),
        ("deepseek2.feed_forward_length", U32(96)),
        ("deepseek2.block_count", U32(1)),
        ("deepseek2.context_length", U32(128)),
        ("deepseek2.expert_count", U32(8)),
        ("deepseek2.expert_used_count", U32(2)),
        ("deepseek2.expert_feed_forward_length", U32(32)),
    ];
    common::write_gguf(
        &path,
        &meta,
        &[("token_embd.weight", &[64, 8], 0, &[0u8; 2048])],
    );
    let err = match open_weights(&path) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a softmax-routed deepseek2 file was accepted"),
    };
    assert!(err.contains("deepseek2.expert_gating_func"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kiln serve` on the tiny DeepSeek-V3 model; `extra` flags added.
fn serve(dir: &std::path::Path, extra: &[&str]) -> common::server::Server {
    let port = common::server::free_port().to_string();
    let model = dir.to_string_lossy().to_string();
    let mut args = vec![
        "--port",
        &port,
        "--model",
        &model,
        "--mode",
        "exact",
        "--threads",
        "1",
    ];
    args.extend_from_slice(extra);
    common::server::Server::start_exactly(port.parse().expect("port"), &args)
}

fn completion(s: &common::server::Server, prompt: &[u32]) -> String {
    let (status, v) = s.post_json(
        "/v1/completions",
        &serde_json::json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The fixture's prompt first (its greedy text is transformers'), then prompts of mixed lengths.
fn mixed_prompts(case: &serde_json::Value) -> Vec<Vec<u32>> {
    let mut prompts = vec![ids(case, "prompt_ids")];
    let mut state = 12345u32;
    for len in [3usize, 9, 17, 30, 41] {
        prompts.push(
            (0..len)
                .map(|_| {
                    state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    3 + (state >> 8) % 509
                })
                .collect(),
        );
    }
    prompts
}

#[test]
fn the_server_serves_it_and_eagle3_speculation_keeps_greedy_output_exact() {
    let case = &models()[0];
    let dir = common::tiny_with_tokenizer("deepseek-v3");
    let tok = common::smollm2_tokenizer();
    let prompts = mixed_prompts(case);
    let base = serve(&dir, &[]);
    let want: Vec<String> = prompts.iter().map(|p| completion(&base, p)).collect();
    let reference = tok.decode(&ids(case, "greedy_ids"), false).expect("decode");
    assert_eq!(
        want[0], reference,
        "served greedy text vs transformers' tokens"
    );
    drop(base);
    let draft =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/eagle3-speculators");
    let draft = draft.to_string_lossy().to_string();
    let spec = serve(
        &dir,
        &[
            "--speculative-algorithm",
            "eagle3",
            "--speculative-draft-model-path",
            &draft,
            "--speculative-policy",
            "fixed",
            "--speculative-num-steps",
            "3",
        ],
    );
    for c in [1usize, 4] {
        let got: Vec<String> = std::thread::scope(|scope| {
            let chunks: Vec<_> = prompts
                .chunks(prompts.len().div_ceil(c))
                .map(|chunk| {
                    scope.spawn(|| {
                        chunk
                            .iter()
                            .map(|p| completion(&spec, p))
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            chunks
                .into_iter()
                .flat_map(|h| h.join().expect("client"))
                .collect()
        });
        assert_eq!(got, want, "EAGLE-3 on DeepSeek-V3, C={c}");
    }
    let drafted = spec.metric("kiln_spec_draft_tokens_total");
    assert!(drafted > 0.0, "the draft proposed nothing");
    eprintln!(
        "drafted {drafted}, accepted {}",
        spec.metric("kiln_spec_accepted_tokens_total")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// EAGLE-3 under tensor parallelism: every rank holds a shard of the head and runs every draft
/// step. The split head must draft exactly what the whole head drafts (same drafted and accepted
/// counts, one request at a time), and the served text must stay the non-speculative text, for
/// chains and for trees (whose verify and draft steps carry tree masks to every rank).
#[test]
fn eagle3_split_over_2_and_4_ranks_drafts_as_one_rank_and_keeps_greedy_output_exact() {
    let case = &models()[0];
    let dir = common::tiny_with_tokenizer("deepseek-v3");
    let prompts = mixed_prompts(case);
    let base = serve(&dir, &[]);
    let want: Vec<String> = prompts.iter().map(|p| completion(&base, p)).collect();
    drop(base);
    // A head drafting only the target's most frequent output tokens, so that drafts are both
    // accepted and rejected (what the equal counts below need to mean anything).
    let mut seen = std::collections::HashMap::<u32, usize>::new();
    for p in &prompts {
        for t in tp_greedy(&dir, 1, p, 16, "the head's tokens").tokens {
            *seen.entry(t).or_default() += 1;
        }
    }
    let mut frequent: Vec<(u32, usize)> = seen.into_iter().collect();
    frequent.sort_by_key(|&(t, n)| (std::cmp::Reverse(n), t));
    let tokens: Vec<u32> = frequent.iter().take(4).map(|&(t, _)| t).collect();
    // Four: the draft vocabulary splits over 2 and 4 ranks, so the LM head's split is tested.
    assert_eq!(tokens.len(), 4, "distinct greedy tokens");
    let head = std::env::temp_dir().join(format!("kiln-tp-draft-{}", std::process::id()));
    common::write_draft(&head, &tokens, &common::DraftShape::TINY_DEEPSEEK);
    let draft = head.to_string_lossy().to_string();
    let chain: Vec<&str> = vec![
        "--speculative-algorithm",
        "eagle3",
        "--speculative-draft-model-path",
        &draft,
        "--speculative-num-steps",
        "3",
    ];
    let tree = common::eagle3_tree_flags(&draft).to_vec();
    for (kind, flags) in [("chain", chain), ("tree", tree)] {
        let mut counts = Vec::new();
        for tp in ["1", "2", "4"] {
            let mut args = flags.clone();
            args.extend([
                "--speculative-policy",
                "fixed",
                "--tensor-parallel-size",
                tp,
            ]);
            let s = serve(&dir, &args);
            let got: Vec<String> = prompts.iter().map(|p| completion(&s, p)).collect();
            assert_eq!(got, want, "EAGLE-3 {kind}, TP={tp}");
            let drafted = s.metric("kiln_spec_draft_tokens_total");
            let accepted = s.metric("kiln_spec_accepted_tokens_total");
            eprintln!("EAGLE-3 {kind}, TP={tp}: drafted {drafted}, accepted {accepted}");
            assert!(drafted > 0.0, "EAGLE-3 {kind}, TP={tp}: nothing drafted");
            counts.push((tp, drafted, accepted));
        }
        let (_, d1, a1) = counts[0];
        for &(tp, d, a) in &counts[1..] {
            assert_eq!(
                (d, a),
                (d1, a1),
                "EAGLE-3 {kind}: TP={tp} drafted/accepted vs TP=1"
            );
        }
        assert!(a1 > 0.0, "EAGLE-3 {kind}: nothing accepted");
    }
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&head);
}

/// Greedy text and usage of one completion over token ids.
fn completion_usage(s: &common::server::Server, prompt: &[u32]) -> (String, serde_json::Value) {
    let (status, v) = s.post_json(
        "/v1/completions",
        &serde_json::json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap_or_default();
    (text.to_string(), v["usage"].clone())
}

#[test]
fn mla_whole_and_split_over_2_ranks_reuses_a_cached_prefix_exactly() {
    // Prompts sharing 48 tokens (three 16-token blocks of latents), each with its own tail.
    let dir = common::tiny_with_tokenizer("deepseek-v3");
    let mut state = 777u32;
    let mut next = || {
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        3 + (state >> 8) % 509
    };
    let shared: Vec<u32> = (0..48).map(|_| next()).collect();
    let prompts: Vec<Vec<u32>> = [5usize, 9, 2, 12]
        .iter()
        .map(|&tail| {
            shared
                .iter()
                .copied()
                .chain((0..tail).map(|_| next()))
                .collect()
        })
        .collect();
    let plain = serve(&dir, &["--no-prefix-cache"]);
    let want: Vec<String> = prompts
        .iter()
        .map(|p| completion_usage(&plain, p).0)
        .collect();
    let plain_prefill = plain.metric("kiln_prefill_tokens_total");
    drop(plain);
    for extra in [&[][..], &["--tp", "2"][..]] {
        let cache = serve(&dir, extra);
        let got: Vec<(String, serde_json::Value)> = prompts
            .iter()
            .map(|p| completion_usage(&cache, p))
            .collect();
        let cached: Vec<u64> = got
            .iter()
            .map(|(_, u)| {
                u["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .expect("cached")
            })
            .collect();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(&g.0, w, "prompt {i}, cache on, {extra:?}");
        }
        assert_eq!(cached, [0, 48, 48, 48], "{extra:?}");
        assert_eq!(
            plain_prefill - cache.metric("kiln_prefill_tokens_total"),
            144.0,
            "the cached latents were not computed again, {extra:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
