/* torch's CPU bernoulli_(p) draws, made faster and the same: the masks a padded model's dropout draws, bit for bit.

   On a CPU where torch does not take MKL's path (any CPU not Intel's, or a build without MKL), `t.bernoulli_(p)`
   fills t element by element, in memory order, from the default generator: a 32-bit mt19937 (at::mt19937), two draws
   an element joined into 64 bits (the first the high half), kept when (bits & (2^53 - 1)) * 2^-53 < p
   (aten/src/ATen/native/cpu/DistributionTemplates.h, bernoulli_kernel; ATen/core/DistributionsHelper.h). This is
   that loop with the state taken from and given back to torch's generator state (torch.get_rng_state's bytes),
   the comparison done on integers (the same outcome), and the compiler free to vectorize. trainscope.dropout_draws
   builds it, and checks it against torch's own bernoulli_ before using it. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define N 624
#define M 397
#define MATRIX_A 0x9908b0dfu
#define UPPER 0x80000000u
#define LOWER 0x7fffffffu

/* CPUGeneratorImplState: legacy_pod { uint64 the_initial_seed; int left; int seeded; uint64 next; uint64 state[624];
   ... } */
#define LEFT_AT 8
#define NEXT_AT 16
#define STATE_AT 24
#define STATE_END (STATE_AT + 8 * N) /* 5016: the bytes read and written (torch 2.x's state is 5056) */

static inline uint32_t twist(uint32_t u, uint32_t v) {
    return (((u & UPPER) | (v & LOWER)) >> 1) ^ ((v & 1u) ? MATRIX_A : 0u);
}

static void next_state(uint32_t *s) {
    int i;
    for (i = 0; i < N - M; i++) s[i] = s[i + M] ^ twist(s[i], s[i + 1]);
    for (; i < N - 1; i++) s[i] = s[i + M - N] ^ twist(s[i], s[i + 1]);
    s[N - 1] = s[M - 1] ^ twist(s[N - 1], s[0]);
}

static inline uint32_t temper(uint32_t y) {
    y ^= (y >> 11);
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= (y >> 18);
    return y;
}

/* kind: 0 float32 (1.0f), 1 bfloat16 (0x3f80), 2 float16 (0x3c00) */
static inline void put(void *out, size_t k, int kind, int keep) {
    if (kind == 0) ((float *)out)[k] = keep ? 1.0f : 0.0f;
    else ((uint16_t *)out)[k] = keep ? (kind == 1 ? 0x3f80 : 0x3c00) : 0;
}

/* Fills out[0..n) as `out.bernoulli_(p)` would and advances the state in `rng` (torch.get_rng_state()'s bytes,
   rng_bytes of them) as torch's generator would advance. Returns 0, or -1 for a state this does not know (one
   shorter than STATE_END is never read). */
int bernoulli_fill(uint8_t *rng, size_t rng_bytes, void *out, size_t n, double p, int kind) {
    uint32_t s[N];
    uint64_t wide[N], next64;
    int32_t left;
    if (rng_bytes < STATE_END) return -1;
    memcpy(&left, rng + LEFT_AT, 4);
    memcpy(&next64, rng + NEXT_AT, 8);
    memcpy(wide, rng + STATE_AT, 8 * N);
    if (left <= 0 || left > N || next64 > N || kind < 0 || kind > 2) return -1;
    for (int i = 0; i < N; i++) s[i] = (uint32_t)wide[i];
    uint32_t next = (uint32_t)next64;
    /* bits * 2^-53 < p  <=>  bits < p * 2^53 (exact: a power of two)  <=>  bits < ceil(p * 2^53) */
    const double top = 9007199254740992.0; /* 2^53 */
    const uint64_t mask53 = (1ull << 53) - 1;
    double scaled = p * top;
    uint64_t below;
    if (!(scaled > 0)) below = 0; /* p <= 0 (or NaN: torch refuses it before) */
    else if (scaled >= top) below = 1ull << 53;
    else {
        below = (uint64_t)scaled;
        if ((double)below < scaled) below++;
    }
    int pending = 0; /* the high half of an element drawn before the state's words ran out */
    uint32_t high = 0;
    size_t k = 0;
    while (k < n) {
        if (left == 1) { /* torch: --left reaches 0, the state is twisted, left = N, next = 0 */
            next_state(s);
            left = N + 1;
            next = 0;
        }
        uint32_t j = next, end = next + (uint32_t)(left - 1);
        if (pending) {
            uint64_t bits = (((uint64_t)high << 32) | temper(s[j++])) & mask53;
            put(out, k++, kind, bits < below);
            pending = 0;
        }
        size_t pairs = (end - j) / 2;
        if (pairs > n - k) pairs = n - k;
        const uint32_t *w = s + j;
        if (kind == 0) {
            float *o = (float *)out + k;
            for (size_t q = 0; q < pairs; q++) {
                uint64_t bits = (((uint64_t)temper(w[2 * q]) << 32) | temper(w[2 * q + 1])) & mask53;
                o[q] = bits < below ? 1.0f : 0.0f;
            }
        } else {
            uint16_t *o = (uint16_t *)out + k, one = kind == 1 ? 0x3f80 : 0x3c00;
            for (size_t q = 0; q < pairs; q++) {
                uint64_t bits = (((uint64_t)temper(w[2 * q]) << 32) | temper(w[2 * q + 1])) & mask53;
                o[q] = bits < below ? one : 0;
            }
        }
        j += 2 * (uint32_t)pairs;
        k += pairs;
        if (k < n && j < end) {
            high = temper(s[j++]);
            pending = 1;
        }
        left -= (int32_t)(j - next);
        next = j;
    }
    for (int i = 0; i < N; i++) wide[i] = s[i];
    next64 = next;
    memcpy(rng + LEFT_AT, &left, 4);
    memcpy(rng + NEXT_AT, &next64, 8);
    memcpy(rng + STATE_AT, wide, 8 * N);
    return 0;
}
