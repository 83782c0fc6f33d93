/* cuda_adamw_element.cuh: one element of the AdamW step on the GPU
 * (internal), shared by the fp32 step (adamw_cuda.cu) and the step over
 * low-precision moments (adamw_lowp_cuda.cu).
 *
 * The math is the CPU reference's, operation for operation. Each operation
 * is an explicit round-to-nearest intrinsic: nvcc contracts a * b + c into
 * one FMA by default, which rounds once where the reference (built without
 * contraction) rounds twice. Division and square root are the correctly
 * rounded ones, so finite results match the CPU bit for bit.
 */
#ifndef RLHFZ_CUDA_ADAMW_ELEMENT_CUH
#define RLHFZ_CUDA_ADAMW_ELEMENT_CUH

#include <cuda_runtime.h>

#include "rlhfz_kernels.h"

/* One element of the step: the grad as read (fp32), and the master weight
 * and both moments, updated in place. Returns sqrt(exp_avg_sq), which the
 * int8 step encodes. */
__device__ __forceinline__ float rlhfz_adamw_element(const rlhfz_adamw_hparams &hp, float grad,
                                                     float &param, float &exp_avg,
                                                     float &exp_avg_sq)
{
    float g = __fmul_rn(grad, hp.grad_scale);
    if (hp.maximize)
        g = -g;

    /* decoupled weight decay */
    float p = __fmul_rn(param, hp.decay);

    /* update the first moment: torch's lerp(m, g, 1 - beta1), m + w * (g - m) */
    float m = exp_avg;
    m = __fadd_rn(m, __fmul_rn(hp.beta1_weight, __fsub_rn(g, m)));

    /* update the second moment: v * beta2 + ((1 - beta2) * g) * g */
    float v = __fmul_rn(exp_avg_sq, hp.beta2);
    v = __fadd_rn(v, __fmul_rn(__fmul_rn(hp.beta2_weight, g), g));

    /* the bias-corrected step: sqrt(v) * (1 / sqrt(1 - beta2^t)) + eps, as the CPU takes it */
    float root = __fsqrt_rn(v);
    float denom = __fadd_rn(__fmul_rn(root, hp.bias_correction2_rsqrt), hp.eps);
    p = __fsub_rn(p, __fmul_rn(hp.step_size, __fdiv_rn(m, denom)));

    param = p;
    exp_avg = m;
    exp_avg_sq = v;
    return root;
}

#endif /* RLHFZ_CUDA_ADAMW_ELEMENT_CUH */
