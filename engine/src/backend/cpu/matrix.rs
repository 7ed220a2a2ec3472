//! Weight matrices on the CPU: preparation from stored tensors (dequantize or repack) and the
//! multi-threaded matmul over them.

use super::blocks::{
    BlockQ4_1, BlockQ4_1x8, BlockQ8_0, BlockQ8Act, BlockQ8x8, BlockQ8x16, QBLOCK, f32_to_f16,
    quantize_two_level,
};
use super::simd::Kernels;
use super::team::Team;
use super::widened::{self, Widened};
use super::{CpuBuffer, OutPtr};
use crate::backend::Precision;
use crate::error::{Error, Result};
use crate::weights::TensorView;
use crate::weights::dtype::{DType, QK_K, dequantize, k_scale_min};

/// Row storage of one matrix. Quantized rows hold `cols / 32` blocks each.
pub enum Rows {
    F32(Vec<f32>),
    Q4_1(Vec<BlockQ4_1>),
    Q8_0(Vec<BlockQ8_0>),
    Q8x16(Vec<BlockQ8x16>),
    /// Groups of eight rows interleaved (`[group][block]`): what the fast kernels use whenever the row
    /// count is a multiple of eight.
    Q4_1x8(Vec<BlockQ4_1x8>),
    Q8x8(Vec<BlockQ8x8>),
    /// Floats kept as stored (bf16, block FP8) in fast mode, widened to f32 as they are read.
    Widened(Widened),
}

/// A group of consecutive output rows stored in one format.
pub struct Part {
    pub rows: usize,
    pub data: Rows,
}

/// A `[rows, cols]` weight matrix, possibly stacked from parts of different formats (a fused QKV whose V
/// projection is stored at higher precision, say).
pub struct CpuMatrix {
    pub rows: usize,
    pub cols: usize,
    pub parts: Vec<Part>,
}

/// Activation rows per input row for the quantized parts: the 8-bit value and its 7-bit residual.
/// Single 8-bit activations (llama.cpp's choice) move SmolLM2-135M's logits by up to 6% of their
/// range and flip greedy tokens with margins near 0.2; two levels bring that to ~6e-4 for a second
/// integer dot product on weights already unpacked.
const ACT_LEVELS: usize = 2;

fn block_count(v: &TensorView, cols: usize) -> Result<usize> {
    if !cols.is_multiple_of(QBLOCK) {
        return Err(Error::tensor(
            &v.path,
            &v.name,
            format!("row length {cols} is not a multiple of 32"),
        ));
    }
    Ok(cols / QBLOCK)
}

