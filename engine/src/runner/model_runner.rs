//! [`Runner`]: one step is drafts -> batch -> forward -> acceptance -> draft catch-up, over any
//! backend. The engine sees none of it: plan in, emitted tokens out.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::accept::{self, DrawnRows, HostRows, Rows, StopRule};
use super::drafter::{Drafter, Drafts};
use super::graphs::{DecodeGraphs, GraphStep, GraphUse, Padded, all_ranks_agree};
use super::guided;
use super::plan::{SeqOutput, SeqParams, StepOutput, StepPlan, TokenMask};
use super::{ModelInfo, ModelRunner, RunnerConfig, SamplingSite};
use crate::backend::{Backend, GraphPhase, SeqSpan, TreeMask};
use crate::batching::scheduler::SeqId;
use crate::error::Result;
use crate::kv_cache::{BlockAllocator, SeqBlocks};
use crate::load::LoadedModel;
use crate::model::{Eagle3Draft, ForwardBatch, Workspace};
use crate::parallel::TpGroup;
use crate::sampling::{RowDraw, Sampler};
use crate::speculation::Policy;
use crate::speculation::eagle::Confirmed;

/// A sequence's state that lives as long as the sequence, across preemptions.
struct SeqSlot {
    params: SeqParams,
    sampler: Sampler,
    /// EAGLE-3: the draft has extended every position of this sequence so far (it may draft).
    draft_whole: bool,
}

pub struct Runner<B: Backend> {
    model: LoadedModel<B>,
    info: Arc<ModelInfo>,
    cfg: RunnerConfig,
    kv: B::KvStore,
    ws: Workspace<B>,
    tp: Option<TpGroup>,
    drafter: Drafter<B>,
    policy: Policy,
    seqs: HashMap<SeqId, SeqSlot>,
    /// Decode steps padded to buckets (and replayed from graphs when they record).
    graphs: Option<DecodeGraphs>,
    /// Buckets whose graph is recorded (the backend may drop them all when a buffer grows).
    recorded: HashSet<usize>,
    /// Steps launched ahead of their results, oldest first (overlap scheduling; at most two).
    launched: VecDeque<Launched<B>>,
}

/// One planned sequence as the batch lays it out.
struct Fed {
    /// Row of its first fed token in the batch.
    first: usize,
    /// Tokens fed, drafts included.
    n: usize,
    /// Its first logits row, when it samples this step.
    row: Option<usize>,
}

impl<B: Backend> Runner<B> {
    /// A runner over `model` (rank 0's shard with `tp`), with `draft` as its EAGLE-3 head when
    /// the speculation settings ask for one. Measures the policy's step costs when speculation is
    /// adaptive.
    pub fn new(
        model: LoadedModel<B>,
        info: Arc<ModelInfo>,
        cfg: RunnerConfig,
        tp: Option<TpGroup>,
        draft: Option<Eagle3Draft<B>>,
    ) -> Result<Runner<B>> {
        let c = model.config();
        let n_blocks = cfg.n_blocks();
        let graphs = Self::decode_graphs(&model, &cfg);
        // This rank's KV heads only (all of them without tensor parallelism), and the block
        // padding sequences write to.
        let kv = model.backend.kv_store(
            c.n_layers,
            n_blocks + usize::from(graphs.is_some()),
            cfg.block_size,
            model.model.local_kv_width(),
            c.kv_layout(),
            model.model.precision,
        )?;
        let drafter = Drafter::new(&cfg.spec, draft, &model.backend, n_blocks, cfg.block_size)?;
        let mut ws = model.model.workspace(&model.backend, cfg.max_step_tokens)?;
        ws.capture_layers = drafter.aux_layers();
        let mut runner = Runner {
            policy: Policy::new(cfg.spec),
            kv,
            ws,
            tp,
            drafter,
            model,
            info,
            cfg,
            seqs: HashMap::new(),
            graphs,
            recorded: HashSet::new(),
            launched: VecDeque::new(),
        };
        if runner.graphs.as_ref().is_some_and(|g| g.record) {
            runner.record_graphs();
        }
        if runner.policy.enabled() && cfg.spec.adaptive {
            runner.calibrate();
        }
        Ok(runner)
    }

