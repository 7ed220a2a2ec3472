// On-device sampling, one block (KILN_SAMPLE_THREADS threads) per row of logits:
// temperature 0 is greedy (argmax, lowest index on ties, like the CPU sampler); otherwise top-k and
// top-p cut the distribution at logit thresholds found by bisection (no sort: each probe is one
// block-wide count or sum), and a seeded counter-based draw picks the token by a prefix sum.
// Ties at a threshold are all kept, so top-k may keep more than k tokens when logits tie exactly.
#define KILN_SAMPLE_THREADS 1024
#define KILN_BISECT_STEPS 40

__device__ __forceinline__ u64 splitmix64(u64 x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// Value and index of the row maximum (lowest index among equal maxima), for every thread.
__device__ void block_argmax(const float* row, int n, float* best_v, int* best_i) {
    __shared__ float sv[KILN_SAMPLE_THREADS / 32];
    __shared__ int si[KILN_SAMPLE_THREADS / 32];
    float v = -KILN_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        if (row[i] > v) { v = row[i]; idx = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = idx; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) {
            if (sv[w] > sv[0] || (sv[w] == sv[0] && si[w] < si[0])) { sv[0] = sv[w]; si[0] = si[w]; }
        }
    }
    __syncthreads();
    *best_v = sv[0];
    *best_i = si[0];
}

extern "C" __global__ void kiln_argmax_f32(const float* __restrict__ logits, int vocab, int* __restrict__ out) {
    float v;
    int i;
    block_argmax(logits + (long)blockIdx.x * vocab, vocab, &v, &i);
    if (threadIdx.x == 0) out[blockIdx.x] = i;
}

extern "C" __global__ void kiln_sample_f32(
    const float* __restrict__ logits, int vocab,
    const float* __restrict__ temperature,  // [rows]; 0 = greedy
    const int* __restrict__ top_k,          // [rows]; 0 = off
    const float* __restrict__ top_p,        // [rows]; 1 = off
    const u64* __restrict__ seeds,          // [rows]
    const u64* __restrict__ counters,       // [rows]: the step, so each draw is fresh
    int* __restrict__ out) {
    const long r = blockIdx.x;
    const float* row = logits + r * vocab;
    float max_v;
    int max_i;
    block_argmax(row, vocab, &max_v, &max_i);
    const float temp = temperature[r];
    if (temp <= 0.0f) {
        if (threadIdx.x == 0) out[r] = max_i;
        return;
    }
    float lo = KILN_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) lo = fminf(lo, row[i]);
    lo = -block_max(-lo);

    // Top-k: the largest threshold that still keeps at least k logits.
    float cut = lo;
    const int k = top_k[r];
    if (k > 0 && k < vocab) {
        float a = lo, b = max_v;
        for (int s = 0; s < KILN_BISECT_STEPS; s++) {
            const float mid = 0.5f * (a + b);
            float c = 0.0f;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) c += row[i] >= mid ? 1.0f : 0.0f;
            if (block_sum(c) >= (float)k) a = mid; else b = mid;
        }
        cut = a;
    }
    // Top-p: the largest threshold whose kept mass is still at least p of the top-k mass.
    float total = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (row[i] >= cut) total += __expf((row[i] - max_v) / temp);
    total = block_sum(total);
    const float p = top_p[r];
    if (p < 1.0f) {
        float a = cut, b = max_v;
        for (int s = 0; s < KILN_BISECT_STEPS; s++) {
            const float mid = 0.5f * (a + b);
            float mass = 0.0f;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x)
                if (row[i] >= mid) mass += __expf((row[i] - max_v) / temp);
            if (block_sum(mass) >= p * total) a = mid; else b = mid;
        }
        cut = a;
        total = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (row[i] >= cut) total += __expf((row[i] - max_v) / temp);
        total = block_sum(total);
    }

    // The draw: each thread owns a contiguous chunk; an exclusive scan of the chunks' kept mass
    // finds the chunk holding u, and that thread walks it.
    __shared__ float chunk_mass[KILN_SAMPLE_THREADS];
    __shared__ int chosen;
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int begin = threadIdx.x * chunk, end = min(vocab, begin + chunk);
    float mine = 0.0f;
    for (int i = begin; i < end; i++)
        if (row[i] >= cut) mine += __expf((row[i] - max_v) / temp);
    chunk_mass[threadIdx.x] = mine;
    if (threadIdx.x == 0) chosen = max_i;
    __syncthreads();
    if (threadIdx.x == 0) {
        float run = 0.0f;
        for (int t = 0; t < (int)blockDim.x; t++) { const float m = chunk_mass[t]; chunk_mass[t] = run; run += m; }
    }
    __syncthreads();
    const u64 bits = splitmix64(seeds[r] ^ splitmix64(counters[r]));
    const float u = (float)(bits >> 40) * (1.0f / 16777216.0f) * total;
    const float start = chunk_mass[threadIdx.x];
    if (u >= start && u < start + mine) {
        float run = start;
        int pick = -1;
        for (int i = begin; i < end; i++) {
            if (row[i] < cut) continue;
            pick = i;
            run += __expf((row[i] - max_v) / temp);
            if (u < run) break;
        }
        if (pick >= 0) chosen = pick;
    }
    __syncthreads();
    if (threadIdx.x == 0) out[r] = chosen;
}
