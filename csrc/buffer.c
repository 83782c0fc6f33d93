/* buffer.c: the Buffer type (an owned, aligned allocation in a memory tier)
 * and BufferView (a typed, shaped range of one), exported through DLPack.
 *
 * Every exported DLPack tensor holds a strong reference to its Buffer, so the
 * memory lives until the last consumer lets go; `exports` counts those, which
 * is how a caller learns that someone outside still holds a view.
 */
#include "rlhfz_module.h"

#include <pthread.h>
#include <stdlib.h>
#include <structmember.h>
#include <string.h>

#define RLHFZ_MAX_ALIGNMENT ((size_t)1 << 30)

/* ---- Buffer ---------------------------------------------------------------- */

rlhfz_Buffer *rlhfz_buffer_alloc(rlhfz_state *state, size_t nbytes, size_t alignment, int zero)
{
    return rlhfz_buffer_alloc_in(state, RLHFZ_TIER_HOST, -1, nbytes, alignment, zero);
}

/* A Buffer object owning nothing yet, and the bytes to allocate for it: a
 * zero-byte buffer still gets a block (DLPack consumers expect a non-null
 * pointer, and a file cannot map empty), and sizes round up to whole cache
 * lines, so SIMD loops may read a tail safely. */
static rlhfz_Buffer *new_buffer(rlhfz_state *state, size_t nbytes, size_t *padded)
{
    rlhfz_finish_deferred_releases();   /* memory that is free, before asking for more */
    *padded = nbytes == 0 ? 64 : (nbytes + 63) / 64 * 64;
    if (*padded < nbytes)
        return (rlhfz_Buffer *)PyErr_NoMemory();
    rlhfz_Buffer *self = (rlhfz_Buffer *)state->Buffer_type->tp_alloc(state->Buffer_type, 0);
    if (self == NULL)
        return NULL;
    self->tier = RLHFZ_TIER_HOST;
    self->device = -1;
    self->fd = -1;
    return self;
}

rlhfz_Buffer *rlhfz_buffer_alloc_in(rlhfz_state *state, rlhfz_tier tier, int device,
                                    size_t nbytes, size_t alignment, int zero)
{
    /* past a huge page, alignment buys nothing and only fails allocations */
    if (alignment < sizeof(void *) || alignment > RLHFZ_MAX_ALIGNMENT ||
        (alignment & (alignment - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "alignment must be a power of two in [%zu, %zu], not %zu",
                     sizeof(void *), (size_t)RLHFZ_MAX_ALIGNMENT, alignment);
        return NULL;
    }
    size_t padded;
    rlhfz_Buffer *self = new_buffer(state, nbytes, &padded);
    if (self == NULL)
        return NULL;
    if (tier == RLHFZ_TIER_DISK) {
        PyErr_SetString(PyExc_ValueError, "a disk Buffer needs a directory (path=...)");
        Py_DECREF(self);
        return NULL;
    }
    void *data = NULL;
    size_t mapped = 0;
    if (rlhfz_tier_alloc(&tier, &device, padded, alignment, zero, &data, &mapped) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->data = data;
    self->mapped = mapped;
    self->nbytes = nbytes;
    self->alignment = alignment;
    self->tier = tier;
    self->device = device;
    return self;
}

rlhfz_Buffer *rlhfz_buffer_alloc_disk(rlhfz_state *state, const char *dir, size_t nbytes)
{
    size_t padded;
    rlhfz_Buffer *self = new_buffer(state, nbytes, &padded);
    if (self == NULL)
        return NULL;
    if (rlhfz_disk_alloc(dir, padded, &self->data, &self->fd, &self->path) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    self->tier = RLHFZ_TIER_DISK;
    self->nbytes = nbytes;
    self->mapped = padded;
    self->alignment = 4096;     /* mmap gives whole pages */
    return self;
}

static PyObject *Buffer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"nbytes", "tier", "device", "alignment", "zero", "path", NULL};
    Py_ssize_t nbytes;
    const char *tier_text = "host";
    int device = -1;
    Py_ssize_t alignment = RLHFZ_DEFAULT_ALIGNMENT;
    int zero = 1;
    PyObject *path = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "n|s$inpO&:Buffer", kwlist,
                                     &nbytes, &tier_text, &device, &alignment, &zero,
                                     PyUnicode_FSConverter, &path))
        return NULL;
    rlhfz_Buffer *made = NULL;
    if (nbytes < 0) {
        PyErr_Format(PyExc_ValueError, "nbytes must be >= 0, not %zd", nbytes);
        return NULL;
    }
    if (alignment <= 0) {
        PyErr_Format(PyExc_ValueError, "alignment must be positive, not %zd", alignment);
        return NULL;
    }
    rlhfz_tier tier;
    if (rlhfz_tier_from_name(tier_text, &tier) < 0)
        goto done;
    if (device < -1 || (device >= 0 && tier != RLHFZ_TIER_DEVICE)) {
        PyErr_Format(PyExc_ValueError, "device must be -1 (the current one) or a CUDA ordinal "
                     "for the device tier, not %d for tier %s", device, tier_text);
        goto done;
    }
    if ((path != NULL) != (tier == RLHFZ_TIER_DISK)) {
        PyErr_SetString(PyExc_ValueError, path != NULL ? "path is for the disk tier only"
                                                       : "the disk tier needs path= (a directory)");
        goto done;
    }
    rlhfz_state *state = rlhfz_state_from_type(type);
    if (state == NULL)
        goto done;
    if (tier == RLHFZ_TIER_DISK && PyBytes_GET_SIZE(path) == 0) {
        PyErr_SetString(PyExc_ValueError, "path must name a directory, not be empty");
        goto done;
    }
    if (tier == RLHFZ_TIER_DISK)
        made = rlhfz_buffer_alloc_disk(state, PyBytes_AS_STRING(path), (size_t)nbytes);
    else
        made = rlhfz_buffer_alloc_in(state, tier, device, (size_t)nbytes, (size_t)alignment, zero);
