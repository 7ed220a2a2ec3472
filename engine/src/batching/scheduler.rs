//! Continuous-batching scheduler: waiting and running queues, admission by free KV blocks, chunked
//! prefill under a per-step token budget, and preemption by recompute when the cache runs out.
//!
//! Plain integers only, as in vLLM v1: every sequence tracks how many of its tokens are already in
//! the KV cache (`computed`) against how many it has (`tokens.len()`); a step schedules
//! `{sequence: n_tokens}` and prefill and decode fall out without special cases.
//!
//! With the prefix cache on, a sequence admitted without a cache of its own first takes the
//! longest run of cached full blocks its tokens hash to (never its last token, whose logits it
//! needs), so it costs the step budget only its uncached tokens; after every step the full
//! blocks sequences computed are registered for the ones that come later.

use std::collections::VecDeque;

use crate::kv_cache::{BlockAllocator, SeqBlocks, chain_hash};

pub type SeqId = u64;

/// One sequence as the scheduler sees it.
#[derive(Debug)]
pub struct SeqState {
    pub id: SeqId,
    /// Prompt followed by every generated token.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose keys and values are in the cache.
    pub computed: usize,
    pub blocks: SeqBlocks,
    /// Times this sequence lost its cache and went back to the waiting queue.
    pub preemptions: u32,
    /// Of `computed`, the tokens its latest admission took from the prefix cache.
    pub cached: usize,
    /// Chain hashes of its first full blocks (extended as blocks fill; tokens only grow).
    hashes: Vec<u64>,
    /// Its blocks registered in the prefix cache so far.
    registered: usize,
}

impl SeqState {
    pub fn new(id: SeqId, prompt: Vec<u32>) -> SeqState {
        SeqState {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            blocks: SeqBlocks::default(),
            preemptions: 0,
            cached: 0,
            hashes: Vec::new(),
            registered: 0,
        }
    }

    /// Hashes of its first `n` full blocks (its tokens must reach that far).
    fn block_hashes(&mut self, n: usize, block_size: usize) -> &[u64] {
        while self.hashes.len() < n {
            let i = self.hashes.len();
            let prev = self.hashes.last().copied().unwrap_or(0);
            let h = chain_hash(prev, &self.tokens[i * block_size..(i + 1) * block_size]);
            self.hashes.push(h);
        }
        &self.hashes[..n]
    }

    /// Tokens that still need a forward pass.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }

    /// Whether a step feeding it `n` tokens decodes: one token, its last, after its prompt
    /// (anything else is a prefill chunk).
    pub fn decodes(&self, n: usize) -> bool {
        n == 1 && self.pending() == 1 && self.tokens.len() > self.prompt_len
    }
}

#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Sequences in one step, at most.
    pub max_running: usize,
    /// Tokens in one step, at most (decode tokens plus prefill chunks).
    pub max_step_tokens: usize,
    /// Admitted sequences start from their longest cached prefix.
    pub prefix_cache: bool,
}

/// What one step runs: `(index into running, number of tokens)`, in running order.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub work: Vec<(usize, usize)>,
    /// Sequences that lost their cache this step (they wait again and recompute).
    pub preempted: Vec<SeqId>,
    /// Sequences admitted this step, each with the tokens it took from the prefix cache and
    /// the tokens it looked up there.
    pub admitted: Vec<Admitted>,
}

