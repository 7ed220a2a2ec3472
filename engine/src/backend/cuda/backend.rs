//! The CUDA backend: the op trait over one GPU. Weights and activations are bf16 on the device
//! (f32 arithmetic inside every kernel, f32 accumulation in cuBLASLt's GEMMs); norm weights and
//! biases stay f32. Weights go up as stored (any GGUF type, f32, f16, bf16) and become bf16 on the
//! device at load (dequant.rs). The KV cache is one device slab: for each layer a K plane and a V plane of
//! `n_blocks * block_size` rows.
//!
//! Every op is enqueued on the GPU's one stream and returns at once; only `to_host` and reading
//! a sampling launch's results wait for the device (uploads wait only for the forward before
//! last, staging.rs). A failed launch or copy is an
//! [`Error::Device`], which the runner treats as the device lost (CUDA errors are sticky).

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, LaunchArgs,
    LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use half::bf16;

use super::experts::{CudaExperts, MoeScratch};
use super::gpu::Gpu;
use super::graphs::{GraphMode, Graphs};
use super::latent::CudaHeadMatrices;
use super::packed_kernel::{KernelOverride, PackedKernel};
use super::sample::{DeviceDraw, Draws};
use super::staging::Staging;
use crate::backend::{
    Backend, ExpertTensors, GraphPhase, HeadColumns, KvLayout, Precision, RopeSpec, RouteSpec,
    SeqSpan, TREE_MAX_POSITIONS,
};
use crate::error::{Error, Result};
use crate::parallel::{Communicator, GroupOptions, ThreadComm};
use crate::sampling::{RowDraw, RowResult};
use crate::weights::{DType, TensorView};

/// The attention kernel's limits (attention.cu): threads per block, keys per tile, and outputs
/// (query heads of one KV head times head_dim) per thread.
const ATTN_THREADS: usize = 128;
const ATTN_TILE: usize = 32;
const ATTN_MAX_OUT: usize = 16;
const ATTN_PAD: usize = 2;
/// Below this many keys per split, splitting a sequence costs more than it spreads.
const ATTN_MIN_SPLIT: usize = 256;
const ATTN_MAX_SPLITS: usize = 32;

/// A failed launch, copy, synchronization or allocation: the device is treated as lost (CUDA
/// errors are sticky), and the server exits for its service manager to restart it.
pub(super) fn dev<E: std::fmt::Debug>(what: &'static str) -> impl FnOnce(E) -> Error {
    move |e| Error::DeviceLost(format!("CUDA {what}: {e:?}"))
}

/// A weight matrix `[rows, cols]`, row-major bf16.
pub struct CudaMatrix {
    pub(super) weights: Weights,
    pub rows: usize,
    pub cols: usize,
}

impl CudaMatrix {
    /// `(format, width, bytes per row)` as dequant.cu's row kernels take them: the packed
    /// layout's own, or format 2 for bf16 rows.
    pub(super) fn row_kernel_args(&self) -> (i32, i32, i64) {
        match &self.weights {
            Weights::Packed { format, .. } => format.kernel_args(self.cols),
            Weights::Bf16(_) => (2, 0, (self.cols * 2) as i64),
        }
    }

    /// Pushes the weights' device address (packed bytes or bf16 values) onto a row kernel's
    /// launch.
    pub(super) fn push_rows<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        match &self.weights {
            Weights::Packed { bytes, .. } => b.arg(bytes),
            Weights::Bf16(data) => b.arg(data),
        };
    }
}

/// A matrix's values on the device.
pub(super) enum Weights {
    /// Row-major bf16: cuBLASLt multiplies it, `embed` reads its rows.
    Bf16(CudaSlice<bf16>),
    /// Row-major packed rows (FP8 blocks as stored, INT4 as Q4 rows: see [`PackedFormat`]),
    /// read by dequant.cu's packed kernels.
    Packed {
        bytes: CudaSlice<u8>,
        format: PackedFormat,
    },
}

/// The stored layouts the packed matmul reads, as its `format` and `width` arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PackedFormat {
    /// GGUF's Q4_0 (Kimi-K2-Thinking's INT4 experts repacked), 18 bytes per 32 values as
    /// stored, laid out on the device a row at a time as its f16 scales (padded to 16 bytes)
    /// then its 16-byte blocks of nibbles: a lane reads a block with one aligned 128-bit load
    /// where Q4_0's 18-byte blocks take 18 byte loads. Same bytes a row where `cols` is a
    /// multiple of 256.
    Q4_0,
    /// DeepSeek-V3's block FP8 as `F8Blocks(width)`, `width` a multiple of 32.
    F8Blocks(usize),
}

impl PackedFormat {
    /// The packed form of `dtype` for rows of `cols` values, where the kernel reads it.
    pub(super) fn of(dtype: DType, cols: usize) -> Option<PackedFormat> {
        if cols == 0 || !cols.is_multiple_of(32) {
            return None;
        }
        match dtype {
            DType::Q4_0 => Some(PackedFormat::Q4_0),
            DType::F8Blocks(w) if (w as usize).is_multiple_of(32) && w > 0 => {
                Some(PackedFormat::F8Blocks(w as usize))
            }
            _ => None,
        }
    }

    /// `(format, width, bytes per row)` as the kernels take them, for the device layout. Q4_0's
    /// `width` is the bytes of a row's scales (the nibbles start there).
    pub(super) fn kernel_args(self, cols: usize) -> (i32, i32, i64) {
        match self {
            PackedFormat::Q4_0 => {
                let scales = q4_scale_bytes(cols);
                (0, scales as i32, (scales + cols / 2) as i64)
            }
            PackedFormat::F8Blocks(w) => (1, w as i32, (cols / w * (4 + w)) as i64),
        }
    }

    /// Bytes of one stored row of `cols` values.
    pub(super) fn stored_row_bytes(self, cols: usize) -> usize {
        match self {
            PackedFormat::Q4_0 => cols / 32 * 18,
            PackedFormat::F8Blocks(w) => cols / w * (4 + w),
        }
    }
}

/// A Q4_0 row's f16 scales on the device, padded so its nibble blocks start 16-byte aligned.
pub fn q4_scale_bytes(cols: usize) -> usize {
    (cols / 32 * 2).next_multiple_of(16)
}

/// Activations `[rows, cols]`, row-major bf16, in an allocation that only grows (the workspace
/// is sized once for the largest step; a larger shape reallocates).
pub struct CudaBuffer {
    pub(super) data: CudaSlice<bf16>,
    pub rows: usize,
    pub cols: usize,
}

impl CudaBuffer {
    /// The device allocation (at least `rows * cols` values).
    pub(super) fn data(&self) -> &CudaSlice<bf16> {
        &self.data
    }
}

/// The paged KV cache: `[layer][K | V][slot][width]` bf16, or `[layer][K][slot][width]` when
/// the values are the keys (`KvLayout::KeysOnly`, MLA's latent cached once).
pub struct CudaKvStore {
    pub(super) cache: CudaSlice<bf16>,
    pub(super) n_layers: usize,
    n_slots: usize,
    pub(super) block_size: usize,
    pub(super) width: usize,
    pub(super) keys_only: bool,
}

impl CudaKvStore {
    pub(super) fn plane_len(&self) -> usize {
        self.n_slots * self.width
    }

    /// Planes per layer: K and V, or K alone.
    pub(super) fn planes(&self) -> usize {
        if self.keys_only { 1 } else { 2 }
    }
}

/// One forward's metadata, uploaded once: per token its RoPE position, its sequence, its place in
/// the cache and its tree row; per sequence its block table (padded to the longest). Slots are
/// worked out on the device from the table and the KV store's own block size (a model's cache and
/// MLA's scratch store may differ), after the host checked every position against its table.
pub struct CudaStepMeta<'a> {
    /// Device addresses in the staging arena: `int*` (`u64*` for tree rows) to the kernels.
    positions: u64,
    pub(super) cache_pos: u64,
    pub(super) token_seq: u64,
    pub(super) block_tables: u64,
    pub(super) tree_base: u64,
    pub(super) tree_rows: u64,
    pub(super) max_blocks: usize,
    pub(super) n_tokens: usize,
    /// The longest context any token of the step attends over (its cache position + 1).
    pub(super) max_context: usize,
    /// Per sequence, the last cache position it writes or reads and its table's length.
    reach: Vec<(usize, usize)>,
    spans: PhantomData<&'a [SeqSpan<'a>]>,
}

