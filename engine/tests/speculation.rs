//! Speculative decoding through the real server: greedy output with n-gram speculation equals the
//! output without it, token for token, at concurrency 1, 4 and 16 with prompts of mixed lengths,
//! under both the fixed policy (drafts verified every step) and the adaptive one.

mod common;

use common::server::Server;
use serde_json::json;

fn prompts() -> Vec<(String, bool)> {
    let code = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef fibonacci_memo(n, memo={}):\n";
    let list = "Colors: red, green, blue, red, green, blue, red, green,";
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(12);
    let mut p: Vec<(String, bool)> = vec![
        (code.to_string(), true),
        (list.to_string(), true),
        (long.clone(), true),
        ("1, 2, 3, 4, 5, 6,".to_string(), false),
        ("Once upon a time".to_string(), false),
        ("import numpy as np\nimport numpy as np\n".to_string(), true),
        (
            "SELECT name FROM users WHERE id = 1;\nSELECT name FROM".to_string(),
            false,
        ),
        ("Dear Sir or Madam,".to_string(), false),
    ];
    // Sixteen in all: the same kinds again with different tails.
    let more: Vec<(String, bool)> = p
        .iter()
        .enumerate()
        .map(|(i, (t, eos))| (format!("{t} {i}"), !eos))
        .collect();
    p.extend(more);
    p
}

/// N-gram drafts of up to four tokens, verified at every step.
const NGRAM_FIXED_S4: [&str; 6] = [
    "--speculative-algorithm",
    "ngram",
    "--speculative-policy",
    "fixed",
    "--speculative-num-steps",
    "4",
];

/// Greedy completion; `ignore_eos` for some prompts so both ends (length, EOS) are exercised.
fn greedy(s: &Server, prompt: &str, ignore_eos: bool) -> (String, u64) {
    let (st, v) = s.post_json(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": ignore_eos}),
    );
    assert_eq!(st, 200, "{v}");
    (
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        v["usage"]["completion_tokens"].as_u64().unwrap_or(0),
    )
}

fn concurrently(s: &Server, prompts: &[(String, bool)], c: usize) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    for wave in prompts.chunks(c) {
        let got: Vec<(String, u64)> = std::thread::scope(|sc| {
            let hs: Vec<_> = wave
                .iter()
                .map(|(p, e)| sc.spawn(move || greedy(s, p, *e)))
                .collect();
            hs.into_iter().map(|h| h.join().expect("client")).collect()
        });
        out.extend(got);
    }
    out
}

#[test]
fn ngram_speculation_keeps_greedy_output_exact_alone_and_at_c16() {
    let p = prompts();
    let want: Vec<(String, u64)> = {
        let base = Server::start(&[]);
        p.iter().map(|(t, e)| greedy(&base, t, *e)).collect()
    };
    let fixed = Server::start(&NGRAM_FIXED_S4);
    for c in [1, 16] {
        let n = if c == 1 { 6 } else { p.len() };
        let got = concurrently(&fixed, &p[..n], c);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "C={c}, prompt {i} ({:?})", p[i].0);
        }
    }
    let drafted = fixed.metric("kiln_spec_draft_tokens_total");
    let accepted = fixed.metric("kiln_spec_accepted_tokens_total");
    assert!(
        accepted > 0.0 && drafted > accepted,
        "drafted {drafted}, accepted {accepted}"
    );
    // The gauge updates at the end of the engine step that sent the last response.
    let mut used = f64::NAN;
    for _ in 0..50 {
        used = fixed.metric("kiln_kv_blocks_used");
        if used == 0.0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert_eq!(used, 0.0, "rejected drafts' blocks leaked");

    // Sampling with speculation (rejection sampling) stays reproducible under a seed.
    let sampled = || {
        let (st, v) = fixed.post_json(
            "/v1/completions",
            &json!({"prompt": p[0].0, "max_tokens": 40, "temperature": 0.8, "seed": 7,
                    "ignore_eos": true}),
        );
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 40, "{v}");
        v["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let before = fixed.metric("kiln_spec_draft_tokens_total");
    assert_eq!(sampled(), sampled(), "seeded sampling with speculation");
    assert!(
        fixed.metric("kiln_spec_draft_tokens_total") > before,
        "sampling drafted nothing"
    );

    let adaptive = Server::start(&["--speculative-algorithm", "ngram"]);
    let got = concurrently(&adaptive, &p, 16);
    assert_eq!(got, want, "adaptive policy at C=16");
    let got = concurrently(&adaptive, &p[..4], 1);
    assert_eq!(got[..], want[..4], "adaptive policy at C=1");
    assert_drafted(&adaptive, "the adaptive n-gram policy");
}

/// The exactness checks above prove something only if the policy drafted.
fn assert_drafted(s: &Server, what: &str) {
    let drafted = s.metric("kiln_spec_draft_tokens_total");
    assert!(
        drafted > 0.0,
        "{what} drafted nothing, so its exactness check verified no draft"
    );
}

/// Exact mode (f32 weights) alone: verifying 2-5 tokens runs the four-rows-by-two-tokens f32
/// kernel, whose every value must equal the one-token decode's bit for bit. (Batches of six or
/// more tokens go through the blocked GEMM, whose summation order differs, so exact mode is not
/// batch-invariant across sequences; one sequence with S = 4 stays on the exact-equal path.)
#[test]
fn ngram_speculation_keeps_exact_mode_greedy_output_exact_alone() {
    let p = prompts();
    let base = Server::start(&["--mode", "exact"]);
    let want: Vec<(String, u64)> = p[..6].iter().map(|(t, e)| greedy(&base, t, *e)).collect();
    drop(base);
    let spec = Server::start(&[&["--mode", "exact"][..], &NGRAM_FIXED_S4].concat());
    let got = concurrently(&spec, &p[..6], 1);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "exact mode, prompt {i} ({:?})", p[i].0);
    }
    assert!(
        spec.metric("kiln_spec_accepted_tokens_total") > 0.0,
        "nothing accepted"
    );
}

