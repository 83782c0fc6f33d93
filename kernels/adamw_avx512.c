/* adamw_avx512.c: the AVX-512 level (F + BW + VL + DQ), 16 floats per vector.
 *
 * Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma
 * -mf16c, and only ever called after run-time detection. It does not need
 * AVX512_BF16: bf16 is rounded with integer ops. This file is only the SIMD
 * layer, in AVX-512 intrinsics; the chunk functions are written once over it
 * in simd_chunk_bodies.h, which lists what each name means.
 */
#include "rlhfz_kernels.h"

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>
#include <stdint.h>

/* ---- the SIMD layer ------------------------------------------------------- */

#define SIMD_WIDTH 16
#define SIMD_NAME(base) base##_avx512
#define SIMD_INLINE static inline __attribute__((always_inline))

typedef __m512 simd_f32;
typedef __m256i simd_half;
typedef __m512d simd_f64;

SIMD_INLINE simd_f32 simd_loadu(const float *x) { return _mm512_loadu_ps(x); }
SIMD_INLINE void simd_storeu(float *x, simd_f32 a) { _mm512_storeu_ps(x, a); }
SIMD_INLINE void simd_stream(float *x, simd_f32 a) { _mm512_stream_ps(x, a); }
SIMD_INLINE simd_f32 simd_set1(float a) { return _mm512_set1_ps(a); }
SIMD_INLINE simd_f32 simd_add(simd_f32 a, simd_f32 b) { return _mm512_add_ps(a, b); }
SIMD_INLINE simd_f32 simd_sub(simd_f32 a, simd_f32 b) { return _mm512_sub_ps(a, b); }
SIMD_INLINE simd_f32 simd_mul(simd_f32 a, simd_f32 b) { return _mm512_mul_ps(a, b); }
SIMD_INLINE simd_f32 simd_div(simd_f32 a, simd_f32 b) { return _mm512_div_ps(a, b); }
SIMD_INLINE simd_f32 simd_sqrt(simd_f32 a) { return _mm512_sqrt_ps(a); }
SIMD_INLINE void simd_sfence(void) { _mm_sfence(); }
SIMD_INLINE simd_f32 simd_fmadd(simd_f32 a, simd_f32 b, simd_f32 c)
{
    return _mm512_fmadd_ps(a, b, c);
}
SIMD_INLINE simd_f32 simd_fnmadd(simd_f32 a, simd_f32 b, simd_f32 c)
{
    return _mm512_fnmadd_ps(a, b, c);
}
/* estimates good to 2^-14 relative */
SIMD_INLINE simd_f32 simd_rsqrt_est(simd_f32 a) { return _mm512_rsqrt14_ps(a); }
SIMD_INLINE simd_f32 simd_rcp_est(simd_f32 a) { return _mm512_rcp14_ps(a); }
/* 1 / sqrt(a) for the int8 codes, for finite a > 0: the estimate suffices */
SIMD_INLINE simd_f32 simd_rsqrt_fine(simd_f32 a) { return _mm512_rsqrt14_ps(a); }
SIMD_INLINE simd_f32 simd_rsqrt_refine(simd_f32 a, simd_f32 r)
{
    (void)a;
    return r;
}

SIMD_INLINE simd_half simd_half_loadu(const uint16_t *x)
{
    return _mm256_loadu_si256((const __m256i *)x);
}
SIMD_INLINE void simd_half_storeu(uint16_t *x, simd_half h)
{
    _mm256_storeu_si256((__m256i *)x, h);
}
SIMD_INLINE void simd_half_stream(uint16_t *x, simd_half h)
{
    _mm256_stream_si256((__m256i *)x, h);
}

SIMD_INLINE simd_f32 simd_widen_bf16(simd_half h)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Lanes below 2^16 as 16-bit lanes. */
SIMD_INLINE simd_half narrow_bf16_bits(__m512i high) { return _mm512_cvtepi32_epi16(high); }

/* Round to nearest even by integer add (see rlhfz_f32_to_bf16); a NaN keeps
 * its top bits and gets the quiet bit instead. */
SIMD_INLINE simd_half simd_narrow_bf16(simd_f32 x)
{
    __m512i bits = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    __m512i chosen = _mm512_mask_or_epi32(rounded, is_nan, bits, _mm512_set1_epi32(0x00400000));
    return narrow_bf16_bits(_mm512_srli_epi32(chosen, 16));
}

SIMD_INLINE simd_f32 simd_widen_f16(simd_half h) { return _mm512_cvtph_ps(h); }
SIMD_INLINE simd_half simd_narrow_f16(simd_f32 x)
{
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}