impl CudaStepMeta<'_> {
    pub(super) fn check_fits(&self, block_size: usize) -> Result<()> {
        check_fits(&self.reach, block_size)
    }
}

/// Every position of a step lies inside its sequence's block table at `block_size` (`reach`:
/// per sequence, its last cache position and its table's length).
pub fn check_fits(reach: &[(usize, usize)], block_size: usize) -> Result<()> {
    for &(last, blocks) in reach {
        if last / block_size >= blocks {
            return Err(Error::InvalidRequest(format!(
                "cache position {last} is past its block table ({blocks} blocks of {block_size})"
            )));
        }
    }
    Ok(())
}

/// A RoPE spec's inverse frequencies (as bits, the key) and their copy on the device.
type RopeTable = (Vec<u32>, Arc<CudaSlice<f32>>);

/// Device scratch reused across calls: the attention splits' partial results.
pub(super) struct Scratch {
    part_acc: Option<CudaSlice<f32>>,
    part_ml: Option<CudaSlice<f32>>,
    /// A tile of a packed matrix's rows widened to bf16 for cuBLASLt (prefill).
    wide_weights: Option<CudaSlice<bf16>>,
}

/// Tokens above which a packed matrix is widened to bf16 a tile of rows at a time for cuBLASLt:
/// the packed kernels read the weights once per 8 (FMAs) or 32 (tensor cores) tokens, which pays
/// at decode, not at prefill.
const PACKED_KERNEL_MAX_TOKENS: usize = 32;
/// bf16 values of that tile: 32 MiB.
const WIDE_TILE_VALUES: usize = 16 << 20;

pub struct CudaBackend {
    gpu: Gpu,
    blas: CudaBlasLT,
    /// RoPE inverse frequencies on the device, per distinct spec (the model's, a draft head's).
    rope_tables: Mutex<Vec<RopeTable>>,
    scratch: Mutex<Scratch>,
    /// The routed experts' per-step arrays, grown to the largest step (experts.rs).
    pub(super) moe_scratch: Mutex<MoeScratch>,
    /// Per-step uploads (staging.rs).
    staging: Mutex<Staging>,
    /// Decode graphs and whether ops now record or replay one (graphs.rs).
    /// Shared with the group's communicator, which destroys the graphs before it aborts.
    pub(super) graphs: Arc<Mutex<Graphs>>,
    /// Replaying a graph: ops stage their inputs and launch nothing (read on every launch).
    pub(super) replaying: AtomicBool,
    /// A packed-weight kernel forced for every matmul (`kiln gpu-check`'s timings), or the
    /// tensor cores (packed_kernel.rs).
    pub(super) packed_kernel: KernelOverride,
    /// The tensor-parallel group's watch on graph replays (their collectives are the graph's),
    /// once this rank has joined a group over NCCL.
    pub(super) replay_watch: Mutex<Option<super::ReplayWatch>>,
    /// The sampling op's scratch, its results on their way to the host, and the tokens the
    /// next embedding may fill from (sample.rs).
    pub(super) draws: Mutex<Draws>,
}

/// The staging arena's size: a step's metadata, ids and row lists for thousands of tokens; a
/// decode graph's block tables (batch x blocks per context) are sized in before it is captured.
const STAGING_BYTES: usize = 4 << 20;

