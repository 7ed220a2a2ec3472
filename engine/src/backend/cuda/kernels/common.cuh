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

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int n_warps = blockDim.x >> 5;
    v = lane < n_warps ? partial[lane] : 0.0f;
    return warp_sum(v);
}

__device__ float block_max(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int n_warps = blockDim.x >> 5;
    v = lane < n_warps ? partial[lane] : -KILN_INF;
    return warp_max(v);
}
