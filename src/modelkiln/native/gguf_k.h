/* What the K-quant kernels share (gguf_k456.c: Q4_K, Q5_K, Q6_K; gguf_k_low.c: Q2_K, Q3_K): X's
 * int8 codes per 256 inputs, and the steps every type's kernel is made of, in their AVX-512 (VNNI),
 * AVX2 and AMX forms. A super-block of 256 inputs of sixteen columns (a tile's) is multiplied with
 * each row of X into two exact integers
 *     sums = Σ_sub-blocks scale · Σ code · x     and     mins = Σ min · (16- or 32-sums of x)
 * (the minimums, or a code offset times the scale: Q6_K's 32, Q3_K's 4), then the same float
 * operations: acc += dx · (d · sums − dmin · mins). However the integers are formed (how many rows
 * at once, AVX2, AVX-512 or AMX) they are the same, so a row's result is the same bits alone, in
 * any batch, on any of them: an answer does not depend on its batch. */
#ifndef KILN_GGUF_K_H
#define KILN_GGUF_K_H

#include <immintrin.h>
#include <stdint.h>

#include "gguf_amx_tiles.h"
#include "gguf_tiles.h"

#define QK_K 256
enum { GGML_Q2_K = 10, GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };

/* ---- the weights: tiles of sixteen columns (convert/gguf/tiles.py writes them) ----------------- */
/* A tile's super-block holds sixteen columns' blocks with the codes interleaved four at a time,
 * so that each 32-bit lane of a 64-byte vector is one column (offsets below; tiles.py draws
 * the layout). The values are the file's, moved. */
enum {  /* byte offsets inside one tile super-block */
    K4_QS = 0, K4_SC = 2048 /* [3 words][16] */, K4_D = 2240, K4_DMIN = 2272, K4_BYTES = 2304,
    K5_QH = 2240 /* Q5_K: Q4_K's codes and scales, then its fifth bits */, K5_D = 2752, K5_DMIN = 2784, K5_BYTES = 2816,
    K6_QL = 0, K6_QH = 2048, K6_SC = 3072, K6_D = 3328, K6_BYTES = 3360,
    K2_QS = 0 /* Q2_K and Q3_K: 2-bit codes [16 v][16 col][4] */, K2_SC = 1024 /* [16][16 col] */, K2_D = 1280, K2_DMIN = 1312, K2_BYTES = 1344,
    K3_QS = K2_QS /* the same 2-bit codes */, K3_HM = 1024 /* [8][16 col][4] */, K3_SC = 1536 /* [3 words][16] */, K3_D = 1728, K3_BYTES = 1760,
};

/* ---- activations: int8 codes per 256 inputs ---------------------------------------------------- */
typedef struct {  /* 64-byte aligned: the dot products' 32- and 64-byte loads never split a cache line */
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];   /* sums of each 16 codes (Q2_K's, Q3_K's and Q6_K's groups) */
    int16_t bsums32[QK_K / 32]; /* and of each 32 (Q4_K's sub-blocks) */
    float d;
} __attribute__((aligned(64))) q8_block;

/* Products summed into one register wait for each other (vpdpbusd takes several cycles): with few
 * rows, each row's sums are split over independent registers (exact integers: added back after). */
#define CHAINS 4
static inline int chains(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }

/* ---- AVX-512 (VNNI): all sixteen columns in one vector ------------------------------------------ */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vnni"), always_inline)) static inline

AVX512 __m512i pairs16_512(__m512i first, __m512i second) {
    return _mm512_or_si512(_mm512_and_si512(first, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(second, 16));
}

AVX512 void float_step_512(__m512 *acc, __m512i sums, __m512i mins, float dx, __m512 d, __m512 dmin) {
    __m512 t = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), dmin, _mm512_mul_ps(_mm512_cvtepi32_ps(sums), d));
    *acc = _mm512_fmadd_ps(_mm512_set1_ps(dx), t, *acc);
}

/* acc += codes · (the four int8 at p, broadcast to every lane): vpdpbusd written out, because GCC's
 * intrinsic copies the accumulator to another register and back around each product, which
 * doubled the instructions of the kernels' inner loops (the bits are the instruction's either way) */
