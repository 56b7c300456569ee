/* GgufMatMul's and GgufGather's kernels for Q4_K, Q5_K and Q6_K (gguf_ops.c holds the operators; Q2_K and
 * Q3_K are gguf_k_low.c's, the AMX forms gguf_k_amx.c's), the values as the file stores them.
 *
 * Why: MatMulNBits needs an fp32 scale per block and an fp32 correction for a block minimum, so a
 * Q4_K weight costs 6 bits there against the file's 4.5, a Q5_K 10 against 5.5, and a Q6_K 10 against 6.56. Decoding one
 * token reads every weight once, so those bytes set its speed.
 *
 * How (llama.cpp's arithmetic): X is quantized to int8 per 256 inputs (one fp32 scale, and the
 * sums of each 16 and 32 codes). The weights come in tiles of sixteen columns whose codes are
 * interleaved four at a time, so that one 32-bit lane of a vector is one column: one vpdpbusd
 * multiplies four codes of sixteen columns by four of X's codes broadcast, with no sums across
 * lanes, and a tile is multiplied with up to four rows of X while its codes are in registers
 * (with four rows or more, Q4_K, Q5_K and the types with a scale per 32 take two tiles at once).
 * For every row, column and super-block the kernel forms two exact integers (the scaled code
 * products, and the minimums or the Q6_K code offset against X's 16- or 32-sums) and then the same
 * float operations, so a row's result is the same bits alone or in any batch, on AVX2 or AVX-512:
 * an answer does not depend on its batch.
 *
 * Built with AVX2 (every machine this package targets has it); the AVX-512 forms (VNNI's vpdpbusd
 * and vpdpwssd, sixteen columns a vector) are chosen at load time where the CPU has them (k_use_avx512).
 * Also here: the gather's exact dequantization, gguf-py's float32 operations in its order (compiled with
 * -ffp-contract=off, as the whole library). */
#include <immintrin.h>
#include <string.h>

#include "gguf_k.h"

/* X's row as int8 codes per 256 inputs, with their scale and the sums of each 16 and 32 codes */
void k_quantize_row(const float *x, int64_t k, q8_block *out) {
    for (int64_t b = 0; b < k / QK_K; b++, x += QK_K) {
        q8_block *o = out + b;
        const float amax = quantize_codes(x, QK_K, o->qs, NULL);
        if (amax == 0.f) {
            memset(o, 0, sizeof *o);
            continue;
        }
        for (int j = 0; j < QK_K / 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += o->qs[16 * j + i];
            o->bsums[j] = (int16_t)s;
        }
        for (int j = 0; j < QK_K / 32; j++) o->bsums32[j] = (int16_t)(o->bsums[2 * j] + o->bsums[2 * j + 1]);
        o->d = amax / 127.f;
    }
}

static const size_t TILE_BLOCK_BYTES[15] = {[GGML_Q2_K] = K2_BYTES, [GGML_Q3_K] = K3_BYTES, [GGML_Q4_K] = K4_BYTES,
                                            [GGML_Q5_K] = K5_BYTES, [GGML_Q6_K] = K6_BYTES};

size_t k_tile_block_bytes(int64_t type) { return TILE_BLOCK_BYTES[type]; }

