// Paged attention over a KV cache in fixed-size blocks, for decode and chunked prefill alike: each
// new token attends to its sequence's positions 0..=its own (causal), found through the sequence's
// block table. Grouped-query: query head h reads KV head h / (n_heads / n_kv_heads).
//
// Cache layout per layer: K and V planes, each [n_blocks * block_size, n_kv_heads * head_dim] bf16
// (slot = block * block_size + offset).
//
// EAGLE trees: a token with tree_base[t] = b sees the positions from b on only where bit (p - b) of
// tree_rows[t] is set (its ancestors and itself); positions before b (the accepted prefix) are all
// visible. A causal token has tree_base = INT_MAX.
#define KILN_ATTN_THREADS 128
#define KILN_ATTN_TILE 32
// Outputs (query heads of one KV head times head_dim) each thread accumulates, at most: a group of
// up to 2048 values (e.g. 8 heads of 256, 16 of 128).
#define KILN_ATTN_MAX_OUT 16
// K and V tile rows are padded by one 32-bit word: with an odd word stride, the lanes of a warp
// reading one column of 32 different keys hit 32 different banks.
#define KILN_ATTN_PAD 2

// Copies this step's K and V rows of the fused qkv buffer into their cache slots: token t goes
// to slot table[pos / block_size] * block_size + pos % block_size of its sequence, pos being its
// cache position (-1: skip). Grid: rows.
extern "C" __global__ void kiln_kv_write_bf16(
    const bf16* __restrict__ qkv, int row_stride, int k_col, int v_col,
    const int* __restrict__ token_seq, const int* __restrict__ cache_pos,
    const int* __restrict__ block_tables, int max_blocks, int block_size,
    bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int kv_width) {
    const long row = blockIdx.x;
    const int pos = cache_pos[row];
    if (pos < 0) return;
    const int block = block_tables[(long)token_seq[row] * max_blocks + pos / block_size];
    if (block < 0) return;
    const long slot = (long)block * block_size + pos % block_size;
    for (int i = threadIdx.x; i < kv_width; i += blockDim.x) {
        k_cache[slot * kv_width + i] = qkv[row * row_stride + k_col + i];
        // v_col -1: the store keeps keys only (MLA reads its values from them).
        if (v_col >= 0) v_cache[slot * kv_width + i] = qkv[row * row_stride + v_col + i];
    }
}

// Moves cached rows within every layer, in order: for each move m, slot to[m] gets what slot
// from[m] held (tree verification keeps the accepted path). Sequential across moves (a later move
// may read what an earlier one wrote), parallel within a row. Grid: planes (2 per layer, 1 when
// the store keeps keys only); the cache is planes of n_slots * width values each.
extern "C" __global__ void kiln_kv_move_bf16(
    bf16* __restrict__ cache, long plane_len, int width,
    const int* __restrict__ from, const int* __restrict__ to, int n_moves) {
    bf16* plane = cache + (long)blockIdx.x * plane_len;
    for (int m = 0; m < n_moves; m++) {
        const long src = (long)from[m] * width, dst = (long)to[m] * width;
        for (int i = threadIdx.x; i < width; i += blockDim.x) plane[dst + i] = plane[src + i];
        __syncthreads();
    }
}