#define DPBUSD_BCAST(acc, codes, p) __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(codes), "m"(*(const int32_t *)(p)))
/* the same with X's four codes already broadcast to every lane (xv): one broadcast feeding two tiles */
#define DPBUSD(acc, codes, xv) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(codes), "v"(xv))

/* Four codes of sixteen columns (first, second) against each row's four codes at byte at and
 * at + 128 of its super-block (the two halves' k4 groups v: at = 4v; Q2_K's and Q3_K's segments s
 * and s + 2), into the row's sums of chain c. Two forms of the same
 * instructions: Q4_K's loop runs faster with the product written out (DPBUSD_BCAST: one row 1.4x
 * from memory, 4-128 rows +4-7%), Q6_K's slower (its code unpacking leaves the compiler fewer
 * registers); measured with benchmarks/generation/gguf_kernels.py-sized matrices on an AMD EPYC Zen 5. */
AVX512 void products_512(__m512i lo[][MAX_ROWS], __m512i hi[][MAX_ROWS], int c, __m512i first, __m512i second,
                         const q8_block *const *x, int64_t b, int at, const int R) {
    for (int r = 0; r < R; r++) {
        DPBUSD_BCAST(lo[c][r], first, x[r][b].qs + at);
        DPBUSD_BCAST(hi[c][r], second, x[r][b].qs + 128 + at);
    }
}
AVX512 void products_intrinsic_512(__m512i lo[][MAX_ROWS], __m512i hi[][MAX_ROWS], int c, __m512i first, __m512i second,
                                   const q8_block *const *x, int64_t b, int at, const int R) {
    for (int r = 0; r < R; r++) {
        lo[c][r] = _mm512_dpbusd_epi32(lo[c][r], first, _mm512_set1_epi32(load32(x[r][b].qs + at)));
        hi[c][r] = _mm512_dpbusd_epi32(hi[c][r], second, _mm512_set1_epi32(load32(x[r][b].qs + 128 + at)));
    }
}

/* Each row's chains added back, then times the sub-block scales of the two groups, into its sums */
AVX512 void add_scaled_512(__m512i *sums, __m512i lo[][MAX_ROWS], __m512i hi[][MAX_ROWS], __m512i sl, __m512i sh, const int R) {
    for (int c = 1; c < chains(R); c++)
        for (int r = 0; r < R; r++) lo[0][r] = _mm512_add_epi32(lo[0][r], lo[c][r]), hi[0][r] = _mm512_add_epi32(hi[0][r], hi[c][r]);
    for (int r = 0; r < R; r++)
        sums[r] = _mm512_add_epi32(sums[r], _mm512_add_epi32(_mm512_mullo_epi32(lo[0][r], sl), _mm512_mullo_epi32(hi[0][r], sh)));
}

/* Q4_K's scales and minimums of sixteen columns from the file's three words each (k4_scales_mins,
 * a lane per column): sc[0] bytes are scales 0-3, sc[1] 4-7, mn likewise */
AVX512 void k4_scales_mins_512(const uint8_t *t, __m512i sc[2], __m512i mn[2]) {
    const __m512i six = _mm512_set1_epi32(0x3f3f3f3f), four = _mm512_set1_epi32(0x0f0f0f0f), two = _mm512_set1_epi32(0x03030303);
    const __m512i u0 = _mm512_loadu_si512(t + K4_SC), u1 = _mm512_loadu_si512(t + K4_SC + 64), u2 = _mm512_loadu_si512(t + K4_SC + 128);
    sc[0] = _mm512_and_si512(u0, six);
    mn[0] = _mm512_and_si512(u1, six);
    sc[1] = _mm512_or_si512(_mm512_and_si512(u2, four), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u0, 6), two), 4));
    mn[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(u2, 4), four), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(u1, 6), two), 4));
}

/* Q5_K's fifth bits of k4 group v (bit 4 of each byte): bit v / 8 of qh vector v % 8 (first: the
 * codes 4v+i; second: 128+4v+i, bit v / 8 + 4). 16-bit shifts carry bits across bytes only where
 * the 0x10 mask drops them. */
AVX512 void k5_fifth_512(const uint8_t *t, int v, __m512i *first, __m512i *second) {
    const __m512i h = _mm512_loadu_si512(t + K5_QH + 64 * (v % 8)), bit4 = _mm512_set1_epi8(0x10);
    const int j = v / 8;
    *first = _mm512_and_si512(_mm512_slli_epi16(h, 4 - j), bit4);
    *second = _mm512_and_si512(j ? _mm512_srli_epi16(h, j) : h, bit4);
}

