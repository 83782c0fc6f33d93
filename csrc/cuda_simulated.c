/* cuda_simulated.c: Python entry points that exist for the simulated CUDA
 * runtime (a build with RLHFZ_CUDA=sim; see kernels/cuda_simulated.cu).
 *
 * There, torch's CPU build stands in for the GPU side of a program: device
 * memory is seen through the host alias the simulator keeps of it. These
 * translate between the two addresses, count runtime calls and inject
 * failures, for the Python layer's simulated backend and for the tests. In
 * any other build each raises RuntimeError saying so.
 */
#include "rlhfz_module.h"

#ifdef RLHFZ_WITH_CUDA
#include "rlhfz_cuda.h"
#endif

static int require_simulated(const char *what)
{
#ifdef RLHFZ_WITH_CUDA
    if (rlhfz_cuda_simulated())
        return 0;
#endif
    PyErr_Format(PyExc_RuntimeError, "%s: only a build against the simulated CUDA runtime "
                 "(RLHFZ_CUDA=sim) has it", what);
    return -1;
}

static int address_and_size(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                            const char *func, void **address, size_t *nbytes)
{
    static const char *const names[] = {"address", "nbytes", NULL};
    PyObject *slots[2];
    if (rlhfz_parse_args(func, args, nargs, kwnames, names, 2, 1, slots) < 0)
        return -1;
    *address = PyLong_AsVoidPtr(slots[0]);
    if (*address == NULL && PyErr_Occurred())
        return -1;
    int64_t size = 0;
    if (slots[1] != NULL && rlhfz_arg_int64(slots[1], "nbytes", &size) < 0)
        return -1;
    if (size < 0) {
        PyErr_Format(PyExc_ValueError, "%s: nbytes must be >= 0, not %lld", func, (long long)size);
        return -1;
    }
    *nbytes = (size_t)size;
    return 0;
}

static PyObject *cuda_simulated(PyObject *module, PyObject *unused)
{
#ifdef RLHFZ_WITH_CUDA
    return PyBool_FromLong(rlhfz_cuda_simulated());
#else
    Py_RETURN_FALSE;
#endif
}

static PyObject *cuda_host_alias(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    void *address;
    size_t nbytes;
    if (address_and_size(args, nargs, kwnames, "cuda_host_alias", &address, &nbytes) < 0 ||
        require_simulated("cuda_host_alias") < 0)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    void *host = NULL;
    if (rlhfz_cuda_host_alias(address, nbytes, &host) != RLHFZ_OK) {
        PyErr_Format(PyExc_ValueError, "cuda_host_alias: %p (%zu bytes) is not live simulated "
                     "device memory", address, nbytes);
        return NULL;
    }
    return PyLong_FromVoidPtr(host);
#else
    return NULL;
#endif
}

static PyObject *cuda_device_pointer(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    void *address;
    size_t nbytes;
    if (address_and_size(args, nargs, kwnames, "cuda_device_pointer", &address, &nbytes) < 0 ||
        require_simulated("cuda_device_pointer") < 0)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    void *device_ptr = NULL;
    int device = -1;
    if (rlhfz_cuda_alias_device(address, nbytes, &device_ptr, &device) != RLHFZ_OK) {
        PyErr_Format(PyExc_ValueError, "cuda_device_pointer: %p (%zu bytes) is not the host "
                     "alias of simulated device memory (a tensor torch allocated, not a view of "
                     "an rlhfz device Buffer?)", address, nbytes);
        return NULL;
    }
    return Py_BuildValue("(Ni)", PyLong_FromVoidPtr(device_ptr), device);
#else
    return NULL;
#endif
}

static PyObject *cuda_sim_calls(PyObject *module, PyObject *arg)
{
    const char *name = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (name == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "cuda_sim_calls: name must be a str, not %.200s",
                         Py_TYPE(arg)->tp_name);
        return NULL;
    }
    if (require_simulated("cuda_sim_calls") < 0)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    unsigned long long calls = 0;
    rlhfz_cuda_sim_calls(name, &calls);
    return PyLong_FromUnsignedLongLong(calls);
#else
    return NULL;
#endif
}

static PyObject *cuda_sim_inject(PyObject *module, PyObject *arg)
{
    const char *spec = PyUnicode_Check(arg) ? PyUnicode_AsUTF8(arg) : NULL;
    if (spec == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "cuda_sim_inject: spec must be a str, not %.200s",
                         Py_TYPE(arg)->tp_name);
        return NULL;
    }
    if (require_simulated("cuda_sim_inject") < 0)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    if (rlhfz_cuda_sim_inject(spec) != RLHFZ_OK) {
        PyErr_Format(PyExc_ValueError, "cuda_sim_inject: %R is not call:n[:error][,...]", arg);
        return NULL;
    }
#endif
    Py_RETURN_NONE;
}

static PyObject *cuda_sim_hold(PyObject *module, PyObject *arg)
{
    void *stream;
    if (rlhfz_arg_stream(arg, &stream) < 0 || require_simulated("cuda_sim_hold") < 0)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    unsigned long long token = 0;
    if (rlhfz_cuda_sim_hold(stream, &token) != RLHFZ_OK) {
        PyErr_SetString(PyExc_ValueError, "cuda_sim_hold: not a live stream of rlhfz's (the "
                        "default streams run inline and cannot be held)");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(token);
#else
    return NULL;
#endif
}

static PyObject *cuda_sim_release(PyObject *module, PyObject *arg)
{
    unsigned long long token = PyLong_AsUnsignedLongLong(arg);
    if (token == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (require_simulated("cuda_sim_release") < 0)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    if (rlhfz_cuda_sim_release(token) != RLHFZ_OK) {
        PyErr_Format(PyExc_ValueError, "cuda_sim_release: %llu is not a held stream's token",
                     token);
        return NULL;
    }
#endif
    Py_RETURN_NONE;
}

PyMethodDef rlhfz_cuda_sim_methods[] = {
    {"cuda_sim_hold", cuda_sim_hold, METH_O,
     "cuda_sim_hold(stream) -> token: work queued on the stream from now on waits until\n"
     "cuda_sim_release(token), so a test can keep it in flight."},
    {"cuda_sim_release", cuda_sim_release, METH_O, "cuda_sim_release(token)"},
    {"cuda_simulated", cuda_simulated, METH_NOARGS,
     "cuda_simulated() -> bool: whether this build runs on the simulated CUDA runtime."},
    {"cuda_host_alias", (PyCFunction)(void (*)(void))cuda_host_alias, METH_FASTCALL | METH_KEYWORDS,
     "cuda_host_alias(address, nbytes=0) -> int\n\n"
     "Simulated build: the host alias of device memory at address (what torch sees)."},
    {"cuda_device_pointer", (PyCFunction)(void (*)(void))cuda_device_pointer,
     METH_FASTCALL | METH_KEYWORDS,
     "cuda_device_pointer(address, nbytes=0) -> (int, int)\n\n"
     "Simulated build: the device pointer and ordinal a host alias stands for."},
    {"cuda_sim_calls", cuda_sim_calls, METH_O,
     "cuda_sim_calls(name) -> int: calls so far of a simulated runtime function."},
    {"cuda_sim_inject", cuda_sim_inject, METH_O,
     "cuda_sim_inject(spec): failures to inject from now on, 'call:n[:error],...' ('' for\n"
     "none); calls are counted afresh."},
    {NULL, NULL, 0, NULL},
};
