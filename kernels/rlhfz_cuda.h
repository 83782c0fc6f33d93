/* rlhfz_cuda.h: rlhfz's CUDA layer behind a C ABI (present only when built
 * with nvcc, i.e. when RLHFZ_WITH_CUDA is defined for csrc/).
 *
 * Streams and events are raw handles (cudaStream_t / cudaEvent_t as void *);
 * a NULL stream is the legacy default stream. Every function returns a
 * status; on RLHFZ_ERR_CUDA, rlhfz_cuda_error_string() names the runtime's
 * error (thread-local, valid until this thread's next failing call). Launchers
 * check the launch (cudaGetLastError), not its completion. None of them
 * prints, exits or synchronizes unless it says so.
 */
#ifndef RLHFZ_CUDA_H
#define RLHFZ_CUDA_H

#include <stddef.h>

#include "rlhfz_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The runtime's description of this thread's most recent failure, or "". */
const char *rlhfz_cuda_error_string(void);

/* ---- devices, memory, streams and events (cuda_memory.cu) ----------------- */

rlhfz_status rlhfz_cuda_get_device(int *device);
rlhfz_status rlhfz_cuda_set_device(int device);
/* Waits on the host for all work queued on `device`. */
rlhfz_status rlhfz_cuda_device_synchronize(int device);
/* Free and total bytes of `device`, as the driver reports them. */
rlhfz_status rlhfz_cuda_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes);

/* Device memory on `device` (cudaMalloc: cudaFree gives it back to the
 * driver, which cudaMemGetInfo then shows). Both allocations return
 * RLHFZ_ERR_NOMEM when the memory is not there, RLHFZ_ERR_CUDA when the
 * runtime failed otherwise. */
rlhfz_status rlhfz_cuda_malloc(void **ptr, size_t nbytes, int device);
rlhfz_status rlhfz_cuda_free(void *ptr, int device);
/* Page-locked host memory (cudaHostAlloc, portable and mapped). */
rlhfz_status rlhfz_cuda_host_alloc(void **ptr, size_t nbytes);
rlhfz_status rlhfz_cuda_host_free(void *ptr);

/* Copies nbytes between any two of host, pinned and device memory
 * (cudaMemcpyDefault), queued on stream; blocking != 0 waits for it. */
rlhfz_status rlhfz_cuda_memcpy(void *dst, const void *src, size_t nbytes, void *stream,
                               int blocking);
rlhfz_status rlhfz_cuda_memset(void *ptr, int value, size_t nbytes, void *stream);

rlhfz_status rlhfz_cuda_stream_create(void **stream, int device);   /* non-blocking */
rlhfz_status rlhfz_cuda_stream_destroy(void *stream);
rlhfz_status rlhfz_cuda_stream_synchronize(void *stream);
rlhfz_status rlhfz_cuda_event_create(void **event);                  /* timing disabled */
rlhfz_status rlhfz_cuda_event_destroy(void *event);
rlhfz_status rlhfz_cuda_event_record(void *event, void *stream);
/* Work queued on stream after this waits for event (no host blocking). */
rlhfz_status rlhfz_cuda_stream_wait_event(void *stream, void *event);
rlhfz_status rlhfz_cuda_event_synchronize(void *event);
/* *done = 1 once the recorded work is done, else 0; never blocks. */
rlhfz_status rlhfz_cuda_event_query(void *event, int *done);

/* ---- the simulated runtime (cuda_simulated.cu) ------------------------------ */

/* 1 in a build against the simulated runtime (RLHFZ_CUDA=sim), else 0. The
 * others return RLHFZ_ERR_UNSUPPORTED in a real build. */
int rlhfz_cuda_simulated(void);
/* The host's alias of nbytes of device memory at device_ptr (what torch's
 * CPU build sees of it); RLHFZ_ERR_INVALID if it is not live device memory. */
rlhfz_status rlhfz_cuda_host_alias(const void *device_ptr, size_t nbytes, void **host);
/* The device pointer and ordinal a host alias stands for; RLHFZ_ERR_INVALID
 * if [host, host + nbytes) is not (all) the alias of one allocation. */
rlhfz_status rlhfz_cuda_alias_device(const void *host, size_t nbytes, void **device_ptr,
                                     int *device);
