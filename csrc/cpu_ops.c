/* cpu_ops.c: Python entry points of the CPU kernels.
 *
 * Each one borrows its arrays (rlhfz views directly, anything else through
 * DLPack), checks dtypes, sizes, aliasing and hyperparameters, then runs the
 * kernel with the GIL released. No math here.
 */
#include "rlhfz_module.h"

#include <math.h>
#include <string.h>

#define MAX_ARRAYS 5

/* Borrowed arrays of one call, released together on every path out. */
typedef struct {
    rlhfz_array items[MAX_ARRAYS];
    int count;
} borrowed;

static void borrowed_release(borrowed *b)
{
    for (int i = 0; i < b->count; i++)
        rlhfz_array_release(&b->items[i]);
    b->count = 0;
}

static rlhfz_array *borrow(PyObject *module, borrowed *b, PyObject *obj, const char *name, int writable)
{
    rlhfz_array *array = &b->items[b->count];
    if (rlhfz_array_from_object(rlhfz_get_state(module), obj, name, writable, array) < 0)
        return NULL;
    b->count++;
    return array;
}

static int check_dtype(const rlhfz_array *a, const char *name, rlhfz_dtype dtype)
{
    if (a->dtype != dtype) {
        PyErr_Format(PyExc_TypeError, "%s must be %s, not %s", name, rlhfz_dtype_name(dtype),
                     rlhfz_dtype_name(a->dtype));
        return -1;
    }
    return 0;
}

static int check_numel(const rlhfz_array *a, const char *name, size_t numel, const char *ref)
{
    if (a->numel != numel) {
        PyErr_Format(PyExc_ValueError, "%s has %zu elements but %s has %zu", name, a->numel, ref, numel);
        return -1;
    }
    return 0;
}

/* In-place kernels read and write element by element: two arguments that
 * share memory would see each other's half-written results. */
static int check_disjoint(const rlhfz_array *a, const char *name_a, const rlhfz_array *b, const char *name_b)
{
    uintptr_t a0 = (uintptr_t)a->data, a1 = a0 + a->numel * rlhfz_dtype_size(a->dtype);
    uintptr_t b0 = (uintptr_t)b->data, b1 = b0 + b->numel * rlhfz_dtype_size(b->dtype);
    if (a->numel > 0 && b->numel > 0 && a0 < b1 && b0 < a1) {
        PyErr_Format(PyExc_ValueError, "%s and %s overlap in memory", name_a, name_b);
        return -1;
    }
    return 0;
}

static int simd_from_object(PyObject *obj, rlhfz_simd_level *level, int *reference)
{
    *reference = 0;
    *level = RLHFZ_SIMD_BEST;
    if (obj == NULL || obj == Py_None)
        return 0;
    static const struct { const char *name; rlhfz_simd_level level; } levels[] = {
        {"scalar", RLHFZ_SIMD_SCALAR}, {"avx2", RLHFZ_SIMD_AVX2}, {"avx512", RLHFZ_SIMD_AVX512},
    };
    if (PyUnicode_Check(obj)) {
        if (PyUnicode_CompareWithASCIIString(obj, "reference") == 0) {
            *reference = 1;
            return 0;
        }
        for (size_t i = 0; i < sizeof(levels) / sizeof(levels[0]); i++) {
            if (PyUnicode_CompareWithASCIIString(obj, levels[i].name) == 0) {
                *level = levels[i].level;
                return 0;
            }
        }
    }
    PyErr_Format(PyExc_ValueError,
                 "simd must be None, 'reference', 'scalar', 'avx2' or 'avx512', not %R", obj);
    return -1;
}

static int raise_status(rlhfz_status status, const char *what)
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

