/* adamw_lowp_cuda.cu: AdamW over bf16 or int8 moments on the GPU, one launch
 * per shard part.
 *
 * The twin of rlhfz_adamw_lowp_reference: each element's step is
 * rlhfz_adamw_element (cuda_adamw_element.cuh), and the formats are
 * lowp_state.h's own functions, which compile for the device with every
 * fp32 operation a rounded intrinsic, so the results are the reference's
 * bits. bf16 moments go element by element, laid out as cuda_elementwise.cuh
 * says. int8 moments go one CUDA block per block of RLHFZ_QBLOCK elements,
 * a thread per element: decode and step into registers, find the block's
 * new scales in shared memory, encode against them. Nothing goes through
 * global memory between the passes.
 */
#include <cuda_runtime.h>

#include <math.h>
#include <stdint.h>

#include "cuda_adamw_element.cuh"
#include "cuda_check.cuh"
#include "cuda_elementwise.cuh"
#include "lowp_state.h"
#include "rlhfz_cuda.h"
#include "rlhfz_kernels.h"

static_assert(RLHFZ_QBLOCK <= 1024 && (RLHFZ_QBLOCK & (RLHFZ_QBLOCK - 1)) == 0,
              "an int8 block is one CUDA block, reduced by halving");

/* What rounds the new moments; plain values, passed to kernels by value. */
struct lowp_rounding {
    rlhfz_rounding rounding;
    uint32_t key;                /* rlhfz_rounding_key(seed, step) */
    uint64_t index_base;
};

/* ---- kernels -------------------------------------------------------------- */

/* Element i's 16 random bits, for its exp_avg_sq. */
__device__ __forceinline__ uint32_t lowp_random16(const lowp_rounding &r, size_t i)
{
    return rlhfz_element_random16(r.rounding, r.key, r.index_base + i);
}

/* One element over bf16 moments: the step from the decoded moments m and v,
 * then each new moment rounded to bf16 as lowp_state.h defines. */
__device__ __forceinline__ void lowp_bf16_element(const rlhfz_adamw_hparams &hp,
                                                  const lowp_rounding &r, size_t i, float grad,
                                                  float &param, float m, float v,
                                                  unsigned short &m_bits,
                                                  unsigned short &v_bits)
{
    rlhfz_adamw_element(hp, grad, param, m, v);
    m_bits = rlhfz_bf16_exp_avg(m);
    v_bits = rlhfz_bf16_exp_avg_sq(v, r.rounding, lowp_random16(r, i));
}

/* G: grad dtype; OUT: param_out dtype, or RLHFZ_OUT_NONE. vector: every
 * pointer is 16-byte aligned, so whole steps of RLHFZ_VEC elements load and
 * store 16 bytes at a time. */
template <int G, int OUT>
__global__ void __launch_bounds__(RLHFZ_BLOCK)
rlhfz_adamw_lowp_bf16_kernel(float *master, unsigned short *exp_avg, unsigned short *exp_avg_sq,
                             const void *grad, void *param_out, size_t n,
                             rlhfz_adamw_hparams hp, lowp_rounding r,
                             const int *skip_if_nonzero, bool vector)
{
    /* a step the caller called off on the device: leave everything as it is */
    if (skip_if_nonzero && *skip_if_nonzero != 0)
        return;
    const size_t thread = rlhfz_thread_index();
    const size_t stride = rlhfz_thread_count();
    size_t done = 0;

    if (vector) {
        const size_t steps = n / RLHFZ_VEC;
        for (size_t s = thread; s < steps; s += stride) {
            const size_t i = s * RLHFZ_VEC;
            float g[RLHFZ_VEC], p[RLHFZ_VEC], m[RLHFZ_VEC], v[RLHFZ_VEC];
            unsigned short m_bits[RLHFZ_VEC], v_bits[RLHFZ_VEC];
            rlhfz_load8<G>(grad, i, g);
            rlhfz_load8<RLHFZ_DTYPE_F32>(master, i, p);
            rlhfz_load8<RLHFZ_DTYPE_BF16>(exp_avg, i, m);
            rlhfz_load8<RLHFZ_DTYPE_BF16>(exp_avg_sq, i, v);
#pragma unroll
            for (int k = 0; k < RLHFZ_VEC; k++)
                lowp_bf16_element(hp, r, i + k, g[k], p[k], m[k], v[k], m_bits[k], v_bits[k]);
            rlhfz_store8<RLHFZ_DTYPE_F32>(master, i, p);
            if constexpr (OUT != RLHFZ_OUT_NONE)
                rlhfz_store8<OUT>(param_out, i, p);
            rlhfz_store8_bits(exp_avg, i, m_bits);
            rlhfz_store8_bits(exp_avg_sq, i, v_bits);
        }
        done = steps * RLHFZ_VEC;
    }

    /* the tail after the vector steps, or everything when unaligned */
    for (size_t i = done + thread; i < n; i += stride) {
        float p = master[i];
        lowp_bf16_element(hp, r, i, rlhfz_load<G>(grad, i), p, rlhfz_bf16_to_f32(exp_avg[i]),
                          rlhfz_bf16_to_f32(exp_avg_sq[i]), exp_avg[i], exp_avg_sq[i]);
        master[i] = p;
        if constexpr (OUT != RLHFZ_OUT_NONE)
            rlhfz_store<OUT>(param_out, i, p);
    }
}

