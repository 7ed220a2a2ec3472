//! Mixture-of-experts on the GPU with no trip to the host per layer: the router's choice
//! (`kiln_moe_route`), the (token, expert) pairs grouped by expert (`kiln_moe_group`), the grouped
//! expert matmuls over the experts' weights as stored (`kiln_moe_mma_bf16` on the tensor cores,
//! `kiln_moe_matmul_bf16` with FMAs for widths that are no multiple of 32: packed_kernel.rs)
//! and the weighted
//! sum back into each token (`kiln_moe_combine`). The experts this rank holds are stacked into one
//! allocation per projection, so a launch reaches every expert.
//!
//! Decode-sized steps run those kernels alone. Larger steps (prefill) read the per-expert counts
//! back once per layer and multiply each expert's run of tokens with cuBLASLt (packed weights
//! widened a tile at a time), where the tensor cores pay.

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::backend::{CudaBackend, CudaBuffer, CudaMatrix, Weights, cfg, dev, int};
use super::graphs::GraphMode;
use super::packed_kernel::{PackedKernel, mma_splits};
use crate::backend::{Backend, ExpertTensors, Precision, RouteSpec};
use crate::bench::moe_layer::{self, MoeLayerPoint, MoeLayerShape};
use crate::error::{Error, Result};

/// As moe.cu's KILN_MOE_THREADS.
const MOE_THREADS: usize = 256;
/// The routing kernel's fixed arrays (groups, experts per token).
const MAX_GROUPS: usize = 64;
const MAX_TOP_K: usize = 64;
/// Dynamic shared memory a launch may take without opting in to more.
const SHARED_LIMIT: usize = 48 * 1024;
/// `kiln_moe_route`'s static shared arrays, rounded up (ptxas reports 832 bytes).
const ROUTE_STATIC_SHARED: usize = 1024;
/// (token, expert) pairs up to which the grouped kernels run alone (decode up to 128 tokens at 8
/// experts a token); past it, cuBLASLt per expert.
const DEVICE_GROUPED_MAX_PAIRS: usize = 1024;

/// The routed experts one rank holds, global ids `first .. first + n_local`, each projection
/// stacked expert after expert.
pub struct CudaExperts {
    /// `[gate | up]` of each expert: `2 * inter` rows of `hidden`.
    gate_up: Option<CudaMatrix>,
    /// `down` of each expert: `hidden` rows of `inter`.
    down: Option<CudaMatrix>,
    first: usize,
    n_local: usize,
    inter: usize,
    hidden: usize,
}

/// The most tiles (runs of at most `tile_tokens` positions) `pairs` pairs over `n_local`
/// experts can take: a partial run per expert at most, whole runs for the rest.
pub fn max_tiles(pairs: usize, n_local: usize, tile_tokens: usize) -> usize {
    pairs.div_ceil(tile_tokens) + n_local.min(pairs)
}

/// Checks that the device kernels cover a routing shape, naming what they do not.
pub fn check_route(spec: &RouteSpec, n_local: usize) -> Result<()> {
    let e = spec.n_experts;
    let refused = |what: String| Err(Error::Device(format!("MoE on the GPU: {what}")));
    if spec.n_group == 0 || spec.n_group > MAX_GROUPS || !e.is_multiple_of(spec.n_group) {
        return refused(format!(
            "{e} experts in {} groups (at most {MAX_GROUPS} equal groups)",
            spec.n_group
        ));
    }
    if spec.topk_group == 0 || spec.topk_group > spec.n_group {
        return refused(format!(
            "{} of {} groups chosen",
            spec.topk_group, spec.n_group
        ));
    }
    if spec.top_k == 0 || spec.top_k > MAX_TOP_K || spec.top_k > e {
        return refused(format!(
            "{} experts a token of {e} (at most {MAX_TOP_K})",
            spec.top_k
        ));
    }
    // The routing kernel's static arrays take about 1 KiB beside its dynamic 2 * e floats.
    let most = (SHARED_LIMIT - ROUTE_STATIC_SHARED) / 8;
    if e > most || n_local > most {
        return refused(format!("{e} experts (at most {most})"));
    }
    Ok(())
}

