/* cpu_kernels_simd.h: the per-level chunk functions behind the CPU kernels
 * (internal).
 *
 * Each level (scalar, avx2, avx512) provides the same set, one file per
 * level (cpu_chunks_scalar.c, adamw_avx2.c, adamw_avx512.c); each function
 * works on elements [begin, end) of flat arrays, and the dispatcher in
 * adamw_cpu.c hands them ranges from the thread pool. The SIMD levels finish
 * their ranges with the scalar functions, so the per-element math is stated
 * in one place.
 */
#ifndef RLHFZ_CPU_KERNELS_SIMD_H
#define RLHFZ_CPU_KERNELS_SIMD_H

#include <stddef.h>

#include "rlhfz_kernels.h"

/* The per-call constants of one AdamW step, derived once from the hparams. */
typedef struct {
    float grad_scale; /* negated when maximizing: -(g * s) == g * -s exactly */
    float decay;      /* 1 - lr * weight_decay */
    float beta1_weight; /* 1 - beta1, exp_avg's lerp weight toward g */
    float beta2;
    float beta2_weight; /* 1 - beta2 */
    float eps;
    float step_size;
    float bias_correction2_rsqrt;
} rlhfz_adamw_consts;

/* From this many elements up, AdamW writes param_out with non-temporal
 * stores: 4M elements move over 100 MB, far more than a last-level cache
 * keeps. (Measured: ~5% faster for bf16 params at 10M elements.) */
#define RLHFZ_STREAM_MIN_ELEMENTS ((size_t)1 << 22)

/* adamw_cpu.c: argument checks shared by the reference and the fast path,
 * so both reject the same inputs. */
rlhfz_status rlhfz_adamw_check_args(const rlhfz_adamw_shard *shard,
                                    const rlhfz_adamw_hparams *hp);
void rlhfz_adamw_consts_init(rlhfz_adamw_consts *c, const rlhfz_adamw_hparams *hp);
/* The level to run for `asked`: BEST resolves to the detected one; a level
 * the CPU lacks is RLHFZ_ERR_UNSUPPORTED. */
rlhfz_status rlhfz_simd_resolve(rlhfz_simd_level asked, rlhfz_simd_level *level);

/* ---- low-precision moments, per level (lowp_chunks_scalar.c,
 * lowp_chunk_bodies.h). The int8 chunks take ranges of whole blocks. ---- */
void rlhfz_lowp_bf16_chunk_scalar(const rlhfz_adamw_lowp_shard *shard,
                                  const rlhfz_adamw_consts *c, size_t begin, size_t end);
void rlhfz_lowp_int8_chunk_scalar(const rlhfz_adamw_lowp_shard *shard,
                                  const rlhfz_adamw_consts *c, size_t begin, size_t end);
void rlhfz_lowp_bf16_chunk_avx2(const rlhfz_adamw_lowp_shard *shard,
                                const rlhfz_adamw_consts *c, size_t begin, size_t end);
void rlhfz_lowp_int8_chunk_avx2(const rlhfz_adamw_lowp_shard *shard,
                                const rlhfz_adamw_consts *c, size_t begin, size_t end);
void rlhfz_lowp_bf16_chunk_avx512(const rlhfz_adamw_lowp_shard *shard,
                                  const rlhfz_adamw_consts *c, size_t begin, size_t end);
void rlhfz_lowp_int8_chunk_avx512(const rlhfz_adamw_lowp_shard *shard,
                                  const rlhfz_adamw_consts *c, size_t begin, size_t end);

/* ---- scalar (cpu_chunks_scalar.c) ---- */
void rlhfz_adamw_chunk_scalar(const rlhfz_adamw_shard *shard, const rlhfz_adamw_consts *c,
                              size_t begin, size_t end);
double rlhfz_sumsq_chunk_scalar(const void *x, rlhfz_dtype dtype, size_t begin, size_t end);
void rlhfz_scale_chunk_scalar(void *x, rlhfz_dtype dtype, float scale, size_t begin, size_t end);
void rlhfz_cast_chunk_scalar(const void *src, rlhfz_dtype src_dtype, void *dst,
                             rlhfz_dtype dst_dtype, size_t begin, size_t end);
void rlhfz_traffic_chunk_scalar(float *p, const float *g, void *m, void *v,
                                size_t moment_bytes, size_t begin, size_t end);

/* ---- avx2 ---- */
void rlhfz_adamw_chunk_avx2(const rlhfz_adamw_shard *shard, const rlhfz_adamw_consts *c,
                            size_t begin, size_t end);
double rlhfz_sumsq_chunk_avx2(const void *x, rlhfz_dtype dtype, size_t begin, size_t end);
void rlhfz_scale_chunk_avx2(void *x, rlhfz_dtype dtype, float scale, size_t begin, size_t end);
void rlhfz_cast_chunk_avx2(const void *src, rlhfz_dtype src_dtype, void *dst,
                           rlhfz_dtype dst_dtype, size_t begin, size_t end);
void rlhfz_traffic_chunk_avx2(float *p, const float *g, void *m, void *v,
                              size_t moment_bytes, size_t begin, size_t end);

/* ---- avx512 ---- */
void rlhfz_adamw_chunk_avx512(const rlhfz_adamw_shard *shard, const rlhfz_adamw_consts *c,
                              size_t begin, size_t end);
double rlhfz_sumsq_chunk_avx512(const void *x, rlhfz_dtype dtype, size_t begin, size_t end);
void rlhfz_scale_chunk_avx512(void *x, rlhfz_dtype dtype, float scale, size_t begin, size_t end);
void rlhfz_cast_chunk_avx512(const void *src, rlhfz_dtype src_dtype, void *dst,
                             rlhfz_dtype dst_dtype, size_t begin, size_t end);
void rlhfz_traffic_chunk_avx512(float *p, const float *g, void *m, void *v,
                                size_t moment_bytes, size_t begin, size_t end);

#endif /* RLHFZ_CPU_KERNELS_SIMD_H */
