/* nccl_comm.c: NcclComm, a native NCCL communicator on rlhfz borrows.
 *
 * Its collectives take arrays, as the kernel entry points do: rlhfz device
 * views, or anything with __dlpack__ in CUDA memory (a torch tensor). Each is
 * borrowed for the call (rlhfz_borrow) and checked before NCCL is called: the
 * communicator's device, one dtype for both, the element counts the
 * collective needs, and no overlap but exact in-place use. The dtype and
 * count NCCL gets come from the arrays. A tensor borrowed through DLPack is
 * kept until the collective is done on its stream (cuda_inflight.c): NCCL
 * reads and writes it after the call returns.
 *
 * Every NCCL call that can block runs with the GIL released. A communicator
 * that saw an NCCL error is aborted (ncclCommAbort), never left half-usable:
 * after a failed collective the ranks no longer agree on the order of
 * operations, and the next collective would hang. The library itself
 * (dlopen, the symbol table, versions) is nccl_library.c's.
 */
#include "nccl_comm.h"
#include "nccl_library.h"

#ifdef RLHFZ_WITH_CUDA
#include "rlhfz_cuda.h"
#endif

#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* ---- argument checking ------------------------------------------------------------ */

/* An int in [lo, hi]. */
static int arg_int_range(PyObject *obj, const char *func, const char *name, int64_t lo, int64_t hi,
                         int *out)
{
    int64_t value;
    if (rlhfz_arg_int64(obj, name, &value) < 0)
        return -1;
    if (value < lo || value > hi) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be in [%lld, %lld], not %lld", func, name,
                     (long long)lo, (long long)hi, (long long)value);
        return -1;
    }
    *out = (int)value;
    return 0;
}

static int arg_op(PyObject *obj, const char *func, ncclRedOp_t *out)
{
    static const struct { const char *name; ncclRedOp_t op; } ops[] = {
        {"sum", ncclSum}, {"avg", ncclAvg}, {"max", ncclMax}, {"min", ncclMin},
    };
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: op must be a str ('sum', 'avg', 'max' or 'min'), "
                     "not %.200s", func, Py_TYPE(obj)->tp_name);
        return -1;
    }
    for (size_t i = 0; i < sizeof(ops) / sizeof(ops[0]); i++) {
        if (PyUnicode_CompareWithASCIIString(obj, ops[i].name) == 0) {
            *out = ops[i].op;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "%s: op must be 'sum', 'avg', 'max' or 'min', not %R", func, obj);
    return -1;
}

/* 128 bytes from a bytes-like object. */
static int arg_unique_id(PyObject *obj, ncclUniqueId *out)
{
    if (!PyObject_CheckBuffer(obj) || PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "NcclComm: unique_id must be bytes (from nccl_unique_id()), "
                     "not %.200s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view.len != RLHFZ_NCCL_UNIQUE_ID_BYTES) {
        PyErr_Format(PyExc_ValueError, "NcclComm: unique_id must be %d bytes (from "
                     "nccl_unique_id()), not %zd", RLHFZ_NCCL_UNIQUE_ID_BYTES, view.len);
        PyBuffer_Release(&view);
        return -1;
    }
    memcpy(out->internal, view.buf, RLHFZ_NCCL_UNIQUE_ID_BYTES);
    PyBuffer_Release(&view);
    return 0;
}

/* world_size >= 1, 0 <= rank < world_size, device >= 0, all as C ints. */
static int arg_geometry(const char *func, PyObject *world_size_obj, PyObject *rank_obj,
                        PyObject *device_obj, int *world_size, int *rank, int *device)
{
    if (arg_int_range(world_size_obj, func, "world_size", 1, INT_MAX, world_size) < 0)
        return -1;
    int64_t value;
    if (rlhfz_arg_int64(rank_obj, "rank", &value) < 0)
        return -1;
    if (value < 0 || value >= *world_size) {
        PyErr_Format(PyExc_ValueError, "%s: rank must be in [0, world_size) = [0, %d), not %lld",
                     func, *world_size, (long long)value);
        return -1;
    }
    *rank = (int)value;
    return arg_int_range(device_obj, func, "device", 0, INT_MAX, device);
}

/* ---- NcclComm ------------------------------------------------------------------------ */

#define REASON_BYTES 512

typedef enum {
    COMM_UNCONNECTED = 0,   /* from _unconnected(): checks arguments, never talks */
    COMM_ALIVE = 1,
    COMM_DESTROYED = 2,
    COMM_ABORTED = 3
} comm_state;

typedef struct {
    PyObject_HEAD
    PyObject *library;           /* the library capsule (NULL when unconnected) */
    const rlhfz_nccl_library *lib;
    ncclComm_t comm;             /* not NULL exactly when state is COMM_ALIVE */
    comm_state state;
    int world_size;
    int rank;
    int device;
    /* A thread is inside a collective with the GIL released. NCCL
     * communicators are not thread-safe: a second collective or a destroy
     * must wait; abort may not (it is the way out of a hang). */
    int collective_in_flight;
    /* Made by non-blocking init: any call may return ncclInProgress, and
     * the next waits until ncclCommGetAsyncError says it is done. */
    int nonblocking;
    double timeout_s;            /* how long a call may stay in progress; <= 0: no limit */
    /* A collective polls the communicator without the GIL; abort() (the
     * watchdog's, from another thread) must not free it under the poll:
     * it asks the poll to stop and waits for it to let go. */
    atomic_int polling;
    atomic_int stop_polling;
    char reason[REASON_BYTES];   /* why the communicator is no longer alive */
} NcclComm;

