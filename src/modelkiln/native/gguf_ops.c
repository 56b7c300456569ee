/* onnxruntime operators that compute with a GGUF file's K-quant blocks as the file stores them.
 *
 * GgufMatMul  Y[..., N] = X[..., K] · Wᵀ, W: [N, row bytes] raw Q4_K or Q6_K rows
 * GgufGather  Y[..., K] = the rows of W for token ids, dequantized exactly as gguf-py does
 * (domain "kiln.gguf"; attributes ggml_type (12: Q4_K, 14: Q6_K), K, and N for GgufMatMul).
 *
 * Why: MatMulNBits needs an fp32 scale per block and an fp32 correction for a block minimum, so a
 * Q4_K weight costs 6 bits there against the file's 4.5, and a Q6_K 10 against 6.56. Decoding one
 * token reads every weight once, so those bytes set its speed.
 *
 * How (llama.cpp's arithmetic): X is quantized to int8 per 256 inputs (one fp32 scale, and the
 * sums of each 16 codes). One row of X is dotted with the blocks directly; several rows with each
 * weight row unpacked once (byte codes interleaved so that every 32-bit lane holds one scale's
 * codes, 32-bit lane scales) and reused for four rows at a time. For every row, column and
 * super-block both paths form the same two exact integers (the scaled code products, and the
 * minimums or the Q6_K code offset against the 16-sums) and then the same float operations, so a
 * row's result is the same bits alone or in any batch, on AVX2 or AVX-512: an answer does not
 * depend on its batch.
 *
 * Built with AVX2 (every machine this package targets has it); AVX-512 forms (VNNI's vpdpbusd
 * for the products, two-source permutes for the interleave) are chosen at load time where the CPU
 * has them. Compiled with -ffp-contract=off so the gather's float operations round as gguf-py's
 * numpy ones do. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"

#define QK_K 256
enum { GGML_Q4_K = 12, GGML_Q6_K = 14 };
static const size_t BLOCK_BYTES[15] = {[GGML_Q4_K] = 144, [GGML_Q6_K] = 210};

/* ---- activations: int8 codes per 256 inputs ---------------------------------------------------- */
typedef struct {  /* 64-byte aligned: the dot products' 32- and 64-byte loads never split a cache line */
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];
    float d;
} __attribute__((aligned(64))) q8_block;

static void quantize_row(const float *x, int64_t k, q8_block *out) {
    for (int64_t b = 0; b < k / QK_K; b++, x += QK_K) {
        q8_block *o = out + b;
        float amax = 0.f;
        for (int i = 0; i < QK_K; i++) amax = fmaxf(amax, fabsf(x[i]));
        if (amax == 0.f) {
            memset(o, 0, sizeof *o);
            continue;
        }
        const float scale = 127.f / amax;
        for (int i = 0; i < QK_K; i++) o->qs[i] = (int8_t)lrintf(x[i] * scale);
        for (int j = 0; j < QK_K / 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += o->qs[16 * j + i];
            o->bsums[j] = (int16_t)s;
        }
        o->d = amax / 127.f;
    }
}

/* ---- exact integer sums, one float step per super-block ---------------------------------------- */
/* Every path computes, per row of X, column and super-block, the same two exact integers
 *     sums = Σ_sub-blocks scale · Σ code · x     and     mins = Σ min · (16-sums of x)
 * (Q4_K: 6-bit scales and minimums; Q6_K: signed 8-bit scales and the code offset 32 · scale), and
 * then the same float operations: acc += dx · (d · sums − dmin · mins) (add_block_lanes for one
 * row, add_block4 for four, lane by lane). How the integers are formed (lanes, instruction set,
 * one row or four) cannot change them, so a row's result is the same bits alone, in any batch, on
 * AVX2 or AVX-512. */

/* One row's super-block: Σ of the eight int32 of sums and of mins (lanes 0 and 1, exact), then the
 * float step on lane 0 of acc, without leaving the vector registers. */
