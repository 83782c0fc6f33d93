/* cpu_features.c: which SIMD level the running CPU and OS support.
 *
 * Checked once with cpuid and xgetbv (the OS must save the wide registers,
 * not just the CPU have them) and cached. RLHFZ_SIMD=scalar|avx2|avx512 caps
 * the level, so tests can force the narrower paths on a wide machine.
 */
#include "rlhfz_kernels.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define RLHFZ_X86 1
#endif

/* The one cached detection result. */
static struct {
    pthread_once_t once;
    rlhfz_simd_level level;
} rlhfz_cpu = {PTHREAD_ONCE_INIT, RLHFZ_SIMD_SCALAR};

#ifdef RLHFZ_X86
/* xgetbv by opcode, so this file needs no -mxsave */
static uint64_t read_xcr0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

static rlhfz_simd_level detect_x86(void)
{
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx))
        return RLHFZ_SIMD_SCALAR;
    int osxsave = (ecx >> 27) & 1;
    int avx = (ecx >> 28) & 1;
    int fma = (ecx >> 12) & 1;
    int f16c = (ecx >> 29) & 1;
    if (!osxsave || !avx)
        return RLHFZ_SIMD_SCALAR;

    uint64_t xcr0 = read_xcr0();
    int os_ymm = (xcr0 & 0x6) == 0x6;   /* SSE and AVX state */
    int os_zmm = (xcr0 & 0xE6) == 0xE6; /* plus opmask and both zmm halves */

    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx))
        return RLHFZ_SIMD_SCALAR;
    int avx2 = (ebx >> 5) & 1;
    int avx512f = (ebx >> 16) & 1;
    int avx512dq = (ebx >> 17) & 1;
    int avx512bw = (ebx >> 30) & 1;
    int avx512vl = (ebx >> 31) & 1;

    if (!(os_ymm && avx2 && fma && f16c))
        return RLHFZ_SIMD_SCALAR;
    if (os_zmm && avx512f && avx512bw && avx512vl && avx512dq)
        return RLHFZ_SIMD_AVX512;
    return RLHFZ_SIMD_AVX2;
}
#endif

static void detect_once(void)
{
    rlhfz_simd_level level = RLHFZ_SIMD_SCALAR;
#ifdef RLHFZ_X86
    level = detect_x86();
#endif
    const char *cap = getenv("RLHFZ_SIMD");
    if (cap) {
        rlhfz_simd_level limit = level;
        if (strcmp(cap, "scalar") == 0)
            limit = RLHFZ_SIMD_SCALAR;
        else if (strcmp(cap, "avx2") == 0)
            limit = RLHFZ_SIMD_AVX2;
        else if (strcmp(cap, "avx512") == 0)
            limit = RLHFZ_SIMD_AVX512;
        if (limit < level) /* a cap never raises the level */
            level = limit;
    }
    rlhfz_cpu.level = level;
}

rlhfz_simd_level rlhfz_simd_detect(void)
{
    pthread_once(&rlhfz_cpu.once, detect_once);
    return rlhfz_cpu.level;
}

const char *rlhfz_simd_name(rlhfz_simd_level level)
{
    switch (level) {
    case RLHFZ_SIMD_BEST:
        return "best";
    case RLHFZ_SIMD_SCALAR:
        return "scalar";
    case RLHFZ_SIMD_AVX2:
        return "avx2";
    case RLHFZ_SIMD_AVX512:
        return "avx512";
    }
    return "unknown";
}

size_t rlhfz_dtype_size(rlhfz_dtype dtype)
{
    switch (dtype) {
    case RLHFZ_DTYPE_F32:
        return 4;
    case RLHFZ_DTYPE_BF16:
    case RLHFZ_DTYPE_F16:
        return 2;
    case RLHFZ_DTYPE_I8:
    case RLHFZ_DTYPE_U8:
        return 1;
    }
    return 0;
}
