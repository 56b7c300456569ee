/* GgufMatMul and GgufGather over GGUF's types with one scale per 32 weights, the values as stored:
 *
 *     Q4_0  d·(q − 8)      q: 4 bits     Q5_0  d·(q − 16)     q: 5 bits     Q8_0  d·q   q: signed 8 bits
 *     Q4_1  d·q + m                      Q5_1  d·q + m
 *
 * Why: MatMulNBits keeps an fp32 scale per block (Q4_0, Q4_1: 5 bits a weight against the file's
 * 4.5 and 5), stores Q5_0/Q5_1 as 8 bits (against 5.5 and 6), and needs a block-sum correction
 * node beside every Q4_1/Q5_1 product (another fp32 a block, and several small nodes). Decoding a
 * token reads every weight once, so those bytes and nodes set its speed.
 *
 * How (llama.cpp's arithmetic for these types): X is quantized to int8 per 32 inputs (an fp32 scale
 * dx and the codes' sum sx). For every row, column and block the kernel forms one exact integer
 *     isum = Σ q·x − offset · sx        (offset 8, 16, 0 with a minimum; Q8_0's codes are signed)
 * and then the same float operations:
 *     t = isum · d;   t = sx · m + t (types with a minimum);   acc = dx · t + acc
 * (fused multiply-adds written out), so a row's result is the same bits alone or in any batch, on
 * AVX2 or AVX-512: an answer does not depend on its batch.
 *
 * The weights come in tiles of sixteen columns (convert/gguf/tiles.py), a block of all sixteen
 * after another, the codes interleaved four at a time so that one 32-bit lane of a vector is one
 * column (one vpdpbusd multiplies four codes of sixteen columns by four of X's codes):
 *     codes  [4 v][16 col][4]  low nibble: code 4v+i, high nibble: code 16+4v+i (the file's byte 4v+i)
 *            Q8_0: [8 v][16 col][4], code 4v+i
 *     high   Q5 only: [16 col][4]: byte i, bit 2v: the fifth bit of code 4v+i, bit 2v+1: of code 16+4v+i
 *     d      [16 col] fp16;  m  [16 col] fp16 (Q4_1, Q5_1)
 * A tile block takes sixteen times the file's block: the same bytes, moved. With four rows or more,
 * AVX-512 takes two tiles at once (q32_pair_512): one broadcast of X's codes feeds both. */
#include "gguf_q32.h"

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "gguf_q32_blocks.h"
#include "gguf_tiles.h"

int q32_type(int64_t type) {
    return type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q5_0 || type == GGML_Q5_1 || type == GGML_Q8_0;
}

size_t q32_tile_block_bytes(int64_t type) { return q32_type(type) ? (size_t)layout_of((int)type).bytes : 0; }

void q32_quantize_row(const float *x, int64_t k, q8_32 *out) {
    for (int64_t b = 0; b < k / QK32; b++, x += QK32) {
        q8_32 *o = out + b;
        const float amax = quantize_codes(x, QK32, o->qs, &o->sum);
        if (amax == 0.f) {
            memset(o, 0, sizeof *o);
            continue;
        }
        o->d = amax / 127.f;
    }
}

AVX512 void q32_tile_512(int type, const uint8_t *t, int64_t nb, const q8_32 *const *x, const int R, __m512 *acc) {
    const layout L = layout_of(type);
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++, t += L.bytes) {
        prefetch_ahead(t, L.bytes);
        __m512i s0[MAX_ROWS], s1[MAX_ROWS];  /* two chains: products summed into one register wait for each other */
        for (int r = 0; r < R; r++) s0[r] = s1[r] = _mm512_setzero_si512();
        int offset = L.offset;
        if (L.codes == 512) {  /* Q8_0: codes + 128 (unsigned for vpdpbusd), less 128 · sx after */
            offset = 128;
            _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++) {
                const __m512i c = _mm512_xor_si512(_mm512_loadu_si512(t + 64 * v), flip);
                for (int r = 0; r < R; r++) {
                    const __m512i xv = _mm512_set1_epi32(load32(x[r][b].qs + 4 * v));
                    if (v % 2) s1[r] = _mm512_dpbusd_epi32(s1[r], c, xv);
                    else s0[r] = _mm512_dpbusd_epi32(s0[r], c, xv);
                }
            }
        } else {
            const __m512i h = L.high ? _mm512_loadu_si512(t + L.high) : _mm512_setzero_si512();
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) {
                const __m512i q = _mm512_loadu_si512(t + 64 * v);
                __m512i c0 = _mm512_and_si512(q, low), c1 = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
                if (L.high) c0 = _mm512_or_si512(c0, fifth_bits_512(h, v, 0)), c1 = _mm512_or_si512(c1, fifth_bits_512(h, v, 1));
                for (int r = 0; r < R; r++) {
                    s0[r] = _mm512_dpbusd_epi32(s0[r], c0, _mm512_set1_epi32(load32(x[r][b].qs + 4 * v)));
                    s1[r] = _mm512_dpbusd_epi32(s1[r], c1, _mm512_set1_epi32(load32(x[r][b].qs + 16 + 4 * v)));
                }
            }
        }
        for (int r = 0; r < R; r++) {
            __m512i isum = _mm512_add_epi32(s0[r], s1[r]);
            if (offset) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(offset * x[r][b].sum));
            float_step_512(&acc[r], isum, &x[r][b], t, L);
        }
    }
}

