/* rlhfz_module.h: what the files of the rlhfz._C extension share.
 *
 * The module keeps its types in module state (no C globals). Buffer owns an
 * aligned allocation in a memory tier; BufferView names a typed, shaped range
 * of it and exports that range through DLPack without copying.
 */
#ifndef RLHFZ_MODULE_H
#define RLHFZ_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include "dlpack.h"
#include "rlhfz_kernels.h"

#define RLHFZ_MAX_NDIM 8
#define RLHFZ_DEFAULT_ALIGNMENT 64

typedef struct rlhfz_inflight rlhfz_inflight;

typedef struct {
    PyTypeObject *Buffer_type;
    PyTypeObject *BufferView_type;
    rlhfz_inflight *inflight;    /* cuda_inflight.c: borrows kernels still read */
} rlhfz_state;

typedef enum {
    RLHFZ_TIER_HOST = 0,
    RLHFZ_TIER_EXTERNAL = 1,  /* memory imported through DLPack, owned by its producer */
    RLHFZ_TIER_PINNED = 2,    /* page-locked host memory (cudaHostAlloc) */
    RLHFZ_TIER_DEVICE = 3,    /* CUDA device memory (cudaMalloc) */
    RLHFZ_TIER_DISK = 4       /* a file in a caller's directory, mapped shared */
} rlhfz_tier;

typedef struct {
    PyObject_HEAD
    void *data;
    size_t nbytes;
    size_t alignment;
    rlhfz_tier tier;
    int device;                  /* CUDA ordinal of device memory, else -1 */
    /* DLPack exports not yet released by their consumers; atomic, since a
     * consumer may release from any thread, with or without the GIL */
    _Atomic Py_ssize_t exports;
    /* tier external: the imported managed tensor, released on dealloc */
    void *external;
    int external_versioned;
    /* tier disk: the open file, the name it had (removed once mapped), the bytes mapped;
     * tier host: the bytes mapped on their own (0: the heap) */
    int fd;
    char *path;
    size_t mapped;
    PyObject *weakreflist;
} rlhfz_Buffer;

typedef struct {
    PyObject_HEAD
    rlhfz_Buffer *buffer;        /* strong reference: a view keeps its buffer alive */
    rlhfz_dtype dtype;
    size_t offset;               /* in elements of dtype */
    int ndim;
    int64_t shape[RLHFZ_MAX_NDIM];
    size_t numel;
} rlhfz_BufferView;

/* A flat, contiguous array borrowed from a Python object for one call. */
typedef struct {
    void *data;
    rlhfz_dtype dtype;
    size_t numel;
    int ndim;
    int64_t shape[RLHFZ_MAX_NDIM];
    DLDevice device;
    int readonly;
    PyObject *keepalive;         /* owns `data` for as long as the borrow lasts */
} rlhfz_array;

/* module_state.c */
rlhfz_state *rlhfz_get_state(PyObject *module);
rlhfz_state *rlhfz_state_from_type(PyTypeObject *type);

/* buffer.c */
int rlhfz_buffer_add_types(PyObject *module, rlhfz_state *state);
rlhfz_Buffer *rlhfz_buffer_alloc(rlhfz_state *state, size_t nbytes, size_t alignment, int zero);
rlhfz_Buffer *rlhfz_buffer_alloc_in(rlhfz_state *state, rlhfz_tier tier, int device,
                                    size_t nbytes, size_t alignment, int zero);
rlhfz_Buffer *rlhfz_buffer_alloc_disk(rlhfz_state *state, const char *dir, size_t nbytes);
/* Finishes releases that DLPack consumers made without the GIL (needs it). */
void rlhfz_finish_deferred_releases(void);

/* disk_tier.c: a file of nbytes in dir, mapped shared (zeros until written).
 * Each returns 0, or -1 with an OSError naming the file and the cause. */
int rlhfz_disk_alloc(const char *dir, size_t nbytes, void **data, int *fd, char **path);
void rlhfz_disk_free(void *data, size_t nbytes, int fd, char *path);
/* 0 if the file still holds nbytes (OSError and -1 if not: reading the
 * mapping past a shortened file's end would kill the process) */
int rlhfz_disk_check(int fd, size_t nbytes, const char *path);
/* the same for any buffer (disk_tier.c): 0 unless a disk buffer's file was shortened */
int rlhfz_buffer_intact(const rlhfz_Buffer *buffer);
int rlhfz_disk_release_pages(void *data, size_t nbytes);

/* memory_tiers.c: allocation, release, zeroing and copies per tier. Each
 * returns 0, or -1 with an exception set. rlhfz_tier_alloc may change a
 * pinned request to host when no CUDA device is usable. */
int rlhfz_cuda_usable(const char **reason);
int rlhfz_raise_cuda(const char *what);
const char *rlhfz_tier_name(rlhfz_tier tier);
int rlhfz_tier_from_name(const char *name, rlhfz_tier *tier);
DLDevice rlhfz_tier_dl_device(rlhfz_tier tier, int device);
/* How a DLPack export presents a buffer: its device and the address of its
 * first byte. The same as the tier's, except on the simulated CUDA runtime,
 * where device memory goes out as the host alias (kDLCPU) that torch's CPU
 * build can use. -1 with an exception set if there is none. */