static inline __m128 add_block_lanes(__m128 acc, __m256i sums, __m256i mins, float dx, float d, float dmin) {
    __m256i h = _mm256_hadd_epi32(sums, mins);  /* [s01 s23 m01 m23 | s45 s67 m45 m67] */
    h = _mm256_hadd_epi32(h, h);                /* [s0-3 m0-3 . . | s4-7 m4-7 . .] */
    __m128 f = _mm_cvtepi32_ps(_mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
    __m128 t = _mm_fnmadd_ss(_mm_movehdup_ps(f), _mm_set_ss(dmin), _mm_mul_ss(f, _mm_set_ss(d)));
    return _mm_fmadd_ss(_mm_set_ss(dx), t, acc);
}

/* [Σa, Σb, Σc, Σd] of four vectors of eight int32 */
static inline __m128i hsum4_i32(__m256i a, __m256i b, __m256i c, __m256i d) {
    __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

static inline __m128 add_block4(__m128 acc, __m128i sums, __m128i mins, __m128 dx, float d, float dmin) {
    __m128 t = _mm_fnmadd_ps(_mm_cvtepi32_ps(mins), _mm_set1_ps(dmin), _mm_mul_ps(_mm_cvtepi32_ps(sums), _mm_set1_ps(d)));
    return _mm_fmadd_ps(dx, t, acc);
}

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Q4_K's eight 6-bit scales and eight 6-bit minimums (12 packed bytes), a byte each, four to a
 * word: sc[0] holds scales 0-3, sc[1] scales 4-7, and mn the minimums likewise. */
static inline void k4_scales_mins(const uint8_t *p, uint32_t sc[2], uint32_t mn[2]) {
    uint32_t u[3];
    memcpy(u, p, 12);
    sc[0] = u[0] & 0x3f3f3f3f;
    mn[0] = u[1] & 0x3f3f3f3f;
    sc[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    mn[1] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
}

/* Q6_K's codes q + 32 (0..63) of one half of a block (128 weights, from 64 low and 32 high bytes),
 * as four vectors of 32 in weight order */
static inline void q6_k_half(const uint8_t *ql, const uint8_t *qh, __m256i c[4]) {
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
    __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    c[0] = _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(_mm256_and_si256(h, two), 4));
    c[1] = _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), two), 4));
    c[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), two), 4));
    c[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), two), 4));
}

/* Q6_K's codes, q + 32 (0..63), in weight order */
static void q6_k_codes(const uint8_t *b, uint8_t c[QK_K]) {
    for (int n = 0; n < 2; n++) {
        __m256i half_codes[4];
        q6_k_half(b + 64 * n, b + 128 + 32 * n, half_codes);
        for (int i = 0; i < 4; i++) _mm256_storeu_si256((__m256i *)(c + 128 * n + 32 * i), half_codes[i]);
    }
}

/* ---- one row of X: the blocks read directly, in weight order ----------------------------------- */
static float dot_q4_k_row(const uint8_t *w, const q8_block *x, int64_t nb) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 144, x++) {
        uint32_t sc[2], mn[2];
        k4_scales_mins(w + 4, sc, mn);
        /* each scale as int16 in both 128-bit halves; SCALE_OF(s) broadcasts scale s to all 16 lanes */
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc[1], (int)sc[0])));
#define SCALE_OF(s) _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (s))))
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
            __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(q, low), _mm256_load_si256((const __m256i *)(x->qs + 64 * j)));
            __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(q, 4), low),
                                              _mm256_load_si256((const __m256i *)(x->qs + 64 * j + 32)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(lo, SCALE_OF(2 * j)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(hi, SCALE_OF(2 * j + 1)));
        }
#undef SCALE_OF
        __m128i m8 = _mm_set_epi32(0, 0, (int)mn[1], (int)mn[0]);
        __m256i m = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)), _mm256_load_si256((const __m256i *)x->bsums));
        acc = add_block_lanes(acc, sumi, m, x->d, half(w), half(w + 2));
    }
    return _mm_cvtss_f32(acc);
}

static float dot_q6_k_row(const uint8_t *w, const q8_block *x, int64_t nb) {
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 210, x++) {
        const int8_t *sc = (const int8_t *)(w + 192);
        __m256i sumi = _mm256_setzero_si256();
        for (int n = 0; n < 2; n++) {  /* the codes kept in registers */
            __m256i c[4];
            q6_k_half(w + 64 * n, w + 128 + 32 * n, c);
            for (int i = 0; i < 4; i++) {  /* 32 codes, two scales of 16 */
                const int s = 4 * n + i;
                __m256i p = _mm256_maddubs_epi16(c[i], _mm256_load_si256((const __m256i *)(x->qs + 32 * s)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_setr_m128i(_mm_set1_epi16(sc[2 * s]), _mm_set1_epi16(sc[2 * s + 1]))));
            }
        }
        __m256i mins = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc)), 5);  /* 32 · scale */
        __m256i m = _mm256_madd_epi16(mins, _mm256_load_si256((const __m256i *)x->bsums));
        const float d = half(w + 208);
        acc = add_block_lanes(acc, sumi, m, x->d, d, d);
    }
    return _mm_cvtss_f32(acc);
}

