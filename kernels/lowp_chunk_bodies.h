/* lowp_chunk_bodies.h: AdamW over bf16 or int8 moments, written once over a
 * level's SIMD layer (internal).
 *
 * Included by a level's source file after simd_chunk_bodies.h (whose layer,
 * adamw_vconsts and load/store helpers it uses); it defines that level's
 * rlhfz_lowp_<dtype>_chunk_<level> functions. Each lane repeats
 * lowp_chunks_scalar.c operation for operation, and the tails call it, so
 * every level gives the same bits. The layer adds integer lanes:
 *   simd_i32                 W 32-bit integers
 *   simd_i32_set1, simd_i32_lanes(base)      a constant; base, base + 1, ...
 *   simd_i32_xor, simd_i32_and, simd_i32_mul (low 32 bits), simd_i32_shr15/16
 *   simd_i32_to_f32, simd_f32_to_i32_nearest (ties to even), simd_f32_to_i32_trunc
 *   simd_abs, simd_max, simd_min             x86's: a NaN in a yields b
 *   simd_q_signed_square_load   W int8 codes q as float(q * |q|)
 *   simd_q_square_load          W uint8 codes q as float(q * q)
 *   simd_q_signed_store         W codes (|q| <= 127), negated by a float's sign
 *   simd_q_unsigned_store       W codes in 0..255
 *   simd_narrow_bf16_stochastic simd_f32 -> bf16 with 16 random bits per lane
 */
#ifndef SIMD_WIDTH
#error "include lowp_chunk_bodies.h from a level's source file, after simd_chunk_bodies.h"
#endif

#include "lowp_state.h"

#define W SIMD_WIDTH
#define OUT_NONE (-1)   /* param_out kinds: a dtype, or none (as simd_chunk_bodies.h) */

/* ---- the counter hash, W lanes at a time ---------------------------------- */

SIMD_INLINE simd_i32 mix32_vec(simd_i32 x)
{
    x = simd_i32_xor(x, simd_i32_shr16(x));
    x = simd_i32_mul(x, simd_i32_set1(0x7FEB352Du));
    x = simd_i32_xor(x, simd_i32_shr15(x));
    x = simd_i32_mul(x, simd_i32_set1(0x846CA68Bu));
    return simd_i32_xor(x, simd_i32_shr16(x));
}

/* Whether elements [i, i + W) share the high half of their index, so one
 * index key serves them (else the scalar level takes the vector). */
SIMD_INLINE int one_index_key(const rlhfz_adamw_lowp_shard *shard, size_t i)
{
    uint64_t index = shard->index_base + i;
    return (uint32_t)index <= UINT32_MAX - (W - 1);
}

/* The random bits of elements [i, i + W), as rlhfz_round_bits. */
SIMD_INLINE simd_i32 random_vec(const rlhfz_adamw_lowp_shard *shard, size_t i)
{
    uint64_t index = shard->index_base + i;
    uint32_t key = rlhfz_index_key(shard->rounding_key, index);
    return mix32_vec(simd_i32_xor(simd_i32_lanes((uint32_t)index), simd_i32_set1(key)));
}

SIMD_INLINE simd_f32 unit16_vec(simd_i32 random16)
{
    return simd_mul(simd_i32_to_f32(random16), simd_set1(1.0f / 65536.0f));
}

/* ---- the step over decoded moments ---------------------------------------- */

/* One vector of rlhfz_lowp_element_scalar: m and v in and out; returns sqrt(v). */
SIMD_INLINE simd_f32 lowp_step_vec(const rlhfz_adamw_lowp_shard *shard, const adamw_vconsts *k,
                                   size_t i, rlhfz_dtype grad_dtype, int out, simd_f32 *m,
                                   simd_f32 *v)
{
    simd_f32 g = simd_mul(load_as_f32(shard->grad, grad_dtype, i), k->grad_scale);

    /* decoupled weight decay */
    simd_f32 p = simd_mul(simd_loadu(shard->master + i), k->decay);

    /* update the first moment: m + (1 - beta1) * (g - m) */
    *m = simd_add(*m, simd_mul(k->beta1_weight, simd_sub(g, *m)));

    /* update the second moment: v * beta2 + (1 - beta2) * g * g */
    *v = simd_add(simd_mul(*v, k->beta2), simd_mul(simd_mul(k->beta2_weight, g), g));

    /* the bias-corrected step */
    simd_f32 root = simd_sqrt(*v);
    simd_f32 denom = simd_add(simd_mul(root, k->bias_correction2_rsqrt), k->eps);
    p = simd_sub(p, simd_mul(k->step_size, simd_div(*m, denom)));

    simd_storeu(shard->master + i, p);
    if (out != OUT_NONE)
        store_from_f32(shard->param_out, (rlhfz_dtype)out, i, p);
    return root;
}

/* ---- bf16 moments --------------------------------------------------------- */

