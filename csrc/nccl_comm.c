/* nccl_comm.c: a native NCCL communicator for rlhfz._C, with libnccl.so.2
 * opened lazily through dlopen (no link-time dependency on NCCL or CUDA).
 *
 * Python surface: nccl_load(path=None), nccl_version(), nccl_unique_id() and
 * the NcclComm type, whose collectives take raw device addresses, element
 * counts, dtype names and a cudaStream_t handle, all as Python ints and str.
 * The caller (rlhfz/ with torch) makes the right device current and keeps the
 * buffers alive until the stream has run the collective.
 *
 * Every argument is checked before NCCL is called; every NCCL call that can
 * block runs with the GIL released. A communicator that saw an NCCL error is
 * aborted (ncclCommAbort), never left half-usable: after a failed collective
 * the ranks no longer agree on the order of operations, and the next
 * collective would hang.
 */
#include "nccl_comm.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* The library table lives in a capsule, one per module instance, stored in
 * the module as _nccl_library: rlhfz_state (shared by every csrc file) has no
 * slot for it, and this keeps it out of C globals. Each NcclComm holds a
 * reference to the capsule, so the table outlives every communicator. */
#define LIBRARY_ATTR "_nccl_library"
#define LIBRARY_CAPSULE "rlhfz._C._nccl_library"

/* ---- errors ------------------------------------------------------------------ */

static const char *result_name(ncclResult_t result)
{
    switch (result) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    }
    return "unknown ncclResult_t";
}

void rlhfz_nccl_set_error(const rlhfz_nccl_library *lib, ncclResult_t result, const char *what,
                          const char *file, int line)
{
    if (PyErr_Occurred())
        return;
    const char *text = lib != NULL && lib->GetErrorString != NULL ? lib->GetErrorString(result) : NULL;
    /* NCCL keeps the last error per thread and ignores the comm argument
     * (documented: it may be NULL); this is the thread that made the call. */
    const char *last = lib != NULL && lib->GetLastError != NULL ? lib->GetLastError(NULL) : NULL;
    if (text == NULL)
        text = "no description";
    if (last != NULL && last[0] != '\0')
        PyErr_Format(PyExc_RuntimeError, "%s:%d: %s failed: %s (%d): %s; last error: %s",
                     file, line, what, result_name(result), (int)result, text, last);
    else
        PyErr_Format(PyExc_RuntimeError, "%s:%d: %s failed: %s (%d): %s",
                     file, line, what, result_name(result), (int)result, text);
}

/* ---- loading libnccl.so.2 ------------------------------------------------------- */

static const struct {
    const char *name;
    size_t offset;
    int required;
} nccl_symbols[] = {
    {"ncclGetVersion", offsetof(rlhfz_nccl_library, GetVersion), 1},
    {"ncclGetUniqueId", offsetof(rlhfz_nccl_library, GetUniqueId), 1},
    {"ncclCommInitRank", offsetof(rlhfz_nccl_library, CommInitRank), 1},
    {"ncclCommDestroy", offsetof(rlhfz_nccl_library, CommDestroy), 1},
    {"ncclCommAbort", offsetof(rlhfz_nccl_library, CommAbort), 1},
    {"ncclCommGetAsyncError", offsetof(rlhfz_nccl_library, CommGetAsyncError), 1},
    {"ncclGetErrorString", offsetof(rlhfz_nccl_library, GetErrorString), 1},
    {"ncclGetLastError", offsetof(rlhfz_nccl_library, GetLastError), 0},
    {"ncclCommCuDevice", offsetof(rlhfz_nccl_library, CommCuDevice), 0},
    {"ncclAllReduce", offsetof(rlhfz_nccl_library, AllReduce), 1},
    {"ncclReduceScatter", offsetof(rlhfz_nccl_library, ReduceScatter), 1},
    {"ncclAllGather", offsetof(rlhfz_nccl_library, AllGather), 1},
    {"ncclBroadcast", offsetof(rlhfz_nccl_library, Broadcast), 1},
    {"ncclGroupStart", offsetof(rlhfz_nccl_library, GroupStart), 1},
    {"ncclGroupEnd", offsetof(rlhfz_nccl_library, GroupEnd), 1},
};

/* dlerror() texts of the attempts that failed (each names its file), for
 * the final message. */
typedef struct {
    char text[2048];
    size_t length;
} attempts;