/* ---- several rows: a weight row unpacked once, then four rows of X at a time ------------------- */
/* The codes are interleaved so that each 32-bit lane of a 64-byte vector belongs to one scale:
 * Q4_K (eight sub-blocks of 32): vector v holds codes 8v..8v+7 of each sub-block j at bytes
 * 8j..8j+7 (lanes 2j, 2j+1); Q6_K (sixteen groups of 16): codes 4v..4v+3 of group g at bytes
 * 4g..4g+3 (lane g). Four code · x products summed per lane (vpdpbusd, or maddubs then madd with
 * ones on AVX2), then one multiply by the lanes' scales per super-block. X's rows are laid out the
 * same way when they are quantized for this path. */
typedef struct {
    uint8_t codes[QK_K];
    int32_t scales[16];  /* per lane */
    int16_t mins[16];    /* against X's 16-sums */
    float d, dmin;
} __attribute__((aligned(64))) unpacked;

static void *aligned(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

static void interleave(int type, const uint8_t natural[QK_K], uint8_t out[QK_K]) {
    if (type == GGML_Q4_K)
        for (int v = 0; v < 4; v++)
            for (int j = 0; j < 8; j++) memcpy(out + 64 * v + 8 * j, natural + 32 * j + 8 * v, 8);
    else
        for (int v = 0; v < 4; v++)
            for (int g = 0; g < 16; g++) memcpy(out + 64 * v + 4 * g, natural + 16 * g + 4 * v, 4);
}

static void unpack_q4_k(const uint8_t *b, unpacked *u) {
    uint32_t sc_words[2], mn_words[2];
    k4_scales_mins(b + 4, sc_words, mn_words);
    const uint8_t *sc = (const uint8_t *)sc_words, *mn = (const uint8_t *)mn_words;  /* x86: byte j is number j */
    uint8_t natural[QK_K] __attribute__((aligned(32)));
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {  /* 32 bytes: the low nibbles are weights 64j.., the high 64j+32.. */
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j));
        _mm256_store_si256((__m256i *)(natural + 64 * j), _mm256_and_si256(q, low));
        _mm256_store_si256((__m256i *)(natural + 64 * j + 32), _mm256_and_si256(_mm256_srli_epi16(q, 4), low));
    }
    interleave(GGML_Q4_K, natural, u->codes);
    for (int j = 0; j < 8; j++) {
        u->scales[2 * j] = u->scales[2 * j + 1] = sc[j];
        u->mins[2 * j] = u->mins[2 * j + 1] = mn[j];
    }
    u->d = half(b);
    u->dmin = half(b + 2);
}

static void unpack_q6_k(const uint8_t *b, unpacked *u) {
    uint8_t natural[QK_K] __attribute__((aligned(32)));
    q6_k_codes(b, natural);
    interleave(GGML_Q6_K, natural, u->codes);
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int g = 0; g < 16; g++) {
        u->scales[g] = sc[g];
        u->mins[g] = (int16_t)(32 * sc[g]);  /* the codes are q + 32 */
    }
    u->d = u->dmin = half(b + 208);
}

/* The same unpacked blocks with AVX-512: the interleave is a transpose of 8-byte (Q4_K) or 4-byte
 * (Q6_K) pieces, done with two-source permutes instead of copies. */
