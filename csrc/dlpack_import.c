/* dlpack_import.c: taking tensors in through DLPack, checked before use.
 *
 * Kernels borrow a flat, contiguous array for the length of one call; the
 * capsule is left unconsumed, so its own destructor frees the tensor when the
 * borrow ends. Buffer.from_dlpack adopts the memory instead: it renames the
 * capsule "used_*" and runs the producer's deleter when the Buffer dies.
 * Every rejection is a BufferError naming what was wrong.
 */
#include "rlhfz_module.h"

#include <string.h>

#ifdef RLHFZ_WITH_CUDA
#include "rlhfz_cuda.h"
#endif

static const char *device_name(int32_t device_type)
{
    switch (device_type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda";
    case kDLCUDAHost: return "cuda_host";
    case kDLCUDAManaged: return "cuda_managed";
    case kDLROCM: return "rocm";
    case kDLROCMHost: return "rocm_host";
    case kDLOpenCL: return "opencl";
    case kDLVulkan: return "vulkan";
    case kDLMetal: return "metal";
    case kDLOneAPI: return "oneapi";
    default: return "unknown";
    }
}

static void describe_dl_dtype(DLDataType dtype, char *out, size_t size)
{
    const char *code;
    switch (dtype.code) {
    case kDLInt: code = "int"; break;
    case kDLUInt: code = "uint"; break;
    case kDLFloat: code = "float"; break;
    case kDLBfloat: code = "bfloat"; break;
    case kDLComplex: code = "complex"; break;
    case kDLBool: code = "bool"; break;
    default: code = "code"; break;
    }
    if (dtype.lanes != 1)
        snprintf(out, size, "%s%u x%u lanes", code, (unsigned)dtype.bits, (unsigned)dtype.lanes);
    else
        snprintf(out, size, "%s%u", code, (unsigned)dtype.bits);
}

/* Checks a DLTensor against what rlhfz kernels take, and fills `out`. */
static int check_place(const char *name, rlhfz_place place, DLDevice device)
{
    int32_t type = device.device_type;
    if (place == RLHFZ_PLACE_HOST && type != kDLCPU && type != kDLCUDAHost) {
        PyErr_Format(PyExc_BufferError,
                     "%s is on device %s:%d; this kernel needs host memory (cpu or cuda_host)",
                     name, device_name(type), (int)device.device_id);
        return -1;
    }
    if (place == RLHFZ_PLACE_CUDA && type != kDLCUDA) {
        PyErr_Format(PyExc_BufferError,
                     "%s is on device %s:%d; this kernel needs CUDA device memory (cuda)",
                     name, device_name(type), (int)device.device_id);
        return -1;
    }
    return 0;
}

/* On the simulated runtime torch holds device memory as CPU tensors over
 * its host alias: such a tensor is device memory, as it would be on a GPU.
 * Where a host tensor may be such an alias, where it lies is known only
 * once its data and size are. */
static int maybe_simulated_alias(DLDevice device)
{
#ifdef RLHFZ_WITH_CUDA
    return (device.device_type == kDLCPU || device.device_type == kDLCUDAHost) &&
           rlhfz_cuda_simulated();
#else
    (void)device;
    return 0;
#endif
}

