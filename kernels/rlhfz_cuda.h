/* rlhfz_cuda.h: host launchers of rlhfz's CUDA kernels (present only when
 * built with nvcc). The device queries are in rlhfz_kernels.h. */
#ifndef RLHFZ_CUDA_H
#define RLHFZ_CUDA_H

#include <stddef.h>

#include "rlhfz_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* x[i] = value for i < n, on the device, queued on `stream` (a cudaStream_t;
 * NULL: the default stream). Checks the launch, not its completion. */
rlhfz_status rlhfz_fill_cuda(float *x, size_t n, float value, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* RLHFZ_CUDA_H */
