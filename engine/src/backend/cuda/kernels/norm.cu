// RMSNorm fused with the residual add that precedes it in every block:
//   x[r] += delta[r] (when delta is given); out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w
// One block per row; the row is read twice (sum of squares, then scale) from global memory.
extern "C" __global__ void kiln_add_rms_norm_bf16(
    __nv_bfloat16* __restrict__ x,            // [rows, width], updated in place when delta != null
    const __nv_bfloat16* __restrict__ delta,  // [rows, width] or null
    const __nv_bfloat16* __restrict__ w,      // [width]
    __nv_bfloat16* __restrict__ out,          // [rows, width]
    int width, float eps) {
    const long row = blockIdx.x;
    __nv_bfloat16* xr = x + row * width;
    const __nv_bfloat16* dr = delta ? delta + row * width : nullptr;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = __bfloat162float(xr[i]);
        if (dr) {
            v += __bfloat162float(dr[i]);
            xr[i] = __float2bfloat16(v);
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    const float scale = rsqrtf(ss / (float)width + eps);
    __nv_bfloat16* orow = out + row * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        // Re-read the stored (rounded) value, as the next layer will see it.
        orow[i] = __float2bfloat16(__bfloat162float(xr[i]) * scale * __bfloat162float(w[i]));
    }
}
