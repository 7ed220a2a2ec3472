//! The model runner on its own: a step plan in, emitted tokens out, over a real model. What the
//! engine relies on and the server tests cannot isolate: the token mask, drafts held to a
//! grammar, the stop rules a step emits by, and drafting within the room the plan gives.

mod common;

use kiln::generate::FinishReason;
use kiln::kv_cache::{BlockAllocator, SeqBlocks};
use kiln::runner::{
    GraphUse, ModelRunner, SamplingSite, SeqParams, SeqPlan, StepOutput, StepPlan, TokenGuide,
    TokenMask,
};
use kiln::sampling::SamplingParams;
use kiln::speculation::{SpecConfig, SpecMethod};
use kiln::structured::{Constraint, Grammars};

fn runner(spec: SpecConfig) -> Box<dyn ModelRunner> {
    runner_at(spec, SamplingSite::Auto)
}

fn runner_at(spec: SpecConfig, sampling: SamplingSite) -> Box<dyn ModelRunner> {
    runner_with(spec, sampling, GraphUse::Off)
}

fn runner_with(spec: SpecConfig, sampling: SamplingSite, graphs: GraphUse) -> Box<dyn ModelRunner> {
    runner_of(common::smollm2(), spec, sampling, graphs)
}

fn runner_of(
    model: std::path::PathBuf,
    spec: SpecConfig,
    sampling: SamplingSite,
    graphs: GraphUse,
) -> Box<dyn ModelRunner> {
    common::steps::load_runner(model, spec, sampling, graphs, 1)
}

fn greedy() -> SeqParams {
    SeqParams {
        sampling: SamplingParams::greedy(),
        ignore_eos: true,
        stop_token_ids: vec![],
    }
}

/// One sequence through the runner step by step, as the engine drives it.
struct Seq {
    tokens: Vec<u32>,
    computed: usize,
    blocks: SeqBlocks,
}

impl Seq {
    fn step(
        &mut self,
        r: &mut dyn ModelRunner,
        alloc: &mut BlockAllocator,
        room: usize,
        tokens_left: usize,
        guide: Option<&dyn TokenGuide>,
    ) -> StepOutput {
        let n_new = self.tokens.len() - self.computed;
        let slots = if n_new == 1 { r.draft_slots(room) } else { 0 };
        self.blocks
            .reserve(alloc, self.tokens.len() + slots)
            .expect("blocks");
        let plan = StepPlan {
            seqs: vec![SeqPlan {
                id: 7,
                tokens: &self.tokens,
                computed: self.computed,
                cached_prefix: 0,
                n_new,
                block_table: &self.blocks.table,
                decoding: n_new == 1,
                draft_room: if slots > 0 { room } else { 0 },
                tokens_left,
                context_left: 1 << 20,
                guide,
                pending_last: false,
            }],
        };
        let out = r.execute(&plan).expect("step");
        let o = &out.seqs[0];
        self.computed += n_new + o.accepted;
        self.tokens.extend(o.tokens.iter().map(|s| s.token));
        out
    }
}

fn start(r: &mut dyn ModelRunner, prompt: &[u32]) -> (Seq, BlockAllocator) {
    start_with(r, prompt, greedy())
}

fn start_with(r: &mut dyn ModelRunner, prompt: &[u32], params: SeqParams) -> (Seq, BlockAllocator) {
    let (n_blocks, block) = r.kv_layout();
    r.admit(7, params, prompt);
    let seq = Seq {
        tokens: prompt.to_vec(),
        computed: 0,
        blocks: SeqBlocks::default(),
    };
    (seq, BlockAllocator::new(n_blocks, block))
}

const PROMPT: [u32; 6] = [1, 504, 3458, 282, 4193, 314];

/// One mask for every row.
#[derive(Debug)]
struct Only(TokenMask);

impl TokenGuide for Only {
    fn admits(&self, _drafts: &[u32]) -> usize {
        0
    }

    fn mask_after(&self, _path: &[u32]) -> TokenMask {
        self.0.clone()
    }
}

