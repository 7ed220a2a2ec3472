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
fn ngram_speculation_keeps_greedy_output_exact_at_every_batch_size() {
    let p = prompts();
    let want: Vec<(String, u64)> = {
        let base = Server::start(&[]);
        p.iter().map(|(t, e)| greedy(&base, t, *e)).collect()
    };
    let fixed = Server::start(&[
        "--speculative-algorithm",
        "ngram",
        "--speculative-policy",
        "fixed",
        "--speculative-num-steps",
        "4",
    ]);
    for c in [1, 4, 16] {
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
}