static void attempts_add(attempts *a, const char *file, const char *error)
{
    size_t room = sizeof(a->text) - a->length;
    if (room <= 1)
        return;
    int n = error != NULL ? snprintf(a->text + a->length, room, "%s%s", a->length ? "; " : "", error)
                          : snprintf(a->text + a->length, room, "%s%s: unknown error",
                                     a->length ? "; " : "", file);
    if (n > 0)
        a->length += (size_t)n < room ? (size_t)n : room - 1;
}

/* Opens NCCL, in this order: the copy already in the process (torch's,
 * usually: two NCCLs in one process is asking for trouble), the file named by
 * RLHFZ_NCCL_LIBRARY, `path` (e.g. the pip wheel's, found by the Python
 * layer), then the dynamic linker's search. Sets RuntimeError on failure. */
static void *open_library(const char *path)
{
    attempts tried = {.length = 0};
    void *handle = dlopen(RLHFZ_NCCL_SONAME, RTLD_NOW | RTLD_NOLOAD);
    if (handle != NULL)
        return handle;
    const char *env = getenv("RLHFZ_NCCL_LIBRARY");
    if (env != NULL && env[0] != '\0') {
        /* An explicit choice: failing over to another copy would hide it. */
        handle = dlopen(env, RTLD_NOW | RTLD_LOCAL);
        if (handle == NULL) {
            const char *error = dlerror();
            PyErr_Format(PyExc_RuntimeError, "RLHFZ_NCCL_LIBRARY=%s could not be loaded: %s",
                         env, error != NULL ? error : "unknown error");
        }
        return handle;
    }
    if (path != NULL) {
        handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (handle != NULL)
            return handle;
        attempts_add(&tried, path, dlerror());
    }
    handle = dlopen(RLHFZ_NCCL_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (handle != NULL)
        return handle;
    attempts_add(&tried, RLHFZ_NCCL_SONAME, dlerror());
    PyErr_Format(PyExc_RuntimeError,
                 "NCCL (%s) could not be loaded: %s. Install the nvidia-nccl-cu13 (or -cu12) "
                 "wheel, or set RLHFZ_NCCL_LIBRARY to the path of a libnccl.so.2",
                 RLHFZ_NCCL_SONAME, tried.text);
    return NULL;
}

/* Fills *lib on success; on failure sets an exception and leaves *lib as it
 * was. Runs with the GIL held, so two threads cannot load at once (the load
 * happens once per module, and NCCL's constructors take no Python locks). */
static int library_load(rlhfz_nccl_library *lib, const char *path)
{
    if (lib->handle != NULL)
        return 0;
    void *handle = open_library(path);
    if (handle == NULL)
        return -1;
    rlhfz_nccl_library staged;
    memset(&staged, 0, sizeof(staged));
    void *version_symbol = dlsym(handle, "ncclGetVersion");
    Dl_info info;
    const char *file = RLHFZ_NCCL_SONAME;
    if (version_symbol != NULL && dladdr(version_symbol, &info) && info.dli_fname != NULL &&
        info.dli_fname[0] != '\0')
        file = info.dli_fname;
    for (size_t i = 0; i < sizeof(nccl_symbols) / sizeof(nccl_symbols[0]); i++) {
        void *symbol = dlsym(handle, nccl_symbols[i].name);
        if (symbol == NULL && nccl_symbols[i].required) {
            PyErr_Format(PyExc_RuntimeError, "the NCCL library %s has no symbol %s (rlhfz needs "
                         "NCCL >= 2.10)", file, nccl_symbols[i].name);
            goto error;
        }
        /* POSIX guarantees that a dlsym result converts to a function
         * pointer; copying the bits keeps the table generic. */
        memcpy((char *)&staged + nccl_symbols[i].offset, &symbol, sizeof(symbol));
    }
    RLHFZ_NCCL_CHECK(&staged, staged.GetVersion(&staged.version), "ncclGetVersion");
    if (staged.version < RLHFZ_NCCL_MIN_VERSION) {
        PyErr_Format(PyExc_RuntimeError, "the NCCL library %s is version %d: rlhfz needs NCCL >= "
                     "2.10 (%d), for bfloat16 and the average reduction", file, staged.version,
                     RLHFZ_NCCL_MIN_VERSION);
        goto error;
    }
    staged.path = realpath(file, NULL);
    if (staged.path == NULL)
        staged.path = strdup(file);
    if (staged.path == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    staged.handle = handle;
    *lib = staged;
    return 0;
error:
    /* Nothing of this library is in use yet, so it may go (a copy that was
     * already in the process only loses the reference taken here). */
    dlclose(handle);
    return -1;
}

/* The library table of `module` (a borrowed pointer kept alive by the
 * capsule), loading NCCL if needed; *capsule_out, if not NULL, gets a new
 * reference to the capsule. */
static rlhfz_nccl_library *library_get(PyObject *module, const char *path, PyObject **capsule_out)
{
    PyObject *capsule = PyObject_GetAttrString(module, LIBRARY_ATTR);
    if (capsule == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_RuntimeError, "rlhfz._C has lost its NCCL library table ("
                            LIBRARY_ATTR " was deleted)");
        }
        return NULL;
    }
    if (!PyCapsule_IsValid(capsule, LIBRARY_CAPSULE)) {
        Py_DECREF(capsule);
        PyErr_SetString(PyExc_RuntimeError, "rlhfz._C." LIBRARY_ATTR " is not rlhfz's NCCL "
                        "library table (it was replaced)");
        return NULL;
    }
    rlhfz_nccl_library *lib = PyCapsule_GetPointer(capsule, LIBRARY_CAPSULE);
    if (lib == NULL || library_load(lib, path) < 0) {
        Py_DECREF(capsule);
        return NULL;
    }
    if (capsule_out != NULL)
        *capsule_out = capsule;
    else
        Py_DECREF(capsule);
    return lib;
}

