//! One mixture-of-experts layer's routed experts timed on a backend, beside the bytes of weights
//! each step must read: `kiln gpu-check` runs it at Kimi-K2's size (384 INT4 experts of
//! 7168 x 2048, 8 chosen per token) at batch 1, 8, 64 and 128, once per expert kernel, the memory
//! roofline being those bytes over
//! the GPU's read bandwidth. The experts' INT4 weights are Q4_0 blocks, the layout Kimi-K2's
//! compressed-tensors experts are repacked to at load (18 bytes per 32 weights).

use std::time::Instant;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::backend::routing::route;
use crate::backend::{Backend, ExpertTensors, Precision, RouteSpec};
use crate::error::Result;
use crate::weights::{DType, TensorView};

/// A MoE layer's shape.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct MoeLayerShape {
    pub n_experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub inter: usize,
}

impl MoeLayerShape {
    /// Kimi-K2's routed experts (one group, no group choice).
    pub const KIMI_K2: MoeLayerShape = MoeLayerShape {
        n_experts: 384,
        top_k: 8,
        hidden: 7168,
        inter: 2048,
    };

    fn spec(&self) -> RouteSpec {
        RouteSpec {
            n_experts: self.n_experts,
            n_group: 1,
            topk_group: 1,
            top_k: self.top_k,
            norm_topk_prob: true,
            scaling: 2.827,
        }
    }

    /// Stored bytes of one expert's three projections as Q4_0.
    pub fn expert_bytes(&self) -> usize {
        3 * self.hidden * self.inter / 32 * 18
    }
}

/// One batch size's timing.
#[derive(Clone, Debug, serde::Serialize)]
pub struct MoeLayerPoint {
    /// Which expert kernel ran (the caller's label: a backend may offer several).
    pub kernel: String,
    pub batch: usize,
    /// Mean wall time of one layer's routed experts (routing through the weighted sum).
    pub seconds: f64,
    pub tokens_per_second: f64,
    /// Distinct experts the batch's tokens chose: each one's weights are read once.
    pub experts_read: usize,
    pub bytes_read: usize,
    /// bytes_read / seconds.
    pub read_bytes_per_second: f64,
}

/// Times `shape`'s routed experts on `b` at each batch size: random Q4_0 experts (one random
/// expert's bytes stored `n_experts` times over, so the host holds one), random router logits,
/// `iters` timed steps after two untimed ones, each step's work waited for. `kernel` labels the
/// points.
pub fn measure<B: Backend>(
    b: &B,
    shape: MoeLayerShape,
    batches: &[usize],
    iters: usize,
    seed: u64,
    kernel: &str,
) -> Result<Vec<MoeLayerPoint>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (h, i) = (shape.hidden, shape.inter);
    let one = [
        q4_0(&mut rng, "gate", i, h)?,
        q4_0(&mut rng, "up", i, h)?,
        q4_0(&mut rng, "down", h, i)?,
    ];
    let held = (0..shape.n_experts)
        .map(|_| {
            Some(ExpertTensors {
                gate: one[0].clone(),
                up: one[1].clone(),
                down: one[2].clone(),
            })
        })
        .collect();
    let experts = b.experts(held, Precision::Fast)?;
    let spec = shape.spec();
    let no_bias = vec![0.0; shape.n_experts];
    let bias = b.vector_from_host(&no_bias)?;
    let mut points = Vec::new();
    for &n in batches {
        let x: Vec<f32> = (0..n * h).map(|_| rng.random_range(-1.0..1.0)).collect();
        let logits: Vec<f32> = (0..n * shape.n_experts)
            .map(|_| rng.random_range(-4.0..4.0))
            .collect();
        let mut chosen = vec![false; shape.n_experts];
        for row in logits.chunks(shape.n_experts) {
            for (e, _) in route(&spec, row, &no_bias) {
                chosen[e] = true;
            }
        }
        let experts_read = chosen.iter().filter(|&&c| c).count();
        let hb = upload(b, n, h, &x)?;
        let lb = upload(b, n, shape.n_experts, &logits)?;
        let mut out = b.buffer(n, h)?;
        for _ in 0..2 {
            b.routed_experts(&spec, &bias, &hb, &lb, &experts, &mut out)?;
        }
        b.to_host(&out)?;
        let start = Instant::now();
        for _ in 0..iters {
            b.routed_experts(&spec, &bias, &hb, &lb, &experts, &mut out)?;
        }
        b.to_host(&out)?;
        let seconds = start.elapsed().as_secs_f64() / iters.max(1) as f64;
        let bytes_read = experts_read * shape.expert_bytes();
        points.push(MoeLayerPoint {
            kernel: kernel.to_string(),
            batch: n,
            seconds,
            tokens_per_second: n as f64 / seconds,
            experts_read,
            bytes_read,
            read_bytes_per_second: bytes_read as f64 / seconds,
        });
    }
    Ok(points)
}

