/* streams.cpp: streams, events and the work queued on them: copies,
 * memsets, host functions (kernels are queued by block_runner.cpp).
 *
 * A created stream is a queue served by a worker thread of its own, so its
 * work really runs apart from the host and from other streams; ordering
 * between them exists only where events say so. With RLHFZ_SIM_CHAOS each
 * queued operation may first be delayed at random: a missing event wait, a
 * host read before a sync, or a buffer reused while a copy is in flight then
 * gives wrong values instead of passing by luck.
 *
 * The default streams (NULL, cudaStreamLegacy, cudaStreamPerThread) run
 * their work inline, in the calling thread: torch's CPU build, which stands
 * in for the GPU side of a program here, is synchronous, so work queued on
 * "torch's current stream" must be finished when its ops run. As the legacy
 * stream does, inline work first waits for the device's blocking streams.
 *
 * Every operand is checked when the operation is queued: device memory must
 * be the stream's device's, the stream the current device's, and the host
 * alias of device memory is never accepted in place of a device pointer.
 */
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "state.h"

struct CUstream_st {
    int device;
    bool blocking;               /* created without cudaStreamNonBlocking */
    bool is_inline;              /* a default stream */
    std::shared_ptr<cudasim::Progress> progress = std::make_shared<cudasim::Progress>();
    std::mutex mutex;
    std::condition_variable wake;
    std::deque<std::function<void()>> queue;
    std::uint64_t submitted = 0;
    bool closing = false;
    std::mt19937_64 chaos;
};

struct CUevent_st {
    int device;
    std::mutex mutex;
    std::shared_ptr<cudasim::Progress> progress;   /* null until recorded */
    std::uint64_t target = 0;
};