#[test]
fn the_token_mask_decides_what_a_step_may_sample() {
    let mut r = runner(SpecConfig::default());
    let (mut seq, mut alloc) = start(r.as_mut(), &PROMPT);
    let free = seq.step(r.as_mut(), &mut alloc, 0, 8, None).seqs[0].tokens[0].token;
    r.release(7);

    // The same step with the free choice masked out: the best of what the mask allows.
    let vocab = r.info().config.vocab_size;
    let allowed = [free + 1, free + 2, 17];
    let mask = Only(TokenMask::allowing(vocab, allowed));
    let (mut seq, mut alloc) = start(r.as_mut(), &PROMPT);
    let out = seq.step(r.as_mut(), &mut alloc, 0, 8, Some(&mask));
    let got = out.seqs[0].tokens[0].token;
    assert_ne!(got, free);
    assert!(allowed.contains(&got), "{got} is outside the mask");
}

#[test]
fn n_gram_drafts_are_made_and_verified_and_stop_at_the_token_budget() {
    let spec = ngram4();
    let mut plain = runner(SpecConfig::default());
    let prompt = repeating_prompt(plain.as_ref());
    let (mut want, mut alloc) = start(plain.as_mut(), &prompt);
    while want.tokens.len() < prompt.len() + 16 {
        want.step(plain.as_mut(), &mut alloc, 0, 64, None);
    }

    let mut r = runner(spec);
    let (mut seq, mut alloc) = start(r.as_mut(), &prompt);
    let (mut drafted, mut accepted) = (0, 0);
    while seq.tokens.len() < prompt.len() + 16 {
        let out = seq.step(r.as_mut(), &mut alloc, 4, 64, None);
        drafted += out.seqs[0].drafted;
        accepted += out.seqs[0].accepted;
        assert_eq!(out.seqs[0].tokens.len(), out.seqs[0].accepted + 1);
    }
    assert!(drafted > 0, "no drafts were made");
    assert!(accepted > 0, "no draft was accepted");
    assert_eq!(
        seq.tokens[..want.tokens.len()],
        want.tokens[..],
        "speculation changed greedy output"
    );

    // With one token left the step emits exactly one, whatever it drafted, and says why it ends.
    let out = seq.step(r.as_mut(), &mut alloc, 4, 1, None);
    assert_eq!(out.seqs[0].tokens.len(), 1);
    assert_eq!(out.seqs[0].finish, Some(FinishReason::Length));
}

/// Runs `prompt` under a regex until `n` tokens or the grammar ends, the guide following what
/// each step emits as the engine's does; returns the output and the drafted, accepted and
/// refused draft counts.
fn guided_run(
    r: &mut dyn ModelRunner,
    prompt: &[u32],
    regex: &str,
    room: usize,
    n: usize,
) -> (Vec<u32>, usize, usize, usize) {
    let info = r.info().clone();
    let grammars = Grammars::new(&info.tokenizer, info.config.vocab_size).expect("token table");
    let guide = std::sync::Mutex::new(
        grammars
            .guide(&Constraint::Regex(regex.into()))
            .expect("regex compiles"),
    );
    let (mut seq, mut alloc) = start(r, prompt);
    let (mut drafted, mut accepted, mut refused) = (0, 0, 0);
    while seq.tokens.len() < prompt.len() + n {
        let out = seq.step(r, &mut alloc, room, 64, Some(&guide));
        let o = &out.seqs[0];
        drafted += o.drafted;
        accepted += o.accepted;
        refused += o.refused;
        let mut g = guide.lock().expect("guide");
        for (k, s) in o.tokens.iter().enumerate() {
            g.advance(s.token);
            assert_eq!(g.error(), None, "the matcher refused an emitted token");
            if g.finished() {
                // What the step emitted past the grammar's end is dropped, as the engine does.
                let end = seq.tokens.len() - o.tokens.len() + k + 1;
                r.release(7);
                return (
                    seq.tokens[prompt.len()..end].to_vec(),
                    drafted,
                    accepted,
                    refused,
                );
            }
        }
    }
    r.release(7);
    (
        seq.tokens[prompt.len()..].to_vec(),
        drafted,
        accepted,
        refused,
    )
}

