// Mixture-of-experts on the device (DeepSeek-V3, Kimi-K2): routing, grouping the chosen
// (token, expert) pairs by expert, the grouped expert matmul and the weighted sum back into each
// token, with no trip to the host. Routing is DeepSeek-V3's noaux_tc as the host's
// backend/routing.rs `route` computes it: sigmoid scores; the scores plus the correction bias
// choose the topk_group best groups (each scored by its best two) and then the top_k experts
// inside them, best first, ties to the lower index; the weights are the chosen scores (without
// the bias), normalized if asked, times the scaling factor. The grouped matmul itself is
// dequant.cu's kiln_moe_matmul_bf16 or packed_mma.cu's kiln_moe_mma_bf16 (they read the weights
// as stored); kiln_moe_group's tile_tokens must be the launched kernel's tile (8 or 32).

#define KILN_MOE_THREADS 256

// Whether candidate (v, i) beats the best so far (bv, bi): a larger value, then the lower index.
// A NaN value (an expert already taken) and i < 0 (no candidate) never win; bi < 0 always loses.
__device__ __forceinline__ bool moe_better(float v, int i, float bv, int bi) {
    if (v != v || i < 0) return false;
    return bi < 0 || v > bv || (v == bv && i < bi);
}

// One block per token. Dynamic shared memory: 2 * n_experts floats. n_group and top_k at most 64.
// ids[t * top_k + r] and weights[t * top_k + r]: the r-th best expert and its weight.
extern "C" __global__ void __launch_bounds__(KILN_MOE_THREADS) kiln_moe_route(
    const bf16* __restrict__ logits, int n_experts, const float* __restrict__ bias, int n_group,
    int topk_group, int top_k, int norm, float scaling, int* __restrict__ ids,
    float* __restrict__ weights) {
    extern __shared__ float route_s[];
    float* score = route_s;               // [n_experts] sigmoid scores
    float* choice = route_s + n_experts;  // [n_experts] scores + bias, masked, then taken
    __shared__ float group_score[64];
    __shared__ int group_on[64];
    __shared__ int chosen[64];
    __shared__ float best_v[KILN_MOE_THREADS / 32];
    __shared__ int best_i[KILN_MOE_THREADS / 32];
    const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bf16* row = logits + (long)t * n_experts;
    for (int e = tid; e < n_experts; e += KILN_MOE_THREADS) {
        const float s = 1.0f / (1.0f + expf(-bf16_to_f32(row[e])));
        score[e] = s;
        choice[e] = s + bias[e];
    }
    const int per_group = n_experts / n_group;
    __syncthreads();
    for (int g = tid; g < n_group; g += KILN_MOE_THREADS) {
        float first = -KILN_INF, second = -KILN_INF;
        for (int i = 0; i < per_group; i++) {
            const float v = choice[g * per_group + i];
            if (v > first) {
                second = first;
                first = v;
            } else if (v > second) {
                second = v;
            }
        }
        // A group of one is scored by its one expert, as the host's top-two sum of it is.
        group_score[g] = per_group > 1 ? first + second : first;
        group_on[g] = 0;
    }
    __syncthreads();
    if (tid == 0) {
        for (int r = 0; r < topk_group; r++) {
            int bi = -1;
            float bv = 0.0f;
            for (int g = 0; g < n_group; g++)
                if (!group_on[g] && moe_better(group_score[g], g, bv, bi)) {
                    bv = group_score[g];
                    bi = g;
                }
            if (bi >= 0) group_on[bi] = 1;
        }
    }
    __syncthreads();
    for (int e = tid; e < n_experts; e += KILN_MOE_THREADS)
        if (!group_on[e / per_group]) choice[e] = -KILN_INF;
    __syncthreads();
    for (int r = 0; r < top_k; r++) {
        // Every thread's best, then the warp's, then the block's.
        float bv = 0.0f;
        int bi = -1;
        for (int e = tid; e < n_experts; e += KILN_MOE_THREADS)
            if (moe_better(choice[e], e, bv, bi)) {
                bv = choice[e];
                bi = e;
            }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (moe_better(ov, oi, bv, bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            best_v[warp] = bv;
            best_i[warp] = bi;
        }
        __syncthreads();
        if (tid == 0) {
            float v = 0.0f;
            int i = -1;
            for (int w = 0; w < KILN_MOE_THREADS / 32; w++)
                if (moe_better(best_v[w], best_i[w], v, i)) {
                    v = best_v[w];
                    i = best_i[w];
                }
            // The host checked top_k <= n_experts: there is always a candidate left (experts
            // outside the chosen groups are -inf, still candidates, as on the host).
            chosen[r] = i < 0 ? 0 : i;
            if (i >= 0) choice[i] = __int_as_float(0x7fc00000);  // taken
        }
        __syncthreads();
    }
    if (tid == 0) {
        float sum = 0.0f;
        for (int r = 0; r < top_k; r++) sum += score[chosen[r]];
        const float norm_by = norm ? sum + 1e-20f : 1.0f;
        for (int r = 0; r < top_k; r++) {
            ids[t * top_k + r] = chosen[r];
            weights[t * top_k + r] = score[chosen[r]] / norm_by * scaling;
        }
    }
}

// Groups the n_pairs (token, slot) pairs by the expert they chose, for the experts held here
// (global ids first .. first + n_local): pair_of_pos[pos] is the pair at sorted position pos,
// pos_of_pair[pair] its position (-1: an expert held elsewhere); offsets[e] .. offsets[e + 1] are
// local expert e's positions; tiles (expert, start, count) cover every expert's positions in runs
// of at most tile_tokens, n_tiles[0] of them (at most max_tiles). Within an expert the order is
// whatever the atomics give: each position's row is computed alone, so results do not depend on it.
// One block of KILN_MOE_THREADS; dynamic shared memory: 2 * n_local ints.
extern "C" __global__ void __launch_bounds__(KILN_MOE_THREADS) kiln_moe_group(
    const int* __restrict__ ids, int n_pairs, int first, int n_local, int tile_tokens,
    int max_tiles, int* __restrict__ pair_of_pos, int* __restrict__ pos_of_pair,
    int* __restrict__ offsets, int* __restrict__ tiles, int* __restrict__ n_tiles) {
    extern __shared__ int group_s[];
    int* count = group_s;            // [n_local]
    int* cursor = group_s + n_local; // [n_local]
    const int tid = threadIdx.x;
    for (int e = tid; e < n_local; e += KILN_MOE_THREADS) count[e] = 0;
    __syncthreads();
    for (int p = tid; p < n_pairs; p += KILN_MOE_THREADS) {
        const int e = ids[p] - first;
        if (e >= 0 && e < n_local) atomicAdd(&count[e], 1);
    }
    __syncthreads();
    if (tid == 0) {
        int at = 0, nt = 0;
        for (int e = 0; e < n_local; e++) {
            offsets[e] = at;
            cursor[e] = at;
            for (int s = 0; s < count[e] && nt < max_tiles; s += tile_tokens, nt++) {
                tiles[nt * 3] = e;
                tiles[nt * 3 + 1] = at + s;
                tiles[nt * 3 + 2] = min(tile_tokens, count[e] - s);
            }
            at += count[e];
        }
        offsets[n_local] = at;
        n_tiles[0] = nt;
    }
    __syncthreads();
    for (int p = tid; p < n_pairs; p += KILN_MOE_THREADS) {
        const int e = ids[p] - first;
        if (e >= 0 && e < n_local) {
            const int pos = atomicAdd(&cursor[e], 1);
            pair_of_pos[pos] = p;
            pos_of_pair[p] = pos;
        } else {
            pos_of_pair[p] = -1;
        }
    }
}

// xs[pos] = x[pair_of_pos[pos] / k] for pos < n: each held pair's token row, in sorted order (the
// prefill path's GEMMs read them as one run per expert). Grid: n; block: 256.
extern "C" __global__ void kiln_moe_gather(const bf16* __restrict__ x, int width,
                                           const int* __restrict__ pair_of_pos, int k,
                                           bf16* __restrict__ xs) {
    const long pos = blockIdx.x;
    const long src = pair_of_pos[pos] / k;
    for (int j = threadIdx.x; j < width; j += blockDim.x) xs[pos * width + j] = x[src * width + j];
}

// out[t][j] += sum_r weights[t * k + r] * y[pos_of_pair[t * k + r]][j] over the slots whose expert
// is held here, summed in f32 in slot order and rounded once. Grid: (tokens, ceil(width / 256));
// block: 256.
extern "C" __global__ void kiln_moe_combine(bf16* __restrict__ out, const bf16* __restrict__ y,
                                            int width, const int* __restrict__ pos_of_pair,
                                            const float* __restrict__ weights, int k) {
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= width) return;
    const long t = blockIdx.x;
    float s = bf16_to_f32(out[t * width + j]);
    for (int r = 0; r < k; r++) {
        const int pos = pos_of_pair[t * k + r];
        if (pos >= 0) s += weights[t * k + r] * bf16_to_f32(y[(long)pos * width + j]);
    }
    out[t * width + j] = f32_to_bf16(s);
}