static void library_capsule_destructor(PyObject *capsule)
{
    rlhfz_nccl_library *lib = PyCapsule_GetPointer(capsule, LIBRARY_CAPSULE);
    if (lib == NULL) {
        PyErr_Clear();
        return;
    }
    /* The handle is never dlclose'd: NCCL runs threads of its own, and a
     * communicator leaked at exit may still be using its code. */
    free(lib->path);
    free(lib);
}

/* ---- module functions ------------------------------------------------------------- */

static PyObject *nccl_load(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames)
{
    static const char *const names[] = {"path", NULL};
    PyObject *slots[1];
    if (rlhfz_parse_args("nccl_load", args, nargs, kwnames, names, 1, 0, slots) < 0)
        return NULL;
    PyObject *path_bytes = NULL;
    const char *path = NULL;
    if (slots[0] != NULL && slots[0] != Py_None) {
        if (!PyUnicode_FSConverter(slots[0], &path_bytes))
            return NULL;
        path = PyBytes_AS_STRING(path_bytes);
        if (path[0] == '\0') {
            Py_DECREF(path_bytes);
            PyErr_SetString(PyExc_ValueError, "nccl_load(): path must not be empty");
            return NULL;
        }
    }
    rlhfz_nccl_library *lib = library_get(module, path, NULL);
    Py_XDECREF(path_bytes);
    if (lib == NULL)
        return NULL;
    return PyUnicode_DecodeFSDefault(lib->path);
}

static PyObject *nccl_version(PyObject *module, PyObject *unused)
{
    rlhfz_nccl_library *lib = library_get(module, NULL, NULL);
    if (lib == NULL)
        return NULL;
    return PyLong_FromLong(lib->version);
}

static PyObject *nccl_unique_id(PyObject *module, PyObject *unused)
{
    rlhfz_nccl_library *lib = library_get(module, NULL, NULL);
    if (lib == NULL)
        return NULL;
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    ncclResult_t result;
    /* It starts NCCL's bootstrap root (a socket and a thread) in this process. */
    Py_BEGIN_ALLOW_THREADS
    result = lib->GetUniqueId(&id);
    Py_END_ALLOW_THREADS
    RLHFZ_NCCL_CHECK(lib, result, "ncclGetUniqueId");
    return PyBytes_FromStringAndSize(id.internal, RLHFZ_NCCL_UNIQUE_ID_BYTES);
error:
    return NULL;
}

static PyMethodDef nccl_methods[] = {
    {"nccl_load", (PyCFunction)(void (*)(void))nccl_load, METH_FASTCALL | METH_KEYWORDS,
     "nccl_load(path=None) -> str\n\n"
     "Load libnccl.so.2 once (later calls return at once) and return the file loaded.\n"
     "Order: a copy already in the process (e.g. torch's), $RLHFZ_NCCL_LIBRARY, path,\n"
     "then the dynamic linker's search. Raises RuntimeError if none loads."},
    {"nccl_version", nccl_version, METH_NOARGS,
     "nccl_version() -> int: ncclGetVersion, e.g. 22703 for 2.27.3 (loads NCCL if needed)."},
    {"nccl_unique_id", nccl_unique_id, METH_NOARGS,
     "nccl_unique_id() -> bytes: a new 128-byte ncclUniqueId; the calling process hosts\n"
     "the bootstrap root, so it must live until every rank has joined."},
    {NULL, NULL, 0, NULL},
};

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

