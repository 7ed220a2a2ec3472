// cudasim's CUDA driver API: the subset kiln (through cudarc) calls, on the CPU.
//
// Memory: every allocation is its own mapping, placed so its end touches an unmapped guard page
// (a kernel that runs past a buffer's rounded end faults, and the fault is reported with the
// kernel's name), filled with 0xff bytes (NaN in every float type) as a GPU's is with garbage.
// Kernels: modules are shared objects the simulated NVRTC built (nvrtc.cpp); a launch binds
// (copies) its arguments at once, as cuLaunchKernel does, and queues the grid on its stream's
// worker thread, or records it into the capturing stream's graph.
// Copies follow the driver's rules for host memory: from pageable memory the source is read when
// the call is made (the driver stages it), to pageable memory the call returns once the copy is
// done; to and from pinned memory (cuMemHostAlloc, cuMemHostRegister) they run in stream order,
// so a host that reuses a pinned buffer before its stream got there sees the race.
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>

#include "sim.h"

using sim::Result;

typedef unsigned long long CUdeviceptr;
typedef int CUdevice;
typedef sim::Context* CUcontext;
typedef sim::Stream* CUstream;
typedef sim::Graph* CUgraph;
typedef sim::Graph* CUgraphExec;

// Where a stream reached one record of an event: done once the work queued before it ran.
struct Mark {
    bool done = false;
    std::chrono::steady_clock::time_point at{};
};

// Under sim::work_lock().
struct CUevent_st {
    std::shared_ptr<Mark> mark;       // the last record; none yet: complete
    sim::Graph* captured = nullptr;   // last recorded into this capture: the host may not wait on it
    bool timing = true;               // CU_EVENT_DISABLE_TIMING clears it
};
typedef CUevent_st* CUevent;

struct Module {
    void* dl = nullptr;
    int device = 0;
};
typedef Module* CUmodule;

struct Function {
    Module* module = nullptr;
    std::string name;
    void* (*bind)(void**) = nullptr;
    void (*run)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                const char*) = nullptr;
    void (*free_bound)(void*) = nullptr;
    int max_dynamic_smem = 48 * 1024;
};
typedef Function* CUfunction;

