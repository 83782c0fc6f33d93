/* cuda_ops.c: Python entry points of the CUDA kernels, and rlhfz's own
 * streams and events.
 *
 * Arrays are rlhfz device views or anything with __dlpack__ on a CUDA
 * device; the stream a kernel runs on is passed to the producer, so it
 * orders its pending writes first. Device scalars (a sum of squares, a
 * found-inf flag, capturable hyperparameters) are device Buffers. Every
 * argument is checked before the launch; the launch itself happens with the
 * GIL released, on the arrays' device, and the caller's current device is
 * restored after. In a build without nvcc, or with no usable device, each
 * entry point raises RuntimeError saying why.
 */
#include "rlhfz_module.h"

#include <string.h>

#ifdef RLHFZ_WITH_CUDA
#include "rlhfz_cuda.h"
#endif

/* A device Buffer of at least min_bytes on `device`, as a device pointer,
 * whose first min_bytes (what the kernel touches) lie apart from every array
 * borrowed in b: a kernel that writes an array while it reads its factor or
 * flag from the same bytes gives garbage (and races, on a GPU). */
static int device_scalar(PyObject *module, PyObject *obj, const char *name, size_t min_bytes,
                         int device, const rlhfz_borrowed *b, void **ptr)
{
    rlhfz_state *state = rlhfz_get_state(module);
    if (!PyObject_TypeCheck(obj, state->Buffer_type)) {
        PyErr_Format(PyExc_TypeError, "%s must be an rlhfz Buffer in the device tier, not %.200s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    rlhfz_Buffer *buffer = (rlhfz_Buffer *)obj;
    if (buffer->tier != RLHFZ_TIER_DEVICE) {
        PyErr_Format(PyExc_BufferError, "%s is a %s Buffer; it must be in the device tier", name,
                     rlhfz_tier_name(buffer->tier));
        return -1;
    }
    if (buffer->device != device) {
        PyErr_Format(PyExc_ValueError, "%s is on cuda:%d but the arrays are on cuda:%d", name,
                     buffer->device, device);
        return -1;
    }
    if (buffer->nbytes < min_bytes) {
        PyErr_Format(PyExc_ValueError, "%s has %zu bytes; it needs at least %zu", name,
                     buffer->nbytes, min_bytes);
        return -1;
    }
    rlhfz_array scalar = {.data = buffer->data, .dtype = RLHFZ_DTYPE_F32,
                          .numel = (min_bytes + 3) / 4};
    for (int i = 0; i < b->count; i++)
        if (rlhfz_check_disjoint(&scalar, name, &b->items[i], "an array of the call") < 0)
            return -1;
    *ptr = buffer->data;
    return 0;
}

static rlhfz_array *borrow(PyObject *module, rlhfz_borrowed *b, PyObject *obj, const char *name,
                           int writable, void *stream)
{
    return rlhfz_borrow(module, b, obj, name, writable, RLHFZ_PLACE_CUDA, stream);
}

/* A launch with its arguments, run on the arrays' device with the GIL released. */
typedef rlhfz_status (*cuda_launch)(const void *args, void *stream);

#ifdef RLHFZ_WITH_CUDA
#define LAUNCHER(fn) fn
#else
#define LAUNCHER(fn) NULL
#endif

/* Checks that CUDA is usable, makes `device` current for the launch, gives
 * the caller's device back (torch reads the runtime's), keeps the DLPack
 * borrows until the kernel is done (cuda_inflight.c), releases the rest and
 * turns the status into None or an exception. */
static PyObject *launch_on(PyObject *module, const char *what, int device, cuda_launch launch,
                           const void *args, void *stream, rlhfz_borrowed *b)
{
    if (rlhfz_require_cuda(what) < 0 || launch == NULL) {
        rlhfz_borrowed_release(b);
        return NULL;
    }
#ifdef RLHFZ_WITH_CUDA
    rlhfz_inflight *inflight = rlhfz_get_state(module)->inflight;
    rlhfz_inflight_sweep(inflight);
    int keep = rlhfz_inflight_needed(b);
    void *event = keep ? rlhfz_inflight_spare_event(inflight, device) : NULL;
    rlhfz_status status;
    int kept = 0;                /* the borrows wait behind `event` */
    Py_BEGIN_ALLOW_THREADS
    int previous = device;
    status = rlhfz_device_enter(device, &previous);
    if (status == RLHFZ_OK) {
        status = launch(args, stream);
        if (status == RLHFZ_OK && keep)
            kept = rlhfz_inflight_fence(&event, stream);
        /* a device left current that the caller did not choose is an error too */
        status = rlhfz_device_leave(device, previous, status);
    }
    Py_END_ALLOW_THREADS
    rlhfz_inflight_settle(inflight, b, event, device, kept);
    rlhfz_borrowed_release(b);
    if (rlhfz_raise_status(status, what) < 0)
        return NULL;
    Py_RETURN_NONE;
#else
    return NULL;
#endif
}

/* ---- kernels ---------------------------------------------------------------------- */

typedef struct {
    rlhfz_adamw_shard shard;
    rlhfz_adamw_hparams hp;
    const void *device_hparams;
    const void *skip_if;
} adamw_launch_args;

typedef struct {
    rlhfz_adamw_lowp_shard shard;
    rlhfz_adamw_hparams hp;
    const void *skip_if;
} adamw_lowp_launch_args;

typedef struct {
    void *x;
    const void *src;
    rlhfz_dtype dtype, src_dtype;
    size_t n;
    float factor;
    void *scalar;            /* out (sumsq), found_inf (unscale), scale_device (scale) */
    void *workspace;
    int accumulate;
} elementwise_launch_args;

#ifdef RLHFZ_WITH_CUDA
static rlhfz_status launch_adamw(const void *p, void *stream)
{
    const adamw_launch_args *a = p;
    return rlhfz_adamw_cuda(&a->shard, &a->hp, a->device_hparams, a->skip_if, stream);
}

static rlhfz_status launch_adamw_lowp(const void *p, void *stream)
{
    const adamw_lowp_launch_args *a = p;
    return rlhfz_adamw_lowp_cuda(&a->shard, &a->hp, a->skip_if, stream);
}

static rlhfz_status launch_sumsq(const void *p, void *stream)
{
    const elementwise_launch_args *a = p;
    return rlhfz_sumsq_cuda(a->x, a->dtype, a->n, a->scalar, a->accumulate, a->workspace, stream);
}

static rlhfz_status launch_unscale(const void *p, void *stream)
{
    const elementwise_launch_args *a = p;
    return rlhfz_unscale_cuda(a->x, a->dtype, a->n, a->factor, a->scalar, stream);
}

static rlhfz_status launch_scale(const void *p, void *stream)
{
    const elementwise_launch_args *a = p;
    return rlhfz_scale_cuda(a->x, a->dtype, a->n, a->factor, a->scalar, stream);
}

static rlhfz_status launch_cast(const void *p, void *stream)
{
    const elementwise_launch_args *a = p;
    return rlhfz_cast_cuda(a->src, a->src_dtype, a->x, a->dtype, a->n, stream);
}

static size_t sumsq_workspace_bytes(void)
{
    return rlhfz_sumsq_cuda_workspace() * sizeof(double);
}
#else
static size_t sumsq_workspace_bytes(void)
{
    return 0;
}
#endif

static PyObject *cuda_adamw_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    static const char *const names[] = {
        "master", "exp_avg", "exp_avg_sq", "grad", "param_out",
        "lr", "beta1", "beta2", "eps", "weight_decay", "step", "maximize", "grad_scale",
        "skip_if", "device_hparams", "stream", NULL};
    enum { MASTER, EXP_AVG, EXP_AVG_SQ, GRAD, PARAM_OUT, LR, BETA1, BETA2, EPS, WD, STEP,
           MAXIMIZE, GRAD_SCALE, SKIP_IF, DEVICE_HPARAMS, STREAM, NSLOTS };
    PyObject *slots[NSLOTS];
    if (rlhfz_parse_args("cuda_adamw_step", args, nargs, kwnames, names, 5, 4, slots) < 0)
        return NULL;
    adamw_launch_args a = {.device_hparams = NULL, .skip_if = NULL};
    void *stream;
    if (rlhfz_adamw_hparams_from_args("cuda_adamw_step", slots + LR, &a.hp) < 0 ||
        rlhfz_arg_stream(slots[STREAM], &stream) < 0)
        return NULL;
    rlhfz_borrowed b = {.count = 0};
    int device;
    void *skip_if = NULL, *device_hparams = NULL;
    if (rlhfz_adamw_shard_from_args(module, &b, slots + MASTER, RLHFZ_PLACE_CUDA, stream, &a.shard,
                                    &device) < 0 ||
        (slots[SKIP_IF] != NULL && slots[SKIP_IF] != Py_None &&
         device_scalar(module, slots[SKIP_IF], "skip_if", sizeof(int), device, &b, &skip_if) < 0) ||
        (slots[DEVICE_HPARAMS] != NULL && slots[DEVICE_HPARAMS] != Py_None &&
         device_scalar(module, slots[DEVICE_HPARAMS], "device_hparams",
                       sizeof(rlhfz_adamw_hparams), device, &b, &device_hparams) < 0)) {
        rlhfz_borrowed_release(&b);
        return NULL;
    }
    a.skip_if = skip_if;
    a.device_hparams = device_hparams;
    return launch_on(module, "cuda_adamw_step", device, LAUNCHER(launch_adamw), &a, stream, &b);
}

static PyObject *cuda_adamw_step_lowp(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                      PyObject *kwnames)
{
    static const char *const names[] = {
        "master", "exp_avg", "exp_avg_sq", "grad", "param_out", "exp_avg_scale",
        "exp_avg_sq_scale", "lr", "beta1", "beta2", "eps", "weight_decay", "step", "maximize",
        "grad_scale", "rounding", "seed", "index_base", "stream", "skip_if", NULL};
    enum { MASTER, EXP_AVG, EXP_AVG_SQ, GRAD, PARAM_OUT, SCALE, SQ_SCALE, LR, BETA1, BETA2,
           EPS, WD, STEP, MAXIMIZE, GRAD_SCALE, ROUNDING, SEED, INDEX_BASE, STREAM, SKIP_IF,
           NSLOTS };
    PyObject *slots[NSLOTS];
    if (rlhfz_parse_args("cuda_adamw_step_lowp", args, nargs, kwnames, names, 7, 4, slots) < 0)
        return NULL;
    adamw_lowp_launch_args a = {.skip_if = NULL};
    void *stream;
    if (rlhfz_adamw_hparams_from_args("cuda_adamw_step_lowp", slots + LR, &a.hp) < 0 ||
        rlhfz_lowp_rounding_from_args(slots + ROUNDING, slots[STEP], &a.shard) < 0 ||
        rlhfz_arg_stream(slots[STREAM], &stream) < 0)
        return NULL;
    rlhfz_borrowed b = {.count = 0};
    int device;
    void *skip_if = NULL;
    if (rlhfz_adamw_lowp_shard_from_args(module, &b, slots + MASTER, RLHFZ_PLACE_CUDA, stream,
                                         &a.shard, &device) < 0 ||
        (slots[SKIP_IF] != NULL && slots[SKIP_IF] != Py_None &&
         device_scalar(module, slots[SKIP_IF], "skip_if", sizeof(int), device, &b, &skip_if) < 0)) {
        rlhfz_borrowed_release(&b);
        return NULL;
    }
    a.skip_if = skip_if;
    return launch_on(module, "cuda_adamw_step_lowp", device, LAUNCHER(launch_adamw_lowp), &a,
                     stream, &b);
}

static PyObject *cuda_sumsq_workspace_bytes(PyObject *module, PyObject *unused)
{
    if (rlhfz_require_cuda("cuda_sumsq_workspace_bytes") < 0)
        return NULL;
    return PyLong_FromSize_t(sumsq_workspace_bytes());
}

static PyObject *cuda_sumsq(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    static const char *const names[] = {"x", "out", "workspace", "accumulate", "index", "stream",
                                        NULL};
    enum { X, OUT, WORKSPACE, ACCUMULATE, INDEX, STREAM, NSLOTS };
    PyObject *slots[NSLOTS];
    if (rlhfz_parse_args("cuda_sumsq", args, nargs, kwnames, names, 3, 3, slots) < 0)
        return NULL;
    elementwise_launch_args a = {.accumulate = 0};
    void *stream;
    int64_t index = 0;
    if ((slots[ACCUMULATE] != NULL && (a.accumulate = PyObject_IsTrue(slots[ACCUMULATE])) < 0) ||
        (slots[INDEX] != NULL && rlhfz_arg_int64(slots[INDEX], "index", &index) < 0) ||
        rlhfz_arg_stream(slots[STREAM], &stream) < 0)
        return NULL;
    if (index < 0 || (uint64_t)index >= SIZE_MAX / sizeof(double)) {
        PyErr_Format(PyExc_ValueError, "index must be a slot of out, not %lld", (long long)index);
        return NULL;
    }
    rlhfz_borrowed b = {.count = 0};
    rlhfz_array *x = borrow(module, &b, slots[X], "x", 0, stream);
    if (x == NULL)
        return NULL;
    int device = x->device.device_id;
    size_t workspace_bytes = sumsq_workspace_bytes();
    /* out holds a double per index: many sums land in one buffer, read back at once */
    if (device_scalar(module, slots[OUT], "out", ((size_t)index + 1) * sizeof(double), device, &b,
                      &a.scalar) < 0 ||
        device_scalar(module, slots[WORKSPACE], "workspace", workspace_bytes, device, &b,
                      &a.workspace) < 0) {
        rlhfz_borrowed_release(&b);
        return NULL;
    }
    a.scalar = (double *)a.scalar + index;
    if ((char *)a.scalar < (char *)a.workspace + workspace_bytes &&
        (char *)a.workspace < (char *)a.scalar + sizeof(double)) {
        PyErr_SetString(PyExc_ValueError, "out and workspace overlap in memory");
        rlhfz_borrowed_release(&b);
        return NULL;
    }
    a.x = x->data;
    a.dtype = x->dtype;
    a.n = x->numel;
    return launch_on(module, "cuda_sumsq", device, LAUNCHER(launch_sumsq), &a, stream, &b);
}

/* The one array of an in-place elementwise op, and its device scalar. */
static int elementwise_args(PyObject *module, rlhfz_borrowed *b, PyObject *x_obj,
                            const char *x_name, PyObject *scalar_obj, const char *scalar_name, size_t scalar_bytes,
                            void *stream, elementwise_launch_args *a, int *device)
{
    rlhfz_array *x = borrow(module, b, x_obj, x_name, 1, stream);
    if (x == NULL)
        return -1;
    *device = x->device.device_id;
    a->x = x->data;
    a->dtype = x->dtype;
    a->n = x->numel;
    a->scalar = NULL;
    if (scalar_obj != NULL && scalar_obj != Py_None &&
        device_scalar(module, scalar_obj, scalar_name, scalar_bytes, *device, b, &a->scalar) < 0)
        return -1;
    return 0;
}

static PyObject *cuda_unscale_(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    static const char *const names[] = {"g", "inv_scale", "found_inf", "stream", NULL};
    enum { G, INV_SCALE, FOUND_INF, STREAM, NSLOTS };
    PyObject *slots[NSLOTS];
    if (rlhfz_parse_args("cuda_unscale_", args, nargs, kwnames, names, 3, 3, slots) < 0)
        return NULL;
    double inv_scale;
    void *stream;
    if (rlhfz_arg_double(slots[INV_SCALE], "inv_scale", &inv_scale) < 0 ||
        rlhfz_arg_stream(slots[STREAM], &stream) < 0)
        return NULL;
    if (slots[FOUND_INF] == Py_None) {
        PyErr_SetString(PyExc_TypeError, "found_inf must be an rlhfz Buffer in the device tier, not None");
        return NULL;
    }
    rlhfz_borrowed b = {.count = 0};
    elementwise_launch_args a = {.factor = (float)inv_scale};
    int device;
    if (elementwise_args(module, &b, slots[G], "g", slots[FOUND_INF], "found_inf", sizeof(int), stream,
                         &a, &device) < 0) {
        rlhfz_borrowed_release(&b);
        return NULL;
    }
    return launch_on(module, "cuda_unscale_", device, LAUNCHER(launch_unscale), &a, stream, &b);
}

static PyObject *cuda_scale_(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    static const char *const names[] = {"x", "scale", "scale_device", "stream", NULL};
    enum { X, SCALE, SCALE_DEVICE, STREAM, NSLOTS };
    PyObject *slots[NSLOTS];
    if (rlhfz_parse_args("cuda_scale_", args, nargs, kwnames, names, 2, 1, slots) < 0)
        return NULL;
    if (slots[SCALE] == NULL && (slots[SCALE_DEVICE] == NULL || slots[SCALE_DEVICE] == Py_None)) {
        PyErr_SetString(PyExc_TypeError, "cuda_scale_() needs scale or scale_device");
        return NULL;
    }
    double scale = 1.0;
    void *stream;
    if ((slots[SCALE] != NULL && rlhfz_arg_double(slots[SCALE], "scale", &scale) < 0) ||
        rlhfz_arg_stream(slots[STREAM], &stream) < 0)
        return NULL;
    rlhfz_borrowed b = {.count = 0};
    elementwise_launch_args a = {.factor = (float)scale};
    int device;
    if (elementwise_args(module, &b, slots[X], "x", slots[SCALE_DEVICE], "scale_device", sizeof(float),
                         stream, &a, &device) < 0) {
        rlhfz_borrowed_release(&b);
        return NULL;
    }
    return launch_on(module, "cuda_scale_", device, LAUNCHER(launch_scale), &a, stream, &b);
}

static PyObject *cuda_cast_(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    static const char *const names[] = {"dst", "src", "stream", NULL};
    enum { DST, SRC, STREAM, NSLOTS };
    PyObject *slots[NSLOTS];
    if (rlhfz_parse_args("cuda_cast_", args, nargs, kwnames, names, 2, 2, slots) < 0)
        return NULL;
    void *stream;
    if (rlhfz_arg_stream(slots[STREAM], &stream) < 0)
        return NULL;
    rlhfz_borrowed b = {.count = 0};
    rlhfz_array *dst, *src;
    const rlhfz_array *all[2];
    static const char *const all_names[] = {"dst", "src"};
    if ((dst = borrow(module, &b, slots[DST], "dst", 1, stream)) == NULL ||
        (src = borrow(module, &b, slots[SRC], "src", 0, stream)) == NULL ||
        (all[0] = dst, all[1] = src, rlhfz_check_numel(src, "src", dst->numel, "dst") < 0) ||
        rlhfz_check_all_disjoint(all, all_names, 2) < 0 ||
        rlhfz_check_same_device(all, all_names, 2) < 0) {
        rlhfz_borrowed_release(&b);
        return NULL;
    }
    elementwise_launch_args a = {.x = dst->data, .dtype = dst->dtype, .src = src->data,
                                 .src_dtype = src->dtype, .n = dst->numel};
    return launch_on(module, "cuda_cast_", dst->device.device_id, LAUNCHER(launch_cast), &a, stream, &b);
}

/* ---- small transfers of device scalars ---------------------------------------------- */

static rlhfz_Buffer *buffer_arg(PyObject *module, PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, rlhfz_get_state(module)->Buffer_type)) {
        PyErr_Format(PyExc_TypeError, "buffer must be an rlhfz Buffer, not %.200s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return (rlhfz_Buffer *)obj;
}

#ifdef RLHFZ_WITH_CUDA
/* A blocking copy to or from a Buffer, on the Buffer's device when it is
 * device memory (else the current one), after the stream's queued work.
 * Called with the GIL released. */
static rlhfz_status transfer_on(const rlhfz_Buffer *buffer, void *dst, const void *src,
                                size_t nbytes, void *stream)
{
    int device = buffer->device, previous = -1;
    rlhfz_status status = buffer->tier == RLHFZ_TIER_DEVICE ? RLHFZ_OK
                                                            : rlhfz_cuda_get_device(&device);
    if (status == RLHFZ_OK)
        status = rlhfz_device_enter(device, &previous);
    if (status != RLHFZ_OK)
        return status;
    status = rlhfz_cuda_memcpy(dst, src, nbytes, stream, 1);
    return rlhfz_device_leave(device, previous, status);
}
#endif

/* offset and nbytes within a Buffer of `size` bytes. */
static int check_range(Py_ssize_t offset, Py_ssize_t nbytes, size_t size)
{
    if (offset < 0 || nbytes < 0 || (size_t)offset > size || (size_t)nbytes > size - (size_t)offset) {
        PyErr_Format(PyExc_ValueError, "bytes [%zd, %zd + %zd) lie outside the Buffer's %zu",
                     offset, offset, nbytes, size);
        return -1;
    }
    return 0;
}

static PyObject *cuda_fetch(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    static const char *const names[] = {"buffer", "offset", "nbytes", "stream", NULL};
    enum { BUFFER, OFFSET, NBYTES, STREAM, NSLOTS };
    PyObject *slots[NSLOTS];
    if (rlhfz_parse_args("cuda_fetch", args, nargs, kwnames, names, 3, 3, slots) < 0)
        return NULL;
    int64_t offset, nbytes;
    void *stream;
    if (rlhfz_arg_int64(slots[OFFSET], "offset", &offset) < 0 ||
        rlhfz_arg_int64(slots[NBYTES], "nbytes", &nbytes) < 0 ||
        rlhfz_arg_stream(slots[STREAM], &stream) < 0)
        return NULL;
    rlhfz_Buffer *buffer = buffer_arg(module, slots[BUFFER]);
    if (buffer == NULL)
        return NULL;
    if (check_range((Py_ssize_t)offset, (Py_ssize_t)nbytes, buffer->nbytes) < 0 ||
        rlhfz_require_cuda("cuda_fetch") < 0)
        return NULL;
    PyObject *result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)nbytes);
    if (result == NULL)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    rlhfz_status status;
    char *dst = PyBytes_AS_STRING(result);
    const char *src = (const char *)buffer->data + offset;
    /* Queued after the stream's work and waited for: the value is final. */
    Py_BEGIN_ALLOW_THREADS
    status = transfer_on(buffer, dst, src, (size_t)nbytes, stream);
    Py_END_ALLOW_THREADS
    if (rlhfz_raise_status(status, "cuda_fetch") < 0)
        Py_CLEAR(result);
