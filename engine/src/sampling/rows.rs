//! Sampling where the logits are: a [`RowDraw`] says everything one logits row needs (settings,
//! penalties, mask, the draft it verifies, its random numbers), so a backend samples every row
//! of a step in one pass and only token ids and logprobs come back. [`sample_row`] is the host
//! reference a device kernel must agree with.
//!
//! Unlike [`Sampler::sample`], a draw is stateless: the sampler folds its penalty state into
//! the draw up front, counting the tokens this step emits before the row as already emitted
//! (row `j` of a verified chain is used only when drafts `0..j` stood, a tree node's row only
//! when the path to it did). Randomness comes as two uniforms from the sequence's seeded
//! generator, so the same seed draws the same tokens on any backend up to float rounding.
//!
//! The kept set is cut at logit thresholds (top-k, top-p, min-p), so tokens tying at a
//! threshold are all kept, and the draw walks kept tokens in vocabulary order: both are what a
//! block-parallel kernel does without sorting.

use std::collections::BTreeMap;

use rand::Rng;

use super::{Sampled, Sampler, SamplingParams, TokenMask, argmax, log_softmax_stats};

/// A token whose logit the penalties change.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Penalty {
    pub token: u32,
    /// The token was seen (prompt or output): the repetition penalty applies.
    pub repeat: bool,
    /// Subtracted after that: the frequency penalty per output occurrence plus the presence
    /// penalty once.
    pub subtract: f32,
}

/// One logits row's draw.
#[derive(Clone, Debug)]
pub struct RowDraw<'a> {
    pub params: SamplingParams,
    /// Tokens the penalties touch, each once, in token order.
    pub penalties: Vec<Penalty>,
    pub mask: Option<&'a TokenMask>,
    /// The draft token this row verifies (rejection sampling; greedy: the argmax decides).
    pub draft: Option<u32>,
    /// Uniforms in [0, 1): the first draws (or accepts the draft), the second redraws after a
    /// rejection.
    pub uniforms: [f32; 2],
}

impl RowDraw<'_> {
    /// A greedy draw with nothing else asked (rows nobody reads).
    pub fn greedy() -> Self {
        RowDraw {
            params: SamplingParams::greedy(),
            penalties: Vec::new(),
            mask: None,
            draft: None,
            uniforms: [0.0; 2],
        }
    }
}

/// What one row drew.
#[derive(Clone, Debug, PartialEq)]
pub struct RowResult {
    pub sampled: Sampled,
    /// The row verified a draft and the token is that draft.
    pub accepted: bool,
}

impl Sampler {
    /// This row's draw: the sequence's penalties with `earlier` (tokens this step emits before
    /// the row) counted as output, fresh uniforms when the row is random, and the draft it
    /// verifies. The sampler's own state is untouched but for its generator; [`Sampler::observe`]
    /// records what is emitted.
    pub fn row_draw<'a>(
        &mut self,
        earlier: &[u32],
        draft: Option<u32>,
        mask: Option<&'a TokenMask>,
    ) -> RowDraw<'a> {
        let p = self.params;
        let uniforms = if p.temperature > 0.0 {
            [self.rng.random::<f32>(), self.rng.random::<f32>()]
        } else {
            [0.0; 2]
        };
        RowDraw {
            params: p,
            penalties: self.penalties_with(earlier),
            mask,
            draft,
            uniforms,
        }
    }

    fn penalties_with(&self, earlier: &[u32]) -> Vec<Penalty> {
        let p = &self.params;
        let repeat = p.repetition_penalty != 1.0;
        let subtract = p.presence_penalty != 0.0 || p.frequency_penalty != 0.0;
        if !repeat && !subtract {
            return Vec::new();
        }
        // token -> (seen, output occurrences)
        let mut touched: BTreeMap<u32, (bool, u32)> = BTreeMap::new();
        if repeat {
            for &t in &self.seen {
                touched.entry(t).or_default().0 = true;
            }
        }
        for (&t, &c) in &self.counts {
            touched.entry(t).or_default().1 += c;
        }
        for &t in earlier {
            let e = touched.entry(t).or_default();
            e.0 = true;
            e.1 += 1;
        }
        touched
            .into_iter()
            .map(|(token, (seen, count))| Penalty {
                token,
                repeat: repeat && seen,
                subtract: if subtract && count > 0 {
                    p.frequency_penalty * count as f32 + p.presence_penalty
                } else {
                    0.0
                },
            })
            .filter(|e| e.repeat || e.subtract != 0.0)
            .collect()
    }
}

