/* devices.cpp: the simulated machine (RLHFZ_SIM_DEVICES devices of
 * RLHFZ_SIM_DEVICE_BYTES each), each thread's current device, and the
 * queries about devices and the runtime. */
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "state.h"

namespace cudasim {
namespace {

thread_local int current = 0;

bool read_size(const char *name, unsigned long long low, unsigned long long high,
               unsigned long long *out)
{
    const char *text = std::getenv(name);
    if (!text || !*text)
        return false;
    errno = 0;
    char *end = nullptr;
    unsigned long long value = std::strtoull(text, &end, 0);
    if (errno != 0 || *end != '\0' || value < low || value > high) {
        std::fprintf(stderr, "cudasim: %s=%s is not a number in [%llu, %llu]; using the default\n",
                     name, text, low, high);
        return false;
    }
    *out = value;
    return true;
}

Config load_config()
{
    Config c;
    unsigned long long value;
    if (read_size("RLHFZ_SIM_DEVICES", 0, 64, &value))
        c.devices = (int)value;
    if (read_size("RLHFZ_SIM_DEVICE_BYTES", 4096, 1ULL << 44, &value))
        c.device_bytes = value;
    if (read_size("RLHFZ_SIM_PINNED_BYTES", 1, 1ULL << 44, &value))
        c.pinned_limit = value;
    if (read_size("RLHFZ_SIM_CHAOS", 0, ~0ULL, &value)) {
        c.chaos = true;
        c.chaos_seed = value;
    }
    return c;
}

} /* namespace */

const Config &config()
{
    static const Config *loaded = new Config(load_config());
    return *loaded;
}

int current_device()
{
    return current;
}

cudaError_t check_device(int device)
{
    if (config().devices == 0)
        return cudaErrorNoDevice;
    if (device < 0 || device >= config().devices)
        return cudaErrorInvalidDevice;
    return cudaSuccess;
}

} /* namespace cudasim */

using namespace cudasim;

extern "C" cudaError_t cudaGetDeviceCount(int *count)
{
    cudaError_t err = count_call("cudaGetDeviceCount");
    if (err != cudaSuccess)
        return fail(err);
    if (!count)
        return fail(cudaErrorInvalidValue);
    *count = config().devices;
    return config().devices == 0 ? fail(cudaErrorNoDevice) : cudaSuccess;
}

extern "C" cudaError_t cudaGetDevice(int *device)
{
    cudaError_t err = count_call("cudaGetDevice");
    if (err != cudaSuccess)
        return fail(err);
    if (!device)
        return fail(cudaErrorInvalidValue);
    if (config().devices == 0)
        return fail(cudaErrorNoDevice);
    *device = current;
    return cudaSuccess;
}

extern "C" cudaError_t cudaSetDevice(int device)
{
    cudaError_t err = count_call("cudaSetDevice");
    if (err == cudaSuccess)
        err = check_device(device);
    if (err != cudaSuccess)
        return fail(err);
    current = device;
    return cudaSuccess;
}

extern "C" cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device)
{
    cudaError_t err = enter("cudaDeviceGetAttribute");
    if (err != cudaSuccess)
        return err;
    if (!value)
        return fail(cudaErrorInvalidValue);
    if ((err = check_device(device)) != cudaSuccess)
        return fail(err);
    switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock:
        *value = 1024;
        return cudaSuccess;
    case cudaDevAttrMultiProcessorCount:
        *value = config().multiprocessors;
        return cudaSuccess;
    case cudaDevAttrMaxThreadsPerMultiProcessor:
        *value = config().threads_per_multiprocessor;
        return cudaSuccess;
    }
    return fail(cudaErrorInvalidValue);
}

extern "C" cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *blocks,
                                                                      const void *kernel,
                                                                      int block_size,
                                                                      size_t shared_bytes)
{
    cudaError_t err = enter("cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    if (err != cudaSuccess)
        return err;
    if (!blocks || !kernel || block_size <= 0 || block_size > 1024 || shared_bytes > 48 * 1024)
        return fail(cudaErrorInvalidValue);
    *blocks = config().threads_per_multiprocessor / block_size;
    return cudaSuccess;
}

extern "C" cudaError_t cudaRuntimeGetVersion(int *version)
{
    if (!version)
        return fail(cudaErrorInvalidValue);
    *version = CUDART_VERSION;
    return cudaSuccess;
}

extern "C" cudaError_t cudaDriverGetVersion(int *version)
{
    if (!version)
        return fail(cudaErrorInvalidValue);
    *version = CUDART_VERSION;
    return cudaSuccess;
}

extern "C" const char *cudasim_describe(void)
{
    static std::string text;
    static std::once_flag once;
    std::call_once(once, [] {
        const Config &c = config();
        char line[256];
        std::snprintf(line, sizeof line, "%d simulated device(s) of %zu bytes%s", c.devices,
                      c.device_bytes, c.chaos ? ", chaos on" : "");
        text = line;
        if (c.chaos)
            text += " (seed " + std::to_string(c.chaos_seed) + ")";
    });
    return text.c_str();
}