/* Q4_K, and Q5_K (five: its fifth bits or'ed into the codes; scales and minimums are Q4_K's) */
AVX512 void q4_k_tile_512(const int five, const uint8_t *t, int64_t nb, const q8_block *const *x, const int R, __m512 *acc) {
    const int bytes = five ? K5_BYTES : K4_BYTES;
    for (int64_t b = 0; b < nb; b++, t += bytes) {
        prefetch_ahead(t, bytes);
        __m512i sc[2], mn[2];
        k4_scales_mins_512(t, sc, mn);
        __m512i sums[MAX_ROWS], mins[MAX_ROWS];
        for (int r = 0; r < R; r++) sums[r] = mins[r] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {  /* sub-block j from the low nibbles, j + 4 from the high */
            __m512i lo[CHAINS][MAX_ROWS], hi[CHAINS][MAX_ROWS];
            for (int c = 0; c < chains(R); c++)
                for (int r = 0; r < R; r++) lo[c][r] = hi[c][r] = _mm512_setzero_si512();
            for (int first = 8 * j; first < 8 * j + 8; first += chains(R))
                for (int c = 0; c < chains(R); c++) {  /* c a constant once unrolled: the chains stay in registers */
                    const int v = first + c;
                    __m512i c0, c1;
                    q4_k_codes_512(five, t, v, &c0, &c1);
                    products_512(lo, hi, c, c0, c1, x, b, 4 * v, R);
                }
            add_scaled_512(sums, lo, hi, byte_512(sc[0], j), byte_512(sc[1], j), R);
        }
        for (int k = 0; k < 4; k++) {
            const __m512i m = byte_pair_512(mn[k / 2], 2 * (k % 2));
            for (int r = 0; r < R; r++) mins[r] = _mm512_dpwssd_epi32(mins[r], m, _mm512_set1_epi32(load32(x[r][b].bsums32 + 2 * k)));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + (five ? K5_D : K4_D))));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + (five ? K5_DMIN : K4_DMIN))));
        for (int r = 0; r < R; r++) float_step_512(&acc[r], sums[r], mins[r], x[r][b].d, d, dmin);
    }
}

AVX512 void q6_k_tile_512(const uint8_t *t, int64_t nb, const q8_block *const *x, const int R, __m512 *acc) {
    for (int64_t b = 0; b < nb; b++, t += K6_BYTES) {
        prefetch_ahead(t, K6_BYTES);
        __m512i sums[MAX_ROWS], mins[MAX_ROWS];
        for (int r = 0; r < R; r++) sums[r] = mins[r] = _mm512_setzero_si512();
        for (int g = 0; g < 8; g++) {  /* group g (codes 16g..) and g + 8 (codes 128 + 16g..) */
            __m512i lo[CHAINS][MAX_ROWS], hi[CHAINS][MAX_ROWS];
            for (int c = 0; c < chains(R); c++)
                for (int r = 0; r < R; r++) lo[c][r] = hi[c][r] = _mm512_setzero_si512();
            _Pragma("GCC unroll 8") for (int v = 4 * g; v < 4 * g + 4; v++) {
                __m512i c0, c1;
                q6_k_codes_512(t, v, &c0, &c1);
                products_intrinsic_512(lo, hi, v % chains(R), c0, c1, x, b, 4 * v, R);
            }
            add_scaled_512(sums, lo, hi, _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + K6_SC + 16 * g))),
                           _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + K6_SC + 16 * (g + 8)))), R);
        }
        for (int k = 0; k < 8; k++) {  /* the codes are q + 32: 32 · scale against the 16-sums */
            const __m512i m = pairs16_512(_mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + K6_SC + 32 * k))), 5),
                                          _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + K6_SC + 32 * k + 16))), 5));
            for (int r = 0; r < R; r++) mins[r] = _mm512_dpwssd_epi32(mins[r], m, _mm512_set1_epi32(load32(x[r][b].bsums + 2 * k)));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + K6_D)));
        for (int r = 0; r < R; r++) float_step_512(&acc[r], sums[r], mins[r], x[r][b].d, d, d);
    }
}

/* each type's kernel in its own function: inlined together, one's register allocation spoiled the other's */
#define TILE_ROWS_512(R)                                                                                              \
    __attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) static void q4_k_rows_512_##R(              \
        const uint8_t *t, int64_t nb, const q8_block *const *x, __m512 *acc) { q4_k_tile_512(0, t, nb, x, R, acc); } \
    __attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) static void q5_k_rows_512_##R(              \
        const uint8_t *t, int64_t nb, const q8_block *const *x, __m512 *acc) { q4_k_tile_512(1, t, nb, x, R, acc); } \
    __attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) static void q6_k_rows_512_##R(              \
        const uint8_t *t, int64_t nb, const q8_block *const *x, __m512 *acc) { q6_k_tile_512(t, nb, x, R, acc); }   \
    __attribute__((target("avx512f,avx512bw,avx512vnni"))) static void tile_rows_512_##R(                          \
        int type, const uint8_t *t, int64_t nb, const q8_block *const *x, float out[][TILE]) {                         \
        __m512 acc[R];                                                                                                \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                                     \
        if (type == GGML_Q4_K) q4_k_rows_512_##R(t, nb, x, acc);                                                     \
        else if (type == GGML_Q5_K) q5_k_rows_512_##R(t, nb, x, acc);                                                \
        else q6_k_rows_512_##R(t, nb, x, acc);                                                                       \
        for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);                                                 \
    }
