/* runtime_selftest.cpp: the simulated runtime's checks that only C++ can
 * make: kernels written here (shared memory, barriers, 3-D blocks), and the
 * errors a GPU would give for what rlhfz's own entry points never pass on
 * (a host pointer as a kernel argument, a diverged barrier, a bad launch).
 *
 *     c++ -std=c++17 -Isim/include runtime_selftest.cpp -lcudasim -o selftest
 *
 * Prints one line per check and exits 1 if any failed. Run with
 * RLHFZ_SIM_DEVICES=2. The last check leaves device 0's context lost (a
 * sticky error), as a kernel fault does on a GPU.
 */
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "cudasim.h"

namespace {

int failures = 0;

void check(bool ok, const char *what)
{
    std::printf("%s: %s\n", ok ? "ok" : "FAILED", what);
    if (!ok)
        failures++;
}

/* Each block sums its part of x by halving in shared memory. */
__global__ void block_sums(const float *x, size_t n, double *out)
{
    __shared__ double partial[256];
    const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const unsigned threads = blockDim.x * blockDim.y * blockDim.z;
    double acc = 0.0;
    for (size_t i = (size_t)blockIdx.x * threads + t; i < n; i += (size_t)gridDim.x * threads)
        acc += x[i];
    partial[t] = acc;
    __syncthreads();
    for (unsigned half = threads / 2; half > 0; half /= 2) {
        if (t < half)
            partial[t] += partial[t + half];
        __syncthreads();
    }
    if (t == 0)
        out[blockIdx.x] = partial[0];
}

/* Thread 0 leaves before the barrier the others wait at. */
__global__ void diverging(int *flag)
{
    if (threadIdx.x == 0)
        return;
    __syncthreads();
    flag[0] = 1;
}

double sum_on_device(const std::vector<float> &host, unsigned blocks, dim3 shape, bool *ok)
{
    float *x = nullptr;
    double *out = nullptr;
    cudaStream_t stream;
    *ok = cudaMalloc((void **)&x, host.size() * sizeof(float)) == cudaSuccess &&
          cudaMalloc((void **)&out, blocks * sizeof(double)) == cudaSuccess &&
          cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
          cudaMemcpyAsync(x, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice,
                          stream) == cudaSuccess;
    CUDASIM_LAUNCH(blocks, shape, 0, stream, block_sums)(x, host.size(), out);
    *ok = *ok && cudaGetLastError() == cudaSuccess;
    std::vector<double> partial(blocks);
    *ok = *ok && cudaMemcpyAsync(partial.data(), out, blocks * sizeof(double),
                                 cudaMemcpyDeviceToHost, stream) == cudaSuccess &&
          cudaStreamSynchronize(stream) == cudaSuccess;
    double total = 0.0;
    for (double p : partial)
        total += p;
    cudaFree(x);
    cudaFree(out);
    cudaStreamDestroy(stream);
    return total;
}

} /* namespace */