#endif
    return result;
}

static PyObject *cuda_store(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    static const char *const names[] = {"buffer", "offset", "data", "stream", NULL};
    enum { BUFFER, OFFSET, DATA, STREAM, NSLOTS };
    PyObject *slots[NSLOTS];
    if (rlhfz_parse_args("cuda_store", args, nargs, kwnames, names, 3, 3, slots) < 0)
        return NULL;
    int64_t offset;
    void *stream;
    if (rlhfz_arg_int64(slots[OFFSET], "offset", &offset) < 0 ||
        rlhfz_arg_stream(slots[STREAM], &stream) < 0)
        return NULL;
    if (!PyBytes_Check(slots[DATA])) {
        PyErr_Format(PyExc_TypeError, "data must be bytes, not %.200s", Py_TYPE(slots[DATA])->tp_name);
        return NULL;
    }
    rlhfz_Buffer *buffer = buffer_arg(module, slots[BUFFER]);
    if (buffer == NULL)
        return NULL;
    Py_ssize_t nbytes = PyBytes_GET_SIZE(slots[DATA]);
    if (check_range((Py_ssize_t)offset, nbytes, buffer->nbytes) < 0 || rlhfz_require_cuda("cuda_store") < 0)
        return NULL;
#ifdef RLHFZ_WITH_CUDA
    rlhfz_status status;
    const char *src = PyBytes_AS_STRING(slots[DATA]);
    char *dst = (char *)buffer->data + offset;
    /* Blocking: the bytes object may be gone once this returns. */
    Py_BEGIN_ALLOW_THREADS
    status = transfer_on(buffer, dst, src, (size_t)nbytes, stream);
    Py_END_ALLOW_THREADS
    if (rlhfz_raise_status(status, "cuda_store") < 0)
        return NULL;
#endif
    Py_RETURN_NONE;
}