static PyObject *adamw_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {
        "master", "exp_avg", "exp_avg_sq", "grad", "param_out",
        "lr", "beta1", "beta2", "eps", "weight_decay", "step", "maximize", "grad_scale", "simd", NULL};
    enum { MASTER, EXP_AVG, EXP_AVG_SQ, GRAD, PARAM_OUT, LR, BETA1, BETA2, EPS, WD, STEP,
           MAXIMIZE, GRAD_SCALE, SIMD, NSLOTS };
    PyObject *slots[NSLOTS];
    if (rlhfz_parse_args("adamw_step", args, nargs, kwnames, names, 5, 4, slots) < 0)
        return NULL;
    static const int required_kw[] = {LR, BETA1, BETA2, EPS, WD, STEP};
    for (size_t i = 0; i < sizeof(required_kw) / sizeof(required_kw[0]); i++) {
        if (slots[required_kw[i]] == NULL) {
            PyErr_Format(PyExc_TypeError, "adamw_step() missing required argument '%s'",
                         names[required_kw[i]]);
            return NULL;
        }
    }
    double lr, beta1, beta2, eps, weight_decay, grad_scale = 1.0;
    int64_t step;
    int maximize = 0;
    if (rlhfz_arg_double(slots[LR], "lr", &lr) < 0 ||
        rlhfz_arg_double(slots[BETA1], "beta1", &beta1) < 0 ||
        rlhfz_arg_double(slots[BETA2], "beta2", &beta2) < 0 ||
        rlhfz_arg_double(slots[EPS], "eps", &eps) < 0 ||
        rlhfz_arg_double(slots[WD], "weight_decay", &weight_decay) < 0 ||
        rlhfz_arg_int64(slots[STEP], "step", &step) < 0)
        return NULL;
    if (slots[GRAD_SCALE] != NULL && rlhfz_arg_double(slots[GRAD_SCALE], "grad_scale", &grad_scale) < 0)
        return NULL;
    if (slots[MAXIMIZE] != NULL && (maximize = PyObject_IsTrue(slots[MAXIMIZE])) < 0)
        return NULL;
    if (check_hparam(lr, "lr", 0.0, INFINITY, 0) < 0 ||
        check_hparam(beta1, "beta1", 0.0, 1.0, 1) < 0 ||
        check_hparam(beta2, "beta2", 0.0, 1.0, 1) < 0 ||
        check_hparam(eps, "eps", 0.0, INFINITY, 0) < 0 ||
        check_hparam(weight_decay, "weight_decay", 0.0, INFINITY, 0) < 0 ||
        check_hparam(grad_scale, "grad_scale", -INFINITY, INFINITY, 0) < 0)
        return NULL;
    if (step < 1) {
        PyErr_Format(PyExc_ValueError, "step must be >= 1 (the step being taken), not %lld", (long long)step);
        return NULL;
    }
    rlhfz_simd_level level;
    int reference;
    if (simd_from_object(slots[SIMD], &level, &reference) < 0)
        return NULL;

    borrowed b = {.count = 0};
    rlhfz_array *master, *exp_avg, *exp_avg_sq, *grad, *param_out = NULL;
    if ((master = borrow(module, &b, slots[MASTER], "master", 1)) == NULL ||
        (exp_avg = borrow(module, &b, slots[EXP_AVG], "exp_avg", 1)) == NULL ||
        (exp_avg_sq = borrow(module, &b, slots[EXP_AVG_SQ], "exp_avg_sq", 1)) == NULL ||
        (grad = borrow(module, &b, slots[GRAD], "grad", 0)) == NULL)
        goto error;
    if (slots[PARAM_OUT] != NULL && slots[PARAM_OUT] != Py_None &&
        (param_out = borrow(module, &b, slots[PARAM_OUT], "param_out", 1)) == NULL)
        goto error;
    if (check_dtype(master, "master", RLHFZ_DTYPE_F32) < 0 ||
        check_dtype(exp_avg, "exp_avg", RLHFZ_DTYPE_F32) < 0 ||
        check_dtype(exp_avg_sq, "exp_avg_sq", RLHFZ_DTYPE_F32) < 0 ||
        check_numel(exp_avg, "exp_avg", master->numel, "master") < 0 ||
        check_numel(exp_avg_sq, "exp_avg_sq", master->numel, "master") < 0 ||
        check_numel(grad, "grad", master->numel, "master") < 0 ||
        (param_out && check_numel(param_out, "param_out", master->numel, "master") < 0))
        goto error;
    {
        const rlhfz_array *all[] = {master, exp_avg, exp_avg_sq, grad, param_out};
        static const char *const all_names[] = {"master", "exp_avg", "exp_avg_sq", "grad", "param_out"};
        int count = param_out ? 5 : 4;
        for (int i = 0; i < count; i++)
            for (int j = i + 1; j < count; j++)
                if (check_disjoint(all[i], all_names[i], all[j], all_names[j]) < 0)
                    goto error;
    }

    /* Bias corrections once, in double, for the step being taken. */
    double bias_correction1 = 1.0 - pow(beta1, (double)step);
    double bias_correction2 = 1.0 - pow(beta2, (double)step);
    /* Derived in double and rounded once, as torch does with Python floats. */
    rlhfz_adamw_hparams hp = {
        .decay = (float)(1.0 - lr * weight_decay),
        .beta1_weight = (float)(1.0 - beta1),
        .beta2 = (float)beta2,
        .beta2_weight = (float)(1.0 - beta2),
        .eps = (float)eps,
        .step_size = (float)(lr / bias_correction1),
        .bias_correction2_sqrt = (float)sqrt(bias_correction2),
        .grad_scale = (float)grad_scale,
        .maximize = maximize,
    };
    rlhfz_adamw_shard shard = {
        .master = master->data,
        .exp_avg = exp_avg->data,
        .exp_avg_sq = exp_avg_sq->data,
        .grad = grad->data,
        .grad_dtype = grad->dtype,
        .param_out = param_out ? param_out->data : NULL,
        .param_dtype = param_out ? param_out->dtype : RLHFZ_DTYPE_F32,
        .n = master->numel,
    };
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = reference ? rlhfz_adamw_reference(&shard, &hp) : rlhfz_adamw_cpu(&shard, &hp, level);
    Py_END_ALLOW_THREADS
    borrowed_release(&b);
    if (raise_status(status, "adamw_step") < 0)
        return NULL;
    Py_RETURN_NONE;
