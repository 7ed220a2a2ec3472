// cudasim's shared state: devices, streams and the work they run. The driver, NVRTC, cuBLASLt and
// NCCL entry points (driver.cpp, nvrtc.cpp, cublaslt.cpp, nccl.cpp) are one library, so a stream
// the driver made is the stream NCCL enqueues on.
//
// "Device" memory is host memory; a stream runs its work when it is enqueued (so a host wait is
// always already satisfied), or records it while the stream is capturing a graph, and a graph's
// launch runs what was recorded, in order.
#pragma once
#include <atomic>
#include <cstdint>
#include <cstdio>
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
    Graph* capture = nullptr;  // recording into this graph
    bool capture_broken = false;
    const void* capturing_thread = nullptr;
};

struct Context {
    int device = 0;
};

// How many devices the driver reports (KILN_CUDASIM_DEVICES, default 1).
int device_count();
Context* primary(int device);
Context* current_context();

// Runs `w` on `s` now, or records it when `s` is capturing.
void enqueue(Stream* s, Work w);
// A host-synchronous call on `s` (or, for s == nullptr, on the thread): a capture on this thread
// cannot contain one, so it breaks the capture(s) and the call fails, as the driver's does.
bool breaks_capture(Stream* s);
// Whether `s` is capturing (its work is recorded, not run).
bool capturing(const Stream* s);

// The kernel a thread is running, for the out-of-bounds report.
extern thread_local const char* running_kernel;

[[noreturn]] void fatal(const std::string& what);

}  // namespace sim