    /// The decode graphs this runner uses: recorded ones on a backend that records them, for a
    /// model whose decode step neither waits for the host nor allocates once warm (MLA and MoE
    /// keep their activations across steps and route on the device; a MoE layer without a
    /// shared expert still allocates its output), under tensor parallelism too (every rank
    /// records its own graphs, collectives included).
    fn decode_graphs(model: &LoadedModel<B>, cfg: &RunnerConfig) -> Option<DecodeGraphs> {
        let c = model.config();
        let (max_bs, record) = match cfg.graphs {
            GraphUse::Off => return None,
            GraphUse::PadOnly { max_bs } => (max_bs, false),
            GraphUse::Record { max_bs } => (max_bs, true),
        };
        let graphable = c.moe.as_ref().is_none_or(|m| m.n_shared_experts > 0);
        if max_bs == 0 || !graphable || (record && !model.backend.records_graphs()) {
            return None;
        }
        Some(DecodeGraphs::new(
            max_bs,
            cfg.n_blocks(),
            cfg.block_size,
            c.max_context,
            record,
        ))
    }

    /// Records every bucket's graph at start: an eager warm-up of each first (largest first),
    /// so every buffer reaches its size before any graph points at it, then the recordings. A
    /// failure leaves decode eager, and says so.
    fn record_graphs(&mut self) {
        let Some(g) = self.graphs.clone() else {
            return;
        };
        let t = Instant::now();
        let result = (|| -> Result<()> {
            for &b in g.buckets.iter().rev() {
                self.graph_phase(&g.warm_up_step(b), GraphPhase::WarmUp)?;
            }
            for &b in g.buckets.iter().rev() {
                self.graph_phase(&g.warm_up_step(b), GraphPhase::Record)?;
                self.recorded.insert(b);
            }
            Ok(())
        })();
        match result {
            Ok(()) => tracing::info!(
                "recorded decode graphs for batch sizes {:?} in {:.1} s",
                g.buckets,
                t.elapsed().as_secs_f64()
            ),
            Err(e) => {
                tracing::warn!("decode graphs are off, decode runs eagerly: {e}");
                self.graphs = None;
                self.recorded.clear();
            }
        }
    }

    /// One forward of a padded step inside a graph phase. Under tensor parallelism every rank
    /// runs the phase on its own backend, and the logits come back gathered on the host
    /// (`Some`, empty for a recording); otherwise they stay in the workspace (`None`). A replay
    /// that some rank ran eagerly (its graph was dropped) leaves the bucket to be recorded again.
    fn graph_phase(&mut self, p: &Padded, phase: GraphPhase) -> Result<Option<Vec<f32>>> {
        let Some(g) = &self.graphs else {
            return Err(crate::Error::Device("decode graphs are off".into()));
        };
        let step = GraphStep {
            phase,
            bucket: p.bucket,
            context_bound: g.context_bound,
            staging_bytes: g.staging_bytes(g.buckets.last().copied().unwrap_or(p.bucket)),
        };
        let spans = p.spans();
        let batch = padded_batch(p, &spans);
        let (m, kv, ws) = (&self.model, &mut self.kv, &mut self.ws);
        let backend = &m.backend;
        // Whether the phase ran as a graph; every rank of a group reaches the same answer.
        let mut as_graph = true;
        let logits = match &self.tp {
            None => {
                as_graph = step.run(backend, Ok, || {
                    m.model.forward_in_place(backend, kv, &batch, ws)
                })?;
                None
            }
            Some(tp) => Some(tp.step_in(&batch, Some(step), |comm| {
                as_graph = step.run(
                    backend,
                    |mine| all_ranks_agree(tp.host_comm(), mine),
                    || {
                        m.model
                            .forward_sharded_in_place(backend, kv, &batch, ws, comm)
                    },
                )?;
                if !step.computes() {
                    return Ok(Vec::new());
                }
                m.model
                    .sharded_logits(backend, ws, batch.logit_rows.len(), comm)
            })?),
        };
        if !as_graph {
            if !step.computes() {
                return Err(crate::Error::Device(format!(
                    "the decode graph of batch size {} could not be recorded on every rank",
                    p.bucket
                )));
            }
            // A replay some rank no longer had ran eagerly on every rank: record it again.
            self.recorded.remove(&p.bucket);
        }
        Ok(logits)
    }

