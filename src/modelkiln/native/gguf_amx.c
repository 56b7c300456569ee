/* AMX tiles for GgufMatMul's types with one scale per 32 weights (gguf_q32.c says the arithmetic):
 * up to sixteen rows of X against a tile of sixteen columns, one tile multiply per block of 32 inputs.
 *
 * Per block: C (rows × 16 columns, int32) = A (each row's 32 int8 codes, read in place: row r of X
 * is nb blocks further on) · B (the block's codes as 8 rows of 4 inputs × 16 columns × 4 bytes, which
 * is the tile layout's four 64-byte vectors with their nibbles apart: low nibbles are inputs 0..15,
 * high ones 16..31; Q8_0's eight vectors as they are). C holds the exact Σ q·x of every row and
 * column; the float step after it is the AVX-512 kernel's own (gguf_q32_blocks.h), row by row, so a
 * row gets the same bits here as on the AVX-512 and AVX2 paths, alone or with any other rows.
 * Q4_0..Q5_1's codes are unsigned and X's signed: TDPBSUD; Q8_0's are signed too: TDPBSSD.
 * Consecutive blocks alternate between the two tile sets, and a block's float step runs while the
 * next block multiplies (amx_tile).
 *
 * The same kernel is compiled twice: with the AMX instructions, and over a plain C model of the
 * tiles it uses (gguf_amx_tiles.h), so that its data layout and arithmetic are tested on any
 * CPU with AVX-512, not only where AMX exists. The K-quants' AMX kernels are gguf_k_amx.c's.
 *
 * Off unless asked (KILN_AMX=1, or kiln_gguf_use_amx): turning it on checks that the CPU has AMX-INT8,
 * asks Linux for the tile state (arch_prctl), and compares products of every type with the AVX-512
 * kernels bit for bit, refusing AMX if any of the three fails (gguf_ops.c runs the products in a
 * child process first, so that a fault on the unit is a refusal too, not the end of the process). */
#include <cpuid.h>
#include <errno.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "gguf_q32.h"
#include "gguf_amx_tiles.h"
#include "gguf_q32_blocks.h"
#include "gguf_tiles.h"

/* A block's codes as B wants them: Q8_0's eight vectors as they are, the others' nibbles apart (and
 * their fifth bits or'ed in) into ``codes`` (the block's image, 512 bytes) */
INLINE_AMX const uint8_t *b_codes(const layout L, const uint8_t *t, uint8_t codes[8][64]) {
    if (L.codes != 256) return t;
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i h = L.high ? _mm512_loadu_si512(t + L.high) : _mm512_setzero_si512();
    for (int v = 0; v < 4; v++) {
        const __m512i q = _mm512_loadu_si512(t + 64 * v);
        __m512i c0 = _mm512_and_si512(q, low), c1 = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
        if (L.high) c0 = _mm512_or_si512(c0, fifth_bits_512(h, v, 0)), c1 = _mm512_or_si512(c1, fifth_bits_512(h, v, 1));
        _mm512_store_si512(codes[v], c0);
        _mm512_store_si512(codes[4 + v], c1);
    }
    return codes[0];
}

/* Every row's float step of block b (its tile bytes at t), from the block's exact sums */
INLINE_AMX void float_steps(const layout L, const uint8_t *t, const q8_32 *x, int64_t nb, int64_t b, int32_t sums[][16],
                            __m512 *acc, int R) {
    for (int r = 0; r < R; r++) {
        const q8_32 *xr = x + (size_t)r * (size_t)nb + b;
        __m512i isum = _mm512_load_si512(sums[r]);
        if (L.offset) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(L.offset * xr->sum));
        float_step_512(&acc[r], isum, xr, t, L);
    }
}

/* Block b multiplies in tile set b % 2 while block b − 1's float steps run on the vector units (and
 * block b + 1's multiply needs no tile of block b's): each row's float steps still come in block order,
 * so its bits are the AVX-512 kernel's. B is read from ``images`` (every block's, q32_amx_images) where
 * given, else unpacked block by block. */