/* ---- non-blocking calls ---------------------------------------------------------------- */

static double monotonic_s(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

/* Polls ncclCommGetAsyncError until the call in progress is done, or until
 * `until` (monotonic seconds; *expired = 1 then), or until *stop is set
 * (*expired = 2). Runs without the GIL. */
static ncclResult_t settle(const rlhfz_nccl_library *lib, ncclComm_t comm, double until,
                           atomic_int *stop, int *expired)
{
    long pause_ns = 20000;
    *expired = 0;
    for (;;) {
        if (stop != NULL && atomic_load(stop)) {
            *expired = 2;
            return ncclInProgress;
        }
        ncclResult_t state = ncclInProgress;
        ncclResult_t result = lib->CommGetAsyncError(comm, &state);
        if (result != ncclSuccess)
            return result;
        if (state != ncclInProgress)
            return state;
        if (monotonic_s() >= until) {
            *expired = 1;
            return ncclInProgress;
        }
        struct timespec pause = {0, pause_ns};
        nanosleep(&pause, NULL);
        if (pause_ns < 1000000)
            pause_ns *= 2;
    }
}

/* settle() for init, under the timeout, in slices with the GIL taken back
 * between them so that Ctrl-C reaches the caller. -1 with an exception set
 * (a signal handler raised); otherwise 0 and *result, *timed_out. */
static int settle_init(const rlhfz_nccl_library *lib, ncclComm_t comm, double timeout_s,
                       ncclResult_t *result, int *timed_out)
{
    double deadline = timeout_s > 0 ? monotonic_s() + timeout_s : INFINITY;
    *timed_out = 0;
    for (;;) {
        double slice = monotonic_s() + 0.2;
        int expired;
        Py_BEGIN_ALLOW_THREADS
        *result = settle(lib, comm, slice < deadline ? slice : deadline, NULL, &expired);
        Py_END_ALLOW_THREADS
        if (!expired)
            return 0;
        if (monotonic_s() >= deadline) {
            *timed_out = 1;
            return 0;
        }
        if (PyErr_CheckSignals() < 0)
            return -1;
    }
}

static const char *state_name(comm_state state)
{
    switch (state) {
    case COMM_UNCONNECTED: return "unconnected";
    case COMM_ALIVE: return "alive";
    case COMM_DESTROYED: return "destroyed";
    case COMM_ABORTED: return "aborted";
    }
    return "unknown";
}

static int require_alive(NcclComm *self, const char *method)
{
    switch (self->state) {
    case COMM_ALIVE:
        return 0;
    case COMM_UNCONNECTED:
        PyErr_Format(PyExc_RuntimeError, "NcclComm.%s: this communicator was never connected "
                     "(made by NcclComm._unconnected, which only checks arguments)", method);
        return -1;
    case COMM_DESTROYED:
        PyErr_Format(PyExc_RuntimeError, "NcclComm.%s: the communicator (rank %d of %d) was "
                     "destroyed", method, self->rank, self->world_size);
        return -1;
    case COMM_ABORTED:
        PyErr_Format(PyExc_RuntimeError, "NcclComm.%s: the communicator (rank %d of %d) was "
                     "aborted %s", method, self->rank, self->world_size, self->reason);
        return -1;
    }
    PyErr_Format(PyExc_SystemError, "NcclComm.%s: bad state %d", method, (int)self->state);
    return -1;
}

/* Marks the communicator aborted and hands it to ncclCommAbort, with the GIL
 * released (it joins NCCL's threads). The state changes first, so no other
 * thread picks the handle up meanwhile. */
static ncclResult_t comm_abort(NcclComm *self, const char *reason)
{
    if (self->state != COMM_ALIVE)
        return ncclSuccess;
    ncclComm_t comm = self->comm;
    const rlhfz_nccl_library *lib = self->lib;
    self->comm = NULL;
    self->state = COMM_ABORTED;
    snprintf(self->reason, sizeof(self->reason), "%s", reason);
    ncclResult_t result;
    atomic_store(&self->stop_polling, 1);
    Py_BEGIN_ALLOW_THREADS
    /* a poll sees the flag within a millisecond; a thread stuck inside an
     * NCCL call itself is not waited for (abort is the way out of that) */
    for (int waited_ms = 0; atomic_load(&self->polling) && waited_ms < 1000; waited_ms++) {
        struct timespec pause = {0, 1000000};
        nanosleep(&pause, NULL);
    }
    result = lib->CommAbort(comm);
    Py_END_ALLOW_THREADS
    return result;
}

/* After an NCCL error with the exception already set: abort, remembering
 * why, and ignore a second failure (the first one is the news). */
static void comm_abort_after_error(NcclComm *self, const char *what, ncclResult_t result)
{
    char reason[REASON_BYTES];
    snprintf(reason, sizeof(reason), "after an error (%s: %s)", what, rlhfz_nccl_result_name(result));
    (void)comm_abort(self, reason);
}

static PyObject *NcclComm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"unique_id", "world_size", "rank", "device", "timeout", NULL};
    PyObject *unique_id_obj, *world_size_obj, *rank_obj, *device_obj, *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO|$O:NcclComm", kwlist, &unique_id_obj,
                                     &world_size_obj, &rank_obj, &device_obj, &timeout_obj))
        return NULL;
    int world_size, rank, device;
    ncclUniqueId id;
    double timeout_s = 0.0;
    if (arg_geometry("NcclComm", world_size_obj, rank_obj, device_obj, &world_size, &rank, &device) < 0 ||
        arg_unique_id(unique_id_obj, &id) < 0)
        return NULL;
    if (timeout_obj != Py_None) {
        if (rlhfz_arg_double(timeout_obj, "timeout", &timeout_s) < 0)
            return NULL;
        if (!(timeout_s > 0.0)) {
            PyErr_Format(PyExc_ValueError, "NcclComm: timeout must be None or seconds > 0, not %R",
                         timeout_obj);
            return NULL;
        }
    }

    NcclComm *self = NULL;
    PyObject *capsule = NULL;
    ncclComm_t comm = NULL;
    ncclResult_t result = ncclSuccess;
    char what[160];
    PyObject *module = PyType_GetModule(type);
    if (module == NULL)
        return NULL;
    const rlhfz_nccl_library *lib = rlhfz_nccl_library_get(module, NULL, &capsule);
    if (lib == NULL)
        return NULL;
    self = (NcclComm *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto error;
    self->library = capsule;
    capsule = NULL;
    self->lib = lib;
    self->state = COMM_UNCONNECTED;
    self->world_size = world_size;
    self->rank = rank;
    self->device = device;
    self->timeout_s = timeout_s;

    /* A blocking init waits for every rank for ever: one that failed inside
     * its own init would leave the others there. Non-blocking, each rank
     * polls, and gives up (aborting) at the timeout. */
    const char *init_name = "ncclCommInitRank";
    if (lib->CommInitRankConfig != NULL && lib->version >= RLHFZ_NCCL_CONFIG_VERSION) {
        rlhfz_nccl_config config = {
            .size = sizeof(config), .magic = RLHFZ_NCCL_API_MAGIC,
            .version = RLHFZ_NCCL_CONFIG_VERSION, .blocking = 0,
            .cgaClusterSize = RLHFZ_NCCL_CONFIG_UNDEF_INT, .minCTAs = RLHFZ_NCCL_CONFIG_UNDEF_INT,
            .maxCTAs = RLHFZ_NCCL_CONFIG_UNDEF_INT, .netName = NULL};
        init_name = "ncclCommInitRankConfig";
        self->nonblocking = 1;
        Py_BEGIN_ALLOW_THREADS
        result = lib->CommInitRankConfig(&comm, world_size, id, rank, &config);
        Py_END_ALLOW_THREADS
        if ((result == ncclSuccess || result == ncclInProgress) && comm != NULL) {
            int timed_out;
            if (settle_init(lib, comm, timeout_s, &result, &timed_out) < 0)
                goto error;
            if (timed_out) {
                char seconds[32];      /* PyErr_Format has no %g */
                snprintf(seconds, sizeof(seconds), "%g", timeout_s);
                PyErr_Format(PyExc_TimeoutError, "%s (rank %d of %d, device %d) did not finish "
                             "within %s s: another rank failed in it or never called it; the "
                             "communicator is aborted", init_name, rank, world_size, device,
                             seconds);
                goto error;
            }
        }
    } else {
        Py_BEGIN_ALLOW_THREADS
        result = lib->CommInitRank(&comm, world_size, id, rank);
        Py_END_ALLOW_THREADS
    }
    snprintf(what, sizeof(what), "%s (rank %d of %d, device %d)", init_name, rank, world_size,
             device);
    RLHFZ_NCCL_CHECK(lib, result, what);

    /* NCCL binds the communicator to the device current at init. The caller
     * promised that is `device`; a mismatch would put this rank's traffic on
     * another GPU, so it is refused rather than remembered wrongly. */
    if (lib->CommCuDevice != NULL) {
        int actual = -1;
        if (lib->CommCuDevice(comm, &actual) == ncclSuccess && actual != device) {
            PyErr_Format(PyExc_ValueError, "NcclComm: device=%d was given, but CUDA device %d was "
                         "current, and NCCL bound the communicator to it: make the device current "
                         "first (torch.cuda.set_device(%d))", device, actual, device);
            goto error;
        }
    }
    self->comm = comm;
    self->state = COMM_ALIVE;
    return (PyObject *)self;

error:
    if (comm != NULL) {
        /* A failed blocking init normally returns no handle; a non-blocking
         * one does, and so may the device check: it must be aborted. */
        Py_BEGIN_ALLOW_THREADS
        (void)lib->CommAbort(comm);
        Py_END_ALLOW_THREADS
    }
    Py_XDECREF(capsule);
    Py_XDECREF(self);    /* unconnected: its dealloc does nothing more */
    return NULL;
}

