/* adamw_reference.c: the plain AdamW step, the oracle for the fast paths.
 *
 * Scalar and single-threaded, in the order of operations of
 * torch.optim.AdamW (fp32 throughout). Written separately from the scalar
 * level (cpu_chunks_scalar.c) on purpose: the tests compare the two.
 */
#include "rlhfz_kernels.h"

#include <math.h>
#include <stdint.h>

#include "cpu_kernels_simd.h"
#include "half_convert.h"

rlhfz_status rlhfz_adamw_reference(const rlhfz_adamw_shard *shard,
                                   const rlhfz_adamw_hparams *hp)
{
    rlhfz_status status = rlhfz_adamw_check_args(shard, hp);
    if (status != RLHFZ_OK)
        return status;

    const float decay = hp->decay;
    const float beta1_weight = hp->beta1_weight;
    const float beta2_weight = hp->beta2_weight;

    for (size_t i = 0; i < shard->n; i++) {
        float g;
        if (shard->grad_dtype == RLHFZ_DTYPE_BF16)
            g = rlhfz_bf16_to_f32(((const uint16_t *)shard->grad)[i]);
        else if (shard->grad_dtype == RLHFZ_DTYPE_F16)
            g = rlhfz_f16_to_f32(((const uint16_t *)shard->grad)[i]);
        else
            g = ((const float *)shard->grad)[i];
        g = g * hp->grad_scale;
        if (hp->maximize)
            g = -g;

        /* decoupled weight decay */
        float param = shard->master[i] * decay;

        /* update the first moment: torch's lerp(m, g, 1 - beta1) */
        float exp_avg = shard->exp_avg[i];
        exp_avg = exp_avg + beta1_weight * (g - exp_avg);

        /* update the second moment */
        float exp_avg_sq = shard->exp_avg_sq[i] * hp->beta2;
        exp_avg_sq = exp_avg_sq + beta2_weight * g * g;

        /* the bias-corrected step */
        float denom = sqrtf(exp_avg_sq) * hp->bias_correction2_rsqrt + hp->eps;
        param = param - hp->step_size * (exp_avg / denom);

        shard->master[i] = param;
        shard->exp_avg[i] = exp_avg;
        shard->exp_avg_sq[i] = exp_avg_sq;
        if (shard->param_out) {
            if (shard->param_dtype == RLHFZ_DTYPE_BF16)
                ((uint16_t *)shard->param_out)[i] = rlhfz_f32_to_bf16(param);
            else if (shard->param_dtype == RLHFZ_DTYPE_F16)
                ((uint16_t *)shard->param_out)[i] = rlhfz_f32_to_f16(param);
            else
                ((float *)shard->param_out)[i] = param;
        }
    }
    return RLHFZ_OK;
}
