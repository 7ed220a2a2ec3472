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

/// Block FP8 and bf16 rows are widened to f32 as the matmul reads them: every product equals
/// the f32 one but for summation order, at every token count (1 to 3 take the dot kernels, 6 and
/// more a GEMM per tile), for row counts that leave partial four-row blocks and tiles, through
/// stacked parts of both types and in embedding lookups.
#[test]
fn widened_fp8_and_bf16_rows_equal_their_f32_values() {
    use kiln::weights::{DType, TensorView};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let (cols, width) = (256, 128);
    let fp8_rows = 37;
    let mut fp8 = Vec::new();
    for _ in 0..fp8_rows * cols / width {
        fp8.extend_from_slice(&rng.random_range(0.001f32..0.1).to_le_bytes());
        // Any e4m3 byte but the NaN pattern, subnormals and signs included.
        fp8.extend(
            (0..width)
                .map(|_| rng.random::<u8>())
                .map(|b| if b & 0x7f == 0x7f { 0 } else { b }),
        );
    }
    let bf16_rows = 21;
    let bf16: Vec<u8> = (0..bf16_rows * cols)
        .flat_map(|_| half::bf16::from_f32(rng.random_range(-1.0..1.0)).to_le_bytes())
        .collect();
    let parts = [
        TensorView::from_bytes(
            "fp8".into(),
            "test".into(),
            DType::F8Blocks(width as u16),
            vec![fp8_rows, cols],
            &fp8,
        )
        .expect("fp8 view"),
        TensorView::from_bytes(
            "bf16".into(),
            "test".into(),
            DType::BF16,
            vec![bf16_rows, cols],
            &bf16,
        )
        .expect("bf16 view"),
    ];
    for level in SimdLevel::available() {
        let b = CpuBackend::with_level(level);
        let exact = b.matrix(&parts, Precision::Exact).expect("exact");
        let fast = b.matrix(&parts, Precision::Fast).expect("fast");
        for n in [1, 2, 3, 6, 9] {
            let mut x = CpuBuffer::default();
            x.resize(n, cols);
            x.data
                .iter_mut()
                .for_each(|e| *e = rng.random_range(-1.0..1.0));
            let (mut ye, mut yf) = (CpuBuffer::default(), CpuBuffer::default());
            b.matmul(&x, &exact, &mut ye).expect("matmul");
            b.matmul(&x, &fast, &mut yf).expect("matmul");
            for (i, (e, f)) in ye.data.iter().zip(&yf.data).enumerate() {
                assert!(
                    (e - f).abs() <= 1e-4 * (1.0 + e.abs()),
                    "{n} tokens at {level:?}: output {i} is {f}, f32 says {e}"
                );
            }
        }
        let ids: Vec<u32> = vec![0, 36, 37, 57];
        let (mut ee, mut ef) = (CpuBuffer::default(), CpuBuffer::default());
        b.embed(&exact, &ids, None, &mut ee).expect("embed");
        b.embed(&fast, &ids, None, &mut ef).expect("embed");
        assert_eq!(ee.data, ef.data, "embedding rows at {level:?}");
    }
}