namespace cudasim {
namespace {

struct Streams {
    std::mutex mutex;
    std::unordered_set<CUstream_st *> live;
    std::unordered_set<CUevent_st *> events;
    std::vector<CUstream_st *> defaults;           /* one inline stream per device */
    /* Handles of destroyed streams whose memory was freed: a new stream never
     * takes one, so a stale handle stays refused (a GPU may hand it out again
     * and run work on the wrong stream without a word). */
    std::unordered_set<CUstream_st *> retired;
    std::vector<CUstream_st *> spare;              /* allocations kept off those handles */
    std::uint64_t created = 0;
};

Streams &streams()
{
    static Streams *state = [] {
        Streams *s = new Streams;
        for (int d = 0; d < config().devices; d++) {
            CUstream_st *stream = new CUstream_st;
            stream->device = d;
            stream->blocking = false;
            stream->is_inline = true;
            s->defaults.push_back(stream);
        }
        return s;
    }();
    return *state;
}

std::uint64_t mix(std::uint64_t x)
{
    x += 0x9E3779B97F4A7C15ULL;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

/* Before an operation under chaos: often a short delay, now and then a long one. */
void chaos_delay(CUstream_st *stream)
{
    std::uint64_t draw = stream->chaos() % 1000;
    if (draw < 500)
        std::this_thread::sleep_for(std::chrono::microseconds(stream->chaos() % 300));
    else if (draw >= 985)
        std::this_thread::sleep_for(std::chrono::milliseconds(2 + stream->chaos() % 4));
}

void worker(CUstream_st *stream)
{
    for (;;) {
        std::function<void()> work;
        {
            std::unique_lock<std::mutex> lock(stream->mutex);
            stream->wake.wait(lock, [&] { return !stream->queue.empty() || stream->closing; });
            if (stream->queue.empty())
                break;
            work = std::move(stream->queue.front());
            stream->queue.pop_front();
        }
        if (config().chaos)
            chaos_delay(stream);
        work();
        std::lock_guard<std::mutex> lock(stream->progress->mutex);
        stream->progress->completed++;
        stream->progress->changed.notify_all();
    }
    Streams &s = streams();
    {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.retired.insert(stream);
    }
    delete stream;       /* destroyed and drained: nothing refers to it any more */
}

/* The point a wait on the stream's work queued so far must reach. */
std::pair<std::shared_ptr<Progress>, std::uint64_t> mark(CUstream_st *stream)
{
    if (stream->is_inline)
        return {stream->progress, 0};
    std::lock_guard<std::mutex> lock(stream->mutex);
    return {stream->progress, stream->submitted};
}

std::vector<std::pair<std::shared_ptr<Progress>, std::uint64_t>> marks_of(int device,
                                                                         bool blocking_only)
{
    std::vector<CUstream_st *> found;
    {
        Streams &s = streams();
        std::lock_guard<std::mutex> lock(s.mutex);
        for (CUstream_st *stream : s.live)
            if (stream->device == device && (!blocking_only || stream->blocking))
                found.push_back(stream);
        /* marks are taken under the registry lock: a destroyed stream's
         * worker frees it, so it must still be live here */
        std::vector<std::pair<std::shared_ptr<Progress>, std::uint64_t>> out;
        for (CUstream_st *stream : found)
            out.push_back(mark(stream));
        return out;
    }
}

CUevent_st *live_event(cudaEvent_t event)
{
    Streams &s = streams();
    std::lock_guard<std::mutex> lock(s.mutex);
    return s.events.count(event) ? event : nullptr;
}

const char *where_name(Where where)
{
    switch (where) {
    case Where::host: return "pageable host memory";
    case Where::pinned: return "page-locked host memory";
    case Where::device: return "device memory";
    case Where::alias: return "the host alias of device memory (not a device pointer)";
    case Where::freed: return "a freed or out-of-range device address";
    }
    return "unknown memory";
}

/* A copy or memset operand: its usable address, or an error (and why, on
 * stderr) for freed memory, an alias, or another device's memory. */
cudaError_t operand(const char *call, const char *role, const void *ptr, std::size_t nbytes,
                    int device, void **usable, Where *where)
{
    int owner;
    *where = locate(ptr, nbytes, usable, &owner);
    const char *problem = nullptr;
    if (*where == Where::freed || *where == Where::alias)
        problem = where_name(*where);
    else if (*where == Where::device && owner != device)
        problem = "memory of another device than the stream's";
    if (!problem)
        return cudaSuccess;
    std::fprintf(stderr, "cudasim: %s: the %s %p (%zu bytes) is %s (device %d)\n", call, role, ptr,
                 nbytes, problem, owner);
    return cudaErrorInvalidValue;
}

/* The stream for an operation queued now: live, and of the current device. */
CUstream_st *stream_for(const char *call, cudaStream_t handle, cudaError_t *err)
{
    CUstream_st *stream = resolve_stream(handle, err);
    if (stream && stream->device != current_device()) {
        std::fprintf(stderr, "cudasim: %s: the stream belongs to device %d, but device %d is "
                     "current\n", call, stream->device, current_device());
        *err = cudaErrorInvalidResourceHandle;
        return nullptr;
    }
    return stream;
}

} /* namespace */

void Progress::wait_for(std::uint64_t target)
{
    std::unique_lock<std::mutex> lock(mutex);
    changed.wait(lock, [&] { return completed >= target; });
}

Stream *resolve_stream(cudaStream_t handle, cudaError_t *err)
{
    Streams &s = streams();
    if (handle == nullptr || handle == cudaStreamLegacy || handle == cudaStreamPerThread) {
        int device = current_device();
        if ((*err = check_device(device)) != cudaSuccess)
            return nullptr;
        return s.defaults[(std::size_t)device];
    }
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.live.count(handle)) {
        *err = cudaErrorInvalidResourceHandle;
        return nullptr;
    }
    *err = cudaSuccess;
    return handle;
}

int stream_device(const Stream *stream)
{
    return stream->device;
}

void synchronize_device(int device)
{
    for (auto &[progress, target] : marks_of(device, false))
        progress->wait_for(target);
}

void enqueue(Stream *stream, std::function<void()> work)
{
    if (stream->is_inline) {
        for (auto &[progress, target] : marks_of(stream->device, true))
            progress->wait_for(target);
        work();
        return;
    }
    std::lock_guard<std::mutex> lock(stream->mutex);
    stream->queue.push_back(std::move(work));
    stream->submitted++;
    stream->wake.notify_one();
}

std::uint64_t chaos_seed_for(Stream *stream)
{
    static std::atomic<std::uint64_t> launches{0};
    if (!config().chaos)
        return 0;
    return mix(config().chaos_seed ^ mix(++launches) ^ (std::uint64_t)stream->device) | 1;
}

} /* namespace cudasim */

using namespace cudasim;

/* ---- streams ------------------------------------------------------------------------------------ */

