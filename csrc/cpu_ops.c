/* cpu_ops.c: Python entry points of the CPU kernels.
 *
 * Each one borrows its arrays (rlhfz views directly, anything else through
 * DLPack), checks dtypes, sizes, aliasing and hyperparameters, then runs the
 * kernel with the GIL released. No math here.
 */
#include "rlhfz_module.h"

#include <math.h>
#include <string.h>

/* CPU kernels take host memory; their arrays need no stream. */
static rlhfz_array *borrow(PyObject *module, rlhfz_borrowed *b, PyObject *obj, const char *name,
                           int writable)
{
    return rlhfz_borrow(module, b, obj, name, writable, RLHFZ_PLACE_HOST, NULL);
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
    rlhfz_adamw_hparams hp;
    if (rlhfz_adamw_hparams_from_args("adamw_step", slots + LR, &hp) < 0)
        return NULL;
    rlhfz_simd_level level;
    int reference;
    if (simd_from_object(slots[SIMD], &level, &reference) < 0)
        return NULL;

    rlhfz_borrowed b = {.count = 0};
    rlhfz_adamw_shard shard;
    int device;
    if (rlhfz_adamw_shard_from_args(module, &b, slots + MASTER, RLHFZ_PLACE_HOST, NULL, &shard,
                                    &device) < 0)
        goto error;
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = reference ? rlhfz_adamw_reference(&shard, &hp) : rlhfz_adamw_cpu(&shard, &hp, level);
    Py_END_ALLOW_THREADS
    rlhfz_borrowed_release(&b);
    if (rlhfz_raise_status(status, "adamw_step") < 0)
        return NULL;
    Py_RETURN_NONE;
error:
    rlhfz_borrowed_release(&b);
    return NULL;
}

static PyObject *adamw_step_lowp(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames)
{
    static const char *const names[] = {
        "master", "exp_avg", "exp_avg_sq", "grad", "param_out", "exp_avg_scale",
        "exp_avg_sq_scale", "lr", "beta1", "beta2", "eps", "weight_decay", "step", "maximize",
        "grad_scale", "rounding", "seed", "index_base", "simd", NULL};
    enum { MASTER, EXP_AVG, EXP_AVG_SQ, GRAD, PARAM_OUT, SCALE, SQ_SCALE, LR, BETA1, BETA2,
           EPS, WD, STEP, MAXIMIZE, GRAD_SCALE, ROUNDING, SEED, INDEX_BASE, SIMD, NSLOTS };
    PyObject *slots[NSLOTS];
    if (rlhfz_parse_args("adamw_step_lowp", args, nargs, kwnames, names, 7, 4, slots) < 0)
        return NULL;
    rlhfz_adamw_hparams hp;
    if (rlhfz_adamw_hparams_from_args("adamw_step_lowp", slots + LR, &hp) < 0)
        return NULL;
    rlhfz_adamw_lowp_shard shard;
    rlhfz_simd_level level;
    int reference;
    if (rlhfz_lowp_rounding_from_args(slots + ROUNDING, slots[STEP], &shard) < 0 ||
        simd_from_object(slots[SIMD], &level, &reference) < 0)
        return NULL;

    rlhfz_borrowed b = {.count = 0};
    int device;
    if (rlhfz_adamw_lowp_shard_from_args(module, &b, slots + MASTER, RLHFZ_PLACE_HOST, NULL,
                                         &shard, &device) < 0)
        goto error;
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = reference ? rlhfz_adamw_lowp_reference(&shard, &hp)
                       : rlhfz_adamw_lowp_cpu(&shard, &hp, level);
    Py_END_ALLOW_THREADS
    rlhfz_borrowed_release(&b);
    if (rlhfz_raise_status(status, "adamw_step_lowp") < 0)
        return NULL;
    Py_RETURN_NONE;
error:
    rlhfz_borrowed_release(&b);
    return NULL;
}