/* An address (a device pointer or a stream handle): a non-negative int that
 * fits in a pointer. */
static int arg_address(PyObject *obj, const char *func, const char *name, uintptr_t *out)
{
    if (!PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: %s must be an int (an address), not %.200s",
                     func, name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *index = PyNumber_Index(obj);
    if (index == NULL)
        return -1;
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(index, &overflow);
    unsigned long long address = (unsigned long long)value;
    if (value == -1 && !overflow && PyErr_Occurred())
        goto error;
    if (overflow < 0 || (!overflow && value < 0)) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be a non-negative address, not %R",
                     func, name, index);
        goto error;
    }
    if (overflow > 0) {
        address = PyLong_AsUnsignedLongLong(index);
        if (address == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_OverflowError, "%s: %s = %R does not fit in a 64-bit address",
                         func, name, index);
            goto error;
        }
    }
    if (address > UINTPTR_MAX) {
        PyErr_Format(PyExc_OverflowError, "%s: %s = %R does not fit in a pointer", func, name, index);
        goto error;
    }
    Py_DECREF(index);
    *out = (uintptr_t)address;
    return 0;
error:
    Py_DECREF(index);
    return -1;
}

static int arg_count(PyObject *obj, const char *func, const char *name, size_t *out)
{
    int64_t value;
    if (rlhfz_arg_int64(obj, name, &value) < 0)
        return -1;
    if (value < 0) {
        PyErr_Format(PyExc_ValueError, "%s: %s must be >= 0, not %lld", func, name, (long long)value);
        return -1;
    }
    if ((uint64_t)value > SIZE_MAX) {
        PyErr_Format(PyExc_OverflowError, "%s: %s = %lld does not fit in size_t", func, name,
                     (long long)value);
        return -1;
    }
    *out = (size_t)value;
    return 0;
}

/* "float32", "bfloat16", "float16" (or torch's dtypes), as rlhfz names them. */
static int arg_dtype(PyObject *obj, ncclDataType_t *out, size_t *itemsize)
{
    rlhfz_dtype dtype;
    if (rlhfz_dtype_from_object(obj, &dtype) < 0)
        return -1;
    switch (dtype) {
    case RLHFZ_DTYPE_F32: *out = ncclFloat32; break;
    case RLHFZ_DTYPE_BF16: *out = ncclBfloat16; break;
    case RLHFZ_DTYPE_F16: *out = ncclFloat16; break;
    default:
        PyErr_Format(PyExc_TypeError, "unsupported dtype %R for NCCL", obj);
        return -1;
    }
    *itemsize = rlhfz_dtype_size(dtype);
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
    char reason[REASON_BYTES];   /* why the communicator is no longer alive */
} NcclComm;

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
    Py_BEGIN_ALLOW_THREADS
    result = lib->CommAbort(comm);
    Py_END_ALLOW_THREADS
    return result;
}

/* After an NCCL error with the exception already set: abort, remembering
 * why, and ignore a second failure (the first one is the news). */
static void comm_abort_after_error(NcclComm *self, const char *what, ncclResult_t result)
{
    char reason[REASON_BYTES];
    snprintf(reason, sizeof(reason), "after an error (%s: %s)", what, result_name(result));
    (void)comm_abort(self, reason);
}

static PyObject *NcclComm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"unique_id", "world_size", "rank", "device", NULL};
    PyObject *unique_id_obj, *world_size_obj, *rank_obj, *device_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO:NcclComm", kwlist, &unique_id_obj,
                                     &world_size_obj, &rank_obj, &device_obj))
        return NULL;
    int world_size, rank, device;
    ncclUniqueId id;
    if (arg_geometry("NcclComm", world_size_obj, rank_obj, device_obj, &world_size, &rank, &device) < 0 ||
        arg_unique_id(unique_id_obj, &id) < 0)
        return NULL;

    NcclComm *self = NULL;
    PyObject *capsule = NULL;
    ncclComm_t comm = NULL;
    ncclResult_t result = ncclSuccess;
    char what[160];
    PyObject *module = PyType_GetModule(type);
    if (module == NULL)
        return NULL;
    const rlhfz_nccl_library *lib = library_get(module, NULL, &capsule);
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

    /* Blocks until all world_size ranks have joined. */
    Py_BEGIN_ALLOW_THREADS
    result = lib->CommInitRank(&comm, world_size, id, rank);
    Py_END_ALLOW_THREADS
    snprintf(what, sizeof(what), "ncclCommInitRank (rank %d of %d, device %d)", rank, world_size, device);
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
        /* A failed blocking init normally returns no handle; if NCCL did hand
         * one back (or the device check refused it), it must be aborted. */
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