int rlhfz_tier_export(rlhfz_tier tier, int device, void *data, size_t nbytes, DLDevice *dl,
                      void **address);
/* *mapped: the bytes a host buffer maps on its own (munmap'd on free), else 0;
 * rlhfz_tier_free takes it back. */
int rlhfz_tier_alloc(rlhfz_tier *tier, int *device, size_t nbytes, size_t alignment, int zero,
                     void **data, size_t *mapped);
void rlhfz_tier_free(rlhfz_tier tier, int device, void *data, size_t mapped);
/* device: the CUDA ordinal of device memory (the work runs with it current). */
int rlhfz_tier_zero(rlhfz_tier tier, int device, void *data, size_t nbytes);
/* device: -1 for a copy between host memories, else the CUDA device the
 * copy runs on (the one its device memory belongs to). */
int rlhfz_tier_copy(void *dst, const void *src, size_t nbytes, int device);
/* The same, queued on stream when CUDA copies; blocking: wait for it. */
int rlhfz_tier_copy_on(void *dst, const void *src, size_t nbytes, int device, void *stream,
                       int blocking);

#ifdef RLHFZ_WITH_CUDA
/* Makes `device` current for work that needs it (the runtime refuses, and a
 * GPU faults on, work on another device's memory), noting the previous one;
 * leave puts it back and returns the first failure of the two. Neither
 * touches Python: call them with the GIL released. */
rlhfz_status rlhfz_device_enter(int device, int *previous);
rlhfz_status rlhfz_device_leave(int device, int previous, rlhfz_status status);
#endif

/* Where a kernel entry point needs its arrays. */
typedef enum {
    RLHFZ_PLACE_HOST = 0,        /* cpu or cuda_host memory, for the CPU kernels */
    RLHFZ_PLACE_CUDA = 1         /* CUDA device memory, for the CUDA kernels */
} rlhfz_place;

/* dlpack_import.c. A CUDA borrow passes `stream` (the stream the kernel will
 * run on; NULL: the legacy default) to the producer's __dlpack__, so the
 * producer orders its pending work before it. */
/* flags: what a borrow allows */
#define RLHFZ_BORROW_WRITABLE 1  /* the kernel writes it: refuse read-only memory */
#define RLHFZ_BORROW_CODES 2     /* int8 / uint8 moment codes are accepted too */
int rlhfz_array_from_object(rlhfz_state *state, PyObject *obj, const char *name,
                            int flags, rlhfz_place place, void *stream, rlhfz_array *out);
void rlhfz_array_release(rlhfz_array *array);
void rlhfz_borrow_end(PyObject *keepalive);   /* a lent capsule gets its name back */
int rlhfz_buffer_import_dlpack(rlhfz_Buffer *buffer, PyObject *obj);
PyObject *rlhfz_describe_dlpack(PyObject *module, PyObject *obj);

/* dtypes.c: "float32", "bfloat16", "float16", "int8", "uint8" (or torch's str of them), the
 * kernels' enum and DLPack's types. from_object raises TypeError; from_dl
 * returns -1 without an exception (the caller names the argument). */
int rlhfz_dtype_from_object(PyObject *obj, rlhfz_dtype *out);
/* Whether dtype is one of the int8 moments' code types, which only the
 * low-precision step takes (RLHFZ_BORROW_CODES). */
int rlhfz_dtype_is_codes(rlhfz_dtype dtype);
const char *rlhfz_dtype_name(rlhfz_dtype dtype);
DLDataType rlhfz_dtype_to_dl(rlhfz_dtype dtype);
int rlhfz_dtype_from_dl(DLDataType dl, int codes, rlhfz_dtype *out);

/* args.c: METH_FASTCALL | METH_KEYWORDS argument binding, public C API only.
 * names is NULL-terminated; at most max_positional may come by position and
 * the first nrequired must be given. Slots receive borrowed references. */
int rlhfz_parse_args(const char *func, PyObject *const *args, Py_ssize_t nargs,
                     PyObject *kwnames, const char *const *names,
                     int max_positional, int nrequired, PyObject **slots);
int rlhfz_arg_double(PyObject *obj, const char *name, double *out);
int rlhfz_arg_int64(PyObject *obj, const char *name, int64_t *out);
/* A stream argument: None (NULL slot too), an int handle, or an object with a
 * cuda_stream (torch) or handle (rlhfz's CudaStream) attribute. 0 and 1 give
 * NULL, the legacy default stream; 2 is the per-thread default stream. */
int rlhfz_arg_stream(PyObject *obj, void **stream);

/* op_args.c: what the kernel entry points share. */
#define RLHFZ_MAX_BORROWED 7
typedef struct {
    rlhfz_array items[RLHFZ_MAX_BORROWED];
    int count;
} rlhfz_borrowed;

