//! MLA's per-head ops on the GPU: the absorbed attention over cached `[k_pe | latent]` rows
//! (`mla.cu`), the per-head matrices `W_UK^T` and `W_UV` stacked for one launch
//! (`kiln_head_matmul_bf16`), and per-head column copies. Each is one launch for every head of a
//! layer where a loop over heads would be hundreds.

use cudarc::driver::PushKernelArg;

use super::backend::{
    CudaBackend, CudaBuffer, CudaKvStore, CudaMatrix, CudaStepMeta, cfg, int, split_parts,
};
use crate::backend::{Backend, HeadColumns, Precision};
use crate::error::{Error, Result};
use crate::weights::TensorView;

/// As mla.cu's KILN_MLA_THREADS, KILN_MLA_TILE, KILN_MLA_MAX_OUT and KILN_MLA_PAD.
const MLA_THREADS: usize = 256;
const MLA_TILE: usize = 16;
const MLA_MAX_OUT: usize = 16;
const MLA_PAD: usize = 2;
/// The most heads one block serves: past this, the chunks' blocks spread the work better than
/// a larger share of the tile's reuse.
const MLA_MAX_CHUNK: usize = 16;
/// Dynamic shared memory a launch may take without opting in to more.
const SHARED_LIMIT: usize = 48 * 1024;
/// As dequant.cu's KILN_PACKED_TOKENS and KILN_PACKED_WARPS.
const PACKED_TOKENS: usize = 8;
const PACKED_WARPS: usize = 8;

/// One matrix per head, stacked head after head in one allocation.
pub struct CudaHeadMatrices {
    pub(super) stacked: CudaMatrix,
    /// Each head's rows.
    pub(super) rows: usize,
    pub(super) heads: usize,
}

/// mla.cu's dynamic shared memory for `chunk` heads over rows of `width`.
pub fn mla_shared_bytes(chunk: usize, width: usize) -> usize {
    let queries = chunk * width * 4;
    let tile = MLA_TILE * (width + MLA_PAD) * 2;
    let scores = chunk * MLA_TILE * 4;
    queries + tile + scores + 3 * chunk * 4
}

/// How many heads one block of mla.cu serves: the largest divisor of `n_heads` (up to
/// MLA_MAX_CHUNK) whose outputs the block's threads hold and whose shared memory fits, or an
/// error naming the shape it cannot serve.
pub fn mla_chunk(n_heads: usize, width: usize, rope: usize) -> Result<usize> {
    let latent = width.saturating_sub(rope);
    (1..=n_heads.min(MLA_MAX_CHUNK))
        .rev()
        .find(|&c| {
            n_heads.is_multiple_of(c)
                && c * latent <= MLA_THREADS * MLA_MAX_OUT
                && mla_shared_bytes(c, width) <= SHARED_LIMIT
        })
        .filter(|_| latent > 0 && latent <= 1024)
        .ok_or_else(|| {
            Error::Device(format!(
                "latent attention: {n_heads} heads over cached rows of {width} ({rope} rotary) \
                 are outside what the CUDA kernel covers (a latent of up to {}, rows of up to \
                 {} values)",
                MLA_THREADS * MLA_MAX_OUT,
                (SHARED_LIMIT - MLA_TILE * MLA_PAD * 2) / (4 + MLA_TILE * 2)
            ))
        })
}

impl CudaBackend {
    pub(super) fn stack_heads(
        &self,
        heads: &[TensorView],
        precision: Precision,
    ) -> Result<CudaHeadMatrices> {
        let Some(first) = heads.first() else {
            return Err(Error::Device("head matrices: no heads".into()));
        };
        let (rows, cols) = first.matrix_shape()?;
        for h in heads {
            if h.matrix_shape()? != (rows, cols) {
                return Err(Error::tensor(
                    &h.path,
                    &h.name,
                    format!(
                        "shape {:?}, stacked with heads of [{rows}, {cols}]",
                        h.shape
                    ),
                ));
            }
        }
        // Packed only where the rows hold whole 32-value chunks (`matrix` checks); bf16 else.
        Ok(CudaHeadMatrices {
            stacked: self.matrix(heads, precision)?,
            rows,
            heads: heads.len(),
        })
    }