extern "C" cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags)
{
    cudaError_t err = enter("cudaStreamCreateWithFlags");
    if (err != cudaSuccess)
        return err;
    if (!stream || (flags & ~(unsigned)cudaStreamNonBlocking))
        return fail(cudaErrorInvalidValue);
    int device = current_device();
    if ((err = check_device(device)) != cudaSuccess)
        return fail(err);
    CUstream_st *created = new CUstream_st;
    Streams &s = streams();
    {
        std::lock_guard<std::mutex> lock(s.mutex);
        while (s.retired.count(created)) {
            s.spare.push_back(created);
            created = new CUstream_st;
        }
        created->device = device;
        created->blocking = !(flags & cudaStreamNonBlocking);
        created->is_inline = false;
        created->chaos.seed(mix(config().chaos_seed ^ mix(++s.created)));
        s.live.insert(created);
    }
    std::thread(worker, created).detach();
    *stream = created;
    return cudaSuccess;
}

extern "C" cudaError_t cudaStreamCreate(cudaStream_t *stream)
{
    return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

/* As the runtime's: returns at once; the work already queued still runs. */
extern "C" cudaError_t cudaStreamDestroy(cudaStream_t stream)
{
    cudaError_t err = enter("cudaStreamDestroy");
    if (err != cudaSuccess)
        return err;
    Streams &s = streams();
    {
        std::lock_guard<std::mutex> lock(s.mutex);
        if (!stream || !s.live.erase(stream))
            return fail(cudaErrorInvalidResourceHandle);
    }
    std::lock_guard<std::mutex> lock(stream->mutex);
    stream->closing = true;
    stream->wake.notify_one();
    return cudaSuccess;
}

extern "C" cudaError_t cudaStreamSynchronize(cudaStream_t handle)
{
    cudaError_t err = enter("cudaStreamSynchronize");
    if (err != cudaSuccess)
        return err;
    CUstream_st *stream = resolve_stream(handle, &err);
    if (!stream)
        return fail(err);
    auto [progress, target] = mark(stream);
    int device = stream->device;
    progress->wait_for(target);
    if ((err = sticky(device)) != cudaSuccess)
        return fail(err);
    return cudaSuccess;
}

extern "C" cudaError_t cudaStreamQuery(cudaStream_t handle)
{
    cudaError_t err = enter("cudaStreamQuery");
    if (err != cudaSuccess)
        return err;
    CUstream_st *stream = resolve_stream(handle, &err);
    if (!stream)
        return fail(err);
    auto [progress, target] = mark(stream);
    std::lock_guard<std::mutex> lock(progress->mutex);
    return progress->completed >= target ? cudaSuccess : cudaErrorNotReady;
}

extern "C" cudaError_t cudaDeviceSynchronize(void)
{
    cudaError_t err = enter("cudaDeviceSynchronize");
    if (err != cudaSuccess)
        return err;
    int device = current_device();
    if ((err = check_device(device)) != cudaSuccess)
        return fail(err);
    synchronize_device(device);
    if ((err = sticky(device)) != cudaSuccess)
        return fail(err);
    return cudaSuccess;
}

extern "C" cudaError_t cudaLaunchHostFunc(cudaStream_t handle, cudaHostFn_t fn, void *user_data)
{
    cudaError_t err = enter("cudaLaunchHostFunc");
    if (err != cudaSuccess)
        return err;
    if (!fn)
        return fail(cudaErrorInvalidValue);
    CUstream_st *stream = stream_for("cudaLaunchHostFunc", handle, &err);
    if (!stream)
        return fail(err);
    enqueue(stream, [fn, user_data] { fn(user_data); });
    return cudaSuccess;
}

namespace {

struct Gate {
    std::mutex mutex;
    std::condition_variable opened;
    bool open = false;
};

struct Gates {
    std::mutex mutex;
    std::unordered_map<unsigned long long, std::shared_ptr<Gate>> held;
    unsigned long long next = 1;
};

Gates &gates()
{
    static Gates *state = new Gates;
    return *state;
}

} /* namespace */

extern "C" cudaError_t cudasim_stream_hold(cudaStream_t handle, unsigned long long *token)
{
    cudaError_t err;
    if (!token)
        return cudaErrorInvalidValue;
    CUstream_st *stream = resolve_stream(handle, &err);
    if (!stream)
        return err;
    if (stream->is_inline)
        return cudaErrorInvalidValue;     /* it would block the caller for good */
    auto gate = std::make_shared<Gate>();
    {
        Gates &g = gates();
        std::lock_guard<std::mutex> lock(g.mutex);
        *token = g.next++;
        g.held[*token] = gate;
    }
    enqueue(stream, [gate] {
        std::unique_lock<std::mutex> lock(gate->mutex);
        gate->opened.wait(lock, [&] { return gate->open; });
    });
    return cudaSuccess;
}

extern "C" cudaError_t cudasim_stream_release(unsigned long long token)
{
    std::shared_ptr<Gate> gate;
    {
        Gates &g = gates();
        std::lock_guard<std::mutex> lock(g.mutex);
        auto found = g.held.find(token);
        if (found == g.held.end())
            return cudaErrorInvalidValue;
        gate = found->second;
        g.held.erase(found);
    }
    std::lock_guard<std::mutex> lock(gate->mutex);
    gate->open = true;
    gate->opened.notify_all();
    return cudaSuccess;
}

extern "C" cudaError_t cudasim_stream_device(cudaStream_t handle, int *device)
{
    cudaError_t err;
    if (!device)
        return cudaErrorInvalidValue;
    CUstream_st *stream = resolve_stream(handle, &err);
    if (!stream)
        return err;
    *device = stream->device;
    return cudaSuccess;
}

/* ---- copies and memsets ------------------------------------------------------------------------- */

extern "C" cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count,
                                       enum cudaMemcpyKind kind, cudaStream_t handle)
{
    cudaError_t err = enter("cudaMemcpyAsync");
    if (err != cudaSuccess)
        return err;
    CUstream_st *stream = stream_for("cudaMemcpyAsync", handle, &err);
    if (!stream)
        return fail(err);
    if ((int)kind < 0 || (int)kind > 4)
        return fail(cudaErrorInvalidMemcpyDirection);
    if (count == 0)
        return cudaSuccess;
    if (!dst || !src)
        return fail(cudaErrorInvalidValue);
    void *to, *from;
    Where dst_where, src_where;
    if ((err = operand("cudaMemcpyAsync", "destination", dst, count, stream->device, &to,
                       &dst_where)) != cudaSuccess ||
        (err = operand("cudaMemcpyAsync", "source", src, count, stream->device, &from,
                       &src_where)) != cudaSuccess)
        return fail(err);
    if (kind != cudaMemcpyDefault) {
        bool dst_device = dst_where == Where::device, src_device = src_where == Where::device;
        bool wanted_dst = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
        bool wanted_src = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
        if (dst_device != wanted_dst || src_device != wanted_src) {
            std::fprintf(stderr, "cudasim: cudaMemcpyAsync: kind %d, but the source is %s and "
                         "the destination %s\n", (int)kind, where_name(src_where),
                         where_name(dst_where));
            return fail(cudaErrorInvalidMemcpyDirection);
        }
    }
    const char *d = (const char *)to, *s = (const char *)from;
    if (d < s + count && s < d + count) {
        std::fprintf(stderr, "cudasim: cudaMemcpyAsync: source %p and destination %p overlap "
                     "(%zu bytes)\n", src, dst, count);
        return fail(cudaErrorInvalidValue);
    }
    enqueue(stream, [to, from, count] { std::memcpy(to, from, count); });
    return cudaSuccess;
}

