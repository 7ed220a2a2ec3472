// Weights to bf16 on the GPU at load: the stored bytes of one tensor go up as they are, and one
// thread per stored block writes its values (the bit layouts of ggml-quants.c, as the host's
// weights/dtype.rs `dequantize` reads them). Every byte is read singly: GGUF blocks of 18, 20,
// 22, 34 or 210 bytes sit at any alignment. (The packed kernels further down read their own
// device layout, Q4 rows, with aligned 128-bit loads.)
//
// `dtype` is the ggml type id: 0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K,
// 13 Q5_K, 14 Q6_K, 30 BF16.

// The 6-bit scale and min of sub-block j (0..8) of a Q4_K / Q5_K super-block.
__device__ __forceinline__ void k_scale_min(int j, const u8* q, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

extern "C" __global__ void kiln_dequant_bf16(const u8* __restrict__ src, int dtype, long n_blocks,
                                             bf16* __restrict__ dst) {
    const long blk = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (blk >= n_blocks) return;
    switch (dtype) {
    case 0: dst[blk] = f32_to_bf16(__uint_as_float(u32_at(src + blk * 4))); break;
    case 1: dst[blk] = f32_to_bf16(f16_at(src + blk * 2)); break;
    case 30: dst[blk] = (bf16)(src[blk * 2] | (src[blk * 2 + 1] << 8)); break;
    case 2: {  // Q4_0: d, 16 bytes of nibbles, offset 8
        const u8* b = src + blk * 18;
        bf16* y = dst + blk * 32;
        const float d = f16_at(b);
        for (int j = 0; j < 16; j++) {
            y[j] = f32_to_bf16((float)((int)(b[2 + j] & 0x0f) - 8) * d);
            y[j + 16] = f32_to_bf16((float)((int)(b[2 + j] >> 4) - 8) * d);
        }
    } break;
    case 3: {  // Q4_1: d, m, 16 bytes of nibbles
        const u8* b = src + blk * 20;
        bf16* y = dst + blk * 32;
        const float d = f16_at(b), m = f16_at(b + 2);
        for (int j = 0; j < 16; j++) {
            y[j] = f32_to_bf16((float)(b[4 + j] & 0x0f) * d + m);
            y[j + 16] = f32_to_bf16((float)(b[4 + j] >> 4) * d + m);
        }
    } break;
    case 6: {  // Q5_0: d, 32 high bits, 16 bytes of nibbles, offset 16
        const u8* b = src + blk * 22;
        bf16* y = dst + blk * 32;
        const float d = f16_at(b);
        const u32 qh = u32_at(b + 2);
        for (int j = 0; j < 16; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
            y[j] = f32_to_bf16((float)(((b[6 + j] & 0x0f) | h0) - 16) * d);
            y[j + 16] = f32_to_bf16((float)(((b[6 + j] >> 4) | h1) - 16) * d);
        }
    } break;
    case 7: {  // Q5_1: d, m, 32 high bits, 16 bytes of nibbles
        const u8* b = src + blk * 24;
        bf16* y = dst + blk * 32;
        const float d = f16_at(b), m = f16_at(b + 2);
        const u32 qh = u32_at(b + 4);
        for (int j = 0; j < 16; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
            y[j] = f32_to_bf16((float)((b[8 + j] & 0x0f) | h0) * d + m);
            y[j + 16] = f32_to_bf16((float)((b[8 + j] >> 4) | h1) * d + m);
        }
    } break;
    case 8: {  // Q8_0: d, 32 signed bytes
        const u8* b = src + blk * 34;
        bf16* y = dst + blk * 32;
        const float d = f16_at(b);
        for (int j = 0; j < 32; j++) y[j] = f32_to_bf16((float)(signed char)b[2 + j] * d);
    } break;
    case 12: {  // Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
        const u8* b = src + blk * 144;
        bf16* y = dst + blk * 256;
        const float d = f16_at(b), dmin = f16_at(b + 2);
        for (int c = 0; c < 4; c++) {
            float sc1, m1, sc2, m2;
            k_scale_min(2 * c, b + 4, &sc1, &m1);
            k_scale_min(2 * c + 1, b + 4, &sc2, &m2);
            const u8* q = b + 16 + 32 * c;
            for (int l = 0; l < 32; l++) {
                y[64 * c + l] = f32_to_bf16(d * sc1 * (float)(q[l] & 0x0f) - dmin * m1);
                y[64 * c + l + 32] = f32_to_bf16(d * sc2 * (float)(q[l] >> 4) - dmin * m2);
            }
        }
    } break;
    case 13: {  // Q5_K: as Q4_K with 32 bytes of high bits before the nibbles
        const u8* b = src + blk * 176;
        bf16* y = dst + blk * 256;
        const float d = f16_at(b), dmin = f16_at(b + 2);
        const u8* qh = b + 16;
        for (int c = 0; c < 4; c++) {
            float sc1, m1, sc2, m2;
            k_scale_min(2 * c, b + 4, &sc1, &m1);
            k_scale_min(2 * c + 1, b + 4, &sc2, &m2);
            const u8* q = b + 48 + 32 * c;
            const u8 u1 = (u8)(1u << (2 * c)), u2 = (u8)(2u << (2 * c));
            for (int l = 0; l < 32; l++) {
                const int h1 = (qh[l] & u1) ? 16 : 0, h2 = (qh[l] & u2) ? 16 : 0;
                y[64 * c + l] = f32_to_bf16(d * sc1 * (float)((q[l] & 0x0f) + h1) - dmin * m1);
                y[64 * c + l + 32] = f32_to_bf16(d * sc2 * (float)((q[l] >> 4) + h2) - dmin * m2);
            }
        }
    } break;
    case 14: {  // Q6_K: 128 bytes of low nibbles, 64 of high pairs, 16 signed scales, d last
        const u8* b = src + blk * 210;
        bf16* y = dst + blk * 256;
        const float d = f16_at(b + 208);
        for (int half = 0; half < 2; half++) {
            const u8* ql = b + 64 * half;
            const u8* qh = b + 128 + 32 * half;
            const signed char* sc = (const signed char*)(b + 192 + 8 * half);
            bf16* out = y + 128 * half;
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = (int)((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32;
                const int q2 = (int)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                out[l] = f32_to_bf16(d * (float)sc[is] * (float)q1);
                out[l + 32] = f32_to_bf16(d * (float)sc[is + 2] * (float)q2);
                out[l + 64] = f32_to_bf16(d * (float)sc[is + 4] * (float)q3);
                out[l + 96] = f32_to_bf16(d * (float)sc[is + 6] * (float)q4);
            }
        }
    } break;
    default: break;
    }
}

// DeepSeek-V3's block FP8 as kiln keeps it (weights/dtype.rs `F8Blocks`): per block an f32 scale,
// then `width` e4m3 bytes (never the NaN pattern, refused at load). One thread per value: the
// blocks are 132 bytes at DeepSeek's width, and a thread per block would leave most lanes idle.
extern "C" __global__ void kiln_dequant_f8_blocks_bf16(const u8* __restrict__ src, int width,
                                                       long n_values, bf16* __restrict__ dst) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_values) return;
    const u8* block = src + (i / width) * (4 + width);
    const float scale = __uint_as_float(u32_at(block));
    dst[i] = f32_to_bf16(e4m3_to_f32(block[4 + i % width]) * scale);
}

