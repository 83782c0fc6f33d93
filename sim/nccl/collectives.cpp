/* collectives.cpp: ncclAllReduce, ncclReduceScatter, ncclAllGather,
 * ncclBroadcast and the group calls of the NCCL stand-in.
 *
 * A call checks every argument against the simulated runtime before
 * anything is queued: the communicator is live, the stream belongs to the
 * communicator's device, and every byte of every buffer is live device
 * memory of that device (a host pointer, the host alias of device memory,
 * a freed range or another device's memory is ncclInvalidArgument, with
 * ncclGetLastError saying which). Then the collective is queued on the
 * stream with cudaLaunchHostFunc, so it runs in stream order with the
 * kernels and copies around it. Between ncclGroupStart and ncclGroupEnd
 * calls are only checked; ncclGroupEnd queues them, in order.
 *
 * A communicator runs its collectives one at a time, in the order they were
 * queued (each gets a number), whatever streams they are on: NCCL does the
 * same, making a collective on another stream than the communicator's last
 * one wait for that one (cudaStreamWaitEvent on its done event before 2.12,
 * its internal "device stream" since). Within a group, the calls on one
 * communicator must share a stream, as NCCL 2.10 and 2.11 require (later
 * versions join the streams). One runs in
 * chunks of at most the staging area: each rank stages its part of a chunk,
 * the ranks step together, each rank computes its output from every rank's
 * staging, and the ranks step together again before the area is reused.
 * The first step also compares the ranks' descriptors: ranks that called
 * different collectives get ncclInvalidUsage as the communicator's
 * asynchronous error (NCCL would hang or compute garbage).
 */
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "cudasim.h"
#include "internal.h"