fn prepare_part(v: &TensorView, precision: Precision) -> Result<Part> {
    let (rows, cols) = v.matrix_shape()?;
    let bytes = v.bytes();
    let data = match (precision, v.dtype) {
        (Precision::Fast, DType::Q4_1) => {
            block_count(v, cols)?;
            Rows::Q4_1(
                bytes
                    .chunks_exact(20)
                    .map(|b| BlockQ4_1 {
                        d: u16::from_le_bytes([b[0], b[1]]),
                        m: u16::from_le_bytes([b[2], b[3]]),
                        qs: b[4..20].try_into().unwrap_or_default(),
                    })
                    .collect(),
            )
        }
        (Precision::Fast, DType::Q4_0) => {
            block_count(v, cols)?;
            // d * (q - 8) = d * q + (-8 d): the same values as Q4_1 with m = -8 d (exact in f16).
            Rows::Q4_1(
                bytes
                    .chunks_exact(18)
                    .map(|b| {
                        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
                        BlockQ4_1 {
                            d: u16::from_le_bytes([b[0], b[1]]),
                            m: f32_to_f16(-8.0 * d),
                            qs: b[2..18].try_into().unwrap_or_default(),
                        }
                    })
                    .collect(),
            )
        }
        (Precision::Fast, DType::Q8_0) => {
            block_count(v, cols)?;
            Rows::Q8_0(
                bytes
                    .chunks_exact(34)
                    .map(|b| BlockQ8_0 {
                        d: u16::from_le_bytes([b[0], b[1]]),
                        qs: std::array::from_fn(|j| b[2 + j] as i8),
                    })
                    .collect(),
            )
        }
        (Precision::Fast, DType::Q5_0) => {
            block_count(v, cols)?;
            // Dequantize each block to its integer levels (-16..16) under the same scale.
            let mut vals = [0f32; 32];
            Rows::Q8_0(
                bytes
                    .chunks_exact(22)
                    .map(|b| {
                        let mut unit = b.to_vec();
                        unit[0..2].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
                        dequantize(DType::Q5_0, &unit, &mut vals);
                        BlockQ8_0 {
                            d: u16::from_le_bytes([b[0], b[1]]),
                            qs: std::array::from_fn(|j| vals[j] as i8),
                        }
                    })
                    .collect(),
            )
        }
        (Precision::Fast, DType::BF16) => Rows::Widened(Widened::Bf16(
            bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect(),
        )),
        (Precision::Fast, DType::F8Blocks(width)) => Rows::Widened(Widened::F8Blocks {
            width: width as usize,
            data: bytes.to_vec(),
        }),
        (Precision::Fast, DType::Q4_K) => Rows::Q4_1(repack_q4_k(bytes)),
        (Precision::Fast, DType::Q6_K) => Rows::Q8x16(repack_q6_k(bytes)),
        _ => Rows::F32(v.to_f32()),
    };
    let data = if rows % 8 == 0 {
        interleave(data, rows, cols / QBLOCK)
    } else {
        data
    };
    Ok(Part { rows, data })
}