typedef struct {
    coll_kind kind;
    const char *method;          /* NcclComm.<method>, for messages */
    const char *nccl_name;       /* the NCCL function it calls */
    uintptr_t send;
    uintptr_t recv;
    size_t count;                /* NCCL's count: per rank for reduce_scatter and all_gather */
    ncclDataType_t dtype;
    ncclRedOp_t op;
    int root;
    uintptr_t stream;
} coll_args;

static int check_extent(const char *func, const char *name, uintptr_t address, size_t nbytes)
{
    if (nbytes > UINTPTR_MAX - address) {
        PyErr_Format(PyExc_OverflowError, "NcclComm.%s: %s = %p with %zu bytes runs past the end "
                     "of the address space", func, name, (void *)address, nbytes);
        return -1;
    }
    return 0;
}

/* Sizes, null pointers and aliasing. In place is the one overlap NCCL allows:
 * send == recv for all_reduce and broadcast, recv == send + rank * chunk for
 * reduce_scatter, send == recv + rank * chunk for all_gather; any other
 * overlap reads values the collective is writing. */
static int check_buffers(NcclComm *self, const coll_args *a, size_t itemsize)
{
    const char *func = a->method;
    size_t world = (size_t)self->world_size;
    if (a->count > SIZE_MAX / itemsize / world) {
        PyErr_Format(PyExc_OverflowError, "NcclComm.%s: %zu elements per rank times %d ranks "
                     "overflow the address space", func, a->count, self->world_size);
        return -1;
    }
    if (a->count == 0)
        return 0;
    size_t chunk = a->count * itemsize;     /* bytes of one rank's part */
    size_t send_bytes = chunk, recv_bytes = chunk;
    if (a->kind == COLL_REDUCE_SCATTER)
        send_bytes = chunk * world;
    else if (a->kind == COLL_ALL_GATHER)
        recv_bytes = chunk * world;
    /* Broadcast reads send only on the root; elsewhere it may be anything. */
    int uses_send = a->kind != COLL_BROADCAST || a->root == self->rank;
    if (uses_send && a->send == 0) {
        PyErr_Format(PyExc_ValueError, "NcclComm.%s: send_ptr is 0 (NULL) with a count of %zu",
                     func, a->count);
        return -1;
    }
    if (a->recv == 0) {
        PyErr_Format(PyExc_ValueError, "NcclComm.%s: recv_ptr is 0 (NULL) with a count of %zu",
                     func, a->count);
        return -1;
    }
    if ((uses_send && check_extent(func, "send_ptr", a->send, send_bytes) < 0) ||
        check_extent(func, "recv_ptr", a->recv, recv_bytes) < 0)
        return -1;
    if (!uses_send)
        return 0;
    size_t offset = (size_t)self->rank * chunk;
    int in_place;
    switch (a->kind) {
    case COLL_REDUCE_SCATTER: in_place = a->recv >= a->send && a->recv - a->send == offset; break;
    case COLL_ALL_GATHER: in_place = a->send >= a->recv && a->send - a->recv == offset; break;
    default: in_place = a->send == a->recv; break;
    }
    int overlap = a->send < a->recv + recv_bytes && a->recv < a->send + send_bytes;
    if (overlap && !in_place) {
        const char *rule = a->kind == COLL_REDUCE_SCATTER ? "recv_ptr == send_ptr + rank * recv bytes"
                         : a->kind == COLL_ALL_GATHER ? "send_ptr == recv_ptr + rank * send bytes"
                         : "send_ptr == recv_ptr";
        PyErr_Format(PyExc_ValueError, "NcclComm.%s: the send buffer (%p, %zu bytes) and the recv "
                     "buffer (%p, %zu bytes) overlap; the only overlap allowed is in place, %s",
                     func, (void *)a->send, send_bytes, (void *)a->recv, recv_bytes, rule);
        return -1;
    }
    return 0;
}