static PyObject *adamw_hparams_bytes(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    static const char *const names[] = {"lr", "beta1", "beta2", "eps", "weight_decay", "step",
                                        "maximize", "grad_scale", NULL};
    PyObject *slots[8];
    if (rlhfz_parse_args("adamw_hparams_bytes", args, nargs, kwnames, names, 0, 0, slots) < 0)
        return NULL;
    rlhfz_adamw_hparams hp;
    if (rlhfz_adamw_hparams_from_args("adamw_hparams_bytes", slots, &hp) < 0)
        return NULL;
    return PyBytes_FromStringAndSize((const char *)&hp, sizeof(hp));
}

PyMethodDef rlhfz_cuda_ops_methods[] = {
    {"cuda_adamw_step", (PyCFunction)(void (*)(void))cuda_adamw_step, METH_FASTCALL | METH_KEYWORDS,
     "cuda_adamw_step(master, exp_avg, exp_avg_sq, grad, param_out=None, *, lr, beta1, beta2,\n"
     "                eps, weight_decay, step, maximize=False, grad_scale=1.0, skip_if=None,\n"
     "                device_hparams=None, stream=None)\n\n"
     "adamw_step on CUDA device arrays, queued on stream (None: the legacy default\n"
     "stream). skip_if: a device Buffer whose first int, if nonzero when the kernel runs,\n"
     "skips the step. device_hparams: a device Buffer holding adamw_hparams_bytes(...),\n"
     "read when the kernel runs instead of the keyword values (for CUDA graph capture)."},
    {"cuda_adamw_step_lowp", (PyCFunction)(void (*)(void))cuda_adamw_step_lowp,
     METH_FASTCALL | METH_KEYWORDS,
     "cuda_adamw_step_lowp(master, exp_avg, exp_avg_sq, grad, param_out=None,\n"
     "                     exp_avg_scale=None, exp_avg_sq_scale=None, *, lr, beta1, beta2,\n"
     "                     eps, weight_decay, step, maximize=False, grad_scale=1.0,\n"
     "                     rounding='nearest', seed=0, index_base=0, stream=None,\n"
     "                     skip_if=None)\n\n"
     "adamw_step_lowp on CUDA device arrays, queued on stream (None: the legacy default\n"
     "stream), with the bits of adamw_step_lowp(..., simd='reference'): bfloat16 moments,\n"
     "or int8 / uint8 codes with one float32 scale per block of 256. skip_if: a device\n"
     "Buffer whose first int, if nonzero when the kernel runs, skips the step. There is no\n"
     "device_hparams: the hyperparameters and the step (which keys stochastic rounding)\n"
     "are the keyword values."},
    {"cuda_sumsq", (PyCFunction)(void (*)(void))cuda_sumsq, METH_FASTCALL | METH_KEYWORDS,
     "cuda_sumsq(x, out, workspace, *, accumulate=False, index=0, stream=None)\n\n"
     "The sum of squares of x, as the double out[index] of the device Buffer out (added\n"
     "to it with accumulate). workspace: a device Buffer of\n"
     "cuda_sumsq_workspace_bytes(). Deterministic; Inf or NaN iff x holds one."},
    {"cuda_sumsq_workspace_bytes", cuda_sumsq_workspace_bytes, METH_NOARGS,
     "cuda_sumsq_workspace_bytes() -> int: the scratch cuda_sumsq needs."},
    {"cuda_unscale_", (PyCFunction)(void (*)(void))cuda_unscale_, METH_FASTCALL | METH_KEYWORDS,
     "cuda_unscale_(g, inv_scale, found_inf, *, stream=None)\n\n"
     "g *= inv_scale in place; sets the int in the device Buffer found_inf to 1 if g held\n"
     "Inf or NaN (it is never cleared here)."},
    {"cuda_scale_", (PyCFunction)(void (*)(void))cuda_scale_, METH_FASTCALL | METH_KEYWORDS,
     "cuda_scale_(x, scale=None, *, scale_device=None, stream=None)\n\n"
     "x *= scale in place; scale_device, a device Buffer holding a float, is read when the\n"
     "kernel runs instead (no host synchronization)."},
    {"cuda_cast_", (PyCFunction)(void (*)(void))cuda_cast_, METH_FASTCALL | METH_KEYWORDS,
     "cuda_cast_(dst, src, *, stream=None): dst = src converted (round to nearest even)."},
    {"cuda_fetch", (PyCFunction)(void (*)(void))cuda_fetch, METH_FASTCALL | METH_KEYWORDS,
     "cuda_fetch(buffer, offset, nbytes, *, stream=None) -> bytes\n\n"
     "Copies bytes of a Buffer to the host after the stream's queued work, and waits."},
    {"cuda_store", (PyCFunction)(void (*)(void))cuda_store, METH_FASTCALL | METH_KEYWORDS,
     "cuda_store(buffer, offset, data, *, stream=None): copies bytes into a Buffer, in\n"
     "stream order, and waits."},
    {"adamw_hparams_bytes", (PyCFunction)(void (*)(void))adamw_hparams_bytes,
     METH_FASTCALL | METH_KEYWORDS,
     "adamw_hparams_bytes(*, lr, beta1, beta2, eps, weight_decay, step, maximize=False,\n"
     "                    grad_scale=1.0) -> bytes: the values the AdamW kernels use, for\n"
     "cuda_adamw_step's device_hparams."},
    {NULL, NULL, 0, NULL},
};
