// cudasim's NCCL: communicators between the rank threads of one process. A collective runs when
// its stream's worker reaches it (queued, or replayed from a graph): every rank's n-th collective meets the
// others' n-th, sums or gathers in rank order (f32 accumulation, so every rank gets identical
// values), and a barrier on each side keeps in-place buffers from being overwritten while a peer
// still reads them. A collective runs on its stream's worker thread, so a rank that never arrives
// leaves the others' streams waiting, as NCCL does, while their host threads go on, until
// ncclCommAbort ends the wait.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "half.h"
#include "sim.h"

namespace {

// ncclResult_t
constexpr int kSuccess = 0, kInvalidArgument = 4, kInvalidUsage = 5, kRemoteError = 6;
// ncclDataType_t
constexpr int kI32 = 2, kF16 = 6, kF32 = 7, kBF16 = 9;

struct Group {
    int world = 0;
    std::mutex m;
    std::condition_variable cv;
    unsigned long gen = 0;
    int arrived = 0;
    // Per rank, as NCCL's: one rank's ncclCommAbort ends its own waits only; its peers go on
    // waiting for it until their own watchdogs abort them.
    std::vector<bool> aborted;
    std::vector<const void*> send;
    std::vector<std::string> what;  // each rank's collective: kind, count and type must agree
};

struct Comm {
    std::shared_ptr<Group> group;
    int rank = 0, device = 0;
};

// Never destroyed: rank threads may still be in a collective while the process exits.
std::mutex& registry_lock = *new std::mutex;
auto& groups = *new std::map<std::string, std::weak_ptr<Group>>;
std::atomic<unsigned long> next_id{1};

// How long a simulated collective waits for what nothing ends (KILN_CUDASIM_NCCL_WAIT_S).
long wait_s() {
    static const long s = [] {
        const char* v = std::getenv("KILN_CUDASIM_NCCL_WAIT_S");
        return v && std::atol(v) > 0 ? std::atol(v) : 600L;
    }();
    return s;
}

// Waits until all ranks have arrived. A rank that never comes leaves the collective, and so its
// stream, waiting until this rank's ncclCommAbort (kiln's watchdog) ends it, as on a GPU: then,
// when `abortable`, it returns false (the collective did not run) and leaves the count. Should
// nothing abort it, the simulation gives up after KILN_CUDASIM_NCCL_WAIT_S seconds (default
// 600) and ends the process saying so.
bool barrier(Group& g, int rank, bool abortable) {
    std::unique_lock<std::mutex> l(g.m);
    if (abortable && g.aborted[rank]) return false;  // queued behind the aborted one: never waits
    const unsigned long gen = g.gen;
    if (++g.arrived == g.world) {
        g.arrived = 0;
        g.gen++;
        g.cv.notify_all();
        return true;
    }
    const auto woken = [&] { return g.gen != gen || (abortable && g.aborted[rank]); };
    if (!g.cv.wait_for(l, std::chrono::seconds(wait_s()), woken))
        sim::fatal("NCCL: a rank never arrived at a collective");
    if (g.gen != gen) return true;  // everyone came (an abort after that changes nothing)
    g.arrived--;                     // aborted while waiting: this rank leaves the meeting
    l.unlock();
    sim::count_aborted_wait(rank);
    return false;
}

float value(const void* p, int type, size_t i) {
    switch (type) {
        case kF32: return static_cast<const float*>(p)[i];
        case kI32: return float(static_cast<const int*>(p)[i]);
        default: return kilnsim_half::bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    }
}

void put(void* p, int type, size_t i, float v) {
    switch (type) {
        case kF32: static_cast<float*>(p)[i] = v; return;
        case kI32: static_cast<int*>(p)[i] = int(v); return;
        default: static_cast<uint16_t*>(p)[i] = kilnsim_half::f32_to_bf16(v);
    }
}

size_t size_of(int type) { return type == kF32 || type == kI32 ? 4 : 2; }

bool supported(int type) { return type == kF32 || type == kI32 || type == kBF16; }

// KILN_CUDASIM_NCCL_STALL=RANK:FILE, a fault a test injects: while FILE exists, rank RANK's
// collectives replayed from a graph never arrive (a hung GPU), until that rank's own abort.
bool stalls(int rank) {
    // Never destroyed: stream workers may still ask while the process exits.
    static const auto& fault = *new std::pair<int, std::string>([]() -> std::pair<int, std::string> {
        const char* v = std::getenv("KILN_CUDASIM_NCCL_STALL");
        const char* colon = v ? std::strchr(v, ':') : nullptr;
        if (!colon) return {-1, ""};
        return {std::atoi(v), std::string(colon + 1)};
    }());
    return rank == fault.first && sim::replaying && access(fault.second.c_str(), F_OK) == 0;
}

// The injected stall: waits for this rank's abort as a hung collective would (one queued behind
// the aborted one returns at once, uncounted, as in barrier()).
void stall(Group& g, int rank) {
    std::unique_lock<std::mutex> l(g.m);
    if (g.aborted[rank]) return;
    if (!g.cv.wait_for(l, std::chrono::seconds(wait_s()), [&] { return bool(g.aborted[rank]); }))
        sim::fatal("NCCL: an injected stall was never aborted");
    l.unlock();
    sim::count_aborted_wait(rank);
}

// Every rank publishes its send buffer and what it calls, waits for all, runs `body`, then waits
// for all again (every rank past the first meeting reaches the second: no abort ends that one,
// so no peer's buffer goes while it is read). Ranks calling different collectives, counts or
// types end the process: NCCL would read past a buffer or hang. False: this rank was aborted
// before all met, and the collective did not run.
template <typename Body>
bool meet(Group& g, int rank, const void* send, const std::string& what, Body body) {
    {
        std::lock_guard<std::mutex> l(g.m);
        g.send[rank] = send;
        g.what[rank] = what;
    }
    if (stalls(rank)) {
        stall(g, rank);
        return false;
    }
    if (!barrier(g, rank, true)) return false;
    for (int r = 1; r < g.world; r++)
        if (g.what[r] != g.what[0])
            sim::fatal("NCCL: rank 0 called " + g.what[0] + " while rank " + std::to_string(r) + " called " + g.what[r]);
    body(g);
    barrier(g, rank, false);
    return true;
}

}  // namespace

