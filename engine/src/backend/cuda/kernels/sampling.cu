// On-device sampling: every logits row of a step drawn in one pass, agreeing with the host
// reference (sampling/rows.rs `sample_row`), so only token ids and logprobs leave the GPU.
// Per row, in order: the token mask, logprob statistics on the masked logits, the penalties
// (originals saved for the chosen token's logprob), then greedy, a draw, or a draft's
// verification (rejection sampling: accept with p(draft), else draw from p without the draft).
//
// The kept set is cut at exact logit thresholds found by a radix search over the floats'
// ordered bit patterns (32 block-wide counts or sums, no sort): top-k keeps every logit at or
// above the k-th largest, top-p the fewest largest logits whose mass reaches p, min-p those
// within ln(min_p) * temperature of the maximum. Ties at a threshold are all kept, as the host
// reference keeps them. The draw walks kept tokens in vocabulary order: an exclusive scan of
// each thread's contiguous chunk finds the chunk holding the target, and that thread walks it.

#define KILN_SAMPLE_THREADS 1024
#define KILN_TOP_MAX 20

// Per-row settings, as sample.rs packs them.
#define RI_TOP_K 0
#define RI_DRAFT 1      // -1: no draft
#define RI_TOP_N 2      // -1: no logprobs; else the alternatives wanted (0..=KILN_TOP_MAX)
#define RI_MASK 3       // first word of the row's mask, -1: no mask
#define RI_PEN_BEGIN 4  // the row's penalty entries [begin, end)
#define RI_PEN_END 5
#define KILN_ROW_INTS 6
#define RF_TEMP 0       // 0: greedy
#define RF_TOP_P 1
#define RF_MIN_P 2
#define RF_REPEAT 3     // the repetition penalty
#define RF_U0 4
#define RF_U1 5
#define KILN_ROW_FLOATS 6

// Larger floats map to larger keys (NaN aside).
__device__ __forceinline__ u32 order_key(float f) {
    // -0 and +0 compare equal on the host: one key for both.
    const u32 b = __float_as_uint(f == 0.0f ? 0.0f : f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The best (value, index) over the block: larger value, then lower index. Every thread gets it.
__device__ void block_best(float* v, int* i) {
    __shared__ float sv[KILN_SAMPLE_THREADS / 32];
    __shared__ int si[KILN_SAMPLE_THREADS / 32];
    float bv = *v;
    int bi = *i;
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) {
            if (sv[w] > sv[0] || (sv[w] == sv[0] && si[w] < si[0])) { sv[0] = sv[w]; si[0] = si[w]; }
        }
    }
    __syncthreads();
    *v = sv[0];
    *i = si[0];
}

// Row `blockIdx.x`, columns from blockIdx.y * blockDim.x: bf16 logits to f32, masked to -inf.
extern "C" __global__ void kiln_sample_prepare(
    const bf16* __restrict__ logits, int vocab, const int* __restrict__ ri,
    const u64* __restrict__ mask_words, float* __restrict__ rows) {
    const long r = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= vocab) return;
    const int m = ri[r * KILN_ROW_INTS + RI_MASK];
    float v = bf16_to_f32(logits[r * vocab + i]);
    if (m >= 0 && !((mask_words[m + (i >> 6)] >> (i & 63)) & 1ull)) v = -KILN_INF;
    rows[r * vocab + i] = v;
}

