/* errors.cpp: the simulated runtime's error state: each thread's last error,
 * each device's sticky error, call counts, and the failures RLHFZ_SIM_FAIL
 * injects ("call:n[:error]", comma-separated: the n-th call of `call` in
 * this process fails, with the named error or the call's usual one).
 *
 * An injected error that a GPU makes sticky (an illegal address, a launch
 * failure: "the process must be terminated") is sticky here too: every
 * later call on the device fails with it. A call's usual injected failure is
 * one a GPU recovers from, so a test that goes on using the device after it
 * proves something a GPU can do. */
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "state.h"

namespace cudasim {
namespace {

thread_local cudaError_t last_error = cudaSuccess;

struct Injection {
    std::string call;
    unsigned long long nth;
    cudaError_t error;         /* cudaSuccess: the call's usual failure */
};

struct Calls {
    std::mutex mutex;
    std::map<std::string, unsigned long long> counts;   /* since the process started */
    std::map<std::string, unsigned long long> since;    /* since the injections were set */
    std::vector<Injection> injections;
    bool loaded = false;
};

Calls &calls()
{
    static Calls *state = new Calls;    /* never destroyed: workers outlive exit */
    return *state;
}

constexpr int MAX_DEVICES = 64;
std::atomic<int> sticky_errors[MAX_DEVICES];

const struct {
    cudaError_t error;
    const char *name;
    const char *text;
} error_table[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration",
     "invalid configuration argument"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection",
     "invalid copy direction for memcpy"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress",
     "an illegal memory access was encountered"},
    {cudaErrorLaunchOutOfResources, "cudaErrorLaunchOutOfResources",
     "too many resources requested for launch"},
    {cudaErrorHostMemoryAlreadyRegistered, "cudaErrorHostMemoryAlreadyRegistered",
     "part or all of the requested memory range is already mapped"},
    {cudaErrorHostMemoryNotRegistered, "cudaErrorHostMemoryNotRegistered",
     "pointer does not correspond to a registered memory region"},
    {cudaErrorMisalignedAddress, "cudaErrorMisalignedAddress", "misaligned address"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

/* What a call fails with when a failure is injected without a named error. */
cudaError_t usual_failure(const std::string &call)
{
    static const char *const allocating[] = {"cudaMalloc", "cudaHostAlloc", "cudaMallocHost",
                                             "cudaHostRegister", "cudaStreamCreateWithFlags",
                                             "cudaStreamCreate", "cudaEventCreateWithFlags",
                                             "cudaEventCreate"};
    for (const char *name : allocating)
        if (call == name)
            return cudaErrorMemoryAllocation;
    if (call == "kernel launch")
        return cudaErrorLaunchOutOfResources;
    return cudaErrorInvalidValue;
}

/* The errors after which a GPU's context is lost for good. */
bool sticky_on_a_gpu(cudaError_t err)
{
    return err == cudaErrorIllegalAddress || err == cudaErrorMisalignedAddress ||
           err == cudaErrorLaunchFailure;
}

bool parse_error_name(const std::string &name, cudaError_t *out)
{
    for (const auto &entry : error_table) {
        if (name == entry.name) {
            *out = entry.error;
            return true;
        }
    }
    return false;
}

/* "call:n[:error],...", with "kernel launch" spelled kernel_launch too. */
bool parse_injections(const char *spec, std::vector<Injection> *out)
{
    std::string text = spec ? spec : "";
    std::size_t start = 0;
    while (start < text.size()) {
        std::size_t end = text.find(',', start);
        if (end == std::string::npos)
            end = text.size();
        std::string item = text.substr(start, end - start);
        start = end + 1;
        if (item.empty())
            continue;
        std::size_t colon = item.find(':');
        if (colon == std::string::npos || colon == 0)
            return false;
        Injection injection{item.substr(0, colon), 0, cudaSuccess};
        if (injection.call == "kernel_launch")
            injection.call = "kernel launch";
        std::string rest = item.substr(colon + 1);
        std::size_t second = rest.find(':');
        std::string count = rest.substr(0, second);
        char *stop = nullptr;
        injection.nth = std::strtoull(count.c_str(), &stop, 10);
        if (count.empty() || *stop != '\0' || injection.nth == 0)
            return false;
        if (second != std::string::npos &&
            !parse_error_name(rest.substr(second + 1), &injection.error))
            return false;
        out->push_back(injection);
    }
    return true;
}

void load_injections_locked(Calls &state)
{
    if (state.loaded)
        return;
    state.loaded = true;
    const char *spec = std::getenv("RLHFZ_SIM_FAIL");
    if (spec && !parse_injections(spec, &state.injections)) {
        std::fprintf(stderr, "cudasim: RLHFZ_SIM_FAIL=%s is not call:n[:error][,...]; "
                     "no failure is injected\n", spec);
        state.injections.clear();
    }
}

} /* namespace */

cudaError_t fail(cudaError_t err)
{
    last_error = err;
    return err;
}

cudaError_t count_call(const char *name)
{
    Calls &state = calls();
    std::lock_guard<std::mutex> lock(state.mutex);
    load_injections_locked(state);
    ++state.counts[name];
    unsigned long long n = ++state.since[name];
    for (const Injection &injection : state.injections) {
        if (injection.call != name || injection.nth != n)
            continue;
        cudaError_t err = injection.error != cudaSuccess ? injection.error : usual_failure(name);
        if (sticky_on_a_gpu(err))
            set_sticky(current_device(), err,
                       (std::string("an injected failure of ") + name).c_str());
        return err;
    }
    return cudaSuccess;
}

cudaError_t enter(const char *name)
{
    cudaError_t err = count_call(name);
    if (err == cudaSuccess)
        err = sticky(current_device());
    if (err != cudaSuccess)
        fail(err);
    return err;
}

void set_sticky(int device, cudaError_t err, const char *why)
{
    if (device < 0 || device >= MAX_DEVICES)
        return;
    int expected = cudaSuccess;
    if (sticky_errors[device].compare_exchange_strong(expected, (int)err))
        std::fprintf(stderr, "cudasim: device %d: %s; every later call on it fails with %s\n",
                     device, why, cudaGetErrorName(err));
}

cudaError_t sticky(int device)
{
    if (device < 0 || device >= MAX_DEVICES)
        return cudaSuccess;
    return (cudaError_t)sticky_errors[device].load();
}

} /* namespace cudasim */

using namespace cudasim;

extern "C" const char *cudaGetErrorString(cudaError_t error)
{
    for (const auto &entry : error_table)
        if (entry.error == error)
            return entry.text;
    return "unrecognized error code";
}

extern "C" const char *cudaGetErrorName(cudaError_t error)
{
    for (const auto &entry : error_table)
        if (entry.error == error)
            return entry.name;
    return "cudaErrorUnknown";
}

/* Returns the last error and resets it, unless the device's error is sticky. */
extern "C" cudaError_t cudaGetLastError(void)
{
    cudaError_t err = last_error;
    cudaError_t lost = sticky(current_device());
    last_error = lost;
    return err != cudaSuccess ? err : lost;
}

extern "C" cudaError_t cudaPeekAtLastError(void)
{
    return last_error != cudaSuccess ? last_error : sticky(current_device());
}

extern "C" void cudasim_set_last_error(cudaError_t error)
{
    fail(error);
}

extern "C" unsigned long long cudasim_calls(const char *name)
{
    if (!name)
        return 0;
    Calls &state = calls();
    std::lock_guard<std::mutex> lock(state.mutex);
    auto found = state.counts.find(name);
    return found == state.counts.end() ? 0 : found->second;
}

extern "C" cudaError_t cudasim_inject(const char *spec)
{
    std::vector<Injection> parsed;
    if (!parse_injections(spec, &parsed))
        return cudaErrorInvalidValue;
    Calls &state = calls();
    std::lock_guard<std::mutex> lock(state.mutex);
    state.loaded = true;
    state.injections = parsed;
    state.since.clear();
    return cudaSuccess;
}