namespace sim {

thread_local const char* running_kernel = nullptr;
thread_local bool replaying = false;

void fatal(const std::string& what) {
    std::fprintf(stderr, "cudasim: %s\n", what.c_str());
    std::fflush(stderr);
    std::abort();
}

int device_count() {
    static int n = [] {
        const char* v = std::getenv("KILN_CUDASIM_DEVICES");
        const int d = v ? std::atoi(v) : 1;
        return d > 0 && d <= 16 ? d : 1;
    }();
    return n;
}

static Context contexts[16];
static thread_local Context* current = nullptr;
// The streams this thread is capturing on (thread-local capture mode: its synchronous calls break them).
static thread_local std::vector<Stream*>* capturing_here = nullptr;

static std::vector<Stream*>& captures_here() {
    if (!capturing_here) capturing_here = new std::vector<Stream*>;
    return *capturing_here;
}

static const void* this_thread() {
    static thread_local char marker;
    return &marker;
}

Context* primary(int device) {
    contexts[device].device = device;
    return &contexts[device];
}

Context* current_context() { return current; }

// Never destroyed: detached workers may still wait on them while the process exits.
std::mutex& work_lock() {
    static std::mutex& m = *new std::mutex;
    return m;
}
static std::condition_variable& work_done = *new std::condition_variable;
// Every stream not yet freed by its worker, under work_lock().
static std::vector<Stream*>& live_streams = *new std::vector<Stream*>;

void wait_until(const std::function<bool()>& done) {
    std::unique_lock<std::mutex> l(work_lock());
    work_done.wait(l, done);
}

// Under work_lock(): whether the device's streams have run everything queued (only the blocking
// ones: what the legacy stream waits for).
static bool device_idle(int device, bool blocking_only) {
    for (const Stream* s : live_streams)
        if (s->device == device && !(blocking_only && s->non_blocking) && s->done != s->enqueued)
            return false;
    return true;
}

static int current_device() { return current ? current->device : 0; }

// The legacy stream's work starts once the device's blocking streams have drained.
void wait_for_legacy_stream(int device) {
    wait_until([=] { return device_idle(device, true); });
}

// Until every stream of the device has run what it was given.
static void wait_for_device(int device) {
    wait_until([=] { return device_idle(device, false); });
}

// KILN_CUDASIM_STREAM_DELAY_US: each stream waits this long before every item, so the host gets
// well ahead of its streams and a missing host wait reads stale data instead of, by luck, data
// the worker already wrote (a race hunt; 0 by default).
static std::chrono::microseconds stream_delay() {
    static const long us = [] {
        const char* v = std::getenv("KILN_CUDASIM_STREAM_DELAY_US");
        return v && std::atol(v) > 0 ? std::atol(v) : 0L;
    }();
    return std::chrono::microseconds(us);
}

static void worker(Stream* s) {
    const auto delay = stream_delay();
    std::unique_lock<std::mutex> l(work_lock());
    for (;;) {
        work_done.wait(l, [&] { return !s->queue.empty() || s->destroyed; });
        if (s->queue.empty()) break;
        Work w = std::move(s->queue.front());
        s->queue.pop_front();
        l.unlock();
        if (delay.count() > 0) std::this_thread::sleep_for(delay);
        w();
        w = nullptr;  // what the work holds (bound arguments) goes before it counts as done
        l.lock();
        s->done++;
        work_done.notify_all();
    }
    live_streams.erase(std::remove(live_streams.begin(), live_streams.end(), s), live_streams.end());
    work_done.notify_all();
    l.unlock();
    delete s;
}

Stream* new_stream(int device, bool non_blocking) {
    auto* s = new Stream;
    s->device = device;
    s->non_blocking = non_blocking;
    try {
        std::thread(worker, s).detach();
    } catch (const std::system_error&) {
        delete s;
        return nullptr;
    }
    std::lock_guard<std::mutex> l(work_lock());
    live_streams.push_back(s);
    return s;
}

void destroy_stream(Stream* s) {
    std::lock_guard<std::mutex> l(work_lock());
    s->destroyed = true;
    work_done.notify_all();
}

// How many items were ever queued on `s`: once that many are done, everything queued so far ran.
static unsigned long long queued_on(Stream* s) {
    std::lock_guard<std::mutex> l(work_lock());
    return s->enqueued;
}

void enqueue(Stream* s, Work w) {
    if (s && s->capture) {
        s->capture->nodes.push_back(std::move(w));
        return;
    }
    if (!s) {
        wait_for_legacy_stream(current_device());
        w();
        return;
    }
    std::lock_guard<std::mutex> l(work_lock());
    s->queue.push_back(std::move(w));
    s->enqueued++;
    work_done.notify_all();
}

// Waits until `s` has run its first `n` items.
static void wait_for(Stream* s, unsigned long long n) {
    wait_until([=] { return s->done >= n; });
}

// Wakes the waiters after a Mark changed.
static void notify_work() { work_done.notify_all(); }

bool breaks_capture(Stream* s) {
    if (s && s->capture) {
        s->capture_broken = true;
        return true;
    }
    auto& here = captures_here();
    for (Stream* c : here) c->capture_broken = true;
    return !here.empty();
}

bool capturing(const Stream* s) { return s && s->capture; }

}  // namespace sim

