/* adamw_lowp_cpu.c: the CPU entry point of AdamW with bf16 or int8 moments.
 *
 * Checks the arguments, picks a SIMD level, and runs that level's chunk
 * function over the thread pool. int8 ranges are whole blocks, so a block's
 * scale is found and written by one thread; the last block may be short.
 */
#include "rlhfz_kernels.h"

#include <stdint.h>

#include "cpu_kernels_simd.h"
#include "lowp_state.h"
#include "thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#define LOWP_CHUNK_FOR(op, level)                                               \
    ((level) == RLHFZ_SIMD_AVX512 ? rlhfz_lowp_##op##_chunk_avx512              \
     : (level) == RLHFZ_SIMD_AVX2 ? rlhfz_lowp_##op##_chunk_avx2                \
                                  : rlhfz_lowp_##op##_chunk_scalar)
#else
#define LOWP_CHUNK_FOR(op, level) ((void)(level), rlhfz_lowp_##op##_chunk_scalar)
#endif

/* bf16 ranges: 64 elements, as the fp32 step; int8 ranges: whole blocks. */
#define BF16_GRAIN 64

uint32_t rlhfz_rounding_key(uint32_t seed, uint64_t step)
{
    uint32_t key = rlhfz_mix32((uint32_t)step ^ rlhfz_mix32((uint32_t)(step >> 32)));
    return rlhfz_mix32(key ^ rlhfz_mix32(seed + 0x9E3779B9u));
}

rlhfz_status rlhfz_adamw_lowp_check_args(const rlhfz_adamw_lowp_shard *shard,
                                         const rlhfz_adamw_hparams *hp)
{
    if (!shard || !hp)
        return RLHFZ_ERR_INVALID;
    rlhfz_adamw_shard plain = {.master = shard->master, .exp_avg = shard->master,
                               .exp_avg_sq = shard->master, .grad = shard->grad,
                               .grad_dtype = shard->grad_dtype, .param_out = shard->param_out,
                               .param_dtype = shard->param_dtype, .n = shard->n};
    rlhfz_status status = rlhfz_adamw_check_args(&plain, hp);
    if (status != RLHFZ_OK)
        return status;
    if (shard->state_dtype != RLHFZ_STATE_BF16 && shard->state_dtype != RLHFZ_STATE_INT8)
        return RLHFZ_ERR_INVALID;
    if (shard->rounding != RLHFZ_ROUND_NEAREST && shard->rounding != RLHFZ_ROUND_STOCHASTIC)
        return RLHFZ_ERR_INVALID;
    if (shard->n == 0)
        return RLHFZ_OK;
    if (!shard->exp_avg || !shard->exp_avg_sq)
        return RLHFZ_ERR_INVALID;
    if (shard->state_dtype == RLHFZ_STATE_INT8 &&
        (!shard->exp_avg_scale || !shard->exp_avg_sq_scale))
        return RLHFZ_ERR_INVALID;
    return RLHFZ_OK;
}

typedef void (*lowp_chunk_fn)(const rlhfz_adamw_lowp_shard *, const rlhfz_adamw_consts *,
                              size_t, size_t);

typedef struct {
    const rlhfz_adamw_lowp_shard *shard;
    rlhfz_adamw_consts consts;
    lowp_chunk_fn chunk;
} lowp_job;

static void lowp_range(void *ctx, size_t begin, size_t end)
{
    const lowp_job *job = ctx;
    job->chunk(job->shard, &job->consts, begin, end);
}

rlhfz_status rlhfz_adamw_lowp_cpu(const rlhfz_adamw_lowp_shard *shard,
                                  const rlhfz_adamw_hparams *hp, rlhfz_simd_level level)
{
    rlhfz_status status = rlhfz_adamw_lowp_check_args(shard, hp);
    if (status != RLHFZ_OK)
        return status;
    status = rlhfz_simd_resolve(level, &level);
    if (status != RLHFZ_OK || shard->n == 0)
        return status;

    lowp_job job = {.shard = shard};
    rlhfz_adamw_consts_init(&job.consts, hp);
    if (shard->state_dtype == RLHFZ_STATE_BF16) {
        job.chunk = LOWP_CHUNK_FOR(bf16, level);
        return rlhfz_parallel_for(shard->n, BF16_GRAIN, lowp_range, &job);
    }
    job.chunk = LOWP_CHUNK_FOR(int8, level);
    return rlhfz_parallel_for(shard->n, RLHFZ_QBLOCK, lowp_range, &job);
}
