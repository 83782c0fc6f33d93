/* cuda_runtime_probe.cu: what the CUDA runtime sees, plus one trivial kernel.
 *
 * Linked with the static cudart, so these must fail politely (a status and
 * the runtime's error string) on a machine with no driver or no GPU. The
 * fill kernel keeps real device code in the nvcc build path.
 */
#include <cuda_runtime.h>

#include "cuda_check.cuh"
#include "rlhfz_cuda.h"
#include "rlhfz_kernels.h"

/* ---- kernels -------------------------------------------------------------- */

__global__ void rlhfz_fill_kernel(float *x, size_t n, float value)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        x[i] = value;
}

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

extern "C" rlhfz_status rlhfz_fill_cuda(float *x, size_t n, float value, void *stream)
{
    if (n == 0)
        return RLHFZ_OK;
    if (!x)
        return RLHFZ_ERR_INVALID;
    const int block = 256;
    size_t blocks = (n + block - 1) / block;
    int grid = blocks < 65535 ? (int)blocks : 65535; /* grid-stride loop covers the rest */
    rlhfz_fill_kernel<<<grid, block, 0, (cudaStream_t)stream>>>(x, n, value);
    RLHFZ_CUDA_CHECK_LAUNCH();
    return RLHFZ_OK;
}