/// Samples one row (modified in place) as a device backend does: mask, logprob statistics on
/// the masked logits, penalties, then greedy, a draw, or a draft's verification.
pub fn sample_row(row: &mut [f32], d: &RowDraw<'_>) -> RowResult {
    let p = &d.params;
    if let Some(m) = d.mask {
        m.apply(row);
    }
    let stats = p.logprobs.then(|| log_softmax_stats(row, p.top_logprobs));
    let raw: Vec<f32> = d
        .penalties
        .iter()
        .map(|e| row.get(e.token as usize).copied().unwrap_or(0.0))
        .collect();
    apply(row, p.repetition_penalty, &d.penalties);
    let (token, accepted) = choose(row, d);
    let sampled = match stats {
        Some((lse, top)) => {
            let at = d.penalties.iter().position(|e| e.token == token);
            let logit = at.map_or(row[token as usize], |i| raw[i]);
            Sampled {
                token,
                logprob: logit - lse,
                top: top.into_iter().map(|(t, l)| (t, l - lse)).collect(),
            }
        }
        None => Sampled {
            token,
            logprob: 0.0,
            top: Vec::new(),
        },
    };
    RowResult { sampled, accepted }
}

fn apply(row: &mut [f32], repetition: f32, penalties: &[Penalty]) {
    for e in penalties {
        if let Some(l) = row.get_mut(e.token as usize) {
            if e.repeat {
                *l = if *l > 0.0 {
                    *l / repetition
                } else {
                    *l * repetition
                };
            }
            *l -= e.subtract;
        }
    }
}

fn choose(row: &[f32], d: &RowDraw<'_>) -> (u32, bool) {
    let best = argmax(row);
    if d.params.temperature == 0.0 || !row[best as usize].is_finite() {
        return (best, d.draft == Some(best));
    }
    let kept = Kept::of(row, &d.params);
    match d.draft {
        None => (kept.walk(row, d.uniforms[0] * kept.total, None), false),
        Some(draft) => {
            let w = kept.weight(row, draft);
            if d.uniforms[0] * kept.total < w {
                return (draft, true);
            }
            let rest = kept.total - w;
            if rest <= 0.0 {
                return (draft, true);
            }
            (kept.walk(row, d.uniforms[1] * rest, Some(draft)), false)
        }
    }
}

/// The kept set of a random row: logits at or above `cut`, weighted `exp((l - max) / t)`.
struct Kept {
    max: f32,
    temperature: f32,
    cut: f32,
    total: f32,
}