/* Converts the arguments every collective shares; NULL slots are unused. */
static int collective_args(NcclComm *self, coll_args *a, PyObject *send, PyObject *recv,
                           PyObject *count, const char *count_name, PyObject *dtype, PyObject *op,
                           PyObject *root, PyObject *stream)
{
    char func[64];
    snprintf(func, sizeof(func), "NcclComm.%s", a->method);
    size_t itemsize = 0;
    if (arg_address(send, func, "send_ptr", &a->send) < 0 ||
        arg_address(recv, func, "recv_ptr", &a->recv) < 0 ||
        arg_count(count, func, count_name, &a->count) < 0 ||
        arg_dtype(dtype, &a->dtype, &itemsize) < 0 ||
        (op != NULL && arg_op(op, func, &a->op) < 0) ||
        arg_address(stream, func, "stream", &a->stream) < 0)
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
    return check_buffers(self, a, itemsize);
}

static PyObject *run_collective(NcclComm *self, const coll_args *a)
{
    if (require_alive(self, a->method) < 0)
        return NULL;
    if (self->collective_in_flight) {
        PyErr_Format(PyExc_RuntimeError, "NcclComm.%s: another thread is inside a collective on "
                     "this communicator; NCCL communicators must not be used from two threads at "
                     "once", a->method);
        return NULL;
    }
    const rlhfz_nccl_library *lib = self->lib;
    ncclComm_t comm = self->comm;
    const void *send = (const void *)a->send;
    void *recv = (void *)a->recv;
    void *stream = (void *)a->stream;
    ncclResult_t result = ncclSuccess;
    char what[160];
    self->collective_in_flight = 1;
    Py_BEGIN_ALLOW_THREADS
    switch (a->kind) {
    case COLL_ALL_REDUCE:
        result = lib->AllReduce(send, recv, a->count, a->dtype, a->op, comm, stream);
        break;
    case COLL_REDUCE_SCATTER:
        result = lib->ReduceScatter(send, recv, a->count, a->dtype, a->op, comm, stream);
        break;
    case COLL_ALL_GATHER:
        result = lib->AllGather(send, recv, a->count, a->dtype, comm, stream);
        break;
    case COLL_BROADCAST:
        result = lib->Broadcast(send, recv, a->count, a->dtype, a->root, comm, stream);
        break;
    }
    Py_END_ALLOW_THREADS
    self->collective_in_flight = 0;
    snprintf(what, sizeof(what), "%s (NcclComm.%s, rank %d of %d; the communicator is aborted)",
             a->nccl_name, a->method, self->rank, self->world_size);
    RLHFZ_NCCL_CHECK(lib, result, what);
    Py_RETURN_NONE;
error:
    /* Another thread may have aborted it meanwhile; then this does nothing. */
    comm_abort_after_error(self, a->nccl_name, result);
    return NULL;
}

static PyObject *NcclComm_all_reduce(NcclComm *self, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    static const char *const names[] = {"send_ptr", "recv_ptr", "count", "dtype", "op", "stream", NULL};
    PyObject *slots[6];
    if (rlhfz_parse_args("all_reduce", args, nargs, kwnames, names, 6, 6, slots) < 0)
        return NULL;
    coll_args a = {.kind = COLL_ALL_REDUCE, .method = "all_reduce", .nccl_name = "ncclAllReduce"};
    if (collective_args(self, &a, slots[0], slots[1], slots[2], "count", slots[3], slots[4], NULL,
                        slots[5]) < 0)
        return NULL;
    return run_collective(self, &a);
}

static PyObject *NcclComm_reduce_scatter(NcclComm *self, PyObject *const *args, Py_ssize_t nargs,
                                         PyObject *kwnames)
{
    static const char *const names[] = {"send_ptr", "recv_ptr", "recv_count", "dtype", "op", "stream",
                                        NULL};
    PyObject *slots[6];
    if (rlhfz_parse_args("reduce_scatter", args, nargs, kwnames, names, 6, 6, slots) < 0)
        return NULL;
    coll_args a = {.kind = COLL_REDUCE_SCATTER, .method = "reduce_scatter",
                   .nccl_name = "ncclReduceScatter"};
    if (collective_args(self, &a, slots[0], slots[1], slots[2], "recv_count", slots[3], slots[4],
                        NULL, slots[5]) < 0)
        return NULL;
    return run_collective(self, &a);
}

