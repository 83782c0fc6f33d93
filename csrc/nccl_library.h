/* nccl_library.h: the slice of the NCCL ABI that rlhfz uses, declared from
 * the published API (no nccl.h needed), the library table filled by
 * dlopen/dlsym, and the check macro for NCCL results.
 *
 * libnccl.so.2 is opened lazily, on first use, so that importing rlhfz._C
 * never needs NCCL, CUDA or a driver. Streams are raw cudaStream_t handles
 * (void *); device pointers are plain addresses.
 */
#ifndef RLHFZ_NCCL_LIBRARY_H
#define RLHFZ_NCCL_LIBRARY_H

#include "rlhfz_module.h"

#include <limits.h>
#include <stddef.h>

/* ---- the NCCL ABI (nccl.h, 2.10 and later) --------------------------------- */

#define RLHFZ_NCCL_SONAME "libnccl.so.2"
#define RLHFZ_NCCL_UNIQUE_ID_BYTES 128
/* NCCL_VERSION(2, 10, 0): bfloat16 and ncclAvg first appear there. */
#define RLHFZ_NCCL_MIN_VERSION 21000

typedef struct ncclComm *ncclComm_t;

typedef struct {
    char internal[RLHFZ_NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7
} ncclResult_t;

typedef enum {
    ncclInt8 = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclFloat32 = 7,
    ncclFloat64 = 8,
    ncclBfloat16 = 9
} ncclDataType_t;

typedef enum {
    ncclSum = 0,
    ncclProd = 1,
    ncclMax = 2,
    ncclMin = 3,
    ncclAvg = 4
} ncclRedOp_t;

/* Communicator options, versioned: NCCL reads `size` bytes of it, and only
 * the fields `version` had, and keeps its defaults for the rest. These are
 * the fields of NCCL 2.14, where the struct and non-blocking init appear;
 * later versions append fields after them. */
#define RLHFZ_NCCL_CONFIG_VERSION 21400
#define RLHFZ_NCCL_API_MAGIC 0xcafebeefu
#define RLHFZ_NCCL_CONFIG_UNDEF_INT INT_MIN

typedef struct {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    int cgaClusterSize;
    int minCTAs;
    int maxCTAs;
    const char *netName;
} rlhfz_nccl_config;

/* The functions rlhfz calls, as pointers resolved with dlsym. */
typedef struct {
    void *handle;                /* NULL until loaded; never dlclose'd */
    char *path;                  /* the file it came from (malloc'd) */
    int version;                 /* ncclGetVersion, e.g. 23203 for 2.32.3 */
    ncclResult_t (*GetVersion)(int *version);
    ncclResult_t (*GetUniqueId)(ncclUniqueId *id);
    ncclResult_t (*CommInitRank)(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
    /* NULL before NCCL 2.14 */
    ncclResult_t (*CommInitRankConfig)(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                       rlhfz_nccl_config *config);
    ncclResult_t (*CommDestroy)(ncclComm_t comm);
    ncclResult_t (*CommAbort)(ncclComm_t comm);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t comm, ncclResult_t *async_error);
    const char *(*GetErrorString)(ncclResult_t result);
    const char *(*GetLastError)(ncclComm_t comm);          /* NULL before NCCL 2.13 */
    ncclResult_t (*CommCuDevice)(ncclComm_t comm, int *device);   /* optional */
    ncclResult_t (*AllReduce)(const void *send, void *recv, size_t count, ncclDataType_t dtype,
                              ncclRedOp_t op, ncclComm_t comm, void *stream);
    ncclResult_t (*ReduceScatter)(const void *send, void *recv, size_t recv_count,
                                  ncclDataType_t dtype, ncclRedOp_t op, ncclComm_t comm,
                                  void *stream);
    ncclResult_t (*AllGather)(const void *send, void *recv, size_t send_count,
                              ncclDataType_t dtype, ncclComm_t comm, void *stream);
    ncclResult_t (*Broadcast)(const void *send, void *recv, size_t count, ncclDataType_t dtype,
                              int root, ncclComm_t comm, void *stream);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
} rlhfz_nccl_library;

/* ---- errors ------------------------------------------------------------------ */

/* Sets RuntimeError "file:line: what failed: <enum name>: <ncclGetErrorString>
 * (last error: <ncclGetLastError>)". Leaves an exception already set alone. */
void rlhfz_nccl_set_error(const rlhfz_nccl_library *lib, ncclResult_t result, const char *what,
                          const char *file, int line);

/* Checks the result of an NCCL call (made beforehand, usually with the GIL
 * released, which a macro argument cannot do): on failure it sets the Python
 * exception described above and jumps to the function's error label. */
#define RLHFZ_NCCL_CHECK(lib, result, what)                                             \
    do {                                                                                \
        ncclResult_t rlhfz_nccl_result_ = (result);                                     \
        if (rlhfz_nccl_result_ != ncclSuccess) {                                        \
            rlhfz_nccl_set_error((lib), rlhfz_nccl_result_, (what), __FILE__, __LINE__); \
            goto error;                                                                 \
        }                                                                               \
    } while (0)

/* Names an ncclResult_t ("ncclInvalidUsage"), for messages. */
const char *rlhfz_nccl_result_name(ncclResult_t result);

/* ---- the library of a module ---------------------------------------------------- */

/* The library table of `module`, loading NCCL first if needed (path: a file
 * to try, see nccl_load); NULL with RuntimeError if it cannot be loaded or
 * the table is gone. The pointer is borrowed from the table's capsule: a
 * caller that keeps it keeps the capsule too (*capsule_out, if not NULL,
 * gets a new reference to it). */
rlhfz_nccl_library *rlhfz_nccl_library_get(PyObject *module, const char *path,
                                           PyObject **capsule_out);

/* Adds the per-module library table (the capsule _nccl_library) and the
 * functions nccl_load, nccl_version and nccl_unique_id to the module. */
int rlhfz_nccl_library_add(PyObject *module);

#endif /* RLHFZ_NCCL_LIBRARY_H */