namespace {

constexpr size_t kPage = 4096;

// Each simulated GPU's memory: KILN_CUDASIM_MEMORY_GIB (default 16), so kiln's own sizing
// (--mem-fraction-static) sees a device of a plausible size and an allocation past it fails.
size_t total_memory() {
    static size_t bytes = [] {
        const char* v = std::getenv("KILN_CUDASIM_MEMORY_GIB");
        const long gib = v ? std::atol(v) : 16;
        return size_t(gib > 0 ? gib : 16) << 30;
    }();
    return bytes;
}

struct Mapping {
    void* base;
    size_t length;
    size_t counted;  // bytes charged to the device
    int device;
};
// Never destroyed: kiln's threads may still free buffers while the process exits.
std::mutex& memory_lock = *new std::mutex;
std::unordered_map<CUdeviceptr, Mapping>& mappings = *new std::unordered_map<CUdeviceptr, Mapping>;
size_t allocated[16] = {};

// A buffer whose rounded end touches an unmapped guard page, on the current context's device.
CUdeviceptr map_buffer(size_t bytes) {
    const size_t rounded = (bytes + 255) & ~size_t(255);
    const int device = sim::current_context() ? sim::current_context()->device : 0;
    {
        std::lock_guard<std::mutex> g(memory_lock);
        if (allocated[device] + rounded > total_memory()) return 0;
    }
    const size_t pages = (rounded + kPage - 1) / kPage + 1;
    void* base = mmap(nullptr, pages * kPage, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return 0;
    char* guard = static_cast<char*>(base) + (pages - 1) * kPage;
    mprotect(guard, kPage, PROT_NONE);
    char* start = guard - rounded;
    std::memset(start, 0xff, rounded);
    const auto ptr = reinterpret_cast<CUdeviceptr>(start);
    std::lock_guard<std::mutex> g(memory_lock);
    mappings[ptr] = {base, pages * kPage, rounded, device};
    allocated[device] += rounded;
    return ptr;
}

// The device a buffer lives on, or -1 when `p` starts no buffer.
int device_of(CUdeviceptr p) {
    std::lock_guard<std::mutex> g(memory_lock);
    auto it = mappings.find(p);
    return it == mappings.end() ? -1 : it->second.device;
}

// Pinned host ranges (start, length): copies to and from them run in stream order.
std::mutex& pinned_lock = *new std::mutex;
std::map<uintptr_t, size_t>& pinned_ranges = *new std::map<uintptr_t, size_t>;

void pin(void* p, size_t bytes) {
    std::lock_guard<std::mutex> g(pinned_lock);
    pinned_ranges[reinterpret_cast<uintptr_t>(p)] = bytes;
}
void unpin(void* p) {
    std::lock_guard<std::mutex> g(pinned_lock);
    pinned_ranges.erase(reinterpret_cast<uintptr_t>(p));
}
bool pinned(const void* p, size_t bytes) {
    const auto at = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> g(pinned_lock);
    auto it = pinned_ranges.upper_bound(at);
    if (it == pinned_ranges.begin()) return false;
    --it;
    return at + bytes <= it->first + it->second;
}

Result unmap_buffer(CUdeviceptr p) {
    if (p == 0) return sim::kSuccess;
    std::lock_guard<std::mutex> g(memory_lock);
    auto it = mappings.find(p);
    if (it == mappings.end()) return sim::kInvalidValue;
    allocated[it->second.device] -= it->second.counted;
    munmap(it->second.base, it->second.length);
    mappings.erase(it);
    return sim::kSuccess;
}

void on_fault(int sig, siginfo_t* info, void*) {
    char msg[256];
    const int n = std::snprintf(msg, sizeof msg, "cudasim: %s at address %p in kernel %s\n",
                                sig == SIGSEGV ? "out-of-bounds access" : "bus error",
                                info->si_addr,
                                sim::running_kernel ? sim::running_kernel : "(none: host code)");
    if (n > 0) (void)!write(2, msg, (size_t)n);
    void* frames[48];
    backtrace_symbols_fd(frames, backtrace(frames, 48), 2);
    signal(sig, SIG_DFL);
    raise(sig);
}

void install_fault_report() {
    static std::once_flag once;
    std::call_once(once, [] {
        struct sigaction sa {};
        sa.sa_sigaction = on_fault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        sigaction(SIGSEGV, &sa, nullptr);
        sigaction(SIGBUS, &sa, nullptr);
    });
}

std::atomic<bool> initialised{false};

// What the process ran, for tests that must know a path was taken (a graph replayed, not only
// recorded): rewritten after every capture and graph launch when KILN_CUDASIM_STATS names a file.
std::atomic<unsigned long> kernel_launches{0}, captures{0}, graph_launches{0};
std::atomic<unsigned long> nccl_aborted_waits[16];  // per rank
std::mutex& per_kernel_lock = *new std::mutex;
std::map<std::string, unsigned long>& per_kernel = *new std::map<std::string, unsigned long>;

// Counts a kernel's launch (run now or replayed from a graph).
void count_kernel(const std::string& name) {
    std::lock_guard<std::mutex> g(per_kernel_lock);
    per_kernel[name]++;
}

void write_stats() {
    static const char* path = std::getenv("KILN_CUDASIM_STATS");
    if (!path) return;
    static std::mutex& lock = *new std::mutex;
    std::lock_guard<std::mutex> g(lock);
    const std::string tmp = std::string(path) + ".tmp";
    if (FILE* f = std::fopen(tmp.c_str(), "w")) {
        std::fprintf(f, "{\"kernel_launches\": %lu, \"captures\": %lu, \"graph_launches\": %lu, ",
                     kernel_launches.load(), captures.load(), graph_launches.load());
        int ranks = 16;
        while (ranks > 0 && nccl_aborted_waits[ranks - 1].load() == 0) ranks--;
        std::fprintf(f, "\"nccl_aborted_waits\": [");
        for (int r = 0; r < ranks; r++) std::fprintf(f, "%s%lu", r ? ", " : "", nccl_aborted_waits[r].load());
        std::fprintf(f, "], \"kernels\": {");
        std::lock_guard<std::mutex> k(per_kernel_lock);
        const char* sep = "";
        for (const auto& [name, n] : per_kernel) {
            std::fprintf(f, "%s\"%s\": %lu", sep, name.c_str(), n);
            sep = ", ";
        }
        std::fprintf(f, "}}\n");
        std::fclose(f);
        std::rename(tmp.c_str(), path);
    }
}

}  // namespace

void sim::count_aborted_wait(int rank) {
    if (rank >= 0 && rank < 16) nccl_aborted_waits[rank]++;
    write_stats();
}

#define API extern "C" __attribute__((visibility("default")))
#define NEED_INIT \
    if (!initialised.load()) return sim::kNotInitialized

API Result cuInit(unsigned) {
    install_fault_report();
    static std::once_flag at_exit;
    std::call_once(at_exit, [] { std::atexit(write_stats); });
    initialised = true;
    write_stats();
    return sim::kSuccess;
}

API Result cuDriverGetVersion(int* v) {
    *v = 13000;
    return sim::kSuccess;
}

API Result cuDeviceGetCount(int* n) {
    NEED_INIT;
    *n = sim::device_count();
    return sim::kSuccess;
}

API Result cuDeviceGet(CUdevice* d, int ordinal) {
    NEED_INIT;
    if (ordinal < 0 || ordinal >= sim::device_count()) return sim::kInvalidDevice;
    *d = ordinal;
    return sim::kSuccess;
}

API Result cuDeviceGetName(char* name, int len, CUdevice d) {
    std::snprintf(name, (size_t)len, "cudasim %d (CUDA on the CPU)", d);
    return sim::kSuccess;
}

API Result cuDeviceGetUuid_v2(unsigned char* uuid, CUdevice d) {
    std::memset(uuid, 0, 16);
    uuid[0] = (unsigned char)d;
    return sim::kSuccess;
}

API Result cuDeviceTotalMem_v2(size_t* bytes, CUdevice) {
    *bytes = total_memory();
    return sim::kSuccess;
}

API Result cuDeviceGetAttribute(int* v, int attribute, CUdevice d) {
    if (d < 0 || d >= sim::device_count()) return sim::kInvalidDevice;
    switch (attribute) {
        case 1: *v = 1024; break;                  // max threads per block
        case 8: *v = 48 * 1024; break;             // shared memory per block
        case 10: *v = 32; break;                   // warp size
        case 13: *v = 1000000; break;              // clock, kHz: clock64() counts nanoseconds
        case 16: *v = 4; break;                    // SMs
        case 36: *v = 1000000; break;              // memory clock, kHz
        case 37: *v = 256; break;                  // bus width, bits
        case 41: *v = 1; break;                    // unified addressing
        case 75: *v = 9; break;                    // compute capability 9.0
        case 76: *v = 0; break;
        case 97: *v = 227 * 1024; break;           // opt-in shared memory per block
        case 115: *v = 0; break;                   // no memory pools: cuMemAlloc
        default: *v = 0; break;
    }
    return sim::kSuccess;
}

API Result cuDeviceCanAccessPeer(int* can, CUdevice, CUdevice) {
    *can = 1;
    return sim::kSuccess;
}

API Result cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
    NEED_INIT;
    if (d < 0 || d >= sim::device_count()) return sim::kInvalidDevice;
    *c = sim::primary(d);
    return sim::kSuccess;
}