#[derive(Debug, Default, PartialEq, Eq, Clone, Copy)]
pub struct Admitted {
    pub id: SeqId,
    pub cached: usize,
    pub queried: usize,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    alloc: BlockAllocator,
    waiting: VecDeque<SeqState>,
    running: Vec<SeqState>,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, alloc: BlockAllocator) -> Scheduler {
        Scheduler {
            cfg,
            alloc,
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    pub fn add(&mut self, seq: SeqState) {
        self.waiting.push_back(seq);
    }

    pub fn running(&self) -> &[SeqState] {
        &self.running
    }
    pub fn running_mut(&mut self) -> &mut [SeqState] {
        &mut self.running
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }
    pub fn blocks_used(&self) -> usize {
        self.alloc.total() - self.alloc.num_free()
    }
    pub fn blocks_total(&self) -> usize {
        self.alloc.total()
    }
    /// Tokens one sequence can ever hold: the whole cache.
    pub fn capacity_tokens(&self) -> usize {
        self.alloc.total() * self.alloc.block_size()
    }

    /// Reserves blocks so running sequence `i` holds `n_tokens` tokens (draft tokens on top of its
    /// scheduled work); `false`, with nothing allocated, when the cache cannot.
    pub fn reserve_running(&mut self, i: usize, n_tokens: usize) -> bool {
        self.running[i]
            .blocks
            .reserve(&mut self.alloc, n_tokens)
            .is_ok()
    }

    /// Frees running sequence `i`'s blocks past its tokens (rejected drafts' slots).
    pub fn trim_running(&mut self, i: usize) {
        let seq = &mut self.running[i];
        seq.blocks.truncate(&mut self.alloc, seq.tokens.len());
    }

    /// A sequence wherever it is (running or waiting).
    pub fn get_mut(&mut self, id: SeqId) -> Option<&mut SeqState> {
        self.running
            .iter_mut()
            .chain(self.waiting.iter_mut())
            .find(|s| s.id == id)
    }

    /// Removes a sequence wherever it is and frees its blocks.
    pub fn remove(&mut self, id: SeqId) -> Option<SeqState> {
        let mut seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i)
        } else {
            let i = self.waiting.iter().position(|s| s.id == id)?;
            self.waiting.remove(i)?
        };
        seq.blocks.release(&mut self.alloc);
        Some(seq)
    }

    /// Chooses this step's work. Running sequences go first, oldest first (FCFS); when a running
    /// sequence needs a block and none is free, the newest running sequence is preempted. Waiting
    /// sequences are admitted in arrival order while the token budget and free blocks allow; one that
    /// does not fit stops admission, so a long prompt is not overtaken forever.
    pub fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.cfg.max_step_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let n = self.running[i].pending().min(budget);
            if n == 0 {
                i += 1;
                continue;
            }
            let want = self.running[i].computed + n;
            loop {
                let seq = &mut self.running[i];
                if seq.blocks.reserve(&mut self.alloc, want).is_ok() {
                    plan.work.push((i, n));
                    budget -= n;
                    i += 1;
                    break;
                }
                // Out of blocks: give up the newest sequence's cache (possibly this one's).
                let victim = self.running.len() - 1;
                let id = self.preempt(victim);
                plan.preempted.push(id);
                plan.work.retain(|&(j, _)| j != victim);
                if victim == i {
                    break;
                }
            }
        }
        while self.running.len() < self.cfg.max_running && budget > 0 {
            let Some(front) = self.waiting.front_mut() else {
                break;
            };
            let queried = if self.cfg.prefix_cache && front.blocks.table.is_empty() {
                take_cached_prefix(front, &mut self.alloc)
            } else {
                0
            };
            let cached = front.computed;
            let n = front.pending().min(budget);
            if front
                .blocks
                .reserve(&mut self.alloc, front.computed + n)
                .is_err()
            {
                // It waits without holding anything: its prefix is looked up again next time.
                if queried > 0 {
                    front.blocks.release(&mut self.alloc);
                    front.computed = 0;
                    front.cached = 0;
                }
                break;
            }
            if let Some(seq) = self.waiting.pop_front() {
                plan.admitted.push(Admitted {
                    id: seq.id,
                    cached,
                    queried,
                });
                plan.work.push((self.running.len(), n));
                self.running.push(seq);
                budget -= n;
            }
        }
        plan
    }

    /// Registers the full blocks running sequences have computed since the last call (after a
    /// step, once their tokens are known), of the sequences `shareable` allows.
    pub fn register_computed(&mut self, shareable: impl Fn(SeqId) -> bool) {
        if !self.cfg.prefix_cache {
            return;
        }
        let bs = self.alloc.block_size();
        for seq in &mut self.running {
            if !shareable(seq.id) {
                continue;
            }
            let full = (seq.computed / bs).min(seq.blocks.table.len());
            if full <= seq.registered {
                continue;
            }
            seq.block_hashes(full, bs);
            for i in seq.registered..full {
                self.alloc.register(seq.blocks.table[i], seq.hashes[i]);
            }
            seq.registered = full;
        }
    }

    /// Blocks in the prefix cache, and how many it gave up for room since the start.
    pub fn prefix_cache_stats(&self) -> (usize, u64) {
        (self.alloc.num_cached(), self.alloc.evictions)
    }

    fn preempt(&mut self, index: usize) -> SeqId {
        let mut seq = self.running.remove(index);
        seq.blocks.release(&mut self.alloc);
        seq.computed = 0;
        seq.cached = 0;
        seq.registered = 0;
        seq.preemptions += 1;
        let id = seq.id;
        self.waiting.push_front(seq);
        id
    }
}