#[test]
fn a_guided_sequence_drafts_only_what_its_grammar_admits_and_keeps_greedy_output() {
    let mut plain = runner(SpecConfig::default());
    // The model would repeat the prompt's `4`s; the grammar forbids them, so prompt lookup keeps
    // proposing drafts the grammar refuses, among others it admits.
    let prompt = repeating_prompt(plain.as_ref());
    let regex = "( [0-35-9],){12}";
    let (want, ..) = guided_run(plain.as_mut(), &prompt, regex, 0, 40);
    let text = plain.info().tokenizer.decode(&want, true).expect("decode");
    assert!(!text.contains('4'), "the grammar was not applied: {text:?}");

    let mut r = runner(ngram4());
    let (got, drafted, accepted, refused) = guided_run(r.as_mut(), &prompt, regex, 4, 40);
    assert!(drafted > 0, "no drafts were verified");
    assert!(accepted > 0, "no draft was accepted");
    assert!(refused > 0, "the grammar refused no draft");
    assert_eq!(got, want, "drafting changed guided greedy output");
}

#[test]
fn a_failing_op_fails_the_step_with_an_error_and_the_runner_goes_on() {
    let mut r = runner(SpecConfig::default());
    let vocab = r.info().config.vocab_size as u32;
    // A token id past the vocabulary: the embedding op refuses it.
    let (mut bad, mut alloc) = start(r.as_mut(), &[1, vocab + 5]);
    bad.blocks.reserve(&mut alloc, 2).expect("blocks");
    let plan = StepPlan {
        seqs: vec![SeqPlan {
            id: 7,
            tokens: &bad.tokens,
            computed: 0,
            cached_prefix: 0,
            n_new: 2,
            block_table: &bad.blocks.table,
            decoding: false,
            draft_room: 0,
            tokens_left: 4,
            context_left: 64,
            guide: None,
            pending_last: false,
        }],
    };
    let e = r
        .execute(&plan)
        .expect_err("an id outside the vocabulary must fail the step");
    assert!(e.to_string().contains("outside the vocabulary"), "{e}");
    assert!(!e.backend_lost(), "one bad step does not lose the backend");
    r.release(7);

    // The next plan runs as if nothing happened.
    let (mut seq, mut alloc) = start(r.as_mut(), &PROMPT);
    let out = seq.step(r.as_mut(), &mut alloc, 0, 8, None);
    assert_eq!(out.seqs[0].tokens.len(), 1);
}

/// N-gram drafting of up to 4 tokens every step (no adaptive policy to park it).
fn ngram4() -> SpecConfig {
    SpecConfig {
        method: SpecMethod::Ngram,
        adaptive: false,
        num_steps: 4,
        ..SpecConfig::default()
    }
}

/// A prompt the model continues by repeating it, so prompt lookup has drafts that stand.
fn repeating_prompt(r: &dyn ModelRunner) -> Vec<u32> {
    r.info()
        .tokenizer
        .encode("1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,", true)
        .expect("encode")
}

/// Runs `n` tokens after `prompt` with n-gram drafting, returning the emitted tokens (with
/// logprobs) and the drafts made.
fn ngram_run(
    r: &mut dyn ModelRunner,
    prompt: &[u32],
    params: SeqParams,
    n: usize,
) -> (Vec<kiln::sampling::Sampled>, usize) {
    let (mut seq, mut alloc) = start_with(r, prompt, params);
    let (mut emitted, mut drafted) = (Vec::new(), 0);
    while emitted.len() < n {
        let out = seq.step(r, &mut alloc, 4, 64, None);
        drafted += out.seqs[0].drafted;
        emitted.extend(out.seqs[0].tokens.iter().cloned());
    }
    r.release(7);
    emitted.truncate(n);
    (emitted, drafted)
}

