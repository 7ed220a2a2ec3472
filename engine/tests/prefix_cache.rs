//! Prefix caching through the real server: questions over one shared document, one at a time
//! and sixteen at once, give exactly the tokens of a server that prefills every prompt in full;
//! the cached part is reported (`usage.prompt_tokens_details.cached_tokens`) and provably not
//! computed again (the prefilled-token counter drops by exactly what was reported); a cache too
//! small for the load evicts and preempts and still answers exactly, and nothing stays held
//! after clients disconnect mid-stream.

mod common;

use std::io::{Read, Write};

use common::server::Server;
use serde_json::{Value, json};

/// A document every question shares: `entries` lines, about 27 tokens each.
fn document(entries: usize) -> String {
    (0..entries)
        .map(|i| {
            format!(
                "Entry {i}: the kiln at station {i} fired {} pots of clay at {} degrees. ",
                i * 7 + 3,
                900 + i * 13
            )
        })
        .collect()
}

fn question(entries: usize, q: usize) -> String {
    format!(
        "{}\nQuestion: how many pots did station {} fire?\nAnswer:",
        document(entries),
        q * 3 % entries
    )
}

/// Greedy text and the usage of one completion.
fn ask(server: &Server, prompt: &str, max_tokens: usize) -> (String, Value) {
    let (status, body) = server.post_json(
        "/v1/completions",
        &json!({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": true}),
    );
    assert_eq!(status, 200, "{body}");
    (
        body["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string(),
        body["usage"].clone(),
    )
}

fn ask_all(server: &Server, prompts: &[String], together: bool) -> Vec<(String, Value)> {
    ask_n(server, prompts, together, 12)
}

fn ask_n(
    server: &Server,
    prompts: &[String],
    together: bool,
    max_tokens: usize,
) -> Vec<(String, Value)> {
    if !together {
        return prompts.iter().map(|p| ask(server, p, max_tokens)).collect();
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| s.spawn(move || ask(server, p, max_tokens)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect()
    })
}

fn cached(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens")
}

#[test]
fn shared_prefixes_are_computed_once_and_answer_exactly() {
    // About 550 tokens of document; one question alone, then eight at once.
    let prompts: Vec<String> = (0..9).map(|q| question(20, q)).collect();
    let plain = Server::start(&["--served-model-name", "m", "--no-prefix-cache"]);
    let want_alone = ask_all(&plain, &prompts[..4], false);
    let want_together = ask_all(&plain, &prompts[1..], true);
    let plain_prefill = plain.metric("kiln_prefill_tokens_total");
    assert!(
        want_alone
            .iter()
            .chain(&want_together)
            .all(|(_, u)| cached(u) == 0),
        "no cache, nothing cached"
    );

    let cache = Server::start(&["--served-model-name", "m"]);
    let got_alone = ask_all(&cache, &prompts[..4], false);
    let got_together = ask_all(&cache, &prompts[1..], true);
    for (i, (g, w)) in got_alone.iter().zip(&want_alone).enumerate() {
        assert_eq!(g.0, w.0, "question {i} alone");
        assert_eq!(g.1["prompt_tokens"], w.1["prompt_tokens"]);
    }
    for (i, (g, w)) in got_together.iter().zip(&want_together).enumerate() {
        assert_eq!(g.0, w.0, "question {} of 8 at once", i + 1);
    }
    // The first question computes the document; every later one finds most of it cached.
    assert_eq!(cached(&got_alone[0].1), 0);
    let prompt_tokens = got_alone[1].1["prompt_tokens"]
        .as_u64()
        .expect("prompt_tokens");
    assert!(
        got_alone[1..]
            .iter()
            .chain(&got_together)
            .all(|(_, u)| cached(u) > prompt_tokens / 2),
        "{got_together:?}"
    );
    // What was reported cached was not prefilled again.
    let reported: u64 = got_alone
        .iter()
        .chain(&got_together)
        .map(|(_, u)| cached(u))
        .sum();
    let cache_prefill = cache.metric("kiln_prefill_tokens_total");
    assert_eq!(
        plain_prefill - cache_prefill,
        reported as f64,
        "prefilled tokens drop by exactly the cached tokens"
    );
    assert!(cache.metric("kiln_prefix_cache_hit_tokens_total") >= reported as f64);
    let (_, info) = cache.request("GET", "/model_info", &[], b"");
    let info: Value = serde_json::from_str(&info).expect("model_info");
    assert_eq!(info["prefix_cache"], true);
}

/// Starts a streaming completion and drops the connection after its first bytes arrive.
fn abandon(server: &Server, prompt: &str) {
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 64, "stream": true,
                      "temperature": 0})
    .to_string();
    let mut sock =
        std::net::TcpStream::connect(("127.0.0.1", server_port(server))).expect("connect");
    write!(
        sock,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut buf = [0u8; 256];
    let _ = sock.read(&mut buf);
}

fn server_port(server: &Server) -> u16 {
    server
        .base_url()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("port")
}

#[test]
fn a_small_cache_evicts_and_preempts_and_still_answers_exactly() {
    // 640 KV tokens: about two prompts of 300, so eight questions at once preempt,
    // and cached blocks are given up for room.
    let model = common::smollm2().to_string_lossy().into_owned();
    let start = |extra: &[&str]| {
        let port = common::server::free_port();
        let port_text = port.to_string();
        let mut a = vec![
            "--model",
            &model,
            "--served-model-name",
            "m",
            "--kv-tokens",
            "640",
            "--threads",
            "1",
            "--port",
            &port_text,
        ];
        a.extend_from_slice(extra);
        Server::start_exactly(port, &a)
    };
    let prompts: Vec<String> = (0..8).map(|q| question(10, q)).collect();
    let plain = start(&["--no-prefix-cache"]);
    // The reference answers one at a time (no preemption); 40 tokens each, so eight
    // sequences at once outgrow the pool even with their document shared.
    let want = ask_n(&plain, &prompts, false, 40);
    let cache = start(&[]);
    // A different document first, so the questions' document must evict it.
    let other: Vec<String> = (0..2)
        .map(|q| format!("{}{}", "Another text entirely. ".repeat(100), q))
        .collect();
    ask_all(&cache, &other, false);
    let got = ask_n(&cache, &prompts, true, 40);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.0, w.0, "question {i}");
    }
    assert!(cache.metric("kiln_prefix_cache_evictions_total") > 0.0);
    assert!(
        cache.metric("kiln_preemptions_total") > 0.0,
        "the load must preempt a sequence that shares blocks"
    );
    // Clients that leave mid-stream hold nothing afterwards.
    for p in &prompts[..4] {
        abandon(&cache, p);
    }
    let t0 = std::time::Instant::now();
    while cache.metric("kiln_kv_blocks_used") > 0.0 {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "blocks still held after every client left"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(
        cache.metric("kiln_prefix_cache_blocks") > 0.0,
        "cached blocks stay"
    );
}

#[test]
fn eagle3_drafts_over_a_cached_prefix_and_stays_exact() {
    let prompts: Vec<String> = (0..4).map(|q| question(12, q)).collect();
    let plain = Server::start(&["--served-model-name", "m", "--no-prefix-cache"]);
    let want = ask_all(&plain, &prompts, false);
    let dir = std::env::temp_dir().join(format!("kiln-prefix-eagle3-{}", std::process::id()));
    let tok = common::smollm2_tokenizer();
    // A head drafting only from the digits the answers are made of.
    let digits: Vec<u32> = (0..10)
        .filter_map(|d| tok.encode(&d.to_string(), false).ok())
        .filter(|t| t.len() == 1)
        .map(|t| t[0])
        .collect();
    common::write_small_vocab_draft(&dir, &digits);
    let head = dir.to_string_lossy().into_owned();
    let spec = Server::start(&[
        "--served-model-name",
        "m",
        "--speculative-algorithm",
        "eagle3",
        "--speculative-draft-model-path",
        &head,
        "--speculative-policy",
        "fixed",
    ]);
    let first = ask(&spec, &prompts[0], 12);
    assert_eq!(first.0, want[0].0);
    let drafted_alone = spec.metric("kiln_spec_draft_tokens_total");
    assert!(drafted_alone > 0.0, "the first request drafts");
    for (i, p) in prompts.iter().enumerate().skip(1) {
        let before = spec.metric("kiln_spec_draft_tokens_total");
        let (text, usage) = ask(&spec, p, 12);
        assert_eq!(text, want[i].0, "question {i}");
        assert!(cached(&usage) > 0, "question {i} took the cached document");
        assert!(
            spec.metric("kiln_spec_draft_tokens_total") > before,
            "question {i} drafted over its cached prefix"
        );
    }
}