int main()
{
    std::vector<float> host(100003);
    double expected = 0.0;
    for (size_t i = 0; i < host.size(); i++) {
        host[i] = (float)(i % 13) - 6.0f;
        expected += host[i];
    }
    const dim3 shapes[] = {dim3(256), dim3(64, 4), dim3(16, 4, 4), dim3(32)};
    for (const dim3 &shape : shapes) {
        bool ok;
        double got = sum_on_device(host, 7, shape, &ok);
        char what[96];
        std::snprintf(what, sizeof what, "block sums with %ux%ux%u threads", shape.x, shape.y,
                      shape.z);
        check(ok && got == expected, what);
    }

    float *x = nullptr;
    double *out = nullptr;
    cudaMalloc((void **)&x, 64 * sizeof(float));
    cudaMalloc((void **)&out, sizeof(double));
    CUDASIM_LAUNCH(1, 32, 0, nullptr, block_sums)(host.data(), (size_t)64, out);
    check(cudaGetLastError() == cudaErrorIllegalAddress, "a host pointer as a kernel argument");
    CUDASIM_LAUNCH(1, 2048, 0, nullptr, block_sums)(x, (size_t)64, out);
    check(cudaGetLastError() == cudaErrorInvalidConfiguration, "2048 threads in a block");
    check(cudaGetLastError() == cudaSuccess, "launch errors are not sticky");

    void *alias = nullptr;
    int device = -1;
    check(cudasim_host_alias(x, 64 * sizeof(float), &alias, &device) == cudaSuccess &&
              device == 0, "a device allocation's host alias");
    check(cudaMemcpy(alias, host.data(), 16, cudaMemcpyDefault) == cudaErrorInvalidValue,
          "the host alias where a copy needs a device or host pointer");
    check(cudaMemcpy(x, host.data(), 16, cudaMemcpyDeviceToHost) ==
              cudaErrorInvalidMemcpyDirection, "a copy whose kind contradicts its pointers");

    cudaPointerAttributes attributes;
    check(cudaPointerGetAttributes(&attributes, x + 3) == cudaSuccess &&
              attributes.type == cudaMemoryTypeDevice && attributes.device == 0,
          "pointer attributes of device memory");
    check(cudaPointerGetAttributes(&attributes, host.data()) == cudaSuccess &&
              attributes.type == cudaMemoryTypeUnregistered, "pointer attributes of host memory");
    check(cudaHostRegister(host.data(), 4096, 0) == cudaSuccess &&
              cudaHostRegister(host.data() + 16, 64, 0) == cudaErrorHostMemoryAlreadyRegistered &&
              cudaPointerGetAttributes(&attributes, host.data() + 8) == cudaSuccess &&
              attributes.type == cudaMemoryTypeHost && cudaHostUnregister(host.data()) == cudaSuccess,
          "registering host memory, twice");

    if (cudaSetDevice(1) == cudaSuccess) {
        int *other = nullptr;
        check(cudaMalloc((void **)&other, 256) == cudaSuccess, "an allocation on device 1");
        cudaSetDevice(0);
        check(cudaMemsetAsync(other, 0, 256, nullptr) == cudaErrorInvalidValue,
              "a memset of device 1's memory while device 0 is current");
        CUDASIM_LAUNCH(1, 32, 0, nullptr, block_sums)((const float *)other, (size_t)64, out);
        check(cudaGetLastError() == cudaErrorIllegalAddress,
              "a kernel on device 0 given device 1's memory");
        cudaSetDevice(1);
        check(cudaFree(other) == cudaSuccess, "freeing it with its device current");
        cudaSetDevice(0);
    }

    check(cudaFree(x) == cudaSuccess && cudaFree(x) == cudaErrorInvalidValue,
          "a second cudaFree of the same pointer");
    check(cudaMemsetAsync(x, 0, 4, nullptr) == cudaErrorInvalidValue, "a memset of freed memory");

    cudaStream_t closed = nullptr, fresh[64];
    bool created = cudaStreamCreate(&closed) == cudaSuccess && cudaStreamDestroy(closed) ==
                   cudaSuccess;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));    /* its worker frees it */
    bool reused = false;
    for (cudaStream_t &stream : fresh) {
        created = created && cudaStreamCreate(&stream) == cudaSuccess;
        reused = reused || stream == closed;
    }
    check(created && !reused && cudaStreamQuery(closed) == cudaErrorInvalidResourceHandle,
          "a destroyed stream's handle is never handed out again");
    for (cudaStream_t stream : fresh)
        cudaStreamDestroy(stream);
    (void)cudaGetLastError();

    int *flag = nullptr;
    cudaMalloc((void **)&flag, sizeof(int));
    (void)cudaGetLastError();      /* the last error so far is the memset's */
    CUDASIM_LAUNCH(1, 64, 0, nullptr, diverging)(flag);
    check(cudaGetLastError() == cudaErrorLaunchFailure && cudaMalloc((void **)&x, 64) ==
              cudaErrorLaunchFailure, "a barrier only some threads reach: the context is lost");

    std::printf("%d failed\n", failures);
    return failures ? 1 : 0;
}