SIMD_INLINE void bf16_loop(const rlhfz_adamw_lowp_shard *shard, const rlhfz_adamw_consts *c,
                           size_t begin, size_t end, rlhfz_dtype grad_dtype, int out)
{
    adamw_vconsts k = adamw_vconsts_of(c);
    uint16_t *exp_avg = shard->exp_avg, *exp_avg_sq = shard->exp_avg_sq;
    int stochastic = shard->rounding == RLHFZ_ROUND_STOCHASTIC;
    size_t i = begin;
    for (; i + W <= end; i += W) {
        if (stochastic && !one_index_key(shard, i)) {
            rlhfz_lowp_bf16_chunk_scalar(shard, c, i, i + W);
            continue;
        }
        simd_f32 m = simd_widen_bf16(simd_half_loadu(exp_avg + i));
        simd_f32 v = simd_widen_bf16(simd_half_loadu(exp_avg_sq + i));
        lowp_step_vec(shard, &k, i, grad_dtype, out, &m, &v);
        if (stochastic) {
            simd_i32 random = random_vec(shard, i);
            simd_half_storeu(exp_avg + i,
                             simd_narrow_bf16_stochastic(m, simd_i32_shr16(random)));
            simd_half_storeu(exp_avg_sq + i, simd_narrow_bf16_stochastic(
                                                 v, simd_i32_and(random, simd_i32_set1(0xFFFFu))));
        } else {
            simd_half_storeu(exp_avg + i, simd_narrow_bf16(m));
            simd_half_storeu(exp_avg_sq + i, simd_narrow_bf16(v));
        }
    }
    rlhfz_lowp_bf16_chunk_scalar(shard, c, i, end);
}

/* ---- int8 moments --------------------------------------------------------- */

/* The largest lane of x (lanes compared as the scalar loop compares them). */
SIMD_INLINE float largest_lane(simd_f32 x)
{
    float lanes[W];
    simd_storeu(lanes, x);
    float largest = lanes[0];
    for (int j = 1; j < W; j++)
        largest = lanes[j] > largest ? lanes[j] : largest;
    return largest;
}

/* Whether every lane of a sum of (x - x) terms is still 0: none was Inf or NaN. */
SIMD_INLINE int all_finite(simd_f32 sum)
{
    float lanes[W];
    simd_storeu(lanes, sum);
    for (int j = 0; j < W; j++)
        if (lanes[j] != 0.0f)
            return 0;
    return 1;
}

/* W codes of one moment, as rlhfz_q_code. */
SIMD_INLINE simd_i32 code_vec(simd_f32 x, float top, int stochastic, simd_i32 random16)
{
    if (stochastic)
        return simd_f32_to_i32_trunc(simd_min(simd_add(x, unit16_vec(random16)), simd_set1(top)));
    return simd_f32_to_i32_nearest(simd_min(x, simd_set1(top)));
}

SIMD_INLINE void int8_block(const rlhfz_adamw_lowp_shard *shard, const rlhfz_adamw_consts *c,
                            const adamw_vconsts *k, size_t begin, size_t end,
                            rlhfz_dtype grad_dtype, int out)
{
    size_t index = begin / RLHFZ_QBLOCK;
    int8_t *codes = shard->exp_avg;
    uint8_t *sq_codes = shard->exp_avg_sq;
    rlhfz_q_block block = {.scale = shard->exp_avg_scale[index],
                           .sq_scale = shard->exp_avg_sq_scale[index]};
    simd_f32 scale = simd_set1(block.scale), sq_scale = simd_set1(block.sq_scale);

    /* decode, step, and find the new scales */
    simd_f32 zero = simd_set1(0.0f);
    simd_f32 largest = zero, sq_largest = zero, nonfinite = zero, sq_nonfinite = zero;
    /* the codes' fractions of their scales, as rlhfz_q_exp_avg_value takes them */
    simd_f32 exp_avg_unit = simd_set1(1.0f / (127.0f * 127.0f));
    simd_f32 sq_unit = simd_set1(1.0f / (255.0f * 255.0f));
    size_t i = begin;
    for (; i + W <= end; i += W) {
        simd_f32 m = simd_mul(simd_mul(simd_q_signed_square_load(codes + i), exp_avg_unit), scale);
        simd_f32 root = simd_mul(simd_mul(simd_q_square_load(sq_codes + i), sq_unit), sq_scale);
        simd_f32 v = simd_mul(root, root);
        root = lowp_step_vec(shard, k, i, grad_dtype, out, &m, &v);
        simd_storeu(block.moments + (i - begin), m);
        simd_storeu(block.roots + (i - begin), root);

        simd_f32 magnitude = simd_abs(m);
        largest = simd_max(magnitude, largest);
        nonfinite = simd_add(nonfinite, simd_sub(magnitude, magnitude));
        sq_largest = simd_max(root, sq_largest);
        sq_nonfinite = simd_add(sq_nonfinite, simd_sub(root, root));
    }
    block.largest = largest_lane(largest);
    block.sq_largest = largest_lane(sq_largest);
    block.finite = all_finite(nonfinite) && isfinite(block.largest);
    block.sq_finite = all_finite(sq_nonfinite) && isfinite(block.sq_largest);
    rlhfz_lowp_int8_step_scalar(shard, c, begin, i, end, &block);

    /* encode against them */
    float encode = rlhfz_q_encode(block.largest, block.finite, &shard->exp_avg_scale[index]);
    float sq_encode =
        rlhfz_q_encode(block.sq_largest, block.sq_finite, &shard->exp_avg_sq_scale[index]);
    simd_f32 encode_vec = simd_set1(encode), sq_encode_vec = simd_set1(sq_encode);
    int stochastic = shard->rounding == RLHFZ_ROUND_STOCHASTIC;
    simd_i32 low16 = simd_i32_set1(0xFFFFu), none = simd_i32_set1(0);
    for (i = begin; i + W <= end; i += W) {
        if (stochastic && !one_index_key(shard, i))
            break;
        simd_f32 m = block.finite ? simd_loadu(block.moments + (i - begin)) : zero;
        simd_f32 root = block.sq_finite ? simd_loadu(block.roots + (i - begin)) : zero;
        simd_i32 random = stochastic ? random_vec(shard, i) : none;

        simd_f32 x = simd_mul(simd_sqrt(simd_mul(simd_abs(m), encode_vec)),
                              simd_set1(RLHFZ_Q_EXP_AVG_MAX));
        simd_q_signed_store(codes + i,
                            code_vec(x, RLHFZ_Q_EXP_AVG_MAX, stochastic, simd_i32_shr16(random)),
                            m);
        simd_f32 sq_x = simd_mul(simd_sqrt(simd_mul(root, sq_encode_vec)),
                                 simd_set1(RLHFZ_Q_EXP_AVG_SQ_MAX));
        simd_q_unsigned_store(sq_codes + i, code_vec(sq_x, RLHFZ_Q_EXP_AVG_SQ_MAX, stochastic,
                                                     simd_i32_and(random, low16)));
    }
    for (; i < end; i++)
        rlhfz_lowp_int8_encode_scalar(shard, i, block.finite ? block.moments[i - begin] : 0.0f,
                                      block.sq_finite ? block.roots[i - begin] : 0.0f, encode,
                                      sq_encode);
}

