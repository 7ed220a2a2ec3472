//! The model runner driven step by step as the engine drives it, for the tests that check what
//! a step emits (shared by `runner.rs` and `graphs.rs`).

use kiln::backend::Precision;
use kiln::kv_cache::{BlockAllocator, SeqBlocks};
use kiln::runner::{
    Device, GraphUse, LoadSpec, ModelRunner, RunnerConfig, SamplingSite, SeqParams, SeqPlan,
    StepPlan,
};
use kiln::sampling::SamplingParams;
use kiln::speculation::SpecConfig;

/// One sequence's tokens and blocks.
struct Seq {
    tokens: Vec<u32>,
    computed: usize,
    blocks: SeqBlocks,
}

/// Several sequences decoding together, as the engine drives them.
pub fn batch_run(
    r: &mut dyn ModelRunner,
    prompts: &[Vec<u32>],
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<Option<usize>>) {
    let (n_blocks, block) = r.kv_layout();
    let mut alloc = BlockAllocator::new(n_blocks, block);
    let mut seqs: Vec<Seq> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            r.admit(
                i as u64,
                SeqParams {
                    sampling: SamplingParams::greedy(),
                    ignore_eos: true,
                    stop_token_ids: vec![],
                },
                p,
            );
            Seq {
                tokens: p.clone(),
                computed: 0,
                blocks: SeqBlocks::default(),
            }
        })
        .collect();
    let mut buckets = Vec::new();
    for _ in 0..steps {
        for s in seqs.iter_mut() {
            s.blocks
                .reserve(&mut alloc, s.tokens.len())
                .expect("blocks");
        }
        let plan = StepPlan {
            seqs: seqs
                .iter()
                .enumerate()
                .map(|(i, s)| SeqPlan {
                    id: i as u64,
                    tokens: &s.tokens,
                    computed: s.computed,
                    cached_prefix: 0,
                    n_new: s.tokens.len() - s.computed,
                    block_table: &s.blocks.table,
                    decoding: s.tokens.len() - s.computed == 1,
                    draft_room: 0,
                    tokens_left: 1 << 20,
                    context_left: 1 << 20,
                    guide: None,
                    pending_last: false,
                })
                .collect(),
        };
        let out = r.execute(&plan).expect("step");
        buckets.push(out.graph_bucket);
        for (s, o) in seqs.iter_mut().zip(&out.seqs) {
            s.computed = s.tokens.len();
            s.tokens.extend(o.tokens.iter().map(|t| t.token));
        }
    }
    for i in 0..prompts.len() {
        r.release(i as u64);
    }
    (seqs.into_iter().map(|s| s.tokens).collect(), buckets)
}

/// A runner over `model` on the CPU (exact mode, two threads, 1024 KV tokens in blocks of 16, steps
/// of up to 256 tokens), split over `world` tensor-parallel ranks.
pub fn load_runner(
    model: std::path::PathBuf,
    spec: SpecConfig,
    sampling: SamplingSite,
    graphs: GraphUse,
    world: usize,
) -> Box<dyn ModelRunner> {
    let load = LoadSpec {
        device: Device::Cpu,
        model,
        precision: Precision::Exact,
        threads: Some(2),
        tensor_parallel: world,
        collective_timeout: std::time::Duration::from_secs(60),
        group: Default::default(),
        moe_split: Default::default(),
        draft_model: None,
        mem_fraction: None,
        runner: RunnerConfig {
            kv_tokens: 1024,
            block_size: 16,
            max_step_tokens: 256,
            spec,
            sampling,
            graphs,
            overlap: false,
        },
    };
    kiln::runner::load(&load, &mut |_| {}).expect("load").0
}
