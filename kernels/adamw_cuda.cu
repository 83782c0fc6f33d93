/* adamw_cuda.cu: the fused AdamW step on the GPU, one launch per shard.
 *
 * The per-element math is rlhfz_adamw_reference's, operation for operation,
 * written once in rlhfz_adamw_element (cuda_adamw_element.cuh, with why it
 * spells each operation as a rounded intrinsic) and used by both the vector
 * body and the scalar tail, so finite results match the CPU bit for bit.
 */
#include <cuda_runtime.h>

#include "cuda_adamw_element.cuh"
#include "cuda_check.cuh"
#include "cuda_elementwise.cuh"
#include "rlhfz_cuda.h"
#include "rlhfz_kernels.h"

/* ---- kernels -------------------------------------------------------------- */

/* Vector steps a thread takes per pass, all loaded before the first is
 * computed, and threads per block. Measured on an H200 (tools/perf/
 * adamw_cuda_variants.cu): two steps per pass in 512-thread blocks, one
 * wave of them, moved 0.93 of the copy bandwidth where one step in
 * 256-thread blocks over several waves moved 0.86: fewer threads with twice
 * the loads in flight each keep the memory system as busy with less
 * interleaving of the seven streams. */
#define ADAMW_UNROLL 2
#define ADAMW_BLOCK 512

/* G: grad dtype; OUT: param_out dtype, or RLHFZ_OUT_NONE. vector: every pointer
 * is 16-byte aligned. Pass k of a thread over the vector part takes steps
 * (u * passes + s) for u < ADAMW_UNROLL, so each load of a warp is
 * contiguous; the last n % (ADAMW_UNROLL * RLHFZ_VEC) elements (or all n
 * when unaligned) go one per thread. */
template <int G, int OUT>
__global__ void __launch_bounds__(ADAMW_BLOCK)
rlhfz_adamw_kernel(float *master, float *exp_avg, float *exp_avg_sq, const void *grad,
                   void *param_out, size_t n, rlhfz_adamw_hparams hp_host,
                   const rlhfz_adamw_hparams *hp_device, const int *skip_if_nonzero, bool vector)
{
    /* a step the caller called off on the device (say, an Inf in the grads):
     * leave params and state as they are */
    if (skip_if_nonzero && *skip_if_nonzero != 0)
        return;
    /* read once into registers; a captured graph sees the values of each replay */
    const rlhfz_adamw_hparams hp = hp_device ? *hp_device : hp_host;

    const size_t thread = rlhfz_thread_index();
    const size_t stride = rlhfz_thread_count();
    size_t done = 0;

    if (vector) {
        const size_t passes = n / (RLHFZ_VEC * ADAMW_UNROLL);
        for (size_t s = thread; s < passes; s += stride) {
            float g[ADAMW_UNROLL][RLHFZ_VEC], p[ADAMW_UNROLL][RLHFZ_VEC];
            float m[ADAMW_UNROLL][RLHFZ_VEC], v[ADAMW_UNROLL][RLHFZ_VEC];
#pragma unroll
            for (int u = 0; u < ADAMW_UNROLL; u++) {
                const size_t i = (u * passes + s) * RLHFZ_VEC;
                rlhfz_load8<G>(grad, i, g[u]);
                rlhfz_load8<RLHFZ_DTYPE_F32>(master, i, p[u]);
                rlhfz_load8<RLHFZ_DTYPE_F32>(exp_avg, i, m[u]);
                rlhfz_load8<RLHFZ_DTYPE_F32>(exp_avg_sq, i, v[u]);
            }
#pragma unroll
            for (int u = 0; u < ADAMW_UNROLL; u++) {
                const size_t i = (u * passes + s) * RLHFZ_VEC;
#pragma unroll
                for (int k = 0; k < RLHFZ_VEC; k++)
                    rlhfz_adamw_element(hp, g[u][k], p[u][k], m[u][k], v[u][k]);
                rlhfz_store8<RLHFZ_DTYPE_F32>(master, i, p[u]);
                rlhfz_store8<RLHFZ_DTYPE_F32>(exp_avg, i, m[u]);
                rlhfz_store8<RLHFZ_DTYPE_F32>(exp_avg_sq, i, v[u]);
                if constexpr (OUT != RLHFZ_OUT_NONE)
                    rlhfz_store8<OUT>(param_out, i, p[u]);
            }
        }
        done = passes * RLHFZ_VEC * ADAMW_UNROLL;
    }

    /* the tail after the vector passes, or everything when unaligned */
    for (size_t i = done + thread; i < n; i += stride) {
        float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
        rlhfz_adamw_element(hp, rlhfz_load<G>(grad, i), p, m, v);
        master[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        if constexpr (OUT != RLHFZ_OUT_NONE)
            rlhfz_store<OUT>(param_out, i, p);
    }
}

/* ---- host side ------------------------------------------------------------ */

template <int G, int OUT>
static void launch_adamw(const rlhfz_adamw_shard *shard, const rlhfz_adamw_hparams &hp,
                         const rlhfz_adamw_hparams *hp_device, const int *skip_if_nonzero,
                         bool vector, cudaStream_t stream)
{
    const size_t items = vector ? shard->n / (RLHFZ_VEC * ADAMW_UNROLL) : shard->n;
    unsigned int grid = rlhfz_one_wave_grid(rlhfz_adamw_kernel<G, OUT>, ADAMW_BLOCK, items);
    RLHFZ_LAUNCH(grid, ADAMW_BLOCK, 0, stream, rlhfz_adamw_kernel<G, OUT>)(
        shard->master, shard->exp_avg, shard->exp_avg_sq, shard->grad, shard->param_out,
        shard->n, hp, hp_device, skip_if_nonzero, vector);
}

extern "C" rlhfz_status rlhfz_adamw_cuda(const rlhfz_adamw_shard *shard,
                                         const rlhfz_adamw_hparams *hp,
                                         const rlhfz_adamw_hparams *hp_device,
                                         const int *skip_if_nonzero, void *stream)
{
    if (!shard || (!hp && !hp_device))
        return RLHFZ_ERR_INVALID;
    if (!rlhfz_dtype_known(shard->grad_dtype) ||
        (shard->param_out && !rlhfz_dtype_known(shard->param_dtype)))
        return RLHFZ_ERR_UNSUPPORTED;
    if (shard->n == 0)
        return RLHFZ_OK; /* empty shards may have null data */
    if (!shard->master || !shard->exp_avg || !shard->exp_avg_sq || !shard->grad)
        return RLHFZ_ERR_INVALID;

    /* with hp_device the kernel ignores this copy; zeros keep it defined */
    rlhfz_adamw_hparams host = {};
    if (hp)
        host = *hp;
    const bool vector = rlhfz_aligned16(shard->master) && rlhfz_aligned16(shard->exp_avg) &&
                        rlhfz_aligned16(shard->exp_avg_sq) && rlhfz_aligned16(shard->grad) &&
                        rlhfz_aligned16(shard->param_out);
    cudaStream_t s = static_cast<cudaStream_t>(stream);

    /* one kernel per (grad dtype, param_out kind), all fixed at compile time */
    rlhfz_with_grad_and_out(shard->grad_dtype, shard->param_out, shard->param_dtype,
                            [&](auto grad, auto out) {
        launch_adamw<decltype(grad)::value, decltype(out)::value>(shard, host, hp_device,
                                                                  skip_if_nonzero, vector, s);
    });
    RLHFZ_CUDA_CHECK_LAUNCH();
    return RLHFZ_OK;
}