namespace ncclsim {

namespace {

struct Collective {
    const char *function;
    Kind kind;
    ncclDataType_t dtype;
    ncclRedOp_t op;
    std::size_t count;           /* NCCL's count: per rank for reduce-scatter and all-gather */
    int root;
    const char *send;            /* host aliases; send is null where it is not read */
    char *recv;
    cudaStream_t stream;
    std::shared_ptr<CommState> comm;
    std::uint64_t seq = 0;
};

/* The calls made between ncclGroupStart and ncclGroupEnd on this thread. */
struct Group {
    int depth = 0;
    std::vector<std::unique_ptr<Collective>> pending;
    ncclResult_t error = ncclSuccess;
};

thread_local Group group;

/* Makes `device` current for the guard's lifetime (NCCL works on its
 * communicator's device whatever the caller's current one is). */
class DeviceGuard {
public:
    explicit DeviceGuard(int device)
    {
        if (cudaGetDevice(&previous_) == cudaSuccess && previous_ != device &&
            cudaSetDevice(device) == cudaSuccess)
            switched_ = true;
    }
    ~DeviceGuard()
    {
        if (switched_)
            cudaSetDevice(previous_);
    }
    DeviceGuard(const DeviceGuard &) = delete;
    DeviceGuard &operator=(const DeviceGuard &) = delete;

private:
    int previous_ = -1;
    bool switched_ = false;
};

/* ---- argument checks -------------------------------------------------------------------- */

/* The host alias of a buffer argument: nbytes of live device memory of `device`. */
ncclResult_t buffer_alias(const char *function, const char *role, const void *ptr,
                          std::size_t nbytes, int device, void **alias)
{
    int owner = -1;
    if (!ptr)
        return fail(ncclInvalidArgument, "%s: %s is NULL", function, role);
    if (cudasim_host_alias(ptr, nbytes, alias, &owner) == cudaSuccess) {
        if (owner == device)
            return ncclSuccess;
        return fail(ncclInvalidArgument, "%s: %s %p is memory of device %d, but the communicator "
                    "is on device %d", function, role, ptr, owner, device);
    }
    void *ignored;
    if (cudasim_host_alias(ptr, 1, &ignored, &owner) == cudaSuccess)
        return fail(ncclInvalidArgument, "%s: %s %p starts in device memory, but its %zu bytes run "
                    "past the end of the allocation", function, role, ptr, nbytes);
    if (cudasim_device_pointer(ptr, 1, &ignored, &owner) == cudaSuccess)
        return fail(ncclInvalidArgument, "%s: %s %p is the host alias of device memory, not a "
                    "device pointer", function, role, ptr);
    return fail(ncclInvalidArgument, "%s: %s %p (%zu bytes) is not live device memory: host "
                "memory, or a freed device allocation", function, role, ptr, nbytes);
}

/* Checks a call and makes its Collective (*out stays null for a call with
 * nothing to do: count 0). */
ncclResult_t prepare(const char *function, Kind kind, const void *send, void *recv,
                     std::size_t count, ncclDataType_t dtype, ncclRedOp_t op, int root,
                     ncclComm_t comm, cudaStream_t stream, std::unique_ptr<Collective> *out)
{
    std::shared_ptr<CommState> state = lookup(comm, function);
    if (!state)
        return ncclInvalidArgument;
    ncclResult_t unsettled = refuse_unsettled(*state, function);
    if (unsettled != ncclSuccess)
        return unsettled;
    std::size_t item = dtype_size(dtype);
    if (item == 0)
        return fail(ncclInvalidArgument, "%s: datatype %d is not an ncclDataType_t", function,
                    (int)dtype);
    bool reduces = kind == Kind::all_reduce || kind == Kind::reduce_scatter;
    if (reduces && !valid_op(op))
        return fail(ncclInvalidArgument, "%s: op %d is not an ncclRedOp_t", function, (int)op);
    int nranks = state->nranks, rank = state->rank;
    if (kind == Kind::broadcast && (root < 0 || root >= nranks))
        return fail(ncclInvalidArgument, "%s: root %d is not a rank of the communicator (0..%d)",
                    function, root, nranks - 1);
    if (count > SIZE_MAX / item / (std::size_t)nranks)
        return fail(ncclInvalidArgument, "%s: count %zu overflows the address space", function,
                    count);

    DeviceGuard on_device(state->device);
    int stream_device = -1;
    if (cudasim_stream_device(stream, &stream_device) != cudaSuccess)
        return fail(ncclInvalidArgument, "%s: stream %p is not a live CUDA stream", function,
                    (void *)stream);
    if (stream_device != state->device)
        return fail(ncclInvalidArgument, "%s: stream %p belongs to device %d, but the "
                    "communicator is on device %d", function, (void *)stream, stream_device,
                    state->device);
    if (count == 0)
        return ncclSuccess;

    std::size_t part = count * item;
    std::size_t send_bytes = kind == Kind::reduce_scatter ? part * nranks : part;
    std::size_t recv_bytes = kind == Kind::all_gather ? part * nranks : part;
    bool reads_send = kind != Kind::broadcast || root == rank;
    void *send_alias = nullptr, *recv_alias = nullptr;
    ncclResult_t result;
    if (reads_send && (result = buffer_alias(function, "sendbuff", send, send_bytes,
                                             state->device, &send_alias)) != ncclSuccess)
        return result;
    if ((result = buffer_alias(function, "recvbuff", recv, recv_bytes, state->device,
                               &recv_alias)) != ncclSuccess)
        return result;
    if (reads_send) {
        /* in place is the only overlap NCCL defines */
        const char *s = (const char *)send, *r = (const char *)recv;
        std::size_t offset = (std::size_t)rank * part;
        bool in_place = kind == Kind::reduce_scatter ? r == s + offset
                        : kind == Kind::all_gather   ? s == r + offset
                                                     : s == r;
        if (!in_place && s < r + recv_bytes && r < s + send_bytes)
            return fail(ncclInvalidArgument, "%s: sendbuff %p (%zu bytes) and recvbuff %p (%zu "
                        "bytes) overlap, and not as the in-place form of the call", function,
                        send, send_bytes, recv, recv_bytes);
    }
    *out = std::unique_ptr<Collective>(new Collective{
        function, kind, dtype, reduces ? op : ncclSum, count, kind == Kind::broadcast ? root : 0,
        (const char *)send_alias, (char *)recv_alias, stream, std::move(state)});
    return ncclSuccess;
}

/* ---- running a collective ----------------------------------------------------------------- */

bool same(const Descriptor &a, const Descriptor &b)
{
    return a.kind == b.kind && a.dtype == b.dtype && a.op == b.op && a.root == b.root &&
           a.count == b.count;
}

const char *kind_name(Kind kind)
{
    switch (kind) {
    case Kind::all_reduce: return "ncclAllReduce";
    case Kind::reduce_scatter: return "ncclReduceScatter";
    case Kind::all_gather: return "ncclAllGather";
    case Kind::broadcast: return "ncclBroadcast";
    }
    return "a collective";
}

/* Every rank compares every descriptor with rank 0's, so all of them reach
 * the same verdict. */
ncclResult_t check_descriptors(const CommState &state)
{
    const Segment &segment = *state.segment;
    const Descriptor &first = segment.descriptor(0);
    for (int peer = 1; peer < state.nranks; peer++) {
        const Descriptor &theirs = segment.descriptor(peer);
        if (same(theirs, first))
            continue;
        std::fprintf(stderr, "nccl (simulated): rank %d: the ranks called different collectives "
                     "(rank 0: %s of %llu x %s, op %s, root %d; rank %d: %s of %llu x %s, op %s, "
                     "root %d); the communicator is broken (ncclInvalidUsage)\n",
                     state.rank, kind_name(first.kind), (unsigned long long)first.count,
                     dtype_name((ncclDataType_t)first.dtype), op_name((ncclRedOp_t)first.op),
                     first.root, peer, kind_name(theirs.kind), (unsigned long long)theirs.count,
                     dtype_name((ncclDataType_t)theirs.dtype), op_name((ncclRedOp_t)theirs.op),
                     theirs.root);
        return ncclInvalidUsage;
    }
    return ncclSuccess;
}

enum class Outcome { done, stopped, broken };

/* All ranks reach the next step, or abort stops the wait. */
bool step_together(CommState &state)
{
    state.segment->arrive(++state.step);
    return state.segment->wait_all(state.step, state.stop);
}

Outcome execute(CommState &state, const Collective &c)
{
    Segment &segment = *state.segment;
    const int nranks = state.nranks, rank = state.rank;
    const std::size_t item = dtype_size(c.dtype);
    const std::size_t staging_items = segment.staging_bytes() / item;
    const std::size_t chunk_items =
        c.kind == Kind::reduce_scatter ? staging_items / (std::size_t)nranks : staging_items;

    segment.descriptor(rank) = Descriptor{c.kind, (std::uint32_t)c.dtype, (std::uint32_t)c.op,
                                          c.root, (std::uint64_t)c.count};
    std::vector<const char *> sources((std::size_t)nranks);
    char *mine = segment.staging(rank);
    bool first = true;
    for (std::size_t done = 0; done < c.count;) {
        const std::size_t n = c.count - done < chunk_items ? c.count - done : chunk_items;
        const std::size_t bytes = n * item, at = done * item;
        state.chaos.maybe_delay();

        /* stage this rank's part of the chunk */
        switch (c.kind) {
        case Kind::all_reduce:
        case Kind::all_gather:
            std::memcpy(mine, c.send + at, bytes);
            break;
        case Kind::reduce_scatter:
            /* one slice per destination rank */
            for (int r = 0; r < nranks; r++)
                std::memcpy(mine + (std::size_t)r * bytes,
                            c.send + (std::size_t)r * c.count * item + at, bytes);
            break;
        case Kind::broadcast:
            if (rank == c.root)
                std::memcpy(mine, c.send + at, bytes);
            break;
        }
        if (!step_together(state))
            return Outcome::stopped;
        if (first && check_descriptors(state) != ncclSuccess)
            return Outcome::broken;
        first = false;
        state.chaos.maybe_delay();

        /* compute this rank's output from every rank's staging */
        switch (c.kind) {
        case Kind::all_reduce:
            for (int r = 0; r < nranks; r++)
                sources[(std::size_t)r] = segment.staging(r);
            reduce(c.dtype, c.op, nranks, sources.data(), c.recv + at, n);
            break;
        case Kind::reduce_scatter:
            for (int r = 0; r < nranks; r++)
                sources[(std::size_t)r] = segment.staging(r) + (std::size_t)rank * bytes;
            reduce(c.dtype, c.op, nranks, sources.data(), c.recv + at, n);
            break;
        case Kind::all_gather:
            for (int r = 0; r < nranks; r++)
                std::memcpy(c.recv + (std::size_t)r * c.count * item + at, segment.staging(r),
                            bytes);
            break;
        case Kind::broadcast:
            std::memcpy(c.recv + at, segment.staging(c.root), bytes);
            break;
        }
        /* nobody restages before everyone has read */
        if (!step_together(state))
            return Outcome::stopped;
        done += n;
    }
    return Outcome::done;
}

/* The host function queued on the stream: waits for its turn on the
 * communicator, runs, and lets the next one go. */
void run_collective(void *data)
{
    std::unique_ptr<Collective> c(static_cast<Collective *>(data));
    CommState &state = *c->comm;
    {
        std::unique_lock<std::mutex> lock(state.mutex);
        state.changed.wait(lock, [&] { return state.closed || state.next_run == c->seq; });
        if (state.closed)
            return;                 /* aborted: its output is undefined, as NCCL's */
        if (state.async_error != ncclSuccess) {
            state.advance_locked();   /* broken: skipped, so destroy can finish */
            return;
        }
        state.running = true;
    }
    Outcome outcome = execute(state, *c);
    std::lock_guard<std::mutex> lock(state.mutex);
    state.running = false;
    if (outcome == Outcome::broken)
        state.async_error = ncclInvalidUsage;
    state.advance_locked();
}

/* Numbers the collective and queues it on its stream. */
ncclResult_t submit(std::unique_ptr<Collective> c)
{
    std::shared_ptr<CommState> state = c->comm;
    const char *function = c->function;
    std::uint64_t seq;
    {
        std::lock_guard<std::mutex> lock(state->mutex);
        if (state->closed)
            return fail(ncclInvalidUsage, "%s: the communicator was destroyed or aborted while "
                        "the call was being made", function);
        seq = c->seq = state->next_seq++;
    }
    DeviceGuard on_device(state->device);
    cudaStream_t stream = c->stream;
    Collective *queued = c.release();
    /* a default stream runs it inline, right here */
    cudaError_t err = cudaLaunchHostFunc(stream, run_collective, queued);
    if (err == cudaSuccess)
        return settle_later(*state);
    delete queued;
    {
        std::lock_guard<std::mutex> lock(state->mutex);
        if (seq == state->next_run)
            state->advance_locked();
        else
            state->cancelled.insert(seq);
    }
    return fail(ncclUnhandledCudaError, "%s: cudaLaunchHostFunc failed: %s", function,
                cudaGetErrorString(err));
}

/* Checks a call, then queues it or, inside a group, keeps it for ncclGroupEnd. */
ncclResult_t collective(const char *function, Kind kind, const void *send, void *recv,
                        std::size_t count, ncclDataType_t dtype, ncclRedOp_t op, int root,
                        ncclComm_t comm, cudaStream_t stream)
{
    std::unique_ptr<Collective> c;
    ncclResult_t result = prepare(function, kind, send, recv, count, dtype, op, root, comm,
                                  stream, &c);
    if (group.depth > 0 && result == ncclSuccess && c) {
        /* NCCL 2.10 and 2.11 launch a group's work on one communicator as one
         * kernel, on one stream, and refuse a second stream (later versions
         * join the streams); rlhfz accepts 2.10, so the stand-in refuses too */
        for (const std::unique_ptr<Collective> &queued : group.pending)
            if (queued->comm == c->comm && queued->stream != c->stream) {
                result = fail(ncclInvalidUsage, "%s: mixing different streams within a group "
                              "call is not supported (stream %p, after %p for this communicator "
                              "in the same group): NCCL before 2.12 refuses it; queue a group's "
                              "calls on one stream", function, (void *)c->stream,
                              (void *)queued->stream);
                c.reset();
                break;
            }
    }
    if (group.depth > 0) {
        if (result != ncclSuccess && group.error == ncclSuccess)
            group.error = result;
        if (result == ncclSuccess && c)
            group.pending.push_back(std::move(c));
        return result;
    }
    if (result != ncclSuccess || !c)
        return result;
    return submit(std::move(c));
}

} /* namespace */

} /* namespace ncclsim */