TILE_ROWS_512(1)
TILE_ROWS_512(2)
TILE_ROWS_512(3)
TILE_ROWS_512(4)

/* Q4_K and Q5_K, two tiles (t, and u: the next sixteen columns) against four rows: each broadcast of
 * X's four codes feeds a product of both tiles (q32_pair_512's reason). Each column's integer sums,
 * minimums and float step are q4_k_tile_512's, so the same bits. */
AVX512 void q4_k_pair_512(const int five, const uint8_t *t, const uint8_t *u, int64_t nb, const q8_block *const *x,
                          __m512 *acc, __m512 *acc2) {
    enum { R = MAX_ROWS };
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int bytes = five ? K5_BYTES : K4_BYTES;
    for (int64_t b = 0; b < nb; b++, t += bytes, u += bytes) {
        prefetch_ahead(t, bytes);
        prefetch_ahead(u, bytes);
        __m512i sums[R], sums2[R], sc[2], sc2[2], mn[2][2];
        k4_scales_mins_512(t, sc, mn[0]);
        k4_scales_mins_512(u, sc2, mn[1]);
        for (int r = 0; r < R; r++) sums[r] = sums2[r] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++) {  /* sub-block j from the low nibbles, j + 4 from the high */
            __m512i lo[1][R], hi[1][R], lo2[1][R], hi2[1][R];
            for (int r = 0; r < R; r++) lo[0][r] = hi[0][r] = lo2[0][r] = hi2[0][r] = _mm512_setzero_si512();
            for (int v = 8 * j; v < 8 * j + 8; v++) {
                const __m512i q = _mm512_loadu_si512(t + K4_QS + 64 * v), q2 = _mm512_loadu_si512(u + K4_QS + 64 * v);
                __m512i c0 = _mm512_and_si512(q, low), c1 = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
                __m512i d0 = _mm512_and_si512(q2, low), d1 = _mm512_and_si512(_mm512_srli_epi16(q2, 4), low);
                if (five) {
                    __m512i f0, f1;
                    k5_fifth_512(t, v, &f0, &f1);
                    c0 = _mm512_or_si512(c0, f0), c1 = _mm512_or_si512(c1, f1);
                    k5_fifth_512(u, v, &f0, &f1);
                    d0 = _mm512_or_si512(d0, f0), d1 = _mm512_or_si512(d1, f1);
                }
                for (int r = 0; r < R; r++) {
                    const __m512i first = _mm512_set1_epi32(load32(x[r][b].qs + 4 * v));
                    const __m512i second = _mm512_set1_epi32(load32(x[r][b].qs + 128 + 4 * v));
                    DPBUSD(lo[0][r], c0, first);
                    DPBUSD(lo2[0][r], d0, first);
                    DPBUSD(hi[0][r], c1, second);
                    DPBUSD(hi2[0][r], d1, second);
                }
            }
            add_scaled_512(sums, lo, hi, byte_512(sc[0], j), byte_512(sc[1], j), R);
            add_scaled_512(sums2, lo2, hi2, byte_512(sc2[0], j), byte_512(sc2[1], j), R);
        }
        for (int tile = 0; tile < 2; tile++) {
            const uint8_t *w = tile ? u : t;
            __m512i mins[R];
            for (int r = 0; r < R; r++) mins[r] = _mm512_setzero_si512();
            for (int k = 0; k < 4; k++) {
                const __m512i m = byte_pair_512(mn[tile][k / 2], 2 * (k % 2));
                for (int r = 0; r < R; r++) mins[r] = _mm512_dpwssd_epi32(mins[r], m, _mm512_set1_epi32(load32(x[r][b].bsums32 + 2 * k)));
            }
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + (five ? K5_D : K4_D))));
            const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + (five ? K5_DMIN : K4_DMIN))));
            for (int r = 0; r < R; r++) float_step_512(tile ? &acc2[r] : &acc[r], tile ? sums2[r] : sums[r], mins[r], x[r][b].d, d, dmin);
        }
    }
}

__attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) static void pair_rows_512(
    int type, const uint8_t *t, const uint8_t *u, int64_t nb, const q8_block *const *x, float out[][TILE], float out2[][TILE]) {
    __m512 acc[MAX_ROWS], acc2[MAX_ROWS];
    for (int r = 0; r < MAX_ROWS; r++) acc[r] = acc2[r] = _mm512_setzero_ps();
    q4_k_pair_512(type == GGML_Q5_K, t, u, nb, x, acc, acc2);
    for (int r = 0; r < MAX_ROWS; r++) _mm512_storeu_ps(out[r], acc[r]), _mm512_storeu_ps(out2[r], acc2[r]);
}

/* The kernel stays static behind this entry: GCC allocates a static function's registers its own way, and
 * exported the kernel itself compiled to other code (the same instructions, other registers). */
void k_pair_rows_512(int type, const uint8_t *t, const uint8_t *u, int64_t nb, const q8_block *const *x, float out[][TILE],
                     float out2[][TILE]) {
    pair_rows_512(type, t, u, nb, x, out, out2);
}

AVX2 void k4_scales_mins_256(const uint8_t *t, int half, __m256i sc[2], __m256i mn[2]) {
    const __m256i six = _mm256_set1_epi32(0x3f3f3f3f), four = _mm256_set1_epi32(0x0f0f0f0f), two = _mm256_set1_epi32(0x03030303);
    const uint8_t *p = t + K4_SC + 32 * half;
    const __m256i u0 = _mm256_loadu_si256((const __m256i *)p), u1 = _mm256_loadu_si256((const __m256i *)(p + 64));
    const __m256i u2 = _mm256_loadu_si256((const __m256i *)(p + 128));
    sc[0] = _mm256_and_si256(u0, six);
    mn[0] = _mm256_and_si256(u1, six);
    sc[1] = _mm256_or_si256(_mm256_and_si256(u2, four), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), two), 4));
    mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), four), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), two), 4));
}

/* columns 8·half .. 8·half + 7: bytes 32·half.. of each 64-byte vector, scales and d from 8·half */
AVX2 void q4_k_tile_256(const int five, const uint8_t *t, int64_t nb, const q8_block *const *x, const int R, int half, __m256 *acc) {
    const __m256i low = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
    const int bytes = five ? K5_BYTES : K4_BYTES;
    for (int64_t b = 0; b < nb; b++, t += bytes) {
        if (!half) prefetch_ahead(t, bytes);  /* the second half finds the tile in cache */
        __m256i sc[2], mn[2];
        k4_scales_mins_256(t, half, sc, mn);
        __m256i sums[MAX_ROWS], mins[MAX_ROWS];
        for (int r = 0; r < R; r++) sums[r] = mins[r] = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {  /* sub-block j: vectors 8(j % 4).., low nibbles for j < 4 */
            const __m256i s = byte_256(sc[j / 4], j % 4), scale = pairs16_256(s, s);
            _Pragma("GCC unroll 8") for (int v = 8 * (j % 4); v < 8 * (j % 4) + 8; v++) {
                const __m256i q = _mm256_loadu_si256((const __m256i *)(t + K4_QS + 64 * v + 32 * half));
                __m256i c = _mm256_and_si256(j < 4 ? q : _mm256_srli_epi16(q, 4), low);
                if (five) {  /* Q5_K: the fifth bits of sub-block j are bit j of qh vector v % 8 (k5_fifth_512) */
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(t + K5_QH + 64 * (v % 8) + 32 * half));
                    c = _mm256_or_si256(c, _mm256_and_si256(j <= 4 ? _mm256_slli_epi16(h, 4 - j) : _mm256_srli_epi16(h, j - 4), bit4));
                }
                for (int r = 0; r < R; r++) sums[r] = scaled_dot4_256(sums[r], c, x[r][b].qs + 128 * (j / 4) + 4 * v, scale);
            }
        }
        for (int k = 0; k < 4; k++) {
            const __m256i m = pairs16_256(byte_256(mn[k / 2], 2 * (k % 2)), byte_256(mn[k / 2], 2 * (k % 2) + 1));
            for (int r = 0; r < R; r++)
                mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(m, _mm256_set1_epi32(load32(x[r][b].bsums32 + 2 * k))));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + (five ? K5_D : K4_D) + 16 * half)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + (five ? K5_DMIN : K4_DMIN) + 16 * half)));
        for (int r = 0; r < R; r++) float_step_256(&acc[r], sums[r], mins[r], x[r][b].d, d, dmin);
    }
}