/// The device sampling path (every row drawn by the backend's op in one pass, drafts verified
/// there) run on the CPU backend: greedy tokens and logprobs equal the host path's, with drafts
/// made and verified; seeded random sampling is reproducible and really random.
#[test]
fn sampling_through_the_backend_op_matches_the_host_path() {
    let spec = ngram4();
    let mut host = runner_at(spec, SamplingSite::Auto);
    let mut device = runner_at(spec, SamplingSite::Backend);
    let prompt = repeating_prompt(host.as_ref());
    let with_logprobs = SeqParams {
        sampling: SamplingParams {
            logprobs: true,
            top_logprobs: 3,
            repetition_penalty: 1.1,
            ..SamplingParams::greedy()
        },
        ..greedy()
    };
    let (want, _) = ngram_run(host.as_mut(), &prompt, with_logprobs.clone(), 16);
    let (got, drafted) = ngram_run(device.as_mut(), &prompt, with_logprobs, 16);
    assert!(drafted > 0, "no drafts were made");
    let ids = |v: &[kiln::sampling::Sampled]| v.iter().map(|s| s.token).collect::<Vec<_>>();
    assert_eq!(ids(&got), ids(&want));
    for (g, w) in got.iter().zip(&want) {
        assert!((g.logprob - w.logprob).abs() < 1e-4, "{g:?} vs {w:?}");
        assert!(g.logprob < 0.0 && g.top.len() == 3, "{g:?}");
        for (a, b) in g.top.iter().zip(&w.top) {
            assert_eq!(a.0, b.0);
            assert!((a.1 - b.1).abs() < 1e-4);
        }
    }

    let seeded = |seed| SeqParams {
        sampling: SamplingParams {
            temperature: 1.5,
            top_k: 50,
            seed: Some(seed),
            ..SamplingParams::greedy()
        },
        ..greedy()
    };
    let (a, drafted) = ngram_run(device.as_mut(), &prompt, seeded(3), 24);
    let (b, _) = ngram_run(device.as_mut(), &prompt, seeded(3), 24);
    let (c, _) = ngram_run(device.as_mut(), &prompt, seeded(4), 24);
    assert!(drafted > 0, "no drafts were made while sampling");
    assert_eq!(ids(&a), ids(&b), "the same seed drew different tokens");
    assert_ne!(ids(&a), ids(&c), "different seeds drew the same 24 tokens");
    assert_ne!(
        ids(&a)[..16],
        ids(&want)[..],
        "sampling at t = 1.5 drew the greedy tokens"
    );
}

/// Decode steps padded to their graph bucket (three sequences run as four, the fourth writing
/// to a block of its own) emit exactly the tokens of unpadded steps, with host sampling and
/// with every row drawn by the backend's op.
#[test]
fn decode_steps_padded_to_graph_buckets_keep_every_token() {
    let load = |graphs, sampling| runner_with(SpecConfig::default(), sampling, graphs);
    let mut plain = load(GraphUse::Off, SamplingSite::Auto);
    let tok = plain.info().tokenizer.clone();
    let prompts: Vec<Vec<u32>> = ["The capital of France is", "def fib(n):", "1, 2, 3,"]
        .iter()
        .map(|p| tok.encode(p, true).expect("encode"))
        .collect();
    let (want, buckets) = common::steps::batch_run(plain.as_mut(), &prompts, 10);
    assert!(buckets.iter().all(Option::is_none));
    for sampling in [SamplingSite::Auto, SamplingSite::Backend] {
        let mut padded = load(GraphUse::PadOnly { max_bs: 8 }, sampling);
        let (got, buckets) = common::steps::batch_run(padded.as_mut(), &prompts, 10);
        // The prefill step is eager; every decode step of three ran as a bucket of four.
        assert_eq!(buckets[0], None);
        assert!(buckets[1..].iter().all(|&b| b == Some(4)), "{buckets:?}");
        assert_eq!(got, want, "padding changed the tokens ({sampling:?})");
    }
}

/// The same on a tiny DeepSeek-V3 (MLA + MoE, which graphs now cover): padded decode steps
/// route the padding's tokens too, and the real sequences' tokens do not move.
#[test]
fn mla_and_moe_decode_steps_padded_to_graph_buckets_keep_every_token() {
    let model = common::tiny_with_tokenizer("deepseek-v3");
    let load = |graphs, sampling| runner_of(model.clone(), SpecConfig::default(), sampling, graphs);
    let prompts: Vec<Vec<u32>> = vec![vec![5, 17, 42, 8, 99], vec![3, 3, 60], vec![71, 2, 30, 11]];
    let (want, buckets) = common::steps::batch_run(
        load(GraphUse::Off, SamplingSite::Auto).as_mut(),
        &prompts,
        8,
    );
    assert!(buckets.iter().all(Option::is_none));
    for sampling in [SamplingSite::Auto, SamplingSite::Backend] {
        let mut padded = load(GraphUse::PadOnly { max_bs: 8 }, sampling);
        let (got, buckets) = common::steps::batch_run(padded.as_mut(), &prompts, 8);
        assert_eq!(buckets[0], None);
        assert!(buckets[1..].iter().all(|&b| b == Some(4)), "{buckets:?}");
        assert_eq!(got, want, "padding changed the tokens ({sampling:?})");
    }
}