// For rows that want logprobs: log-sum-exp and the top-n (value descending, index ascending).
extern "C" __global__ void __launch_bounds__(KILN_SAMPLE_THREADS) kiln_sample_stats(
    const float* __restrict__ rows, int vocab, const int* __restrict__ ri,
    float* __restrict__ lse, int* __restrict__ top_ids, float* __restrict__ top_lp) {
    const long r = blockIdx.x;
    const int n = min(ri[r * KILN_ROW_INTS + RI_TOP_N], KILN_TOP_MAX);
    if (n < 0) return;
    const float* row = rows + r * vocab;
    float m = -KILN_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) m = fmaxf(m, row[i]);
    m = block_max(m);
    float s = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) s += expf(row[i] - m);
    s = block_sum(s);
    const float l = m + logf(s);
    if (threadIdx.x == 0) lse[r] = l;
    // Each pass takes the best entry ordered after the previous pass's.
    float pv = KILN_INF;
    int pi = -1;
    for (int k = 0; k < n; k++) {
        float bv = -KILN_INF;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = row[i];
            const bool after = v < pv || (v == pv && i > pi);
            if (after && (v > bv || (v == bv && i < bi))) { bv = v; bi = i; }
        }
        block_best(&bv, &bi);
        if (threadIdx.x == 0) {
            top_ids[r * KILN_TOP_MAX + k] = bi;
            top_lp[r * KILN_TOP_MAX + k] = bv - l;
        }
        pv = bv;
        pi = bi;
    }
}

// The penalties of row `blockIdx.x`, each entry a distinct token: the original logit saved,
// then the repetition penalty (divide a positive logit, multiply a negative one) and the
// subtraction. `pen_val` holds (repeat flag, subtract) per entry.
extern "C" __global__ void kiln_sample_penalties(
    float* __restrict__ rows, int vocab, const int* __restrict__ ri, const float* __restrict__ rf,
    const int* __restrict__ pen_tok, const float* __restrict__ pen_val, float* __restrict__ saved) {
    const long r = blockIdx.x;
    const int begin = ri[r * KILN_ROW_INTS + RI_PEN_BEGIN], end = ri[r * KILN_ROW_INTS + RI_PEN_END];
    const float rep = rf[r * KILN_ROW_FLOATS + RF_REPEAT];
    for (int e = begin + threadIdx.x; e < end; e += blockDim.x) {
        const int t = pen_tok[e];
        if (t < 0 || t >= vocab) continue;
        float l = rows[r * vocab + t];
        saved[e] = l;
        if (pen_val[2 * e] != 0.0f) l = l > 0.0f ? l / rep : l * rep;
        rows[r * vocab + t] = l - pen_val[2 * e + 1];
    }
}

// The kept mass of `row` at or above key `cut` (weights relative to the maximum).
__device__ float kept_mass(const float* row, int vocab, u32 cut, float max_v, float temp) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x)
        if (order_key(row[i]) >= cut) s += expf((row[i] - max_v) / temp);
    return block_sum(s);
}

