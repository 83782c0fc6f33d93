/* cuda_elementwise.cuh: element access by dtype and the launch shape shared
 * by rlhfz's CUDA kernels (internal).
 *
 * Every kernel reads and writes its arrays as fp32 values through these
 * helpers, one element at a time or RLHFZ_VEC at a time with 16-byte loads
 * and stores. Conversions round as half_convert.h does: to nearest even
 * (the hardware's cvt.rn), and a NaN stays a NaN, made quiet, with the top
 * of its payload kept, so a cast gives the CPU's bits even for NaNs.
 *
 * The layout every elementwise kernel follows: when all of its pointers are
 * 16-byte aligned, steps of RLHFZ_VEC elements [0, n / RLHFZ_VEC *
 * RLHFZ_VEC) go to threads by a grid-stride loop, then the last n %
 * RLHFZ_VEC elements one each; otherwise all n one each. Either way every
 * element is handled exactly once.
 */
#ifndef RLHFZ_CUDA_ELEMENTWISE_CUH
#define RLHFZ_CUDA_ELEMENTWISE_CUH

#include <stddef.h>
#include <stdint.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "rlhfz_kernels.h"

/* Elements per vector step: 16 bytes of 16-bit values, two float4s of fp32. */
#define RLHFZ_VEC 8
/* Threads per block of every kernel here. */
#define RLHFZ_BLOCK 256
/* Most blocks of an elementwise grid; the grid-stride loop covers the rest
 * (4096 x 256 threads keep every SM of an H100 busy for several waves). */
#define RLHFZ_MAX_BLOCKS 4096

/* ---- conversions ---------------------------------------------------------- */

/* bf16 is the top half of an fp32: widening is exact, NaN payload and all. */
__device__ __forceinline__ float rlhfz_bf16_bits_to_f32(unsigned short h)
{
    return __uint_as_float((unsigned int)h << 16);
}

__device__ __forceinline__ float rlhfz_f16_bits_to_f32(unsigned short h)
{
    unsigned int bits = h;
    if ((bits & 0x7FFFu) > 0x7C00u) /* NaN: quiet, the payload shifted up */
        return __uint_as_float(((bits & 0x8000u) << 16) | 0x7FC00000u | ((bits & 0x3FFu) << 13));
    return __half2float(__ushort_as_half(h));
}

__device__ __forceinline__ unsigned short rlhfz_f32_to_bf16_bits(float x)
{
    unsigned int bits = __float_as_uint(x);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) /* NaN: set the quiet bit */
        return (unsigned short)((bits >> 16) | 0x0040u);
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
}

__device__ __forceinline__ unsigned short rlhfz_f32_to_f16_bits(float x)
{
    unsigned int bits = __float_as_uint(x);
    unsigned int magnitude = bits & 0x7FFFFFFFu;
    if (magnitude > 0x7F800000u) /* NaN: keep the top payload bits, make it quiet */
        return (unsigned short)(((bits >> 16) & 0x8000u) | 0x7E00u | ((magnitude >> 13) & 0x3FFu));
    return __half_as_ushort(__float2half_rn(x));
}

/* A 16-bit value from its bits, as fp32; D is a 16-bit dtype. */
template <int D>
__device__ __forceinline__ float rlhfz_half_to_f32(unsigned short h)
{
    if constexpr (D == RLHFZ_DTYPE_BF16)
        return rlhfz_bf16_bits_to_f32(h);
    else
        return rlhfz_f16_bits_to_f32(h);
}

template <int D>
__device__ __forceinline__ unsigned short rlhfz_f32_to_half(float x)
{
    if constexpr (D == RLHFZ_DTYPE_BF16)
        return rlhfz_f32_to_bf16_bits(x);
    else
        return rlhfz_f32_to_f16_bits(x);
}

/* ---- one element ---------------------------------------------------------- */

template <int D>
__device__ __forceinline__ float rlhfz_load(const void *x, size_t i)
{
    if constexpr (D == RLHFZ_DTYPE_F32)
        return static_cast<const float *>(x)[i];
    else
        return rlhfz_half_to_f32<D>(static_cast<const unsigned short *>(x)[i]);
}