pub(super) fn cfg(grid: (usize, usize, usize), block: usize, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
        block_dim: (block as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

pub(super) fn int(v: usize) -> i32 {
    v as i32
}

fn to_bf16(values: &[f32]) -> Vec<bf16> {
    values.iter().map(|&v| bf16::from_f32(v)).collect()
}

impl CudaBackend {
    /// `out = x · wᵀ` for a packed `w` and many tokens (prefill): see [`Self::widened_gemm`].
    fn packed_gemm(
        &self,
        x: &CudaBuffer,
        bytes: &CudaSlice<u8>,
        format: PackedFormat,
        rows: usize,
        cols: usize,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let n = x.rows;
        self.widened_gemm(
            &x.data.slice(0..n * cols),
            n,
            &bytes.slice(..),
            format,
            (rows, cols),
            &mut out.data.slice_mut(0..n * rows),
            rows,
        )
    }

    /// `out[t][j] = sum_c w[j][c] * x[t][c]` for `n` rows of `x` (`cols` apart) and a packed `w`
    /// of `shape` (rows, cols), `out`'s rows `ldc` apart: a tile of `w`'s rows at a time is
    /// widened to bf16 on the device, then multiplied by cuBLASLt into its columns of `out`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn widened_gemm(
        &self,
        x: &CudaView<'_, bf16>,
        n: usize,
        bytes: &CudaView<'_, u8>,
        format: PackedFormat,
        shape: (usize, usize),
        out: &mut CudaViewMut<'_, bf16>,
        ldc: usize,
    ) -> Result<()> {
        let (rows, cols) = shape;
        if n == 0 || rows == 0 {
            return Ok(());
        }
        // Whole multiples of 128 rows: each tile's first output column then sits 256 bytes
        // on, the alignment cuBLASLt's heuristic assumes of every pointer (cudarc sets no
        // smaller minimum).
        let tile_rows = (WIDE_TILE_VALUES / cols.max(1) / 128 * 128).clamp(128.min(rows), rows);
        let mut guard = self
            .scratch
            .lock()
            .map_err(|_| Error::Device("the weight tile scratch was poisoned".into()))?;
        if guard
            .wide_weights
            .as_ref()
            .is_none_or(|s| s.len() < tile_rows * cols)
        {
            self.may_allocate("the widened weight tile")?;
            self.forget_graphs()?;
            guard.wide_weights = Some(self.zeros(tile_rows * cols)?);
        }
        let Some(tile) = guard.wide_weights.as_mut() else {
            return Err(Error::Device("weight tile scratch missing".into()));
        };
        let (_, _, row_bytes) = format.kernel_args(cols);
        let row_bytes = row_bytes as usize;
        let mut r0 = 0;
        while r0 < rows {
            let m = tile_rows.min(rows - r0);
            let src = bytes.slice(r0 * row_bytes..(r0 + m) * row_bytes);
            self.widen_packed(&src, format, (m, cols), &mut tile.slice_mut(0..m * cols))?;
            // Out's view from column r0 holds (n - 1) * ldc + m values at stride ldc.
            let mut o = out.slice_mut(r0..(n - 1) * ldc + r0 + m);
            self.view_gemm(x, n, &tile.slice(0..m * cols), (m, cols), &mut o, ldc)?;
            r0 += m;
        }
        Ok(())
    }

    /// `out[t][j] = sum_c w[j][c] * x[t][c]`: cuBLASLt on views, `x`'s `n` rows `cols` apart,
    /// row-major `w` of `shape` (rows, cols), `out`'s rows `ldc` apart.
    pub(super) fn view_gemm(
        &self,
        x: &CudaView<'_, bf16>,
        n: usize,
        w: &CudaView<'_, bf16>,
        shape: (usize, usize),
        out: &mut CudaViewMut<'_, bf16>,
        ldc: usize,
    ) -> Result<()> {
        let (rows, cols) = shape;
        if n == 0 || rows == 0 || self.replaying.load(Ordering::Relaxed) {
            return Ok(());
        }
        if x.len() < n * cols || w.len() < rows * cols || out.len() < (n - 1) * ldc + rows {
            return Err(Error::Device(format!(
                "gemm: views of {}, {} and {} values for {n} rows through [{rows}, {cols}]",
                x.len(),
                w.len(),
                out.len()
            )));
        }
        // Column-major as in `matmul`: out^T [rows, n] = W [rows, cols] read transposed, x^T.
        let c = MatmulConfig {
            transa: true,
            transb: false,
            transc: false,
            m: rows as u64,
            n: n as u64,
            k: cols as u64,
            alpha: 1.0,
            lda: cols as i64,
            ldb: cols as i64,
            beta: 0.0,
            ldc: ldc as i64,
            stride_a: None,
            stride_b: None,
            stride_c: None,
            stride_bias: None,
            batch_size: None,
        };
        // SAFETY: the lengths were checked above against the shapes cuBLASLt reads and writes.
        unsafe { self.blas.matmul(c, w, x, out, None, None) }.map_err(dev("cuBLASLt matmul"))
    }

    /// Opens CUDA device `ordinal`; the error names what is missing (driver, device, NVRTC,
    /// cuBLASLt) or what failed.
    pub fn open(ordinal: usize) -> Result<CudaBackend> {
        let gpu = Gpu::open(ordinal).map_err(|e| {
            Error::Device(format!("--device cuda: {e}; --device cpu runs on the CPU"))
        })?;
        let blas = gpu.blas().map_err(|e| {
            Error::Device(format!("--device cuda: {e}; --device cpu runs on the CPU"))
        })?;
        let staging = Staging::new(&gpu.stream, STAGING_BYTES)?;
        Ok(CudaBackend {
            gpu,
            blas,
            rope_tables: Mutex::new(Vec::new()),
            scratch: Mutex::new(Scratch {
                wide_weights: None,
                part_acc: None,
                part_ml: None,
            }),
            moe_scratch: Mutex::new(MoeScratch::default()),
            staging: Mutex::new(staging),
            graphs: Arc::new(Mutex::new(Graphs::default())),
            replaying: AtomicBool::new(false),
            packed_kernel: KernelOverride::default(),
            replay_watch: Mutex::new(None),
            draws: Mutex::new(Draws::default()),
        })
    }

    /// Forces `kernel` for every matmul over packed weights at decode sizes (`None`: the
    /// tensor cores, FMAs only for expert widths they do not take: packed_kernel.rs), so the
    /// two can be timed and checked side by side. Recorded
    /// graphs hold the kernels they were recorded with: they are dropped.
    pub fn force_packed_kernel(&self, kernel: Option<PackedKernel>) -> Result<()> {
        self.forget_graphs()?;
        self.packed_kernel.set(kernel);
        Ok(())
    }

    /// Enqueues a launch, unless a graph replay is only staging its inputs (the graph holds
    /// the launch).
    ///
    /// # Safety
    /// As `LaunchArgs::launch`: the arguments and configuration match the kernel.
    pub(super) unsafe fn launch(
        &self,
        b: &mut LaunchArgs<'_>,
        c: LaunchConfig,
        what: &'static str,
    ) -> Result<()> {
        if self.replaying.load(Ordering::Relaxed) {
            return Ok(());
        }
        // SAFETY: the caller's.
        unsafe { b.launch(c) }.map(|_| ()).map_err(dev(what))
    }

    /// Whether ops may allocate: never while recording or replaying a graph, whose addresses
    /// are fixed (a warm-up step at the same shape grows every buffer first).
    pub(super) fn may_allocate(&self, what: &str) -> Result<()> {
        match self.graph_mode()? {
            GraphMode::Eager | GraphMode::WarmUp => Ok(()),
            _ => Err(Error::Device(format!(
                "{what} would allocate inside a CUDA graph (its warm-up step did not size it)"
            ))),
        }
    }

    fn staging(&self) -> Result<std::sync::MutexGuard<'_, Staging>> {
        self.staging
            .lock()
            .map_err(|_| Error::Device("the staging arena was poisoned".into()))
    }

    /// Uploads a step's host array through the staging arena; returns its device address,
    /// valid until the next forward begins.
    pub(super) fn stage<T: Copy + DeviceRepr>(&self, values: &[T]) -> Result<u64> {
        let mode = self.graph_mode()?;
        let mut st = self.staging()?;
        // A recording runs nothing, and a replay copies its whole staged range at its end.
        let copy = matches!(mode, GraphMode::Eager | GraphMode::WarmUp);
        match st.push(self.stream(), values, copy)? {
            Some(ptr) => Ok(ptr),
            None if matches!(mode, GraphMode::Eager | GraphMode::WarmUp) => {
                st.spill(self.stream(), values)
            }
            None => Err(Error::Device(format!(
                "a CUDA graph's inputs outgrew the staging arena ({} bytes)",
                st.bump.capacity
            ))),
        }
    }

    /// Turns to the other staging arena (at the start of a forward or a graph, never inside
    /// one), waiting only for the forward before last to finish with it.
    pub(super) fn restart_staging(&self) -> Result<()> {
        let mut st = self.staging()?;
        if st.bump.used > 0 {
            st.restart(self.stream())?;
        }
        Ok(())
    }

    /// A graph replay's inputs, staged since its begin, to the device before its launch.
    pub(super) fn upload_staged(&self) -> Result<()> {
        self.staging()?.upload_staged(self.stream())
    }

    /// Refuses a graph whose staged inputs would not fit the arena recorded graphs point at.
    pub(super) fn check_staging_fits(&self, bytes: usize) -> Result<()> {
        let st = self.staging()?;
        if st.bump.capacity < bytes {
            return Err(Error::Device(format!(
                "a CUDA graph needs {bytes} staging bytes, the arena has {} (record the largest \
                 batch first)",
                st.bump.capacity
            )));
        }
        Ok(())
    }

    /// Grows the staging arena to at least `bytes` (before any graph captures its addresses).
    pub(super) fn reserve_staging(&self, bytes: usize) -> Result<()> {
        let mut st = self.staging()?;
        if st.bump.capacity < bytes {
            self.stream()
                .synchronize()
                .map_err(dev("synchronize before growing the staging arena"))?;
            *st = Staging::new(self.stream(), bytes)?;
        }
        Ok(())
    }

    pub(super) fn stream(&self) -> &Arc<CudaStream> {
        &self.gpu.stream
    }

    pub(super) fn f(&self, name: &str) -> Result<&CudaFunction> {
        self.gpu.f(name).map_err(Error::Device)
    }

    pub(super) fn upload<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        values: &[T],
    ) -> Result<CudaSlice<T>> {
        if values.is_empty() {
            return self.zeros(1);
        }
        self.stream()
            .clone_htod(values)
            .map_err(dev("copy to the device"))
    }

    /// `slot`'s allocation, grown to at least `n` values (zeros) where it is smaller: scratch
    /// that only grows, so steps after the largest allocate nothing.
    pub(super) fn grown<'s, T: DeviceRepr + ValidAsZeroBits>(
        &self,
        slot: &'s mut Option<CudaSlice<T>>,
        n: usize,
        what: &str,
    ) -> Result<&'s mut CudaSlice<T>> {
        if slot.as_ref().is_none_or(|s| s.len() < n) {
            self.may_allocate(what)?;
            self.forget_graphs()?;
            *slot = Some(self.zeros(n)?);
        }
        slot.as_mut()
            .ok_or_else(|| Error::Device(format!("{what} missing")))
    }

    pub(super) fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        // A zero-length allocation is an error to the driver; keep one element.
        self.stream()
            .alloc_zeros(n.max(1))
            .map_err(dev("allocation (out of device memory?)"))
    }

    /// Gives `buf` the shape `[rows, cols]`, reallocating only when it has to grow.
    pub(super) fn shape(&self, buf: &mut CudaBuffer, rows: usize, cols: usize) -> Result<()> {
        if rows * cols > buf.data.len() {
            self.may_allocate("a buffer")?;
            self.forget_graphs()?;
            buf.data = self.zeros(rows * cols)?;
        }
        buf.rows = rows;
        buf.cols = cols;
        Ok(())
    }

    fn rope_table(&self, spec: &RopeSpec) -> Result<Arc<CudaSlice<f32>>> {
        let key: Vec<u32> = spec.inv_freq.iter().map(|v| v.to_bits()).collect();
        let mut tables = self
            .rope_tables
            .lock()
            .map_err(|_| Error::Device("the RoPE table cache was poisoned".into()))?;
        if let Some((_, t)) = tables.iter().find(|(k, _)| *k == key) {
            return Ok(t.clone());
        }
        self.may_allocate("a RoPE table")?;
        let t = Arc::new(self.upload(&spec.inv_freq)?);
        tables.push((key, t.clone()));
        Ok(t)
    }

    /// How many splits the attention over `max_context` keys gets: enough blocks to fill the GPU
    /// twice over when the batch alone does not.
    /// The GPU's peak read bandwidth in bytes per second, where the driver reports it.
    pub fn peak_read_bandwidth(&self) -> Option<f64> {
        self.gpu.peak_read_bandwidth
    }

    pub(super) fn attention_splits(
        &self,
        n_tokens: usize,
        n_kv_heads: usize,
        max_context: usize,
    ) -> usize {
        attention_splits(self.gpu.sm_count, n_tokens, n_kv_heads, max_context)
    }

    /// The scratch for `splits` partial results of `rows` (token, head) rows of `width` values
    /// each, grown to fit (with one split nothing is read from it).
    pub(super) fn split_scratch(
        &self,
        rows: usize,
        splits: usize,
        width: usize,
    ) -> Result<std::sync::MutexGuard<'_, Scratch>> {
        let mut guard = self
            .scratch
            .lock()
            .map_err(|_| Error::Device("the attention scratch was poisoned".into()))?;
        let scratch = &mut *guard;
        let (acc_len, ml_len) = if splits > 1 {
            (rows * splits * width, rows * splits * 2)
        } else {
            (1, 1)
        };
        for (slot, len) in [
            (&mut scratch.part_acc, acc_len),
            (&mut scratch.part_ml, ml_len),
        ] {
            if slot.as_ref().is_none_or(|s| s.len() < len) {
                self.may_allocate("the attention scratch")?;
                self.forget_graphs()?;
                *slot = Some(self.zeros(len)?);
            }
        }
        Ok(guard)
    }

    /// Joins the splits' partial results into `out` (`[n, n_heads * width]`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn combine_splits(
        &self,
        part_acc: &CudaSlice<f32>,
        part_ml: &CudaSlice<f32>,
        splits: usize,
        n: usize,
        n_heads: usize,
        width: usize,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let (splits_i, heads_i, width_i) = (int(splits), int(n_heads), int(width));
        let mut b = self
            .stream()
            .launch_builder(self.f("kiln_attention_combine")?);
        b.arg(part_acc)
            .arg(part_ml)
            .arg(&splits_i)
            .arg(&heads_i)
            .arg(&width_i)
            .arg(&mut out.data);
        // SAFETY: as attention.cu declares: grid (tokens, heads), `width` threads (at most 1024,
        // checked by the callers' shape checks); the parts hold n * n_heads * splits rows.
        unsafe {
            self.launch(
                &mut b,
                cfg((n, n_heads, 1), width, 0),
                "attention combine launch",
            )
        }
    }
}

