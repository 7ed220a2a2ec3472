//! The CPU backend: rayon threads, SIMD kernels picked at run time, f32 activations.

mod attention;
#[cfg(target_arch = "x86_64")]
mod attention_x86;
pub mod blocks;
pub mod exp;
mod graph_emulation;
pub mod matrix;
pub mod simd;
pub mod team;
mod widened;
#[cfg(target_arch = "x86_64")]
mod x86_rows8;

/// A raw output pointer shared by the threads of one op (a matmul, attention); each thread
/// writes disjoint elements.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

pub use attention::CpuKvStore;
pub use matrix::CpuMatrix;
pub use simd::{Kernels, SimdLevel};

use super::routing::HostExperts;
use super::{
    Backend, ExpertTensors, HeadColumns, KvLayout, Precision, RopeSpec, RouteSpec, SeqSpan,
};
use crate::error::{Error, Result};
use crate::sampling::{RowDraw, RowResult, sample_row};
use crate::weights::TensorView;

/// Row-major `[rows, cols]` f32 activations. Reused across steps: `resize` keeps the allocation.
#[derive(Clone, Debug, Default)]
pub struct CpuBuffer {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl CpuBuffer {
    pub fn resize(&mut self, rows: usize, cols: usize) {
        self.rows = rows;
        self.cols = cols;
        self.data.resize(rows * cols, 0.0);
    }
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

pub struct CpuBackend {
    kernels: Kernels,
    team: team::Team,
    /// The latest sampling launch's tokens, for [`Backend::embed`]'s `fill`.
    drawn: std::sync::Mutex<Vec<u32>>,
    /// Graph phases kept as bookkeeping only, for tests (`graph_emulation`).
    graphs: Option<graph_emulation::EmulatedGraphs>,
}

pub use graph_emulation::EMULATE_GRAPHS_ENV;

impl CpuBackend {
    /// The best SIMD level of this CPU, one thread per core.
    pub fn new() -> CpuBackend {
        Self::with_threads(
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
        )
    }
    pub fn with_threads(threads: usize) -> CpuBackend {
        CpuBackend {
            kernels: *Kernels::best(),
            team: team::Team::new(threads),
            drawn: std::sync::Mutex::new(Vec::new()),
            graphs: graph_emulation::EmulatedGraphs::from_env(),
        }
    }
    /// A backend that uses one specific SIMD level (tests compare levels).
    pub fn with_level(level: SimdLevel) -> CpuBackend {
        CpuBackend {
            kernels: Kernels::for_level(level),
            ..Self::new()
        }
    }
    pub fn threads(&self) -> usize {
        self.team.threads()
    }
    pub fn simd_level(&self) -> SimdLevel {
        self.kernels.level
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new()
    }
}

/// The CPU reads a forward's metadata where it already lies: the host slices themselves.
#[derive(Clone, Copy, Debug)]
pub struct CpuStepMeta<'a> {
    pub positions: &'a [usize],
    pub spans: &'a [SeqSpan<'a>],
}

impl Backend for CpuBackend {
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type HeadMatrices = Vec<CpuMatrix>;
    type Experts = HostExperts<CpuBackend>;
    type Buffer = CpuBuffer;
    type KvStore = CpuKvStore;
    type Drawn = Vec<RowResult>;
    type StepMeta<'a> = CpuStepMeta<'a>;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn describe(&self) -> String {
        format!("cpu ({:?}, {} threads)", self.simd_level(), self.threads())
    }

    fn matrix(&self, parts: &[TensorView], precision: Precision) -> Result<CpuMatrix> {
        CpuMatrix::prepare(parts, precision)
    }

    fn draft_matrix(&self, parts: &[TensorView], precision: Precision) -> Result<CpuMatrix> {
        match precision {
            Precision::Fast => CpuMatrix::prepare_compact(parts),
            Precision::Exact => CpuMatrix::prepare(parts, precision),
        }
    }

    fn head_matrices(&self, heads: &[TensorView], precision: Precision) -> Result<Vec<CpuMatrix>> {
        heads
            .iter()
            .map(|h| CpuMatrix::prepare(std::slice::from_ref(h), precision))
            .collect()
    }

    fn experts(
        &self,
        held: Vec<Option<ExpertTensors>>,
        precision: Precision,
    ) -> Result<HostExperts<CpuBackend>> {
        HostExperts::load(self, held, precision)
    }

    fn vector(&self, v: &TensorView) -> Result<Vec<f32>> {
        Ok(v.to_f32())
    }

