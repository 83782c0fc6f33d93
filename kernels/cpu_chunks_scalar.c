/* cpu_chunks_scalar.c: the scalar level of the CPU kernels.
 *
 * Each function states one kernel's per-element math plainly, over elements
 * [begin, end) of flat arrays. The dispatcher (adamw_cpu.c) runs them where
 * no SIMD level is usable, and the SIMD levels (adamw_avx2.c,
 * adamw_avx512.c) finish their ranges with them, so every level computes the
 * same bits. A file of its own, compiled without ISA flags, so that the
 * dispatcher and the SIMD levels both call down into it and never into each
 * other.
 */
#include "rlhfz_kernels.h"

#include <math.h>
#include <stdint.h>

#include "cpu_kernels_simd.h"
#include "half_convert.h"

/* ---- scalar chunk functions ----------------------------------------------- */

void rlhfz_adamw_chunk_scalar(const rlhfz_adamw_shard *shard, const rlhfz_adamw_consts *c,
                              size_t begin, size_t end)
{
    for (size_t i = begin; i < end; i++) {
        float g = rlhfz_load_f32(shard->grad, shard->grad_dtype, i) * c->grad_scale;

        /* decoupled weight decay */
        float p = shard->master[i] * c->decay;

        /* update the first moment: a lerp toward g */
        float m = shard->exp_avg[i];
        m = m + c->beta1_weight * (g - m);

        /* update the second moment */
        float v = shard->exp_avg_sq[i] * c->beta2;
        v = v + c->beta2_weight * g * g;

        /* the bias-corrected step */
        float denom = sqrtf(v) * c->bias_correction2_rsqrt + c->eps;
        p = p - c->step_size * (m / denom);

        shard->master[i] = p;
        shard->exp_avg[i] = m;
        shard->exp_avg_sq[i] = v;
        if (shard->param_out)
            rlhfz_store_f32(shard->param_out, shard->param_dtype, i, p);
    }
}

double rlhfz_sumsq_chunk_scalar(const void *x, rlhfz_dtype dtype, size_t begin, size_t end)
{
    double sum = 0.0;
    for (size_t i = begin; i < end; i++) {
        double value = rlhfz_load_f32(x, dtype, i);
        sum += value * value;
    }
    return sum;
}

void rlhfz_scale_chunk_scalar(void *x, rlhfz_dtype dtype, float scale, size_t begin, size_t end)
{
    for (size_t i = begin; i < end; i++)
        rlhfz_store_f32(x, dtype, i, rlhfz_load_f32(x, dtype, i) * scale);
}

void rlhfz_cast_chunk_scalar(const void *src, rlhfz_dtype src_dtype, void *dst,
                             rlhfz_dtype dst_dtype, size_t begin, size_t end)
{
    /* 16-bit to 16-bit goes through fp32 exactly, so it rounds once */
    for (size_t i = begin; i < end; i++)
        rlhfz_store_f32(dst, dst_dtype, i, rlhfz_load_f32(src, src_dtype, i));
}

void rlhfz_traffic_chunk_scalar(float *p, const float *g, void *m, void *v, size_t moment_bytes,
                                size_t begin, size_t end)
{
    for (size_t i = begin; i < end; i++) {
        p[i] += g[i];
        if (moment_bytes == 4) {
            ((float *)m)[i] += g[i];
            ((float *)v)[i] += g[i];
        } else if (moment_bytes == 2) {
            ((uint16_t *)m)[i]++;
            ((uint16_t *)v)[i]++;
        } else {
            ((uint8_t *)m)[i]++;
            ((uint8_t *)v)[i]++;
        }
    }
}
