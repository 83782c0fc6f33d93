/* copy_cpu.c: a host memory copy over the CPU thread pool.
 *
 * Moving state between host memory and mapped files is bound by page faults
 * as much as by bandwidth (each new page of the target, and each page of a
 * file read back, faults once); several threads take those faults at once.
 * Ranges are whole 2 MiB pieces, so each thread's part of a huge-page-backed
 * buffer is its own set of pages.
 */
#include <string.h>

#include "rlhfz_kernels.h"
#include "thread_pool.h"

#define COPY_GRAIN ((size_t)2 << 20)

typedef struct {
    char *dst;
    const char *src;
} copy_args;

static void copy_range(void *ctx, size_t begin, size_t end)
{
    const copy_args *a = ctx;
    memcpy(a->dst + begin, a->src + begin, end - begin);
}

rlhfz_status rlhfz_copy_cpu(void *dst, const void *src, size_t nbytes)
{
    if (nbytes == 0)
        return RLHFZ_OK;
    if (dst == NULL || src == NULL)
        return RLHFZ_ERR_INVALID;
    copy_args args = {.dst = dst, .src = src};
    /* only copies of several pieces are worth waking the workers for */
    if (nbytes < 2 * COPY_GRAIN) {
        memcpy(dst, src, nbytes);
        return RLHFZ_OK;
    }
    return rlhfz_parallel_for(nbytes, COPY_GRAIN, copy_range, &args);
}
