//! One batched forward over several sequences (a prefill chunk, a decode token, a longer prompt mixed
//! in one step) gives the same logits as running each sequence alone.

mod common;

use kiln::backend::cpu::CpuBackend;
use kiln::backend::{Backend, Precision, SeqSpan};
use kiln::kv_cache::{BlockAllocator, SeqBlocks};
use kiln::load::{LoadedModel, load_model};
use kiln::model::{ForwardBatch, Workspace};

const BLOCK: usize = 16;

struct Seq {
    tokens: Vec<u32>,
    blocks: SeqBlocks,
}

/// Runs `steps`: each step is a list of (sequence index, how many of its next tokens to feed).
fn run(
    m: &LoadedModel<CpuBackend>,
    seqs: &mut [Seq],
    steps: &[Vec<(usize, usize)>],
) -> Vec<Vec<f32>> {
    let c = m.config();
    let mut alloc = BlockAllocator::new(64, BLOCK);
    let mut kv = m
        .backend
        .kv_store(
            c.n_layers,
            64,
            BLOCK,
            c.kv_width(),
            c.kv_layout(),
            m.model.precision,
        )
        .expect("backend op");
    let mut ws = Workspace::new(&m.backend).expect("workspace");
    let mut done = vec![0usize; seqs.len()];
    let mut all_logits = Vec::new();
    for step in steps {
        for &(s, n) in step {
            seqs[s]
                .blocks
                .reserve(&mut alloc, done[s] + n)
                .expect("kv fits");
        }
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::new();
        let mut logit_rows = Vec::new();
        for &(s, n) in step {
            spans.push(SeqSpan {
                first_token: tokens.len(),
                n_tokens: n,
                start_pos: done[s],
                block_table: &seqs[s].blocks.table,
                tree: None,
            });
            tokens.extend_from_slice(&seqs[s].tokens[done[s]..done[s] + n]);
            positions.extend(done[s]..done[s] + n);
            logit_rows.push(tokens.len() - 1);
        }
        let batch = ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            spans: &spans,
            logit_rows: &logit_rows,
            fill: None,
        };
        let logits = m
            .model
            .forward(&m.backend, &mut kv, &batch, &mut ws)
            .expect("forward");
        for (i, &(s, n)) in step.iter().enumerate() {
            done[s] += n;
            all_logits.push(logits[i * c.vocab_size..(i + 1) * c.vocab_size].to_vec());
        }
    }
    all_logits
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

fn check(precision: Precision, tolerance: f32) {
    let m = load_model(CpuBackend::new(), &common::smollm2(), precision, |_, _| {}).expect("load");
    let text = [
        "The quick brown fox jumps over the lazy dog.",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "In 1905, Albert Einstein published four papers that changed physics: on the photoelectric effect, \
         Brownian motion, special relativity, and the equivalence of mass and energy.",
    ];
    let make = || -> Vec<Seq> {
        text.iter()
            .map(|t| Seq {
                tokens: m.tokenizer.encode(t, true).expect("encode"),
                blocks: SeqBlocks::default(),
            })
            .collect()
    };
    let lens: Vec<usize> = make().iter().map(|s| s.tokens.len()).collect();
    // Batched: seq 0 whole prompt minus one + seq 2 first chunk; then seq 0's last token (decode), seq 1
    // whole, seq 2 the rest.
    let (a, c) = (lens[0], lens[2]);
    let batched_steps = vec![
        vec![(0, a - 1), (2, 17)],
        vec![(0, 1), (1, lens[1]), (2, c - 17)],
    ];
    let batched = run(&m, &mut make(), &batched_steps);
    // Alone: the same split per sequence, one sequence per step.
    let alone0 = run(&m, &mut make(), &[vec![(0, a - 1)], vec![(0, 1)]]);
    let alone1 = run(&m, &mut make(), &[vec![(1, lens[1])]]);
    let alone2 = run(&m, &mut make(), &[vec![(2, 17)], vec![(2, c - 17)]]);
    let pairs = [
        (&batched[0], &alone0[0]),
        (&batched[2], &alone0[1]),
        (&batched[3], &alone1[0]),
        (&batched[1], &alone2[0]),
        (&batched[4], &alone2[1]),
    ];
    for (i, (x, y)) in pairs.iter().enumerate() {
        let d = max_rel_diff(y, x);
        assert!(
            d <= tolerance,
            "{precision:?} pair {i}: relative difference {d}"
        );
        assert_eq!(
            kiln::sampling::argmax(x),
            kiln::sampling::argmax(y),
            "{precision:?} pair {i}: argmax"
        );
    }
}

