//! Op-by-op parity of the CUDA kernels against CPU references, on fresh random inputs, for the GPU
//! check (`kiln gpu-check`). Inputs are rounded to bf16 first, so the reference computes from
//! exactly the values the device sees; outputs are poisoned with NaN before every launch, so a
//! kernel that skips an element fails instead of passing on stale memory.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::kernels::{self, SOURCES};

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

fn err<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

struct Device {
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
}

fn virtual_arch(cc: (i32, i32)) -> R<&'static str> {
    Ok(match cc {
        (8, 0) => "compute_80",
        (8, 6) => "compute_86",
        (8, 9) => "compute_89",
        (9, 0) => "compute_90",
        (10, 0) => "compute_100",
        (12, 0) => "compute_120",
        other => {
            return Err(format!(
                "compute capability {other:?} is not one kiln compiles for"
            ));
        }
    })
}

impl Device {
    fn open() -> R<Device> {
        super::probe().map_err(|e| format!("CUDA: {e}"))?;
        let ctx = CudaContext::new(0).map_err(err("opening device 0"))?;
        let arch = virtual_arch(
            ctx.compute_capability()
                .map_err(err("compute capability"))?,
        )?;
        let target = kernels::Target {
            virtual_arch: arch,
            sm: "",
        };
        let mut functions = HashMap::new();
        for k in SOURCES {
            let ptx = kernels::compile_ptx(k, target, None)?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
                .map_err(err(k.file))?;
            for name in k.entry_points {
                functions.insert(*name, module.load_function(name).map_err(err(name))?);
            }
        }
        Ok(Device {
            stream: ctx.default_stream(),
            functions,
        })
    }

    fn f(&self, name: &str) -> R<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| format!("kernel {name} not loaded"))
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

/// max |a - b| relative to max |b|; any NaN in `a` (an element never written) is an infinite error.
fn rel_error(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() || a.iter().any(|x| x.is_nan()) {
        return f64::INFINITY;
    }
    let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y).abs() / scale) as f64)
        .fold(0.0, f64::max)
}