API Result cuDevicePrimaryCtxRelease_v2(CUdevice) { return sim::kSuccess; }

API Result cuCtxSetCurrent(CUcontext c) {
    sim::current = c;
    return sim::kSuccess;
}

API Result cuCtxGetCurrent(CUcontext* c) {
    *c = sim::current;
    return sim::kSuccess;
}

API Result cuCtxPushCurrent_v2(CUcontext c) { return cuCtxSetCurrent(c); }
API Result cuCtxPopCurrent_v2(CUcontext* c) {
    if (c) *c = sim::current;
    return sim::kSuccess;
}

API Result cuCtxGetDevice(CUdevice* d) {
    if (!sim::current) return sim::kInvalidContext;
    *d = sim::current->device;
    return sim::kSuccess;
}

API Result cuCtxSynchronize() {
    if (sim::breaks_capture(nullptr)) return sim::kCaptureUnsupported;
    if (!sim::current) return sim::kInvalidContext;
    sim::wait_for_device(sim::current->device);
    return sim::kSuccess;
}

API Result cuCtxEnablePeerAccess(CUcontext peer, unsigned) {
    static std::mutex& lock = *new std::mutex;
    static auto& enabled = *new std::map<std::pair<int, int>, bool>;
    if (!sim::current || !peer) return sim::kInvalidContext;
    std::lock_guard<std::mutex> g(lock);
    auto& e = enabled[{sim::current->device, peer->device}];
    if (e) return sim::kPeerAccessAlreadyEnabled;
    e = true;
    return sim::kSuccess;
}

