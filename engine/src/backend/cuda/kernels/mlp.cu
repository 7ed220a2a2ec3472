// The SiLU-gated MLP's activation: out[r, j] = silu(gate[r, j]) * up[r, j], where each row of
// `gate_up` is [gate | up] (the two projections fused into one matmul).
extern "C" __global__ void kiln_silu_mul_bf16(
    const bf16* __restrict__ gate_up, // [rows, 2 * width]
    bf16* __restrict__ out,           // [rows, width]
    int rows, int width) {
    const long idx = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long)rows * width) return;
    const long r = idx / width, j = idx % width;
    const float g = bf16_to_f32(gate_up[r * 2 * width + j]);
    const float u = bf16_to_f32(gate_up[r * 2 * width + width + j]);
    out[idx] = f32_to_bf16(g / (1.0f + __expf(-g)) * u);
}

// Embedding gather: out[t] = table[ids[t]]. An id outside the vocabulary gives a zero row (the
// host validates ids; the kernel must still never read out of bounds). Grid: tokens; block: any.
// `fill` (may be null): a token whose entry is a row r >= 0 takes `drawn[r]`, the token the
// latest sampling launch drew for row r (overlap scheduling feeds it before the host reads it).
extern "C" __global__ void kiln_embed_bf16(
    const bf16* __restrict__ table, // [vocab, width]
    const u32* __restrict__ ids,             // [tokens]
    bf16* __restrict__ out,         // [tokens, width]
    int vocab, int width,
    const int* __restrict__ fill,   // [tokens] or null
    const int* __restrict__ drawn) {
    const long t = blockIdx.x;
    const u32 id = (fill != nullptr && fill[t] >= 0) ? (u32)drawn[fill[t]] : ids[t];
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        out[t * width + i] = id < (u32)vocab ? table[(long)id * width + i] : f32_to_bf16(0.0f);
    }
}