    /// A padded decode step: replayed from its bucket's graph (recorded again first if the
    /// backend dropped it), or eagerly when graphs only pad. The logits stay in the workspace,
    /// or (tensor parallelism) come back gathered on the host.
    fn forward_padded(&mut self, p: &Padded) -> Result<Option<Vec<f32>>> {
        let record = self.graphs.as_ref().is_some_and(|g| g.record);
        if !record {
            let spans = p.spans();
            let batch = padded_batch(p, &spans);
            return match self.tp {
                Some(_) => self.forward(&batch).map(Some),
                None => self.forward_in_place(&batch).map(|()| None),
            };
        }
        if self.recorded.contains(&p.bucket) {
            match self.graph_phase(p, GraphPhase::Replay) {
                Ok(logits) => return Ok(logits),
                Err(e) if e.backend_lost() => return Err(e),
                Err(_) => {}
            }
        }
        // Not recorded, or dropped when a buffer grew: record it again, then replay.
        self.recorded.remove(&p.bucket);
        let Some(g) = self.graphs.clone() else {
            return Err(crate::Error::Device("decode graphs are off".into()));
        };
        let warm = g.warm_up_step(p.bucket);
        self.graph_phase(&warm, GraphPhase::WarmUp)?;
        self.graph_phase(&warm, GraphPhase::Record)?;
        self.recorded.insert(p.bucket);
        self.graph_phase(p, GraphPhase::Replay)
    }

    /// Seeds the speculation policy's cost table: timed forwards of 1..64 tokens on scratch
    /// blocks (nothing else is in the cache yet). Steps measured while serving refine it.
    fn calibrate(&mut self) {
        let vocab = self.model.config().vocab_size as u32;
        let mut alloc = BlockAllocator::new(self.cfg.n_blocks(), self.cfg.block_size);
        let mut blocks = SeqBlocks::default();
        for n in [1usize, 2, 4, 8, 16, 32, 64] {
            if n > self.cfg.max_step_tokens || blocks.reserve(&mut alloc, n).is_err() {
                break;
            }
            let tokens: Vec<u32> = (0..n as u32).map(|i| i % vocab).collect();
            let positions: Vec<usize> = (0..n).collect();
            let spans = [SeqSpan {
                first_token: 0,
                n_tokens: n,
                start_pos: 0,
                block_table: &blocks.table,
                tree: None,
            }];
            let batch = ForwardBatch {
                tokens: &tokens,
                positions: &positions,
                spans: &spans,
                logit_rows: &[n - 1],
                fill: None,
            };
            for _ in 0..2 {
                let t = Instant::now();
                if self.forward(&batch).is_err() {
                    return;
                }
                self.policy.record_step(n, t.elapsed().as_secs_f64());
            }
        }
    }

    /// The whole model, or (tensor parallelism: this is rank 0) rank 0's shard while the peers
    /// run theirs.
    fn forward(&mut self, batch: &ForwardBatch<'_>) -> Result<Vec<f32>> {
        let m = &self.model;
        let (kv, ws) = (&mut self.kv, &mut self.ws);
        match &self.tp {
            None => m.model.forward(&m.backend, kv, batch, ws),
            Some(tp) => tp.step(batch, |comm| {
                m.model.forward_sharded(&m.backend, kv, batch, ws, comm)
            }),
        }
    }