fn result(op: &str, case: String, error: f64, tolerance: f64) -> OpParity {
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
    let w_d = d.up(&w)?;
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
    let scale = 1.0f32;
    let f = d.f("kiln_rope_bf16")?;
    let mut b = d.stream.launch_builder(f);
    b.arg(&mut qkv_d).arg(&pos_d).arg(&freq_d);
    for a in &args {
        b.arg(a);
    }
    b.arg(&scale);
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
    let ids: Vec<u32> = vec![0, 999, 17, 1000, u32::MAX, 500];
    let (table_d, ids_d) = (d.up(&table)?, d.up(&ids)?);
    let mut out_d = d.poisoned(ids.len() * dim)?;
    let (vocab_i, dim_i) = (vocab as i32, dim as i32);
    let f = d.f("kiln_embed_bf16")?;
    let mut b = d.stream.launch_builder(f);
    b.arg(&table_d)
        .arg(&ids_d)
        .arg(&mut out_d)
        .arg(&vocab_i)
        .arg(&dim_i);
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

/// Two sequences, one decoding 3 tokens after 34 cached positions and one prefilling 5, with KV
/// written by kiln_kv_write_bf16 into scattered blocks; optionally the second as an EAGLE tree.
fn attention(d: &Device, rng: &mut ChaCha8Rng, tree: bool) -> R<OpParity> {
    let (heads, kv_heads, head_dim, block) = (8usize, 2usize, 64usize, 16usize);
    let (q_w, kv_w) = (heads * head_dim, kv_heads * head_dim);
    let stride = q_w + 2 * kv_w;
    let n_blocks = 8usize;
    let tables: Vec<i32> = vec![5, 2, 7, 0, /* seq 1 */ 3, 6, 1, 4];
    let max_blocks = 4usize;
    // (sequence, position) of each new token.
    let tokens: Vec<(usize, usize)> = vec![
        (0, 34),
        (0, 35),
        (0, 36),
        (1, 0),
        (1, 1),
        (1, 2),
        (1, 3),
        (1, 4),
    ];
    let parents: Vec<i32> = vec![-1, 0, 0, 1, 2]; // seq 1's five tokens as a tree (tree case)
    let mut k_cache = vec![bf16::ZERO; n_blocks * block * kv_w];
    let mut v_cache = vec![bf16::ZERO; n_blocks * block * kv_w];
    let slot =
        |seq: usize, p: usize| tables[seq * max_blocks + p / block] as usize * block + p % block;
    for p in 0..34 {
        let s = slot(0, p);
        for i in 0..kv_w {
            k_cache[s * kv_w + i] = bf16::from_f32(rng.random_range(-1.0..1.0));
            v_cache[s * kv_w + i] = bf16::from_f32(rng.random_range(-1.0..1.0));
        }
    }
    let qkv = random_bf16(rng, tokens.len() * stride, 1.0);
    let slots: Vec<i32> = tokens.iter().map(|&(s, p)| slot(s, p) as i32).collect();
    let (mut k_d, mut v_d) = (d.up(&k_cache)?, d.up(&v_cache)?);
    let (qkv_d, slots_d) = (d.up(&qkv)?, d.up(&slots)?);
    let (stride_i, k_col, v_col, kv_w_i) =
        (stride as i32, q_w as i32, (q_w + kv_w) as i32, kv_w as i32);
    let f = d.f("kiln_kv_write_bf16")?;
    let mut b = d.stream.launch_builder(f);
    b.arg(&qkv_d)
        .arg(&stride_i)
        .arg(&k_col)
        .arg(&v_col)
        .arg(&slots_d)
        .arg(&mut k_d)
        .arg(&mut v_d)
        .arg(&kv_w_i);
    // SAFETY: as attention.cu declares.
    unsafe { b.launch(cfg((tokens.len() as u32, 1), 128)) }.map_err(err("launch"))?;

    // The reference cache after the write.
    for (t, &(s, p)) in tokens.iter().enumerate() {
        let sl = slot(s, p);
        for i in 0..kv_w {
            k_cache[sl * kv_w + i] = qkv[t * stride + q_w + i];
            v_cache[sl * kv_w + i] = qkv[t * stride + q_w + kv_w + i];
        }
    }
    // Tree: node i of seq 1 sees nodes on its path to the root only.
    let tree_n = parents.len();
    let mut mask = vec![0u8; tree_n * tree_n];
    for i in 0..tree_n {
        let mut n = i as i32;
        while n >= 0 {
            mask[i * tree_n + n as usize] = 1;
            n = parents[n as usize];
        }
    }
    let seq_of: Vec<i32> = tokens.iter().map(|&(s, _)| s as i32).collect();
    let pos_of: Vec<i32> = tokens.iter().map(|&(_, p)| p as i32).collect();
    let base: Vec<i32> = tokens
        .iter()
        .map(|&(s, _)| if s == 1 { 0 } else { i32::MAX })
        .collect();
    let node: Vec<i32> = tokens
        .iter()
        .map(|&(s, p)| if s == 1 { p as i32 } else { 0 })
        .collect();
    let (seq_d, pos_d, tab_d) = (d.up(&seq_of)?, d.up(&pos_of)?, d.up(&tables)?);
    let (mask_d, base_d, node_d) = (d.up(&mask)?, d.up(&base)?, d.up(&node)?);
    let mut out_d = d.poisoned(tokens.len() * q_w)?;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let ints = [
        max_blocks as i32,
        block as i32,
        heads as i32,
        kv_heads as i32,
        head_dim as i32,
    ];
    let null: u64 = 0;
    let tree_n_i = tree_n as i32;
    let f = d.f("kiln_paged_attention_bf16")?;
    let mut b = d.stream.launch_builder(f);
    b.arg(&qkv_d)
        .arg(&stride_i)
        .arg(&k_d)
        .arg(&v_d)
        .arg(&seq_d)
        .arg(&pos_d)
        .arg(&tab_d);
    for a in &ints {
        b.arg(a);
    }
    b.arg(&scale);
    if tree {
        b.arg(&mask_d).arg(&base_d).arg(&node_d);
    } else {
        b.arg(&null).arg(&null).arg(&null);
    }
    b.arg(&tree_n_i).arg(&mut out_d);
    // SAFETY: as attention.cu declares; null pointers where the tree is off.
    unsafe { b.launch(cfg((tokens.len() as u32, heads as u32), 128)) }.map_err(err("launch"))?;
    let got = f32s(&d.down(&out_d)?);

    let mut want = vec![0f32; tokens.len() * q_w];
    for (t, &(s, p)) in tokens.iter().enumerate() {
        for h in 0..heads {
            let kvh = h / (heads / kv_heads);
            let q: Vec<f32> = (0..head_dim)
                .map(|i| qkv[t * stride + h * head_dim + i].to_f32() * scale)
                .collect();
            let visible: Vec<usize> = (0..=p)
                .filter(|&j| !(tree && s == 1) || mask[p * tree_n + j] == 1)
                .collect();
            let scores: Vec<f32> = visible
                .iter()
                .map(|&j| {
                    let sl = slot(s, j);
                    (0..head_dim)
                        .map(|i| q[i] * k_cache[sl * kv_w + kvh * head_dim + i].to_f32())
                        .sum()
                })
                .collect();
            let m = scores.iter().cloned().fold(f32::MIN, f32::max);
            let e: Vec<f32> = scores.iter().map(|x| (x - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for i in 0..head_dim {
                want[t * q_w + h * head_dim + i] = visible
                    .iter()
                    .zip(&e)
                    .map(|(&j, w)| w * v_cache[slot(s, j) * kv_w + kvh * head_dim + i].to_f32())
                    .sum::<f32>()
                    / z;
            }
        }
    }
    let case = if tree {
        "decode + tree-masked prefill"
    } else {
        "decode + causal prefill"
    };
    Ok(result(
        "paged_attention",
        case.into(),
        rel_error(&got, &want),
        BF16_TOL,
    ))
}

fn tree_mask(d: &Device) -> R<OpParity> {
    let parents: Vec<i32> = vec![-1, 0, 0, 1, 1, 2, -1, 6];
    let n = parents.len();
    let par_d = d.up(&parents)?;
    let mut mask_d = d.up(&vec![7u8; n * n])?;
    let n_i = n as i32;
    let f = d.f("kiln_tree_mask")?;
    let mut b = d.stream.launch_builder(f);
    b.arg(&par_d).arg(&n_i).arg(&mut mask_d);
    // SAFETY: as attention.cu declares.
    unsafe { b.launch(cfg((n as u32, 1), n as u32)) }.map_err(err("launch"))?;
    let got = d.down(&mask_d)?;
    let mut wrong = 0usize;
    for i in 0..n {
        let mut ancestors = vec![0u8; n];
        let mut a = i as i32;
        while a >= 0 {
            ancestors[a as usize] = 1;
            a = parents[a as usize];
        }
        wrong += (0..n).filter(|&j| got[i * n + j] != ancestors[j]).count();
    }
    Ok(result(
        "tree_mask",
        format!("{n} nodes, two roots"),
        wrong as f64,
        0.0,
    ))
}

fn argmax_and_sampling(d: &Device, rng: &mut ChaCha8Rng) -> R<Vec<OpParity>> {
    let vocab = 49152usize;
    let mut logits: Vec<f32> = (0..4 * vocab)
        .map(|_| rng.random_range(-10.0..10.0))
        .collect();
    logits[vocab + 100] = 50.0; // a tie: the lowest index must win
    logits[vocab + 200] = 50.0;
    let want: Vec<i32> = (0..4)
        .map(|r| {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let mut best = 0;
            for (i, &x) in row.iter().enumerate() {
                if x > row[best] {
                    best = i;
                }
            }
            best as i32
        })
        .collect();
    let l_d = d.up(&logits)?;
    let mut out_d = d.up(&[-1i32; 4])?;
    let vocab_i = vocab as i32;
    let f = d.f("kiln_argmax_f32")?;
    let mut b = d.stream.launch_builder(f);
    b.arg(&l_d).arg(&vocab_i).arg(&mut out_d);
    // SAFETY: as sampling.cu declares; one 1024-thread block per row.
    unsafe { b.launch(cfg((4, 1), 1024)) }.map_err(err("launch"))?;
    let got = d.down(&out_d)?;
    let mismatches = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    let mut out = vec![result(
        "argmax",
        "4 rows, a tie".into(),
        mismatches as f64,
        0.0,
    )];

    // Sampling: many draws of one small distribution; frequencies against the softmax (with top-k /
    // top-p applied). 20000 draws: a frequency's standard error is at most 0.0035.
    let small = [2.0f32, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0];
    let draws = 20000usize;
    for (top_k, top_p, label) in [
        (0, 1.0f32, "full"),
        (3, 1.0, "top-k 3"),
        (0, 0.8, "top-p 0.8"),
    ] {
        let logits: Vec<f32> = (0..draws).flat_map(|_| small).collect();
        let temps = vec![0.7f32; draws];
        let ks = vec![top_k; draws];
        let ps = vec![top_p; draws];
        let seeds = vec![1234u64; draws];
        let counters: Vec<u64> = (0..draws as u64).collect();
        let (l_d, t_d, k_d, p_d) = (d.up(&logits)?, d.up(&temps)?, d.up(&ks)?, d.up(&ps)?);
        let (s_d, c_d) = (d.up(&seeds)?, d.up(&counters)?);
        let mut o_d = d.up(&vec![-1i32; draws])?;
        let v = small.len() as i32;
        let f = d.f("kiln_sample_f32")?;
        let mut b = d.stream.launch_builder(f);
        b.arg(&l_d)
            .arg(&v)
            .arg(&t_d)
            .arg(&k_d)
            .arg(&p_d)
            .arg(&s_d)
            .arg(&c_d)
            .arg(&mut o_d);
        // SAFETY: as sampling.cu declares.
        unsafe { b.launch(cfg((draws as u32, 1), 1024)) }.map_err(err("launch"))?;
        let picks = d.down(&o_d)?;
        let mut freq = vec![0f64; small.len()];
        for &p in &picks {
            match freq.get_mut(p as usize) {
                Some(f) => *f += 1.0 / draws as f64,
                None => return Ok(vec![result("sample", label.into(), f64::INFINITY, 0.02)]),
            }
        }
        let mut probs: Vec<f64> = small.iter().map(|&x| ((x / 0.7) as f64).exp()).collect();
        if top_k > 0 {
            probs.iter_mut().skip(top_k as usize).for_each(|p| *p = 0.0);
        }
        if top_p < 1.0 {
            // Sorted descending already: keep the smallest prefix reaching top_p of the mass.
            let z: f64 = probs.iter().sum();
            let mut run = 0.0;
            for p in probs.iter_mut() {
                if run >= top_p as f64 * z {
                    *p = 0.0;
                }
                run += *p;
            }
        }
        let z: f64 = probs.iter().sum();
        let gap = probs
            .iter()
            .zip(&freq)
            .map(|(p, f)| (p / z - f).abs())
            .fold(0.0, f64::max);
        out.push(result(
            "sample",
            format!("{label}, {draws} draws"),
            gap,
            0.02,
        ));
    }
    Ok(out)
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
    out.push(attention(&d, &mut rng, false)?);
    out.push(attention(&d, &mut rng, true)?);
    out.push(tree_mask(&d)?);
    out.extend(argmax_and_sampling(&d, &mut rng)?);
    d.stream.synchronize().map_err(err("synchronize"))?;
    Ok(out)
}
