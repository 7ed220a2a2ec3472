//! Op-by-op parity of the CUDA kernels against CPU references, on fresh random inputs, for the GPU
//! check (`kiln gpu-check`). Inputs are rounded to bf16 first, so the reference computes from
//! exactly the values the device sees; outputs are poisoned with NaN before every launch, so a
//! kernel that skips an element fails instead of passing on stale memory.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::gpu::{Gpu, err};

/// One case's result.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OpParity {
    pub op: String,
    pub case: String,
    /// max |device - reference| / max(|reference|, 1e-6) (for sampling: the largest frequency gap).
    pub error: f64,
    pub tolerance: f64,
    pub pass: bool,
}

type R<T> = Result<T, String>;

struct Device {
    stream: Arc<CudaStream>,
    gpu: Gpu,
}

impl Device {
    fn open() -> R<Device> {
        let gpu = Gpu::open(0)?;
        Ok(Device {
            stream: gpu.stream.clone(),
            gpu,
        })
    }

    fn f(&self, name: &str) -> R<&CudaFunction> {
        self.gpu.f(name)
    }

    fn up<T: cudarc::driver::DeviceRepr>(&self, v: &[T]) -> R<CudaSlice<T>> {
        self.stream.clone_htod(v).map_err(err("copy to device"))
    }

    fn down<T: cudarc::driver::DeviceRepr>(&self, v: &CudaSlice<T>) -> R<Vec<T>> {
        self.stream.clone_dtoh(v).map_err(err("copy to host"))
    }

    /// A bf16 output buffer full of NaN.
    fn poisoned(&self, n: usize) -> R<CudaSlice<bf16>> {
        self.up(&vec![bf16::NAN; n])
    }
}

fn cfg(grid: (u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn random_bf16(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-scale..scale)))
        .collect()
}

fn f32s(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

/// max |a - b| relative to max |b|; a NaN in `a` (an element never written), an infinity or a
/// length mismatch is an infinite error.
pub(super) fn rel_error(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() || a.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y).abs() / scale) as f64)
        .fold(0.0, f64::max)
}

pub(super) fn result(op: &str, case: String, error: f64, tolerance: f64) -> OpParity {
    OpParity {
        op: op.into(),
        case,
        error,
        tolerance,
        pass: error <= tolerance,
    }
}

// bf16 keeps 8 significant bits: one rounding is 2^-9 relative; a few of them plus f32
// accumulation-order differences stay under 1e-2 of the output's range.
const BF16_TOL: f64 = 1e-2;

fn rms_norm(d: &Device, rng: &mut ChaCha8Rng, rows: usize, width: usize) -> R<OpParity> {
    let x = random_bf16(rng, rows * width, 2.0);
    let delta = random_bf16(rng, rows * width, 2.0);
    let w = random_bf16(rng, width, 1.5);
    let mut x_d = d.up(&x)?;
    let delta_d = d.up(&delta)?;
    let w_d = d.up(&f32s(&w))?;
    let mut out_d = d.poisoned(rows * width)?;
    let (width_i, eps) = (width as i32, 1e-5f32);
    let f = d.f("kiln_add_rms_norm_bf16")?;
    let mut b = d.stream.launch_builder(f);
    b.arg(&mut x_d)
        .arg(&delta_d)
        .arg(&w_d)
        .arg(&mut out_d)
        .arg(&width_i)
        .arg(&eps);
    // SAFETY: argument types and buffer sizes match the kernel's signature (norm.cu).
    unsafe { b.launch(cfg((rows as u32, 1), 256)) }.map_err(err("launch"))?;
    let got = f32s(&d.down(&out_d)?);
    let mut want = Vec::with_capacity(rows * width);
    for r in 0..rows {
        let summed: Vec<f32> = (0..width)
            .map(|i| {
                bf16::from_f32(x[r * width + i].to_f32() + delta[r * width + i].to_f32()).to_f32()
            })
            .collect();
        let ss: f32 = summed.iter().map(|v| v * v).sum();
        let scale = 1.0 / (ss / width as f32 + eps).sqrt();
        want.extend(summed.iter().zip(&w).map(|(v, w)| v * scale * w.to_f32()));
    }
    Ok(result(
        "add_rms_norm",
        format!("{rows}x{width}"),
        rel_error(&got, &want),
        BF16_TOL,
    ))
}