AVX2 void q6_k_tile_256(const uint8_t *t, int64_t nb, const q8_block *const *x, const int R, int half, __m256 *acc) {
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    for (int64_t b = 0; b < nb; b++, t += K6_BYTES) {
        if (!half) prefetch_ahead(t, K6_BYTES);
        __m256i sums[MAX_ROWS], mins[MAX_ROWS];
        for (int r = 0; r < R; r++) sums[r] = mins[r] = _mm256_setzero_si256();
        for (int g = 0; g < 16; g++) {  /* group g: vectors 4(g % 8).., low nibbles for g < 8 */
            const __m256i s = signed_bytes_to_i32(t + K6_SC + 16 * g + 8 * half), scale = pairs16_256(s, s);
            _Pragma("GCC unroll 8") for (int v = 4 * (g % 8); v < 4 * (g % 8) + 4; v++) {
                const __m256i l = _mm256_loadu_si256((const __m256i *)(t + K6_QL + 64 * v + 32 * half));
                const __m256i h = _mm256_loadu_si256((const __m256i *)(t + K6_QH + 64 * (v % 16) + 32 * half));
                const int f = v / 16 + 2 * (g / 8);  /* which two bits of qh */
                const __m256i hb = f == 0 ? _mm256_slli_epi16(h, 4) : f == 1 ? _mm256_slli_epi16(h, 2) : f == 2 ? h : _mm256_srli_epi16(h, 2);
                const __m256i c = _mm256_or_si256(_mm256_and_si256(g < 8 ? l : _mm256_srli_epi16(l, 4), low), _mm256_and_si256(hb, top));
                for (int r = 0; r < R; r++) sums[r] = scaled_dot4_256(sums[r], c, x[r][b].qs + 128 * (g / 8) + 4 * v, scale);
            }
        }
        for (int k = 0; k < 8; k++) {
            const __m256i m = pairs16_256(_mm256_slli_epi32(signed_bytes_to_i32(t + K6_SC + 32 * k + 8 * half), 5),
                                          _mm256_slli_epi32(signed_bytes_to_i32(t + K6_SC + 32 * k + 16 + 8 * half), 5));
            for (int r = 0; r < R; r++)
                mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(m, _mm256_set1_epi32(load32(x[r][b].bsums + 2 * k))));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + K6_D + 16 * half)));
        for (int r = 0; r < R; r++) float_step_256(&acc[r], sums[r], mins[r], x[r][b].d, d, d);
    }
}

#define TILE_ROWS_256(R)                                                                                              \
    static void tile_rows_256_##R(int type, const uint8_t *t, int64_t nb, const q8_block *const *x, float out[][TILE]) { \
        for (int half = 0; half < 2; half++) {                                                                        \
            __m256 acc[R];                                                                                            \
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                                 \
            if (type == GGML_Q4_K) q4_k_tile_256(0, t, nb, x, R, half, acc);                                          \
            else if (type == GGML_Q5_K) q4_k_tile_256(1, t, nb, x, R, half, acc);                                     \
            else q6_k_tile_256(t, nb, x, R, half, acc);                                                               \
            for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + 8 * half, acc[r]);                                  \
        }                                                                                                             \
    }
TILE_ROWS_256(1)
TILE_ROWS_256(2)
TILE_ROWS_256(3)
TILE_ROWS_256(4)

typedef void (*tile_rows_fn)(int, const uint8_t *, int64_t, const q8_block *const *, float[][TILE]);
static tile_rows_fn tile_rows[MAX_ROWS + 1] = {NULL, tile_rows_256_1, tile_rows_256_2, tile_rows_256_3, tile_rows_256_4};
typedef void (*k_low_rows_fn)(int, int, const uint8_t *, int64_t, const q8_block *const *, float[][TILE]);
static k_low_rows_fn k_low_rows = k_low_tile_rows_256;  /* Q2_K, Q3_K (gguf_k_low.c) */

