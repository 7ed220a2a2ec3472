//! The drafters behind one interface: none, n-gram prompt lookup, and an EAGLE-3 head drafting
//! chains (topk = 1) or trees. Each step the runner asks for proposals before the target forward
//! and, for EAGLE-3, has the head catch up on what the step confirmed after it.
//!
//! The engine has already reserved every KV slot a sequence's `draft_room` may need (see
//! [`Drafter::slots`]), so proposing never touches the block allocator.

use std::time::Instant;

use super::plan::StepPlan;
use crate::backend::Backend;
use crate::error::Result;
use crate::load::LoadedModel;
use crate::model::{DraftState, DraftStep, Eagle3Draft};
use crate::parallel::TpGroup;
use crate::speculation::eagle::{ChainRequest, Confirmed, RunDraftStep, TreeRequest};
use crate::speculation::tree::DraftTree;
use crate::speculation::{self, EagleDrafter, Policy, SpecConfig, SpecMethod};

/// This step's proposals, one entry per planned sequence.
pub struct Drafts {
    /// Draft tokens fed after the sequence's own (empty: none).
    pub tokens: Vec<Vec<u32>>,
    /// The tree they form, for tree speculation.
    pub trees: Vec<Option<DraftTree>>,
    /// The draft length the policy chose, when it chose one.
    pub chosen_k: Option<usize>,
}

impl Drafts {
    pub fn none(n: usize) -> Drafts {
        Drafts {
            tokens: vec![Vec::new(); n],
            trees: vec![None; n],
            chosen_k: None,
        }
    }
}

pub enum Drafter<B: Backend> {
    Off,
    Ngram,
    Eagle(Box<EagleDrafter<B>>),
}

impl<B: Backend> Drafter<B> {
    /// The drafter `spec` asks for; EAGLE-3 without a loaded head drafts nothing.
    pub fn new(
        spec: &SpecConfig,
        draft: Option<Eagle3Draft<B>>,
        backend: &B,
        n_blocks: usize,
        block_size: usize,
    ) -> Result<Drafter<B>> {
        Ok(match spec.method {
            SpecMethod::None => Drafter::Off,
            SpecMethod::Ngram => Drafter::Ngram,
            SpecMethod::Eagle3 => match draft {
                Some(d) => Drafter::Eagle(Box::new(EagleDrafter::new(
                    d, backend, n_blocks, block_size, spec.topk,
                )?)),
                None => Drafter::Off,
            },
        })
    }

    /// Target layers whose hidden states the drafter reads (the forward must capture them).
    pub fn aux_layers(&self) -> Vec<usize> {
        match self {
            Drafter::Eagle(e) => e.aux_layers().to_vec(),
            _ => Vec::new(),
        }
    }

    /// KV slots past a sequence's current tokens that a draft of at most `room` tokens may write:
    /// a chain's tokens, or a tree's verified nodes and the draft steps that grow it.
    pub fn slots(&self, spec: &SpecConfig, room: usize) -> usize {
        let depth = spec.num_steps.min(room);
        match self {
            Drafter::Off => 0,
            Drafter::Ngram => depth,
            Drafter::Eagle(_) if spec.topk > 1 && depth > 0 => spec
                .num_draft_tokens
                .saturating_sub(1)
                .max(spec.topk * (depth - 1)),
            Drafter::Eagle(_) => depth,
        }
    }

    /// Proposals for the plan's decoding sequences: each proposes what it can, the policy picks
    /// K for the batch, and the step's token budget (`budget`: tokens left after the plan's own)
    /// caps the total. A failed draft only costs drafts, unless it took the backend or the
    /// tensor-parallel group down with it (then the step fails as a target step would).
    pub fn propose(
        &mut self,
        m: &LoadedModel<B>,
        tp: Option<&TpGroup>,
        policy: &mut Policy,
        plan: &StepPlan<'_>,
        budget: usize,
    ) -> Result<Drafts> {
        Ok(match self {
            Drafter::Off => Drafts::none(plan.seqs.len()),
            Drafter::Ngram => propose_ngram(policy, plan, budget),
            Drafter::Eagle(e) => {
                propose_eagle(e, &mut draft_steps(m, tp, &[]), policy, plan, budget)?
            }
        })
    }