__attribute__((target("avx512f,avx512bw")))
static void unpack_q4_k_avx512(const uint8_t *b, unpacked *u) {
    uint32_t sc[2], mn[2];
    k4_scales_mins(b + 4, sc, mn);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512i q0 = _mm512_loadu_si512(b + 16), q1 = _mm512_loadu_si512(b + 80);
    /* as 8-byte pieces T[j][v] (codes 8v..8v+7 of sub-block j): a = [T0 | T2], b = [T1 | T3], c = [T4 | T6], d = [T5 | T7] */
    __m512i a = _mm512_and_si512(q0, low), bb = _mm512_and_si512(_mm512_srli_epi16(q0, 4), low);
    __m512i c = _mm512_and_si512(q1, low), d = _mm512_and_si512(_mm512_srli_epi16(q1, 4), low);
    for (int v = 0; v < 4; v++) {  /* vector v: T0[v] T1[v] ... T7[v] */
        __m512i idx = _mm512_set_epi64(12 + v, 4 + v, 8 + v, v, 12 + v, 4 + v, 8 + v, v);
        __m512i first = _mm512_permutex2var_epi64(a, idx, bb), second = _mm512_permutex2var_epi64(c, idx, d);
        _mm512_store_si512(u->codes + 64 * v, _mm512_mask_blend_epi64(0xF0, first, second));
    }
    __m128i sc8 = _mm_set_epi32(0, 0, (int)sc[1], (int)sc[0]), mn8 = _mm_set_epi32(0, 0, (int)mn[1], (int)mn[0]);
    _mm512_store_si512(u->scales, _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sc8, sc8)));  /* each scale for two lanes */
    _mm256_store_si256((__m256i *)u->mins, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8)));
    u->d = half(b);
    u->dmin = half(b + 2);
}

__attribute__((target("avx512f,avx512bw")))
static void unpack_q6_k_avx512(const uint8_t *b, unpacked *u) {
    /* q6_k_codes in registers: z0..z3 hold codes 0-63, 64-127, 128-191, 192-255 */
    const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(3);
    const __m512i shift_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);  /* 0 | 2 */
    const __m512i shift_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);   /* 4 | 6 */
    __m512i z[4];
    for (int n = 0; n < 2; n++) {
        __m512i l = _mm512_loadu_si512(b + 64 * n);
        __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n)));
        z[2 * n] = _mm512_or_si512(_mm512_and_si512(l, low),
                                   _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift_lo), two), 4));
        z[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift_hi), two), 4));
    }
    /* 4-byte pieces G[g][v] (codes 4v..4v+3 of group g), g-major in z */
    const __m512i z0 = z[0], z1 = z[1], z2 = z[2], z3 = z[3];
    for (int v = 0; v < 4; v++) {  /* vector v: G0[v] ... G15[v] */
        __m512i idx = _mm512_set_epi32(28 + v, 24 + v, 20 + v, 16 + v, 12 + v, 8 + v, 4 + v, v,
                                       28 + v, 24 + v, 20 + v, 16 + v, 12 + v, 8 + v, 4 + v, v);
        __m512i first = _mm512_permutex2var_epi32(z0, idx, z1), second = _mm512_permutex2var_epi32(z2, idx, z3);
        _mm512_store_si512(u->codes + 64 * v, _mm512_mask_blend_epi32(0xFF00, first, second));
    }
    __m128i sc = _mm_loadu_si128((const __m128i *)(b + 192));
    _mm512_store_si512(u->scales, _mm512_cvtepi8_epi32(sc));
    _mm256_store_si256((__m256i *)u->mins, _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), 5));  /* 32 · scale */
    u->d = u->dmin = half(b + 208);
}

static void (*unpack_q4_k_fast)(const uint8_t *, unpacked *) = unpack_q4_k;
static void (*unpack_q6_k_fast)(const uint8_t *, unpacked *) = unpack_q6_k;

static void unpack_row(int type, const uint8_t *row, int64_t nb, unpacked *out) {
    for (int64_t b = 0; b < nb; b++)
        if (type == GGML_Q4_K) unpack_q4_k_fast(row + b * 144, out + b);
        else unpack_q6_k_fast(row + b * 210, out + b);
}