SIMD_INLINE void int8_loop(const rlhfz_adamw_lowp_shard *shard, const rlhfz_adamw_consts *c,
                           size_t begin, size_t end, rlhfz_dtype grad_dtype, int out)
{
    adamw_vconsts k = adamw_vconsts_of(c);
    for (size_t b = begin; b < end; b += RLHFZ_QBLOCK)
        int8_block(shard, c, &k, b, b + RLHFZ_QBLOCK < end ? b + RLHFZ_QBLOCK : end,
                   grad_dtype, out);
}

/* ---- one loop per (grad dtype, param_out kind), known at compile time ----- */

#define LOWP_FOR_OUT(loop, shard, c, begin, end, grad_dtype)                             \
    do {                                                                                 \
        if (!(shard)->param_out)                                                         \
            loop(shard, c, begin, end, grad_dtype, OUT_NONE);                            \
        else if ((shard)->param_dtype == RLHFZ_DTYPE_BF16)                               \
            loop(shard, c, begin, end, grad_dtype, RLHFZ_DTYPE_BF16);                    \
        else if ((shard)->param_dtype == RLHFZ_DTYPE_F16)                                \
            loop(shard, c, begin, end, grad_dtype, RLHFZ_DTYPE_F16);                     \
        else                                                                             \
            loop(shard, c, begin, end, grad_dtype, RLHFZ_DTYPE_F32);                     \
    } while (0)

#define LOWP_FOR_GRAD(loop, shard, c, begin, end)                                        \
    do {                                                                                 \
        if ((shard)->grad_dtype == RLHFZ_DTYPE_BF16)                                     \
            LOWP_FOR_OUT(loop, shard, c, begin, end, RLHFZ_DTYPE_BF16);                  \
        else if ((shard)->grad_dtype == RLHFZ_DTYPE_F16)                                 \
            LOWP_FOR_OUT(loop, shard, c, begin, end, RLHFZ_DTYPE_F16);                   \
        else                                                                             \
            LOWP_FOR_OUT(loop, shard, c, begin, end, RLHFZ_DTYPE_F32);                   \
    } while (0)

void SIMD_NAME(rlhfz_lowp_bf16_chunk)(const rlhfz_adamw_lowp_shard *shard,
                                      const rlhfz_adamw_consts *c, size_t begin, size_t end)
{
    LOWP_FOR_GRAD(bf16_loop, shard, c, begin, end);
}

void SIMD_NAME(rlhfz_lowp_int8_chunk)(const rlhfz_adamw_lowp_shard *shard,
                                      const rlhfz_adamw_consts *c, size_t begin, size_t end)
{
    LOWP_FOR_GRAD(int8_loop, shard, c, begin, end);
}

#undef LOWP_FOR_GRAD
#undef LOWP_FOR_OUT
#undef OUT_NONE
#undef W