fn rope(d: &Device, rng: &mut ChaCha8Rng, interleaved: bool) -> R<OpParity> {
    let (rows, heads, head_dim, rope_dim, offset) = (5usize, 4usize, 64usize, 64usize, 64usize);
    let stride = offset + heads * head_dim;
    let qkv = random_bf16(rng, rows * stride, 1.0);
    let positions: Vec<i32> = (0..rows).map(|_| rng.random_range(0..4096)).collect();
    let inv_freq: Vec<f32> = (0..rope_dim / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / rope_dim as f32))
        .collect();
    let mut qkv_d = d.up(&qkv)?;
    let (pos_d, freq_d) = (d.up(&positions)?, d.up(&inv_freq)?);
    let args = [
        stride as i32,
        offset as i32,
        head_dim as i32,
        rope_dim as i32,
        interleaved as i32,
    ];
    let (scale, attention_factor) = (1.0f32, 1.0f32);
    let f = d.f("kiln_rope_bf16")?;
    let mut b = d.stream.launch_builder(f);
    b.arg(&mut qkv_d).arg(&pos_d).arg(&freq_d);
    for a in &args {
        b.arg(a);
    }
    b.arg(&scale).arg(&attention_factor);
    // SAFETY: as rope.cu declares; grid (rows, heads), one thread per rotated pair.
    unsafe { b.launch(cfg((rows as u32, heads as u32), (rope_dim / 2) as u32)) }
        .map_err(err("launch"))?;
    let got = f32s(&d.down(&qkv_d)?);
    let mut want = f32s(&qkv);
    for (r, &pos) in positions.iter().enumerate() {
        for h in 0..heads {
            let base = r * stride + offset + h * head_dim;
            for (i, &freq) in inv_freq.iter().enumerate() {
                let (a, b) = if interleaved {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + rope_dim / 2)
                };
                let angle = pos as f32 * freq;
                let (s, c) = angle.sin_cos();
                let (x0, x1) = (qkv[base + a].to_f32(), qkv[base + b].to_f32());
                want[base + a] = x0 * c - x1 * s;
                want[base + b] = x1 * c + x0 * s;
            }
        }
    }
    let layout = if interleaved {
        "interleaved"
    } else {
        "half-split"
    };
    Ok(result(
        "rope",
        layout.into(),
        rel_error(&got, &want),
        BF16_TOL,
    ))
}