#[test]
fn bad_speculation_flags_are_refused_with_the_flag_named() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args([
            "serve",
            "--speculative-algorithm",
            "ngram",
            "--speculative-ngram-min",
            "4",
        ])
        .args(["--speculative-ngram-max", "2"])
        .output()
        .expect("run kiln");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--speculative-ngram-min"), "{err}");
    // Tree flags: each mistake names the flag at fault.
    let cases: [(&[&str], &str); 4] = [
        (
            &[
                "--speculative-algorithm",
                "ngram",
                "--speculative-eagle-topk",
                "2",
            ],
            "--speculative-eagle-topk",
        ),
        (
            &[
                "--speculative-algorithm",
                "ngram",
                "--speculative-num-draft-tokens",
                "9",
            ],
            "--speculative-num-draft-tokens",
        ),
        (
            &[
                "--speculative-algorithm",
                "eagle3",
                "--speculative-eagle-topk",
                "4",
                "--speculative-num-draft-tokens",
                "65",
            ],
            "--speculative-num-draft-tokens",
        ),
        (
            &[
                "--speculative-algorithm",
                "eagle3",
                "--speculative-eagle-topk",
                "9",
                "--speculative-num-steps",
                "10",
            ],
            "--speculative-eagle-topk",
        ),
    ];
    for (args, flag) in cases {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("serve")
            .args(args)
            .output()
            .expect("run kiln");
        assert!(!out.status.success(), "{args:?} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{args:?}: {err}");
    }
}

#[test]
fn eagle3_chain_speculation_keeps_greedy_output_exact_alone_and_at_c16() {
    let p = prompts();
    let want: Vec<(String, u64)> = {
        let base = Server::start(&[]);
        p.iter().map(|(t, e)| greedy(&base, t, *e)).collect()
    };
    let comma = common::smollm2_tokenizer()
        .encode(",", false)
        .expect("encode");
    assert_eq!(comma.len(), 1, "\",\" is one token");
    let dir = common::small_vocab_draft("eagle3-comma", &[","]);
    let draft = dir.to_string_lossy().to_string();
    let fixed = Server::start(&[
        "--speculative-algorithm",
        "eagle3",
        "--speculative-draft-model-path",
        &draft,
        "--speculative-policy",
        "fixed",
        "--speculative-num-steps",
        "3",
    ]);
    for c in [1, 16] {
        let n = if c == 1 { 6 } else { p.len() };
        let got = concurrently(&fixed, &p[..n], c);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "EAGLE-3, C={c}, prompt {i} ({:?})", p[i].0);
        }
    }
    let drafted = fixed.metric("kiln_spec_draft_tokens_total");
    let accepted = fixed.metric("kiln_spec_accepted_tokens_total");
    assert!(
        accepted > 0.0 && drafted > accepted,
        "drafted {drafted}, accepted {accepted}"
    );
    let adaptive = Server::start(&[
        "--speculative-algorithm",
        "eagle3",
        "--speculative-draft-model-path",
        &draft,
    ]);
    let got = concurrently(&adaptive, &p, 16);
    assert_eq!(got, want, "EAGLE-3, adaptive policy at C=16");
    let got = concurrently(&adaptive, &p[..4], 1);
    assert_eq!(got[..], want[..4], "EAGLE-3, adaptive policy at C=1");
    assert_drafted(&adaptive, "the adaptive EAGLE-3 chain policy");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn eagle3_tree_speculation_keeps_greedy_output_exact_alone_and_at_c16() {
    let p = prompts();
    let want: Vec<(String, u64)> = {
        let base = Server::start(&[]);
        p.iter().map(|(t, e)| greedy(&base, t, *e)).collect()
    };
    let dir = common::small_vocab_draft("eagle3-tree", &[",", " ", ".", "\n", " the"]);
    let draft = dir.to_string_lossy().to_string();
    let tree = common::eagle3_tree_flags(&draft);
    let mut fixed_flags = tree.to_vec();
    fixed_flags.extend(["--speculative-policy", "fixed"]);
    let fixed = Server::start(&fixed_flags);
    for c in [1, 16] {
        let n = if c == 1 { 6 } else { p.len() };
        let got = concurrently(&fixed, &p[..n], c);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "EAGLE-3 tree, C={c}, prompt {i} ({:?})", p[i].0);
        }
    }
    let drafted = fixed.metric("kiln_spec_draft_tokens_total");
    let accepted = fixed.metric("kiln_spec_accepted_tokens_total");
    assert!(
        accepted > 0.0 && drafted > accepted,
        "drafted {drafted}, accepted {accepted}"
    );
    // The adaptive policy: on this CPU it parks a tree draft (verifying 8 positions and
    // expanding 3 nodes per draft step costs more than the accepted tokens return, even at one
    // sequence), so this checks that the parked path serves exact output; the fixed run above is
    // the one that verifies tree drafts. No drafted-count assertion here: it would depend on
    // timings the policy measures on a shared machine.
    let adaptive = Server::start(&tree);
    let got = concurrently(&adaptive, &p, 16);
    assert_eq!(got, want, "EAGLE-3 tree, adaptive policy at C=16");
    let got = concurrently(&adaptive, &p[..4], 1);
    assert_eq!(got[..], want[..4], "EAGLE-3 tree, adaptive policy at C=1");
    std::fs::remove_dir_all(&dir).ok();
}