// Weights multiplied as stored (W4A16 / W8A16): Kimi-K2-Thinking's INT4 experts as Q4_0 blocks and
// DeepSeek-V3's block FP8 as F8Blocks stay packed in GPU memory, a quarter and a half of bf16, and
// this kernel reads them with bf16 activations. One warp per output row, its lanes striding over the
// row's 32-value chunks, KILN_PACKED_TOKENS tokens per pass so each weight byte is read once per
// pass. packed_mma.cu's tensor-core kernels serve by default (packed_kernel.rs: half the
// instructions per weight byte at one token, a fraction per extra token); these stay for bf16
// experts whose widths are no multiple of 32, as the alternative `kiln gpu-check` times and
// checks, and (row_times_tokens) for the per-head matmul below. Plain loads and FMAs, so one source serves sm_90 and sm_120.
// out[t][row] = sum_c w[row][c] * x[t][c].
//
// format 0: Q4_0 as the device lays it out (Q4 rows): per row, its cols / 32 f16 scales padded to
// `width` bytes (a multiple of 16), then a 16-byte block of nibbles per 32 values; row_bytes =
// width + cols / 2, a multiple of 16, so every block is one aligned 128-bit load. Within a block
// the nibbles are in the tensor cores' order (packed_mma.cu): 32-bit word t holds, from its low
// nibble up, values 2t, 2t + 8, 2t + 16, 2t + 24, then 2t + 1, 2t + 9, 2t + 17, 2t + 25, so the
// lane that multiplies those columns takes one word and a shift and mask per pair of values.
// format 1: F8Blocks(width), width a multiple of 32, row_bytes = cols / width * (4 + width). Grid: (ceil(rows / KILN_PACKED_WARPS),
// ceil(n / KILN_PACKED_TOKENS)); block: 32 * KILN_PACKED_WARPS threads.
#define KILN_PACKED_TOKENS 8
#define KILN_PACKED_WARPS 8