/// A `[rows, cols]` Q4_0 tensor of random blocks with small f16 scales.
fn q4_0(rng: &mut ChaCha8Rng, name: &str, rows: usize, cols: usize) -> Result<TensorView> {
    let mut bytes: Vec<u8> = (0..rows * cols / 32 * 18).map(|_| rng.random()).collect();
    for block in bytes.chunks_exact_mut(18) {
        let d = half::f16::from_f32(rng.random_range(-0.02..0.02));
        block[..2].copy_from_slice(&d.to_le_bytes());
    }
    TensorView::from_bytes(
        format!("moe-layer {name}"),
        "moe-layer".into(),
        DType::Q4_0,
        vec![rows, cols],
        &bytes,
    )
}

/// Host values as a backend buffer (through an embedding of its rows).
fn upload<B: Backend>(b: &B, rows: usize, cols: usize, values: &[f32]) -> Result<B::Buffer> {
    let table = TensorView::from_f32(
        "values".into(),
        "moe-layer".into(),
        vec![rows, cols],
        values,
    )?;
    let table = b.embedding(&[table], Precision::Exact)?;
    let mut out = b.buffer(0, 0)?;
    b.embed(
        &table,
        &(0..rows as u32).collect::<Vec<_>>(),
        None,
        &mut out,
    )?;
    Ok(out)
}

/// A markdown table of the points, with the roofline at `read_bandwidth` bytes per second when
/// it is known.
pub fn render(points: &[MoeLayerPoint], read_bandwidth: Option<f64>) -> String {
    let mut s = String::from(
        "| kernel | batch | experts read | MB read | us / layer | tok/s | GB/s | roofline tok/s | of roofline |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in points {
        let roofline = read_bandwidth.map(|bw| p.batch as f64 * bw / p.bytes_read as f64);
        s += &format!(
            "| {} | {} | {} | {:.0} | {:.1} | {:.0} | {:.0} | {} | {} |\n",
            p.kernel,
            p.batch,
            p.experts_read,
            p.bytes_read as f64 / 1e6,
            p.seconds * 1e6,
            p.tokens_per_second,
            p.read_bytes_per_second / 1e9,
            roofline.map_or("-".into(), |r| format!("{r:.0}")),
            roofline.map_or("-".into(), |r| format!(
                "{:.0}%",
                100.0 * p.tokens_per_second / r
            )),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    /// The measurement runs on the CPU backend at a small shape: every expert it reports read
    /// was chosen, and batch 1 reads exactly top_k experts.
    #[test]
    fn a_small_layer_is_timed_and_its_reads_counted() {
        let shape = MoeLayerShape {
            n_experts: 16,
            top_k: 4,
            hidden: 64,
            inter: 32,
        };
        let cpu = CpuBackend::with_threads(2);
        let points = measure(&cpu, shape, &[1, 8], 2, 7, "cpu").expect("measured");
        assert_eq!(points[0].experts_read, 4);
        assert_eq!(points[0].bytes_read, 4 * shape.expert_bytes());
        assert!(points[1].experts_read >= 4 && points[1].experts_read <= 16);
        assert!(
            points
                .iter()
                .all(|p| p.seconds > 0.0 && p.tokens_per_second > 0.0)
        );
        let table = render(&points, Some(1e11));
        assert!(table.contains("| cpu | 1 | 4 |"), "{table}");
    }
}
