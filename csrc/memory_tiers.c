/* memory_tiers.c: where a Buffer's bytes come from, tier by tier.
 *
 * host: anonymous mmap from 64 KiB up, so that freeing a buffer of any size
 * gives its pages back to the OS (glibc keeps blocks under its mmap threshold,
 * which grows to 32 MiB, on the heap); aligned malloc below that.
 * pinned: cudaHostAlloc when a CUDA device is usable,
 * else host memory (callers see the tier they got). device: cudaMalloc, so
 * that freeing really returns the memory to the driver. The CUDA calls go
 * through kernels/rlhfz_cuda.h and exist only in a build with nvcc; without
 * them the device tier raises and pinned falls back to host.
 */
#include "rlhfz_module.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Host buffers this large or larger are mapped on their own. */
#define HOST_MAP_LEAST ((size_t)64 << 10)

#ifdef RLHFZ_WITH_CUDA
#include "rlhfz_cuda.h"
#endif

int rlhfz_cuda_usable(const char **reason)
{
#ifdef RLHFZ_WITH_CUDA
    int count = 0;
    const char *error = NULL;
    if (rlhfz_cuda_device_count(&count, &error) != RLHFZ_OK) {
        *reason = error ? error : "the CUDA runtime failed to start";
        return 0;
    }
    if (count == 0) {
        *reason = "no CUDA device is visible";
        return 0;
    }
    *reason = NULL;
    return 1;
#else
    *reason = "rlhfz was built without CUDA (no nvcc at build time, or RLHFZ_CUDA=0)";
    return 0;
#endif
}

int rlhfz_require_cuda(const char *what)
{
    const char *reason = NULL;
    if (!rlhfz_cuda_usable(&reason)) {
        PyErr_Format(PyExc_RuntimeError, "%s: %s", what, reason);
        return -1;
    }
    return 0;
}

int rlhfz_raise_cuda(const char *what)
{
#ifdef RLHFZ_WITH_CUDA
    PyErr_Format(PyExc_RuntimeError, "%s: CUDA error: %s", what, rlhfz_cuda_error_string());
#else
    PyErr_Format(PyExc_RuntimeError, "%s: rlhfz was built without CUDA", what);
#endif
    return -1;
}

const char *rlhfz_tier_name(rlhfz_tier tier)
{
    switch (tier) {
    case RLHFZ_TIER_HOST: return "host";
    case RLHFZ_TIER_EXTERNAL: return "external";
    case RLHFZ_TIER_PINNED: return "pinned";
    case RLHFZ_TIER_DEVICE: return "device";
    case RLHFZ_TIER_DISK: return "disk";
    }
    return "unknown";
}

int rlhfz_tier_from_name(const char *name, rlhfz_tier *tier)
{
    if (strcmp(name, "host") == 0)
        *tier = RLHFZ_TIER_HOST;
    else if (strcmp(name, "pinned") == 0)
        *tier = RLHFZ_TIER_PINNED;
    else if (strcmp(name, "device") == 0)
        *tier = RLHFZ_TIER_DEVICE;
    else if (strcmp(name, "disk") == 0)
        *tier = RLHFZ_TIER_DISK;
    else {
        PyErr_Format(PyExc_ValueError, "tier must be 'host', 'pinned', 'device' or 'disk', not '%s'",
                     name);
        return -1;
    }
    return 0;
}

DLDevice rlhfz_tier_dl_device(rlhfz_tier tier, int device)
{
    DLDevice dl = {kDLCPU, 0};
    if (tier == RLHFZ_TIER_PINNED)
        dl.device_type = kDLCUDAHost;
    else if (tier == RLHFZ_TIER_DEVICE) {
        dl.device_type = kDLCUDA;
        dl.device_id = device;
    }
    return dl;
}

int rlhfz_tier_export(rlhfz_tier tier, int device, void *data, size_t nbytes, DLDevice *dl,
                      void **address)
{
    *dl = rlhfz_tier_dl_device(tier, device);
    *address = data;
#ifdef RLHFZ_WITH_CUDA
    if (tier == RLHFZ_TIER_DEVICE && rlhfz_cuda_simulated()) {
        if (rlhfz_cuda_host_alias(data, nbytes, address) != RLHFZ_OK) {
            PyErr_Format(PyExc_RuntimeError, "the simulated device memory at %p (%zu bytes) has "
                         "no host alias", data, nbytes);
            return -1;
        }
        dl->device_type = kDLCPU;
        dl->device_id = 0;
    }
#else
    (void)nbytes;
#endif
    return 0;
}

/* Large host buffers ask for transparent huge pages (where the system
 * leaves that to madvise): first touch then faults a 2 MiB page at a time,
 * which makes filling a new buffer several times faster. */
