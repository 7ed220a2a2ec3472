//! Weights to bf16 on the GPU at load (dequant.cu): a tensor's stored bytes are uploaded as
//! they are, a quarter to an eighth of the f32 values the host would otherwise make and send,
//! and one thread per stored block writes its bf16 values in place.

use cudarc::driver::{CudaViewMut, PushKernelArg};
use half::bf16;

use super::backend::{CudaBackend, CudaBuffer, CudaMatrix, PackedFormat, Weights, cfg, dev};
use super::packed_kernel::{PackedKernel, mma_splits};
use crate::error::{Error, Result};
use crate::weights::{DType, TensorView};

/// dequant.cu's type code (the ggml type id) for `kiln_dequant_bf16`. Every type kiln reads
/// has a case there or a kernel of its own (`None`: block FP8, whose blocks vary in width); a
/// new one fails to compile here until it gets one.
pub fn kernel_code(dtype: DType) -> Option<i32> {
    Some(match dtype {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q5_0 => 6,
        DType::Q5_1 => 7,
        DType::Q8_0 => 8,
        DType::Q4_K => 12,
        DType::Q5_K => 13,
        DType::Q6_K => 14,
        DType::BF16 => 30,
        DType::F8Blocks(_) => return None,
    })
}

impl CudaBackend {
    /// Writes `t`'s values as bf16 into `dst` (exactly `t.n_elements()` long).
    pub(super) fn dequantize_into(
        &self,
        t: &TensorView,
        dst: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let n = t.n_elements();
        let bytes = t.bytes();
        if t.dtype.bytes_for(n) != Some(bytes.len()) || dst.len() != n {
            return Err(Error::tensor(
                &t.path,
                &t.name,
                format!(
                    "{} bytes of {:?} for {n} values (into {} on the device)",
                    bytes.len(),
                    t.dtype,
                    dst.len()
                ),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        let src = self.upload(bytes)?;
        let Some(code) = kernel_code(t.dtype) else {
            return self.dequantize_f8_blocks(
                &src.slice(0..src.len()),
                t.dtype.block_len(),
                n,
                dst,
            );
        };
        let n_blocks = (n / t.dtype.block_len()) as i64;
        let mut b = self.stream().launch_builder(self.f("kiln_dequant_bf16")?);
        b.arg(&src).arg(&code).arg(&n_blocks).arg(dst);
        // SAFETY: dequant.cu reads n_blocks whole blocks of `code` from `src` (its length was
        // checked above) and writes block_len values per block into `dst` (n values).
        unsafe {
            self.launch(
                &mut b,
                cfg(((n_blocks as usize).div_ceil(256), 1, 1), 256, 0),
                "dequantize launch",
            )
        }?;
        Ok(())
    }

    /// `parts` stacked by rows, packed as stored (Kimi-K2's INT4 at 0.56 bytes a weight,
    /// DeepSeek-V3's FP8 at 1.03, instead of bf16's 2): FP8 blocks go up as they are, Q4_0
    /// blocks are relaid into Q4 rows on the device.
    pub(super) fn packed_matrix(
        &self,
        parts: &[TensorView],
        format: PackedFormat,
    ) -> Result<CudaMatrix> {
        let cols = parts
            .first()
            .map_or(Ok(0), |p| p.matrix_shape().map(|s| s.1))?;
        let mut rows = 0;
        let mut total = 0;
        for p in parts {
            let (r, c) = p.matrix_shape()?;
            if c != cols {
                return Err(Error::tensor(
                    &p.path,
                    &p.name,
                    format!("{c} columns, stacked with a matrix of {cols}"),
                ));
            }
            rows += r;
            total += p.bytes().len();
        }
        if total != rows * format.stored_row_bytes(cols) {
            return Err(Error::Device(format!(
                "{total} bytes of {format:?} for [{rows}, {cols}]"
            )));
        }
        let (_, _, row_bytes) = format.kernel_args(cols);
        let row_bytes = row_bytes as usize;
        // Part by part into one allocation: a layer's experts never gather in host memory.
        let mut bytes = self.zeros::<u8>(rows * row_bytes)?;
        let mut at = 0;
        for p in parts {
            let src = p.bytes();
            let part_rows = p.matrix_shape()?.0;
            if part_rows == 0 {
                continue;
            }
            let mut dst = bytes.slice_mut(at..at + part_rows * row_bytes);
            match format {
                PackedFormat::F8Blocks(_) => self
                    .stream()
                    .memcpy_htod(src, &mut dst)
                    .map_err(dev("copy of packed weights to the device"))?,
                PackedFormat::Q4_0 => {
                    let stored = self.upload(src)?;
                    self.q4_0_to_rows(&stored.slice(..), (part_rows, cols), &mut dst)?;
                }
            }
            at += part_rows * row_bytes;
        }
        // Uploaded: the host's file pages of these weights need not stay resident.
        parts.iter().for_each(TensorView::release_pages);
        Ok(CudaMatrix {
            weights: Weights::Packed { bytes, format },
            rows,
            cols,
        })
    }

    /// `out = x · wᵀ` for a packed `w` of `rows x cols` (`out` already shaped `[x.rows, rows]`),
    /// at decode sizes (up to 32 tokens): on the tensor cores, or with FMAs when forced
    /// (packed_kernel.rs).
    pub(super) fn packed_matmul(
        &self,
        x: &CudaBuffer,
        w: &cudarc::driver::CudaSlice<u8>,
        format: PackedFormat,
        rows: usize,
        cols: usize,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        if x.cols != cols || out.rows != x.rows || out.cols != rows {
            return Err(Error::Device(format!(
                "packed matmul: x [{}, {}], out [{}, {}] for a [{rows}, {cols}] matrix",
                x.rows, x.cols, out.rows, out.cols
            )));
        }
        let kernel = self.packed_kernel.choose();
        let name = match kernel {
            PackedKernel::Fma => "kiln_packed_matmul_bf16",
            PackedKernel::TensorCores => "kiln_packed_mma_bf16",
        };
        let (format_i, width, row_bytes) = format.kernel_args(cols);
        let (rows_i, cols_i, n_i) = (rows as i32, cols as i32, x.rows as i32);
        let splits = mma_splits(cols) as i32;
        let mut b = self.stream().launch_builder(self.f(name)?);
        b.arg(w)
            .arg(&format_i)
            .arg(&width)
            .arg(&row_bytes)
            .arg(&rows_i)
            .arg(&cols_i);
        if kernel == PackedKernel::TensorCores {
            b.arg(&splits);
        }
        b.arg(&x.data).arg(&n_i).arg(&mut out.data);
        // SAFETY: as dequant.cu and packed_mma.cu declare (the same arguments, and the tensor
        // cores' warp split): `w` holds rows * row_bytes bytes (checked when it was uploaded;
        // packed rows hold whole 32-value blocks), x at least x.rows * cols values, out
        // x.rows * rows.
        unsafe {
            self.launch(
                &mut b,
                cfg(
                    (
                        rows.div_ceil(kernel.rows_per_block(cols)),
                        x.rows.div_ceil(kernel.tile_tokens()),
                        1,
                    ),
                    PackedKernel::THREADS,
                    0,
                ),
                "packed matmul launch",
            )
        }
    }

    /// `rows` rows of `cols` values of packed rows already on the device (in the device layout),
    /// as bf16 into `dst`.
    pub(super) fn widen_packed(
        &self,
        src: &cudarc::driver::CudaView<u8>,
        format: PackedFormat,
        (rows, cols): (usize, usize),
        dst: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        match format {
            PackedFormat::F8Blocks(width) => {
                self.dequantize_f8_blocks(src, width, rows * cols, dst)
            }
            PackedFormat::Q4_0 => self.q4_block_kernel(
                "kiln_dequant_q4_rows_bf16",
                src,
                (rows, cols),
                dst,
                "packed widen launch",
            ),
        }
    }

    /// Stored Q4_0 rows (on the device) into the device's row layout: scales, then nibbles.
    fn q4_0_to_rows(
        &self,
        stored: &cudarc::driver::CudaView<u8>,
        (rows, cols): (usize, usize),
        dst: &mut CudaViewMut<u8>,
    ) -> Result<()> {
        self.q4_block_kernel(
            "kiln_q4_0_to_rows",
            stored,
            (rows, cols),
            dst,
            "Q4_0 relayout launch",
        )
    }

    /// One of dequant.cu's Q4-row block kernels (`kiln_q4_0_to_rows`,
    /// `kiln_dequant_q4_rows_bf16`): one thread per 32-value block of `rows` rows of `cols`, with
    /// the row layout's arguments (columns, scale bytes, bytes per row, blocks).
    fn q4_block_kernel<T: cudarc::driver::DeviceRepr>(
        &self,
        kernel: &str,
        src: &cudarc::driver::CudaView<u8>,
        (rows, cols): (usize, usize),
        dst: &mut CudaViewMut<T>,
        what: &'static str,
    ) -> Result<()> {
        let (_, scales, row_bytes) = PackedFormat::Q4_0.kernel_args(cols);
        let (cols_i, n_blocks) = (cols as i32, (rows * cols / 32) as i64);
        let mut b = self.stream().launch_builder(self.f(kernel)?);
        b.arg(src)
            .arg(&cols_i)
            .arg(&scales)
            .arg(&row_bytes)
            .arg(&n_blocks)
            .arg(dst);
        // SAFETY: both kernels read `rows` rows of `src` (whole stored blocks or whole Q4 rows,
        // as the callers sliced them) and write `rows` rows of `dst` in the other layout; one
        // thread per block.
        unsafe {
            self.launch(
                &mut b,
                cfg(((n_blocks as usize).div_ceil(256), 1, 1), 256, 0),
                what,
            )
        }
    }

    /// `F8Blocks(width)` values (`n` of them, already on the device in `src`) as bf16 into `dst`.
    fn dequantize_f8_blocks(
        &self,
        src: &cudarc::driver::CudaView<u8>,
        width: usize,
        n: usize,
        dst: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let (width, n_values) = (width as i32, n as i64);
        let mut b = self
            .stream()
            .launch_builder(self.f("kiln_dequant_f8_blocks_bf16")?);
        b.arg(src).arg(&width).arg(&n_values).arg(dst);
        // SAFETY: the caller checked that `src` holds exactly the whole blocks of n values and
        // `dst` n values; the kernel reads block i / width of 4 + width bytes for value i.
        unsafe {
            self.launch(
                &mut b,
                cfg((n.div_ceil(256), 1, 1), 256, 0),
                "FP8 dequantize launch",
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_s_kernel_code_is_its_ggml_id() {
        for id in 0..40 {
            if let Some(d) = DType::from_ggml(id) {
                assert_eq!(kernel_code(d), Some(id as i32), "{d:?}");
            }
        }
    }
}