fn silu_mul_and_embed(d: &Device, rng: &mut ChaCha8Rng) -> R<Vec<OpParity>> {
    let (rows, width) = (3usize, 1536usize);
    let gu = random_bf16(rng, rows * 2 * width, 4.0);
    let gu_d = d.up(&gu)?;
    let mut out_d = d.poisoned(rows * width)?;
    let (rows_i, width_i) = (rows as i32, width as i32);
    let f = d.f("kiln_silu_mul_bf16")?;
    let mut b = d.stream.launch_builder(f);
    b.arg(&gu_d).arg(&mut out_d).arg(&rows_i).arg(&width_i);
    let n = (rows * width) as u32;
    // SAFETY: as mlp.cu declares.
    unsafe { b.launch(cfg((n.div_ceil(256), 1), 256)) }.map_err(err("launch"))?;
    let got = f32s(&d.down(&out_d)?);
    let want: Vec<f32> = (0..rows * width)
        .map(|idx| {
            let (r, j) = (idx / width, idx % width);
            let g = gu[r * 2 * width + j].to_f32();
            g / (1.0 + (-g).exp()) * gu[r * 2 * width + width + j].to_f32()
        })
        .collect();
    let silu = result(
        "silu_mul",
        format!("{rows}x{width}"),
        rel_error(&got, &want),
        BF16_TOL,
    );

    let (vocab, dim) = (1000usize, 64usize);
    let table = random_bf16(rng, vocab * dim, 1.0);
    let given: Vec<u32> = vec![0, 999, 17, 1000, u32::MAX, 500, 3];
    // Two tokens fill from an earlier draw (rows 1 and 0), the rest are as given.
    let fill: Vec<i32> = vec![-1, -1, 1, -1, -1, -1, 0];
    let drawn: Vec<i32> = vec![42, 7];
    let ids: Vec<u32> = given
        .iter()
        .zip(&fill)
        .map(|(&id, &r)| if r >= 0 { drawn[r as usize] as u32 } else { id })
        .collect();
    let (table_d, ids_d) = (d.up(&table)?, d.up(&given)?);
    let (fill_d, drawn_d) = (d.up(&fill)?, d.up(&drawn)?);
    let mut out_d = d.poisoned(ids.len() * dim)?;
    let (vocab_i, dim_i) = (vocab as i32, dim as i32);
    let f = d.f("kiln_embed_bf16")?;
    let mut b = d.stream.launch_builder(f);
    b.arg(&table_d)
        .arg(&ids_d)
        .arg(&mut out_d)
        .arg(&vocab_i)
        .arg(&dim_i)
        .arg(&fill_d)
        .arg(&drawn_d);
    // SAFETY: as mlp.cu declares.
    unsafe { b.launch(cfg((ids.len() as u32, 1), 64)) }.map_err(err("launch"))?;
    let got = f32s(&d.down(&out_d)?);
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&id| {
            (0..dim).map(move |i| {
                if (id as usize) < vocab {
                    id as usize * dim + i
                } else {
                    usize::MAX
                }
            })
        })
        .map(|at| {
            if at == usize::MAX {
                0.0
            } else {
                table[at].to_f32()
            }
        })
        .collect();
    // Gathers are copies: exact, out-of-range ids included (zero rows).
    let embed = result(
        "embed",
        "with out-of-range ids".into(),
        rel_error(&got, &want),
        0.0,
    );
    Ok(vec![silu, embed])
}

/// The tensor cores' fragment layouts (packed_mma.cu's `kiln_mma_layout_check`): one mma.sync
/// of a random 16x16 by 16x8 product against the host's. Products of bf16 values are exact in
/// f32 and the sums of 16 agree to f32 rounding; a value in the wrong register is off by the
/// size of the values.
fn mma_layout(d: &Device, rng: &mut ChaCha8Rng) -> R<OpParity> {
    let a = random_bf16(rng, 16 * 16, 1.0);
    let b = random_bf16(rng, 8 * 16, 1.0); // b[n][k]
    let (a_d, b_d) = (d.up(&a)?, d.up(&b)?);
    let mut out_d = d.up(&vec![f32::NAN; 16 * 8])?;
    let mut l = d.stream.launch_builder(d.f("kiln_mma_layout_check")?);
    l.arg(&a_d).arg(&b_d).arg(&mut out_d);
    // SAFETY: as packed_mma.cu declares: one warp, a 16x16, b 8x16, out 16x8.
    unsafe { l.launch(cfg((1, 1), 32)) }.map_err(err("launch"))?;
    let got = d.down(&out_d)?;
    let want: Vec<f32> = (0..16)
        .flat_map(|row| {
            let (a, b) = (&a, &b);
            (0..8).map(move |n| {
                (0..16)
                    .map(|k| a[row * 16 + k].to_f32() * b[n * 16 + k].to_f32())
                    .sum::<f32>()
            })
        })
        .collect();
    Ok(result(
        "mma.sync",
        "m16n8k16 bf16 fragment layout".into(),
        rel_error(&got, &want),
        1e-5,
    ))
}

/// Runs every case on device 0. Err when there is no usable device or a launch fails.
pub fn run(seed: u64) -> R<Vec<OpParity>> {
    let d = Device::open()?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = vec![
        rms_norm(&d, &mut rng, 7, 576)?,
        rms_norm(&d, &mut rng, 3, 7168)?,
        rope(&d, &mut rng, false)?,
        rope(&d, &mut rng, true)?,
    ];
    out.extend(silu_mul_and_embed(&d, &mut rng)?);
    out.push(mma_layout(&d, &mut rng)?);
    d.stream.synchronize().map_err(err("synchronize"))?;
    Ok(out)
}