INLINE_AMX void amx_tile(int emulate, int type, int R, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_32 *x,
                         float out[][TILE]) {
    const layout L = layout_of(type);
    tile_use use;
    t_setup(emulate, R, QK32, &use);  /* A: R rows × 32 codes; B: 8 groups of 4 inputs × 16 columns × 4 */
    const size_t row_bytes = (size_t)nb * sizeof(q8_32);  /* from a row's block to the next row's */
    __attribute__((aligned(64))) uint8_t codes[2][8][64];
    __attribute__((aligned(64))) int32_t sums[2][16][16];
    __m512 acc[16];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, t += L.bytes) {
        const int set = (int)(b & 1);
        prefetch_ahead(t, L.bytes);
        const uint8_t *codes_b = images ? images + b * Q32_IMAGE_BYTES : b_codes(L, t, codes[set]);
        t_zero_c(emulate, set);
        t_load(emulate, set, TILE_A, x[b].qs, row_bytes);
        t_load(emulate, set, TILE_B, codes_b, 64);
        t_multiply(emulate, set, L.codes == 512);
        if (b > 0) float_steps(L, t - L.bytes, x, nb, b - 1, sums[!set], acc, R);
        t_store_c(emulate, set, sums[set]);
    }
    float_steps(L, t - L.bytes, x, nb, nb - 1, sums[(nb - 1) & 1], acc, R);
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
    t_done(emulate, &use);
}

#define EACH_TYPE(call)                                       \
    switch (type) { /* each type's own loop, as gguf_q32.c */ \
    case GGML_Q4_0: call(GGML_Q4_0); break;                   \
    case GGML_Q4_1: call(GGML_Q4_1); break;                   \
    case GGML_Q5_0: call(GGML_Q5_0); break;                   \
    case GGML_Q5_1: call(GGML_Q5_1); break;                   \
    default: call(GGML_Q8_0);                                 \
    }

AMX_TARGET static void rows_amx(int type, int R, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_32 *x,
                                float out[][TILE]) {
#define CALL(T) amx_tile(0, T, R, t, images, nb, x, out)
    EACH_TYPE(CALL)
#undef CALL
}

AMX_TARGET static void rows_model(int type, int R, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_32 *x,
                                  float out[][TILE]) {
#define CALL(T) amx_tile(1, T, R, t, images, nb, x, out)
    EACH_TYPE(CALL)
#undef CALL
}

typedef void (*amx_rows_fn)(int, int, const uint8_t *, const uint8_t *, int64_t, const q8_32 *, float[][TILE]);
static amx_rows_fn amx_rows = NULL;

int q32_amx_on(void) { return amx_rows != NULL; }

void q32_amx_rows(int type, int rows, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_32 *x, float out[][16]) {
    amx_rows(type, rows, t, images, nb, x, out);
}

size_t q32_amx_image_bytes(int type) { return layout_of(type).codes == 256 ? Q32_IMAGE_BYTES : 0; }

AMX_TARGET void q32_amx_images(int type, const uint8_t *t, int64_t nb, uint8_t *images) {
    const layout L = layout_of(type);
    if (L.codes != 256) return;
    for (int64_t b = 0; b < nb; b++) b_codes(L, t + b * L.bytes, (uint8_t(*)[64])(images + b * Q32_IMAGE_BYTES));
}

static int cpu_has_amx_int8(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    return (d >> 24 & 1) && (d >> 25 & 1) && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}

/* 0, or arch_prctl's errno: ENOSPC where a thread's signal stack (sigaltstack) is too small for the
 * tile state a signal frame would then carry, EOPNOTSUPP where the kernel does not offer it, EINVAL
 * where it does not know the request (before 5.16). */
static int linux_grants_tiles(void) {
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : errno;
}

