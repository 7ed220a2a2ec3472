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
use crate::backend::{Backend, SeqSpan};
use crate::generate::FinishReason;
use crate::kv_cache::BlockAllocator;
use crate::load::LoadedModel;
use crate::metrics::Metrics;
use crate::model::{ForwardBatch, Workspace};
use crate::sampling::Sampler;
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
}

pub struct Engine<B: Backend> {
    model: Arc<LoadedModel<B>>,
    cfg: EngineConfig,
    kv: B::KvStore,
    ws: Workspace<B>,
    sched: Scheduler,
    live: HashMap<SeqId, Live>,
    next_id: SeqId,
    metrics: Arc<Metrics>,
    status: Arc<EngineStatus>,
    started: Instant,
}

/// Starts the engine thread.
pub fn spawn<B: Backend + 'static>(
    model: Arc<LoadedModel<B>>,
    cfg: EngineConfig,
    metrics: Arc<Metrics>,
) -> std::io::Result<EngineHandle> {
    let (tx, rx) = std::sync::mpsc::channel();
    let status = Arc::new(EngineStatus::default());
    let started = Instant::now();
    let mut engine = Engine::new(model, cfg, metrics, status.clone(), started);
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
    ) -> Self {
        let c = model.config();
        let n_blocks = cfg.kv_tokens.div_ceil(cfg.block_size);
        let kv = model
            .backend
            .kv_store(c.n_layers, n_blocks, cfg.block_size, c.kv_width());
        let ws = Workspace::new(&model.backend);
        let sched = Scheduler::new(
            SchedulerConfig {
                max_running: cfg.max_running,
                max_step_tokens: cfg.max_step_tokens,
            },
            BlockAllocator::new(n_blocks, cfg.block_size),
        );
        metrics.kv_blocks_total.set(n_blocks as i64);
        Engine {
            model,
            cfg,
            kv,
            ws,
            sched,
            live: HashMap::new(),
            next_id: 0,
            metrics,
            status,
            started,
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
        let mut tokens = Vec::new();
        let mut positions = Vec::new();
        let mut logit_rows = Vec::new();
        // (running index, tokens scheduled, logits row if it samples).
        let mut sampling: Vec<(usize, usize, Option<usize>)> = Vec::new();
        for &(i, n) in &plan.work {
            let seq = &self.sched.running()[i];
            let first = tokens.len();
            tokens.extend_from_slice(&seq.tokens[seq.computed..seq.computed + n]);
            positions.extend(seq.computed..seq.computed + n);
            let samples = seq.computed + n == seq.tokens.len();
            let row = samples.then(|| {
                logit_rows.push(first + n - 1);
                logit_rows.len() - 1
            });
            sampling.push((i, n, row));
        }
        let running = self.sched.running();
        let mut first = 0;
        let spans: Vec<SeqSpan> = plan
            .work
            .iter()
            .map(|&(i, n)| {
                let s = &running[i];
                let span = SeqSpan {
                    first_token: first,
                    n_tokens: n,
                    start_pos: s.computed,
                    block_table: &s.blocks.table,
                };
                first += n;
                span
            })
            .collect();
        let batch = ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            spans: &spans,
            logit_rows: &logit_rows,
        };
        let result =
            self.model
                .model
                .forward(&self.model.backend, &mut self.kv, &batch, &mut self.ws);
        drop(spans);
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("forward failed: {e}");
                let ids: Vec<SeqId> = plan
                    .work
                    .iter()
                    .map(|&(i, _)| self.sched.running()[i].id)
                    .collect();
                for id in ids {
                    self.finish_with(id, Event::Failed(format!("the model step failed: {e}")));
                }
                return;
            }
        };
        let vocab = self.model.config().vocab_size;
        let mut finished = Vec::new();
        for (i, n, row) in sampling {
            let seq = &mut self.sched.running_mut()[i];
            seq.computed += n;
            let Some(row) = row else { continue };
            let id = seq.id;
            let Some(live) = self.live.get_mut(&id) else {
                continue;
            };
            let mut row_logits = logits[row * vocab..(row + 1) * vocab].to_vec();
            let sampled = live.sampler.sample(&mut row_logits);
            let tok = sampled.token;
            seq.tokens.push(tok);
            live.generated += 1;
            let now = Instant::now();
            match live.last_token {
                None => self
                    .metrics
                    .ttft
                    .observe((now - live.arrival).as_secs_f64()),
                Some(t) => self.metrics.inter_token.observe((now - t).as_secs_f64()),
            }
            live.last_token = Some(now);
            self.metrics.generation_tokens.inc();
            let text = match live.decoder.as_mut() {
                Some(d) => d.push(&self.model.tokenizer, tok).ok().flatten(),
                None => None,
            };
            let _ = live.events.send(Event::Token { sampled, text });
            let p = &live.params;
            let stop_token = p.stop_token_ids.contains(&tok)
                || (!p.ignore_eos && self.model.tokenizer.is_eos(tok));
            let reason = if stop_token {
                Some(FinishReason::Eos)
            } else if live.generated >= p.max_tokens {
                Some(FinishReason::Length)
            } else if seq.tokens.len() >= self.cfg.max_model_len {
                Some(FinishReason::ContextFull)
            } else {
                None
            };
            if let Some(r) = reason {
                finished.push((id, r));
            }
        }
        for (id, reason) in finished {
            self.finish(id, reason);
        }
        self.update_gauges();
        self.metrics.step_time.observe(t0.elapsed().as_secs_f64());
        self.metrics.batch_size.observe(plan.work.len() as f64);
        self.metrics.batch_tokens.observe(tokens.len() as f64);
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
