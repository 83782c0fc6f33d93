/* adamw_lowp_reference.c: the plain AdamW step over bf16 or int8 moments,
 * the oracle for the fast paths.
 *
 * Scalar and single-threaded: decode a moment, take torch.optim.AdamW's step
 * in fp32, encode it again. The formats and their rounding are lowp_state.h's;
 * the step and the block bookkeeping are written out here separately from the
 * scalar level (lowp_chunks_scalar.c), so the tests compare two writings.
 */
#include "rlhfz_kernels.h"

#include <math.h>
#include <stdint.h>

#include "cpu_kernels_simd.h"
#include "half_convert.h"
#include "lowp_state.h"

/* One element's AdamW step; m and v in and out, returns sqrt(v). */
static float step_element(const rlhfz_adamw_lowp_shard *shard, const rlhfz_adamw_hparams *hp,
                          size_t i, float *m, float *v)
{
    float g = rlhfz_load_f32(shard->grad, shard->grad_dtype, i) * hp->grad_scale;
    if (hp->maximize)
        g = -g;
    float param = shard->master[i] * hp->decay;
    *m = *m + hp->beta1_weight * (g - *m);
    *v = *v * hp->beta2;
    *v = *v + hp->beta2_weight * g * g;
    float root = sqrtf(*v);
    float denom = root * hp->bias_correction2_rsqrt + hp->eps;
    param = param - hp->step_size * (*m / denom);
    shard->master[i] = param;
    if (shard->param_out)
        rlhfz_store_f32(shard->param_out, shard->param_dtype, i, param);
    return root;
}

static uint32_t random16(const rlhfz_adamw_lowp_shard *shard, size_t i)
{
    return rlhfz_element_random16(shard->rounding, shard->rounding_key, shard->index_base + i);
}

static void bf16_reference(const rlhfz_adamw_lowp_shard *shard, const rlhfz_adamw_hparams *hp)
{
    uint16_t *exp_avg = shard->exp_avg, *exp_avg_sq = shard->exp_avg_sq;
    for (size_t i = 0; i < shard->n; i++) {
        float m = rlhfz_bf16_to_f32(exp_avg[i]);
        float v = rlhfz_bf16_to_f32(exp_avg_sq[i]);
        step_element(shard, hp, i, &m, &v);
        exp_avg[i] = rlhfz_bf16_exp_avg(m);
        exp_avg_sq[i] = rlhfz_bf16_exp_avg_sq(v, shard->rounding, random16(shard, i));
    }
}

static void int8_reference(const rlhfz_adamw_lowp_shard *shard, const rlhfz_adamw_hparams *hp)
{
    int8_t *codes = shard->exp_avg;
    uint8_t *sq_codes = shard->exp_avg_sq;
    float m[RLHFZ_QBLOCK], root[RLHFZ_QBLOCK];
    for (size_t begin = 0; begin < shard->n; begin += RLHFZ_QBLOCK) {
        size_t block = begin / RLHFZ_QBLOCK;
        size_t count = shard->n - begin < RLHFZ_QBLOCK ? shard->n - begin : RLHFZ_QBLOCK;

        /* decode, step, and find the new scales */
        float old_scale = shard->exp_avg_scale[block];
        float old_sq_scale = shard->exp_avg_sq_scale[block];
        float largest = 0.0f, sq_largest = 0.0f;
        int finite = 1, sq_finite = 1;
        for (size_t k = 0; k < count; k++) {
            size_t i = begin + k;
            m[k] = rlhfz_q_exp_avg_value(codes[i], old_scale);
            float old_root = rlhfz_q_exp_avg_sq_root(sq_codes[i], old_sq_scale);
            float v = old_root * old_root;
            root[k] = step_element(shard, hp, i, &m[k], &v);
            if (isfinite(m[k]))
                largest = fmaxf(largest, fabsf(m[k]));
            else
                finite = 0;
            if (isfinite(root[k]))
                sq_largest = fmaxf(sq_largest, root[k]);
            else
                sq_finite = 0;
        }

        /* encode against them */
        float scale, sq_scale;
        float encode = rlhfz_q_encode(largest, finite, &scale);
        float sq_encode = rlhfz_q_encode(sq_largest, sq_finite, &sq_scale);
        shard->exp_avg_scale[block] = scale;
        shard->exp_avg_sq_scale[block] = sq_scale;
        for (size_t k = 0; k < count; k++) {
            size_t i = begin + k;
            codes[i] = finite ? rlhfz_q_exp_avg_code(m[k], encode) : 0;
            sq_codes[i] = sq_finite ? rlhfz_q_exp_avg_sq_code(root[k], sq_encode,
                                                              shard->rounding,
                                                              random16(shard, i))
                                    : 0;
        }
    }
}

rlhfz_status rlhfz_adamw_lowp_reference(const rlhfz_adamw_lowp_shard *shard,
                                        const rlhfz_adamw_hparams *hp)
{
    rlhfz_status status = rlhfz_adamw_lowp_check_args(shard, hp);
    if (status != RLHFZ_OK || shard->n == 0)
        return status;
    if (shard->state_dtype == RLHFZ_STATE_BF16)
        bf16_reference(shard, hp);
    else
        int8_reference(shard, hp);
    return RLHFZ_OK;
}
