/* state.h: what the files of the simulated CUDA runtime share (internal).
 *
 * One process-wide state, created at the first runtime call and never torn
 * down (stream workers may still run while the process exits). Every API
 * entry goes through enter(), which counts the call, injects a configured
 * failure, and returns a device's sticky error once a kernel has faulted.
 */
#ifndef CUDASIM_STATE_H
#define CUDASIM_STATE_H

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <random>

#include "cudasim.h"

namespace cudasim {

/* ---- configuration (devices.cpp) -------------------------------------------------- */

struct Config {
    int devices = 1;
    std::size_t device_bytes = std::size_t(4) << 30;
    std::size_t pinned_limit = 0;        /* 0: no limit */
    bool chaos = false;
    std::uint64_t chaos_seed = 0;
    int multiprocessors = 4;             /* per device, for occupancy queries */
    int threads_per_multiprocessor = 2048;
};

const Config &config();
int current_device();
cudaError_t check_device(int device);

/* ---- errors, call counts and injected failures (errors.cpp) ----------------------- */

/* Records err as this thread's last error and returns it. */
cudaError_t fail(cudaError_t err);
/* Counts a call of `name`; returns the failure to inject now, or cudaSuccess. */
cudaError_t count_call(const char *name);
/* count_call(name), then the current device's sticky error; a failure is
 * recorded as the last error. What every API entry does first. */
cudaError_t enter(const char *name);
/* A kernel fault: every later call on the device fails with err, as on a GPU
 * whose context is lost. Prints why, once, to stderr. */
void set_sticky(int device, cudaError_t err, const char *why);
cudaError_t sticky(int device);

/* ---- memory (device_memory.cpp) ------------------------------------------------- */

enum class Where { host, pinned, device, alias, freed };

/* Where [ptr, ptr + nbytes) lies. For device memory (and an alias of it),
 * *usable is the host-accessible address and *device its ordinal; for host
 * and pinned memory *usable is ptr. `freed` is a device range no longer
 * allocated (or straddling the end of an allocation). */
Where locate(const void *ptr, std::size_t nbytes, void **usable, int *device);

/* ---- streams (streams.cpp) --------------------------------------------------------- */

struct Progress {
    std::mutex mutex;
    std::condition_variable changed;
    std::uint64_t completed = 0;

    void wait_for(std::uint64_t target);
};

using Stream = ::CUstream_st;

/* The stream behind a handle, or nullptr with *err set: NULL, the legacy and
 * the per-thread handles are the current device's default stream, which
 * runs work inline (synchronously, in the calling thread). */
Stream *resolve_stream(cudaStream_t handle, cudaError_t *err);
int stream_device(const Stream *stream);
/* Waits for the work queued so far on every stream of the device. */
void synchronize_device(int device);
/* Queues work on the stream; inline streams run it now. */
void enqueue(Stream *stream, std::function<void()> work);
/* The seed for a launch's block and thread order under chaos (0: in order). */
std::uint64_t chaos_seed_for(Stream *stream);

/* ---- kernels (block_runner.cpp) -------------------------------------------------------- */

/* Runs a whole grid on this OS thread. Returns false (with why) if a block's
 * threads did not all reach the same barriers, or its shared memory is over
 * the limit. */
bool run_grid(dim3 grid, dim3 block, std::size_t dynamic_shared, void (*run)(void *),
              void *closure, std::uint64_t order_seed, const char **why);
/* The device of the kernel this OS thread is running (and *name its name),
 * or -1 outside a kernel. */
int running_kernel(const char **name);

} /* namespace cudasim */

#endif /* CUDASIM_STATE_H */
