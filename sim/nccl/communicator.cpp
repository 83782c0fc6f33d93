/* communicator.cpp: the NCCL stand-in's communicators and the calls about
 * them: version, unique ids, init, destroy, abort, queries and errors.
 *
 * A communicator is bound to the CUDA device current at ncclCommInitRank;
 * as NCCL's, init fails with ncclInvalidUsage where two ranks are on one.
 * Its handle is registered while live, so a destroyed, aborted or made-up
 * handle is refused (ncclInvalidArgument) instead of being dereferenced.
 * Destroy waits for the communicator's queued collectives, as NCCL's does
 * (and hangs with them when a peer is gone); abort never waits for a peer:
 * it stops the collective running, drops the queued ones and releases the
 * shared memory at once.
 */
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <unordered_set>

#include "internal.h"

namespace ncclsim {

namespace {

constexpr char ID_MAGIC[8] = {'r', 'l', 'h', 'f', 'z', 's', 'i', 'm'};
constexpr std::size_t ID_NAME_OFFSET = 16;
constexpr std::size_t ID_NAME_BYTES = 64;
constexpr std::size_t DEFAULT_STAGING = 256 << 10;
constexpr double DEFAULT_INIT_TIMEOUT_S = 300.0;
constexpr int MAX_RANKS = 1024;

thread_local char last_error[1024];

struct Registry {
    std::mutex mutex;
    std::unordered_set<ncclComm *> live;
};

Registry &registry()
{
    static Registry *state = new Registry;    /* never destroyed: stream workers outlive exit */
    return *state;
}

/* Takes a live handle out of the registry: the caller then owns it. */
ncclComm *unregister(ncclComm_t comm, const char *function)
{
    Registry &r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (!comm || !r.live.erase(comm)) {
        fail(ncclInvalidArgument, "%s: %p is not a live communicator (never created, or already "
             "destroyed or aborted)", function, (void *)comm);
        return nullptr;
    }
    return comm;
}

std::uint64_t mix(std::uint64_t x)
{
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* A size or a time from the environment, or `fallback` (saying so) if unusable. */
double read_number(const char *name, double low, double high, double fallback)
{
    const char *text = std::getenv(name);
    if (!text || !*text)
        return fallback;
    char *end = nullptr;
    errno = 0;
    double value = std::strtod(text, &end);
    if (errno != 0 || *end != '\0' || !(value >= low && value <= high)) {
        std::fprintf(stderr, "nccl (simulated): %s=%s is not a number in [%g, %g]; using %g\n",
                     name, text, low, high, fallback);
        return fallback;
    }
    return value;
}

} /* namespace */

ncclResult_t fail(ncclResult_t result, const char *format, ...)
{
    va_list args;
    va_start(args, format);
    std::vsnprintf(last_error, sizeof last_error, format, args);
    va_end(args);
    return result;
}

std::shared_ptr<CommState> lookup(ncclComm_t comm, const char *function)
{
    Registry &r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    if (!comm || !r.live.count(comm)) {
        fail(ncclInvalidArgument, "%s: %p is not a live communicator (never created, or already "
             "destroyed or aborted)", function, (void *)comm);
        return nullptr;
    }
    return comm->state;
}

void CommState::advance_locked()
{
    ++next_run;
    while (cancelled.erase(next_run))
        ++next_run;
    changed.notify_all();
}

void Chaos::seed(const char *text, int rank)
{
    on_ = text && *text;
    if (on_)
        state_ = mix(std::strtoull(text, nullptr, 0) ^ mix((std::uint64_t)rank + 1));
}

void Chaos::maybe_delay()
{
    if (!on_)
        return;
    state_ = mix(state_);
    std::uint64_t draw = state_ % 1000;
    if (draw < 300)
        std::this_thread::sleep_for(std::chrono::microseconds(state_ % 200));
    else if (draw >= 990)
        std::this_thread::sleep_for(std::chrono::milliseconds(1 + (state_ >> 20) % 3));
}

} /* namespace ncclsim */

using namespace ncclsim;

/* ---- version, errors ------------------------------------------------------------------- */

extern "C" ncclResult_t ncclGetVersion(int *version)
{
    if (!version)
        return fail(ncclInvalidArgument, "ncclGetVersion: version is NULL");
    /* a test may pose as an older NCCL, to see it refused */
    *version = (int)read_number("RLHFZ_NCCL_SIM_VERSION", 0, 1e9, NCCL_VERSION_CODE);
    return ncclSuccess;
}

extern "C" const char *ncclGetErrorString(ncclResult_t result)
{
    switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (a CUDA call failed)";
    case ncclSystemError: return "unhandled system error (shared memory, or a peer's setup)";
    case ncclInternalError: return "internal error in the NCCL stand-in";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage (ranks disagree, or a call out of order)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    case ncclNumResults: break;
    }
    return "unknown result code";
}