/* Q4_K's codes of four weights of sixteen columns (five: Q5_K's, their fifth bits or'ed in): k4 group v
 * (0..31) from the low nibbles of vector v, group v + 32 from the high ones */
AVX512 void q4_k_codes_512(const int five, const uint8_t *t, int v, __m512i *first, __m512i *second) {
    const __m512i low = _mm512_set1_epi8(0x0F), q = _mm512_loadu_si512(t + K4_QS + 64 * v);
    *first = _mm512_and_si512(q, low), *second = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
    if (five) {
        __m512i f0, f1;
        k5_fifth_512(t, v, &f0, &f1);
        *first = _mm512_or_si512(*first, f0), *second = _mm512_or_si512(*second, f1);
    }
}

/* Q6_K's codes of four weights of sixteen columns: k4 group v (0..31) from the low nibbles of ql
 * vector v and bits 2f of qh vector v % 16 (f = v / 16), group v + 32 from the high nibbles and
 * bits 2(f + 2). Shifting 16-bit lanes moves bits across bytes only where the 0x30 mask drops them. */
AVX512 void q6_k_codes_512(const uint8_t *t, int v, __m512i *first, __m512i *second) {
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    const __m512i l = _mm512_loadu_si512(t + K6_QL + 64 * v), h = _mm512_loadu_si512(t + K6_QH + 64 * (v % 16));
    *first = _mm512_or_si512(_mm512_and_si512(l, low), _mm512_and_si512(v < 16 ? _mm512_slli_epi16(h, 4) : _mm512_slli_epi16(h, 2), top));
    *second = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low), _mm512_and_si512(v < 16 ? h : _mm512_srli_epi16(h, 2), top));
}

/* byte i of every lane, as int32; bytes i and i + 1 as an int16 pair (the minimums: Q4_K's of
 * sub-blocks 2k and 2k+1 against X's 32-sums of them, Q6_K's 32 · scale of groups 2k, 2k+1 against
 * its 16-sums, one vpdpwssd each) */
AVX512 __m512i byte_512(__m512i v, int i) { return _mm512_and_si512(_mm512_srli_epi32(v, 8 * i), _mm512_set1_epi32(0xFF)); }
AVX512 __m512i byte_pair_512(__m512i v, int i) { return pairs16_512(byte_512(v, i), byte_512(v, i + 1)); }

/* the sixteen bytes at p (one per column), as int32 lanes */
AVX512 __m512i unsigned_bytes_512(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }

/* ---- AVX2: eight columns a vector, the tile in two halves; vpmaddubsw makes pair sums of the
 *      products (at most 2 · 63 · 127: no saturation), and vpmaddwd multiplies them by the column's
 *      sub-block scale (an int16 pair a lane) into the exact int32 sums --------------------------- */
#define AVX2 __attribute__((always_inline)) static inline

AVX2 __m256i pairs16_256(__m256i first, __m256i second) {
    return _mm256_or_si256(_mm256_and_si256(first, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(second, 16));
}

AVX2 __m256i scaled_dot4_256(__m256i acc, __m256i codes, const int8_t *x4, __m256i scale_pairs) {
    const __m256i p = _mm256_maddubs_epi16(codes, _mm256_set1_epi32(load32(x4)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale_pairs));
}

AVX2 void float_step_256(__m256 *acc, __m256i sums, __m256i mins, float dx, __m256 d, __m256 dmin) {
    __m256 t = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), dmin, _mm256_mul_ps(_mm256_cvtepi32_ps(sums), d));
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(dx), t, *acc);
}