// The row's token (and, verifying a draft, whether it stood), and its logprob when asked.
// `out` holds (token, accepted) per row; `drawn` the token alone, at a fixed address.
extern "C" __global__ void __launch_bounds__(KILN_SAMPLE_THREADS) kiln_sample_draw(
    const float* __restrict__ rows, int vocab, const int* __restrict__ ri,
    const float* __restrict__ rf, const int* __restrict__ pen_tok, const float* __restrict__ saved,
    const float* __restrict__ lse, int* __restrict__ out, float* __restrict__ out_lp,
    int* __restrict__ drawn) {
    const long r = blockIdx.x;
    const float* row = rows + r * vocab;
    const int* I = ri + r * KILN_ROW_INTS;
    const float* F = rf + r * KILN_ROW_FLOATS;
    const int draft = I[RI_DRAFT];
    const float temp = F[RF_TEMP];

    float max_v = -KILN_INF;
    int max_i = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (row[i] > max_v) { max_v = row[i]; max_i = i; }
    }
    block_best(&max_v, &max_i);
    if (max_i == 0x7fffffff) max_i = 0;

    __shared__ int chosen;
    __shared__ int stood;
    if (threadIdx.x == 0) { chosen = max_i; stood = draft == max_i; }
    __syncthreads();
    if (temp > 0.0f && fabsf(max_v) < KILN_INF) {
        // Top-k: the largest key that still keeps k logits (the k-th largest logit's).
        u32 cut = 0;
        const int k = I[RI_TOP_K];
        if (k > 0 && k < vocab) {
            for (int bit = 31; bit >= 0; bit--) {
                const u32 probe = cut | (1u << bit);
                float c = 0.0f;
                for (int i = threadIdx.x; i < vocab; i += blockDim.x) c += order_key(row[i]) >= probe ? 1.0f : 0.0f;
                if (block_sum(c) >= (float)k) cut = probe;
            }
        }
        float total = kept_mass(row, vocab, cut, max_v, temp);
        // Top-p: the largest key whose kept mass still reaches p of it.
        const float p = F[RF_TOP_P];
        if (p < 1.0f) {
            const float goal = p * total;
            u32 t = 0;
            for (int bit = 31; bit >= 0; bit--) {
                const u32 probe = t | (1u << bit);
                if (kept_mass(row, vocab, probe > cut ? probe : cut, max_v, temp) >= goal) t = probe;
            }
            if (t > cut) cut = t;
        }
        const float min_p = F[RF_MIN_P];
        if (min_p > 0.0f) {
            const u32 floor_key = order_key(max_v + temp * logf(min_p));
            if (floor_key > cut) cut = floor_key;
        }
        total = kept_mass(row, vocab, cut, max_v, temp);

        // Verification first: the draft stands with its probability.
        float target;
        int skip = -1;
        bool decided = false;
        if (draft >= 0) {
            const float w = (draft < vocab && order_key(row[draft]) >= cut) ? expf((row[draft] - max_v) / temp) : 0.0f;
            const float rest = total - w;
            if (F[RF_U0] * total < w || rest <= 0.0f) {
                decided = true;
                if (threadIdx.x == 0) { chosen = draft; stood = 1; }
            } else {
                target = F[RF_U1] * rest;
                skip = draft;
            }
        } else {
            target = F[RF_U0] * total;
        }
        if (!decided) {
            __shared__ float chunk_mass[KILN_SAMPLE_THREADS];
            const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
            const int begin = threadIdx.x * chunk, end = min(vocab, begin + chunk);
            float mine = 0.0f;
            int last = -1;
            for (int i = begin; i < end; i++) {
                if (i == skip || order_key(row[i]) < cut) continue;
                // A zero weight (masked, or underflowed) is never drawn, as on the host.
                const float w = expf((row[i] - max_v) / temp);
                if (w > 0.0f) {
                    mine += w;
                    last = i;
                }
            }
            // The fallback when rounding leaves the target past the end: the last kept token.
            float lv = (float)last;
            int li = 0;
            block_best(&lv, &li);
            chunk_mass[threadIdx.x] = mine;
            __syncthreads();
            if (threadIdx.x == 0) {
                float run = 0.0f;
                for (int t = 0; t < (int)blockDim.x; t++) { const float m = chunk_mass[t]; chunk_mass[t] = run; run += m; }
                chosen = lv >= 0.0f ? (int)lv : draft;
                stood = 0;
            }
            __syncthreads();
            const float start = chunk_mass[threadIdx.x];
            if (mine > 0.0f && target >= start && target < start + mine) {
                // The target lies in this chunk; if rounding leaves the running sum short of
                // it, the chunk's last drawable token takes it.
                float run = start;
                int pick = last;
                for (int i = begin; i < end; i++) {
                    if (i == skip || order_key(row[i]) < cut) continue;
                    const float w = expf((row[i] - max_v) / temp);
                    if (w <= 0.0f) continue;
                    run += w;
                    if (target < run) { pick = i; break; }
                }
                chosen = pick;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // No drawable token (everything masked): token 0, as the host reads it.
        const int token = chosen < 0 ? 0 : chosen;
        out[2 * r] = token;
        out[2 * r + 1] = stood;
        // Where the next step's embedding reads it (kiln_embed_bf16's `fill`).
        drawn[r] = token;
        if (I[RI_TOP_N] >= 0) {
            float raw = row[token];
            for (int e = I[RI_PEN_BEGIN]; e < I[RI_PEN_END]; e++)
                if (pen_tok[e] == token) raw = saved[e];
            out_lp[r] = raw - lse[r];
        }
    }
}