#[test]
fn batched_equals_alone_fast() {
    // Fast mode computes each token's dot products independently of its batch: identical results.
    check(Precision::Fast, 0.0);
}

#[test]
fn batched_equals_alone_exact() {
    // Exact mode's blocked GEMM may sum in a different order for different batch sizes.
    check(Precision::Exact, 1e-4);
}

#[test]
fn every_simd_level_gives_the_same_logits() {
    // One prompt through the whole model (prefill of 17 tokens, then two decode steps) at each SIMD
    // level this CPU has: the kernels and attention variants differ only in summation order.
    let levels = kiln::backend::cpu::SimdLevel::available();
    let mut results = Vec::new();
    for &level in &levels {
        let m = load_model(
            CpuBackend::with_level(level),
            &common::smollm2(),
            Precision::Fast,
            |_, _| {},
        )
        .expect("load");
        let tokens = m
            .tokenizer
            .encode("def add(a, b):\n    return a + b\n\nprint(add(2, 3))", true)
            .expect("encode");
        let n = tokens.len();
        let mut seqs = vec![Seq {
            tokens,
            blocks: SeqBlocks::default(),
        }];
        results.push(run(
            &m,
            &mut seqs,
            &[vec![(0, n - 2)], vec![(0, 1)], vec![(0, 1)]],
        ));
    }
    for (level, r) in levels.iter().zip(&results).skip(1) {
        for (step, (x, y)) in r.iter().zip(&results[0]).enumerate() {
            let d = max_rel_diff(y, x);
            assert!(d <= 1e-3, "{level:?} step {step}: relative difference {d}");
            assert_eq!(
                kiln::sampling::argmax(x),
                kiln::sampling::argmax(y),
                "{level:?} step {step}"
            );
        }
    }
}

/// Plain causal forward of `tokens` in a fresh cache; the logits after its last token.
fn alone_last(m: &LoadedModel<CpuBackend>, tokens: &[u32]) -> Vec<f32> {
    let mut seqs = [Seq {
        tokens: tokens.to_vec(),
        blocks: SeqBlocks::default(),
    }];
    run(m, &mut seqs, &[vec![(0, tokens.len())]]).remove(0)
}

