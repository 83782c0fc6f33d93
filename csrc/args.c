/* args.c: binding METH_FASTCALL | METH_KEYWORDS arguments to named slots,
 * and converting the arguments many entry points share: numbers and streams.
 *
 * The public C API has no keyword parser for vectorcall, and the tuple/dict
 * one would cost an allocation per call on the optimizer's hot path. Every
 * `stream=` of rlhfz._C goes through rlhfz_arg_stream, so they all accept the
 * same things. */
#include "rlhfz_module.h"

int rlhfz_parse_args(const char *func, PyObject *const *args, Py_ssize_t nargs,
                     PyObject *kwnames, const char *const *names,
                     int max_positional, int nrequired, PyObject **slots)
{
    int count = 0;
    while (names[count] != NULL)
        count++;
    for (int i = 0; i < count; i++)
        slots[i] = NULL;
    if (nargs > max_positional) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d positional arguments (%zd given)",
                     func, max_positional, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        slots[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int found = -1;
        for (int i = 0; i < count; i++) {
            if (PyUnicode_CompareWithASCIIString(key, names[i]) == 0) {
                found = i;
                break;
            }
        }
        if (found < 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%U'", func, key);
            return -1;
        }
        if (slots[found] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'",
                         func, names[found]);
            return -1;
        }
        slots[found] = args[nargs + k];
    }
    for (int i = 0; i < nrequired; i++) {
        if (slots[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", func, names[i]);
            return -1;
        }
    }
    return 0;
}

int rlhfz_arg_double(PyObject *obj, const char *name, double *out)
{
    double value = PyFloat_AsDouble(obj);
    if (value == -1.0 && PyErr_Occurred()) {
        /* only "not a number" is renamed; an interrupt or a device error
         * raised by __float__ passes through as it is */
        if (!PyErr_ExceptionMatches(PyExc_TypeError))
            return -1;
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be a real number, not %.200s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = value;
    return 0;
}

int rlhfz_arg_int64(PyObject *obj, const char *name, int64_t *out)
{
    if (!PyLong_Check(obj) && !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an integer, not %.200s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    long long value = PyLong_AsLongLong(obj);
    if (value == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s is out of the int64 range", name);
        }
        return -1;
    }
    *out = (int64_t)value;
    return 0;
}

int rlhfz_arg_stream(PyObject *obj, void **stream)
{
    *stream = NULL;
    if (obj == NULL || obj == Py_None)
        return 0;
    PyObject *handle = NULL;
    if (PyLong_Check(obj)) {
        handle = Py_NewRef(obj);
    } else {
        /* torch.cuda.Stream names its handle cuda_stream; rlhfz's CudaStream, handle. */
        static const char *const attributes[] = {"cuda_stream", "handle"};
        for (int i = 0; i < 2 && handle == NULL; i++) {
            handle = PyObject_GetAttrString(obj, attributes[i]);
            if (handle == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_AttributeError))
                    return -1;
                PyErr_Clear();
            }
        }
        if (handle == NULL || !PyLong_Check(handle)) {
            Py_XDECREF(handle);
            PyErr_Format(PyExc_TypeError,
                         "stream must be None, a stream handle (int), or a stream object with "
                         "a cuda_stream or handle attribute, not %.200s", Py_TYPE(obj)->tp_name);
            return -1;
        }
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(handle);
    Py_DECREF(handle);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "stream handle must be an address >= 0");
        }
        return -1;
    }
    /* 0 and 1 are the legacy default stream, 2 the per-thread one (the
     * runtime's own values for cudaStreamLegacy and cudaStreamPerThread). */
    *stream = value <= 1 ? NULL : (void *)(uintptr_t)value;
    return 0;
}
