/* op_args.c: the checks every kernel entry point shares (CPU and CUDA).
 *
 * Arrays are borrowed for one call and released together on every path out;
 * dtypes, element counts, overlap and hyperparameters are checked before any
 * kernel runs, so a refused call changes nothing.
 */
#include "rlhfz_module.h"

#include <math.h>
#include <string.h>

void rlhfz_borrowed_release(rlhfz_borrowed *b)
{
    for (int i = 0; i < b->count; i++)
        rlhfz_array_release(&b->items[i]);
    b->count = 0;
}

rlhfz_array *rlhfz_borrow(PyObject *module, rlhfz_borrowed *b, PyObject *obj, const char *name,
                          int flags, rlhfz_place place, void *stream)
{
    if (b->count >= RLHFZ_MAX_BORROWED) {
        PyErr_SetString(PyExc_SystemError, "rlhfz: too many arrays borrowed in one call");
        return NULL;
    }
    rlhfz_array *array = &b->items[b->count];
    if (rlhfz_array_from_object(rlhfz_get_state(module), obj, name, flags, place, stream,
                                array) < 0)
        return NULL;
    b->count++;
    return array;
}

int rlhfz_check_dtype(const rlhfz_array *a, const char *name, rlhfz_dtype dtype)
{
    if (a->dtype != dtype) {
        PyErr_Format(PyExc_TypeError, "%s must be %s, not %s", name, rlhfz_dtype_name(dtype),
                     rlhfz_dtype_name(a->dtype));
        return -1;
    }
    return 0;
}

int rlhfz_check_numel(const rlhfz_array *a, const char *name, size_t numel, const char *ref)
{
    if (a->numel != numel) {
        PyErr_Format(PyExc_ValueError, "%s has %zu elements but %s has %zu", name, a->numel, ref, numel);
        return -1;
    }
    return 0;
}

/* In-place kernels read and write element by element: two arguments that
 * share memory would see each other's half-written results. */
int rlhfz_check_disjoint(const rlhfz_array *a, const char *name_a, const rlhfz_array *b,
                         const char *name_b)
{
    uintptr_t a0 = (uintptr_t)a->data, a1 = a0 + a->numel * rlhfz_dtype_size(a->dtype);
    uintptr_t b0 = (uintptr_t)b->data, b1 = b0 + b->numel * rlhfz_dtype_size(b->dtype);
    if (a->numel > 0 && b->numel > 0 && a0 < b1 && b0 < a1) {
        PyErr_Format(PyExc_ValueError, "%s and %s overlap in memory", name_a, name_b);
        return -1;
    }
    return 0;
}

int rlhfz_check_all_disjoint(const rlhfz_array *const *arrays, const char *const *names, int count)
{
    for (int i = 0; i < count; i++)
        for (int j = i + 1; j < count; j++)
            if (rlhfz_check_disjoint(arrays[i], names[i], arrays[j], names[j]) < 0)
                return -1;
    return 0;
}

/* Every array of a CUDA call on one device: a kernel runs on one. */
int rlhfz_check_same_device(const rlhfz_array *const *arrays, const char *const *names, int count)
{
    for (int i = 1; i < count; i++) {
        if (arrays[i]->device.device_id != arrays[0]->device.device_id) {
            PyErr_Format(PyExc_ValueError, "%s is on cuda:%d but %s is on cuda:%d", names[i],
                         (int)arrays[i]->device.device_id, names[0],
                         (int)arrays[0]->device.device_id);
            return -1;
        }
    }
    return 0;
}

