/* module.c: the rlhfz._C module: multi-phase init (each file registers its
 * own types and functions), and the entry points that describe the build,
 * set the CPU threads and pick the CUDA device. Nothing calls into this
 * file; the state lookups are in module_state.c. */
#include "rlhfz_module.h"
#include "nccl_comm.h"
#include "nccl_library.h"

#ifdef RLHFZ_WITH_CUDA
#include "rlhfz_cuda.h"
#endif

#ifndef RLHFZ_VERSION
#define RLHFZ_VERSION "0.1.0"
#endif

static PyObject *build_info(PyObject *module, PyObject *unused)
{
    PyObject *info = PyDict_New();
    if (info == NULL)
        return NULL;
    PyObject *cuda_error = Py_None;
    int device_count = 0;
    int cuda_compiled = 0;
    int runtime_version = 0;
    const char *simulated = NULL;
#ifdef RLHFZ_WITH_CUDA
    if (rlhfz_cuda_simulated())
        simulated = rlhfz_cuda_sim_describe();
    cuda_compiled = 1;
    const char *error = NULL;
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_cuda_device_count(&device_count, &error);
    runtime_version = rlhfz_cuda_runtime_version();
    Py_END_ALLOW_THREADS
    if (status != RLHFZ_OK && error != NULL)
        cuda_error = PyUnicode_FromString(error);
    else
        Py_INCREF(cuda_error);
#else
    Py_INCREF(cuda_error);
#endif
    if (cuda_error == NULL)
        goto error;
    rlhfz_simd_level simd = rlhfz_simd_detect();
    /* cuda: True, False, or "sim" (true as well) on the simulated runtime */
    PyObject *cuda = device_count <= 0 ? Py_NewRef(Py_False)
                     : simulated != NULL ? PyUnicode_FromString("sim") : Py_NewRef(Py_True);
    if (cuda == NULL) {
        Py_DECREF(cuda_error);
        goto error;
    }
    PyObject *values = Py_BuildValue(
        "{s:s,s:O,s:N,s:z,s:i,s:i,s:N,s:s,s:i,s:i}",
        "version", RLHFZ_VERSION,
        "cuda_compiled", cuda_compiled ? Py_True : Py_False,
        "cuda", cuda,
        "cuda_simulator", simulated,
        "cuda_devices", device_count,
        "cuda_runtime_version", runtime_version,
        "cuda_error", cuda_error,
        "simd", rlhfz_simd_name(simd),
        "threads", rlhfz_threads_get(),
        "dlpack_version", RLHFZ_DLPACK_MAJOR_VERSION * 100 + RLHFZ_DLPACK_MINOR_VERSION);
    if (values == NULL || PyDict_Update(info, values) < 0) {
        Py_XDECREF(values);
        goto error;
    }
    Py_DECREF(values);
    return info;
error:
    Py_DECREF(info);
    return NULL;
}