/// The split scratch's two parts, `(part_acc, part_ml)`.
pub(super) fn split_parts(
    scratch: &mut Scratch,
) -> Result<(&mut CudaSlice<f32>, &mut CudaSlice<f32>)> {
    let Scratch {
        part_acc, part_ml, ..
    } = scratch;
    match (part_acc.as_mut(), part_ml.as_mut()) {
        (Some(acc), Some(ml)) => Ok((acc, ml)),
        _ => Err(Error::Device("attention scratch missing".into())),
    }
}

/// See [`CudaBackend::attention_splits`]; a free function so it is tested without a GPU.
pub fn attention_splits(
    sm_count: usize,
    n_tokens: usize,
    n_kv_heads: usize,
    max_context: usize,
) -> usize {
    let blocks = n_tokens * n_kv_heads;
    let target = 2 * sm_count;
    if blocks == 0 || blocks >= target || max_context <= ATTN_MIN_SPLIT {
        return 1;
    }
    target
        .div_ceil(blocks)
        .min(max_context.div_ceil(ATTN_MIN_SPLIT))
        .clamp(1, ATTN_MAX_SPLITS)
}

/// The attention kernel's dynamic shared memory for one KV head's group of query heads.
pub fn attention_shared_bytes(group: usize, head_dim: usize) -> usize {
    let q = group * head_dim * 4;
    let tiles = 2 * ATTN_TILE * (head_dim + ATTN_PAD) * 2;
    let scores = group * ATTN_TILE * 4;
    q + tiles + scores + 3 * group * 4
}

/// Checks that the attention kernel covers this head layout, naming what does not fit.
pub fn check_attention_shape(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Result<()> {
    if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
        return Err(Error::Device(format!(
            "attention: {n_heads} query heads are not a multiple of {n_kv_heads} KV heads"
        )));
    }
    let group = n_heads / n_kv_heads;
    if head_dim == 0 || head_dim > 256 || group * head_dim > ATTN_THREADS * ATTN_MAX_OUT {
        return Err(Error::Device(format!(
            "attention: head size {head_dim} with {group} query heads per KV head is outside \
             what the CUDA kernel covers (head size up to 256, group x head size up to {})",
            ATTN_THREADS * ATTN_MAX_OUT
        )));
    }
    Ok(())
}

/// A step's metadata on the host, flattened as the kernels read it.
#[derive(Debug, PartialEq, Eq)]
pub struct HostStepMeta {
    /// RoPE positions, as given.
    pub positions: Vec<i32>,
    /// Where each token's K and V go and up to where it attends: its span's `start_pos` plus
    /// its index in the span (a tree node's RoPE position is its depth, its cache place is not).
    pub cache_pos: Vec<i32>,
    pub token_seq: Vec<i32>,
    pub block_tables: Vec<i32>,
    pub max_blocks: usize,
    pub tree_base: Vec<i32>,
    pub tree_rows: Vec<u64>,
    pub max_context: usize,
    /// Per sequence: the last cache position the step touches and the table's length in blocks.
    pub reach: Vec<(usize, usize)>,
}

