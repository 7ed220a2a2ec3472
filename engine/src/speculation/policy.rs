//! How many draft tokens a step verifies. Each step picks one K in 0..=S for the batch, the one
//! with the most expected output tokens per second:
//!
//!   tokens(K) = Σ_seq (1 + Σ_{j < min(K, draft_len)} Π_{m <= j} α_m)
//!   time(K)   = cost(prefill tokens + Σ_seq (1 + min(K, draft_len)))
//!
//! where α_m is the measured probability that draft position m is accepted once m-1 were, and
//! `cost` is the measured step time as a function of the tokens in the step (a table of moving
//! averages, seeded by a calibration at start). EAGLE-3 adds K-1 chained draft steps to time(K)
//! (measured per batch size; a tree's steps expand topk nodes per sequence, and it verifies
//! its best N-1 nodes rather than K tokens); its draft-extend runs whatever K is, so it does not enter the
//! choice — it is the price of keeping the draft ready, paid at K = 0 too. On the CPU a single sequence's step is bound by
//! reading the weights, so verifying a few extra tokens is nearly free and K grows; a large batch is
//! compute-bound, every draft token costs as much as a real one, and K falls to 0 (plain decode,
//! which costs nothing extra for n-gram drafts: there is no draft state to catch up).
//!
//! An EAGLE-3 draft at K = 0 still costs its extend every step (about 7% of a step on the default
//! model). When drafting has not paid for `PARK_AFTER` straight steps — the best K's rate, extend
//! included, below plain decoding's without it — the draft is *parked*: no extend, no drafts, the
//! engine runs exactly the baseline. After a park of `PARK_MIN` steps (doubling after each probe
//! that fails, up to `PARK_MAX`) the acceptance estimate goes back to its prior and the draft
//! probes again on the sequences admitted from then on (the others' draft KV has holes). When the
//! batch halves during a park, the park ends only if the model above, with the acceptance measured
//! before the park, says drafting pays at the new size.

/// Which drafter proposes tokens.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum SpecMethod {
    /// No speculation.
    #[default]
    #[value(alias = "NONE")]
    #[serde(alias = "NONE")]
    None,
    /// Prompt lookup: continue the most recent earlier occurrence of the last n tokens.
    #[value(alias = "NGRAM")]
    #[serde(alias = "NGRAM")]
    Ngram,
    /// EAGLE-3 chain drafts from a draft head (`--speculative-draft-model-path`). SGLang's
    /// `EAGLE` is accepted too: kiln runs EAGLE-3 heads, and refuses another head at load.
    #[value(name = "eagle3", aliases = ["EAGLE3", "EAGLE", "eagle"])]
    #[serde(alias = "EAGLE3", alias = "EAGLE", alias = "eagle")]
    Eagle3,
}

/// How K is chosen each step.
#[derive(
    Clone,
    Copy,
    Debug,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum SpecPolicy {
    /// From measured step costs and acceptance (K may be 0).
    #[default]
    Adaptive,
    /// Always the full `--speculative-num-steps` (the reference's behaviour).
    Fixed,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpecConfig {
    pub method: SpecMethod,
    /// Most draft tokens per sequence per step (S; S+1 positions verified).
    pub num_steps: usize,
    pub ngram_min: usize,
    pub ngram_max: usize,
    /// Pick K per step from measured costs (`true`) or always verify every proposed token.
    pub adaptive: bool,
    /// EAGLE-3 candidates per draft step: 1 is a chain, more a tree.
    pub topk: usize,
    /// Tree: tokens verified per sequence per step, the current one included.
    pub num_draft_tokens: usize,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            method: SpecMethod::None,
            num_steps: 3,
            ngram_min: 1,
            ngram_max: 3,
            adaptive: true,
            topk: 1,
            num_draft_tokens: 4,
        }
    }
}