/* Products of every type through ``fn``, for every row count a tile takes (each its own tile
 * configuration), and through the AVX-512 kernel: the same bits? */
static int agrees_with_avx512(amx_rows_fn fn) {
    enum { NB = 3, ROWS = 16 };
    static const int types[] = {GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q8_0};
    uint8_t tile[NB * 544];
    q8_32 x[ROWS * NB];
    uint32_t seed = 12345;
    for (size_t i = 0; i < sizeof tile; i++) tile[i] = (uint8_t)((seed = seed * 1103515245u + 12345u) >> 16);
    for (int i = 0; i < ROWS * NB; i++) {
        int sum = 0;
        for (int j = 0; j < QK32; j++)  /* −127..127, as q32_quantize_row's codes */
            sum += x[i].qs[j] = (int8_t)((int)((seed = seed * 1103515245u + 12345u) >> 16) % 255 - 127);
        x[i].d = 0.01f * (float)(i % 7 + 1);
        x[i].sum = sum;
    }
    for (int k = 0; k < 5; k++) {
        const layout L = layout_of(types[k]);
        for (int b = 0; b < NB; b++)  /* finite scales: fp16 1/64 and −1/16 */
            for (int c = 0; c < 16; c++) {
                memcpy(tile + b * L.bytes + L.d + 2 * c, &(uint16_t){0x2400}, 2);
                if (L.m) memcpy(tile + b * L.bytes + L.m + 2 * c, &(uint16_t){0xAC00}, 2);
            }
        float ours[ROWS][TILE], theirs[ROWS][TILE];
        for (int r = 0; r < ROWS; r += 4) {
            const q8_32 *rows[4] = {x + r * NB, x + (r + 1) * NB, x + (r + 2) * NB, x + (r + 3) * NB};
            q32_tile_rows(types[k], 4, tile, NB, rows, theirs + r);
        }
        __attribute__((aligned(64))) uint8_t images[NB * Q32_IMAGE_BYTES];
        q32_amx_images(types[k], tile, NB, images);
        for (int R = 1; R <= ROWS; R++)
            for (int unpacked = 0; unpacked < 2; unpacked++) {  /* block by block, and from the images */
                fn(types[k], R, tile, unpacked && q32_amx_image_bytes(types[k]) ? images : NULL, NB, x, ours);
                if (memcmp(ours, theirs, sizeof(float) * TILE * (size_t)R)) return 0;
            }
    }
    return 1;
}

/* Whether ``mode`` may be tried here (AMX_ON), or why not: 1, the CPU's AMX, needs the instructions built, the
 * unit and Linux's grant (arch_prctl's errno in *error where Linux refused); 2, the model of the tiles, the
 * AVX-512 VNNI its float steps are written in; 3 (a test's check that faults) is always tried. */
int q32_amx_available(int mode, int *error) {
    *error = 0;
    if (mode == 2) return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni") ? AMX_ON : AMX_NO_UNIT;
    if (mode != 1) return AMX_ON;
    if (!AMX_COMPILED) return AMX_NOT_BUILT;
    if (!cpu_has_amx_int8()) return AMX_NO_UNIT;
    *error = linux_grants_tiles();
    return *error ? AMX_NOT_GRANTED : AMX_ON;
}

/* 0: off; 1: the CPU's AMX; 2: the model of its tiles (tests). The kernels go on only where their products
 * agree with the AVX-512 kernels' (call after q32_use_avx512(1), where q32_amx_available said AMX_ON); returns
 * what it found (an amx_state). */
int q32_use_amx(int mode) {
    amx_rows = NULL;
    if (mode != 1 && mode != 2) return AMX_OFF;
    const amx_rows_fn fn = mode == 1 ? rows_amx : rows_model;
    if (!agrees_with_avx512(fn)) return AMX_DISAGREES;
    amx_rows = fn;
    return mode == 1 ? AMX_ON : AMX_MODEL;
}