/// Flattens positions and spans: each token's cache position, sequence and tree row; every block
/// table padded to the longest (with -1).
pub fn host_step_meta(positions: &[usize], spans: &[SeqSpan<'_>]) -> Result<HostStepMeta> {
    let n = positions.len();
    let max_blocks = spans
        .iter()
        .map(|s| s.block_table.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let mut m = HostStepMeta {
        positions: positions.iter().map(|&p| int(p)).collect(),
        // -1: a token in no span (none in a well-formed step) neither writes nor attends.
        cache_pos: vec![-1; n],
        token_seq: vec![0; n],
        block_tables: vec![-1; spans.len().max(1) * max_blocks],
        max_blocks,
        tree_base: vec![i32::MAX; n],
        tree_rows: vec![0; n],
        max_context: 0,
        reach: Vec::with_capacity(spans.len()),
    };
    for (si, span) in spans.iter().enumerate() {
        if span.first_token + span.n_tokens > n {
            return Err(Error::InvalidRequest(format!(
                "a span of tokens {}..{} in a step of {n}",
                span.first_token,
                span.first_token + span.n_tokens
            )));
        }
        for (b, &block) in span.block_table.iter().enumerate() {
            m.block_tables[si * max_blocks + b] = block as i32;
        }
        for i in 0..span.n_tokens {
            let t = span.first_token + i;
            let pos = span.start_pos + i;
            m.cache_pos[t] = int(pos);
            m.token_seq[t] = si as i32;
            if let Some(tree) = &span.tree {
                if pos < tree.base || pos - tree.base >= TREE_MAX_POSITIONS {
                    return Err(Error::InvalidRequest(format!(
                        "tree token at cache position {pos} is outside its mask (base {})",
                        tree.base
                    )));
                }
                m.tree_base[t] = int(tree.base);
                m.tree_rows[t] = *tree.rows.get(i).ok_or_else(|| {
                    Error::InvalidRequest("a tree mask without a row per token".into())
                })?;
            }
        }
        if span.n_tokens > 0 {
            let last = span.start_pos + span.n_tokens - 1;
            m.max_context = m.max_context.max(last + 1);
            m.reach.push((last, span.block_table.len()));
        }
    }
    Ok(m)
}

impl Backend for CudaBackend {
    type Matrix = CudaMatrix;
    type Vector = CudaSlice<f32>;
    type HeadMatrices = CudaHeadMatrices;
    type Experts = CudaExperts;
    type Buffer = CudaBuffer;
    type KvStore = CudaKvStore;
    type Drawn = DeviceDraw;
    type StepMeta<'a> = CudaStepMeta<'a>;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn memory(&self) -> Option<crate::runner::memory::DeviceMemory> {
        let (free, total) = self.gpu.ctx.mem_get_info().ok()?;
        Some(crate::runner::memory::DeviceMemory { free, total })
    }

    fn describe(&self) -> String {
        let (major, minor) = self.gpu.compute_capability;
        format!("cuda ({}, sm_{major}{minor}, bf16)", self.gpu.name)
    }

    fn matrix(&self, parts: &[TensorView], precision: Precision) -> Result<CudaMatrix> {
        // Packed INT4 and FP8 stay as stored when every part shares one such layout.
        if let Some(first) = parts.first()
            && let Some(format) = PackedFormat::of(first.dtype, first.matrix_shape()?.1)
            && parts.iter().all(|p| p.dtype == first.dtype)
        {
            return self.packed_matrix(parts, format);
        }
        self.embedding(parts, precision)
    }

    fn embedding(&self, parts: &[TensorView], _precision: Precision) -> Result<CudaMatrix> {
        // bf16 whatever the precision: the device loader refuses exact mode before any weight.
        let mut cols = None;
        let mut rows = 0;
        for p in parts {
            let (r, c) = p.matrix_shape()?;
            if *cols.get_or_insert(c) != c {
                return Err(Error::tensor(
                    &p.path,
                    &p.name,
                    format!("{c} columns, stacked with a matrix of {cols:?}"),
                ));
            }
            rows += r;
        }
        let cols = cols.unwrap_or(0);
        let mut data = self.zeros::<bf16>(rows * cols)?;
        // Each part's stored bytes go up as they are and become bf16 rows on the device.
        let mut at = 0;
        for p in parts {
            let n = p.n_elements();
            self.dequantize_into(p, &mut data.slice_mut(at..at + n))?;
            // Uploaded: the host's file pages of this weight need not stay resident.
            p.release_pages();
            at += n;
        }
        Ok(CudaMatrix {
            weights: Weights::Bf16(data),
            rows,
            cols,
        })
    }

    fn head_matrices(
        &self,
        heads: &[TensorView],
        precision: Precision,
    ) -> Result<CudaHeadMatrices> {
        self.stack_heads(heads, precision)
    }

    fn experts(
        &self,
        held: Vec<Option<ExpertTensors>>,
        precision: Precision,
    ) -> Result<CudaExperts> {
        self.load_experts(held, precision)
    }

    fn vector(&self, v: &TensorView) -> Result<CudaSlice<f32>> {
        self.upload(&v.to_f32())
    }

    fn vector_from_host(&self, values: &[f32]) -> Result<CudaSlice<f32>> {
        self.upload(values)
    }

    fn buffer(&self, n_rows: usize, width: usize) -> Result<CudaBuffer> {
        self.may_allocate("a new buffer")?;
        Ok(CudaBuffer {
            data: self.zeros(n_rows * width)?,
            rows: n_rows,
            cols: width,
        })
    }

    fn reshape(&self, buf: &mut CudaBuffer, n_rows: usize, width: usize) -> Result<()> {
        self.shape(buf, n_rows, width)
    }

    fn kv_store(
        &self,
        n_layers: usize,
        n_blocks: usize,
        block_size: usize,
        kv_width: usize,
        layout: KvLayout,
        _precision: Precision,
    ) -> Result<CudaKvStore> {
        if block_size == 0 {
            return Err(Error::Device("a KV block of 0 tokens".into()));
        }
        let n_slots = n_blocks * block_size;
        let planes = layout.rows_per_position();
        let cache = self
            .zeros(n_layers * planes * n_slots * kv_width)
            .map_err(|e| {
                Error::Device(format!(
                    "the KV cache ({n_slots} tokens, {} MiB) does not fit on the GPU: {e}; lower \
                 --kv-tokens or --mem-fraction-static",
                    (n_layers * planes * n_slots * kv_width * 2) >> 20
                ))
            })?;
        Ok(CudaKvStore {
            cache,
            n_layers,
            n_slots,
            block_size,
            width: kv_width,
            keys_only: layout == KvLayout::KeysOnly,
        })
    }

    fn begin_forward(&self) -> Result<()> {
        // Inside a graph phase its begin did this (a capture must not synchronize).
        match self.graph_mode()? {
            GraphMode::Eager => self.restart_staging(),
            _ => Ok(()),
        }
    }

    fn step_meta<'a>(
        &self,
        positions: &'a [usize],
        spans: &'a [SeqSpan<'a>],
    ) -> Result<CudaStepMeta<'a>> {
        let m = host_step_meta(positions, spans)?;
        // Staged after whatever this forward staged before (MLA makes metadata per layer):
        // the arena restarts only at a forward's beginning.
        let max_context = match self.graph_mode()? {
            GraphMode::Eager => m.max_context,
            _ => self.graph_context_bound()?.max(m.max_context),
        };
        Ok(CudaStepMeta {
            positions: self.stage(&m.positions)?,
            cache_pos: self.stage(&m.cache_pos)?,
            token_seq: self.stage(&m.token_seq)?,
            block_tables: self.stage(&m.block_tables)?,
            tree_base: self.stage(&m.tree_base)?,
            tree_rows: self.stage(&m.tree_rows)?,
            max_blocks: m.max_blocks,
            n_tokens: positions.len(),
            max_context,
            reach: m.reach,
            spans: PhantomData,
        })
    }

    fn embed(
        &self,
        table: &CudaMatrix,
        ids: &[u32],
        fill: Option<&[i32]>,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.rows) {
            return Err(Error::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary (size {})",
                table.rows
            )));
        }
        self.shape(out, ids.len(), table.cols)?;
        if ids.is_empty() {
            return Ok(());
        }
        let ids_d = self.stage(ids)?;
        // A graph always reads a fill array (all -1 without one), so a replay that fills
        // stages where the recording did.
        let fill_d = match (fill, self.graph_mode()?) {
            (Some(f), _) if f.len() != ids.len() => {
                return Err(Error::Device(format!(
                    "{} fill entries for {} tokens",
                    f.len(),
                    ids.len()
                )));
            }
            (Some(f), _) => self.stage(f)?,
            (None, GraphMode::Eager) => 0u64,
            (None, _) => self.stage(&vec![-1i32; ids.len()])?,
        };
        let drawn_d = self.drawn_tokens(fill)?;
        let Weights::Bf16(data) = &table.weights else {
            return Err(Error::Device(
                "embed: the table is packed; embedding tables load through `embedding` as bf16"
                    .into(),
            ));
        };
        let (vocab, width) = (int(table.rows), int(table.cols));
        let mut b = self.stream().launch_builder(self.f("kiln_embed_bf16")?);
        b.arg(data)
            .arg(&ids_d)
            .arg(&mut out.data)
            .arg(&vocab)
            .arg(&width)
            .arg(&fill_d)
            .arg(&drawn_d);
        // SAFETY: as mlp.cu declares: grid = tokens, `out` holds tokens * width values.
        unsafe { self.launch(&mut b, cfg((ids.len(), 1, 1), 256, 0), "embed launch") }?;
        Ok(())
    }

    fn matmul(&self, x: &CudaBuffer, w: &CudaMatrix, out: &mut CudaBuffer) -> Result<()> {
        if x.cols != w.cols {
            return Err(Error::Device(format!(
                "matmul: input width {} against a matrix of {} columns",
                x.cols, w.cols
            )));
        }
        self.shape(out, x.rows, w.rows)?;
        if x.rows == 0 || w.rows == 0 {
            return Ok(());
        }
        let data = match &w.weights {
            Weights::Bf16(data) => data,
            Weights::Packed { bytes, format } if x.rows <= PACKED_KERNEL_MAX_TOKENS => {
                return self.packed_matmul(x, bytes, *format, w.rows, w.cols, out);
            }
            Weights::Packed { bytes, format } => {
                return self.packed_gemm(x, bytes, *format, w.rows, w.cols, out);
            }
        };
        // Column-major view: out^T [w.rows, x.rows] = W [w.rows, cols] (row-major W read as
        // transposed column-major) times x^T [cols, x.rows].
        let c = MatmulConfig {
            transa: true,
            transb: false,
            transc: false,
            m: w.rows as u64,
            n: x.rows as u64,
            k: w.cols as u64,
            alpha: 1.0,
            lda: w.cols as i64,
            ldb: x.cols as i64,
            beta: 0.0,
            ldc: w.rows as i64,
            stride_a: None,
            stride_b: None,
            stride_c: None,
            stride_bias: None,
            batch_size: None,
        };
        if self.replaying.load(Ordering::Relaxed) {
            return Ok(());
        }
        // SAFETY: the shapes above match the allocations: W holds rows * cols, x at least
        // x.rows * cols, out at least x.rows * w.rows values.
        unsafe {
            self.blas
                .matmul(c, data, &x.data, &mut out.data, None, None)
        }
        .map_err(dev("cuBLASLt matmul"))
    }

    fn add_bias(&self, x: &mut CudaBuffer, bias: &CudaSlice<f32>, col_offset: usize) -> Result<()> {
        let width = bias.len();
        if x.rows == 0 {
            return Ok(());
        }
        let (stride, off, w) = (int(x.cols), int(col_offset), int(width));
        let mut b = self.stream().launch_builder(self.f("kiln_add_bias_bf16")?);
        b.arg(&mut x.data).arg(&stride).arg(&off).arg(bias).arg(&w);
        // SAFETY: as elementwise.cu declares; col_offset + width <= cols (the model's layout).
        unsafe {
            self.launch(
                &mut b,
                cfg((x.rows, width.div_ceil(256), 1), 256, 0),
                "add_bias launch",
            )
        }?;
        Ok(())
    }

    fn rms_norm(
        &self,
        x: &CudaBuffer,
        w: &CudaSlice<f32>,
        eps: f32,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        self.shape(out, x.rows, x.cols)?;
        if x.rows == 0 {
            return Ok(());
        }
        let (width, null) = (int(x.cols), 0u64);
        let mut b = self
            .stream()
            .launch_builder(self.f("kiln_add_rms_norm_bf16")?);
        // No delta: the kernel reads `x` only.
        b.arg(&x.data)
            .arg(&null)
            .arg(w)
            .arg(&mut out.data)
            .arg(&width)
            .arg(&eps);
        // SAFETY: as norm.cu declares: one block per row, a multiple of 32 threads.
        unsafe { self.launch(&mut b, cfg((x.rows, 1, 1), 256, 0), "rms_norm launch") }?;
        Ok(())
    }

    fn head_rms_norm(
        &self,
        x: &mut CudaBuffer,
        w: &CudaSlice<f32>,
        eps: f32,
        col_offset: usize,
        n_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        if x.rows == 0 || n_heads == 0 {
            return Ok(());
        }
        let (stride, off, hd) = (int(x.cols), int(col_offset), int(head_dim));
        let mut b = self
            .stream()
            .launch_builder(self.f("kiln_head_rms_norm_bf16")?);
        b.arg(&mut x.data)
            .arg(&stride)
            .arg(&off)
            .arg(&hd)
            .arg(w)
            .arg(&eps);
        // SAFETY: as norm.cu declares: grid (rows, heads), one warp per head.
        unsafe {
            self.launch(
                &mut b,
                cfg((x.rows, n_heads, 1), 32, 0),
                "head_rms_norm launch",
            )
        }?;
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CudaBuffer,
        col_offset: usize,
        n_heads: usize,
        meta: &CudaStepMeta<'_>,
        spec: &RopeSpec,
    ) -> Result<()> {
        if x.rows == 0 || n_heads == 0 || spec.rope_dim < 2 {
            return Ok(());
        }
        let table = self.rope_table(spec)?;
        let ints = [
            int(x.cols),
            int(col_offset),
            int(spec.head_dim),
            int(spec.rope_dim),
            i32::from(spec.interleaved),
        ];
        let mut b = self.stream().launch_builder(self.f("kiln_rope_bf16")?);
        b.arg(&mut x.data).arg(&meta.positions).arg(&*table);
        for v in &ints {
            b.arg(v);
        }
        b.arg(&spec.position_scale).arg(&spec.attention_factor);
        // SAFETY: as rope.cu declares: grid (rows, heads), one thread per rotated pair.
        unsafe {
            self.launch(
                &mut b,
                cfg((x.rows, n_heads, 1), spec.rope_dim / 2, 0),
                "rope launch",
            )
        }?;
        Ok(())
    }

    fn attention(
        &self,
        qkv: &CudaBuffer,
        kv: &mut CudaKvStore,
        layer: usize,
        meta: &CudaStepMeta<'_>,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        check_attention_shape(n_heads, n_kv_heads, head_dim)?;
        let q_width = n_heads * head_dim;
        if kv.width != n_kv_heads * head_dim {
            return Err(Error::Device(format!(
                "attention: KV rows of {} values for {n_kv_heads} heads of {head_dim}",
                kv.width
            )));
        }
        self.store_kv(qkv, kv, layer, meta, q_width)?;
        let n = meta.n_tokens;
        self.shape(out, n, q_width)?;
        if n == 0 {
            return Ok(());
        }
        let group = n_heads / n_kv_heads;
        let splits = self.attention_splits(n, n_kv_heads, meta.max_context);
        let (plane, planes) = (kv.plane_len(), kv.planes());
        let k_plane = kv
            .cache
            .slice(planes * layer * plane..(planes * layer + 1) * plane);
        // Keys only: the values are read from the K plane.
        let v_first = (planes * layer + planes - 1) * plane;
        let v_plane = kv.cache.slice(v_first..v_first + plane);
        let mut guard = self.split_scratch(n * n_heads, splits, head_dim)?;
        let (part_acc, part_ml) = split_parts(&mut guard)?;
        let block_size = int(kv.block_size);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let args = [
            int(meta.max_blocks),
            block_size,
            int(n_heads),
            int(n_kv_heads),
            int(head_dim),
        ];
        let (splits_i, stride) = (int(splits), int(qkv.cols));
        let mut b = self
            .stream()
            .launch_builder(self.f("kiln_paged_attention_bf16")?);
        b.arg(&qkv.data)
            .arg(&stride)
            .arg(&k_plane)
            .arg(&v_plane)
            .arg(&meta.token_seq)
            .arg(&meta.cache_pos)
            .arg(&meta.block_tables);
        for a in &args {
            b.arg(a);
        }
        b.arg(&scale)
            .arg(&meta.tree_base)
            .arg(&meta.tree_rows)
            .arg(&splits_i)
            .arg(&mut out.data)
            .arg(&mut *part_acc)
            .arg(&mut *part_ml);
        let shared = attention_shared_bytes(group, head_dim);
        // SAFETY: as attention.cu declares: grid (tokens, KV heads, splits), 128 threads, the
        // dynamic shared memory sized for this group; check_attention_shape bounds it (< 48 KiB).
        unsafe {
            self.launch(
                &mut b,
                cfg((n, n_kv_heads, splits), ATTN_THREADS, shared),
                "attention launch",
            )
        }?;
        if splits > 1 {
            self.combine_splits(part_acc, part_ml, splits, n, n_heads, head_dim, out)?;
        }
        Ok(())
    }

    fn latent_attention(
        &self,
        qkv: &CudaBuffer,
        kv: &mut CudaKvStore,
        layer: usize,
        meta: &CudaStepMeta<'_>,
        n_heads: usize,
        head_width: usize,
        rope_dim: usize,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        self.mla_attention(qkv, kv, layer, meta, n_heads, head_width, rope_dim, out)
    }

    fn store_kv(
        &self,
        qkv: &CudaBuffer,
        kv: &mut CudaKvStore,
        layer: usize,
        meta: &CudaStepMeta<'_>,
        q_width: usize,
    ) -> Result<()> {
        if meta.n_tokens == 0 {
            return Ok(());
        }
        if layer >= kv.n_layers || q_width + kv.planes() * kv.width > qkv.cols {
            return Err(Error::Device(format!(
                "store_kv: layer {layer} of {}, rows of {} values for q {q_width} and K/V {}",
                kv.n_layers, qkv.cols, kv.width
            )));
        }
        meta.check_fits(kv.block_size)?;
        let (plane, planes) = (kv.plane_len(), kv.planes());
        let mut layer_planes = kv
            .cache
            .slice_mut(planes * layer * plane..(planes * layer + planes) * plane);
        // Keys only: an empty V plane and a V column of -1, which the kernel skips.
        let (mut k_plane, mut v_plane) = layer_planes.split_at_mut(plane);
        let v_col = if kv.keys_only {
            -1
        } else {
            int(q_width + kv.width)
        };
        let ints = [int(qkv.cols), int(q_width), v_col];
        let (max_blocks, block_size, width) =
            (int(meta.max_blocks), int(kv.block_size), int(kv.width));
        let mut b = self.stream().launch_builder(self.f("kiln_kv_write_bf16")?);
        b.arg(&qkv.data);
        for a in &ints {
            b.arg(a);
        }
        b.arg(&meta.token_seq)
            .arg(&meta.cache_pos)
            .arg(&meta.block_tables)
            .arg(&max_blocks)
            .arg(&block_size)
            .arg(&mut k_plane)
            .arg(&mut v_plane)
            .arg(&width);
        // SAFETY: as attention.cu declares: one block per token; check_fits proved every cache
        // position inside its table, whose blocks the scheduler allocated inside this store.
        unsafe {
            self.launch(
                &mut b,
                cfg((meta.n_tokens, 1, 1), 128, 0),
                "kv write launch",
            )
        }?;
        Ok(())
    }

    fn move_kv(
        &self,
        kv: &mut CudaKvStore,
        block_table: &[u32],
        moves: &[(usize, usize)],
    ) -> Result<()> {
        if moves.is_empty() {
            return Ok(());
        }
        let block_size = kv.block_size;
        let slot = |pos: usize| -> Result<i32> {
            let block = block_table.get(pos / block_size).ok_or_else(|| {
                Error::InvalidRequest(format!("move_kv: position {pos} past the block table"))
            })?;
            Ok(int(*block as usize * block_size + pos % block_size))
        };
        let from: Vec<i32> = moves.iter().map(|m| slot(m.0)).collect::<Result<_>>()?;
        let to: Vec<i32> = moves.iter().map(|m| slot(m.1)).collect::<Result<_>>()?;
        let (from_d, to_d) = (self.stage(&from)?, self.stage(&to)?);
        let (plane, width, n) = (kv.plane_len() as i64, int(kv.width), int(moves.len()));
        let n_planes = kv.planes() * kv.n_layers;
        let mut b = self.stream().launch_builder(self.f("kiln_kv_move_bf16")?);
        b.arg(&mut kv.cache)
            .arg(&plane)
            .arg(&width)
            .arg(&from_d)
            .arg(&to_d)
            .arg(&n);
        // SAFETY: as attention.cu declares: one block per plane (1 or 2 per layer).
        unsafe { self.launch(&mut b, cfg((n_planes, 1, 1), 256, 0), "kv move launch") }?;
        Ok(())
    }

    fn silu_mul(&self, gu: &CudaBuffer, out: &mut CudaBuffer) -> Result<()> {
        let h = gu.cols / 2;
        self.shape(out, gu.rows, h)?;
        let total = gu.rows * h;
        if total == 0 {
            return Ok(());
        }
        let (rows, width) = (int(gu.rows), int(h));
        let mut b = self.stream().launch_builder(self.f("kiln_silu_mul_bf16")?);
        b.arg(&gu.data).arg(&mut out.data).arg(&rows).arg(&width);
        // SAFETY: as mlp.cu declares: one thread per output value.
        unsafe {
            self.launch(
                &mut b,
                cfg((total.div_ceil(256), 1, 1), 256, 0),
                "silu_mul launch",
            )
        }?;
        Ok(())
    }

    fn add(&self, x: &mut CudaBuffer, y: &CudaBuffer) -> Result<()> {
        if (x.rows, x.cols) != (y.rows, y.cols) {
            return Err(Error::Device(format!(
                "add: [{}, {}] += [{}, {}]",
                x.rows, x.cols, y.rows, y.cols
            )));
        }
        let n = x.rows * x.cols;
        if n == 0 {
            return Ok(());
        }
        let n_i = n as i64;
        let mut b = self.stream().launch_builder(self.f("kiln_add_bf16")?);
        b.arg(&mut x.data).arg(&y.data).arg(&n_i);
        // SAFETY: as elementwise.cu declares: one thread per value.
        unsafe { self.launch(&mut b, cfg((n.div_ceil(256), 1, 1), 256, 0), "add launch") }?;
        Ok(())
    }

    fn copy_columns(
        &self,
        src: &CudaBuffer,
        src_col: usize,
        dst: &mut CudaBuffer,
        dst_col: usize,
        width: usize,
    ) -> Result<()> {
        if src.rows != dst.rows || src_col + width > src.cols || dst_col + width > dst.cols {
            return Err(Error::Device("copy_columns: shapes do not match".into()));
        }
        if src.rows == 0 || width == 0 {
            return Ok(());
        }
        let ints = [
            int(src.cols),
            int(src_col),
            int(dst.cols),
            int(dst_col),
            int(width),
        ];
        let mut b = self
            .stream()
            .launch_builder(self.f("kiln_copy_columns_bf16")?);
        b.arg(&src.data)
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&mut dst.data)
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(&ints[4]);
        // SAFETY: as elementwise.cu declares; the column ranges were checked above.
        unsafe {
            self.launch(
                &mut b,
                cfg((src.rows, width.div_ceil(256), 1), 256, 0),
                "copy_columns launch",
            )
        }?;
        Ok(())
    }

    fn routed_experts(
        &self,
        spec: &RouteSpec,
        correction_bias: &CudaSlice<f32>,
        h: &CudaBuffer,
        logits: &CudaBuffer,
        experts: &CudaExperts,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        self.experts_forward(spec, correction_bias, h, logits, experts, out)
    }

    fn copy_head_columns(
        &self,
        src: &CudaBuffer,
        src_cols: HeadColumns,
        dst: &mut CudaBuffer,
        dst_cols: HeadColumns,
        width: usize,
        count: usize,
    ) -> Result<()> {
        self.head_columns_copy(src, src_cols, dst, dst_cols, width, count)
    }

    fn matmul_heads(
        &self,
        x: &CudaBuffer,
        x_cols: HeadColumns,
        w: &CudaHeadMatrices,
        out: &mut CudaBuffer,
        out_cols: HeadColumns,
    ) -> Result<()> {
        self.head_matmul(x, x_cols, w, out, out_cols)
    }

    fn scale_columns(
        &self,
        x: &mut CudaBuffer,
        col: usize,
        width: usize,
        factor: f32,
    ) -> Result<()> {
        if x.rows == 0 || width == 0 {
            return Ok(());
        }
        let ints = [int(x.cols), int(col), int(width)];
        let mut b = self
            .stream()
            .launch_builder(self.f("kiln_scale_columns_bf16")?);
        b.arg(&mut x.data)
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&factor);
        // SAFETY: as elementwise.cu declares.
        unsafe {
            self.launch(
                &mut b,
                cfg((x.rows, width.div_ceil(256), 1), 256, 0),
                "scale_columns launch",
            )
        }?;
        Ok(())
    }

    fn scatter_add_rows(
        &self,
        dst: &mut CudaBuffer,
        rows: &[usize],
        src: &CudaBuffer,
        weights: &[f32],
    ) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        if rows.len() != weights.len()
            || src.rows < rows.len()
            || src.cols != dst.cols
            || rows.iter().any(|&r| r >= dst.rows)
        {
            return Err(Error::Device(
                "scatter_add_rows: shapes do not match".into(),
            ));
        }
        let rows_i: Vec<i32> = rows.iter().map(|&r| int(r)).collect();
        let (rows_d, w_d) = (self.stage(&rows_i)?, self.stage(weights)?);
        let (width, n) = (int(dst.cols), int(rows.len()));
        let mut b = self
            .stream()
            .launch_builder(self.f("kiln_scatter_add_rows_bf16")?);
        b.arg(&mut dst.data)
            .arg(&src.data)
            .arg(&width)
            .arg(&rows_d)
            .arg(&w_d)
            .arg(&n);
        // SAFETY: as elementwise.cu declares; rows were checked against dst above.
        unsafe {
            self.launch(
                &mut b,
                cfg((dst.cols.div_ceil(256), 1, 1), 256, 0),
                "scatter_add_rows launch",
            )
        }?;
        Ok(())
    }

    fn gather_rows_into(&self, x: &CudaBuffer, rows: &[usize], out: &mut CudaBuffer) -> Result<()> {
        self.shape(out, rows.len(), x.cols)?;
        if rows.is_empty() || x.cols == 0 {
            return Ok(());
        }
        if let Some(&bad) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(Error::Device(format!(
                "gather_rows: row {bad} of {}",
                x.rows
            )));
        }
        let rows_i: Vec<i32> = rows.iter().map(|&r| int(r)).collect();
        let rows_d = self.stage(&rows_i)?;
        let width = int(x.cols);
        let mut b = self
            .stream()
            .launch_builder(self.f("kiln_gather_rows_bf16")?);
        b.arg(&x.data).arg(&width).arg(&rows_d).arg(&mut out.data);
        // SAFETY: as elementwise.cu declares: one block per gathered row.
        unsafe {
            self.launch(
                &mut b,
                cfg((rows.len(), 1, 1), 256, 0),
                "gather_rows launch",
            )
        }?;
        Ok(())
    }

    fn to_host(&self, x: &CudaBuffer) -> Result<Vec<f32>> {
        let n = x.rows * x.cols;
        if n == 0 {
            return Ok(Vec::new());
        }
        let host = self
            .stream()
            .clone_dtoh(&x.data.slice(0..n))
            .map_err(dev("copy to the host"))?;
        Ok(host.iter().map(|v| v.to_f32()).collect())
    }

    fn sample_launch(&self, logits: &CudaBuffer, draws: &[RowDraw<'_>]) -> Result<DeviceDraw> {
        self.launch_draws(logits, draws)
    }

    fn sample_read(&self, drawn: DeviceDraw) -> Result<Vec<RowResult>> {
        self.read_draws(drawn)
    }

    fn samples_in_place(&self) -> bool {
        true
    }

    fn records_graphs(&self) -> bool {
        true
    }

    fn begin_graph(
        &self,
        bucket: usize,
        phase: GraphPhase,
        context_bound: usize,
        staging_bytes: usize,
    ) -> Result<()> {
        self.graph_begin(bucket, phase, context_bound, staging_bytes)
    }

    fn has_graph(&self, bucket: usize) -> bool {
        self.graph_recorded(bucket)
    }

    fn end_graph(&self) -> Result<()> {
        self.graph_end()
    }

    fn abort_graph(&self) {
        self.graph_abort()
    }

    fn group_communicator(
        &self,
        host: &ThreadComm,
        opts: &GroupOptions,
    ) -> Result<Option<Box<dyn Communicator>>> {
        if host.world() == 1 {
            return Ok(None);
        }
        let report = super::probe().map_err(Error::Device)?;
        if report.nccl_version.is_none() {
            return Err(Error::Device(
                "tensor parallelism over GPUs needs NCCL: libnccl.so.2 is not loadable (put \
                 its folder on LD_LIBRARY_PATH)"
                    .into(),
            ));
        }
        let comm = super::NcclComm::join(&self.gpu, host, opts)?;
        if let Ok(mut w) = self.replay_watch.lock() {
            *w = comm.replay_watch();
        }
        let graphs = self.graphs.clone();
        comm.before_abort(Box::new(move || super::graphs::destroy_all(&graphs)));
        Ok(Some(Box::new(comm)))
    }

    fn all_reduce_sum(&self, x: &mut CudaBuffer, comm: &dyn Communicator) -> Result<()> {
        if comm.world() == 1 {
            return Ok(());
        }
        let n = x.rows * x.cols;
        if let Some(nccl) = comm
            .device()
            .and_then(|d| d.downcast_ref::<super::NcclComm>())
        {
            // A replay's collectives are in its graph (recorded with the rest of the step).
            if self.replaying.load(Ordering::Relaxed) {
                return Ok(nccl.ensure_up()?);
            }
            return Ok(nccl.all_reduce_bf16(&mut x.data, n)?);
        }
        // A host communicator (a group of CPU threads) works through host copies.
        let mut host = self.to_host(x)?;
        comm.all_reduce_sum(&mut host)?;
        let n = host.len();
        self.stream()
            .memcpy_htod(&to_bf16(&host), &mut x.data.slice_mut(0..n))
            .map_err(dev("copy to the device"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_metadata_places_tree_nodes_by_index_and_ropes_them_by_depth() {
        let (a, b) = ([7u32, 3], [9u32, 4, 5]);
        let rows = [0b1u64, 0b11, 0b101];
        // Sequence A decodes at 20; B verifies a 3-node tree after 33 accepted tokens (node 2 is
        // node 0's second child, so its RoPE position equals node 1's).
        let positions = [20usize, 33, 34, 34];
        let spans = [
            SeqSpan {
                first_token: 0,
                n_tokens: 1,
                start_pos: 20,
                block_table: &a,
                tree: None,
            },
            SeqSpan {
                first_token: 1,
                n_tokens: 3,
                start_pos: 33,
                block_table: &b,
                tree: Some(crate::backend::TreeMask {
                    base: 33,
                    rows: &rows,
                }),
            },
        ];
        let m = host_step_meta(&positions, &spans).expect("valid step");
        assert_eq!(m.positions, vec![20, 33, 34, 34]);
        assert_eq!(m.cache_pos, vec![20, 33, 34, 35]);
        assert_eq!(m.token_seq, vec![0, 1, 1, 1]);
        assert_eq!(m.max_blocks, 3);
        assert_eq!(m.block_tables, vec![7, 3, -1, 9, 4, 5]);
        assert_eq!(m.tree_base, vec![i32::MAX, 33, 33, 33]);
        assert_eq!(m.tree_rows, vec![0, 0b1, 0b11, 0b101]);
        assert_eq!(m.max_context, 36);
        assert_eq!(m.reach, vec![(20, 2), (35, 3)]);
    }

    #[test]
    fn positions_past_a_block_table_are_refused_at_the_store_s_block_size() {
        let table = [0u32, 1];
        let spans = [SeqSpan {
            first_token: 0,
            n_tokens: 2,
            start_pos: 30,
            block_table: &table,
            tree: None,
        }];
        let m = host_step_meta(&[30, 31], &spans).expect("flattens");
        assert!(check_fits(&m.reach, 16).is_ok());
        assert!(check_fits(&m.reach, 8).is_err());
        // A tree node outside its 64-position window, and a span past the step's tokens.
        let rows = [1u64];
        let far = [SeqSpan {
            first_token: 0,
            n_tokens: 1,
            start_pos: 100,
            block_table: &table,
            tree: Some(crate::backend::TreeMask {
                base: 30,
                rows: &rows,
            }),
        }];
        assert!(host_step_meta(&[100], &far).is_err());
        assert!(host_step_meta(&[30], &spans).is_err());
    }

    #[test]
    fn q4_rows_keep_kimi_k2_s_stored_size_and_align_every_block() {
        // Kimi-K2's expert widths: the device rows take exactly the stored bytes.
        for cols in [7168usize, 2048] {
            let (_, scales, row_bytes) = PackedFormat::Q4_0.kernel_args(cols);
            assert_eq!(
                row_bytes as usize,
                PackedFormat::Q4_0.stored_row_bytes(cols)
            );
            assert_eq!(scales as usize % 16, 0);
            assert_eq!(row_bytes % 16, 0);
        }
        // A narrow row pads its scales to 16 bytes; its blocks stay aligned.
        let (_, scales, row_bytes) = PackedFormat::Q4_0.kernel_args(96);
        assert_eq!((scales, row_bytes), (16, 64));
    }

    #[test]
    fn splits_fill_the_gpu_only_when_the_batch_does_not() {
        // 132 SMs: a decode of one token over 2 KV heads at 4096 context splits 16 ways
        // (4096 / 256), capped by the 264 blocks wanted.
        assert_eq!(attention_splits(132, 1, 2, 4096), 16);
        assert_eq!(attention_splits(132, 1, 8, 100_000), 32);
        // Short contexts and large batches do not split.
        assert_eq!(attention_splits(132, 1, 8, 200), 1);
        assert_eq!(attention_splits(132, 64, 8, 4096), 1);
        assert_eq!(attention_splits(132, 0, 8, 4096), 1);
    }

    #[test]
    fn the_attention_kernel_s_shared_memory_and_shapes() {
        // Llama-3-8B: 4 query heads per KV head of 128.
        assert_eq!(
            attention_shared_bytes(4, 128),
            4 * 128 * 4 + 2 * 32 * 130 * 2 + 4 * 32 * 4 + 3 * 4 * 4
        );
        for (h, kv, d) in [
            (32, 8, 128),
            (14, 2, 64),
            (9, 3, 64),
            (64, 8, 128),
            (16, 2, 256),
        ] {
            assert!(check_attention_shape(h, kv, d).is_ok(), "{h} {kv} {d}");
            assert!(attention_shared_bytes(h / kv, d) <= 48 * 1024);
        }
        assert!(check_attention_shape(32, 1, 128).is_err());
        assert!(check_attention_shape(8, 3, 64).is_err());
        assert!(check_attention_shape(8, 8, 512).is_err());
    }
}
