/* GgufMatMul and GgufGather over GGUF's 2- and 3-bit K-quants, the values as the file stores them:
 *
 *     Q2_K  (d·sc)·q − dmin·m     q: 2 bits, sc and m: 4 bits per 16 weights      84 bytes / 256
 *     Q3_K  (d·(sc − 32))·(q − 4) q: 3 bits, sc: 6 bits per 16 weights          110 bytes / 256
 *
 * Why: MatMulNBits stores them as 4-bit codes with an fp32 scale per 16 weights (and a minimum's
 * correction node for Q2_K): 6 bits a weight against the file's 2.6 and 3.4, and decoding a token
 * reads every weight once. Its int8 activations (accuracy level 4) with a scale per 16 weights
 * also moved a small model's answers more than the file's own arithmetic does.
 *
 * How (llama.cpp's arithmetic, gguf_k.h's steps): X's int8 codes per 256 inputs; for every row,
 * column and super-block the exact integers
 *     Q2_K  sums = Σ_g sc_g · Σ q·x           mins = Σ_g m_g · xsum16_g
 *     Q3_K  sums = Σ_g (sc_g − 32) · Σ q·x    mins = Σ_g 4 · (sc_g − 32) · xsum16_g
 * (g: the sixteen groups of 16; Q3_K's codes q = the file's 2 low bits | its mask bit << 2, 0..7)
 * and then acc += dx · (d · sums − dmin · mins) (Q3_K: dmin = d).
 *
 * The tiles (convert/gguf/tiles.py), sixteen columns' super-blocks together, take the file's bytes:
 *     qs  [16 v][16 col][4]   bits 2s..2s+1 of byte i: the 2 low bits of code 64s + 4v + i
 *     Q2_K: sc [16 g][16 col] the file's byte (scale | minimum << 4);  d, dmin [16 col] fp16
 *     Q3_K: hm [8 h][16 col][4] bit b of byte i: the third bit of code 4(h + 8b) + i;
 *           sc [3][16 col][4] the file's 12 bytes of 6-bit scales, as three words;  d [16 col] fp16
 * so a 64-byte vector v gives four codes of all sixteen columns for each of the four segments s. */
#include <immintrin.h>
#include <string.h>

#include "gguf_k.h"

int k_low_type(int64_t type) { return type == GGML_Q2_K || type == GGML_Q3_K; }

/* ---- AVX-512 (VNNI) ------------------------------------------------------------------------------ */
/* The codes of segment s from vector v: four codes (64s + 4v + i) of sixteen columns, a lane each.
 * Q3_K's third bit is bit 2s + v / 8 of mask vector v % 8; 16-bit shifts of at most 5 carry bits
 * across bytes only where the 0x04 mask drops them. */
AVX512 __m512i k_low_codes_512(const int three, const uint8_t *t, int v, int s) {
    const __m512i q = _mm512_loadu_si512(t + K2_QS + 64 * v);
    __m512i c = _mm512_and_si512(_mm512_srli_epi16(q, 2 * s), _mm512_set1_epi8(0x03));
    if (three) {
        const __m512i h = _mm512_loadu_si512(t + K3_HM + 64 * (v % 8));
        const int bit = 2 * s + v / 8;
        const __m512i moved = bit <= 2 ? _mm512_slli_epi16(h, 2 - bit) : _mm512_srli_epi16(h, bit - 2);
        c = _mm512_or_si512(c, _mm512_and_si512(moved, _mm512_set1_epi8(0x04)));
    }
    return c;
}

/* Q3_K's sixteen 6-bit scales of sixteen columns from the file's three words each (llama.cpp's
 * unpacking, a lane per column): byte i of sc[k] is the scale of group 4k + i, 0..63 (minus 32 to use) */
AVX512 void k3_scales_512(const uint8_t *t, __m512i sc[4]) {
    const __m512i u0 = _mm512_loadu_si512(t + K3_SC), u1 = _mm512_loadu_si512(t + K3_SC + 64), u2 = _mm512_loadu_si512(t + K3_SC + 128);
    const __m512i four = _mm512_set1_epi32(0x0F0F0F0F), two = _mm512_set1_epi32(0x03030303);
    for (int k = 0; k < 4; k++) {
        const __m512i low = _mm512_and_si512(k % 2 ? u1 : u0, four);
        const __m512i nibble = k < 2 ? low : _mm512_and_si512(_mm512_srli_epi32(k % 2 ? u1 : u0, 4), four);
        sc[k] = _mm512_or_si512(nibble, _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u2, 2 * k), two), 4));
    }
}

