// cudasim's cuBLASLt: cublasLtMatmul for the layouts cudarc sets up (column-major, optional
// transposes of A and B, strided batches, no epilogue), in f32 accumulation over bf16, f16 or
// f32 matrices, rounded to D's type as cuBLASLt does. Anything else is refused with
// CUBLAS_STATUS_NOT_SUPPORTED, so kiln never gets a silently wrong product.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "sim.h"

namespace {

// cublasStatus_t
constexpr int kOk = 0, kInvalidValue = 7, kNotSupported = 15;
// cudaDataType_t
constexpr int kF32 = 0, kF16 = 2, kBF16 = 14;

struct Layout {
    int type = kF32;
    uint64_t rows = 0, cols = 0;
    int64_t ld = 0;
    int batch = 1;
    int64_t stride = 0;
};

struct Desc {
    int compute = 0, scale = kF32;
    int trans_a = 0, trans_b = 0, trans_c = 0;
    int epilogue = 1;  // CUBLASLT_EPILOGUE_DEFAULT
    bool bias = false;
};

struct Handle {};
struct Pref {};

float load(const void* base, int type, int64_t i) {
    switch (type) {
        case kF32: return static_cast<const float*>(base)[i];
        case kBF16: return kilnsim_half::bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
        default: return kilnsim_half::f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    }
}

void store(void* base, int type, int64_t i, float v) {
    switch (type) {
        case kF32: static_cast<float*>(base)[i] = v; return;
        case kBF16: static_cast<uint16_t*>(base)[i] = kilnsim_half::f32_to_bf16(v); return;
        default: sim::fatal("cuBLASLt: f16 output is not simulated");
    }
}

size_t type_size(int t) { return t == kF32 ? 4 : 2; }

}  // namespace

#define API extern "C" __attribute__((visibility("default")))

API int cublasLtCreate(Handle** h) {
    *h = new Handle;
    return kOk;
}
API int cublasLtDestroy(Handle* h) {
    delete h;
    return kOk;
}
API size_t cublasLtGetVersion() { return 130000; }

API int cublasLtMatmulDescCreate(Desc** d, int compute, int scale) {
    *d = new Desc;
    (*d)->compute = compute;
    (*d)->scale = scale;
    return kOk;
}
API int cublasLtMatmulDescDestroy(Desc* d) {
    delete d;
    return kOk;
}
API int cublasLtMatmulDescSetAttribute(Desc* d, int attr, const void* buf, size_t size) {
    int32_t v = 0;
    if (size >= 4) std::memcpy(&v, buf, 4);
    switch (attr) {
        case 3: d->trans_a = v; break;
        case 4: d->trans_b = v; break;
        case 5: d->trans_c = v; break;
        case 7: d->epilogue = v; break;
        case 8: {
            const void* p = nullptr;
            if (size == sizeof p) std::memcpy(&p, buf, sizeof p);
            d->bias = p != nullptr;
            break;
        }
        default: break;
    }
    return kOk;
}

API int cublasLtMatrixLayoutCreate(Layout** l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
    if (type != kF32 && type != kF16 && type != kBF16) return kNotSupported;
    *l = new Layout{type, rows, cols, ld, 1, 0};
    return kOk;
}
API int cublasLtMatrixLayoutDestroy(Layout* l) {
    delete l;
    return kOk;
}
API int cublasLtMatrixLayoutSetAttribute(Layout* l, int attr, const void* buf, size_t size) {
    if (attr == 5 && size >= 4) std::memcpy(&l->batch, buf, 4);
    else if (attr == 6 && size >= 8) std::memcpy(&l->stride, buf, 8);
    else if (attr == 1) return kNotSupported;  // only the default column-major order
    return kOk;
}

API int cublasLtMatmulPreferenceCreate(Pref** p) {
    *p = new Pref;
    return kOk;
}
API int cublasLtMatmulPreferenceDestroy(Pref* p) {
    delete p;
    return kOk;
}
API int cublasLtMatmulPreferenceSetAttribute(Pref*, int, const void*, size_t) { return kOk; }