static PyObject *NcclComm_unconnected(PyTypeObject *type, PyObject *const *args, Py_ssize_t nargs,
                                      PyObject *kwnames)
{
    static const char *const names[] = {"world_size", "rank", "device", NULL};
    PyObject *slots[3];
    if (rlhfz_parse_args("_unconnected", args, nargs, kwnames, names, 3, 2, slots) < 0)
        return NULL;
    int world_size, rank, device;
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL)
        return NULL;
    int rc = arg_geometry("NcclComm._unconnected", slots[0], slots[1],
                          slots[2] != NULL ? slots[2] : zero, &world_size, &rank, &device);
    Py_DECREF(zero);
    if (rc < 0)
        return NULL;
    NcclComm *self = (NcclComm *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->state = COMM_UNCONNECTED;
    self->world_size = world_size;
    self->rank = rank;
    self->device = device;
    return (PyObject *)self;
}

static void warn_leaked(NcclComm *self)
{
#if PY_VERSION_HEX >= 0x030D0000
    if (Py_IsFinalizing())
        return;
#endif
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *saved = PyErr_GetRaisedException();
#else
    PyObject *saved_type, *saved_value, *saved_tb;
    PyErr_Fetch(&saved_type, &saved_value, &saved_tb);
#endif
    /* No source object: the warning must not keep a dying object alive. */
    if (PyErr_ResourceWarning(NULL, 1, "NcclComm (rank %d of %d, device %d) was never destroyed: "
                              "its NCCL communicator is leaked; call destroy() or abort()",
                              self->rank, self->world_size, self->device) < 0)
        PyErr_WriteUnraisable(NULL);
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(saved);
#else
    PyErr_Restore(saved_type, saved_value, saved_tb);
#endif
}

