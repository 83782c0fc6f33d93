/* adamw_avx2.c: the AVX2 level (AVX2 + FMA + F16C), 8 floats per vector.
 *
 * Compiled with -mavx2 -mfma -mf16c, and only ever called after run-time
 * detection. A thin layer of loads and stores per dtype sits under math
 * written once; each loop runs four vectors per step, then one, then hands
 * the last few elements to the scalar level. master, exp_avg and exp_avg_sq
 * are read and written, so they get normal stores; param_out of a large
 * shard is streamed past the cache. The math mirrors the scalar level
 * operation for operation (no fused multiply-adds, true sqrt and division),
 * so both give the same bits. Build with -ffp-contract=off (implied by
 * -std=c11): gcc's default for GNU C would fuse them.
 */
#include "rlhfz_kernels.h"

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>
#include <stdint.h>

#include "cpu_kernels_simd.h"

#define W 8 /* floats per vector */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* param_out kinds: a dtype, or none */
#define OUT_NONE (-1)

/* ---- the SIMD layer: loads and stores by dtype ---------------------------- */

ALWAYS_INLINE __m256 load_bf16(const uint16_t *x)
{
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Round to nearest even by integer add (see rlhfz_f32_to_bf16); a NaN keeps
 * its top bits and gets the quiet bit instead. */
ALWAYS_INLINE __m128i to_bf16(__m256 x)
{
    __m256i bits = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    __m256i quieted = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
    __m256 is_nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    __m256i chosen = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(quieted), is_nan));
    __m256i high = _mm256_srli_epi32(chosen, 16);
    /* values are < 2^16, so the unsigned-saturating pack just narrows */
    return _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1));
}

ALWAYS_INLINE __m256 load_as_f32(const void *x, rlhfz_dtype dtype, size_t i)
{
    switch (dtype) {
    case RLHFZ_DTYPE_BF16:
        return load_bf16((const uint16_t *)x + i);
    case RLHFZ_DTYPE_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i)));
    default:
        return _mm256_loadu_ps((const float *)x + i);
    }
}

ALWAYS_INLINE void store_from_f32(void *x, rlhfz_dtype dtype, size_t i, __m256 value)
{
    switch (dtype) {
    case RLHFZ_DTYPE_BF16:
        _mm_storeu_si128((__m128i *)((uint16_t *)x + i), to_bf16(value));
        break;
    case RLHFZ_DTYPE_F16:
        _mm_storeu_si128((__m128i *)((uint16_t *)x + i),
                         _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT));
        break;
    default:
        _mm256_storeu_ps((float *)x + i, value);
        break;
    }
}

/* A non-temporal store, for param_out only: it is written and never read
 * here, so a normal store would first read each of its lines in from memory
 * (2 or 4 more bytes of traffic per element). x + i must be vector-aligned. */
ALWAYS_INLINE void stream_from_f32(void *x, rlhfz_dtype dtype, size_t i, __m256 value)
{
    switch (dtype) {
    case RLHFZ_DTYPE_BF16:
        _mm_stream_si128((__m128i *)((uint16_t *)x + i), to_bf16(value));
        break;
    case RLHFZ_DTYPE_F16:
        _mm_stream_si128((__m128i *)((uint16_t *)x + i),
                         _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT));
        break;
    default:
        _mm256_stream_ps((float *)x + i, value);
        break;
    }
}

/* ---- AdamW ---------------------------------------------------------------- */

typedef struct {
    __m256 grad_scale, decay, beta1_weight, beta2, beta2_weight, eps, step_size,
        bias_correction2_sqrt;
} adamw_vconsts;