    /// Whether this step's rows go to the backend's sampling op (tensor parallelism returns
    /// rank 0's logits on the host, so it samples there).
    fn samples_in_backend(&self) -> bool {
        self.tp.is_none()
            && match self.cfg.sampling {
                SamplingSite::Auto => self.model.backend.samples_in_place(),
                SamplingSite::Backend => true,
            }
    }

    /// The step's forward: logits left in the workspace for the backend to sample, or copied
    /// to the host.
    fn forward_either(&mut self, batch: &ForwardBatch<'_>, in_backend: bool) -> Result<Vec<f32>> {
        if in_backend {
            self.forward_in_place(batch).map(|()| Vec::new())
        } else {
            self.forward(batch)
        }
    }

    /// Like [`Runner::forward`], leaving the logits in the workspace.
    fn forward_in_place(&mut self, batch: &ForwardBatch<'_>) -> Result<()> {
        let m = &self.model;
        m.model
            .forward_in_place(&m.backend, &mut self.kv, batch, &mut self.ws)
    }

    /// The draw of every logits row of the step, in row order, for the backend's sampling op:
    /// each sampling sequence's rows from its own sampler ([`DrawnRows::draws`]).
    fn row_draws<'a>(
        &mut self,
        plan: &StepPlan<'_>,
        fed: &[Fed],
        drafts: &Drafts,
        masks: &'a [Option<Vec<TokenMask>>],
        n_rows: usize,
    ) -> Vec<RowDraw<'a>> {
        let mut draws: Vec<RowDraw<'a>> = Vec::with_capacity(n_rows);
        for (w, (s, f)) in plan.seqs.iter().zip(fed).enumerate() {
            if f.row.is_none() {
                continue;
            }
            let tree = drafts.trees[w].as_ref();
            match self.seqs.get_mut(&s.id) {
                Some(slot) => draws.extend(DrawnRows::draws(
                    &mut slot.sampler,
                    &drafts.tokens[w],
                    tree,
                    masks.get(w).and_then(Option::as_deref),
                )),
                // Released mid-step: its rows are drawn greedily and never read.
                None => {
                    let n = 1 + drafts.tokens[w].len();
                    draws.extend((0..n).map(|_| RowDraw::greedy()));
                }
            }
        }
        debug_assert_eq!(draws.len(), n_rows);
        draws
    }

    /// Each planned sequence's span of the batch (`masks[w]`: its verification tree's mask;
    /// none past the end of `masks`).
    fn spans<'a>(
        plan: &'a StepPlan<'_>,
        fed: &[Fed],
        masks: &'a [Option<Vec<u64>>],
    ) -> Vec<SeqSpan<'a>> {
        plan.seqs
            .iter()
            .zip(fed)
            .enumerate()
            .map(|(w, (s, f))| SeqSpan {
                first_token: f.first,
                n_tokens: f.n,
                start_pos: s.computed,
                block_table: s.block_table,
                tree: masks.get(w).and_then(Option::as_ref).map(|rows| TreeMask {
                    base: s.computed,
                    rows,
                }),
            })
            .collect()
    }

    /// Overlap scheduling: the batch tokens that are the latest launched step's draws, not yet
    /// read (a sequence's placeholder last token, [`super::SeqPlan::pending_last`]).
    fn fill_from_launched(&self, plan: &StepPlan<'_>, fed: &[Fed]) -> Result<Option<Vec<i32>>> {
        if !plan.seqs.iter().any(|s| s.pending_last) {
            return Ok(None);
        }
        let latest = self.launched.back().ok_or_else(|| {
            crate::Error::Device("a token waits on a step that was never launched".into())
        })?;
        let n: usize = fed.iter().map(|f| f.n).sum();
        let mut fill = vec![-1i32; n];
        for (s, f) in plan.seqs.iter().zip(fed) {
            if !s.pending_last {
                continue;
            }
            let row = latest
                .seqs
                .iter()
                .find(|l| l.id == s.id)
                .and_then(|l| l.row)
                .ok_or_else(|| {
                    crate::Error::Device(format!(
                        "sequence {} waits on a token the latest step did not draw",
                        s.id
                    ))
                })?;
            // The placeholder is the sequence's last token; fed only when this step reaches it.
            let last = s.tokens.len() - 1;
            if (s.computed..s.computed + s.n_new).contains(&last) {
                fill[f.first + last - s.computed] = row as i32;
            }
        }
        Ok(Some(fill))
    }

    /// The step's forward, padded to a graph bucket when it is a plain decode step: logits left
    /// in the workspace (`in_backend`) or copied to the host. Returns them (empty when left in
    /// place) and the bucket, if the step was padded.
    fn step_forward(
        &mut self,
        batch: &ForwardBatch<'_>,
        in_backend: bool,
    ) -> Result<(Vec<f32>, Option<usize>)> {
        let padded = self.graphs.as_ref().and_then(|g| {
            let mut p = g.pad(batch.tokens, batch.positions, batch.spans, batch.logit_rows)?;
            if let Some(fill) = batch.fill {
                p.fill[..fill.len()].copy_from_slice(fill);
            }
            Some(p)
        });
        let t = Instant::now();
        let logits = match &padded {
            Some(p) => match self.forward_padded(p) {
                // The padding rows' logits follow the real ones and are never read.
                Ok(Some(host)) => Ok(host),
                Ok(None) if in_backend => Ok(Vec::new()),
                Ok(None) => self.model.backend.to_host(self.ws.logits()),
                Err(e) if e.backend_lost() => Err(e),
                Err(e) => {
                    tracing::warn!("decode graphs are off, decode runs eagerly: {e}");
                    self.graphs = None;
                    self.recorded.clear();
                    self.forward_either(batch, in_backend)
                }
            },
            None => self.forward_either(batch, in_backend),
        };
        self.policy
            .record_step(batch.tokens.len(), t.elapsed().as_secs_f64());
        let bucket = padded.filter(|_| self.graphs.is_some()).map(|p| p.bucket);
        Ok((logits?, bucket))
    }

    /// The step's batch: each sequence's new tokens and drafts, their positions (a tree's nodes
    /// at their depths), and the logits rows of every sequence that samples.
    fn lay_out(
        plan: &StepPlan<'_>,
        drafts: &Drafts,
    ) -> (Vec<u32>, Vec<usize>, Vec<usize>, Vec<Fed>) {
        let (mut tokens, mut positions, mut rows) = (Vec::new(), Vec::new(), Vec::new());
        let mut fed = Vec::with_capacity(plan.seqs.len());
        for (w, s) in plan.seqs.iter().enumerate() {
            let d = &drafts.tokens[w];
            let first = tokens.len();
            let n = s.n_new + d.len();
            tokens.extend_from_slice(&s.tokens[s.computed..s.computed + s.n_new]);
            tokens.extend_from_slice(d);
            match &drafts.trees[w] {
                // Tree nodes take the slots after the current token, at their depth's position.
                Some(t) => {
                    positions.push(s.computed);
                    positions.extend(t.depths().into_iter().map(|dep| s.computed + dep));
                }
                None => positions.extend(s.computed..s.computed + n),
            }
            let row = s.samples().then(|| {
                let row = rows.len();
                // A verified sequence needs the logits after its last real token and after each
                // draft token.
                rows.extend(first + n - 1 - d.len()..first + n);
                row
            });
            fed.push(Fed { first, n, row });
        }
        (tokens, positions, rows, fed)
    }
}

