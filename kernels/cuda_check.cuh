/* cuda_check.cuh: error handling shared by rlhfz's CUDA sources (internal).
 *
 * A failing runtime call is recorded as this thread's error string (what
 * rlhfz_cuda_error_string returns), the runtime's last error is cleared so
 * that a later launch check does not report it again, and the caller
 * returns RLHFZ_ERR_CUDA.
 */
#ifndef RLHFZ_CUDA_CHECK_CUH
#define RLHFZ_CUDA_CHECK_CUH

#include <cuda_runtime.h>

#include "rlhfz_kernels.h"

/* cuda_error.cu: records err for this thread, clears the runtime's last
 * error, and returns RLHFZ_ERR_CUDA. */
extern "C" rlhfz_status rlhfz_cuda_fail(cudaError_t err);

/* The same for an allocation, whose caller tells running out of memory
 * (RLHFZ_ERR_NOMEM: try again after freeing some) from a runtime that
 * failed (RLHFZ_ERR_CUDA: a lost device fails every call). */
extern "C" rlhfz_status rlhfz_cuda_fail_alloc(cudaError_t err);

/* Returns RLHFZ_ERR_CUDA from the enclosing function if call fails. */
#define RLHFZ_CUDA_CHECK(call)                                                  \
    do {                                                                        \
        cudaError_t rlhfz_check_err_ = (call);                                  \
        if (rlhfz_check_err_ != cudaSuccess)                                    \
            return rlhfz_cuda_fail(rlhfz_check_err_);                           \
    } while (0)

/* A kernel launch, written RLHFZ_LAUNCH(grid, block, shared_bytes, stream,
 * kernel)(arguments...): kernel<<<grid, block, shared_bytes, stream>>> under
 * nvcc, and the simulated runtime's launcher (sim/include/cudasim_device.h)
 * when the .cu files are compiled for the host with RLHFZ_CUDA=sim. */
#ifdef CUDASIM
#define RLHFZ_LAUNCH(grid, block, shared_bytes, stream, ...) \
    CUDASIM_LAUNCH(grid, block, shared_bytes, stream, __VA_ARGS__)
#else
#define RLHFZ_LAUNCH(grid, block, shared_bytes, stream, ...) \
    __VA_ARGS__<<<grid, block, shared_bytes, stream>>>
#endif

/* A __shared__ array, declared RLHFZ_SHARED_ARRAY(type, name, count). A GPU
 * promises nothing of what a block has not written there, so on the
 * simulated runtime it reads as NaN (all bits set) when each block starts. */
#ifdef CUDASIM
#define RLHFZ_SHARED_ARRAY(type, name, count) \
    __shared__ type name[count];               \
    cudasim_shared_fresh(name, sizeof(name))
#else
#define RLHFZ_SHARED_ARRAY(type, name, count) __shared__ type name[count]
#endif

/* After a launch: did it start? (Its completion is not waited for.) */
#define RLHFZ_CUDA_CHECK_LAUNCH() RLHFZ_CUDA_CHECK(cudaGetLastError())

#endif /* RLHFZ_CUDA_CHECK_CUH */
