/* reduce_cuda.cu: sum of squares, grad unscaling, scaling and casts on the GPU.
 *
 * The sum of squares is deterministic: its partition of the elements
 * depends on n alone (not on the pointer's alignment, which only picks how
 * each thread loads its elements), and both passes add in a fixed order.
 * The other kernels are elementwise, laid out as cuda_elementwise.cuh says.
 */
#include <cuda_runtime.h>

#include "cuda_check.cuh"
#include "cuda_elementwise.cuh"
#include "rlhfz_cuda.h"
#include "rlhfz_kernels.h"

/* Most blocks of the sum of squares' first pass, and so the doubles of
 * workspace it needs (one partial per block). */
#define SUMSQ_MAX_BLOCKS 1024

/* ---- kernels -------------------------------------------------------------- */

/* Sums a block's values in shared memory by halving, in a fixed order;
 * thread 0 gets the total. Every thread of the block must call it. */
__device__ __forceinline__ double rlhfz_block_sum(double value)
{
    RLHFZ_SHARED_ARRAY(double, sums, RLHFZ_BLOCK);
    sums[threadIdx.x] = value;
    __syncthreads();
#pragma unroll
    for (unsigned int half = RLHFZ_BLOCK / 2; half > 0; half /= 2) {
        if (threadIdx.x < half)
            sums[threadIdx.x] += sums[threadIdx.x + half];
        __syncthreads();
    }
    return sums[0];
}

/* acc + x * x in double. The square of an fp32 is exact in double, so the
 * fused multiply-add rounds only the sum, as the CPU's x * x + acc does. */
__device__ __forceinline__ double rlhfz_add_square(double acc, float x)
{
    double d = x;
    return fma(d, d, acc);
}

/* First pass: each thread sums whole groups of RLHFZ_VEC elements (the
 * last group may be short) in order, the block sums its threads, and each
 * block writes one partial, 0 if it had no elements. vector: x is 16-byte
 * aligned, so full groups load with 16-byte loads. */
template <int D>
__global__ void __launch_bounds__(RLHFZ_BLOCK)
rlhfz_sumsq_partial_kernel(const void *x, size_t n, bool vector, double *partials)
{
    const size_t stride = rlhfz_thread_count();
    const size_t full = n / RLHFZ_VEC;
    const size_t groups = (n + RLHFZ_VEC - 1) / RLHFZ_VEC;
    double acc = 0.0;

    for (size_t s = rlhfz_thread_index(); s < groups; s += stride) {
        const size_t i = s * RLHFZ_VEC;
        if (vector && s < full) {
            float v[RLHFZ_VEC];
            rlhfz_load8<D>(x, i, v);
#pragma unroll
            for (int k = 0; k < RLHFZ_VEC; k++)
                acc = rlhfz_add_square(acc, v[k]);
        } else {
            /* the same elements in the same order, one load each */
            const size_t end = n - i < RLHFZ_VEC ? n : i + RLHFZ_VEC;
            for (size_t j = i; j < end; j++)
                acc = rlhfz_add_square(acc, rlhfz_load<D>(x, j));
        }
    }

    double total = rlhfz_block_sum(acc);
    if (threadIdx.x == 0)
        partials[blockIdx.x] = total;
}

/* Second pass, one block: the partials in a fixed order, into out[0]. */
__global__ void __launch_bounds__(RLHFZ_BLOCK)
rlhfz_sumsq_final_kernel(const double *partials, unsigned int count, double *out, int accumulate)
{
    double acc = 0.0;
    for (unsigned int b = threadIdx.x; b < count; b += RLHFZ_BLOCK)
        acc += partials[b];

    double total = rlhfz_block_sum(acc);
    if (threadIdx.x == 0)
        out[0] = accumulate ? out[0] + total : total;
}

/* An Inf or a NaN: the exponent bits all set. */
__device__ __forceinline__ bool rlhfz_nonfinite(float x)
{
    return (__float_as_uint(x) & 0x7F800000u) == 0x7F800000u;
}

/* g *= inv_scale in g's dtype; any non-finite g (before scaling) sets
 * *found_inf, once per thread at most. */