/* A value a block's largest is taken over: a non-finite one counts as +Inf,
 * so the largest is Inf exactly when the block is not finite, and finite
 * otherwise (every finite float is below Inf), as the reference's largest
 * finite value and its flag say together. */
__device__ __forceinline__ float lowp_finite_or_inf(float x)
{
    return isfinite(x) ? x : INFINITY;
}

/* a and b become their largest over the block's threads, by halving in
 * shared memory (max is exact, so the order does not matter). Every thread
 * of the block calls it. */
__device__ __forceinline__ void lowp_block_max(float &a, float &b)
{
    RLHFZ_SHARED_ARRAY(float, as, RLHFZ_QBLOCK);
    RLHFZ_SHARED_ARRAY(float, bs, RLHFZ_QBLOCK);
    const unsigned int t = threadIdx.x;
    as[t] = a;
    bs[t] = b;
    __syncthreads();
#pragma unroll
    for (unsigned int half = RLHFZ_QBLOCK / 2; half > 0; half /= 2) {
        if (t < half) {
            as[t] = fmaxf(as[t], as[t + half]);
            bs[t] = fmaxf(bs[t], bs[t + half]);
        }
        __syncthreads();
    }
    a = as[0];
    b = bs[0];
    /* the thread's next block writes these arrays again: all read first */
    __syncthreads();
}

/* One CUDA block of RLHFZ_QBLOCK threads per int8 block (a grid-stride loop
 * over them), a thread per element; the last block's extra threads step
 * nothing and count as zeros. G and OUT as for bf16. */
template <int G, int OUT>
__global__ void __launch_bounds__(RLHFZ_QBLOCK)
rlhfz_adamw_lowp_int8_kernel(float *master, int8_t *exp_avg, uint8_t *exp_avg_sq,
                             float *exp_avg_scale, float *exp_avg_sq_scale, const void *grad,
                             void *param_out, size_t n, rlhfz_adamw_hparams hp, lowp_rounding r,
                             const int *skip_if_nonzero)
{
    if (skip_if_nonzero && *skip_if_nonzero != 0)
        return;
    const size_t blocks = (n + RLHFZ_QBLOCK - 1) / RLHFZ_QBLOCK;
    for (size_t block = blockIdx.x; block < blocks; block += gridDim.x) {
        const size_t i = block * RLHFZ_QBLOCK + threadIdx.x;
        const bool live = i < n;

        /* decode and step; every thread reads the old scales before the
         * block max's first barrier, and thread 0 writes the new ones after */
        const float old_scale = exp_avg_scale[block];
        const float old_sq_scale = exp_avg_sq_scale[block];
        float m = 0.0f, v = 0.0f, root = 0.0f;
        if (live) {
            m = rlhfz_q_exp_avg_value(exp_avg[i], old_scale);
            float old_root = rlhfz_q_exp_avg_sq_root(exp_avg_sq[i], old_sq_scale);
            v = __fmul_rn(old_root, old_root);
            float p = master[i];
            root = rlhfz_adamw_element(hp, rlhfz_load<G>(grad, i), p, m, v);
            master[i] = p;
            if constexpr (OUT != RLHFZ_OUT_NONE)
                rlhfz_store<OUT>(param_out, i, p);
        }

        /* the new scales: the block's largest |exp_avg| and sqrt(exp_avg_sq) */
        float largest = lowp_finite_or_inf(fabsf(m)), sq_largest = lowp_finite_or_inf(root);
        lowp_block_max(largest, sq_largest);
        const int finite = isfinite(largest), sq_finite = isfinite(sq_largest);
        float scale, sq_scale;
        const float encode = rlhfz_q_encode(largest, finite, &scale);
        const float sq_encode = rlhfz_q_encode(sq_largest, sq_finite, &sq_scale);
        if (threadIdx.x == 0) {
            exp_avg_scale[block] = scale;
            exp_avg_sq_scale[block] = sq_scale;
        }

        /* encode against them; a block that is not finite gets all-zero codes */
        if (live) {
            exp_avg[i] = finite ? rlhfz_q_exp_avg_code(m, encode) : 0;
            exp_avg_sq[i] = sq_finite ? rlhfz_q_exp_avg_sq_code(root, sq_encode, r.rounding,
                                                                lowp_random16(r, i))
                                      : 0;
        }
    }
}

