//! The engine thread: owns the scheduler and the model runner, and runs `step()` = drop aborted
//! requests -> schedule -> reserve draft room -> plan -> runner executes -> emit tokens and
//! finish requests. Everything that touches the model (drafting, the forward, sampling,
//! verification) is the runner's; the engine sees token ids.
//!
//! Overlap scheduling (SGLang's overlap scheduler): where the runner draws every token where the
//! logits are (a GPU) and each request's next draw needs nothing the host learns from the step
//! before (no penalties, no speculation), the engine launches step N+1 before it collects step
//! N's tokens. Step N's sequences get a placeholder token that the runner feeds from the
//! device ([`SeqPlan::pending_last`]); collecting replaces it. A request that ends at step N by
//! a stop token is found one step late, so its step N+1 row is wasted and dropped; one that ends
//! by its length is known ahead, and the engine collects before planning past it. Any request
//! that cannot run ahead makes every step wait for the one before (the plain path).
//!
//! Detokenization, stop strings, JSON and SSE happen on the HTTP side, in parallel with the next
//! model step (the detokenization overlap, another thing); `detok_overlap: false` moves
//! detokenization onto this thread for comparison.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use super::request::{EngineRequest, Event, RequestParams};
use super::scheduler::{Admitted, Scheduler, SchedulerConfig, SeqId, SeqState};
use crate::generate::FinishReason;
use crate::kv_cache::BlockAllocator;
use crate::metrics::Metrics;
use crate::metrics::{BatchLabels, PositionLabels};
use crate::runner::{ModelInfo, ModelRunner, SeqOutput, SeqParams, SeqPlan, StepOutput, StepPlan};
use crate::sampling::{Sampled, TokenGuide};
use crate::structured::{Guide, guide_mut};
use crate::tokenizer::IncrementalDecoder;

#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    pub max_running: usize,
    /// Tokens in one step, at most, before drafts (the runner caps drafts by the same number).
    pub max_step_tokens: usize,
    /// Longest sequence (prompt + output) a request may reach.
    pub max_model_len: usize,
    /// Detokenization on the HTTP side (off: on this thread).
    pub detok_overlap: bool,
    /// Requests start from their longest cached prompt prefix (`--no-prefix-cache` turns it off).
    pub prefix_cache: bool,
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

/// Per-sequence state the scheduler and the runner do not need.
struct Live {
    params: RequestParams,
    events: UnboundedSender<Event>,
    decoder: Option<IncrementalDecoder>,
    arrival: Instant,
    last_token: Option<Instant>,
    generated: usize,
    /// Its draws need nothing from the host's view of the step before (overlap scheduling).
    overlaps: bool,
    /// Index in its tokens of the placeholder for the launched step's draw, if one is out.
    placeholder: Option<usize>,
    /// Its cached prompt tokens were sent (on its first admission).
    cached_reported: bool,
    /// Structured outputs: the runner asks it what each row may sample (drafts included) while
    /// the forward runs; it follows what the request emits. A guided request never runs
    /// overlapped (its next mask needs the token before). A matcher that fails fails its request
    /// when the step is applied, and nothing more from it reaches the client.
    guide: Option<Mutex<Guide>>,
}

/// A step launched and not yet collected (overlap scheduling).
struct InFlight {
    seqs: Vec<InFlightSeq>,
    /// A sequence in it ends by its length with this step's token: the next plan waits for it.
    ends_by_length: bool,
}

struct InFlightSeq {
    id: SeqId,
    /// Where its drawn token goes, when the step draws one for it.
    placeholder: Option<usize>,
}

pub struct Engine {
    runner: Box<dyn ModelRunner>,
    info: Arc<ModelInfo>,
    cfg: EngineConfig,
    sched: Scheduler,
    live: HashMap<SeqId, Live>,
    next_id: SeqId,
    metrics: Arc<Metrics>,
    status: Arc<EngineStatus>,
    started: Instant,
    in_flight: Option<InFlight>,
}

/// What the engine reserved for a scheduled sequence's drafts before planning.
#[derive(Clone, Copy, Default)]
struct DraftRoom {
    decoding: bool,
    /// Draft tokens it may take (their KV slots are reserved; 0: none).
    tokens: usize,
}

