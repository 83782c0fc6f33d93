/* lowp_chunk_bodies.h: AdamW over bf16 or int8 moments, written once over a
 * level's SIMD layer (internal).
 *
 * Included by a level's source file after simd_chunk_bodies.h (whose layer,
 * load/store helpers it uses); it defines that level's
 * rlhfz_lowp_<dtype>_chunk_<level> functions.
 *
 * The moments are updated with the reference's fp32 operations, so a level
 * gets the reference's bf16 moments bit for bit. Square roots and
 * divisions are the reciprocal estimates of the layer, and an int8 code is
 * decoded by one product per block instead of two: on 2 cores a divider
 * per element (and another square root per int8 element) cost more than
 * the bytes saved. The master, the int8 scales and codes therefore differ
 * from the reference in the last bits (a code by one where its position
 * sits within ~1e-3 of a cut). Every element, tails included, takes the
 * vector path, so a level gives the same bits wherever a shard part starts.
 *
 * The layer adds to simd_chunk_bodies.h's:
 *   simd_fmadd(a, b, c) a * b + c, simd_fnmadd(a, b, c) c - a * b (fused)
 *   simd_rsqrt_est, simd_rcp_est   1 / sqrt(x), 1 / x to ~2^-11 relative or better
 *   simd_rsqrt_fine          1 / sqrt(x) to ~2^-14 or better, for finite x > 0
 *   simd_rsqrt_refine(x, r)  r (simd_rsqrt_est(x)) brought to simd_rsqrt_fine's precision
 *   simd_i32                 W 32-bit integers
 *   simd_i32_set1, simd_i32_lanes(base)      a constant; base, base + 1, ...
 *   simd_i32_loadu, simd_i32_xor, simd_i32_add,
 *   simd_i32_mul (low 32 bits), simd_i32_shr16
 *   simd_f32_to_i32_nearest (ties to even), simd_f32_to_i32_trunc
 *   simd_abs, simd_max, simd_min             x86's: a NaN in a yields b
 *   simd_max_bits(a, b)      the lane whose bits are the larger unsigned: for
 *                            floats without a sign bit their order, with Inf
 *                            and then every NaN (of either sign) above all
 *   simd_q_signed_load          W int8 codes q as float(q)
 *   simd_q_square_load          W uint8 codes q as float(q * q)
 *   simd_q_signed_store         W codes: signed positions (|x| < 127.5) to
 *                               nearest even
 *   simd_q_unsigned_store       W codes, above 255 saturating to 255
 *   simd_narrow_bf16_stochastic simd_f32 -> bf16 with 16 random bits per lane,
 *                               as rlhfz_f32_to_bf16_stochastic
 */
#ifndef SIMD_WIDTH
#error "include lowp_chunk_bodies.h from a level's source file, after simd_chunk_bodies.h"
#endif

#include <string.h>

#include "lowp_state.h"

#define W SIMD_WIDTH
#define OUT_NONE (-1)   /* param_out kinds: a dtype, or none (as simd_chunk_bodies.h) */

/* ---- the counter hash, W lanes at a time ---------------------------------- */

/* rlhfz_round_bits16 over a run of whole vectors [begin, end), taken in
 * order. The high half of the indices, and so the index key, is one for the
 * whole run unless it crosses a multiple of 2^32; then each element keys
 * itself. The key is mixed once per run and the indices' low halves are
 * carried from vector to vector: on cores whose scalar and vector work share
 * ports, a mix per vector cost 3-12% of a step. */
typedef struct {
    int one_key;
    simd_i32 key, lanes;    /* the key, and the low halves of the next indices */
    uint64_t next;          /* the next vector's first index */
} random16_run;

SIMD_INLINE random16_run random16_run_of(const rlhfz_adamw_lowp_shard *shard, size_t begin,
                                         size_t end)
{
    uint64_t first = shard->index_base + begin, last = shard->index_base + end - 1;
    random16_run run = {.one_key = end <= begin || first >> 32 == last >> 32, .next = first};
    run.key = simd_i32_set1(rlhfz_index_key(shard->rounding_key, first));
    run.lanes = simd_i32_lanes((uint32_t)first);
    return run;
}

