//! The sampling op on the GPU: a step's draws packed into a few flat arrays, four kernels over
//! the logits where the LM head left them (sampling.cu), and token ids and the logprobs asked
//! for copied back. Packing and unpacking are host code with unit tests; the kernels are checked
//! against the host reference by `kiln gpu-check` (op_parity.rs).

use cudarc::driver::PushKernelArg;

use super::backend::{CudaBackend, CudaBuffer, cfg, dev, int};
use crate::error::{Error, Result};
use crate::sampling::{RowDraw, RowResult, Sampled};

/// Settings per row, in sampling.cu's order (`RI_*`, `RF_*`).
const ROW_INTS: usize = 6;
const ROW_FLOATS: usize = 6;
/// Most alternatives a row may ask for (`KILN_TOP_MAX`).
pub const TOP_MAX: usize = 20;
const THREADS: usize = 1024;
const PREPARE_THREADS: usize = 256;

/// A step's draws as the kernels read them.
#[derive(Debug, Default, PartialEq)]
pub struct Packed {
    /// Per row: top-k, draft (-1), alternatives wanted (-1: no logprobs), first mask word (-1),
    /// penalty entries begin and end.
    pub ints: Vec<i32>,
    /// Per row: temperature, top-p, min-p, repetition penalty, the two uniforms.
    pub floats: Vec<f32>,
    pub pen_tokens: Vec<i32>,
    /// Per penalty entry: repeat flag (0 or 1), amount subtracted.
    pub pen_values: Vec<f32>,
    /// Every distinct mask once, each `vocab.div_ceil(64)` words.
    pub mask_words: Vec<u64>,
    pub any_logprobs: bool,
}