void k_tile_rows(int type, int rows, const uint8_t *t, int64_t nb, const q8_block *const *x, float out[][TILE]) {
    if (k_low_type(type)) k_low_rows(type, rows, t, nb, x, out);
    else tile_rows[rows](type, t, nb, x, out);
}

/* The AVX-512 (VNNI) forms where the CPU has them and ``on`` (the same results as the AVX2 forms). */
void k_use_avx512(int on) {
    const int vnni = on && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
    tile_rows[1] = vnni ? tile_rows_512_1 : tile_rows_256_1;
    tile_rows[2] = vnni ? tile_rows_512_2 : tile_rows_256_2;
    tile_rows[3] = vnni ? tile_rows_512_3 : tile_rows_256_3;
    tile_rows[4] = vnni ? tile_rows_512_4 : tile_rows_256_4;
    k_low_rows = vnni ? k_low_tile_rows_512 : k_low_tile_rows_256;
}

/* ---- exact dequantization (the gather): gguf-py's float32 operations, in its order -------------- */
/* Q4_K's eight 6-bit scales and eight 6-bit minimums (the file's 12 packed bytes), a byte each,
 * four to a word: sc[0] holds scales 0-3, sc[1] scales 4-7, and mn the minimums likewise. */
static void k4_scales_mins(const uint8_t *p, uint32_t sc[2], uint32_t mn[2]) {
    uint32_t u[3];
    memcpy(u, p, 12);
    sc[0] = u[0] & 0x3f3f3f3f;
    mn[0] = u[1] & 0x3f3f3f3f;
    sc[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    mn[1] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
}

/* Column c of a tile super-block, as the file's weights 0..255. */
static void dequantize_column(int type, const uint8_t *t, int c, float *y) {
    if (type == GGML_Q4_K || type == GGML_Q5_K) {  /* Q5_K: Q4_K's with a fifth bit a code */
        const int five = type == GGML_Q5_K;
        const float d = half(t + (five ? K5_D : K4_D) + 2 * c), dmin = half(t + (five ? K5_DMIN : K4_DMIN) + 2 * c);
        uint8_t packed[12];
        uint32_t sc_words[2], mn_words[2];
        for (int i = 0; i < 3; i++) memcpy(packed + 4 * i, t + K4_SC + 64 * i + 4 * c, 4);
        k4_scales_mins(packed, sc_words, mn_words);
        const uint8_t *sc = (const uint8_t *)sc_words, *mn = (const uint8_t *)mn_words;  /* x86: byte j is number j */
        for (int s = 0; s < 8; s++) {
            const float scale = d * (float)sc[s], offset = -(dmin * (float)mn[s]);
            for (int l = 0; l < 32; l++) {
                const int k = 32 * s + l, at = K4_QS + 64 * ((k % 128) / 4) + 4 * c + k % 4;
                int q = (t[at] >> (4 * (k / 128))) & 0x0F;
                if (five) q |= ((t[K5_QH + 64 * ((k / 4) % 8) + 4 * c + k % 4] >> (k / 32)) & 1) << 4;
                y[k] = scale * (float)q + offset;
            }
        }
    } else {
        const float d = half(t + K6_D + 2 * c);
        for (int k = 0; k < QK_K; k++) {
            const int low = (t[K6_QL + 64 * ((k % 128) / 4) + 4 * c + k % 4] >> (4 * (k / 128))) & 0x0F;
            const int high = (t[K6_QH + 64 * ((k % 64) / 4) + 4 * c + k % 4] >> (2 * (k / 64))) & 3;
            y[k] = (d * (float)(int8_t)t[K6_SC + 16 * (k / 16) + c]) * (float)((low | high << 4) - 32);
        }
    }
}

void k_dequantize_row(int type, const uint8_t *w, int64_t row, int64_t nb, float *y) {
    const uint8_t *t = w + (size_t)(row / TILE) * (size_t)nb * TILE_BLOCK_BYTES[type];
    for (int64_t b = 0; b < nb; b++) {
        if (k_low_type(type)) k_low_dequantize_column(type, t + b * TILE_BLOCK_BYTES[type], (int)(row % TILE), y + b * QK_K);
        else dequantize_column(type, t + b * TILE_BLOCK_BYTES[type], (int)(row % TILE), y + b * QK_K);
    }
}