/* One vector of the AdamW step; see rlhfz_adamw_chunk_scalar for the plain form. */
ALWAYS_INLINE void adamw_vec(const rlhfz_adamw_shard *shard, const adamw_vconsts *k, size_t i,
                             rlhfz_dtype grad_dtype, int out, int stream)
{
    __m256 g = _mm256_mul_ps(load_as_f32(shard->grad, grad_dtype, i), k->grad_scale);

    /* decoupled weight decay */
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(shard->master + i), k->decay);

    /* update the first moment: m + (1 - beta1) * (g - m) */
    __m256 m = _mm256_loadu_ps(shard->exp_avg + i);
    m = _mm256_add_ps(m, _mm256_mul_ps(k->beta1_weight, _mm256_sub_ps(g, m)));

    /* update the second moment: v * beta2 + (1 - beta2) * g * g */
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(shard->exp_avg_sq + i), k->beta2);
    v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_mul_ps(k->beta2_weight, g), g));

    /* the bias-corrected step */
    __m256 denom =
        _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), k->bias_correction2_sqrt), k->eps);
    p = _mm256_sub_ps(p, _mm256_mul_ps(k->step_size, _mm256_div_ps(m, denom)));

    _mm256_storeu_ps(shard->master + i, p);
    _mm256_storeu_ps(shard->exp_avg + i, m);
    _mm256_storeu_ps(shard->exp_avg_sq + i, v);
    if (out != OUT_NONE && stream)
        stream_from_f32(shard->param_out, (rlhfz_dtype)out, i, p);
    else if (out != OUT_NONE)
        store_from_f32(shard->param_out, (rlhfz_dtype)out, i, p);
}

ALWAYS_INLINE void adamw_loop(const rlhfz_adamw_shard *shard, const rlhfz_adamw_consts *c,
                              size_t begin, size_t end, rlhfz_dtype grad_dtype, int out,
                              int stream)
{
    adamw_vconsts k = {
        .grad_scale = _mm256_set1_ps(c->grad_scale),
        .decay = _mm256_set1_ps(c->decay),
        .beta1_weight = _mm256_set1_ps(c->beta1_weight),
        .beta2 = _mm256_set1_ps(c->beta2),
        .beta2_weight = _mm256_set1_ps(c->beta2_weight),
        .eps = _mm256_set1_ps(c->eps),
        .step_size = _mm256_set1_ps(c->step_size),
        .bias_correction2_sqrt = _mm256_set1_ps(c->bias_correction2_sqrt),
    };
    size_t i = begin;
    for (; i + 4 * W <= end; i += 4 * W) {
        adamw_vec(shard, &k, i, grad_dtype, out, stream);
        adamw_vec(shard, &k, i + W, grad_dtype, out, stream);
        adamw_vec(shard, &k, i + 2 * W, grad_dtype, out, stream);
        adamw_vec(shard, &k, i + 3 * W, grad_dtype, out, stream);
    }
    for (; i + W <= end; i += W)
        adamw_vec(shard, &k, i, grad_dtype, out, stream);
    if (stream)
        _mm_sfence(); /* the streamed stores are visible before the range is done */
    rlhfz_adamw_chunk_scalar(shard, c, i, end);
}

/* Stream param_out when the shard is far bigger than any cache (its lines
 * would be evicted before their next use anyway) and this range of it is
 * vector-aligned. */
ALWAYS_INLINE void adamw_for_out(const rlhfz_adamw_shard *shard, const rlhfz_adamw_consts *c,
                                 size_t begin, size_t end, rlhfz_dtype grad_dtype,
                                 rlhfz_dtype out)
{
    size_t size = out == RLHFZ_DTYPE_F32 ? 4 : 2;
    uintptr_t at = (uintptr_t)shard->param_out + begin * size;
    if (shard->n >= RLHFZ_STREAM_MIN_ELEMENTS && at % (W * size) == 0)
        adamw_loop(shard, c, begin, end, grad_dtype, out, 1);
    else
        adamw_loop(shard, c, begin, end, grad_dtype, out, 0);
}

/* One loop per (grad dtype, param_out kind, streaming), all known at compile time. */
ALWAYS_INLINE void adamw_for_grad(const rlhfz_adamw_shard *shard, const rlhfz_adamw_consts *c,
                                  size_t begin, size_t end, rlhfz_dtype grad_dtype)
{
    if (!shard->param_out)
        adamw_loop(shard, c, begin, end, grad_dtype, OUT_NONE, 0);
    else if (shard->param_dtype == RLHFZ_DTYPE_BF16)
        adamw_for_out(shard, c, begin, end, grad_dtype, RLHFZ_DTYPE_BF16);
    else if (shard->param_dtype == RLHFZ_DTYPE_F16)
        adamw_for_out(shard, c, begin, end, grad_dtype, RLHFZ_DTYPE_F16);
    else
        adamw_for_out(shard, c, begin, end, grad_dtype, RLHFZ_DTYPE_F32);
}

