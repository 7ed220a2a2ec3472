//! Tensor parallelism on the CPU communicator: the model split over 2, 3 or 4 rank threads must
//! give the greedy tokens of the whole model (TP = 1) and of the transformers reference, with logits
//! within 1e-4 of TP = 1 (relative to the logit range: only the summation order differs). Runs
//! the tiny random models of every architecture (4 query / 2 KV heads: TP = 4 replicates KV
//! heads), SmolLM2 (9 / 3 heads: TP = 3) and Qwen2.5-Coder (14 / 2 heads: TP = 2).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use kiln::backend::Precision;
use kiln::parallel::tp::{GreedyRun, TpOptions, greedy};
use kiln::runner::Device;

fn run(path: &Path, world: usize, prompt: &[u32], n: usize) -> GreedyRun {
    run_in(Precision::Exact, path, world, prompt, n)
}

fn run_in(precision: Precision, path: &Path, world: usize, prompt: &[u32], n: usize) -> GreedyRun {
    let opts = TpOptions {
        device: Device::Cpu,
        world,
        precision,
        threads_per_rank: 1,
        timeout: Duration::from_secs(300),
        group: Default::default(),
        moe: Default::default(),
    };
    greedy(path, opts, prompt, n).unwrap_or_else(|e| panic!("{}, TP={world}: {e}", path.display()))
}

/// Largest |a - b| over the logits, relative to the range of `b`.
fn rel_diff(a: &GreedyRun, b: &GreedyRun) -> f32 {
    let mut worst = 0f32;
    for (x, y) in a.logits.iter().zip(&b.logits) {
        let (lo, hi) = y
            .iter()
            .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
        let d = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max);
        worst = worst.max(d / (hi - lo).max(1e-6));
    }
    worst
}

fn ids(v: &serde_json::Value, key: &str) -> Vec<u32> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("fixture lacks {key}"))
        .iter()
        .map(|x| x.as_u64().expect("token id") as u32)
        .collect()
}

fn check_equivalence(path: &Path, worlds: &[usize], prompt: &[u32], reference: &[u32]) {
    let n = reference.len();
    let whole = run(path, 1, prompt, n);
    assert_eq!(
        whole.tokens,
        reference,
        "{}: TP=1 vs transformers",
        path.display()
    );
    for &w in worlds {
        let split = run(path, w, prompt, n);
        assert_eq!(
            split.tokens,
            whole.tokens,
            "{}: TP={w} vs TP=1",
            path.display()
        );
        let d = rel_diff(&split, &whole);
        assert!(
            d < 1e-4,
            "{}: TP={w} logits differ by {d} of their range",
            path.display()
        );
        eprintln!(
            "{}: TP={w} equal to TP=1, logits within {d:.2e}",
            path.display()
        );
    }
}

#[test]
fn tiny_models_split_over_2_and_4_ranks_match_the_whole_model() {
    let f = common::fixture("tiny-models.json");
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for m in f["models"].as_array().expect("models") {
        let name = m["name"].as_str().unwrap_or_default();
        if name.contains("sharded") {
            continue; // bf16 shards: the same architecture as llama3, different storage
        }
        let path = dir.join(m["dir"].as_str().expect("dir"));
        check_equivalence(&path, &[2, 4], &ids(m, "prompt_ids"), &ids(m, "greedy_ids"));
    }
}

#[test]
fn smollm2_split_over_3_ranks_matches_the_whole_model() {
    let f = common::fixture("smollm2-135m.greedy.json");
    let case = &f["cases"][0];
    let reference: Vec<u32> = ids(case, "greedy_ids").into_iter().take(12).collect();
    check_equivalence(
        &common::smollm2(),
        &[3],
        &ids(case, "prompt_ids"),
        &reference,
    );
}

#[test]
fn smollm2_fast_mode_splits_its_quantized_blocks_over_3_ranks() {
    // Fast mode keeps Q4_1 blocks: each rank's output-projection columns (192) and MLP columns
    // (512) fall on 32-value block boundaries, so the shards are the stored blocks themselves.
    let f = common::fixture("smollm2-135m.greedy.json");
    let case = &f["cases"][0];
    let prompt = ids(case, "prompt_ids");
    let whole = run_in(Precision::Fast, &common::smollm2(), 1, &prompt, 12);
    let split = run_in(Precision::Fast, &common::smollm2(), 3, &prompt, 12);
    assert_eq!(split.tokens, whole.tokens);
    let d = rel_diff(&split, &whole);
    assert!(d < 1e-3, "fast TP=3 logits differ by {d} of their range");
    eprintln!("SmolLM2 fast: TP=3 equal to TP=1, logits within {d:.2e}");
}

#[test]
fn qwen_split_over_2_ranks_matches_the_whole_model() {
    let f = common::fixture("qwen2.5-coder-0.5b.greedy.json");
    let case = &f["cases"][0];
    let reference: Vec<u32> = ids(case, "greedy_ids").into_iter().take(6).collect();
    check_equivalence(&common::qwen(), &[2], &ids(case, "prompt_ids"), &reference);
}

