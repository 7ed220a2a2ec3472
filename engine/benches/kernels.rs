//! `cargo bench --bench kernels`: the quantized dot-product kernels alone, once with weights that fit
//! in L2 and once streaming a weight set larger than the caches, per SIMD level. Tells compute-bound
//! from bandwidth-bound.

use std::time::Instant;

use kiln::backend::cpu::blocks::{
    BlockQ4_1, BlockQ4_1x8, BlockQ8Act, quantize_activations, quantize_two_level,
};
use kiln::backend::cpu::{Kernels, SimdLevel};

fn run(k: &Kernels, w: &[BlockQ4_1], a: &[BlockQ8Act], nb: usize, passes: usize) -> (f64, f32) {
    let rows = w.len() / nb;
    let t = Instant::now();
    let mut sink = 0f32;
    for _ in 0..passes {
        let mut r = 0;
        while r + 4 <= rows {
            let v = (k.dot4_q4_1)([0, 1, 2, 3].map(|i| &w[(r + i) * nb..(r + i + 1) * nb]), a);
            sink += v[0] + v[3];
            r += 4;
        }
    }
    let bytes = (std::mem::size_of_val(w) * passes) as f64;
    (bytes / t.elapsed().as_secs_f64() / 1e9, sink)
}

/// The eight-row kernel on one two-level activation row (`hi`, `lo`), as fast-mode decode runs it.
fn run8(k: &Kernels, w: &[BlockQ4_1x8], a: &Pair, nb: usize, passes: usize) -> (f64, f32) {
    let groups = w.len() / nb;
    let t = Instant::now();
    let mut sink = 0f32;
    for _ in 0..passes {
        for g in 0..groups {
            let [v] = (k.dot8_q4_1.p1)(&w[g * nb..(g + 1) * nb], [&a.0], [&a.1]);
            sink += v[0] + v[7];
        }
    }
    let bytes = (std::mem::size_of_val(w) * passes) as f64;
    (bytes / t.elapsed().as_secs_f64() / 1e9, sink)
}

/// A two-level activation row: its 8-bit level and its residual.
type Pair = (Vec<BlockQ8Act>, Vec<BlockQ8Act>);

/// Integer multiply-accumulates per second (billions) of the eight-row kernel at 1, 2 and 4
/// two-level rows per pass (each level counts as a row of products), weights in L1: the compute
/// ceiling of batched decode and prefill.
fn macs8(k: &Kernels, w: &[BlockQ4_1x8], a: &Pair, nb: usize) -> [f64; 3] {
    let groups = w.len() / nb;
    let passes = 20_000;
    let (h, l) = (&a.0[..], &a.1[..]);
    let mut sink = 0f32;
    let mut rate = |rows: usize, f: &dyn Fn(&[BlockQ4_1x8]) -> f32| {
        let t = Instant::now();
        for _ in 0..passes {
            for g in 0..groups {
                sink += f(&w[g * nb..(g + 1) * nb]);
            }
        }
        let macs = (passes * groups * nb * 256 * rows * 2) as f64;
        macs / t.elapsed().as_secs_f64() / 1e9
    };
    let r = [
        rate(1, &|wg| (k.dot8_q4_1.p1)(wg, [h], [l])[0][3]),
        rate(2, &|wg| (k.dot8_q4_1.p2)(wg, [h, h], [l, l])[1][3]),
        rate(4, &|wg| (k.dot8_q4_1.p4)(wg, [h; 4], [l; 4])[3][3]),
    ];
    std::hint::black_box(sink);
    r
}

fn interleave(rows: &[BlockQ4_1], nb: usize) -> Vec<BlockQ4_1x8> {
    let groups = rows.len() / nb / 8;
    (0..groups * nb)
        .map(|gb| {
            let (g, b) = (gb / nb, gb % nb);
            BlockQ4_1x8::pack(std::array::from_fn(|i| &rows[(8 * g + i) * nb + b]))
        })
        .collect()
}

fn main() {
    let nb = 18; // 576 columns, the default model's hidden size
    let x: Vec<f32> = (0..nb * 32)
        .map(|i| ((i * 7919) % 200) as f32 / 100.0 - 1.0)
        .collect();
    let mut a = vec![BlockQ8Act::default(); nb];
    quantize_activations(&x, &mut a);
    let mut pair: Pair = (
        vec![BlockQ8Act::default(); nb],
        vec![BlockQ8Act::default(); nb],
    );
    quantize_two_level(&x, &mut pair.0, &mut pair.1);
    let block = |i: usize| BlockQ4_1 {
        d: 0x2000,
        m: 0xa000,
        qs: std::array::from_fn(|j| ((i * 31 + j * 17) % 256) as u8),
    };
    let small: Vec<BlockQ4_1> = (0..nb * 256).map(block).collect(); // 92 KB
    let large: Vec<BlockQ4_1> = (0..nb * 256 * 1024).map(block).collect(); // 94 MB
    for level in SimdLevel::available() {
        let k = Kernels::for_level(level);
        let (in_cache, s1) = run(&k, &small, &a, nb, 2000);
        let (streaming, s2) = run(&k, &large, &a, nb, 2);
        let (s8, l8) = (interleave(&small, nb), interleave(&large, nb));
        let (in_cache8, s3) = run8(&k, &s8, &pair, nb, 2000);
        let (streaming8, s4) = run8(&k, &l8, &pair, nb, 2);
        println!(
            "{level:?}: dot8_q4_1 {in_cache8:6.1} GB/s of weights in L2, {streaming8:6.1} GB/s streaming 94 MB (checksum {})",
            s3 + s4
        );
        let [m1, m2, m4] = macs8(&k, &s8[..4 * nb], &pair, nb);
        println!(
            "{level:?}: dot8_q4_1 in L1, one thread: {m1:6.1} / {m2:6.1} / {m4:6.1} GMAC/s at 1 / 2 / 4 two-level rows"
        );
        println!(
            "{level:?}: dot4_q4_1 {in_cache:6.1} GB/s of weights in L2, {streaming:6.1} GB/s streaming 94 MB (checksum {})",
            s1 + s2
        );
    }
}