template <int D>
__global__ void __launch_bounds__(RLHFZ_BLOCK)
rlhfz_unscale_kernel(void *g, size_t n, float inv_scale, int *found_inf, bool vector)
{
    const size_t thread = rlhfz_thread_index();
    const size_t stride = rlhfz_thread_count();
    bool nonfinite = false;
    size_t done = 0;

    if (vector) {
        const size_t steps = n / RLHFZ_VEC;
        for (size_t s = thread; s < steps; s += stride) {
            float v[RLHFZ_VEC];
            rlhfz_load8<D>(g, s * RLHFZ_VEC, v);
#pragma unroll
            for (int k = 0; k < RLHFZ_VEC; k++) {
                nonfinite |= rlhfz_nonfinite(v[k]);
                v[k] = __fmul_rn(v[k], inv_scale);
            }
            rlhfz_store8<D>(g, s * RLHFZ_VEC, v);
        }
        done = steps * RLHFZ_VEC;
    }
    for (size_t i = done + thread; i < n; i += stride) {
        float v = rlhfz_load<D>(g, i);
        nonfinite |= rlhfz_nonfinite(v);
        rlhfz_store<D>(g, i, __fmul_rn(v, inv_scale));
    }

    /* racing stores of the same 1 are harmless */
    if (nonfinite)
        *found_inf = 1;
}

/* x *= factor in x's dtype, the factor from the device when given there. */
template <int D>
__global__ void __launch_bounds__(RLHFZ_BLOCK)
rlhfz_scale_kernel(void *x, size_t n, float scale, const float *scale_device, bool vector)
{
    const float factor = scale_device ? *scale_device : scale;
    const size_t thread = rlhfz_thread_index();
    const size_t stride = rlhfz_thread_count();
    size_t done = 0;

    if (vector) {
        const size_t steps = n / RLHFZ_VEC;
        for (size_t s = thread; s < steps; s += stride) {
            float v[RLHFZ_VEC];
            rlhfz_load8<D>(x, s * RLHFZ_VEC, v);
#pragma unroll
            for (int k = 0; k < RLHFZ_VEC; k++)
                v[k] = __fmul_rn(v[k], factor);
            rlhfz_store8<D>(x, s * RLHFZ_VEC, v);
        }
        done = steps * RLHFZ_VEC;
    }
    for (size_t i = done + thread; i < n; i += stride)
        rlhfz_store<D>(x, i, __fmul_rn(rlhfz_load<D>(x, i), factor));
}

/* dst = src converted through fp32, which holds every 16-bit value
 * exactly, so a 16-bit to 16-bit cast rounds once. */
template <int S, int D>
__global__ void __launch_bounds__(RLHFZ_BLOCK)
rlhfz_cast_kernel(const void *src, void *dst, size_t n, bool vector)
{
    const size_t thread = rlhfz_thread_index();
    const size_t stride = rlhfz_thread_count();
    size_t done = 0;

    if (vector) {
        const size_t steps = n / RLHFZ_VEC;
        for (size_t s = thread; s < steps; s += stride) {
            float v[RLHFZ_VEC];
            rlhfz_load8<S>(src, s * RLHFZ_VEC, v);
            rlhfz_store8<D>(dst, s * RLHFZ_VEC, v);
        }
        done = steps * RLHFZ_VEC;
    }
    for (size_t i = done + thread; i < n; i += stride)
        rlhfz_store<D>(dst, i, rlhfz_load<S>(src, i));
}

/* ---- host side ------------------------------------------------------------ */

extern "C" size_t rlhfz_sumsq_cuda_workspace(void)
{
    return SUMSQ_MAX_BLOCKS;
}