static void NcclComm_dealloc(NcclComm *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    /* A live communicator is leaked, not destroyed: ncclCommDestroy waits for
     * the other ranks' work and ncclCommAbort joins NCCL's threads, either of
     * which can block or hang here, e.g. at interpreter exit. */
    if (self->state == COMM_ALIVE)
        warn_leaked(self);
    Py_CLEAR(self->library);
    type->tp_free(self);
    Py_DECREF(type);
}

static int NcclComm_traverse(NcclComm *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->library);
    return 0;
}

/* ---- collectives ------------------------------------------------------------------------ */

typedef enum {
    COLL_ALL_REDUCE,
    COLL_REDUCE_SCATTER,
    COLL_ALL_GATHER,
    COLL_BROADCAST
} coll_kind;

/* What NCCL is called with, taken from the checked arguments. */
typedef struct {
    coll_kind kind;
    const char *method;          /* NcclComm.<method>, for messages */
    const char *nccl_name;       /* the NCCL function it calls */
    const void *send;
    void *recv;
    size_t count;                /* NCCL's count: per rank for reduce_scatter and all_gather */
    ncclDataType_t dtype;
    ncclRedOp_t op;
    int root;
    void *stream;                /* NULL: the legacy default stream */
} coll_args;

static ncclDataType_t nccl_dtype(rlhfz_dtype dtype)
{
    switch (dtype) {
    case RLHFZ_DTYPE_BF16: return ncclBfloat16;
    case RLHFZ_DTYPE_F16: return ncclFloat16;
    case RLHFZ_DTYPE_I8: return ncclInt8;
    case RLHFZ_DTYPE_U8: return ncclUint8;
    case RLHFZ_DTYPE_F32: break;
    }
    return ncclFloat32;
}

/* NCCL runs on the communicator's device; memory of another device would
 * be read through the wrong GPU, or fault. */
static int check_on_device(const NcclComm *self, const rlhfz_array *array, const char *name)
{
    if (array->device.device_id != self->device) {
        PyErr_Format(PyExc_ValueError, "NcclComm: %s is on cuda:%d but the communicator is on "
                     "cuda:%d", name, (int)array->device.device_id, self->device);
        return -1;
    }
    return 0;
}

/* `parts` must hold world_size times `whole`'s elements: the full side of a
 * reduce_scatter (send) or an all_gather (recv). */
static int check_world_parts(const NcclComm *self, const char *method, const rlhfz_array *whole,
                             const char *whole_name, const rlhfz_array *part, const char *part_name)
{
    size_t world = (size_t)self->world_size;
    if (part->numel > SIZE_MAX / world || whole->numel != part->numel * world) {
        PyErr_Format(PyExc_ValueError, "NcclComm.%s: %s has %zu elements but must have "
                     "world_size (%d) times %s's %zu", method, whole_name, whole->numel,
                     self->world_size, part_name, part->numel);
        return -1;
    }
    return 0;
}

/* In place is the one overlap NCCL allows: send == recv for all_reduce and
 * broadcast, recv == send + rank * chunk for reduce_scatter, send == recv +
 * rank * chunk for all_gather; any other overlap reads values the
 * collective is writing. */
static int check_overlap(const NcclComm *self, const coll_args *a, const rlhfz_array *send,
                         const rlhfz_array *recv)
{
    size_t itemsize = rlhfz_dtype_size(recv->dtype);
    uintptr_t s0 = (uintptr_t)send->data, s1 = s0 + send->numel * itemsize;
    uintptr_t r0 = (uintptr_t)recv->data, r1 = r0 + recv->numel * itemsize;
    if (send->numel == 0 || recv->numel == 0 || s1 <= r0 || r1 <= s0)
        return 0;
    size_t offset = (size_t)self->rank * a->count * itemsize;
    int in_place;
    const char *rule;
    switch (a->kind) {
    case COLL_REDUCE_SCATTER:
        in_place = r0 >= s0 && r0 - s0 == offset;
        rule = "recv must be this rank's part of send (send's address + rank * recv's bytes)";
        break;
    case COLL_ALL_GATHER:
        in_place = s0 >= r0 && s0 - r0 == offset;
        rule = "send must be this rank's part of recv (recv's address + rank * send's bytes)";
        break;
    default:
        in_place = s0 == r0;
        rule = "send and recv must be the same memory";
        break;
    }
    if (!in_place) {
        PyErr_Format(PyExc_ValueError, "NcclComm.%s: send (%p, %zu bytes) and recv (%p, %zu "
                     "bytes) overlap; the only overlap allowed is in place: %s", a->method,
                     (void *)s0, (size_t)(s1 - s0), (void *)r0, (size_t)(r1 - r0), rule);
        return -1;
    }
    return 0;
}