static void dot4_avx2(const unpacked *w, const q8_block *const x[4], const float *dx4, int64_t nb, float out[4]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w++) {
        __m256i lo[4], hi[4];
        for (int r = 0; r < 4; r++) lo[r] = hi[r] = _mm256_setzero_si256();
        for (int v = 0; v < 4; v++) {
            __m256i c0 = _mm256_load_si256((const __m256i *)(w->codes + 64 * v));
            __m256i c1 = _mm256_load_si256((const __m256i *)(w->codes + 64 * v + 32));
            for (int r = 0; r < 4; r++) {
                const int8_t *q = x[r][b].qs + 64 * v;
                lo[r] = _mm256_add_epi32(lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(c0, _mm256_load_si256((const __m256i *)q)), ones));
                hi[r] = _mm256_add_epi32(hi[r], _mm256_madd_epi16(_mm256_maddubs_epi16(c1, _mm256_load_si256((const __m256i *)(q + 32))), ones));
            }
        }
        const __m256i s0 = _mm256_load_si256((const __m256i *)w->scales), s1 = _mm256_load_si256((const __m256i *)(w->scales + 8));
        const __m256i mins = _mm256_load_si256((const __m256i *)w->mins);
        __m256i sums[4], m[4];
        for (int r = 0; r < 4; r++) {
            sums[r] = _mm256_add_epi32(_mm256_mullo_epi32(lo[r], s0), _mm256_mullo_epi32(hi[r], s1));
            m[r] = _mm256_madd_epi16(mins, _mm256_load_si256((const __m256i *)x[r][b].bsums));
        }
        __m128 dx = _mm_loadu_ps(dx4 + 4 * b);  /* the four rows' scales of block b */
        acc = add_block4(acc, hsum4_i32(sums[0], sums[1], sums[2], sums[3]), hsum4_i32(m[0], m[1], m[2], m[3]), dx, w->d, w->dmin);
    }
    _mm_storeu_ps(out, acc);
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void dot4_vnni(const unpacked *w, const q8_block *const x[4], const float *dx4, int64_t nb, float out[4]) {
    __m128 acc = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w++) {
        __m512i lanes[4];
        for (int r = 0; r < 4; r++) lanes[r] = _mm512_setzero_si512();
        for (int v = 0; v < 4; v++) {
            __m512i c = _mm512_load_si512(w->codes + 64 * v);
            for (int r = 0; r < 4; r++) lanes[r] = _mm512_dpbusd_epi32(lanes[r], c, _mm512_load_si512(x[r][b].qs + 64 * v));
        }
        const __m512i scales = _mm512_load_si512(w->scales);
        const __m256i mins = _mm256_load_si256((const __m256i *)w->mins);
        __m256i sums[4], m[4];
        for (int r = 0; r < 4; r++) {
            __m512i p = _mm512_mullo_epi32(lanes[r], scales);
            sums[r] = _mm256_add_epi32(_mm512_castsi512_si256(p), _mm512_extracti64x4_epi64(p, 1));
            m[r] = _mm256_madd_epi16(mins, _mm256_load_si256((const __m256i *)x[r][b].bsums));
        }
        __m128 dx = _mm_loadu_ps(dx4 + 4 * b);  /* the four rows' scales of block b */
        acc = add_block4(acc, hsum4_i32(sums[0], sums[1], sums[2], sums[3]), hsum4_i32(m[0], m[1], m[2], m[3]), dx, w->d, w->dmin);
    }
    _mm_storeu_ps(out, acc);
}

static void (*dot4)(const unpacked *, const q8_block *const[4], const float *, int64_t, float[4]) = dot4_avx2;

/* ---- the matmul, split by column ranges over onnxruntime's threads ----------------------------- */
#define COLUMNS_PER_TASK 16

typedef struct {
    int type;
    const uint8_t *w;
    size_t row_bytes;
    const q8_block *x;
    int64_t rows, n, nb;
    float *y;
} matmul_job;