/// A padded step's forward batch (`spans` from [`Padded::spans`]).
fn padded_batch<'a>(p: &'a Padded, spans: &'a [SeqSpan<'a>]) -> ForwardBatch<'a> {
    ForwardBatch {
        tokens: &p.tokens,
        positions: &p.positions,
        spans,
        logit_rows: &p.logit_rows,
        fill: Some(&p.fill),
    }
}

impl<B: Backend> ModelRunner for Runner<B> {
    fn info(&self) -> &Arc<ModelInfo> {
        &self.info
    }

    fn kv_layout(&self) -> (usize, usize) {
        (self.cfg.n_blocks(), self.cfg.block_size)
    }

    fn admit(&mut self, id: SeqId, params: SeqParams, prompt: &[u32]) {
        let sampler = Sampler::new(params.sampling, prompt);
        self.seqs.insert(
            id,
            SeqSlot {
                params,
                sampler,
                draft_whole: false,
            },
        );
    }

    fn release(&mut self, id: SeqId) {
        self.seqs.remove(&id);
    }

    fn draft_slots(&self, room: usize) -> usize {
        if self.policy.enabled() {
            self.drafter.slots(&self.cfg.spec, room)
        } else {
            0
        }
    }

    fn execute(&mut self, plan: &StepPlan<'_>) -> Result<StepOutput> {
        if !self.launched.is_empty() || plan.seqs.iter().any(|s| s.pending_last) {
            return Err(crate::Error::Device(
                "a step ran while an earlier one's tokens were still on the device".into(),
            ));
        }
        // The policy may park the EAGLE-3 draft (drafting did not pay): no drafts, no extend.
        let parked = self.policy.draft_parked(plan.seqs.len());
        let budget = self.cfg.max_step_tokens.saturating_sub(plan.tokens());
        let mut drafts = if self.policy.enabled() && !parked {
            self.drafter.propose(
                &self.model,
                self.tp.as_ref(),
                &mut self.policy,
                plan,
                budget,
            )?
        } else {
            Drafts::none(plan.seqs.len())
        };
        let refused = guided::trim_drafts(plan, &mut drafts);
        let (tokens, positions, logit_rows, fed) = Self::lay_out(plan, &drafts);
        let masks: Vec<Option<Vec<u64>>> = drafts
            .trees
            .iter()
            .map(|t| t.as_ref().map(|t| t.verify_mask()))
            .collect();
        let spans = Self::spans(plan, &fed, &masks);
        let batch = ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            spans: &spans,
            logit_rows: &logit_rows,
            fill: None,
        };
        let in_backend = self.samples_in_backend();
        // Guided sequences' masks are computed on the host while the forward runs (on the
        // device, or on the CPU backend's other threads).
        let (forward, row_masks) = if guided::any(plan) {
            std::thread::scope(|scope| {
                let masks = scope.spawn(|| guided::row_masks(plan, &drafts));
                let forward = self.step_forward(&batch, in_backend);
                (forward, masks.join())
            })
        } else {
            (self.step_forward(&batch, in_backend), Ok(Vec::new()))
        };
        let (logits, graph_bucket) = forward?;
        let row_masks = row_masks
            .map_err(|_| crate::Error::Panicked("computing structured-output masks".into()))?;
        guided::check_rows(plan, &drafts, &row_masks)?;
        let drawn = if in_backend {
            let draws = self.row_draws(plan, &fed, &drafts, &row_masks, logit_rows.len());
            self.model.backend.sample(self.ws.logits(), &draws)?
        } else {
            Vec::new()
        };