using namespace ncclsim;

extern "C" ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream)
{
    return collective("ncclAllReduce", Kind::all_reduce, sendbuff, recvbuff, count, datatype, op,
                      0, comm, stream);
}

extern "C" ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                          ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                          cudaStream_t stream)
{
    return collective("ncclReduceScatter", Kind::reduce_scatter, sendbuff, recvbuff, recvcount,
                      datatype, op, 0, comm, stream);
}

extern "C" ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                      ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream)
{
    return collective("ncclAllGather", Kind::all_gather, sendbuff, recvbuff, sendcount, datatype,
                      ncclSum, 0, comm, stream);
}

extern "C" ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count,
                                      ncclDataType_t datatype, int root, ncclComm_t comm,
                                      cudaStream_t stream)
{
    return collective("ncclBroadcast", Kind::broadcast, sendbuff, recvbuff, count, datatype,
                      ncclSum, root, comm, stream);
}

extern "C" ncclResult_t ncclGroupStart(void)
{
    group.depth++;
    return ncclSuccess;
}

/* Queues the group's calls in order; if any of them failed its checks,
 * none is queued and that failure is returned (its last error kept). */
extern "C" ncclResult_t ncclGroupEnd(void)
{
    if (group.depth == 0)
        return fail(ncclInvalidUsage, "ncclGroupEnd without a matching ncclGroupStart");
    if (--group.depth > 0)
        return ncclSuccess;
    std::vector<std::unique_ptr<Collective>> pending = std::move(group.pending);
    ncclResult_t error = group.error;
    group.pending.clear();
    group.error = ncclSuccess;
    if (error != ncclSuccess)
        return error;
    ncclResult_t outcome = ncclSuccess;
    for (std::unique_ptr<Collective> &c : pending) {
        ncclResult_t result = submit(std::move(c));
        if (result == ncclInProgress)
            outcome = result;   /* a non-blocking communicator's: poll it */
        else if (result != ncclSuccess)
            return result;      /* the rest are dropped: the ranks no longer agree anyway */
    }
    return outcome;
}