/// Starts the engine thread over `runner`.
pub fn spawn(
    runner: Box<dyn ModelRunner>,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
) -> std::io::Result<EngineHandle> {
    let (tx, rx) = std::sync::mpsc::channel();
    let status = Arc::new(EngineStatus::default());
    let started = Instant::now();
    let mut engine = Engine::new(runner, cfg, metrics, status.clone(), started);
    std::thread::Builder::new()
        .name("kiln-engine".into())
        .spawn(move || engine.run(rx))?;
    Ok(EngineHandle {
        tx,
        status,
        started,
    })
}

impl Engine {
    fn new(
        runner: Box<dyn ModelRunner>,
        cfg: EngineConfig,
        metrics: Arc<Metrics>,
        status: Arc<EngineStatus>,
        started: Instant,
    ) -> Self {
        let (n_blocks, block_size) = runner.kv_layout();
        let sched = Scheduler::new(
            SchedulerConfig {
                max_running: cfg.max_running,
                max_step_tokens: cfg.max_step_tokens,
                prefix_cache: cfg.prefix_cache,
            },
            BlockAllocator::new(n_blocks, block_size),
        );
        metrics.kv_blocks_total.set(n_blocks as i64);
        Engine {
            info: runner.info().clone(),
            runner,
            cfg,
            sched,
            live: HashMap::new(),
            next_id: 0,
            metrics,
            status,
            started,
            in_flight: None,
        }
    }