static PyObject *sumsq(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"x", NULL};
    PyObject *slots[1];
    if (rlhfz_parse_args("sumsq", args, nargs, kwnames, names, 1, 1, slots) < 0)
        return NULL;
    rlhfz_borrowed b = {.count = 0};
    rlhfz_array *x = borrow(module, &b, slots[0], "x", 0);
    if (x == NULL)
        return NULL;
    double result = 0.0;
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_sumsq_cpu(x->data, x->dtype, x->numel, &result);
    Py_END_ALLOW_THREADS
    rlhfz_borrowed_release(&b);
    if (rlhfz_raise_status(status, "sumsq") < 0)
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
    rlhfz_borrowed b = {.count = 0};
    rlhfz_array *x = borrow(module, &b, slots[0], "x", 1);
    if (x == NULL)
        return NULL;
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_scale_cpu(x->data, x->dtype, x->numel, (float)scale);
    Py_END_ALLOW_THREADS
    rlhfz_borrowed_release(&b);
    if (rlhfz_raise_status(status, "scale_") < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *cast_(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    static const char *const names[] = {"dst", "src", NULL};
    PyObject *slots[2];
    if (rlhfz_parse_args("cast_", args, nargs, kwnames, names, 2, 2, slots) < 0)
        return NULL;
    rlhfz_borrowed b = {.count = 0};
    rlhfz_array *dst, *src;
    if ((dst = borrow(module, &b, slots[0], "dst", 1)) == NULL ||
        (src = borrow(module, &b, slots[1], "src", 0)) == NULL ||
        rlhfz_check_numel(src, "src", dst->numel, "dst") < 0 ||
        rlhfz_check_disjoint(dst, "dst", src, "src") < 0) {
        rlhfz_borrowed_release(&b);
        return NULL;
    }
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_cast_cpu(src->data, src->dtype, dst->data, dst->dtype, dst->numel);
    Py_END_ALLOW_THREADS
    rlhfz_borrowed_release(&b);
    if (rlhfz_raise_status(status, "cast_") < 0)
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
    rlhfz_borrowed b = {.count = 0};
    rlhfz_array *p, *g, *m, *v;
    /* moments of any width: 1-byte ones stand for int8 codes */
    int moments = RLHFZ_BORROW_WRITABLE | RLHFZ_BORROW_CODES;
    if ((p = borrow(module, &b, slots[0], "p", 1)) == NULL ||
        (g = borrow(module, &b, slots[1], "g", 0)) == NULL ||
        (m = rlhfz_borrow(module, &b, slots[2], "m", moments, RLHFZ_PLACE_HOST, NULL)) == NULL ||
        (v = rlhfz_borrow(module, &b, slots[3], "v", moments, RLHFZ_PLACE_HOST, NULL)) == NULL ||
        rlhfz_check_dtype(p, "p", RLHFZ_DTYPE_F32) < 0 ||
        rlhfz_check_dtype(g, "g", RLHFZ_DTYPE_F32) < 0 || rlhfz_check_dtype(v, "v", m->dtype) < 0 ||
        rlhfz_check_numel(g, "g", p->numel, "p") < 0 || rlhfz_check_numel(m, "m", p->numel, "p") < 0 ||
        rlhfz_check_numel(v, "v", p->numel, "p") < 0 ||
        rlhfz_check_disjoint(p, "p", m, "m") < 0 || rlhfz_check_disjoint(p, "p", v, "v") < 0 ||
        rlhfz_check_disjoint(m, "m", v, "v") < 0 || rlhfz_check_disjoint(g, "g", p, "p") < 0 ||
        rlhfz_check_disjoint(g, "g", m, "m") < 0 || rlhfz_check_disjoint(g, "g", v, "v") < 0) {
        rlhfz_borrowed_release(&b);
        return NULL;
    }
    rlhfz_status status;
    Py_BEGIN_ALLOW_THREADS
    status = rlhfz_adamw_traffic_bound_cpu(p->data, g->data, m->data, v->data,
                                           rlhfz_dtype_size(m->dtype), p->numel);
    Py_END_ALLOW_THREADS
    rlhfz_borrowed_release(&b);
    if (rlhfz_raise_status(status, "adamw_traffic_bound") < 0)
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
    {"adamw_step_lowp", (PyCFunction)(void (*)(void))adamw_step_lowp,
     METH_FASTCALL | METH_KEYWORDS,
     "adamw_step_lowp(master, exp_avg, exp_avg_sq, grad, param_out=None, exp_avg_scale=None,\n"
     "                exp_avg_sq_scale=None, *, lr, beta1, beta2, eps, weight_decay, step,\n"
     "                maximize=False, grad_scale=1.0, rounding='nearest', seed=0,\n"
     "                index_base=0, simd=None)\n\n"
     "One AdamW step over a flat shard whose moments are low precision, in place: bfloat16\n"
     "exp_avg and exp_avg_sq, or int8 / uint8 codes with one float32 scale per block of 256\n"
     "for each. rounding 'stochastic' rounds exp_avg_sq from a hash of (seed, step,\n"
     "index_base + i); exp_avg rounds to nearest under either."},
    {"sumsq", (PyCFunction)(void (*)(void))sumsq, METH_FASTCALL | METH_KEYWORDS,
     "sumsq(x) -> float: sum of squares in double; Inf or NaN iff x holds one."},
    {"scale_", (PyCFunction)(void (*)(void))scale_, METH_FASTCALL | METH_KEYWORDS,
     "scale_(x, scale): x *= scale in place."},
    {"cast_", (PyCFunction)(void (*)(void))cast_, METH_FASTCALL | METH_KEYWORDS,
     "cast_(dst, src): copy src into dst, converting dtype (round to nearest even)."},
    {"adamw_traffic_bound", (PyCFunction)(void (*)(void))adamw_traffic_bound,
     METH_FASTCALL | METH_KEYWORDS,
     "adamw_traffic_bound(p, g, m, v): AdamW's memory traffic with trivial arithmetic;\n"
     "the bandwidth ceiling of an AdamW step on this machine. p and g are float32; m and\n"
     "v share a dtype of 4, 2 or 1 bytes, the moments' width (their bits only move)."},
    {NULL, NULL, 0, NULL},
};
