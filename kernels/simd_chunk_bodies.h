/* simd_chunk_bodies.h: the chunk functions of a SIMD level, written once over
 * a thin SIMD layer (internal).
 *
 * A level's source file (adamw_avx2.c, adamw_avx512.c) defines the layer
 * below with its own intrinsics, then includes this file once; it defines
 * that level's rlhfz_<op>_chunk_<level> functions (cpu_kernels_simd.h).
 * Each loop runs four vectors per step, then one, then hands the last few
 * elements to the scalar level, whose chunk functions state the math
 * plainly. master, exp_avg and exp_avg_sq are read and written, so they get
 * normal stores; param_out of a large shard is streamed past the cache.
 *
 * The math mirrors the scalar level operation for operation (no fused
 * multiply-adds, true sqrt and division), so every level gives the same
 * bits. Build with -ffp-contract=off (implied by -std=c11): gcc's default
 * for GNU C would fuse them.
 *
 * The layer, W = SIMD_WIDTH floats per vector:
 *   SIMD_WIDTH               floats per simd_f32
 *   SIMD_NAME(base)          base##_<level>, the exported name of a chunk function
 *   SIMD_INLINE              static inline, always inlined
 *   simd_f32                 W floats
 *   simd_half                W 16-bit values (bf16 or f16 bits)
 *   simd_f64                 W/2 doubles, a sum-of-squares accumulator
 *   simd_loadu, simd_storeu  W floats, unaligned
 *   simd_stream              W floats, non-temporal; the address is vector-aligned
 *   simd_set1                W copies of a float
 *   simd_add, simd_sub, simd_mul, simd_div, simd_sqrt
 *                            lane-wise and correctly rounded, as in C
 *   simd_half_loadu, simd_half_storeu, simd_half_stream
 *                            W 16-bit values, as simd_loadu/storeu/stream
 *   simd_widen_bf16, simd_widen_f16      simd_half -> simd_f32, exact
 *   simd_narrow_bf16, simd_narrow_f16    simd_f32 -> simd_half, rounded as
 *                                        half_convert.h rounds
 *   simd_sfence              orders the streamed stores before what follows
 *   simd_f64_zero, simd_f64_add
 *   simd_add_squares_lo, simd_add_squares_hi
 *                            acc + x * x over the low or high W/2 lanes of a
 *                            simd_f32, widened to double (squares of fp32 are
 *                            exact in double, so a fused multiply-add rounds
 *                            only the sum)
 *   simd_f64_hsum            the sum of a simd_f64's lanes, as a double
 */
#ifndef SIMD_WIDTH
#error "define a SIMD layer (adamw_avx2.c shows one) before including simd_chunk_bodies.h"
#endif

#include <stddef.h>
#include <stdint.h>

#include "cpu_kernels_simd.h"

#define W SIMD_WIDTH

/* param_out kinds: a dtype, or none */
#define OUT_NONE (-1)

/* ---- loads and stores by dtype --------------------------------------------- */

SIMD_INLINE simd_f32 load_as_f32(const void *x, rlhfz_dtype dtype, size_t i)
{
    switch (dtype) {
    case RLHFZ_DTYPE_BF16:
        return simd_widen_bf16(simd_half_loadu((const uint16_t *)x + i));
    case RLHFZ_DTYPE_F16:
        return simd_widen_f16(simd_half_loadu((const uint16_t *)x + i));
    default:
        return simd_loadu((const float *)x + i);
    }
}

/* A store of W values as dtype. stream (known at compile time) makes it
 * non-temporal, for param_out only: it is written and never read here, so a
 * normal store would first read each of its lines in from memory (2 or 4
 * more bytes of traffic per element); x + i must then be vector-aligned. */
SIMD_INLINE void write_from_f32(void *x, rlhfz_dtype dtype, size_t i, simd_f32 value,
                                int stream)
{
    if (dtype == RLHFZ_DTYPE_BF16 || dtype == RLHFZ_DTYPE_F16) {
        simd_half narrow =
            dtype == RLHFZ_DTYPE_BF16 ? simd_narrow_bf16(value) : simd_narrow_f16(value);
        if (stream)
            simd_half_stream((uint16_t *)x + i, narrow);
        else
            simd_half_storeu((uint16_t *)x + i, narrow);
    } else if (stream) {
        simd_stream((float *)x + i, value);
    } else {
        simd_storeu((float *)x + i, value);
    }
}

/* The usual, cached store. */
SIMD_INLINE void store_from_f32(void *x, rlhfz_dtype dtype, size_t i, simd_f32 value)
{
    write_from_f32(x, dtype, i, value, 0);
}

