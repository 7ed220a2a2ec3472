// Shared helpers for kiln's CUDA kernels: bf16 storage, f32 arithmetic, warp/block reductions.
// Prepended to every kernel source before NVRTC compiles it. No #include at all: a serving host
// needs only the driver and libnvrtc, not the CUDA toolkit's headers.

// NVRTC has no <math.h>: infinity from its bit pattern.
#define KILN_INF __int_as_float(0x7f800000)

typedef unsigned int u32;
typedef unsigned long long u64;

// bf16 as its bits: the upper half of an f32. Conversion to bf16 rounds to nearest even, as
// __float2bfloat16 and torch do; NaN stays NaN.
typedef unsigned short bf16;

__device__ __forceinline__ float bf16_to_f32(bf16 b) { return __uint_as_float(((u32)b) << 16); }

__device__ __forceinline__ bf16 f32_to_bf16(float f) {
    const u32 bits = __float_as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16)((bits >> 16) | 0x40u);
    return (bf16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// Reading stored weight bytes (dequant.cu, packed_mma.cu): any alignment, little-endian.
typedef unsigned char u8;

__device__ __forceinline__ float f16_bits_to_f32(unsigned short h) {
#ifdef KILN_CUDASIM
    return kilnsim::f16_to_f32(h);  // cudasim (CUDA on the CPU): no PTX there
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

__device__ __forceinline__ float f16_at(const u8* b) {
    return f16_bits_to_f32((unsigned short)(b[0] | (b[1] << 8)));
}

__device__ __forceinline__ u32 u32_at(const u8* b) {
    return (u32)b[0] | ((u32)b[1] << 8) | ((u32)b[2] << 16) | ((u32)b[3] << 24);
}

// One e4m3 byte (DeepSeek-V3's FP8: bias 7, subnormals, no infinities) as f32, exactly.
__device__ __forceinline__ float e4m3_to_f32(u8 b) {
    const u32 magnitude = b & 0x7f;
    const float v = magnitude < 8 ? (float)magnitude * (1.0f / 512.0f)
                                  : __uint_as_float((magnitude << 20) + (120u << 23));
    return (b & 0x80) ? -v : v;
}

struct SumOp {
    __device__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
    __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Reduces over the warp with `op` (butterfly: every lane gets the result).
template <typename Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
#ifdef KILN_CUDASIM
    // cudasim (CUDA on the CPU): the same butterfly, bit for bit, over one exchange of the
    // warp's values instead of five (each exchange there is a round of fiber switches).
    return kilnsim::warp_butterfly(v, op);
#else
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
#endif
}

__device__ __forceinline__ float warp_sum(float v) { return warp_reduce(v, SumOp()); }

// Reduces over the block with `op` (blockDim.x a multiple of 32, at most 1024); every thread
// gets the result. `identity` fills the slots of absent warps.
template <typename Op>
__device__ float block_reduce(float v, Op op, float identity) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_reduce(v, op);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int n_warps = blockDim.x >> 5;
    v = lane < n_warps ? partial[lane] : identity;
    return warp_reduce(v, op);
}

__device__ float block_sum(float v) { return block_reduce(v, SumOp(), 0.0f); }
__device__ float block_max(float v) { return block_reduce(v, MaxOp(), -KILN_INF); }

// One tile's step of an online softmax for `heads` rows of `tile` scores each (s[g * tile + j],
// -inf where masked), one thread per row: each row's scores become their exponentials against
// the new running max m[g], the running sum l[g] is rescaled and extended, and c[g] gets the
// factor the row's accumulated output must be rescaled by. A row with nothing visible yet keeps
// its state (c = 1). Callers synchronize before and after.
__device__ __forceinline__ void online_softmax_tile(float* s, float* m, float* l, float* c,
                                                    int heads, int tile, int tid, int threads) {
    for (int g = tid; g < heads; g += threads) {
        float* sg = s + g * tile;
        float tile_max = -KILN_INF;
        for (int j = 0; j < tile; j++) tile_max = fmaxf(tile_max, sg[j]);
        const float m_old = m[g];
        const float m_new = fmaxf(m_old, tile_max);
        const float corr = m_new == -KILN_INF ? 1.0f : __expf(m_old - m_new);
        float sum = 0.0f;
        for (int j = 0; j < tile; j++) {
            const float e = sg[j] == -KILN_INF ? 0.0f : __expf(sg[j] - m_new);
            sg[j] = e;
            sum += e;
        }
        l[g] = l[g] * corr + sum;
        m[g] = m_new;
        c[g] = corr;
    }
}