static void advise_huge_pages(void *data, size_t nbytes)
{
#ifdef MADV_HUGEPAGE
    const size_t page = 4096, least = (size_t)4 << 20;
    uintptr_t start = ((uintptr_t)data + page - 1) & ~(uintptr_t)(page - 1);
    uintptr_t end = ((uintptr_t)data + nbytes) & ~(uintptr_t)(page - 1);
    if (nbytes >= least && end > start)
        (void)madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)data;
    (void)nbytes;
#endif
}

#ifdef RLHFZ_WITH_CUDA
rlhfz_status rlhfz_device_enter(int device, int *previous)
{
    rlhfz_status status = rlhfz_cuda_get_device(previous);
    if (status == RLHFZ_OK && *previous != device)
        status = rlhfz_cuda_set_device(device);
    return status;
}

rlhfz_status rlhfz_device_leave(int device, int previous, rlhfz_status status)
{
    if (previous != device) {
        rlhfz_status restored = rlhfz_cuda_set_device(previous);
        if (status == RLHFZ_OK)
            status = restored;
    }
    return status;
}

/* Zeroes device memory on its device's legacy default stream, and waits:
 * finished before anyone can see the memory. */
static rlhfz_status zero_device_memory(void *data, size_t nbytes, int device)
{
    int previous = device;
    rlhfz_status status = rlhfz_device_enter(device, &previous);
    if (status != RLHFZ_OK)
        return status;
    status = rlhfz_cuda_memset(data, 0, nbytes, NULL);
    if (status == RLHFZ_OK)
        status = rlhfz_cuda_stream_synchronize(NULL);
    return rlhfz_device_leave(device, previous, status);
}
#endif

/* Host memory of nbytes: its own mapping (zeros already, unmapped on free)
 * when large enough and the alignment is within a page, else the heap.
 * *mapped: the bytes mapped, or 0 for the heap. */
static int host_alloc(size_t nbytes, size_t alignment, int zero, void **data, size_t *mapped)
{
    const long page = sysconf(_SC_PAGESIZE);
    *mapped = 0;
    if (nbytes >= HOST_MAP_LEAST && page > 0 && alignment <= (size_t)page) {
        void *p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return -1;
        *data = p;
        *mapped = nbytes;
        advise_huge_pages(p, nbytes);
        return 0;
    }
    if (posix_memalign(data, alignment, nbytes) != 0)
        return -1;
    advise_huge_pages(*data, nbytes);
    if (zero)
        memset(*data, 0, nbytes);
    return 0;
}

int rlhfz_tier_alloc(rlhfz_tier *tier, int *device, size_t nbytes, size_t alignment, int zero,
                     void **data, size_t *mapped)
{
    *data = NULL;
    *mapped = 0;
    /* No C object may exceed PTRDIFF_MAX bytes: refuse before an allocator
     * sees a size that reads as negative. */
    if (nbytes > PTRDIFF_MAX) {
        PyErr_Format(PyExc_MemoryError, "could not allocate %zu bytes: more than any object "
                     "can hold", nbytes);
        return -1;
    }
    const char *reason = NULL;
    if (*tier == RLHFZ_TIER_PINNED && !rlhfz_cuda_usable(&reason))
        *tier = RLHFZ_TIER_HOST;       /* pageable memory works, only slower to copy */
    if (*tier == RLHFZ_TIER_HOST) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = host_alloc(nbytes, alignment, zero, data, mapped);
        Py_END_ALLOW_THREADS
        if (rc != 0) {
            *data = NULL;
            *mapped = 0;
            PyErr_Format(PyExc_MemoryError, "could not allocate %zu bytes of host memory", nbytes);
            return -1;
        }
        *device = -1;
        return 0;
    }
