//! The engine thread: owns the model, the KV cache and the scheduler, and runs
//! `step()` = take new requests -> drop aborted ones -> schedule -> forward -> sample -> emit events.
//!
//! Detokenization, stop strings, JSON and SSE happen on the HTTP side, in parallel with the next
//! model step (the overlap); `overlap: false` moves detokenization onto this thread for comparison.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use super::request::{EngineRequest, Event, RequestParams};
use super::scheduler::{Scheduler, SchedulerConfig, SeqId, SeqState};
use crate::backend::{Backend, SeqSpan, TreeMask};
use crate::generate::FinishReason;
use crate::kv_cache::BlockAllocator;
use crate::load::LoadedModel;
use crate::metrics::Metrics;
use crate::metrics::{BatchLabels, PositionLabels};
use crate::model::{Eagle3Draft, ForwardBatch, Workspace};
use crate::parallel::TpGroup;
use crate::sampling::{Sampled, Sampler};
use crate::speculation::eagle::{ChainRequest, Confirmed, TreeRequest};
use crate::speculation::tree::DraftTree;
use crate::speculation::{self, EagleDrafter, Policy, SpecConfig, SpecMethod};
use crate::tokenizer::IncrementalDecoder;

#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    pub block_size: usize,
    /// KV cache size in tokens (rounded up to whole blocks).
    pub kv_tokens: usize,
    pub max_running: usize,
    pub max_step_tokens: usize,
    /// Longest sequence (prompt + output) a request may reach.
    pub max_model_len: usize,
    pub overlap: bool,
    pub spec: SpecConfig,
}

/// State the HTTP side reads without talking to the engine thread.
#[derive(Default)]
pub struct EngineStatus {
    /// Requests submitted and not yet finished.
    pub in_flight: AtomicUsize,
    /// Milliseconds since `started` of the engine loop's last turn (the watchdog's evidence).
    pub heartbeat_ms: AtomicU64,
}

/// The HTTP side's handle: submit requests; everything else flows back through each request's events.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Sender<EngineRequest>,
    pub status: Arc<EngineStatus>,
    pub started: Instant,
}