static inline __m256i signed_bytes_to_i32(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256i unsigned_bytes_to_i32(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

AVX2 __m256i byte_256(__m256i v, int i) { return _mm256_and_si256(_mm256_srli_epi32(v, 8 * i), _mm256_set1_epi32(0xFF)); }

/* ---- AMX (gguf_amx_tiles.h): up to sixteen rows of X a tile multiply, one per sub-block of 32
 *      inputs (Q4_K, Q5_K: the codes of eight vectors are B's eight rows) or group of 16 (Q2_K,
 *      Q3_K, Q6_K: four vectors' codes), two at a time, one in each tile set; each product (exact)
 *      times its sub-block's scale into the same integer sums as above, the minimums and the float
 *      step as above: the AVX-512 kernels' bits ------------------------------------------------------ */
/* sums[r] += scale0 · (row r's codes at a0 · codes0) + scale1 · (its codes at a1 · codes1) */
INLINE_AMX void amx_scaled_pair(int emulate, size_t row_bytes, const void *a0, const uint8_t *codes0, __m512i scale0,
                                const void *a1, const uint8_t *codes1, __m512i scale1, __m512i *sums, int R) {
    __attribute__((aligned(64))) int32_t c0[16][16], c1[16][16];
    /* both multiplies issued before either's sums are stored: the second runs while the first does */
    t_zero_c(emulate, 0);
    t_load(emulate, 0, TILE_A, a0, row_bytes);
    t_load(emulate, 0, TILE_B, codes0, 64);
    t_multiply(emulate, 0, 0);  /* the codes are unsigned: TDPBSUD */
    t_zero_c(emulate, 1);
    t_load(emulate, 1, TILE_A, a1, row_bytes);
    t_load(emulate, 1, TILE_B, codes1, 64);
    t_multiply(emulate, 1, 0);
    t_store_c(emulate, 0, c0);
    t_store_c(emulate, 1, c1);
    for (int r = 0; r < R; r++)
        sums[r] = _mm512_add_epi32(sums[r], _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(c0[r]), scale0),
                                                             _mm512_mullo_epi32(_mm512_load_si512(c1[r]), scale1)));
}

/* ---- the kernels' entry points ------------------------------------------------------------------- */
/* gguf_k456.c: X's rows quantized per 256 inputs; rows 1..4 (MAX_ROWS) against a tile with the kernel in force
 * (AVX-512 VNNI where k_use_avx512 turned it on, else AVX2), any K-quant; Q4_K's and Q5_K's two tiles (t, and u:
 * the next sixteen columns) against four rows (AVX-512 only); a tile super-block's bytes; a row dequantized as
 * gguf-py does (the gather) */
void k_quantize_row(const float *x, int64_t k, q8_block *out);
void k_use_avx512(int on);
void k_tile_rows(int type, int rows, const uint8_t *t, int64_t nb, const q8_block *const *x, float out[][TILE]);
void k_pair_rows_512(int type, const uint8_t *t, const uint8_t *u, int64_t nb, const q8_block *const *x, float out[][TILE],
                     float out2[][TILE]);
size_t k_tile_block_bytes(int64_t type);
void k_dequantize_row(int type, const uint8_t *w, int64_t row, int64_t nb, float *y);
/* gguf_k_amx.c: rows 1..16 of X at x, x + nb, ... against a tile on AMX where k_use_amx turned it on (k_amx_on);
 * the same bits as k_tile_rows. ``images``: NULL, or the tile's B tiles unpacked once by k_amx_images
 * (K_IMAGE_BYTES a super-block, every type), for many rows. */
#define K_IMAGE_BYTES 4096  /* a super-block's 256 codes of sixteen columns, as int8 */
int k_use_amx(int mode);  /* an amx_state */
int k_amx_on(void);
void k_amx_rows(int type, int rows, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_block *x, float out[][TILE]);
void k_amx_images(int type, const uint8_t *t, int64_t nb, uint8_t *images);

/* ---- Q2_K and Q3_K (gguf_k_low.c) ---------------------------------------------------------------- */
int k_low_type(int64_t type);
/* out[r][c] = row r of x · column c of a tile, 1 ≤ rows ≤ 4 (the AVX-512 and the AVX2 form) */
void k_low_tile_rows_512(int type, int rows, const uint8_t *t, int64_t nb, const q8_block *const *x, float out[][TILE]);
void k_low_tile_rows_256(int type, int rows, const uint8_t *t, int64_t nb, const q8_block *const *x, float out[][TILE]);
/* rows 1..16 of X at x, x + nb, ... against a tile on AMX (emulate: the tiles' model), and a super-block's B tiles */
void k_low_amx_rows(int emulate, int type, int rows, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_block *x,
                    float out[][TILE]);
void k_low_amx_images(int type, const uint8_t *t, uint8_t *img);
void k_low_dequantize_column(int type, const uint8_t *t, int c, float *y);

#endif
