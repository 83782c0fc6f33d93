/* adamw_avx2.c: the AVX2 level (AVX2 + FMA + F16C), 8 floats per vector.
 *
 * Compiled with -mavx2 -mfma -mf16c, and only ever called after run-time
 * detection. This file is only the SIMD layer, in AVX2 intrinsics; the chunk
 * functions are written once over it in simd_chunk_bodies.h, which lists
 * what each name means.
 */
#include "rlhfz_kernels.h"

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>
#include <stdint.h>

/* ---- the SIMD layer ------------------------------------------------------- */

#define SIMD_WIDTH 8
#define SIMD_NAME(base) base##_avx2
#define SIMD_INLINE static inline __attribute__((always_inline))

typedef __m256 simd_f32;
typedef __m128i simd_half;
typedef __m256d simd_f64;

SIMD_INLINE simd_f32 simd_loadu(const float *x) { return _mm256_loadu_ps(x); }
SIMD_INLINE void simd_storeu(float *x, simd_f32 a) { _mm256_storeu_ps(x, a); }
SIMD_INLINE void simd_stream(float *x, simd_f32 a) { _mm256_stream_ps(x, a); }
SIMD_INLINE simd_f32 simd_set1(float a) { return _mm256_set1_ps(a); }
SIMD_INLINE simd_f32 simd_add(simd_f32 a, simd_f32 b) { return _mm256_add_ps(a, b); }
SIMD_INLINE simd_f32 simd_sub(simd_f32 a, simd_f32 b) { return _mm256_sub_ps(a, b); }
SIMD_INLINE simd_f32 simd_mul(simd_f32 a, simd_f32 b) { return _mm256_mul_ps(a, b); }
SIMD_INLINE simd_f32 simd_div(simd_f32 a, simd_f32 b) { return _mm256_div_ps(a, b); }
SIMD_INLINE simd_f32 simd_sqrt(simd_f32 a) { return _mm256_sqrt_ps(a); }
SIMD_INLINE void simd_sfence(void) { _mm_sfence(); }
SIMD_INLINE simd_f32 simd_fmadd(simd_f32 a, simd_f32 b, simd_f32 c)
{
    return _mm256_fmadd_ps(a, b, c);
}
SIMD_INLINE simd_f32 simd_fnmadd(simd_f32 a, simd_f32 b, simd_f32 c)
{
    return _mm256_fnmadd_ps(a, b, c);
}
/* estimates good to 1.5 * 2^-12 relative */
SIMD_INLINE simd_f32 simd_rsqrt_est(simd_f32 a) { return _mm256_rsqrt_ps(a); }
SIMD_INLINE simd_f32 simd_rcp_est(simd_f32 a) { return _mm256_rcp_ps(a); }
/* r, an estimate of 1 / sqrt(a), refined by one Newton step to ~2^-21 (for
 * finite a > 0) */
SIMD_INLINE simd_f32 simd_rsqrt_refine(simd_f32 a, simd_f32 r)
{
    __m256 half_a_r = _mm256_mul_ps(_mm256_mul_ps(a, _mm256_set1_ps(0.5f)), r);
    return _mm256_mul_ps(r, _mm256_fnmadd_ps(half_a_r, r, _mm256_set1_ps(1.5f)));
}
SIMD_INLINE simd_f32 simd_rsqrt_fine(simd_f32 a)
{
    return simd_rsqrt_refine(a, _mm256_rsqrt_ps(a));
}

SIMD_INLINE simd_half simd_half_loadu(const uint16_t *x)
{
    return _mm_loadu_si128((const __m128i *)x);
}
SIMD_INLINE void simd_half_storeu(uint16_t *x, simd_half h) { _mm_storeu_si128((__m128i *)x, h); }
SIMD_INLINE void simd_half_stream(uint16_t *x, simd_half h) { _mm_stream_si128((__m128i *)x, h); }

SIMD_INLINE simd_f32 simd_widen_bf16(simd_half h)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* Lanes below 2^16 as 16-bit lanes: the unsigned-saturating pack just
 * narrows them. */
SIMD_INLINE simd_half narrow_bf16_bits(__m256i high)
{
    return _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
}

/* Round to nearest even by integer add (see rlhfz_f32_to_bf16); a NaN keeps
 * its top bits and gets the quiet bit instead. */
SIMD_INLINE simd_half simd_narrow_bf16(simd_f32 x)
{
    __m256i bits = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    __m256i quieted = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
    __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    __m256i chosen = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quieted), is_nan));
    return narrow_bf16_bits(_mm256_srli_epi32(chosen, 16));
}

SIMD_INLINE simd_f32 simd_widen_f16(simd_half h) { return _mm256_cvtph_ps(h); }
SIMD_INLINE simd_half simd_narrow_f16(simd_f32 x)
{
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
}

