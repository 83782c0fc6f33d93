/* segment.cpp: the shared-memory segment the ranks of a communicator meet
 * in, and the barrier they step through it with.
 *
 * The segment is a POSIX shared-memory object named in the unique id. The
 * first rank to arrive creates it (O_EXCL decides who) and fills the header;
 * the others attach once the header says it is ready. Each rank claims its
 * slot, counts itself in, and the rank that completes the count unlinks the
 * name: from then on the memory lives only as long as the mappings do, so
 * no crash can leave it in /dev/shm. Each rank publishes its CUDA device in
 * its slot before it counts itself in; once all have, every rank compares
 * them all, and two ranks on one device fail the init on every rank, as
 * NCCL's "Duplicate GPU detected" does (every process simulates the same
 * machine, so a device ordinal names one device in all of them).
 *
 * Layout: a header page, then one cache-line-aligned slot per rank, then
 * one staging area per rank. The ranks step together: each step, a rank
 * publishes (its staged data, its descriptor), stores the step number in
 * its slot with release order, and rings every peer's bell; a rank waits
 * for a step by sleeping on its own bell (a futex in the shared memory)
 * until every slot shows the step. Nothing here gives up on a peer: a rank
 * that dies leaves the others waiting, as a GPU's NCCL kernels would, until
 * the communicator is aborted.
 */
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <thread>

#include "internal.h"

namespace ncclsim {

namespace {

constexpr std::uint64_t READY = 0x7265646179534d53ULL;   /* set last by the creator */
constexpr std::uint32_t LAYOUT_VERSION = 2;
constexpr std::size_t PAGE = 4096;
constexpr std::size_t MIN_STAGING = 4096;

static_assert(std::atomic<std::uint32_t>::is_always_lock_free, "futex words must be plain words");
static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "counters shared between processes must be lock-free");
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t), "futex word size");

std::size_t round_up(std::size_t n, std::size_t unit) { return (n + unit - 1) / unit * unit; }

long futex(std::atomic<std::uint32_t> *word, int op, std::uint32_t value,
           const struct timespec *timeout)
{
    /* Not FUTEX_PRIVATE_FLAG: the word is shared between processes. */
    return syscall(SYS_futex, reinterpret_cast<std::uint32_t *>(word), op, value, timeout,
                   nullptr, 0);
}

/* Sleeps while *word == seen, at most `ms` milliseconds (a wake can be
 * missed only by a peer that died, and then the caller waits on anyway). */
void sleep_on(std::atomic<std::uint32_t> *word, std::uint32_t seen, long ms)
{
    struct timespec timeout = {ms / 1000, (ms % 1000) * 1000000L};
    futex(word, FUTEX_WAIT, seen, &timeout);
}

void wake_all(std::atomic<std::uint32_t> *word)
{
    futex(word, FUTEX_WAKE, INT_MAX, nullptr);
}

using Clock = std::chrono::steady_clock;

} /* namespace */

struct SegmentHeader {
    std::atomic<std::uint64_t> ready;
    std::uint32_t layout_version;
    std::uint32_t nranks;
    std::uint64_t total_bytes;
    std::uint64_t staging_bytes;
    std::uint64_t slots_offset;
    std::uint64_t staging_offset;
    std::atomic<std::uint32_t> joined;      /* ranks counted in; a futex word */
};

struct alignas(64) RankSlot {
    std::atomic<std::uint32_t> owner;       /* pid of the process holding the rank, 0: free */
    std::atomic<std::int32_t> device;       /* its CUDA device, set before it counts itself in */
    std::atomic<std::uint32_t> bell;        /* rung by every peer's arrival; a futex word */
    std::atomic<std::uint64_t> arrived;     /* the last step this rank reached */
    Descriptor descriptor;                  /* written before arrive, read after wait_all */
};

static_assert(sizeof(SegmentHeader) <= PAGE, "the header fits its page");

Segment::~Segment()
{
    if (base_)
        munmap(base_, bytes_);
}

char *Segment::staging(int rank) const
{
    return staging_ + (std::size_t)rank * staging_bytes_;
}

Descriptor &Segment::descriptor(int rank) const
{
    return slots_[rank].descriptor;
}

void Segment::arrive(std::uint64_t step)
{
    slots_[rank_].arrived.store(step, std::memory_order_release);
    for (int peer = 0; peer < nranks_; peer++) {
        if (peer == rank_)
            continue;
        slots_[peer].bell.fetch_add(1, std::memory_order_acq_rel);
        wake_all(&slots_[peer].bell);
    }
}