error:
    borrowed_release(&b);
    return NULL;
}

static PyObject *sumsq(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"x", NULL};
    PyObject *slots[1];
    if (rlhfz_parse_args("sumsq", args, nargs, kwnames, names, 1, 1, slots) < 0)
        return NULL;
    borrowed b = {.count = 0};
    rlhfz_array *x = borrow(module, &b, slots[0], "x", 0);
    if (x == NULL)
        return NULL;
    double result = 0.0;
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_sumsq_cpu(x->data, x->dtype, x->numel, &result);
    Py_END_ALLOW_THREADS
    borrowed_release(&b);
    if (raise_status(status, "sumsq") < 0)
        return NULL;
    return PyFloat_FromDouble(result);
}

static PyObject *scale_(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"x", "scale", NULL};
    PyObject *slots[2];
    if (rlhfz_parse_args("scale_", args, nargs, kwnames, names, 2, 2, slots) < 0)
        return NULL;
    double scale;
    if (rlhfz_arg_double(slots[1], "scale", &scale) < 0)
        return NULL;
    borrowed b = {.count = 0};
    rlhfz_array *x = borrow(module, &b, slots[0], "x", 1);
    if (x == NULL)
        return NULL;
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_scale_cpu(x->data, x->dtype, x->numel, (float)scale);
    Py_END_ALLOW_THREADS
    borrowed_release(&b);
    if (raise_status(status, "scale_") < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *cast_(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"dst", "src", NULL};
    PyObject *slots[2];
    if (rlhfz_parse_args("cast_", args, nargs, kwnames, names, 2, 2, slots) < 0)
        return NULL;
    borrowed b = {.count = 0};
    rlhfz_array *dst, *src;
    if ((dst = borrow(module, &b, slots[0], "dst", 1)) == NULL ||
        (src = borrow(module, &b, slots[1], "src", 0)) == NULL ||
        check_numel(src, "src", dst->numel, "dst") < 0 ||
        check_disjoint(dst, "dst", src, "src") < 0) {
        borrowed_release(&b);
        return NULL;
    }
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_cast_cpu(src->data, src->dtype, dst->data, dst->dtype, dst->numel);
    Py_END_ALLOW_THREADS
    borrowed_release(&b);
    if (raise_status(status, "cast_") < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *adamw_traffic_bound(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames)
{
    static const char *const names[] = {"p", "g", "m", "v", NULL};
    PyObject *slots[4];
    if (rlhfz_parse_args("adamw_traffic_bound", args, nargs, kwnames, names, 4, 4, slots) < 0)
        return NULL;
    borrowed b = {.count = 0};
    rlhfz_array *p, *g, *m, *v;
    if ((p = borrow(module, &b, slots[0], "p", 1)) == NULL ||
        (g = borrow(module, &b, slots[1], "g", 0)) == NULL ||
        (m = borrow(module, &b, slots[2], "m", 1)) == NULL ||
        (v = borrow(module, &b, slots[3], "v", 1)) == NULL ||
        check_dtype(p, "p", RLHFZ_DTYPE_F32) < 0 || check_dtype(g, "g", RLHFZ_DTYPE_F32) < 0 ||
        check_dtype(m, "m", RLHFZ_DTYPE_F32) < 0 || check_dtype(v, "v", RLHFZ_DTYPE_F32) < 0 ||
        check_numel(g, "g", p->numel, "p") < 0 || check_numel(m, "m", p->numel, "p") < 0 ||
        check_numel(v, "v", p->numel, "p") < 0 ||
        check_disjoint(p, "p", m, "m") < 0 || check_disjoint(p, "p", v, "v") < 0 ||
        check_disjoint(m, "m", v, "v") < 0 || check_disjoint(g, "g", p, "p") < 0 ||
        check_disjoint(g, "g", m, "m") < 0 || check_disjoint(g, "g", v, "v") < 0) {
        borrowed_release(&b);
        return NULL;
    }
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_adamw_traffic_bound_cpu(p->data, g->data, m->data, v->data, p->numel);
    Py_END_ALLOW_THREADS
    borrowed_release(&b);
    if (raise_status(status, "adamw_traffic_bound") < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyMethodDef rlhfz_cpu_ops_methods[] = {
    {"adamw_step", (PyCFunction)(void (*)(void))adamw_step, METH_FASTCALL | METH_KEYWORDS,
     "adamw_step(master, exp_avg, exp_avg_sq, grad, param_out=None, *, lr, beta1, beta2, eps,\n"
     "           weight_decay, step, maximize=False, grad_scale=1.0, simd=None)\n\n"
     "One AdamW step over a flat fp32 shard, in place. grad may be float32, bfloat16 or\n"
     "float16; param_out, if given, receives the new values in its own dtype. step is the\n"
     "step being taken (1 for the first). simd: None (best), 'reference', 'scalar', 'avx2',\n"
     "'avx512'."},
    {"sumsq", (PyCFunction)(void (*)(void))sumsq, METH_FASTCALL | METH_KEYWORDS,
     "sumsq(x) -> float: sum of squares in double; Inf or NaN iff x holds one."},
    {"scale_", (PyCFunction)(void (*)(void))scale_, METH_FASTCALL | METH_KEYWORDS,
     "scale_(x, scale): x *= scale in place."},
    {"cast_", (PyCFunction)(void (*)(void))cast_, METH_FASTCALL | METH_KEYWORDS,
     "cast_(dst, src): copy src into dst, converting dtype (round to nearest even)."},
    {"adamw_traffic_bound", (PyCFunction)(void (*)(void))adamw_traffic_bound,
     METH_FASTCALL | METH_KEYWORDS,
     "adamw_traffic_bound(p, g, m, v): AdamW's memory traffic with trivial arithmetic;\n"
     "the bandwidth ceiling of an AdamW step on this machine."},
    {NULL, NULL, 0, NULL},
};