#ifdef RLHFZ_WITH_CUDA
    if (*tier == RLHFZ_TIER_DEVICE && !rlhfz_cuda_usable(&reason)) {
        PyErr_Format(PyExc_RuntimeError, "the device tier needs a CUDA device: %s", reason);
        return -1;
    }
    /* cudaMalloc and cudaHostAlloc align to at least 256 bytes. */
    if (alignment > 256) {
        PyErr_Format(PyExc_ValueError, "alignment %zu is more than CUDA allocations give (256)",
                     alignment);
        return -1;
    }
    rlhfz_status status;
    if (*tier == RLHFZ_TIER_PINNED) {
        Py_BEGIN_ALLOW_THREADS
        status = rlhfz_cuda_host_alloc(data, nbytes);
        if (status == RLHFZ_OK && zero)
            memset(*data, 0, nbytes);
        Py_END_ALLOW_THREADS
        if (status != RLHFZ_OK) {
            *data = NULL;
            /* only running out is a MemoryError (callers fall back or retry on it) */
            PyErr_Format(status == RLHFZ_ERR_NOMEM ? PyExc_MemoryError : PyExc_RuntimeError,
                         "could not pin %zu bytes of host memory: %s", nbytes,
                         rlhfz_cuda_error_string());
            return -1;
        }
        *device = -1;
        return 0;
    }
    if (*device < 0 && rlhfz_cuda_get_device(device) != RLHFZ_OK)
        return rlhfz_raise_cuda("Buffer");
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_cuda_malloc(data, nbytes, *device);
    if (status == RLHFZ_OK && zero) {
        status = zero_device_memory(*data, nbytes, *device);
        if (status != RLHFZ_OK) {
            rlhfz_cuda_free(*data, *device);
            *data = NULL;
        }
    }
    Py_END_ALLOW_THREADS
    if (status != RLHFZ_OK) {
        *data = NULL;
        /* only running out is a MemoryError: reload() frees torch's cache and
         * tries again on it, which a lost device would fail forever */
        PyErr_Format(status == RLHFZ_ERR_NOMEM ? PyExc_MemoryError : PyExc_RuntimeError,
                     "could not allocate %zu bytes on CUDA device %d: %s",
                     nbytes, *device, rlhfz_cuda_error_string());
        return -1;
    }
    return 0;
#else
    (void)reason;
    PyErr_SetString(PyExc_RuntimeError, "the device tier needs CUDA, and rlhfz was built "
                    "without it (no nvcc at build time, or RLHFZ_CUDA=0)");
    return -1;
#endif
}

void rlhfz_tier_free(rlhfz_tier tier, int device, void *data, size_t mapped)
{
    if (data == NULL)
        return;
    switch (tier) {
    case RLHFZ_TIER_HOST:
        if (mapped > 0)
            (void)munmap(data, mapped);
        else
            free(data);
        return;
#ifdef RLHFZ_WITH_CUDA
    /* Both synchronize the device, which may wait on work that needs another
     * thread to run Python (the NCCL watchdog that aborts a stuck collective). */
    case RLHFZ_TIER_PINNED:
        Py_BEGIN_ALLOW_THREADS
        rlhfz_cuda_host_free(data);
        Py_END_ALLOW_THREADS
        return;
    case RLHFZ_TIER_DEVICE:
        Py_BEGIN_ALLOW_THREADS
        rlhfz_cuda_free(data, device);
        Py_END_ALLOW_THREADS
        return;
#endif
    default:
        return;     /* external memory belongs to its producer */
    }
}

int rlhfz_tier_zero(rlhfz_tier tier, int device, void *data, size_t nbytes)
{
    if (tier != RLHFZ_TIER_DEVICE) {
        Py_BEGIN_ALLOW_THREADS
        memset(data, 0, nbytes);
        Py_END_ALLOW_THREADS
        return 0;
    }
#ifdef RLHFZ_WITH_CUDA
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = zero_device_memory(data, nbytes, device);
    Py_END_ALLOW_THREADS
    if (status != RLHFZ_OK)
        return rlhfz_raise_cuda("zero_");
    return 0;
#else
    (void)device;
    return rlhfz_raise_cuda("zero_");
#endif
}

int rlhfz_tier_copy(void *dst, const void *src, size_t nbytes, int device)
{
    return rlhfz_tier_copy_on(dst, src, nbytes, device, NULL, 1);
}

int rlhfz_tier_copy_on(void *dst, const void *src, size_t nbytes, int device, void *stream,
                       int blocking)
{
    if (device < 0) {
        rlhfz_status status;
        Py_BEGIN_ALLOW_THREADS
        status = rlhfz_copy_cpu(dst, src, nbytes);
        Py_END_ALLOW_THREADS
        if (status != RLHFZ_OK) {
            PyErr_Format(PyExc_RuntimeError, "copy: the CPU copy failed (status %d)", (int)status);
            return -1;
        }
        return 0;
    }
#ifdef RLHFZ_WITH_CUDA
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    int previous = device;
    status = rlhfz_device_enter(device, &previous);
    if (status == RLHFZ_OK) {
        status = rlhfz_cuda_memcpy(dst, src, nbytes, stream, blocking);
        status = rlhfz_device_leave(device, previous, status);
    }
    Py_END_ALLOW_THREADS
    if (status != RLHFZ_OK)
        return rlhfz_raise_cuda("copy");
    return 0;
#else
    (void)stream;
    (void)blocking;
    return rlhfz_raise_cuda("copy");
#endif
}