API Result cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    if (!sim::current) return sim::kInvalidContext;
    std::lock_guard<std::mutex> g(memory_lock);
    const size_t used = allocated[sim::current->device];
    *total = total_memory();
    *free_bytes = total_memory() - (used < total_memory() ? used : total_memory());
    return sim::kSuccess;
}

// cudaMalloc and cudaFree may not run inside a thread-local capture: the capture breaks.
API Result cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    NEED_INIT;
    if (!sim::current) return sim::kInvalidContext;
    if (sim::breaks_capture(nullptr)) return sim::kCaptureUnsupported;
    *p = map_buffer(bytes);
    return *p ? sim::kSuccess : sim::kOutOfMemory;
}

// Like cudaFree, a free waits for the device's work, which may still read the buffer.
API Result cuMemFree_v2(CUdeviceptr p) {
    if (sim::breaks_capture(nullptr)) return sim::kCaptureUnsupported;
    const int device = device_of(p);
    if (device < 0) return p == 0 ? sim::kSuccess : sim::kInvalidValue;
    sim::wait_for_device(device);
    return unmap_buffer(p);
}

// Stream-ordered allocation is never used (the device reports no memory pools); refused while
// capturing, where the driver would record it as a node.
API Result cuMemAllocAsync(CUdeviceptr* p, size_t bytes, CUstream s) {
    if (sim::capturing(s)) return sim::kCaptureUnsupported;
    return cuMemAlloc_v2(p, bytes);
}
API Result cuMemFreeAsync(CUdeviceptr p, CUstream s) {
    if (sim::capturing(s)) return sim::kCaptureUnsupported;
    if (device_of(p) < 0) return p == 0 ? sim::kSuccess : sim::kInvalidValue;
    sim::enqueue(s, [=] { unmap_buffer(p); });
    return sim::kSuccess;
}

API Result cuMemAllocHost_v2(void** p, size_t bytes) {
    *p = std::malloc(bytes ? bytes : 1);
    if (!*p) return sim::kOutOfMemory;
    pin(*p, bytes ? bytes : 1);
    return sim::kSuccess;
}
API Result cuMemHostAlloc(void** p, size_t bytes, unsigned) { return cuMemAllocHost_v2(p, bytes); }
// Queued copies may still use the pinned buffer: wait for every device's work first.
static void wait_all_devices() {
    for (int d = 0; d < sim::device_count(); d++) sim::wait_for_device(d);
}

API Result cuMemFreeHost(void* p) {
    wait_all_devices();
    unpin(p);
    std::free(p);
    return sim::kSuccess;
}
API Result cuMemHostRegister_v2(void* p, size_t bytes, unsigned) {
    pin(p, bytes);
    return sim::kSuccess;
}
API Result cuMemHostUnregister(void* p) {
    wait_all_devices();
    unpin(p);
    return sim::kSuccess;
}

static void copy_on(CUstream s, void* dst, const void* src, size_t n) {
    sim::enqueue(s, [=] { std::memmove(dst, src, n); });
}

// A graph cannot hold a copy to or from pageable memory (its staging is a host-side step): the
// capture breaks, as the driver's does.
static Result pageable_in_capture(CUstream s) {
    sim::breaks_capture(s);
    return sim::kCaptureUnsupported;
}

// From pageable memory the driver stages the source before it returns; from pinned memory the
// copy reads it when the stream gets there.
API Result cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
    const bool pinned_src = pinned(src, n);
    if (sim::capturing(s) && !pinned_src) return pageable_in_capture(s);
    if (pinned_src) {
        copy_on(s, reinterpret_cast<void*>(dst), src, n);
        return sim::kSuccess;
    }
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + n);
    void* to = reinterpret_cast<void*>(dst);
    sim::enqueue(s, [=] { std::memcpy(to, staged->data(), n); });
    return sim::kSuccess;
}
// To pageable memory the call returns once the copy is done; to pinned memory, at once.
API Result cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
    if (pinned(dst, n)) {
        copy_on(s, dst, reinterpret_cast<const void*>(src), n);
        return sim::kSuccess;
    }
    if (sim::capturing(s)) return pageable_in_capture(s);
    copy_on(s, dst, reinterpret_cast<const void*>(src), n);
    if (s) sim::wait_for(s, sim::queued_on(s));
    return sim::kSuccess;
}
API Result cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    copy_on(s, reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
    return sim::kSuccess;
}
API Result cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return cuMemcpyDtoDAsync_v2(dst, src, n, s);
}
API Result cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext, CUdeviceptr src, CUcontext, size_t n,
                             CUstream s) {
    return cuMemcpyDtoDAsync_v2(dst, src, n, s);
}
API Result cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    if (sim::breaks_capture(nullptr)) return sim::kCaptureUnsupported;
    sim::wait_for_legacy_stream(sim::current_device());
    std::memmove(reinterpret_cast<void*>(dst), src, n);
    return sim::kSuccess;
}
API Result cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    if (sim::breaks_capture(nullptr)) return sim::kCaptureUnsupported;
    sim::wait_for_legacy_stream(sim::current_device());
    std::memmove(dst, reinterpret_cast<const void*>(src), n);
    return sim::kSuccess;
}
API Result cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    if (sim::breaks_capture(nullptr)) return sim::kCaptureUnsupported;
    sim::wait_for_legacy_stream(sim::current_device());
    std::memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
    return sim::kSuccess;
}