int rlhfz_adamw_shard_from_args(PyObject *module, rlhfz_borrowed *b, PyObject *const *slots,
                                rlhfz_place place, void *stream, rlhfz_adamw_shard *shard,
                                int *device)
{
    static const char *const names[] = {"master", "exp_avg", "exp_avg_sq", "grad", "param_out"};
    const rlhfz_array *all[5] = {NULL};
    int count = 0;
    for (int i = 0; i < 5; i++) {
        if (i == 4 && (slots[i] == NULL || slots[i] == Py_None))
            break;
        /* grad is the one array the step only reads */
        if ((all[i] = rlhfz_borrow(module, b, slots[i], names[i], i != 3, place, stream)) == NULL)
            return -1;
        count++;
    }
    const rlhfz_array *master = all[0], *grad = all[3], *param_out = all[4];
    for (int i = 0; i < 3; i++)
        if (rlhfz_check_dtype(all[i], names[i], RLHFZ_DTYPE_F32) < 0)
            return -1;
    for (int i = 1; i < count; i++)
        if (rlhfz_check_numel(all[i], names[i], master->numel, "master") < 0)
            return -1;
    if (rlhfz_check_all_disjoint(all, names, count) < 0 ||
        (place == RLHFZ_PLACE_CUDA && rlhfz_check_same_device(all, names, count) < 0))
        return -1;
    *shard = (rlhfz_adamw_shard){
        .master = master->data,
        .exp_avg = all[1]->data,
        .exp_avg_sq = all[2]->data,
        .grad = grad->data,
        .grad_dtype = grad->dtype,
        .param_out = param_out ? param_out->data : NULL,
        .param_dtype = param_out ? param_out->dtype : RLHFZ_DTYPE_F32,
        .n = master->numel,
    };
    *device = master->device.device_id;
    return 0;
}

int rlhfz_adamw_lowp_shard_from_args(PyObject *module, rlhfz_borrowed *b, PyObject *const *slots,
                                     rlhfz_place place, void *stream,
                                     rlhfz_adamw_lowp_shard *shard, int *device)
{
    enum { MASTER, EXP_AVG, EXP_AVG_SQ, GRAD, PARAM_OUT, SCALE, SQ_SCALE, COUNT };
    static const char *const names[] = {"master", "exp_avg", "exp_avg_sq", "grad", "param_out",
                                        "exp_avg_scale", "exp_avg_sq_scale"};
    const rlhfz_array *all[COUNT] = {NULL};
    const char *present[COUNT];
    const rlhfz_array *listed[COUNT];
    int count = 0;
    for (int i = 0; i < COUNT; i++) {
        if (i >= PARAM_OUT && (slots[i] == NULL || slots[i] == Py_None))
            continue;
        int flags = (i == GRAD ? 0 : RLHFZ_BORROW_WRITABLE) |
                    (i == EXP_AVG || i == EXP_AVG_SQ ? RLHFZ_BORROW_CODES : 0);
        if ((all[i] = rlhfz_borrow(module, b, slots[i], names[i], flags, place, stream)) == NULL)
            return -1;
        present[count] = names[i];
        listed[count++] = all[i];
    }
    const rlhfz_array *master = all[MASTER];
    if (rlhfz_check_dtype(master, "master", RLHFZ_DTYPE_F32) < 0)
        return -1;
    for (int i = EXP_AVG; i <= PARAM_OUT; i++)
        if (all[i] && rlhfz_check_numel(all[i], names[i], master->numel, "master") < 0)
            return -1;

    rlhfz_state_dtype state_dtype;
    if (all[EXP_AVG]->dtype == RLHFZ_DTYPE_BF16) {
        state_dtype = RLHFZ_STATE_BF16;
        if (rlhfz_check_dtype(all[EXP_AVG_SQ], "exp_avg_sq", RLHFZ_DTYPE_BF16) < 0)
            return -1;
        if (all[SCALE] || all[SQ_SCALE]) {
            PyErr_SetString(PyExc_ValueError, "bf16 moments take no scales");
            return -1;
        }
    } else if (all[EXP_AVG]->dtype == RLHFZ_DTYPE_I8) {
        state_dtype = RLHFZ_STATE_INT8;
        if (rlhfz_check_dtype(all[EXP_AVG_SQ], "exp_avg_sq", RLHFZ_DTYPE_U8) < 0)
            return -1;
        if (!all[SCALE] || !all[SQ_SCALE]) {
            PyErr_SetString(PyExc_TypeError,
                            "int8 moments need exp_avg_scale and exp_avg_sq_scale");
            return -1;
        }
        size_t blocks = (master->numel + RLHFZ_QBLOCK - 1) / RLHFZ_QBLOCK;
        for (int i = SCALE; i <= SQ_SCALE; i++)
            if (rlhfz_check_dtype(all[i], names[i], RLHFZ_DTYPE_F32) < 0 ||
                rlhfz_check_numel(all[i], names[i], blocks, "the blocks of master") < 0)
                return -1;
    } else {
        PyErr_Format(PyExc_TypeError,
                     "exp_avg must be bfloat16 (bf16 moments) or int8 (int8 codes), not %s",
                     rlhfz_dtype_name(all[EXP_AVG]->dtype));
        return -1;
    }
    if (rlhfz_check_all_disjoint(listed, present, count) < 0 ||
        (place == RLHFZ_PLACE_CUDA && rlhfz_check_same_device(listed, present, count) < 0))
        return -1;
    /* the rounding is rlhfz_lowp_rounding_from_args's, already there */
    *shard = (rlhfz_adamw_lowp_shard){
        .rounding = shard->rounding,
        .rounding_key = shard->rounding_key,
        .index_base = shard->index_base,
        .master = master->data,
        .exp_avg = all[EXP_AVG]->data,
        .exp_avg_sq = all[EXP_AVG_SQ]->data,
        .exp_avg_scale = all[SCALE] ? all[SCALE]->data : NULL,
        .exp_avg_sq_scale = all[SQ_SCALE] ? all[SQ_SCALE]->data : NULL,
        .state_dtype = state_dtype,
        .grad = all[GRAD]->data,
        .grad_dtype = all[GRAD]->dtype,
        .param_out = all[PARAM_OUT] ? all[PARAM_OUT]->data : NULL,
        .param_dtype = all[PARAM_OUT] ? all[PARAM_OUT]->dtype : RLHFZ_DTYPE_F32,
        .n = master->numel,
    };
    *device = master->device.device_id;
    return 0;
}