void rlhfz_adamw_chunk_avx2(const rlhfz_adamw_shard *shard, const rlhfz_adamw_consts *c,
                            size_t begin, size_t end)
{
    if (shard->grad_dtype == RLHFZ_DTYPE_BF16)
        adamw_for_grad(shard, c, begin, end, RLHFZ_DTYPE_BF16);
    else if (shard->grad_dtype == RLHFZ_DTYPE_F16)
        adamw_for_grad(shard, c, begin, end, RLHFZ_DTYPE_F16);
    else
        adamw_for_grad(shard, c, begin, end, RLHFZ_DTYPE_F32);
}

/* ---- sum of squares ------------------------------------------------------- */

/* Squares of fp32 values are exact in double, so the FMA rounds only the sum. */
ALWAYS_INLINE __m256d add_squares(__m256d acc, __m128 x)
{
    __m256d wide = _mm256_cvtps_pd(x);
    return _mm256_fmadd_pd(wide, wide, acc);
}

ALWAYS_INLINE double sumsq_loop(const void *x, rlhfz_dtype dtype, size_t begin, size_t end)
{
    __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
    __m256d acc2 = _mm256_setzero_pd(), acc3 = _mm256_setzero_pd();
    size_t i = begin;
    for (; i + 2 * W <= end; i += 2 * W) {
        __m256 a = load_as_f32(x, dtype, i);
        __m256 b = load_as_f32(x, dtype, i + W);
        acc0 = add_squares(acc0, _mm256_castps256_ps128(a));
        acc1 = add_squares(acc1, _mm256_extractf128_ps(a, 1));
        acc2 = add_squares(acc2, _mm256_castps256_ps128(b));
        acc3 = add_squares(acc3, _mm256_extractf128_ps(b, 1));
    }
    for (; i + W <= end; i += W) {
        __m256 a = load_as_f32(x, dtype, i);
        acc0 = add_squares(acc0, _mm256_castps256_ps128(a));
        acc1 = add_squares(acc1, _mm256_extractf128_ps(a, 1));
    }
    __m256d acc = _mm256_add_pd(_mm256_add_pd(acc0, acc1), _mm256_add_pd(acc2, acc3));
    double lanes[4];
    _mm256_storeu_pd(lanes, acc);
    double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    return sum + rlhfz_sumsq_chunk_scalar(x, dtype, i, end);
}

double rlhfz_sumsq_chunk_avx2(const void *x, rlhfz_dtype dtype, size_t begin, size_t end)
{
    if (dtype == RLHFZ_DTYPE_BF16)
        return sumsq_loop(x, RLHFZ_DTYPE_BF16, begin, end);
    if (dtype == RLHFZ_DTYPE_F16)
        return sumsq_loop(x, RLHFZ_DTYPE_F16, begin, end);
    return sumsq_loop(x, RLHFZ_DTYPE_F32, begin, end);
}

/* ---- scale ---------------------------------------------------------------- */

ALWAYS_INLINE void scale_loop(void *x, rlhfz_dtype dtype, float scale, size_t begin, size_t end)
{
    __m256 s = _mm256_set1_ps(scale);
    size_t i = begin;
    for (; i + 4 * W <= end; i += 4 * W) {
        __m256 a = load_as_f32(x, dtype, i);
        __m256 b = load_as_f32(x, dtype, i + W);
        __m256 c = load_as_f32(x, dtype, i + 2 * W);
        __m256 d = load_as_f32(x, dtype, i + 3 * W);
        store_from_f32(x, dtype, i, _mm256_mul_ps(a, s));
        store_from_f32(x, dtype, i + W, _mm256_mul_ps(b, s));
        store_from_f32(x, dtype, i + 2 * W, _mm256_mul_ps(c, s));
        store_from_f32(x, dtype, i + 3 * W, _mm256_mul_ps(d, s));
    }
    for (; i + W <= end; i += W)
        store_from_f32(x, dtype, i, _mm256_mul_ps(load_as_f32(x, dtype, i), s));
    rlhfz_scale_chunk_scalar(x, dtype, scale, i, end);
}

