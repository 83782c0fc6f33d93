/* nccl.h: the NCCL API slice that the stand-in library (libnccl.so.2 of the
 * simulated build) implements, with NCCL's own names, types, enum values and
 * signatures, declared here from the published API.
 *
 * The stand-in runs collectives between the processes of one machine over
 * POSIX shared memory, on the simulated CUDA runtime's streams (sim/runtime).
 * What a caller may rely on beyond NCCL's documented behaviour:
 *
 * - The unique id is not opaque to tests: bytes [0, 8) hold "rlhfzsim" and
 *   bytes [16, 80) the NUL-terminated name of the shared-memory segment the
 *   ranks meet in ("/rlhfz-nccl-..."); the name is unlinked as soon as every
 *   rank has attached, so a later crash leaves nothing in /dev/shm.
 * - Environment, read at ncclCommInitRank:
 *     RLHFZ_NCCL_SIM_STAGING_BYTES=n   bytes each rank stages a transfer
 *                                      through (default 256 KiB; the rank
 *                                      that creates the segment decides)
 *     RLHFZ_NCCL_SIM_INIT_TIMEOUT=s    seconds ncclCommInitRank waits for the
 *                                      other ranks (default 300), then fails
 *     RLHFZ_SIM_CHAOS=seed             random delays inside collectives too
 *     RLHFZ_NCCL_SIM_SETTLE_US=n       how long a non-blocking communicator's
 *                                      call stays ncclInProgress (default
 *                                      200; read at each call)
 * - RLHFZ_NCCL_SIM_VERSION=n, read at each ncclGetVersion: the version code
 *   it reports instead of NCCL_VERSION_CODE (tests pose as an older NCCL).
 * - A non-blocking communicator (ncclCommInitRankConfig, blocking = 0) is
 *   harsher than NCCL's: init always returns ncclInProgress and joins the
 *   other ranks on a thread of its own; every collective on it returns
 *   ncclInProgress and settles a little later; and a call made before
 *   ncclCommGetAsyncError has said ncclSuccess is refused (ncclInvalidUsage),
 *   where NCCL leaves it undefined. The config's magic, version, size and
 *   blocking value are checked.
 */
#ifndef RLHFZ_SIM_NCCL_H
#define RLHFZ_SIM_NCCL_H

#include <stddef.h>

#include "cuda_runtime.h"

#define NCCL_MAJOR 2
#define NCCL_MINOR 27
#define NCCL_PATCH 0
#define NCCL_VERSION(X, Y, Z) (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) \
                                                      : (X) * 10000 + (Y) * 100 + (Z))
#define NCCL_VERSION_CODE NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH)

#define NCCL_UNIQUE_ID_BYTES 128

#ifdef __cplusplus
extern "C" {
#endif

typedef struct ncclComm *ncclComm_t;

typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
    ncclNumResults = 8
} ncclResult_t;

typedef enum {
    ncclInt8 = 0,
    ncclChar = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclInt = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclHalf = 6,
    ncclFloat32 = 7,
    ncclFloat = 7,
    ncclFloat64 = 8,
    ncclDouble = 8,
    ncclBfloat16 = 9
} ncclDataType_t;

typedef enum {
    ncclSum = 0,
    ncclProd = 1,
    ncclMax = 2,
    ncclMin = 3,
    ncclAvg = 4
} ncclRedOp_t;

/* Communicator options (NCCL 2.14 and later), versioned by size and version:
 * a library reads only the fields the caller's struct has. These are the
 * fields of NCCL 2.18; later versions append more. */
#define NCCL_CONFIG_UNDEF_INT (-2147483647 - 1)
#define NCCL_CONFIG_UNDEF_PTR NULL
#define NCCL_API_MAGIC 0xcafebeef

typedef struct ncclConfig_v21800 {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    int cgaClusterSize;
    int minCTAs;
    int maxCTAs;
    const char *netName;
    int splitShare;
} ncclConfig_t;

#define NCCL_CONFIG_INITIALIZER                                                     \
    {sizeof(ncclConfig_t), NCCL_API_MAGIC, NCCL_VERSION(2, 18, 0),                \
     NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT,          \
     NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_PTR, NCCL_CONFIG_UNDEF_INT}

ncclResult_t ncclGetVersion(int *version);
ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t *config);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count);
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank);
const char *ncclGetErrorString(ncclResult_t result);
const char *ncclGetLastError(ncclComm_t comm);

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream);
ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);

ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);

#ifdef __cplusplus
}
#endif

#endif /* RLHFZ_SIM_NCCL_H */