static int rounding_from_object(PyObject *obj, rlhfz_rounding *rounding)
{
    if (obj == NULL || (PyUnicode_Check(obj) &&
                        PyUnicode_CompareWithASCIIString(obj, "nearest") == 0)) {
        *rounding = RLHFZ_ROUND_NEAREST;
        return 0;
    }
    if (PyUnicode_Check(obj) && PyUnicode_CompareWithASCIIString(obj, "stochastic") == 0) {
        *rounding = RLHFZ_ROUND_STOCHASTIC;
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "rounding must be 'nearest' or 'stochastic', not %R", obj);
    return -1;
}

int rlhfz_lowp_rounding_from_args(PyObject *const *slots, PyObject *step_obj,
                                  rlhfz_adamw_lowp_shard *shard)
{
    rlhfz_rounding rounding;
    /* seed and index_base of stochastic rounding: plain non-negative ints */
    int64_t step, seed = 0, index_base = 0;
    if (rlhfz_arg_int64(step_obj, "step", &step) < 0 ||
        rounding_from_object(slots[0], &rounding) < 0 ||
        (slots[1] && rlhfz_arg_int64(slots[1], "seed", &seed) < 0) ||
        (slots[2] && rlhfz_arg_int64(slots[2], "index_base", &index_base) < 0))
        return -1;
    if (seed < 0 || seed > UINT32_MAX || index_base < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "seed must be in [0, 2**32) and index_base must be >= 0");
        return -1;
    }
    shard->rounding = rounding;
    shard->rounding_key = rlhfz_rounding_key((uint32_t)seed, (uint64_t)step);
    shard->index_base = (uint64_t)index_base;
    return 0;
}