impl CudaBackend {
    pub(super) fn load_experts(
        &self,
        held: Vec<Option<ExpertTensors>>,
        precision: Precision,
    ) -> Result<CudaExperts> {
        let first = held.iter().position(Option::is_some).unwrap_or(0);
        let total = held.iter().filter(|e| e.is_some()).count();
        let mine: Vec<ExpertTensors> = held.into_iter().skip(first).map_while(|e| e).collect();
        let n_local = mine.len();
        if n_local != total {
            // Expert parallelism gives each rank one contiguous range; the kernels index it so.
            return Err(Error::Device(format!(
                "MoE on the GPU: this rank holds {total} experts, not one run of them from {first}"
            )));
        }
        let Some(one) = mine.first() else {
            return Ok(CudaExperts {
                gate_up: None,
                down: None,
                first,
                n_local: 0,
                inter: 0,
                hidden: 0,
            });
        };
        let (inter, hidden) = one.gate.matrix_shape()?;
        for t in &mine {
            for (v, want) in [
                (&t.gate, (inter, hidden)),
                (&t.up, (inter, hidden)),
                (&t.down, (hidden, inter)),
            ] {
                if v.matrix_shape()? != want {
                    return Err(Error::tensor(
                        &v.path,
                        &v.name,
                        format!("shape {:?}, stacked with experts of {want:?}", v.shape),
                    ));
                }
            }
        }
        let mut gate_up = Vec::with_capacity(2 * n_local);
        let mut down = Vec::with_capacity(n_local);
        for t in mine {
            gate_up.extend([t.gate, t.up]);
            down.push(t.down);
        }
        Ok(CudaExperts {
            gate_up: Some(self.matrix(&gate_up, precision)?),
            down: Some(self.matrix(&down, precision)?),
            first,
            n_local,
            inter,
            hidden,
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn experts_forward(
        &self,
        spec: &RouteSpec,
        correction_bias: &CudaSlice<f32>,
        h: &CudaBuffer,
        logits: &CudaBuffer,
        experts: &CudaExperts,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let (Some(gate_up), Some(down)) = (&experts.gate_up, &experts.down) else {
            return Ok(());
        };
        let n = h.rows;
        let (e, k, hidden, inter) = (spec.n_experts, spec.top_k, experts.hidden, experts.inter);
        if logits.rows != n
            || logits.cols != e
            || h.cols != hidden
            || out.rows != n
            || out.cols != hidden
            || correction_bias.len() < e
            || experts.first + experts.n_local > e
        {
            return Err(Error::Device(format!(
                "routed experts: h [{n}, {}], logits [{}, {}], out [{}, {}] for {e} experts of \
                 [{inter}, {hidden}]",
                h.cols, logits.rows, logits.cols, out.rows, out.cols
            )));
        }
        check_route(spec, experts.n_local)?;
        if n == 0 {
            return Ok(());
        }
        let pairs = n * k;
        let mut guard = self
            .moe_scratch
            .lock()
            .map_err(|_| Error::Device("the MoE scratch was poisoned".into()))?;
        let MoeScratch {
            ids,
            weights,
            groups,
            gu,
            act,
            y,
            xs,
        } = &mut *guard;
        let (gu, act, y, xs) = (
            self.slot_buffer(gu)?,
            self.slot_buffer(act)?,
            self.slot_buffer(y)?,
            self.slot_buffer(xs)?,
        );
        let ids = self.grown(ids, pairs, "the MoE routing scratch")?;
        let weights = self.grown(weights, pairs, "the MoE routing scratch")?;
        self.route(spec, correction_bias, logits, ids, weights)?;
        // The tensor cores (packed_kernel.rs) where both widths are whole 32-value blocks, FMAs
        // otherwise; the grouping's runs are that kernel's tiles.
        let kernel = match self.packed_kernel.choose() {
            PackedKernel::TensorCores if hidden.is_multiple_of(32) && inter.is_multiple_of(32) => {
                PackedKernel::TensorCores
            }
            _ => PackedKernel::Fma,
        };
        let groups = self.group(groups, ids, pairs, experts, kernel.tile_tokens())?;

        // cuBLASLt's views of an expert's run start 256-byte aligned only where both widths
        // are multiples of 128 (every MoE model's are; tiny test models' need not be).
        let aligned = hidden.is_multiple_of(128) && inter.is_multiple_of(128);
        // A graph's steps cannot wait for the counts: they stay on the grouped kernels.
        let graphed = !matches!(self.graph_mode()?, GraphMode::Eager);
        if pairs <= DEVICE_GROUPED_MAX_PAIRS || !aligned || graphed {
            self.shape(gu, pairs, 2 * inter)?;
            self.grouped_matmul(gate_up, h, k, &groups, pairs, kernel, gu)?;
            self.silu_mul(gu, act)?;
            self.shape(y, pairs, hidden)?;
            self.grouped_matmul(down, act, 0, &groups, pairs, kernel, y)?;
        } else {
            // Only this layer's counts: the slot may be longer (another layer held more experts).
            let offsets = self
                .stream()
                .clone_dtoh(&groups.offsets.slice(..experts.n_local + 1))
                .map_err(dev("copy of the expert counts to the host"))?;
            let held = offsets[experts.n_local].max(0) as usize;
            if held == 0 {
                return Ok(());
            }
            self.shape(xs, held, hidden)?;
            self.gather_pairs(h, groups.pair_of_pos, k, held, xs)?;
            self.shape(gu, held, 2 * inter)?;
            self.per_expert_gemm(gate_up, xs, &offsets, gu)?;
            self.silu_mul(gu, act)?;
            self.shape(y, held, hidden)?;
            self.per_expert_gemm(down, act, &offsets, y)?;
        }
        self.combine_pairs(out, y, groups.pos_of_pair, weights, k)
    }

    /// The buffer in `slot`, made (empty) the first time.
    fn slot_buffer<'s>(&self, slot: &'s mut Option<CudaBuffer>) -> Result<&'s mut CudaBuffer> {
        if slot.is_none() {
            *slot = Some(self.buffer(0, 0)?);
        }
        slot.as_mut()
            .ok_or_else(|| Error::Device("MoE scratch buffer missing".into()))
    }

    /// `ids` and `weights` `[n, top_k]`: each token's experts, best first, and their weights.
    fn route(
        &self,
        spec: &RouteSpec,
        bias: &CudaSlice<f32>,
        logits: &CudaBuffer,
        ids: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let ints = [
            int(spec.n_experts),
            int(spec.n_group),
            int(spec.n_group.min(spec.topk_group)),
            int(spec.top_k),
            int(spec.norm_topk_prob as usize),
        ];
        let mut b = self.stream().launch_builder(self.f("kiln_moe_route")?);
        b.arg(&logits.data).arg(&ints[0]).arg(bias);
        for a in &ints[1..] {
            b.arg(a);
        }
        b.arg(&spec.scaling).arg(ids).arg(weights);
        // SAFETY: as moe.cu declares: one block per token over rows of n_experts logits; the
        // bias holds n_experts values, ids and weights n * top_k; check_route bounded the groups,
        // top_k and the shared memory.
        unsafe {
            self.launch(
                &mut b,
                cfg((logits.rows, 1, 1), MOE_THREADS, 2 * spec.n_experts * 4),
                "MoE routing launch",
            )
        }
    }

    fn group<'s>(
        &self,
        slots: &'s mut GroupSlots,
        ids: &CudaSlice<i32>,
        pairs: usize,
        experts: &CudaExperts,
        tile_tokens: usize,
    ) -> Result<Groups<'s>> {
        let n_local = experts.n_local;
        let tiles_max = max_tiles(pairs, n_local, tile_tokens);
        // Sized for the shorter runs whichever kernel runs, so switching kernels at a shape
        // (`force_packed_kernel`) never grows the array under a recorded graph.
        let tiles_room = max_tiles(pairs, n_local, PackedKernel::Fma.tile_tokens());
        let what = "the MoE grouping scratch";
        let GroupSlots {
            pair_of_pos,
            pos_of_pair,
            offsets,
            tiles,
            n_tiles,
        } = slots;
        let g = Groups {
            pair_of_pos: self.grown(pair_of_pos, pairs, what)?,
            pos_of_pair: self.grown(pos_of_pair, pairs, what)?,
            offsets: self.grown(offsets, n_local + 1, what)?,
            tiles: self.grown(tiles, 3 * tiles_room.max(tiles_max), what)?,
            n_tiles: self.grown(n_tiles, 1, what)?,
            max_tiles: tiles_max,
        };
        let ints = [
            int(pairs),
            int(experts.first),
            int(n_local),
            int(tile_tokens),
            int(tiles_max),
        ];
        let mut b = self.stream().launch_builder(self.f("kiln_moe_group")?);
        b.arg(ids);
        for a in &ints {
            b.arg(a);
        }
        b.arg(&mut *g.pair_of_pos)
            .arg(&mut *g.pos_of_pair)
            .arg(&mut *g.offsets)
            .arg(&mut *g.tiles)
            .arg(&mut *g.n_tiles);
        // SAFETY: as moe.cu declares: one block; ids holds `pairs` values, the outputs their
        // sizes above (tiles for max_tiles, a bound the kernel keeps to); shared 2 * n_local ints.
        unsafe {
            self.launch(
                &mut b,
                cfg((1, 1, 1), MOE_THREADS, 2 * n_local * 4),
                "MoE grouping launch",
            )
        }?;
        Ok(g)
    }

    /// `out[pos] = W_e x[src(pos)]` for every held pair's sorted position (the decode path):
    /// `gather_k` > 0 reads the pair's token row of `x`, 0 reads row `pos`. `kernel` is the one
    /// the grouping's tiles were cut for.
    #[allow(clippy::too_many_arguments)]
    fn grouped_matmul(
        &self,
        w: &CudaMatrix,
        x: &CudaBuffer,
        gather_k: usize,
        groups: &Groups,
        pairs: usize,
        kernel: PackedKernel,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let (rows, cols) = (out.cols, x.cols);
        if w.cols != cols || out.rows < pairs || (gather_k == 0 && x.rows < pairs) {
            return Err(Error::Device(format!(
                "grouped matmul: x [{}, {cols}], out [{}, {rows}] for experts of [{rows}, {}]",
                x.rows, out.rows, w.cols
            )));
        }
        let name = match kernel {
            PackedKernel::Fma => "kiln_moe_matmul_bf16",
            PackedKernel::TensorCores => "kiln_moe_mma_bf16",
        };
        let (format, width, row_bytes) = w.row_kernel_args();
        let (rows_i, cols_i, k_i) = (int(rows), int(cols), int(gather_k));
        let splits = int(mma_splits(cols));
        let mut b = self.stream().launch_builder(self.f(name)?);
        w.push_rows(&mut b);
        b.arg(&format)
            .arg(&width)
            .arg(&row_bytes)
            .arg(&rows_i)
            .arg(&cols_i);
        if kernel == PackedKernel::TensorCores {
            b.arg(&splits);
        }
        b.arg(&x.data)
            .arg(&k_i)
            .arg(&*groups.pair_of_pos)
            .arg(&*groups.tiles)
            .arg(&*groups.n_tiles)
            .arg(&mut out.data);
        // SAFETY: as dequant.cu and packed_mma.cu declare (the same arguments, and the tensor
        // cores' warp split; the tiles were cut for this kernel): the stacked weights hold n_local * rows rows (the tiles name
        // local experts), x's rows are the pairs' tokens or positions, out holds a row of `rows`
        // per position; blocks past n_tiles return at once.
        unsafe {
            self.launch(
                &mut b,
                cfg(
                    (
                        rows.div_ceil(kernel.rows_per_block(cols)),
                        groups.max_tiles,
                        1,
                    ),
                    PackedKernel::THREADS,
                    0,
                ),
                "grouped expert matmul launch",
            )
        }
    }

    fn gather_pairs(
        &self,
        x: &CudaBuffer,
        pair_of_pos: &CudaSlice<i32>,
        k: usize,
        held: usize,
        xs: &mut CudaBuffer,
    ) -> Result<()> {
        let (width, k_i) = (int(x.cols), int(k));
        let mut b = self.stream().launch_builder(self.f("kiln_moe_gather")?);
        b.arg(&x.data)
            .arg(&width)
            .arg(pair_of_pos)
            .arg(&k_i)
            .arg(&mut xs.data);
        // SAFETY: as moe.cu declares: `held` positions, each naming a pair of a token of x; xs
        // holds held rows of x's width.
        unsafe { self.launch(&mut b, cfg((held, 1, 1), 256, 0), "MoE gather launch") }
    }

    /// Each held expert's run of rows of `x` (its positions, `offsets` from the device) through
    /// its matrix into the same rows of `out` (the prefill path).
    fn per_expert_gemm(
        &self,
        w: &CudaMatrix,
        x: &CudaBuffer,
        offsets: &[i32],
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let (rows, cols) = (out.cols, x.cols);
        for (e, run) in offsets.windows(2).enumerate() {
            let (start, end) = (run[0].max(0) as usize, run[1].max(0) as usize);
            if end <= start {
                continue;
            }
            // Slices past an allocation would panic in cudarc: refuse them by name instead.
            if (e + 1) * rows > w.rows || end > x.rows || end > out.rows {
                return Err(Error::Device(format!(
                    "per-expert GEMM: expert {e}'s run {start}..{end} outside [{}, {}] rows of \
                     input and output, {} rows of weights",
                    x.rows, out.rows, w.rows
                )));
            }
            let c = end - start;
            let xv = x.data.slice(start * cols..end * cols);
            let mut ov = out.data.slice_mut(start * rows..end * rows);
            match &w.weights {
                Weights::Bf16(data) => {
                    let wv = data.slice(e * rows * cols..(e + 1) * rows * cols);
                    self.view_gemm(&xv, c, &wv, (rows, cols), &mut ov, rows)?;
                }
                Weights::Packed { bytes, format } => {
                    let (_, _, row_bytes) = format.kernel_args(cols);
                    let per = rows * row_bytes as usize;
                    let wv = bytes.slice(e * per..(e + 1) * per);
                    self.widened_gemm(&xv, c, &wv, *format, (rows, cols), &mut ov, rows)?;
                }
            }
        }
        Ok(())
    }

    fn combine_pairs(
        &self,
        out: &mut CudaBuffer,
        y: &CudaBuffer,
        pos_of_pair: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        k: usize,
    ) -> Result<()> {
        let (width, k_i) = (int(out.cols), int(k));
        let mut b = self.stream().launch_builder(self.f("kiln_moe_combine")?);
        b.arg(&mut out.data)
            .arg(&y.data)
            .arg(&width)
            .arg(pos_of_pair)
            .arg(weights)
            .arg(&k_i);
        // SAFETY: as moe.cu declares: out holds its rows of `width`, pos_of_pair and weights
        // rows * k values, y a row of `width` for every held position (-1 names none).
        unsafe {
            self.launch(
                &mut b,
                cfg((out.rows, out.cols.div_ceil(256), 1), 256, 0),
                "MoE combine launch",
            )
        }
    }
}