    /// EAGLE-3: the head extends over every position this step confirmed (`captured`: the
    /// target's aux-layer states, a row per step token). A failure only costs drafts, unless
    /// it took the backend or the tensor-parallel group down.
    pub fn extend(
        &mut self,
        m: &LoadedModel<B>,
        tp: Option<&TpGroup>,
        policy: &mut Policy,
        captured: &[B::Buffer],
        seqs: &[Confirmed<'_>],
    ) -> Result<()> {
        let Drafter::Eagle(e) = self else {
            return Ok(());
        };
        let t = Instant::now();
        if let Err(err) = e.extend(&mut draft_steps(m, tp, captured), seqs) {
            if err.backend_lost() {
                return Err(err);
            }
            tracing::error!("EAGLE-3 draft extend failed: {err}");
        }
        if !seqs.is_empty() {
            // A parked step's empty extend is not what keeping the draft costs.
            policy.record_extend(t.elapsed().as_secs_f64());
        }
        Ok(())
    }

    pub fn is_eagle(&self) -> bool {
        matches!(self, Drafter::Eagle(_))
    }
}

/// Draft steps on rank 0 alone, or (tensor parallelism) on every rank of the group, each over
/// its shard of the head: the peers get the step's token ids and row indices and run it beside
/// rank 0 (`captured`: the target step's aux-layer states, read by an extend).
fn draft_steps<'a, B: Backend>(
    m: &'a LoadedModel<B>,
    tp: Option<&'a TpGroup>,
    captured: &'a [B::Buffer],
) -> impl FnMut(&Eagle3Draft<B>, &mut DraftState<B>, &DraftStep<'_>) -> Result<Vec<f32>> + 'a {
    move |draft, state, step| {
        let embed = m.model.embedding();
        match tp {
            None => state.run(&m.backend, draft, embed, captured, step, None),
            Some(tp) => tp.draft_step(step, |comm| {
                state.run(&m.backend, draft, embed, captured, step, Some(comm))
            }),
        }
    }
}

fn propose_ngram(policy: &mut Policy, plan: &StepPlan<'_>, mut budget: usize) -> Drafts {
    let spec = policy.cfg;
    let mut drafts = Drafts::none(plan.seqs.len());
    let mut other_tokens = 0;
    let mut lens = Vec::new();
    for (w, s) in plan.seqs.iter().enumerate() {
        if !s.decoding {
            other_tokens += s.n_new;
            continue;
        }
        let k = spec.num_steps.min(s.draft_room);
        drafts.tokens[w] = speculation::propose(s.tokens, spec.ngram_min, spec.ngram_max, k);
        lens.push(drafts.tokens[w].len());
    }
    let k = policy.choose_k(other_tokens, &lens);
    drafts.chosen_k = Some(k);
    for d in drafts.tokens.iter_mut() {
        let n = d.len().min(k).min(budget);
        d.truncate(n);
        budget -= n;
    }
    drafts
}

fn propose_eagle<B: Backend>(
    eagle: &mut EagleDrafter<B>,
    run: &mut RunDraftStep<'_, B>,
    policy: &mut Policy,
    plan: &StepPlan<'_>,
    mut budget: usize,
) -> Result<Drafts> {
    let spec = policy.cfg;
    let mut drafts = Drafts::none(plan.seqs.len());
    let mut other_tokens = 0;
    let mut lens = Vec::new();
    let mut wanted = vec![0usize; plan.seqs.len()];
    for (w, s) in plan.seqs.iter().enumerate() {
        if s.decoding && eagle.ready(s.id, s.tokens.len()) {
            wanted[w] = spec.num_steps.min(s.draft_room);
            lens.push(wanted[w]);
        } else {
            other_tokens += s.n_new;
        }
    }
    let k = policy.choose_k(other_tokens, &lens);
    drafts.chosen_k = Some(k);
    let tree = spec.topk > 1;
    // (sequence, depth, tokens verified)
    let mut chosen = Vec::new();
    for (w, &want) in wanted.iter().enumerate() {
        let depth = want.min(k);
        let verified = if tree {
            (spec.num_draft_tokens - 1).min(budget)
        } else {
            depth.min(budget)
        };
        let depth = depth.min(verified);
        if depth == 0 {
            continue;
        }
        chosen.push((w, depth, verified));
        budget -= verified;
    }
    if chosen.is_empty() {
        return Ok(drafts);
    }
    let t = Instant::now();
    let proposed: Result<Vec<(Vec<u32>, Option<DraftTree>)>> = if tree {
        let reqs: Vec<TreeRequest> = chosen
            .iter()
            .map(|&(w, depth, nodes)| {
                let s = &plan.seqs[w];
                TreeRequest {
                    id: s.id,
                    len: s.tokens.len(),
                    depth,
                    nodes,
                    block_table: s.block_table,
                }
            })
            .collect();
        eagle.propose_tree(run, &reqs).map(|ts| {
            ts.into_iter()
                .map(|t| (t.tokens.clone(), Some(t)))
                .collect()
        })
    } else {
        let reqs: Vec<ChainRequest> = chosen
            .iter()
            .map(|&(w, k, _)| {
                let s = &plan.seqs[w];
                ChainRequest {
                    id: s.id,
                    len: s.tokens.len(),
                    k,
                    block_table: s.block_table,
                }
            })
            .collect();
        eagle
            .propose(run, &reqs)
            .map(|ds| ds.into_iter().map(|d| (d, None)).collect())
    };
    let proposed = match proposed {
        Ok(p) => p,
        Err(e) if e.backend_lost() => return Err(e),
        Err(e) => {
            tracing::error!("EAGLE-3 drafting failed: {e}");
            return Ok(drafts);
        }
    };
    let longest = chosen.iter().map(|&(_, d, _)| d).max().unwrap_or(0);
    if longest > 1 {
        policy.record_chain(
            chosen.len() * spec.topk,
            t.elapsed().as_secs_f64() / (longest - 1) as f64,
        );
    }
    for (&(w, d, _), (mut tokens, tree)) in chosen.iter().zip(proposed) {
        if tree.is_none() {
            tokens.truncate(d);
        }
        drafts.tokens[w] = tokens;
        drafts.trees[w] = tree.filter(|t| !t.is_empty());
    }
    Ok(drafts)
}
