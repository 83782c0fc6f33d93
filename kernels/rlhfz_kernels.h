/* rlhfz_kernels.h: the C ABI of rlhfz's compute kernels.
 *
 * Pure compute over flat arrays. Nothing here knows of Python, tensors or
 * buffers: callers pass raw pointers, element counts and dtypes, and get a
 * status code back. Kernels never print, never exit and never allocate per
 * call (the CPU thread pool is created once and reused).
 */
#ifndef RLHFZ_KERNELS_H
#define RLHFZ_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    RLHFZ_OK = 0,
    RLHFZ_ERR_INVALID = 1,     /* a null pointer where data is needed, or a bad enum */
    RLHFZ_ERR_UNSUPPORTED = 2, /* a dtype or SIMD level this build or CPU lacks */
    RLHFZ_ERR_NOMEM = 3,
    RLHFZ_ERR_THREADS = 4,     /* the thread pool could not be started */
    RLHFZ_ERR_CUDA = 5
} rlhfz_status;

typedef enum {
    RLHFZ_DTYPE_F32 = 0,
    RLHFZ_DTYPE_BF16 = 1,
    RLHFZ_DTYPE_F16 = 2,
    /* the codes of int8 moments: only the low-precision step takes these */
    RLHFZ_DTYPE_I8 = 3,
    RLHFZ_DTYPE_U8 = 4
} rlhfz_dtype;

typedef enum {
    RLHFZ_SIMD_BEST = -1,      /* the widest level the running CPU supports */
    RLHFZ_SIMD_SCALAR = 0,
    RLHFZ_SIMD_AVX2 = 1,       /* AVX2 + FMA + F16C */
    RLHFZ_SIMD_AVX512 = 2      /* AVX-512 F + BW + VL + DQ */
} rlhfz_simd_level;

/* Size in bytes of one element of dtype, or 0 for an unknown dtype. */
size_t rlhfz_dtype_size(rlhfz_dtype dtype);

/* ---- run-time CPU dispatch and threads ------------------------------------ */

/* The widest SIMD level this CPU and OS support (checked once, with cpuid+xgetbv). */
rlhfz_simd_level rlhfz_simd_detect(void);
const char *rlhfz_simd_name(rlhfz_simd_level level);

/* The most threads the CPU kernels use, so the pool needs no allocation. */
#define RLHFZ_MAX_THREADS 256

/* Threads used by the CPU kernels. Default: the CPUs this process may run on.
 * n is clamped to [1, RLHFZ_MAX_THREADS]. Safe to call between kernel calls from any thread. */
void rlhfz_threads_set(int n);
int rlhfz_threads_get(void);

/* ---- AdamW ---------------------------------------------------------------- */

/* Hyperparameters for one step over one flat shard, as the kernels use them.
 * The caller derives each from its double-precision settings and rounds it
 * to float once, as torch.optim.AdamW does with its Python floats (rounding
 * 1 - beta1 from a float beta1 would differ from torch in the last bit). */
typedef struct {
    float decay;                 /* 1 - lr * weight_decay (decoupled: master *= decay) */
    float beta1_weight;          /* 1 - beta1 */
    float beta2;
    float beta2_weight;          /* 1 - beta2 */
    float eps;
    float step_size;             /* lr / (1 - beta1^t) */
    float bias_correction2_rsqrt; /* 1 / sqrt(1 - beta2^t): a multiply, where a division
                                   * would leave the CPU step bound by its divider */
    float grad_scale;            /* the grad is multiplied by this first (1: as is) */
    int maximize;                /* nonzero: ascend, i.e. use -grad */
} rlhfz_adamw_hparams;

/* One flat shard of n elements. master, exp_avg and exp_avg_sq are fp32 and
 * updated in place. grad is read in grad_dtype. If param_out is not NULL, the
 * updated master is also written there in param_dtype, rounded to nearest
 * even (this is how 16-bit params get their new values in the same pass). */
typedef struct {
    float *master;
    float *exp_avg;
    float *exp_avg_sq;
    const void *grad;
    rlhfz_dtype grad_dtype;
    void *param_out;
    rlhfz_dtype param_dtype;
    size_t n;
} rlhfz_adamw_shard;

/* The plain reference: scalar, single-threaded, the math written out once. */
rlhfz_status rlhfz_adamw_reference(const rlhfz_adamw_shard *shard,
                                   const rlhfz_adamw_hparams *hp);

/* The fast path: SIMD at `level` (RLHFZ_SIMD_BEST picks at run time) over the
 * thread pool. Asking for a level the CPU lacks returns RLHFZ_ERR_UNSUPPORTED. */
rlhfz_status rlhfz_adamw_cpu(const rlhfz_adamw_shard *shard,
                             const rlhfz_adamw_hparams *hp,
                             rlhfz_simd_level level);

/* ---- AdamW with low-precision moments ------------------------------------ */

/* How exp_avg and exp_avg_sq are stored. The master stays fp32 throughout. */
typedef enum {
    RLHFZ_STATE_BF16 = 1,        /* both moments as bf16 */
    RLHFZ_STATE_INT8 = 2         /* blockwise codes, one fp32 scale per block per moment */
} rlhfz_state_dtype;