/// Step-size buckets of the cost table (tokens in one forward).
const BUCKETS: [usize; 16] = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512];
/// Weight of a new observation in a bucket's moving average.
const COST_EWMA: f64 = 0.2;
/// Acceptance counts decay by this per verification, so the policy follows the content.
const ACCEPT_DECAY: f64 = 0.995;
/// Prior of the acceptance estimate: `PRIOR_ACCEPTED` of `PRIOR_TRIED` draft tokens.
const PRIOR_ACCEPTED: f64 = 1.0;
const PRIOR_TRIED: f64 = 2.0;
/// Straight steps in which drafting does not pay before an EAGLE-3 draft is parked.
const PARK_AFTER: usize = 64;
/// Steps of the first park; each park after a failed probe doubles it, up to `PARK_MAX`.
const PARK_MIN: usize = 1024;
const PARK_MAX: usize = 32768;

/// The EAGLE-3 draft's parking (see the module comment).
#[derive(Clone, Copy, Debug)]
struct Parking {
    /// Steps in a row whose best choice did not pay.
    losing: usize,
    /// Length of the next park.
    next_len: usize,
    /// The park under way: steps left and the batch it began with.
    park: Option<(usize, usize)>,
}

pub struct Policy {
    pub cfg: SpecConfig,
    /// Per bucket, the moving averages of a step's tokens and seconds: a measured point on the
    /// cost curve; `None` until measured.
    cost: [Option<(f64, f64)>; BUCKETS.len()],
    /// Per draft position: (accepted, tried), decayed.
    accept: Vec<(f64, f64)>,
    /// EAGLE-3: moving-average seconds of one chained draft step, by sequences in the batch.
    chain: [Option<f64>; BUCKETS.len()],
    /// EAGLE-3: moving-average seconds of the draft-extend after each step.
    pub extend_secs: Option<f64>,
    parking: Parking,
}

impl Policy {
    pub fn new(cfg: SpecConfig) -> Policy {
        Policy {
            accept: vec![(0.0, 0.0); cfg.num_steps.max(1)],
            cfg,
            cost: [None; BUCKETS.len()],
            chain: [None; BUCKETS.len()],
            extend_secs: None,
            parking: Parking {
                losing: 0,
                next_len: PARK_MIN,
                park: None,
            },
        }
    }

    /// Whether an EAGLE-3 draft can be parked: only when K is chosen, and there is an extend to save.
    fn parks(&self) -> bool {
        self.cfg.method == SpecMethod::Eagle3 && self.cfg.adaptive
    }

    /// Once per engine step, with the sequences in it: whether the draft is parked this step.
    /// Ends a park whose time is up (a probe from the prior acceptance), or whose batch has halved
    /// to a size where the measured costs and the acceptance measured before the park say
    /// drafting pays. Ending a park on every halving re-ran the 64 losing steps (extend and
    /// rejected drafts) each time a closed-loop batch drained: at C=4, 5-7x the drafts.
    pub fn draft_parked(&mut self, batch: usize) -> bool {
        let Some((left, parked_batch)) = self.parking.park else {
            return false;
        };
        let halved = parked_batch >= 2 && 2 * batch <= parked_batch;
        let timed_out = left <= 1;
        if timed_out || (halved && self.best_k(0, &vec![self.cfg.num_steps; batch]).1) {
            self.parking.park = None;
            self.parking.losing = 0;
            if timed_out {
                // A fresh estimate, so the probe drafts if the prior says drafting could pay.
                self.accept.iter_mut().for_each(|c| *c = (0.0, 0.0));
            }
            return false;
        }
        // After a halving that does not pay, the next halving is judged from this size.
        let anchor = if halved { batch } else { parked_batch };
        self.parking.park = Some((left - 1, anchor));
        true
    }

    /// Parks after `PARK_AFTER` straight steps whose best choice does not pay.
    fn note_outcome(&mut self, pays: bool, batch: usize) {
        if !self.parks() {
            return;
        }
        let p = &mut self.parking;
        if pays {
            p.losing = 0;
            p.next_len = PARK_MIN;
            return;
        }
        p.losing += 1;
        if p.losing >= PARK_AFTER {
            p.park = Some((p.next_len, batch));
            p.next_len = (p.next_len * 2).min(PARK_MAX);
            p.losing = 0;
        }
    }

    pub fn enabled(&self) -> bool {
        self.cfg.method != SpecMethod::None && self.cfg.num_steps > 0
    }

