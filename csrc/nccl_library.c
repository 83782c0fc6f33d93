/* nccl_library.c: finding, opening and checking libnccl.so.2, with dlopen
 * (no link-time dependency on NCCL or CUDA), and the module functions that
 * need only the library: nccl_load, nccl_version, nccl_unique_id.
 *
 * The library is opened once per module, on first use; its functions go into
 * a table of pointers (rlhfz_nccl_library) that the communicators use.
 */
#include "nccl_library.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

/* The library table lives in a capsule, one per module instance, stored in
 * the module as _nccl_library: rlhfz_state (shared by every csrc file) has no
 * slot for it, and this keeps it out of C globals. Each NcclComm holds a
 * reference to the capsule, so the table outlives every communicator. */
#define LIBRARY_ATTR "_nccl_library"
#define LIBRARY_CAPSULE "rlhfz._C._nccl_library"

/* ---- errors ------------------------------------------------------------------ */

const char *rlhfz_nccl_result_name(ncclResult_t result)
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
                     file, line, what, rlhfz_nccl_result_name(result), (int)result, text, last);
    else
        PyErr_Format(PyExc_RuntimeError, "%s:%d: %s failed: %s (%d): %s",
                     file, line, what, rlhfz_nccl_result_name(result), (int)result, text);
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
    {"ncclCommInitRankConfig", offsetof(rlhfz_nccl_library, CommInitRankConfig), 0},
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

rlhfz_nccl_library *rlhfz_nccl_library_get(PyObject *module, const char *path,
                                           PyObject **capsule_out)
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
    rlhfz_nccl_library *lib = rlhfz_nccl_library_get(module, path, NULL);
    Py_XDECREF(path_bytes);
    if (lib == NULL)
        return NULL;
    return PyUnicode_DecodeFSDefault(lib->path);
}

static PyObject *nccl_version(PyObject *module, PyObject *unused)
{
    rlhfz_nccl_library *lib = rlhfz_nccl_library_get(module, NULL, NULL);
    if (lib == NULL)
        return NULL;
    return PyLong_FromLong(lib->version);
}

static PyObject *nccl_unique_id(PyObject *module, PyObject *unused)
{
    rlhfz_nccl_library *lib = rlhfz_nccl_library_get(module, NULL, NULL);
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

/* ---- registration ------------------------------------------------------------------------- */

int rlhfz_nccl_library_add(PyObject *module)
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
    int rc = PyModule_AddObjectRef(module, LIBRARY_ATTR, capsule);
    Py_DECREF(capsule);
    if (rc < 0)
        return -1;
    return PyModule_AddFunctions(module, nccl_methods);
}
