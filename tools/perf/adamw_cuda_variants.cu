/* adamw_cuda_variants.cu: the fp32 AdamW step's shapes on a real GPU, side by side.
 *
 * Each variant runs rlhfz_adamw_element, so all compute the same bits; they
 * differ in how elements reach threads (vector steps per iteration, cache
 * hints, block size, grid). Two ceilings frame them: cudaMemcpy device to
 * device (bytes read + written) and a kernel with AdamW's access pattern
 * (read 4 arrays, write 3) and no math. Every variant's output is checked
 * bitwise against the shipped kernel's, from the same inputs.
 *
 * Build and run on a GPU machine (a few seconds):
 *   nvcc -O3 -std=c++17 -arch=sm_90 -Ikernels -Icsrc tools/perf/adamw_cuda_variants.cu \
 *        kernels/cuda_error.cu -o build/adamw_variants && build/adamw_variants [n ...]
 */
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../kernels/adamw_cuda.cu"

#define CHECK(call)                                                                   \
    do {                                                                              \
        cudaError_t e_ = (call);                                                      \
        if (e_ != cudaSuccess) {                                                      \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call,         \
                         cudaGetErrorString(e_));                                     \
            std::exit(1);                                                             \
        }                                                                             \
    } while (0)

/* ---- variants ----------------------------------------------------------------------------- */

__device__ __forceinline__ float4 load4(const float *p, bool stream)
{
    return stream ? __ldcs(reinterpret_cast<const float4 *>(p))
                  : *reinterpret_cast<const float4 *>(p);
}

__device__ __forceinline__ void store4(float *p, float4 v, bool stream)
{
    if (stream)
        __stcs(reinterpret_cast<float4 *>(p), v);
    else
        *reinterpret_cast<float4 *>(p) = v;
}

/* U vector steps of 8 elements per thread per iteration, every load issued
 * before the first use; STREAM: evict-first loads and stores. */
template <int U, bool STREAM>
__global__ void variant_kernel(float *master, float *exp_avg, float *exp_avg_sq,
                               const float *grad, size_t n, rlhfz_adamw_hparams hp)
{
    const size_t steps = n / (RLHFZ_VEC * U);
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t s = (size_t)blockIdx.x * blockDim.x + threadIdx.x; s < steps; s += stride) {
        float4 g[2 * U], p[2 * U], m[2 * U], v[2 * U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            /* step u of this thread: consecutive threads side by side, coalesced */
            const size_t base = ((size_t)u * steps + s) * RLHFZ_VEC;
            g[2 * u] = load4(grad + base, STREAM);
            g[2 * u + 1] = load4(grad + base + 4, STREAM);
            p[2 * u] = load4(master + base, STREAM);
            p[2 * u + 1] = load4(master + base + 4, STREAM);
            m[2 * u] = load4(exp_avg + base, STREAM);
            m[2 * u + 1] = load4(exp_avg + base + 4, STREAM);
            v[2 * u] = load4(exp_avg_sq + base, STREAM);
            v[2 * u + 1] = load4(exp_avg_sq + base + 4, STREAM);
        }
#pragma unroll
        for (int q = 0; q < 2 * U; q++) {
            rlhfz_adamw_element(hp, g[q].x, p[q].x, m[q].x, v[q].x);
            rlhfz_adamw_element(hp, g[q].y, p[q].y, m[q].y, v[q].y);
            rlhfz_adamw_element(hp, g[q].z, p[q].z, m[q].z, v[q].z);
            rlhfz_adamw_element(hp, g[q].w, p[q].w, m[q].w, v[q].w);
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            const size_t base = ((size_t)u * steps + s) * RLHFZ_VEC;
            store4(master + base, p[2 * u], STREAM);
            store4(master + base + 4, p[2 * u + 1], STREAM);
            store4(exp_avg + base, m[2 * u], STREAM);
            store4(exp_avg + base + 4, m[2 * u + 1], STREAM);
            store4(exp_avg_sq + base, v[2 * u], STREAM);
            store4(exp_avg_sq + base + 4, v[2 * u + 1], STREAM);
        }
    }
    /* the tail, one element each */
    for (size_t i = steps * RLHFZ_VEC * U + (size_t)blockIdx.x * blockDim.x + threadIdx.x;
         i < n; i += stride) {
        float p = master[i], m = exp_avg[i], v = exp_avg_sq[i];
        rlhfz_adamw_element(hp, grad[i], p, m, v);
        master[i] = p;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
    }
}