#define TILE_ROWS_512(R)                                                                                        \
    __attribute__((target("avx512f,avx512bw,avx512vnni"))) static void tile_rows_512_##R(                    \
        int type, const uint8_t *t, int64_t nb, const q8_32 *const *x, float out[][TILE]) {                      \
        __m512 acc[R];                                                                                          \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                               \
        switch (type) { /* each type's own loop: its layout known when compiled */                           \
        case GGML_Q4_0: q32_tile_512(GGML_Q4_0, t, nb, x, R, acc); break;                                      \
        case GGML_Q4_1: q32_tile_512(GGML_Q4_1, t, nb, x, R, acc); break;                                      \
        case GGML_Q5_0: q32_tile_512(GGML_Q5_0, t, nb, x, R, acc); break;                                      \
        case GGML_Q5_1: q32_tile_512(GGML_Q5_1, t, nb, x, R, acc); break;                                      \
        default: q32_tile_512(GGML_Q8_0, t, nb, x, R, acc);                                                    \
        }                                                                                                       \
        for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);                                           \
    }
TILE_ROWS_512(1)
TILE_ROWS_512(2)
TILE_ROWS_512(3)
TILE_ROWS_512(4)

/* Two tiles (32 columns) against MAX_ROWS rows: each broadcast of X's four codes feeds a product of
 * both tiles, so a product needs half a broadcast (one tile: one each, and the loads of X's codes,
 * not the multiplies, had set the speed). Each column's integer sums and float step are q32_tile_512's,
 * so the same bits. */
AVX512 void q32_pair_512(int type, const uint8_t *t, const uint8_t *u, int64_t nb, const q8_32 *const *x, __m512 *acc,
                         __m512 *acc2) {
    const layout L = layout_of(type);
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    for (int64_t b = 0; b < nb; b++, t += L.bytes, u += L.bytes) {
        prefetch_ahead(t, L.bytes);
        prefetch_ahead(u, L.bytes);
        __m512i s[MAX_ROWS], s2[MAX_ROWS];  /* one chain a row and tile: eight in flight */
        for (int r = 0; r < MAX_ROWS; r++) s[r] = s2[r] = _mm512_setzero_si512();
        int offset = L.offset;
        if (L.codes == 512) {  /* Q8_0, as q32_tile_512 */
            offset = 128;
            _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++) {
                const __m512i c = _mm512_xor_si512(_mm512_loadu_si512(t + 64 * v), flip);
                const __m512i c2 = _mm512_xor_si512(_mm512_loadu_si512(u + 64 * v), flip);
                for (int r = 0; r < MAX_ROWS; r++) {
                    const __m512i xv = _mm512_set1_epi32(load32(x[r][b].qs + 4 * v));
                    s[r] = _mm512_dpbusd_epi32(s[r], c, xv);
                    s2[r] = _mm512_dpbusd_epi32(s2[r], c2, xv);
                }
            }
        } else {
            const __m512i h = L.high ? _mm512_loadu_si512(t + L.high) : _mm512_setzero_si512();
            const __m512i h2 = L.high ? _mm512_loadu_si512(u + L.high) : _mm512_setzero_si512();
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) {
                const __m512i q = _mm512_loadu_si512(t + 64 * v), q2 = _mm512_loadu_si512(u + 64 * v);
                __m512i c0 = _mm512_and_si512(q, low), c1 = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
                __m512i d0 = _mm512_and_si512(q2, low), d1 = _mm512_and_si512(_mm512_srli_epi16(q2, 4), low);
                if (L.high) {
                    c0 = _mm512_or_si512(c0, fifth_bits_512(h, v, 0)), c1 = _mm512_or_si512(c1, fifth_bits_512(h, v, 1));
                    d0 = _mm512_or_si512(d0, fifth_bits_512(h2, v, 0)), d1 = _mm512_or_si512(d1, fifth_bits_512(h2, v, 1));
                }
                for (int r = 0; r < MAX_ROWS; r++) {
                    const __m512i first = _mm512_set1_epi32(load32(x[r][b].qs + 4 * v));
                    const __m512i second = _mm512_set1_epi32(load32(x[r][b].qs + 16 + 4 * v));
                    s[r] = _mm512_dpbusd_epi32(s[r], c0, first);
                    s2[r] = _mm512_dpbusd_epi32(s2[r], d0, first);
                    s[r] = _mm512_dpbusd_epi32(s[r], c1, second);
                    s2[r] = _mm512_dpbusd_epi32(s2[r], d1, second);
                }
            }
        }
        for (int r = 0; r < MAX_ROWS; r++) {
            __m512i isum = s[r], isum2 = s2[r];
            if (offset) {
                const __m512i o = _mm512_set1_epi32(offset * x[r][b].sum);
                isum = _mm512_sub_epi32(isum, o), isum2 = _mm512_sub_epi32(isum2, o);
            }
            float_step_512(&acc[r], isum, &x[r][b], t, L);
            float_step_512(&acc2[r], isum2, &x[r][b], u, L);
        }
    }
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void pair_rows_512(
    int type, const uint8_t *t, const uint8_t *u, int64_t nb, const q8_32 *const *x, float out[][TILE], float out2[][TILE]) {
    __m512 acc[MAX_ROWS], acc2[MAX_ROWS];
    for (int r = 0; r < MAX_ROWS; r++) acc[r] = acc2[r] = _mm512_setzero_ps();
    switch (type) { /* each type's own loop: its layout known when compiled */
    case GGML_Q4_0: q32_pair_512(GGML_Q4_0, t, u, nb, x, acc, acc2); break;
    case GGML_Q4_1: q32_pair_512(GGML_Q4_1, t, u, nb, x, acc, acc2); break;
    case GGML_Q5_0: q32_pair_512(GGML_Q5_0, t, u, nb, x, acc, acc2); break;
    case GGML_Q5_1: q32_pair_512(GGML_Q5_1, t, u, nb, x, acc, acc2); break;
    default: q32_pair_512(GGML_Q8_0, t, u, nb, x, acc, acc2);
    }
    for (int r = 0; r < MAX_ROWS; r++) _mm512_storeu_ps(out[r], acc[r]), _mm512_storeu_ps(out2[r], acc2[r]);
}

