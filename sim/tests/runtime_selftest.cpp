/* runtime_selftest.cpp: the simulated runtime's checks that only C++ can
 * make: kernels written here (shared memory, barriers, 3-D blocks), and the
 * errors a GPU would give for what rlhfz's own entry points never pass on
 * (a host pointer as a kernel argument, a diverged barrier, a bad launch).
 *
 *     c++ -std=c++17 -fsanitize=alignment -Isim/include runtime_selftest.cpp \
 *         -lcudasim -o selftest
 *
 * Prints one line per check and exits 1 if any failed. Run with
 * RLHFZ_SIM_DEVICES=2. The last check leaves device 0's context lost (a
 * sticky error), as a kernel fault does on a GPU. So does every fault
 * `selftest FAULT` makes, one process each (see faults below).
 */
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
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

#define SHARED_ARRAY(type, name, count) \
    __shared__ type name[count];         \
    cudasim_shared_fresh(name, sizeof(name))

/* Block 0 writes its shared array and reads it back after a barrier; every
 * later block reads it unwritten. */
__global__ void shared_leftovers(float *out)
{
    SHARED_ARRAY(float, scratch, 32);
    if (blockIdx.x == 0)
        scratch[threadIdx.x] = 1.0f + threadIdx.x;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = scratch[(threadIdx.x + 1) % blockDim.x];
}

/* More static shared memory than any GPU gives a block without opting in. */
__global__ void too_much_shared(float *out)
{
    SHARED_ARRAY(double, big, 7000);
    big[threadIdx.x] = 1.0;
    __syncthreads();
    out[threadIdx.x] = (float)big[0];
}

/* A 16-byte load off a 16-byte boundary. */
__global__ void misaligned_load(const float *x, float *out)
{
    const float4 *p = reinterpret_cast<const float4 *>(x + 1);
    out[threadIdx.x] = p[0].x;
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

/* Faults after which the device's context is lost: one process each. */
int fault(const std::string &which)
{
    float *x = nullptr, *out = nullptr;
    std::vector<float> host(64);
    check(cudaMalloc((void **)&x, 64 * sizeof(float)) == cudaSuccess &&
              cudaMalloc((void **)&out, 64 * sizeof(float)) == cudaSuccess, "two allocations");
    cudaError_t expected = cudaErrorIllegalAddress;
    if (which == "host-pointer") {
        CUDASIM_LAUNCH(1, 32, 0, nullptr, block_sums)(host.data(), (size_t)64, (double *)out);
    } else if (which == "other-device") {
        float *other = nullptr;
        check(cudaSetDevice(1) == cudaSuccess &&
                  cudaMalloc((void **)&other, 256) == cudaSuccess &&
                  cudaSetDevice(0) == cudaSuccess, "an allocation on device 1");
        CUDASIM_LAUNCH(1, 32, 0, nullptr, block_sums)(other, (size_t)64, (double *)out);
    } else if (which == "misaligned") {
        expected = cudaErrorMisalignedAddress;
        CUDASIM_LAUNCH(1, 32, 0, nullptr, misaligned_load)(x, out);
    } else if (which == "shared-over-48k") {
        expected = cudaErrorLaunchFailure;
        CUDASIM_LAUNCH(1, 32, 0, nullptr, too_much_shared)(out);
    } else {
        std::printf("unknown fault %s\n", which.c_str());
        return 2;
    }
    cudaError_t first = cudaDeviceSynchronize();
    check(first == expected || cudaGetLastError() == expected, ("fault " + which).c_str());
    check(cudaMalloc((void **)&x, 64) == expected, "and every later call fails with it");
    std::printf("%d failed\n", failures);
    return failures ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        return fault(argv[1]);
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

    float *leftovers = nullptr;
    std::vector<float> seen(3 * 32);
    bool shared_ok = cudaMalloc((void **)&leftovers, seen.size() * sizeof(float)) == cudaSuccess;
    CUDASIM_LAUNCH(3, 32, 0, nullptr, shared_leftovers)(leftovers);
    shared_ok = shared_ok && cudaMemcpy(seen.data(), leftovers, seen.size() * sizeof(float),
                                        cudaMemcpyDeviceToHost) == cudaSuccess;
    for (unsigned i = 0; i < seen.size(); i++)
        shared_ok = shared_ok && (i < 32 ? seen[i] == 1.0f + (i + 1) % 32 : seen[i] != seen[i]);
    check(shared_ok, "__shared__ keeps a block's writes, and reads as NaN in the next block");
    cudaFree(leftovers);

    int *flag = nullptr;
    cudaMalloc((void **)&flag, sizeof(int));
    (void)cudaGetLastError();      /* the last error so far is the memset's */
    CUDASIM_LAUNCH(1, 64, 0, nullptr, diverging)(flag);
    check(cudaGetLastError() == cudaErrorLaunchFailure && cudaMalloc((void **)&x, 64) ==
              cudaErrorLaunchFailure, "a barrier only some threads reach: the context is lost");

    std::printf("%d failed\n", failures);
    return failures ? 1 : 0;
}
