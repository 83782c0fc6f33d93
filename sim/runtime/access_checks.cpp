/* access_checks.cpp: misaligned loads and stores in device code.
 *
 * A GPU faults on an access that is not aligned to its type's size (a
 * float4 load off a 16-byte boundary, a float off a 4-byte one) and loses
 * the context: cudaErrorMisalignedAddress, sticky. An x86 host just does
 * it. So the .cu files are compiled for the simulator with
 * -fsanitize=alignment: the compiler checks every typed access and calls
 * the handler below for a misaligned one. Its ABI is the compiler's
 * undefined-behaviour check interface, declared here; that runtime is not
 * linked, so this handler is the one called.
 */
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "state.h"

namespace {

struct SourceLocation {
    const char *file;
    std::uint32_t line;
    std::uint32_t column;
};

struct TypeMismatch {
    SourceLocation where;
    const void *type;
    unsigned char log_alignment;
    unsigned char kind;
};

const char *access_kind(unsigned char kind)
{
    static const char *const names[] = {"load", "store", "reference binding", "member access",
                                        "member call"};
    return kind < sizeof names / sizeof names[0] ? names[kind] : "access";
}

} /* namespace */

extern "C" __attribute__((visibility("default"))) void
__ubsan_handle_type_mismatch_v1(TypeMismatch *data, std::uintptr_t address)
{
    char why[512];
    std::snprintf(why, sizeof why, "a %s at %#llx, which needs %u-byte alignment (%s:%u)",
                  access_kind(data->kind), (unsigned long long)address,
                  1u << data->log_alignment, data->where.file ? data->where.file : "?",
                  data->where.line);
    const char *kernel = nullptr;
    int device = cudasim::running_kernel(&kernel);
    if (device < 0) {
        /* host code of a .cu file: a plain bug, not a device fault */
        std::fprintf(stderr, "cudasim: misaligned host access: %s\n", why);
        std::abort();
    }
    char text[640];
    std::snprintf(text, sizeof text, "kernel %s: misaligned address: %s", kernel ? kernel : "?",
                  why);
    cudasim::set_sticky(device, cudaErrorMisalignedAddress, text);
}
