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
#include <cstddef>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
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

namespace ncclsim {
namespace {

constexpr std::size_t CONFIG_2_14_BYTES = offsetof(ncclConfig_t, netName) + sizeof(const char *);
/* how long a non-blocking collective stays ncclInProgress */
constexpr auto SETTLE_TIME = std::chrono::microseconds(200);

void register_handle(ncclComm *handle)
{
    Registry &r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    r.live.insert(handle);
}

/* Reads a config as NCCL does: its own size and version say which fields it has. */
ncclResult_t read_config(const ncclConfig_t *config, bool *blocking)
{
    *blocking = true;
    if (!config)
        return ncclSuccess;
    if (config->magic != NCCL_API_MAGIC)
        return fail(ncclInvalidArgument, "ncclCommInitRankConfig: the config's magic is 0x%x, "
                    "not NCCL_API_MAGIC: it was not initialized with NCCL_CONFIG_INITIALIZER",
                    config->magic);
    if (config->version < (unsigned)NCCL_VERSION(2, 14, 0) || config->size < CONFIG_2_14_BYTES)
        return fail(ncclInvalidArgument, "ncclCommInitRankConfig: a config of version %u and "
                    "%zu bytes is older than NCCL 2.14's (%zu bytes)", config->version,
                    config->size, CONFIG_2_14_BYTES);
    int value = config->blocking;
    if (value != 0 && value != 1 && value != NCCL_CONFIG_UNDEF_INT)
        return fail(ncclInvalidArgument, "ncclCommInitRankConfig: blocking must be 0 or 1, not %d",
                    value);
    *blocking = value != 0;
    return ncclSuccess;
}

ncclResult_t init(ncclComm_t *comm, int nranks, const ncclUniqueId &comm_id, int rank,
                  const ncclConfig_t *config, const char *function)
{
    if (!comm)
        return fail(ncclInvalidArgument, "%s: comm is NULL", function);
    *comm = nullptr;
    if (nranks < 1 || nranks > MAX_RANKS)
        return fail(ncclInvalidArgument, "%s: nranks must be in [1, %d] here, not %d", function,
                    MAX_RANKS, nranks);
    if (rank < 0 || rank >= nranks)
        return fail(ncclInvalidArgument, "%s: rank must be in [0, %d), not %d", function,
                    nranks, rank);
    bool blocking = true;
    ncclResult_t result = read_config(config, &blocking);
    if (result != ncclSuccess)
        return result;
    const char *name = comm_id.internal + ID_NAME_OFFSET;
    if (std::memcmp(comm_id.internal, ID_MAGIC, sizeof ID_MAGIC) != 0 ||
        std::memchr(name, '\0', ID_NAME_BYTES) == nullptr || name[0] != '/')
        return fail(ncclInvalidArgument, "%s: the unique id does not come from this library's "
                    "ncclGetUniqueId", function);
    int device = -1;
    cudaError_t cuda = cudaGetDevice(&device);
    if (cuda != cudaSuccess)
        return fail(ncclUnhandledCudaError, "%s: cudaGetDevice failed: %s", function,
                    cudaGetErrorString(cuda));

    double staging = read_number("RLHFZ_NCCL_SIM_STAGING_BYTES", 1, (double)(1ULL << 32),
                                 (double)DEFAULT_STAGING);
    double timeout_s = read_number("RLHFZ_NCCL_SIM_INIT_TIMEOUT", 0, 1e7, DEFAULT_INIT_TIMEOUT_S);
    auto state = std::make_shared<CommState>();
    state->nranks = nranks;
    state->rank = rank;
    state->device = device;
    state->chaos.seed(std::getenv("RLHFZ_SIM_CHAOS"), rank);
    if (blocking) {
        result = Segment::join(name, nranks, rank, device, (std::size_t)staging, timeout_s,
                               nullptr, &state->segment);
        if (result != ncclSuccess)
            return result;
        ncclComm *handle = new ncclComm{std::move(state)};
        register_handle(handle);
        *comm = handle;
        return ncclSuccess;
    }
    /* Non-blocking: the handle first, then the ranks join on a thread of
     * their own, which an abort stops. */
    state->nonblocking = true;
    state->initializing = true;
    std::string segment_name(name);
    std::thread([state, segment_name, nranks, rank, device, staging, timeout_s] {
        std::unique_ptr<Segment> segment;
        ncclResult_t joined = Segment::join(segment_name.c_str(), nranks, rank, device,
                                            (std::size_t)staging, timeout_s, &state->stop,
                                            &segment);
        std::lock_guard<std::mutex> lock(state->mutex);
        if (joined == ncclSuccess && !state->closed)
            state->segment = std::move(segment);
        state->init_result = joined;
        if (joined != ncclSuccess)
            std::snprintf(state->init_error, sizeof state->init_error, "%s", last_error);
        state->initializing = false;
        state->changed.notify_all();
    }).detach();
    ncclComm *handle = new ncclComm{std::move(state)};
    register_handle(handle);
    *comm = handle;
    return ncclInProgress;
}

} /* namespace */

ncclResult_t CommState::async_state_locked() const
{
    if (initializing)
        return ncclInProgress;
    if (init_result != ncclSuccess)
        return init_result;
    if (async_error != ncclSuccess)
        return async_error;
    if (nonblocking && std::chrono::steady_clock::now() < settles_at)
        return ncclInProgress;
    return ncclSuccess;
}

ncclResult_t refuse_unsettled(CommState &state, const char *function)
{
    std::lock_guard<std::mutex> lock(state.mutex);
    ncclResult_t now = state.async_state_locked();
    if (now == ncclInProgress)
        return fail(ncclInvalidUsage, "%s: the communicator's %s is still in progress: poll "
                    "ncclCommGetAsyncError until it says ncclSuccess before the next call",
                    function, state.initializing ? "init" : "last call");
    if (state.init_result != ncclSuccess)
        return fail(ncclInvalidUsage, "%s: the communicator's init failed (%s): abort it",
                    function, state.init_error);
    return ncclSuccess;
}

ncclResult_t settle_later(CommState &state)
{
    if (!state.nonblocking)
        return ncclSuccess;
    double settle_us = read_number("RLHFZ_NCCL_SIM_SETTLE_US", 0, 1e10,
                                   (double)SETTLE_TIME.count());
    std::lock_guard<std::mutex> lock(state.mutex);
    state.settles_at = std::chrono::steady_clock::now() +
                       std::chrono::microseconds((long long)settle_us);
    return ncclInProgress;
}

} /* namespace ncclsim */

extern "C" ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId comm_id,
                                         int rank)
{
    return init(comm, nranks, comm_id, rank, nullptr, "ncclCommInitRank");
}

extern "C" ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId comm_id,
                                               int rank, ncclConfig_t *config)
{
    return init(comm, nranks, comm_id, rank, config, "ncclCommInitRankConfig");
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
    /* a non-blocking init finishes first (NCCL's destroy waits for it too) */
    state->changed.wait(lock, [&] { return !state->initializing; });
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
     * arithmetic), and a non-blocking init at its next look; nothing either
     * does can block on a peer any more */
    state->changed.wait(lock, [&] { return !state->running && !state->initializing; });
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
    *async_error = state->async_state_locked();
    if (*async_error == state->init_result && state->init_result != ncclSuccess)
        fail(state->init_result, "%s", state->init_error);   /* the init thread's words, here */
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