#[test]
fn tree_verification_equals_each_path_run_alone_and_moved_kv_decodes_on() {
    use kiln::backend::TreeMask;
    use kiln::speculation::tree::DraftTree;
    let m = load_model(
        CpuBackend::new(),
        &common::smollm2(),
        Precision::Exact,
        |_, _| {},
    )
    .expect("load");
    let c = m.config();
    let prompt = m
        .tokenizer
        .encode("def fibonacci(n):\n    if n < 2:\n", true)
        .expect("encode");
    let node = |t: &str| m.tokenizer.encode(t, false).expect("encode")[0];
    // Two root children, the first with two children of its own, and a grandchild: 6 nodes,
    // each seeing only its own path.
    let tree = DraftTree {
        tokens: vec![
            node("        "),
            node(" return"),
            node("return"),
            node(" pass"),
            node(" n"),
            node(" n"),
        ],
        parents: vec![None, None, Some(0), Some(0), Some(1), Some(2)],
    };
    let depths = tree.depths();
    let mask = tree.verify_mask();
    let n = prompt.len();
    let mut alloc = BlockAllocator::new(64, BLOCK);
    let mut kv = m
        .backend
        .kv_store(
            c.n_layers,
            64,
            BLOCK,
            c.kv_width(),
            c.kv_layout(),
            m.model.precision,
        )
        .expect("backend op");
    let mut ws = Workspace::new(&m.backend).expect("workspace");
    let mut blocks = SeqBlocks::default();
    blocks.reserve(&mut alloc, n + tree.len()).expect("kv fits");
    // Prefill all but the last prompt token, then the tree step.
    let prefill_pos: Vec<usize> = (0..n - 1).collect();
    let span = [SeqSpan {
        first_token: 0,
        n_tokens: n - 1,
        start_pos: 0,
        block_table: &blocks.table,
        tree: None,
    }];
    let rows = [n - 2];
    let batch = ForwardBatch {
        tokens: &prompt[..n - 1],
        positions: &prefill_pos,
        spans: &span,
        logit_rows: &rows,
        fill: None,
    };
    m.model
        .forward(&m.backend, &mut kv, &batch, &mut ws)
        .expect("prefill");
    let mut step_tokens = vec![prompt[n - 1]];
    step_tokens.extend_from_slice(&tree.tokens);
    let mut positions = vec![n - 1];
    positions.extend(depths.iter().map(|d| n - 1 + d));
    let span = [SeqSpan {
        first_token: 0,
        n_tokens: step_tokens.len(),
        start_pos: n - 1,
        block_table: &blocks.table,
        tree: Some(TreeMask {
            base: n - 1,
            rows: &mask,
        }),
    }];
    let rows: Vec<usize> = (0..step_tokens.len()).collect();
    let batch = ForwardBatch {
        tokens: &step_tokens,
        positions: &positions,
        spans: &span,
        logit_rows: &rows,
        fill: None,
    };
    let logits = m
        .model
        .forward(&m.backend, &mut kv, &batch, &mut ws)
        .expect("tree step");
    let path_of = |mut i: usize| {
        let mut p = vec![i];
        while let Some(up) = tree.parents[i] {
            p.push(up);
            i = up;
        }
        p.reverse();
        p
    };
    for r in 0..step_tokens.len() {
        let mut alone = prompt.clone();
        if r > 0 {
            alone.extend(path_of(r - 1).iter().map(|&i| tree.tokens[i]));
        }
        let want = alone_last(&m, &alone);
        let got = &logits[r * c.vocab_size..(r + 1) * c.vocab_size];
        let d = max_rel_diff(&want, got);
        // Masked positions add exact zeros, but the masked kernel sums in another order than
        // the plain one: the batched test's exact-mode tolerance.
        assert!(d <= 1e-4, "tree row {r}: relative difference {d}");
        assert_eq!(kiln::sampling::argmax(got), kiln::sampling::argmax(&want));
    }
    // Accept the path node 0 -> node 2 -> node 5: their KV moves to consecutive positions, and
    // decoding the next token on that cache matches the path run alone.
    let path = path_of(5);
    let moves: Vec<(usize, usize)> = path
        .iter()
        .enumerate()
        .map(|(depth, &i)| (n + i, n + depth))
        .collect();
    m.backend
        .move_kv(&mut kv, &blocks.table, &moves)
        .expect("move_kv");
    let next = node(" return");
    let at = n + path.len();
    let span = [SeqSpan {
        first_token: 0,
        n_tokens: 1,
        start_pos: at,
        block_table: &blocks.table,
        tree: None,
    }];
    let batch = ForwardBatch {
        tokens: &[next],
        positions: &[at],
        spans: &span,
        logit_rows: &[0],
        fill: None,
    };
    let got = m
        .model
        .forward(&m.backend, &mut kv, &batch, &mut ws)
        .expect("decode after the move");
    let mut alone = prompt.clone();
    alone.extend(path.iter().map(|&i| tree.tokens[i]));
    alone.push(next);
    let d = max_rel_diff(&alone_last(&m, &alone), &got);
    assert!(d <= 1e-4, "after the KV move: relative difference {d}");
}
