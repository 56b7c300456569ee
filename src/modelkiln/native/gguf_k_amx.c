/* AMX tiles for GgufMatMul's Q4_K, Q5_K and Q6_K (Q2_K's and Q3_K's are gguf_k_low.c's): up to sixteen
 * rows of X against a tile of sixteen columns, one tile multiply per sub-block of 32 inputs (Q4_K, Q5_K:
 * the codes of eight vectors are B's eight rows) or group of 16 (Q6_K: four vectors' codes), two at a
 * time (a sub-block's low and high nibbles, or Q6_K's groups g and g + 8, one in each tile set of
 * gguf_amx_tiles.h). The A tile is the rows' codes read in place (row r is nb blocks further on); each
 * product, exact, times its sub-block scale goes into the same integer sums as the AVX-512 kernel's,
 * then the minimums and the float step as there (gguf_k.h): the same bits as the AVX-512 and AVX2
 * kernels, alone or with any other rows.
 *
 * Compiled twice, with the AMX instructions and over the C model of the tiles, as gguf_amx.c's kernels;
 * k_use_amx checks either against the AVX-512 kernels, bit for bit, before it turns it on (gguf_ops.c
 * asks for it, in a child process first). */
#include <stdlib.h>
#include <string.h>

#include "gguf_amx_tiles.h"
#include "gguf_k.h"

/* A Q4_K (five: Q5_K) super-block's B tiles (K_IMAGE_BYTES): sub-block j's low nibbles at 1024 j, its high
 * ones (sub-block j + 4) 512 bytes on, each eight vectors' codes */
INLINE_AMX void q4_k_images(const int five, const uint8_t *t, uint8_t *img) {
    for (int v = 0; v < 32; v++) {  /* vector v: sub-block v / 8 */
        __m512i c0, c1;
        q4_k_codes_512(five, t, v, &c0, &c1);
        _mm512_store_si512(img + 1024 * (v / 8) + 64 * (v % 8), c0);
        _mm512_store_si512(img + 1024 * (v / 8) + 512 + 64 * (v % 8), c1);
    }
}

INLINE_AMX void q4_k_amx(int emulate, const int five, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_block *x,
                         int R, float out[][TILE]) {
    const size_t row_bytes = (size_t)nb * sizeof(q8_block);
    const int bytes = five ? K5_BYTES : K4_BYTES;
    __attribute__((aligned(64))) uint8_t local[K_IMAGE_BYTES];
    __m512 acc[AMX_MAX_ROWS];
    tile_use use;
    t_setup(emulate, R, 32, &use);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, t += bytes) {
        prefetch_ahead(t, bytes);
        __m512i sc[2], mn[2], sums[AMX_MAX_ROWS], mins[AMX_MAX_ROWS];
        k4_scales_mins_512(t, sc, mn);
        const uint8_t *img = images ? images + b * K_IMAGE_BYTES : (q4_k_images(five, t, local), local);
        for (int r = 0; r < R; r++) sums[r] = mins[r] = _mm512_setzero_si512();
        for (int j = 0; j < 4; j++)  /* sub-block j from the low nibbles, j + 4 from the high */
            amx_scaled_pair(emulate, row_bytes, x[b].qs + 32 * j, img + 1024 * j, byte_512(sc[0], j), x[b].qs + 128 + 32 * j,
                            img + 1024 * j + 512, byte_512(sc[1], j), sums, R);
        for (int k = 0; k < 4; k++) {
            const __m512i m = byte_pair_512(mn[k / 2], 2 * (k % 2));
            for (int r = 0; r < R; r++)
                mins[r] = _mm512_dpwssd_epi32(mins[r], m, _mm512_set1_epi32(load32(x[(size_t)r * (size_t)nb + b].bsums32 + 2 * k)));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + (five ? K5_D : K4_D))));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + (five ? K5_DMIN : K4_DMIN))));
        for (int r = 0; r < R; r++) float_step_512(&acc[r], sums[r], mins[r], x[(size_t)r * (size_t)nb + b].d, d, dmin);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
    t_done(emulate, &use);
}