template <int D>
__device__ __forceinline__ void rlhfz_store(void *x, size_t i, float value)
{
    if constexpr (D == RLHFZ_DTYPE_F32)
        static_cast<float *>(x)[i] = value;
    else
        static_cast<unsigned short *>(x)[i] = rlhfz_f32_to_half<D>(value);
}

/* ---- RLHFZ_VEC elements, 16-byte aligned ---------------------------------- */

/* Elements i .. i + 7; x must be 16-byte aligned and i a multiple of 8. */
template <int D>
__device__ __forceinline__ void rlhfz_load8(const void *x, size_t i, float v[RLHFZ_VEC])
{
    if constexpr (D == RLHFZ_DTYPE_F32) {
        const float4 *p = reinterpret_cast<const float4 *>(static_cast<const float *>(x) + i);
        float4 a = p[0];
        float4 b = p[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    } else {
        /* eight 16-bit values, two to a word, the lower index in the low half */
        uint4 raw = *reinterpret_cast<const uint4 *>(static_cast<const unsigned short *>(x) + i);
        unsigned int words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            v[2 * k] = rlhfz_half_to_f32<D>((unsigned short)(words[k] & 0xFFFFu));
            v[2 * k + 1] = rlhfz_half_to_f32<D>((unsigned short)(words[k] >> 16));
        }
    }
}

/* Eight 16-bit values as they are, into elements i .. i + 7 of x (16-byte
 * aligned, i a multiple of 8). */
__device__ __forceinline__ void rlhfz_store8_bits(void *x, size_t i,
                                                  const unsigned short h[RLHFZ_VEC])
{
    unsigned int words[4];
#pragma unroll
    for (int k = 0; k < 4; k++)
        words[k] = (unsigned int)h[2 * k] | ((unsigned int)h[2 * k + 1] << 16);
    *reinterpret_cast<uint4 *>(static_cast<unsigned short *>(x) + i) =
        make_uint4(words[0], words[1], words[2], words[3]);
}

template <int D>
__device__ __forceinline__ void rlhfz_store8(void *x, size_t i, const float v[RLHFZ_VEC])
{
    if constexpr (D == RLHFZ_DTYPE_F32) {
        float4 *p = reinterpret_cast<float4 *>(static_cast<float *>(x) + i);
        p[0] = make_float4(v[0], v[1], v[2], v[3]);
        p[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
        unsigned short h[RLHFZ_VEC];
#pragma unroll
        for (int k = 0; k < RLHFZ_VEC; k++)
            h[k] = rlhfz_f32_to_half<D>(v[k]);
        rlhfz_store8_bits(x, i, h);
    }
}

/* ---- indexing ------------------------------------------------------------- */

__device__ __forceinline__ size_t rlhfz_thread_index(void)
{
    return (size_t)blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ size_t rlhfz_thread_count(void)
{
    return (size_t)gridDim.x * blockDim.x;
}

/* ---- host side ------------------------------------------------------------ */

static inline bool rlhfz_dtype_known(rlhfz_dtype dtype)
{
    return dtype == RLHFZ_DTYPE_F32 || dtype == RLHFZ_DTYPE_BF16 || dtype == RLHFZ_DTYPE_F16;
}

/* NULL counts as aligned: an absent array does not stop the vector path. */
static inline bool rlhfz_aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

/* Blocks of RLHFZ_BLOCK threads for `items` units of work, one unit per
 * thread per pass, at least one block and at most `cap`. */
static inline unsigned int rlhfz_grid_for(size_t items, unsigned int cap)
{
    size_t blocks = (items + RLHFZ_BLOCK - 1) / RLHFZ_BLOCK;
    if (blocks < 1)
        blocks = 1;
    return blocks < cap ? (unsigned int)blocks : cap;
}

#define RLHFZ_MAX_DEVICES 64

/* The blocks of `block` threads of this kernel the current device runs at
 * once (its multiprocessors times the blocks that fit on one), asked of the
 * runtime once per kernel and device; 0 when the runtime cannot say. Each
 * kernel is launched with one block size, which the cache assumes. */
template <typename Kernel>
static inline size_t rlhfz_wave(Kernel kernel, int block)
{
    static int wave[RLHFZ_MAX_DEVICES];
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= RLHFZ_MAX_DEVICES) {
        (void)cudaGetLastError();
        return 0;
    }
    if (wave[device] <= 0) {
        int sms = 0, blocks = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, block, 0) !=
                cudaSuccess || sms <= 0 || blocks <= 0) {
            (void)cudaGetLastError();
            return 0;
        }
        wave[device] = sms * blocks;        /* racing writers store the same value */
    }
    return (size_t)wave[device];
}