bool Segment::wait_all(std::uint64_t step, const std::atomic<bool> &stop) const
{
    std::atomic<std::uint32_t> *bell = &slots_[rank_].bell;
    for (;;) {
        /* read the bell first: a ring after this read makes the sleep return at once */
        std::uint32_t seen = bell->load(std::memory_order_acquire);
        int peer = 0;
        while (peer < nranks_ && slots_[peer].arrived.load(std::memory_order_acquire) >= step)
            peer++;
        if (peer == nranks_)
            return true;
        if (stop.load())
            return false;
        sleep_on(bell, seen, 100);
    }
}

void Segment::wake()
{
    slots_[rank_].bell.fetch_add(1, std::memory_order_acq_rel);
    wake_all(&slots_[rank_].bell);
}

namespace {

/* Opens the segment, creating it if this rank is the first. */
ncclResult_t open_segment(const char *name, Clock::time_point deadline, int *fd, bool *created)
{
    for (;;) {
        *fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (*fd >= 0) {
            *created = true;
            return ncclSuccess;
        }
        if (errno != EEXIST)
            return fail(ncclSystemError, "shm_open(%s) failed: %s", name, std::strerror(errno));
        *fd = shm_open(name, O_RDWR | O_CLOEXEC, 0);
        if (*fd >= 0) {
            *created = false;
            return ncclSuccess;
        }
        if (errno != ENOENT)
            return fail(ncclSystemError, "shm_open(%s) failed: %s", name, std::strerror(errno));
        /* unlinked in between (every rank of that segment had joined): start over */
        if (Clock::now() > deadline)
            return fail(ncclSystemError, "shm_open(%s) kept failing", name);
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
}

bool stopped(const std::atomic<bool> *stop)
{
    return stop && stop->load(std::memory_order_acquire);
}

ncclResult_t aborted_while_joining(const char *name)
{
    return fail(ncclSystemError, "ncclCommAbort was called while the communicator was joining "
                "the other ranks (segment %s)", name);
}

/* Waits until the file holds at least `bytes`. */
ncclResult_t wait_for_size(int fd, std::size_t bytes, const char *name, Clock::time_point deadline,
                           const std::atomic<bool> *stop)
{
    for (;;) {
        struct stat st;
        if (fstat(fd, &st) != 0)
            return fail(ncclSystemError, "fstat(%s) failed: %s", name, std::strerror(errno));
        if ((std::size_t)st.st_size >= bytes)
            return ncclSuccess;
        if (stopped(stop))
            return aborted_while_joining(name);
        if (Clock::now() > deadline)
            return fail(ncclSystemError, "the segment %s was never sized: the rank that created "
                        "it failed or stopped", name);
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
}

} /* namespace */

ncclResult_t Segment::join(const char *name, int nranks, int rank, int device,
                           std::size_t staging_request, double timeout_s,
                           const std::atomic<bool> *stop, std::unique_ptr<Segment> *out)
{
    auto deadline = Clock::now() + std::chrono::milliseconds((long long)(timeout_s * 1000.0));
    int fd = -1;
    bool created = false;
    ncclResult_t result = open_segment(name, deadline, &fd, &created);
    if (result != ncclSuccess)
        return result;

    std::unique_ptr<Segment> segment(new Segment);
    SegmentHeader *header = nullptr;
    if (created) {
        std::size_t staging =
            round_up(staging_request < MIN_STAGING ? MIN_STAGING : staging_request, PAGE);
        /* reduce-scatter stages one part per rank: at least one 8-byte element each */
        if (staging < (std::size_t)nranks * 8)
            staging = round_up((std::size_t)nranks * 8, PAGE);
        std::size_t slots_offset = PAGE;
        std::size_t staging_offset = round_up(slots_offset + (std::size_t)nranks * sizeof(RankSlot),
                                              PAGE);
        std::size_t total = staging_offset + (std::size_t)nranks * staging;
        /* fallocate, not ftruncate: a full /dev/shm fails here, not with SIGBUS later */
        int err = posix_fallocate(fd, 0, (off_t)total);
        void *base = err == 0 ? mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                              : MAP_FAILED;
        if (base == MAP_FAILED) {
            if (err == 0)
                err = errno;
            close(fd);
            shm_unlink(name);
            return fail(ncclSystemError, "cannot make the shared segment %s of %zu bytes: %s",
                        name, total, std::strerror(err));
        }
        segment->base_ = (char *)base;
        segment->bytes_ = total;
        header = (SegmentHeader *)base;
        header->layout_version = LAYOUT_VERSION;
        header->nranks = (std::uint32_t)nranks;
        header->total_bytes = total;
        header->staging_bytes = staging;
        header->slots_offset = slots_offset;
        header->staging_offset = staging_offset;
        header->ready.store(READY, std::memory_order_release);
    } else {
        /* the header page first, to learn the size; then the whole */
        result = wait_for_size(fd, PAGE, name, deadline, stop);
        void *first = result == ncclSuccess
                          ? mmap(nullptr, PAGE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                          : MAP_FAILED;
        if (first == MAP_FAILED) {
            close(fd);
            return result != ncclSuccess ? result
                                         : fail(ncclSystemError, "mmap(%s) failed: %s", name,
                                                std::strerror(errno));
        }
        SegmentHeader *peek = (SegmentHeader *)first;
        while (peek->ready.load(std::memory_order_acquire) != READY) {
            if (stopped(stop)) {
                munmap(first, PAGE);
                close(fd);
                return aborted_while_joining(name);
            }
            if (Clock::now() > deadline) {
                munmap(first, PAGE);
                close(fd);
                return fail(ncclSystemError, "the segment %s was never set up: the rank that "
                            "created it failed or stopped", name);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        std::uint32_t their_nranks = peek->nranks, layout = peek->layout_version;
        std::size_t total = peek->total_bytes;
        munmap(first, PAGE);
        if (layout != LAYOUT_VERSION || their_nranks != (std::uint32_t)nranks) {
            close(fd);
            return fail(ncclInvalidUsage, "rank %d was given nranks=%d, but the rank that created "
                        "the communicator said %u%s", rank, nranks, their_nranks,
                        layout != LAYOUT_VERSION ? " (and another layout version)" : "");
        }
        result = wait_for_size(fd, total, name, deadline, stop);
        void *base = result == ncclSuccess
                         ? mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                         : MAP_FAILED;
        if (base == MAP_FAILED) {
            close(fd);
            return result != ncclSuccess ? result
                                         : fail(ncclSystemError, "mmap(%s) failed: %s", name,
                                                std::strerror(errno));
        }
        segment->base_ = (char *)base;
        segment->bytes_ = total;
        header = (SegmentHeader *)base;
    }
    close(fd);

    segment->header_ = header;
    segment->nranks_ = nranks;
    segment->rank_ = rank;
    segment->staging_bytes_ = header->staging_bytes;
    segment->slots_ = (RankSlot *)(segment->base_ + header->slots_offset);
    segment->staging_ = segment->base_ + header->staging_offset;

    std::uint32_t expected = 0, me = (std::uint32_t)getpid();
    if (!segment->slots_[rank].owner.compare_exchange_strong(expected, me))
        return fail(ncclInvalidUsage, "rank %d of %d joined twice with the same unique id (pid %u "
                    "holds it)", rank, nranks, expected);
    segment->slots_[rank].device.store(device, std::memory_order_relaxed);

    /* the count's read-modify-write publishes the device with it */
    std::uint32_t joined = header->joined.fetch_add(1) + 1;
    wake_all(&header->joined);
    if (joined == (std::uint32_t)nranks)
        shm_unlink(name);
    while ((joined = header->joined.load(std::memory_order_acquire)) < (std::uint32_t)nranks) {
        if (stopped(stop)) {
            shm_unlink(name);
            return aborted_while_joining(name);
        }
        if (Clock::now() > deadline) {
            /* nobody may ever complete it: the name must not outlive this */
            shm_unlink(name);
            return fail(ncclSystemError, "ncclCommInitRank timed out after %.0f s with %u of %d "
                        "ranks joined (RLHFZ_NCCL_SIM_INIT_TIMEOUT)", timeout_s, joined, nranks);
        }
        sleep_on(&header->joined, joined, 50);
    }
    result = segment->check_devices();
    if (result != ncclSuccess)
        return result;
    *out = std::move(segment);
    return ncclSuccess;
}

ncclResult_t Segment::check_devices() const
{
    /* every rank reaches the same verdict from the same slots: one on a
     * shared device names itself and a peer (as NCCL's message does), any
     * other rank the first pair it finds; none of them goes on to wait for
     * the others in a collective */
    int first = -1, second = -1;
    for (int a = 0; a < nranks_ && second < 0; a++)
        for (int b = a + 1; b < nranks_; b++)
            if (slots_[a].device.load(std::memory_order_relaxed) ==
                slots_[b].device.load(std::memory_order_relaxed)) {
                first = a;
                second = b;
                break;
            }
    if (second < 0)
        return ncclSuccess;
    int mine = slots_[rank_].device.load(std::memory_order_relaxed);
    for (int peer = 0; peer < nranks_; peer++)
        if (peer != rank_ && slots_[peer].device.load(std::memory_order_relaxed) == mine)
            return fail(ncclInvalidUsage, "Duplicate GPU detected : rank %d and rank %d both on "
                        "CUDA device %d: NCCL needs a device of its own for every rank (make "
                        "the local rank's device current before init)", rank_, peer, mine);
    return fail(ncclInvalidUsage, "Duplicate GPU detected : rank %d and rank %d both on CUDA "
                "device %d (this rank, %d, is on device %d): NCCL needs a device of its own for "
                "every rank", first, second, slots_[first].device.load(std::memory_order_relaxed),
                rank_, mine);
}

} /* namespace ncclsim */
