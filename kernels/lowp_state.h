/* lowp_state.h: the low-precision moment formats, element by element
 * (internal).
 *
 * The definition of the bf16 and int8 states for the whole library: the
 * reference, the scalar level and the CUDA kernels use these, and get the
 * same bits. Every step is an fp32 operation in a fixed order. The SIMD
 * levels update the moments with the same operations, but take square
 * roots and quotients from estimates (lowp_chunk_bodies.h says why).
 */
#ifndef RLHFZ_LOWP_STATE_H
#define RLHFZ_LOWP_STATE_H

#include <math.h>
#include <stdint.h>

#include "half_convert.h"
#include "rlhfz_kernels.h"

/* ---- fp32 operations, each rounded once ----------------------------------- */

/* On the host these are the plain operators: gcc in ISO C mode contracts
 * nothing, and one operation per function leaves a compiler that contracts
 * within an expression nothing to fuse. nvcc fuses a multiply into the add
 * that follows it across inlined calls, rounding once where the CPU rounds
 * twice, so on the device these are the rounded intrinsics, and a kernel
 * gets the CPU's bits. */
static inline RLHFZ_HOST_DEVICE float rlhfz_add_rn(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

static inline RLHFZ_HOST_DEVICE float rlhfz_mul_rn(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

static inline RLHFZ_HOST_DEVICE float rlhfz_div_rn(float a, float b)
{
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
}

static inline RLHFZ_HOST_DEVICE float rlhfz_sqrt_rn(float x)
{
#ifdef __CUDA_ARCH__
    return __fsqrt_rn(x);
#else
    return sqrtf(x);
#endif
}

/* ---- the counter hash behind stochastic rounding -------------------------- */

/* An integer finalizer with full avalanche: every input bit flips each
 * output bit with probability close to 1/2. */
static inline RLHFZ_HOST_DEVICE uint32_t rlhfz_mix32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

/* The high half of an element's index changes once per 2^32 elements; it is
 * folded into the key, so the per-element work is one mix of the low half. */
static inline RLHFZ_HOST_DEVICE uint32_t rlhfz_index_key(uint32_t key, uint64_t index)
{
    return rlhfz_mix32(key ^ (uint32_t)(index >> 32));
}

/* The 16 random bits of an element, for its exp_avg_sq (exp_avg rounds to
 * nearest): the top half of one multiply over the index key. The key is a
 * full mix of (seed, step, high half), so one multiply per element
 * suffices: over steps an element's input is uniform and x -> x * odd is a
 * bijection, so the product's top half is uniform; within a step neighbours
 * get a low-discrepancy sequence, which only evens rounding out. The top
 * half is the product's best-mixed. A full mix per element cost ~0.12 ns of
 * a ~0.5 ns SIMD step. */
static inline RLHFZ_HOST_DEVICE uint32_t rlhfz_round_bits16(uint32_t index_key, uint64_t index)
{
    return (((uint32_t)index ^ index_key) * 0x9E3779B1u) >> 16;
}

/* Element `index`'s 16 random bits under `rounding` and the rounding key;
 * rounding to nearest draws none. */
static inline RLHFZ_HOST_DEVICE uint32_t rlhfz_element_random16(rlhfz_rounding rounding,
                                                                uint32_t key, uint64_t index)
{
    if (rounding != RLHFZ_ROUND_STOCHASTIC)
        return 0;
    return rlhfz_round_bits16(rlhfz_index_key(key, index), index);
}

/* ---- bf16 moments --------------------------------------------------------- */

/* Stochastic: 16 random bits added below the kept half carry into it with
 * probability equal to the dropped fraction. For exp_avg_sq, which is never
 * negative: a NaN (quiet, as arithmetic leaves it) becomes the quiet NaN
 * 0x7FC0, and so would a value with the sign bit set, as torch's sqrt of a
 * negative exp_avg_sq is NaN. One unsigned min does it all. */
static inline RLHFZ_HOST_DEVICE uint16_t rlhfz_f32_to_bf16_stochastic(float x, uint32_t random16)
{
    uint32_t bits = rlhfz_f32_bits(x);
    bits = bits < 0x7FC00000u ? bits : 0x7FC00000u;
    return (uint16_t)((bits + random16) >> 16);
}

/* exp_avg rounds to nearest even under either rounding: beta1's steps are
 * wide against bf16's spacing (and an int8 code's). exp_avg_sq's (1 - beta2
 * = 1e-3 of it) are narrower than half of it, so nearest would stall it: it
 * rounds stochastically unless told to round to nearest. */
static inline RLHFZ_HOST_DEVICE uint16_t rlhfz_bf16_exp_avg(float m)
{
    return rlhfz_f32_to_bf16(m);
}

static inline RLHFZ_HOST_DEVICE uint16_t rlhfz_bf16_exp_avg_sq(float v, rlhfz_rounding rounding,
                                                                uint32_t random16)
{
    return rounding == RLHFZ_ROUND_STOCHASTIC ? rlhfz_f32_to_bf16_stochastic(v, random16)
                                              : rlhfz_f32_to_bf16(v);
}

/* ---- int8 moments --------------------------------------------------------- */

#define RLHFZ_Q_EXP_AVG_MAX 127.0f      /* signed codes: -127 .. 127 */
#define RLHFZ_Q_EXP_AVG_SQ_MAX 255.0f   /* unsigned codes: 0 .. 255 */

/* Decoding: exp_avg = (q / 127) * scale, linear, and sqrt(exp_avg_sq) =
 * (q * q / 255^2) * scale, whose square-root axis keeps exp_avg_sq's small
 * values off zero (a zero there with a nonzero exp_avg would step by
 * exp_avg / eps). exp_avg's small values rounding to zero only stop their
 * step, and its linear codes take no square root to encode. The fraction
 * first: the top code's is exactly 1 (127 times the float nearest 1 / 127
 * rounds to 1, as 255^2 times that of 1 / 255^2), so the block's largest
 * value decodes to its scale exactly, and decoding then encoding again
 * gives back every code and scale. */
static inline RLHFZ_HOST_DEVICE float rlhfz_q_exp_avg_value(int8_t q, float scale)
{
    return rlhfz_mul_rn(rlhfz_mul_rn((float)q, 1.0f / 127.0f), scale);
}

static inline RLHFZ_HOST_DEVICE float rlhfz_q_exp_avg_sq_root(uint8_t q, float scale)
{
    return rlhfz_mul_rn(rlhfz_mul_rn((float)(q * q), 1.0f / (255.0f * 255.0f)), scale);
}

/* The code of a position x in [0, top] of a map's square-root axis: nearest
 * (ties to even, as the SIMD conversions do), or up with probability of the
 * distance to the code below: floor(x + random16 / 2^16), computed exactly
 * in 1/65536ths. x above top (by rounding) clamps. */
static inline RLHFZ_HOST_DEVICE int rlhfz_q_code(float x, int top, rlhfz_rounding rounding,
                                                  uint32_t random16)
{
    int code = rounding == RLHFZ_ROUND_STOCHASTIC
                   ? (int)(((uint32_t)rlhfz_mul_rn(x, 65536.0f) + random16) >> 16)
                   : (int)nearbyintf(x);
    return code < top ? code : top;
}

/* A block's scale and the factor that encodes it, for either moment: the
 * largest |exp_avg|, or the largest sqrt(exp_avg_sq); 0 for an all-zero
 * block. A block that is not finite gets scale NaN and its codes are all 0
 * (the caller writes them without encoding). */
static inline RLHFZ_HOST_DEVICE float rlhfz_q_encode(float largest, int finite, float *scale)
{
    *scale = finite ? largest : NAN;
    return finite && largest > 0.0f ? rlhfz_div_rn(1.0f, largest) : 0.0f;
}

/* exp_avg's code: |m| * (encode * 127), signed, rounded to nearest (as
 * bf16's exp_avg). One product per element, with the block's factor
 * rounded once. */
static inline RLHFZ_HOST_DEVICE int8_t rlhfz_q_exp_avg_code(float m, float encode)
{
    float x = rlhfz_mul_rn(fabsf(m), rlhfz_mul_rn(encode, RLHFZ_Q_EXP_AVG_MAX));
    int q = rlhfz_q_code(x, (int)RLHFZ_Q_EXP_AVG_MAX, RLHFZ_ROUND_NEAREST, 0);
    return (int8_t)(signbit(m) ? -q : q);
}

/* exp_avg_sq's code, from its square root r (the step computes r anyway):
 * the square-root axis of r / scale, and at least code 1 where r > 0. A
 * block whose largest root is far above the rest (a grad spike that its
 * exp_avg has long forgotten) puts an element's first small grads below
 * half a code while their exp_avg keeps a code: read as 0, exp_avg_sq
 * would step the element by exp_avg / eps. Code 1 reads exp_avg_sq larger
 * than it is, which only shortens the step. */
static inline RLHFZ_HOST_DEVICE uint8_t rlhfz_q_exp_avg_sq_code(float root, float encode,
                                                                rlhfz_rounding rounding,
                                                                uint32_t random16)
{
    float x = rlhfz_mul_rn(rlhfz_sqrt_rn(rlhfz_mul_rn(root, encode)), RLHFZ_Q_EXP_AVG_SQ_MAX);
    int code = rlhfz_q_code(x, (int)RLHFZ_Q_EXP_AVG_SQ_MAX, rounding, random16);
    return (uint8_t)(code == 0 && root > 0.0f ? 1 : code);
}

#endif /* RLHFZ_LOWP_STATE_H */