/* A Q6_K super-block's B tiles (K_IMAGE_BYTES): group g's codes at 512 g, group g + 8's 256 bytes on, each
 * four vectors' codes */
INLINE_AMX void q6_k_images(const uint8_t *t, uint8_t *img) {
    for (int v = 0; v < 32; v++) {  /* vector v: group v / 4 */
        __m512i c0, c1;
        q6_k_codes_512(t, v, &c0, &c1);
        _mm512_store_si512(img + 512 * (v / 4) + 64 * (v % 4), c0);
        _mm512_store_si512(img + 512 * (v / 4) + 256 + 64 * (v % 4), c1);
    }
}

INLINE_AMX void q6_k_amx(int emulate, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_block *x, int R,
                         float out[][TILE]) {
    const size_t row_bytes = (size_t)nb * sizeof(q8_block);
    __attribute__((aligned(64))) uint8_t local[K_IMAGE_BYTES];
    __m512 acc[AMX_MAX_ROWS];
    tile_use use;
    t_setup(emulate, R, 16, &use);
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, t += K6_BYTES) {
        prefetch_ahead(t, K6_BYTES);
        __m512i sums[AMX_MAX_ROWS], mins[AMX_MAX_ROWS];
        const uint8_t *img = images ? images + b * K_IMAGE_BYTES : (q6_k_images(t, local), local);
        for (int r = 0; r < R; r++) sums[r] = mins[r] = _mm512_setzero_si512();
        for (int g = 0; g < 8; g++)  /* group g (codes 16g..) and g + 8 (codes 128 + 16g..) */
            amx_scaled_pair(emulate, row_bytes, x[b].qs + 16 * g, img + 512 * g,
                            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + K6_SC + 16 * g))),
                            x[b].qs + 128 + 16 * g, img + 512 * g + 256,
                            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + K6_SC + 16 * (g + 8)))), sums, R);
        for (int k = 0; k < 8; k++) {  /* the codes are q + 32: 32 · scale against the 16-sums */
            const __m512i m = pairs16_512(_mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + K6_SC + 32 * k))), 5),
                                          _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(t + K6_SC + 32 * k + 16))), 5));
            for (int r = 0; r < R; r++)
                mins[r] = _mm512_dpwssd_epi32(mins[r], m, _mm512_set1_epi32(load32(x[(size_t)r * (size_t)nb + b].bsums + 2 * k)));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(t + K6_D)));
        for (int r = 0; r < R; r++) float_step_512(&acc[r], sums[r], mins[r], x[(size_t)r * (size_t)nb + b].d, d, d);
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
    t_done(emulate, &use);
}

/* Each type's kernel, ``emulate`` a constant in each of the two entries below (the instructions, the model) */
INLINE_AMX void k_rows(int emulate, int type, int R, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_block *x,
                       float out[][TILE]) {
    if (k_low_type(type)) k_low_amx_rows(emulate, type, R, t, images, nb, x, out);
    else if (type == GGML_Q4_K) q4_k_amx(emulate, 0, t, images, nb, x, R, out);
    else if (type == GGML_Q5_K) q4_k_amx(emulate, 1, t, images, nb, x, R, out);
    else q6_k_amx(emulate, t, images, nb, x, R, out);
}
AMX_TARGET static void k_rows_amx(int type, int R, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_block *x,
                                  float out[][TILE]) {
    k_rows(0, type, R, t, images, nb, x, out);
}
AMX_TARGET static void k_rows_model(int type, int R, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_block *x,
                                    float out[][TILE]) {
    k_rows(1, type, R, t, images, nb, x, out);
}

typedef void (*k_amx_fn)(int, int, const uint8_t *, const uint8_t *, int64_t, const q8_block *, float[][TILE]);
static k_amx_fn amx_rows = NULL;

int k_amx_on(void) { return amx_rows != NULL; }

void k_amx_rows(int type, int rows, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_block *x, float out[][TILE]) {
    amx_rows(type, rows, t, images, nb, x, out);
}