/* group g's scale (Q2_K: its low nibble; Q3_K: sc − 32) and the weight its minimums' integer gets
 * (Q2_K: the high nibble, m; Q3_K: the code offset, 4 · (sc − 32)), a lane per column */
AVX512 __m512i k_low_scale_512(const int three, const uint8_t *t, const __m512i sc3[4], int g) {
    if (three) return _mm512_sub_epi32(byte_512(sc3[g / 4], g % 4), _mm512_set1_epi32(32));
    return _mm512_and_si512(unsigned_bytes_512(t + K2_SC + 16 * g), _mm512_set1_epi32(0x0F));
}
AVX512 __m512i k_low_min_512(const int three, const uint8_t *t, const __m512i sc3[4], int g) {
    if (three) return _mm512_slli_epi32(k_low_scale_512(1, t, sc3, g), 2);
    return _mm512_srli_epi32(unsigned_bytes_512(t + K2_SC + 16 * g), 4);
}

/* add_scaled_512 (gguf_k.h) in one instruction a group: a group's Σ q·x fits in 16 bits (at most
 * 16 · 7 · 127 in magnitude), so vpdpwssd multiplies each lane's low half by the scale held in the
 * low half of the scale's lane (its high half 0) and adds the product: the same exact integer as
 * vpmulld and vpaddd, in one cheaper instruction (Q2_K, 16 rows, one thread of an AMD EPYC Zen 5:
 * 197 → 229 G multiply-adds/s; one row unchanged). */
AVX512 void add_scaled16_512(__m512i *sums, __m512i lo[][MAX_ROWS], __m512i hi[][MAX_ROWS], __m512i sl, __m512i sh, const int R) {
    const __m512i low16 = _mm512_set1_epi32(0xFFFF);
    sl = _mm512_and_si512(sl, low16), sh = _mm512_and_si512(sh, low16);  /* Q3_K's negative scales: their low half */
    for (int c = 1; c < chains(R); c++)
        for (int r = 0; r < R; r++) lo[0][r] = _mm512_add_epi32(lo[0][r], lo[c][r]), hi[0][r] = _mm512_add_epi32(hi[0][r], hi[c][r]);
    for (int r = 0; r < R; r++) sums[r] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(sums[r], lo[0][r], sl), hi[0][r], sh);
}

AVX512 void k_low_tile_512(const int three, const uint8_t *t, int64_t nb, const q8_block *const *x, const int R, __m512 *acc) {
    const int bytes = three ? K3_BYTES : K2_BYTES;
    for (int64_t b = 0; b < nb; b++, t += bytes) {
        prefetch_ahead(t, bytes);
        __m512i sc3[4], sums[MAX_ROWS], mins[MAX_ROWS];
        if (three) k3_scales_512(t, sc3);
        for (int r = 0; r < R; r++) sums[r] = mins[r] = _mm512_setzero_si512();
        /* unrolled, every shift below is a constant: one row 2.45 → 1.20 ms (Q2_K), 3.34 → 1.83 (Q3_K) */
        _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {  /* group g (segment g / 4) and g + 8 (segment g / 4 + 2), vectors 4(g % 4).. */
            const int s = g / 4;
            __m512i lo[CHAINS][MAX_ROWS], hi[CHAINS][MAX_ROWS];
            for (int c = 0; c < chains(R); c++)
                for (int r = 0; r < R; r++) lo[c][r] = hi[c][r] = _mm512_setzero_si512();
            _Pragma("GCC unroll 4") for (int v = 4 * (g % 4); v < 4 * (g % 4) + 4; v++)
                products_intrinsic_512(lo, hi, v % chains(R), k_low_codes_512(three, t, v, s), k_low_codes_512(three, t, v, s + 2),
                                       x, b, 64 * s + 4 * v, R);  /* segment s + 2: 128 further */
            add_scaled16_512(sums, lo, hi, k_low_scale_512(three, t, sc3, g), k_low_scale_512(three, t, sc3, g + 8), R);
        }
        for (int k = 0; k < 8; k++) {  /* groups 2k and 2k + 1 against X's 16-sums, one vpdpwssd */
            const __m512i m = pairs16_512(k_low_min_512(three, t, sc3, 2 * k), k_low_min_512(three, t, sc3, 2 * k + 1));
            for (int r = 0; r < R; r++) mins[r] = _mm512_dpwssd_epi32(mins[r], m, _mm512_set1_epi32(load32(x[r][b].bsums + 2 * k)));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + (three ? K3_D : K2_D))));
        const __m512 dmin = three ? d : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + K2_DMIN)));
        for (int r = 0; r < R; r++) float_step_512(&acc[r], sums[r], mins[r], x[r][b].d, d, dmin);
    }
}