/* As NCCL's: the calling thread's last error text, whatever comm is. */
extern "C" const char *ncclGetLastError(ncclComm_t comm)
{
    (void)comm;
    return last_error;
}

/* ---- unique ids and init ------------------------------------------------------------------ */

extern "C" ncclResult_t ncclGetUniqueId(ncclUniqueId *unique_id)
{
    if (!unique_id)
        return fail(ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
    std::uint64_t nonce[2] = {0, 0};
    if (getrandom(nonce, sizeof nonce, 0) != (ssize_t)sizeof nonce) {
        /* no entropy source: time, pid and a counter still make it unique here */
        static std::atomic<std::uint64_t> counter{0};
        nonce[0] = mix((std::uint64_t)std::chrono::steady_clock::now().time_since_epoch().count());
        nonce[1] = mix(((std::uint64_t)getpid() << 32) ^ ++counter);
    }
    std::memset(unique_id->internal, 0, sizeof unique_id->internal);
    std::memcpy(unique_id->internal, ID_MAGIC, sizeof ID_MAGIC);
    std::uint32_t layout = 1, pid = (std::uint32_t)getpid();
    std::memcpy(unique_id->internal + 8, &layout, sizeof layout);
    std::memcpy(unique_id->internal + 12, &pid, sizeof pid);
    std::snprintf(unique_id->internal + ID_NAME_OFFSET, ID_NAME_BYTES,
                  "/rlhfz-nccl-%u-%016llx%016llx", pid, (unsigned long long)nonce[0],
                  (unsigned long long)nonce[1]);
    return ncclSuccess;
}

extern "C" ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId comm_id,
                                         int rank)
{
    if (!comm)
        return fail(ncclInvalidArgument, "ncclCommInitRank: comm is NULL");
    *comm = nullptr;
    if (nranks < 1 || nranks > MAX_RANKS)
        return fail(ncclInvalidArgument, "ncclCommInitRank: nranks must be in [1, %d] here, not %d",
                    MAX_RANKS, nranks);
    if (rank < 0 || rank >= nranks)
        return fail(ncclInvalidArgument, "ncclCommInitRank: rank must be in [0, %d), not %d",
                    nranks, rank);
    const char *name = comm_id.internal + ID_NAME_OFFSET;
    if (std::memcmp(comm_id.internal, ID_MAGIC, sizeof ID_MAGIC) != 0 ||
        std::memchr(name, '\0', ID_NAME_BYTES) == nullptr || name[0] != '/')
        return fail(ncclInvalidArgument, "ncclCommInitRank: the unique id does not come from this "
                    "library's ncclGetUniqueId");
    int device = -1;
    cudaError_t cuda = cudaGetDevice(&device);
    if (cuda != cudaSuccess)
        return fail(ncclUnhandledCudaError, "ncclCommInitRank: cudaGetDevice failed: %s",
                    cudaGetErrorString(cuda));

    double staging = read_number("RLHFZ_NCCL_SIM_STAGING_BYTES", 1, (double)(1ULL << 32),
                                 (double)DEFAULT_STAGING);
    double timeout_s = read_number("RLHFZ_NCCL_SIM_INIT_TIMEOUT", 0, 1e7, DEFAULT_INIT_TIMEOUT_S);
    std::unique_ptr<Segment> segment;
    ncclResult_t result = Segment::join(name, nranks, rank, device, (std::size_t)staging,
                                        timeout_s, &segment);
    if (result != ncclSuccess)
        return result;

    auto state = std::make_shared<CommState>();
    state->nranks = nranks;
    state->rank = rank;
    state->device = device;
    state->segment = std::move(segment);
    state->chaos.seed(std::getenv("RLHFZ_SIM_CHAOS"), rank);
    ncclComm *handle = new ncclComm{std::move(state)};
    {
        Registry &r = registry();
        std::lock_guard<std::mutex> lock(r.mutex);
        r.live.insert(handle);
    }
    *comm = handle;
    return ncclSuccess;
}

