/* cuda_simulated.cu: what rlhfz needs to know about the simulated runtime.
 *
 * Built with nvcc, every function says "not simulated". Built for the host
 * against the simulated runtime (RLHFZ_CUDA=sim, sim/), torch's CPU build
 * stands in for the GPU side of a program: device memory reaches torch as
 * the host alias the simulator keeps of it, and an alias coming back from
 * torch is turned into the device pointer it stands for. The tests also
 * count runtime calls and inject failures through here.
 */
#include <cuda_runtime.h>

#include "cuda_check.cuh"
#include "rlhfz_cuda.h"
#include "rlhfz_kernels.h"

#ifdef CUDASIM
#include "cudasim.h"
#endif

/* ---- host side ------------------------------------------------------------ */

extern "C" int rlhfz_cuda_simulated(void)
{
#ifdef CUDASIM
    return 1;
#else
    return 0;
#endif
}

extern "C" rlhfz_status rlhfz_cuda_host_alias(const void *device_ptr, size_t nbytes, void **host)
{
    if (!host)
        return RLHFZ_ERR_INVALID;
    *host = NULL;
#ifdef CUDASIM
    int device = -1;
    if (cudasim_host_alias(device_ptr, nbytes, host, &device) != cudaSuccess)
        return RLHFZ_ERR_INVALID;
    return RLHFZ_OK;
#else
    (void)device_ptr;
    (void)nbytes;
    return RLHFZ_ERR_UNSUPPORTED;
#endif
}

extern "C" rlhfz_status rlhfz_cuda_alias_device(const void *host, size_t nbytes, void **device_ptr,
                                                int *device)
{
    if (!device_ptr || !device)
        return RLHFZ_ERR_INVALID;
    *device_ptr = NULL;
    *device = -1;
#ifdef CUDASIM
    if (cudasim_device_pointer(host, nbytes, device_ptr, device) != cudaSuccess)
        return RLHFZ_ERR_INVALID;
    return RLHFZ_OK;
#else
    (void)host;
    (void)nbytes;
    return RLHFZ_ERR_UNSUPPORTED;
#endif
}

extern "C" const char *rlhfz_cuda_sim_describe(void)
{
#ifdef CUDASIM
    return cudasim_describe();
#else
    return NULL;
#endif
}

extern "C" rlhfz_status rlhfz_cuda_sim_calls(const char *name, unsigned long long *calls)
{
    if (!name || !calls)
        return RLHFZ_ERR_INVALID;
#ifdef CUDASIM
    *calls = cudasim_calls(name);
    return RLHFZ_OK;
#else
    *calls = 0;
    return RLHFZ_ERR_UNSUPPORTED;
#endif
}

extern "C" rlhfz_status rlhfz_cuda_sim_inject(const char *spec)
{
#ifdef CUDASIM
    return cudasim_inject(spec) == cudaSuccess ? RLHFZ_OK : RLHFZ_ERR_INVALID;
#else
    (void)spec;
    return RLHFZ_ERR_UNSUPPORTED;
#endif
}

extern "C" rlhfz_status rlhfz_cuda_sim_hold(void *stream, unsigned long long *token)
{
    if (!token)
        return RLHFZ_ERR_INVALID;
#ifdef CUDASIM
    return cudasim_stream_hold(static_cast<cudaStream_t>(stream), token) == cudaSuccess
               ? RLHFZ_OK : RLHFZ_ERR_INVALID;
#else
    (void)stream;
    return RLHFZ_ERR_UNSUPPORTED;
#endif
}

extern "C" rlhfz_status rlhfz_cuda_sim_release(unsigned long long token)
{
#ifdef CUDASIM
    return cudasim_stream_release(token) == cudaSuccess ? RLHFZ_OK : RLHFZ_ERR_INVALID;
#else
    (void)token;
    return RLHFZ_ERR_UNSUPPORTED;
#endif
}
