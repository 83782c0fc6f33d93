/* thread_pool.c: the persistent pthread pool behind rlhfz_parallel_for.
 *
 * Workers are started on first use and restarted only when the thread count
 * changes or after a fork (threads do not survive one). A call allocates
 * nothing: the job is a few fields of the pool and a counter from which
 * every thread, the caller included, claims its next range. Claiming rather
 * than a fixed split matters on a small machine: right after torch's or
 * another OpenMP library's parallel region, its workers spin on a CPU for
 * milliseconds, and a fixed half of the work on that CPU would finish last.
 *
 * Between calls workers sleep on a condition variable, but they first poll
 * for the next job for up to RLHFZ_POLL_NS, and the caller polls for the
 * workers to finish before it sleeps. Measured on a 2-vCPU VM: a thread
 * woken from sleep is often placed on its waker's CPU and then runs only
 * after the caller's own range, so a pool that always sleeps gets almost no
 * speedup below a few million elements. A polling thread stays runnable, so
 * the scheduler spreads the threads over the CPUs and they stay there. The
 * poll yields the CPU between checks: when two threads do share one CPU, or
 * other processes want it, the polling thread steps aside at once instead
 * of holding the CPU that the thread it waits for needs.
 */
#define _GNU_SOURCE
#include "thread_pool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

/* How long a thread polls before it sleeps. */
#define RLHFZ_POLL_NS 100000L

/* The one thread pool. */
static struct {
    pthread_once_t once;      /* CPU count, default thread count, fork handlers */
    int ncpus;
    int default_threads;
    atomic_int requested;     /* set by rlhfz_threads_set; 0: the default */

    pthread_mutex_t caller;   /* serializes callers of rlhfz_parallel_for */
    pthread_mutex_t lock;     /* held to sleep on, or to signal, the conditions */
    pthread_cond_t wake;      /* to workers: a new job, or stop */
    pthread_cond_t done;      /* to the caller: the last worker finished */

    /* changed only by the caller, with no job in flight and no workers */
    pthread_t workers[RLHFZ_MAX_THREADS - 1];
    int nworkers;
    int poll;                 /* whether threads poll before they sleep */
    unsigned long spawn_generation; /* the generation workers start from */

    atomic_int stop;
    atomic_ulong generation;  /* bumped once per job, after the job is written */
    atomic_int pending;       /* workers yet to report the current job done */

    /* the current job: written before `generation` is bumped, then read-only
     * until every worker has reported it done */
    rlhfz_range_fn fn;
    void *ctx;
    size_t n;
    size_t span;
    size_t nranges;
    int backward;             /* claim the last range first */
    atomic_size_t next;       /* the next range to claim */
} rlhfz_pool = {
    .once = PTHREAD_ONCE_INIT,
    .caller = PTHREAD_MUTEX_INITIALIZER,
    .lock = PTHREAD_MUTEX_INITIALIZER,
    .wake = PTHREAD_COND_INITIALIZER,
    .done = PTHREAD_COND_INITIALIZER,
};

static int clamp_threads(long n)
{
    if (n < 1)
        return 1;
    if (n > RLHFZ_MAX_THREADS)
        return RLHFZ_MAX_THREADS;
    return (int)n;
}

/* ---- fork: hold both locks across fork(), so the child gets them free
 * and no job in flight; the child then forgets the workers it lacks. ---- */

static void before_fork(void)
{
    pthread_mutex_lock(&rlhfz_pool.caller);
    pthread_mutex_lock(&rlhfz_pool.lock);
}

static void after_fork_parent(void)
{
    pthread_mutex_unlock(&rlhfz_pool.lock);
    pthread_mutex_unlock(&rlhfz_pool.caller);
}

static void after_fork_child(void)
{
    rlhfz_pool.nworkers = 0;
    atomic_store(&rlhfz_pool.stop, 0);
    atomic_store(&rlhfz_pool.pending, 0);
    /* the dead workers may still be listed as waiters */
    pthread_cond_init(&rlhfz_pool.wake, NULL);
    pthread_cond_init(&rlhfz_pool.done, NULL);
    pthread_mutex_unlock(&rlhfz_pool.lock);
    pthread_mutex_unlock(&rlhfz_pool.caller);
}