static int validate_tensor(const DLTensor *tensor, const char *name, rlhfz_place place,
                           int codes, rlhfz_array *out)
{
    DLDevice device = tensor->device;
    int deferred = maybe_simulated_alias(device);
    if (!deferred && check_place(name, place, device) < 0)
        return -1;
    if (rlhfz_dtype_from_dl(tensor->dtype, codes, &out->dtype) < 0) {
        char text[48];
        describe_dl_dtype(tensor->dtype, text, sizeof(text));
        PyErr_Format(PyExc_BufferError,
                     codes ? "%s has dtype %s; supported dtypes are float32, bfloat16, "
                             "float16, int8 and uint8"
                           : "%s has dtype %s; supported dtypes are float32, bfloat16 and float16",
                     name, text);
        return -1;
    }
    if (tensor->ndim < 0 || tensor->ndim > RLHFZ_MAX_NDIM) {
        PyErr_Format(PyExc_BufferError, "%s has %d dimensions; 0 to %d are supported",
                     name, (int)tensor->ndim, RLHFZ_MAX_NDIM);
        return -1;
    }
    if (tensor->ndim > 0 && tensor->shape == NULL) {
        PyErr_Format(PyExc_BufferError, "%s has %d dimensions but no shape", name, (int)tensor->ndim);
        return -1;
    }
    /* Its bytes must fit a ptrdiff_t, so that sizes and the stride products
     * below cannot overflow. */
    size_t itemsize = rlhfz_dtype_size(out->dtype);
    size_t max_numel = (size_t)PTRDIFF_MAX / itemsize;
    size_t numel = 1;
    for (int i = 0; i < tensor->ndim; i++) {
        int64_t dim = tensor->shape[i];
        if (dim < 0) {
            PyErr_Format(PyExc_BufferError, "%s has a negative dimension %lld at axis %d",
                         name, (long long)dim, i);
            return -1;
        }
        if (dim != 0 && numel > max_numel / (size_t)dim) {
            PyErr_Format(PyExc_BufferError, "%s is too large", name);
            return -1;
        }
        numel *= (size_t)dim;
        out->shape[i] = dim;
    }
    /* Row-major and compact; a stride on a dimension of size 1 carries no meaning. */
    if (tensor->strides != NULL && numel > 0) {
        int64_t expected = 1;
        for (int i = tensor->ndim - 1; i >= 0; i--) {
            int64_t dim = tensor->shape[i];
            if (dim != 1 && tensor->strides[i] != expected) {
                PyErr_Format(PyExc_BufferError,
                             "%s is not contiguous: stride %lld at axis %d of a dimension of "
                             "size %lld, where a compact row-major layout has stride %lld",
                             name, (long long)tensor->strides[i], i, (long long)dim,
                             (long long)expected);
                return -1;
            }
            expected *= dim;
        }
    }
    if (numel > 0 && tensor->data == NULL) {
        PyErr_Format(PyExc_BufferError, "%s has %zu elements but a null data pointer", name, numel);
        return -1;
    }
    /* data + byte_offset + its bytes, without wrapping past the address space */
    uintptr_t start = (uintptr_t)tensor->data;
    if (tensor->byte_offset > UINTPTR_MAX - start ||
        numel * itemsize > UINTPTR_MAX - (start + tensor->byte_offset)) {
        PyErr_Format(PyExc_BufferError, "%s: data pointer %p plus byte_offset %llu and %zu bytes "
                     "runs past the end of the address space", name, tensor->data,
                     (unsigned long long)tensor->byte_offset, numel * itemsize);
        return -1;
    }
    char *data = (char *)(start + tensor->byte_offset);
    if (((uintptr_t)data) % itemsize != 0) {
        PyErr_Format(PyExc_BufferError, "%s data at %p is not aligned to its %zu-byte elements",
                     name, (void *)data, itemsize);
        return -1;
    }
#ifdef RLHFZ_WITH_CUDA
    if (deferred) {
        void *device_ptr;
        int ordinal;
        if (rlhfz_cuda_alias_device(data, numel * itemsize, &device_ptr, &ordinal) == RLHFZ_OK) {
            data = device_ptr;
            device.device_type = kDLCUDA;
            device.device_id = ordinal;
        } else if (numel == 0 && place == RLHFZ_PLACE_CUDA &&
                   rlhfz_cuda_get_device(&ordinal) == RLHFZ_OK) {
            /* torch gives an empty slice a null pointer, so where its tensor
             * lived cannot be told: it holds no memory, and serves as the
             * current device's, as an empty CUDA tensor would */
            device.device_type = kDLCUDA;
            device.device_id = ordinal;
        }
    }
#endif
    if (deferred && check_place(name, place, device) < 0)
        return -1;
    out->data = data;
    out->numel = numel;
    out->ndim = tensor->ndim;
    out->device = device;
    return 0;
}

/* The DLPack device type obj reports, or -1 if it has no __dlpack_device__. */
static int dlpack_device_type(PyObject *obj)
{
    PyObject *device = PyObject_CallMethod(obj, "__dlpack_device__", NULL);
    if (device == NULL) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            return -1;
        }
        return -2;
    }
    long type = -1;
    if (PyTuple_Check(device) && PyTuple_GET_SIZE(device) == 2)
        type = PyLong_AsLong(PyTuple_GET_ITEM(device, 0));
    Py_DECREF(device);
    if (type == -1 && PyErr_Occurred())
        return -2;
    return (int)type;
}

/* Calls obj.__dlpack__ asking for a versioned capsule, falling back to the
 * legacy call for producers that do not take max_version. For CUDA memory
 * the consumer's stream goes along (1 for the legacy default stream, as the
 * array API asks), so the producer orders its pending writes before it. */
