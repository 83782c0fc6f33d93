/* cuda_runtime_probe.cu: what the CUDA runtime sees.
 *
 * Linked with the static cudart, so these must fail politely (a status and
 * the runtime's error string) on a machine with no driver or no GPU.
 */
#include <cuda_runtime.h>

#include "cuda_check.cuh"
#include "rlhfz_cuda.h"
#include "rlhfz_kernels.h"

/* ---- host side ------------------------------------------------------------ */

extern "C" rlhfz_status rlhfz_cuda_device_count(int *count, const char **error)
{
    if (!count)
        return RLHFZ_ERR_INVALID;
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        *count = 0;
        if (error)
            *error = cudaGetErrorString(err);
        /* also this thread's error string; clears the last error, so a later
         * launch check does not see this one */
        return rlhfz_cuda_fail(err);
    }
    *count = n;
    if (error)
        *error = NULL;
    return RLHFZ_OK;
}

extern "C" int rlhfz_cuda_runtime_version(void)
{
    int version = 0;
    if (cudaRuntimeGetVersion(&version) != cudaSuccess)
        return 0;
    return version;
}