/* ---- asking for lines ahead ----------------------------------------------- */

/* How far ahead of the element being stepped, in elements, a step asks for
 * its arrays' lines. The hardware prefetchers alone leave the memory idle
 * through much of a step's arithmetic on some cores: on a Xeon, at 50M
 * params on 2 threads, the bf16 and int8 steps ran ~10% faster with these
 * and the fp32 step ~3%. A prefetch never faults, so one past an array's
 * end is harmless. */
#define PREFETCH_AHEAD 512

/* Element i + PREFETCH_AHEAD of x (elements of `size` bytes), once per 64
 * bytes as i steps by W; `write`: for a line that will be written (a
 * constant). */
SIMD_INLINE void prefetch_ahead(const void *x, size_t size, size_t i, int write)
{
    if (((i * size) & 63) >= W * size)
        return;
    const char *line = (const char *)x + (i + PREFETCH_AHEAD) * size;
    if (write)
        __builtin_prefetch(line, 1);
    else
        __builtin_prefetch(line, 0);
}

/* A step's own arrays ahead of element i: the grad (fp32, or 16 bits) it
 * reads and the master and two moments (of `state_bytes`) it rewrites. */
SIMD_INLINE void prefetch_step_ahead(const void *grad, rlhfz_dtype grad_dtype,
                                     const float *master, const void *exp_avg,
                                     const void *exp_avg_sq, size_t state_bytes, size_t i)
{
    prefetch_ahead(grad, grad_dtype == RLHFZ_DTYPE_F32 ? 4 : 2, i, 0);
    prefetch_ahead(master, 4, i, 1);
    prefetch_ahead(exp_avg, state_bytes, i, 1);
    prefetch_ahead(exp_avg_sq, state_bytes, i, 1);
}

/* ---- AdamW ---------------------------------------------------------------- */

typedef struct {
    simd_f32 grad_scale, decay, beta1_weight, beta2, beta2_weight, eps, step_size,
        bias_correction2_rsqrt;
} adamw_vconsts;

/* One vector of the AdamW step; see rlhfz_adamw_chunk_scalar for the plain form. */
SIMD_INLINE void adamw_vec(const rlhfz_adamw_shard *shard, const adamw_vconsts *k, size_t i,
                           rlhfz_dtype grad_dtype, int out, int stream)
{
    prefetch_step_ahead(shard->grad, grad_dtype, shard->master, shard->exp_avg,
                        shard->exp_avg_sq, 4, i);
    simd_f32 g = simd_mul(load_as_f32(shard->grad, grad_dtype, i), k->grad_scale);

    /* decoupled weight decay */
    simd_f32 p = simd_mul(simd_loadu(shard->master + i), k->decay);

    /* update the first moment: m + (1 - beta1) * (g - m) */
    simd_f32 m = simd_loadu(shard->exp_avg + i);
    m = simd_add(m, simd_mul(k->beta1_weight, simd_sub(g, m)));

    /* update the second moment: v * beta2 + (1 - beta2) * g * g */
    simd_f32 v = simd_mul(simd_loadu(shard->exp_avg_sq + i), k->beta2);
    v = simd_add(v, simd_mul(simd_mul(k->beta2_weight, g), g));

    /* the bias-corrected step */
    simd_f32 denom = simd_add(simd_mul(simd_sqrt(v), k->bias_correction2_rsqrt), k->eps);
    p = simd_sub(p, simd_mul(k->step_size, simd_div(m, denom)));

    simd_storeu(shard->master + i, p);
    simd_storeu(shard->exp_avg + i, m);
    simd_storeu(shard->exp_avg_sq + i, v);
    if (out != OUT_NONE)
        write_from_f32(shard->param_out, (rlhfz_dtype)out, i, p, stream);
}

SIMD_INLINE adamw_vconsts adamw_vconsts_of(const rlhfz_adamw_consts *c)
{
    adamw_vconsts k = {
        .grad_scale = simd_set1(c->grad_scale),
        .decay = simd_set1(c->decay),
        .beta1_weight = simd_set1(c->beta1_weight),
        .beta2 = simd_set1(c->beta2),
        .beta2_weight = simd_set1(c->beta2_weight),
        .eps = simd_set1(c->eps),
        .step_size = simd_set1(c->step_size),
        .bias_correction2_rsqrt = simd_set1(c->bias_correction2_rsqrt),
    };
    return k;
}

SIMD_INLINE void adamw_loop(const rlhfz_adamw_shard *shard, const rlhfz_adamw_consts *c,
                            size_t begin, size_t end, rlhfz_dtype grad_dtype, int out,
                            int stream)
{
    adamw_vconsts k = adamw_vconsts_of(c);
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
        simd_sfence(); /* the streamed stores are visible before the range is done */
    rlhfz_adamw_chunk_scalar(shard, c, i, end);
}

