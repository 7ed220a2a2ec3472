// 16-bit floats as their bits, for cudasim's cuBLASLt, NCCL and (ahead of the kernel prelude, see
// build.sh) the kernels: bf16 is the upper half of an f32, rounded to nearest even as the GPU and
// torch round, NaN kept NaN; f16 is IEEE half, widened exactly (PTX's cvt.f32.f16).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kilnsim_half {

inline float bf16_to_f32(uint16_t b) {
    const uint32_t bits = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline uint16_t f32_to_bf16(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40u);
    return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = uint32_t(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    float f;
    if (exp == 0) {
        f = std::ldexp(float(man), -24);
        return sign ? -f : f;
    }
    const uint32_t bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    std::memcpy(&f, &bits, 4);
    return f;
}

}  // namespace kilnsim_half
