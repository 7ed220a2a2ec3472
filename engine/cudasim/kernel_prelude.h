// cudasim's kernel prelude: what a CUDA C kernel source needs to compile and run as host C++.
//
// The simulated NVRTC hands kiln's kernel sources (common.cuh and the file, exactly as a GPU
// gets them) to g++ with this header in front. Each CUDA thread of a block is a fiber: one OS
// thread runs a block's fibers round-robin, each until its next barrier (__syncthreads, a warp
// shuffle or __syncwarp), so barrier semantics, shared memory and warp shuffles behave as on a
// GPU, and the order threads run between barriers is fixed (a race shows up as a wrong answer
// every time, or never: this checks indexing and protocol, not memory ordering). A barrier some
// live threads never reach is reported and aborts the process, as a hung kernel would be.
#pragma once
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <sched.h>
#include <sys/mman.h>
#include <vector>

#if !defined(__x86_64__)
#error "cudasim's fibers switch stacks with x86-64 code"
#endif

#define KILN_CUDASIM 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
// A block's shared memory: one copy per OS thread, and an OS thread runs one block at a time.
#define __shared__ static thread_local

struct kilnsim_uint3 {
    unsigned x, y, z;
};

namespace kilnsim {

enum class Wait { None, Block, Warp };

struct Fiber {
    void* sp = nullptr;
    kilnsim_uint3 idx{0, 0, 0};
    unsigned warp = 0, lane = 0;
    bool done = false;
    Wait wait = Wait::None;
    unsigned long gen = 0;
};

struct Barrier {
    unsigned live = 0, arrived = 0;
    unsigned long gen = 0;
};

struct WarpState {
    Barrier barrier;
    uint64_t slot[32];
    uint32_t mma_fragments[32][6];  // each lane's A (4 words) and B (2 words) of an mma.sync
};

struct BlockState {
    std::vector<Fiber> fibers;
    std::vector<WarpState> warps;
    Barrier barrier;
    void* scheduler_sp = nullptr;
    const std::function<void()>* body = nullptr;
    const char* kernel = "";
};

inline thread_local BlockState* block = nullptr;
inline thread_local Fiber* current = nullptr;
inline thread_local kilnsim_uint3 block_idx{0, 0, 0}, block_dim{1, 1, 1}, grid_dim{1, 1, 1};
inline thread_local unsigned char* dynamic_smem = nullptr;

constexpr size_t kStack = 256 * 1024;

// Saves the callee-saved registers on the current stack, stores its pointer in *from, and
// resumes the stack `to` (saved the same way, or prepared by `start`).
extern "C" __attribute__((visibility("hidden"))) void kilnsim_switch(void** from, void* to);
asm(R"(
.text
.globl kilnsim_switch
.hidden kilnsim_switch
.type kilnsim_switch,@function
kilnsim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size kilnsim_switch, .-kilnsim_switch
)");

[[noreturn]] inline void fail(const char* what) {
    std::fprintf(stderr, "cudasim: kernel %s: %s\n", block ? block->kernel : "?", what);
    std::fflush(stderr);
    std::abort();
}

inline void yield_to_scheduler() { kilnsim_switch(&current->sp, block->scheduler_sp); }

inline void release(Barrier& b) {
    b.arrived = 0;
    b.gen++;
}

// Waits at `b` until every live participant has arrived; the last to arrive goes on at once.
inline void arrive(Barrier& b, Wait kind) {
    b.arrived++;
    if (b.arrived == b.live) {
        release(b);
        return;
    }
    current->wait = kind;
    current->gen = b.gen;
    yield_to_scheduler();
    current->wait = Wait::None;
}

inline void sync_threads() { arrive(block->barrier, Wait::Block); }
inline void sync_warp() { arrive(block->warps[current->warp].barrier, Wait::Warp); }

// A thread's end: it leaves the block's barrier, which may release the threads waiting without
// it (a GPU counts exited threads out of __syncthreads). Its warp's lanes waiting at a shuffle
// would wait for it forever, or read what it never wrote: undefined on a GPU, an error here.
inline void leave(Barrier& b) {
    b.live--;
    if (b.arrived > 0 && b.arrived == b.live) release(b);
}

inline void leave_warp(Barrier& b) {
    if (b.arrived > 0) fail("a thread returned while lanes of its warp wait at a shuffle or __syncwarp");
    b.live--;
}

extern "C" __attribute__((used)) void kilnsim_fiber_entry() {
    (*block->body)();
    current->done = true;
    leave(block->barrier);
    leave_warp(block->warps[current->warp].barrier);
    yield_to_scheduler();
    fail("a finished thread was resumed");
}

inline std::vector<void*>& stacks() {
    static thread_local std::vector<void*> s;
    return s;
}

inline void* stack_for(size_t i) {
    auto& s = stacks();
    while (s.size() <= i) {
        void* p = mmap(nullptr, kStack, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
        if (p == MAP_FAILED) fail("no memory for a thread's stack");
        mprotect(p, 4096, PROT_NONE);  // an overflow faults instead of writing the next stack
        s.push_back(p);
    }
    return s[i];
}

// A fresh stack whose first switch "returns" into kilnsim_fiber_entry with the ABI's alignment.
inline void* start(size_t i) {
    auto top = reinterpret_cast<uintptr_t>(stack_for(i)) + kStack;
    auto* sp = reinterpret_cast<void**>(top & ~uintptr_t(15));
    *--sp = nullptr;  // the entry's return address: it never returns
    *--sp = reinterpret_cast<void*>(&kilnsim_fiber_entry);
    for (int r = 0; r < 6; r++) *--sp = nullptr;  // rbp rbx r12 r13 r14 r15
    return sp;
}

inline bool runnable(const Fiber& f) {
    switch (f.wait) {
        case Wait::None: return true;
        case Wait::Block: return block->barrier.gen != f.gen;
        case Wait::Warp: return block->warps[f.warp].barrier.gen != f.gen;
    }
    return false;
}

inline void run_block(BlockState& b) {
    const unsigned n = block_dim.x * block_dim.y * block_dim.z;
    b.fibers.assign(n, Fiber{});
    b.warps.assign((n + 31) / 32, WarpState{});
    b.barrier = Barrier{n, 0, 0};
    for (unsigned t = 0; t < n; t++) {
        Fiber& f = b.fibers[t];
        f.idx = {t % block_dim.x, (t / block_dim.x) % block_dim.y, t / (block_dim.x * block_dim.y)};
        f.warp = t / 32;
        f.lane = t % 32;
        f.sp = start(t);
        b.warps[f.warp].barrier.live++;
    }
    unsigned finished = 0;
    while (finished < n) {
        bool progressed = false;
        for (auto& f : b.fibers) {
            if (f.done || !runnable(f)) continue;
            current = &f;
            kilnsim_switch(&b.scheduler_sp, f.sp);
            progressed = true;
            if (f.done) finished++;
        }
        if (!progressed) fail("a barrier that some live threads never reach (the kernel would hang)");
    }
    current = nullptr;
}

inline void run_grid(const std::function<void()>& body, kilnsim_uint3 grid, kilnsim_uint3 dim,
                     unsigned smem_bytes, const char* kernel) {
    if (dim.x * dim.y * dim.z == 0 || dim.x * dim.y * dim.z > 1024) fail("a block of 0 or more than 1024 threads");
    BlockState b;
    b.body = &body;
    b.kernel = kernel;
    std::vector<unsigned char> smem(smem_bytes + 16);
    grid_dim = grid;
    block_dim = dim;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                // Dynamic shared memory starts as garbage on a GPU: NaN bytes here, so a read
                // before a write shows.
                std::memset(smem.data(), 0xff, smem.size());
                dynamic_smem = smem.data();
                block_idx = {x, y, z};
                block = &b;
                run_block(b);
                block = nullptr;
            }
}

inline uint64_t bits_of(float v) { uint32_t u; std::memcpy(&u, &v, 4); return u; }
inline uint64_t bits_of(int v) { return (uint32_t)v; }
inline uint64_t bits_of(unsigned v) { return v; }
inline uint64_t bits_of(long long v) { return (uint64_t)v; }
inline uint64_t bits_of(unsigned long long v) { return v; }
template <typename T>
inline T from_bits(uint64_t b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

// Whether lane `l` of the current warp exists (a block's last warp may be short) and has not
// returned: only those publish values.
inline bool lane_present(unsigned l) {
    const unsigned t = current->warp * 32 + l;
    return t < block->fibers.size() && !block->fibers[t].done;
}

// Every lane publishes its value, then reads lane `src(lane)`'s (its own where that lane is
// absent or out of range), with a warp barrier on each side so no slot is overwritten early.
template <typename T, typename Src>
inline T exchange(T v, Src src) {
    auto& w = block->warps[current->warp];
    w.slot[current->lane] = bits_of(v);
    sync_warp();
    const int s = src((int)current->lane);
    const T r = (s >= 0 && s < 32 && lane_present(s)) ? from_bits<T>(w.slot[s]) : v;
    sync_warp();
    return r;
}

// IEEE half to float, exactly (what PTX's cvt.f32.f16 does): half.h's, which build.sh puts
// ahead of this prelude.
inline float f16_to_f32(unsigned short h) { return kilnsim_half::f16_to_f32(h); }

// warp_reduce's butterfly (v = op(v, shfl_xor(v, o)) for o = 16, 8, 4, 2, 1) for the whole warp
// at one barrier: every lane publishes its value, the last to arrive replays the 32 lanes'
// rounds in the order a GPU's lanes do them and leaves each lane its result in its slot, so the
// results are the butterfly's, bit for bit. An absent source lane leaves a lane its own value,
// as `exchange` does.
template <typename Op>
inline float warp_butterfly(float v, Op op) {
    auto& w = block->warps[current->warp];
    w.slot[current->lane] = bits_of(v);
    Barrier& b = w.barrier;
    if (++b.arrived == b.live) {
        bool present[32];
        float vals[32], next[32];
        for (unsigned l = 0; l < 32; l++) {
            present[l] = lane_present(l);
            vals[l] = present[l] ? from_bits<float>(w.slot[l]) : 0.0f;
        }
        for (unsigned o = 16; o > 0; o >>= 1) {
            for (unsigned l = 0; l < 32; l++) next[l] = op(vals[l], present[l ^ o] ? vals[l ^ o] : vals[l]);
            for (unsigned l = 0; l < 32; l++) vals[l] = next[l];
        }
        for (unsigned l = 0; l < 32; l++) w.slot[l] = bits_of(vals[l]);
        release(b);
    } else {
        current->wait = Wait::Warp;
        current->gen = b.gen;
        yield_to_scheduler();
        current->wait = Wait::None;
    }
    const float r = from_bits<float>(w.slot[current->lane]);
    sync_warp();  // no lane publishes again before every lane has read its result
    return r;
}

// One bf16 of a 32-bit word holding two (element e: 0 the low half, 1 the high) as f32.
inline float bf16_half(uint32_t word, unsigned e) {
    return from_bits<float>((uint64_t)((e ? word >> 16 : word & 0xffffu) << 16));
}

// PTX's mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 with D = C (d += A B) for the whole
// warp: every lane publishes its A words (4) and B words (2) at one warp barrier, then computes
// its own four D values from the gathered 16x16 A and 16x8 B, each fragment read where the PTX
// ISA puts it ("Matrix Fragments for mma.m16n8k16 with floating point type"; lane l, g = l / 4,
// t = l % 4: A word r holds row g + 8 (r % 2), columns 2t + 8 (r / 2) and the next; B word r
// rows 2t + 8r and the next of column g; D value r row g + 8 (r / 2), column 2t + r % 2). A
// kernel that puts a value in the wrong register gets the wrong product here, as on a GPU. The
// products are exact in f32 and summed in k order; a tensor core's order and rounding are its
// own, so results agree to f32 rounding, not bit for bit.
inline void mma_bf16_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2]) {
    auto& w = block->warps[current->warp];
    if (w.barrier.live != 32) fail("mma.sync with lanes of its warp absent or returned (undefined on a GPU)");
    const unsigned lane = current->lane;
    for (int r = 0; r < 4; r++) w.mma_fragments[lane][r] = a[r];
    for (int r = 0; r < 2; r++) w.mma_fragments[lane][4 + r] = b[r];
    sync_warp();
    const auto a_at = [&](unsigned row, unsigned k) {
        return bf16_half(w.mma_fragments[(row % 8) * 4 + (k % 8) / 2][row / 8 + 2 * (k / 8)], k % 2);
    };
    const auto b_at = [&](unsigned k, unsigned n) {
        return bf16_half(w.mma_fragments[n * 4 + (k % 8) / 2][4 + k / 8], k % 2);
    };
    const unsigned g = lane / 4, t = lane % 4;
    for (unsigned r = 0; r < 4; r++) {
        const unsigned row = g + 8 * (r / 2), col = 2 * t + r % 2;
        float s = d[r];
        for (unsigned k = 0; k < 16; k++) s += a_at(row, k) * b_at(k, col);
        d[r] = s;
    }
    sync_warp();  // no lane publishes its next fragments before every lane has read these
}

}  // namespace kilnsim