static PyObject *set_num_threads(PyObject *module, PyObject *arg)
{
    int64_t n;
    if (rlhfz_arg_int64(arg, "n", &n) < 0)
        return NULL;
    if (n < 1 || n > RLHFZ_MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "thread count must be in [1, %d], not %lld",
                     RLHFZ_MAX_THREADS, (long long)n);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rlhfz_threads_set((int)n);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *get_num_threads(PyObject *module, PyObject *unused)
{
    return PyLong_FromLong(rlhfz_threads_get());
}

static PyObject *simd_level(PyObject *module, PyObject *unused)
{
    return PyUnicode_FromString(rlhfz_simd_name(rlhfz_simd_detect()));
}

static PyObject *describe_dlpack(PyObject *module, PyObject *obj)
{
    return rlhfz_describe_dlpack(module, obj);
}

static PyObject *cuda_mem_get_info(PyObject *module, PyObject *arg)
{
    long device = PyLong_AsLong(arg);
    if (device == -1 && PyErr_Occurred())
        return NULL;
    if (device < 0 || device > 1 << 16) {
        PyErr_Format(PyExc_ValueError, "device must be a CUDA ordinal >= 0, not %ld", device);
        return NULL;
    }
    const char *reason = NULL;
    if (!rlhfz_cuda_usable(&reason)) {
        PyErr_Format(PyExc_RuntimeError, "cuda_mem_get_info: %s", reason);
        return NULL;
    }
#ifdef RLHFZ_WITH_CUDA
    size_t free_bytes = 0, total_bytes = 0;
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_cuda_mem_get_info((int)device, &free_bytes, &total_bytes);
    Py_END_ALLOW_THREADS
    if (status != RLHFZ_OK) {
        rlhfz_raise_cuda("cuda_mem_get_info");
        return NULL;
    }
    return Py_BuildValue("(nn)", (Py_ssize_t)free_bytes, (Py_ssize_t)total_bytes);
#else
    return NULL;
#endif
}

static int device_ordinal(PyObject *arg, const char *func, int *device)
{
    long value = PyLong_AsLong(arg);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (value < 0 || value > 1 << 16) {
        PyErr_Format(PyExc_ValueError, "%s: device must be a CUDA ordinal >= 0, not %ld", func,
                     value);
        return -1;
    }
    *device = (int)value;
    return rlhfz_require_cuda(func);
}

static PyObject *cuda_synchronize(PyObject *module, PyObject *arg)
{
    int device;
    if (device_ordinal(arg, "cuda_synchronize", &device) < 0)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_cuda_device_synchronize(device);
    Py_END_ALLOW_THREADS
    if (status != RLHFZ_OK) {
        rlhfz_raise_cuda("cuda_synchronize");
        return NULL;
    }
    rlhfz_inflight_sweep(rlhfz_get_state(module)->inflight);   /* their kernels are done */
#endif
    Py_RETURN_NONE;
}

static PyObject *cuda_get_device(PyObject *module, PyObject *unused)
{
    if (rlhfz_require_cuda("cuda_get_device") < 0)
        return NULL;
    int device = 0;
#ifdef RLHFZ_WITH_CUDA
    if (rlhfz_cuda_get_device(&device) != RLHFZ_OK) {
        rlhfz_raise_cuda("cuda_get_device");
        return NULL;
    }
#endif
    return PyLong_FromLong(device);
}

static PyObject *cuda_set_device(PyObject *module, PyObject *arg)
{
    int device;
    if (device_ordinal(arg, "cuda_set_device", &device) < 0)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    if (rlhfz_cuda_set_device(device) != RLHFZ_OK) {
        rlhfz_raise_cuda("cuda_set_device");
        return NULL;
    }
#endif
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"cuda_synchronize", cuda_synchronize, METH_O,
     "cuda_synchronize(device): wait on the host for all work queued on the device."},
    {"cuda_get_device", cuda_get_device, METH_NOARGS,
     "cuda_get_device() -> int: the CUDA runtime's current device of this thread."},
    {"cuda_set_device", cuda_set_device, METH_O,
     "cuda_set_device(device): make the device current for this thread (the runtime's)."},
    {"cuda_mem_get_info", cuda_mem_get_info, METH_O,
     "cuda_mem_get_info(device) -> (free, total): bytes of the device, as the driver sees them."},
    {"build_info", build_info, METH_NOARGS,
     "build_info() -> dict: version, CUDA availability, SIMD level, threads (rlhfz.build_info\n"
     "adds NCCL's)."},
    {"set_num_threads", set_num_threads, METH_O, "set_num_threads(n): threads for CPU kernels."},
    {"get_num_threads", get_num_threads, METH_NOARGS, "get_num_threads() -> int"},
    {"simd_level", simd_level, METH_NOARGS, "simd_level() -> str: the SIMD level in use."},
    {"describe_dlpack", describe_dlpack, METH_O,
     "describe_dlpack(tensor) -> dict: what the DLPack importer sees (after validation)."},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module)
{
    rlhfz_state *state = rlhfz_get_state(module);
    state->inflight = rlhfz_inflight_new();
    if (state->inflight == NULL)
        return -1;
    if (rlhfz_buffer_add_types(module, state) < 0)
        return -1;
    if (PyModule_AddFunctions(module, rlhfz_cpu_ops_methods) < 0)
        return -1;
    if (PyModule_AddFunctions(module, rlhfz_cuda_ops_methods) < 0)
        return -1;
    if (PyModule_AddFunctions(module, rlhfz_cuda_sim_methods) < 0)
        return -1;
    if (rlhfz_cuda_add_types(module) < 0)
        return -1;
    if (rlhfz_nccl_library_add(module) < 0 || rlhfz_nccl_comm_add_type(module) < 0)
        return -1;
    /* elements per int8 moment block: shard layouts align to it */
    if (PyModule_AddIntConstant(module, "QBLOCK", RLHFZ_QBLOCK) < 0)
        return -1;
    if (PyModule_AddStringConstant(module, "__version__", RLHFZ_VERSION) < 0)
        return -1;
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg)
{
    rlhfz_state *state = rlhfz_get_state(module);
    Py_VISIT(state->Buffer_type);
    Py_VISIT(state->BufferView_type);
    return 0;
}

static int module_clear(PyObject *module)
{
    rlhfz_state *state = rlhfz_get_state(module);
    Py_CLEAR(state->Buffer_type);
    Py_CLEAR(state->BufferView_type);
    return 0;
}

static void module_free(void *module)
{
    rlhfz_state *state = rlhfz_get_state((PyObject *)module);
    rlhfz_inflight_free(state->inflight);
    state->inflight = NULL;
    module_clear((PyObject *)module);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "rlhfz._C",
    .m_doc = "rlhfz's C core: tiered buffers with DLPack views, and the CPU/CUDA kernels.",
    .m_size = sizeof(rlhfz_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void)
{
    return PyModuleDef_Init(&module_def);
}