        let vocab = self.model.config().vocab_size;
        let mut outputs = Vec::with_capacity(plan.seqs.len());
        // Tree sequences: the batch rows of the positions verification confirmed.
        let mut confirmed_rows: Vec<Option<Vec<usize>>> = vec![None; plan.seqs.len()];
        for (w, (s, f)) in plan.seqs.iter().zip(&fed).enumerate() {
            let (Some(row), Some(slot)) = (f.row, self.seqs.get_mut(&s.id)) else {
                outputs.push(SeqOutput::default());
                continue;
            };
            let mut host;
            let mut device;
            let rows: &mut dyn Rows = if in_backend {
                device = DrawnRows {
                    sampler: &mut slot.sampler,
                    results: &drawn[row..],
                };
                &mut device
            } else {
                host = HostRows {
                    sampler: &mut slot.sampler,
                    logits: &logits,
                    first_row: row,
                    vocab,
                    masks: row_masks.get(w).and_then(Option::as_deref),
                };
                &mut host
            };
            let stop = StopRule {
                tokenizer: &self.model.tokenizer,
                params: &slot.params,
                tokens_left: s.tokens_left,
                context_left: s.context_left,
            };
            let out = match &drafts.trees[w] {
                Some(tree) => {
                    let (out, path) = accept::tree(rows, tree, &stop);
                    // Node c's KV sits in the slot after the current token's plus c; the
                    // accepted path moves to consecutive positions (sources never precede
                    // destinations).
                    let moves: Vec<(usize, usize)> = path
                        .iter()
                        .enumerate()
                        .map(|(depth, &c)| (s.computed + 1 + c, s.computed + 1 + depth))
                        .collect();
                    self.model
                        .backend
                        .move_kv(&mut self.kv, s.block_table, &moves)?;
                    if let Some(tp) = &self.tp {
                        tp.move_kv(s.block_table, &moves)?;
                    }
                    confirmed_rows[w] = Some(
                        std::iter::once(f.first)
                            .chain(path.iter().map(|&c| f.first + 1 + c))
                            .collect(),
                    );
                    out
                }
                None => accept::chain(rows, &drafts.tokens[w], &stop),
            };
            let out = SeqOutput {
                refused: refused[w],
                ..out
            };
            if out.drafted > 0 {
                // A tree is tried depth by depth, as a chain of its depth.
                let proposed = drafts.trees[w]
                    .as_ref()
                    .map_or(out.drafted, |t| t.depths().into_iter().max().unwrap_or(0));
                self.policy.record_verify(proposed, out.accepted);
            }
            outputs.push(out);
        }
        if self.drafter.is_eagle() {
            // Fails only when the draft took the backend or the group down with it.
            self.extend_draft(plan, &fed, &outputs, &confirmed_rows, parked)?;
        }
        Ok(StepOutput {
            seqs: outputs,
            chosen_k: drafts.chosen_k,
            draft_parked: parked,
            forward_tokens: tokens.len(),
            graph_bucket,
        })
    }

    fn kv_shareable(&self, id: SeqId) -> bool {
        !self.drafter.is_eagle() || self.seqs.get(&id).is_some_and(|s| s.draft_whole)
    }

    fn overlaps(&self, params: &SeqParams) -> bool {
        // Penalties count the tokens before each draw on the host, which the step ahead
        // does not have yet; drafting reads them too (n-gram lookups, EAGLE-3's extend).
        self.cfg.overlap
            && self.tp.is_none()
            && !self.policy.enabled()
            && self.samples_in_backend()
            && !params.sampling.has_penalties()
    }

    fn launch(&mut self, plan: &StepPlan<'_>) -> Result<()> {
        if self.launched.len() >= 2 {
            return Err(crate::Error::Device(
                "a third step launched before the first was collected".into(),
            ));
        }
        let drafts = Drafts::none(plan.seqs.len());
        let (tokens, positions, logit_rows, fed) = Self::lay_out(plan, &drafts);
        let fill = self.fill_from_launched(plan, &fed)?;
        let spans = Self::spans(plan, &fed, &[]);
        let batch = ForwardBatch {
            tokens: &tokens,
            positions: &positions,
            spans: &spans,
            logit_rows: &logit_rows,
            fill: fill.as_deref(),
        };
        let (_, graph_bucket) = self.step_forward(&batch, true)?;
        // Guided sequences never run launched ahead (their masks need the token before).
        let draws = self.row_draws(plan, &fed, &drafts, &[], logit_rows.len());
        let drawn = self.model.backend.sample_launch(self.ws.logits(), &draws)?;
        let seqs = plan
            .seqs
            .iter()
            .zip(&fed)
            .map(|(s, f)| LaunchedSeq {
                id: s.id,
                row: f.row,
                tokens_left: s.tokens_left,
                context_left: s.context_left,
            })
            .collect();
        self.launched.push_back(Launched {
            drawn,
            seqs,
            forward_tokens: tokens.len(),
            graph_bucket,
        });
        Ok(())
    }

    fn collect(&mut self) -> Result<StepOutput> {
        let Some(l) = self.launched.pop_front() else {
            return Err(crate::Error::Device("no launched step to collect".into()));
        };
        let drawn = self.model.backend.sample_read(l.drawn)?;
        let outputs = l
            .seqs
            .iter()
            .map(|s| {
                let (Some(row), Some(slot)) = (s.row, self.seqs.get_mut(&s.id)) else {
                    return SeqOutput::default();
                };
                let mut rows = DrawnRows {
                    sampler: &mut slot.sampler,
                    results: &drawn[row..],
                };
                let stop = StopRule {
                    tokenizer: &self.model.tokenizer,
                    params: &slot.params,
                    tokens_left: s.tokens_left,
                    context_left: s.context_left,
                };
                accept::chain(&mut rows, &[], &stop)
            })
            .collect();
        Ok(StepOutput {
            seqs: outputs,
            forward_tokens: l.forward_tokens,
            graph_bucket: l.graph_bucket,
            ..StepOutput::default()
        })
    }
}

