/* What gguf_q32.c's AVX-512 kernel and gguf_amx.c's AMX kernel share: a tile block's layout for each
 * type, the fifth bits of Q5's codes, and the float step from a block's exact integer sum to the
 * accumulator (the same operations in the same order in both, so their results are the same bits). */
#ifndef KILN_GGUF_Q32_BLOCKS_H
#define KILN_GGUF_Q32_BLOCKS_H

#include <immintrin.h>

#include "gguf_q32.h"

typedef struct {
    int codes;  /* bytes of codes: 256 (4-bit) or 512 (8-bit) */
    int high;   /* offset of the fifth bits, or 0 */
    int d, m;   /* offsets of the scales and minimums (m: 0 for none) */
    int bytes;
    int offset; /* the code of 0 (Q4_0: 8, Q5_0: 16; Q8_0's signed codes: 0) */
} layout;

static inline __attribute__((always_inline)) layout layout_of(int type) {
    switch (type) {
    case GGML_Q4_0: return (layout){256, 0, 256, 0, 288, 8};
    case GGML_Q4_1: return (layout){256, 0, 256, 288, 320, 0};
    case GGML_Q5_0: return (layout){256, 256, 320, 0, 352, 16};
    case GGML_Q5_1: return (layout){256, 256, 320, 352, 384, 0};
    default: return (layout){512, 0, 512, 0, 544, 0};  /* Q8_0 */
    }
}

/* -- AVX-512 (VNNI): sixteen columns a vector -- */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline

/* bit 4 of every byte: the fifth bit of code 4v+i (second: of 16+4v+i) from the tile's high bits.
 * 16-bit shifts carry bits across bytes only below bit 4 (left) or above it (right): masked away. */
AVX512 __m512i fifth_bits_512(__m512i h, int v, int second) {
    const int s = (second ? 3 : 4) - 2 * v;
    const __m512i moved = s > 0 ? _mm512_slli_epi16(h, s) : s < 0 ? _mm512_srli_epi16(h, -s) : h;
    return _mm512_and_si512(moved, _mm512_set1_epi8(0x10));
}

/* isum → acc as the header says; the same operations as float_step_256 */
AVX512 void float_step_512(__m512 *acc, __m512i isum, const q8_32 *x, const uint8_t *t, layout L) {
    __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + L.d))));
    if (L.m) f = _mm512_fmadd_ps(_mm512_set1_ps((float)x->sum), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + L.m))), f);
    *acc = _mm512_fmadd_ps(_mm512_set1_ps(x->d), f, *acc);
}

#endif