/* Elements per int8 block. Blocks are counted from the start of the shard
 * part, so a part that starts on a block boundary of its bucket keeps the
 * bucket's blocks. */
#define RLHFZ_QBLOCK 256

/* The int8 maps (lowp_state.h states them in code):
 *   exp_avg:    int8 q in [-127, 127], value = q / 127 * scale, where scale
 *               is the block's largest |exp_avg|: linear, encoded with one
 *               product; a small value rounding to 0 only stops its step.
 *   exp_avg_sq: uint8 q in [0, 255], sqrt(value) = q^2 / 255^2 * scale,
 *               where scale is the block's largest sqrt(exp_avg_sq): a
 *               square map of the step's denominator, fine near zero, so a
 *               small exp_avg_sq is not read as 0 (a step of exp_avg / eps).
 * A block whose moment is all zero has scale 0; one that holds an Inf or NaN
 * has scale NaN and codes 0, so the whole block reads NaN. */
typedef enum {
    RLHFZ_ROUND_NEAREST = 0,     /* to nearest, ties to even */
    RLHFZ_ROUND_STOCHASTIC = 1   /* up with probability of the distance, from a counter hash */
} rlhfz_rounding;               /* of exp_avg_sq: exp_avg always rounds to nearest */

typedef struct {
    float *master;
    void *exp_avg;               /* bf16 bits, or int8 codes */
    void *exp_avg_sq;            /* bf16 bits, or uint8 codes */
    float *exp_avg_scale;        /* int8: one per block, ceil(n / RLHFZ_QBLOCK) */
    float *exp_avg_sq_scale;
    rlhfz_state_dtype state_dtype;
    rlhfz_rounding rounding;
    /* Stochastic rounding draws from hash(key, index_base + i): the same bits
     * for an element wherever its shard part starts, so runs repeat across
     * world sizes. The key mixes a seed with the step (rlhfz_rounding_key). */
    uint32_t rounding_key;
    uint64_t index_base;
    const void *grad;
    rlhfz_dtype grad_dtype;
    void *param_out;
    rlhfz_dtype param_dtype;
    size_t n;
} rlhfz_adamw_lowp_shard;

/* The key of one step's stochastic rounding, from a seed and the step. */
uint32_t rlhfz_rounding_key(uint32_t seed, uint64_t step);

/* The checks every low-precision step makes before it touches memory (the
 * reference, the CPU levels and the CUDA step reject the same inputs):
 * RLHFZ_ERR_INVALID for a null pointer where data is needed or a bad enum. */
rlhfz_status rlhfz_adamw_lowp_check_args(const rlhfz_adamw_lowp_shard *shard,
                                         const rlhfz_adamw_hparams *hp);

rlhfz_status rlhfz_adamw_lowp_reference(const rlhfz_adamw_lowp_shard *shard,
                                        const rlhfz_adamw_hparams *hp);
rlhfz_status rlhfz_adamw_lowp_cpu(const rlhfz_adamw_lowp_shard *shard,
                                  const rlhfz_adamw_hparams *hp, rlhfz_simd_level level);

/* ---- reductions, scaling and casts ---------------------------------------- */

/* Sum of squares of n elements, accumulated in double. The result is Inf or
 * NaN if and only if some element is (finite fp32 squares cannot overflow a
 * double), so this one pass serves both grad clipping and the NaN/Inf check. */
rlhfz_status rlhfz_sumsq_cpu(const void *x, rlhfz_dtype dtype, size_t n,
                             double *out);

/* x *= scale in place, in x's dtype (16-bit values rounded to nearest even). */
rlhfz_status rlhfz_scale_cpu(void *x, rlhfz_dtype dtype, size_t n, float scale);

/* dst = src converted, n elements; rounding to nearest even into 16 bits. */
rlhfz_status rlhfz_cast_cpu(const void *src, rlhfz_dtype src_dtype,
                            void *dst, rlhfz_dtype dst_dtype, size_t n);

/* dst = src, nbytes of host memory (the two must not overlap), over the
 * thread pool for large copies. */
rlhfz_status rlhfz_copy_cpu(void *dst, const void *src, size_t nbytes);

/* ---- the memory-bandwidth bound for AdamW --------------------------------- */

/* Exactly AdamW's memory traffic (read p, g, m, v; write p, m, v) with
 * trivial arithmetic, on the same thread pool: 28 bytes per element with
 * fp32 moments, 20 with moments of 2 bytes and 16 with 1 (moment_bytes).
 * Its throughput is the ceiling an AdamW step with that state can reach on
 * this machine. */
rlhfz_status rlhfz_adamw_traffic_bound_cpu(float *p, const float *g, void *m,
                                           void *v, size_t moment_bytes, size_t n);

/* ---- CUDA (present only when built with nvcc) ----------------------------- */

/* Number of visible CUDA devices; 0 with no driver or no device. Returns the
 * runtime's error string through *error (static storage) when it fails. */
rlhfz_status rlhfz_cuda_device_count(int *count, const char **error);
int rlhfz_cuda_runtime_version(void);

#ifdef __cplusplus
}
#endif

#endif /* RLHFZ_KERNELS_H */
