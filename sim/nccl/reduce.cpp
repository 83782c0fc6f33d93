/* reduce.cpp: the element math of the stand-in's reductions.
 *
 * One fold per (type, op): dest starts as rank 0's input and takes in the
 * ranks 1, 2, ... in order, each step rounded to the element type (binary16
 * and bfloat16 through fp32, round to nearest even, with the simulated
 * runtime's conversions), so the result is the same on every rank and in
 * every run. Avg follows NCCL: for floating types each input is first
 * multiplied by 1/nranks rounded to the type (a premultiplied sum); for
 * integer types the sum is divided at the end. Integer sums and products
 * wrap; max and min of floats propagate NaN.
 */
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "internal.h"

namespace ncclsim {

namespace {

/* ---- element types: how a stored element becomes a value and back ------------------------ */

struct Float32 {
    using Stored = float;
    using Value = float;
    static Value load(Stored x) { return x; }
    static Stored store(Value x) { return x; }
};

struct Float64 {
    using Stored = double;
    using Value = double;
    static Value load(Stored x) { return x; }
    static Stored store(Value x) { return x; }
};

struct Float16 {
    using Stored = std::uint16_t;
    using Value = float;
    static Value load(Stored x) { return __half2float(__ushort_as_half(x)); }
    static Stored store(Value x) { return __half_as_ushort(__float2half_rn(x)); }
};

struct Bfloat16 {
    using Stored = std::uint16_t;
    using Value = float;
    static Value load(Stored x) { return __bfloat162float(__ushort_as_bfloat16(x)); }
    static Stored store(Value x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
};

template <class T>
struct Integer {
    using Stored = T;
    using Value = T;
    static Value load(Stored x) { return x; }
    static Stored store(Value x) { return x; }
};

/* ---- the binary operations -------------------------------------------------------------- */

template <class V>
V add(V a, V b)
{
    if constexpr (std::is_integral_v<V>) {
        using U = std::make_unsigned_t<V>;
        return (V)(U)((U)a + (U)b);          /* wraps, as the GPU's does */
    } else {
        return a + b;
    }
}

template <class V>
V multiply(V a, V b)
{
    if constexpr (std::is_integral_v<V>) {
        using U = std::make_unsigned_t<V>;
        /* unsigned short/char promote to int: widen first so the product wraps */
        using Wide = std::conditional_t<(sizeof(U) < sizeof(unsigned)), unsigned, U>;
        return (V)(U)((Wide)(U)a * (Wide)(U)b);
    } else {
        return a * b;
    }
}

template <class V>
V maximum(V a, V b)
{
    if constexpr (!std::is_integral_v<V>) {
        if (std::isnan(a) || std::isnan(b))
            return std::numeric_limits<V>::quiet_NaN();
    }
    return a < b ? b : a;
}

template <class V>
V minimum(V a, V b)
{
    if constexpr (!std::is_integral_v<V>) {
        if (std::isnan(a) || std::isnan(b))
            return std::numeric_limits<V>::quiet_NaN();
    }
    return b < a ? b : a;
}

/* dest = fold of combine over the ranks' inputs, each first mapped by prepare. */
template <class E, class Prepare, class Combine>
void fold(int nranks, const char *const *sources, char *dest, std::size_t count,
          Prepare prepare, Combine combine)
{
    using Stored = typename E::Stored;
    Stored *out = reinterpret_cast<Stored *>(dest);
    const Stored *first = reinterpret_cast<const Stored *>(sources[0]);
    for (std::size_t i = 0; i < count; i++)
        out[i] = E::store(prepare(E::load(first[i])));
    for (int r = 1; r < nranks; r++) {
        const Stored *in = reinterpret_cast<const Stored *>(sources[r]);
        for (std::size_t i = 0; i < count; i++)
            out[i] = E::store(combine(E::load(out[i]), prepare(E::load(in[i]))));
    }
}

template <class E>
void reduce_as(ncclRedOp_t op, int nranks, const char *const *sources, char *dest,
               std::size_t count)
{
    using V = typename E::Value;
    auto same = [](V x) { return x; };
    switch (op) {
    case ncclSum:
        fold<E>(nranks, sources, dest, count, same, add<V>);
        return;
    case ncclProd:
        fold<E>(nranks, sources, dest, count, same, multiply<V>);
        return;
    case ncclMax:
        fold<E>(nranks, sources, dest, count, same, maximum<V>);
        return;
    case ncclMin:
        fold<E>(nranks, sources, dest, count, same, minimum<V>);
        return;
    case ncclAvg:
        if constexpr (std::is_integral_v<V>) {
            fold<E>(nranks, sources, dest, count, same, add<V>);
            using Stored = typename E::Stored;
            Stored *out = reinterpret_cast<Stored *>(dest);
            using Wide = std::conditional_t<std::is_signed_v<V>, long long, unsigned long long>;
            for (std::size_t i = 0; i < count; i++)
                out[i] = (Stored)((Wide)out[i] / (Wide)nranks);
        } else {
            /* the factor as the type holds it, then each product rounded to the type */
            const V factor = E::load(E::store((V)(1.0 / nranks)));
            auto premultiply = [factor](V x) { return E::load(E::store(x * factor)); };
            fold<E>(nranks, sources, dest, count, premultiply, add<V>);
        }
        return;
    }
}

} /* namespace */

std::size_t dtype_size(ncclDataType_t dtype)
{
    switch (dtype) {
    case ncclInt8:
    case ncclUint8:
        return 1;
    case ncclFloat16:
    case ncclBfloat16:
        return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
        return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
        return 8;
    }
    return 0;
}

const char *dtype_name(ncclDataType_t dtype)
{
    switch (dtype) {
    case ncclInt8: return "ncclInt8";
    case ncclUint8: return "ncclUint8";
    case ncclInt32: return "ncclInt32";
    case ncclUint32: return "ncclUint32";
    case ncclInt64: return "ncclInt64";
    case ncclUint64: return "ncclUint64";
    case ncclFloat16: return "ncclFloat16";
    case ncclFloat32: return "ncclFloat32";
    case ncclFloat64: return "ncclFloat64";
    case ncclBfloat16: return "ncclBfloat16";
    }
    return "an unknown ncclDataType_t";
}

const char *op_name(ncclRedOp_t op)
{
    switch (op) {
    case ncclSum: return "ncclSum";
    case ncclProd: return "ncclProd";
    case ncclMax: return "ncclMax";
    case ncclMin: return "ncclMin";
    case ncclAvg: return "ncclAvg";
    }
    return "an unknown ncclRedOp_t";
}

bool valid_op(ncclRedOp_t op)
{
    return op == ncclSum || op == ncclProd || op == ncclMax || op == ncclMin || op == ncclAvg;
}

void reduce(ncclDataType_t dtype, ncclRedOp_t op, int nranks, const char *const *sources,
            char *dest, std::size_t count)
{
    switch (dtype) {
    case ncclInt8: reduce_as<Integer<std::int8_t>>(op, nranks, sources, dest, count); return;
    case ncclUint8: reduce_as<Integer<std::uint8_t>>(op, nranks, sources, dest, count); return;
    case ncclInt32: reduce_as<Integer<std::int32_t>>(op, nranks, sources, dest, count); return;
    case ncclUint32: reduce_as<Integer<std::uint32_t>>(op, nranks, sources, dest, count); return;
    case ncclInt64: reduce_as<Integer<std::int64_t>>(op, nranks, sources, dest, count); return;
    case ncclUint64: reduce_as<Integer<std::uint64_t>>(op, nranks, sources, dest, count); return;
    case ncclFloat16: reduce_as<Float16>(op, nranks, sources, dest, count); return;
    case ncclFloat32: reduce_as<Float32>(op, nranks, sources, dest, count); return;
    case ncclFloat64: reduce_as<Float64>(op, nranks, sources, dest, count); return;
    case ncclBfloat16: reduce_as<Bfloat16>(op, nranks, sources, dest, count); return;
    }
}

} /* namespace ncclsim */