/* each type and row count its own function: the rows' sums stay in registers */
#define K_LOW_ROWS_512(R)                                                                                              \
    __attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) static void q2_k_rows_512_##R(               \
        const uint8_t *t, int64_t nb, const q8_block *const *x, __m512 *acc) { k_low_tile_512(0, t, nb, x, R, acc); } \
    __attribute__((target("avx512f,avx512bw,avx512vnni"), noinline)) static void q3_k_rows_512_##R(               \
        const uint8_t *t, int64_t nb, const q8_block *const *x, __m512 *acc) { k_low_tile_512(1, t, nb, x, R, acc); }
K_LOW_ROWS_512(1)
K_LOW_ROWS_512(2)
K_LOW_ROWS_512(3)
K_LOW_ROWS_512(4)

__attribute__((target("avx512f,avx512bw,avx512vnni")))
void k_low_tile_rows_512(int type, int rows, const uint8_t *t, int64_t nb, const q8_block *const *x, float out[][TILE]) {
    typedef void (*fn)(const uint8_t *, int64_t, const q8_block *const *, __m512 *);
    static const fn q2[] = {NULL, q2_k_rows_512_1, q2_k_rows_512_2, q2_k_rows_512_3, q2_k_rows_512_4};
    static const fn q3[] = {NULL, q3_k_rows_512_1, q3_k_rows_512_2, q3_k_rows_512_3, q3_k_rows_512_4};
    __m512 acc[MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    (type == GGML_Q3_K ? q3 : q2)[rows](t, nb, x, acc);
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out[r], acc[r]);
}

/* ---- AVX2: columns 8·half .. 8·half + 7 (bytes 32·half.. of each 64-byte vector) ---------------- */
AVX2 __m256i k_low_codes_256(const int three, const uint8_t *t, int v, int s, int half) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(t + K2_QS + 64 * v + 32 * half));
    __m256i c = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s), _mm256_set1_epi8(0x03));
    if (three) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)(t + K3_HM + 64 * (v % 8) + 32 * half));
        const int bit = 2 * s + v / 8;
        const __m256i moved = bit <= 2 ? _mm256_slli_epi16(h, 2 - bit) : _mm256_srli_epi16(h, bit - 2);
        c = _mm256_or_si256(c, _mm256_and_si256(moved, _mm256_set1_epi8(0x04)));
    }
    return c;
}

AVX2 void k3_scales_256(const uint8_t *t, int half, __m256i sc[4]) {
    const uint8_t *p = t + K3_SC + 32 * half;
    const __m256i u0 = _mm256_loadu_si256((const __m256i *)p), u1 = _mm256_loadu_si256((const __m256i *)(p + 64));
    const __m256i u2 = _mm256_loadu_si256((const __m256i *)(p + 128));
    const __m256i four = _mm256_set1_epi32(0x0F0F0F0F), two = _mm256_set1_epi32(0x03030303);
    for (int k = 0; k < 4; k++) {
        const __m256i low = _mm256_and_si256(k % 2 ? u1 : u0, four);
        const __m256i nibble = k < 2 ? low : _mm256_and_si256(_mm256_srli_epi32(k % 2 ? u1 : u0, 4), four);
        sc[k] = _mm256_or_si256(nibble, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u2, 2 * k), two), 4));
    }
}