// The value (0..31) of a Q4 rows block's word t, nibble k (from the low end): 2t + 8k for
// k < 4, 2t + 1 + 8(k - 4) after.
#define Q4_NIBBLE_VALUE(t, k) (2 * (t) + ((k) >> 2) + 8 * ((k) & 3))

// 16 bytes, aligned for one 128-bit load.
struct alignas(16) Bytes16 {
    u32 w[4];
};

__device__ __forceinline__ void packed_chunk(const u8* row, int format, int width, int c, float* v) {
    if (format == 0) {
        // Q4 rows: f16 scales at the row's start, block c's 16 nibble bytes at width + 16 c, word
        // t's nibble k (from the low end) value Q4_NIBBLE_VALUE(t, k).
        const float d = f16_at(row + c * 2);
        const Bytes16 q = *(const Bytes16*)(row + width + (long)c * 16);
#pragma unroll
        for (int t = 0; t < 4; t++) {
#pragma unroll
            for (int k = 0; k < 8; k++)
                v[Q4_NIBBLE_VALUE(t, k)] = (float)((int)((q.w[t] >> (4 * k)) & 0x0fu) - 8) * d;
        }
    } else {
        const int first = c * 32;
        const u8* block = row + (long)(first / width) * (4 + width);
        const float scale = __uint_as_float(u32_at(block));
        const u8* q = block + 4 + first % width;
        for (int j = 0; j < 32; j++) v[j] = e4m3_to_f32(q[j]) * scale;
    }
}

// One warp's row of weights against up to KILN_PACKED_TOKENS token rows: acc[t] gets the warp's
// sum of w[c] * xr[t][c] for t < nt (every lane holds it after the shuffles). Formats 0 and 1
// read whole 32-value chunks, lanes striding over them; format 2 (bf16 rows of any length)
// single values. xr[t] for t >= nt are never read.
__device__ __forceinline__ void row_times_tokens(const u8* wr, int format, int width, int cols,
                                                 const bf16* const* xr, int nt, float* acc) {
    const int lane = threadIdx.x & 31;
    for (int t = 0; t < KILN_PACKED_TOKENS; t++) acc[t] = 0.f;
    if (format == 2) {
        const bf16* wb = (const bf16*)wr;
        for (int c = lane; c < cols; c += 32) {
            const float wv = bf16_to_f32(wb[c]);
            for (int t = 0; t < KILN_PACKED_TOKENS; t++) {
                if (t >= nt) break;
                acc[t] += wv * bf16_to_f32(xr[t][c]);
            }
        }
    } else {
        float v[32];
        for (int c = lane; c < cols / 32; c += 32) {
            packed_chunk(wr, format, width, c, v);
            for (int t = 0; t < KILN_PACKED_TOKENS; t++) {
                if (t >= nt) break;
                const bf16* xc = xr[t] + c * 32;
                float s = 0.f;
                for (int j = 0; j < 32; j++) s += v[j] * bf16_to_f32(xc[j]);
                acc[t] += s;
            }
        }
    }
    for (int t = 0; t < KILN_PACKED_TOKENS; t++) acc[t] = warp_sum(acc[t]);
}