static void matmul_task(void *data, size_t task) {
    const matmul_job *job = data;
    const int64_t n0 = (int64_t)task * COLUMNS_PER_TASK;
    const int64_t n1 = n0 + COLUMNS_PER_TASK < job->n ? n0 + COLUMNS_PER_TASK : job->n;
    if (job->rows == 1) {
        for (int64_t c = n0; c < n1; c++) {
            const uint8_t *row = job->w + c * job->row_bytes;
            job->y[c] = job->type == GGML_Q4_K ? dot_q4_k_row(row, job->x, job->nb) : dot_q6_k_row(row, job->x, job->nb);
        }
        return;
    }
    /* the task's weight rows unpacked once (at most COLUMNS_PER_TASK · K/256 blocks: L2), then each
     * four rows of X (L1) against every one of them */
    const int64_t nb = job->nb;
    unpacked *u = aligned(sizeof(unpacked) * (size_t)(nb * (n1 - n0)));
    if (!u) return;
    for (int64_t c = n0; c < n1; c++) unpack_row(job->type, job->w + c * job->row_bytes, nb, u + (c - n0) * nb);
    float *dx4 = aligned(sizeof(float) * 4 * (size_t)nb);
    for (int64_t r = 0; r < job->rows && dx4; r += 4) {
        const q8_block *x[4];
        for (int i = 0; i < 4; i++) x[i] = job->x + (r + i < job->rows ? r + i : r) * nb;  /* past the end: row r again */
        for (int64_t b = 0; b < nb; b++)
            for (int i = 0; i < 4; i++) dx4[4 * b + i] = x[i][b].d;
        for (int64_t c = n0; c < n1; c++) {
            float out[4];
            dot4(u + (c - n0) * nb, x, dx4, nb, out);
            for (int i = 0; i < 4 && r + i < job->rows; i++) job->y[(r + i) * job->n + c] = out[i];
        }
    }
    free(dx4);
    free(u);
}

typedef struct {
    const float *x;
    int64_t k, nb;
    q8_block *out;
    int type;  /* 0: weight order (one row); else the codes interleaved as that type's unpacked rows */
} quantize_job;

static void quantize_task(void *data, size_t row) {
    const quantize_job *job = data;
    q8_block *out = job->out + row * job->nb;
    quantize_row(job->x + row * job->k, job->k, out);
    if (job->type)
        for (int64_t b = 0; b < job->nb; b++) {
            int8_t natural[QK_K];
            memcpy(natural, out[b].qs, QK_K);
            interleave(job->type, (const uint8_t *)natural, (uint8_t *)out[b].qs);
        }
}

/* ---- exact dequantization (the gather): gguf-py's float32 operations, in its order -------------- */
static void dequantize_row(int type, const uint8_t *row, int64_t nb, float *y) {
    for (int64_t b = 0; b < nb; b++, y += QK_K) {
        if (type == GGML_Q4_K) {
            const uint8_t *p = row + b * 144;
            uint32_t sc_words[2], mn_words[2];
            k4_scales_mins(p + 4, sc_words, mn_words);
            const uint8_t *sc = (const uint8_t *)sc_words, *mn = (const uint8_t *)mn_words;
            const float d = half(p), dmin = half(p + 2);
            for (int s = 0; s < 8; s++) {
                const float scale = d * (float)sc[s], offset = -(dmin * (float)mn[s]);
                const int j = s / 2, shift = 4 * (s % 2);
                for (int l = 0; l < 32; l++) y[32 * s + l] = scale * (float)((p[16 + 32 * j + l] >> shift) & 0x0F) + offset;
            }
        } else {
            uint8_t codes[QK_K] __attribute__((aligned(32)));
            const uint8_t *p = row + b * 210;
            q6_k_codes(p, codes);
            const int8_t *sc = (const int8_t *)(p + 192);
            const float d = half(p + 208);
            for (int i = 0; i < QK_K; i++) y[i] = (d * (float)sc[i / 16]) * (float)((int)codes[i] - 32);
        }
    }
}

/* ---- the onnxruntime side ----------------------------------------------------------------------- */
typedef struct {
    const OrtApi *api;
    int gather;
    int64_t type, k, n;
} kernel;

#define CHECK(call)                                                                   \
    do {                                                                              \
        OrtStatus *status_ = (call);                                                  \
        if (status_) {                                                                \
            ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status_);         \
            return;                                                                   \
        }                                                                             \
    } while (0)

static int shape_of(const OrtApi *api, const OrtValue *value, int64_t dims[8], size_t *rank) {
    OrtTensorTypeAndShapeInfo *info;
    if (((GetTensorTypeAndShapeFn)kiln_ort_fn(api, SLOT_GetTensorTypeAndShape))(value, &info)) return 0;
    int ok = !((GetDimensionsCountFn)kiln_ort_fn(api, SLOT_GetDimensionsCount))(info, rank) && *rank <= 8 &&
             !((GetDimensionsFn)kiln_ort_fn(api, SLOT_GetDimensions))(info, dims, *rank);
    ((ReleaseTensorTypeAndShapeInfoFn)kiln_ort_fn(api, SLOT_ReleaseTensorTypeAndShapeInfo))(info);
    return ok;
}

