/* cuda_streams.c: CudaStream and CudaEvent, rlhfz's own ordering handles.
 *
 * rlhfz runs collectives on streams of its own and joins them back to the
 * caller's stream with events, never by blocking the host. Both types own
 * their handle: close() releases it, and so does the destructor if close()
 * was never called (the runtime frees a stream only after its queued work).
 * `handle` is the raw cudaStream_t / cudaEvent_t as an int, what every
 * `stream=` argument of rlhfz (and torch's cuda_stream) uses.
 */
#include "rlhfz_module.h"

#ifdef RLHFZ_WITH_CUDA
#include "rlhfz_cuda.h"
#endif

/* Both types: a handle, the device it belongs to, and which kind it is. */
typedef struct {
    PyObject_HEAD
    void *handle;
    int device;
    int is_stream;
} rlhfz_CudaHandle;

typedef rlhfz_CudaHandle rlhfz_CudaStream;
typedef rlhfz_CudaHandle rlhfz_CudaEvent;

static int parse_device(PyObject *obj, int *device)
{
    *device = -1;
    if (obj == NULL || obj == Py_None)
        return 0;
    int64_t value;
    if (rlhfz_arg_int64(obj, "device", &value) < 0)
        return -1;
    if (value < 0 || value > 1 << 16) {
        PyErr_Format(PyExc_ValueError, "device must be a CUDA ordinal >= 0, not %lld",
                     (long long)value);
        return -1;
    }
    *device = (int)value;
    return 0;
}

#ifdef RLHFZ_WITH_CUDA
/* Creates a stream or event with `device` current (-1: the current one). */
static rlhfz_status create_on(int *device, int is_stream, void **handle)
{
    int previous;
    rlhfz_status status = rlhfz_cuda_get_device(&previous);
    if (status != RLHFZ_OK)
        return status;
    if (*device < 0)
        *device = previous;
    if ((status = rlhfz_device_enter(*device, &previous)) != RLHFZ_OK)
        return status;
    status = is_stream ? rlhfz_cuda_stream_create(handle, *device) : rlhfz_cuda_event_create(handle);
    status = rlhfz_device_leave(*device, previous, status);
    if (status != RLHFZ_OK && *handle != NULL) {
        /* made, but the caller's device could not be put back: the call fails */
        if (is_stream)
            rlhfz_cuda_stream_destroy(*handle);
        else
            rlhfz_cuda_event_destroy(*handle);
        *handle = NULL;
    }
    return status;
}
#endif

static int closed_error(void *handle, const char *type)
{
    if (handle == NULL) {
        PyErr_Format(PyExc_ValueError, "the %s is closed", type);
        return -1;
    }
    return 0;
}

/* ---- what both types share ------------------------------------------------------------ */

static PyObject *handle_new(PyTypeObject *type, PyObject *args, PyObject *kwargs, int is_stream)
{
    const char *what = is_stream ? "CudaStream" : "CudaEvent";
    static char *kwlist[] = {"device", NULL};
    PyObject *device_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O", kwlist, &device_obj))
        return NULL;
    int device;
    if (parse_device(device_obj, &device) < 0 || rlhfz_require_cuda(what) < 0)
        return NULL;
    rlhfz_CudaHandle *self = (rlhfz_CudaHandle *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->is_stream = is_stream;
#ifdef RLHFZ_WITH_CUDA
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = create_on(&device, is_stream, &self->handle);
    Py_END_ALLOW_THREADS
    if (status != RLHFZ_OK) {
        Py_DECREF(self);
        rlhfz_raise_cuda(what);
        return NULL;
    }
    self->device = device;
#endif
    return (PyObject *)self;
}

static void handle_release(rlhfz_CudaHandle *self)
{
#ifdef RLHFZ_WITH_CUDA
    if (self->handle != NULL) {
        if (self->is_stream)
            rlhfz_cuda_stream_destroy(self->handle);
        else
            rlhfz_cuda_event_destroy(self->handle);
    }
#endif
    self->handle = NULL;
}

static void handle_dealloc(rlhfz_CudaHandle *self)
{
    PyTypeObject *type = Py_TYPE(self);
    handle_release(self);
    type->tp_free(self);
    Py_DECREF(type);
}

static PyObject *handle_close(rlhfz_CudaHandle *self, PyObject *unused)
{
    handle_release(self);
    Py_RETURN_NONE;
}

static PyObject *handle_get_handle(rlhfz_CudaHandle *self, void *closure)
{
    return PyLong_FromVoidPtr(self->handle);
}

static PyObject *handle_get_device(rlhfz_CudaHandle *self, void *closure)
{
    return PyLong_FromLong(self->device);
}

/* ---- CudaStream --------------------------------------------------------------------- */

static PyObject *CudaStream_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    return handle_new(type, args, kwargs, 1);
}