extern "C" cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
    cudaError_t err = cudaMemcpyAsync(dst, src, count, kind, nullptr);
    return err != cudaSuccess ? err : cudaStreamSynchronize(nullptr);
}

extern "C" cudaError_t cudaMemsetAsync(void *ptr, int value, size_t count, cudaStream_t handle)
{
    cudaError_t err = enter("cudaMemsetAsync");
    if (err != cudaSuccess)
        return err;
    CUstream_st *stream = stream_for("cudaMemsetAsync", handle, &err);
    if (!stream)
        return fail(err);
    if (count == 0)
        return cudaSuccess;
    void *usable;
    Where where;
    if ((err = operand("cudaMemsetAsync", "target", ptr, count, stream->device, &usable,
                       &where)) != cudaSuccess)
        return fail(err);
    if (where != Where::device) {
        std::fprintf(stderr, "cudasim: cudaMemsetAsync: %p is %s, not device memory\n", ptr,
                     where_name(where));
        return fail(cudaErrorInvalidValue);
    }
    enqueue(stream, [usable, value, count] { std::memset(usable, value, count); });
    return cudaSuccess;
}

extern "C" cudaError_t cudaMemset(void *ptr, int value, size_t count)
{
    cudaError_t err = cudaMemsetAsync(ptr, value, count, nullptr);
    return err != cudaSuccess ? err : cudaStreamSynchronize(nullptr);
}

