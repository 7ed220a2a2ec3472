//! A matrix's transpose in its own stored type where that is lossless: MLA's absorbed attention
//! multiplies queries by `W_UK` itself, which kiln's `x · Wᵀ` matmul takes as `W_UKᵀ`.

use super::{DType, TensorView};
use crate::error::Result;

impl TensorView {
    /// `[cols, rows]` from `[rows, cols]`. Plain floats keep their type. Block FP8 stays FP8
    /// where every run of transposed values sharing a block also shared its scale (DeepSeek's
    /// square 128 x 128 blocks: a head's `W_UK` block of rows had one scale per column block);
    /// anything else becomes f32.
    pub fn transposed(&self) -> Result<TensorView> {
        let (rows, cols) = self.matrix_shape()?;
        let name = format!("{}ᵀ", self.name);
        let shape = vec![cols, rows];
        let bytes = self.bytes();
        let transpose_units = |unit: usize| -> Vec<u8> {
            let mut out = vec![0u8; bytes.len()];
            for r in 0..rows {
                for c in 0..cols {
                    let (src, dst) = ((r * cols + c) * unit, (c * rows + r) * unit);
                    out[dst..dst + unit].copy_from_slice(&bytes[src..src + unit]);
                }
            }
            out
        };
        let path = self.path.clone();
        match self.dtype {
            DType::F32 => {
                TensorView::from_bytes(name, path, DType::F32, shape, &transpose_units(4))
            }
            d @ (DType::F16 | DType::BF16) => {
                TensorView::from_bytes(name, path, d, shape, &transpose_units(2))
            }
            DType::F8Blocks(width) => {
                match transpose_f8_blocks(bytes, rows, cols, width as usize) {
                    Some((width, out)) => {
                        TensorView::from_bytes(name, path, DType::F8Blocks(width), shape, &out)
                    }
                    None => self.transposed_f32(name, shape),
                }
            }
            _ => self.transposed_f32(name, shape),
        }
    }

    fn transposed_f32(&self, name: String, shape: Vec<usize>) -> Result<TensorView> {
        let (rows, cols) = (shape[1], shape[0]);
        let values = self.to_f32();
        let mut out = vec![0f32; values.len()];
        for r in 0..rows {
            for c in 0..cols {
                out[c * rows + r] = values[r * cols + c];
            }
        }
        TensorView::from_f32(name, self.path.clone(), shape, &out)
    }
}

/// The transpose of `[rows, cols]` `F8Blocks(width)` bytes as `F8Blocks(w)` for the widest `w`
/// (dividing `rows`, at least 8) such that each run of `w` source rows holds one scale per source
/// column block; `None` where there is none.
fn transpose_f8_blocks(
    bytes: &[u8],
    rows: usize,
    cols: usize,
    width: usize,
) -> Option<(u16, Vec<u8>)> {
    let row_bytes = cols / width * (4 + width);
    let scale = |r: usize, c: usize| -> [u8; 4] {
        let at = r * row_bytes + c / width * (4 + width);
        [bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]
    };
    let value = |r: usize, c: usize| bytes[r * row_bytes + c / width * (4 + width) + 4 + c % width];
    let mut w = rows.min(1 << 15);
    while w >= 8 {
        let fits = rows.is_multiple_of(w)
            && (0..rows).step_by(w).all(|r0| {
                (0..cols)
                    .step_by(width)
                    .all(|c| (r0 + 1..r0 + w).all(|r| scale(r, c) == scale(r0, c)))
            });
        if fits {
            let mut out = Vec::with_capacity(cols * rows / w * (4 + w));
            for c in 0..cols {
                for r0 in (0..rows).step_by(w) {
                    out.extend_from_slice(&scale(r0, c));
                    out.extend((r0..r0 + w).map(|r| value(r, c)));
                }
            }
            return Some((w as u16, out));
        }
        w /= 2;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::quantized::repack_block_fp8;
    use half::bf16;

    fn transposed_values(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..cols)
            .flat_map(|c| (0..rows).map(move |r| v[r * cols + c]))
            .collect()
    }

    #[test]
    fn bf16_transposes_in_its_own_type() {
        let values: Vec<f32> = (0..12).map(|i| i as f32 - 4.5).collect();
        let bytes: Vec<u8> = values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect();
        let t = TensorView::from_bytes("w".into(), "t".into(), DType::BF16, vec![3, 4], &bytes)
            .expect("view");
        let tt = t.transposed().expect("transpose");
        assert_eq!((tt.dtype, tt.shape.clone()), (DType::BF16, vec![4, 3]));
        assert_eq!(tt.to_f32(), transposed_values(&values, 3, 4));
    }

    #[test]
    fn square_fp8_blocks_transpose_as_fp8_and_others_as_f32() {
        // [16, 32] in blocks of [8, 16]: four scales.
        let (rows, cols) = (16, 32);
        let bytes: Vec<u8> = (0..rows * cols).map(|i| (i * 11 % 120) as u8).collect();
        let scales = [0.5f32, 0.25, 2.0, 4.0];
        let packed = repack_block_fp8(&bytes, rows, cols, [8, 16], &scales).expect("packed");
        let v = TensorView::from_bytes(
            "kv_b".into(),
            "t".into(),
            DType::F8Blocks(16),
            vec![rows, cols],
            &packed,
        )
        .expect("view");
        let want = transposed_values(&v.to_f32(), rows, cols);
        let t = v.transposed().expect("transpose");
        assert_eq!(
            (t.dtype, t.shape.clone()),
            (DType::F8Blocks(8), vec![cols, rows])
        );
        assert_eq!(t.to_f32(), want);
        // One scale everywhere but on row 4's first block: every run of 8 or more rows holds
        // two scales there, so the transpose is f32.
        let mut odd = repack_block_fp8(&bytes, rows, cols, [3, 16], &[0.5; 6 * 2]).expect("packed");
        odd[4 * (2 * 20)..4 * (2 * 20) + 4].copy_from_slice(&3.0f32.to_le_bytes());
        let v = TensorView::from_bytes(
            "w".into(),
            "t".into(),
            DType::F8Blocks(16),
            vec![rows, cols],
            &odd,
        )
        .expect("view");
        let t = v.transposed().expect("transpose");
        assert_eq!(t.dtype, DType::F32);
        assert_eq!(t.to_f32(), transposed_values(&v.to_f32(), rows, cols));
    }
}