static PyObject *NcclComm_all_gather(NcclComm *self, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    static const char *const names[] = {"send_ptr", "recv_ptr", "send_count", "dtype", "stream", NULL};
    PyObject *slots[5];
    if (rlhfz_parse_args("all_gather", args, nargs, kwnames, names, 5, 5, slots) < 0)
        return NULL;
    coll_args a = {.kind = COLL_ALL_GATHER, .method = "all_gather", .nccl_name = "ncclAllGather"};
    if (collective_args(self, &a, slots[0], slots[1], slots[2], "send_count", slots[3], NULL, NULL,
                        slots[4]) < 0)
        return NULL;
    return run_collective(self, &a);
}

static PyObject *NcclComm_broadcast(NcclComm *self, PyObject *const *args, Py_ssize_t nargs,
                                    PyObject *kwnames)
{
    static const char *const names[] = {"send_ptr", "recv_ptr", "count", "dtype", "root", "stream", NULL};
    PyObject *slots[6];
    if (rlhfz_parse_args("broadcast", args, nargs, kwnames, names, 6, 6, slots) < 0)
        return NULL;
    coll_args a = {.kind = COLL_BROADCAST, .method = "broadcast", .nccl_name = "ncclBroadcast"};
    if (collective_args(self, &a, slots[0], slots[1], slots[2], "count", slots[3], NULL, slots[4],
                        slots[5]) < 0)
        return NULL;
    return run_collective(self, &a);
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
     "all_reduce(send_ptr, recv_ptr, count, dtype, op, stream)\n\n"
     "recv = op over ranks of send, count elements each; in place if send_ptr == recv_ptr.\n"
     "dtype: 'float32', 'bfloat16' or 'float16'; op: 'sum', 'avg', 'max' or 'min'; stream:\n"
     "a cudaStream_t as an int (0: the legacy default stream). Queued on stream, not waited for."},
    {"reduce_scatter", (PyCFunction)(void (*)(void))NcclComm_reduce_scatter,
     METH_FASTCALL | METH_KEYWORDS,
     "reduce_scatter(send_ptr, recv_ptr, recv_count, dtype, op, stream)\n\n"
     "send holds world_size * recv_count elements; recv gets this rank's reduced part.\n"
     "In place: recv_ptr == send_ptr + rank * recv_count * itemsize."},
    {"all_gather", (PyCFunction)(void (*)(void))NcclComm_all_gather, METH_FASTCALL | METH_KEYWORDS,
     "all_gather(send_ptr, recv_ptr, send_count, dtype, stream)\n\n"
     "recv gets every rank's send_count elements, in rank order.\n"
     "In place: send_ptr == recv_ptr + rank * send_count * itemsize."},
    {"broadcast", (PyCFunction)(void (*)(void))NcclComm_broadcast, METH_FASTCALL | METH_KEYWORDS,
     "broadcast(send_ptr, recv_ptr, count, dtype, root, stream)\n\n"
     "recv = root's send on every rank; send_ptr is read only on root."},
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
    {Py_tp_doc, "NcclComm(unique_id, world_size, rank, device)\n\n"
                "An NCCL communicator over raw device buffers. The caller makes `device`\n"
                "current first (torch.cuda.set_device); construction blocks until all\n"
                "world_size ranks have joined with the same unique_id (nccl_unique_id()).\n"
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

int rlhfz_nccl_add_types(PyObject *module)
{
    rlhfz_nccl_library *lib = calloc(1, sizeof(*lib));
    if (lib == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyObject *capsule = PyCapsule_New(lib, LIBRARY_CAPSULE, library_capsule_destructor);
    if (capsule == NULL) {
        free(lib);
        return -1;
    }
    PyObject *type = NULL;
    if (PyModule_AddObjectRef(module, LIBRARY_ATTR, capsule) < 0)
        goto error;
    type = PyType_FromModuleAndSpec(module, &NcclComm_spec, NULL);
    if (type == NULL || PyModule_AddType(module, (PyTypeObject *)type) < 0)
        goto error;
    if (PyModule_AddFunctions(module, nccl_methods) < 0)
        goto error;
    Py_DECREF(type);
    Py_DECREF(capsule);
    return 0;
error:
    Py_XDECREF(type);
    Py_DECREF(capsule);
    return -1;
}
