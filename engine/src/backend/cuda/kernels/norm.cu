// RMSNorm fused with the residual add that precedes it in every block:
//   x[r] += delta[r] (when delta is given); out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w
// One block per row; the row is read twice (sum of squares, then scale) from global memory.
extern "C" __global__ void kiln_add_rms_norm_bf16(
    bf16* __restrict__ x,            // [rows, width], updated in place when delta != null
    const bf16* __restrict__ delta,  // [rows, width] or null
    const float* __restrict__ w,     // [width]
    bf16* __restrict__ out,          // [rows, width]
    int width, float eps) {
    const long row = blockIdx.x;
    bf16* xr = x + row * width;
    const bf16* dr = delta ? delta + row * width : nullptr;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = bf16_to_f32(xr[i]);
        if (dr) {
            v += bf16_to_f32(dr[i]);
            xr[i] = f32_to_bf16(v);
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    const float scale = rsqrtf(ss / (float)width + eps);
    bf16* orow = out + row * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        // Re-read the stored (rounded) value, as the next layer will see it.
        orow[i] = f32_to_bf16(bf16_to_f32(xr[i]) * scale * w[i]);
    }
}

// RMSNorm of each head in place (Qwen3's Q/K norm): columns col_offset + h * head_dim .. of every
// row. Grid: (rows, n_heads); block: 32 threads (one warp per head).
extern "C" __global__ void kiln_head_rms_norm_bf16(
    bf16* __restrict__ x, int row_stride, int col_offset, int head_dim,
    const float* __restrict__ w,  // [head_dim]
    float eps) {
    bf16* h = x + (long)blockIdx.x * row_stride + col_offset + blockIdx.y * head_dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < head_dim; i += 32) {
        const float v = bf16_to_f32(h[i]);
        ss += v * v;
    }
    ss = warp_sum(ss);
    const float scale = rsqrtf(ss / (float)head_dim + eps);
    for (int i = threadIdx.x; i < head_dim; i += 32) h[i] = f32_to_bf16(bf16_to_f32(h[i]) * scale * w[i]);
}