SIMD_INLINE simd_f64 simd_f64_zero(void) { return _mm256_setzero_pd(); }
SIMD_INLINE simd_f64 simd_f64_add(simd_f64 a, simd_f64 b) { return _mm256_add_pd(a, b); }
SIMD_INLINE simd_f64 simd_add_squares_lo(simd_f64 acc, simd_f32 x)
{
    simd_f64 wide = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    return _mm256_fmadd_pd(wide, wide, acc);
}
SIMD_INLINE simd_f64 simd_add_squares_hi(simd_f64 acc, simd_f32 x)
{
    simd_f64 wide = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    return _mm256_fmadd_pd(wide, wide, acc);
}
SIMD_INLINE double simd_f64_hsum(simd_f64 a)
{
    double lanes[4];
    _mm256_storeu_pd(lanes, a);
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

/* ---- integer lanes, for the low-precision moments ------------------------- */

typedef __m256i simd_i32;

SIMD_INLINE simd_i32 simd_i32_set1(uint32_t a) { return _mm256_set1_epi32((int)a); }
SIMD_INLINE simd_i32 simd_i32_lanes(uint32_t base)
{
    return _mm256_add_epi32(_mm256_set1_epi32((int)base),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
SIMD_INLINE simd_i32 simd_i32_loadu(const uint32_t *x)
{
    return _mm256_loadu_si256((const __m256i *)x);
}
SIMD_INLINE simd_i32 simd_i32_xor(simd_i32 a, simd_i32 b) { return _mm256_xor_si256(a, b); }
SIMD_INLINE simd_i32 simd_i32_add(simd_i32 a, simd_i32 b) { return _mm256_add_epi32(a, b); }
SIMD_INLINE simd_i32 simd_i32_mul(simd_i32 a, simd_i32 b) { return _mm256_mullo_epi32(a, b); }
SIMD_INLINE simd_i32 simd_i32_shr16(simd_i32 a) { return _mm256_srli_epi32(a, 16); }
/* to nearest even under the default MXCSR, as nearbyintf */
SIMD_INLINE simd_i32 simd_f32_to_i32_nearest(simd_f32 a) { return _mm256_cvtps_epi32(a); }
SIMD_INLINE simd_i32 simd_f32_to_i32_trunc(simd_f32 a) { return _mm256_cvttps_epi32(a); }

SIMD_INLINE simd_f32 simd_abs(simd_f32 a)
{
    return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a);
}
/* a NaN in a yields b, in either: b (x86's max/min) */
SIMD_INLINE simd_f32 simd_max(simd_f32 a, simd_f32 b) { return _mm256_max_ps(a, b); }
SIMD_INLINE simd_f32 simd_min(simd_f32 a, simd_f32 b) { return _mm256_min_ps(a, b); }
SIMD_INLINE simd_f32 simd_max_bits(simd_f32 a, simd_f32 b)
{
    return _mm256_castsi256_ps(_mm256_max_epu32(_mm256_castps_si256(a), _mm256_castps_si256(b)));
}

/* W exp_avg codes as floats, and W exp_avg_sq codes as q * q (exact in fp32) */
SIMD_INLINE simd_f32 simd_q_signed_load(const int8_t *x)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)x)));
}
SIMD_INLINE simd_f32 simd_q_square_load(const uint8_t *x)
{
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)x));
    return _mm256_cvtepi32_ps(_mm256_mullo_epi32(q, q));
}
/* W codes: positions (|x| < 127.5) rounded to nearest even */
SIMD_INLINE void simd_q_signed_store(int8_t *x, simd_f32 position)
{
    __m256i q = _mm256_cvtps_epi32(position);
    __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64((__m128i *)x, _mm_packs_epi16(words, words));
}
/* W codes, above 255 saturating to 255 */
SIMD_INLINE void simd_q_unsigned_store(uint8_t *x, simd_i32 q)
{
    __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64((__m128i *)x, _mm_packus_epi16(words, words));
}

/* Stochastic rounding to bf16, as rlhfz_f32_to_bf16_stochastic: a NaN (or a
 * sign bit) clamps to the quiet NaN by one unsigned min. */
SIMD_INLINE simd_half simd_narrow_bf16_stochastic(simd_f32 x, simd_i32 random16)
{
    __m256i bits = _mm256_min_epu32(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FC00000));
    return narrow_bf16_bits(_mm256_srli_epi32(_mm256_add_epi32(bits, random16), 16));
}

/* ---- the chunk functions -------------------------------------------------- */

#include "simd_chunk_bodies.h"
#include "lowp_chunk_bodies.h"

#endif /* x86 */