/* Stream param_out when the shard is far bigger than any cache (its lines
 * would be evicted before their next use anyway) and this range of it is
 * vector-aligned. */
SIMD_INLINE void adamw_for_out(const rlhfz_adamw_shard *shard, const rlhfz_adamw_consts *c,
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
SIMD_INLINE void adamw_for_grad(const rlhfz_adamw_shard *shard, const rlhfz_adamw_consts *c,
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

void SIMD_NAME(rlhfz_adamw_chunk)(const rlhfz_adamw_shard *shard, const rlhfz_adamw_consts *c,
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

SIMD_INLINE double sumsq_loop(const void *x, rlhfz_dtype dtype, size_t begin, size_t end)
{
    /* Four streams a quarter of the range apart: one sequential stream keeps
     * too few cache misses in flight to reach the memory's bandwidth (on a
     * 2-vCPU EPYC, 37 GB/s read-only, against 57 GB/s for AdamW's streams). */
    const size_t quarter = (end - begin) / (4 * W) * W;
    const size_t q1 = begin + quarter, q2 = q1 + quarter, q3 = q2 + quarter;
    simd_f64 acc0 = simd_f64_zero(), acc1 = simd_f64_zero();
    simd_f64 acc2 = simd_f64_zero(), acc3 = simd_f64_zero();
    simd_f64 acc4 = simd_f64_zero(), acc5 = simd_f64_zero();
    simd_f64 acc6 = simd_f64_zero(), acc7 = simd_f64_zero();
    for (size_t k = 0; k < quarter; k += W) {
        simd_f32 a = load_as_f32(x, dtype, begin + k);
        simd_f32 b = load_as_f32(x, dtype, q1 + k);
        simd_f32 c = load_as_f32(x, dtype, q2 + k);
        simd_f32 d = load_as_f32(x, dtype, q3 + k);
        acc0 = simd_add_squares_lo(acc0, a);
        acc1 = simd_add_squares_hi(acc1, a);
        acc2 = simd_add_squares_lo(acc2, b);
        acc3 = simd_add_squares_hi(acc3, b);
        acc4 = simd_add_squares_lo(acc4, c);
        acc5 = simd_add_squares_hi(acc5, c);
        acc6 = simd_add_squares_lo(acc6, d);
        acc7 = simd_add_squares_hi(acc7, d);
    }
    size_t i = q3 + quarter;
    for (; i + W <= end; i += W) {
        simd_f32 a = load_as_f32(x, dtype, i);
        acc0 = simd_add_squares_lo(acc0, a);
        acc1 = simd_add_squares_hi(acc1, a);
    }
    simd_f64 acc = simd_f64_add(simd_f64_add(simd_f64_add(acc0, acc1), simd_f64_add(acc2, acc3)),
                                simd_f64_add(simd_f64_add(acc4, acc5), simd_f64_add(acc6, acc7)));
    return simd_f64_hsum(acc) + rlhfz_sumsq_chunk_scalar(x, dtype, i, end);
}

double SIMD_NAME(rlhfz_sumsq_chunk)(const void *x, rlhfz_dtype dtype, size_t begin, size_t end)
{
    if (dtype == RLHFZ_DTYPE_BF16)
        return sumsq_loop(x, RLHFZ_DTYPE_BF16, begin, end);
    if (dtype == RLHFZ_DTYPE_F16)
        return sumsq_loop(x, RLHFZ_DTYPE_F16, begin, end);
    return sumsq_loop(x, RLHFZ_DTYPE_F32, begin, end);
}

/* ---- scale ---------------------------------------------------------------- */

SIMD_INLINE void scale_loop(void *x, rlhfz_dtype dtype, float scale, size_t begin, size_t end)
{
    simd_f32 s = simd_set1(scale);
    size_t i = begin;
    for (; i + 4 * W <= end; i += 4 * W) {
        simd_f32 a = load_as_f32(x, dtype, i);
        simd_f32 b = load_as_f32(x, dtype, i + W);
        simd_f32 c = load_as_f32(x, dtype, i + 2 * W);
        simd_f32 d = load_as_f32(x, dtype, i + 3 * W);
        store_from_f32(x, dtype, i, simd_mul(a, s));
        store_from_f32(x, dtype, i + W, simd_mul(b, s));
        store_from_f32(x, dtype, i + 2 * W, simd_mul(c, s));
        store_from_f32(x, dtype, i + 3 * W, simd_mul(d, s));
    }
    for (; i + W <= end; i += W)
        store_from_f32(x, dtype, i, simd_mul(load_as_f32(x, dtype, i), s));
    rlhfz_scale_chunk_scalar(x, dtype, scale, i, end);
}

void SIMD_NAME(rlhfz_scale_chunk)(void *x, rlhfz_dtype dtype, float scale, size_t begin,
                                  size_t end)
{
    if (dtype == RLHFZ_DTYPE_BF16)
        scale_loop(x, RLHFZ_DTYPE_BF16, scale, begin, end);
    else if (dtype == RLHFZ_DTYPE_F16)
        scale_loop(x, RLHFZ_DTYPE_F16, scale, begin, end);
    else
        scale_loop(x, RLHFZ_DTYPE_F32, scale, begin, end);
}

/* ---- cast ----------------------------------------------------------------- */

SIMD_INLINE void cast_loop(const void *src, rlhfz_dtype src_dtype, void *dst,
                           rlhfz_dtype dst_dtype, size_t begin, size_t end)
{
    size_t i = begin;
    for (; i + 4 * W <= end; i += 4 * W) {
        simd_f32 a = load_as_f32(src, src_dtype, i);
        simd_f32 b = load_as_f32(src, src_dtype, i + W);
        simd_f32 c = load_as_f32(src, src_dtype, i + 2 * W);
        simd_f32 d = load_as_f32(src, src_dtype, i + 3 * W);
        store_from_f32(dst, dst_dtype, i, a);
        store_from_f32(dst, dst_dtype, i + W, b);
        store_from_f32(dst, dst_dtype, i + 2 * W, c);
        store_from_f32(dst, dst_dtype, i + 3 * W, d);
    }
    for (; i + W <= end; i += W)
        store_from_f32(dst, dst_dtype, i, load_as_f32(src, src_dtype, i));
    rlhfz_cast_chunk_scalar(src, src_dtype, dst, dst_dtype, i, end);
}

SIMD_INLINE void cast_from(const void *src, rlhfz_dtype src_dtype, void *dst,
                           rlhfz_dtype dst_dtype, size_t begin, size_t end)
{
    if (dst_dtype == RLHFZ_DTYPE_BF16)
        cast_loop(src, src_dtype, dst, RLHFZ_DTYPE_BF16, begin, end);
    else if (dst_dtype == RLHFZ_DTYPE_F16)
        cast_loop(src, src_dtype, dst, RLHFZ_DTYPE_F16, begin, end);
    else
        cast_loop(src, src_dtype, dst, RLHFZ_DTYPE_F32, begin, end);
}

void SIMD_NAME(rlhfz_cast_chunk)(const void *src, rlhfz_dtype src_dtype, void *dst,
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

/* 4W elements. Their moments of `moment_bytes` each (a constant where this
 * is inlined) span moment_bytes vectors of floats, which take grad vectors
 * as fp32 moments do: a narrow moment's bits are only to be moved. (Asking
 * for lines ahead, as the steps do, slowed this pure stream by 5-8%.) */
SIMD_INLINE void traffic_block(float *p, const float *g, char *m, char *v,
                               size_t moment_bytes, size_t i)
{
    simd_f32 grad[4];
    for (int k = 0; k < 4; k++) {
        grad[k] = simd_loadu(g + i + k * W);
        simd_storeu(p + i + k * W, simd_add(simd_loadu(p + i + k * W), grad[k]));
    }
    float *m_words = (float *)(m + i * moment_bytes), *v_words = (float *)(v + i * moment_bytes);
    for (size_t k = 0; k < moment_bytes; k++) {
        simd_storeu(m_words + k * W, simd_add(simd_loadu(m_words + k * W), grad[k]));
        simd_storeu(v_words + k * W, simd_add(simd_loadu(v_words + k * W), grad[k]));
    }
}

void SIMD_NAME(rlhfz_traffic_chunk)(float *p, const float *g, void *m, void *v,
                                    size_t moment_bytes, size_t begin, size_t end)
{
    size_t i = begin;
    if (moment_bytes == 4)
        for (; i + 4 * W <= end; i += 4 * W)
            traffic_block(p, g, m, v, 4, i);
    else if (moment_bytes == 2)
        for (; i + 4 * W <= end; i += 4 * W)
            traffic_block(p, g, m, v, 2, i);
    else
        for (; i + 4 * W <= end; i += 4 * W)
            traffic_block(p, g, m, v, 1, i);
    rlhfz_traffic_chunk_scalar(p, g, m, v, moment_bytes, i, end);
}

#undef OUT_NONE
#undef W