    fn bucket(tokens: usize) -> usize {
        BUCKETS
            .partition_point(|&b| b < tokens)
            .min(BUCKETS.len() - 1)
    }

    /// One measured step: `tokens` tokens took `secs`.
    pub fn record_step(&mut self, tokens: usize, secs: f64) {
        if tokens == 0 || !secs.is_finite() {
            return;
        }
        // Nearby step sizes share a bucket, which keeps the point they average to, tokens and
        // seconds together: scaling each step to the bucket's size instead assumed cost
        // proportional to tokens, and a fixed per-step cost (the weights streamed once) then
        // inflated the bucket by partly-filled steps (13 tokens counted as 16), which made long
        // drafts at C = 4 look dearer than they were.
        let slot = &mut self.cost[Self::bucket(tokens)];
        let t = tokens as f64;
        *slot = Some(match *slot {
            Some((ct, cs)) => (ct + COST_EWMA * (t - ct), cs + COST_EWMA * (secs - cs)),
            None => (t, secs),
        });
    }

    /// One chained EAGLE-3 draft step over `seqs` sequences took `secs`.
    pub fn record_chain(&mut self, seqs: usize, secs: f64) {
        if seqs == 0 || !secs.is_finite() {
            return;
        }
        let slot = &mut self.chain[Self::bucket(seqs)];
        *slot = Some(match *slot {
            Some(c) => c + COST_EWMA * (secs - c),
            None => secs,
        });
    }

    /// One EAGLE-3 draft-extend took `secs`.
    pub fn record_extend(&mut self, secs: f64) {
        if secs.is_finite() {
            self.extend_secs = Some(match self.extend_secs {
                Some(c) => c + COST_EWMA * (secs - c),
                None => secs,
            });
        }
    }

    /// Seconds of one chained draft step over `seqs` sequences: the nearest measured bucket at
    /// or below (a smaller batch never costs more), else the smallest measured one; 0 before any.
    fn chain_cost(&self, seqs: usize) -> f64 {
        let b = Self::bucket(seqs);
        self.chain[..=b]
            .iter()
            .rev()
            .find_map(|c| *c)
            .or_else(|| self.chain.iter().find_map(|c| *c))
            .unwrap_or(0.0)
    }

    /// Estimated seconds of a step of `tokens` tokens: linear between the measured points,
    /// the first point's cost below it, proportional beyond the last (the conservative guess where
    /// steps may turn compute-bound). `None` before any measurement.
    pub fn cost(&self, tokens: usize) -> Option<f64> {
        // A step never gets cheaper by adding tokens: a running maximum irons out noise that would
        // make, say, 4 tokens look dearer than 6. Buckets cover disjoint, rising token ranges, so
        // their points come in rising token order.
        let mut known: Vec<(f64, f64)> = self.cost.iter().flatten().copied().collect();
        for i in 1..known.len() {
            known[i].1 = known[i].1.max(known[i - 1].1);
        }
        let t = tokens as f64;
        let (first, last) = (known.first()?, known.last()?);
        if t <= first.0 {
            return Some(first.1);
        }
        if t >= last.0 {
            return Some(last.1 * t / last.0);
        }
        let i = known.partition_point(|&(b, _)| b < t);
        let (lo, hi) = (known[i - 1], known[i]);
        Some(lo.1 + (hi.1 - lo.1) * (t - lo.0) / (hi.0 - lo.0))
    }

    /// One sequence's verification: `proposed` draft tokens, the first `accepted` of them accepted.
    pub fn record_verify(&mut self, proposed: usize, accepted: usize) {
        for (j, (a, n)) in self.accept.iter_mut().enumerate() {
            *a *= ACCEPT_DECAY;
            *n *= ACCEPT_DECAY;
            // Position j was tried when all before it were accepted.
            if j < proposed && j <= accepted {
                *n += 1.0;
                if j < accepted {
                    *a += 1.0;
                }
            }
        }
    }

    /// Probability that draft position `j` is accepted, given that the ones before it were.
    pub fn accept_prob(&self, j: usize) -> f64 {
        let (a, n) = self.accept.get(j).copied().unwrap_or((0.0, 0.0));
        (a + PRIOR_ACCEPTED) / (n + PRIOR_TRIED)
    }