#define API extern "C" __attribute__((visibility("default")))

struct UniqueId {
    char internal[128];
};

API int ncclGetVersion(int* v) {
    *v = 23000;  // 2.30.0
    return kSuccess;
}

API int ncclGetUniqueId(UniqueId* id) {
    std::memset(id->internal, 0, sizeof id->internal);
    std::snprintf(id->internal, sizeof id->internal, "cudasim-%d-%lu", (int)getpid(), next_id++);
    return kSuccess;
}

API const char* ncclGetErrorString(int r) {
    switch (r) {
        case kSuccess: return "no error";
        case kInvalidArgument: return "invalid argument";
        case kInvalidUsage: return "invalid usage";
        case kRemoteError: return "remote process exited or there was a network error";
        case 7: return "NCCL operation in progress";
        default: return "cudasim NCCL error";
    }
}

API const char* ncclGetLastError(void*) { return ""; }

API int ncclCommInitRankConfig(Comm** comm, int world, UniqueId id, int rank, void*) {
    if (world < 1 || rank < 0 || rank >= world) return kInvalidArgument;
    const std::string key(id.internal, strnlen(id.internal, sizeof id.internal));
    std::shared_ptr<Group> g;
    {
        std::lock_guard<std::mutex> l(registry_lock);
        g = groups[key].lock();
        if (!g) {
            g = std::make_shared<Group>();
            g->world = world;
            g->send.assign(world, nullptr);
            g->aborted.assign(world, false);
            g->what.assign(world, "");
            groups[key] = g;
        }
    }
    if (g->world != world) return kInvalidArgument;
    sim::Context* ctx = sim::current_context();
    *comm = new Comm{g, rank, ctx ? ctx->device : 0};
    return kSuccess;
}

API int ncclCommInitRank(Comm** comm, int world, UniqueId id, int rank) {
    return ncclCommInitRankConfig(comm, world, id, rank, nullptr);
}

// A peer that stops coming is no error NCCL can see: its collectives just wait.
API int ncclCommGetAsyncError(Comm* c, int* state) {
    if (!c) return kInvalidArgument;
    *state = kSuccess;
    return kSuccess;
}

// Ends this rank's waits (its queued collectives return without running); the peers' go on.
API int ncclCommAbort(Comm* c) {
    if (!c) return kSuccess;
    {
        std::lock_guard<std::mutex> l(c->group->m);
        c->group->aborted[c->rank] = true;
    }
    c->group->cv.notify_all();
    delete c;
    return kSuccess;
}

API int ncclCommFinalize(Comm*) { return kSuccess; }
API int ncclCommDestroy(Comm* c) {
    delete c;
    return kSuccess;
}
API int ncclCommCount(const Comm* c, int* n) {
    *n = c->group->world;
    return kSuccess;
}
API int ncclCommUserRank(const Comm* c, int* r) {
    *r = c->rank;
    return kSuccess;
}
API int ncclCommCuDevice(const Comm* c, int* d) {
    *d = c->device;
    return kSuccess;
}
API int ncclGroupStart() { return kSuccess; }
API int ncclGroupEnd() { return kSuccess; }

API int ncclAllReduce(const void* send, void* recv, size_t n, int type, int op, Comm* c,
                      sim::Stream* s) {
    if (!c || op != 0 || !supported(type)) return kInvalidArgument;  // sums only
    const int rank = c->rank;
    std::shared_ptr<Group> group = c->group;
    if (group->world == 1) {  // a sum over one rank is its input
        sim::enqueue(s, [=] {
            if (recv != send) std::memmove(recv, send, n * size_of(type));
        });
        return kSuccess;
    }
    sim::enqueue(s, [=] {
        std::vector<float> sum(n, 0.f);
        const std::string what = "ncclAllReduce(" + std::to_string(n) + " of type " + std::to_string(type) + ")";
        const bool ran = meet(*group, rank, send, what, [&](Group& g) {
            for (int r = 0; r < g.world; r++)
                for (size_t i = 0; i < n; i++) sum[i] += value(g.send[r], type, i);
        });
        // Written after the second barrier: every peer has read this rank's (maybe aliased) input.
        if (ran)
            for (size_t i = 0; i < n; i++) put(recv, type, i, sum[i]);
    });
    return kSuccess;
}

API int ncclAllGather(const void* send, void* recv, size_t n, int type, Comm* c, sim::Stream* s) {
    if (!c || !supported(type)) return kInvalidArgument;
    const int rank = c->rank;
    std::shared_ptr<Group> group = c->group;
    sim::enqueue(s, [=] {
        std::vector<char> all;
        const std::string what = "ncclAllGather(" + std::to_string(n) + " of type " + std::to_string(type) + ")";
        const bool ran = meet(*group, rank, send, what, [&](Group& g) {
            const size_t bytes = n * size_of(type);
            all.resize(bytes * g.world);
            for (int r = 0; r < g.world; r++) std::memcpy(all.data() + r * bytes, g.send[r], bytes);
        });
        if (ran) std::memcpy(recv, all.data(), all.size());
    });
    return kSuccess;
}