static void compute(void *state, OrtKernelContext *context) {
    const kernel *kn = state;
    if (!kn) return;  /* its attributes were refused at creation (the graph writer never does that) */
    const OrtApi *api = kn->api;
    const OrtValue *first, *second;
    CHECK(((KernelContextGetInputFn)kiln_ort_fn(api, SLOT_KernelContext_GetInput))(context, 0, &first));
    CHECK(((KernelContextGetInputFn)kiln_ort_fn(api, SLOT_KernelContext_GetInput))(context, 1, &second));
    int64_t dims[8];
    size_t rank;
    const int64_t nb = kn->k / QK_K;
    const size_t row_bytes = (size_t)nb * BLOCK_BYTES[kn->type];
    OrtValue *output;
    float *y;
    if (kn->gather) {  /* inputs: W [V, row bytes], ids [...] → [..., K] */
        const uint8_t *w;
        const int64_t *ids;
        int64_t wdims[8];
        size_t wrank;
        if (!shape_of(api, second, dims, &rank) || rank > 7 || !shape_of(api, first, wdims, &wrank)) return;
        CHECK(((GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData))((OrtValue *)first, (void **)&w));
        CHECK(((GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData))((OrtValue *)second, (void **)&ids));
        int64_t count = 1;
        for (size_t i = 0; i < rank; i++) count *= dims[i];
        dims[rank] = kn->k;
        CHECK(((KernelContextGetOutputFn)kiln_ort_fn(api, SLOT_KernelContext_GetOutput))(context, 0, dims, rank + 1, &output));
        CHECK(((GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData))(output, (void **)&y));
        for (int64_t i = 0; i < count; i++) {
            int64_t id = ids[i] < 0 ? ids[i] + wdims[0] : ids[i];
            if (id < 0 || id >= wdims[0]) {  /* out of the vocabulary: NaN, as no real row is */
                for (int64_t j = 0; j < kn->k; j++) y[i * kn->k + j] = NAN;
                continue;
            }
            dequantize_row((int)kn->type, w + id * row_bytes, nb, y + i * kn->k);
        }
        return;
    }
    const float *x;  /* inputs: X [..., K], W [N, row bytes] → [..., N] */
    const uint8_t *w;
    if (!shape_of(api, first, dims, &rank) || rank < 1 || dims[rank - 1] != kn->k) return;
    CHECK(((GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData))((OrtValue *)first, (void **)&x));
    CHECK(((GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData))((OrtValue *)second, (void **)&w));
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < rank; i++) rows *= dims[i];
    dims[rank - 1] = kn->n;
    CHECK(((KernelContextGetOutputFn)kiln_ort_fn(api, SLOT_KernelContext_GetOutput))(context, 0, dims, rank, &output));
    CHECK(((GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData))(output, (void **)&y));
    if (rows == 0) return;
    q8_block *qx = aligned(sizeof(q8_block) * (size_t)(rows * nb));
    if (!qx) return;
    KernelContextParallelForFn parallel = (KernelContextParallelForFn)kiln_ort_fn(api, SLOT_KernelContext_ParallelFor);
    quantize_job qjob = {x, kn->k, nb, qx, rows > 1 ? (int)kn->type : 0};
    if (rows > 1) {
        OrtStatus *status = parallel(context, quantize_task, (size_t)rows, 0, &qjob);
        if (status) ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status);
    } else {
        quantize_task(&qjob, 0);
    }
    matmul_job job = {(int)kn->type, w, row_bytes, qx, rows, kn->n, nb, y};
    OrtStatus *status = parallel(context, matmul_task, (size_t)((kn->n + COLUMNS_PER_TASK - 1) / COLUMNS_PER_TASK), 0, &job);
    if (status) ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status);
    free(qx);
}

static void *create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info, int gather) {
    (void)op;
    kernel *kn = calloc(1, sizeof *kn);
    if (!kn) return NULL;
    kn->api = api;
    kn->gather = gather;
    KernelInfoGetAttributeInt64Fn attr = (KernelInfoGetAttributeInt64Fn)kiln_ort_fn(api, SLOT_KernelInfoGetAttribute_int64);
    OrtStatus *status;
    if ((status = attr(info, "ggml_type", &kn->type)) || (status = attr(info, "K", &kn->k)) ||
        (!gather && (status = attr(info, "N", &kn->n)))) {
        ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status);
        free(kn);
        return NULL;
    }
    if ((kn->type != GGML_Q4_K && kn->type != GGML_Q6_K) || kn->k <= 0 || kn->k % QK_K) {
        free(kn);
        return NULL;
    }
    return kn;
}