/* ---- events --------------------------------------------------------------------------------------- */

extern "C" cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags)
{
    cudaError_t err = enter("cudaEventCreateWithFlags");
    if (err != cudaSuccess)
        return err;
    if (!event || (flags & ~0x7u))
        return fail(cudaErrorInvalidValue);
    int device = current_device();
    if ((err = check_device(device)) != cudaSuccess)
        return fail(err);
    CUevent_st *created = new CUevent_st;
    created->device = device;
    Streams &s = streams();
    std::lock_guard<std::mutex> lock(s.mutex);
    s.events.insert(created);
    *event = created;
    return cudaSuccess;
}

extern "C" cudaError_t cudaEventCreate(cudaEvent_t *event)
{
    return cudaEventCreateWithFlags(event, cudaEventDefault);
}

extern "C" cudaError_t cudaEventDestroy(cudaEvent_t event)
{
    cudaError_t err = enter("cudaEventDestroy");
    if (err != cudaSuccess)
        return err;
    Streams &s = streams();
    {
        std::lock_guard<std::mutex> lock(s.mutex);
        if (!event || !s.events.erase(event))
            return fail(cudaErrorInvalidResourceHandle);
    }
    delete event;      /* waits already queued hold the progress they need, not the event */
    return cudaSuccess;
}

extern "C" cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t handle)
{
    cudaError_t err = enter("cudaEventRecord");
    if (err != cudaSuccess)
        return err;
    CUevent_st *e = live_event(event);
    if (!e)
        return fail(cudaErrorInvalidResourceHandle);
    CUstream_st *stream = stream_for("cudaEventRecord", handle, &err);
    if (!stream)
        return fail(err);
    if (stream->device != e->device) {
        std::fprintf(stderr, "cudasim: cudaEventRecord: an event of device %d on a stream of "
                     "device %d\n", e->device, stream->device);
        return fail(cudaErrorInvalidResourceHandle);
    }
    auto [progress, target] = mark(stream);
    std::lock_guard<std::mutex> lock(e->mutex);
    e->progress = progress;
    e->target = target;
    return cudaSuccess;
}

extern "C" cudaError_t cudaStreamWaitEvent(cudaStream_t handle, cudaEvent_t event,
                                           unsigned int flags)
{
    cudaError_t err = enter("cudaStreamWaitEvent");
    if (err != cudaSuccess)
        return err;
    if (flags != 0)
        return fail(cudaErrorInvalidValue);
    CUevent_st *e = live_event(event);
    if (!e)
        return fail(cudaErrorInvalidResourceHandle);
    CUstream_st *stream = stream_for("cudaStreamWaitEvent", handle, &err);
    if (!stream)
        return fail(err);
    std::shared_ptr<Progress> progress;
    std::uint64_t target;
    {
        std::lock_guard<std::mutex> lock(e->mutex);
        progress = e->progress;
        target = e->target;
    }
    if (!progress)
        return cudaSuccess;        /* never recorded: nothing to wait for */
    enqueue(stream, [progress, target] { progress->wait_for(target); });
    return cudaSuccess;
}

extern "C" cudaError_t cudaEventQuery(cudaEvent_t event)
{
    cudaError_t err = enter("cudaEventQuery");
    if (err != cudaSuccess)
        return err;
    CUevent_st *e = live_event(event);
    if (!e)
        return fail(cudaErrorInvalidResourceHandle);
    std::lock_guard<std::mutex> lock(e->mutex);
    if (!e->progress)
        return cudaSuccess;
    std::lock_guard<std::mutex> progress_lock(e->progress->mutex);
    return e->progress->completed >= e->target ? cudaSuccess : cudaErrorNotReady;
}

extern "C" cudaError_t cudaEventSynchronize(cudaEvent_t event)
{
    cudaError_t err = enter("cudaEventSynchronize");
    if (err != cudaSuccess)
        return err;
    CUevent_st *e = live_event(event);
    if (!e)
        return fail(cudaErrorInvalidResourceHandle);
    std::shared_ptr<Progress> progress;
    std::uint64_t target;
    int device;
    {
        std::lock_guard<std::mutex> lock(e->mutex);
        progress = e->progress;
        target = e->target;
        device = e->device;
    }
    if (progress)
        progress->wait_for(target);
    if ((err = sticky(device)) != cudaSuccess)
        return fail(err);
    return cudaSuccess;
}