/* ---- teardown -------------------------------------------------------------------------------- */

extern "C" ncclResult_t ncclCommDestroy(ncclComm_t comm)
{
    if (!comm)
        return ncclSuccess;        /* as NCCL's: destroying NULL does nothing */
    ncclComm *handle = unregister(comm, "ncclCommDestroy");
    if (!handle)
        return ncclInvalidArgument;
    std::shared_ptr<CommState> state = std::move(handle->state);
    delete handle;
    std::unique_lock<std::mutex> lock(state->mutex);
    /* every collective queued so far runs (or is skipped after an error) first */
    state->changed.wait(lock, [&] { return state->next_run >= state->next_seq; });
    state->closed = true;
    state->segment.reset();
    return ncclSuccess;
}

extern "C" ncclResult_t ncclCommAbort(ncclComm_t comm)
{
    if (!comm)
        return ncclSuccess;
    ncclComm *handle = unregister(comm, "ncclCommAbort");
    if (!handle)
        return ncclInvalidArgument;
    std::shared_ptr<CommState> state = std::move(handle->state);
    delete handle;
    std::unique_lock<std::mutex> lock(state->mutex);
    state->closed = true;
    state->stop.store(true);
    if (state->segment)
        state->segment->wake();
    state->changed.notify_all();
    /* the running collective notices stop at its next wait (or finishes its
     * arithmetic); nothing it does can block on a peer any more */
    state->changed.wait(lock, [&] { return !state->running; });
    state->segment.reset();
    return ncclSuccess;
}

/* ---- queries --------------------------------------------------------------------------------- */

extern "C" ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async_error)
{
    if (!async_error)
        return fail(ncclInvalidArgument, "ncclCommGetAsyncError: asyncError is NULL");
    std::shared_ptr<CommState> state = lookup(comm, "ncclCommGetAsyncError");
    if (!state)
        return ncclInvalidArgument;
    std::lock_guard<std::mutex> lock(state->mutex);
    *async_error = state->async_error;
    return ncclSuccess;
}

extern "C" ncclResult_t ncclCommCount(const ncclComm_t comm, int *count)
{
    if (!count)
        return fail(ncclInvalidArgument, "ncclCommCount: count is NULL");
    std::shared_ptr<CommState> state = lookup(comm, "ncclCommCount");
    if (!state)
        return ncclInvalidArgument;
    *count = state->nranks;
    return ncclSuccess;
}

extern "C" ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device)
{
    if (!device)
        return fail(ncclInvalidArgument, "ncclCommCuDevice: device is NULL");
    std::shared_ptr<CommState> state = lookup(comm, "ncclCommCuDevice");
    if (!state)
        return ncclInvalidArgument;
    *device = state->device;
    return ncclSuccess;
}

extern "C" ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank)
{
    if (!rank)
        return fail(ncclInvalidArgument, "ncclCommUserRank: rank is NULL");
    std::shared_ptr<CommState> state = lookup(comm, "ncclCommUserRank");
    if (!state)
        return ncclInvalidArgument;
    *rank = state->rank;
    return ncclSuccess;
}