/// Padded decode steps under tensor parallelism: every rank runs the padded step (the padding
/// writing to the extra block each rank's cache keeps) and the gathered logits give the tokens
/// of TP = 1's unpadded steps.
#[test]
fn decode_steps_padded_to_graph_buckets_split_over_2_ranks_keep_every_token() {
    let model = common::tiny_with_tokenizer("deepseek-v3");
    let prompts: Vec<Vec<u32>> = vec![vec![5, 17, 42, 8, 99], vec![3, 3, 60], vec![71, 2, 30, 11]];
    let load = |graphs, world| {
        common::steps::load_runner(
            model.clone(),
            SpecConfig::default(),
            SamplingSite::Auto,
            graphs,
            world,
        )
    };
    let (want, _) = common::steps::batch_run(load(GraphUse::Off, 1).as_mut(), &prompts, 8);
    let mut split = load(GraphUse::PadOnly { max_bs: 8 }, 2);
    let (got, buckets) = common::steps::batch_run(split.as_mut(), &prompts, 8);
    assert_eq!(buckets[0], None);
    assert!(buckets[1..].iter().all(|&b| b == Some(4)), "{buckets:?}");
    assert_eq!(got, want, "TP = 2 padded steps vs TP = 1");
}

/// A runner whose step panics once (as a bug in a kernel would), around a real one.
struct PanicsOnce {
    inner: Box<dyn ModelRunner>,
    armed: bool,
}

impl ModelRunner for PanicsOnce {
    fn info(&self) -> &std::sync::Arc<kiln::runner::ModelInfo> {
        self.inner.info()
    }
    fn kv_layout(&self) -> (usize, usize) {
        self.inner.kv_layout()
    }
    fn admit(&mut self, id: u64, params: SeqParams, prompt: &[u32]) {
        self.inner.admit(id, params, prompt)
    }
    fn release(&mut self, id: u64) {
        self.inner.release(id)
    }
    fn draft_slots(&self, room: usize) -> usize {
        self.inner.draft_slots(room)
    }
    fn execute(&mut self, plan: &StepPlan<'_>) -> kiln::Result<StepOutput> {
        if std::mem::take(&mut self.armed) {
            panic!("a kernel bug");
        }
        self.inner.execute(plan)
    }
}

/// A panic inside a step fails that step's request with an error naming it, and the engine
/// thread goes on to serve the next request: never a hang.
#[test]
fn a_panicking_step_fails_its_request_and_the_engine_goes_on() {
    use kiln::batching::{EngineConfig, EngineRequest, Event, RequestParams};
    let runner = PanicsOnce {
        inner: runner(SpecConfig::default()),
        armed: true,
    };
    let metrics = std::sync::Arc::new(kiln::metrics::Metrics::new("m", "i"));
    let engine = kiln::batching::spawn(
        Box::new(runner),
        EngineConfig {
            max_running: 4,
            max_step_tokens: 256,
            max_model_len: 1024,
            detok_overlap: true,
            prefix_cache: true,
        },
        metrics,
    )
    .expect("engine");
    let run = |prompt: &[u32]| {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        assert!(engine.submit(EngineRequest {
            prompt: prompt.to_vec(),
            params: RequestParams {
                max_tokens: 3,
                sampling: SamplingParams::greedy(),
                ignore_eos: true,
                stop_token_ids: vec![],
                guide: None,
                keep_special: false,
            },
            events: tx,
            arrival: std::time::Instant::now(),
        }));
        let t0 = std::time::Instant::now();
        loop {
            match rx.try_recv() {
                Ok(Event::Finished { .. }) => return Ok(()),
                Ok(Event::Failed(m)) => return Err(m),
                Ok(Event::Token { .. } | Event::Cached(_)) => {}
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                    assert!(t0.elapsed().as_secs() < 60, "the request hangs");
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                Err(e) => panic!("the engine dropped the request: {e}"),
            }
        }
    };
    let failed = run(&PROMPT).expect_err("the panicking step fails its request");
    assert!(
        failed.contains("panicked") && failed.contains("a kernel bug"),
        "{failed}"
    );
    run(&PROMPT).expect("the next request is served");
}