static PyObject *call_dlpack(PyObject *obj, rlhfz_place place, void *stream)
{
    PyObject *stream_arg = NULL;
    if (place == RLHFZ_PLACE_CUDA) {
        int type = dlpack_device_type(obj);
        if (type == -2)
            return NULL;
        if (type == kDLCUDA) {
            stream_arg = PyLong_FromUnsignedLongLong(stream ? (unsigned long long)(uintptr_t)stream : 1ULL);
            if (stream_arg == NULL)
                return NULL;
        }
    }
    PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
    if (method == NULL) {
        Py_XDECREF(stream_arg);
        return NULL;
    }
    PyObject *kwargs = Py_BuildValue("{s(ii)}", "max_version", RLHFZ_DLPACK_MAJOR_VERSION,
                                     RLHFZ_DLPACK_MINOR_VERSION);
    if (kwargs != NULL && stream_arg != NULL &&
        PyDict_SetItemString(kwargs, "stream", stream_arg) < 0)
        Py_CLEAR(kwargs);
    if (kwargs == NULL) {
        Py_DECREF(method);
        Py_XDECREF(stream_arg);
        return NULL;
    }
    PyObject *empty = PyTuple_New(0);
    PyObject *capsule = empty ? PyObject_Call(method, empty, kwargs) : NULL;
    Py_DECREF(kwargs);
    if (capsule == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        if (stream_arg != NULL) {
            PyObject *legacy = Py_BuildValue("{s:O}", "stream", stream_arg);
            capsule = legacy && empty ? PyObject_Call(method, empty, legacy) : NULL;
            Py_XDECREF(legacy);
        } else {
            capsule = PyObject_CallNoArgs(method);
        }
    }
    Py_XDECREF(empty);
    Py_XDECREF(stream_arg);
    Py_DECREF(method);
    return capsule;
}

/* A capsule passed in by the caller stays the caller's, so a kernel only
 * borrows it; while it does (with the GIL released), the capsule carries
 * these names, so that no other consumer takes it and frees the memory
 * under the kernel. The names are restored when the borrow ends. The same
 * capsule may be borrowed again by the thread that lent it (an in-place
 * collective takes one array as send and recv), never consumed. Lends are
 * recorded with their thread; the GIL guards the record. */
#define LENT_NAME "rlhfz_lent_dltensor"
#define LENT_NAME_VERSIONED "rlhfz_lent_dltensor_versioned"
#define MAX_LENT 256

static struct { PyObject *capsule; unsigned long thread; int borrows; } lent[MAX_LENT];
static int lent_count;

static int lent_here(PyObject *capsule)
{
    unsigned long thread = PyThread_get_thread_ident();
    for (int i = 0; i < lent_count; i++)
        if (lent[i].capsule == capsule && lent[i].thread == thread)
            return 1;
    return 0;
}

static int lend_capsule(PyObject *capsule, int versioned)
{
    if (lent_count == MAX_LENT) {
        PyErr_Format(PyExc_BufferError, "more than %d DLPack capsules are lent to rlhfz "
                     "calls at once; pass tensors rather than capsules", MAX_LENT);
        return -1;
    }
    lent[lent_count].capsule = capsule;
    lent[lent_count].thread = PyThread_get_thread_ident();
    lent[lent_count].borrows = 1;
    lent_count++;
    /* cannot fail: the capsule was just found valid under its own name */
    (void)PyCapsule_SetName(capsule, versioned ? LENT_NAME_VERSIONED : LENT_NAME);
    return 0;
}

void rlhfz_borrow_end(PyObject *keepalive)
{
    if (keepalive == NULL || !PyCapsule_CheckExact(keepalive))
        return;
    for (int i = 0; i < lent_count; i++) {
        if (lent[i].capsule != keepalive)
            continue;
        if (--lent[i].borrows > 0)
            return;            /* an outer or in-flight borrow still holds it */
        if (PyCapsule_IsValid(keepalive, LENT_NAME))
            (void)PyCapsule_SetName(keepalive, "dltensor");
        else if (PyCapsule_IsValid(keepalive, LENT_NAME_VERSIONED))
            (void)PyCapsule_SetName(keepalive, "dltensor_versioned");
        lent[i] = lent[--lent_count];
        return;
    }
}