done:
    Py_XDECREF(path);
    return (PyObject *)made;
}

static void release_external(rlhfz_Buffer *self)
{
    if (self->external == NULL)
        return;
    if (self->external_versioned) {
        DLManagedTensorVersioned *managed = self->external;
        if (managed->deleter)
            managed->deleter(managed);
    } else {
        DLManagedTensor *managed = self->external;
        if (managed->deleter)
            managed->deleter(managed);
    }
    self->external = NULL;
}

static void Buffer_dealloc(rlhfz_Buffer *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    if (self->tier == RLHFZ_TIER_EXTERNAL)
        release_external(self);
    else if (self->tier == RLHFZ_TIER_DISK)
        rlhfz_disk_free(self->data, self->mapped, self->fd, self->path);
    else
        rlhfz_tier_free(self->tier, self->device, self->data, self->mapped);
    self->path = NULL;
    self->data = NULL;
    type->tp_free(self);
    Py_DECREF(type);
}

static int Buffer_traverse(rlhfz_Buffer *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static PyObject *Buffer_view(rlhfz_Buffer *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames);

static PyObject *Buffer_zero_(rlhfz_Buffer *self, PyObject *unused)
{
    if (rlhfz_buffer_intact(self) < 0)
        return NULL;
    if (rlhfz_tier_zero(self->tier, self->device, self->data, self->nbytes) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Buffer_from_dlpack(PyTypeObject *type, PyObject *obj)
{
    rlhfz_state *state = rlhfz_state_from_type(type);
    if (state == NULL)
        return NULL;
    rlhfz_Buffer *self = (rlhfz_Buffer *)state->Buffer_type->tp_alloc(state->Buffer_type, 0);
    if (self == NULL)
        return NULL;
    self->tier = RLHFZ_TIER_EXTERNAL;
    self->device = -1;
    self->fd = -1;
    self->alignment = 1;
    if (rlhfz_buffer_import_dlpack(self, obj) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* copy_from(src, *, stream=None, non_blocking=False): this buffer's bytes =
 * src's, between any two tiers. CUDA copies go on stream; non_blocking
 * leaves them in flight (the caller orders what reads them). */
static PyObject *Buffer_copy_from(rlhfz_Buffer *self, PyObject *const *args, Py_ssize_t nargs,
                                  PyObject *kwnames)
{
    static const char *const names[] = {"src", "stream", "non_blocking", NULL};
    PyObject *slots[3];
    if (rlhfz_parse_args("copy_from", args, nargs, kwnames, names, 1, 1, slots) < 0)
        return NULL;
    if (!PyObject_TypeCheck(slots[0], Py_TYPE(self))) {
        PyErr_Format(PyExc_TypeError, "src must be a Buffer, not %.200s", Py_TYPE(slots[0])->tp_name);
        return NULL;
    }
    rlhfz_Buffer *src = (rlhfz_Buffer *)slots[0];
    if (src->nbytes != self->nbytes) {
        PyErr_Format(PyExc_ValueError, "src has %zu bytes but this buffer has %zu", src->nbytes,
                     self->nbytes);
        return NULL;
    }
    void *stream = NULL;
    int non_blocking = 0;
    if (rlhfz_arg_stream(slots[1], &stream) < 0 ||
        (slots[2] != NULL && (non_blocking = PyObject_IsTrue(slots[2])) < 0))
        return NULL;
    if (src == self || src->data == self->data || self->nbytes == 0)
        Py_RETURN_NONE;
    /* Buffers adopted from one array may share memory; the copy runs in
     * parallel chunks, which would read what another chunk already wrote. */
    if ((char *)src->data < (char *)self->data + self->nbytes &&
        (char *)self->data < (char *)src->data + src->nbytes) {
        PyErr_SetString(PyExc_ValueError, "copy_from: src and this buffer overlap in memory; "
                        "copy through a separate buffer");
        return NULL;
    }
    /* A copy runs on the device of its device memory; one between two
     * devices would need peer access, which rlhfz never sets up. */
    if (src->tier == RLHFZ_TIER_DEVICE && self->tier == RLHFZ_TIER_DEVICE &&
        src->device != self->device) {
        PyErr_Format(PyExc_ValueError, "copy_from: src is on CUDA device %d and this buffer on "
                     "%d; copies between devices are not supported (go through host memory)",
                     src->device, self->device);
        return NULL;
    }
    if (rlhfz_buffer_intact(src) < 0 || rlhfz_buffer_intact(self) < 0)
        return NULL;
    int device = self->tier == RLHFZ_TIER_DEVICE ? self->device
                 : src->tier == RLHFZ_TIER_DEVICE ? src->device : -1;
    if (rlhfz_tier_copy_on(self->data, src->data, self->nbytes, device, stream, !non_blocking) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Buffer_release_pages(rlhfz_Buffer *self, PyObject *unused)
{
    if (self->tier != RLHFZ_TIER_DISK) {
        PyErr_Format(PyExc_ValueError, "release_pages() is for disk buffers, not %s ones",
                     rlhfz_tier_name(self->tier));
        return NULL;
    }
    if (rlhfz_disk_release_pages(self->data, self->mapped) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Buffer_get_path(rlhfz_Buffer *self, void *c)
{
    if (self->path == NULL)
        Py_RETURN_NONE;
    return PyUnicode_DecodeFSDefault(self->path);
}

static PyObject *Buffer_get_nbytes(rlhfz_Buffer *self, void *c) { return PyLong_FromSize_t(self->nbytes); }
static PyObject *Buffer_get_alignment(rlhfz_Buffer *self, void *c) { return PyLong_FromSize_t(self->alignment); }
static PyObject *Buffer_get_tier(rlhfz_Buffer *self, void *c) { return PyUnicode_FromString(rlhfz_tier_name(self->tier)); }
static PyObject *Buffer_get_device(rlhfz_Buffer *self, void *c) { return PyLong_FromLong(self->device); }
static PyObject *Buffer_get_address(rlhfz_Buffer *self, void *c) { return PyLong_FromVoidPtr(self->data); }
static PyObject *Buffer_get_exports(rlhfz_Buffer *self, void *c) { return PyLong_FromSsize_t(self->exports); }

static PyObject *Buffer_repr(rlhfz_Buffer *self)
{
    return PyUnicode_FromFormat("<rlhfz._C.Buffer %zu bytes, tier=%s, exports=%zd>",
                                self->nbytes, rlhfz_tier_name(self->tier), self->exports);
}

static PyMethodDef Buffer_methods[] = {
    {"view", (PyCFunction)(void (*)(void))Buffer_view, METH_FASTCALL | METH_KEYWORDS,
     "view(dtype, offset=0, shape=None) -> BufferView\n\n"
     "A typed range of this buffer; offset counts elements of dtype, and shape\n"
     "None means every element from offset to the end, as one dimension."},
    {"zero_", (PyCFunction)Buffer_zero_, METH_NOARGS, "Fill the buffer with zero bytes."},
    {"copy_from", (PyCFunction)(void (*)(void))Buffer_copy_from, METH_FASTCALL | METH_KEYWORDS,
     "copy_from(src, *, stream=None, non_blocking=False)\n\n"
     "Copy src's bytes (a Buffer of the same size, any tier) into this buffer, with the\n"
     "GIL released. CUDA copies are queued on stream; non_blocking leaves them in flight."},
    {"release_pages", (PyCFunction)Buffer_release_pages, METH_NOARGS,
     "Disk tier: drop this process's resident pages (the file keeps the bytes; they\n"
     "fault back in when next read)."},
    {"from_dlpack", (PyCFunction)Buffer_from_dlpack, METH_O | METH_CLASS,
     "from_dlpack(tensor) -> Buffer\n\n"
     "Adopt a contiguous host tensor's memory (consuming its DLPack capsule);\n"
     "the producer's deleter runs when the Buffer is freed."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Buffer_getset[] = {
    {"nbytes", (getter)Buffer_get_nbytes, NULL, "size in bytes", NULL},
    {"alignment", (getter)Buffer_get_alignment, NULL, "alignment of the start, in bytes", NULL},
    {"tier", (getter)Buffer_get_tier, NULL,
     "memory tier: host, pinned, device, disk or external (pinned asked for with no usable "
     "CUDA device gives host)", NULL},
    {"device", (getter)Buffer_get_device, NULL, "CUDA ordinal of device memory, else -1", NULL},
    {"path", (getter)Buffer_get_path, NULL, "the name a disk buffer's file had (removed once mapped), else None", NULL},
    {"address", (getter)Buffer_get_address, NULL, "address of the first byte", NULL},
    {"exports", (getter)Buffer_get_exports, NULL,
     "DLPack exports of this buffer that their consumers still hold", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef Buffer_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(rlhfz_Buffer, weakreflist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot Buffer_slots[] = {
    {Py_tp_doc, "Buffer(nbytes, tier='host', *, device=-1, alignment=64, zero=True, path=None)\n\n"
                "An owned, aligned allocation. Views of it are exported through DLPack\n"
                "without copying, and each export keeps the buffer alive. The disk tier is\n"
                "a new file in the directory `path`, mapped into memory; its name is removed\n"
                "at once, so its blocks go back when the buffer is freed or the process ends."},
    {Py_tp_new, Buffer_new},
    {Py_tp_dealloc, Buffer_dealloc},
    {Py_tp_traverse, Buffer_traverse},
    {Py_tp_repr, Buffer_repr},
    {Py_tp_methods, Buffer_methods},
    {Py_tp_getset, Buffer_getset},
    {Py_tp_members, Buffer_members},
    {0, NULL},
};

static PyType_Spec Buffer_spec = {
    .name = "rlhfz._C.Buffer",
    .basicsize = sizeof(rlhfz_Buffer),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Buffer_slots,
};

/* ---- BufferView ------------------------------------------------------------ */

static PyObject *Buffer_view(rlhfz_Buffer *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    static const char *const names[] = {"dtype", "offset", "shape", NULL};
    PyObject *slots[3];
    if (rlhfz_parse_args("view", args, nargs, kwnames, names, 3, 1, slots) < 0)
        return NULL;
    rlhfz_dtype dtype;
    if (rlhfz_dtype_from_object(slots[0], &dtype) < 0)
        return NULL;
    size_t itemsize = rlhfz_dtype_size(dtype);
    int64_t offset = 0;
    if (slots[1] != NULL && slots[1] != Py_None && rlhfz_arg_int64(slots[1], "offset", &offset) < 0)
        return NULL;
    if (offset < 0) {
        PyErr_Format(PyExc_ValueError, "offset must be >= 0, not %lld", (long long)offset);
        return NULL;
    }
    /* Every consumer of a view reads whole elements; an adopted buffer may
     * start anywhere. */
    if ((uintptr_t)self->data % itemsize != 0) {
        PyErr_Format(PyExc_ValueError, "this buffer starts at an address not aligned to %zu "
                     "bytes, so it has no %s view; adopt memory aligned to the element size",
                     itemsize, rlhfz_dtype_name(dtype));
        return NULL;
    }
    size_t capacity = self->nbytes / itemsize;
    if ((size_t)offset > capacity) {
        PyErr_Format(PyExc_ValueError, "offset %lld is past the end of a buffer of %zu %s elements",
                     (long long)offset, capacity, rlhfz_dtype_name(dtype));
        return NULL;
    }
    rlhfz_state *state = rlhfz_state_from_type(Py_TYPE(self));
    if (state == NULL)
        return NULL;
    int ndim = 1;
    int64_t shape[RLHFZ_MAX_NDIM];
    size_t numel = capacity - (size_t)offset;
    shape[0] = (int64_t)numel;
    if (slots[2] != NULL && slots[2] != Py_None) {
        PyObject *seq = PySequence_Fast(slots[2], "shape must be a sequence of integers");
        if (seq == NULL)
            return NULL;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (n > RLHFZ_MAX_NDIM) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "shape has %zd dimensions; at most %d are supported",
                         n, RLHFZ_MAX_NDIM);
            return NULL;
        }
        ndim = (int)n;
        numel = 1;
        uint64_t extent = 1;  /* product of max(dim, 1): the largest stride plus one */
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t dim;
            if (rlhfz_arg_int64(PySequence_Fast_GET_ITEM(seq, i), "shape entry", &dim) < 0) {
                Py_DECREF(seq);
                return NULL;
            }
            if (dim < 0) {
                Py_DECREF(seq);
                PyErr_Format(PyExc_ValueError, "shape entries must be >= 0, not %lld", (long long)dim);
                return NULL;
            }
            shape[i] = dim;
            uint64_t factor = dim > 1 ? (uint64_t)dim : 1;
            if (extent > (uint64_t)INT64_MAX / factor) {
                Py_DECREF(seq);
                PyErr_SetString(PyExc_ValueError, "shape is too large: its strides overflow int64");
                return NULL;
            }
            extent *= factor;
            numel *= (size_t)dim;
        }
        Py_DECREF(seq);
        if (numel > capacity - (size_t)offset) {
            PyErr_Format(PyExc_ValueError,
                         "a view of %zu %s elements at offset %lld does not fit in %zu bytes",
                         numel, rlhfz_dtype_name(dtype), (long long)offset, self->nbytes);
            return NULL;
        }
    }
    rlhfz_BufferView *view = (rlhfz_BufferView *)state->BufferView_type->tp_alloc(
        state->BufferView_type, 0);
    if (view == NULL)
        return NULL;
    view->buffer = (rlhfz_Buffer *)Py_NewRef(self);
    view->dtype = dtype;
    view->offset = (size_t)offset;
    view->ndim = ndim;
    memcpy(view->shape, shape, sizeof(int64_t) * (size_t)ndim);
    view->numel = numel;
    return (PyObject *)view;
}

static void BufferView_dealloc(rlhfz_BufferView *self)
{
    PyTypeObject *type = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Py_CLEAR(self->buffer);
    type->tp_free(self);
    Py_DECREF(type);
}

static int BufferView_traverse(rlhfz_BufferView *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->buffer);
    return 0;
}

static int BufferView_clear(rlhfz_BufferView *self)
{
    Py_CLEAR(self->buffer);
    return 0;
}

/* One allocation holds the managed tensor and its shape and strides, so the
 * deleter frees one block. */
typedef struct {
    DLManagedTensorVersioned managed;
    int64_t shape[RLHFZ_MAX_NDIM];
    int64_t strides[RLHFZ_MAX_NDIM];
} versioned_export;

typedef struct {
    DLManagedTensor managed;
    int64_t shape[RLHFZ_MAX_NDIM];
    int64_t strides[RLHFZ_MAX_NDIM];
} legacy_export;

static int interpreter_finalizing(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

/* Releases that came from threads without the GIL, for a thread with it to
 * finish: one node per release, since a buffer may have many exports. */
typedef struct deferred_release {
    rlhfz_Buffer *buffer;
    struct deferred_release *next;
} deferred_release;

static pthread_mutex_t deferred_lock = PTHREAD_MUTEX_INITIALIZER;
static deferred_release *deferred_head;
static int deferred_scheduled;

/* With the GIL: drops the references that the released exports held. */
void rlhfz_finish_deferred_releases(void)
{
    pthread_mutex_lock(&deferred_lock);
    deferred_release *node = deferred_head;
    deferred_head = NULL;
    deferred_scheduled = 0;
    pthread_mutex_unlock(&deferred_lock);
    while (node != NULL) {
        deferred_release *next = node->next;
        Py_DECREF(node->buffer);
        free(node);
        node = next;
    }
}

static int finish_deferred(void *unused)
{
    rlhfz_finish_deferred_releases();
    return 0;
}

/* Consumers may free a tensor from any thread, with or without the GIL, and
 * even after the interpreter is gone. The count drops at once. A thread
 * without the GIL never waits for it: while the interpreter shuts down, a
 * thread that gets the GIL is ended by pthread_exit, which aborts a C++
 * thread (a gloo worker finishing a collective), and with it the process.
 * Its reference goes when Python next runs (a pending call), or at the next
 * allocation; at exit, with the interpreter, never. */
/* PyGILState_Check answers yes to every thread once a subinterpreter has
 * existed; this asks whether this thread's own state is the one running. */
static int this_thread_holds_gil(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyThreadState *running = PyThreadState_GetUnchecked();
#else
    PyThreadState *running = _PyThreadState_UncheckedGet();
#endif
    PyThreadState *mine = PyGILState_GetThisThreadState();
    return running != NULL && running == mine;
}

static void release_export(rlhfz_Buffer *buffer)
{
    buffer->exports--;
    if (!Py_IsInitialized())
        return;
    if (this_thread_holds_gil()) {
        Py_DECREF(buffer);
        return;
    }
    deferred_release *node = malloc(sizeof(*node));
    if (node == NULL)
        return;     /* the buffer outlives its use, rather than crash */
    node->buffer = buffer;
    pthread_mutex_lock(&deferred_lock);
    node->next = deferred_head;
    deferred_head = node;
    int schedule = !deferred_scheduled && !interpreter_finalizing();
    if (schedule)
        deferred_scheduled = Py_AddPendingCall(finish_deferred, NULL) == 0;
    pthread_mutex_unlock(&deferred_lock);
}

static void versioned_deleter(DLManagedTensorVersioned *managed)
{
    release_export((rlhfz_Buffer *)managed->manager_ctx);
    free(managed);
}

static void legacy_deleter(DLManagedTensor *managed)
{
    release_export((rlhfz_Buffer *)managed->manager_ctx);
    free(managed);
}

/* A capsule that nobody consumed still owns its tensor. */
static void versioned_capsule_destructor(PyObject *capsule)
{
    if (PyCapsule_IsValid(capsule, "used_dltensor_versioned"))
        return;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    DLManagedTensorVersioned *managed = PyCapsule_GetPointer(capsule, "dltensor_versioned");
    if (managed == NULL)
        PyErr_WriteUnraisable(capsule);
    else if (managed->deleter)
        managed->deleter(managed);
    PyErr_Restore(type, value, traceback);
}

static void legacy_capsule_destructor(PyObject *capsule)
{
    if (PyCapsule_IsValid(capsule, "used_dltensor"))
        return;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    DLManagedTensor *managed = PyCapsule_GetPointer(capsule, "dltensor");
    if (managed == NULL)
        PyErr_WriteUnraisable(capsule);
    else if (managed->deleter)
        managed->deleter(managed);
    PyErr_Restore(type, value, traceback);
}

/* Reads a pair of non-negative ints, as DLPack's max_version and dl_device are. */
static int parse_int_pair(PyObject *obj, const char *what, long *first, long *second)
{
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 2) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple of two ints, not %.200s",
                     what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    long values[2];
    for (int i = 0; i < 2; i++) {
        PyObject *item = PyTuple_GET_ITEM(obj, i);
        if (!PyLong_Check(item)) {
            PyErr_Format(PyExc_TypeError, "%s must be a tuple of two ints", what);
            return -1;
        }
        values[i] = PyLong_AsLong(item);
        if (values[i] == -1 && PyErr_Occurred())
            return -1;
        if (values[i] < 0) {
            PyErr_Format(PyExc_ValueError, "%s entries must be >= 0, not %ld", what, values[i]);
            return -1;
        }
    }
    *first = values[0];
    *second = values[1];
    return 0;
}

/* base: where the export says the buffer starts (rlhfz_tier_export). */
static void fill_tensor(DLTensor *tensor, rlhfz_BufferView *view, void *base,
                        DLDevice device, int64_t *shape, int64_t *strides)
{
    size_t itemsize = rlhfz_dtype_size(view->dtype);
    tensor->data = base;
    tensor->byte_offset = (uint64_t)(view->offset * itemsize);
    tensor->device = device;
    tensor->ndim = view->ndim;
    tensor->dtype = rlhfz_dtype_to_dl(view->dtype);
    int64_t stride = 1;
    for (int i = view->ndim - 1; i >= 0; i--) {
        shape[i] = view->shape[i];
        strides[i] = stride;
        stride *= view->shape[i] > 0 ? view->shape[i] : 1;
    }
    tensor->shape = shape;
    tensor->strides = strides;
}

static PyObject *BufferView_dlpack(rlhfz_BufferView *self, PyObject *const *args,
                                   Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *slots[4];
    if (rlhfz_parse_args("__dlpack__", args, nargs, kwnames, names, 0, 0, slots) < 0)
        return NULL;
    PyObject *stream = slots[0], *max_version = slots[1], *dl_device = slots[2], *copy = slots[3];
    rlhfz_Buffer *source = self->buffer;
    DLDevice here;
    void *base;
    if (rlhfz_tier_export(source->tier, source->device, source->data, source->nbytes, &here,
                          &base) < 0)
        return NULL;
    if (stream != NULL && stream != Py_None) {
        /* Host memory needs no stream ordering; the array API asks for None. */
        if (here.device_type != kDLCUDA) {
            PyErr_Format(PyExc_BufferError, "stream must be None for host memory, not %R",
                         stream);
            return NULL;
        }
        if (!PyLong_Check(stream)) {
            PyErr_Format(PyExc_TypeError, "stream must be None or an int, not %.200s",
                         Py_TYPE(stream)->tp_name);
            return NULL;
        }
        long long handle = PyLong_AsLongLong(stream);
        if (handle == -1 && PyErr_Occurred())
            return NULL;
        /* The array API: -1 asks for no synchronization, 1 and 2 name the
         * legacy and per-thread default streams, 0 is ambiguous. rlhfz
         * queues kernels only on the stream its caller names (torch's
         * current one, in the optimizer), and joins its own collective
         * stream back to that stream before a collective's wait() returns,
         * so a consumer on the caller's stream needs no event from here. */
        if (handle == 0 || handle < -1) {
            PyErr_Format(PyExc_BufferError, "stream %lld is not valid for CUDA memory (use None, "
                         "-1, 1 for the legacy default stream, 2, or a stream handle)", handle);
            return NULL;
        }
    }
    if (dl_device != NULL && dl_device != Py_None) {
        long device_type, device_id;
        if (parse_int_pair(dl_device, "dl_device", &device_type, &device_id) < 0)
            return NULL;
        /* Pinned memory is host memory too: a CPU consumer (torch takes no
         * kDLCUDAHost) may have it as kDLCPU, without a copy. */
        int pinned_as_cpu = here.device_type == kDLCUDAHost && device_type == kDLCPU &&
                            device_id == 0;
        if (pinned_as_cpu)
            here.device_type = kDLCPU;
        else if (device_type != here.device_type || device_id != here.device_id) {
            PyErr_Format(PyExc_BufferError,
                         "cannot export memory of DLPack device (%d, %d) to device type %ld "
                         "(id %ld) without a copy across devices", (int)here.device_type,
                         (int)here.device_id, device_type, device_id);
            return NULL;
        }
    }
    int versioned = 0;
    if (max_version != NULL && max_version != Py_None) {
        long major, minor;
        if (parse_int_pair(max_version, "max_version", &major, &minor) < 0)
            return NULL;
        versioned = major >= RLHFZ_DLPACK_MAJOR_VERSION;
    }
    int want_copy = 0;
    if (copy != NULL && copy != Py_None) {
        want_copy = PyObject_IsTrue(copy);
        if (want_copy < 0)
            return NULL;
    }

    rlhfz_BufferView copied_view = *self;
    rlhfz_BufferView *view = self;
    rlhfz_Buffer *buffer = source;
    if (want_copy) {
        if (rlhfz_buffer_intact(source) < 0)
            return NULL;
        size_t nbytes = self->numel * rlhfz_dtype_size(self->dtype);
        rlhfz_state *state = rlhfz_state_from_type(Py_TYPE(self));
        if (state == NULL)
            return NULL;
        rlhfz_tier tier = source->tier == RLHFZ_TIER_EXTERNAL || source->tier == RLHFZ_TIER_DISK
                              ? RLHFZ_TIER_HOST : source->tier;
        size_t alignment = source->alignment < 64 ? 64 : source->alignment;
        buffer = rlhfz_buffer_alloc_in(state, tier, source->device, nbytes,
                                       alignment > 256 && tier != RLHFZ_TIER_HOST ? 256 : alignment,
                                       0);
        if (buffer == NULL)
            return NULL;
        const char *from = (const char *)source->data + self->offset * rlhfz_dtype_size(self->dtype);
        if (rlhfz_tier_copy(buffer->data, from, nbytes,
                            tier == RLHFZ_TIER_DEVICE ? buffer->device : -1) < 0) {
            Py_DECREF(buffer);
            return NULL;
        }
        copied_view.offset = 0;
        view = &copied_view;
        DLDevice copied_device;
        if (rlhfz_tier_export(buffer->tier, buffer->device, buffer->data, buffer->nbytes,
                              &copied_device, &base) < 0) {
            Py_DECREF(buffer);
            return NULL;
        }
    } else {
        Py_INCREF(buffer);
    }
    /* From here `buffer` is a new reference, handed to the export. */
    PyObject *capsule = NULL;
    if (versioned) {
        versioned_export *out = calloc(1, sizeof(*out));
        if (out == NULL) {
            Py_DECREF(buffer);
            return PyErr_NoMemory();
        }
        out->managed.version.major = RLHFZ_DLPACK_MAJOR_VERSION;
        out->managed.version.minor = RLHFZ_DLPACK_MINOR_VERSION;
        out->managed.manager_ctx = buffer;
        out->managed.deleter = versioned_deleter;
        out->managed.flags = want_copy ? RLHFZ_DLPACK_FLAG_IS_COPIED : 0;
        fill_tensor(&out->managed.dl_tensor, view, base, here, out->shape, out->strides);
        buffer->exports++;
        capsule = PyCapsule_New(&out->managed, "dltensor_versioned", versioned_capsule_destructor);
        if (capsule == NULL) {
            buffer->exports--;
            Py_DECREF(buffer);
            free(out);
        }
    } else {
        legacy_export *out = calloc(1, sizeof(*out));
        if (out == NULL) {
            Py_DECREF(buffer);
            return PyErr_NoMemory();
        }
        out->managed.manager_ctx = buffer;
        out->managed.deleter = legacy_deleter;
        fill_tensor(&out->managed.dl_tensor, view, base, here, out->shape, out->strides);
        buffer->exports++;
        capsule = PyCapsule_New(&out->managed, "dltensor", legacy_capsule_destructor);
        if (capsule == NULL) {
            buffer->exports--;
            Py_DECREF(buffer);
            free(out);
        }
    }
    return capsule;
}

static PyObject *BufferView_dlpack_device(rlhfz_BufferView *self, PyObject *unused)
{
    rlhfz_Buffer *buffer = self->buffer;
    DLDevice here;
    void *base;
    if (rlhfz_tier_export(buffer->tier, buffer->device, buffer->data, buffer->nbytes, &here,
                          &base) < 0)
        return NULL;
    return Py_BuildValue("(ii)", (int)here.device_type, (int)here.device_id);
}

static PyObject *BufferView_get_buffer(rlhfz_BufferView *self, void *c) { return Py_NewRef(self->buffer); }
static PyObject *BufferView_get_dtype(rlhfz_BufferView *self, void *c) { return PyUnicode_FromString(rlhfz_dtype_name(self->dtype)); }
static PyObject *BufferView_get_offset(rlhfz_BufferView *self, void *c) { return PyLong_FromSize_t(self->offset); }
static PyObject *BufferView_get_numel(rlhfz_BufferView *self, void *c) { return PyLong_FromSize_t(self->numel); }

static PyObject *BufferView_get_nbytes(rlhfz_BufferView *self, void *c)
{
    return PyLong_FromSize_t(self->numel * rlhfz_dtype_size(self->dtype));
}

static PyObject *BufferView_get_address(rlhfz_BufferView *self, void *c)
{
    return PyLong_FromVoidPtr((char *)self->buffer->data + self->offset * rlhfz_dtype_size(self->dtype));
}

static PyObject *BufferView_get_shape(rlhfz_BufferView *self, void *c)
{
    PyObject *shape = PyTuple_New(self->ndim);
    if (shape == NULL)
        return NULL;
    for (int i = 0; i < self->ndim; i++) {
        PyObject *dim = PyLong_FromLongLong(self->shape[i]);
        if (dim == NULL) {
            Py_DECREF(shape);
            return NULL;
        }
        PyTuple_SET_ITEM(shape, i, dim);
    }
    return shape;
}

static PyObject *BufferView_repr(rlhfz_BufferView *self)
{
    return PyUnicode_FromFormat("<rlhfz._C.BufferView %s[%zu] at offset %zu>",
                                rlhfz_dtype_name(self->dtype), self->numel, self->offset);
}

static PyMethodDef BufferView_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))BufferView_dlpack, METH_FASTCALL | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None)\n\n"
     "Export as a DLPack capsule: versioned when max_version allows it, else legacy."},
    {"__dlpack_device__", (PyCFunction)BufferView_dlpack_device, METH_NOARGS,
     "(device_type, device_id) of the memory, as DLPack numbers it."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef BufferView_getset[] = {
    {"buffer", (getter)BufferView_get_buffer, NULL, "the Buffer this view is of", NULL},
    {"dtype", (getter)BufferView_get_dtype, NULL, "element type", NULL},
    {"offset", (getter)BufferView_get_offset, NULL, "offset in elements of dtype", NULL},
    {"numel", (getter)BufferView_get_numel, NULL, "number of elements", NULL},
    {"nbytes", (getter)BufferView_get_nbytes, NULL, "size in bytes", NULL},
    {"shape", (getter)BufferView_get_shape, NULL, "shape", NULL},
    {"address", (getter)BufferView_get_address, NULL, "address of the first element", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot BufferView_slots[] = {
    {Py_tp_doc, "A typed, shaped range of a Buffer, exported through DLPack without copying."},
    {Py_tp_dealloc, BufferView_dealloc},
    {Py_tp_traverse, BufferView_traverse},
    {Py_tp_clear, BufferView_clear},
    {Py_tp_repr, BufferView_repr},
    {Py_tp_methods, BufferView_methods},
    {Py_tp_getset, BufferView_getset},
    {0, NULL},
};

static PyType_Spec BufferView_spec = {
    .name = "rlhfz._C.BufferView",
    .basicsize = sizeof(rlhfz_BufferView),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = BufferView_slots,
};

int rlhfz_buffer_add_types(PyObject *module, rlhfz_state *state)
{
    state->Buffer_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &Buffer_spec, NULL);
    if (state->Buffer_type == NULL || PyModule_AddType(module, state->Buffer_type) < 0)
        return -1;
    state->BufferView_type = (PyTypeObject *)PyType_FromModuleAndSpec(module, &BufferView_spec, NULL);
    if (state->BufferView_type == NULL || PyModule_AddType(module, state->BufferView_type) < 0)
        return -1;
    return 0;
}
