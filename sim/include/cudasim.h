/* cudasim.h: what the simulated CUDA runtime offers beyond the CUDA API.
 *
 * For the code that must know it runs on the simulator: rlhfz's bridge
 * (kernels/cuda_simulated.cu), which hands torch's CPU build the host alias
 * of device memory, the NCCL stand-in (sim/nccl/), which moves device bytes
 * between processes, and the tests, which count calls and inject failures.
 *
 * Environment, read once, at the first runtime call:
 *   RLHFZ_SIM_DEVICES=n         devices (default 1; 0: cudaErrorNoDevice)
 *   RLHFZ_SIM_DEVICE_BYTES=n    capacity of each device (default 4 GiB)
 *   RLHFZ_SIM_PINNED_BYTES=n    most page-locked host bytes (default: no limit)
 *   RLHFZ_SIM_CHAOS=seed        random delays before each queued operation,
 *                               blocks and threads run in a random order
 *   RLHFZ_SIM_FAIL=call:n[:error][,...]   the n-th call of `call` fails
 */
#ifndef CUDASIM_H
#define CUDASIM_H

#include <stddef.h>

#include "cuda_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The host's read-write alias of nbytes of device memory at device_ptr, all
 * within one live allocation; *device gets its ordinal. Fails with
 * cudaErrorInvalidDevicePointer for anything else. */
cudaError_t cudasim_host_alias(const void *device_ptr, size_t nbytes, void **alias, int *device);

/* The reverse: the device pointer behind a host alias (nbytes of it, all in
 * one allocation). Fails with cudaErrorInvalidValue if alias is not one. */
cudaError_t cudasim_device_pointer(const void *alias, size_t nbytes, void **device_ptr,
                                   int *device);

/* The device of a stream (the current device's for the default streams). */
cudaError_t cudasim_stream_device(cudaStream_t stream, int *device);

/* Holds a created stream: the work queued on it from now on waits until
 * cudasim_stream_release(*token), so a test can keep work in flight for as
 * long as it likes. Not for the default streams, which run inline. */
cudaError_t cudasim_stream_hold(cudaStream_t stream, unsigned long long *token);
cudaError_t cudasim_stream_release(unsigned long long token);

/* How many times the named runtime function has been called in this
 * process ("cudaHostAlloc", "cudaFree", "kernel launch", ...). */
unsigned long long cudasim_calls(const char *name);

/* Replaces the failures to inject (RLHFZ_SIM_FAIL's syntax; "" for none),
 * counting calls afresh. Returns cudaErrorInvalidValue for a bad spec. */
cudaError_t cudasim_inject(const char *spec);

/* One line describing the simulated machine, for build_info(). */
const char *cudasim_describe(void);

#ifdef __cplusplus
}
#endif

#endif /* CUDASIM_H */