SIMD_INLINE simd_i32 random16_next(const rlhfz_adamw_lowp_shard *shard, random16_run *run)
{
    uint64_t index = run->next;
    run->next += W;
    if (run->one_key) {
        simd_i32 x = simd_i32_xor(run->lanes, run->key);
        run->lanes = simd_i32_add(run->lanes, simd_i32_set1(W));
        return simd_i32_shr16(simd_i32_mul(x, simd_i32_set1(0x9E3779B1u)));
    }
    uint32_t lanes[W];
    for (int j = 0; j < W; j++)
        lanes[j] = rlhfz_element_random16(shard->rounding, shard->rounding_key, index + j);
    return simd_i32_loadu(lanes);
}

/* ---- the step over decoded moments ---------------------------------------- */

typedef struct {
    simd_f32 grad_scale, decay, beta1_weight, beta2, beta2_weight;
    /* step_size / denom = r / (root_weight + eps_weight * r), r = 1 / sqrt(v):
     * one reciprocal, and a v of 0 or Inf needs no special case */
    simd_f32 root_weight, eps_weight;
    simd_f32 smallest;   /* keeps a zero off the reciprocal square root */
    simd_f32 one, huge;  /* min(v * huge * huge, one): 1 where v > 0, else 0 */
    int scaled;          /* grad_scale is not 1 */
    int still;           /* lr = 0: the master only decays */
} lowp_vconsts;

SIMD_INLINE lowp_vconsts lowp_vconsts_of(const rlhfz_adamw_consts *c)
{
    double step = c->step_size;
    int still = !(step > 0);
    lowp_vconsts k = {
        .grad_scale = simd_set1(c->grad_scale),
        .decay = simd_set1(c->decay),
        .beta1_weight = simd_set1(c->beta1_weight),
        .beta2 = simd_set1(c->beta2),
        .beta2_weight = simd_set1(c->beta2_weight),
        .root_weight = simd_set1(still ? 1.0f : (float)(c->bias_correction2_rsqrt / step)),
        .eps_weight = simd_set1(still ? 1.0f : (float)(c->eps / step)),
        .smallest = simd_set1(1.17549435e-38f),
        .one = simd_set1(1.0f),
        .huge = simd_set1(0x1p100f),
        .scaled = c->grad_scale != 1.0f,
        .still = still,
    };
    return k;
}

/* One vector of the step (lowp_chunks_scalar.c's element_step, with
 * estimates): m and v in and out; returns the
 * estimate of 1 / sqrt(v) it stepped with (of 1 / sqrt(smallest) for 0). */
SIMD_INLINE simd_f32 lowp_step_vec(const rlhfz_adamw_lowp_shard *shard, const lowp_vconsts *k,
                                   size_t i, rlhfz_dtype grad_dtype, int out, simd_f32 *m,
                                   simd_f32 *v)
{
    simd_f32 g = load_as_f32(shard->grad, grad_dtype, i);
    if (k->scaled)
        g = simd_mul(g, k->grad_scale);

    /* decoupled weight decay */
    simd_f32 p = simd_mul(simd_loadu(shard->master + i), k->decay);

    /* the moments, as the reference rounds them */
    *m = simd_add(*m, simd_mul(k->beta1_weight, simd_sub(g, *m)));
    *v = simd_add(simd_mul(*v, k->beta2), simd_mul(simd_mul(k->beta2_weight, g), g));

    /* the bias-corrected step, through reciprocal estimates (smallest
     * first: a NaN v stays NaN, and steps the master to NaN as the
     * reference does) */
    simd_f32 r = simd_rsqrt_est(simd_max(k->smallest, *v));
    if (!k->still) {
        simd_f32 step = simd_mul(r, simd_rcp_est(simd_fmadd(k->eps_weight, r, k->root_weight)));
        p = simd_fnmadd(*m, step, p);
    }

    simd_storeu(shard->master + i, p);
    if (out != OUT_NONE)
        store_from_f32(shard->param_out, (rlhfz_dtype)out, i, p);
    return r;
}

/* ---- short ends, through a padded copy ------------------------------------ */

