/* thread_pool.h: the persistent CPU thread pool behind the kernels (internal).
 *
 * rlhfz_parallel_for cuts [0, n) into the ranges [k * span, (k + 1) * span)
 * of rlhfz_parallel_span(n, grain), and calls fn once on each. The calling
 * thread and the pool's workers claim ranges one at a time until none is
 * left, so a thread that shares its CPU (another library's spinning
 * workers, another process) simply runs fewer of them. The cut depends on
 * n and grain alone, never on the thread count: a caller that keeps one
 * result per range gets the same results with any number of threads. Small
 * n runs inline on the caller. Concurrent callers are served one at a time.
 * fn must not itself call rlhfz_parallel_for.
 */
#ifndef RLHFZ_THREAD_POOL_H
#define RLHFZ_THREAD_POOL_H

#include <stddef.h>

#include "rlhfz_kernels.h"

/* Below this many elements a call runs inline: waking workers costs more. */
#define RLHFZ_PARALLEL_MIN_ELEMENTS 32768

/* A call is cut into at most this many ranges (callers size per-range
 * results by it), each of at least RLHFZ_MIN_RANGE elements where n allows:
 * claiming a range costs one atomic add. */
#define RLHFZ_MAX_RANGES 1024
#define RLHFZ_MIN_RANGE 16384

typedef void (*rlhfz_range_fn)(void *ctx, size_t begin, size_t end);

/* The length of every range but the last: a multiple of grain. */
size_t rlhfz_parallel_span(size_t n, size_t grain);

rlhfz_status rlhfz_parallel_for(size_t n, size_t grain, rlhfz_range_fn fn, void *ctx);

/* The same ranges, claimed last first. A read-only pass that runs so, ahead
 * of a forward pass over the same memory, leaves the forward pass's first
 * ranges in the cache, rather than its last (evicted again before use). */
rlhfz_status rlhfz_parallel_for_backward(size_t n, size_t grain, rlhfz_range_fn fn, void *ctx);

#endif /* RLHFZ_THREAD_POOL_H */
