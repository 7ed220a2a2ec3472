//! The `kiln` binary as a user runs it: JSON output, streaming text, and clear errors (never a panic)
//! for missing, truncated and unsupported model files.

mod common;

use std::path::Path;
use std::process::Command;

use common::{Meta, write_gguf};

fn kiln(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .output()
        .expect("run kiln");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn temp(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("kiln-cli-{}-{name}", std::process::id()))
}

fn assert_clean_failure(ok: bool, stderr: &str, needles: &[&str]) {
    assert!(!ok, "kiln should fail");
    assert!(!stderr.contains("panicked"), "kiln panicked: {stderr}");
    for n in needles {
        assert!(stderr.contains(n), "stderr lacks `{n}`: {stderr}");
    }
}

#[test]
fn json_output_is_one_object_and_matches_streamed_text() {
    let model = common::smollm2();
    let m = model.to_str().expect("utf-8 path");
    let (ok, stdout, stderr) = kiln(&[
        "generate",
        "--model",
        m,
        "--chat",
        "Say hello.",
        "--max-tokens",
        "12",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.len(),
        1,
        "stdout must hold exactly one JSON object: {stdout}"
    );
    let v: serde_json::Value = serde_json::from_str(lines[0]).expect("valid JSON");
    let prompt_ids = v["prompt_ids"].as_array().expect("prompt_ids");
    let output_ids = v["output_ids"].as_array().expect("output_ids");
    assert!(!prompt_ids.is_empty() && !output_ids.is_empty() && output_ids.len() <= 12);
    let (ok, streamed, stderr) = kiln(&[
        "generate",
        "--model",
        m,
        "--chat",
        "Say hello.",
        "--max-tokens",
        "12",
    ]);
    assert!(ok, "{stderr}");
    assert_eq!(
        streamed.trim_end_matches('\n'),
        v["text"].as_str().expect("text")
    );
    assert!(stderr.contains("tok/s"), "speed report missing: {stderr}");
}

#[test]
fn prompt_ids_and_ignore_eos_give_exactly_max_tokens() {
    let model = common::smollm2();
    let (ok, stdout, stderr) = kiln(&[
        "generate",
        "--model",
        model.to_str().expect("utf-8"),
        "--prompt-ids",
        "1,9690,198,2683,359,253,5356,2",
        "--max-tokens",
        "7",
        "--ignore-eos",
        "--json",
        "--mode",
        "exact",
    ]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).expect("json");
    assert_eq!(v["prompt_ids"].as_array().map(|a| a.len()), Some(8));
    assert_eq!(v["output_ids"].as_array().map(|a| a.len()), Some(7));
}

#[test]
fn missing_model_names_the_path() {
    let (ok, _, stderr) = kiln(&[
        "generate",
        "--model",
        "/nonexistent/model.gguf",
        "--prompt",
        "hi",
    ]);
    assert_clean_failure(ok, &stderr, &["/nonexistent/model.gguf"]);
}

#[test]
fn missing_default_model_says_what_to_run() {
    let dir = temp("empty-cache");
    std::fs::create_dir_all(&dir).expect("dir");
    let (ok, _, stderr) = kiln(&[
        "generate",
        "--cache-dir",
        dir.to_str().expect("utf-8"),
        "--prompt",
        "hi",
    ]);
    assert_clean_failure(ok, &stderr, &["kiln fetch"]);
}

#[test]
fn truncated_model_names_file_and_tensor() {
    let src = common::smollm2();
    let bytes = std::fs::read(&src).expect("read model");
    let path = temp("truncated.gguf");
    std::fs::write(&path, &bytes[..bytes.len() / 3]).expect("write");
    let (ok, _, stderr) = kiln(&[
        "generate",
        "--model",
        path.to_str().expect("utf-8"),
        "--prompt",
        "hi",
    ]);
    let _ = std::fs::remove_file(&path);
    assert_clean_failure(
        ok,
        &stderr,
        &["truncated", "tensor `", path.to_str().expect("utf-8")],
    );
}

#[test]
fn not_a_gguf_file_is_an_error() {
    let path = temp("garbage.gguf");
    std::fs::write(&path, b"this is not a model file at all").expect("write");
    let (ok, _, stderr) = kiln(&[
        "generate",
        "--model",
        path.to_str().expect("utf-8"),
        "--prompt",
        "hi",
    ]);
    let _ = std::fs::remove_file(&path);
    assert_clean_failure(ok, &stderr, &["not a GGUF file"]);
}

fn llama_meta(arch: &'static str) -> Vec<(&'static str, Meta<'static>)> {
    let k = |s: &str| -> &'static str { Box::leak(format!("{arch}.{s}").into_boxed_str()) };
    vec![
        ("general.architecture", Meta::Str(arch)),
        (k("embedding_length"), Meta::U32(32)),
        (k("feed_forward_length"), Meta::U32(64)),
        (k("block_count"), Meta::U32(1)),
        (k("attention.head_count"), Meta::U32(2)),
        (k("context_length"), Meta::U32(128)),
        ("tokenizer.ggml.model", Meta::Str("gpt2")),
    ]
}

#[test]
fn unknown_architecture_is_named() {
    let path = temp("falcon.gguf");
    write_gguf(&path, &llama_meta("falcon"), &[]);
    let (ok, _, stderr) = kiln(&[
        "generate",
        "--model",
        path.to_str().expect("utf-8"),
        "--prompt",
        "hi",
    ]);
    let _ = std::fs::remove_file(&path);
    assert_clean_failure(ok, &stderr, &["unsupported architecture `falcon`"]);
}

#[test]
fn unsupported_tensor_type_names_the_tensor() {
    let path = temp("q2k.gguf");
    // token_embd.weight stored as Q2_K (ggml type 10), which kiln does not read.
    let data = vec![0u8; 84 * 4];
    write_gguf(
        &path,
        &llama_meta("llama"),
        &[("token_embd.weight", &[256, 4], 10, &data)],
    );
    let (ok, _, stderr) = kiln(&[
        "generate",
        "--model",
        path.to_str().expect("utf-8"),
        "--prompt",
        "hi",
    ]);
    let _ = std::fs::remove_file(&path);
    assert_clean_failure(ok, &stderr, &["token_embd.weight", "Q2_K"]);
    assert!(Path::new(env!("CARGO_BIN_EXE_kiln")).exists());
}

#[test]
fn device_cuda_without_a_cuda_backend_fails_naming_it_and_never_falls_back_to_the_cpu() {
    let model = common::smollm2();
    let model = model.to_string_lossy();
    for cmd in ["generate", "serve"] {
        let mut args = vec![cmd, "--device", "cuda", "--model", &model];
        if cmd == "generate" {
            args.extend(["--prompt", "hi", "--max-tokens", "2"]);
        } else {
            args.extend(["--port", "0"]);
        }
        let (ok, stdout, stderr) = kiln(&args);
        assert_clean_failure(ok, &stderr, &["--device cuda", "--device cpu"]);
        // No token came out: nothing ran on the CPU instead.
        assert!(stdout.trim().is_empty(), "{cmd}: {stdout}");
    }
}

#[test]
fn a_corrupt_layer_count_is_refused_by_name_not_allocated() {
    let path = temp("layers.gguf");
    let mut meta = llama_meta("llama");
    meta.retain(|(k, _)| *k != "llama.block_count");
    meta.push(("llama.block_count", Meta::U32(u32::MAX)));
    let data = vec![0u8; 32 * 8 * 4];
    write_gguf(&path, &meta, &[("token_embd.weight", &[32, 8], 0, &data)]);
    let (ok, _, stderr) = kiln(&[
        "generate",
        "--model",
        path.to_str().expect("utf-8"),
        "--prompt",
        "hi",
    ]);
    let _ = std::fs::remove_file(&path);
    assert_clean_failure(ok, &stderr, &["layers", "4294967295", "layers.gguf"]);
}

#[test]
fn a_zero_max_model_len_is_refused() {
    let (ok, _, stderr) = kiln(&["serve", "--max-model-len", "0", "--port", "1"]);
    assert_clean_failure(ok, &stderr, &["--max-model-len must be at least 1"]);
}
