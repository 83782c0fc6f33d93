/* thread_pool.h: the persistent CPU thread pool behind the kernels (internal).
 *
 * rlhfz_parallel_for splits [0, n) into at most rlhfz_threads_get()
 * contiguous ranges whose boundaries are multiples of grain, runs one range
 * on the calling thread and the others on the pool's workers, and returns
 * when all are done. Small n runs inline on the caller. Concurrent callers are
 * served one at a time. fn must not itself call rlhfz_parallel_for.
 */
#ifndef RLHFZ_THREAD_POOL_H
#define RLHFZ_THREAD_POOL_H

#include <stddef.h>

#include "rlhfz_kernels.h"

/* Thread counts are clamped to this, so the pool needs no allocation. */
#define RLHFZ_MAX_THREADS 256

/* Below this many elements a call runs inline: waking workers costs more. */
#define RLHFZ_PARALLEL_MIN_ELEMENTS 32768

typedef void (*rlhfz_range_fn)(void *ctx, size_t begin, size_t end);

rlhfz_status rlhfz_parallel_for(size_t n, size_t grain, rlhfz_range_fn fn, void *ctx);

#endif /* RLHFZ_THREAD_POOL_H */