/// Gives a sequence with no blocks its longest cached prefix of full blocks, short of its last
/// token; returns the tokens it looked up.
fn take_cached_prefix(seq: &mut SeqState, alloc: &mut BlockAllocator) -> usize {
    let bs = alloc.block_size();
    let n = seq.tokens.len().saturating_sub(1) / bs;
    let hits = alloc.take_cached(seq.block_hashes(n, bs));
    seq.computed = hits.len() * bs;
    seq.cached = seq.computed;
    // Already registered: they came from the cache.
    seq.registered = hits.len();
    seq.blocks.table = hits;
    n * bs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(blocks: usize, max_running: usize, budget: usize) -> Scheduler {
        Scheduler::new(
            SchedulerConfig {
                max_running,
                max_step_tokens: budget,
                prefix_cache: false,
            },
            BlockAllocator::new(blocks, 4),
        )
    }

    /// Marks the planned tokens computed, and appends a sampled token to sequences that finished
    /// their pending work (what the engine does after a forward).
    fn run(s: &mut Scheduler, plan: &StepPlan) {
        for &(i, n) in &plan.work {
            let seq = &mut s.running_mut()[i];
            seq.computed += n;
            if seq.pending() == 0 {
                seq.tokens.push(7);
            }
        }
    }

    #[test]
    fn long_prompt_is_chunked_under_the_budget() {
        let mut s = sched(16, 4, 5);
        s.add(SeqState::new(1, vec![0; 12]));
        let chunks: Vec<usize> = (0..3)
            .map(|_| {
                let p = s.schedule();
                run(&mut s, &p);
                p.work[0].1
            })
            .collect();
        assert_eq!(chunks, [5, 5, 2]);
        assert_eq!(s.schedule().work, [(0, 1)], "then one decode token");
    }

    #[test]
    fn decode_goes_before_new_prefill_and_shares_the_budget() {
        let mut s = sched(16, 4, 4);
        s.add(SeqState::new(1, vec![0; 3]));
        let p = s.schedule();
        run(&mut s, &p);
        s.add(SeqState::new(2, vec![0; 10]));
        let p = s.schedule();
        assert_eq!(p.work, [(0, 1), (1, 3)]);
    }

    #[test]
    fn admission_waits_for_free_blocks_in_arrival_order() {
        let mut s = sched(3, 4, 100);
        s.add(SeqState::new(1, vec![0; 8]));
        s.add(SeqState::new(2, vec![0; 8]));
        s.add(SeqState::new(3, vec![0; 2]));
        let p = s.schedule();
        // 1 takes two blocks; 2 needs two and only one is left, so 3 waits behind it.
        assert_eq!(p.work, [(0, 8)]);
        assert_eq!(s.num_waiting(), 2);
        s.remove(1);
        assert_eq!(s.blocks_used(), 0);
        let p = s.schedule();
        assert_eq!(p.work, [(0, 8), (1, 2)], "now 2 fits, and 3 behind it");
        let ids: Vec<SeqId> = s.running().iter().map(|q| q.id).collect();
        assert_eq!(ids, [2, 3]);
    }

    #[test]
    fn full_cache_preempts_the_newest_and_it_recomputes_later() {
        let mut s = sched(4, 4, 100);
        s.add(SeqState::new(1, vec![0; 8]));
        s.add(SeqState::new(2, vec![0; 8]));
        let p = s.schedule();
        assert_eq!(p.work, [(0, 8), (1, 8)]);
        run(&mut s, &p);
        // Both now hold 9 tokens and need a third block each; none is free.
        let p = s.schedule();
        assert_eq!(p.preempted, [2]);
        assert_eq!(p.work, [(0, 1)]);
        run(&mut s, &p);
        s.remove(1);
        let p = s.schedule();
        assert_eq!(
            p.work,
            [(0, 9)],
            "prompt plus its sampled token, recomputed"
        );
        assert_eq!(s.running()[0].preemptions, 1);
    }

    #[test]
    fn a_cached_prefix_costs_only_the_uncached_tokens_and_survives_its_holder() {
        let mut s = Scheduler::new(
            SchedulerConfig {
                max_running: 4,
                max_step_tokens: 100,
                prefix_cache: true,
            },
            BlockAllocator::new(8, 4),
        );
        let doc: Vec<u32> = (10..20).collect();
        s.add(SeqState::new(1, doc.clone()));
        let p = s.schedule();
        assert_eq!(
            p.admitted[0],
            Admitted {
                id: 1,
                cached: 0,
                queried: 8
            }
        );
        run(&mut s, &p);
        s.register_computed(|_| true);
        assert_eq!(s.prefix_cache_stats().0, 2, "two full blocks of ten tokens");
        // The same ten tokens and a question: the first eight come from the cache.
        let mut asked = doc.clone();
        asked.extend([30, 31, 32]);
        s.add(SeqState::new(2, asked));
        let p = s.schedule();
        assert_eq!(
            p.admitted[0],
            Admitted {
                id: 2,
                cached: 8,
                queried: 12
            }
        );
        assert_eq!(
            p.work,
            [(0, 1), (1, 5)],
            "seq 2 prefills only its last five"
        );
        assert_eq!(
            s.running()[1].blocks.table[..2],
            s.running()[0].blocks.table[..2]
        );
        run(&mut s, &p);
        // The first one finishes; its blocks stay cached for a third.
        s.remove(1);
        s.remove(2);
        assert_eq!(s.blocks_used(), 0);
        s.add(SeqState::new(3, doc.clone()));
        let p = s.schedule();
        assert_eq!(p.admitted[0].cached, 8);
        // A different first block shares nothing.
        let mut other = doc;
        other[0] = 99;
        s.add(SeqState::new(4, other));
        assert_eq!(s.schedule().admitted[0].cached, 0);
    }

    #[test]
    fn max_running_caps_the_batch() {
        let mut s = sched(64, 2, 100);
        for id in 0..5 {
            s.add(SeqState::new(id, vec![0; 3]));
        }
        assert_eq!(s.schedule().work.len(), 2);
        assert_eq!(s.num_waiting(), 3);
    }

    #[test]
    fn removing_frees_blocks_of_waiting_and_running() {
        let mut s = sched(8, 1, 100);
        s.add(SeqState::new(1, vec![0; 5]));
        s.add(SeqState::new(2, vec![0; 5]));
        s.schedule();
        assert!(s.remove(2).is_some());
        assert!(s.remove(1).is_some());
        assert!(s.remove(3).is_none());
        assert_eq!(s.blocks_used(), 0);
        assert!(s.is_idle());
    }
}
