//! Turning logits into the next token: greedy, temperature, top-k, top-p, min-p, repetition /
//! presence / frequency penalties, seeded randomness, and logprobs.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

mod mask;
pub mod rows;

pub use mask::{TokenGuide, TokenMask};
pub use rows::{Penalty, RowDraw, RowResult, sample_row};

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no limit.
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// Hugging Face style: > 1 discourages every token already in the prompt or output.
    pub repetition_penalty: f32,
    /// OpenAI style, on output tokens: subtracted once from a token that appeared.
    pub presence_penalty: f32,
    /// OpenAI style, on output tokens: subtracted per occurrence.
    pub frequency_penalty: f32,
    pub seed: Option<u64>,
    /// Compute the chosen token's logprob (the request asked for logprobs). Without it a token's
    /// `logprob` is 0 and sampling spends no pass over the vocabulary on it.
    pub logprobs: bool,
    /// With `logprobs`, also the top-n alternatives' logprobs (0: only the chosen token's).
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Whether a draw depends on the tokens emitted before it (repetition, presence or
    /// frequency penalties).
    pub fn has_penalties(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }

    /// Rejects values no sampler can honour, naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |f: &str, why: &str| Err(Error::InvalidRequest(format!("`{f}` {why}")));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad("temperature", "must be a finite number >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", "must be in [0, 1]");
        }
        if !self.repetition_penalty.is_finite() || self.repetition_penalty <= 0.0 {
            return bad("repetition_penalty", "must be > 0");
        }
        for (f, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() || !(-2.0..=2.0).contains(&v) {
                return bad(f, "must be in [-2, 2]");
            }
        }
        if self.top_logprobs > 20 {
            return bad("top_logprobs", "must be at most 20");
        }
        Ok(())
    }
}

/// The chosen token with its logprob under the model's distribution (0 unless the request asked).
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    pub logprob: f32,
    /// The `top_logprobs` most likely tokens, best first.
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Occurrences of each token in the output so far (presence / frequency penalties).
    counts: std::collections::HashMap<u32, u32>,
    /// Every token of prompt and output (repetition penalty).
    seen: std::collections::HashSet<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Sampler {
        let rng = match params.seed {
            Some(s) => ChaCha8Rng::seed_from_u64(s),
            None => ChaCha8Rng::from_os_rng(),
        };
        Sampler {
            rng,
            counts: Default::default(),
            seen: prompt.iter().copied().collect(),
            params,
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a token that joined the output (also when it came from elsewhere, e.g. speculation).
    pub fn observe(&mut self, token: u32) {
        *self.counts.entry(token).or_default() += 1;
        self.seen.insert(token);
    }

    /// Picks the next token from `logits` (modified in place) and records it.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sampled {
        self.pick(logits, |s, l| {
            if s.params.temperature == 0.0 {
                argmax(l)
            } else {
                let (ids, probs) = s.distribution(l);
                ids[s.draw_index(&probs)]
            }
        })
    }

    /// Verifies one draft token against this position's `logits` (modified in place) and records
    /// the token that results; `true` when it is the draft. Greedy: the draft stands iff it is the
    /// argmax. Sampling: it stands with probability p(draft), else the token is drawn from p with
    /// the draft removed and renormalised — rejection sampling for a drafter that proposes one token
    /// deterministically, which leaves the output distributed exactly as p.
    pub fn verify(&mut self, logits: &mut [f32], draft: u32) -> (Sampled, bool) {
        let out = self.pick(logits, |s, l| {
            if s.params.temperature == 0.0 {
                return argmax(l);
            }
            let (ids, mut probs) = s.distribution(l);
            let at = ids.iter().position(|&t| t == draft);
            let p_draft = at.map_or(0.0, |i| probs[i]);
            if s.rng.random::<f32>() < p_draft {
                return draft;
            }
            if let Some(i) = at {
                probs[i] = 0.0;
            }
            if probs.iter().all(|&q| q <= 0.0) {
                return draft;
            }
            ids[s.draw_index(&probs)]
        });
        let accepted = out.token == draft;
        (out, accepted)
    }

    fn pick(
        &mut self,
        logits: &mut [f32],
        choose: impl FnOnce(&mut Self, &[f32]) -> u32,
    ) -> Sampled {
        let p = &self.params;
        // Logprobs describe the model's distribution, before penalties rewrite the logits.
        let stats = p
            .logprobs
            .then(|| log_softmax_stats(logits, p.top_logprobs));
        let penalised =
            p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        let raw = (p.logprobs && penalised).then(|| logits.to_vec());
        self.apply_penalties(logits);
        let token = choose(self, logits);
        let out = match stats {
            Some((raw_lse, top)) => Sampled {
                token,
                logprob: raw.as_deref().unwrap_or(logits)[token as usize] - raw_lse,
                top: top.into_iter().map(|(t, l)| (t, l - raw_lse)).collect(),
            },
            None => Sampled {
                token,
                logprob: 0.0,
                top: Vec::new(),
            },
        };
        self.observe(token);
        out
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.frequency_penalty * c as f32 + p.presence_penalty;
                }
            }
        }
    }

    /// The sampling distribution after temperature, top-k, top-p and min-p: the kept token ids,
    /// best first, and their probabilities (summing to 1).
    fn distribution(&self, logits: &[f32]) -> (Vec<u32>, Vec<f32>) {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l * inv_t))
            .collect();
        // Best first; the stable sort keeps lower ids first among equal logits.
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.truncate(p.top_k);
        }
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|(_, l)| (l - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= sum);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p;
            keep = keep.min(probs.iter().take_while(|&&q| q >= floor).count().max(1));
        }
        probs.truncate(keep);
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        (cand[..keep].iter().map(|&(t, _)| t).collect(), probs)
    }

    /// An index drawn with the given (not necessarily normalised) weights.
    fn draw_index(&mut self, weights: &[f32]) -> usize {
        let total: f32 = weights.iter().sum();
        let mut u = self.rng.random::<f32>() * total;
        for (i, w) in weights.iter().enumerate() {
            u -= w;
            if u <= 0.0 && *w > 0.0 {
                return i;
            }
        }
        weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
    }
}