struct HeuristicResult {
    uint64_t algo[8];
    size_t workspace;
    int state;
    float waves;
    int reserved[4];
};

API int cublasLtMatmulAlgoGetHeuristic(Handle*, Desc*, Layout*, Layout*, Layout*, Layout*, Pref*,
                                       int requested, HeuristicResult* results, int* returned) {
    if (requested < 1) return kInvalidValue;
    std::memset(results, 0, sizeof *results);
    *returned = 1;
    return kOk;
}

API int cublasLtMatmul(Handle*, Desc* d, const void* alpha, const void* A, Layout* la, const void* B,
                       Layout* lb, const void* beta, const void* C, Layout* lc, void* D, Layout* ld,
                       const void*, void*, size_t, sim::Stream* stream) {
    if (d->scale != kF32 || d->epilogue != 1 || d->bias || d->trans_c || ld->type == kF16 || lc->type == kF16)
        return kNotSupported;
    float a_scale, b_scale;
    std::memcpy(&a_scale, alpha, 4);
    std::memcpy(&b_scale, beta, 4);
    // op(A) is m x k, op(B) k x n, C and D m x n, all column-major.
    const uint64_t m = d->trans_a ? la->cols : la->rows, k = d->trans_a ? la->rows : la->cols;
    const uint64_t kb = d->trans_b ? lb->cols : lb->rows, n = d->trans_b ? lb->rows : lb->cols;
    if (k != kb || lc->rows != m || lc->cols != n || ld->rows != m || ld->cols != n) return kInvalidValue;
    if (la->ld < int64_t(la->rows) || lb->ld < int64_t(lb->rows) || lc->ld < int64_t(m) ||
        ld->ld < int64_t(m))
        return kInvalidValue;
    const int batch = ld->batch;
    if (la->batch != batch || lb->batch != batch || lc->batch != batch) return kInvalidValue;
    const Desc desc = *d;
    const Layout a = *la, b = *lb, c = *lc, dl = *ld;
    sim::enqueue(stream, [=] {
        // Both operands widened to f32 once, laid out so each dot product reads two contiguous
        // rows: op(A) row i at a_rows[i * k], op(B) column j at b_cols[j * k]. The sums run in
        // the order p = 0..k, as the element-wise loop would.
        std::vector<float> a_rows(m * k), b_cols(n * k);
        for (int bi = 0; bi < batch; bi++) {
            const char* pa = static_cast<const char*>(A) + bi * a.stride * type_size(a.type);
            const char* pb = static_cast<const char*>(B) + bi * b.stride * type_size(b.type);
            const char* pc = static_cast<const char*>(C) + bi * c.stride * type_size(c.type);
            char* pd = static_cast<char*>(D) + bi * dl.stride * type_size(dl.type);
            for (uint64_t i = 0; i < m; i++)
                for (uint64_t p = 0; p < k; p++)
                    a_rows[i * k + p] = load(pa, a.type, desc.trans_a ? int64_t(p + i * a.ld) : int64_t(i + p * a.ld));
            for (uint64_t j = 0; j < n; j++)
                for (uint64_t p = 0; p < k; p++)
                    b_cols[j * k + p] = load(pb, b.type, desc.trans_b ? int64_t(j + p * b.ld) : int64_t(p + j * b.ld));
            for (uint64_t j = 0; j < n; j++) {
                const float* bj = &b_cols[j * k];
                for (uint64_t i = 0; i < m; i++) {
                    const float* ai = &a_rows[i * k];
                    float acc = 0.f;
                    for (uint64_t p = 0; p < k; p++) acc += ai[p] * bj[p];
                    float v = a_scale * acc;
                    if (b_scale != 0.f) v += b_scale * load(pc, c.type, int64_t(i + j * c.ld));
                    store(pd, dl.type, int64_t(i + j * dl.ld), v);
                }
            }
        }
    });
    return kOk;
}

API const char* cublasLtGetStatusString(int s) { return s == 0 ? "CUBLAS_STATUS_SUCCESS" : "cudasim cuBLASLt error"; }
API const char* cublasLtGetStatusName(int s) { return cublasLtGetStatusString(s); }