void rlhfz_scale_chunk_avx2(void *x, rlhfz_dtype dtype, float scale, size_t begin, size_t end)
{
    if (dtype == RLHFZ_DTYPE_BF16)
        scale_loop(x, RLHFZ_DTYPE_BF16, scale, begin, end);
    else if (dtype == RLHFZ_DTYPE_F16)
        scale_loop(x, RLHFZ_DTYPE_F16, scale, begin, end);
    else
        scale_loop(x, RLHFZ_DTYPE_F32, scale, begin, end);
}

/* ---- cast ----------------------------------------------------------------- */

ALWAYS_INLINE void cast_loop(const void *src, rlhfz_dtype src_dtype, void *dst,
                             rlhfz_dtype dst_dtype, size_t begin, size_t end)
{
    size_t i = begin;
    for (; i + 4 * W <= end; i += 4 * W) {
        __m256 a = load_as_f32(src, src_dtype, i);
        __m256 b = load_as_f32(src, src_dtype, i + W);
        __m256 c = load_as_f32(src, src_dtype, i + 2 * W);
        __m256 d = load_as_f32(src, src_dtype, i + 3 * W);
        store_from_f32(dst, dst_dtype, i, a);
        store_from_f32(dst, dst_dtype, i + W, b);
        store_from_f32(dst, dst_dtype, i + 2 * W, c);
        store_from_f32(dst, dst_dtype, i + 3 * W, d);
    }
    for (; i + W <= end; i += W)
        store_from_f32(dst, dst_dtype, i, load_as_f32(src, src_dtype, i));
    rlhfz_cast_chunk_scalar(src, src_dtype, dst, dst_dtype, i, end);
}

ALWAYS_INLINE void cast_from(const void *src, rlhfz_dtype src_dtype, void *dst,
                             rlhfz_dtype dst_dtype, size_t begin, size_t end)
{
    if (dst_dtype == RLHFZ_DTYPE_BF16)
        cast_loop(src, src_dtype, dst, RLHFZ_DTYPE_BF16, begin, end);
    else if (dst_dtype == RLHFZ_DTYPE_F16)
        cast_loop(src, src_dtype, dst, RLHFZ_DTYPE_F16, begin, end);
    else
        cast_loop(src, src_dtype, dst, RLHFZ_DTYPE_F32, begin, end);
}

void rlhfz_cast_chunk_avx2(const void *src, rlhfz_dtype src_dtype, void *dst,
                           rlhfz_dtype dst_dtype, size_t begin, size_t end)
{
    if (src_dtype == RLHFZ_DTYPE_BF16)
        cast_from(src, RLHFZ_DTYPE_BF16, dst, dst_dtype, begin, end);
    else if (src_dtype == RLHFZ_DTYPE_F16)
        cast_from(src, RLHFZ_DTYPE_F16, dst, dst_dtype, begin, end);
    else
        cast_from(src, RLHFZ_DTYPE_F32, dst, dst_dtype, begin, end);
}

/* ---- the traffic bound: AdamW's loads and stores, trivial math ------------ */

ALWAYS_INLINE void traffic_vec(float *p, const float *g, float *m, float *v, size_t i)
{
    __m256 grad = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_loadu_ps(p + i), grad));
    _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), grad));
    _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), grad));
}

void rlhfz_traffic_chunk_avx2(float *p, const float *g, float *m, float *v, size_t begin,
                              size_t end)
{
    size_t i = begin;
    for (; i + 4 * W <= end; i += 4 * W) {
        traffic_vec(p, g, m, v, i);
        traffic_vec(p, g, m, v, i + W);
        traffic_vec(p, g, m, v, i + 2 * W);
        traffic_vec(p, g, m, v, i + 3 * W);
    }
    for (; i + W <= end; i += W)
        traffic_vec(p, g, m, v, i);
    rlhfz_traffic_chunk_scalar(p, g, m, v, i, end);
}

#endif /* x86 */