/// A step launched ahead of its results (overlap scheduling).
struct Launched<B: Backend> {
    drawn: B::Drawn,
    seqs: Vec<LaunchedSeq>,
    forward_tokens: usize,
    graph_bucket: Option<usize>,
}

/// One planned sequence of a launched step: its row in the step's draw, and its stop limits
/// as they were when it launched.
struct LaunchedSeq {
    id: SeqId,
    row: Option<usize>,
    tokens_left: usize,
    context_left: usize,
}

impl<B: Backend> Runner<B> {
    /// EAGLE-3: the draft head catches up on every position this step confirmed.
    fn extend_draft(
        &mut self,
        plan: &StepPlan<'_>,
        fed: &[Fed],
        outputs: &[SeqOutput],
        confirmed_rows: &[Option<Vec<usize>>],
        parked: bool,
    ) -> Result<()> {
        // Each sequence's tokens after this step: the draft reads the token after every
        // confirmed position.
        let grown: Vec<Vec<u32>> = plan
            .seqs
            .iter()
            .zip(outputs)
            .map(|(s, o)| {
                let mut t = s.tokens.to_vec();
                t.extend(o.tokens.iter().map(|x| x.token));
                t
            })
            .collect();
        let mut confirmed = Vec::new();
        for (w, s) in plan.seqs.iter().enumerate() {
            // Only a sequence whose every position went through the draft may draft: one that
            // starts now (from nothing, or from cached blocks, which only whole sequences
            // register: see `kv_shareable`), or one that has been whole since it started; none
            // while parked.
            let Some(slot) = self.seqs.get_mut(&s.id) else {
                continue;
            };
            slot.draft_whole = !parked && (s.computed == s.cached_prefix || slot.draft_whole);
            if !slot.draft_whole {
                continue;
            }
            let o = &outputs[w];
            let computed = s.computed + s.n_new + if fed[w].row.is_some() { o.accepted } else { 0 };
            let count = computed - s.computed;
            confirmed.push(Confirmed {
                id: s.id,
                start: s.computed,
                batch_rows: confirmed_rows[w]
                    .clone()
                    .unwrap_or_else(|| (fed[w].first..fed[w].first + count).collect()),
                tokens: &grown[w],
                block_table: s.block_table,
                drafts_next: computed + 1 == grown[w].len() && o.finish.is_none(),
            });
        }
        let captured = std::mem::take(&mut self.ws.captured);
        let extended = self.drafter.extend(
            &self.model,
            self.tp.as_ref(),
            &mut self.policy,
            &captured,
            &confirmed,
        );
        self.ws.captured = captured;
        extended
    }
}