    pub(super) fn head_matmul(
        &self,
        x: &CudaBuffer,
        x_cols: HeadColumns,
        w: &CudaHeadMatrices,
        out: &mut CudaBuffer,
        out_cols: HeadColumns,
    ) -> Result<()> {
        let (rows, cols, heads) = (w.rows, w.stacked.cols, w.heads);
        let last = heads.saturating_sub(1);
        if x.rows != out.rows
            || x_cols.of(last) + cols > x.cols
            || out_cols.of(last) + rows > out.cols
        {
            return Err(Error::Device(format!(
                "matmul_heads: x [{}, {}] at {x_cols:?}, out [{}, {}] at {out_cols:?} for {heads} \
                 heads of [{rows}, {cols}]",
                x.rows, x.cols, out.rows, out.cols
            )));
        }
        if x.rows == 0 || heads == 0 {
            return Ok(());
        }
        let (format, width, row_bytes) = w.stacked.row_kernel_args();
        let ints = [
            int(rows),
            int(cols),
            int(x.cols),
            int(x_cols.first),
            int(x_cols.stride),
            int(x.rows),
            int(out.cols),
            int(out_cols.first),
            int(out_cols.stride),
        ];
        let mut b = self
            .stream()
            .launch_builder(self.f("kiln_head_matmul_bf16")?);
        w.stacked.push_rows(&mut b);
        b.arg(&format).arg(&width).arg(&row_bytes);
        b.arg(&ints[0]).arg(&ints[1]).arg(&x.data);
        for a in &ints[2..6] {
            b.arg(a);
        }
        b.arg(&mut out.data);
        for a in &ints[6..] {
            b.arg(a);
        }
        // SAFETY: as dequant.cu declares: the weights hold heads * rows rows of row_bytes (checked
        // at upload), every head's columns lie inside x and out (checked above); one warp per row.
        unsafe {
            self.launch(
                &mut b,
                cfg(
                    (
                        rows.div_ceil(PACKED_WARPS),
                        x.rows.div_ceil(PACKED_TOKENS),
                        heads,
                    ),
                    32 * PACKED_WARPS,
                    0,
                ),
                "head matmul launch",
            )
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn head_columns_copy(
        &self,
        src: &CudaBuffer,
        src_cols: HeadColumns,
        dst: &mut CudaBuffer,
        dst_cols: HeadColumns,
        width: usize,
        count: usize,
    ) -> Result<()> {
        let last = count.saturating_sub(1);
        if src.rows != dst.rows
            || src_cols.of(last) + width > src.cols
            || dst_cols.of(last) + width > dst.cols
        {
            return Err(Error::Device(format!(
                "copy_head_columns: [{}, {}] at {src_cols:?} to [{}, {}] at {dst_cols:?}, {count} \
                 heads of {width}",
                src.rows, src.cols, dst.rows, dst.cols
            )));
        }
        if src.rows == 0 || width == 0 || count == 0 {
            return Ok(());
        }
        let ints = [
            int(src.cols),
            int(src_cols.first),
            int(src_cols.stride),
            int(dst.cols),
            int(dst_cols.first),
            int(dst_cols.stride),
            int(width),
        ];
        let mut b = self
            .stream()
            .launch_builder(self.f("kiln_copy_head_columns_bf16")?);
        b.arg(&src.data).arg(&ints[0]).arg(&ints[1]).arg(&ints[2]);
        b.arg(&mut dst.data);
        for a in &ints[3..] {
            b.arg(a);
        }
        // SAFETY: as elementwise.cu declares; every head's columns were checked above.
        unsafe {
            self.launch(
                &mut b,
                cfg((src.rows, width.div_ceil(256), count), 256, 0),
                "copy_head_columns launch",
            )
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn mla_attention(
        &self,
        qkv: &CudaBuffer,
        kv: &mut CudaKvStore,
        layer: usize,
        meta: &CudaStepMeta<'_>,
        n_heads: usize,
        width: usize,
        rope: usize,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        if !kv.keys_only || kv.width != width {
            return Err(Error::Device(format!(
                "latent attention: a store of {} rows{}, for cached rows of {width}",
                kv.width,
                if kv.keys_only { "" } else { " of K and V" }
            )));
        }
        let chunk = mla_chunk(n_heads, width, rope)?;
        let latent = width - rope;
        let n = meta.n_tokens;
        if out.rows != n || out.cols != n_heads * latent {
            return Err(Error::Device(format!(
                "latent attention: out [{}, {}] for {n} tokens of {n_heads} heads of {latent}",
                out.rows, out.cols
            )));
        }
        self.store_kv(qkv, kv, layer, meta, n_heads * width)?;
        if n == 0 {
            return Ok(());
        }
        let chunks = n_heads / chunk;
        let splits = self.attention_splits(n, chunks, meta.max_context);
        let plane = kv.plane_len();
        let cache = kv.cache.slice(layer * plane..(layer + 1) * plane);
        let mut guard = self.split_scratch(n * n_heads, splits, latent)?;
        let (part_acc, part_ml) = split_parts(&mut guard)?;
        let scale = 1.0 / (width as f32).sqrt();
        let ints = [
            int(qkv.cols),
            int(meta.max_blocks),
            int(kv.block_size),
            int(n_heads),
            int(chunk),
            int(width),
            int(rope),
            int(splits),
        ];
        let mut b = self
            .stream()
            .launch_builder(self.f("kiln_mla_attention_bf16")?);
        b.arg(&qkv.data)
            .arg(&ints[0])
            .arg(&cache)
            .arg(&meta.token_seq)
            .arg(&meta.cache_pos)
            .arg(&meta.block_tables);
        for a in &ints[1..7] {
            b.arg(a);
        }
        b.arg(&scale)
            .arg(&meta.tree_base)
            .arg(&meta.tree_rows)
            .arg(&ints[7])
            .arg(&mut out.data)
            .arg(&mut *part_acc)
            .arg(&mut *part_ml);
        // SAFETY: as mla.cu declares: grid (tokens, head chunks, splits), MLA_THREADS threads,
        // the dynamic shared memory for this chunk (under 48 KiB, mla_chunk checked); the store
        // keeps rows of `width` (checked above) and store_kv checked the step's slots.
        unsafe {
            self.launch(
                &mut b,
                cfg(
                    (n, chunks, splits),
                    MLA_THREADS,
                    mla_shared_bytes(chunk, width),
                ),
                "latent attention launch",
            )
        }?;
        if splits > 1 {
            self.combine_splits(part_acc, part_ml, splits, n, n_heads, latent, out)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kimi_k2_s_rows_take_eight_heads_a_block_inside_the_shared_memory() {
        // 64 heads (one GPU) and 8 (tensor parallelism 8) over rows of 64 + 512.
        assert_eq!(mla_chunk(64, 576, 64).expect("covered"), 8);
        assert_eq!(mla_chunk(8, 576, 64).expect("covered"), 8);
        assert!(mla_shared_bytes(8, 576) <= SHARED_LIMIT);
        // DeepSeek-V3 at 128 heads, the tiny test models' narrow rows, an odd head count.
        assert_eq!(mla_chunk(128, 576, 64).expect("covered"), 8);
        assert_eq!(mla_chunk(8, 48, 16).expect("covered"), 8);
        assert_eq!(mla_chunk(6, 576, 64).expect("covered"), 6);
        assert_eq!(mla_chunk(7, 576, 64).expect("covered"), 7);
    }

    #[test]
    fn rows_past_the_kernel_are_refused_by_name() {
        let err = mla_chunk(8, 4096, 64).expect_err("too wide").to_string();
        assert!(err.contains("4096"), "{err}");
        assert!(mla_chunk(8, 64, 64).is_err(), "no latent");
    }
}
