//! The EAGLE-3 draft head against the reference implementation: speculators' `Eagle3DraftModel`
//! on the same random weights (`tests/reference/make_eagle3_fixture.py`), in both checkpoint
//! layouts, reading hidden states that kiln's own target forward captured.

mod common;

use std::path::Path;

use kiln::backend::cpu::{CpuBackend, CpuBuffer, CpuKvStore};
use kiln::backend::{Backend, KvLayout, Precision, SeqSpan};
use kiln::kv_cache::{BlockAllocator, SeqBlocks};
use kiln::load::{LoadedModel, load_model};
use kiln::model::{DraftBatch, DraftInput, DraftWorkspace, Eagle3Draft, ForwardBatch, Workspace};
use kiln::parallel::Communicator;

const BLOCK: usize = 16;

fn floats(case: &serde_json::Value, k: &str) -> Vec<f32> {
    serde_json::from_value(case[k].clone()).expect("floats")
}

fn ids(case: &serde_json::Value, k: &str) -> Vec<usize> {
    serde_json::from_value(case[k].clone()).expect("ids")
}

/// Largest absolute difference relative to the reference's largest magnitude.
fn rel_err(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len());
    let scale = reference.iter().fold(0f32, |m, v| m.max(v.abs()));
    ours.iter()
        .zip(reference)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
        / scale
}

/// The target's residual streams entering `layers`, for every prompt token.
fn captured(m: &LoadedModel<CpuBackend>, prompt: &[u32], layers: &[usize]) -> Vec<CpuBuffer> {
    let c = m.config();
    let n = prompt.len();
    let mut alloc = BlockAllocator::new(n.div_ceil(BLOCK), BLOCK);
    let mut seq = SeqBlocks::default();
    seq.reserve(&mut alloc, n).expect("kv");
    let mut kv = m
        .backend
        .kv_store(
            c.n_layers,
            n.div_ceil(BLOCK),
            BLOCK,
            c.kv_width(),
            c.kv_layout(),
            m.model.precision,
        )
        .expect("backend op");
    let positions: Vec<usize> = (0..n).collect();
    let spans = [SeqSpan {
        first_token: 0,
        n_tokens: n,
        start_pos: 0,
        block_table: &seq.table,
        tree: None,
    }];
    let mut ws = Workspace::new(&m.backend).expect("workspace");
    ws.capture_layers = layers.to_vec();
    let batch = ForwardBatch {
        tokens: prompt,
        positions: &positions,
        spans: &spans,
        logit_rows: &[n - 1],
        fill: None,
    };
    m.model
        .forward(&m.backend, &mut kv, &batch, &mut ws)
        .expect("forward");
    ws.captured
}

struct Run {
    step0: Vec<f32>,
    step1: Vec<f32>,
}

/// Draft-extend over the whole prompt (inputs (g_t, x_{t+1})), then for every position t one
/// chained step from t's output hidden state with token x_{t+2} at position t+1 — on a KV cache
/// holding the extend's entries up to t, as speculators' second training-time-test step sees it.
fn run_draft(
    m: &LoadedModel<CpuBackend>,
    draft: &Eagle3Draft<CpuBackend>,
    prompt: &[u32],
    next_id: u32,
    comm: Option<&dyn Communicator>,
) -> Run {
    // One draft forward through the group's communicator when `draft` is a rank's shard.
    let forward = |kv: &mut CpuKvStore,
                   ws: &mut DraftWorkspace<CpuBackend>,
                   batch: DraftBatch<'_>,
                   input: DraftInput<'_, CpuBackend>| {
        draft
            .forward_batch(&m.backend, m.model.embedding(), kv, &batch, input, ws, comm)
            .expect("draft forward")
    };
    let n = prompt.len();
    let aux = captured(m, prompt, draft.aux_layers());
    let mut tokens: Vec<u32> = prompt[1..].to_vec();
    tokens.push(next_id);
    let positions: Vec<usize> = (0..n).collect();
    let blocks = (n + 1).div_ceil(BLOCK);
    let mut alloc = BlockAllocator::new(blocks, BLOCK);
    let mut seq = SeqBlocks::default();
    seq.reserve(&mut alloc, n + 1).expect("kv");
    let mut kv = m
        .backend
        .kv_store(
            1,
            blocks,
            BLOCK,
            draft.kv_width(),
            KvLayout::KeysAndValues,
            Precision::Exact,
        )
        .expect("backend op");
    let mut ws = DraftWorkspace::new(&m.backend).expect("workspace");
    let all: Vec<usize> = (0..n).collect();
    let spans = [SeqSpan {
        first_token: 0,
        n_tokens: n,
        start_pos: 0,
        block_table: &seq.table,
        tree: None,
    }];
    let batch = DraftBatch {
        tokens: &tokens,
        positions: &positions,
        spans: &spans,
        rows: &all,
    };
    let out = forward(&mut kv, &mut ws, batch, DraftInput::Target(&aux));
    let step0 = out.logits;
    let mut step1 = Vec::new();
    for t in 0..n - 2 {
        // A fresh cache with the extend's entries 0..=t, then the chained step at t + 1.
        let mut kv = m
            .backend
            .kv_store(
                1,
                blocks,
                BLOCK,
                draft.kv_width(),
                KvLayout::KeysAndValues,
                Precision::Exact,
            )
            .expect("backend op");
        let prefix: Vec<usize> = (0..=t).collect();
        let aux_prefix: Vec<CpuBuffer> = aux
            .iter()
            .map(|a| m.backend.gather_rows(a, &prefix).expect("backend op"))
            .collect();
        let spans = [SeqSpan {
            first_token: 0,
            n_tokens: t + 1,
            start_pos: 0,
            block_table: &seq.table,
            tree: None,
        }];
        let batch = DraftBatch {
            tokens: &tokens[..=t],
            positions: &positions[..=t],
            spans: &spans,
            rows: &[t],
        };
        let ext = forward(&mut kv, &mut ws, batch, DraftInput::Target(&aux_prefix));
        let spans = [SeqSpan {
            first_token: 0,
            n_tokens: 1,
            start_pos: t + 1,
            block_table: &seq.table,
            tree: None,
        }];
        let batch = DraftBatch {
            tokens: &[tokens[t + 1]],
            positions: &[t + 1],
            spans: &spans,
            rows: &[0],
        };
        let step = forward(&mut kv, &mut ws, batch, DraftInput::Own(&ext.hidden));
        step1.extend(step.logits);
    }
    Run { step0, step1 }
}