/* Obtains a capsule from obj (or obj itself, if it is one) and its tensor. */
static PyObject *open_capsule(PyObject *obj, const char *name, rlhfz_place place, void *stream,
                              DLTensor **tensor, int *readonly, void **managed, int *versioned,
                              int borrow)
{
    PyObject *capsule;
    if (PyCapsule_CheckExact(obj)) {
        capsule = Py_NewRef(obj);
    } else {
        if (!PyObject_HasAttrString(obj, "__dlpack__")) {
            PyErr_Format(PyExc_TypeError,
                         "%s must be a tensor or array supporting DLPack (__dlpack__), "
                         "not %.200s", name, Py_TYPE(obj)->tp_name);
            return NULL;
        }
        capsule = call_dlpack(obj, place, stream);
        if (capsule == NULL)
            return NULL;
    }
    int again = borrow && (PyCapsule_IsValid(capsule, LENT_NAME) ||
                           PyCapsule_IsValid(capsule, LENT_NAME_VERSIONED)) && lent_here(capsule);
    const char *versioned_name = again ? LENT_NAME_VERSIONED : "dltensor_versioned";
    const char *legacy_name = again ? LENT_NAME : "dltensor";
    if (PyCapsule_IsValid(capsule, versioned_name)) {
        DLManagedTensorVersioned *m = PyCapsule_GetPointer(capsule, versioned_name);
        if (m->version.major != RLHFZ_DLPACK_MAJOR_VERSION) {
            PyErr_Format(PyExc_BufferError,
                         "%s uses DLPack version %u.%u; rlhfz reads major version %d",
                         name, (unsigned)m->version.major, (unsigned)m->version.minor,
                         RLHFZ_DLPACK_MAJOR_VERSION);
            Py_DECREF(capsule);
            return NULL;
        }
        *tensor = &m->dl_tensor;
        *readonly = (m->flags & RLHFZ_DLPACK_FLAG_READ_ONLY) != 0;
        *managed = m;
        *versioned = 1;
    } else if (PyCapsule_IsValid(capsule, legacy_name)) {
        DLManagedTensor *m = PyCapsule_GetPointer(capsule, legacy_name);
        *tensor = &m->dl_tensor;
        *readonly = 0;
        *managed = m;
        *versioned = 0;
    } else if (PyCapsule_IsValid(capsule, LENT_NAME) ||
               PyCapsule_IsValid(capsule, LENT_NAME_VERSIONED)) {
        PyErr_Format(PyExc_BufferError, "%s is a DLPack capsule lent to an rlhfz call right "
                     "now (a kernel on another thread reads it, or this call borrows it and "
                     "cannot also consume it); pass each use its own capsule", name);
        Py_DECREF(capsule);
        return NULL;
    } else if (PyCapsule_IsValid(capsule, "used_dltensor") ||
               PyCapsule_IsValid(capsule, "used_dltensor_versioned")) {
        PyErr_Format(PyExc_BufferError, "%s is a DLPack capsule that was already consumed", name);
        Py_DECREF(capsule);
        return NULL;
    } else {
        PyErr_Format(PyExc_BufferError, "%s: __dlpack__ returned %.200s, not a DLPack capsule",
                     name, Py_TYPE(capsule)->tp_name);
        Py_DECREF(capsule);
        return NULL;
    }
    return capsule;
}

