// cudasim's shared state: devices, streams and the work they run. The driver, NVRTC, cuBLASLt and
// NCCL entry points (driver.cpp, nvrtc.cpp, cublaslt.cpp, nccl.cpp) are one library, so a stream
// the driver made is the stream NCCL enqueues on.
//
// "Device" memory is host memory. Each stream has a worker thread that runs its work in order,
// while the host thread goes on, as a GPU does: a host wait (a stream or event synchronize, a copy
// to pageable memory) really waits, and one that is missing lets the host read what the stream
// has not written yet. The legacy stream (a null handle) runs its work on the calling thread once
// the device's blocking streams have drained. A capturing stream records its work instead, and a
// graph's launch enqueues what was recorded, in order.
#pragma once
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

namespace sim {

// CUresult values kiln can meet (each one exists in cudarc's enum).
enum Result : int {
    kSuccess = 0,
    kInvalidValue = 1,
    kOutOfMemory = 2,
    kNotInitialized = 3,
    kInvalidDevice = 101,
    kInvalidImage = 200,
    kInvalidContext = 201,
    kInvalidHandle = 400,
    kNotFound = 500,
    kNotReady = 600,
    kLaunchOutOfResources = 701,
    kPeerAccessAlreadyEnabled = 704,
    kCaptureUnsupported = 900,
    kCaptureInvalidated = 901,
    kCaptureIsolation = 904,
    kCapturedEvent = 907,
    kCaptureWrongThread = 908,
    kNotSupported = 801,
    kUnknown = 999,
};

using Work = std::function<void()>;

struct Graph {
    std::vector<Work> nodes;
};

struct Stream {
    int device = 0;
    bool non_blocking = false;  // CU_STREAM_NON_BLOCKING: the legacy stream does not wait for it
    // Touched by the host thread only.
    Graph* capture = nullptr;  // recording into this graph
    bool capture_broken = false;
    const void* capturing_thread = nullptr;
    // Shared with the stream's worker, under work_lock().
    std::deque<Work> queue;
    unsigned long long enqueued = 0, done = 0;
    bool destroyed = false;  // the worker leaves (and frees the stream) once the queue is empty
};

struct Context {
    int device = 0;
};

// How many devices the driver reports (KILN_CUDASIM_DEVICES, default 1).
int device_count();
Context* primary(int device);
Context* current_context();

// Queues `w` on `s` (its worker runs it), runs it now for the legacy stream, or records it when
// `s` is capturing.
void enqueue(Stream* s, Work w);
// Everything below waits under one lock and one condition, notified whenever a stream's work ends.
std::mutex& work_lock();
// Blocks until `done()` holds (checked under work_lock()).
void wait_until(const std::function<bool()>& done);
// Counts a collective of `rank` that was still waiting for its peers when its own communicator
// was aborted (KILN_CUDASIM_STATS reports them per rank as "nccl_aborted_waits").
void count_aborted_wait(int rank);
// A host-synchronous call on `s` (or, for s == nullptr, on the thread): a capture on this thread
// cannot contain one, so it breaks the capture(s) and the call fails, as the driver's does.
bool breaks_capture(Stream* s);
// Whether `s` is capturing (its work is recorded, not run).
bool capturing(const Stream* s);

// The kernel a thread is running, for the out-of-bounds report.
extern thread_local const char* running_kernel;
// Whether a stream's worker is running work replayed from a graph (for injected faults).
extern thread_local bool replaying;

[[noreturn]] void fatal(const std::string& what);

}  // namespace sim
