/* internal.h: what the files of the NCCL stand-in share (not installed).
 *
 * segment.cpp   the shared-memory segment the ranks meet in, and its barrier
 * reduce.cpp    the element math of the reductions
 * communicator.cpp   communicators: init, destroy, abort, queries, errors
 * collectives.cpp    argument checks, groups, queuing on streams, and the
 *                    collectives themselves
 */
#ifndef RLHFZ_SIM_NCCL_INTERNAL_H
#define RLHFZ_SIM_NCCL_INTERNAL_H

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>

#include "nccl.h"

namespace ncclsim {

/* ---- errors (communicator.cpp) -------------------------------------------------------- */

/* Records why as this thread's last error (ncclGetLastError) and returns result. */
ncclResult_t fail(ncclResult_t result, const char *format, ...)
    __attribute__((format(printf, 2, 3)));

/* ---- the segment (segment.cpp) ---------------------------------------------------------- */

enum class Kind : std::uint32_t { all_reduce = 1, reduce_scatter, all_gather, broadcast };

/* What a rank is running, published for its peers to compare. */
struct Descriptor {
    Kind kind;
    std::uint32_t dtype;
    std::uint32_t op;
    std::int32_t root;
    std::uint64_t count;
};

struct SegmentHeader;
struct RankSlot;

/* One rank's view of the shared memory its communicator's ranks meet in:
 * per rank a slot (a step counter, a futex word to sleep on, the
 * descriptor of the collective it runs) and a staging area of
 * staging_bytes that it writes and every rank reads. */
class Segment {
public:
    /* Creates or attaches the segment `name`, claims `rank` in it for the
     * CUDA device `device` and waits until all nranks ranks have (unlinking
     * the name once they have), or fails after timeout_s seconds. Like
     * NCCL's init, it fails (ncclInvalidUsage, on every rank) where two
     * ranks are on one device; and at once when *stop is set (an abort). */
    static ncclResult_t join(const char *name, int nranks, int rank, int device,
                             std::size_t staging_request, double timeout_s,
                             const std::atomic<bool> *stop, std::unique_ptr<Segment> *out);
    ~Segment();
    Segment(const Segment &) = delete;
    Segment &operator=(const Segment &) = delete;

    int nranks() const { return nranks_; }
    int rank() const { return rank_; }
    std::size_t staging_bytes() const { return staging_bytes_; }
    char *staging(int rank) const;
    Descriptor &descriptor(int rank) const;

    /* This rank has reached `step`: its staged data and descriptor are
     * published. */
    void arrive(std::uint64_t step);
    /* Waits until every rank has reached `step`. Returns false as soon as
     * `stop` is set (with wake() to cut a sleep short); never times out. */
    bool wait_all(std::uint64_t step, const std::atomic<bool> &stop) const;
    /* Wakes this rank's own wait_all, to notice `stop`. */
    void wake();

private:
    Segment() = default;
    /* ncclInvalidUsage (on every rank) where two ranks published one device. */
    ncclResult_t check_devices() const;
    char *base_ = nullptr;
    std::size_t bytes_ = 0;
    int nranks_ = 0;
    int rank_ = 0;
    std::size_t staging_bytes_ = 0;
    SegmentHeader *header_ = nullptr;
    RankSlot *slots_ = nullptr;
    char *staging_ = nullptr;
};

/* ---- element math (reduce.cpp) --------------------------------------------------------- */

/* Bytes per element, 0 for a value that is no ncclDataType_t. */
std::size_t dtype_size(ncclDataType_t dtype);
const char *dtype_name(ncclDataType_t dtype);
const char *op_name(ncclRedOp_t op);
bool valid_op(ncclRedOp_t op);

/* dest[i] = op over ranks r = 0, 1, ... of sources[r][i], folded in rank
 * order and rounded to the element type at every step, so every rank gets
 * the same bits. Avg of a floating type multiplies each input by 1/nranks
 * (rounded to the type) first, then sums; of an integer type it sums, then
 * divides. */
void reduce(ncclDataType_t dtype, ncclRedOp_t op, int nranks, const char *const *sources,
            char *dest, std::size_t count);

/* ---- communicators (communicator.cpp) ------------------------------------------------- */

/* Random delays inside collectives, under RLHFZ_SIM_CHAOS. */
class Chaos {
public:
    void seed(const char *text, int rank);
    void maybe_delay();

private:
    bool on_ = false;
    std::uint64_t state_ = 0;
};

/* A communicator's process-local state. Each queued collective holds a
 * reference, so the state outlives the handle that destroy or abort frees;
 * the segment itself is released as soon as no collective can touch it. */
struct CommState {
    int nranks = 0;
    int rank = 0;
    int device = 0;
    std::unique_ptr<Segment> segment;     /* null once released */

    std::mutex mutex;
    std::condition_variable changed;
    std::uint64_t next_seq = 0;           /* the number the next queued collective gets */
    std::uint64_t next_run = 0;           /* the number of the one allowed to run */
    std::set<std::uint64_t> cancelled;    /* numbers handed out but never queued */
    bool running = false;                 /* a collective is inside the segment */
    bool closed = false;                  /* destroyed or aborted: nothing more runs */
    ncclResult_t async_error = ncclSuccess;
    std::atomic<bool> stop{false};        /* abort: running and waiting collectives return */

    /* a non-blocking communicator (ncclCommInitRankConfig, blocking = 0) */
    bool nonblocking = false;
    bool initializing = false;            /* its init thread is still joining the ranks */
    ncclResult_t init_result = ncclSuccess;
    char init_error[1024] = {0};          /* the init thread's last error, for the caller */
    std::chrono::steady_clock::time_point settles_at{};   /* the last call's ncclInProgress */

    /* What ncclCommGetAsyncError says. Holds mutex. */
    ncclResult_t async_state_locked() const;

    /* only the running collective touches these */
    std::uint64_t step = 0;
    Chaos chaos;

    /* Moves next_run past `seq` (and past any cancelled numbers). Holds mutex. */
    void advance_locked();
};

/* The state behind a live handle, or null (with the last error set). */
std::shared_ptr<CommState> lookup(ncclComm_t comm, const char *function);

/* A call on a non-blocking communicator before ncclCommGetAsyncError said
 * ncclSuccess (its init or its last call still in progress), or after its
 * init failed: refused, as NCCL leaves it undefined. */
ncclResult_t refuse_unsettled(CommState &state, const char *function);
/* What a call that was queued returns: ncclSuccess, or on a non-blocking
 * communicator ncclInProgress, which settles a little later. */
ncclResult_t settle_later(CommState &state);

} /* namespace ncclsim */

/* The handle: ncclComm_t points to one of these until destroy or abort. */
struct ncclComm {
    std::shared_ptr<ncclsim::CommState> state;
};

#endif /* RLHFZ_SIM_NCCL_INTERNAL_H */
