/* adamw_cpu.c: the CPU entry points: the dispatcher over the SIMD levels.
 *
 * Each entry point checks its arguments, picks a SIMD level, and runs that
 * level's chunk function over the thread pool in ranges of whole 64-element
 * blocks (cache-line aligned when the arrays are). The chunk functions live
 * one file per level: cpu_chunks_scalar.c states the per-element math
 * plainly, and adamw_avx2.c / adamw_avx512.c call it for their tails.
 */
#include "rlhfz_kernels.h"

#include <stdint.h>
#include <string.h>

#include "cpu_kernels_simd.h"
#include "thread_pool.h"

/* The chunk function of `op` at `level` (a level resolved, never BEST). */
#if defined(__x86_64__) || defined(__i386__)
#define CHUNK_FOR(op, level)                                                    \
    ((level) == RLHFZ_SIMD_AVX512 ? rlhfz_##op##_chunk_avx512                   \
     : (level) == RLHFZ_SIMD_AVX2 ? rlhfz_##op##_chunk_avx2                     \
                                  : rlhfz_##op##_chunk_scalar)
#else
#define CHUNK_FOR(op, level) ((void)(level), rlhfz_##op##_chunk_scalar)
#endif

/* Elements per pool block: 64 fp32 are 4 cache lines, 64 16-bit values 2. */
#define RLHFZ_GRAIN 64

/* ---- argument checks and level selection ---------------------------------- */

static int dtype_valid(rlhfz_dtype dtype)
{
    return dtype == RLHFZ_DTYPE_F32 || dtype == RLHFZ_DTYPE_BF16 || dtype == RLHFZ_DTYPE_F16;
}

rlhfz_status rlhfz_adamw_check_args(const rlhfz_adamw_shard *shard,
                                    const rlhfz_adamw_hparams *hp)
{
    if (!shard || !hp)
        return RLHFZ_ERR_INVALID;
    if (!dtype_valid(shard->grad_dtype))
        return RLHFZ_ERR_INVALID;
    if (shard->param_out && !dtype_valid(shard->param_dtype))
        return RLHFZ_ERR_INVALID;
    if (shard->n == 0)
        return RLHFZ_OK; /* empty tensors may have null data */
    if (!shard->master || !shard->exp_avg || !shard->exp_avg_sq || !shard->grad)
        return RLHFZ_ERR_INVALID;
    return RLHFZ_OK;
}

void rlhfz_adamw_consts_init(rlhfz_adamw_consts *c, const rlhfz_adamw_hparams *hp)
{
    c->grad_scale = hp->maximize ? -hp->grad_scale : hp->grad_scale;
    c->decay = hp->decay;
    c->beta1_weight = hp->beta1_weight;
    c->beta2 = hp->beta2;
    c->beta2_weight = hp->beta2_weight;
    c->eps = hp->eps;
    c->step_size = hp->step_size;
    c->bias_correction2_rsqrt = hp->bias_correction2_rsqrt;
}

rlhfz_status rlhfz_simd_resolve(rlhfz_simd_level asked, rlhfz_simd_level *level)
{
    rlhfz_simd_level detected = rlhfz_simd_detect();
    if (asked == RLHFZ_SIMD_BEST) {
        *level = detected;
        return RLHFZ_OK;
    }
    if (asked < RLHFZ_SIMD_SCALAR || asked > RLHFZ_SIMD_AVX512)
        return RLHFZ_ERR_INVALID;
    if (asked > detected)
        return RLHFZ_ERR_UNSUPPORTED;
    *level = asked;
    return RLHFZ_OK;
}

/* ---- AdamW ---------------------------------------------------------------- */

typedef void (*adamw_chunk_fn)(const rlhfz_adamw_shard *, const rlhfz_adamw_consts *,
                               size_t, size_t);

typedef struct {
    const rlhfz_adamw_shard *shard;
    rlhfz_adamw_consts consts;
    adamw_chunk_fn chunk;
} adamw_job;

static void adamw_range(void *ctx, size_t begin, size_t end)
{
    const adamw_job *job = ctx;
    job->chunk(job->shard, &job->consts, begin, end);
}

rlhfz_status rlhfz_adamw_cpu(const rlhfz_adamw_shard *shard, const rlhfz_adamw_hparams *hp,
                             rlhfz_simd_level level)
{
    rlhfz_status status = rlhfz_adamw_check_args(shard, hp);
    if (status != RLHFZ_OK)
        return status;
    status = rlhfz_simd_resolve(level, &level);
    if (status != RLHFZ_OK || shard->n == 0)
        return status;

    adamw_job job = {.shard = shard, .chunk = CHUNK_FOR(adamw, level)};
    rlhfz_adamw_consts_init(&job.consts, hp);
    return rlhfz_parallel_for(shard->n, RLHFZ_GRAIN, adamw_range, &job);
}

/* ---- sum of squares ------------------------------------------------------- */

typedef double (*sumsq_chunk_fn)(const void *, rlhfz_dtype, size_t, size_t);

/* One partial per range, added in the order of the ranges: the sum is the
 * same whichever thread ran which range, and with any number of threads. */
typedef struct {
    const void *x;
    rlhfz_dtype dtype;
    sumsq_chunk_fn chunk;
    size_t span;
    double partials[RLHFZ_MAX_RANGES];
} sumsq_job;

static void sumsq_range(void *ctx, size_t begin, size_t end)
{
    sumsq_job *job = ctx;
    job->partials[begin / job->span] = job->chunk(job->x, job->dtype, begin, end);
}

rlhfz_status rlhfz_sumsq_cpu(const void *x, rlhfz_dtype dtype, size_t n, double *out)
{
    if (!out || !dtype_valid(dtype) || (n > 0 && !x))
        return RLHFZ_ERR_INVALID;
    *out = 0.0;
    if (n == 0)
        return RLHFZ_OK;

    sumsq_job job = {.x = x, .dtype = dtype, .chunk = CHUNK_FOR(sumsq, rlhfz_simd_detect()),
                     .span = rlhfz_parallel_span(n, RLHFZ_GRAIN)};
    rlhfz_status status = rlhfz_parallel_for_backward(n, RLHFZ_GRAIN, sumsq_range, &job);
    if (status != RLHFZ_OK)
        return status;

    size_t nranges = n / job.span + (n % job.span != 0);
    double sum = 0.0;
    for (size_t i = 0; i < nranges; i++)
        sum += job.partials[i];
    *out = sum;
    return RLHFZ_OK;
}

/* ---- scale ---------------------------------------------------------------- */

typedef struct {
    void *x;
    rlhfz_dtype dtype;
    float scale;
    void (*chunk)(void *, rlhfz_dtype, float, size_t, size_t);
} scale_job;

static void scale_range(void *ctx, size_t begin, size_t end)
{
    const scale_job *job = ctx;
    job->chunk(job->x, job->dtype, job->scale, begin, end);
}

rlhfz_status rlhfz_scale_cpu(void *x, rlhfz_dtype dtype, size_t n, float scale)
{
    if (!dtype_valid(dtype) || (n > 0 && !x))
        return RLHFZ_ERR_INVALID;
    if (n == 0)
        return RLHFZ_OK;

    scale_job job = {.x = x, .dtype = dtype, .scale = scale,
                     .chunk = CHUNK_FOR(scale, rlhfz_simd_detect())};
    return rlhfz_parallel_for(n, RLHFZ_GRAIN, scale_range, &job);
}

/* ---- cast ----------------------------------------------------------------- */

typedef struct {
    const void *src;
    rlhfz_dtype src_dtype;
    void *dst;
    rlhfz_dtype dst_dtype;
    void (*chunk)(const void *, rlhfz_dtype, void *, rlhfz_dtype, size_t, size_t);
} cast_job;

static void cast_range(void *ctx, size_t begin, size_t end)
{
    const cast_job *job = ctx;
    job->chunk(job->src, job->src_dtype, job->dst, job->dst_dtype, begin, end);
}

static void copy_range(void *ctx, size_t begin, size_t end)
{
    const cast_job *job = ctx;
    size_t size = rlhfz_dtype_size(job->src_dtype);
    memcpy((char *)job->dst + begin * size, (const char *)job->src + begin * size,
           (end - begin) * size);
}

rlhfz_status rlhfz_cast_cpu(const void *src, rlhfz_dtype src_dtype, void *dst,
                            rlhfz_dtype dst_dtype, size_t n)
{
    if (!dtype_valid(src_dtype) || !dtype_valid(dst_dtype) || (n > 0 && (!src || !dst)))
        return RLHFZ_ERR_INVALID;
    if (n == 0)
        return RLHFZ_OK;

    cast_job job = {.src = src, .src_dtype = src_dtype, .dst = dst, .dst_dtype = dst_dtype,
                    .chunk = CHUNK_FOR(cast, rlhfz_simd_detect())};
    if (src_dtype == dst_dtype) {
        if (src == dst)
            return RLHFZ_OK;
        return rlhfz_parallel_for(n, RLHFZ_GRAIN, copy_range, &job);
    }
    return rlhfz_parallel_for(n, RLHFZ_GRAIN, cast_range, &job);
}

/* ---- the traffic bound ---------------------------------------------------- */

typedef struct {
    float *p;
    const float *g;
    void *m;
    void *v;
    size_t moment_bytes;
    void (*chunk)(float *, const float *, void *, void *, size_t, size_t, size_t);
} traffic_job;

static void traffic_range(void *ctx, size_t begin, size_t end)
{
    const traffic_job *job = ctx;
    job->chunk(job->p, job->g, job->m, job->v, job->moment_bytes, begin, end);
}

rlhfz_status rlhfz_adamw_traffic_bound_cpu(float *p, const float *g, void *m, void *v,
                                           size_t moment_bytes, size_t n)
{
    if ((n > 0 && (!p || !g || !m || !v)) ||
        !(moment_bytes == 4 || moment_bytes == 2 || moment_bytes == 1))
        return RLHFZ_ERR_INVALID;
    if (n == 0)
        return RLHFZ_OK;

    traffic_job job = {.p = p, .g = g, .m = m, .v = v, .moment_bytes = moment_bytes,
                       .chunk = CHUNK_FOR(traffic, rlhfz_simd_detect())};
    return rlhfz_parallel_for(n, RLHFZ_GRAIN, traffic_range, &job);
}