    fn vector_from_host(&self, values: &[f32]) -> Result<Vec<f32>> {
        Ok(values.to_vec())
    }

    fn buffer(&self, n_rows: usize, width: usize) -> Result<CpuBuffer> {
        Ok(CpuBuffer {
            data: vec![0.0; n_rows * width],
            rows: n_rows,
            cols: width,
        })
    }

    fn reshape(&self, buf: &mut CpuBuffer, n_rows: usize, width: usize) -> Result<()> {
        buf.resize(n_rows, width);
        Ok(())
    }

    fn kv_store(
        &self,
        n_layers: usize,
        n_blocks: usize,
        block_size: usize,
        kv_width: usize,
        layout: KvLayout,
        precision: Precision,
    ) -> Result<CpuKvStore> {
        // f16 cells only where the AVX-512 attention kernel widens them as it loads; elsewhere
        // every task would have to widen its blocks first.
        let half = precision == Precision::Fast && self.kernels.level >= SimdLevel::Avx512Vnni;
        Ok(CpuKvStore::new(
            n_layers, n_blocks, block_size, kv_width, layout, half,
        ))
    }

    fn step_meta<'a>(
        &self,
        positions: &'a [usize],
        spans: &'a [SeqSpan<'a>],
    ) -> Result<CpuStepMeta<'a>> {
        Ok(CpuStepMeta { positions, spans })
    }

    fn embed(
        &self,
        table: &CpuMatrix,
        ids: &[u32],
        fill: Option<&[i32]>,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        let filled;
        let ids = match fill {
            None => ids,
            Some(fill) => {
                let drawn = self
                    .drawn
                    .lock()
                    .map_err(|_| Error::Device("the drawn tokens were poisoned".into()))?;
                filled = crate::backend::fill_ids(ids, fill, &drawn)?;
                &filled
            }
        };
        out.resize(ids.len(), table.cols);
        for (i, &id) in ids.iter().enumerate() {
            if id as usize >= table.rows {
                return Err(Error::InvalidRequest(format!(
                    "token id {id} is outside the vocabulary (size {})",
                    table.rows
                )));
            }
            table.row_f32(
                id as usize,
                &mut out.data[i * table.cols..(i + 1) * table.cols],
            );
        }
        Ok(())
    }

    fn matmul(&self, x: &CpuBuffer, w: &CpuMatrix, out: &mut CpuBuffer) -> Result<()> {
        matrix::matmul(&self.kernels, &self.team, x, w, out);
        Ok(())
    }

    fn add_bias(&self, x: &mut CpuBuffer, bias: &Vec<f32>, col_offset: usize) -> Result<()> {
        let cols = x.cols;
        for row in x.data.chunks_exact_mut(cols) {
            for (v, b) in row[col_offset..col_offset + bias.len()]
                .iter_mut()
                .zip(bias)
            {
                *v += b;
            }
        }
        Ok(())
    }

    fn rms_norm(&self, x: &CpuBuffer, w: &Vec<f32>, eps: f32, out: &mut CpuBuffer) -> Result<()> {
        out.resize(x.rows, x.cols);
        let cols = x.cols;
        self.team
            .for_each_chunk_mut(&mut out.data, cols, 4, &|first, chunk| {
                for (i, or) in chunk.chunks_exact_mut(cols).enumerate() {
                    let r = first + i;
                    rms_norm_into(&x.data[r * cols..(r + 1) * cols], w, eps, or);
                }
            });
        Ok(())
    }

    fn head_rms_norm(
        &self,
        x: &mut CpuBuffer,
        w: &Vec<f32>,
        eps: f32,
        col_offset: usize,
        n_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        let cols = x.cols;
        let mut tmp = vec![0f32; head_dim];
        for row in x.data.chunks_exact_mut(cols) {
            for h in 0..n_heads {
                let head = &mut row[col_offset + h * head_dim..col_offset + (h + 1) * head_dim];
                rms_norm_into(head, w, eps, &mut tmp);
                head.copy_from_slice(&tmp);
            }
        }
        Ok(())
    }

    fn rope(
        &self,
        x: &mut CpuBuffer,
        col_offset: usize,
        n_heads: usize,
        meta: &CpuStepMeta<'_>,
        spec: &RopeSpec,
    ) -> Result<()> {
        let positions = meta.positions;
        let cols = x.cols;
        let half = spec.rope_dim / 2;
        let rotate = |row: &mut [f32], pos: usize| {
            let p = pos as f32 / spec.position_scale;
            let (mut cos, mut sin) = (vec![0f32; half], vec![0f32; half]);
            for i in 0..half {
                let a = p * spec.inv_freq[i];
                cos[i] = a.cos() * spec.attention_factor;
                sin[i] = a.sin() * spec.attention_factor;
            }
            for h in 0..n_heads {
                let head =
                    &mut row[col_offset + h * spec.head_dim..col_offset + (h + 1) * spec.head_dim];
                for i in 0..half {
                    let (a, b) = if spec.interleaved {
                        (2 * i, 2 * i + 1)
                    } else {
                        (i, i + half)
                    };
                    let (x0, x1) = (head[a], head[b]);
                    head[a] = x0 * cos[i] - x1 * sin[i];
                    head[b] = x0 * sin[i] + x1 * cos[i];
                }
            }
        };
        self.team
            .for_each_chunk_mut(&mut x.data, cols, 2, &|first, chunk| {
                for (i, row) in chunk.chunks_exact_mut(cols).enumerate() {
                    rotate(row, positions[first + i]);
                }
            });
        Ok(())
    }

    fn attention(
        &self,
        qkv: &CpuBuffer,
        kv: &mut CpuKvStore,
        layer: usize,
        meta: &CpuStepMeta<'_>,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        attention::attention(
            &self.kernels,
            &self.team,
            qkv,
            kv,
            layer,
            meta.spans,
            n_heads,
            n_kv_heads,
            head_dim,
            out,
        );
        Ok(())
    }

    fn store_kv(
        &self,
        qkv: &CpuBuffer,
        kv: &mut CpuKvStore,
        layer: usize,
        meta: &CpuStepMeta<'_>,
        q_width: usize,
    ) -> Result<()> {
        attention::store_kv(qkv, kv, layer, meta.spans, q_width);
        Ok(())
    }

    fn move_kv(
        &self,
        kv: &mut CpuKvStore,
        block_table: &[u32],
        moves: &[(usize, usize)],
    ) -> Result<()> {
        kv.move_positions(block_table, moves);
        Ok(())
    }

    fn silu_mul(&self, gu: &CpuBuffer, out: &mut CpuBuffer) -> Result<()> {
        let h = gu.cols / 2;
        out.resize(gu.rows, h);
        // Element-wise across the team: even one decode row is 1.5k exponentials per layer.
        // Each chunk walks its rows' segments, so the inner loop is a plain slice loop that
        // vectorizes (with `exp::exp`).
        self.team
            .for_each_chunk_mut(&mut out.data, 1, 1024, &|first, chunk| {
                let mut done = 0;
                while done < chunk.len() {
                    let (r, c) = ((first + done) / h, (first + done) % h);
                    let len = (h - c).min(chunk.len() - done);
                    let row = &gu.data[r * gu.cols..(r + 1) * gu.cols];
                    let (gate, up) = (&row[c..c + len], &row[h + c..h + c + len]);
                    for ((o, &x), &u) in chunk[done..done + len].iter_mut().zip(gate).zip(up) {
                        *o = x / (1.0 + exp::exp(-x)) * u;
                    }
                    done += len;
                }
            });
        Ok(())
    }

    fn add(&self, x: &mut CpuBuffer, y: &CpuBuffer) -> Result<()> {
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
        Ok(())
    }

    fn copy_columns(
        &self,
        src: &CpuBuffer,
        src_col: usize,
        dst: &mut CpuBuffer,
        dst_col: usize,
        width: usize,
    ) -> Result<()> {
        debug_assert_eq!(src.rows, dst.rows);
        let (sc, dc) = (src.cols, dst.cols);
        for (s, d) in src.data.chunks_exact(sc).zip(dst.data.chunks_exact_mut(dc)) {
            d[dst_col..dst_col + width].copy_from_slice(&s[src_col..src_col + width]);
        }
        Ok(())
    }

    fn routed_experts(
        &self,
        spec: &RouteSpec,
        correction_bias: &Vec<f32>,
        h: &CpuBuffer,
        logits: &CpuBuffer,
        experts: &HostExperts<CpuBackend>,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        experts.forward(self, spec, correction_bias, h, logits, out)
    }

    fn matmul_heads(
        &self,
        x: &CpuBuffer,
        x_cols: HeadColumns,
        w: &Vec<CpuMatrix>,
        out: &mut CpuBuffer,
        out_cols: HeadColumns,
    ) -> Result<()> {
        // Head by head through the ordinary matmul: the host gains nothing from one pass.
        let (mut head_x, mut head_y) = (self.buffer(0, 0)?, self.buffer(0, 0)?);
        for (i, m) in w.iter().enumerate() {
            head_x.resize(x.rows, m.cols);
            self.copy_columns(x, x_cols.of(i), &mut head_x, 0, m.cols)?;
            self.matmul(&head_x, m, &mut head_y)?;
            self.copy_columns(&head_y, 0, out, out_cols.of(i), m.rows)?;
        }
        Ok(())
    }

    fn scale_columns(
        &self,
        x: &mut CpuBuffer,
        col: usize,
        width: usize,
        factor: f32,
    ) -> Result<()> {
        let cols = x.cols;
        for row in x.data.chunks_exact_mut(cols) {
            for v in &mut row[col..col + width] {
                *v *= factor;
            }
        }
        Ok(())
    }

    fn scatter_add_rows(
        &self,
        dst: &mut CpuBuffer,
        rows: &[usize],
        src: &CpuBuffer,
        weights: &[f32],
    ) -> Result<()> {
        let cols = dst.cols;
        for ((&r, w), s) in rows
            .iter()
            .zip(weights)
            .zip(src.data.chunks_exact(src.cols))
        {
            for (d, v) in dst.data[r * cols..(r + 1) * cols].iter_mut().zip(s) {
                *d += w * v;
            }
        }
        Ok(())
    }

    fn gather_rows_into(&self, x: &CpuBuffer, rows: &[usize], out: &mut CpuBuffer) -> Result<()> {
        if let Some(&bad) = rows.iter().find(|&&r| r >= x.rows) {
            return Err(Error::InvalidRequest(format!(
                "gather_rows: row {bad} of {}",
                x.rows
            )));
        }
        out.resize(rows.len(), x.cols);
        for (i, &r) in rows.iter().enumerate() {
            out.data[i * x.cols..(i + 1) * x.cols].copy_from_slice(x.row(r));
        }
        Ok(())
    }

    fn to_host(&self, x: &CpuBuffer) -> Result<Vec<f32>> {
        Ok(x.data.clone())
    }

    /// The host draws at once: the results are ready when this returns.
    fn sample_launch(&self, logits: &CpuBuffer, draws: &[RowDraw<'_>]) -> Result<Vec<RowResult>> {
        if draws.len() > logits.rows || (logits.cols == 0 && !draws.is_empty()) {
            return Err(Error::InvalidRequest(format!(
                "{} draws for {} logits rows",
                draws.len(),
                logits.rows
            )));
        }
        let results: Vec<RowResult> = draws
            .iter()
            .zip(logits.data.chunks_exact(logits.cols.max(1)))
            .map(|(d, row)| sample_row(&mut row.to_vec(), d))
            .collect();
        let mut drawn = self
            .drawn
            .lock()
            .map_err(|_| Error::Device("the drawn tokens were poisoned".into()))?;
        drawn.clear();
        drawn.extend(results.iter().map(|r| r.sampled.token));
        Ok(results)
    }

    fn sample_read(&self, drawn: Vec<RowResult>) -> Result<Vec<RowResult>> {
        Ok(drawn)
    }

    fn records_graphs(&self) -> bool {
        self.graphs.is_some()
    }

    fn begin_graph(
        &self,
        bucket: usize,
        phase: crate::backend::GraphPhase,
        _context_bound: usize,
        _staging_bytes: usize,
    ) -> Result<()> {
        match &self.graphs {
            Some(g) => g.begin(bucket, phase),
            None => Err(crate::Error::Device(
                "the cpu backend records no graphs".into(),
            )),
        }
    }

    fn end_graph(&self) -> Result<()> {
        match &self.graphs {
            Some(g) => g.end(),
            None => Err(crate::Error::Device(
                "the cpu backend records no graphs".into(),
            )),
        }
    }

    fn abort_graph(&self) {
        if let Some(g) = &self.graphs {
            g.abort();
        }
    }

    fn has_graph(&self, bucket: usize) -> bool {
        self.graphs.as_ref().is_some_and(|g| g.has(bucket))
    }

    fn all_reduce_sum(
        &self,
        x: &mut CpuBuffer,
        comm: &dyn crate::parallel::Communicator,
    ) -> Result<()> {
        Ok(comm.all_reduce_sum(&mut x.data)?)
    }
}

/// `out = x / sqrt(mean(x^2) + eps) * w`, as Hugging Face's LlamaRMSNorm computes it in f32.
fn rms_norm_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ss + eps).sqrt();
    for ((o, v), wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (v * inv);
    }
}