fn load_target() -> LoadedModel<CpuBackend> {
    let dir = common::tiny_with_tokenizer("llama3");
    load_model(CpuBackend::new(), &dir, Precision::Exact, |_, _| {}).expect("target")
}

fn load_draft(m: &LoadedModel<CpuBackend>, name: &str) -> Eagle3Draft<CpuBackend> {
    let dir = common::tiny_fixture_dir(name);
    Eagle3Draft::load(&m.backend, &dir, m.config(), Precision::Exact).expect("draft")
}

#[test]
fn speculators_layout_matches_the_reference_for_extend_and_chained_steps() {
    let case = common::fixture("tiny/eagle3.json");
    let m = load_target();
    let draft = load_draft(&m, "eagle3-speculators");
    assert_eq!(draft.aux_layers(), ids(&case, "aux_layer_ids").as_slice());
    for (d, &t) in ids(&case, "d2t_target_ids").iter().enumerate() {
        assert_eq!(draft.target_id(d) as usize, t, "d2t of draft id {d}");
    }
    let prompt: Vec<u32> = ids(&case, "prompt_ids").iter().map(|&i| i as u32).collect();
    let run = run_draft(
        &m,
        &draft,
        &prompt,
        case["next_id"].as_u64().expect("id") as u32,
        None,
    );
    let e0 = rel_err(&run.step0, &floats(&case, "step0_logits"));
    let e1 = rel_err(&run.step1, &floats(&case, "step1_logits"));
    eprintln!("speculators layout: step 0 rel err {e0:.2e}, chained step {e1:.2e}");
    assert!(e0 < 1e-4, "extend logits differ from speculators: {e0}");
    assert!(
        e1 < 1e-4,
        "chained-step logits differ from speculators: {e1}"
    );
}

/// The head split over `world` rank threads (tensor parallelism's shard of it on each, its
/// partial sums meeting in the group's all-reduces): every rank's draft KV width, and rank 0's
/// extend and chained-step logits.
fn sharded_run(world: usize, prompt: &[u32], next_id: u32) -> (Vec<usize>, Run) {
    use kiln::parallel::{Shard, ThreadComm};
    let comms = ThreadComm::group(world, std::time::Duration::from_secs(60));
    let ranks: Vec<_> = comms
        .into_iter()
        .map(|comm| {
            let prompt = prompt.to_vec();
            std::thread::spawn(move || {
                let m = load_target();
                let dir = common::tiny_fixture_dir("eagle3-speculators");
                let shard = Shard::of(comm.rank(), world);
                let draft =
                    Eagle3Draft::load_shard(&m.backend, &dir, m.config(), Precision::Exact, shard)
                        .expect("draft shard");
                let run = run_draft(&m, &draft, &prompt, next_id, Some(&comm));
                (draft.kv_width(), run)
            })
        })
        .collect();
    let mut results: Vec<(usize, Run)> =
        ranks.into_iter().map(|h| h.join().expect("rank")).collect();
    let widths = results.iter().map(|r| r.0).collect();
    (widths, results.swap_remove(0).1)
}