static void *create_matmul(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info) { return create(op, api, info, 0); }
static void *create_gather(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info) { return create(op, api, info, 1); }
static void destroy(void *state) { free(state); }
static const char *matmul_name(const OrtCustomOp *op) { (void)op; return "GgufMatMul"; }
static const char *gather_name(const OrtCustomOp *op) { (void)op; return "GgufGather"; }
static const char *cpu(const OrtCustomOp *op) { (void)op; return NULL; }
static size_t two(const OrtCustomOp *op) { (void)op; return 2; }
static size_t one(const OrtCustomOp *op) { (void)op; return 1; }
static int matmul_input(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? KILN_TENSOR_FLOAT : KILN_TENSOR_UINT8; }
static int gather_input(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? KILN_TENSOR_UINT8 : 7 /* int64 */; }
static int float_output(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return KILN_TENSOR_FLOAT; }
static int required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static int default_memory(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }

static const OrtCustomOp MATMUL = {13, create_matmul, matmul_name, cpu, matmul_input, two, float_output, one,
                                   compute, destroy, required, required, default_memory};
static const OrtCustomOp GATHER = {13, create_gather, gather_name, cpu, gather_input, two, float_output, one,
                                   compute, destroy, required, required, default_memory};

/* The dot products' AVX-512 forms where the CPU has them (the same results as the AVX2 forms). */
__attribute__((visibility("default")))
void kiln_gguf_use_avx512(int on) {
    const int avx512 = on && __builtin_cpu_supports("avx512bw");
    dot4 = avx512 && __builtin_cpu_supports("avx512vnni") ? dot4_vnni : dot4_avx2;
    unpack_q4_k_fast = avx512 ? unpack_q4_k_avx512 : unpack_q4_k;
    unpack_q6_k_fast = avx512 ? unpack_q6_k_avx512 : unpack_q6_k;
}

__attribute__((visibility("default")))
OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    const OrtApi *api = base->GetApi(KILN_ORT_API_VERSION);
    if (!api) return NULL;  /* cannot even make a status: onnxruntime older than the ABI used here */
    kiln_gguf_use_avx512(1);
    OrtCustomOpDomain *domain;
    OrtStatus *status = ((CreateCustomOpDomainFn)kiln_ort_fn(api, SLOT_CreateCustomOpDomain))("kiln.gguf", &domain);
    if (status) return status;
    if ((status = ((CustomOpDomainAddFn)kiln_ort_fn(api, SLOT_CustomOpDomain_Add))(domain, &MATMUL))) return status;
    if ((status = ((CustomOpDomainAddFn)kiln_ort_fn(api, SLOT_CustomOpDomain_Add))(domain, &GATHER))) return status;
    return ((AddCustomOpDomainFn)kiln_ort_fn(api, SLOT_AddCustomOpDomain))(options, domain);
}

/* For tests and measurements without onnxruntime: the same kernels on one thread. */
__attribute__((visibility("default")))
void kiln_gguf_matmul(int type, const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n, float *y) {
    const int64_t nb = k / QK_K;
    q8_block *qx = aligned(sizeof(q8_block) * (size_t)(rows * nb));
    quantize_job qjob = {x, k, nb, qx, rows > 1 ? type : 0};
    for (int64_t r = 0; r < rows; r++) quantize_task(&qjob, (size_t)r);
    matmul_job job = {type, w, (size_t)nb * BLOCK_BYTES[type], qx, rows, n, nb, y};
    for (int64_t t = 0; t < (n + COLUMNS_PER_TASK - 1) / COLUMNS_PER_TASK; t++) matmul_task(&job, (size_t)t);
    free(qx);
}

__attribute__((visibility("default")))
void kiln_gguf_dequantize(int type, const uint8_t *w, int64_t rows, int64_t k, float *y) {
    for (int64_t r = 0; r < rows; r++) dequantize_row(type, w + r * (k / QK_K) * BLOCK_BYTES[type], k / QK_K, y + r * k);
}


