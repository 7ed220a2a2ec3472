// Weights multiplied as stored, on the tensor cores (W4A16 / W8A16, and bf16 rows): the layouts
// dequant.cu's kiln_packed_matmul_bf16 reads (format 0 Q4 rows, 1 F8Blocks, 2 bf16 rows of a
// multiple of 32 values), for 1 to 32 tokens: decode, verify steps, MoE experts. Its cost per
// weight byte is a fixed unpacking and next to nothing per token, where that kernel spends an
// FMA per weight and token (packed_kernel.rs has the counts).
//
// mma.sync m16n8k16 (bf16 in, f32 accumulate), sm_80's instruction: no wgmma, TMA or shared-
// memory staging, so one source serves sm_90 and sm_120. The weights are the 16-row A operand and
// the tokens B, in up to KILN_MMA_TILES tiles of 8: each lane turns its share of two rows (g and
// g + 8) of a 32-value block into registers once and every token tile is multiplied by them.
// Each block's products are summed by the tensor core unscaled (INT4's integers -8..7 and e4m3's
// values are exact in bf16) and scaled in f32 afterwards, as the CPU's reference scales its
// blocks, so no weight is ever rounded to bf16.
// A thread block of KILN_MMA_WARPS warps takes 16 rows, or 32 to 128 where rows are short
// (`splits`, below): the warps sharing 16 rows split their 32-value blocks (warp w takes blocks
// w, w + splits, ...: together they read neighbouring bytes), so the 256-row slices column-split
// experts have still fill the GPU, and sum through shared memory in warp order at the end
// (deterministic: a token's result does not depend on its neighbours or the batch's size).
#define KILN_MMA_WARPS 8
#define KILN_MMA_TILES 4
#define KILN_MMA_TOKENS (8 * KILN_MMA_TILES)

// d += A B for the warp (fragment layouts: the PTX ISA's "Matrix Fragments for mma.m16n8k16").
__device__ __forceinline__ void mma_m16n8k16(float* d, const u32* a, const u32* b) {
#ifdef KILN_CUDASIM
    kilnsim::mma_bf16_m16n8k16(d, a, b);  // cudasim (CUDA on the CPU): the warp's product
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// (a & mask) | bits in one LOP3 (the compiler's own form takes two: an instruction holds one
// immediate).
__device__ __forceinline__ u32 and_or(u32 a, u32 mask, u32 bits) {
#ifdef KILN_CUDASIM
    return (a & mask) | bits;
#else
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
    return d;
#endif
}

// Two 4-bit values q (bits 0-3 and 16-19 of v) as the bf16 pair q - 8: or-ing q into bf16 128.0's
// mantissa gives 128 + q exactly, and one packed FMA subtracts 136.
__device__ __forceinline__ u32 nibbles_to_bf16x2(u32 v) {
    v = and_or(v, 0x000f000fu, 0x43004300u);
#ifdef KILN_CUDASIM
    return (u32)f32_to_bf16(bf16_to_f32((bf16)(v & 0xffffu)) - 136.0f) |
           ((u32)f32_to_bf16(bf16_to_f32((bf16)(v >> 16)) - 136.0f) << 16);
#else
    u32 r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3f803f80u), "r"(0xc308c308u));
    return r;
#endif
}

// Two e4m3 bytes as a bf16 pair, exactly (every e4m3 value is a bf16 value).
__device__ __forceinline__ u32 e4m3_to_bf16x2(u32 two_bytes) {
    return (__float_as_uint(e4m3_to_f32((u8)(two_bytes & 0xffu))) >> 16) |
           (__float_as_uint(e4m3_to_f32((u8)(two_bytes >> 8))) & 0xffff0000u);
}

__device__ __forceinline__ u32 u16_at(const u8* p) { return *(const unsigned short*)p; }