impl EngineHandle {
    /// Queues a request; `false` when the engine thread is gone.
    pub fn submit(&self, req: EngineRequest) -> bool {
        self.status.in_flight.fetch_add(1, Ordering::SeqCst);
        if self.tx.send(req).is_err() {
            self.status.in_flight.fetch_sub(1, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// Time since the engine loop last turned.
    pub fn since_heartbeat(&self) -> Duration {
        let beat = Duration::from_millis(self.status.heartbeat_ms.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(beat)
    }
}

/// Per-sequence state the scheduler does not need.
struct Live {
    params: RequestParams,
    sampler: Sampler,
    events: UnboundedSender<Event>,
    decoder: Option<IncrementalDecoder>,
    arrival: Instant,
    last_token: Option<Instant>,
    generated: usize,
    /// EAGLE-3: the draft has extended every position of this sequence so far (it may draft).
    draft_whole: bool,
}

pub struct Engine<B: Backend> {
    model: Arc<LoadedModel<B>>,
    cfg: EngineConfig,
    kv: B::KvStore,
    ws: Workspace<B>,
    tp: Option<TpGroup>,
    sched: Scheduler,
    live: HashMap<SeqId, Live>,
    next_id: SeqId,
    metrics: Arc<Metrics>,
    status: Arc<EngineStatus>,
    started: Instant,
    policy: Policy,
    /// The EAGLE-3 draft head and its state (`--speculative-algorithm eagle3`).
    eagle: Option<EagleDrafter<B>>,
}

/// One scheduled sequence of a step: its running index, tokens fed, and where its logits are.
struct Fed {
    index: usize,
    /// Tokens in the KV cache before this step (the first fed token's position).
    start: usize,
    /// Row of the first fed token in the step's batch.
    first: usize,
    n: usize,
    /// First logits row of this sequence, if it samples this step.
    row: Option<usize>,
    /// Draft tokens among the fed ones (the last `drafts` of them); each has its own logits row.
    drafts: usize,
    /// Tree speculation: the drafts as a tree, and its verification mask.
    tree: Option<(DraftTree, Vec<u64>)>,
}

/// This step's proposals: draft tokens per work item (appended to its sequence), and the tree
/// they form when tree speculation drafted them.
struct Drafts {
    counts: Vec<usize>,
    trees: Vec<Option<DraftTree>>,
}

impl Drafts {
    fn none(n: usize) -> Drafts {
        Drafts {
            counts: vec![0; n],
            trees: vec![None; n],
        }
    }
}

/// Hands one generated token to its request (events, metrics, sampler history already updated by
/// the sampler) and appends it to the sequence; returns why the request ends, if it does.
fn emit<B: Backend>(
    seq: &mut SeqState,
    live: &mut Live,
    sampled: Sampled,
    metrics: &Metrics,
    model: &LoadedModel<B>,
    cfg: &EngineConfig,
) -> Option<FinishReason> {
    let tok = sampled.token;
    seq.tokens.push(tok);
    live.generated += 1;
    let now = Instant::now();
    match live.last_token {
        None => metrics.ttft.observe((now - live.arrival).as_secs_f64()),
        Some(t) => metrics.inter_token.observe((now - t).as_secs_f64()),
    }
    live.last_token = Some(now);
    metrics.generation_tokens.inc();
    let text = match live.decoder.as_mut() {
        Some(d) => d.push(&model.tokenizer, tok).ok().flatten(),
        None => None,
    };
    let _ = live.events.send(Event::Token { sampled, text });
    let p = &live.params;
    let stop_token =
        p.stop_token_ids.contains(&tok) || (!p.ignore_eos && model.tokenizer.is_eos(tok));
    if stop_token {
        Some(FinishReason::Eos)
    } else if live.generated >= p.max_tokens {
        Some(FinishReason::Length)
    } else if seq.tokens.len() >= cfg.max_model_len {
        Some(FinishReason::ContextFull)
    } else {
        None
    }
}

/// One model step: the whole model, or (tensor parallelism: the engine thread is rank 0 and its
/// model rank 0's shard) rank 0's shard while the peers run theirs.
fn step_forward<B: Backend>(
    m: &LoadedModel<B>,
    kv: &mut B::KvStore,
    ws: &mut Workspace<B>,
    tp: Option<&TpGroup>,
    batch: &ForwardBatch<'_>,
) -> crate::Result<Vec<f32>> {
    match tp {
        None => m.model.forward(&m.backend, kv, batch, ws),
        Some(tp) => tp.step(batch, |comm| {
            m.model.forward_sharded(&m.backend, kv, batch, ws, comm)
        }),
    }
}

/// Starts the engine thread.
pub fn spawn<B: Backend + 'static>(
    model: Arc<LoadedModel<B>>,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
) -> std::io::Result<EngineHandle> {
    spawn_parallel(model, cfg, metrics, None, None)
}

/// Starts the engine thread as rank 0 of a tensor-parallel group (`model` is rank 0's shard),
/// with an EAGLE-3 draft head when `draft` is given (it runs on rank 0 only).
pub fn spawn_parallel<B: Backend + 'static>(
    model: Arc<LoadedModel<B>>,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
    tp: Option<TpGroup>,
    draft: Option<Eagle3Draft<B>>,
) -> std::io::Result<EngineHandle> {
    let (tx, rx) = std::sync::mpsc::channel();
    let status = Arc::new(EngineStatus::default());
    let started = Instant::now();
    let mut engine = Engine::new(model, cfg, metrics, status.clone(), started, tp, draft);
    std::thread::Builder::new()
        .name("kiln-engine".into())
        .spawn(move || engine.run(rx))?;
    Ok(EngineHandle {
        tx,
        status,
        started,
    })
}

impl<B: Backend> Engine<B> {
    fn new(
        model: Arc<LoadedModel<B>>,
        cfg: EngineConfig,
        metrics: Arc<Metrics>,
        status: Arc<EngineStatus>,
        started: Instant,
        tp: Option<TpGroup>,
        draft: Option<Eagle3Draft<B>>,
    ) -> Self {
        let c = model.config();
        let n_blocks = cfg.kv_tokens.div_ceil(cfg.block_size);
        // This rank's KV heads only (all of them without tensor parallelism).
        let kv = model.backend.kv_store(
            c.n_layers,
            n_blocks,
            cfg.block_size,
            model.model.local_kv_width(),
            model.model.precision,
        );
        let mut ws = Workspace::new(&model.backend);
        let eagle = draft
            .filter(|_| cfg.spec.method == SpecMethod::Eagle3)
            .map(|d| EagleDrafter::new(d, &model.backend, n_blocks, cfg.block_size, cfg.spec.topk));
        if let Some(e) = &eagle {
            ws.capture_layers = e.aux_layers().to_vec();
        }
        let sched = Scheduler::new(
            SchedulerConfig {
                max_running: cfg.max_running,
                max_step_tokens: cfg.max_step_tokens,
            },
            BlockAllocator::new(n_blocks, cfg.block_size),
        );
        metrics.kv_blocks_total.set(n_blocks as i64);
        let mut engine = Engine {
            policy: Policy::new(cfg.spec),
            model,
            cfg,
            kv,
            ws,
            tp,
            sched,
            live: HashMap::new(),
            next_id: 0,
            metrics,
            status,
            started,
            eagle,
        };
        if engine.policy.enabled() && engine.cfg.spec.adaptive {
            engine.calibrate();
        }
        engine
    }

    /// Seeds the speculation policy's cost table: timed forwards of 1..64 tokens on scratch blocks
    /// (released afterwards). Steps measured while serving refine it.
    fn calibrate(&mut self) {
        let c = self.model.config();
        let mut alloc = BlockAllocator::new(self.sched.blocks_total(), self.cfg.block_size);
        let mut blocks = crate::kv_cache::SeqBlocks::default();
        for n in [1usize, 2, 4, 8, 16, 32, 64] {
            if n > self.cfg.max_step_tokens || blocks.reserve(&mut alloc, n).is_err() {
                break;
            }
            let tokens: Vec<u32> = (0..n as u32).map(|i| i % c.vocab_size as u32).collect();
            let positions: Vec<usize> = (0..n).collect();
            let spans = [SeqSpan {
                first_token: 0,
                n_tokens: n,
                start_pos: 0,
                block_table: &blocks.table,
                tree: None,
            }];
            let rows = [n - 1];
            let batch = ForwardBatch {
                tokens: &tokens,
                positions: &positions,
                spans: &spans,
                logit_rows: &rows,
            };
            for _ in 0..2 {
                let t = Instant::now();
                if step_forward(
                    &self.model,
                    &mut self.kv,
                    &mut self.ws,
                    self.tp.as_ref(),
                    &batch,
                )
                .is_err()
                {
                    return;
                }
                self.policy.record_step(n, t.elapsed().as_secs_f64());
            }
        }
    }

    fn run(&mut self, rx: Receiver<EngineRequest>) {
        loop {
            self.beat();
            if self.sched.is_idle() {
                // Wake at least once a second so the heartbeat stays fresh for the watchdog.
                match rx.recv_timeout(Duration::from_secs(1)) {
                    Ok(req) => self.admit(req),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(req) = rx.try_recv() {
                self.admit(req);
            }
            self.step();
        }
    }

    fn beat(&self) {
        let ms = self.started.elapsed().as_millis() as u64;
        self.status.heartbeat_ms.store(ms, Ordering::Relaxed);
    }

    fn admit(&mut self, req: EngineRequest) {
        let id = self.next_id;
        self.next_id += 1;
        self.metrics.prompt_tokens.inc_by(req.prompt.len() as u64);
        let sampler = Sampler::new(req.params.sampling.clone(), &req.prompt);
        self.live.insert(
            id,
            Live {
                decoder: (!self.cfg.overlap).then(|| IncrementalDecoder::new(true)),
                params: req.params,
                sampler,
                events: req.events,
                arrival: req.arrival,
                last_token: None,
                generated: 0,
                draft_whole: false,
            },
        );
        self.sched.add(SeqState::new(id, req.prompt));
    }

    /// One model step over whatever the scheduler picks.
    pub fn step(&mut self) {
        let t0 = Instant::now();
        self.drop_aborted();
        let plan = self.sched.schedule();
        self.metrics.preemptions.inc_by(plan.preempted.len() as u64);
        self.update_gauges();
        if plan.work.is_empty() {
            return;
        }
        // The policy parked the EAGLE-3 draft (drafting did not pay): no drafts, no extend.
        let parked = self.policy.draft_parked(plan.work.len());
        self.metrics.spec_draft_parked.set(i64::from(parked));
        let Drafts { counts, trees } = self.draft(&plan.work, parked);
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut logit_rows = Vec::new();
        let mut fed: Vec<Fed> = Vec::new();
        for ((&(i, n), &d), tree) in plan.work.iter().zip(&counts).zip(trees) {
            let seq = &self.sched.running()[i];
            let n = n + d;
            let first = tokens.len();
            tokens.extend_from_slice(&seq.tokens[seq.computed..seq.computed + n]);
            match &tree {
                // Tree nodes take the slots after the current token, at their depth's position.
                Some(t) => {
                    positions.push(seq.computed);
                    positions.extend(t.depths().into_iter().map(|dep| seq.computed + dep));
                }
                None => positions.extend(seq.computed..seq.computed + n),
            }
            let samples = seq.computed + n == seq.tokens.len();
            let row = samples.then(|| {
                let row = logit_rows.len();
                // A verified sequence needs the logits after its last real token and after each
                // draft token.
                logit_rows.extend(first + n - 1 - d..first + n);
                row
            });
            fed.push(Fed {
                index: i,
                start: seq.computed,
                first,
                n,
                row,
                drafts: d,
                tree: tree.map(|t| {
                    let mask = t.verify_mask();
                    (t, mask)
                }),
            });
        }
        let running = self.sched.running();
        let mut first = 0;
        let spans: Vec<SeqSpan> = fed
            .iter()
            .map(|f| {
                let s = &running[f.index];
                let span = SeqSpan {
                    first_token: first,
                    n_tokens: f.n,
                    start_pos: s.computed,
                    block_table: &s.blocks.table,
                    tree: f.tree.as_ref().map(|(_, rows)| TreeMask {
                        base: s.computed,
                        rows,
                    }),
                };
                first += f.n;
                span
            })
            .collect();
        let batch = ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            spans: &spans,
            logit_rows: &logit_rows,
        };
        let t_forward = Instant::now();
        let result = step_forward(
            &self.model,
            &mut self.kv,
            &mut self.ws,
            self.tp.as_ref(),
            &batch,
        );
        drop(spans);
        self.policy
            .record_step(tokens.len(), t_forward.elapsed().as_secs_f64());
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("forward failed: {e}");
                let ids: Vec<SeqId> = fed
                    .iter()
                    .map(|f| self.sched.running()[f.index].id)
                    .collect();
                for id in ids {
                    self.finish_with(id, Event::Failed(format!("the model step failed: {e}")));
                }
                if matches!(e, crate::Error::Parallel(_)) {
                    // The group is down and cannot be rebuilt in place: end the process so the
                    // service manager restarts the whole server (the failed requests got their
                    // errors above; a moment lets them reach the clients).
                    eprintln!("kiln: {e}; exiting so the service restarts with a whole group");
                    std::thread::sleep(Duration::from_millis(300));
                    std::process::exit(70);
                }
                return;
            }
        };
        let vocab = self.model.config().vocab_size;
        let batch_label = BatchLabels::of(fed.len());
        let mut finished = Vec::new();
        // Tree sequences: the step rows of the positions verification confirmed.
        let mut confirmed_rows: Vec<Option<Vec<usize>>> = vec![None; fed.len()];
        for (fi, f) in fed.iter().enumerate() {
            let seq = &mut self.sched.running_mut()[f.index];
            seq.computed += f.n;
            let Some(row) = f.row else { continue };
            let id = seq.id;
            let Some(live) = self.live.get_mut(&id) else {
                continue;
            };
            // Take the drafts back off the sequence: only what verification emits stays.
            let base = seq.tokens.len() - f.drafts;
            let draft: Vec<u32> = seq.tokens.drain(base..).collect();
            seq.computed -= f.drafts;
            let mut accepted = 0;
            if let Some((tree, _)) = &f.tree {
                // Sample at each node the target reached (greedy: its argmax) and follow the
                // child carrying that token: exactly the tokens plain decoding would emit.
                // A token that ends the request stops the walk (as in a chain, it is not counted
                // as accepted: the sequence is done).
                let mut ended = None;
                let path = tree.accepted_path(|at| {
                    let r = row + at.map_or(0, |n| n + 1);
                    let mut row_logits = logits[r * vocab..(r + 1) * vocab].to_vec();
                    let sampled = live.sampler.sample(&mut row_logits);
                    let token = sampled.token;
                    ended = emit(seq, live, sampled, &self.metrics, &self.model, &self.cfg);
                    ended.is_none().then_some(token)
                });
                if let Some(r) = ended {
                    finished.push((id, r));
                }
                accepted = path.len();
                // Node c's KV sits in the slot after the current token's plus c; the accepted
                // path moves to consecutive positions (sources never precede destinations).
                let moves: Vec<(usize, usize)> = path
                    .iter()
                    .enumerate()
                    .map(|(depth, &c)| (f.start + 1 + c, f.start + 1 + depth))
                    .collect();
                self.model
                    .backend
                    .move_kv(&mut self.kv, &seq.blocks.table, &moves);
                seq.computed += accepted;
                confirmed_rows[fi] = Some(
                    std::iter::once(f.first)
                        .chain(path.iter().map(|&c| f.first + 1 + c))
                        .collect(),
                );
            } else {
                for j in 0..=f.drafts {
                    let r = row + j;
                    let mut row_logits = logits[r * vocab..(r + 1) * vocab].to_vec();
                    let (sampled, is_draft) = match draft.get(j) {
                        Some(&d) => live.sampler.verify(&mut row_logits, d),
                        None => (live.sampler.sample(&mut row_logits), false),
                    };
                    let reason = emit(seq, live, sampled, &self.metrics, &self.model, &self.cfg);
                    if let Some(r) = reason {
                        finished.push((id, r));
                        break;
                    }
                    if !is_draft {
                        break;
                    }
                    // An accepted draft's KV entry is already in the cache.
                    accepted += 1;
                    seq.computed += 1;
                }
            }
            if f.drafts > 0 {
                // A tree is tried depth by depth, as a chain of its depth.
                let proposed = f
                    .tree
                    .as_ref()
                    .map_or(f.drafts, |(t, _)| t.depths().into_iter().max().unwrap_or(0));
                self.policy.record_verify(proposed, accepted);
                self.metrics.spec_draft_tokens.inc_by(f.drafts as u64);
                self.metrics.spec_accepted_tokens.inc_by(accepted as u64);
                for p in 0..accepted {
                    self.metrics
                        .spec_accepted_per_position
                        .get_or_create(&PositionLabels {
                            position: p.to_string(),
                        })
                        .inc();
                }
                self.metrics
                    .spec_accept_length
                    .get_or_create(&batch_label)
                    .observe((accepted + 1) as f64);
                self.sched.trim_running(f.index);
            }
        }
        self.extend_draft(&fed, &confirmed_rows, &finished, parked);
        for (id, reason) in finished {
            self.finish(id, reason);
        }
        self.update_gauges();
        self.metrics.step_time.observe(t0.elapsed().as_secs_f64());
        self.metrics.batch_size.observe(fed.len() as f64);
        self.metrics.batch_tokens.observe(tokens.len() as f64);
    }

    /// EAGLE-3: the draft head catches up on every position this step confirmed.
    fn extend_draft(
        &mut self,
        fed: &[Fed],
        confirmed_rows: &[Option<Vec<usize>>],
        finished: &[(SeqId, FinishReason)],
        parked: bool,
    ) {
        let Some(eagle) = self.eagle.as_mut() else {
            return;
        };
        let running = self.sched.running();
        let seqs: Vec<Confirmed> = fed
            .iter()
            .zip(confirmed_rows)
            .filter(|(f, _)| {
                // Only a sequence whose every position went through the draft may draft: one
                // that starts now, or one that has been whole since it started; none while parked.
                let s = &running[f.index];
                self.live.get_mut(&s.id).is_some_and(|live| {
                    live.draft_whole = !parked && (f.start == 0 || live.draft_whole);
                    live.draft_whole
                })
            })
            .map(|(f, rows)| {
                let s = &running[f.index];
                let count = s.computed.saturating_sub(f.start);
                Confirmed {
                    id: s.id,
                    start: f.start,
                    batch_rows: rows
                        .clone()
                        .unwrap_or_else(|| (f.first..f.first + count).collect()),
                    tokens: &s.tokens,
                    block_table: &s.blocks.table,
                    drafts_next: s.computed + 1 == s.tokens.len()
                        && !finished.iter().any(|&(id, _)| id == s.id),
                }
            })
            .collect();
        let t = Instant::now();
        let m = &self.model;
        if let Err(e) = eagle.extend(&m.backend, m.model.embedding(), &self.ws.captured, &seqs) {
            // Drafting is an optimisation: the requests go on without drafts.
            tracing::error!("EAGLE-3 draft extend failed: {e}");
        }
        if !seqs.is_empty() {
            // A parked step's empty extend is not what keeping the draft costs.
            self.policy.record_extend(t.elapsed().as_secs_f64());
        }
    }

    /// EAGLE-3 proposals: K for the batch from the policy, then the chained draft steps (a
    /// chain of K tokens, or a tree of depth K with topk > 1).
    fn draft_eagle(&mut self, work: &[(usize, usize)]) -> Drafts {
        let mut drafts = Drafts::none(work.len());
        let Some(eagle) = self.eagle.as_ref() else {
            return drafts;
        };
        let spec = self.cfg.spec;
        let mut other_tokens = 0;
        let mut lens = Vec::new();
        let mut wanted = vec![0usize; work.len()];
        for (w, &(i, n)) in work.iter().enumerate() {
            let seq = &self.sched.running()[i];
            let decoding = n == 1 && seq.pending() == 1 && seq.tokens.len() > seq.prompt_len;
            let live = self.live.get(&seq.id);
            match live.filter(|_| decoding && eagle.ready(seq.id, seq.tokens.len())) {
                Some(live) => {
                    let room = (live.params.max_tokens.saturating_sub(live.generated + 1))
                        .min(self.cfg.max_model_len.saturating_sub(seq.tokens.len() + 1));
                    wanted[w] = spec.num_steps.min(room);
                    lens.push(wanted[w]);
                }
                None => other_tokens += n,
            }
        }
        let k = self.policy.choose_k(other_tokens, &lens);
        self.metrics
            .spec_chosen_k
            .get_or_create(&BatchLabels::of(work.len()))
            .observe(k as f64);
        let mut budget = self
            .cfg
            .max_step_tokens
            .saturating_sub(work.iter().map(|&(_, n)| n).sum());
        let tree = spec.topk > 1;
        // (work item, depth, tokens verified)
        let mut chosen = Vec::new();
        for (w, &(i, _)) in work.iter().enumerate() {
            let depth = wanted[w].min(k);
            let verified = if tree {
                (spec.num_draft_tokens - 1).min(budget)
            } else {
                depth.min(budget)
            };
            let depth = depth.min(verified);
            if depth == 0 {
                continue;
            }
            // The draft steps and the verification write KV up to their last slot: reserve first.
            let slots = if tree {
                verified.max(spec.topk * (depth - 1))
            } else {
                depth
            };
            let want = self.sched.running()[i].tokens.len() + slots;
            if !self.sched.reserve_running(i, want) {
                continue;
            }
            chosen.push((w, depth, verified));
            budget -= verified;
        }
        if chosen.is_empty() {
            return drafts;
        }
        let t = Instant::now();
        let m = &self.model;
        let running = self.sched.running();
        let Some(eagle) = self.eagle.as_mut() else {
            return drafts;
        };
        let proposed = if tree {
            let reqs: Vec<TreeRequest> = chosen
                .iter()
                .map(|&(w, depth, nodes)| {
                    let s = &running[work[w].0];
                    TreeRequest {
                        id: s.id,
                        len: s.tokens.len(),
                        depth,
                        nodes,
                        block_table: &s.blocks.table,
                    }
                })
                .collect();
            eagle
                .propose_tree(&m.backend, m.model.embedding(), &reqs)
                .map(|ts| {
                    ts.into_iter()
                        .map(|t| (t.tokens.clone(), Some(t)))
                        .collect()
                })
        } else {
            let reqs: Vec<ChainRequest> = chosen
                .iter()
                .map(|&(w, d, _)| {
                    let s = &running[work[w].0];
                    ChainRequest {
                        id: s.id,
                        len: s.tokens.len(),
                        k: d,
                        block_table: &s.blocks.table,
                    }
                })
                .collect();
            eagle
                .propose(&m.backend, m.model.embedding(), &reqs)
                .map(|ds| ds.into_iter().map(|d| (d, None)).collect::<Vec<_>>())
        };
        let proposed: Vec<(Vec<u32>, Option<DraftTree>)> = match proposed {
            Ok(p) => p,
            Err(e) => {
                tracing::error!("EAGLE-3 drafting failed: {e}");
                return drafts;
            }
        };
        let longest = chosen.iter().map(|&(_, d, _)| d).max().unwrap_or(0);
        if longest > 1 {
            self.policy.record_chain(
                chosen.len() * spec.topk,
                t.elapsed().as_secs_f64() / (longest - 1) as f64,
            );
        }
        for (&(w, d, _), (tokens, tree)) in chosen.iter().zip(proposed) {
            let seq = &mut self.sched.running_mut()[work[w].0];
            let d = if tree.is_some() {
                tokens.len()
            } else {
                d.min(tokens.len())
            };
            seq.tokens.extend_from_slice(&tokens[..d]);
            drafts.counts[w] = d;
            drafts.trees[w] = tree.filter(|t| !t.is_empty());
        }
        drafts
    }

    /// Draft tokens for this step's decoding sequences, appended to their tokens (and their blocks
    /// reserved); returns the count per work item (0 for prefill and undrafted sequences).
    fn draft(&mut self, work: &[(usize, usize)], parked: bool) -> Drafts {
        let mut drafts = Drafts::none(work.len());
        if !self.policy.enabled() || parked {
            return drafts;
        }
        if self.cfg.spec.method == SpecMethod::Eagle3 {
            return self.draft_eagle(work);
        }
        let spec = self.cfg.spec;
        let mut proposals: Vec<Vec<u32>> = vec![Vec::new(); work.len()];
        let mut other_tokens = 0;
        let mut lens = Vec::new();
        for (w, &(i, n)) in work.iter().enumerate() {
            let seq = &self.sched.running()[i];
            let decoding = n == 1 && seq.pending() == 1 && seq.tokens.len() > seq.prompt_len;
            let Some(live) = self.live.get(&seq.id).filter(|_| decoding) else {
                other_tokens += n;
                continue;
            };
            // Never draft past the request's last token or the model's context.
            let room = (live.params.max_tokens.saturating_sub(live.generated + 1))
                .min(self.cfg.max_model_len.saturating_sub(seq.tokens.len() + 1));
            let k = spec.num_steps.min(room);
            proposals[w] = speculation::propose(&seq.tokens, spec.ngram_min, spec.ngram_max, k);
            lens.push(proposals[w].len());
        }
        let k = self.policy.choose_k(other_tokens, &lens);
        self.metrics
            .spec_chosen_k
            .get_or_create(&BatchLabels::of(work.len()))
            .observe(k as f64);
        let mut budget = self
            .cfg
            .max_step_tokens
            .saturating_sub(work.iter().map(|&(_, n)| n).sum());
        for (w, &(i, _)) in work.iter().enumerate() {
            let d = proposals[w].len().min(k).min(budget);
            if d == 0 {
                continue;
            }
            let want = self.sched.running()[i].tokens.len() + d;
            if !self.sched.reserve_running(i, want) {
                continue;
            }
            self.sched.running_mut()[i]
                .tokens
                .extend_from_slice(&proposals[w][..d]);
            drafts.counts[w] = d;
            budget -= d;
        }
        drafts
    }

    fn finish(&mut self, id: SeqId, reason: FinishReason) {
        let Some(seq) = self.sched.remove(id) else {
            return;
        };
        let Some(live) = self.live.remove(&id) else {
            return;
        };
        self.metrics
            .e2e
            .observe(live.arrival.elapsed().as_secs_f64());
        let _ = live.events.send(Event::Finished {
            reason,
            prompt_tokens: seq.prompt_len,
            completion_tokens: live.generated,
        });
        self.status.in_flight.fetch_sub(1, Ordering::SeqCst);
    }

    fn finish_with(&mut self, id: SeqId, event: Event) {
        self.sched.remove(id);
        if let Some(live) = self.live.remove(&id) {
            let _ = live.events.send(event);
            self.status.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// A request whose receiver is gone (client disconnected, stop string matched) is removed and
    /// its KV blocks freed before the step runs.
    fn drop_aborted(&mut self) {
        let gone: Vec<SeqId> = self
            .live
            .iter()
            .filter(|(_, l)| l.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.sched.remove(id);
            self.live.remove(&id);
            self.status.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn update_gauges(&self) {
        self.metrics.running.set(self.sched.running().len() as i64);
        self.metrics.waiting.set(self.sched.num_waiting() as i64);
        self.metrics
            .kv_blocks_used
            .set(self.sched.blocks_used() as i64);
    }
}