/* AdamW's traffic with no math: the ceiling for this access pattern. */
template <bool STREAM>
__global__ void pattern_kernel(float *master, float *exp_avg, float *exp_avg_sq,
                               const float *grad, size_t n)
{
    const size_t steps = n / 4;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t s = (size_t)blockIdx.x * blockDim.x + threadIdx.x; s < steps; s += stride) {
        const size_t i = s * 4;
        float4 g = load4(grad + i, STREAM), p = load4(master + i, STREAM);
        float4 m = load4(exp_avg + i, STREAM), v = load4(exp_avg_sq + i, STREAM);
        p.x += g.x; m.y += g.y; v.z += g.z; p.w += m.w + v.w;
        store4(master + i, p, STREAM);
        store4(exp_avg + i, m, STREAM);
        store4(exp_avg_sq + i, v, STREAM);
    }
}

/* ---- the harness -------------------------------------------------------------------------- */

struct Arrays {
    float *master, *exp_avg, *exp_avg_sq, *grad;
};

static int sms;

template <typename Kernel>
static unsigned blocks_per_sm(Kernel k, int block)
{
    int b = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, k, block, 0));
    return (unsigned)b;
}

/* Random values in [-0.5, 0.5) from a hash of the index: no host pass over 4 GB. */
__global__ void init_kernel(float *x, size_t n, unsigned salt, bool square)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        unsigned h = (unsigned)i * 2654435761u ^ salt;
        h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
        float v = (float)(h >> 8) / 16777216.0f - 0.5f;
        x[i] = square ? v * v : v;
    }
}

__global__ void count_diff_kernel(const unsigned *a, const unsigned *b, size_t n,
                                  unsigned long long *diffs)
{
    unsigned long long local = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        local += a[i] != b[i];
    if (local)
        atomicAdd(diffs, local);
}

static void fill(Arrays dst, Arrays init, size_t n)
{
    CHECK(cudaMemcpy(dst.grad, init.grad, n * 4, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemcpy(dst.master, init.master, n * 4, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemcpy(dst.exp_avg, init.exp_avg, n * 4, cudaMemcpyDeviceToDevice));
    CHECK(cudaMemcpy(dst.exp_avg_sq, init.exp_avg_sq, n * 4, cudaMemcpyDeviceToDevice));
}

template <typename Launch>
static double median_ms(Launch launch, int rounds)
{
    cudaEvent_t start, stop;
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
    for (int i = 0; i < 3; i++)
        launch();
    CHECK(cudaDeviceSynchronize());
    std::vector<float> times;
    for (int r = 0; r < rounds; r++) {
        CHECK(cudaEventRecord(start));
        launch();
        CHECK(cudaEventRecord(stop));
        CHECK(cudaEventSynchronize(stop));
        CHECK(cudaGetLastError());
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, start, stop));
        times.push_back(ms);
    }
    std::sort(times.begin(), times.end());
    CHECK(cudaEventDestroy(start));
    CHECK(cudaEventDestroy(stop));
    return times[times.size() / 2];
}

static bool same_bits(Arrays a, Arrays b, size_t n)
{
    unsigned long long *diffs, found = 0;
    CHECK(cudaMalloc(&diffs, sizeof *diffs));
    CHECK(cudaMemset(diffs, 0, sizeof *diffs));
    const float *pa[3] = {a.master, a.exp_avg, a.exp_avg_sq};
    const float *pb[3] = {b.master, b.exp_avg, b.exp_avg_sq};
    for (int k = 0; k < 3; k++)
        count_diff_kernel<<<4 * sms, 256>>>(reinterpret_cast<const unsigned *>(pa[k]),
                                            reinterpret_cast<const unsigned *>(pb[k]), n, diffs);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(&found, diffs, sizeof found, cudaMemcpyDeviceToHost));
    CHECK(cudaFree(diffs));
    return found == 0;
}