/* One line on the simulated machine; NULL in a real build. */
const char *rlhfz_cuda_sim_describe(void);
/* Calls so far of a runtime function ("cudaHostAlloc", "kernel launch", ...). */
rlhfz_status rlhfz_cuda_sim_calls(const char *name, unsigned long long *calls);
/* Failures to inject from now on: "call:n[:error],..." ("" for none). */
rlhfz_status rlhfz_cuda_sim_inject(const char *spec);

/* Holds a stream (not a default one): its work queued from now on waits
 * until rlhfz_cuda_sim_release(token). */
rlhfz_status rlhfz_cuda_sim_hold(void *stream, unsigned long long *token);
rlhfz_status rlhfz_cuda_sim_release(unsigned long long token);

/* ---- AdamW (adamw_cuda.cu) ------------------------------------------------- */

/* One fused AdamW step over a flat shard in device memory, the same math as
 * rlhfz_adamw_reference (fp32 master, exp_avg, exp_avg_sq updated in place;
 * grad read in grad_dtype; param_out, if not NULL, written in param_dtype,
 * rounded to nearest even). One launch, 16-byte vector loads where the
 * pointers allow, a scalar tail otherwise.
 *
 * Capturable: if hp_device is not NULL, the kernel reads the hyperparameters
 * from that device copy of an rlhfz_adamw_hparams (hp is then ignored), so a
 * captured CUDA graph replays with whatever values were written there since.
 * If skip_if_nonzero is not NULL and *skip_if_nonzero != 0 on the device
 * (e.g. the found-inf flag of rlhfz_unscale_cuda), nothing is written. */
rlhfz_status rlhfz_adamw_cuda(const rlhfz_adamw_shard *shard, const rlhfz_adamw_hparams *hp,
                              const rlhfz_adamw_hparams *hp_device,
                              const int *skip_if_nonzero, void *stream);

/* ---- AdamW with low-precision moments (adamw_lowp_cuda.cu) ----------------- */

/* One step over a flat shard part in device memory whose moments are bf16,
 * or int8 / uint8 codes with one fp32 scale per RLHFZ_QBLOCK block: the
 * bits of rlhfz_adamw_lowp_reference, for either rounding. One launch; the
 * arguments are checked as rlhfz_adamw_lowp_check_args does. If
 * skip_if_nonzero is not NULL and *skip_if_nonzero != 0 on the device,
 * nothing is written. The hyperparameters are host values only: the
 * rounding key depends on the step, so a captured replay could not change
 * it. */
rlhfz_status rlhfz_adamw_lowp_cuda(const rlhfz_adamw_lowp_shard *shard,
                                   const rlhfz_adamw_hparams *hp, const int *skip_if_nonzero,
                                   void *stream);

/* ---- reductions, scaling and casts (reduce_cuda.cu) ------------------------ */

/* Doubles of scratch that rlhfz_sumsq_cuda needs (one per block it launches). */
size_t rlhfz_sumsq_cuda_workspace(void);

/* out[0] = sum of squares of x's n elements in double (accumulate != 0: out[0]
 * += it), deterministic: per-block partials in `workspace` (device memory,
 * rlhfz_sumsq_cuda_workspace() doubles), then one block sums them in order.
 * Inf or NaN iff some element is. out and workspace are device pointers. */
rlhfz_status rlhfz_sumsq_cuda(const void *x, rlhfz_dtype dtype, size_t n, double *out,
                              int accumulate, double *workspace, void *stream);

/* g *= inv_scale in place; if any element of g (before scaling) is Inf or
 * NaN, *found_inf (device int) is set to 1. It is never cleared here. */
rlhfz_status rlhfz_unscale_cuda(void *g, rlhfz_dtype dtype, size_t n, float inv_scale,
                                int *found_inf, void *stream);

/* x *= scale in place, in x's dtype. If scale_device is not NULL the factor
 * is read from there (a device float), so clipping needs no host sync. */
rlhfz_status rlhfz_scale_cuda(void *x, rlhfz_dtype dtype, size_t n, float scale,
                              const float *scale_device, void *stream);

/* dst = src converted, n elements; to 16 bits with rounding to nearest even. */
rlhfz_status rlhfz_cast_cuda(const void *src, rlhfz_dtype src_dtype, void *dst,
                             rlhfz_dtype dst_dtype, size_t n, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* RLHFZ_CUDA_H */