/* -- AVX2: eight columns a vector, the tile in two halves; vpmaddubsw makes pair sums of the
 *    products (4- and 5-bit codes: at most 2 · 31 · 127; Q8_0 as |q| times x with q's sign: at most
 *    2 · 128 · 127, no saturation), vpmaddwd adds the pairs into exact int32 sums -- */
#define AVX2 __attribute__((always_inline)) static inline

AVX2 __m256i fifth_bits_256(__m256i h, int v, int second) {
    const int s = (second ? 3 : 4) - 2 * v;
    const __m256i moved = s > 0 ? _mm256_slli_epi16(h, s) : s < 0 ? _mm256_srli_epi16(h, -s) : h;
    return _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
}

AVX2 void float_step_256(__m256 *acc, __m256i isum, const q8_32 *x, const uint8_t *t, layout L, int half) {
    __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + L.d + 16 * half))));
    if (L.m) f = _mm256_fmadd_ps(_mm256_set1_ps((float)x->sum), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + L.m + 16 * half))), f);
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(x->d), f, *acc);
}

/* columns 8·half .. 8·half + 7: bytes 32·half.. of each 64-byte vector, scales from 8·half */
AVX2 void q32_tile_256(int type, const uint8_t *t, int64_t nb, const q8_32 *const *x, const int R, int half, __m256 *acc) {
    const layout L = layout_of(type);
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++, t += L.bytes) {
        if (!half) prefetch_ahead(t, L.bytes);  /* the second half finds the tile in cache */
        __m256i s[MAX_ROWS];
        for (int r = 0; r < R; r++) s[r] = _mm256_setzero_si256();
        if (L.codes == 512) {
            _Pragma("GCC unroll 8") for (int v = 0; v < 8; v++) {
                const __m256i c = _mm256_loadu_si256((const __m256i *)(t + 64 * v + 32 * half)), a = _mm256_abs_epi8(c);
                for (int r = 0; r < R; r++) {
                    const __m256i p = _mm256_maddubs_epi16(a, _mm256_sign_epi8(_mm256_set1_epi32(load32(x[r][b].qs + 4 * v)), c));
                    s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p, ones));
                }
            }
        } else {
            const __m256i h = L.high ? _mm256_loadu_si256((const __m256i *)(t + L.high + 32 * half)) : _mm256_setzero_si256();
            _Pragma("GCC unroll 4") for (int v = 0; v < 4; v++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(t + 64 * v + 32 * half));
                __m256i c0 = _mm256_and_si256(q, low), c1 = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
                if (L.high) c0 = _mm256_or_si256(c0, fifth_bits_256(h, v, 0)), c1 = _mm256_or_si256(c1, fifth_bits_256(h, v, 1));
                for (int r = 0; r < R; r++) {
                    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(c0, _mm256_set1_epi32(load32(x[r][b].qs + 4 * v))),
                                                       _mm256_maddubs_epi16(c1, _mm256_set1_epi32(load32(x[r][b].qs + 16 + 4 * v))));
                    s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(p, ones));
                }
            }
        }
        for (int r = 0; r < R; r++) {
            __m256i isum = s[r];
            if (L.offset) isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(L.offset * x[r][b].sum));
            float_step_256(&acc[r], isum, &x[r][b], t, L, half);
        }
    }
}

