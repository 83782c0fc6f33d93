/* lowp_chunks_scalar.c: the scalar level of AdamW with bf16 or int8 moments.
 *
 * The per-element math stated plainly, over elements [begin, end) of a flat
 * shard part, with the reference's bits. The dispatcher (adamw_lowp_cpu.c)
 * runs these where no SIMD level is usable. Compiled without ISA flags, as
 * cpu_chunks_scalar.c.
 */
#include "rlhfz_kernels.h"

#include <math.h>
#include <stdint.h>

#include "cpu_kernels_simd.h"
#include "half_convert.h"
#include "lowp_state.h"

/* One int8 block on its way through a step: the scales its codes were
 * encoded against, its new moments (exp_avg, and sqrt(exp_avg_sq)), and the
 * running largest magnitude of each over the finite values, with whether
 * all were finite. */
typedef struct {
    float scale, sq_scale;
    float moments[RLHFZ_QBLOCK], roots[RLHFZ_QBLOCK];
    float largest, sq_largest;
    int finite, sq_finite;
} q_block;

static float element_step(const rlhfz_adamw_lowp_shard *shard, const rlhfz_adamw_consts *c,
                          size_t i, float *exp_avg, float *exp_avg_sq)
{
    float g = rlhfz_load_f32(shard->grad, shard->grad_dtype, i) * c->grad_scale;

    /* decoupled weight decay */
    float p = shard->master[i] * c->decay;

    /* update the first moment: a lerp toward g */
    float m = *exp_avg;
    m = m + c->beta1_weight * (g - m);

    /* update the second moment */
    float v = *exp_avg_sq * c->beta2;
    v = v + c->beta2_weight * g * g;

    /* the bias-corrected step */
    float root = sqrtf(v);
    float denom = root * c->bias_correction2_rsqrt + c->eps;
    p = p - c->step_size * (m / denom);

    shard->master[i] = p;
    if (shard->param_out)
        rlhfz_store_f32(shard->param_out, shard->param_dtype, i, p);
    *exp_avg = m;
    *exp_avg_sq = v;
    return root;
}

void rlhfz_lowp_bf16_chunk_scalar(const rlhfz_adamw_lowp_shard *shard,
                                  const rlhfz_adamw_consts *c, size_t begin, size_t end)
{
    uint16_t *exp_avg = shard->exp_avg, *exp_avg_sq = shard->exp_avg_sq;
    for (size_t i = begin; i < end; i++) {
        float m = rlhfz_bf16_to_f32(exp_avg[i]);
        float v = rlhfz_bf16_to_f32(exp_avg_sq[i]);
        element_step(shard, c, i, &m, &v);

        uint32_t random16 = rlhfz_element_random16(shard->rounding, shard->rounding_key,
                                                   shard->index_base + i);
        exp_avg[i] = rlhfz_bf16_exp_avg(m);
        exp_avg_sq[i] = rlhfz_bf16_exp_avg_sq(v, shard->rounding, random16);
    }
}

static void int8_encode(const rlhfz_adamw_lowp_shard *shard, size_t i, float exp_avg,
                        float exp_avg_root, float exp_avg_encode, float exp_avg_sq_encode)
{
    uint32_t random16 = rlhfz_element_random16(shard->rounding, shard->rounding_key,
                                               shard->index_base + i);
    ((int8_t *)shard->exp_avg)[i] = rlhfz_q_exp_avg_code(exp_avg, exp_avg_encode);
    ((uint8_t *)shard->exp_avg_sq)[i] =
        rlhfz_q_exp_avg_sq_code(exp_avg_root, exp_avg_sq_encode, shard->rounding, random16);
}

static void int8_step(const rlhfz_adamw_lowp_shard *shard, const rlhfz_adamw_consts *c,
                      size_t begin, size_t from, size_t end, q_block *block)
{
    const int8_t *codes = shard->exp_avg;
    const uint8_t *sq_codes = shard->exp_avg_sq;
    for (size_t i = from; i < end; i++) {
        float m = rlhfz_q_exp_avg_value(codes[i], block->scale);
        float root = rlhfz_q_exp_avg_sq_root(sq_codes[i], block->sq_scale);
        float v = root * root;
        root = element_step(shard, c, i, &m, &v);
        block->moments[i - begin] = m;
        block->roots[i - begin] = root;

        float magnitude = fabsf(m);
        if (!isfinite(magnitude))
            block->finite = 0;
        else if (magnitude > block->largest)
            block->largest = magnitude;
        if (!isfinite(root))
            block->sq_finite = 0;
        else if (root > block->sq_largest)
            block->sq_largest = root;
    }
}

/* One block: decode and step every element, keeping the new moments, then
 * encode them against the block's new scales. */
static void int8_block(const rlhfz_adamw_lowp_shard *shard, const rlhfz_adamw_consts *c,
                       size_t begin, size_t end)
{
    size_t index = begin / RLHFZ_QBLOCK;
    q_block block = {
        .scale = shard->exp_avg_scale[index], .sq_scale = shard->exp_avg_sq_scale[index],
        .finite = 1, .sq_finite = 1};
    int8_step(shard, c, begin, begin, end, &block);

    float encode = rlhfz_q_encode(block.largest, block.finite, &shard->exp_avg_scale[index]);
    float sq_encode =
        rlhfz_q_encode(block.sq_largest, block.sq_finite, &shard->exp_avg_sq_scale[index]);
    for (size_t i = begin; i < end; i++) {
        /* a block that is not finite keeps all-zero codes under its NaN scale */
        float m = block.finite ? block.moments[i - begin] : 0.0f;
        float root = block.sq_finite ? block.roots[i - begin] : 0.0f;
        int8_encode(shard, i, m, root, encode, sq_encode);
    }
}

void rlhfz_lowp_int8_chunk_scalar(const rlhfz_adamw_lowp_shard *shard,
                                  const rlhfz_adamw_consts *c, size_t begin, size_t end)
{
    for (size_t b = begin; b < end; b += RLHFZ_QBLOCK)
        int8_block(shard, c, b, b + RLHFZ_QBLOCK < end ? b + RLHFZ_QBLOCK : end);
}
