/* block_runner.cpp: kernel launches, and the threads of a block as fibers.
 *
 * A launch is checked (configuration, stream, device) and queued on its
 * stream like any other work. When it runs, its blocks go one after another
 * on the stream's OS thread, and each block's threads are fibers there, each
 * with its own small stack from a pool kept per OS thread (never an OS
 * thread per simulated thread). The runner resumes every fiber in turn; a
 * fiber runs until it returns or calls __syncthreads(). When all of a
 * block's threads wait at a barrier, the next round begins; when some have
 * returned while others wait, the block has diverged at a barrier, which a
 * GPU may hang on or silently mis-order: here it is a launch failure, sticky
 * as a GPU's fault is. Under RLHFZ_SIM_CHAOS the blocks, and the threads in
 * each round, run in a random order.
 *
 * A GPU promises nothing of the shared memory a block has not written, so
 * every __shared__ array (declared through RLHFZ_SHARED_ARRAY, which calls
 * cudasim_shared_fresh) reads as NaN, all bits set, when a block starts,
 * never as the last block left it.
 */
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "state.h"

extern "C" {
__thread uint3 cudasim_thread_idx;
__thread uint3 cudasim_block_idx;
__thread dim3 cudasim_block_dim;
__thread dim3 cudasim_grid_dim;
}

namespace cudasim {
namespace {

constexpr std::size_t STACK_BYTES = 64 * 1024;
constexpr std::size_t GUARD_BYTES = 4096;
constexpr unsigned MAX_BLOCK_THREADS = 1024;
constexpr std::size_t MAX_SHARED_BYTES = 48 * 1024;

struct Fiber;

/* ---- context switching -------------------------------------------------------------- */

#if defined(__x86_64__)
/* Saves the callee-saved registers, MXCSR and the x87 control word on the
 * current stack, stores the stack pointer in *save, and resumes the context
 * whose stack pointer is `load` (one this function saved, or a fresh frame
 * from new_context). */
extern "C" void cudasim_fiber_switch(void **save, void *load);
extern "C" void cudasim_fiber_start(void);
asm(R"(
    .text
    .p2align 4
    .globl cudasim_fiber_switch
    .hidden cudasim_fiber_switch
    .type cudasim_fiber_switch, @function
cudasim_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cudasim_fiber_switch, .-cudasim_fiber_switch

    .p2align 4
    .globl cudasim_fiber_start
    .hidden cudasim_fiber_start
    .type cudasim_fiber_start, @function
cudasim_fiber_start:
    movq %r12, %rdi
    callq *%rbx
    ud2
    .size cudasim_fiber_start, .-cudasim_fiber_start
)");

/* A frame that cudasim_fiber_switch resumes into entry(argument). */
void *new_context(char *stack, std::size_t bytes, void (*entry)(void *), void *argument)
{
    std::uintptr_t top = ((std::uintptr_t)(stack + bytes)) & ~(std::uintptr_t)15;
    void **sp = (void **)top;
    *--sp = (void *)&cudasim_fiber_start;   /* where the switch returns to */
    *--sp = nullptr;                        /* rbp */
    *--sp = (void *)entry;                  /* rbx */
    *--sp = argument;                       /* r12 */
    *--sp = nullptr;                        /* r13 */
    *--sp = nullptr;                        /* r14 */
    *--sp = nullptr;                        /* r15 */
    std::uint32_t control[2] = {0, 0};
    asm volatile("stmxcsr %0" : "=m"(control[0]));
    asm volatile("fnstcw %0" : "=m"(control[1]));
    std::uint64_t packed = control[0] | ((std::uint64_t)(control[1] & 0xFFFF) << 32);
    *--sp = (void *)packed;
    return sp;
}
#else
#error "the simulated runtime's fibers are written for x86-64"
#endif

/* ---- fibers ------------------------------------------------------------------------- */

struct Fiber {
    char *stack = nullptr;
    void *context = nullptr;
    uint3 index{0, 0, 0};
    bool done = false;
    bool waiting = false;      /* at a __syncthreads() */
};

struct Runner {
    std::vector<Fiber> fibers;
    void *scheduler = nullptr;
    Fiber *running = nullptr;
    void (*body)(void *) = nullptr;
    void *closure = nullptr;

