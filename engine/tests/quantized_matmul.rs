//! Fast-mode matmuls (quantized weights x 8-bit activations) against exact f32 matmuls on the real
//! models' tensors, for every stored weight type they use.

mod common;

use kiln::backend::cpu::{CpuBackend, CpuBuffer, SimdLevel};
use kiln::backend::{Backend, Precision};
use kiln::weights::gguf::GgufFile;
use rand::{Rng, SeedableRng};

fn check_file(path: &std::path::Path, names: &[&str]) {
    let g = GgufFile::open(path).expect("open model");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    for name in names {
        let v = g.view(name).expect("tensor");
        let (_, cols) = v.matrix_shape().expect("matrix");
        let mut x = CpuBuffer::default();
        x.resize(3, cols);
        x.data
            .iter_mut()
            .for_each(|e| *e = rng.random_range(-1.0..1.0));
        for level in SimdLevel::available() {
            let b = CpuBackend::with_level(level);
            let exact = b
                .matrix(std::slice::from_ref(&v), Precision::Exact)
                .expect("exact");
            let fast = b
                .matrix(std::slice::from_ref(&v), Precision::Fast)
                .expect("fast");
            let (mut ye, mut yf) = (CpuBuffer::default(), CpuBuffer::default());
            b.matmul(&x, &exact, &mut ye).expect("matmul");
            b.matmul(&x, &fast, &mut yf).expect("matmul");
            let num: f32 = ye
                .data
                .iter()
                .zip(&yf.data)
                .map(|(a, b)| (a - b) * (a - b))
                .sum();
            let den: f32 = ye.data.iter().map(|a| a * a).sum();
            let rel = (num / den).sqrt();
            // 8-bit activations: llama.cpp's q8 path has the same ~1% relative error.
            assert!(
                rel < 0.02,
                "{name} ({:?}) at {level:?}: relative error {rel}",
                v.dtype
            );
        }
    }
}

#[test]
fn smollm2_tensor_types() {
    check_file(
        &common::smollm2(),
        &[
            "blk.0.attn_q.weight",
            "blk.3.ffn_down.weight",
            "token_embd.weight",
        ],
    );
}

#[test]
fn qwen_tensor_types() {
    let path = common::qwen();
    let g = GgufFile::open(&path).expect("open");
    // One tensor of each stored type in the file.
    let mut seen = std::collections::HashMap::new();
    for t in &g.tensors {
        if t.dims.len() == 2 {
            seen.entry(format!("{:?}", t.dtype))
                .or_insert(t.name.clone());
        }
    }
    let names: Vec<&str> = seen.values().map(|s| s.as_str()).collect();
    check_file(&path, &names);
}