int rlhfz_raise_status(rlhfz_status status, const char *what)
{
    switch (status) {
    case RLHFZ_OK:
        return 0;
    case RLHFZ_ERR_UNSUPPORTED:
        PyErr_Format(PyExc_RuntimeError, "%s: not supported by this CPU or build (best SIMD level: %s)",
                     what, rlhfz_simd_name(rlhfz_simd_detect()));
        return -1;
    case RLHFZ_ERR_NOMEM:
        PyErr_Format(PyExc_MemoryError, "%s: out of memory", what);
        return -1;
    case RLHFZ_ERR_THREADS:
        PyErr_Format(PyExc_RuntimeError, "%s: the CPU thread pool could not be started", what);
        return -1;
    case RLHFZ_ERR_CUDA:
        return rlhfz_raise_cuda(what);
    default:
        PyErr_Format(PyExc_RuntimeError, "%s: kernel rejected its arguments (status %d)", what, (int)status);
        return -1;
    }
}

static int check_hparam(double value, const char *name, double lo, double hi, int hi_open)
{
    if (!isfinite(value) || value < lo || (hi_open ? value >= hi : value > hi)) {
        char text[160];
        snprintf(text, sizeof(text), "invalid %s: %g (expected a finite value in [%g, %g%s)",
                 name, value, lo, hi, hi_open ? ")" : "]");
        PyErr_SetString(PyExc_ValueError, text);
        return -1;
    }
    return 0;
}

int rlhfz_adamw_hparams_from_args(const char *func, PyObject *const *slots, rlhfz_adamw_hparams *hp)
{
    static const char *const names[] = {"lr", "beta1", "beta2", "eps", "weight_decay", "step"};
    for (int i = 0; i < 6; i++) {
        if (slots[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", func, names[i]);
            return -1;
        }
    }
    double lr, beta1, beta2, eps, weight_decay, grad_scale = 1.0;
    int64_t step;
    int maximize = 0;
    if (rlhfz_arg_double(slots[0], "lr", &lr) < 0 ||
        rlhfz_arg_double(slots[1], "beta1", &beta1) < 0 ||
        rlhfz_arg_double(slots[2], "beta2", &beta2) < 0 ||
        rlhfz_arg_double(slots[3], "eps", &eps) < 0 ||
        rlhfz_arg_double(slots[4], "weight_decay", &weight_decay) < 0 ||
        rlhfz_arg_int64(slots[5], "step", &step) < 0)
        return -1;
    if (slots[7] != NULL && rlhfz_arg_double(slots[7], "grad_scale", &grad_scale) < 0)
        return -1;
    if (slots[6] != NULL && (maximize = PyObject_IsTrue(slots[6])) < 0)
        return -1;
    if (check_hparam(lr, "lr", 0.0, INFINITY, 0) < 0 ||
        check_hparam(beta1, "beta1", 0.0, 1.0, 1) < 0 ||
        check_hparam(beta2, "beta2", 0.0, 1.0, 1) < 0 ||
        check_hparam(eps, "eps", 0.0, INFINITY, 0) < 0 ||
        check_hparam(weight_decay, "weight_decay", 0.0, INFINITY, 0) < 0 ||
        check_hparam(grad_scale, "grad_scale", -INFINITY, INFINITY, 0) < 0)
        return -1;
    if (step < 1) {
        PyErr_Format(PyExc_ValueError, "step must be >= 1 (the step being taken), not %lld", (long long)step);
        return -1;
    }
    /* Bias corrections once, in double, for the step being taken. */
    double bias_correction1 = 1.0 - pow(beta1, (double)step);
    double bias_correction2 = 1.0 - pow(beta2, (double)step);
    /* Derived in double and rounded once, as torch does with Python floats. */
    memset(hp, 0, sizeof(*hp));
    hp->decay = (float)(1.0 - lr * weight_decay);
    hp->beta1_weight = (float)(1.0 - beta1);
    hp->beta2 = (float)beta2;
    hp->beta2_weight = (float)(1.0 - beta2);
    hp->eps = (float)eps;
    hp->step_size = (float)(lr / bias_correction1);
    hp->bias_correction2_rsqrt = (float)(1.0 / sqrt(bias_correction2));
    hp->grad_scale = (float)grad_scale;
    hp->maximize = maximize;
    return 0;
}