/// A step's pairs grouped by expert, on the device (moe.cu's kiln_moe_group), in the scratch.
struct Groups<'s> {
    pair_of_pos: &'s mut CudaSlice<i32>,
    pos_of_pair: &'s mut CudaSlice<i32>,
    offsets: &'s mut CudaSlice<i32>,
    tiles: &'s mut CudaSlice<i32>,
    n_tiles: &'s mut CudaSlice<i32>,
    max_tiles: usize,
}

/// The grouping's arrays, grown to the largest step.
#[derive(Default)]
pub(super) struct GroupSlots {
    pair_of_pos: Option<CudaSlice<i32>>,
    pos_of_pair: Option<CudaSlice<i32>>,
    offsets: Option<CudaSlice<i32>>,
    tiles: Option<CudaSlice<i32>>,
    n_tiles: Option<CudaSlice<i32>>,
}

/// The routed experts' per-step arrays: allocated at the largest step seen, so the steps that
/// follow (and a recorded graph's replays) allocate nothing.
#[derive(Default)]
pub struct MoeScratch {
    ids: Option<CudaSlice<i32>>,
    weights: Option<CudaSlice<f32>>,
    groups: GroupSlots,
    gu: Option<CudaBuffer>,
    act: Option<CudaBuffer>,
    y: Option<CudaBuffer>,
    xs: Option<CudaBuffer>,
}

