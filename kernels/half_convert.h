/* half_convert.h: scalar bf16/f16 <-> f32 conversions, bit-exact.
 *
 * These are the definition of rounding for the whole library: the reference,
 * the scalar level and every SIMD tail use them, and the SIMD bodies are
 * tested to agree with them bit for bit. Narrowing rounds to nearest even;
 * a NaN stays a NaN, made quiet, with the top of its payload kept (the same
 * bits x86's F16C instructions produce).
 */
#ifndef RLHFZ_HALF_CONVERT_H
#define RLHFZ_HALF_CONVERT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "rlhfz_kernels.h"

/* Under nvcc the bit casts and the bf16 conversions are device functions as
 * well: lowp_state.h's formats use them, and CUDA kernels run those too. */
#ifdef __CUDACC__
#define RLHFZ_HOST_DEVICE __host__ __device__
#else
#define RLHFZ_HOST_DEVICE
#endif

static inline RLHFZ_HOST_DEVICE uint32_t rlhfz_f32_bits(float x)
{
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return bits;
}

static inline RLHFZ_HOST_DEVICE float rlhfz_f32_from_bits(uint32_t bits)
{
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* ---- bfloat16: the top half of an fp32 ------------------------------------ */

static inline RLHFZ_HOST_DEVICE float rlhfz_bf16_to_f32(uint16_t h)
{
    return rlhfz_f32_from_bits((uint32_t)h << 16);
}

static inline RLHFZ_HOST_DEVICE uint16_t rlhfz_f32_to_bf16(float x)
{
    uint32_t bits = rlhfz_f32_bits(x);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((bits >> 16) | 0x0040u); /* NaN: set the quiet bit */
    /* Adding 0x7FFF plus the kept lsb carries into bit 16 exactly when the
     * dropped half is above one half, or equal to it with an odd lsb. A carry
     * out of the largest finite values lands on Inf, as it should. */
    uint32_t lsb = (bits >> 16) & 1u;
    return (uint16_t)((bits + 0x7FFFu + lsb) >> 16);
}

/* ---- IEEE binary16 -------------------------------------------------------- */

static inline float rlhfz_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu;
    uint32_t mantissa = h & 0x3FFu;

    if (exponent == 0x1F) /* Inf, or NaN made quiet */
        return rlhfz_f32_from_bits(sign | 0x7F800000u | (mantissa << 13) |
                                   (mantissa ? 0x00400000u : 0u));
    if (exponent == 0) {
        /* zero or subnormal: mantissa * 2^-24 is exact in fp32 */
        float magnitude = (float)mantissa * 0x1p-24f;
        return rlhfz_f32_from_bits(sign | rlhfz_f32_bits(magnitude));
    }
    /* normal: rebias the exponent from 15 to 127 */
    return rlhfz_f32_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

static inline uint16_t rlhfz_f32_to_f16(float x)
{
    uint32_t bits = rlhfz_f32_bits(x);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t magnitude = bits & 0x7FFFFFFFu;

    if (magnitude > 0x7F800000u) /* NaN: keep the top payload bits, make it quiet */
        return (uint16_t)(sign | 0x7E00u | ((magnitude >> 13) & 0x3FFu));
    if (magnitude >= 0x477FF000u) /* >= 65520 rounds up past 65504: Inf */
        return (uint16_t)(sign | 0x7C00u);
    if (magnitude >= 0x38800000u) {
        /* normal in f16 (>= 2^-14): rebias the exponent by -112 and round
         * away 13 mantissa bits the same way as for bf16 */
        uint32_t lsb = (magnitude >> 13) & 1u;
        uint32_t rounded = magnitude - 0x38000000u + 0xFFFu + lsb;
        return (uint16_t)(sign | (rounded >> 13));
    }
    if (magnitude < 0x33000001u) /* <= 2^-25, half the smallest subnormal: 0 */
        return sign;

    /* subnormal in f16: value / 2^-24 = significand * 2^(exponent - 126),
     * a right shift of 14..24 bits, rounded to nearest even. A round up out
     * of the largest subnormal gives 0x400, the smallest normal: correct. */
    uint32_t exponent = magnitude >> 23;
    uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126u - exponent;
    uint32_t result = significand >> shift;
    uint32_t rest = significand & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (result & 1u)))
        result += 1u;
    return (uint16_t)(sign | result);
}

/* ---- element i of an array in any of the kernels' dtypes ------------------- */

static inline float rlhfz_load_f32(const void *x, rlhfz_dtype dtype, size_t i)
{
    switch (dtype) {
    case RLHFZ_DTYPE_BF16:
        return rlhfz_bf16_to_f32(((const uint16_t *)x)[i]);
    case RLHFZ_DTYPE_F16:
        return rlhfz_f16_to_f32(((const uint16_t *)x)[i]);
    default:
        return ((const float *)x)[i];
    }
}

static inline void rlhfz_store_f32(void *x, rlhfz_dtype dtype, size_t i, float value)
{
    switch (dtype) {
    case RLHFZ_DTYPE_BF16:
        ((uint16_t *)x)[i] = rlhfz_f32_to_bf16(value);
        break;
    case RLHFZ_DTYPE_F16:
        ((uint16_t *)x)[i] = rlhfz_f32_to_f16(value);
        break;
    default:
        ((float *)x)[i] = value;
        break;
    }
}

#endif /* RLHFZ_HALF_CONVERT_H */