extern "C" __global__ void kiln_packed_matmul_bf16(const u8* __restrict__ w, int format, int width,
                                                   long row_bytes, int rows, int cols,
                                                   const bf16* __restrict__ x, int n,
                                                   bf16* __restrict__ out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * KILN_PACKED_WARPS + warp;
    // The whole warp shares its row: it leaves together, before any shuffle.
    if (row >= rows) return;
    const int t0 = blockIdx.y * KILN_PACKED_TOKENS;
    const int nt = min(KILN_PACKED_TOKENS, n - t0);
    const u8* wr = w + (long)row * row_bytes;
    const bf16* xr[KILN_PACKED_TOKENS];
    for (int t = 0; t < KILN_PACKED_TOKENS; t++) xr[t] = x + (long)(t0 + min(t, nt - 1)) * cols;
    float acc[KILN_PACKED_TOKENS];
    row_times_tokens(wr, format, width, cols, xr, nt, acc);
    for (int t = 0; t < KILN_PACKED_TOKENS; t++)
        if (lane == 0 && t < nt) out[(long)(t0 + t) * rows + row] = f32_to_bf16(acc[t]);
}

// One matrix per head (MLA's absorbed W_UK^T and W_UV, stacked head after head: head h's rows are
// h * rows .. (h + 1) * rows), each multiplying its own head's columns of x:
// out[t][out_first + h * out_head + row] = sum_c w[h * rows + row][c] * x[t][x_first + h * x_head + c].
// As kiln_packed_matmul_bf16 otherwise, plus format 2: bf16 rows of any length (row_bytes =
// cols * 2). Grid: (ceil(rows / KILN_PACKED_WARPS), ceil(n / KILN_PACKED_TOKENS), heads); block:
// 32 * KILN_PACKED_WARPS threads.
extern "C" __global__ void kiln_head_matmul_bf16(const u8* __restrict__ w, int format, int width,
                                                 long row_bytes, int rows, int cols,
                                                 const bf16* __restrict__ x, int x_stride,
                                                 int x_first, int x_head, int n,
                                                 bf16* __restrict__ out, int out_stride,
                                                 int out_first, int out_head) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * KILN_PACKED_WARPS + warp;
    if (row >= rows) return;
    const int h = blockIdx.z;
    const int t0 = blockIdx.y * KILN_PACKED_TOKENS;
    const int nt = min(KILN_PACKED_TOKENS, n - t0);
    const u8* wr = w + ((long)h * rows + row) * row_bytes;
    const bf16* xh = x + x_first + (long)h * x_head;
    const bf16* xr[KILN_PACKED_TOKENS];
    for (int t = 0; t < KILN_PACKED_TOKENS; t++) xr[t] = xh + (long)(t0 + min(t, nt - 1)) * x_stride;
    float acc[KILN_PACKED_TOKENS];
    row_times_tokens(wr, format, width, cols, xr, nt, acc);
    for (int t = 0; t < KILN_PACKED_TOKENS; t++)
        if (lane == 0 && t < nt)
            out[(long)(t0 + t) * out_stride + out_first + (long)h * out_head + row] =
                f32_to_bf16(acc[t]);
}