#[test]
fn the_head_split_over_2_and_4_rank_threads_matches_the_reference_and_3_runs_it_whole() {
    let case = common::fixture("tiny/eagle3.json");
    let prompt: Vec<u32> = ids(&case, "prompt_ids").iter().map(|&i| i as u32).collect();
    let next = case["next_id"].as_u64().expect("id") as u32;
    let (ref0, ref1) = (floats(&case, "step0_logits"), floats(&case, "step1_logits"));
    // Each rank stores only its KV heads: the head's 2 (of width 16) split over 2 ranks, one
    // replicated per pair of ranks over 4. Its 4 heads do not divide over 3 ranks: then the head
    // runs whole on every rank, and still drafts the same.
    for (world, kv_width) in [(2, 16), (4, 16), (3, 32)] {
        let (widths, run) = sharded_run(world, &prompt, next);
        assert_eq!(
            widths,
            vec![kv_width; world],
            "{world} ranks: draft KV widths"
        );
        let (e0, e1) = (rel_err(&run.step0, &ref0), rel_err(&run.step1, &ref1));
        eprintln!("draft head over {world} ranks: extend rel err {e0:.2e}, chained step {e1:.2e}");
        assert!(e0 < 1e-4, "{world} ranks: extend logits differ: {e0}");
        assert!(e1 < 1e-4, "{world} ranks: chained-step logits differ: {e1}");
    }
}

#[test]
fn fast_mode_draft_with_8_bit_weights_stays_close_to_the_reference() {
    // Fast mode stores a float draft head's matrices as 8-bit blocks (a quarter of the bytes per
    // draft step); only acceptance can move, so a loose bound suffices — but it must hold.
    let case = common::fixture("tiny/eagle3.json");
    let m = load_target();
    let dir = common::tiny_fixture_dir("eagle3-speculators");
    let draft = Eagle3Draft::load(&m.backend, &dir, m.config(), Precision::Fast).expect("draft");
    let prompt: Vec<u32> = ids(&case, "prompt_ids").iter().map(|&i| i as u32).collect();
    let run = run_draft(
        &m,
        &draft,
        &prompt,
        case["next_id"].as_u64().expect("id") as u32,
        None,
    );
    let e0 = rel_err(&run.step0, &floats(&case, "step0_logits"));
    let e1 = rel_err(&run.step1, &floats(&case, "step1_logits"));
    eprintln!("fast-mode draft: step 0 rel err {e0:.2e}, chained step {e1:.2e}");
    assert!(e0 > 0.0, "8-bit weights should not be bit-exact");
    assert!(
        e0 < 3e-2 && e1 < 3e-2,
        "fast-mode draft drifted: {e0}, {e1}"
    );
}

#[test]
fn sglang_layout_reads_shifted_layer_ids_and_the_targets_embeddings() {
    let case = common::fixture("tiny/eagle3.json");
    let m = load_target();
    let draft = load_draft(&m, "eagle3-sglang");
    // eagle_config [0, 0, 1] = the outputs of layers 0, 0 and 1.
    assert_eq!(
        draft.aux_layers(),
        ids(&case, "sglang_aux_layer_ids").as_slice()
    );
    let prompt: Vec<u32> = ids(&case, "prompt_ids").iter().map(|&i| i as u32).collect();
    let run = run_draft(
        &m,
        &draft,
        &prompt,
        case["next_id"].as_u64().expect("id") as u32,
        None,
    );
    let e0 = rel_err(&run.step0, &floats(&case, "sglang_step0_logits"));
    eprintln!("sglang layout: step 0 rel err {e0:.2e}");
    assert!(e0 < 1e-4, "extend logits differ from speculators: {e0}");
}

#[test]
fn a_broken_draft_is_refused_naming_the_file_and_field() {
    let m = load_target();
    let src = common::tiny_fixture_dir("eagle3-speculators");
    let dst = std::env::temp_dir().join(format!("kiln-eagle3-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dst).expect("dir");
    std::fs::copy(src.join("model.safetensors"), dst.join("model.safetensors")).expect("copy");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).expect("read"))
            .expect("json");
    let try_config = |edit: &dyn Fn(&mut serde_json::Value)| -> String {
        let mut c = config.clone();
        edit(&mut c);
        std::fs::write(dst.join("config.json"), c.to_string()).expect("write");
        match Eagle3Draft::load(&m.backend, &dst, m.config(), Precision::Exact) {
            Ok(_) => panic!("a broken draft loaded"),
            Err(e) => e.to_string(),
        }
    };
    let e = try_config(&|c| c["draft_vocab_size"] = 100000.into());
    assert!(
        e.contains("draft_vocab_size") && e.contains("config.json"),
        "{e}"
    );
    let e = try_config(&|c| c["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([0, 9]));
    assert!(e.contains("layer 9"), "{e}");
    let e = try_config(&|c| c["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([0, 1]));
    assert!(e.contains("fc.weight reads 3"), "{e}");
    let e = try_config(&|c| c["norm_output"] = true.into());
    assert!(e.contains("norm_output"), "{e}");
    let e = try_config(&|c| c["transformer_layer_config"]["hidden_size"] = 32.into());
    assert!(e.contains("hidden size"), "{e}");
    let missing = Path::new("/nonexistent/kiln-draft");
    assert!(Eagle3Draft::load(&m.backend, missing, m.config(), Precision::Exact).is_err());
    std::fs::remove_dir_all(&dst).ok();
}