static void pool_init_once(void)
{
    long ncpus = 0;
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    if (sched_getaffinity(0, sizeof cpus, &cpus) == 0)
        ncpus = CPU_COUNT(&cpus);
    if (ncpus < 1)
        ncpus = sysconf(_SC_NPROCESSORS_ONLN);
    rlhfz_pool.ncpus = clamp_threads(ncpus);

    long n = ncpus;
    const char *env = getenv("RLHFZ_NUM_THREADS");
    if (env && *env) {
        char *end;
        errno = 0;
        long v = strtol(env, &end, 10);
        if (errno == 0 && *end == '\0' && v >= 1)
            n = v;
    }
    rlhfz_pool.default_threads = clamp_threads(n);
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

void rlhfz_threads_set(int n)
{
    pthread_once(&rlhfz_pool.once, pool_init_once);
    atomic_store(&rlhfz_pool.requested, clamp_threads(n));
}

int rlhfz_threads_get(void)
{
    pthread_once(&rlhfz_pool.once, pool_init_once);
    int n = atomic_load(&rlhfz_pool.requested);
    return n > 0 ? n : rlhfz_pool.default_threads;
}

/* ---- polling -------------------------------------------------------------- */

static long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)t.tv_sec * 1000000000L + t.tv_nsec;
}

static int new_job_or_stop(unsigned long seen)
{
    return atomic_load(&rlhfz_pool.generation) != seen || atomic_load(&rlhfz_pool.stop);
}

static int all_done(unsigned long unused)
{
    (void)unused;
    return atomic_load(&rlhfz_pool.pending) == 0;
}

/* Poll ready(arg) until it holds (1) or RLHFZ_POLL_NS pass (0). */
static int poll_until(int (*ready)(unsigned long), unsigned long arg)
{
    long deadline = now_ns() + RLHFZ_POLL_NS;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (ready(arg))
                return 1;
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        }
        if (now_ns() > deadline)
            return 0;
        sched_yield();
    }
}

/* ---- workers -------------------------------------------------------------- */

size_t rlhfz_parallel_span(size_t n, size_t grain)
{
    if (grain == 0)
        grain = 1;
    size_t nblocks = n / grain + (n % grain != 0);
    size_t blocks = (RLHFZ_MIN_RANGE + grain - 1) / grain;
    size_t fewest = (nblocks + RLHFZ_MAX_RANGES - 1) / RLHFZ_MAX_RANGES;
    if (blocks < fewest)
        blocks = fewest;
    if (blocks < 1)
        blocks = 1;
    return blocks * grain;
}

/* Claims and runs ranges of the current job until none is left. */
static void run_claimed_ranges(void)
{
    size_t span = rlhfz_pool.span;
    size_t n = rlhfz_pool.n;
    for (;;) {
        size_t k = atomic_fetch_add(&rlhfz_pool.next, 1);
        if (k >= rlhfz_pool.nranges)
            return;
        if (rlhfz_pool.backward)
            k = rlhfz_pool.nranges - 1 - k;
        size_t begin = k * span;
        size_t end = n - begin > span ? begin + span : n;
        rlhfz_pool.fn(rlhfz_pool.ctx, begin, end);
    }
}

static void *worker_main(void *arg)
{
    (void)arg;
    unsigned long seen = rlhfz_pool.spawn_generation;

    for (;;) {
        if (!rlhfz_pool.poll || !poll_until(new_job_or_stop, seen)) {
            pthread_mutex_lock(&rlhfz_pool.lock);
            while (!new_job_or_stop(seen))
                pthread_cond_wait(&rlhfz_pool.wake, &rlhfz_pool.lock);
            pthread_mutex_unlock(&rlhfz_pool.lock);
        }
        if (atomic_load(&rlhfz_pool.stop))
            break;

        /* Every worker reports every job done, even one it has no range
         * in, so none can lag behind and read the next job's fields. */
        seen = atomic_load(&rlhfz_pool.generation);
        run_claimed_ranges();
        if (atomic_fetch_sub(&rlhfz_pool.pending, 1) == 1) {
            /* the last one; signal under the lock, so a caller that found
             * pending > 0 under it is already asleep and gets the signal */
            pthread_mutex_lock(&rlhfz_pool.lock);
            pthread_cond_signal(&rlhfz_pool.done);
            pthread_mutex_unlock(&rlhfz_pool.lock);
        }
    }
    return NULL;
}