    fn run(&mut self, rx: Receiver<EngineRequest>) {
        loop {
            self.beat();
            if self.sched.is_idle() && self.in_flight.is_none() {
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

    fn admit(&mut self, mut req: EngineRequest) {
        let id = self.next_id;
        self.next_id += 1;
        self.metrics.prompt_tokens.inc_by(req.prompt.len() as u64);
        let p = &req.params;
        let seq_params = SeqParams {
            sampling: p.sampling,
            ignore_eos: p.ignore_eos,
            stop_token_ids: p.stop_token_ids.clone(),
        };
        let guide = req.params.guide.take();
        let overlaps = self.runner.overlaps(&seq_params) && guide.is_none();
        self.runner.admit(id, seq_params, &req.prompt);
        self.live.insert(
            id,
            Live {
                decoder: (!self.cfg.detok_overlap).then(|| {
                    if req.params.keep_special {
                        IncrementalDecoder::keeping_special(req.params.stop_token_ids.clone())
                    } else {
                        IncrementalDecoder::new(true)
                    }
                }),
                params: req.params,
                events: req.events,
                arrival: req.arrival,
                last_token: None,
                generated: 0,
                overlaps,
                placeholder: None,
                cached_reported: false,
                guide: guide.map(Mutex::new),
            },
        );
        self.sched.add(SeqState::new(id, req.prompt));
    }

    /// One model step over whatever the scheduler picks.
    pub fn step(&mut self) {
        let t0 = Instant::now();
        self.drop_aborted();
        if self.in_flight.is_some() && !self.may_launch_ahead() {
            self.collect();
        }
        let schedule = self.sched.schedule();
        self.metrics
            .preemptions
            .inc_by(schedule.preempted.len() as u64);
        self.report_admissions(&schedule.admitted);
        self.count_prefill(&schedule.work);
        self.update_gauges();
        if schedule.work.is_empty() {
            if self.in_flight.is_some() {
                self.collect();
                self.update_gauges();
            }
            return;
        }
        if self.may_launch_ahead() {
            self.launch(&schedule.work);
        } else {
            self.execute(&schedule.work);
        }
        let runner = &self.runner;
        self.sched.register_computed(|id| runner.kv_shareable(id));
        self.update_gauges();
        self.metrics.step_time.observe(t0.elapsed().as_secs_f64());
    }

    /// Each request learns, on its first admission, how many prompt tokens came from the
    /// prefix cache (OpenAI's `cached_tokens`); the cache's counters follow every admission.
    fn report_admissions(&mut self, admitted: &[Admitted]) {
        for a in admitted {
            self.metrics.prefix_cache_queried.inc_by(a.queried as u64);
            self.metrics.prefix_cache_hits.inc_by(a.cached as u64);
            if let Some(live) = self.live.get_mut(&a.id)
                && !live.cached_reported
            {
                live.cached_reported = true;
                let _ = live.events.send(Event::Cached(a.cached));
            }
        }
    }

    /// Tokens this step runs through a prefill (every fed token of a sequence that is not
    /// decoding one): what the prefix cache saves shows here.
    fn count_prefill(&self, work: &[(usize, usize)]) {
        let running = self.sched.running();
        let prefill: usize = work
            .iter()
            .filter(|&&(i, n)| !running[i].decodes(n))
            .map(|&(_, n)| n)
            .sum();
        self.metrics.prefill_tokens.inc_by(prefill as u64);
    }

    /// Whether the next step may launch before the one in flight is collected: every live
    /// request runs overlapped, and none ends by its length with the step in flight (known
    /// ahead, so planning past it would only waste its row).
    fn may_launch_ahead(&self) -> bool {
        self.live.values().all(|l| l.overlaps)
            && self.in_flight.as_ref().is_none_or(|f| !f.ends_by_length)
    }

    /// The plain step: the runner runs it to its tokens, which are applied before returning.
    fn execute(&mut self, work: &[(usize, usize)]) {
        let rooms = self.reserve_draft_room(work);
        let result = {
            let plan = plan(&self.sched, &self.live, &self.cfg, work, &rooms);
            let runner = &mut self.runner;
            guarded(|| runner.execute(&plan))
        };
        match result {
            Ok(out) => {
                self.record_step(&out, work.len());
                self.apply(work, &rooms, out);
            }
            Err(e) => {
                let ids = self.ids(work);
                self.fail_step(&ids, e);
            }
        }
    }

    /// Overlap scheduling: launches this step, then collects the one before it (whose tokens
    /// this step already fed from the device).
    fn launch(&mut self, work: &[(usize, usize)]) {
        let rooms = vec![DraftRoom::default(); work.len()];
        let (result, ends_by_length) = {
            let plan = plan(&self.sched, &self.live, &self.cfg, work, &rooms);
            let ends = plan
                .seqs
                .iter()
                .any(|s| s.samples() && (s.tokens_left <= 1 || s.context_left <= 1));
            let runner = &mut self.runner;
            (guarded(|| runner.launch(&plan)), ends)
        };
        let mut ids = self.ids(work);
        if let Err(e) = result {
            // The step before is still out: collected after this step's requests fail (a
            // collected request that failed is skipped), or failed with them when the device
            // is gone.
            if e.backend_lost()
                && let Some(f) = self.in_flight.take()
            {
                ids.extend(f.seqs.iter().map(|s| s.id));
            }
            self.fail_step(&ids, e);
            self.collect();
            return;
        }
        // The fed tokens are in the cache once the step runs; a sequence the step draws for
        // gets a placeholder, so the next plan feeds the draw and the scheduler counts it.
        let mut seqs = Vec::with_capacity(work.len());
        for &(i, n) in work {
            let seq = &mut self.sched.running_mut()[i];
            seq.computed += n;
            let mut placeholder = None;
            if seq.computed == seq.tokens.len() {
                placeholder = Some(seq.tokens.len());
                seq.tokens.push(0);
                if let Some(live) = self.live.get_mut(&seq.id) {
                    live.placeholder = placeholder;
                }
            }
            seqs.push(InFlightSeq {
                id: seq.id,
                placeholder,
            });
        }
        let earlier = self.in_flight.replace(InFlight {
            seqs,
            ends_by_length,
        });
        if let Some(earlier) = earlier {
            self.metrics.steps_launched_ahead.inc();
            self.collect_step(earlier);
        }
    }

    /// Collects the step in flight.
    fn collect(&mut self) {
        if let Some(f) = self.in_flight.take() {
            self.collect_step(f);
        }
    }

    /// A launched step's tokens: each replaces its placeholder and goes to its request;
    /// sequences that ended (by a stop token, found only now) finish, and whatever the step
    /// after drew for them is dropped when it is collected.
    fn collect_step(&mut self, f: InFlight) {
        let runner = &mut self.runner;
        let out = match guarded(|| runner.collect()) {
            Ok(out) => out,
            Err(e) => {
                let ids: Vec<SeqId> = f.seqs.iter().map(|s| s.id).collect();
                self.fail_step(&ids, e);
                return;
            }
        };
        self.record_step(&out, f.seqs.len());
        let mut finished = Vec::new();
        for (s, o) in f.seqs.iter().zip(out.seqs) {
            let (Some(at), Some(live)) = (s.placeholder, self.live.get_mut(&s.id)) else {
                continue;
            };
            let Some(seq) = self.sched.get_mut(s.id) else {
                continue;
            };
            if live.placeholder == Some(at) {
                live.placeholder = None;
            }
            for sampled in o.tokens {
                if let Some(slot) = seq.tokens.get_mut(at) {
                    *slot = sampled.token;
                }
                deliver(live, sampled, &self.metrics, &self.info);
            }
            if let Some(reason) = o.finish {
                finished.push((s.id, reason));
            }
        }
        for (id, reason) in finished {
            self.finish(id, reason);
        }
    }

    fn ids(&self, work: &[(usize, usize)]) -> Vec<SeqId> {
        work.iter()
            .map(|&(i, _)| self.sched.running()[i].id)
            .collect()
    }

    /// Reserves the KV slots of every decoding sequence's largest draft, so the runner drafts
    /// without touching the allocator; a sequence whose slots do not fit drafts nothing.
    fn reserve_draft_room(&mut self, work: &[(usize, usize)]) -> Vec<DraftRoom> {
        let mut rooms = vec![DraftRoom::default(); work.len()];
        for (room, &(i, n)) in rooms.iter_mut().zip(work) {
            let seq = &self.sched.running()[i];
            room.decoding = seq.decodes(n);
            let Some(live) = self.live.get(&seq.id).filter(|_| room.decoding) else {
                continue;
            };
            // Never draft past the request's last token or the model's context.
            let limit = (live.params.max_tokens.saturating_sub(live.generated + 1))
                .min(self.cfg.max_model_len.saturating_sub(seq.tokens.len() + 1));
            let slots = self.runner.draft_slots(limit);
            let len = seq.tokens.len();
            if slots > 0 && self.sched.reserve_running(i, len + slots) {
                room.tokens = limit;
            }
        }
        rooms
    }

    /// Step-level metrics: the policy's choice, parking, the batch.
    fn record_step(&self, out: &StepOutput, batch: usize) {
        let m = &self.metrics;
        m.spec_draft_parked.set(i64::from(out.draft_parked));
        if let Some(k) = out.chosen_k {
            m.spec_chosen_k
                .get_or_create(&BatchLabels::of(batch))
                .observe(k as f64);
        }
        m.batch_size.observe(batch as f64);
        m.batch_tokens.observe(out.forward_tokens as f64);
    }

    /// Hands each sequence's tokens to its request, advances its cache, frees rejected drafts'
    /// slots, and finishes the requests that ended.
    fn apply(&mut self, work: &[(usize, usize)], rooms: &[DraftRoom], out: StepOutput) {
        let batch_label = BatchLabels::of(work.len());
        let mut finished = Vec::new();
        let mut failed = Vec::new();
        for ((&(i, n), room), o) in work.iter().zip(rooms).zip(out.seqs) {
            let seq = &mut self.sched.running_mut()[i];
            // The fed tokens and the accepted drafts are in the cache now.
            seq.computed += n + o.accepted;
            let id = seq.id;
            let mut finish = o.finish;
            if let Some(live) = self.live.get_mut(&id) {
                for sampled in o.tokens.iter().cloned() {
                    let mut complete = false;
                    if let Some(g) = live.guide.as_mut().map(guide_mut) {
                        // The mask allowed the token, so the matcher takes it (a refusal fails
                        // the request, the token unsent); a grammar that is complete ends the
                        // request as an end-of-sequence token would.
                        g.advance(sampled.token);
                        if g.error().is_some() {
                            break;
                        }
                        complete = g.finished();
                    }
                    emit(seq, live, sampled, &self.metrics, &self.info);
                    if complete {
                        // Complete output: `stop`, whatever the runner judged for a later token
                        // (or for this one, by its length).
                        finish = Some(FinishReason::Eos);
                        break;
                    }
                }
                let error = live
                    .guide
                    .as_mut()
                    .and_then(|g| guide_mut(g).error().map(str::to_string));
                if let Some(e) = error {
                    failed.push((id, e));
                    finish = None;
                }
            }
            if let Some(reason) = finish {
                finished.push((id, reason));
            }
            if o.drafted > 0 {
                self.record_drafts(&o, &batch_label);
            }
            self.metrics
                .spec_grammar_refused_tokens
                .inc_by(o.refused as u64);
            if room.tokens > 0 {
                self.sched.trim_running(i);
            }
        }
        for (id, reason) in finished {
            self.finish(id, reason);
        }
        for (id, e) in failed {
            self.finish_with(id, Event::Failed(format!("structured output: {e}")));
        }
    }

    fn record_drafts(&self, o: &SeqOutput, batch_label: &BatchLabels) {
        let m = &self.metrics;
        m.spec_draft_tokens.inc_by(o.drafted as u64);
        m.spec_accepted_tokens.inc_by(o.accepted as u64);
        for p in 0..o.accepted {
            m.spec_accepted_per_position
                .get_or_create(&PositionLabels {
                    position: p.to_string(),
                })
                .inc();
        }
        m.spec_accept_length
            .get_or_create(batch_label)
            .observe((o.accepted + 1) as f64);
    }

    /// A failed step fails the requests in it; when the runner's state is gone (a
    /// tensor-parallel rank died) the process exits so the service manager restarts it whole.
    fn fail_step(&mut self, ids: &[SeqId], e: crate::Error) {
        tracing::error!("the model step failed: {e}");
        for &id in ids {
            self.finish_with(id, Event::Failed(format!("the model step failed: {e}")));
        }
        if e.backend_lost() {
            // The failed requests got their errors above; a moment lets them reach the clients.
            eprintln!("kiln: {e}; exiting so the service restarts with a whole group");
            std::thread::sleep(Duration::from_millis(300));
            std::process::exit(70);
        }
    }

    fn finish(&mut self, id: SeqId, reason: FinishReason) {
        self.runner.release(id);
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
        self.runner.release(id);
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
            self.runner.release(id);
            self.sched.remove(id);
            self.live.remove(&id);
            self.status.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn update_gauges(&self) {
        let (cached, evictions) = self.sched.prefix_cache_stats();
        self.metrics.prefix_cache_blocks.set(cached as i64);
        let seen = self.metrics.prefix_cache_evictions.get();
        self.metrics
            .prefix_cache_evictions
            .inc_by(evictions.saturating_sub(seen));
        self.metrics.running.set(self.sched.running().len() as i64);
        self.metrics.waiting.set(self.sched.num_waiting() as i64);
        self.metrics
            .kv_blocks_used
            .set(self.sched.blocks_used() as i64);
    }
}

/// The runner's view of this step: each scheduled sequence's tokens, cache and limits.
fn plan<'a>(
    sched: &'a Scheduler,
    live: &'a HashMap<SeqId, Live>,
    cfg: &EngineConfig,
    work: &[(usize, usize)],
    rooms: &[DraftRoom],
) -> StepPlan<'a> {
    let running = sched.running();
    let seqs = work
        .iter()
        .zip(rooms)
        .map(|(&(i, n), room)| {
            let seq = &running[i];
            let l = live.get(&seq.id);
            // A draw still out (overlap scheduling) counts as emitted.
            let generated = l.map_or(0, |l| l.generated + usize::from(l.placeholder.is_some()));
            let max_tokens = l.map_or(0, |l| l.params.max_tokens);
            SeqPlan {
                id: seq.id,
                tokens: &seq.tokens,
                computed: seq.computed,
                cached_prefix: seq.cached,
                n_new: n,
                block_table: &seq.blocks.table,
                decoding: room.decoding,
                draft_room: room.tokens,
                tokens_left: max_tokens.saturating_sub(generated),
                context_left: cfg.max_model_len.saturating_sub(seq.tokens.len()),
                guide: l
                    .and_then(|l| l.guide.as_ref())
                    .map(|g| g as &dyn TokenGuide),
                pending_last: l.is_some_and(|l| l.placeholder.is_some()),
            }
        })
        .collect();
    StepPlan { seqs }
}

/// Runs a runner call so that a panic inside it (a bug in a kernel, say) fails the step's
/// requests like any error instead of killing the engine thread and hanging every client.
fn guarded<T>(f: impl FnOnce() -> crate::Result<T>) -> crate::Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "no message".into());
        Err(crate::Error::Panicked(msg))
    })
}

/// Hands one generated token to its request and appends it to the sequence (whether it ends
/// the request is the runner's call, made as it emitted).
fn emit(
    seq: &mut SeqState,
    live: &mut Live,
    sampled: Sampled,
    metrics: &Metrics,
    info: &ModelInfo,
) {
    seq.tokens.push(sampled.token);
    deliver(live, sampled, metrics, info);
}

/// Hands one generated token to its request (its sequence already holds it).
fn deliver(live: &mut Live, sampled: Sampled, metrics: &Metrics, info: &ModelInfo) {
    let tok = sampled.token;
    live.generated += 1;
    let now = Instant::now();
    match live.last_token {
        None => metrics.ttft.observe((now - live.arrival).as_secs_f64()),
        Some(t) => metrics.inter_token.observe((now - t).as_secs_f64()),
    }
    live.last_token = Some(now);
    metrics.generation_tokens.inc();
    let text = match live.decoder.as_mut() {
        Some(d) => d.push(&info.tokenizer, tok).ok().flatten(),
        None => None,
    };
    let _ = live.events.send(Event::Token { sampled, text });
}
