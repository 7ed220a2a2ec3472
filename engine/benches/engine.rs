//! `cargo bench --bench engine`: prefill and single-stream decode throughput of the CPU backend on the
//! default model, in both precision modes, plus the weight-bandwidth roofline for decode.
//!
//! Batched decode (what a server does at concurrency B): B sequences with a 200-token context each
//! decode together, one token per sequence per step.
//!
//! Options (env, since cargo bench passes no flags through cleanly): KILN_BENCH_MODEL=path,
//! KILN_BENCH_PROMPT=512, KILN_BENCH_DECODE=128, KILN_BENCH_MODES=fast,exact, KILN_BENCH_REPS=3,
//! KILN_BENCH_THREADS=n (default: all cores), KILN_BENCH_BATCHES=1,4,16 (empty: skip batched decode).

use std::path::PathBuf;
use std::time::Instant;

use kiln::backend::cpu::CpuBackend;
use kiln::backend::{Backend, Precision, SeqSpan};
use kiln::generate::{GenerateOptions, SingleSequence};
use kiln::kv_cache::{BlockAllocator, SeqBlocks};
use kiln::load::{LoadedModel, load_model};
use kiln::model::{ForwardBatch, Workspace};

const BLOCK: usize = 16;

/// Output tok/s of `batch` sequences decoding `steps` tokens each after a `context`-token prefill.
fn batched_decode(m: &LoadedModel<CpuBackend>, batch: usize, context: usize, steps: usize) -> f64 {
    let c = m.config();
    let per_seq = (context + steps).div_ceil(BLOCK);
    let mut alloc = BlockAllocator::new(per_seq * batch, BLOCK);
    let mut kv = m
        .backend
        .kv_store(
            c.n_layers,
            per_seq * batch,
            BLOCK,
            c.kv_width(),
            c.kv_layout(),
            m.model.precision,
        )
        .expect("backend op");
    let mut ws = Workspace::new(&m.backend).expect("workspace");
    let mut seqs: Vec<SeqBlocks> = (0..batch).map(|_| SeqBlocks::default()).collect();
    for s in &mut seqs {
        s.reserve(&mut alloc, context + steps).expect("kv fits");
    }
    let mut run_step = |len: usize, n_new: usize| {
        let spans: Vec<SeqSpan> = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| SeqSpan {
                first_token: i * n_new,
                n_tokens: n_new,
                start_pos: len,
                block_table: &s.table,
                tree: None,
            })
            .collect();
        let tokens: Vec<u32> = (0..batch * n_new)
            .map(|i| 1000 + (i as u32 * 37) % 40000)
            .collect();
        let positions: Vec<usize> = (0..batch).flat_map(|_| len..len + n_new).collect();
        let logit_rows: Vec<usize> = (0..batch).map(|i| (i + 1) * n_new - 1).collect();
        let fb = ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            spans: &spans,
            logit_rows: &logit_rows,
            fill: None,
        };
        m.model
            .forward(&m.backend, &mut kv, &fb, &mut ws)
            .expect("forward");
    };
    run_step(0, context);
    let t = Instant::now();
    for i in 0..steps {
        run_step(context + i, 1);
    }
    (batch * steps) as f64 / t.elapsed().as_secs_f64()
}

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Sustained read bandwidth of this machine (GB/s), all cores: sums a buffer far larger than the
/// caches.
fn read_bandwidth() -> f64 {
    use rayon::prelude::*;
    let n = 512 << 20;
    let buf = vec![1u64; n / 8];
    let mut best = 0f64;
    for _ in 0..3 {
        let t = Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(s);
        best = best.max(n as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    best
}

fn main() {
    let model = std::env::var("KILN_BENCH_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            let cache = kiln::catalog::cache_dir(
                std::env::var("XDG_CACHE_HOME").ok().as_deref(),
                std::env::var("HOME").ok().as_deref(),
            );
            kiln::catalog::DEFAULT_MODEL
                .require(&cache)
                .unwrap_or_else(|e| panic!("{e}"))
        });
    let n_prompt = env_usize("KILN_BENCH_PROMPT", 512);
    let n_decode = env_usize("KILN_BENCH_DECODE", 128);
    let reps = env_usize("KILN_BENCH_REPS", 3);
    let modes = std::env::var("KILN_BENCH_MODES").unwrap_or_else(|_| "fast,exact".into());
    let weight_bytes = std::fs::metadata(&model).map(|m| m.len()).unwrap_or(0) as f64;
    let bw = read_bandwidth();
    println!(
        "model {} ({:.1} MB), {} threads, read bandwidth {:.1} GB/s -> decode roofline {:.0} tok/s",
        model.display(),
        weight_bytes / 1e6,
        std::env::var("KILN_BENCH_THREADS").unwrap_or_else(|_| "all".into()),
        bw,
        bw * 1e9 / weight_bytes
    );
    for mode in modes.split(',') {
        let precision = match mode {
            "exact" => Precision::Exact,
            _ => Precision::Fast,
        };
        let backend = match std::env::var("KILN_BENCH_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            Some(t) => CpuBackend::with_threads(t),
            None => CpuBackend::new(),
        };
        let m = load_model(backend, &model, precision, |_, _| {}).expect("load");
        let mut seq = SingleSequence::new(&m, n_prompt + n_decode + 1).expect("sequence");
        // Prompt ids cycle through ordinary vocabulary; the content does not change the work.
        let prompt: Vec<u32> = (0..n_prompt as u32)
            .map(|i| 1000 + (i * 37) % 40000)
            .collect();
        // As llama-bench: prefill is timed on its own, decode starts from a one-token context.
        let prefill_only = GenerateOptions {
            max_tokens: 1,
            ignore_eos: true,
            ..Default::default()
        };
        let decode = GenerateOptions {
            max_tokens: n_decode + 1,
            ignore_eos: true,
            ..Default::default()
        };
        let (mut best_pp, mut best_tg) = (0f64, 0f64);
        for _ in 0..reps {
            let r = seq
                .generate(&m, &prompt, &prefill_only, |_| {})
                .expect("prefill");
            best_pp = best_pp.max(n_prompt as f64 / r.prefill_time.as_secs_f64());
            let r = seq
                .generate(&m, &prompt[..1], &decode, |_| {})
                .expect("decode");
            best_tg = best_tg.max((r.output.len() - 1) as f64 / r.decode_time.as_secs_f64());
        }
        let batches = std::env::var("KILN_BENCH_BATCHES").unwrap_or_else(|_| "1,4,16".into());
        for b in batches
            .split(',')
            .filter_map(|b| b.trim().parse::<usize>().ok())
        {
            let best = (0..reps)
                .map(|_| batched_decode(&m, b, 200, 32))
                .fold(0f64, f64::max);
            println!("{mode:>5}: batched decode B={b:<3} {best:8.1} tok/s (200-token contexts)");
        }
        println!(
            "{mode:>5}: prefill pp{n_prompt} {best_pp:8.1} tok/s | decode tg{n_decode} {best_tg:8.1} tok/s (best of {reps}, simd {:?})",
            m.backend.simd_level()
        );
    }
}