SIMD_INLINE simd_f64 simd_f64_zero(void) { return _mm512_setzero_pd(); }
SIMD_INLINE simd_f64 simd_f64_add(simd_f64 a, simd_f64 b) { return _mm512_add_pd(a, b); }
SIMD_INLINE simd_f64 simd_add_squares_lo(simd_f64 acc, simd_f32 x)
{
    simd_f64 wide = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    return _mm512_fmadd_pd(wide, wide, acc);
}
SIMD_INLINE simd_f64 simd_add_squares_hi(simd_f64 acc, simd_f32 x)
{
    simd_f64 wide = _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1));
    return _mm512_fmadd_pd(wide, wide, acc);
}
SIMD_INLINE double simd_f64_hsum(simd_f64 a)
{
    double lanes[8];
    _mm512_storeu_pd(lanes, a);
    return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
           ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

/* ---- integer lanes, for the low-precision moments ------------------------- */

typedef __m512i simd_i32;

SIMD_INLINE simd_i32 simd_i32_set1(uint32_t a) { return _mm512_set1_epi32((int)a); }
SIMD_INLINE simd_i32 simd_i32_lanes(uint32_t base)
{
    return _mm512_add_epi32(_mm512_set1_epi32((int)base),
                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                              14, 15));
}
SIMD_INLINE simd_i32 simd_i32_loadu(const uint32_t *x) { return _mm512_loadu_si512(x); }
SIMD_INLINE simd_i32 simd_i32_xor(simd_i32 a, simd_i32 b) { return _mm512_xor_si512(a, b); }
SIMD_INLINE simd_i32 simd_i32_add(simd_i32 a, simd_i32 b) { return _mm512_add_epi32(a, b); }
SIMD_INLINE simd_i32 simd_i32_mul(simd_i32 a, simd_i32 b) { return _mm512_mullo_epi32(a, b); }
SIMD_INLINE simd_i32 simd_i32_shr16(simd_i32 a) { return _mm512_srli_epi32(a, 16); }
/* to nearest even under the default MXCSR, as nearbyintf */
SIMD_INLINE simd_i32 simd_f32_to_i32_nearest(simd_f32 a) { return _mm512_cvtps_epi32(a); }
SIMD_INLINE simd_i32 simd_f32_to_i32_trunc(simd_f32 a) { return _mm512_cvttps_epi32(a); }

SIMD_INLINE simd_f32 simd_abs(simd_f32 a) { return _mm512_abs_ps(a); }
/* a NaN in a yields b, in either: b (x86's max/min) */
SIMD_INLINE simd_f32 simd_max(simd_f32 a, simd_f32 b) { return _mm512_max_ps(a, b); }
SIMD_INLINE simd_f32 simd_min(simd_f32 a, simd_f32 b) { return _mm512_min_ps(a, b); }
SIMD_INLINE simd_f32 simd_max_bits(simd_f32 a, simd_f32 b)
{
    return _mm512_castsi512_ps(_mm512_max_epu32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

/* W exp_avg codes as floats, and W exp_avg_sq codes as q * q (exact in fp32) */
SIMD_INLINE simd_f32 simd_q_signed_load(const int8_t *x)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x)));
}
SIMD_INLINE simd_f32 simd_q_square_load(const uint8_t *x)
{
    __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)x)));
    return _mm512_mul_ps(q, q);
}
/* W codes: positions (|x| < 127.5) rounded to nearest even */
SIMD_INLINE void simd_q_signed_store(int8_t *x, simd_f32 position)
{
    _mm_storeu_si128((__m128i *)x, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(position)));
}
/* W codes, above 255 saturating to 255 */
SIMD_INLINE void simd_q_unsigned_store(uint8_t *x, simd_i32 q)
{
    _mm_storeu_si128((__m128i *)x, _mm512_cvtusepi32_epi8(q));
}

/* Stochastic rounding to bf16, as rlhfz_f32_to_bf16_stochastic: a NaN (or a
 * sign bit) clamps to the quiet NaN by one unsigned min. */
SIMD_INLINE simd_half simd_narrow_bf16_stochastic(simd_f32 x, simd_i32 random16)
{
    __m512i bits = _mm512_min_epu32(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FC00000));
    return narrow_bf16_bits(_mm512_srli_epi32(_mm512_add_epi32(bits, random16), 16));
}

/* ---- the chunk functions -------------------------------------------------- */

#include "simd_chunk_bodies.h"
#include "lowp_chunk_bodies.h"

#endif /* x86 */