/// Packs `draws` for a vocabulary of `vocab` tokens. A mask shorter than the vocabulary (or a
/// draft or penalty past it) is refused rather than read past.
pub fn pack(draws: &[RowDraw<'_>], vocab: usize) -> Result<Packed> {
    let words = vocab.div_ceil(64);
    let mut p = Packed {
        ints: Vec::with_capacity(draws.len() * ROW_INTS),
        floats: Vec::with_capacity(draws.len() * ROW_FLOATS),
        ..Packed::default()
    };
    // Rows of one sequence share its mask: upload it once.
    let mut masks: Vec<(*const crate::sampling::TokenMask, i32)> = Vec::new();
    for d in draws {
        let s = &d.params;
        let mask_at = match d.mask {
            None => -1,
            Some(m) => match masks.iter().find(|(ptr, _)| std::ptr::eq(*ptr, m)) {
                Some(&(_, at)) => at,
                None => {
                    if m.words().len() < words {
                        return Err(Error::InvalidRequest(format!(
                            "a token mask of {} words for a vocabulary of {vocab}",
                            m.words().len()
                        )));
                    }
                    let at = int(p.mask_words.len());
                    p.mask_words.extend_from_slice(&m.words()[..words]);
                    masks.push((m as *const _, at));
                    at
                }
            },
        };
        let draft = match d.draft {
            Some(t) if t as usize >= vocab => {
                return Err(Error::InvalidRequest(format!(
                    "draft token {t} is past the vocabulary ({vocab})"
                )));
            }
            Some(t) => t as i32,
            None => -1,
        };
        let top_n = if s.logprobs {
            p.any_logprobs = true;
            int(s.top_logprobs.min(TOP_MAX))
        } else {
            -1
        };
        let begin = int(p.pen_tokens.len());
        for e in &d.penalties {
            if e.token as usize >= vocab {
                continue;
            }
            p.pen_tokens.push(e.token as i32);
            p.pen_values
                .extend([if e.repeat { 1.0 } else { 0.0 }, e.subtract]);
        }
        let top_k = if s.top_k >= vocab { 0 } else { int(s.top_k) };
        p.ints
            .extend([top_k, draft, top_n, mask_at, begin, int(p.pen_tokens.len())]);
        p.floats.extend([
            s.temperature,
            s.top_p,
            s.min_p,
            s.repetition_penalty,
            d.uniforms[0],
            d.uniforms[1],
        ]);
    }
    Ok(p)
}

/// What the kernels wrote, read back: `out` is (token, accepted) per row, `logprob` per row,
/// `top_ids` and `top_logprobs` [`TOP_MAX`] per row (the last three only when a row asked).
pub fn unpack(
    draws: &[RowDraw<'_>],
    out: &[i32],
    logprob: &[f32],
    top_ids: &[i32],
    top_logprobs: &[f32],
) -> Vec<RowResult> {
    draws
        .iter()
        .enumerate()
        .map(|(r, d)| {
            let token = out.get(2 * r).map_or(0, |&t| t.max(0) as u32);
            let accepted = out.get(2 * r + 1).is_some_and(|&a| a != 0);
            let (logprob, top) = if d.params.logprobs {
                let n = d.params.top_logprobs.min(TOP_MAX);
                let base = r * TOP_MAX;
                let top = (0..n)
                    .filter_map(|k| {
                        let id = *top_ids.get(base + k)?;
                        Some((id.max(0) as u32, *top_logprobs.get(base + k)?))
                    })
                    .collect();
                (logprob.get(r).copied().unwrap_or(0.0), top)
            } else {
                (0.0, Vec::new())
            };
            RowResult {
                sampled: Sampled {
                    token,
                    logprob,
                    top,
                },
                accepted,
            }
        })
        .collect()
}

impl CudaBackend {
    /// [`crate::backend::Backend::sample`] on the GPU.
    pub(super) fn sample_rows(
        &self,
        logits: &CudaBuffer,
        draws: &[RowDraw<'_>],
    ) -> Result<Vec<RowResult>> {
        if draws.is_empty() {
            return Ok(Vec::new());
        }
        let (rows, vocab) = (draws.len(), logits.cols);
        if rows > logits.rows || vocab == 0 {
            return Err(Error::InvalidRequest(format!(
                "{rows} draws for {} logits rows of {vocab}",
                logits.rows
            )));
        }
        let p = pack(draws, vocab)?;
        let ints = self.stage(&p.ints)?;
        let floats = self.stage(&p.floats)?;
        let pen_tokens = self.stage(&p.pen_tokens)?;
        let pen_values = self.stage(&p.pen_values)?;
        let mask_words = self.stage(&p.mask_words)?;
        let mut work = self.zeros::<f32>(rows * vocab)?;
        let mut saved = self.zeros::<f32>(p.pen_tokens.len())?;
        let mut lse = self.zeros::<f32>(rows)?;
        let mut top_ids = self.zeros::<i32>(rows * TOP_MAX)?;
        let mut top_lp = self.zeros::<f32>(rows * TOP_MAX)?;
        let mut out = self.zeros::<i32>(2 * rows)?;
        let mut out_lp = self.zeros::<f32>(rows)?;
        let v = int(vocab);
        let s = self.stream();

        let mut b = s.launch_builder(self.f("kiln_sample_prepare")?);
        b.arg(logits.data())
            .arg(&v)
            .arg(&ints)
            .arg(&mask_words)
            .arg(&mut work);
        let col_blocks = vocab.div_ceil(PREPARE_THREADS);
        // SAFETY: as sampling.cu declares; rows on grid.x, columns on grid.y.
        unsafe {
            self.launch(
                &mut b,
                cfg((rows, col_blocks, 1), PREPARE_THREADS, 0),
                "sample prepare launch",
            )
        }?;
        if p.any_logprobs {
            let mut b = s.launch_builder(self.f("kiln_sample_stats")?);
            b.arg(&work)
                .arg(&v)
                .arg(&ints)
                .arg(&mut lse)
                .arg(&mut top_ids)
                .arg(&mut top_lp);
            // SAFETY: one block per row.
            unsafe { self.launch(&mut b, cfg((rows, 1, 1), THREADS, 0), "sample stats launch") }?;
        }
        if !p.pen_tokens.is_empty() {
            let mut b = s.launch_builder(self.f("kiln_sample_penalties")?);
            b.arg(&mut work)
                .arg(&v)
                .arg(&ints)
                .arg(&floats)
                .arg(&pen_tokens)
                .arg(&pen_values)
                .arg(&mut saved);
            // SAFETY: one block per row; a row's entries are distinct tokens.
            unsafe { self.launch(&mut b, cfg((rows, 1, 1), 128, 0), "sample penalties launch") }?;
        }
        let mut b = s.launch_builder(self.f("kiln_sample_draw")?);
        b.arg(&work)
            .arg(&v)
            .arg(&ints)
            .arg(&floats)
            .arg(&pen_tokens)
            .arg(&saved)
            .arg(&lse)
            .arg(&mut out)
            .arg(&mut out_lp);
        // SAFETY: one block per row.
        unsafe { self.launch(&mut b, cfg((rows, 1, 1), THREADS, 0), "sample draw launch") }?;

        let out = s.clone_dtoh(&out).map_err(dev("copy to the host"))?;
        let (logprob, ids, lps) = if p.any_logprobs {
            (
                s.clone_dtoh(&out_lp).map_err(dev("copy to the host"))?,
                s.clone_dtoh(&top_ids).map_err(dev("copy to the host"))?,
                s.clone_dtoh(&top_lp).map_err(dev("copy to the host"))?,
            )
        } else {
            (Vec::new(), Vec::new(), Vec::new())
        };
        Ok(unpack(draws, &out, &logprob, &ids, &lps))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::{Penalty, SamplingParams, TokenMask};

    fn draw<'a>(params: SamplingParams, mask: Option<&'a TokenMask>) -> RowDraw<'a> {
        RowDraw {
            params,
            penalties: Vec::new(),
            mask,
            draft: None,
            uniforms: [0.25, 0.75],
        }
    }

    #[test]
    fn rows_pack_their_settings_and_share_a_mask_once() {
        let mask = TokenMask::allowing(130, [1, 2]);
        let other = TokenMask::allowing(130, [3]);
        let sampled = SamplingParams {
            temperature: 0.7,
            top_k: 5,
            top_p: 0.9,
            logprobs: true,
            top_logprobs: 50,
            ..SamplingParams::greedy()
        };
        let mut first = draw(sampled, Some(&mask));
        first.draft = Some(7);
        first.penalties = vec![
            Penalty {
                token: 4,
                repeat: true,
                subtract: 0.0,
            },
            Penalty {
                token: 999,
                repeat: true,
                subtract: 1.0,
            },
        ];
        let draws = [
            first,
            draw(SamplingParams::greedy(), Some(&mask)),
            draw(SamplingParams::greedy(), Some(&other)),
            draw(SamplingParams::greedy(), None),
        ];
        let p = pack(&draws, 130).expect("pack");
        // Two distinct masks of three words each.
        assert_eq!(p.mask_words.len(), 6);
        assert_eq!(p.mask_words[0], 0b110);
        assert_eq!(p.mask_words[3], 0b1000);
        // top-k, draft, alternatives (capped), mask, penalties [begin, end): the entry past the
        // vocabulary is dropped.
        assert_eq!(&p.ints[..6], &[5, 7, TOP_MAX as i32, 0, 0, 1]);
        assert_eq!(&p.ints[6..12], &[0, -1, -1, 0, 1, 1]);
        assert_eq!(p.ints[6 * 2 + 3], 3);
        assert_eq!(p.ints[6 * 3 + 3], -1);
        assert_eq!(&p.floats[..6], &[0.7, 0.9, 0.0, 1.0, 0.25, 0.75]);
        assert_eq!(
            (p.pen_tokens.as_slice(), p.pen_values.as_slice()),
            (&[4][..], &[1.0, 0.0][..])
        );
        assert!(p.any_logprobs);
    }

    #[test]
    fn a_short_mask_or_a_draft_past_the_vocabulary_is_refused() {
        let mask = TokenMask::allowing(64, [1]);
        assert!(pack(&[draw(SamplingParams::greedy(), Some(&mask))], 130).is_err());
        let mut d = draw(SamplingParams::greedy(), None);
        d.draft = Some(130);
        assert!(pack(&[d], 130).is_err());
    }

    #[test]
    fn results_unpack_per_row_with_only_the_logprobs_asked_for() {
        let with = SamplingParams {
            logprobs: true,
            top_logprobs: 2,
            ..SamplingParams::greedy()
        };
        let draws = [draw(SamplingParams::greedy(), None), draw(with, None)];
        let mut ids = vec![0; 2 * TOP_MAX];
        let mut lps = vec![0.0; 2 * TOP_MAX];
        ids[TOP_MAX..TOP_MAX + 2].copy_from_slice(&[9, 3]);
        lps[TOP_MAX..TOP_MAX + 2].copy_from_slice(&[-0.1, -2.5]);
        let r = unpack(&draws, &[5, 0, 9, 1], &[-7.0, -0.1], &ids, &lps);
        assert_eq!(r[0].sampled.token, 5);
        assert!(!r[0].accepted);
        assert_eq!((r[0].sampled.logprob, r[0].sampled.top.len()), (0.0, 0));
        assert_eq!(r[1].sampled.token, 9);
        assert!(r[1].accepted);
        assert_eq!(r[1].sampled.logprob, -0.1);
        assert_eq!(r[1].sampled.top, vec![(9, -0.1), (3, -2.5)]);
    }
}