/* Blocks for an elementwise kernel over n elements (vector steps, plus the
 * tail's few elements, which the first threads of the grid take), in whole
 * waves. Less than a wave of work gets one block per unit of it; more gets
 * as many whole waves as the work fills, at most RLHFZ_MAX_BLOCKS' worth,
 * and the grid-stride loop spreads the rest evenly: no last wave left
 * mostly idle. */
template <typename Kernel>
static inline unsigned int rlhfz_elementwise_grid(Kernel kernel, size_t n, bool vector)
{
    const size_t items = vector ? n / RLHFZ_VEC : n;
    const size_t wave = rlhfz_wave(kernel, RLHFZ_BLOCK);
    if (wave == 0)
        return rlhfz_grid_for(items, RLHFZ_MAX_BLOCKS);
    const size_t needed = rlhfz_grid_for(items, 0xFFFFFFFFu);
    if (needed <= wave)
        return (unsigned int)needed;
    size_t waves = needed / wave;
    const size_t most = RLHFZ_MAX_BLOCKS / wave > 0 ? RLHFZ_MAX_BLOCKS / wave : 1;
    return (unsigned int)((waves < most ? waves : most) * wave);
}

/* Blocks of `block` threads for `items` units of work (one per thread per
 * pass): one per `block` units, at most one wave (RLHFZ_MAX_BLOCKS when the
 * runtime cannot say); the grid-stride loop takes the rest. */
template <typename Kernel>
static inline unsigned int rlhfz_one_wave_grid(Kernel kernel, int block, size_t items)
{
    size_t needed = (items + (size_t)block - 1) / (size_t)block;
    if (needed < 1)
        needed = 1;
    const size_t wave = rlhfz_wave(kernel, block);
    const size_t most = wave > 0 ? wave : RLHFZ_MAX_BLOCKS;
    return (unsigned int)(needed < most ? needed : most);
}

/* Calls launch(tag) with decltype(tag)::value the compile-time twin of
 * dtype (already checked with rlhfz_dtype_known): the one place a run-time
 * dtype picks a kernel instantiation. */
template <int D>
struct rlhfz_dtype_tag {
    static constexpr int value = D;
};

template <typename Launch>
static inline void rlhfz_with_dtype(rlhfz_dtype dtype, Launch &&launch)
{
    if (dtype == RLHFZ_DTYPE_BF16)
        launch(rlhfz_dtype_tag<RLHFZ_DTYPE_BF16>{});
    else if (dtype == RLHFZ_DTYPE_F16)
        launch(rlhfz_dtype_tag<RLHFZ_DTYPE_F16>{});
    else
        launch(rlhfz_dtype_tag<RLHFZ_DTYPE_F32>{});
}

/* The param_out kind of a kernel that writes no param_out. */
#define RLHFZ_OUT_NONE (-1)

/* Calls launch(grad, out) with the tags of the grad dtype and of param_out's
 * dtype (RLHFZ_OUT_NONE's when param_out is NULL), both already checked:
 * the AdamW steps' one kernel per (grad dtype, param_out kind). */
template <typename Launch>
static inline void rlhfz_with_grad_and_out(rlhfz_dtype grad_dtype, const void *param_out,
                                           rlhfz_dtype param_dtype, Launch &&launch)
{
    rlhfz_with_dtype(grad_dtype, [&](auto grad) {
        if (!param_out)
            launch(grad, rlhfz_dtype_tag<RLHFZ_OUT_NONE>{});
        else
            rlhfz_with_dtype(param_dtype, [&](auto out) { launch(grad, out); });
    });
}

#endif /* RLHFZ_CUDA_ELEMENTWISE_CUH */
