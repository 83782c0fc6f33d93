/* cuda_fp16.h: the simulated runtime's __half and its conversions.
 *
 * Written from IEEE 754 binary16 as the GPU converts: round to nearest even,
 * overflow to Inf, gradual underflow, and a NaN narrowed to the GPU's one
 * canonical NaN (0x7FFF), whatever its payload. Independent of rlhfz's own
 * conversions, which the kernels are tested against.
 */
#ifndef CUDASIM_CUDA_FP16_H
#define CUDASIM_CUDA_FP16_H

#include <cstdint>
#include <cstring>

#include "cuda_runtime.h"

struct __half {
    unsigned short x;
};

__device__ __forceinline__ __half __ushort_as_half(unsigned short bits) { return __half{bits}; }
__device__ __forceinline__ unsigned short __half_as_ushort(__half h) { return h.x; }

__device__ __forceinline__ float __half2float(__half h)
{
    const std::uint32_t sign = (std::uint32_t)(h.x & 0x8000u) << 16;
    const std::uint32_t exponent = (h.x >> 10) & 0x1Fu;
    const std::uint32_t mantissa = h.x & 0x3FFu;
    std::uint32_t bits;
    if (exponent == 0x1Fu) {
        bits = sign | 0x7F800000u | (mantissa << 13) | (mantissa ? 0x00400000u : 0u);
    } else if (exponent == 0) {
        /* zero or subnormal: mantissa * 2^-24, exact in fp32 */
        float magnitude = (float)mantissa * 0x1p-24f;
        std::memcpy(&bits, &magnitude, sizeof bits);
        bits |= sign;
    } else {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    }
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}

__device__ __forceinline__ __half __float2half_rn(float f)
{
    std::uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    const unsigned short sign = (unsigned short)((bits >> 16) & 0x8000u);
    const std::uint32_t magnitude = bits & 0x7FFFFFFFu;
    if (magnitude > 0x7F800000u)
        return __half{0x7FFF};                         /* the canonical NaN */
    if (magnitude >= 0x477FF000u)                      /* 65520 and up round to Inf */
        return __half{(unsigned short)(sign | 0x7C00u)};
    const std::uint32_t exponent = magnitude >> 23;
    if (exponent < 113) {
        /* a binary16 subnormal (or zero): the 24-bit significand shifted down,
         * rounded to nearest even */
        if (exponent < 102)
            return __half{sign};                       /* below 2^-25: zero */
        const std::uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;
        const std::uint32_t shift = 126u - exponent;
        std::uint32_t kept = significand >> shift;
        const std::uint32_t rest = significand & ((1u << shift) - 1u);
        const std::uint32_t half_way = 1u << (shift - 1u);
        if (rest > half_way || (rest == half_way && (kept & 1u)))
            kept++;
        return __half{(unsigned short)(sign | kept)};
    }
    std::uint32_t h = ((exponent - 112u) << 10) | ((magnitude >> 13) & 0x3FFu);
    const std::uint32_t rest = magnitude & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
        h++;                                           /* may carry into the exponent */
    return __half{(unsigned short)(sign | h)};
}

#endif /* CUDASIM_CUDA_FP16_H */