AVX2 __m256i k_low_scale_256(const int three, const uint8_t *t, const __m256i sc3[4], int g, int half) {
    if (three) return _mm256_sub_epi32(byte_256(sc3[g / 4], g % 4), _mm256_set1_epi32(32));
    return _mm256_and_si256(unsigned_bytes_to_i32(t + K2_SC + 16 * g + 8 * half), _mm256_set1_epi32(0x0F));
}
AVX2 __m256i k_low_min_256(const int three, const uint8_t *t, const __m256i sc3[4], int g, int half) {
    if (three) return _mm256_slli_epi32(k_low_scale_256(1, t, sc3, g, half), 2);
    return _mm256_srli_epi32(unsigned_bytes_to_i32(t + K2_SC + 16 * g + 8 * half), 4);
}

AVX2 void k_low_tile_256(const int three, const uint8_t *t, int64_t nb, const q8_block *const *x, const int R, int half, __m256 *acc) {
    const int bytes = three ? K3_BYTES : K2_BYTES;
    for (int64_t b = 0; b < nb; b++, t += bytes) {
        if (!half) prefetch_ahead(t, bytes);  /* the second half finds the tile in cache */
        __m256i sc3[4], sums[MAX_ROWS], mins[MAX_ROWS];
        if (three) k3_scales_256(t, half, sc3);
        for (int r = 0; r < R; r++) sums[r] = mins[r] = _mm256_setzero_si256();
        for (int g = 0; g < 16; g++) {  /* group g: segment g / 4, vectors 4(g % 4).. */
            const __m256i s = k_low_scale_256(three, t, sc3, g, half), scale = pairs16_256(s, s);
            _Pragma("GCC unroll 4") for (int v = 4 * (g % 4); v < 4 * (g % 4) + 4; v++) {
                const __m256i c = k_low_codes_256(three, t, v, g / 4, half);
                for (int r = 0; r < R; r++) sums[r] = scaled_dot4_256(sums[r], c, x[r][b].qs + 64 * (g / 4) + 4 * v, scale);
            }
        }
        for (int k = 0; k < 8; k++) {
            const __m256i m = pairs16_256(k_low_min_256(three, t, sc3, 2 * k, half), k_low_min_256(three, t, sc3, 2 * k + 1, half));
            for (int r = 0; r < R; r++)
                mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(m, _mm256_set1_epi32(load32(x[r][b].bsums + 2 * k))));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + (three ? K3_D : K2_D) + 16 * half)));
        const __m256 dmin = three ? d : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(t + K2_DMIN + 16 * half)));
        for (int r = 0; r < R; r++) float_step_256(&acc[r], sums[r], mins[r], x[r][b].d, d, dmin);
    }
}

#define K_LOW_ROWS_256(R)                                                                                               \
    __attribute__((noinline)) static void k_low_rows_256_##R(int three, const uint8_t *t, int64_t nb,                 \
                                                             const q8_block *const *x, float out[][TILE]) {           \
        for (int half = 0; half < 2; half++) {                                                                         \
            __m256 acc[R];                                                                                             \
            for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                                                  \
            if (three) k_low_tile_256(1, t, nb, x, R, half, acc);                                                      \
            else k_low_tile_256(0, t, nb, x, R, half, acc);                                                            \
            for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + 8 * half, acc[r]);                                   \
        }                                                                                                              \
    }
K_LOW_ROWS_256(1)
K_LOW_ROWS_256(2)
K_LOW_ROWS_256(3)
K_LOW_ROWS_256(4)

void k_low_tile_rows_256(int type, int rows, const uint8_t *t, int64_t nb, const q8_block *const *x, float out[][TILE]) {
    typedef void (*fn)(int, const uint8_t *, int64_t, const q8_block *const *, float[][TILE]);
    static const fn by_rows[] = {NULL, k_low_rows_256_1, k_low_rows_256_2, k_low_rows_256_3, k_low_rows_256_4};
    by_rows[rows](type == GGML_Q3_K, t, nb, x, out);
}

/* ---- AMX: one tile multiply per group of 16 inputs (four vectors' codes are B's four rows), two at a time */
/* A super-block's B tiles (K_IMAGE_BYTES): group g's four vectors' codes at 256 g */
INLINE_AMX void k_low_images(const int three, const uint8_t *t, uint8_t *img) {
    for (int g = 0; g < 16; g++)
        for (int i = 0; i < 4; i++) _mm512_store_si512(img + 256 * g + 64 * i, k_low_codes_512(three, t, 4 * (g % 4) + i, g / 4));
}