/* ---- host side ------------------------------------------------------------ */

template <int G, int OUT>
static void launch_bf16(const rlhfz_adamw_lowp_shard *shard, const rlhfz_adamw_hparams &hp,
                        const lowp_rounding &r, const int *skip_if_nonzero, cudaStream_t stream)
{
    const bool vector = rlhfz_aligned16(shard->master) && rlhfz_aligned16(shard->exp_avg) &&
                        rlhfz_aligned16(shard->exp_avg_sq) && rlhfz_aligned16(shard->grad) &&
                        rlhfz_aligned16(shard->param_out);
    unsigned int grid = rlhfz_elementwise_grid(rlhfz_adamw_lowp_bf16_kernel<G, OUT>, shard->n,
                                               vector);
    RLHFZ_LAUNCH(grid, RLHFZ_BLOCK, 0, stream, rlhfz_adamw_lowp_bf16_kernel<G, OUT>)(
        shard->master, static_cast<unsigned short *>(shard->exp_avg),
        static_cast<unsigned short *>(shard->exp_avg_sq), shard->grad, shard->param_out,
        shard->n, hp, r, skip_if_nonzero, vector);
}

template <int G, int OUT>
static void launch_int8(const rlhfz_adamw_lowp_shard *shard, const rlhfz_adamw_hparams &hp,
                        const lowp_rounding &r, const int *skip_if_nonzero, cudaStream_t stream)
{
    /* whole blocks, at most one wave of them resident */
    const size_t blocks = (shard->n + RLHFZ_QBLOCK - 1) / RLHFZ_QBLOCK;
    unsigned int grid = rlhfz_one_wave_grid(rlhfz_adamw_lowp_int8_kernel<G, OUT>, RLHFZ_QBLOCK,
                                            blocks * RLHFZ_QBLOCK);
    RLHFZ_LAUNCH(grid, RLHFZ_QBLOCK, 0, stream, rlhfz_adamw_lowp_int8_kernel<G, OUT>)(
        shard->master, static_cast<int8_t *>(shard->exp_avg),
        static_cast<uint8_t *>(shard->exp_avg_sq), shard->exp_avg_scale,
        shard->exp_avg_sq_scale, shard->grad, shard->param_out, shard->n, hp, r,
        skip_if_nonzero);
}

extern "C" rlhfz_status rlhfz_adamw_lowp_cuda(const rlhfz_adamw_lowp_shard *shard,
                                              const rlhfz_adamw_hparams *hp,
                                              const int *skip_if_nonzero, void *stream)
{
    rlhfz_status status = rlhfz_adamw_lowp_check_args(shard, hp);
    if (status != RLHFZ_OK || shard->n == 0)
        return status;       /* empty shards may have null data */

    const lowp_rounding r = {shard->rounding, shard->rounding_key, shard->index_base};
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    /* one kernel per (state dtype, grad dtype, param_out kind), fixed at compile time */
    rlhfz_with_grad_and_out(shard->grad_dtype, shard->param_out, shard->param_dtype,
                            [&](auto grad, auto out) {
        constexpr int G = decltype(grad)::value, OUT = decltype(out)::value;
        if (shard->state_dtype == RLHFZ_STATE_BF16)
            launch_bf16<G, OUT>(shard, *hp, r, skip_if_nonzero, s);
        else
            launch_int8<G, OUT>(shard, *hp, r, skip_if_nonzero, s);
    });
    RLHFZ_CUDA_CHECK_LAUNCH();
    return RLHFZ_OK;
}