/* Elements [begin, end) of a shard, at most RLHFZ_QBLOCK, copied into
 * buffers padded with zeros to whole vectors: a view the vector loops run
 * over from 0, with the index base (and so the random bits) of the place the
 * elements came from. Zero grads and moments step to zero and never raise a
 * block's largest value. */
typedef struct {
    rlhfz_adamw_lowp_shard view;
    float master[RLHFZ_QBLOCK];
    unsigned char grad[RLHFZ_QBLOCK * 4], param_out[RLHFZ_QBLOCK * 4];
    uint16_t exp_avg[RLHFZ_QBLOCK], exp_avg_sq[RLHFZ_QBLOCK];
    float scale, sq_scale;
} padded_part;

static size_t padded_part_of(padded_part *part, const rlhfz_adamw_lowp_shard *shard,
                             size_t begin, size_t end, size_t state_bytes)
{
    size_t n = end - begin, padded = (n + W - 1) / W * W;
    memset(part, 0, sizeof *part);
    part->view = *shard;
    part->view.index_base = shard->index_base + begin;
    part->view.n = padded;
    memcpy(part->master, shard->master + begin, n * 4);
    part->view.master = part->master;
    size_t grad_bytes = rlhfz_dtype_size(shard->grad_dtype);
    memcpy(part->grad, (const unsigned char *)shard->grad + begin * grad_bytes, n * grad_bytes);
    part->view.grad = part->grad;
    if (shard->param_out)
        part->view.param_out = part->param_out;
    memcpy(part->exp_avg, (const unsigned char *)shard->exp_avg + begin * state_bytes,
           n * state_bytes);
    memcpy(part->exp_avg_sq, (const unsigned char *)shard->exp_avg_sq + begin * state_bytes,
           n * state_bytes);
    part->view.exp_avg = part->exp_avg;
    part->view.exp_avg_sq = part->exp_avg_sq;
    if (shard->state_dtype == RLHFZ_STATE_INT8) {
        part->scale = shard->exp_avg_scale[begin / RLHFZ_QBLOCK];
        part->sq_scale = shard->exp_avg_sq_scale[begin / RLHFZ_QBLOCK];
        part->view.exp_avg_scale = &part->scale;
        part->view.exp_avg_sq_scale = &part->sq_scale;
    }
    return padded;
}

static void padded_part_back(const padded_part *part, const rlhfz_adamw_lowp_shard *shard,
                             size_t begin, size_t end, size_t state_bytes)
{
    size_t n = end - begin;
    memcpy(shard->master + begin, part->master, n * 4);
    if (shard->param_out) {
        size_t out_bytes = rlhfz_dtype_size(shard->param_dtype);
        memcpy((unsigned char *)shard->param_out + begin * out_bytes, part->param_out,
               n * out_bytes);
    }
    memcpy((unsigned char *)shard->exp_avg + begin * state_bytes, part->exp_avg,
           n * state_bytes);
    memcpy((unsigned char *)shard->exp_avg_sq + begin * state_bytes, part->exp_avg_sq,
           n * state_bytes);
    if (shard->state_dtype == RLHFZ_STATE_INT8) {
        shard->exp_avg_scale[begin / RLHFZ_QBLOCK] = part->scale;
        shard->exp_avg_sq_scale[begin / RLHFZ_QBLOCK] = part->sq_scale;
    }
}

/* ---- bf16 moments --------------------------------------------------------- */

/* Whole vectors of [begin, end), end - begin a multiple of W. */
SIMD_INLINE void bf16_vectors(const rlhfz_adamw_lowp_shard *shard, const lowp_vconsts *k,
                              size_t begin, size_t end, rlhfz_dtype grad_dtype, int out)
{
    uint16_t *exp_avg = shard->exp_avg, *exp_avg_sq = shard->exp_avg_sq;
    int stochastic = shard->rounding == RLHFZ_ROUND_STOCHASTIC;
    random16_run run = random16_run_of(shard, begin, end);
    for (size_t i = begin; i < end; i += W) {
        prefetch_step_ahead(shard->grad, grad_dtype, shard->master, exp_avg, exp_avg_sq, 2, i);
        simd_f32 m = simd_widen_bf16(simd_half_loadu(exp_avg + i));
        simd_f32 v = simd_widen_bf16(simd_half_loadu(exp_avg_sq + i));
        lowp_step_vec(shard, k, i, grad_dtype, out, &m, &v);
        simd_half_storeu(exp_avg + i, simd_narrow_bf16(m));
        simd_half_storeu(exp_avg_sq + i, stochastic ? simd_narrow_bf16_stochastic(
                                                          v, random16_next(shard, &run))
                                                    : simd_narrow_bf16(v));
    }
}

