// Small row-wise kernels over bf16 activations [rows, row_stride]: bias, residual add, column
// copies and scaling (MLA's per-head layouts), row gathers (the LM head's rows, MoE's tokens) and
// the weighted scatter-add of routed experts' outputs.

// x[r, col_offset + j] += bias[j] for j < width. Grid: (rows, ceil(width / 256)); block: 256.
// (Rows on x: grid.y stops at 65535, a long prefill has more rows.)
extern "C" __global__ void kiln_add_bias_bf16(
    bf16* __restrict__ x, int row_stride, int col_offset,
    const float* __restrict__ bias, int width) {
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= width) return;
    bf16* v = x + (long)blockIdx.x * row_stride + col_offset + j;
    *v = f32_to_bf16(bf16_to_f32(*v) + bias[j]);
}

// x[i] += y[i]. Grid: ceil(n / 256); block: 256.
extern "C" __global__ void kiln_add_bf16(bf16* __restrict__ x, const bf16* __restrict__ y, long n) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
}

// dst[r, dst_col + j] = src[r, src_col + j] for j < width. Grid: (rows, ceil(width / 256)).
extern "C" __global__ void kiln_copy_columns_bf16(
    const bf16* __restrict__ src, int src_stride, int src_col,
    bf16* __restrict__ dst, int dst_stride, int dst_col, int width) {
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= width) return;
    const long r = blockIdx.x;
    dst[r * dst_stride + dst_col + j] = src[r * src_stride + src_col + j];
}

// x[r, col + j] *= factor for j < width. Grid: (rows, ceil(width / 256)).
extern "C" __global__ void kiln_scale_columns_bf16(
    bf16* __restrict__ x, int row_stride, int col, int width, float factor) {
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= width) return;
    bf16* v = x + (long)blockIdx.x * row_stride + col + j;
    *v = f32_to_bf16(bf16_to_f32(*v) * factor);
}

// out[i] = x[rows[i]]. Grid: n; block: 256.
extern "C" __global__ void kiln_gather_rows_bf16(
    const bf16* __restrict__ x, int width, const int* __restrict__ rows, bf16* __restrict__ out) {
    const long i = blockIdx.x;
    const long r = rows[i];
    for (int j = threadIdx.x; j < width; j += blockDim.x) out[i * width + j] = x[r * width + j];
}

// dst[rows[i]] += weights[i] * src[i], i in order. One thread per column walks every i, so two
// experts adding to the same token never race and the sum's order is fixed.
// Grid: ceil(width / 256); block: 256.
extern "C" __global__ void kiln_scatter_add_rows_bf16(
    bf16* __restrict__ dst, const bf16* __restrict__ src, int width,
    const int* __restrict__ rows, const float* __restrict__ weights, int n) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= width) return;
    for (int i = 0; i < n; i++) {
        bf16* d = dst + (long)rows[i] * width + j;
        *d = f32_to_bf16(bf16_to_f32(*d) + weights[i] * bf16_to_f32(src[(long)i * width + j]));
    }
}

// For each head h < count: dst[r, dst_first + h * dst_head + j] = src[r, src_first + h * src_head + j],
// j < width (MLA assembles every head's rotary and latent parts in one launch; a head stride of 0
// copies one source block to every head). Grid: (rows, ceil(width / 256), count); block: 256.
extern "C" __global__ void kiln_copy_head_columns_bf16(
    const bf16* __restrict__ src, int src_stride, int src_first, int src_head,
    bf16* __restrict__ dst, int dst_stride, int dst_first, int dst_head, int width) {
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= width) return;
    const long r = blockIdx.x;
    const int h = blockIdx.z;
    dst[r * dst_stride + dst_first + h * dst_head + j] = src[r * src_stride + src_first + h * src_head + j];
}