static PyObject *CudaStream_synchronize(rlhfz_CudaStream *self, PyObject *unused)
{
    if (closed_error(self->handle, "CudaStream") < 0)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_cuda_stream_synchronize(self->handle);
    Py_END_ALLOW_THREADS
    if (status != RLHFZ_OK) {
        rlhfz_raise_cuda("CudaStream.synchronize");
        return NULL;
    }
#endif
    Py_RETURN_NONE;
}

static PyObject *CudaStream_repr(rlhfz_CudaStream *self)
{
    return PyUnicode_FromFormat("CudaStream(device=%d, handle=%p%s)", self->device, self->handle,
                                self->handle ? "" : ", closed");
}

static PyMethodDef CudaStream_methods[] = {
    {"synchronize", (PyCFunction)CudaStream_synchronize, METH_NOARGS,
     "Wait on the host until the stream's queued work is done."},
    {"close", (PyCFunction)handle_close, METH_NOARGS,
     "Release the stream (after its queued work); later use raises."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef CudaStream_getset[] = {
    {"handle", (getter)handle_get_handle, NULL, "the cudaStream_t, as an int (0 once closed)", NULL},
    {"cuda_stream", (getter)handle_get_handle, NULL, "the same as handle, as torch names it", NULL},
    {"device", (getter)handle_get_device, NULL, "the CUDA ordinal it was created on", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot CudaStream_slots[] = {
    {Py_tp_new, CudaStream_new},
    {Py_tp_dealloc, handle_dealloc},
    {Py_tp_repr, CudaStream_repr},
    {Py_tp_methods, CudaStream_methods},
    {Py_tp_getset, CudaStream_getset},
    {Py_tp_doc, "CudaStream(device=None): a non-blocking CUDA stream owned by rlhfz."},
    {0, NULL},
};

static PyType_Spec CudaStream_spec = {
    .name = "rlhfz._C.CudaStream",
    .basicsize = sizeof(rlhfz_CudaStream),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = CudaStream_slots,
};

/* ---- CudaEvent ---------------------------------------------------------------------- */

static PyObject *CudaEvent_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    return handle_new(type, args, kwargs, 0);
}

#ifdef RLHFZ_WITH_CUDA
/* Runs an event call with the event's device current: the legacy default
 * stream (a NULL handle, torch's default stream) is the current device's,
 * and the event's device is the one the caller means, whichever is current
 * in this thread. */
static rlhfz_status on_event_device(rlhfz_CudaEvent *self, void *stream, int record)
{
    int previous = self->device;
    rlhfz_status status = rlhfz_device_enter(self->device, &previous);
    if (status != RLHFZ_OK)
        return status;
    status = record ? rlhfz_cuda_event_record(self->handle, stream)
                    : rlhfz_cuda_stream_wait_event(stream, self->handle);
    return rlhfz_device_leave(self->device, previous, status);
}
#endif

/* record(stream=None): the event completes when the stream's work queued so
 * far does; None or 0 is the event's device's default stream. */
static PyObject *CudaEvent_record(rlhfz_CudaEvent *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames)
{
    static const char *const names[] = {"stream", NULL};
    PyObject *slots[1];
    if (rlhfz_parse_args("record", args, nargs, kwnames, names, 1, 0, slots) < 0)
        return NULL;
    void *stream;
    if (closed_error(self->handle, "CudaEvent") < 0 ||
        rlhfz_arg_stream(slots[0], &stream) < 0)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = on_event_device(self, stream, 1);
    Py_END_ALLOW_THREADS
    if (status != RLHFZ_OK) {
        rlhfz_raise_cuda("CudaEvent.record");
        return NULL;
    }
#endif
    Py_RETURN_NONE;
}

/* wait(stream=None): work queued on the stream from now on waits for the
 * event; None or 0 is the event's device's default stream. */
static PyObject *CudaEvent_wait(rlhfz_CudaEvent *self, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    static const char *const names[] = {"stream", NULL};
    PyObject *slots[1];
    if (rlhfz_parse_args("wait", args, nargs, kwnames, names, 1, 0, slots) < 0)
        return NULL;
    void *stream;
    if (closed_error(self->handle, "CudaEvent") < 0 ||
        rlhfz_arg_stream(slots[0], &stream) < 0)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = on_event_device(self, stream, 0);
    Py_END_ALLOW_THREADS
    if (status != RLHFZ_OK) {
        rlhfz_raise_cuda("CudaEvent.wait");
        return NULL;
    }
#endif
    Py_RETURN_NONE;
}

static PyObject *CudaEvent_synchronize(rlhfz_CudaEvent *self, PyObject *unused)
{
    if (closed_error(self->handle, "CudaEvent") < 0)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_cuda_event_synchronize(self->handle);
    Py_END_ALLOW_THREADS
    if (status != RLHFZ_OK) {
        rlhfz_raise_cuda("CudaEvent.synchronize");
        return NULL;
    }
#endif
    Py_RETURN_NONE;
}

static PyObject *CudaEvent_query(rlhfz_CudaEvent *self, PyObject *unused)
{
    if (closed_error(self->handle, "CudaEvent") < 0)
        return NULL;
    int done = 1;
#ifdef RLHFZ_WITH_CUDA
    if (rlhfz_cuda_event_query(self->handle, &done) != RLHFZ_OK) {
        rlhfz_raise_cuda("CudaEvent.query");
        return NULL;
    }
#endif
    return PyBool_FromLong(done);
}

static PyMethodDef CudaEvent_methods[] = {
    {"query", (PyCFunction)CudaEvent_query, METH_NOARGS,
     "query() -> bool: whether the recorded work is done (never blocks; an event never\n"
     "recorded is done)."},
    {"record", (PyCFunction)(void (*)(void))CudaEvent_record, METH_FASTCALL | METH_KEYWORDS,
     "record(stream=None): mark the work queued on stream so far."},
    {"wait", (PyCFunction)(void (*)(void))CudaEvent_wait, METH_FASTCALL | METH_KEYWORDS,
     "wait(stream=None): make later work on stream wait for the recorded work (no host wait)."},
    {"synchronize", (PyCFunction)CudaEvent_synchronize, METH_NOARGS,
     "Wait on the host for the recorded work."},
    {"close", (PyCFunction)handle_close, METH_NOARGS, "Release the event."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef CudaEvent_getset[] = {
    {"handle", (getter)handle_get_handle, NULL, "the cudaEvent_t, as an int (0 once closed)", NULL},
    {"device", (getter)handle_get_device, NULL, "the CUDA ordinal it was created on", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot CudaEvent_slots[] = {
    {Py_tp_new, CudaEvent_new},
    {Py_tp_dealloc, handle_dealloc},
    {Py_tp_methods, CudaEvent_methods},
    {Py_tp_getset, CudaEvent_getset},
    {Py_tp_doc, "CudaEvent(device=None): a CUDA event (timing disabled) owned by rlhfz."},
    {0, NULL},
};

static PyType_Spec CudaEvent_spec = {
    .name = "rlhfz._C.CudaEvent",
    .basicsize = sizeof(rlhfz_CudaEvent),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = CudaEvent_slots,
};

int rlhfz_cuda_add_types(PyObject *module)
{
    PyObject *stream_type = PyType_FromModuleAndSpec(module, &CudaStream_spec, NULL);
    if (stream_type == NULL)
        return -1;
    int rc = PyModule_AddObjectRef(module, "CudaStream", stream_type);
    Py_DECREF(stream_type);
    if (rc < 0)
        return -1;
    PyObject *event_type = PyType_FromModuleAndSpec(module, &CudaEvent_spec, NULL);
    if (event_type == NULL)
        return -1;
    rc = PyModule_AddObjectRef(module, "CudaEvent", event_type);
    Py_DECREF(event_type);
    return rc;
}