/* Called with `caller` held and no job in flight. */
static void stop_workers(void)
{
    if (rlhfz_pool.nworkers == 0)
        return;
    pthread_mutex_lock(&rlhfz_pool.lock);
    atomic_store(&rlhfz_pool.stop, 1);
    pthread_cond_broadcast(&rlhfz_pool.wake);
    pthread_mutex_unlock(&rlhfz_pool.lock);
    for (int i = 0; i < rlhfz_pool.nworkers; i++)
        pthread_join(rlhfz_pool.workers[i], NULL);
    rlhfz_pool.nworkers = 0;
    atomic_store(&rlhfz_pool.stop, 0);
}

/* Called with `caller` held and no workers running. */
static rlhfz_status start_workers(int count)
{
    /* with more threads than CPUs, polling only takes turns from the others */
    rlhfz_pool.poll = count + 1 <= rlhfz_pool.ncpus;
    rlhfz_pool.spawn_generation = atomic_load(&rlhfz_pool.generation);

    /* Workers block all signals, so signals (Python's SIGINT) keep going to
     * the application's own threads. They inherit this mask. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int started = 0;
    while (started < count &&
           pthread_create(&rlhfz_pool.workers[started], NULL, worker_main,
                          NULL) == 0)
        started++;
    pthread_sigmask(SIG_SETMASK, &old, NULL);

    rlhfz_pool.nworkers = started;
    if (started < count) {
        stop_workers();
        return RLHFZ_ERR_THREADS;
    }
    return RLHFZ_OK;
}

static rlhfz_status parallel_for(size_t n, size_t grain, rlhfz_range_fn fn, void *ctx,
                                 int backward)
{
    if (!fn)
        return RLHFZ_ERR_INVALID;
    if (n == 0)
        return RLHFZ_OK;
    if (grain == 0)
        grain = 1;

    int threads = rlhfz_threads_get();
    size_t span = rlhfz_parallel_span(n, grain);
    size_t nranges = n / span + (n % span != 0);
    if (threads <= 1 || n < RLHFZ_PARALLEL_MIN_ELEMENTS || nranges < 2) {
        for (size_t k = 0; k < nranges; k++) {
            size_t begin = (backward ? nranges - 1 - k : k) * span;
            fn(ctx, begin, n - begin > span ? begin + span : n);
        }
        return RLHFZ_OK;
    }
    pthread_mutex_lock(&rlhfz_pool.caller);
    if (rlhfz_pool.nworkers != threads - 1) {
        stop_workers();
        rlhfz_status status = start_workers(threads - 1);
        if (status != RLHFZ_OK) {
            pthread_mutex_unlock(&rlhfz_pool.caller);
            return status;
        }
    }

    /* post the job: its fields first, then the generation that publishes it */
    pthread_mutex_lock(&rlhfz_pool.lock);
    rlhfz_pool.fn = fn;
    rlhfz_pool.ctx = ctx;
    rlhfz_pool.n = n;
    rlhfz_pool.span = span;
    rlhfz_pool.nranges = nranges;
    rlhfz_pool.backward = backward;
    atomic_store(&rlhfz_pool.next, 0);
    atomic_store(&rlhfz_pool.pending, rlhfz_pool.nworkers);
    atomic_fetch_add(&rlhfz_pool.generation, 1);
    pthread_cond_broadcast(&rlhfz_pool.wake);
    pthread_mutex_unlock(&rlhfz_pool.lock);

    run_claimed_ranges();

    /* wait for the workers */
    if (!rlhfz_pool.poll || !poll_until(all_done, 0)) {
        pthread_mutex_lock(&rlhfz_pool.lock);
        while (!all_done(0))
            pthread_cond_wait(&rlhfz_pool.done, &rlhfz_pool.lock);
        pthread_mutex_unlock(&rlhfz_pool.lock);
    }

    pthread_mutex_unlock(&rlhfz_pool.caller);
    return RLHFZ_OK;
}

rlhfz_status rlhfz_parallel_for(size_t n, size_t grain, rlhfz_range_fn fn, void *ctx)
{
    return parallel_for(n, grain, fn, ctx, 0);
}

rlhfz_status rlhfz_parallel_for_backward(size_t n, size_t grain, rlhfz_range_fn fn, void *ctx)
{
    return parallel_for(n, grain, fn, ctx, 1);
}
