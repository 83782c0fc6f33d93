/* traffic_floor.c: the memory traffic of an AdamW step with no arithmetic
 * to speak of, as a floor for the step benchmarks.
 *
 * One pass reads and writes the fp32 master, reads the fp32 grad, and reads
 * and writes two moments of `state_bytes` each (4: fp32, 2: bf16, 1: int8
 * codes), the bytes per element an optimizer step must move. The ratio of
 * two widths' times is the most that moving fewer bytes can buy on the
 * machine at the time. Built by benchmarks/test_bench_state_dtype.py with
 * the system C compiler and loaded through ctypes.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    float *master;
    const float *grad;
    unsigned char *exp_avg, *exp_avg_sq;
    size_t begin, end;
    int state_bytes;
} traffic_part;

/* Sixteen elements at a time in the compiler's vector types, so that every
 * width moves as whole vectors. The moments only need to be read and written
 * back changed: each takes an integer add at its own width. */
typedef float floats16 __attribute__((vector_size(64)));

#define MOMENTS(type)                                                          \
    do {                                                                       \
        typedef type codes16 __attribute__((vector_size(16 * sizeof(type))));  \
        unsigned char *m = part->exp_avg, *v = part->exp_avg_sq;               \
        size_t i = part->begin;                                                \
        for (; i + 16 <= part->end; i += 16) {                                 \
            floats16 p, g;                                                     \
            codes16 a, b;                                                      \
            memcpy(&p, part->master + i, sizeof p);                            \
            memcpy(&g, part->grad + i, sizeof g);                              \
            memcpy(&a, m + i * sizeof(type), sizeof a);                        \
            memcpy(&b, v + i * sizeof(type), sizeof b);                        \
            p = p * 0.999f + g;                                                \
            a = a + 1;                                                         \
            b = b + a;                                                         \
            memcpy(part->master + i, &p, sizeof p);                            \
            memcpy(m + i * sizeof(type), &a, sizeof a);                        \
            memcpy(v + i * sizeof(type), &b, sizeof b);                        \
        }                                                                      \
        for (; i < part->end; i++) {                                           \
            part->master[i] = part->master[i] * 0.999f + part->grad[i];        \
            ((type *)m)[i] = (type)(((type *)m)[i] + 1);                       \
            ((type *)v)[i] = (type)(((type *)v)[i] + ((type *)m)[i]);          \
        }                                                                      \
    } while (0)

static void *traffic_run(void *arg)
{
    traffic_part *part = arg;
    if (part->state_bytes == 4)
        MOMENTS(uint32_t);
    else if (part->state_bytes == 2)
        MOMENTS(uint16_t);
    else
        MOMENTS(uint8_t);
    return NULL;
}

/* One pass over n elements on `threads` threads (at most 64), each taking a
 * contiguous part as the optimizer's pool does. Returns 0, or -1 on bad
 * arguments. */
int traffic_pass(float *master, const float *grad, void *exp_avg, void *exp_avg_sq, size_t n,
                 int state_bytes, int threads)
{
    if (threads < 1 || threads > 64 || !(state_bytes == 1 || state_bytes == 2 || state_bytes == 4))
        return -1;
    traffic_part parts[64];
    pthread_t ids[64];
    size_t each = (n + threads - 1) / threads;
    for (int t = 0; t < threads; t++) {
        size_t begin = each * t < n ? each * t : n;
        size_t end = begin + each < n ? begin + each : n;
        parts[t] = (traffic_part){master, grad, exp_avg, exp_avg_sq, begin, end, state_bytes};
    }
    int started = 0;
    for (int t = 1; t < threads; t++, started++)
        if (pthread_create(&ids[t], NULL, traffic_run, &parts[t]) != 0)
            break;
    traffic_run(&parts[0]);
    for (int t = 1; t <= started; t++)
        pthread_join(ids[t], NULL);
    for (int t = started + 1; t < threads; t++)   /* threads that did not start */
        traffic_run(&parts[t]);
    return 0;
}