int main(int argc, char **argv)
{
    std::vector<size_t> sizes;
    for (int i = 1; i < argc; i++)
        sizes.push_back(std::strtoull(argv[i], nullptr, 10));
    if (sizes.empty())
        sizes = {100000000ull + 3, 1000000000ull + 5};
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    sms = prop.multiProcessorCount;
    std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);

    rlhfz_adamw_hparams hp = {};
    hp.decay = 1.0f - 1e-3f * 1e-2f;
    hp.beta1_weight = 0.1f;
    hp.beta2 = 0.999f;
    hp.beta2_weight = 1.0f - 0.999f;
    hp.eps = 1e-8f;
    hp.step_size = 1e-3f / 0.1f;
    hp.bias_correction2_rsqrt = 31.6227766f;
    hp.grad_scale = 1.0f;

    for (size_t n : sizes) {
        Arrays a, ref, init;
        for (Arrays *x : {&a, &ref, &init}) {
            CHECK(cudaMalloc(&x->master, n * 4));
            CHECK(cudaMalloc(&x->exp_avg, n * 4));
            CHECK(cudaMalloc(&x->exp_avg_sq, n * 4));
            CHECK(cudaMalloc(&x->grad, n * 4));
        }
        init_kernel<<<4 * sms, 256>>>(init.grad, n, 1u, false);
        init_kernel<<<4 * sms, 256>>>(init.master, n, 2u, false);
        init_kernel<<<4 * sms, 256>>>(init.exp_avg, n, 3u, false);
        init_kernel<<<4 * sms, 256>>>(init.exp_avg_sq, n, 4u, true);   /* v >= 0 */
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
        const double bytes = 28.0 * (double)n;
        std::printf("\nn = %zu (%.1f GB of AdamW traffic)\n", n, bytes / 1e9);
        std::printf("%-34s %10s %9s %8s %6s\n", "variant", "median ms", "GB/s", "of copy", "bits");

        /* the ceiling: a device-to-device copy of 2 arrays' bytes */
        const int rounds = n > 500000000ull ? 20 : 50;
        double copy_ms = median_ms([&] {
            CHECK(cudaMemcpyAsync(ref.master, init.master, n * 4, cudaMemcpyDeviceToDevice));
        }, rounds);
        const double copy_gbps = 2.0 * n * 4 / copy_ms / 1e6;
        std::printf("%-34s %10.3f %9.1f %8.3f %6s\n", "cudaMemcpy d2d (read+write)", copy_ms,
                    copy_gbps, 1.0, "-");

        /* the shipped kernel: the reference bits */
        fill(ref, init, n);
        rlhfz_adamw_shard shard = {ref.master, ref.exp_avg, ref.exp_avg_sq, ref.grad,
                                   RLHFZ_DTYPE_F32, nullptr, RLHFZ_DTYPE_F32, n};
        if (rlhfz_adamw_cuda(&shard, &hp, nullptr, nullptr, nullptr) != RLHFZ_OK)
            return 1;
        CHECK(cudaDeviceSynchronize());
        fill(a, init, n);
        shard = {a.master, a.exp_avg, a.exp_avg_sq, a.grad, RLHFZ_DTYPE_F32, nullptr,
                 RLHFZ_DTYPE_F32, n};
        double ms = median_ms([&] {
            if (rlhfz_adamw_cuda(&shard, &hp, nullptr, nullptr, nullptr) != RLHFZ_OK)
                std::exit(1);
        }, rounds);
        std::printf("%-34s %10.3f %9.1f %8.3f %6s\n", "shipped rlhfz_adamw_cuda", ms,
                    bytes / ms / 1e6, bytes / ms / 1e6 / copy_gbps, "ref");

        auto run = [&](const char *name, auto kernel, int block, unsigned grid) {
            if (grid == 0)
                return;          /* too many registers for this block size */
            fill(a, init, n);
            kernel<<<grid, block>>>(a.master, a.exp_avg, a.exp_avg_sq, a.grad, n, hp);
            CHECK(cudaGetLastError());
            CHECK(cudaDeviceSynchronize());
            const bool same = same_bits(a, ref, n);
            double t = median_ms([&] {
                kernel<<<grid, block>>>(a.master, a.exp_avg, a.exp_avg_sq, a.grad, n, hp);
            }, rounds);
            char label[96];
            std::snprintf(label, sizeof label, "%s b%d g%u", name, block, grid);
            std::printf("%-34s %10.3f %9.1f %8.3f %6s\n", label, t, bytes / t / 1e6,
                        bytes / t / 1e6 / copy_gbps, same ? "same" : "DIFF");
        };
        for (int block : {256, 512}) {
            auto k11 = variant_kernel<1, false>, k12 = variant_kernel<2, false>;
            auto k21 = variant_kernel<1, true>, k22 = variant_kernel<2, true>;
            auto k14 = variant_kernel<4, true>;
            for (unsigned waves : {1u, 4u}) {
                run("u1", k11, block, waves * sms * blocks_per_sm(k11, block));
                run("u2", k12, block, waves * sms * blocks_per_sm(k12, block));
                run("u1 stream", k21, block, waves * sms * blocks_per_sm(k21, block));
                run("u2 stream", k22, block, waves * sms * blocks_per_sm(k22, block));
                run("u4 stream", k14, block, waves * sms * blocks_per_sm(k14, block));
            }
        }
        for (bool stream : {false, true}) {
            auto k = stream ? pattern_kernel<true> : pattern_kernel<false>;
            unsigned grid = 4 * sms * blocks_per_sm(k, 256);
            fill(a, init, n);
            double t = median_ms([&] {
                k<<<grid, 256>>>(a.master, a.exp_avg, a.exp_avg_sq, a.grad, n);
            }, rounds);
            std::printf("%-34s %10.3f %9.1f %8.3f %6s\n",
                        stream ? "no-math pattern, stream" : "no-math pattern", t,
                        bytes / t / 1e6, bytes / t / 1e6 / copy_gbps, "-");
        }
        for (Arrays *x : {&a, &ref, &init}) {
            CHECK(cudaFree(x->master));
            CHECK(cudaFree(x->exp_avg));
            CHECK(cudaFree(x->exp_avg_sq));
            CHECK(cudaFree(x->grad));
        }
    }
    return 0;
}