#[test]
fn a_split_that_does_not_fit_is_refused_by_name_and_nothing_hangs() {
    let opts = |world| TpOptions {
        device: Device::Cpu,
        world,
        precision: Precision::Exact,
        threads_per_rank: 1,
        timeout: Duration::from_secs(60),
        group: Default::default(),
        moe: Default::default(),
    };
    let e = greedy(&common::smollm2(), opts(2), &[1, 2, 3], 2).unwrap_err();
    assert!(e.to_string().contains("9 attention heads"), "{e}");
    // Every rank fails to load: the run reports the file, not a peer failure.
    let e = greedy(Path::new("/nonexistent/model.gguf"), opts(2), &[1], 1).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/model.gguf"), "{e}");
}

fn serve(tp: usize, threads: usize) -> common::server::Server {
    let port = common::server::free_port();
    let model = common::smollm2();
    let (port_s, tp_s, threads_s) = (port.to_string(), tp.to_string(), threads.to_string());
    let args = [
        "--port",
        &port_s,
        "--model",
        model.to_str().expect("utf-8 path"),
        "--kv-tokens",
        "4096",
        "--threads",
        &threads_s,
        "--tensor-parallel-size",
        &tp_s,
    ];
    common::server::Server::start_exactly(port, &args)
}

#[test]
fn the_server_split_over_3_ranks_answers_as_the_whole_model_does() {
    let whole = serve(1, 1);
    let split = serve(3, 3);
    let prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Water boils at a temperature of",
    ];
    // Concurrent requests too: continuous batching across ranks keeps every sequence apart.
    let answers = |s: &common::server::Server| -> Vec<String> {
        std::thread::scope(|scope| {
            let handles: Vec<_> = prompts
                .iter()
                .map(|p| {
                    scope.spawn(move || {
                        let body =
                            serde_json::json!({"prompt": p, "max_tokens": 24, "temperature": 0});
                        let (status, v) = s.post_json("/v1/completions", &body);
                        assert_eq!(status, 200, "{v}");
                        v["choices"][0]["text"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("client thread"))
                .collect()
        })
    };
    let (a, b) = (answers(&whole), answers(&split));
    assert_eq!(a, b);
    assert!(a.iter().all(|t| !t.is_empty()), "{a:?}");
}

#[test]
fn the_server_refuses_a_split_the_model_cannot_take() {
    let model = common::smollm2();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve", "--port", &common::server::free_port().to_string()])
        .arg("--model")
        .arg(&model)
        .args(["--tensor-parallel-size", "2", "--threads", "2"])
        .output()
        .expect("run kiln serve");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("9 attention heads"), "{err}");
}

/// Peers on the CPU over `model`, one thread each, blocks of 16, exact mode.
fn peer_config(model: PathBuf) -> kiln::parallel::PeerConfig {
    kiln::parallel::PeerConfig {
        device: Device::Cpu,
        model,
        precision: Precision::Exact,
        threads_per_rank: 1,
        block_size: 16,
        group: Default::default(),
        moe: Default::default(),
        draft_model: None,
    }
}

#[test]
fn a_peer_whose_group_stalls_fails_its_step_instead_of_hanging() {
    use kiln::parallel::{ThreadComm, TpPeers};

    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/llama3");
    let cfg = peer_config;
    // A peer that cannot load fails the start with the loading error.
    let mut comms = ThreadComm::group(2, Duration::from_secs(10));
    let e = TpPeers::spawn(cfg(PathBuf::from("/nonexistent/tiny")), comms.split_off(1))
        .err()
        .expect("a missing model must fail the start");
    assert!(e.to_string().contains("/nonexistent/tiny"), "{e}");

    // Rank 0 hands out a step and then never joins the collective (a stuck rank): the peer's
    // all-reduce times out and its step reports that, well before any test timeout.
    let mut comms = ThreadComm::group(2, Duration::from_millis(500));
    let peers = TpPeers::spawn(cfg(dir), comms.split_off(1)).expect("peer loads");
    peers.size_caches(4).expect("peer sizes its cache");
    let t0 = std::time::Instant::now();
    common::submit_two_token_step(&peers);
    let e = peers.collect().expect_err("the stalled group must fail");
    assert!(e.to_string().contains("waited"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(20));
    drop(comms);
}

/// A peer that fails a job rank 0 does not wait for (a tree's KV move) reports it and leaves; the
/// next job that cannot reach it fails the group with that report's cause, not only "rank 1
/// failed".
#[test]
fn a_peer_failing_a_kv_move_takes_the_group_down_with_its_cause() {
    use kiln::backend::cpu::CpuBackend;
    use kiln::parallel::TpGroup;

    let cfg =
        peer_config(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/llama3"));
    let group = TpGroup::spawn(cfg, 2, Duration::from_secs(10), &CpuBackend::new())
        .expect("the group starts");
    group.size_caches(4).expect("the peer sizes its cache");
    // Position 100 lies past the one-block table: the peer's move panics.
    group
        .move_kv(&[0], &[(100, 0)])
        .expect("a KV move is sent without waiting");
    let t0 = std::time::Instant::now();
    let e = loop {
        match group.move_kv(&[0], &[]) {
            Err(e) => break e,
            Ok(()) => {
                assert!(
                    t0.elapsed() < Duration::from_secs(20),
                    "the peer never left"
                );
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    };
    assert!(e.to_string().contains("panicked"), "{e}");
    assert!(e.backend_lost(), "{e}");
}