AMX_TARGET void k_low_amx_images(int type, const uint8_t *t, uint8_t *img) {
    if (type == GGML_Q3_K) k_low_images(1, t, img);
    else k_low_images(0, t, img);
}

INLINE_AMX void k_low_amx(int emulate, const int three, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_block *x,
                          int R, float out[][TILE]) {
    const size_t row_bytes = (size_t)nb * sizeof(q8_block);
    const int bytes = three ? K3_BYTES : K2_BYTES;
    __attribute__((aligned(64))) uint8_t local[K_IMAGE_BYTES];
    __m512 acc[AMX_MAX_ROWS];
    tile_use use;
    t_setup(emulate, R, 16, &use);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, t += bytes) {
        prefetch_ahead(t, bytes);
        __m512i sc3[4], sums[AMX_MAX_ROWS], mins[AMX_MAX_ROWS];
        if (three) k3_scales_512(t, sc3);
        const uint8_t *img = images ? images + b * K_IMAGE_BYTES : (k_low_images(three, t, local), local);
        for (int r = 0; r < R; r++) sums[r] = mins[r] = _mm512_setzero_si512();
        for (int g = 0; g < 16; g += 2)  /* groups g and g + 1, one in each tile set */
            amx_scaled_pair(emulate, row_bytes, x[b].qs + 16 * g, img + 256 * g, k_low_scale_512(three, t, sc3, g),
                            x[b].qs + 16 * (g + 1), img + 256 * (g + 1), k_low_scale_512(three, t, sc3, g + 1), sums, R);
        for (int k = 0; k < 8; k++) {
            const __m512i m = pairs16_512(k_low_min_512(three, t, sc3, 2 * k), k_low_min_512(three, t, sc3, 2 * k + 1));
            for (int r = 0; r < R; r++)
                mins[r] = _mm512_dpwssd_epi32(mins[r], m, _mm512_set1_epi32(load32(x[(size_t)r * (size_t)nb + b].bsums + 2 * k)));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + (three ? K3_D : K2_D))));
        const __m512 dmin = three ? d : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + K2_DMIN)));
        for (int r = 0; r < R; r++) float_step_512(&acc[r], sums[r], mins[r], x[(size_t)r * (size_t)nb + b].d, d, dmin);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
    t_done(emulate, &use);
}

AMX_TARGET void k_low_amx_rows(int emulate, int type, int rows, const uint8_t *t, const uint8_t *images, int64_t nb,
                               const q8_block *x, float out[][TILE]) {
    /* each call with constant flags, so that each inlined copy is specialised */
    const int three = type == GGML_Q3_K;
    if (emulate && three) k_low_amx(1, 1, t, images, nb, x, rows, out);
    else if (emulate) k_low_amx(1, 0, t, images, nb, x, rows, out);
    else if (three) k_low_amx(0, 1, t, images, nb, x, rows, out);
    else k_low_amx(0, 0, t, images, nb, x, rows, out);
}

/* ---- exact dequantization (the gather): gguf-py's float32 operations, in its order --------------- */
void k_low_dequantize_column(int type, const uint8_t *t, int c, float *y) {
    for (int k = 0; k < QK_K; k++) {  /* code k: segment k / 64, vector (k % 64) / 4, byte k % 4 */
        int q = (t[K2_QS + 64 * ((k % 64) / 4) + 4 * c + k % 4] >> (2 * (k / 64))) & 3;
        const int g = k / 16;
        if (type == GGML_Q2_K) {
            const uint8_t sc = t[K2_SC + 16 * g + c];
            const float dl = half(t + K2_D + 2 * c) * (float)(sc & 0x0F), ml = half(t + K2_DMIN + 2 * c) * (float)(sc >> 4);
            y[k] = dl * (float)q - ml;
        } else {
            q |= ((t[K3_HM + 64 * ((k / 4) % 8) + 4 * c + k % 4] >> (k / 32)) & 1) << 2;
            const int low = (t[K3_SC + 64 * ((g % 8) / 4) + 4 * c + g % 4] >> (4 * (g / 8))) & 0x0F;
            const int high = (t[K3_SC + 128 + 4 * c + g % 4] >> (2 * (g / 4))) & 0x03;
            y[k] = (half(t + K3_D + 2 * c) * (float)((low | high << 4) - 32)) * (float)(q - 4);
        }
    }
}
