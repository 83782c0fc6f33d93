/* cudasim_device.h: CUDA device code compiled for the host (C++17).
 *
 * A kernel is a plain function run once per simulated thread. The threads of
 * a block run as fibers on one OS thread (sim/runtime/block_runner.cpp), so
 * a per-OS-thread variable is per block: that is __shared__, and the
 * built-in indices are per-OS-thread values the runner sets before it
 * resumes each fiber. __syncthreads() switches to the next fiber; the
 * runner checks that every thread of the block reaches the same barrier.
 *
 * RLHFZ_LAUNCH (kernels/cuda_check.cuh) turns a launch site into
 * cudasim::launch(kernel, ...)(args...), which turns device-pointer
 * arguments into their host aliases and queues the kernel on the stream.
 */
#ifndef CUDASIM_DEVICE_H
#define CUDASIM_DEVICE_H

#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_runtime.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static thread_local

/* The built-in variables: per OS thread, set by the block runner. */
extern "C" __thread uint3 cudasim_thread_idx;
extern "C" __thread uint3 cudasim_block_idx;
extern "C" __thread dim3 cudasim_block_dim;
extern "C" __thread dim3 cudasim_grid_dim;
#define threadIdx cudasim_thread_idx
#define blockIdx cudasim_block_idx
#define blockDim cudasim_block_dim
#define gridDim cudasim_grid_dim

#define __syncthreads() cudasim_syncthreads()

/* ---- arithmetic intrinsics: IEEE operations, each rounded once --------------- */
/* (the build turns off contraction: -ffp-contract=off) */

__device__ __forceinline__ float __fadd_rn(float a, float b) { return a + b; }
__device__ __forceinline__ float __fsub_rn(float a, float b) { return a - b; }
__device__ __forceinline__ float __fmul_rn(float a, float b) { return a * b; }
__device__ __forceinline__ float __fdiv_rn(float a, float b) { return a / b; }
__device__ __forceinline__ float __fsqrt_rn(float a) { return std::sqrt(a); }
using std::fma;

__device__ __forceinline__ float __uint_as_float(unsigned int bits)
{
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
}

__device__ __forceinline__ unsigned int __float_as_uint(float x)
{
    unsigned int bits;
    std::memcpy(&bits, &x, sizeof bits);
    return bits;
}

/* ---- launches ----------------------------------------------------------------- */

/* The runtime's C++ overload: any kernel, by its function. */
template <class... P>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, void (*kernel)(P...),
                                                                 int block_size,
                                                                 size_t shared_bytes)
{
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        blocks, reinterpret_cast<const void *>(kernel), block_size, shared_bytes);
}

namespace cudasim {

/* One launch: the kernel and its arguments, as the kernel takes them. */
template <class... P>
struct kernel_call {
    void (*kernel)(P...);
    std::tuple<std::decay_t<P>...> args;

    static void run(void *self)
    {
        kernel_call *call = static_cast<kernel_call *>(self);
        std::apply(call->kernel, call->args);
    }

    static void destroy(void *self) { delete static_cast<kernel_call *>(self); }
};

template <class T>
cudaError_t translate_argument(T &value, const char *name)
{
    if constexpr (std::is_pointer_v<T>) {
        void *usable = nullptr;
        cudaError_t err = cudasim_kernel_pointer((const void *)value, &usable, name);
        if (err == cudaSuccess)
            value = (T)usable;
        return err;
    } else {
        (void)value;
        (void)name;
        return cudaSuccess;
    }
}

template <class... P>
struct launcher {
    void (*kernel)(P...);
    const char *name;
    dim3 grid, block;
    size_t shared_bytes;
    cudaStream_t stream;

    template <class... A>
    void operator()(A &&...arguments) const
    {
        static_assert(sizeof...(A) == sizeof...(P), "a kernel launch with the wrong argument count");
        auto *call = new kernel_call<P...>{kernel, std::tuple<std::decay_t<P>...>(
                                                       static_cast<P>(arguments)...)};
        cudaError_t err = cudaSuccess;
        std::apply([&](auto &...value) {
            ((err = err != cudaSuccess ? err : translate_argument(value, name)), ...);
        }, call->args);
        if (err != cudaSuccess) {
            delete call;
            cudasim_set_last_error(err);
            return;
        }
        (void)cudasim_launch(grid, block, shared_bytes, stream, &kernel_call<P...>::run,
                             &kernel_call<P...>::destroy, call, name);
    }
};

template <class... P>
launcher<P...> launch(void (*kernel)(P...), const char *name, dim3 grid, dim3 block,
                      size_t shared_bytes, cudaStream_t stream)
{
    return launcher<P...>{kernel, name, grid, block, shared_bytes, stream};
}

} /* namespace cudasim */

#define CUDASIM_LAUNCH(grid, block, shared_bytes, stream, ...) \
    cudasim::launch(__VA_ARGS__, #__VA_ARGS__, (grid), (block), (shared_bytes), (stream))

#endif /* CUDASIM_DEVICE_H */