API Result cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s) {
    sim::enqueue(s, [=] { std::memset(reinterpret_cast<void*>(dst), v, n); });
    return sim::kSuccess;
}
API Result cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, CUstream s) {
    sim::enqueue(s, [=] {
        auto* p = reinterpret_cast<unsigned*>(dst);
        for (size_t i = 0; i < n; i++) p[i] = v;
    });
    return sim::kSuccess;
}
API Result cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    if (sim::breaks_capture(nullptr)) return sim::kCaptureUnsupported;
    sim::wait_for_legacy_stream(sim::current_device());
    std::memset(reinterpret_cast<void*>(dst), v, n);
    return sim::kSuccess;
}

API Result cuStreamCreate(CUstream* s, unsigned flags) {
    NEED_INIT;
    if (!sim::current) return sim::kInvalidContext;
    *s = sim::new_stream(sim::current->device, (flags & 1) != 0);
    return *s ? sim::kSuccess : sim::kOutOfMemory;
}
API Result cuStreamCreateWithPriority(CUstream* s, unsigned flags, int) {
    return cuStreamCreate(s, flags);
}
API Result cuStreamDestroy_v2(CUstream s) {
    if (s && s->capture) sim::fatal("a stream was destroyed in the middle of a graph capture");
    if (s) sim::destroy_stream(s);  // its worker frees it once its queue is done, as the driver does
    return sim::kSuccess;
}
API Result cuStreamSynchronize(CUstream s) {
    if (sim::breaks_capture(s)) return sim::kCaptureUnsupported;
    if (!s) {
        sim::wait_for_legacy_stream(sim::current_device());
        return sim::kSuccess;
    }
    sim::wait_for(s, sim::queued_on(s));
    return sim::kSuccess;
}
API Result cuStreamQuery(CUstream s) {
    if (sim::breaks_capture(s)) return sim::kCaptureUnsupported;
    std::lock_guard<std::mutex> l(sim::work_lock());
    if (!s) return sim::device_idle(sim::current_device(), true) ? sim::kSuccess : sim::kNotReady;
    return s->done == s->enqueued ? sim::kSuccess : sim::kNotReady;
}
// The stream's later work waits for the event's last record. In a capture the wait joins the
// event's node of the same capture (the simulation keeps host order there); an event recorded
// outside it cannot join one (the capture breaks, CUDA_ERROR_STREAM_CAPTURE_ISOLATION), and one
// recorded inside a capture cannot be waited on outside it.
API Result cuStreamWaitEvent(CUstream s, CUevent e, unsigned) {
    if (!e) return sim::kInvalidHandle;
    std::shared_ptr<Mark> mark;
    sim::Graph* captured;
    {
        std::lock_guard<std::mutex> l(sim::work_lock());
        mark = e->mark;
        captured = e->captured;
    }
    if (sim::capturing(s)) {
        if (mark && captured != s->capture) {
            s->capture_broken = true;
            return sim::kCaptureIsolation;
        }
        return sim::kSuccess;
    }
    if (captured) return sim::kCapturedEvent;
    if (!mark) return sim::kSuccess;
    sim::enqueue(s, [mark] { sim::wait_until([mark] { return mark->done; }); });
    return sim::kSuccess;
}

API Result cuStreamBeginCapture_v2(CUstream s, int) {
    if (!s) return sim::kCaptureUnsupported;  // the legacy stream cannot capture
    if (s->capture) return sim::kInvalidValue;
    s->capture = new sim::Graph;
    s->capture_broken = false;
    s->capturing_thread = sim::this_thread();
    sim::captures_here().push_back(s);
    return sim::kSuccess;
}