/* Borrows recv (written) and send (read) as CUDA arrays and checks them
 * against each other and the communicator; fills a's buffers, dtype and
 * count. a->kind, root and stream are set. send may be None only where it is
 * not read: a broadcast on a rank other than the root (recv stands in for
 * it). On failure the caller still releases b. */
static int borrow_buffers(NcclComm *self, PyObject *module, rlhfz_borrowed *b, coll_args *a,
                          PyObject *send_obj, PyObject *recv_obj)
{
    int reads_send = a->kind != COLL_BROADCAST || a->root == self->rank;
    rlhfz_array *recv = rlhfz_borrow(module, b, recv_obj, "recv", 1, RLHFZ_PLACE_CUDA, a->stream);
    if (recv == NULL)
        return -1;
    rlhfz_array *send = NULL;
    if (send_obj == Py_None && reads_send) {
        if (a->kind == COLL_BROADCAST)
            PyErr_Format(PyExc_TypeError, "NcclComm.broadcast: send is None, but this rank (%d) "
                         "is the root: its send is what every rank receives", self->rank);
        else
            PyErr_Format(PyExc_TypeError, "NcclComm.%s: send must be an array, not None",
                         a->method);
        return -1;
    }
    if (send_obj != Py_None &&
        (send = rlhfz_borrow(module, b, send_obj, "send", 0, RLHFZ_PLACE_CUDA, a->stream)) == NULL)
        return -1;
    if (check_on_device(self, recv, "recv") < 0 ||
        (send != NULL && (check_on_device(self, send, "send") < 0 ||
                          rlhfz_check_dtype(send, "send", recv->dtype) < 0)))
        return -1;
    switch (a->kind) {
    case COLL_REDUCE_SCATTER:
        if (check_world_parts(self, a->method, send, "send", recv, "recv") < 0)
            return -1;
        a->count = recv->numel;
        break;
    case COLL_ALL_GATHER:
        if (check_world_parts(self, a->method, recv, "recv", send, "send") < 0)
            return -1;
        a->count = send->numel;
        break;
    default:
        if (send != NULL && rlhfz_check_numel(send, "send", recv->numel, "recv") < 0)
            return -1;
        a->count = recv->numel;
        break;
    }
    if (reads_send && check_overlap(self, a, send, recv) < 0)
        return -1;
    a->send = send != NULL ? send->data : recv->data;
    a->recv = recv->data;
    a->dtype = nccl_dtype(recv->dtype);
    return 0;
}

/* Parses op, root and stream (scalars first: the stream goes to the
 * producers of the arrays), then borrows and checks the arrays. */
static int collective_args(NcclComm *self, PyObject *module, rlhfz_borrowed *b, coll_args *a,
                           PyObject *send, PyObject *recv, PyObject *op, PyObject *root,
                           PyObject *stream)
{
    char func[64];
    snprintf(func, sizeof(func), "NcclComm.%s", a->method);
    if ((op != NULL && arg_op(op, func, &a->op) < 0) || rlhfz_arg_stream(stream, &a->stream) < 0)
        return -1;
    if (root != NULL) {
        int64_t value;
        if (rlhfz_arg_int64(root, "root", &value) < 0)
            return -1;
        if (value < 0 || value >= self->world_size) {
            PyErr_Format(PyExc_ValueError, "%s: root must be in [0, world_size) = [0, %d), not %lld",
                         func, self->world_size, (long long)value);
            return -1;
        }
        a->root = (int)value;
    }
    return borrow_buffers(self, module, b, a, send, recv);
}

#ifdef RLHFZ_WITH_CUDA
/* The NCCL call itself; runs without the GIL. */
static ncclResult_t call_nccl(const rlhfz_nccl_library *lib, ncclComm_t comm, const coll_args *a)
{
    switch (a->kind) {
    case COLL_ALL_REDUCE:
        return lib->AllReduce(a->send, a->recv, a->count, a->dtype, a->op, comm, a->stream);
    case COLL_REDUCE_SCATTER:
        return lib->ReduceScatter(a->send, a->recv, a->count, a->dtype, a->op, comm, a->stream);
    case COLL_ALL_GATHER:
        return lib->AllGather(a->send, a->recv, a->count, a->dtype, comm, a->stream);
    case COLL_BROADCAST:
        return lib->Broadcast(a->send, a->recv, a->count, a->dtype, a->root, comm, a->stream);
    }
    return ncclInvalidArgument;
}
#endif

/* Queues the collective on a->stream with the GIL released, then keeps the
 * DLPack borrows of b behind an event recorded after it (rlhfz views need no
 * keeping: a view holds its Buffer, and freeing device memory waits for the
 * device). Releases b on every path. */
