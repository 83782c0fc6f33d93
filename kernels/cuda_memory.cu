/* cuda_memory.cu: devices, memory, streams and events behind rlhfz's C ABI.
 *
 * Thin wrappers over the runtime. A call that names a device makes it
 * current only for its own duration and puts the caller's current device
 * back. On failure each records the runtime's error string for this thread
 * and returns RLHFZ_ERR_CUDA (cuda_check.cuh).
 */
#include <cuda_runtime.h>

#include "cuda_check.cuh"
#include "rlhfz_cuda.h"
#include "rlhfz_kernels.h"

/* ---- host side ------------------------------------------------------------ */

/* Makes `device` current, noting in *previous the one that was. */
static cudaError_t enter_device(int device, int *previous)
{
    cudaError_t err = cudaGetDevice(previous);
    if (err == cudaSuccess && *previous != device)
        err = cudaSetDevice(device);
    return err;
}

/* Puts back the device enter_device replaced; the first of err and a
 * failed restore is what the caller reports. */
static cudaError_t leave_device(int device, int previous, cudaError_t err)
{
    if (previous != device) {
        cudaError_t restored = cudaSetDevice(previous);
        if (err == cudaSuccess)
            err = restored;
    }
    return err;
}

extern "C" rlhfz_status rlhfz_cuda_get_device(int *device)
{
    if (!device)
        return RLHFZ_ERR_INVALID;
    RLHFZ_CUDA_CHECK(cudaGetDevice(device));
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cuda_set_device(int device)
{
    RLHFZ_CUDA_CHECK(cudaSetDevice(device));
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cuda_device_synchronize(int device)
{
    int previous = device;
    RLHFZ_CUDA_CHECK(enter_device(device, &previous));
    cudaError_t err = cudaDeviceSynchronize();
    RLHFZ_CUDA_CHECK(leave_device(device, previous, err));
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cuda_mem_get_info(int device, size_t *free_bytes,
                                                size_t *total_bytes)
{
    if (!free_bytes || !total_bytes)
        return RLHFZ_ERR_INVALID;
    int previous = device;
    RLHFZ_CUDA_CHECK(enter_device(device, &previous));
    cudaError_t err = cudaMemGetInfo(free_bytes, total_bytes);
    RLHFZ_CUDA_CHECK(leave_device(device, previous, err));
    return RLHFZ_OK;
}

/* ---- memory ---- */

extern "C" rlhfz_status rlhfz_cuda_malloc(void **ptr, size_t nbytes, int device)
{
    if (!ptr)
        return RLHFZ_ERR_INVALID;
    *ptr = NULL;
    if (nbytes == 0)
        return RLHFZ_OK;
    int previous = device;
    RLHFZ_CUDA_CHECK(enter_device(device, &previous));
    void *memory = NULL;
    cudaError_t err = cudaMalloc(&memory, nbytes);
    err = leave_device(device, previous, err);
    if (err != cudaSuccess) {
        /* allocated, but the caller's device could not be put back: the
         * call fails, so the memory must not leak */
        if (memory)
            (void)cudaFree(memory);
        return rlhfz_cuda_fail_alloc(err);
    }
    *ptr = memory;
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cuda_free(void *ptr, int device)
{
    if (!ptr)
        return RLHFZ_OK; /* as free(NULL) */
    int previous = device;
    RLHFZ_CUDA_CHECK(enter_device(device, &previous));
    cudaError_t err = cudaFree(ptr);
    RLHFZ_CUDA_CHECK(leave_device(device, previous, err));
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cuda_host_alloc(void **ptr, size_t nbytes)
{
    if (!ptr)
        return RLHFZ_ERR_INVALID;
    *ptr = NULL;
    if (nbytes == 0)
        return RLHFZ_OK;
    void *memory = NULL;
    /* portable: pinned for every context; mapped: kernels may read it too */
    cudaError_t err = cudaHostAlloc(&memory, nbytes, cudaHostAllocPortable | cudaHostAllocMapped);
    if (err != cudaSuccess)
        return rlhfz_cuda_fail_alloc(err);
    *ptr = memory;
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cuda_host_free(void *ptr)
{
    if (!ptr)
        return RLHFZ_OK;
    RLHFZ_CUDA_CHECK(cudaFreeHost(ptr));
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cuda_memcpy(void *dst, const void *src, size_t nbytes, void *stream,
                                          int blocking)
{
    if (nbytes == 0)
        return RLHFZ_OK;
    if (!dst || !src)
        return RLHFZ_ERR_INVALID;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    RLHFZ_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, s));
    if (blocking)
        RLHFZ_CUDA_CHECK(cudaStreamSynchronize(s));
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cuda_memset(void *ptr, int value, size_t nbytes, void *stream)
{
    if (nbytes == 0)
        return RLHFZ_OK;
    if (!ptr)
        return RLHFZ_ERR_INVALID;
    RLHFZ_CUDA_CHECK(cudaMemsetAsync(ptr, value, nbytes, static_cast<cudaStream_t>(stream)));
    return RLHFZ_OK;
}

/* ---- streams ---- */

extern "C" rlhfz_status rlhfz_cuda_stream_create(void **stream, int device)
{
    if (!stream)
        return RLHFZ_ERR_INVALID;
    *stream = NULL;
    int previous = device;
    RLHFZ_CUDA_CHECK(enter_device(device, &previous));
    cudaStream_t created = NULL;
    /* non-blocking: no implicit waits on the legacy default stream */
    cudaError_t err = cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking);
    err = leave_device(device, previous, err);
    if (err != cudaSuccess) {
        if (created)
            (void)cudaStreamDestroy(created);
        return rlhfz_cuda_fail(err);
    }
    *stream = created;
    return RLHFZ_OK;
}

/* The legacy default stream (NULL) cannot be destroyed. */
extern "C" rlhfz_status rlhfz_cuda_stream_destroy(void *stream)
{
    if (!stream)
        return RLHFZ_ERR_INVALID;
    RLHFZ_CUDA_CHECK(cudaStreamDestroy(static_cast<cudaStream_t>(stream)));
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cuda_stream_synchronize(void *stream)
{
    RLHFZ_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
    return RLHFZ_OK;
}

/* ---- events ---- */

extern "C" rlhfz_status rlhfz_cuda_event_create(void **event)
{
    if (!event)
        return RLHFZ_ERR_INVALID;
    *event = NULL;
    cudaEvent_t created = NULL;
    /* no timing: lighter to record, and what stream ordering needs */
    RLHFZ_CUDA_CHECK(cudaEventCreateWithFlags(&created, cudaEventDisableTiming));
    *event = created;
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cuda_event_destroy(void *event)
{
    if (!event)
        return RLHFZ_ERR_INVALID;
    RLHFZ_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cuda_event_record(void *event, void *stream)
{
    if (!event)
        return RLHFZ_ERR_INVALID;
    RLHFZ_CUDA_CHECK(
        cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cuda_stream_wait_event(void *stream, void *event)
{
    if (!event)
        return RLHFZ_ERR_INVALID;
    RLHFZ_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                         static_cast<cudaEvent_t>(event), 0));
    return RLHFZ_OK;
}

extern "C" rlhfz_status rlhfz_cuda_event_synchronize(void *event)
{
    if (!event)
        return RLHFZ_ERR_INVALID;
    RLHFZ_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
    return RLHFZ_OK;
}

/* *done: whether the recorded work is done (an event never recorded is). */
extern "C" rlhfz_status rlhfz_cuda_event_query(void *event, int *done)
{
    if (!event || !done)
        return RLHFZ_ERR_INVALID;
    cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (err == cudaErrorNotReady) {
        (void)cudaGetLastError();   /* not an error: the work is still running */
        *done = 0;
        return RLHFZ_OK;
    }
    RLHFZ_CUDA_CHECK(err);
    *done = 1;
    return RLHFZ_OK;
}
