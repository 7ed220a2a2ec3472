// The one-shot all-reduce over PCIe peer-to-peer: parallel/oneshot.rs's protocol (tested there
// over CPU rank threads), one block per rank's launch. Each rank's inbox is device memory every
// rank can write (peer access enabled): bf16 values [2 parities][world senders][capacity], then
// one u64 flag per sender holding the last call it finished writing (capacity a multiple of 4,
// so the flags are 8-byte aligned). Call `call` of `rank` (the rank's own device counter, one
// past the last call: counted on the device, so a launch recorded into a CUDA graph takes the next
// number on every replay, as an eager launch does):
//   1. push its n values into slot `rank` of set `call & 1` in every inbox (stores only: loads
//      from a peer over PCIe are the slow, hang-prone direction);
//   2. every thread fences system-wide, the block syncs, then one thread per inbox raises this
//      rank's flag there with a release store;
//   3. thread s < world spins (acquire loads) until sender s's flag in its own inbox reaches
//      `call`, or `deadline` clock cycles pass: then it writes 1 + s to `status` and the launch
//      ends without an output (the host fails the group at the step's end); every later launch
//      on this rank sees the status and returns at once;
//   4. sums the slots in rank order in f32, so every rank writes bit-identical bf16 values.
// The parity of `call` is the closing barrier: set `call & 1` is rewritten only by call + 2,
// which no rank can push before every rank has finished reading this call.

__device__ __forceinline__ void store_release_sys(u64* p, u64 v) {
#ifdef KILN_CUDASIM
    __atomic_store_n(p, v, __ATOMIC_RELEASE);  // cudasim (CUDA on the CPU): no PTX there
#else
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
#endif
}

__device__ __forceinline__ u64 load_acquire_sys(const u64* p) {
#ifdef KILN_CUDASIM
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);  // cudasim (CUDA on the CPU): no PTX there
#else
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#endif
}

extern "C" __global__ void kiln_oneshot_allreduce_bf16(
    const u64* __restrict__ inboxes,  // [world] device addresses of every rank's inbox
    int world, int rank, long capacity, const bf16* x, long n, u64* __restrict__ calls,
    long long deadline, bf16* out, int* __restrict__ status) {
    // `x` and `out` may be one buffer (the host sums in place): every read of `x` happens before
    // the block's barrier, every write of `out` after it, so neither is `__restrict__`.
    // A launch before this one gave up on a peer: the group is down, and the launches queued
    // behind it end at once instead of each waiting out its own deadline.
    if (*(volatile const int*)status != 0) return;
    // Launches on the rank's stream run one after another: the next one reads the new count.
    __shared__ u64 call_of_block;
    if (threadIdx.x == 0) {
        call_of_block = *calls + 1;
        *calls = call_of_block;
    }
    __syncthreads();
    const u64 call = call_of_block;
    const long set = (long)(call & 1);
    const long flags_at = 2L * world * capacity;  // in bf16 values: the flags follow the slots
    for (int dst = 0; dst < world; dst++) {
        bf16* slot = (bf16*)inboxes[dst] + (set * world + rank) * capacity;
        for (long i = threadIdx.x; i < n; i += blockDim.x) slot[i] = x[i];
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < world) {
        u64* flags = (u64*)((bf16*)inboxes[threadIdx.x] + flags_at);
        store_release_sys(flags + rank, call);
    }
    __shared__ int late;
    if (threadIdx.x == 0) late = 0;
    __syncthreads();
    if (threadIdx.x < world) {
        const u64* mine = (const u64*)((const bf16*)inboxes[rank] + flags_at);
        const long long start = clock64();
        while (load_acquire_sys(mine + threadIdx.x) < call) {
            if (clock64() - start > deadline) {
                atomicExch(status, 1 + (int)threadIdx.x);
                late = 1;
                break;
            }
        }
    }
    __syncthreads();
    if (late) return;
    const bf16* slots = (const bf16*)inboxes[rank] + set * world * capacity;
    for (long i = threadIdx.x; i < n; i += blockDim.x) {
        float s = 0.f;
        for (int r = 0; r < world; r++) s += bf16_to_f32(slots[(long)r * capacity + i]);
        out[i] = f32_to_bf16(s);
    }
}