static PyObject *run_collective(NcclComm *self, rlhfz_state *state, const coll_args *a,
                                rlhfz_borrowed *b)
{
    char func[64];
    snprintf(func, sizeof(func), "NcclComm.%s", a->method);
    if (require_alive(self, a->method) < 0)
        goto refused;
    if (self->collective_in_flight) {
        PyErr_Format(PyExc_RuntimeError, "NcclComm.%s: another thread is inside a collective on "
                     "this communicator; NCCL communicators must not be used from two threads at "
                     "once", a->method);
        goto refused;
    }
#ifndef RLHFZ_WITH_CUDA
    /* Without the CUDA runtime there is no event to keep the borrows behind,
     * and nothing to tell when NCCL is done with them. */
    rlhfz_require_cuda(func);
    goto refused;
#else
    rlhfz_inflight *inflight = state->inflight;
    rlhfz_inflight_sweep(inflight);
    int keep = rlhfz_inflight_needed(b);
    void *event = keep ? rlhfz_inflight_spare_event(inflight, self->device) : NULL;
    const rlhfz_nccl_library *lib = self->lib;
    ncclComm_t comm = self->comm;
    ncclResult_t result = ncclSuccess;
    rlhfz_status device_status = RLHFZ_OK;
    int kept = 0;                /* the borrows wait behind `event` */
    int expired = 0;             /* still in progress at the timeout */
    self->collective_in_flight = 1;
    Py_BEGIN_ALLOW_THREADS
    int previous = self->device;
    /* The event is made and recorded on the communicator's device (NCCL sets
     * the device for its own call and puts the caller's back). */
    if (keep)
        device_status = rlhfz_device_enter(self->device, &previous);
    if (device_status == RLHFZ_OK) {
        result = call_nccl(lib, comm, a);
        /* in progress: queued on the stream only once it settles, so the
         * fence after it waits for that */
        if (result == ncclInProgress && self->nonblocking) {
            atomic_store(&self->polling, 1);
            result = settle(lib, comm, self->timeout_s > 0 ? monotonic_s() + self->timeout_s
                                                           : INFINITY, &self->stop_polling,
                            &expired);
            atomic_store(&self->polling, 0);
        }
        if (result == ncclSuccess && keep)
            kept = rlhfz_inflight_fence(&event, a->stream);
        if (keep)
            device_status = rlhfz_device_leave(self->device, previous, device_status);
    }
    Py_END_ALLOW_THREADS
    self->collective_in_flight = 0;

    rlhfz_inflight_settle(inflight, b, event, self->device, kept);
    /* The errors are set here rather than through RLHFZ_NCCL_CHECK's goto:
     * the borrows go on every path, after the exception is set. */
    PyObject *out = NULL;
    if (expired == 2) {
        PyErr_Format(PyExc_RuntimeError, "%s (NcclComm.%s, rank %d of %d) was still in progress "
                     "when the communicator was aborted %s", a->nccl_name, a->method, self->rank,
                     self->world_size, self->reason);
    } else if (expired) {
        char seconds[32];      /* PyErr_Format has no %g */
        snprintf(seconds, sizeof(seconds), "%g", self->timeout_s);
        PyErr_Format(PyExc_TimeoutError, "%s (NcclComm.%s, rank %d of %d) was still in progress "
                     "after %s s; the communicator is aborted", a->nccl_name, a->method,
                     self->rank, self->world_size, seconds);
        comm_abort(self, "after a call stayed in progress past the timeout");
    } else if (result != ncclSuccess) {
        char what[160];
        snprintf(what, sizeof(what), "%s (NcclComm.%s, rank %d of %d; the communicator is aborted)",
                 a->nccl_name, a->method, self->rank, self->world_size);
        rlhfz_nccl_set_error(lib, result, what, __FILE__, __LINE__);
        /* Another thread may have aborted it meanwhile; then this does nothing. */
        comm_abort_after_error(self, a->nccl_name, result);
    } else if (device_status != RLHFZ_OK) {
        rlhfz_raise_cuda(func);
    } else {
        out = Py_NewRef(Py_None);
    }
    rlhfz_borrowed_release(b);
    return out;
#endif
refused:
    rlhfz_borrowed_release(b);
    return NULL;
}

/* The method bodies: bind the arguments, borrow and check, run. */
static PyObject *collective(NcclComm *self, coll_args *a, PyObject *send, PyObject *recv,
                            PyObject *op, PyObject *root, PyObject *stream)
{
    PyObject *module = PyType_GetModule(Py_TYPE(self));
    if (module == NULL)
        return NULL;
    rlhfz_borrowed b = {.count = 0};
    if (collective_args(self, module, &b, a, send, recv, op, root, stream) < 0) {
        rlhfz_borrowed_release(&b);
        return NULL;
    }
    return run_collective(self, rlhfz_get_state(module), a, &b);
}

static PyObject *NcclComm_all_reduce(NcclComm *self, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    static const char *const names[] = {"send", "recv", "op", "stream", NULL};
    PyObject *slots[4];
    if (rlhfz_parse_args("all_reduce", args, nargs, kwnames, names, 3, 3, slots) < 0)
        return NULL;
    coll_args a = {.kind = COLL_ALL_REDUCE, .method = "all_reduce", .nccl_name = "ncclAllReduce"};
    return collective(self, &a, slots[0], slots[1], slots[2], NULL, slots[3]);
}