#define threadIdx (kilnsim::current->idx)
#define blockIdx (kilnsim::block_idx)
#define blockDim (kilnsim::block_dim)
#define gridDim (kilnsim::grid_dim)
#define warpSize 32

// Only full-warp shuffles are simulated: a partial mask is refused rather than guessed at.
inline void kilnsim_full_mask(unsigned mask, int width) {
    if (mask != 0xffffffffu || width != 32) kilnsim::fail("a shuffle over part of a warp (not simulated)");
}
inline void __syncthreads() { kilnsim::sync_threads(); }
inline void __syncwarp(unsigned m = 0xffffffffu) {
    kilnsim_full_mask(m, 32);
    kilnsim::sync_warp();
}
template <typename T>
inline T __shfl_xor_sync(unsigned m, T v, int mask, int width = 32) {
    kilnsim_full_mask(m, width);
    return kilnsim::exchange(v, [=](int lane) { return lane ^ mask; });
}
template <typename T>
inline T __shfl_down_sync(unsigned m, T v, unsigned delta, int width = 32) {
    kilnsim_full_mask(m, width);
    return kilnsim::exchange(v, [=](int lane) { return (lane % width) + (int)delta < width ? lane + (int)delta : lane; });
}
template <typename T>
inline T __shfl_up_sync(unsigned m, T v, unsigned delta, int width = 32) {
    kilnsim_full_mask(m, width);
    return kilnsim::exchange(v, [=](int lane) { return (lane % width) >= (int)delta ? lane - (int)delta : lane; });
}
template <typename T>
inline T __shfl_sync(unsigned m, T v, int src, int width = 32) {
    kilnsim_full_mask(m, width);
    return kilnsim::exchange(v, [=](int lane) { return (lane / width) * width + (src % width); });
}

inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// The simulated device reports a 1 GHz clock (CU_DEVICE_ATTRIBUTE_CLOCK_RATE), so a cycle is a
// nanosecond of the host's steady clock. Kernels read the clock in spin loops only (waiting on a
// peer rank's thread): each read yields the core, so a waiting rank does not starve the one it
// waits for on a small machine.
inline long long clock64() {
    sched_yield();
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

template <typename T>
inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline float atomicAdd(float* p, float v) {
    auto* word = reinterpret_cast<uint32_t*>(p);
    uint32_t seen = __atomic_load_n(word, __ATOMIC_SEQ_CST);
    for (;;) {
        float old;
        std::memcpy(&old, &seen, 4);
        const float sum = old + v;
        uint32_t next;
        std::memcpy(&next, &sum, 4);
        if (__atomic_compare_exchange_n(word, &seen, next, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return old;
    }
}
template <typename T>
inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
template <typename T>
inline T atomicMax(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
template <typename T>
inline T atomicCAS(T* p, T compare, T v) {
    __atomic_compare_exchange_n(p, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}

inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float f) { int v; std::memcpy(&v, &f, 4); return v; }
inline unsigned __float_as_uint(float f) { unsigned v; std::memcpy(&v, &f, 4); return v; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
template <typename T>
inline T __ldg(const T* p) { return *p; }
#include <math.h>  // expf, fmaxf, sqrtf and the rest, as CUDA names them
inline void sincosf(float x, float* s, float* c) {
    *s = std::sin(x);
    *c = std::cos(x);
}
// CUDA's min/max overloads for the integer and float types kernels mix.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

// The launch side, called by the simulated driver through the wrappers cudasim generates for
// each kernel (`kilnsim_bind_<name>` copies the arguments when the launch is enqueued).
extern "C" __attribute__((visibility("default"))) void kilnsim_run(void* bound, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                   unsigned by, unsigned bz, unsigned smem, const char* name) {
    kilnsim::run_grid(*static_cast<std::function<void()>*>(bound), {gx, gy, gz}, {bx, by, bz}, smem,
                      name);
}
extern "C" __attribute__((visibility("default"))) void kilnsim_free(void* bound) { delete static_cast<std::function<void()>*>(bound); }
