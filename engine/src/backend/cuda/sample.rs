//! The sampling op on the GPU: a step's draws packed into a few flat arrays, four kernels over
//! the logits where the LM head left them (sampling.cu), and token ids and the logprobs asked
//! for copied back asynchronously into one of two pinned slots, read when the host needs them
//! (overlap scheduling launches the next step first). The tokens also stay on the device at a
//! fixed address, where the next step's embedding reads them. Packing and unpacking are host code with unit tests; the kernels are checked
//! against the host reference by `kiln gpu-check` (op_parity.rs).

use cudarc::driver::{
    CudaEvent, CudaSlice, DevicePtr, DeviceRepr, PushKernelArg, ValidAsZeroBits, result,
};

use super::backend::{CudaBackend, CudaBuffer, cfg, dev, int};
use super::staging::Pinned;
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
    // Equal masks are uploaded once: a guided sequence's rows often allow the same tokens (the
    // inside of a JSON string, say), and each row carries its own mask.
    let mut masks: Vec<(&crate::sampling::TokenMask, i32)> = Vec::new();
    for d in draws {
        let s = &d.params;
        let mask_at = match d.mask {
            None => -1,
            Some(m) => match masks
                .iter()
                .find(|(seen, _)| std::ptr::eq(*seen, m) || *seen == m)
            {
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
                    masks.push((m, at));
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
/// `tops[r]`: the alternatives row `r` asked for (`None`: no logprobs).
pub fn unpack(
    tops: &[Option<usize>],
    out: &[i32],
    logprob: &[f32],
    top_ids: &[i32],
    top_logprobs: &[f32],
) -> Vec<RowResult> {
    tops.iter()
        .enumerate()
        .map(|(r, wanted)| {
            let token = out.get(2 * r).map_or(0, |&t| t.max(0) as u32);
            let accepted = out.get(2 * r + 1).is_some_and(|&a| a != 0);
            let (logprob, top) = match *wanted {
                Some(n) => {
                    let base = r * TOP_MAX;
                    let top = (0..n.min(TOP_MAX))
                        .filter_map(|k| {
                            let id = *top_ids.get(base + k)?;
                            Some((id.max(0) as u32, *top_logprobs.get(base + k)?))
                        })
                        .collect();
                    (logprob.get(r).copied().unwrap_or(0.0), top)
                }
                None => (0.0, Vec::new()),
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

/// Where a row's results sit in a result slot's pinned memory: (token, accepted) pairs, then
/// logprobs, then the alternatives' ids and logprobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotLayout {
    pub rows: usize,
}

impl SlotLayout {
    pub fn out(&self) -> usize {
        0
    }
    pub fn logprob(&self) -> usize {
        8 * self.rows
    }
    pub fn top_ids(&self) -> usize {
        12 * self.rows
    }
    pub fn top_logprobs(&self) -> usize {
        self.top_ids() + 4 * TOP_MAX * self.rows
    }
    pub fn bytes(&self) -> usize {
        self.top_logprobs() + 4 * TOP_MAX * self.rows
    }
}

/// Results on their way to the host: pinned memory the copies land in, and the event after them.
struct ResultSlot {
    host: Pinned,
    /// Bumped by every launch into the slot: a read of an older launch is refused.
    generation: u64,
    copied: Option<CudaEvent>,
}

/// Device scratch of the sampling kernels, grown as needed and never shrunk.
#[derive(Default)]
struct Scratch {
    work: Option<CudaSlice<f32>>,
    saved: Option<CudaSlice<f32>>,
    lse: Option<CudaSlice<f32>>,
    top_ids: Option<CudaSlice<i32>>,
    top_lp: Option<CudaSlice<f32>>,
    out: Option<CudaSlice<i32>>,
    out_lp: Option<CudaSlice<f32>>,
}

/// The sampling op's state across calls.
#[derive(Default)]
pub struct Draws {
    scratch: Scratch,
    /// The latest launch's tokens at a fixed address (`kiln_embed_bf16`'s `fill` reads them;
    /// a recorded graph holds the address, so growing it drops the graphs).
    drawn: Option<CudaSlice<i32>>,
    /// Two slots taking turns, so a launch's results wait unread while the next one runs.
    slots: [Option<ResultSlot>; 2],
    launches: u64,
    /// Rows of the latest launch (what a fill may read).
    last_rows: usize,
}

/// A sampling launch, read with [`crate::backend::Backend::sample_read`].
pub struct DeviceDraw {
    slot: usize,
    generation: u64,
    tops: Vec<Option<usize>>,
    any_logprobs: bool,
}

/// `slot` holding at least `n` elements: the old one, or a new one (`true`) when it was short.
fn grow<T: DeviceRepr + ValidAsZeroBits>(
    b: &CudaBackend,
    slot: &mut Option<CudaSlice<T>>,
    n: usize,
) -> Result<bool> {
    if slot.as_ref().is_some_and(|s| s.len() >= n.max(1)) {
        return Ok(false);
    }
    b.may_allocate("the sampling scratch")?;
    *slot = Some(b.zeros::<T>(n.max(1).next_power_of_two())?);
    Ok(true)
}

fn take<T>(slot: &Option<CudaSlice<T>>) -> Result<&CudaSlice<T>> {
    slot.as_ref()
        .ok_or_else(|| Error::Device("the sampling scratch was not allocated".into()))
}

fn take_mut<T>(slot: &mut Option<CudaSlice<T>>) -> Result<&mut CudaSlice<T>> {
    slot.as_mut()
        .ok_or_else(|| Error::Device("the sampling scratch was not allocated".into()))
}

impl CudaBackend {
    fn draws_state(&self) -> Result<std::sync::MutexGuard<'_, Draws>> {
        self.draws
            .lock()
            .map_err(|_| Error::Device("the sampling state was poisoned".into()))
    }

    /// The device address of the latest launch's tokens (allocated on first use, so a graph
    /// recorded before any sampling already points at it). `fill` must read rows that launch
    /// drew.
    pub(super) fn drawn_tokens(&self, fill: Option<&[i32]>) -> Result<u64> {
        let mut d = self.draws_state()?;
        if let Some(&r) = fill.and_then(|f| f.iter().max())
            && r >= 0
            && r as usize >= d.last_rows
        {
            return Err(Error::Device(format!(
                "a token fills from row {r} of a draw of {} rows",
                d.last_rows
            )));
        }
        if d.drawn.is_none() {
            self.may_allocate("the drawn-token buffer")?;
            d.drawn = Some(self.zeros::<i32>(DRAWN_ROWS)?);
        }
        Ok(take(&d.drawn)?.device_ptr(self.stream()).0)
    }

    /// [`crate::backend::Backend::sample_launch`] on the GPU: four kernels, then the results'
    /// copies to a pinned slot and an event after them. Returns without waiting.
    pub(super) fn launch_draws(
        &self,
        logits: &CudaBuffer,
        draws: &[RowDraw<'_>],
    ) -> Result<DeviceDraw> {
        let (rows, vocab) = (draws.len(), logits.cols);
        if rows > logits.rows || (vocab == 0 && rows > 0) {
            return Err(Error::InvalidRequest(format!(
                "{rows} draws for {} logits rows of {vocab}",
                logits.rows
            )));
        }
        let p = pack(draws, vocab)?;
        let tops: Vec<Option<usize>> = draws
            .iter()
            .map(|d| {
                d.params
                    .logprobs
                    .then(|| d.params.top_logprobs.min(TOP_MAX))
            })
            .collect();
        let mut state = self.draws_state()?;
        let d = &mut *state;
        d.launches += 1;
        d.last_rows = rows;
        let slot = (d.launches % 2) as usize;
        if rows == 0 {
            return Ok(DeviceDraw {
                slot,
                generation: 0,
                tops,
                any_logprobs: false,
            });
        }
        let ints = self.stage(&p.ints)?;
        let floats = self.stage(&p.floats)?;
        let pen_tokens = self.stage(&p.pen_tokens)?;
        let pen_values = self.stage(&p.pen_values)?;
        let mask_words = self.stage(&p.mask_words)?;
        let sc = &mut d.scratch;
        grow(self, &mut sc.work, rows * vocab)?;
        grow(self, &mut sc.saved, p.pen_tokens.len())?;
        grow(self, &mut sc.lse, rows)?;
        grow(self, &mut sc.top_ids, rows * TOP_MAX)?;
        grow(self, &mut sc.top_lp, rows * TOP_MAX)?;
        grow(self, &mut sc.out, 2 * rows)?;
        grow(self, &mut sc.out_lp, rows)?;
        if d.drawn.as_ref().is_none_or(|t| t.len() < rows) {
            d.drawn = Some(self.zeros::<i32>(rows.max(DRAWN_ROWS).next_power_of_two())?);
            // The recorded graphs' embeddings read the old address.
            self.forget_graphs()?;
        }
        let v = int(vocab);
        let s = self.stream();

        let mut b = s.launch_builder(self.f("kiln_sample_prepare")?);
        b.arg(logits.data())
            .arg(&v)
            .arg(&ints)
            .arg(&mask_words)
            .arg(take_mut(&mut sc.work)?);
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
            let (work, lse) = (take(&sc.work)?, take(&sc.lse)?);
            let (top_ids, top_lp) = (take(&sc.top_ids)?, take(&sc.top_lp)?);
            let mut b = s.launch_builder(self.f("kiln_sample_stats")?);
            b.arg(work)
                .arg(&v)
                .arg(&ints)
                .arg(lse)
                .arg(top_ids)
                .arg(top_lp);
            // SAFETY: one block per row.
            unsafe { self.launch(&mut b, cfg((rows, 1, 1), THREADS, 0), "sample stats launch") }?;
        }
        if !p.pen_tokens.is_empty() {
            let (work, saved) = (take(&sc.work)?, take(&sc.saved)?);
            let mut b = s.launch_builder(self.f("kiln_sample_penalties")?);
            b.arg(work)
                .arg(&v)
                .arg(&ints)
                .arg(&floats)
                .arg(&pen_tokens)
                .arg(&pen_values)
                .arg(saved);
            // SAFETY: one block per row; a row's entries are distinct tokens.
            unsafe { self.launch(&mut b, cfg((rows, 1, 1), 128, 0), "sample penalties launch") }?;
        }
        let drawn = take(&d.drawn)?;
        let mut b = s.launch_builder(self.f("kiln_sample_draw")?);
        b.arg(take(&sc.work)?)
            .arg(&v)
            .arg(&ints)
            .arg(&floats)
            .arg(&pen_tokens)
            .arg(take(&sc.saved)?)
            .arg(take(&sc.lse)?)
            .arg(take(&sc.out)?)
            .arg(take(&sc.out_lp)?)
            .arg(drawn);
        // SAFETY: one block per row.
        unsafe { self.launch(&mut b, cfg((rows, 1, 1), THREADS, 0), "sample draw launch") }?;

        // The results go to a pinned slot without waiting; the event says when they are there.
        let layout = SlotLayout { rows };
        let fits = d.slots[slot]
            .as_ref()
            .is_some_and(|r| r.host.len() >= layout.bytes());
        if !fits {
            if let Some(old) = d.slots[slot].take()
                && let Some(e) = &old.copied
            {
                e.synchronize().map_err(dev("wait for sampled tokens"))?;
            }
            d.slots[slot] = Some(ResultSlot {
                host: Pinned::new(layout.bytes().next_power_of_two())?,
                generation: 0,
                copied: None,
            });
        }
        let r = d.slots[slot]
            .as_mut()
            .ok_or_else(|| Error::Device("the sampling result slot is missing".into()))?;
        let base = r.host.as_mut_ptr();
        let sc = &d.scratch;
        let mut copies: Vec<(u64, usize, usize)> =
            vec![(take(&sc.out)?.device_ptr(s).0, layout.out(), 8 * rows)];
        if p.any_logprobs {
            copies.push((
                take(&sc.out_lp)?.device_ptr(s).0,
                layout.logprob(),
                4 * rows,
            ));
            copies.push((
                take(&sc.top_ids)?.device_ptr(s).0,
                layout.top_ids(),
                4 * TOP_MAX * rows,
            ));
            copies.push((
                take(&sc.top_lp)?.device_ptr(s).0,
                layout.top_logprobs(),
                4 * TOP_MAX * rows,
            ));
        }
        for (src, at, bytes) in copies {
            // SAFETY: [at, at + bytes) lies inside the slot (its layout's size), which nothing
            // reads until the event below completes; the source holds `bytes` bytes.
            let dst = unsafe { std::slice::from_raw_parts_mut(base.add(at), bytes) };
            unsafe { result::memcpy_dtoh_async(dst, src, s.cu_stream()) }
                .map_err(dev("copy sampled tokens to the host"))?;
        }
        // Unique across slots and reallocations: a stale draw never matches a newer launch.
        r.generation = d.launches;
        r.copied = Some(s.record_event(None).map_err(dev("record an event"))?);
        Ok(DeviceDraw {
            slot,
            generation: r.generation,
            tops,
            any_logprobs: p.any_logprobs,
        })
    }

    /// [`crate::backend::Backend::sample_read`] on the GPU: waits for the launch's copies.
    pub(super) fn read_draws(&self, drawn: DeviceDraw) -> Result<Vec<RowResult>> {
        let rows = drawn.tops.len();
        if rows == 0 {
            return Ok(Vec::new());
        }
        let d = self.draws_state()?;
        let r = d.slots[drawn.slot]
            .as_ref()
            .filter(|r| r.generation == drawn.generation)
            .ok_or_else(|| {
                Error::Device("a sampling launch's results were overwritten before read".into())
            })?;
        if let Some(e) = &r.copied {
            e.synchronize().map_err(dev("wait for sampled tokens"))?;
        }
        let layout = SlotLayout { rows };
        let base = r.host.as_ptr();
        // SAFETY: the copies into [0, layout.bytes()) completed (the event), and the slot
        // holds at least that many bytes; i32 and f32 are plain data at 4-byte offsets.
        let read_i32 = |at: usize, n: usize| -> Vec<i32> {
            unsafe { std::slice::from_raw_parts(base.add(at) as *const i32, n) }.to_vec()
        };
        let read_f32 = |at: usize, n: usize| -> Vec<f32> {
            unsafe { std::slice::from_raw_parts(base.add(at) as *const f32, n) }.to_vec()
        };
        let out = read_i32(layout.out(), 2 * rows);
        let (logprob, ids, lps) = if drawn.any_logprobs {
            (
                read_f32(layout.logprob(), rows),
                read_i32(layout.top_ids(), TOP_MAX * rows),
                read_f32(layout.top_logprobs(), TOP_MAX * rows),
            )
        } else {
            (Vec::new(), Vec::new(), Vec::new())
        };
        Ok(unpack(&drawn.tops, &out, &logprob, &ids, &lps))
    }
}

/// Rows the drawn-token buffer starts with (it grows for larger draws).
const DRAWN_ROWS: usize = 1024;

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
        // Another row's own mask, equal to the first: shared too.
        let same = mask.clone();
        let draws = [
            first,
            draw(SamplingParams::greedy(), Some(&mask)),
            draw(SamplingParams::greedy(), Some(&other)),
            draw(SamplingParams::greedy(), None),
            draw(SamplingParams::greedy(), Some(&same)),
        ];
        let p = pack(&draws, 130).expect("pack");
        assert_eq!(p.ints[6 * 4 + 3], 0, "the equal mask is the first one");
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
        let tops: Vec<Option<usize>> = draws
            .iter()
            .map(|d| d.params.logprobs.then_some(d.params.top_logprobs))
            .collect();
        let mut ids = vec![0; 2 * TOP_MAX];
        let mut lps = vec![0.0; 2 * TOP_MAX];
        ids[TOP_MAX..TOP_MAX + 2].copy_from_slice(&[9, 3]);
        lps[TOP_MAX..TOP_MAX + 2].copy_from_slice(&[-0.1, -2.5]);
        let r = unpack(&tops, &[5, 0, 9, 1], &[-7.0, -0.1], &ids, &lps);
        assert_eq!(r[0].sampled.token, 5);
        assert!(!r[0].accepted);
        assert_eq!((r[0].sampled.logprob, r[0].sampled.top.len()), (0.0, 0));
        assert_eq!(r[1].sampled.token, 9);
        assert!(r[1].accepted);
        assert_eq!(r[1].sampled.logprob, -0.1);
        assert_eq!(r[1].sampled.top, vec![(9, -0.1), (3, -2.5)]);
    }
}
