/* dtypes.c: the element types rlhfz takes, in one table: the name rlhfz
 * uses, torch's name for it, the kernels' enum and the DLPack type.
 *
 * Everything that turns a dtype into text, a DLPack type or back reads this
 * table, so adding a type is one line here (and the kernels for it). */
#include "rlhfz_module.h"

static const struct {
    const char *name;
    const char *alias;           /* str(torch.<dtype>), accepted without importing torch */
    rlhfz_dtype dtype;
    DLDataType dl;
    int codes;                   /* moment codes: taken only where a borrow asks for them */
} dtype_table[] = {
    {"float32", "torch.float32", RLHFZ_DTYPE_F32, {kDLFloat, 32, 1}, 0},
    {"bfloat16", "torch.bfloat16", RLHFZ_DTYPE_BF16, {kDLBfloat, 16, 1}, 0},
    {"float16", "torch.float16", RLHFZ_DTYPE_F16, {kDLFloat, 16, 1}, 0},
    {"int8", "torch.int8", RLHFZ_DTYPE_I8, {kDLInt, 8, 1}, 1},
    {"uint8", "torch.uint8", RLHFZ_DTYPE_U8, {kDLUInt, 8, 1}, 1},
};

#define DTYPE_COUNT (sizeof(dtype_table) / sizeof(dtype_table[0]))

const char *rlhfz_dtype_name(rlhfz_dtype dtype)
{
    for (size_t i = 0; i < DTYPE_COUNT; i++)
        if (dtype_table[i].dtype == dtype)
            return dtype_table[i].name;
    return "unknown";
}

int rlhfz_dtype_from_object(PyObject *obj, rlhfz_dtype *out)
{
    /* Accept "float32" and also torch dtypes (by their str), without importing torch. */
    PyObject *text = PyUnicode_Check(obj) ? Py_NewRef(obj) : PyObject_Str(obj);
    if (text == NULL)
        return -1;
    for (size_t i = 0; i < DTYPE_COUNT; i++) {
        if (PyUnicode_CompareWithASCIIString(text, dtype_table[i].name) == 0 ||
            PyUnicode_CompareWithASCIIString(text, dtype_table[i].alias) == 0) {
            *out = dtype_table[i].dtype;
            Py_DECREF(text);
            return 0;
        }
    }
    PyErr_Format(PyExc_TypeError, "unsupported dtype %R: expected float32, bfloat16 or "
                 "float16 (or int8 / uint8 for the codes of int8 moments)", text);
    Py_DECREF(text);
    return -1;
}

int rlhfz_dtype_is_codes(rlhfz_dtype dtype)
{
    for (size_t i = 0; i < DTYPE_COUNT; i++)
        if (dtype_table[i].dtype == dtype)
            return dtype_table[i].codes;
    return 0;
}

DLDataType rlhfz_dtype_to_dl(rlhfz_dtype dtype)
{
    for (size_t i = 0; i < DTYPE_COUNT; i++)
        if (dtype_table[i].dtype == dtype)
            return dtype_table[i].dl;
    return dtype_table[0].dl;    /* unreachable: every rlhfz_dtype is in the table */
}

int rlhfz_dtype_from_dl(DLDataType dl, int codes, rlhfz_dtype *out)
{
    for (size_t i = 0; i < DTYPE_COUNT; i++) {
        DLDataType known = dtype_table[i].dl;
        if (dtype_table[i].codes && !codes)
            continue;
        if (dl.code == known.code && dl.bits == known.bits && dl.lanes == known.lanes) {
            *out = dtype_table[i].dtype;
            return 0;
        }
    }
    return -1;
}
