/* cuda_error.cu: the thread-local record of the last failing CUDA call.
 *
 * The runtime's error strings are static, so keeping the pointer is enough;
 * it stays what this thread last failed with until its next failure.
 */
#include <cuda_runtime.h>

#include "cuda_check.cuh"
#include "rlhfz_cuda.h"

/* ---- host side ------------------------------------------------------------ */

static thread_local const char *last_error = "";

extern "C" rlhfz_status rlhfz_cuda_fail(cudaError_t err)
{
    last_error = cudaGetErrorString(err);
    /* clear a non-sticky error, so the next launch check starts clean */
    (void)cudaGetLastError();
    return RLHFZ_ERR_CUDA;
}

extern "C" rlhfz_status rlhfz_cuda_fail_alloc(cudaError_t err)
{
    rlhfz_cuda_fail(err);
    return err == cudaErrorMemoryAllocation ? RLHFZ_ERR_NOMEM : RLHFZ_ERR_CUDA;
}

extern "C" const char *rlhfz_cuda_error_string(void)
{
    return last_error;
}