// This lane's A words for one row (half h: 0 the tile's row g, 1 row g + 8) of block c (values
// 32c .. 32c + 31) and the block's scale: a[s][h] holds columns 16s + 2t and the next,
// a[s][2 + h] columns 16s + 2t + 8 and the next (t = lane % 4). `row` is the row's first byte;
// FORMAT (1 F8Blocks, 2 bf16 rows; Q4 rows have their own loop below) is a template argument
// so each format's loop is compiled alone.
template <int FORMAT>
__device__ __forceinline__ float row_block(const u8* row, int width, int c, int t, int h,
                                           u32 (*a)[4]) {
    if constexpr (FORMAT == 1) {
        // F8Blocks(width): per block of `width` values an f32 scale, then the e4m3 bytes.
        const int first = c * 32;
        const u8* block = row + (long)(first / width) * (4 + width);
        const u8* q = block + 4 + first % width + 2 * t;
        a[0][h] = e4m3_to_bf16x2(u16_at(q));
        a[0][2 + h] = e4m3_to_bf16x2(u16_at(q + 8));
        a[1][h] = e4m3_to_bf16x2(u16_at(q + 16));
        a[1][2 + h] = e4m3_to_bf16x2(u16_at(q + 24));
        return __uint_as_float(u32_at(block));
    } else {
        const u32* p = (const u32*)row + c * 16;
        a[0][h] = p[t];
        a[0][2 + h] = p[4 + t];
        a[1][h] = p[8 + t];
        a[1][2 + h] = p[12 + t];
        return 1.0f;
    }
}

// This lane's B words of block c for its token: b[s][r] holds columns 16s + 8r + 2t and the
// next of the token's row.
__device__ __forceinline__ void token_block(const bf16* x, int c, int t, u32 (*b)[2]) {
    const u32* p = (const u32*)(x + (long)c * 32);
    b[0][0] = p[t];
    b[0][1] = p[4 + t];
    b[1][0] = p[8 + t];
    b[1][1] = p[12 + t];
}

// One warp's share of its 16 rows (near: row g's first byte, far: row g + 8's) against the
// tokens (xrow[j]: this lane's token of tile j), blocks c0, c0 + step, ... of `chunks`: acc[j]
// gets the lane's D values of tile j.
template <int FORMAT>
__device__ __forceinline__ void mma_warp_share(const u8* near, const u8* far, int width,
                                               int chunks, int c0, int step, int tiles,
                                               const bf16* const* xrow,
                                               float (*acc)[4]) {
    const int t = threadIdx.x & 3;
    if constexpr (FORMAT == 0) {
        // Q4 rows, the experts' format: word t of a block holds this lane's 8 values (nibble k
        // value 2t + 8k for k < 4, 2t + 1 + 8(k - 4) after: dequant.cu), so each register's pair
        // is a shift, a mask and a packed FMA. Every pointer walks, one add a block each (a fifth
        // of the loop's instructions, against indexing from the block number).
        const unsigned short* sn = (const unsigned short*)near + c0;
        const unsigned short* sf = (const unsigned short*)far + c0;
        const u32* qn = (const u32*)(near + width) + 4 * c0 + t;
        const u32* qf = (const u32*)(far + width) + 4 * c0 + t;
        const u32* xp[KILN_MMA_TILES];
        for (int j = 0; j < KILN_MMA_TILES; j++) xp[j] = (const u32*)xrow[j] + 16 * c0 + t;
        // The next block's words and scales are loaded before this block is multiplied: one
        // block's 256 bytes a warp are too few to cover the memory's latency at the warps an SM
        // holds, two in flight are not.
        u32 wn = 0, wf = 0;
        unsigned short hn = 0, hf = 0;
        if (c0 < chunks) {
            wn = *qn;
            wf = *qf;
            hn = *sn;
            hf = *sf;
        }
        for (int c = c0; c < chunks; c += step) {
            const u32 cn = wn, cf = wf;
            const float s_near = f16_bits_to_f32(hn), s_far = f16_bits_to_f32(hf);
            if (c + step < chunks) {
                qn += 4 * step;
                qf += 4 * step;
                sn += step;
                sf += step;
                wn = *qn;
                wf = *qf;
                hn = *sn;
                hf = *sf;
            }
            u32 a[2][4];
            a[0][0] = nibbles_to_bf16x2(cn);
            a[0][2] = nibbles_to_bf16x2(cn >> 4);
            a[1][0] = nibbles_to_bf16x2(cn >> 8);
            a[1][2] = nibbles_to_bf16x2(cn >> 12);
            a[0][1] = nibbles_to_bf16x2(cf);
            a[0][3] = nibbles_to_bf16x2(cf >> 4);
            a[1][1] = nibbles_to_bf16x2(cf >> 8);
            a[1][3] = nibbles_to_bf16x2(cf >> 12);
#pragma unroll
            for (int j = 0; j < KILN_MMA_TILES; j++) {
                if (j >= tiles) break;  // uniform over the block: the warp stays converged
                const u32* p = xp[j];
                const u32 b0[2] = {p[0], p[4]}, b1[2] = {p[8], p[12]};
                float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_m16n8k16(d, a[0], b0);
                mma_m16n8k16(d, a[1], b1);
                acc[j][0] += s_near * d[0];
                acc[j][1] += s_near * d[1];
                acc[j][2] += s_far * d[2];
                acc[j][3] += s_far * d[3];
                xp[j] = p + 16 * step;
            }
        }
    } else {
        for (int c = c0; c < chunks; c += step) {
            u32 a[2][4];
            const float s_near = row_block<FORMAT>(near, width, c, t, 0, a);
            const float s_far = row_block<FORMAT>(far, width, c, t, 1, a);
#pragma unroll
            for (int j = 0; j < KILN_MMA_TILES; j++) {
                if (j >= tiles) break;  // uniform over the block: the warp stays converged
                u32 b[2][2];
                token_block(xrow[j], c, t, b);
                float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_m16n8k16(p, a[0], b[0]);
                mma_m16n8k16(p, a[1], b[1]);
                acc[j][0] += s_near * p[0];
                acc[j][1] += s_near * p[1];
                acc[j][2] += s_far * p[2];
                acc[j][3] += s_far * p[3];
            }
        }
    }
}