static PyObject *NcclComm_reduce_scatter(NcclComm *self, PyObject *const *args, Py_ssize_t nargs,
                                         PyObject *kwnames)
{
    static const char *const names[] = {"send", "recv", "op", "stream", NULL};
    PyObject *slots[4];
    if (rlhfz_parse_args("reduce_scatter", args, nargs, kwnames, names, 3, 3, slots) < 0)
        return NULL;
    coll_args a = {.kind = COLL_REDUCE_SCATTER, .method = "reduce_scatter",
                   .nccl_name = "ncclReduceScatter"};
    return collective(self, &a, slots[0], slots[1], slots[2], NULL, slots[3]);
}

static PyObject *NcclComm_all_gather(NcclComm *self, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    static const char *const names[] = {"send", "recv", "stream", NULL};
    PyObject *slots[3];
    if (rlhfz_parse_args("all_gather", args, nargs, kwnames, names, 2, 2, slots) < 0)
        return NULL;
    coll_args a = {.kind = COLL_ALL_GATHER, .method = "all_gather", .nccl_name = "ncclAllGather"};
    return collective(self, &a, slots[0], slots[1], NULL, NULL, slots[2]);
}

static PyObject *NcclComm_broadcast(NcclComm *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames)
{
    static const char *const names[] = {"send", "recv", "root", "stream", NULL};
    PyObject *slots[4];
    if (rlhfz_parse_args("broadcast", args, nargs, kwnames, names, 3, 3, slots) < 0)
        return NULL;
    coll_args a = {.kind = COLL_BROADCAST, .method = "broadcast", .nccl_name = "ncclBroadcast"};
    return collective(self, &a, slots[0], slots[1], NULL, slots[2], slots[3]);
}

/* ---- health and teardown ------------------------------------------------------------------ */

/* NCCL's asynchronous error, if any: set as the Python exception, and the
 * communicator aborted. Returns 0 when healthy. The query runs with the GIL
 * held: it only reads a flag and never blocks, and holding the GIL keeps it
 * atomic with respect to destroy() and abort() in other threads. */
static int check_async_error(NcclComm *self, const char *method)
{
    const rlhfz_nccl_library *lib = self->lib;
    ncclResult_t async_error = ncclSuccess;
    ncclResult_t result = lib->CommGetAsyncError(self->comm, &async_error);
    const char *nccl_name = "ncclCommGetAsyncError";
    char what[200];
    if (result == ncclSuccess) {
        /* ncclInProgress only means a non-blocking call is still running. */
        if (async_error == ncclSuccess || async_error == ncclInProgress)
            return 0;
        result = async_error;
        nccl_name = "an asynchronous NCCL operation (ncclCommGetAsyncError)";
    }
    snprintf(what, sizeof(what), "%s (NcclComm.%s, rank %d of %d; the communicator is aborted)",
             nccl_name, method, self->rank, self->world_size);
    RLHFZ_NCCL_CHECK(lib, result, what);
    return 0;
error:
    comm_abort_after_error(self, nccl_name, result);
    return -1;
}