// The grouped expert matmul at decode sizes: block row y takes tile y (an expert and a run of
// its sorted positions); its warps take rows of that expert's matrix (rows `rows` per expert,
// stacked expert after expert) and multiply every position of the run:
// out[pos][row] = sum_c w[e * rows + row][c] * x[src(pos)][c], src(pos) = pair_of_pos[pos] / k
// (the pair's token) when gather_k > 0, else pos. Weights as kiln_head_matmul_bf16 reads them
// (format 0 Q4_0, 1 F8Blocks, 2 bf16). Grid: (ceil(rows / KILN_PACKED_WARPS), max_tiles); block:
// 32 * KILN_PACKED_WARPS.
extern "C" __global__ void kiln_moe_matmul_bf16(const u8* __restrict__ w, int format, int width,
                                                long row_bytes, int rows, int cols,
                                                const bf16* __restrict__ x, int gather_k,
                                                const int* __restrict__ pair_of_pos,
                                                const int* __restrict__ tiles,
                                                const int* __restrict__ n_tiles,
                                                bf16* __restrict__ out) {
    const int tile = blockIdx.y;
    if (tile >= n_tiles[0]) return;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * KILN_PACKED_WARPS + warp;
    if (row >= rows) return;
    const int e = tiles[tile * 3], start = tiles[tile * 3 + 1], nt = tiles[tile * 3 + 2];
    const u8* wr = w + ((long)e * rows + row) * row_bytes;
    const bf16* xr[KILN_PACKED_TOKENS];
    for (int t = 0; t < KILN_PACKED_TOKENS; t++) {
        const int pos = start + min(t, nt - 1);
        const long src = gather_k > 0 ? pair_of_pos[pos] / gather_k : pos;
        xr[t] = x + src * cols;
    }
    float acc[KILN_PACKED_TOKENS];
    row_times_tokens(wr, format, width, cols, xr, nt, acc);
    for (int t = 0; t < KILN_PACKED_TOKENS; t++)
        if (lane == 0 && t < nt) out[(long)(start + t) * rows + row] = f32_to_bf16(acc[t]);
}

// Stored Q4_0 blocks (18 bytes: an f16 scale, 16 bytes of nibbles, byte j holding value j low and
// value j + 16 high) into Q4 rows (format 0 above): block b of a row of `cols` values gives its
// scale to bytes 2b.. of the row and its nibbles, in the tensor cores' order, to bytes
// scales + 16b... Grid: ceil(n_blocks / 256); block: 256.
extern "C" __global__ void kiln_q4_0_to_rows(const u8* __restrict__ src, int cols, int scales,
                                             long row_bytes, long n_blocks, u8* __restrict__ dst) {
    const long blk = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (blk >= n_blocks) return;
    const int per_row = cols / 32;
    const long row = blk / per_row;
    const int c = (int)(blk % per_row);
    const u8* b = src + blk * 18;
    u8* r = dst + row * row_bytes;
    r[c * 2] = b[0];
    r[c * 2 + 1] = b[1];
    const u8* q = b + 2;
    for (int t = 0; t < 4; t++) {
        u32 word = 0;
        for (int k = 0; k < 8; k++) {
            const int value = Q4_NIBBLE_VALUE(t, k);
            const u32 nibble = value < 16 ? (q[value] & 0x0fu) : (q[value - 16] >> 4);
            word |= nibble << (4 * k);
        }
        for (int i = 0; i < 4; i++) r[scales + c * 16 + 4 * t + i] = (u8)(word >> (8 * i));
    }
}

// Q4 rows (format 0) widened to bf16 for cuBLASLt (prefill): one thread per 32-value block.
// Grid: ceil(n_blocks / 256); block: 256.
extern "C" __global__ void kiln_dequant_q4_rows_bf16(const u8* __restrict__ src, int cols,
                                                     int scales, long row_bytes, long n_blocks,
                                                     bf16* __restrict__ dst) {
    const long blk = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (blk >= n_blocks) return;
    const int per_row = cols / 32;
    const long row = blk / per_row;
    const int c = (int)(blk % per_row);
    float v[32];
    packed_chunk(src + row * row_bytes, 0, scales, c, v);
    for (int j = 0; j < 32; j++) dst[blk * 32 + j] = f32_to_bf16(v[j]);
}
