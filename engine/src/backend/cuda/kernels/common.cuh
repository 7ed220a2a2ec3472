// Shared helpers for kiln's CUDA kernels: bf16 storage, f32 arithmetic, warp/block reductions.
// Prepended to every kernel source before NVRTC compiles it (NVRTC has no file includes of ours).
#include <cuda_bf16.h>

// NVRTC has no <math.h>: infinity from its bit pattern.
#define KILN_INF __int_as_float(0x7f800000)

typedef unsigned int u32;
typedef unsigned long long u64;

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