SIMD_INLINE void bf16_loop(const rlhfz_adamw_lowp_shard *shard, const rlhfz_adamw_consts *c,
                           size_t begin, size_t end, rlhfz_dtype grad_dtype, int out)
{
    lowp_vconsts k = lowp_vconsts_of(c);
    size_t whole = begin + (end - begin) / W * W;
    bf16_vectors(shard, &k, begin, whole, grad_dtype, out);
    if (whole == end)
        return;
    padded_part part;
    size_t padded = padded_part_of(&part, shard, whole, end, 2);
    bf16_vectors(&part.view, &k, 0, padded, grad_dtype, out);
    padded_part_back(&part, shard, whole, end, 2);
}

/* ---- int8 moments --------------------------------------------------------- */

/* The largest lane of x, by simd_max_bits's order. */
SIMD_INLINE float largest_lane(simd_f32 x)
{
    float lanes[W];
    simd_storeu(lanes, x);
    uint32_t largest = 0;
    for (int j = 0; j < W; j++) {
        uint32_t bits = rlhfz_f32_bits(lanes[j]);
        largest = bits > largest ? bits : largest;
    }
    return rlhfz_f32_from_bits(largest);
}

/* W exp_avg_sq codes at x = 255 * position (position in [0, 1]): nearest,
 * or up with probability of the distance from 16 random bits, as
 * rlhfz_q_code; x in 1/65536ths for stochastic rounding. A code above 255
 * (by rounding) saturates in the store. */
SIMD_INLINE simd_i32 sq_code_vec(simd_f32 x, int stochastic, simd_i32 random16)
{
    if (!stochastic)
        return simd_f32_to_i32_nearest(x);
    return simd_i32_shr16(simd_i32_add(simd_f32_to_i32_trunc(x), random16));
}

/* A block's codes against its new scales: exp_avg's position is
 * m * (encode * 127), rounded to nearest; exp_avg_sq's is
 * v^(1/4) * sqrt(sq_encode) * 255, and at least code 1's where v > 0
 * (rlhfz_q_exp_avg_sq_code says why). A fourth root of a v > 0 is at least
 * ~1e-11, so times 2^64 it is above any code's position. */
SIMD_INLINE void int8_codes(const rlhfz_adamw_lowp_shard *shard,
                            size_t begin, size_t end, const float *moments,
                            const float *fourth_roots, float encode, float sq_encode,
                            const int stochastic)
{
    int8_t *codes = shard->exp_avg;
    uint8_t *sq_codes = shard->exp_avg_sq;
    float top = RLHFZ_Q_EXP_AVG_MAX, sq_top = RLHFZ_Q_EXP_AVG_SQ_MAX;
    simd_f32 encode_vec = simd_set1(encode * top);
    float fixed = stochastic ? 65536.0f : 1.0f;   /* stochastic positions in 1/65536ths */
    simd_f32 sq_encode_vec = simd_set1(sqrtf(sq_encode) * sq_top * fixed);
    simd_f32 code_one = simd_set1(fixed), above_any = simd_set1(0x1p64f);
    simd_i32 none = simd_i32_set1(0);
    random16_run run = random16_run_of(shard, begin, end);
    for (size_t i = begin; i < end; i += W) {
        simd_q_signed_store(codes + i, simd_mul(simd_loadu(moments + (i - begin)), encode_vec));
        simd_f32 fourth = simd_loadu(fourth_roots + (i - begin));
        simd_f32 sq_x = simd_mul(fourth, sq_encode_vec);
        sq_x = simd_max(sq_x, simd_min(simd_mul(fourth, above_any), code_one));
        simd_i32 random16 = stochastic ? random16_next(shard, &run) : none;
        simd_q_unsigned_store(sq_codes + i, sq_code_vec(sq_x, stochastic, random16));
    }
}