impl Kept {
    fn of(row: &[f32], p: &SamplingParams) -> Kept {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(l));
        let mut k = Kept {
            max,
            temperature: p.temperature,
            cut: f32::NEG_INFINITY,
            total: 0.0,
        };
        let mut sorted: Vec<f32> = row.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if p.top_k > 0 && p.top_k < row.len() {
            k.cut = sorted[p.top_k - 1];
        }
        k.total = k.mass(row);
        if p.top_p < 1.0 {
            let goal = p.top_p * k.total;
            let mut acc = 0.0;
            for &l in sorted.iter().take_while(|&&l| l >= k.cut) {
                acc += k.weight_of(l);
                if acc >= goal {
                    k.cut = l;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            k.cut = k.cut.max(max + p.temperature * p.min_p.ln());
        }
        k.total = k.mass(row);
        k
    }

    fn weight_of(&self, l: f32) -> f32 {
        if l >= self.cut {
            ((l - self.max) / self.temperature).exp()
        } else {
            0.0
        }
    }

    fn weight(&self, row: &[f32], token: u32) -> f32 {
        row.get(token as usize).map_or(0.0, |&l| self.weight_of(l))
    }

    fn mass(&self, row: &[f32]) -> f32 {
        row.iter().map(|&l| self.weight_of(l)).sum()
    }

    /// The kept token (other than `skip`) where the running mass in vocabulary order passes
    /// `target`.
    fn walk(&self, row: &[f32], target: f32, skip: Option<u32>) -> u32 {
        let mut acc = 0.0;
        let mut last = None;
        for (i, &l) in row.iter().enumerate() {
            let w = self.weight_of(l);
            if w <= 0.0 || skip == Some(i as u32) {
                continue;
            }
            acc += w;
            last = Some(i as u32);
            if target < acc {
                return i as u32;
            }
        }
        last.or(skip).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VOCAB: usize = 6;

    fn row() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 0.5, 2.9, -1.0]
    }

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            seed: Some(11),
            ..SamplingParams::greedy()
        }
    }

    fn softmax(l: &[f32]) -> Vec<f64> {
        let m = l.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let e: Vec<f64> = l.iter().map(|&x| ((x - m) as f64).exp()).collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|v| v / z).collect()
    }

    fn histogram(n: usize, mut draw: impl FnMut() -> RowResult) -> Vec<f64> {
        let mut h = vec![0.0; VOCAB];
        for _ in 0..n {
            h[draw().sampled.token as usize] += 1.0 / n as f64;
        }
        h
    }

    #[test]
    fn greedy_rows_take_the_argmax_and_accept_only_it() {
        let mut s = Sampler::new(params(0.0), &[]);
        let d = s.row_draw(&[], Some(1), None);
        assert_eq!(sample_row(&mut row(), &d).sampled.token, 1);
        assert!(sample_row(&mut row(), &d).accepted);
        let d = s.row_draw(&[], Some(4), None);
        let r = sample_row(&mut row(), &d);
        assert_eq!((r.sampled.token, r.accepted), (1, false));
    }

    #[test]
    fn draws_follow_the_softmax_and_verification_keeps_it() {
        let n = 40_000;
        let want = softmax(&row());
        let mut s = Sampler::new(params(1.0), &[]);
        let plain = histogram(n, || sample_row(&mut row(), &s.row_draw(&[], None, None)));
        // Verifying a fixed, unlikely draft must leave the emitted distribution as p.
        let verified = histogram(n, || {
            sample_row(&mut row(), &s.row_draw(&[], Some(3), None))
        });
        for t in 0..VOCAB {
            assert!((plain[t] - want[t]).abs() < 0.01, "plain {t}: {plain:?}");
            assert!(
                (verified[t] - want[t]).abs() < 0.01,
                "verified {t}: {verified:?}"
            );
        }
    }

    #[test]
    fn a_rejected_draft_is_never_redrawn() {
        let mut s = Sampler::new(params(1.0), &[]);
        for _ in 0..2000 {
            let r = sample_row(&mut row(), &s.row_draw(&[], Some(1), None));
            assert_eq!(r.accepted, r.sampled.token == 1);
        }
    }

    #[test]
    fn cuts_keep_the_top_k_the_nucleus_and_the_min_p_band() {
        let mut s = Sampler::new(
            SamplingParams {
                top_k: 2,
                ..params(1.0)
            },
            &[],
        );
        let h = histogram(4000, || {
            sample_row(&mut row(), &s.row_draw(&[], None, None))
        });
        assert!(
            h[1] > 0.0 && h[4] > 0.0 && (h[1] + h[4] - 1.0).abs() < 1e-9,
            "{h:?}"
        );
        // p(1) ~ 0.40, p(4) ~ 0.36: top-p 0.5 needs both, top-p 0.39 only token 1.
        for (top_p, kept) in [(0.5, vec![1, 4]), (0.39, vec![1])] {
            let mut s = Sampler::new(
                SamplingParams {
                    top_p,
                    ..params(1.0)
                },
                &[],
            );
            let h = histogram(4000, || {
                sample_row(&mut row(), &s.row_draw(&[], None, None))
            });
            let got: Vec<usize> = (0..VOCAB).filter(|&t| h[t] > 0.0).collect();
            assert_eq!(got, kept, "top_p {top_p}");
        }
        // min_p 0.5: tokens with p >= p_max / 2: 1 and 4 (token 2's ratio is e^-1).
        let mut s = Sampler::new(
            SamplingParams {
                min_p: 0.5,
                ..params(1.0)
            },
            &[],
        );
        let h = histogram(4000, || {
            sample_row(&mut row(), &s.row_draw(&[], None, None))
        });
        let got: Vec<usize> = (0..VOCAB).filter(|&t| h[t] > 0.0).collect();
        assert_eq!(got, vec![1, 4]);
    }

    #[test]
    fn penalties_count_the_tokens_emitted_earlier_in_the_step() {
        let mut s = Sampler::new(
            SamplingParams {
                frequency_penalty: 1.5,
                ..params(0.0)
            },
            &[],
        );
        // Token 1 leads by 0.1; one earlier emission of it hands the row to token 4.
        assert_eq!(
            sample_row(&mut row(), &s.row_draw(&[], None, None))
                .sampled
                .token,
            1
        );
        let d = s.row_draw(&[1], None, None);
        assert_eq!(d.penalties.len(), 1);
        assert_eq!(sample_row(&mut row(), &d).sampled.token, 4);
        // What the sampler observed counts the same way.
        s.observe(1);
        assert_eq!(
            sample_row(&mut row(), &s.row_draw(&[], None, None))
                .sampled
                .token,
            4
        );
    }

    #[test]
    fn the_mask_applies_before_everything_and_logprobs_ignore_penalties() {
        let mask = TokenMask::allowing(VOCAB, [2, 4]);
        let mut s = Sampler::new(
            SamplingParams {
                logprobs: true,
                top_logprobs: 2,
                repetition_penalty: 10.0,
                ..params(0.0)
            },
            &[4],
        );
        let r = sample_row(&mut row(), &s.row_draw(&[], None, Some(&mask)));
        // Token 4 is penalised to 0.29, so 2 wins; logprobs are over the masked, unpenalised row.
        assert_eq!(r.sampled.token, 2);
        let p = softmax(&[2.0, 2.9]);
        assert!((r.sampled.logprob as f64 - p[0].ln()).abs() < 1e-5);
        assert_eq!(r.sampled.top[0].0, 4);
        assert!((r.sampled.top[0].1 as f64 - p[1].ln()).abs() < 1e-5);
    }

    #[test]
    fn the_same_seed_draws_the_same_tokens() {
        let run = || {
            let mut s = Sampler::new(params(0.8), &[]);
            (0..50)
                .map(|_| {
                    sample_row(&mut row(), &s.row_draw(&[], None, None))
                        .sampled
                        .token
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
    }
}