/// Kimi-K2's routed experts (one layer, 384 INT4 experts, 8 a token) timed on GPU 0 at batch 1
/// to 128 (`kiln gpu-check`) with each expert kernel forced in turn, side by side (whether the
/// tensor cores, the default, beat FMAs at every size: packed_kernel.rs), with the GPU's peak
/// read bandwidth where
/// the driver reports it. Every point runs the grouped kernels: Kimi-K2's widths are multiples
/// of 32 and 128 tokens make 1,024 pairs, the most DEVICE_GROUPED_MAX_PAIRS keeps on them.
pub fn kimi_moe_layer_speed(seed: u64) -> Result<(Vec<MoeLayerPoint>, Option<f64>)> {
    let gpu = CudaBackend::open(0)?;
    let mut points = Vec::new();
    for kernel in [PackedKernel::Fma, PackedKernel::TensorCores] {
        gpu.force_packed_kernel(Some(kernel))?;
        let label = match kernel {
            PackedKernel::Fma => "fma",
            PackedKernel::TensorCores => "tensor cores",
        };
        let shape = MoeLayerShape::KIMI_K2;
        points.extend(moe_layer::measure(
            &gpu,
            shape,
            &[1, 8, 64, 128],
            20,
            seed,
            label,
        )?);
    }
    gpu.force_packed_kernel(None)?;
    Ok((points, gpu.peak_read_bandwidth()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(n_experts: usize, n_group: usize, top_k: usize) -> RouteSpec {
        RouteSpec {
            n_experts,
            n_group,
            topk_group: 1,
            top_k,
            norm_topk_prob: true,
            scaling: 2.827,
        }
    }

    #[test]
    fn kimi_k2_and_deepseek_v3_routing_fit_the_kernels_and_others_are_named() {
        check_route(&spec(384, 1, 8), 384).expect("Kimi-K2 on one GPU");
        check_route(&spec(384, 1, 8), 48).expect("Kimi-K2 at TP 8");
        check_route(&spec(256, 8, 8), 256).expect("DeepSeek-V3");
        let e = check_route(&spec(384, 100, 8), 384).expect_err("groups");
        assert!(e.to_string().contains("100 groups"), "{e}");
        let e = check_route(&spec(8192, 1, 8), 8192).expect_err("experts");
        assert!(e.to_string().contains("8192 experts"), "{e}");
        let e = check_route(&spec(4, 1, 8), 4).expect_err("top_k");
        assert!(e.to_string().contains("8 experts a token of 4"), "{e}");
    }

    #[test]
    fn the_tile_bound_covers_every_spread_of_pairs() {
        // Every way of spreading `pairs` over `experts` takes at most max_tiles runs of either
        // kernel's tile.
        for tile in [PackedKernel::Fma, PackedKernel::TensorCores].map(PackedKernel::tile_tokens) {
            for (pairs, experts) in [(8usize, 384usize), (512, 384), (512, 48), (3, 2), (17, 1)] {
                let worst: usize = (0..experts)
                    .map(|e| pairs / experts + usize::from(e < pairs % experts))
                    .map(|c| c.div_ceil(tile))
                    .sum();
                assert!(
                    worst <= max_tiles(pairs, experts, tile),
                    "{pairs} over {experts}"
                );
                // All on one expert, and all but a few on one.
                assert!(pairs.div_ceil(tile) <= max_tiles(pairs, experts, tile));
            }
        }
    }
}
