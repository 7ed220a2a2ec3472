//! Overlap scheduling, driven through the engine on the CPU: the runner draws every token with
//! the backend's sampling op (as on a GPU), so steps launch before the previous step's tokens
//! are read, each fed from where it was drawn. The tokens must be exactly those of the plain
//! path, whatever ends each request (a stop token found one step late, its length known ahead),
//! alone or sixteen at once, and the steps must really have launched ahead.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln::backend::Precision;
use kiln::batching::{EngineConfig, EngineHandle, EngineRequest, Event, RequestParams};
use kiln::generate::FinishReason;
use kiln::metrics::Metrics;
use kiln::runner::{Device, GraphUse, LoadSpec, RunnerConfig, SamplingSite};
use kiln::sampling::SamplingParams;
use kiln::speculation::SpecConfig;

fn engine(overlap: bool, graphs: GraphUse) -> (EngineHandle, Arc<Metrics>) {
    let load = LoadSpec {
        device: Device::Cpu,
        model: common::smollm2(),
        precision: Precision::Fast,
        threads: Some(2),
        tensor_parallel: 1,
        collective_timeout: Duration::from_secs(60),
        group: Default::default(),
        moe_split: Default::default(),
        draft_model: None,
        mem_fraction: None,
        runner: RunnerConfig {
            kv_tokens: 4096,
            block_size: 16,
            max_step_tokens: 256,
            spec: SpecConfig::default(),
            sampling: SamplingSite::Backend,
            graphs,
            overlap,
        },
    };
    let (runner, _) = kiln::runner::load(&load, &mut |_| {}).expect("load");
    let metrics = Arc::new(Metrics::new("m", "i"));
    let handle = kiln::batching::spawn(
        runner,
        EngineConfig {
            max_running: 16,
            max_step_tokens: 256,
            max_model_len: 2048,
            detok_overlap: true,
            prefix_cache: true,
        },
        metrics.clone(),
    )
    .expect("engine");
    (handle, metrics)
}

#[derive(Clone)]
struct Ask {
    prompt: Vec<u32>,
    max_tokens: usize,
    stop: Vec<u32>,
    sampling: SamplingParams,
}

/// What a request got: its tokens and how it ended.
#[derive(Debug, PartialEq)]
struct Got {
    tokens: Vec<u32>,
    reason: FinishReason,
    completion_tokens: usize,
}

/// Submits every ask at once (or one after another) and waits for all of them.
fn run(engine: &EngineHandle, asks: &[Ask], together: bool) -> Vec<Got> {
    let mut receivers = Vec::new();
    let mut out = Vec::new();
    for a in asks {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        assert!(engine.submit(EngineRequest {
            prompt: a.prompt.clone(),
            params: RequestParams {
                max_tokens: a.max_tokens,
                sampling: a.sampling,
                ignore_eos: true,
                stop_token_ids: a.stop.clone(),
                guide: None,
                keep_special: false,
            },
            events: tx,
            arrival: Instant::now(),
        }));
        receivers.push(rx);
        if !together {
            out.push(wait(receivers.pop().expect("receiver")));
        }
    }
    out.extend(receivers.into_iter().map(wait));
    out
}

fn wait(mut rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Got {
    let t0 = Instant::now();
    let mut tokens = Vec::new();
    loop {
        match rx.try_recv() {
            Ok(Event::Token { sampled, .. }) => tokens.push(sampled.token),
            Ok(Event::Cached(_)) => {}
            Ok(Event::Finished {
                reason,
                completion_tokens,
                ..
            }) => {
                return Got {
                    tokens,
                    reason,
                    completion_tokens,
                };
            }
            Ok(Event::Failed(m)) => panic!("the request failed: {m}"),
            Err(tokio::sync::mpsc::error::TryRecvError::Empty) => {
                assert!(t0.elapsed() < Duration::from_secs(120), "the request hangs");
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("the engine dropped the request: {e}"),
        }
    }
}

/// Sixteen prompts of different lengths and budgets; one ends at its first token.
fn asks() -> Vec<Ask> {
    (0..16u32)
        .map(|i| Ask {
            prompt: (0..3 + 5 * i)
                .map(|j| 200 + (j * 37 + i * 101) % 20_000)
                .collect(),
            max_tokens: if i == 5 { 1 } else { 6 + (i as usize * 3) % 17 },
            stop: Vec::new(),
            sampling: SamplingParams::greedy(),
        })
        .collect()
}

fn launched_ahead(m: &Metrics) -> u64 {
    m.steps_launched_ahead.get()
}

#[test]
fn steps_launched_ahead_emit_exactly_the_plain_path_s_tokens() {
    let (plain, plain_m) = engine(false, GraphUse::Off);
    let mut asks = asks();
    let probe = run(&plain, &asks, true);
    // Stop tokens the plain run emits mid-way, so those requests end by a token the overlapped
    // engine only learns of after it launched the next step.
    for (a, got) in asks.iter_mut().zip(&probe).step_by(3) {
        if got.tokens.len() > 3 {
            a.stop = vec![got.tokens[2]];
        }
    }
    let want_together = run(&plain, &asks, true);
    let want_alone = run(&plain, &asks[..4], false);
    assert_eq!(
        launched_ahead(&plain_m),
        0,
        "overlap off launches nothing ahead"
    );
    assert!(
        want_together
            .iter()
            .any(|g| g.reason == FinishReason::Eos && g.tokens.len() < 20),
        "some request must end by a stop token mid-way: {want_together:?}"
    );

    for graphs in [GraphUse::Off, GraphUse::PadOnly { max_bs: 8 }] {
        let (ahead, m) = engine(true, graphs);
        let got_together = run(&ahead, &asks, true);
        let together_launches = launched_ahead(&m);
        let got_alone = run(&ahead, &asks[..4], false);
        for (i, (g, w)) in got_together.iter().zip(&want_together).enumerate() {
            assert_eq!(g, w, "request {i} of 16 at once ({graphs:?})");
        }
        assert_eq!(got_alone, want_alone, "one at a time ({graphs:?})");
        assert!(
            together_launches > 10 && launched_ahead(&m) > together_launches + 10,
            "steps must launch ahead at C = 16 and C = 1: {together_launches}, {}",
            launched_ahead(&m)
        );
        assert_eq!(m.kv_blocks_used.get(), 0, "every block is freed at the end");
    }
}

#[test]
fn a_request_with_penalties_makes_every_step_wait_and_keeps_its_tokens() {
    let penalised = Ask {
        prompt: vec![504, 3458, 282, 4193, 314, 504, 3458],
        max_tokens: 12,
        stop: Vec::new(),
        sampling: SamplingParams {
            repetition_penalty: 1.3,
            frequency_penalty: 0.5,
            ..SamplingParams::greedy()
        },
    };
    let (plain, _) = engine(false, GraphUse::Off);
    let want = run(&plain, std::slice::from_ref(&penalised), true);
    let (ahead, m) = engine(true, GraphUse::Off);
    let got = run(&ahead, std::slice::from_ref(&penalised), true);
    assert_eq!(got, want);
    assert_eq!(
        launched_ahead(&m),
        0,
        "penalties count the tokens before each draw on the host"
    );
    // A plain request next launches ahead again.
    run(&ahead, &asks()[..1], true);
    assert!(launched_ahead(&m) > 0);
}
