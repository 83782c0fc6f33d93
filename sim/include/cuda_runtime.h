/* cuda_runtime.h: the simulated CUDA runtime's API, for builds with
 * RLHFZ_CUDA=sim.
 *
 * The slice of the CUDA runtime that rlhfz calls, with the runtime's own
 * names, types, enum values and semantics, so that the .cu files compile
 * unchanged with a host C++ compiler and links against libcudasim.so
 * (sim/runtime/). Device memory is real memory the host cannot touch: the
 * pointers handed out are PROT_NONE views (sim/runtime/device_memory.cpp).
 * Under C++ it also pulls in the device-code emulation (cudasim_device.h):
 * threadIdx, __shared__, __syncthreads and the kernel launcher.
 */
#ifndef CUDASIM_CUDA_RUNTIME_H
#define CUDASIM_CUDA_RUNTIME_H

#include <stddef.h>

#define CUDASIM 1
/* What cudaRuntimeGetVersion reports: the API level simulated (13.0). */
#define CUDART_VERSION 13000

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors: the runtime's values ---------------------------------------- */

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchOutOfResources = 701,
    cudaErrorHostMemoryAlreadyRegistered = 712,
    cudaErrorHostMemoryNotRegistered = 713,
    cudaErrorMisalignedAddress = 716,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotSupported = 801,
    cudaErrorUnknown = 999
} cudaError_t;

/* ---- handles, flags and enums ------------------------------------------- */

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef void (*cudaHostFn_t)(void *user_data);

#define cudaStreamLegacy ((cudaStream_t)0x1)
#define cudaStreamPerThread ((cudaStream_t)0x2)

#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventBlockingSync 0x01
#define cudaEventDisableTiming 0x02
#define cudaHostAllocDefault 0x00
#define cudaHostAllocPortable 0x01
#define cudaHostAllocMapped 0x02
#define cudaHostAllocWriteCombined 0x04
#define cudaHostRegisterDefault 0x00
#define cudaHostRegisterPortable 0x01
#define cudaHostRegisterMapped 0x02

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};

enum cudaMemoryType {
    cudaMemoryTypeUnregistered = 0,
    cudaMemoryTypeHost = 1,
    cudaMemoryTypeDevice = 2,
    cudaMemoryTypeManaged = 3
};

struct cudaPointerAttributes {
    enum cudaMemoryType type;
    int device;
    void *devicePointer;
    void *hostPointer;
};

enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrMaxThreadsPerMultiProcessor = 39
};

/* ---- vector types ----------------------------------------------------------- */

typedef struct uint3 { unsigned int x, y, z; } uint3;
typedef struct __attribute__((aligned(16))) float4 { float x, y, z, w; } float4;
typedef struct __attribute__((aligned(16))) uint4 { unsigned int x, y, z, w; } uint4;

#ifdef __cplusplus
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
        : x(vx), y(vy), z(vz) {}
};
#else
typedef struct dim3 { unsigned int x, y, z; } dim3;
#endif

static inline float4 make_float4(float x, float y, float z, float w)
{
    float4 v = {x, y, z, w};
    return v;
}

static inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w)
{
    uint4 v = {x, y, z, w};
    return v;
}

/* ---- the runtime API (sim/runtime/) --------------------------------------------- */

const char *cudaGetErrorString(cudaError_t error);
const char *cudaGetErrorName(cudaError_t error);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
cudaError_t cudaRuntimeGetVersion(int *version);
cudaError_t cudaDriverGetVersion(int *version);

cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
/* How many blocks of block_size threads of a kernel fit on one multiprocessor
 * (here: by threads alone, as no registers are counted). */
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks, const void *kernel,
                                                          int block_size, size_t shared_bytes);

cudaError_t cudaMalloc(void **ptr, size_t size);
cudaError_t cudaFree(void *ptr);
cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned int flags);
cudaError_t cudaMallocHost(void **ptr, size_t size);
cudaError_t cudaFreeHost(void *ptr);
cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags);
cudaError_t cudaHostUnregister(void *ptr);
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes *attributes, const void *ptr);

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind);
cudaError_t cudaMemsetAsync(void *ptr, int value, size_t count, cudaStream_t stream);
cudaError_t cudaMemset(void *ptr, int value, size_t count);

cudaError_t cudaStreamCreate(cudaStream_t *stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *user_data);

cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);

/* ---- the launch ABI of cudasim_device.h (the simulator's cudaLaunchKernel) --------------- */

/* Queues a kernel on stream: run(closure) is one thread's body, called for
 * every thread of every block; destroy(closure) frees it after the last.
 * Validates the configuration; a failure is also the thread's last error. */
cudaError_t cudasim_launch(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                           void (*run)(void *), void (*destroy)(void *), void *closure,
                           const char *name);

/* A kernel argument: a device pointer of the current device becomes its host
 * alias, a page-locked host pointer stays (mapped memory), NULL stays; any
 * other pointer is the fault a GPU's kernel would hit when it used it:
 * cudaErrorIllegalAddress, sticky on the current device. */
cudaError_t cudasim_kernel_pointer(const void *ptr, void **usable, const char *name);

/* Records a launch that failed before it reached the runtime as this
 * thread's last error. */
void cudasim_set_last_error(cudaError_t error);

void cudasim_syncthreads(void);

/* A __shared__ array met by a thread of the running block (every thread
 * passes its declaration): the first of the block fills it with all bits
 * set, so what the block did not write reads as NaN. RLHFZ_SHARED_ARRAY
 * (kernels/cuda_check.cuh) declares through it. */
void cudasim_shared_fresh(void *address, size_t bytes);

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
#include "cudasim_device.h"
#endif

#endif /* CUDASIM_CUDA_RUNTIME_H */