    /// Draft tokens verified for a draft of depth `depth`: the chain itself, or a tree's best
    /// N-1 nodes among the candidates that depth grows (`topk` per frontier node, `topk` kept).
    pub fn verified_tokens(&self, depth: usize) -> usize {
        let k = self.cfg.topk;
        if k <= 1 || depth == 0 {
            return depth;
        }
        (k + (depth - 1) * k * k).min(self.cfg.num_draft_tokens.saturating_sub(1))
    }

    /// K for this step (a tree's depth with topk > 1). `other_tokens`: tokens in the step that sample nothing new (prefill
    /// chunks); `drafts`: the proposal length of each decoding sequence (0 when it has none).
    /// Under the adaptive EAGLE-3 policy this also counts towards parking the draft.
    pub fn choose_k(&mut self, other_tokens: usize, drafts: &[usize]) -> usize {
        if !self.enabled() || drafts.iter().all(|&d| d == 0) {
            return 0;
        }
        if !self.cfg.adaptive {
            return self.cfg.num_steps;
        }
        let (k, pays) = self.best_k(other_tokens, drafts);
        self.note_outcome(pays, drafts.len());
        k
    }

    /// The K with the best expected rate, and whether that rate, with the draft's extend
    /// counted, beats plain decoding without it (the extend is saved only by parking).
    fn best_k(&self, other_tokens: usize, drafts: &[usize]) -> (usize, bool) {
        let s = self.cfg.num_steps;
        let mut reach = vec![1.0f64; s + 1];
        for j in 0..s {
            reach[j + 1] = reach[j] * self.accept_prob(j);
        }
        // Expected extra tokens of a draft of length L verified up to K: Σ_{j < min(K, L)} reach[j+1].
        // From the longest draft down; a shorter one must win by a clear margin, so measurement noise
        // does not shave drafts whose acceptance is high.
        let drafting = drafts.iter().filter(|&&d| d > 0).count();
        let mut best = (s, 0f64, 0f64);
        let mut plain_rate = 0.0;
        for k in (0..=s).rev() {
            let mut tokens = other_tokens;
            let mut yield_ = 0.0;
            for &d in drafts {
                let used = d.min(k);
                tokens += 1 + self.verified_tokens(used);
                yield_ += 1.0 + reach[1..=used].iter().sum::<f64>();
            }
            let Some(mut t) = self.cost(tokens) else {
                return (0, true);
            };
            if k == 0 {
                plain_rate = yield_ / t.max(1e-9);
            }
            if self.cfg.method == SpecMethod::Eagle3 && k > 1 {
                t += (k - 1) as f64 * self.chain_cost(drafting * self.cfg.topk);
            }
            let rate = yield_ / t.max(1e-9);
            let with_extend = yield_ / (t + self.extend_secs.unwrap_or(0.0)).max(1e-9);
            if k == s || rate > best.1 * 1.01 {
                best = (k, rate, with_extend);
            }
        }
        (best.0, best.0 > 0 && best.2 > plain_rate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy::new(SpecConfig {
            method: SpecMethod::Ngram,
            num_steps: 3,
            ..Default::default()
        })
    }

    #[test]
    fn cost_interpolates_between_measured_buckets() {
        let mut p = policy();
        assert_eq!(p.cost(4), None);
        p.record_step(1, 0.010);
        p.record_step(16, 0.040);
        assert_eq!(p.cost(1), Some(0.010));
        let mid = p.cost(8).expect("measured");
        assert!((mid - (0.010 + 0.030 * 7.0 / 15.0)).abs() < 1e-9);
        assert!((p.cost(32).expect("measured") - 0.080).abs() < 1e-9);
        // Noise that makes more tokens look cheaper is ironed out.
        p.record_step(4, 0.030);
        p.record_step(6, 0.020);
        assert!(p.cost(6) >= p.cost(4));
    }

    /// Steps of 13 and 16 tokens share a bucket. With a fixed per-step cost (weights streamed
    /// once), scaling each step to 16 tokens over-estimated the bucket (13 tokens at 0.0139 s
    /// counted as 0.0171 s); the bucket's point stays on the cost line.
    #[test]
    fn partly_filled_steps_do_not_inflate_their_bucket() {
        let mut p = policy();
        let affine = |t: usize| 0.010 + 0.0003 * t as f64;
        for _ in 0..200 {
            for t in [1, 12, 13, 16, 16] {
                p.record_step(t, affine(t));
            }
        }
        for t in [1, 4, 12, 14, 15] {
            let got = p.cost(t).expect("measured");
            assert!(
                (got - affine(t)).abs() < 1e-6,
                "{t} tokens: {got} vs {}",
                affine(t)
            );
        }
        // Just past the last point (15 tokens on average): proportional, a little over the line.
        let over = p.cost(16).expect("measured") / affine(16) - 1.0;
        assert!((0.0..0.05).contains(&over), "{over}");
        for _ in 0..50 {
            p.record_verify(3, 3);
        }
        assert_eq!(p.choose_k(0, &[3; 4]), 3);
    }

    #[test]
    fn memory_bound_steps_speculate_and_compute_bound_steps_do_not() {
        let mut p = policy();
        for (t, s) in STREAMING_THEN_COMPUTE {
            p.record_step(t, s);
        }
        for _ in 0..50 {
            p.record_verify(3, 3); // every draft accepted
        }
        assert_eq!(p.choose_k(0, &[3]), 3, "one sequence, cheap verification");
        assert_eq!(
            p.choose_k(0, &[3; 16]),
            0,
            "sixteen sequences, compute-bound"
        );
        assert_eq!(p.choose_k(0, &[0, 0]), 0, "no drafts");
        // Poor acceptance makes even the cheap case not worth it.
        for _ in 0..2000 {
            p.record_verify(3, 0);
        }
        assert_eq!(p.choose_k(0, &[3]), 0);
    }

    #[test]
    fn eagle_chain_steps_count_against_long_drafts() {
        let mut p = eagle_with_costs(&WEIGHT_STREAMING);
        for _ in 0..50 {
            p.record_verify(3, 3);
        }
        // Free chained steps: the longest draft.
        assert_eq!(p.choose_k(0, &[3]), 3);
        // A chained step as dear as a target step: K = 1 (no chained step) wins.
        p.record_chain(1, 0.010);
        assert_eq!(p.choose_k(0, &[3]), 1);
        // A cheap draft head: back to the longest draft.
        for _ in 0..40 {
            p.record_chain(1, 0.0005);
        }
        assert_eq!(p.choose_k(0, &[3]), 3);
    }

    #[test]
    fn fixed_policy_always_verifies_every_step() {
        let mut p = Policy::new(SpecConfig {
            method: SpecMethod::Ngram,
            num_steps: 4,
            adaptive: false,
            ..Default::default()
        });
        p.record_step(1, 0.01);
        assert_eq!(p.choose_k(0, &[2; 16]), 4);
    }

    #[test]
    fn acceptance_counts_only_positions_that_were_tried() {
        let mut p = policy();
        p.record_verify(3, 1); // position 0 accepted, position 1 rejected, 2 never tried
        assert!(p.accept_prob(0) > 0.5);
        assert!(p.accept_prob(1) < 0.5);
        assert!((p.accept_prob(2) - 0.5).abs() < 1e-9);
    }

    /// A weight-streaming machine: 1..4 tokens cost about the same; big steps cost per token.
    const STREAMING_THEN_COMPUTE: [(usize, f64); 6] = [
        (1, 0.010),
        (2, 0.0102),
        (4, 0.0105),
        (8, 0.014),
        (16, 0.024),
        (64, 0.1),
    ];

    /// Step costs of a weight-streaming machine: 1..8 tokens cost about the same.
    const WEIGHT_STREAMING: [(usize, f64); 4] = [(1, 0.010), (2, 0.0102), (4, 0.0105), (8, 0.014)];

    /// An adaptive EAGLE-3 policy (S = 3) with these measured step costs.
    fn eagle_with_costs(costs: &[(usize, f64)]) -> Policy {
        let mut p = Policy::new(SpecConfig {
            method: SpecMethod::Eagle3,
            num_steps: 3,
            ..Default::default()
        });
        for &(t, s) in costs {
            p.record_step(t, s);
        }
        p
    }

    /// An adaptive EAGLE-3 policy on a compute-bound machine (every token costs a full step's
    /// share) with a draft that is accepted half the time.
    fn compute_bound_eagle() -> Policy {
        let mut p = eagle_with_costs(&[(1, 0.009), (2, 0.015), (4, 0.024), (8, 0.05)]);
        p.record_extend(0.0008);
        p
    }

    #[test]
    fn a_draft_that_does_not_pay_is_parked_and_probed_again_with_growing_parks() {
        let mut p = compute_bound_eagle();
        // Before parking: K = 0 chosen, the draft extended at every step.
        for _ in 0..PARK_AFTER - 1 {
            assert!(!p.draft_parked(1));
            assert_eq!(p.choose_k(0, &[3]), 0);
        }
        assert!(!p.draft_parked(1));
        assert_eq!(p.choose_k(0, &[3]), 0);
        // Parked for PARK_MIN steps, then a probe.
        let parked = (0..PARK_MIN * 4).take_while(|_| p.draft_parked(1)).count();
        assert_eq!(parked, PARK_MIN - 1);
        // The probe fails too: the next park is twice as long.
        for _ in 0..PARK_AFTER {
            assert_eq!(p.choose_k(0, &[3]), 0);
        }
        let parked = (0..PARK_MIN * 4).take_while(|_| p.draft_parked(1)).count();
        assert_eq!(parked, 2 * PARK_MIN - 1);
    }

    #[test]
    fn a_park_ends_when_the_batch_halves_to_a_size_where_drafting_pays() {
        // Compute-bound at every size: halving the batch changes nothing, the park holds.
        let mut p = compute_bound_eagle();
        for _ in 0..PARK_AFTER {
            p.choose_k(0, &[3; 16]);
        }
        assert!(p.draft_parked(16));
        assert!(p.draft_parked(8), "compute-bound at 8 sequences too");
        assert!(p.draft_parked(1), "and at 1");
        // Weight streaming up to a few sequences, compute-bound at 16, every draft accepted: parked
        // at 16, not yet at 12 (not half), back as soon as a halving reaches a size that pays.
        let mut p = eagle_with_costs(&STREAMING_THEN_COMPUTE);
        p.record_extend(0.0008);
        for _ in 0..50 {
            p.record_verify(3, 3);
        }
        for _ in 0..PARK_AFTER {
            assert_eq!(p.choose_k(0, &[3; 16]), 0);
        }
        assert!(p.draft_parked(16));
        assert!(p.draft_parked(12));
        assert!(!p.draft_parked(2), "two sequences: drafting pays again");
        assert!(p.accept_prob(0) > 0.9, "the measured acceptance is kept");
    }

    #[test]
    fn a_draft_that_pays_is_never_parked_and_others_never_park() {
        // Weight-streaming costs and a good draft: drafting pays, the draft stays.
        let mut p = eagle_with_costs(&WEIGHT_STREAMING);
        p.record_extend(0.0008);
        for _ in 0..50 {
            p.record_verify(3, 3);
        }
        for _ in 0..PARK_AFTER * 4 {
            assert!(!p.draft_parked(1));
            assert_eq!(p.choose_k(0, &[3]), 3);
        }
        // Extend costs more than drafting gains: parked even though K > 0 would be chosen.
        for _ in 0..50 {
            p.record_extend(1.0);
        }
        for _ in 0..PARK_AFTER {
            p.choose_k(0, &[3]);
        }
        assert!(p.draft_parked(1));
        // n-gram drafts have no extend to save and the fixed policy never chooses: no parking.
        for cfg in [
            SpecConfig {
                method: SpecMethod::Ngram,
                num_steps: 3,
                ..Default::default()
            },
            SpecConfig {
                method: SpecMethod::Eagle3,
                num_steps: 3,
                adaptive: false,
                ..Default::default()
            },
        ] {
            let mut p = Policy::new(cfg);
            p.record_step(1, 0.009);
            p.record_step(4, 0.036);
            for _ in 0..PARK_AFTER * 2 {
                p.choose_k(0, &[3]);
                assert!(!p.draft_parked(1));
            }
        }
    }
}