AMX_TARGET void k_amx_images(int type, const uint8_t *t, int64_t nb, uint8_t *images) {
    const size_t bytes = k_tile_block_bytes(type);
    for (int64_t b = 0; b < nb; b++, t += bytes, images += K_IMAGE_BYTES) {
        if (k_low_type(type)) k_low_amx_images(type, t, images);
        else if (type == GGML_Q4_K) q4_k_images(0, t, images);
        else if (type == GGML_Q5_K) q4_k_images(1, t, images);
        else q6_k_images(t, images);
    }
}

/* Products of every K-quant through the AMX kernel, for every row count a tile takes, and through
 * the AVX-512 one: the same bits? */
static int agrees_with_avx512(k_amx_fn fn) {
    enum { NB = 2, ROWS = 16 };
    /* each type, where its fp16 scale d and (0: none) its minimums' scale dmin lie */
    static const struct { int type, bytes, d, dmin; } types[] = {{GGML_Q2_K, K2_BYTES, K2_D, K2_DMIN},
        {GGML_Q3_K, K3_BYTES, K3_D, 0}, {GGML_Q4_K, K4_BYTES, K4_D, K4_DMIN}, {GGML_Q5_K, K5_BYTES, K5_D, K5_DMIN},
        {GGML_Q6_K, K6_BYTES, K6_D, 0}};
    uint8_t *tile = aligned_alloc(64, NB * K6_BYTES);  /* the largest */
    q8_block *x = aligned_alloc(64, sizeof(q8_block) * ROWS * NB);
    uint8_t *images = aligned_alloc(64, NB * K_IMAGE_BYTES);
    uint32_t seed = 54321;
    int same = 1;
    for (int i = 0; i < ROWS * NB; i++) {
        float values[QK_K];
        for (int j = 0; j < QK_K; j++) values[j] = (float)((int)((seed = seed * 1103515245u + 12345u) >> 16) % 255 - 127);
        k_quantize_row(values, QK_K, x + i);
    }
    for (size_t k = 0; k < sizeof types / sizeof *types && same; k++) {
        const int type = types[k].type, bytes = types[k].bytes;
        for (int i = 0; i < NB * bytes; i++) tile[i] = (uint8_t)((seed = seed * 1103515245u + 12345u) >> 16);
        for (int b = 0; b < NB; b++)  /* finite fp16 scales: 1/64 */
            for (int c = 0; c < TILE; c++) {
                memcpy(tile + b * bytes + types[k].d + 2 * c, &(uint16_t){0x2400}, 2);
                if (types[k].dmin) memcpy(tile + b * bytes + types[k].dmin + 2 * c, &(uint16_t){0x2400}, 2);
            }
        float ours[ROWS][TILE], theirs[ROWS][TILE];
        for (int r = 0; r < ROWS; r += 4) {
            const q8_block *rows[4] = {x + r * NB, x + (r + 1) * NB, x + (r + 2) * NB, x + (r + 3) * NB};
            k_tile_rows(type, 4, tile, NB, rows, theirs + r);
        }
        k_amx_images(type, tile, NB, images);
        for (int R = 1; R <= ROWS && same; R++)
            for (int unpacked = 0; unpacked < 2 && same; unpacked++) {  /* block by block, and from the images */
                fn(type, R, tile, unpacked ? images : NULL, NB, x, ours);
                same = !memcmp(ours, theirs, sizeof(float) * TILE * (size_t)R);
            }
    }
    free(tile);
    free(x);
    free(images);
    return same;
}

/* 0: off; 1: the CPU's AMX; 2: the model of its tiles (tests). The kernels go on only where their products
 * agree with the AVX-512 kernels' (call after kiln_gguf_use_avx512(1), where q32_amx_available
 * said AMX_ON); returns what it found (an amx_state). */
int k_use_amx(int mode) {
    amx_rows = NULL;
    if (mode != 1 && mode != 2) return AMX_OFF;
    const k_amx_fn fn = mode == 1 ? k_rows_amx : k_rows_model;
    if (!agrees_with_avx512(fn)) return AMX_DISAGREES;
    amx_rows = fn;
    return mode == 1 ? AMX_ON : AMX_MODEL;
}