rlhfz_array *rlhfz_borrow(PyObject *module, rlhfz_borrowed *b, PyObject *obj, const char *name,
                          int flags, rlhfz_place place, void *stream);
void rlhfz_borrowed_release(rlhfz_borrowed *b);
int rlhfz_check_dtype(const rlhfz_array *a, const char *name, rlhfz_dtype dtype);
int rlhfz_check_numel(const rlhfz_array *a, const char *name, size_t numel, const char *ref);
int rlhfz_check_disjoint(const rlhfz_array *a, const char *name_a, const rlhfz_array *b,
                         const char *name_b);
int rlhfz_check_all_disjoint(const rlhfz_array *const *arrays, const char *const *names, int count);
int rlhfz_check_same_device(const rlhfz_array *const *arrays, const char *const *names, int count);
/* Borrows and checks AdamW's arrays: slots hold master, exp_avg, exp_avg_sq,
 * grad and param_out (NULL or None: none). Fills the kernel's shard and the
 * arrays' device ordinal. On failure the caller still releases b. */
int rlhfz_adamw_shard_from_args(PyObject *module, rlhfz_borrowed *b, PyObject *const *slots,
                                rlhfz_place place, void *stream, rlhfz_adamw_shard *shard,
                                int *device);
/* The same for bf16 or int8 moments: slots hold master, exp_avg, exp_avg_sq,
 * grad, param_out, exp_avg_scale and exp_avg_sq_scale (the last two for int8
 * only). The moments' dtypes name the state dtype. The shard's rounding,
 * rounding_key and index_base are kept as they are: fill them first with
 * rlhfz_lowp_rounding_from_args. */
int rlhfz_adamw_lowp_shard_from_args(PyObject *module, rlhfz_borrowed *b, PyObject *const *slots,
                                     rlhfz_place place, void *stream,
                                     rlhfz_adamw_lowp_shard *shard, int *device);
/* slots: rounding ('nearest', the default, or 'stochastic'), seed and
 * index_base (ints, default 0; NULL: defaults); step_obj the step, once
 * rlhfz_adamw_hparams_from_args has checked it (its key seeds stochastic
 * rounding with the seed). Checks them and fills the shard's rounding,
 * rounding_key and index_base. */
int rlhfz_lowp_rounding_from_args(PyObject *const *slots, PyObject *step_obj,
                                  rlhfz_adamw_lowp_shard *shard);
/* cuda_inflight.c: DLPack borrows of a queued kernel, kept until the event
 * recorded after its launch is done. */
rlhfz_inflight *rlhfz_inflight_new(void);
void rlhfz_inflight_free(rlhfz_inflight *inflight);
/* Whether b holds a DLPack borrow (rlhfz views need no keeping). */
int rlhfz_inflight_needed(const rlhfz_borrowed *b);
/* An event of `device` to record again, or NULL. */
void *rlhfz_inflight_spare_event(rlhfz_inflight *inflight, int device);
/* Moves b's DLPack borrows behind the recorded event; -1 with an exception. */
int rlhfz_inflight_keep(rlhfz_inflight *inflight, rlhfz_borrowed *b, void *event, int device);
#ifdef RLHFZ_WITH_CUDA
/* After work queued on `stream` that b's borrows must outlive: records
 * *event (made if NULL) behind it, or, with no event to be had, waits for
 * the stream. Returns whether the borrows may wait behind the event. No
 * Python: call it with the GIL released, on the work's device. */
int rlhfz_inflight_fence(void **event, void *stream);
/* Then, with the GIL held: b's borrows wait behind the event (kept), or
 * with no memory to keep them the event is waited for here; an event
 * nothing waits behind is destroyed. */
void rlhfz_inflight_settle(rlhfz_inflight *inflight, rlhfz_borrowed *b, void *event, int device,
                           int kept);
#endif
/* Lets go of the borrows whose events are done. */
void rlhfz_inflight_sweep(rlhfz_inflight *inflight);

/* Raises the Python exception for a kernel's status (0 for RLHFZ_OK). */
int rlhfz_raise_status(rlhfz_status status, const char *what);
/* slots: lr, beta1, beta2, eps, weight_decay, step (required), maximize,
 * grad_scale (NULL: defaults). Checks them and derives the kernel's values. */
int rlhfz_adamw_hparams_from_args(const char *func, PyObject *const *slots, rlhfz_adamw_hparams *hp);
/* RuntimeError saying why, when no CUDA device is usable (memory_tiers.c). */
int rlhfz_require_cuda(const char *what);

/* cpu_ops.c, cuda_ops.c, cuda_simulated.c */
extern PyMethodDef rlhfz_cpu_ops_methods[];
extern PyMethodDef rlhfz_cuda_ops_methods[];
extern PyMethodDef rlhfz_cuda_sim_methods[];
int rlhfz_cuda_add_types(PyObject *module);

#endif /* RLHFZ_MODULE_H */