int rlhfz_array_from_object(rlhfz_state *state, PyObject *obj, const char *name,
                            int flags, rlhfz_place place, void *stream, rlhfz_array *out)
{
    int writable = flags & RLHFZ_BORROW_WRITABLE;
    memset(out, 0, sizeof(*out));
    /* rlhfz's own views need no capsule round trip: this is the hot path. */
    if (Py_TYPE(obj) == state->BufferView_type) {
        rlhfz_BufferView *view = (rlhfz_BufferView *)obj;
        int on_device = view->buffer->tier == RLHFZ_TIER_DEVICE;
        if (place == RLHFZ_PLACE_HOST && on_device) {
            PyErr_Format(PyExc_BufferError, "%s is on device cuda:%d; this kernel needs host "
                         "memory (cpu or cuda_host)", name, view->buffer->device);
            return -1;
        }
        if (place == RLHFZ_PLACE_CUDA && !on_device) {
            PyErr_Format(PyExc_BufferError, "%s is in %s memory; this kernel needs CUDA device "
                         "memory (cuda)", name, rlhfz_tier_name(view->buffer->tier));
            return -1;
        }
        if (rlhfz_buffer_intact(view->buffer) < 0)
            return -1;
        if (rlhfz_dtype_is_codes(view->dtype) && !(flags & RLHFZ_BORROW_CODES)) {
            PyErr_Format(PyExc_BufferError, "%s has dtype %s; supported dtypes are float32, "
                         "bfloat16 and float16", name, rlhfz_dtype_name(view->dtype));
            return -1;
        }
        out->data = (char *)view->buffer->data + view->offset * rlhfz_dtype_size(view->dtype);
        out->dtype = view->dtype;
        out->numel = view->numel;
        out->ndim = view->ndim;
        memcpy(out->shape, view->shape, sizeof(int64_t) * (size_t)view->ndim);
        out->device = rlhfz_tier_dl_device(view->buffer->tier, view->buffer->device);
        out->keepalive = Py_NewRef(obj);
        return 0;
    }
    DLTensor *tensor;
    int readonly, versioned;
    void *managed;
    PyObject *capsule = open_capsule(obj, name, place, stream, &tensor, &readonly, &managed,
                                     &versioned, 1);
    if (capsule == NULL)
        return -1;
    if (validate_tensor(tensor, name, place, flags & RLHFZ_BORROW_CODES, out) < 0) {
        Py_DECREF(capsule);
        return -1;
    }
    if (writable && readonly) {
        PyErr_Format(PyExc_BufferError, "%s is read-only, but this kernel writes to it", name);
        Py_DECREF(capsule);
        return -1;
    }
    int counted = 0;
    for (int i = 0; i < lent_count; i++)
        if (lent[i].capsule == capsule && lent[i].thread == PyThread_get_thread_ident()) {
            lent[i].borrows++;
            counted = 1;
            break;
        }
    if (!counted && capsule == obj && lend_capsule(capsule, versioned) < 0) {
        Py_DECREF(capsule);
        return -1;
    }
    out->readonly = readonly;
    out->keepalive = capsule;
    return 0;
}

void rlhfz_array_release(rlhfz_array *array)
{
    rlhfz_borrow_end(array->keepalive);
    Py_CLEAR(array->keepalive);
}

int rlhfz_buffer_import_dlpack(rlhfz_Buffer *buffer, PyObject *obj)
{
    DLTensor *tensor;
    int readonly, versioned;
    void *managed;
    PyObject *capsule = open_capsule(obj, "tensor", RLHFZ_PLACE_HOST, NULL, &tensor, &readonly,
                                     &managed, &versioned, 0);
    if (capsule == NULL)
        return -1;
    rlhfz_array array;
    memset(&array, 0, sizeof(array));
    if (validate_tensor(tensor, "tensor", RLHFZ_PLACE_HOST, 0, &array) < 0)
        goto error;
    if (readonly) {
        PyErr_SetString(PyExc_BufferError, "tensor is read-only; a Buffer must be writable");
        goto error;
    }
    /* Taking ownership: the capsule must no longer free the tensor. */
    if (PyCapsule_SetName(capsule, versioned ? "used_dltensor_versioned" : "used_dltensor") < 0)
        goto error;
    buffer->data = array.data;
    buffer->nbytes = array.numel * rlhfz_dtype_size(array.dtype);
    buffer->external = managed;
    buffer->external_versioned = versioned;
    Py_DECREF(capsule);
    return 0;
error:
    Py_DECREF(capsule);
    return -1;
}

PyObject *rlhfz_describe_dlpack(PyObject *module, PyObject *obj)
{
    rlhfz_state *state = rlhfz_get_state(module);
    rlhfz_array array;
    if (rlhfz_array_from_object(state, obj, "tensor", 0, RLHFZ_PLACE_HOST, NULL, &array) < 0)
        return NULL;
    PyObject *shape = PyTuple_New(array.ndim);
    if (shape == NULL) {
        rlhfz_array_release(&array);
        return NULL;
    }
    for (int i = 0; i < array.ndim; i++)
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(array.shape[i]));
    PyObject *result = Py_BuildValue(
        "{s:N,s:s,s:N,s:n,s:(ii),s:O}",
        "address", PyLong_FromVoidPtr(array.data),
        "dtype", rlhfz_dtype_name(array.dtype),
        "shape", shape,
        "numel", (Py_ssize_t)array.numel,
        "device", (int)array.device.device_type, (int)array.device.device_id,
        "readonly", array.readonly ? Py_True : Py_False);
    rlhfz_array_release(&array);
    return result;
}