/// Index of the largest logit (the first one on ties, as torch.argmax).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// log-sum-exp of the logits and the `n` largest (id, logit) pairs.
fn log_softmax_stats(logits: &[f32], n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    let lse = max + sum.ln();
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if top.len() < n || l > top[top.len() - 1].1 {
                let at = top.partition_point(|&(_, v)| v >= l);
                top.insert(at, (i as u32, l));
                top.truncate(n);
            }
        }
    }
    (lse, top)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 0.5, 2.9]
    }

    /// Pearson's chi-square statistic of observed counts against expected probabilities.
    fn chi_square(counts: &[u32], probs: &[f64]) -> f64 {
        let n: u32 = counts.iter().sum();
        counts
            .iter()
            .zip(probs)
            .filter(|(_, p)| **p > 0.0)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// The chi-square critical value for 4 degrees of freedom at p = 0.001.
    const CHI2_DF4_P001: f64 = 18.467;
    const SAMPLES: usize = 40_000;

    fn sampling_params() -> SamplingParams {
        SamplingParams {
            temperature: 0.8,
            seed: Some(11),
            ..SamplingParams::greedy()
        }
    }

    /// The reference distribution: softmax(logits / T).
    fn target() -> Vec<f64> {
        let l = logits();
        let e: Vec<f64> = l.iter().map(|&x| ((x / 0.8) as f64).exp()).collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|v| v / z).collect()
    }

    fn histogram(mut draw: impl FnMut() -> u32) -> Vec<u32> {
        let mut counts = vec![0u32; logits().len()];
        for _ in 0..SAMPLES {
            counts[draw() as usize] += 1;
        }
        counts
    }

    #[test]
    fn speculative_sampling_keeps_the_target_distribution_for_any_draft() {
        let want = target();
        // Without speculation, as the baseline the test's threshold must accept.
        let mut s = Sampler::new(sampling_params(), &[]);
        let base = histogram(|| s.sample(&mut logits()).token);
        assert!(chi_square(&base, &want) < CHI2_DF4_P001, "plain sampling");
        // With a draft: the likeliest token, an unlikely one, each must leave p unchanged.
        for draft in [1u32, 3, 2] {
            let mut s = Sampler::new(sampling_params(), &[]);
            let got = histogram(|| s.verify(&mut logits(), draft).0.token);
            let chi = chi_square(&got, &want);
            assert!(chi < CHI2_DF4_P001, "draft {draft}: chi-square {chi:.1}");
        }
    }

    #[test]
    fn a_verifier_that_resamples_from_p_after_rejection_fails_the_same_test() {
        // The classic bug: on rejection, draw from p instead of p without the draft. The draft then
        // comes out with probability p + (1 - p) p; the statistical test must catch it.
        let want = target();
        let draft = 2u32;
        let mut s = Sampler::new(sampling_params(), &[]);
        let got = histogram(|| {
            let l = logits();
            let (ids, probs) = s.distribution(&l);
            let p_draft = probs[ids.iter().position(|&t| t == draft).expect("kept")];
            if s.rng.random::<f32>() < p_draft {
                draft
            } else {
                ids[s.draw_index(&probs)]
            }
        });
        let chi = chi_square(&got, &want);
        assert!(
            chi > CHI2_DF4_P001,
            "the wrong verifier passed (chi-square {chi:.1})"
        );
    }

    #[test]
    fn greedy_verification_accepts_exactly_the_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy(), &[]);
        let (out, ok) = s.verify(&mut logits(), 1);
        assert!(ok && out.token == 1);
        // 4 is a near-tie (2.9 vs 3.0) but not the argmax: rejected, the argmax stands.
        let (out, ok) = s.verify(&mut logits(), 4);
        assert!(!ok && out.token == 1);
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy(), &[]);
        assert_eq!(s.sample(&mut logits()).token, 1);
    }

    #[test]
    fn seed_reproduces_and_differs_across_seeds() {
        let p = |seed| SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            ..Default::default()
        };
        let run = |seed| {
            let mut s = Sampler::new(p(seed), &[]);
            (0..64)
                .map(|_| s.sample(&mut logits()).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 5.0,
                top_k: 1,
                seed: Some(3),
                ..Default::default()
            },
            &[],
        );
        for _ in 0..20 {
            assert_eq!(s.sample(&mut logits()).token, 1);
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        let params = |top_p, min_p| SamplingParams {
            temperature: 1.0,
            top_p,
            min_p,
            seed: Some(9),
            ..Default::default()
        };
        for p in [params(0.5, 0.0), params(1.0, 0.8)] {
            let mut s = Sampler::new(p, &[]);
            for _ in 0..200 {
                let t = s.sample(&mut logits()).token;
                assert!(t == 1 || t == 4, "token {t} is outside the nucleus");
            }
        }
    }

    #[test]
    fn repetition_penalty_demotes_seen_tokens() {
        let mut s = Sampler::new(
            SamplingParams {
                repetition_penalty: 2.0,
                ..Default::default()
            },
            &[1],
        );
        assert_eq!(s.sample(&mut logits()).token, 4);
    }

    #[test]
    fn frequency_penalty_grows_with_count() {
        let mut s = Sampler::new(
            SamplingParams {
                frequency_penalty: 0.6,
                ..Default::default()
            },
            &[],
        );
        assert_eq!(s.sample(&mut logits()).token, 1); // 3.0 > 2.9
        assert_eq!(s.sample(&mut logits()).token, 4); // 3.0 - 0.6 < 2.9
    }

    #[test]
    fn logprobs_are_normalised_and_sorted() {
        let mut s = Sampler::new(
            SamplingParams {
                logprobs: true,
                top_logprobs: 3,
                ..Default::default()
            },
            &[],
        );
        let out = s.sample(&mut logits());
        let total: f32 = logits().iter().map(|l| l.exp()).sum();
        assert!((out.logprob - (3.0f32.exp() / total).ln()).abs() < 1e-5);
        assert_eq!(
            out.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 4, 2]
        );
    }

    #[test]
    fn invalid_params_name_the_field() {
        let p = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(
            p.validate()
                .err()
                .is_some_and(|e| e.to_string().contains("top_p"))
        );
    }
}