// The thread block's rows against up to KILN_MMA_TOKENS tokens (xrow[j]: this lane's token of
// tile j, i.e. token 8j + lane / 4; past the run, any token of it): out[tok * rows + row] for
// tok < nt. The block's warps form KILN_MMA_WARPS / splits groups of `splits` (1, 2, 4 or 8);
// group q takes the 16 rows from block_row0 + 16q, its warps every splits-th 32-value block of
// them, so a short row (few blocks) is not cut thinner than the sum in shared memory costs. A
// row past the matrix reads the last row instead and a token past the run another token of it:
// their D values are never written, so the loop needs no tests. Every warp of the block calls
// it (it synchronizes).
__device__ __forceinline__ void mma_rows_times_tokens(const u8* w, int format, int width,
                                                      long row_bytes, int rows, int block_row0,
                                                      int cols, int splits,
                                                      const bf16* const* xrow, int nt,
                                                      bf16* __restrict__ out) {
    __shared__ float partial[KILN_MMA_WARPS][KILN_MMA_TILES * 4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2;
    const int row0 = block_row0 + 16 * (warp / splits);
    const int tiles = (nt + 7) / 8;
    const u8* near = w + (long)min(row0 + g, rows - 1) * row_bytes;
    const u8* far = w + (long)min(row0 + g + 8, rows - 1) * row_bytes;
    float acc[KILN_MMA_TILES][4];
    for (int j = 0; j < KILN_MMA_TILES; j++)
        for (int i = 0; i < 4; i++) acc[j][i] = 0.0f;
    const int chunks = cols / 32, c0 = warp % splits;
    if (format == 0)
        mma_warp_share<0>(near, far, width, chunks, c0, splits, tiles, xrow, acc);
    else if (format == 1)
        mma_warp_share<1>(near, far, width, chunks, c0, splits, tiles, xrow, acc);
    else
        mma_warp_share<2>(near, far, width, chunks, c0, splits, tiles, xrow, acc);
    for (int j = 0; j < KILN_MMA_TILES; j++)
        for (int i = 0; i < 4; i++) partial[warp][j * 4 + i][lane] = acc[j][i];
    __syncthreads();
    // Group q's D value i of lane l in tile j: row block_row0 + 16q + l / 4 + 8 (i / 2), token
    // 8j + 2 (l % 4) + i % 2; its warps' partial sums added in warp order.
    const int groups = KILN_MMA_WARPS / splits;
    for (int e = threadIdx.x; e < groups * KILN_MMA_TILES * 4 * 32; e += blockDim.x) {
        const int q = e / (KILN_MMA_TILES * 4 * 32), ji = (e >> 5) % (KILN_MMA_TILES * 4);
        const int l = e & 31, j = ji >> 2, i = ji & 3;
        const int row = block_row0 + 16 * q + (l >> 2) + 8 * (i >> 1);
        const int tok = 8 * j + 2 * (l & 3) + (i & 1);
        if (row >= rows || tok >= nt) continue;
        float s = 0.0f;
        for (int v = 0; v < splits; v++) s += partial[q * splits + v][ji][l];
        out[(long)tok * rows + row] = f32_to_bf16(s);
    }
}

// out[t][row] = sum_c w[row][c] * x[t][c] for n tokens, as kiln_packed_matmul_bf16, cols a
// multiple of 32; `splits` as above. Grid: (ceil(rows / (16 * KILN_MMA_WARPS / splits)),
// ceil(n / KILN_MMA_TOKENS)); block: 32 * KILN_MMA_WARPS.
extern "C" __global__ void __launch_bounds__(32 * KILN_MMA_WARPS) kiln_packed_mma_bf16(
    const u8* __restrict__ w, int format, int width, long row_bytes, int rows, int cols,
    int splits, const bf16* __restrict__ x, int n, bf16* __restrict__ out) {
    const int t0 = blockIdx.y * KILN_MMA_TOKENS;
    const int nt = min(KILN_MMA_TOKENS, n - t0);
    const int g = (threadIdx.x & 31) >> 2;
    const bf16* xrow[KILN_MMA_TILES];
    for (int j = 0; j < KILN_MMA_TILES; j++) {
        const int tok = 8 * j + g;
        xrow[j] = x + (long)(t0 + min(tok, nt - 1)) * cols;
    }
    const int block_rows = 16 * (KILN_MMA_WARPS / splits);
    mma_rows_times_tokens(w, format, width, row_bytes, rows, blockIdx.x * block_rows, cols,
                          splits, xrow, nt, out + (long)t0 * rows);
}

// The grouped expert matmul on the tensor cores, as dequant.cu's kiln_moe_matmul_bf16 (the same
// arguments plus `splits`, tiles of up to KILN_MMA_TOKENS positions from kiln_moe_group): block
// row y takes tile y (an expert and a run of its sorted positions) and 16 * KILN_MMA_WARPS /
// splits of that expert's rows: out[pos][row] = sum_c w[e * rows + row][c] * x[src(pos)][c].
// Grid: (ceil(rows / (16 * KILN_MMA_WARPS / splits)), max_tiles); block: 32 * KILN_MMA_WARPS;
// cols a multiple of 32.
extern "C" __global__ void __launch_bounds__(32 * KILN_MMA_WARPS) kiln_moe_mma_bf16(
    const u8* __restrict__ w, int format, int width, long row_bytes, int rows, int cols,
    int splits, const bf16* __restrict__ x, int gather_k, const int* __restrict__ pair_of_pos,
    const int* __restrict__ tiles, const int* __restrict__ n_tiles, bf16* __restrict__ out) {
    const int tile = blockIdx.y;
    if (tile >= n_tiles[0]) return;  // the whole block: no warp is left waiting
    const int e = tiles[tile * 3], start = tiles[tile * 3 + 1], nt = tiles[tile * 3 + 2];
    const int g = (threadIdx.x & 31) >> 2;
    const bf16* xrow[KILN_MMA_TILES];
    for (int j = 0; j < KILN_MMA_TILES; j++) {
        const int tok = 8 * j + g;
        const int pos = start + min(tok, nt - 1);
        const long src = gather_k > 0 ? pair_of_pos[pos] / gather_k : pos;
        xrow[j] = x + src * cols;
    }
    const int block_rows = 16 * (KILN_MMA_WARPS / splits);
    mma_rows_times_tokens(w + (long)e * rows * row_bytes, format, width, row_bytes, rows,
                          blockIdx.x * block_rows, cols, splits, xrow, nt,
                          out + (long)start * rows);
}

// The fragment layouts every kernel above relies on, checked alone (`kiln gpu-check`): one warp
// loads a row-major 16x16 A and a 16x8 B (stored b[n][k], as token rows are) into its registers
// where the PTX ISA puts them (lane l, g = l / 4, t = l % 4: A word r holds row g + 8 (r % 2),
// columns 2t + 8 (r / 2) and the next; B word r rows 2t + 8r and the next of column g), runs one
// mma.sync and writes D from where it lands (value r: row g + 8 (r / 2), column 2t + r % 2) to a
// row-major 16x8 d. A wrong layout gives a wrong product here, naming the cause where the packed
// cases would only fail. Grid: 1; block: 32.
extern "C" __global__ void kiln_mma_layout_check(const bf16* __restrict__ a,
                                                 const bf16* __restrict__ b,
                                                 float* __restrict__ d) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const u32* a32 = (const u32*)a;  // 8 words a row
    const u32* b32 = (const u32*)b;  // 8 words a column (b[n][k])
    u32 af[4], bf[2];
    for (int r = 0; r < 4; r++) af[r] = a32[(g + 8 * (r % 2)) * 8 + t + 4 * (r / 2)];
    for (int r = 0; r < 2; r++) bf[r] = b32[g * 8 + t + 4 * r];
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma_m16n8k16(acc, af, bf);
    for (int r = 0; r < 4; r++) d[(g + 8 * (r / 2)) * 8 + 2 * t + r % 2] = acc[r];
}