    ~Runner()
    {
        for (Fiber &f : fibers)
            munmap(f.stack - GUARD_BYTES, STACK_BYTES + GUARD_BYTES);
    }

    void ensure(std::size_t count)
    {
        while (fibers.size() < count) {
            char *block = (char *)mmap(nullptr, STACK_BYTES + GUARD_BYTES, PROT_READ | PROT_WRITE,
                                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (block == MAP_FAILED)
                return;
            mprotect(block, GUARD_BYTES, PROT_NONE);     /* an overflow faults */
            Fiber f;
            f.stack = block + GUARD_BYTES;
            fibers.push_back(f);
        }
    }
};

thread_local Runner runner;

/* ---- __shared__ arrays: nothing carries over from the last block ---------------- */

/* A __shared__ array of the kernels, as cudasim_shared_fresh() met it on
 * this OS thread: which block and which launch last saw it. */
struct SharedArray {
    void *address;
    std::uint64_t block;
    std::uint64_t launch;
};

thread_local std::vector<SharedArray> shared_arrays;
thread_local std::uint64_t block_serial = 0;
thread_local std::uint64_t launch_serial = 0;
thread_local std::size_t launch_shared_bytes = 0;

void fiber_entry(void *argument)
{
    Fiber *self = static_cast<Fiber *>(argument);
    runner.body(runner.closure);
    self->done = true;
    cudasim_fiber_switch(&self->context, runner.scheduler);
    __builtin_unreachable();
}

/* Runs one block's threads to the end. False if they diverged at a barrier. */
bool run_block(std::size_t threads, dim3 shape, std::mt19937_64 *order)
{
    for (std::size_t t = 0; t < threads; t++) {
        Fiber &f = runner.fibers[t];
        f.done = f.waiting = false;
        f.index = uint3{(unsigned)(t % shape.x), (unsigned)(t / shape.x % shape.y),
                        (unsigned)(t / ((std::size_t)shape.x * shape.y))};
        f.context = new_context(f.stack, STACK_BYTES, fiber_entry, &f);
    }
    std::vector<std::size_t> turn(threads);
    std::iota(turn.begin(), turn.end(), std::size_t(0));
    for (;;) {
        if (order)
            std::shuffle(turn.begin(), turn.end(), *order);
        for (std::size_t t : turn) {
            Fiber &f = runner.fibers[t];
            if (f.done)
                continue;
            f.waiting = false;
            cudasim_thread_idx = f.index;
            runner.running = &f;
            cudasim_fiber_switch(&runner.scheduler, f.context);
            runner.running = nullptr;
        }
        std::size_t done = 0, waiting = 0;
        for (std::size_t t = 0; t < threads; t++) {
            done += runner.fibers[t].done;
            waiting += runner.fibers[t].waiting;
        }
        if (done == threads)
            return true;
        if (done > 0)
            return false;      /* the waiting fibers are abandoned; their stacks are reused */
    }
}

/* The kernel this OS thread runs now, for the faults it may hit. */
thread_local int kernel_device = -1;
thread_local const char *kernel_name = nullptr;

struct KernelScope {
    KernelScope(int device, const char *name)
    {
        kernel_device = device;
        kernel_name = name;
    }
    ~KernelScope()
    {
        kernel_device = -1;
        kernel_name = nullptr;
    }
};

} /* namespace */

int running_kernel(const char **name)
{
    *name = kernel_name;
    return kernel_device;
}

bool run_grid(dim3 grid, dim3 block, std::size_t dynamic_shared, void (*body)(void *),
              void *closure, std::uint64_t order_seed, const char **why)
{
    std::size_t threads = (std::size_t)block.x * block.y * block.z;
    runner.ensure(threads);
    if (runner.fibers.size() < threads) {
        *why = "no memory for the block's thread stacks";
        return false;
    }
    runner.body = body;
    runner.closure = closure;
    std::size_t blocks = (std::size_t)grid.x * grid.y * grid.z;
    std::mt19937_64 order(order_seed);
    std::vector<std::size_t> sequence;
    if (order_seed) {
        sequence.resize(blocks);
        std::iota(sequence.begin(), sequence.end(), std::size_t(0));
        std::shuffle(sequence.begin(), sequence.end(), order);
    }
    cudasim_block_dim = block;
    cudasim_grid_dim = grid;
    ++launch_serial;
    launch_shared_bytes = dynamic_shared;
    for (std::size_t i = 0; i < blocks; i++) {
        ++block_serial;
        std::size_t b = order_seed ? sequence[i] : i;
        cudasim_block_idx = uint3{(unsigned)(b % grid.x), (unsigned)(b / grid.x % grid.y),
                                  (unsigned)(b / ((std::size_t)grid.x * grid.y))};
        if (!run_block(threads, block, order_seed ? &order : nullptr)) {
            *why = "the threads of a block diverged at __syncthreads() (some returned while "
                   "others waited)";
            return false;
        }
        if (launch_shared_bytes > MAX_SHARED_BYTES) {
            *why = "its __shared__ arrays and dynamic shared memory hold more than 48 KiB";
            return false;
        }
    }
    return true;
}

} /* namespace cudasim */

using namespace cudasim;

extern "C" void cudasim_syncthreads(void)
{
    Fiber *self = runner.running;
    if (!self)
        return;      /* host code: nothing to wait for */
    self->waiting = true;
    cudasim_fiber_switch(&self->context, runner.scheduler);
}

extern "C" void cudasim_shared_fresh(void *address, size_t bytes)
{
    if (!runner.running)
        return;      /* host code */
    SharedArray *array = nullptr;
    for (SharedArray &known : shared_arrays)
        if (known.address == address)
            array = &known;
    if (!array) {
        shared_arrays.push_back(SharedArray{address, 0, 0});
        array = &shared_arrays.back();
    }
    if (array->launch != launch_serial) {
        array->launch = launch_serial;
        launch_shared_bytes += bytes;
    }
    if (array->block != block_serial) {      /* the block's first thread to get here */
        array->block = block_serial;
        std::memset(address, 0xFF, bytes);
    }
}

extern "C" cudaError_t cudasim_launch(dim3 grid, dim3 block, size_t shared_bytes,
                                      cudaStream_t handle, void (*run)(void *),
                                      void (*destroy)(void *), void *closure, const char *name)
{
    cudaError_t err = enter("kernel launch");
    std::size_t threads = (std::size_t)block.x * block.y * block.z;
    if (err == cudaSuccess &&
        (threads == 0 || threads > MAX_BLOCK_THREADS || block.z > 64 || grid.x == 0 ||
         grid.y == 0 || grid.z == 0 || grid.x > 0x7FFFFFFFu || grid.y > 65535 || grid.z > 65535 ||
         shared_bytes > MAX_SHARED_BYTES))
        err = fail(cudaErrorInvalidConfiguration);
    Stream *stream = nullptr;
    if (err == cudaSuccess && !(stream = resolve_stream(handle, &err)))
        fail(err);
    if (err == cudaSuccess && stream_device(stream) != current_device()) {
        std::fprintf(stderr, "cudasim: launch of %s on a stream of device %d while device %d is "
                     "current\n", name, stream_device(stream), current_device());
        err = fail(cudaErrorInvalidResourceHandle);
    }
    if (err != cudaSuccess) {
        destroy(closure);
        return err;
    }
    int device = stream_device(stream);
    std::uint64_t seed = chaos_seed_for(stream);
    std::string kernel = name ? name : "a kernel";
    enqueue(stream, [=] {
        const char *why = nullptr;
        KernelScope scope(device, kernel.c_str());
        if (sticky(device) == cudaSuccess &&
            !run_grid(grid, block, shared_bytes, run, closure, seed, &why)) {
            std::string text = "kernel " + kernel + ": " + why;
            set_sticky(device, cudaErrorLaunchFailure, text.c_str());
        }
        destroy(closure);
    });
    return cudaSuccess;
}