extern "C" rlhfz_status rlhfz_sumsq_cuda(const void *x, rlhfz_dtype dtype, size_t n, double *out,
                                         int accumulate, double *workspace, void *stream)
{
    if (!out)
        return RLHFZ_ERR_INVALID;
    if (!rlhfz_dtype_known(dtype))
        return RLHFZ_ERR_UNSUPPORTED;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (n == 0) {
        /* the empty sum is 0 (all-zero bits); added to out[0], nothing */
        if (!accumulate)
            RLHFZ_CUDA_CHECK(cudaMemsetAsync(out, 0, sizeof(double), s));
        return RLHFZ_OK;
    }
    if (!x || !workspace)
        return RLHFZ_ERR_INVALID;

    /* blocks from n alone, so the order of the additions is n's alone */
    const size_t groups = (n + RLHFZ_VEC - 1) / RLHFZ_VEC;
    const unsigned int blocks = rlhfz_grid_for(groups, SUMSQ_MAX_BLOCKS);
    const bool vector = rlhfz_aligned16(x);

    rlhfz_with_dtype(dtype, [&](auto d) {
        RLHFZ_LAUNCH(blocks, RLHFZ_BLOCK, 0, s, rlhfz_sumsq_partial_kernel<decltype(d)::value>)(
            x, n, vector, workspace);
    });
    RLHFZ_CUDA_CHECK_LAUNCH();

    RLHFZ_LAUNCH(1, RLHFZ_BLOCK, 0, s, rlhfz_sumsq_final_kernel)(workspace, blocks, out, accumulate);
    RLHFZ_CUDA_CHECK_LAUNCH();
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_unscale_cuda(void *g, rlhfz_dtype dtype, size_t n, float inv_scale,
                                           int *found_inf, void *stream)
{
    if (!rlhfz_dtype_known(dtype))
        return RLHFZ_ERR_UNSUPPORTED;
    if (n == 0)
        return RLHFZ_OK;
    if (!g || !found_inf)
        return RLHFZ_ERR_INVALID;

    const bool vector = rlhfz_aligned16(g);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    rlhfz_with_dtype(dtype, [&](auto d) {
        const auto kernel = rlhfz_unscale_kernel<decltype(d)::value>;
        RLHFZ_LAUNCH(rlhfz_elementwise_grid(kernel, n, vector), RLHFZ_BLOCK, 0, s, kernel)(
            g, n, inv_scale, found_inf, vector);
    });
    RLHFZ_CUDA_CHECK_LAUNCH();
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_scale_cuda(void *x, rlhfz_dtype dtype, size_t n, float scale,
                                         const float *scale_device, void *stream)
{
    if (!rlhfz_dtype_known(dtype))
        return RLHFZ_ERR_UNSUPPORTED;
    if (n == 0)
        return RLHFZ_OK;
    if (!x)
        return RLHFZ_ERR_INVALID;

    const bool vector = rlhfz_aligned16(x);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    rlhfz_with_dtype(dtype, [&](auto d) {
        const auto kernel = rlhfz_scale_kernel<decltype(d)::value>;
        RLHFZ_LAUNCH(rlhfz_elementwise_grid(kernel, n, vector), RLHFZ_BLOCK, 0, s, kernel)(
            x, n, scale, scale_device, vector);
    });
    RLHFZ_CUDA_CHECK_LAUNCH();
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cast_cuda(const void *src, rlhfz_dtype src_dtype, void *dst,
                                        rlhfz_dtype dst_dtype, size_t n, void *stream)
{
    if (!rlhfz_dtype_known(src_dtype) || !rlhfz_dtype_known(dst_dtype))
        return RLHFZ_ERR_UNSUPPORTED;
    if (n == 0)
        return RLHFZ_OK;
    if (!src || !dst)
        return RLHFZ_ERR_INVALID;
    cudaStream_t s = static_cast<cudaStream_t>(stream);

    if (src_dtype == dst_dtype) {
        /* a byte copy: going through fp32 would quiet signalling NaNs */
        if (src == dst)
            return RLHFZ_OK;
        RLHFZ_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * rlhfz_dtype_size(src_dtype),
                                         cudaMemcpyDefault, s));
        return RLHFZ_OK;
    }

    const bool vector = rlhfz_aligned16(src) && rlhfz_aligned16(dst);
    rlhfz_with_dtype(src_dtype, [&](auto from) {
        rlhfz_with_dtype(dst_dtype, [&](auto to) {
            const auto kernel = rlhfz_cast_kernel<decltype(from)::value, decltype(to)::value>;
            RLHFZ_LAUNCH(rlhfz_elementwise_grid(kernel, n, vector), RLHFZ_BLOCK, 0, s, kernel)(
                src, dst, n, vector);
        });
    });
    RLHFZ_CUDA_CHECK_LAUNCH();
    return RLHFZ_OK;
}
