/* adamw_avx512.c: the AVX-512 level (F + BW + VL + DQ), 16 floats per vector.
 *
 * Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx2 -mfma
 * -mf16c, and only ever called after run-time detection. It does not need
 * AVX512_BF16: bf16 is rounded with integer ops. The layout follows
 * adamw_avx2.c: loads and stores per dtype, the math written once, four
 * vectors per step, then one, then the scalar level for the last few
 * elements; param_out of a large shard is streamed past the cache. The
 * math mirrors the scalar level operation for operation (no fused
 * multiply-adds, true sqrt and division), so both give the same bits.
 * Build with -ffp-contract=off (implied by -std=c11): gcc's default for GNU
 * C would fuse them.
 */
#include "rlhfz_kernels.h"

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>
#include <stdint.h>

#include "cpu_kernels_simd.h"

#define W 16 /* floats per vector */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* param_out kinds: a dtype, or none */
#define OUT_NONE (-1)

/* ---- the SIMD layer: loads and stores by dtype ---------------------------- */

ALWAYS_INLINE __m512 load_bf16(const uint16_t *x)
{
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* Round to nearest even by integer add (see rlhfz_f32_to_bf16); a NaN keeps
 * its top bits and gets the quiet bit instead. */
ALWAYS_INLINE __m256i to_bf16(__m512 x)
{
    __m512i bits = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    __m512i chosen = _mm512_mask_or_epi32(rounded, is_nan, bits, _mm512_set1_epi32(0x00400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(chosen, 16));
}

ALWAYS_INLINE __m512 load_as_f32(const void *x, rlhfz_dtype dtype, size_t i)
{
    switch (dtype) {
    case RLHFZ_DTYPE_BF16:
        return load_bf16((const uint16_t *)x + i);
    case RLHFZ_DTYPE_F16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i)));
    default:
        return _mm512_loadu_ps((const float *)x + i);
    }
}

ALWAYS_INLINE void store_from_f32(void *x, rlhfz_dtype dtype, size_t i, __m512 value)
{
    switch (dtype) {
    case RLHFZ_DTYPE_BF16:
        _mm256_storeu_si256((__m256i *)((uint16_t *)x + i), to_bf16(value));
        break;
    case RLHFZ_DTYPE_F16:
        _mm256_storeu_si256((__m256i *)((uint16_t *)x + i),
                            _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT));
        break;
    default:
        _mm512_storeu_ps((float *)x + i, value);
        break;
    }
}

/* A non-temporal store, for param_out only: it is written and never read
 * here, so a normal store would first read each of its lines in from memory
 * (2 or 4 more bytes of traffic per element). x + i must be vector-aligned. */
ALWAYS_INLINE void stream_from_f32(void *x, rlhfz_dtype dtype, size_t i, __m512 value)
{
    switch (dtype) {
    case RLHFZ_DTYPE_BF16:
        _mm256_stream_si256((__m256i *)((uint16_t *)x + i), to_bf16(value));
        break;
    case RLHFZ_DTYPE_F16:
        _mm256_stream_si256((__m256i *)((uint16_t *)x + i),
                            _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT));
        break;
    default:
        _mm512_stream_ps((float *)x + i, value);
        break;
    }
}

/* ---- AdamW ---------------------------------------------------------------- */

typedef struct {
    __m512 grad_scale, decay, beta1_weight, beta2, beta2_weight, eps, step_size,
        bias_correction2_sqrt;
} adamw_vconsts;

/* One vector of the AdamW step; see rlhfz_adamw_chunk_scalar for the plain form. */
ALWAYS_INLINE void adamw_vec(const rlhfz_adamw_shard *shard, const adamw_vconsts *k, size_t i,
                             rlhfz_dtype grad_dtype, int out, int stream)
{
    __m512 g = _mm512_mul_ps(load_as_f32(shard->grad, grad_dtype, i), k->grad_scale);

    /* decoupled weight decay */
    __m512 p = _mm512_mul_ps(_mm512_loadu_ps(shard->master + i), k->decay);

    /* update the first moment: m + (1 - beta1) * (g - m) */
    __m512 m = _mm512_loadu_ps(shard->exp_avg + i);
    m = _mm512_add_ps(m, _mm512_mul_ps(k->beta1_weight, _mm512_sub_ps(g, m)));

    /* update the second moment: v * beta2 + (1 - beta2) * g * g */
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(shard->exp_avg_sq + i), k->beta2);
    v = _mm512_add_ps(v, _mm512_mul_ps(_mm512_mul_ps(k->beta2_weight, g), g));

    /* the bias-corrected step */
    __m512 denom =
        _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), k->bias_correction2_sqrt), k->eps);
    p = _mm512_sub_ps(p, _mm512_mul_ps(k->step_size, _mm512_div_ps(m, denom)));

    _mm512_storeu_ps(shard->master + i, p);
    _mm512_storeu_ps(shard->exp_avg + i, m);
    _mm512_storeu_ps(shard->exp_avg_sq + i, v);
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
        .grad_scale = _mm512_set1_ps(c->grad_scale),
        .decay = _mm512_set1_ps(c->decay),
        .beta1_weight = _mm512_set1_ps(c->beta1_weight),
        .beta2 = _mm512_set1_ps(c->beta2),
        .beta2_weight = _mm512_set1_ps(c->beta2_weight),
        .eps = _mm512_set1_ps(c->eps),
        .step_size = _mm512_set1_ps(c->step_size),
        .bias_correction2_sqrt = _mm512_set1_ps(c->bias_correction2_sqrt),
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