/// Row-major values (a whole number of 32-value blocks per row) as Q8_0 blocks: scale
/// `max |x| / 127`, values rounded to the nearest level.
fn quantize_q8_0(values: &[f32]) -> Vec<BlockQ8_0> {
    values
        .chunks_exact(QBLOCK)
        .map(|b| {
            let amax = b.iter().fold(0f32, |m, &x| m.max(x.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            BlockQ8_0 {
                d: f32_to_f16(d),
                qs: std::array::from_fn(|j| (b[j] * inv).round().clamp(-127.0, 127.0) as i8),
            }
        })
        .collect()
}

/// Q4_K super-blocks (8 sub-blocks of 32 with 6-bit scales and mins) as eight Q4_1 blocks. The sub-block
/// scale `d * sc` is rounded to f16, a relative error below 5e-4 — fast mode only.
fn repack_q4_k(bytes: &[u8]) -> Vec<BlockQ4_1> {
    let mut out = Vec::with_capacity(bytes.len() / 144 * 8);
    for b in bytes.chunks_exact(144) {
        let d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let dmin = half::f16::from_le_bytes([b[2], b[3]]).to_f32();
        let scales = &b[4..16];
        let qs = &b[16..144];
        for chunk in 0..4 {
            let q = &qs[chunk * 32..chunk * 32 + 32];
            for (sub, shift) in [(2 * chunk, 0u8), (2 * chunk + 1, 4u8)] {
                let (sc, m) = k_scale_min(sub, scales);
                // Q4_K packs elements l and l+32 in one byte; Q4_1 packs j and j+16.
                let nib = |l: usize| (q[l] >> shift) & 0x0f;
                out.push(BlockQ4_1 {
                    d: f32_to_f16(d * sc as f32),
                    m: f32_to_f16(-dmin * m as f32),
                    qs: std::array::from_fn(|j| nib(j) | (nib(j + 16) << 4)),
                });
            }
        }
    }
    out
}

/// Q6_K super-blocks (16 sub-blocks of 16 with int8 scales) as eight Q8x16 blocks.
fn repack_q6_k(bytes: &[u8]) -> Vec<BlockQ8x16> {
    let mut out = Vec::with_capacity(bytes.len() / 210 * 8);
    let mut levels = [0f32; QK_K];
    for b in bytes.chunks_exact(210) {
        let d = half::f16::from_le_bytes([b[208], b[209]]).to_f32();
        // Dequantize with d = 1 and every scale = 1 to read the raw levels (q - 32).
        let mut unit = b.to_vec();
        unit[192..208].fill(1);
        unit[208..210].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
        dequantize(DType::Q6_K, &unit, &mut levels);
        let sc = &b[192..208];
        for blk in 0..8 {
            out.push(BlockQ8x16 {
                d: [
                    f32_to_f16(d * (sc[2 * blk] as i8) as f32),
                    f32_to_f16(d * (sc[2 * blk + 1] as i8) as f32),
                ],
                qs: std::array::from_fn(|j| levels[blk * 32 + j] as i8),
            });
        }
    }
    out
}

impl CpuMatrix {
    pub fn prepare(parts: &[TensorView], precision: Precision) -> Result<CpuMatrix> {
        Self::prepare_with(parts, |v| prepare_part(v, precision))
    }

    /// Like fast mode, but float weights (f32 / f16 / bf16) are quantized to 8-bit blocks
    /// (Q8_0: one f16 scale per 32 values) so they stream at a quarter of the bytes — for a
    /// draft head, whose precision only moves acceptance, never the output.
    pub fn prepare_compact(parts: &[TensorView]) -> Result<CpuMatrix> {
        Self::prepare_with(parts, |v| {
            let (rows, cols) = v.matrix_shape()?;
            let float = matches!(v.dtype, DType::F32 | DType::F16 | DType::BF16);
            if !float || !cols.is_multiple_of(QBLOCK) {
                return prepare_part(v, Precision::Fast);
            }
            let data = Rows::Q8_0(quantize_q8_0(&v.to_f32()));
            let data = if rows % 8 == 0 {
                interleave(data, rows, cols / QBLOCK)
            } else {
                data
            };
            Ok(Part { rows, data })
        })
    }

    fn prepare_with(
        parts: &[TensorView],
        prepare_part: impl Fn(&TensorView) -> Result<Part>,
    ) -> Result<CpuMatrix> {
        let first = parts
            .first()
            .ok_or_else(|| Error::InvalidRequest("a matrix needs at least one tensor".into()))?;
        let (_, cols) = first.matrix_shape()?;
        let mut prepared: Vec<Part> = Vec::with_capacity(parts.len());
        for v in parts {
            let (_, c) = v.matrix_shape()?;
            if c != cols {
                return Err(Error::tensor(
                    &v.path,
                    &v.name,
                    format!("row length {c} differs from `{}` ({cols})", first.name),
                ));
            }
            let p = prepare_part(v)?;
            // The weight is now in its prepared form: its file pages need not stay resident.
            v.release_pages();
            // Stack onto the previous part when both use the same format.
            match (prepared.last_mut(), p) {
                (Some(last), p) if same_format(&last.data, &p.data) => {
                    last.rows += p.rows;
                    append(&mut last.data, p.data);
                }
                (_, p) => prepared.push(p),
            }
        }
        Ok(CpuMatrix {
            rows: prepared.iter().map(|p| p.rows).sum(),
            cols,
            parts: prepared,
        })
    }

    /// Row `r` dequantized into `out` (embedding lookups).
    pub fn row_f32(&self, mut r: usize, out: &mut [f32]) {
        for p in &self.parts {
            if r >= p.rows {
                r -= p.rows;
                continue;
            }
            let nb = self.cols / QBLOCK;
            match &p.data {
                Rows::F32(d) => out.copy_from_slice(&d[r * self.cols..(r + 1) * self.cols]),
                Rows::Widened(w) => w.row_f32(r, self.cols, out),
                Rows::Q4_1(b) => {
                    for (blk, o) in b[r * nb..(r + 1) * nb].iter().zip(out.chunks_exact_mut(32)) {
                        let (d, m) = (
                            super::blocks::f16_to_f32(blk.d),
                            super::blocks::f16_to_f32(blk.m),
                        );
                        for j in 0..16 {
                            o[j] = (blk.qs[j] & 0x0f) as f32 * d + m;
                            o[j + 16] = (blk.qs[j] >> 4) as f32 * d + m;
                        }
                    }
                }
                Rows::Q8_0(b) => {
                    for (blk, o) in b[r * nb..(r + 1) * nb].iter().zip(out.chunks_exact_mut(32)) {
                        let d = super::blocks::f16_to_f32(blk.d);
                        for (oj, q) in o.iter_mut().zip(&blk.qs) {
                            *oj = *q as f32 * d;
                        }
                    }
                }
                Rows::Q4_1x8(b) => {
                    let (g, i) = (r / 8, r % 8);
                    for (blk, o) in b[g * nb..(g + 1) * nb].iter().zip(out.chunks_exact_mut(32)) {
                        let (d, m) = (
                            super::blocks::f16_to_f32(blk.d[i]),
                            super::blocks::f16_to_f32(blk.m[i]),
                        );
                        for (e, oe) in o.iter_mut().enumerate() {
                            *oe = blk.level(i, e) as f32 * d + m;
                        }
                    }
                }
                Rows::Q8x8(b) => {
                    let (g, i) = (r / 8, r % 8);
                    for (blk, o) in b[g * nb..(g + 1) * nb].iter().zip(out.chunks_exact_mut(32)) {
                        for (e, oe) in o.iter_mut().enumerate() {
                            *oe = blk.level(i, e) as f32
                                * super::blocks::f16_to_f32(blk.d[e / 16][i]);
                        }
                    }
                }
                Rows::Q8x16(b) => {
                    for (blk, o) in b[r * nb..(r + 1) * nb].iter().zip(out.chunks_exact_mut(32)) {
                        for (j, (oj, q)) in o.iter_mut().zip(&blk.qs).enumerate() {
                            *oj = *q as f32 * super::blocks::f16_to_f32(blk.d[j / 16]);
                        }
                    }
                }
            }
            return;
        }
    }
}

/// Per-row blocks into eight-row groups (`rows` a multiple of 8, `nb` blocks per row).
fn interleave(data: Rows, rows: usize, nb: usize) -> Rows {
    let groups = rows / 8;
    match data {
        Rows::Q4_1(b) => Rows::Q4_1x8(
            (0..groups * nb)
                .map(|gb| {
                    let (g, blk) = (gb / nb, gb % nb);
                    BlockQ4_1x8::pack(std::array::from_fn(|i| &b[(8 * g + i) * nb + blk]))
                })
                .collect(),
        ),
        Rows::Q8_0(b) => Rows::Q8x8(
            (0..groups * nb)
                .map(|gb| {
                    let (g, blk) = (gb / nb, gb % nb);
                    let r: [&BlockQ8_0; 8] = std::array::from_fn(|i| &b[(8 * g + i) * nb + blk]);
                    let d = r.map(|x| x.d);
                    BlockQ8x8::pack(r.map(|x| &x.qs), [d, d])
                })
                .collect(),
        ),
        Rows::Q8x16(b) => Rows::Q8x8(
            (0..groups * nb)
                .map(|gb| {
                    let (g, blk) = (gb / nb, gb % nb);
                    let r: [&BlockQ8x16; 8] = std::array::from_fn(|i| &b[(8 * g + i) * nb + blk]);
                    BlockQ8x8::pack(r.map(|x| &x.qs), [r.map(|x| x.d[0]), r.map(|x| x.d[1])])
                })
                .collect(),
        ),
        other => other,
    }
}

fn same_format(a: &Rows, b: &Rows) -> bool {
    matches!(
        (a, b),
        (Rows::F32(_), Rows::F32(_))
            | (Rows::Q4_1(_), Rows::Q4_1(_))
            | (Rows::Q8_0(_), Rows::Q8_0(_))
            | (Rows::Q8x16(_), Rows::Q8x16(_))
            | (Rows::Q4_1x8(_), Rows::Q4_1x8(_))
            | (Rows::Q8x8(_), Rows::Q8x8(_))
    ) || matches!((a, b), (Rows::Widened(a), Rows::Widened(b)) if a.same_format(b))
}

fn append(a: &mut Rows, b: Rows) {
    match (a, b) {
        (Rows::F32(x), Rows::F32(y)) => x.extend(y),
        (Rows::Q4_1(x), Rows::Q4_1(y)) => x.extend(y),
        (Rows::Q8_0(x), Rows::Q8_0(y)) => x.extend(y),
        (Rows::Q8x16(x), Rows::Q8x16(y)) => x.extend(y),
        (Rows::Q4_1x8(x), Rows::Q4_1x8(y)) => x.extend(y),
        (Rows::Q8x8(x), Rows::Q8x8(y)) => x.extend(y),
        (Rows::Widened(x), Rows::Widened(y)) => x.append(y),
        _ => unreachable!("append is only called on parts of the same format"),
    }
}

/// Chunks are sized for this many threads; more chunks than threads lets fast threads take more.
const TEAM_THREADS_HINT: usize = 4;

/// Row chunks per matmul: enough for work stealing to balance, few enough to keep dispatch cheap.
fn chunk_rows(rows: usize, n_tokens: usize) -> usize {
    let threads = TEAM_THREADS_HINT;
    let target_chunks = if n_tokens > 1 {
        threads * 8
    } else {
        threads * 4
    };
    rows.div_ceil(target_chunks).next_multiple_of(4).max(4)
}

/// Tokens at or above this count use the blocked f32 GEMM instead of row dot products.
const GEMM_MIN_TOKENS: usize = 6;

pub fn matmul(k: &Kernels, team: &Team, x: &CpuBuffer, w: &CpuMatrix, out: &mut CpuBuffer) {
    let n = x.rows;
    assert_eq!(x.cols, w.cols, "matmul input width");
    out.resize(n, w.rows);
    let needs_act = w
        .parts
        .iter()
        .any(|p| !matches!(p.data, Rows::F32(_) | Rows::Widened(_)));
    let nb = w.cols / QBLOCK;
    // f32 parts read `x` directly: one pass, no activation rows.
    let levels = if needs_act { ACT_LEVELS } else { 1 };
    let acts = if needs_act {
        quantize_rows(team, x, nb)
    } else {
        Vec::new()
    };
    let out_ptr = OutPtr(out.data.as_mut_ptr());
    let out_stride = w.rows;
    let mut col0 = 0;
    for p in &w.parts {
        match &p.data {
            Rows::F32(data) if n >= GEMM_MIN_TOKENS => {
                // SAFETY: dst is `out` at column col0 with row stride out_stride, `n x p.rows` in bounds;
                // lhs is x (`n x cols`), rhs is the transposed row-major weight (`cols x p.rows`).
                unsafe {
                    gemm::gemm(
                        n,
                        p.rows,
                        w.cols,
                        out_ptr.0.add(col0),
                        1,
                        out_stride as isize,
                        false,
                        x.data.as_ptr(),
                        1,
                        w.cols as isize,
                        data.as_ptr(),
                        w.cols as isize,
                        1,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::Rayon(rayon::current_num_threads()),
                    );
                }
            }
            Rows::Widened(rows) => widened::matmul(
                k,
                team,
                x,
                rows,
                p.rows,
                widened::Dest {
                    out: out_ptr.0,
                    stride: out_stride,
                    col0,
                },
                chunk_rows(p.rows, n),
                GEMM_MIN_TOKENS,
            ),
            Rows::Q4_1x8(_) | Rows::Q8x8(_) => {
                let groups = p.rows / 8;
                // An even count: the 512-bit kernels take groups two at a time.
                let chunk = chunk_rows(groups, n).div_ceil(4).max(1).next_multiple_of(2);
                team.run(groups.div_ceil(chunk), &|c| {
                    let op = out_ptr;
                    let (g0, g1) = (c * chunk, ((c + 1) * chunk).min(groups));
                    // Level `l` of token `t`'s activations.
                    let row = |t: usize, l: usize| {
                        let r = t * ACT_LEVELS + l;
                        &acts[r * nb..(r + 1) * nb]
                    };
                    // Up to four tokens per pass over this chunk's weights, which stay in L1
                    // between passes.
                    let mut t0 = 0;
                    while t0 < n {
                        let take = match n - t0 {
                            4.. => 4,
                            2 | 3 => 2,
                            _ => 1,
                        };
                        let hi = |i: usize| row(t0 + i, 0);
                        let lo = |i: usize| row(t0 + i, 1);
                        // SAFETY (for `put`): rows 8g..8g+8 of token t0 + i are inside out and
                        // owned by this chunk.
                        let put = |g: usize, i: usize, o: &[f32]| unsafe {
                            std::ptr::copy_nonoverlapping(
                                o.as_ptr(),
                                op.0.add((t0 + i) * out_stride + col0 + 8 * g),
                                8,
                            )
                        };
                        let mut g = g0;
                        while g < g1 {
                            // `$kern` at this pass's token count, on weight groups `$w...`.
                            macro_rules! at_take {
                                ($kern:expr, $vals:ident, $($w:expr),+) => {
                                    match take {
                                        4 => {
                                            $vals = ($kern.p4)(
                                                $($w,)+
                                                [hi(0), hi(1), hi(2), hi(3)],
                                                [lo(0), lo(1), lo(2), lo(3)],
                                            )
                                        }
                                        2 => $vals[..2].copy_from_slice(&($kern.p2)(
                                            $($w,)+
                                            [hi(0), hi(1)],
                                            [lo(0), lo(1)],
                                        )),
                                        _ => $vals[..1].copy_from_slice(&($kern.p1)(
                                            $($w,)+
                                            [hi(0)],
                                            [lo(0)],
                                        )),
                                    }
                                };
                            }
                            // Two groups per call where the kernel has a 512-bit form.
                            macro_rules! run {
                                ($kern:expr, $b:expr) => {{
                                    let wg = |g: usize| &$b[g * nb..(g + 1) * nb];
                                    match $kern.wide.filter(|_| g + 1 < g1) {
                                        Some(wide) => {
                                            let mut vals = [[0f32; 16]; 4];
                                            at_take!(wide, vals, wg(g), wg(g + 1));
                                            for (i, o) in vals[..take].iter().enumerate() {
                                                put(g, i, &o[..8]);
                                                put(g + 1, i, &o[8..]);
                                            }
                                            g += 2;
                                        }
                                        None => {
                                            let mut vals = [[0f32; 8]; 4];
                                            at_take!($kern, vals, wg(g));
                                            for (i, o) in vals[..take].iter().enumerate() {
                                                put(g, i, o);
                                            }
                                            g += 1;
                                        }
                                    }
                                }};
                            }
                            match &p.data {
                                Rows::Q4_1x8(b) => run!(k.dot8_q4_1, b),
                                Rows::Q8x8(b) => run!(k.dot8_q8, b),
                                _ => unreachable!("matched above"),
                            }
                        }
                        t0 += take;
                    }
                });
            }
            data => {
                let chunk = chunk_rows(p.rows, n);
                let n_chunks = p.rows.div_ceil(chunk);
                team.run(n_chunks, &|c| {
                    let op = out_ptr;
                    let r0 = c * chunk;
                    let r1 = (r0 + chunk).min(p.rows);
                    // Rows outer, tokens inner: a block of four weight rows stays in L1 while every
                    // token (and activation level) passes over it, so a multi-token step (a
                    // speculative verification, a small batch) streams the weights once instead of
                    // once per token. Each (row, token) value is the same dot product as before.
                    let mut r = r0;
                    while r < r1 {
                        let block = (r1 - r).min(4);
                        if let (Rows::F32(d), 4) = (data, block) {
                            let rows =
                                [0, 1, 2, 3].map(|i| &d[(r + i) * w.cols..(r + i + 1) * w.cols]);
                            let xt = |t: usize| &x.data[t * w.cols..(t + 1) * w.cols];
                            // SAFETY: (t, col0 + r + i) is inside out; chunks own disjoint r.
                            let put = |t: usize, vals: [f32; 4]| unsafe {
                                let o = op.0.add(t * out_stride + col0 + r);
                                std::ptr::copy_nonoverlapping(vals.as_ptr(), o, 4);
                            };
                            let mut t = 0;
                            while t + 2 <= n {
                                let [a, b] = (k.dot4x2_f32)(rows, [xt(t), xt(t + 1)]);
                                put(t, a);
                                put(t + 1, b);
                                t += 2;
                            }
                            if t < n {
                                put(t, rows.map(|row| (k.dot_f32)(row, xt(t))));
                            }
                            r += 4;
                            continue;
                        }
                        for (t, l) in (0..n).flat_map(|t| (0..levels).map(move |l| (t, l))) {
                            let at = if acts.is_empty() {
                                &acts[..]
                            } else {
                                &acts[(t * levels + l) * nb..(t * levels + l + 1) * nb]
                            };
                            let xt = &x.data[t * w.cols..(t + 1) * w.cols];
                            // SAFETY: (t, col0 + r) is inside out (n x out_stride); chunks own
                            // disjoint r. The second level adds to the first.
                            let put = |r: usize, v: f32| unsafe {
                                let o = op.0.add(t * out_stride + col0 + r);
                                *o = if l == 0 { v } else { *o + v };
                            };
                            if block == 4 {
                                let vals = match data {
                                    Rows::F32(_) => unreachable!("four f32 rows take dot4x2 above"),
                                    Rows::Widened(_) => unreachable!("widened rows matched above"),
                                    Rows::Q4_1(b) => (k.dot4_q4_1)(
                                        [0, 1, 2, 3].map(|i| &b[(r + i) * nb..(r + i + 1) * nb]),
                                        at,
                                    ),
                                    Rows::Q8_0(b) => (k.dot4_q8_0)(
                                        [0, 1, 2, 3].map(|i| &b[(r + i) * nb..(r + i + 1) * nb]),
                                        at,
                                    ),
                                    Rows::Q8x16(b) => (k.dot4_q8x16)(
                                        [0, 1, 2, 3].map(|i| &b[(r + i) * nb..(r + i + 1) * nb]),
                                        at,
                                    ),
                                    Rows::Q4_1x8(_) | Rows::Q8x8(_) => {
                                        unreachable!("handled as groups")
                                    }
                                };
                                for (i, v) in vals.into_iter().enumerate() {
                                    put(r + i, v);
                                }
                                continue;
                            }
                            for r in r..r + block {
                                let v = match data {
                                    Rows::F32(d) => {
                                        (k.dot_f32)(&d[r * w.cols..(r + 1) * w.cols], xt)
                                    }
                                    Rows::Q4_1(b) => (k.dot_q4_1)(&b[r * nb..(r + 1) * nb], at),
                                    Rows::Q8_0(b) => (k.dot_q8_0)(&b[r * nb..(r + 1) * nb], at),
                                    Rows::Q8x16(b) => (k.dot_q8x16)(&b[r * nb..(r + 1) * nb], at),
                                    Rows::Widened(_) => unreachable!("widened rows matched above"),
                                    Rows::Q4_1x8(_) | Rows::Q8x8(_) => {
                                        unreachable!("handled as groups")
                                    }
                                };
                                put(r, v);
                            }
                        }
                        r += block;
                    }
                });
            }
        }
        col0 += p.rows;
    }
}

/// Two-level quantized activations: per input row, `nb` blocks of the 8-bit level, then `nb` of the
/// residual (`ACT_LEVELS` rows).
fn quantize_rows(team: &Team, x: &CpuBuffer, nb: usize) -> Vec<BlockQ8Act> {
    let mut a = vec![BlockQ8Act::default(); x.rows * ACT_LEVELS * nb];
    team.for_each_chunk_mut(&mut a, ACT_LEVELS * nb, 2, &|first, chunk| {
        for (i, ab) in chunk.chunks_exact_mut(ACT_LEVELS * nb).enumerate() {
            let r = first + i;
            let (hi, lo) = ab.split_at_mut(nb);
            quantize_two_level(&x.data[r * x.cols..(r + 1) * x.cols], hi, lo);
        }
    });
    a
}