API Result cuStreamEndCapture(CUstream s, CUgraph* g) {
    if (!s || !s->capture) return sim::kInvalidValue;
    if (s->capturing_thread != sim::this_thread()) return sim::kCaptureWrongThread;
    sim::Graph* graph = s->capture;
    s->capture = nullptr;
    auto& here = sim::captures_here();
    here.erase(std::remove(here.begin(), here.end(), s), here.end());
    if (s->capture_broken) {
        delete graph;
        *g = nullptr;
        return sim::kCaptureInvalidated;
    }
    *g = graph;
    captures++;
    write_stats();
    return sim::kSuccess;
}

API Result cuStreamIsCapturing(CUstream s, int* status) {
    *status = s && s->capture ? (s->capture_broken ? 2 : 1) : 0;
    return sim::kSuccess;
}

API Result cuLaunchHostFunc(CUstream s, void (*fn)(void*), void* data) {
    sim::enqueue(s, [=] { fn(data); });
    return sim::kSuccess;
}

API Result cuGraphInstantiateWithFlags(CUgraphExec* exec, CUgraph g, unsigned long long) {
    if (!g) return sim::kInvalidValue;
    *exec = new sim::Graph(*g);
    return sim::kSuccess;
}
API Result cuGraphUpload(CUgraphExec, CUstream) { return sim::kSuccess; }
API Result cuGraphLaunch(CUgraphExec exec, CUstream s) {
    if (!exec) return sim::kInvalidValue;
    for (auto& node : exec->nodes)
        sim::enqueue(s, [node] {
            sim::replaying = true;
            node();
            sim::replaying = false;
        });
    graph_launches++;
    write_stats();
    return sim::kSuccess;
}
API Result cuGraphExecDestroy(CUgraphExec exec) {
    delete exec;
    return sim::kSuccess;
}
API Result cuGraphDestroy(CUgraph g) {
    delete g;
    return sim::kSuccess;
}

API Result cuEventCreate(CUevent* e, unsigned flags) {
    *e = new CUevent_st;
    (*e)->timing = (flags & 2) == 0;  // CU_EVENT_DISABLE_TIMING
    return sim::kSuccess;
}
// Work already queued that completes a record holds its Mark, not the event.
API Result cuEventDestroy_v2(CUevent e) {
    delete e;
    return sim::kSuccess;
}
API Result cuEventRecord(CUevent e, CUstream s) {
    if (!e) return sim::kInvalidHandle;
    auto mark = std::make_shared<Mark>();
    {
        std::lock_guard<std::mutex> l(sim::work_lock());
        e->mark = mark;
        e->captured = sim::capturing(s) ? s->capture : nullptr;
    }
    sim::enqueue(s, [mark] {
        {
            std::lock_guard<std::mutex> l(sim::work_lock());
            mark->at = std::chrono::steady_clock::now();
            mark->done = true;
        }
        sim::notify_work();
    });
    return sim::kSuccess;
}
API Result cuEventRecordWithFlags(CUevent e, CUstream s, unsigned) { return cuEventRecord(e, s); }
API Result cuEventSynchronize(CUevent e) {
    if (!e) return sim::kInvalidHandle;
    std::shared_ptr<Mark> mark;
    {
        std::lock_guard<std::mutex> l(sim::work_lock());
        if (e->captured) return sim::kCapturedEvent;
        mark = e->mark;
    }
    if (sim::breaks_capture(nullptr)) return sim::kCaptureUnsupported;
    if (mark) sim::wait_until([mark] { return mark->done; });
    return sim::kSuccess;
}
API Result cuEventQuery(CUevent e) {
    if (!e) return sim::kInvalidHandle;
    std::lock_guard<std::mutex> l(sim::work_lock());
    if (e->captured) return sim::kCapturedEvent;
    return !e->mark || e->mark->done ? sim::kSuccess : sim::kNotReady;
}
API Result cuEventElapsedTime_v2(float* ms, CUevent start, CUevent end) {
    if (!start || !end) return sim::kInvalidHandle;
    std::lock_guard<std::mutex> l(sim::work_lock());
    // Never recorded, or made with CU_EVENT_DISABLE_TIMING (cudarc's default), as the driver.
    if (!start->mark || !end->mark || !start->timing || !end->timing) return sim::kInvalidHandle;
    if (!start->mark->done || !end->mark->done) return sim::kNotReady;
    *ms = std::chrono::duration<float, std::milli>(end->mark->at - start->mark->at).count();
    return sim::kSuccess;
}
API Result cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
    return cuEventElapsedTime_v2(ms, start, end);
}