#define TILE_ROWS_256(R)                                                                                        \
    static void tile_rows_256_##R(int type, const uint8_t *t, int64_t nb, const q8_32 *const *x, float out[][TILE]) { \
        for (int half = 0; half < 2; half++) {                                                                  \
            __m256 acc[R];                                                                                      \
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                           \
            switch (type) {                                                                                     \
            case GGML_Q4_0: q32_tile_256(GGML_Q4_0, t, nb, x, R, half, acc); break;                            \
            case GGML_Q4_1: q32_tile_256(GGML_Q4_1, t, nb, x, R, half, acc); break;                            \
            case GGML_Q5_0: q32_tile_256(GGML_Q5_0, t, nb, x, R, half, acc); break;                            \
            case GGML_Q5_1: q32_tile_256(GGML_Q5_1, t, nb, x, R, half, acc); break;                            \
            default: q32_tile_256(GGML_Q8_0, t, nb, x, R, half, acc);                                          \
            }                                                                                                   \
            for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + 8 * half, acc[r]);                            \
        }                                                                                                       \
    }
TILE_ROWS_256(1)
TILE_ROWS_256(2)
TILE_ROWS_256(3)
TILE_ROWS_256(4)

typedef void (*tile_rows_fn)(int, const uint8_t *, int64_t, const q8_32 *const *, float[][TILE]);
static tile_rows_fn tile_rows[MAX_ROWS + 1] = {NULL, tile_rows_256_1, tile_rows_256_2, tile_rows_256_3, tile_rows_256_4};

void q32_tile_rows(int type, int rows, const uint8_t *t, int64_t nb, const q8_32 *const *x, float out[][16]) {
    tile_rows[rows](type, t, nb, x, out);
}

static int pairs_on = 0;  /* the AVX-512 kernels are on: they have the two-tile form */
int q32_pairs_on(void) { return pairs_on; }
void q32_pair_rows(int type, const uint8_t *t, const uint8_t *u, int64_t nb, const q8_32 *const *x, float out[][16],
                   float out2[][16]) {
    pair_rows_512(type, t, u, nb, x, out, out2);
}

void q32_use_avx512(int on) {
    const int vnni = on && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    pairs_on = vnni;
    tile_rows[1] = vnni ? tile_rows_512_1 : tile_rows_256_1;
    tile_rows[2] = vnni ? tile_rows_512_2 : tile_rows_256_2;
    tile_rows[3] = vnni ? tile_rows_512_3 : tile_rows_256_3;
    tile_rows[4] = vnni ? tile_rows_512_4 : tile_rows_256_4;
}

/* ---- exact dequantization (the gather): gguf-py's float32 operations, in its order -------------- */
/* Column c of a tile block, as the file's weights 0..31 */
static void dequantize_column(int type, const uint8_t *t, int c, float *y) {
    const layout L = layout_of(type);
    const float d = half(t + L.d + 2 * c), m = L.m ? half(t + L.m + 2 * c) : 0.f;
    for (int j = 0; j < QK32; j++) {
        if (L.codes == 512) {
            y[j] = (float)(int8_t)t[64 * (j / 4) + 4 * c + j % 4] * d;
            continue;
        }
        const int v = (j % 16) / 4, second = j / 16;
        int q = (t[64 * v + 4 * c + j % 4] >> (4 * second)) & 0x0F;
        if (L.high) q |= ((t[L.high + 4 * c + j % 4] >> (2 * v + second)) & 1) << 4;
        y[j] = L.m ? d * (float)q + m : d * (float)(q - L.offset);
    }
}

void q32_dequantize_row(int type, const uint8_t *w, int64_t row, int64_t nb, float *y) {
    const size_t bytes = q32_tile_block_bytes(type);
    const uint8_t *t = w + (size_t)(row / TILE) * (size_t)nb * bytes;
    for (int64_t b = 0; b < nb; b++) dequantize_column(type, t + b * bytes, (int)(row % TILE), y + b * QK32);
}
