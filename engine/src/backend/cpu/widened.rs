//! Weight rows kept as stored floats narrower than f32 (bf16, block FP8) and widened to f32 a
//! tile of rows at a time inside the matmul: a DeepSeek-V3 or Kimi-K2 checkpoint's FP8 and bf16
//! weights stay at their stored size in memory (a quarter and a half of f32), and every product
//! is the f32 one, since widening is exact.

use std::cell::RefCell;

use super::simd::Kernels;
use super::team::Team;
use super::{CpuBuffer, OutPtr};
use crate::weights::dtype::decode_f8_block;

/// Stored float rows, row-major.
pub enum Widened {
    /// bf16 bit patterns.
    Bf16(Vec<u16>),
    /// `DType::F8Blocks(width)` bytes: per row, blocks of an f32 scale and `width` e4m3 values.
    F8Blocks { width: usize, data: Vec<u8> },
}

impl Widened {
    /// Row `r` of a `cols`-wide matrix as f32 into `out`.
    pub fn row_f32(&self, r: usize, cols: usize, out: &mut [f32]) {
        match self {
            Widened::Bf16(d) => {
                for (o, &b) in out.iter_mut().zip(&d[r * cols..(r + 1) * cols]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            Widened::F8Blocks { width, data } => {
                let row_bytes = cols / width * (4 + width);
                let row = &data[r * row_bytes..(r + 1) * row_bytes];
                for (b, o) in row
                    .chunks_exact(4 + width)
                    .zip(out.chunks_exact_mut(*width))
                {
                    decode_f8_block(b, o);
                }
            }
        }
    }

    /// Whether `other` can be appended to this one as further rows.
    pub fn same_format(&self, other: &Widened) -> bool {
        match (self, other) {
            (Widened::Bf16(_), Widened::Bf16(_)) => true,
            (Widened::F8Blocks { width: a, .. }, Widened::F8Blocks { width: b, .. }) => a == b,
            _ => false,
        }
    }

    pub fn append(&mut self, other: Widened) {
        match (self, other) {
            (Widened::Bf16(a), Widened::Bf16(b)) => a.extend(b),
            (Widened::F8Blocks { data: a, .. }, Widened::F8Blocks { data: b, .. }) => a.extend(b),
            _ => unreachable!("append is only called on parts of the same format"),
        }
    }
}

/// Rows widened per tile for the dot kernels (few tokens): enough to keep their four-row blocks
/// busy, few enough that a tile of the widest rows (18432 values) stays in L2.
const TILE_ROWS: usize = 16;
/// Rows widened per tile for a GEMM (many tokens): each call packs the activations again, so
/// its panel must be wide for that to pay.
const GEMM_TILE_ROWS: usize = 128;

thread_local! {
    /// Each team thread's tile, kept between matmuls: decode steps run hundreds a second.
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Where one part's results go: `out` at column `col0`, rows `stride` apart.
pub struct Dest {
    pub out: *mut f32,
    pub stride: usize,
    pub col0: usize,
}

/// `x · rowsᵀ` for a part of `n_rows` widened rows into `dest`. Tokens at or above `gemm_min`
/// take a GEMM per tile; fewer take the f32 dot kernels, every token over each four-row block
/// while it is in L1.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    k: &Kernels,
    team: &Team,
    x: &CpuBuffer,
    rows: &Widened,
    n_rows: usize,
    dest: Dest,
    chunk: usize,
    gemm_min: usize,
) {
    let (n, cols) = (x.rows, x.cols);
    let out_ptr = OutPtr(dest.out);
    let (stride, col0) = (dest.stride, dest.col0);
    team.run(n_rows.div_ceil(chunk), &|c| {
        let op = out_ptr;
        let (r0, r1) = (c * chunk, ((c + 1) * chunk).min(n_rows));
        let tile_rows = if n >= gemm_min {
            GEMM_TILE_ROWS
        } else {
            TILE_ROWS
        };
        TILE.with_borrow_mut(|tile| {
            tile.resize(tile_rows * cols, 0.0);
            let mut r = r0;
            while r < r1 {
                let m = (r1 - r).min(tile_rows);
                for (i, out) in tile.chunks_exact_mut(cols).take(m).enumerate() {
                    rows.row_f32(r + i, cols, out);
                }
                if n >= gemm_min {
                    // SAFETY: dst is out at column col0 + r with row stride `stride`, n x m in
                    // bounds and owned by this chunk; lhs is x (n x cols), rhs the tile's m rows
                    // read as the transposed matrix (cols x m).
                    unsafe {
                        gemm::gemm(
                            n,
                            m,
                            cols,
                            op.0.add(col0 + r),
                            1,
                            stride as isize,
                            false,
                            x.data.as_ptr(),
                            1,
                            cols as isize,
                            tile.as_ptr(),
                            cols as isize,
                            1,
                            0.0,
                            1.0,
                            false,
                            false,
                            false,
                            gemm::Parallelism::None,
                        );
                    }
                } else {
                    let xt = |t: usize| &x.data[t * cols..(t + 1) * cols];
                    // SAFETY: (t, col0 + row) is inside out; chunks own disjoint rows.
                    let put = |t: usize, row: usize, v: f32| unsafe {
                        *op.0.add(t * stride + col0 + row) = v;
                    };
                    let row = |i: usize| &tile[i * cols..(i + 1) * cols];
                    let mut i = 0;
                    while i + 4 <= m {
                        let block = [0, 1, 2, 3].map(|j| row(i + j));
                        let mut t = 0;
                        while t + 2 <= n {
                            let pair = (k.dot4x2_f32)(block, [xt(t), xt(t + 1)]);
                            for (dt, vals) in pair.into_iter().enumerate() {
                                for (j, v) in vals.into_iter().enumerate() {
                                    put(t + dt, r + i + j, v);
                                }
                            }
                            t += 2;
                        }
                        if t < n {
                            for (j, w) in block.into_iter().enumerate() {
                                put(t, r + i + j, (k.dot_f32)(w, xt(t)));
                            }
                        }
                        i += 4;
                    }
                    for i in i..m {
                        for t in 0..n {
                            put(t, r + i, (k.dot_f32)(row(i), xt(t)));
                        }
                    }
                }
                r += m;
            }
        });
    });
}