// The simulated NVRTC's "PTX" names the shared object it built (nvrtc.cpp).
static const char kModuleMark[] = "//cudasim-module:";

API Result cuModuleLoadData(CUmodule* m, const void* image) {
    if (!sim::current) return sim::kInvalidContext;
    const char* text = static_cast<const char*>(image);
    if (std::strncmp(text, kModuleMark, sizeof kModuleMark - 1) != 0) return sim::kInvalidImage;
    std::string path(text + sizeof kModuleMark - 1);
    while (!path.empty() && (path.back() == '\n' || path.back() == '\0')) path.pop_back();
    void* dl = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!dl) {
        std::fprintf(stderr, "cudasim: loading %s: %s\n", path.c_str(), dlerror());
        return sim::kInvalidImage;
    }
    *m = new Module{dl, sim::current->device};
    return sim::kSuccess;
}

API Result cuModuleUnload(CUmodule) { return sim::kSuccess; }  // functions may outlive it

API Result cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
    const std::string bind = std::string("kilnsim_bind_") + name;
    auto* fn = new Function;
    fn->module = m;
    fn->name = name;
    fn->bind = reinterpret_cast<void* (*)(void**)>(dlsym(m->dl, bind.c_str()));
    fn->run = reinterpret_cast<decltype(fn->run)>(dlsym(m->dl, "kilnsim_run"));
    fn->free_bound = reinterpret_cast<void (*)(void*)>(dlsym(m->dl, "kilnsim_free"));
    if (!fn->bind || !fn->run || !fn->free_bound) {
        delete fn;
        return sim::kNotFound;
    }
    *f = fn;
    return sim::kSuccess;
}

API Result cuFuncSetAttribute(CUfunction f, int attribute, int value) {
    if (attribute == 8) {  // max dynamic shared memory
        if (value < 0 || value > 227 * 1024) return sim::kInvalidValue;
        f->max_dynamic_smem = value;
    }
    return sim::kSuccess;
}

API Result cuFuncGetAttribute(int* v, int attribute, CUfunction f) {
    switch (attribute) {
        case 0: *v = 1024; break;  // max threads per block
        case 4: *v = 32; break;    // registers
        case 8: *v = f->max_dynamic_smem; break;
        default: *v = 0; break;
    }
    return sim::kSuccess;
}

API Result cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                          unsigned by, unsigned bz, unsigned smem, CUstream s, void** params,
                          void** extra) {
    if (!f || extra) return sim::kInvalidValue;
    // The function's module and the stream must belong to the current context's device.
    if (!sim::current) return sim::kInvalidContext;
    if (f->module->device != sim::current->device || (s && s->device != sim::current->device)) {
        std::fprintf(stderr, "cudasim: %s launched on device %d with a %s of device %d\n", f->name.c_str(),
                     sim::current->device, f->module->device != sim::current->device ? "module" : "stream",
                     f->module->device != sim::current->device ? f->module->device : s->device);
        return sim::kInvalidHandle;
    }
    const unsigned long long threads = (unsigned long long)bx * by * bz;
    if (gx == 0 || gy == 0 || gz == 0 || threads == 0 || gy > 65535 || gz > 65535 ||
        gx > 0x7fffffffu)
        return sim::kInvalidValue;
    if (threads > 1024 || by > 1024 || bz > 64) return sim::kInvalidValue;
    if ((int)smem > f->max_dynamic_smem) {
        std::fprintf(stderr, "cudasim: %s launched with %u bytes of dynamic shared memory, over its %d\n",
                     f->name.c_str(), smem, f->max_dynamic_smem);
        return sim::kInvalidValue;
    }
    // Bound now: a launch copies its arguments when it is enqueued.
    std::shared_ptr<void> bound(f->bind(params), f->free_bound);
    kernel_launches++;
    Function* fn = f;
    sim::enqueue(s, [=] {
        const char* outer = sim::running_kernel;
        sim::running_kernel = fn->name.c_str();
        fn->run(bound.get(), gx, gy, gz, bx, by, bz, smem, fn->name.c_str());
        sim::running_kernel = outer;
        count_kernel(fn->name);
    });
    return sim::kSuccess;
}

API Result cuGetErrorString(Result r, const char** s) {
    switch (r) {
        case sim::kSuccess: *s = "no error"; break;
        case sim::kCaptureUnsupported: *s = "operation not permitted when stream is capturing"; break;
        case sim::kCaptureInvalidated: *s = "operation failed due to a previous error during capture"; break;
        default: *s = "cudasim error"; break;
    }
    return sim::kSuccess;
}
API Result cuGetErrorName(Result r, const char** s) { return cuGetErrorString(r, s); }
