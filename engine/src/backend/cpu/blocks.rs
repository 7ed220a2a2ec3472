//! Block layouts the CPU kernels compute on. Weight blocks keep ggml's byte layout (f16 scales), so
//! Q4_1 and Q8_0 tensors are copied verbatim from the GGUF file; activation blocks are built per matmul.

/// 32 weights `d * q + m`, `q` in 0..16: element `j` is the low nibble of `qs[j]`, element `j + 16` the
/// high nibble (ggml Q4_1). Q4_0 and Q4_K sub-blocks are repacked into this form.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockQ4_1 {
    pub d: u16,
    pub m: u16,
    pub qs: [u8; 16],
}

/// 32 weights `d * q`, `q` in -128..128 (ggml Q8_0). Q5_0 is repacked into this form.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockQ8_0 {
    pub d: u16,
    pub qs: [i8; 32],
}

/// 32 weights in two halves of 16 with their own scale: `d[j / 16] * q[j]`. Q6_K repacks into this.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockQ8x16 {
    pub d: [u16; 2],
    pub qs: [i8; 32],
}

/// 32 activations quantized to 8 bits: `x ≈ d * q`; `s = d * Σq` serves the `m` term of Q4_1 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockQ8Act {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; 32],
}

pub const QBLOCK: usize = 32;

/// Quantizes one row (`x.len()` a multiple of 32) the way ggml's `quantize_row_q8_1` does.
pub fn quantize_activations(x: &[f32], out: &mut [BlockQ8Act]) {
    for (xb, ob) in x.chunks_exact(QBLOCK).zip(out.iter_mut()) {
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, v) in ob.qs.iter_mut().zip(xb) {
            let r = (v * id).round() as i32;
            *q = r as i8;
            sum += r;
        }
        ob.d = d;
        ob.s = d * sum as f32;
    }
}

#[inline]
pub fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32()
}

#[inline]
pub fn f32_to_f16(v: f32) -> u16 {
    half::f16::from_f32(v).to_bits()
}