/* One block of whole vectors (end - begin a multiple of W). */
SIMD_INLINE void int8_block(const rlhfz_adamw_lowp_shard *shard, const lowp_vconsts *k,
                            size_t begin, size_t end, rlhfz_dtype grad_dtype, int out)
{
    size_t index = begin / RLHFZ_QBLOCK;
    int8_t *codes = shard->exp_avg;
    uint8_t *sq_codes = shard->exp_avg_sq;
    /* the new exp_avg, and estimates of exp_avg_sq^(1/4) (the position of
     * its code is that over the scale's square root) */
    float moments[RLHFZ_QBLOCK], fourth_roots[RLHFZ_QBLOCK];

    /* decode, step, and find the new scales. A code's value is its fraction
     * (rlhfz_q_exp_avg_value) times the scale in one product: one rounding
     * more than the reference, an ulp at most. */
    simd_f32 m_decode = simd_set1(shard->exp_avg_scale[index] * (1.0f / 127.0f));
    simd_f32 root_decode = simd_set1(shard->exp_avg_sq_scale[index] * (1.0f / (255.0f * 255.0f)));
    /* |exp_avg| and exp_avg_sq have no sign bit, or are NaN: their largest
     * bits are their largest value, and Inf or NaN if any lane is */
    simd_f32 largest = simd_set1(0.0f), v_largest = largest;
    for (size_t i = begin; i < end; i += W) {
        prefetch_step_ahead(shard->grad, grad_dtype, shard->master, codes, sq_codes, 1, i);
        simd_f32 m = simd_mul(simd_q_signed_load(codes + i), m_decode);
        simd_f32 root = simd_mul(simd_q_square_load(sq_codes + i), root_decode);
        simd_f32 v = simd_mul(root, root);
        simd_f32 r = lowp_step_vec(shard, k, i, grad_dtype, out, &m, &v);
        r = simd_rsqrt_refine(simd_max(k->smallest, v), r);
        /* 0 where v is: int8_codes keeps every other v off code 0 */
        simd_f32 positive = simd_min(simd_mul(simd_mul(v, k->huge), k->huge), k->one);
        simd_storeu(moments + (i - begin), m);
        simd_storeu(fourth_roots + (i - begin), simd_mul(simd_rsqrt_fine(r), positive));
        largest = simd_max_bits(largest, simd_abs(m));
        v_largest = simd_max_bits(v_largest, v);
    }
    /* the scales, exactly: sqrt is monotone, so the largest root is the
     * root of the largest v */
    float m_largest = largest_lane(largest), sq_largest = sqrtf(largest_lane(v_largest));
    int finite = isfinite(m_largest), sq_finite = isfinite(sq_largest);
    float encode = rlhfz_q_encode(m_largest, finite, &shard->exp_avg_scale[index]);
    float sq_encode = rlhfz_q_encode(sq_largest, sq_finite, &shard->exp_avg_sq_scale[index]);

    /* a block that is not finite keeps all-zero codes under its NaN scale */
    if (!finite)
        memset(moments, 0, sizeof moments);
    if (!sq_finite)
        memset(fourth_roots, 0, sizeof fourth_roots);
    if (shard->rounding == RLHFZ_ROUND_STOCHASTIC)
        int8_codes(shard, begin, end, moments, fourth_roots, encode, sq_encode, 1);
    else
        int8_codes(shard, begin, end, moments, fourth_roots, encode, sq_encode, 0);
}

SIMD_INLINE void int8_loop(const rlhfz_adamw_lowp_shard *shard, const rlhfz_adamw_consts *c,
                           size_t begin, size_t end, rlhfz_dtype grad_dtype, int out)
{
    lowp_vconsts k = lowp_vconsts_of(c);
    size_t b = begin;
    for (; b + RLHFZ_QBLOCK <= end; b += RLHFZ_QBLOCK)
        int8_block(shard, &k, b, b + RLHFZ_QBLOCK, grad_dtype, out);
    if (b == end)
        return;
    /* a short last block */
    padded_part part;
    size_t padded = padded_part_of(&part, shard, b, end, 1);
    int8_block(&part.view, &k, 0, padded, grad_dtype, out);
    padded_part_back(&part, shard, b, end, 1);
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