void rlhfz_adamw_chunk_avx512(const rlhfz_adamw_shard *shard, const rlhfz_adamw_consts *c,
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
ALWAYS_INLINE __m512d add_squares(__m512d acc, __m256 x)
{
    __m512d wide = _mm512_cvtps_pd(x);
    return _mm512_fmadd_pd(wide, wide, acc);
}

ALWAYS_INLINE double sumsq_loop(const void *x, rlhfz_dtype dtype, size_t begin, size_t end)
{
    __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
    __m512d acc2 = _mm512_setzero_pd(), acc3 = _mm512_setzero_pd();
    size_t i = begin;
    for (; i + 2 * W <= end; i += 2 * W) {
        __m512 a = load_as_f32(x, dtype, i);
        __m512 b = load_as_f32(x, dtype, i + W);
        acc0 = add_squares(acc0, _mm512_castps512_ps256(a));
        acc1 = add_squares(acc1, _mm512_extractf32x8_ps(a, 1));
        acc2 = add_squares(acc2, _mm512_castps512_ps256(b));
        acc3 = add_squares(acc3, _mm512_extractf32x8_ps(b, 1));
    }
    for (; i + W <= end; i += W) {
        __m512 a = load_as_f32(x, dtype, i);
        acc0 = add_squares(acc0, _mm512_castps512_ps256(a));
        acc1 = add_squares(acc1, _mm512_extractf32x8_ps(a, 1));
    }
    __m512d acc = _mm512_add_pd(_mm512_add_pd(acc0, acc1), _mm512_add_pd(acc2, acc3));
    double lanes[8];
    _mm512_storeu_pd(lanes, acc);
    double sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                 ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    return sum + rlhfz_sumsq_chunk_scalar(x, dtype, i, end);
}

double rlhfz_sumsq_chunk_avx512(const void *x, rlhfz_dtype dtype, size_t begin, size_t end)
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
    __m512 s = _mm512_set1_ps(scale);
    size_t i = begin;
    for (; i + 4 * W <= end; i += 4 * W) {
        __m512 a = load_as_f32(x, dtype, i);
        __m512 b = load_as_f32(x, dtype, i + W);
        __m512 c = load_as_f32(x, dtype, i + 2 * W);
        __m512 d = load_as_f32(x, dtype, i + 3 * W);
        store_from_f32(x, dtype, i, _mm512_mul_ps(a, s));
        store_from_f32(x, dtype, i + W, _mm512_mul_ps(b, s));
        store_from_f32(x, dtype, i + 2 * W, _mm512_mul_ps(c, s));
        store_from_f32(x, dtype, i + 3 * W, _mm512_mul_ps(d, s));
    }
    for (; i + W <= end; i += W)
        store_from_f32(x, dtype, i, _mm512_mul_ps(load_as_f32(x, dtype, i), s));
    rlhfz_scale_chunk_scalar(x, dtype, scale, i, end);
}

void rlhfz_scale_chunk_avx512(void *x, rlhfz_dtype dtype, float scale, size_t begin, size_t end)
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
        __m512 a = load_as_f32(src, src_dtype, i);
        __m512 b = load_as_f32(src, src_dtype, i + W);
        __m512 c = load_as_f32(src, src_dtype, i + 2 * W);
        __m512 d = load_as_f32(src, src_dtype, i + 3 * W);
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

void rlhfz_cast_chunk_avx512(const void *src, rlhfz_dtype src_dtype, void *dst,
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
    __m512 grad = _mm512_loadu_ps(g + i);
    _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), grad));
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), grad));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), grad));
}

void rlhfz_traffic_chunk_avx512(float *p, const float *g, float *m, float *v, size_t begin,
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
