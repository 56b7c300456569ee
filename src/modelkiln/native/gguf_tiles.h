/* What both families of GGUF kernels (gguf_ops.c: the K-quants; gguf_q32.c: a scale per 32 weights)
 * share: the tile of sixteen output columns, how many rows of X meet a tile at once, how far ahead
 * the weights are asked for, and the small loads. */
#ifndef KILN_GGUF_TILES_H
#define KILN_GGUF_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TILE 16     /* output columns a tile: one 32-bit lane of a 64-byte vector each */
#define MAX_ROWS 4  /* rows of X a tile is multiplied with at once: their sums stay in registers */
/* The weights stream from memory once per call: asking for the (super-)block four ahead, and at
 * least PREFETCH_MIN_BYTES ahead, keeps enough reads in flight for one row of X to run at the
 * memory's speed (without it, one row ran slower than the per-row kernel this replaced once a
 * matrix left the caches; four of the 320-byte blocks of a Q4_1 tile were too near). */
#define PREFETCH_AHEAD 4
#define PREFETCH_MIN_BYTES 8192
static inline void prefetch_ahead(const uint8_t *t, int bytes) {
    const int ahead = PREFETCH_AHEAD * bytes > PREFETCH_MIN_BYTES ? PREFETCH_AHEAD * bytes : PREFETCH_MIN_BYTES;
    for (int line = 0; line < bytes; line += 64) __builtin_prefetch(t + ahead + line);
}

static inline float half(const uint8_t *p) {  /* an fp16 as float */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline int32_t load32(const void *p) {  /* four int8 codes as one int32, any alignment */
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* X's n inputs (a multiple of 8) as int8 codes at the scale amax / 127, as the plain loop
 *     amax = fmaxf(amax, fabsf(x[i]));  qs[i] = (int8_t)lrintf(x[i] * (127.f / amax));
 * gives them, eight at a time: the maximum ignores NaN as fmaxf does (vmaxps returns its second
 * operand when either is NaN), the product is the same float multiply, the conversion rounds to
 * nearest, ties to even, as lrintf does in the default rounding mode, and each code is the low
 * byte, as the cast keeps it. Returns amax; at 0 no code is written. Where sum is given, *sum is the
 * codes' sum (the low bytes', sign-extended). (The plain loop called libm twice an input: X's
 * quantization had taken most of a 64-row product with 1536 inputs.) */
static inline float quantize_codes(const float *x, int n, int8_t *qs, int32_t *sum) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), magnitude), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
    const float amax = _mm_cvtss_f32(h);
    if (amax == 0.f) return 0.f;
    const __m256 scale = _mm256_set1_ps(127.f / amax);
    /* the low byte of each 32-bit code, four a 128-bit half, then the halves' four together */
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                               0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i together = _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1);
    __m256i sums = _mm256_setzero_si256();
    for (int i = 0; i < n; i += 8) {
        const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale));
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(q, low_bytes), together);
        _mm_storel_epi64((__m128i *)(qs + i), _mm256_castsi256_si128(bytes));
        if (sum) sums = _mm256_add_epi32(sums, _mm256_srai_epi32(_mm256_slli_epi32(q, 24), 24));
    }
    if (sum) {
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
        *sum = _mm_cvtsi128_si32(s);
    }
    return amax;
}

#endif
