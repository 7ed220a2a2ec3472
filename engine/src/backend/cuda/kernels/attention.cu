// Paged attention over a KV cache in fixed-size blocks, for decode and chunked prefill alike: each
// new token attends to its sequence's positions 0..=its own (causal), found through the sequence's
// block table. Grouped-query: query head h reads KV head h / (n_heads / n_kv_heads).
//
// Cache layout per layer: k_cache, v_cache [n_blocks, block_size, n_kv_heads * head_dim] bf16.
//
// EAGLE tree verification: with `tree_mask` set, a token that is tree node `tree_node[t]` sees the
// positions from `tree_base[t]` on only where mask[node, p - base] is 1 (its ancestors and itself);
// the positions before the tree (the accepted prefix) are all visible.
#define KILN_MAX_HEAD_DIM 256
#define KILN_ATTN_WARPS 4

// Copies this step's K and V rows of the fused qkv buffer into their cache slots
// (slot = block * block_size + offset; the host's block tables decide it). Grid: rows.
extern "C" __global__ void kiln_kv_write_bf16(
    const bf16* __restrict__ qkv, int row_stride, int k_col, int v_col,
    const int* __restrict__ slots,
    bf16* __restrict__ k_cache, bf16* __restrict__ v_cache, int kv_width) {
    const long row = blockIdx.x;
    const long slot = slots[row];
    if (slot < 0) return;  // padding row
    for (int i = threadIdx.x; i < kv_width; i += blockDim.x) {
        k_cache[slot * kv_width + i] = qkv[row * row_stride + k_col + i];
        v_cache[slot * kv_width + i] = qkv[row * row_stride + v_col + i];
    }
}

// Grid: (tokens, n_heads); block: KILN_ATTN_WARPS * 32 threads. head_dim a multiple of 32, at most
// KILN_MAX_HEAD_DIM. Online softmax per warp over its share of the keys, then the warps combine.
extern "C" __global__ void kiln_paged_attention_bf16(
    const bf16* __restrict__ qkv, int row_stride,  // queries at column 0
    const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
    const int* __restrict__ token_seq,     // [tokens] -> sequence index
    const int* __restrict__ token_pos,     // [tokens] absolute position
    const int* __restrict__ block_tables,  // [n_seqs, max_blocks]
    int max_blocks, int block_size, int n_heads, int n_kv_heads, int head_dim, float scale,
    const unsigned char* __restrict__ tree_mask,  // [tree_n, tree_n] or null
    const int* __restrict__ tree_base, const int* __restrict__ tree_node, int tree_n,
    bf16* __restrict__ out) {     // [tokens, n_heads * head_dim]
    const int t = blockIdx.x, h = blockIdx.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per_lane = head_dim / 32;
    const int kv_head = h / (n_heads / n_kv_heads);
    const int kv_width = n_kv_heads * head_dim;
    const int seq = token_seq[t], pos = token_pos[t];
    const int* table = block_tables + (long)seq * max_blocks;

    float q[KILN_MAX_HEAD_DIM / 32], acc[KILN_MAX_HEAD_DIM / 32];
    const bf16* qh = qkv + (long)t * row_stride + h * head_dim;
    for (int i = 0; i < per_lane; i++) {
        q[i] = bf16_to_f32(qh[lane + 32 * i]) * scale;
        acc[i] = 0.0f;
    }
    float m = -KILN_INF, l = 0.0f;
    const int base = tree_mask ? tree_base[t] : 0x7fffffff;
    for (int p = warp; p <= pos; p += KILN_ATTN_WARPS) {
        if (p >= base) {
            const int node = tree_node[t];
            if (!tree_mask[(long)node * tree_n + (p - base)]) continue;
        }
        const long slot = (long)table[p / block_size] * block_size + p % block_size;
        const bf16* kp = k_cache + slot * kv_width + kv_head * head_dim;
        float s = 0.0f;
        for (int i = 0; i < per_lane; i++) s += q[i] * bf16_to_f32(kp[lane + 32 * i]);
        s = warp_sum(s);
        const float m_new = fmaxf(m, s);
        const float corr = __expf(m - m_new), e = __expf(s - m_new);
        l = l * corr + e;
        const bf16* vp = v_cache + slot * kv_width + kv_head * head_dim;
        for (int i = 0; i < per_lane; i++) acc[i] = acc[i] * corr + e * bf16_to_f32(vp[lane + 32 * i]);
        m = m_new;
    }

    __shared__ float sm[KILN_ATTN_WARPS], sl[KILN_ATTN_WARPS];
    __shared__ float sacc[KILN_ATTN_WARPS][KILN_MAX_HEAD_DIM];
    if (lane == 0) { sm[warp] = m; sl[warp] = l; }
    for (int i = 0; i < per_lane; i++) sacc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    if (warp == 0) {
        float M = -KILN_INF;
        for (int w = 0; w < KILN_ATTN_WARPS; w++) M = fmaxf(M, sm[w]);
        float L = 0.0f;
        for (int w = 0; w < KILN_ATTN_WARPS; w++) L += sm[w] == -KILN_INF ? 0.0f : sl[w] * __expf(sm[w] - M);
        bf16* o = out + (long)t * n_heads * head_dim + h * head_dim;
        for (int i = 0; i < per_lane; i++) {
            const int d = lane + 32 * i;
            float v = 0.0f;
            for (int w = 0; w < KILN_ATTN_WARPS; w++)
                if (sm[w] != -KILN_INF) v += sacc[w][d] * __expf(sm[w] - M);
            o[d] = f32_to_bf16(L > 0.0f ? v / L : 0.0f);
        }
    }
}

// The EAGLE tree attention mask from each node's parent (-1 for children of the accepted prefix):
// mask[i, j] = 1 when node j is node i or one of its ancestors. Grid: (tree_n); block: tree_n.
extern "C" __global__ void kiln_tree_mask(
    const int* __restrict__ parents, int tree_n, unsigned char* __restrict__ mask) {
    const int i = blockIdx.x, j = threadIdx.x;
    if (i >= tree_n || j >= tree_n) return;
    unsigned char visible = 0;
    // Walk up from i; a depth bound guards against a malformed (cyclic) parent list.
    for (int node = i, depth = 0; node >= 0 && depth < tree_n; node = parents[node], depth++) {
        if (node == j) { visible = 1; break; }
    }
    mask[(long)i * tree_n + j] = visible;
}
