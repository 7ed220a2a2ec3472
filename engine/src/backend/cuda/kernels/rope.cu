// Rotary position embedding on `n_heads` heads starting at column `col_offset` of each row of a
// fused [q | k | v] buffer. Half-split layout (Hugging Face): pairs (i, i + rope_dim/2);
// interleaved layout (GGUF llama): pairs (2i, 2i + 1). Only the first rope_dim dims rotate.
// YaRN's attention factor scales cos and sin. Grid: (rows, n_heads); block: rope_dim / 2 threads (one pair each).
extern "C" __global__ void kiln_rope_bf16(
    bf16* __restrict__ qkv,   // [rows, row_stride]
    const int* __restrict__ positions, // [rows]
    const float* __restrict__ inv_freq, // [rope_dim / 2]
    int row_stride, int col_offset, int head_dim, int rope_dim, int interleaved,
    float position_scale, float attention_factor) {
    const int row = blockIdx.x, head = blockIdx.y, i = threadIdx.x;
    const int half = rope_dim / 2;
    if (i >= half) return;
    bf16* h = qkv + (long)row * row_stride + col_offset + head * head_dim;
    const float angle = ((float)positions[row] / position_scale) * inv_freq[i];
    float s, c;
    sincosf(angle, &s, &c);
    s *= attention_factor;
    c *= attention_factor;
    const int a = interleaved ? 2 * i : i;
    const int b = interleaved ? 2 * i + 1 : i + half;
    const float x0 = bf16_to_f32(h[a]), x1 = bf16_to_f32(h[b]);
    h[a] = f32_to_bf16(x0 * c - x1 * s);
    h[b] = f32_to_bf16(x1 * c + x0 * s);
}
