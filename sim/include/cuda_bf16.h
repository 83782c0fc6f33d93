/* cuda_bf16.h: the simulated runtime's __nv_bfloat16 and its conversions:
 * the top half of an fp32, narrowed with round to nearest even, and a NaN
 * narrowed to the GPU's canonical NaN (0x7FFF). */
#ifndef CUDASIM_CUDA_BF16_H
#define CUDASIM_CUDA_BF16_H

#include <cstdint>
#include <cstring>

#include "cuda_runtime.h"

struct __nv_bfloat16 {
    unsigned short x;
};

__device__ __forceinline__ unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
__device__ __forceinline__ __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits)
{
    return __nv_bfloat16{bits};
}

__device__ __forceinline__ float __bfloat162float(__nv_bfloat16 h)
{
    const std::uint32_t bits = (std::uint32_t)h.x << 16;
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
}

__device__ __forceinline__ __nv_bfloat16 __float2bfloat16_rn(float f)
{
    std::uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u)
        return __nv_bfloat16{0x7FFF};
    const std::uint32_t lsb = (bits >> 16) & 1u;
    return __nv_bfloat16{(unsigned short)((bits + 0x7FFFu + lsb) >> 16)};
}

#endif /* CUDASIM_CUDA_BF16_H */