// One block per (token, KV head, split): every query head of the group attends over the split's
// positions, a tile of KILN_ATTN_TILE keys at a time. The tile's K and V rows are loaded into
// shared memory once (coalesced along the head dimension) and read by all the group's heads; the
// scores of a tile are one dot product per thread; the softmax is online (running max and sum per
// head). With one split the block writes the normalized output; with several it writes its
// unnormalized accumulator and its (max, sum) for kiln_attention_combine.
//
// Dynamic shared memory: group * head_dim floats (queries), 2 * TILE * (head_dim + PAD) bf16 (K and
// V tiles), group * TILE floats (scores), 3 * group floats (max, sum, correction).
extern "C" __global__ void kiln_paged_attention_bf16(
    const bf16* __restrict__ qkv, int row_stride,  // queries at column 0
    const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
    const int* __restrict__ token_seq,     // [tokens] -> sequence index
    const int* __restrict__ token_pos,     // [tokens] cache position (-1: none)
    const int* __restrict__ block_tables,  // [n_seqs, max_blocks]
    int max_blocks, int block_size, int n_heads, int n_kv_heads, int head_dim, float scale,
    const int* __restrict__ tree_base,     // [tokens]
    const u64* __restrict__ tree_rows,     // [tokens]
    int n_splits,
    bf16* __restrict__ out,                // [tokens, n_heads * head_dim] (one split)
    float* __restrict__ part_acc,          // [tokens, n_heads, n_splits, head_dim] (several)
    float* __restrict__ part_ml) {         // [tokens, n_heads, n_splits, 2]
    extern __shared__ float smem[];
    const int t = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    const int tid = threadIdx.x;
    const int group = n_heads / n_kv_heads;
    const int n_out = group * head_dim;
    const int kv_width = n_kv_heads * head_dim;
    const int k_stride = head_dim + KILN_ATTN_PAD;
    float* q_s = smem;                                   // [group * head_dim]
    bf16* k_s = (bf16*)(q_s + n_out);                    // [TILE * k_stride]
    bf16* v_s = k_s + KILN_ATTN_TILE * k_stride;         // [TILE * k_stride]
    float* s_s = (float*)(v_s + KILN_ATTN_TILE * k_stride);  // [group * TILE]
    float* m_s = s_s + group * KILN_ATTN_TILE;           // [group]
    float* l_s = m_s + group;                            // [group]
    float* c_s = l_s + group;                            // [group]

    const int seq = token_seq[t], pos = token_pos[t];
    const int* table = block_tables + (long)seq * max_blocks;
    const int base = tree_base[t];
    const u64 row_bits = tree_rows[t];
    // Each token divides its own context among the splits (whole tiles each), so the split
    // count may be fixed for a recorded graph whatever the context.
    const int per_split = (pos + n_splits) / n_splits;  // ceil((pos + 1) / n_splits)
    const int split_len = (per_split + KILN_ATTN_TILE - 1) / KILN_ATTN_TILE * KILN_ATTN_TILE;
    const int start = split * split_len;
    const int end = min(pos + 1, start + split_len);

    const bf16* q = qkv + (long)t * row_stride + kvh * group * head_dim;
    for (int i = tid; i < n_out; i += KILN_ATTN_THREADS) q_s[i] = bf16_to_f32(q[i]) * scale;
    for (int g = tid; g < group; g += KILN_ATTN_THREADS) {
        m_s[g] = -KILN_INF;
        l_s[g] = 0.0f;
    }
    float acc[KILN_ATTN_MAX_OUT];
#pragma unroll
    for (int k = 0; k < KILN_ATTN_MAX_OUT; k++) acc[k] = 0.0f;
    __syncthreads();

    for (int p0 = start; p0 < end; p0 += KILN_ATTN_TILE) {
        const int n_keys = min(KILN_ATTN_TILE, end - p0);
        for (int idx = tid; idx < n_keys * head_dim; idx += KILN_ATTN_THREADS) {
            const int j = idx / head_dim, d = idx % head_dim;
            const int p = p0 + j;
            const long slot = (long)table[p / block_size] * block_size + p % block_size;
            const long at = slot * kv_width + kvh * head_dim + d;
            k_s[j * k_stride + d] = k_cache[at];
            v_s[j * k_stride + d] = v_cache[at];
        }
        __syncthreads();
        for (int idx = tid; idx < group * KILN_ATTN_TILE; idx += KILN_ATTN_THREADS) {
            const int g = idx / KILN_ATTN_TILE, j = idx % KILN_ATTN_TILE;
            const int p = p0 + j;
            float s = -KILN_INF;
            const bool visible =
                j < n_keys && (p < base || (p - base < 64 && ((row_bits >> (p - base)) & 1ull)));
            if (visible) {
                s = 0.0f;
                const float* qg = q_s + g * head_dim;
                const bf16* kj = k_s + j * k_stride;
                for (int d = 0; d < head_dim; d++) s += qg[d] * bf16_to_f32(kj[d]);
            }
            s_s[idx] = s;
        }
        __syncthreads();
        online_softmax_tile(s_s, m_s, l_s, c_s, group, KILN_ATTN_TILE, tid, KILN_ATTN_THREADS);
        __syncthreads();
#pragma unroll
        for (int k = 0; k < KILN_ATTN_MAX_OUT; k++) {
            const int idx = tid + k * KILN_ATTN_THREADS;
            if (idx < n_out) {
                const int g = idx / head_dim, d = idx % head_dim;
                const float* pg = s_s + g * KILN_ATTN_TILE;
                float a = acc[k] * c_s[g];
                for (int j = 0; j < n_keys; j++) a += pg[j] * bf16_to_f32(v_s[j * k_stride + d]);
                acc[k] = a;
            }
        }
        __syncthreads();
    }

#pragma unroll
    for (int k = 0; k < KILN_ATTN_MAX_OUT; k++) {
        const int idx = tid + k * KILN_ATTN_THREADS;
        if (idx < n_out) {
            const int g = idx / head_dim, d = idx % head_dim;
            const int h = kvh * group + g;
            if (n_splits == 1) {
                const float l = l_s[g];
                out[(long)t * n_heads * head_dim + h * head_dim + d] =
                    f32_to_bf16(l > 0.0f ? acc[k] / l : 0.0f);
            } else {
                part_acc[(((long)t * n_heads + h) * n_splits + split) * head_dim + d] = acc[k];
            }
        }
    }
    if (n_splits > 1) {
        for (int g = tid; g < group; g += KILN_ATTN_THREADS) {
            const long at = ((long)t * n_heads + kvh * group + g) * n_splits + split;
            part_ml[at * 2] = m_s[g];
            part_ml[at * 2 + 1] = l_s[g];
        }
    }
}

// Joins the splits of kiln_paged_attention_bf16: out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M).
// Grid: (tokens, n_heads); block: head_dim threads (at most 1024).
extern "C" __global__ void kiln_attention_combine(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, int n_splits,
    int n_heads, int head_dim, bf16* __restrict__ out) {
    const long th = (long)blockIdx.x * n_heads + blockIdx.y;
    const int d = threadIdx.x;
    if (d >= head_dim) return;
    float M = -KILN_INF;
    for (int s = 0; s < n_splits; s++) M = fmaxf(M, part_ml[(th * n_splits + s) * 2]);
    float L = 0.0f, v = 0.0f;
    if (M != -KILN_INF) {
        for (int s = 0; s < n_splits; s++) {
            const float m = part_ml[(th * n_splits + s) * 2];
            if (m == -KILN_INF) continue;
            const float w = __expf(m - M);
            L += part_ml[(th * n_splits + s) * 2 + 1] * w;
            v += part_acc[(th * n_splits + s) * head_dim + d] * w;
        }
    }
    out[th * head_dim + d] = f32_to_bf16(L > 0.0f ? v / L : 0.0f);
}