static PyObject *NcclComm_check(NcclComm *self, PyObject *unused)
{
    if (require_alive(self, "check") < 0 || check_async_error(self, "check") < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *NcclComm_abort(NcclComm *self, PyObject *unused)
{
    const rlhfz_nccl_library *lib = self->lib;
    ncclResult_t result = comm_abort(self, "by abort()");
    RLHFZ_NCCL_CHECK(lib, result, "ncclCommAbort (NcclComm.abort)");
    Py_RETURN_NONE;
error:
    return NULL;
}

static PyObject *NcclComm_destroy(NcclComm *self, PyObject *unused)
{
    if (self->state != COMM_ALIVE)
        Py_RETURN_NONE;
    if (self->collective_in_flight) {
        PyErr_SetString(PyExc_RuntimeError, "NcclComm.destroy: another thread is inside a collective "
                        "on this communicator; wait for it, or call abort()");
        return NULL;
    }
    /* ncclCommDestroy waits for outstanding work, which never finishes after
     * an asynchronous error (e.g. a peer died): abort instead, and say why. */
    if (check_async_error(self, "destroy") < 0)
        return NULL;
    const rlhfz_nccl_library *lib = self->lib;
    ncclComm_t comm = self->comm;
    self->comm = NULL;
    self->state = COMM_DESTROYED;
    ncclResult_t result;
    Py_BEGIN_ALLOW_THREADS
    result = lib->CommDestroy(comm);
    Py_END_ALLOW_THREADS
    if (result == ncclInProgress)
        result = ncclSuccess;    /* a non-blocking communicator's: NCCL finishes it alone */
    RLHFZ_NCCL_CHECK(lib, result, "ncclCommDestroy (NcclComm.destroy)");
    Py_RETURN_NONE;
error:
    return NULL;
}

static PyObject *NcclComm_get_rank(NcclComm *self, void *c) { return PyLong_FromLong(self->rank); }
static PyObject *NcclComm_get_world_size(NcclComm *self, void *c) { return PyLong_FromLong(self->world_size); }
static PyObject *NcclComm_get_device(NcclComm *self, void *c) { return PyLong_FromLong(self->device); }
static PyObject *NcclComm_get_alive(NcclComm *self, void *c) { return PyBool_FromLong(self->state == COMM_ALIVE); }
static PyObject *NcclComm_get_state(NcclComm *self, void *c) { return PyUnicode_FromString(state_name(self->state)); }

static PyObject *NcclComm_repr(NcclComm *self)
{
    return PyUnicode_FromFormat("<rlhfz._C.NcclComm rank %d of %d, device %d, %s>", self->rank,
                                self->world_size, self->device, state_name(self->state));
}

static PyMethodDef NcclComm_methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))NcclComm_all_reduce, METH_FASTCALL | METH_KEYWORDS,
     "all_reduce(send, recv, op, *, stream=None)\n\n"
     "recv = op over ranks of send. send and recv: rlhfz device views or CUDA tensors\n"
     "(DLPack) on the communicator's device, of one dtype (float32, bfloat16 or float16)\n"
     "and size; in place if they are the same memory. op: 'sum', 'avg', 'max' or 'min'.\n"
     "stream: None (the legacy default stream), a handle, or a stream object. Queued on\n"
     "stream, not waited for; a borrowed tensor is kept until the collective is done."},
    {"reduce_scatter", (PyCFunction)(void (*)(void))NcclComm_reduce_scatter,
     METH_FASTCALL | METH_KEYWORDS,
     "reduce_scatter(send, recv, op, *, stream=None)\n\n"
     "send holds world_size times recv's elements; recv gets this rank's reduced part.\n"
     "In place: recv is this rank's part of send."},
    {"all_gather", (PyCFunction)(void (*)(void))NcclComm_all_gather, METH_FASTCALL | METH_KEYWORDS,
     "all_gather(send, recv, *, stream=None)\n\n"
     "recv (world_size times send's elements) gets every rank's send, in rank order.\n"
     "In place: send is this rank's part of recv."},
    {"broadcast", (PyCFunction)(void (*)(void))NcclComm_broadcast, METH_FASTCALL | METH_KEYWORDS,
     "broadcast(send, recv, root, *, stream=None)\n\n"
     "recv = root's send on every rank. send is read only on root; elsewhere it may be\n"
     "None (if given, it is checked as on the root)."},
    {"check", (PyCFunction)NcclComm_check, METH_NOARGS,
     "check(): raise RuntimeError, after aborting the communicator, if NCCL reports an\n"
     "asynchronous error (ncclCommGetAsyncError). Never blocks."},
    {"abort", (PyCFunction)NcclComm_abort, METH_NOARGS,
     "abort(): ncclCommAbort; idempotent. The way out of a hang: it may be called while\n"
     "another thread is inside a collective."},
    {"destroy", (PyCFunction)NcclComm_destroy, METH_NOARGS,
     "destroy(): ncclCommDestroy (waits for outstanding work); idempotent. With an\n"
     "asynchronous error pending it aborts instead and raises RuntimeError."},
    {"_unconnected", (PyCFunction)(void (*)(void))NcclComm_unconnected,
     METH_FASTCALL | METH_KEYWORDS | METH_CLASS,
     "_unconnected(world_size, rank, device=0) -> NcclComm\n\n"
     "A communicator that never connects, to test argument checking without a GPU:\n"
     "collectives check their arguments, then raise RuntimeError."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef NcclComm_getset[] = {
    {"rank", (getter)NcclComm_get_rank, NULL, "this process's rank", NULL},
    {"world_size", (getter)NcclComm_get_world_size, NULL, "number of ranks", NULL},
    {"device", (getter)NcclComm_get_device, NULL, "the CUDA device ordinal it was created on", NULL},
    {"alive", (getter)NcclComm_get_alive, NULL, "True until destroy() or abort()", NULL},
    {"state", (getter)NcclComm_get_state, NULL,
     "'alive', 'destroyed', 'aborted' or 'unconnected'", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot NcclComm_slots[] = {
    {Py_tp_doc, "NcclComm(unique_id, world_size, rank, device, *, timeout=None)\n\n"
                "An NCCL communicator over rlhfz borrows (device views, CUDA tensors through\n"
                "DLPack), checked as the kernels check theirs. The caller makes `device`\n"
                "current first (torch.cuda.set_device); construction waits until all\n"
                "world_size ranks have joined with the same unique_id (nccl_unique_id()).\n"
                "From NCCL 2.14 the communicator is non-blocking: init, and any call NCCL\n"
                "leaves in progress, is polled for at most timeout seconds (None: no limit),\n"
                "then aborted with TimeoutError. Before 2.14 init blocks without a limit.\n"
                "Call destroy() (or abort()) explicitly: a live communicator is leaked, with a\n"
                "ResourceWarning, when the object is freed. Any NCCL error aborts it."},
    {Py_tp_new, NcclComm_new},
    {Py_tp_dealloc, NcclComm_dealloc},
    {Py_tp_traverse, NcclComm_traverse},
    {Py_tp_repr, NcclComm_repr},
    {Py_tp_methods, NcclComm_methods},
    {Py_tp_getset, NcclComm_getset},
    {0, NULL},
};

static PyType_Spec NcclComm_spec = {
    .name = "rlhfz._C.NcclComm",
    .basicsize = sizeof(NcclComm),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = NcclComm_slots,
};

/* ---- registration ------------------------------------------------------------------------- */

int rlhfz_nccl_comm_add_type(PyObject *module)
{
    PyObject *type = PyType_FromModuleAndSpec(module, &NcclComm_spec, NULL);
    if (type == NULL)
        return -1;
    int rc = PyModule_AddType(module, (PyTypeObject *)type);
    Py_DECREF(type);
    return rc;
}
