// MLA's absorbed attention (DeepSeek-V3, Kimi-K2): every query head scores [q_pe | q_latent]
// against its sequence's cached rows [k_pe | latent] (one row per position, shared by all heads:
// multi-query attention) and takes the rows' latent columns as its values. Those rows are 576
// values wide for these models (64 + 512), past the paged kernel's heads of up to 256, and the
// heads sharing them are many (64 per layer; 8 per GPU at tensor parallelism 8). So one block
// serves a chunk of `chunk` heads of one token: each tile of KILN_MLA_TILE cached rows is read
// into shared memory once and serves every head of the chunk as keys and as values. A warp
// computes one score at a time (lanes along the row, then a shuffle sum); the softmax is online.
// With one split the block writes the normalized output; with several, its unnormalized
// accumulator and (max, sum) for kiln_attention_combine (its head_dim = the latent width).
//
// Masks as kiln_paged_attention_bf16: causal up to the token's cache position, and EAGLE trees
// (positions from tree_base[t] on visible only where their bit of tree_rows[t] is set).
//
// Dynamic shared memory: chunk * width floats (queries), TILE * (width + PAD) bf16 (the tile),
// chunk * TILE floats (scores), 3 * chunk floats (max, sum, correction).
#define KILN_MLA_THREADS 256
#define KILN_MLA_TILE 16
// Outputs each thread accumulates, at most: chunk * latent <= 256 * 16 (8 heads of 512).
#define KILN_MLA_MAX_OUT 16
// Tile rows padded by one 32-bit word, as in the paged kernel.
#define KILN_MLA_PAD 2

extern "C" __global__ void __launch_bounds__(KILN_MLA_THREADS) kiln_mla_attention_bf16(
    const bf16* __restrict__ qkv, int row_stride,  // query heads of `width` from column 0
    const bf16* __restrict__ cache,                // this layer's rows [slots, width]
    const int* __restrict__ token_seq,             // [tokens] -> sequence index
    const int* __restrict__ token_pos,             // [tokens] cache position (-1: none)
    const int* __restrict__ block_tables,          // [n_seqs, max_blocks]
    int max_blocks, int block_size, int n_heads, int chunk, int width, int rope, float scale,
    const int* __restrict__ tree_base,             // [tokens]
    const u64* __restrict__ tree_rows,             // [tokens]
    int n_splits,
    bf16* __restrict__ out,                        // [tokens, n_heads * latent] (one split)
    float* __restrict__ part_acc,                  // [tokens, n_heads, n_splits, latent]
    float* __restrict__ part_ml) {                 // [tokens, n_heads, n_splits, 2]
    extern __shared__ float smem[];
    const int t = blockIdx.x, h0 = blockIdx.y * chunk, split = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int latent = width - rope;
    const int n_out = chunk * latent;
    const int k_stride = width + KILN_MLA_PAD;
    float* q_s = smem;                                   // [chunk * width]
    bf16* k_s = (bf16*)(q_s + chunk * width);            // [TILE * k_stride]
    float* s_s = (float*)(k_s + KILN_MLA_TILE * k_stride);  // [chunk * TILE]
    float* m_s = s_s + chunk * KILN_MLA_TILE;            // [chunk]
    float* l_s = m_s + chunk;                            // [chunk]
    float* c_s = l_s + chunk;                            // [chunk]

    const int seq = token_seq[t], pos = token_pos[t];
    const int* table = block_tables + (long)seq * max_blocks;
    const int base = tree_base[t];
    const u64 row_bits = tree_rows[t];
    // Each token divides its own context among the splits, whole tiles each.
    const int per_split = (pos + n_splits) / n_splits;
    const int split_len = (per_split + KILN_MLA_TILE - 1) / KILN_MLA_TILE * KILN_MLA_TILE;
    const int start = split * split_len;
    const int end = min(pos + 1, start + split_len);

    const bf16* q = qkv + (long)t * row_stride + (long)h0 * width;
    for (int i = tid; i < chunk * width; i += KILN_MLA_THREADS) q_s[i] = bf16_to_f32(q[i]) * scale;
    for (int g = tid; g < chunk; g += KILN_MLA_THREADS) {
        m_s[g] = -KILN_INF;
        l_s[g] = 0.0f;
    }
    float acc[KILN_MLA_MAX_OUT];
#pragma unroll
    for (int k = 0; k < KILN_MLA_MAX_OUT; k++) acc[k] = 0.0f;
    __syncthreads();

    for (int p0 = start; p0 < end; p0 += KILN_MLA_TILE) {
        const int n_keys = min(KILN_MLA_TILE, end - p0);
        for (int idx = tid; idx < n_keys * width; idx += KILN_MLA_THREADS) {
            const int j = idx / width, d = idx % width;
            const int p = p0 + j;
            const long slot = (long)table[p / block_size] * block_size + p % block_size;
            k_s[j * k_stride + d] = cache[slot * width + d];
        }
        __syncthreads();
        // One warp per score; `idx` is the same across the warp, so the shuffle sum inside the
        // branch is taken by every lane or by none.
        for (int idx = warp; idx < chunk * KILN_MLA_TILE; idx += KILN_MLA_THREADS / 32) {
            const int g = idx / KILN_MLA_TILE, j = idx % KILN_MLA_TILE;
            const int p = p0 + j;
            const bool visible =
                j < n_keys && (p < base || (p - base < 64 && ((row_bits >> (p - base)) & 1ull)));
            float s = -KILN_INF;
            if (visible) {
                const float* qg = q_s + g * width;
                const bf16* kj = k_s + j * k_stride;
                float part = 0.0f;
                for (int d = lane; d < width; d += 32) part += qg[d] * bf16_to_f32(kj[d]);
                s = warp_sum(part);
            }
            if (lane == 0) s_s[idx] = s;
        }
        __syncthreads();
        online_softmax_tile(s_s, m_s, l_s, c_s, chunk, KILN_MLA_TILE, tid, KILN_MLA_THREADS);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < KILN_MLA_MAX_OUT; k++) {
            const int idx = tid + k * KILN_MLA_THREADS;
            if (idx < n_out) {
                const int g = idx / latent, d = idx % latent;
                const float* pg = s_s + g * KILN_MLA_TILE;
                float a = acc[k] * c_s[g];
                for (int j = 0; j < n_keys; j++)
                    a += pg[j] * bf16_to_f32(k_s[j * k_stride + rope + d]);
                acc[k] = a;
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int k = 0; k < KILN_MLA_MAX_OUT; k++) {
        const int idx = tid + k * KILN_MLA_THREADS;
        if (idx < n_out) {
            const int g = idx / latent, d = idx % latent;
            const long h = h0 + g;
            if (n_splits == 1) {
                const float l = l_s[g];
                out[((long)t * n_heads + h) * latent + d] = f32_to_bf16(l > 0.0f ? acc[k] / l : 0.0f);
            } else {
                part_acc[(((long)t * n_heads + h) * n_splits + split) * latent + d] = acc[k];
            }
        }
    }
    if (n_splits > 1) {
        for (int g = tid; g < chunk; g += KILN_MLA_THREADS) {
            const long at = ((long)t * n_heads + h0 + g) * n_splits + split;
            part_ml[at * 2] = m_s[g];
            part_ml[at * 2 + 1] = l_s[g];
        }
    }
}
