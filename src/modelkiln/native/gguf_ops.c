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
 * sums of each 16 codes); a weight row's super-blocks are unpacked once into byte codes and 16-bit
 * sub-block scales (`unpacked`), then dotted with every row of X by integer multiply-adds, the
 * minimums (Q4_K) or the code offset (Q6_K) taken out with the 16-sums. Each output is one row
 * of X against one weight row, always in the same order, whatever the number of rows or threads:
 * an answer does not depend on its batch.
 *
 * Built with AVX2 (every machine this package targets has it); the dot product has an AVX-512
 * form chosen at load time where the CPU has AVX-512 BW. Compiled with -ffp-contract=off so the
 * gather's float operations round as gguf-py's numpy ones do. */
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

/* ---- a weight super-block unpacked for the dot product ----------------------------------------- */
/* codes: 256 unsigned bytes in weight order; scales: per 32 codes, 16 int16 (the scale of codes
 * 0-15 eight times... as maddubs pairs them: 16 int16 lanes = 32 codes); mins: 16 int16 that, madd'ed
 * with the activations' 16-sums, give what to take out; result = dx·(d·Σscale·code·x − dmin·Σmins). */
typedef struct {
    uint8_t codes[QK_K];
    int16_t scales[8][16];
    int16_t mins[16];
    float d, dmin;
} __attribute__((aligned(64))) unpacked;

static void *aligned(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static void k4_scales_mins(const uint8_t *p, uint8_t sc[8], uint8_t mn[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = p[j] & 63;
        mn[j] = p[j + 4] & 63;
        sc[j + 4] = (p[j + 8] & 0x0F) | ((p[j] >> 6) << 4);
        mn[j + 4] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
    }
}

static void unpack_q4_k(const uint8_t *b, unpacked *u) {
    uint8_t sc[8], mn[8];
    k4_scales_mins(b + 4, sc, mn);
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {  /* 32 bytes: the low nibbles are weights 64j.., the high 64j+32.. */
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * j));
        _mm256_storeu_si256((__m256i *)(u->codes + 64 * j), _mm256_and_si256(q, low));
        _mm256_storeu_si256((__m256i *)(u->codes + 64 * j + 32), _mm256_and_si256(_mm256_srli_epi16(q, 4), low));
    }
    for (int s = 0; s < 8; s++) _mm256_storeu_si256((__m256i *)u->scales[s], _mm256_set1_epi16(sc[s]));
    __m128i m8 = _mm_loadl_epi64((const __m128i *)mn);
    _mm256_storeu_si256((__m256i *)u->mins, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)));  /* each min twice */
    u->d = half(b);
    u->dmin = half(b + 2);
}

static void unpack_q6_k(const uint8_t *b, unpacked *u) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
    for (int n = 0; n < 2; n++, ql += 64, qh += 32) {  /* two halves of 128: codes q + 32, 0..63 */
        __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        __m256i h = _mm256_loadu_si256((const __m256i *)qh);
        uint8_t *c = u->codes + 128 * n;
        _mm256_storeu_si256((__m256i *)c, _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(_mm256_and_si256(h, two), 4)));
        _mm256_storeu_si256((__m256i *)(c + 32), _mm256_or_si256(_mm256_and_si256(l1, low),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), two), 4)));
        _mm256_storeu_si256((__m256i *)(c + 64), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), two), 4)));
        _mm256_storeu_si256((__m256i *)(c + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), two), 4)));
    }
    for (int s = 0; s < 8; s++)  /* 16 weights a scale: a 32-code vector holds two */
        _mm256_storeu_si256((__m256i *)u->scales[s], _mm256_setr_m128i(_mm_set1_epi16(sc[2 * s]), _mm_set1_epi16(sc[2 * s + 1])));
    __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
    _mm256_storeu_si256((__m256i *)u->mins, _mm256_slli_epi16(sc16, 5));  /* 32 · scale: the codes are q + 32 */
    u->d = u->dmin = half(b + 208);
}

static void unpack_row(int type, const uint8_t *row, int64_t nb, unpacked *out) {
    for (int64_t b = 0; b < nb; b++)
        if (type == GGML_Q4_K) unpack_q4_k(row + b * 144, out + b);
        else unpack_q6_k(row + b * 210, out + b);
}

/* ---- the dot product of one unpacked weight row with one quantized row of X -------------------- */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One super-block's share of a dot product, the same float operations on every path (so a row's
 * result does not depend on which path computed it): acc += dx · (d·Σcodes·x − dmin·Σmins). */
static inline __m256 add_block(__m256 acc, __m256i sums, __m256i mins, float dx, float d, float dmin) {
    __m256 t = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_set1_ps(dmin), _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(d)));
    return _mm256_fmadd_ps(_mm256_set1_ps(dx), t, acc);
}

static float dot_avx2(const unpacked *w, const q8_block *x, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w++, x++) {
        __m256i sumi = _mm256_setzero_si256();
        for (int s = 0; s < 8; s++) {
            __m256i p = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(w->codes + 32 * s)),
                                             _mm256_loadu_si256((const __m256i *)(x->qs + 32 * s)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_loadu_si256((const __m256i *)w->scales[s])));
        }
        __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)w->mins),
                                      _mm256_loadu_si256((const __m256i *)x->bsums));
        acc = add_block(acc, sumi, m, x->d, w->d, w->dmin);
    }
    return hsum8(acc);
}

__attribute__((target("avx512f,avx512bw")))
static float dot_avx512(const unpacked *w, const q8_block *x, int64_t nb) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w++, x++) {
        __m512i sumi = _mm512_setzero_si512();
        for (int s = 0; s < 8; s += 2) {
            __m512i p = _mm512_maddubs_epi16(_mm512_loadu_si512(w->codes + 32 * s), _mm512_loadu_si512(x->qs + 32 * s));
            sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(p, _mm512_loadu_si512(w->scales[s])));
        }
        __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sumi), _mm512_extracti64x4_epi64(sumi, 1));
        __m256i m = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)w->mins),
                                      _mm256_loadu_si256((const __m256i *)x->bsums));
        acc = add_block(acc, s8, m, x->d, w->d, w->dmin);
    }
    return hsum8(acc);
}

/* Four rows of X against one unpacked weight row: each weight vector is loaded once for the four.
 * Per row, the very operations of dot_avx2 / dot_avx512 (the same bits). */
static void dot4_avx2(const unpacked *w, const q8_block *x, int64_t nb, float out[4]) {
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w++) {
        __m256i sumi[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int s = 0; s < 8; s++) {
            __m256i codes = _mm256_loadu_si256((const __m256i *)(w->codes + 32 * s));
            __m256i scales = _mm256_loadu_si256((const __m256i *)w->scales[s]);
            for (int r = 0; r < 4; r++) {
                __m256i p = _mm256_maddubs_epi16(codes, _mm256_loadu_si256((const __m256i *)(x[r * nb + b].qs + 32 * s)));
                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(p, scales));
            }
        }
        __m256i mins = _mm256_loadu_si256((const __m256i *)w->mins);
        for (int r = 0; r < 4; r++) {
            const q8_block *xb = x + r * nb + b;
            __m256i m = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)xb->bsums));
            acc[r] = add_block(acc[r], sumi[r], m, xb->d, w->d, w->dmin);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = hsum8(acc[r]);
}

__attribute__((target("avx512f,avx512bw")))
static void dot4_avx512(const unpacked *w, const q8_block *x, int64_t nb, float out[4]) {
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w++) {
        __m512i sumi[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int s = 0; s < 8; s += 2) {
            __m512i codes = _mm512_loadu_si512(w->codes + 32 * s), scales = _mm512_loadu_si512(w->scales[s]);
            for (int r = 0; r < 4; r++) {
                __m512i p = _mm512_maddubs_epi16(codes, _mm512_loadu_si512(x[r * nb + b].qs + 32 * s));
                sumi[r] = _mm512_add_epi32(sumi[r], _mm512_madd_epi16(p, scales));
            }
        }
        __m256i mins = _mm256_loadu_si256((const __m256i *)w->mins);
        for (int r = 0; r < 4; r++) {
            const q8_block *xb = x + r * nb + b;
            __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sumi[r]), _mm512_extracti64x4_epi64(sumi[r], 1));
            __m256i m = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)xb->bsums));
            acc[r] = add_block(acc[r], s8, m, xb->d, w->d, w->dmin);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = hsum8(acc[r]);
}

/* With AVX-512 VNNI, vpdpwssd does the scales' multiply-add and the sum in one instruction:
 * the same integers as madd then add (neither saturates here). */
__attribute__((target("avx512f,avx512bw,avx512vnni")))
static void dot4_avx512_vnni(const unpacked *w, const q8_block *x, int64_t nb, float out[4]) {
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w++) {
        __m512i sumi[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
        for (int s = 0; s < 8; s += 2) {
            __m512i codes = _mm512_loadu_si512(w->codes + 32 * s), scales = _mm512_loadu_si512(w->scales[s]);
            for (int r = 0; r < 4; r++) {
                __m512i p = _mm512_maddubs_epi16(codes, _mm512_loadu_si512(x[r * nb + b].qs + 32 * s));
                sumi[r] = _mm512_dpwssd_epi32(sumi[r], p, scales);
            }
        }
        __m256i mins = _mm256_loadu_si256((const __m256i *)w->mins);
        for (int r = 0; r < 4; r++) {
            const q8_block *xb = x + r * nb + b;
            __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(sumi[r]), _mm512_extracti64x4_epi64(sumi[r], 1));
            __m256i m = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)xb->bsums));
            acc[r] = add_block(acc[r], s8, m, xb->d, w->d, w->dmin);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = hsum8(acc[r]);
}

static float (*dot)(const unpacked *, const q8_block *, int64_t) = dot_avx2;
static void (*dot4)(const unpacked *, const q8_block *, int64_t, float[4]) = dot4_avx2;

/* One row of X needs no unpacked copy: these read the blocks directly, with the same integer lanes
 * and the same float operations as dot_avx2, so a row's result is the same bits either way. */
static float dot_q4_k_row(const uint8_t *w, const q8_block *x, int64_t nb) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 144, x++) {
        /* the eight 6-bit scales and mins, a byte each, four at a time (k4_scales_mins' bytes) */
        uint32_t u[3];
        memcpy(u, w + 4, 12);
        const uint32_t sc_lo = u[0] & 0x3f3f3f3f, mn_lo = u[1] & 0x3f3f3f3f;
        const uint32_t sc_hi = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
        const uint32_t mn_hi = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
        /* each scale as int16 in both 128-bit halves; SCALE_OF(s) broadcasts scale s to all 16 lanes */
        const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)sc_hi, (int)sc_lo)));
#define SCALE_OF(s) _mm256_shuffle_epi8(sc16, _mm256_set1_epi16((short)(0x0100 + 0x0202 * (s))))
        __m256i sumi = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(w + 16 + 32 * j));
            __m256i lo = _mm256_maddubs_epi16(_mm256_and_si256(q, low), _mm256_loadu_si256((const __m256i *)(x->qs + 64 * j)));
            __m256i hi = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(q, 4), low),
                                              _mm256_loadu_si256((const __m256i *)(x->qs + 64 * j + 32)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(lo, SCALE_OF(2 * j)));
            sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(hi, SCALE_OF(2 * j + 1)));
        }
#undef SCALE_OF
        __m128i m8 = _mm_set_epi32(0, 0, (int)mn_hi, (int)mn_lo);
        __m256i m = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)),
                                      _mm256_loadu_si256((const __m256i *)x->bsums));
        acc = add_block(acc, sumi, m, x->d, half(w), half(w + 2));
    }
    return hsum8(acc);
}

static float dot_q6_k_row(const uint8_t *w, const q8_block *x, int64_t nb) {
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 210, x++) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        const int8_t *qx = x->qs;
        __m256i sumi = _mm256_setzero_si256();
        for (int n = 0; n < 2; n++, ql += 64, qh += 32, qx += 128) {
            __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            __m256i h = _mm256_loadu_si256((const __m256i *)qh);
            __m256i c[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, low), _mm256_slli_epi16(_mm256_and_si256(h, two), 4)),
                _mm256_or_si256(_mm256_and_si256(l1, low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), two), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), two), 4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), two), 4)),
            };
            for (int i = 0; i < 4; i++) {
                const int s = 4 * n + i;
                __m256i p = _mm256_maddubs_epi16(c[i], _mm256_loadu_si256((const __m256i *)(qx + 32 * i)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, _mm256_setr_m128i(_mm_set1_epi16(sc[2 * s]), _mm_set1_epi16(sc[2 * s + 1]))));
            }
        }
        __m256i mins = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc)), 5);
        __m256i m = _mm256_madd_epi16(mins, _mm256_loadu_si256((const __m256i *)x->bsums));
        const float d = half(w + 208);
        acc = add_block(acc, sumi, m, x->d, d, d);
    }
    return hsum8(acc);
}

/* ---- the matmul, split by column ranges over onnxruntime's threads ----------------------------- */
#define COLUMNS_PER_TASK 16
#define X_TILE_BYTES (192 * 1024)  /* rows of quantized X dotted per unpacked weight row: kept in L2 */

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
    unpacked *u = aligned(sizeof(unpacked) * job->nb);
    if (!u) return;
    int64_t tile = X_TILE_BYTES / (int64_t)(sizeof(q8_block) * job->nb);
    if (tile < 1) tile = 1;
    for (int64_t r0 = 0; r0 < job->rows; r0 += tile) {
        const int64_t r1 = r0 + tile < job->rows ? r0 + tile : job->rows;
        for (int64_t c = n0; c < n1; c++) {
            unpack_row(job->type, job->w + c * job->row_bytes, job->nb, u);
            int64_t r = r0;
            for (float out[4]; r + 4 <= r1; r += 4) {
                dot4(u, job->x + r * job->nb, job->nb, out);
                for (int i = 0; i < 4; i++) job->y[(r + i) * job->n + c] = out[i];
            }
            for (; r < r1; r++) job->y[r * job->n + c] = dot(u, job->x + r * job->nb, job->nb);
        }
    }
    free(u);
}

typedef struct {
    const float *x;
    int64_t k, nb;
    q8_block *out;
} quantize_job;

static void quantize_task(void *data, size_t row) {
    const quantize_job *job = data;
    quantize_row(job->x + row * job->k, job->k, job->out + row * job->nb);
}

/* ---- exact dequantization (the gather): gguf-py's float32 operations, in its order -------------- */
static void dequantize_row(int type, const uint8_t *row, int64_t nb, float *y) {
    for (int64_t b = 0; b < nb; b++, y += QK_K) {
        if (type == GGML_Q4_K) {
            const uint8_t *p = row + b * 144;
            uint8_t sc[8], mn[8];
            k4_scales_mins(p + 4, sc, mn);
            const float d = half(p), dmin = half(p + 2);
            for (int s = 0; s < 8; s++) {
                const float scale = d * (float)sc[s], offset = -(dmin * (float)mn[s]);
                const int j = s / 2, shift = 4 * (s % 2);
                for (int l = 0; l < 32; l++) y[32 * s + l] = scale * (float)((p[16 + 32 * j + l] >> shift) & 0x0F) + offset;
            }
        } else {
            unpacked u;
            const uint8_t *p = row + b * 210;
            unpack_q6_k(p, &u);
            const int8_t *sc = (const int8_t *)(p + 192);
            for (int i = 0; i < QK_K; i++) y[i] = (u.d * (float)sc[i / 16]) * (float)((int)u.codes[i] - 32);
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
    quantize_job qjob = {x, kn->k, nb, qx};
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
    const int ok = on && __builtin_cpu_supports("avx512bw");
    dot = ok ? dot_avx512 : dot_avx2;
    dot4 = ok ? (__builtin_cpu_supports("avx512vnni") ? dot4_avx512_vnni : dot4_avx512) : dot4_avx2;
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
    quantize_job qjob = {x, k, nb, qx};
    for (int64_t r = 0; r < rows; r++) quantize_task(&qjob, (size_t)r);
    matmul_job job = {type, w, (size_t)nb * BLOCK_BYTES[type], qx, rows, n, nb, y};
    for (int64_t t = 0; t < (n + COLUMNS_PER_TASK - 1) / COLUMNS_PER_TASK; t++) matmul_task(&job, (size_t)t);
    free(qx);
}

__attribute__((visibility("default")))
void kiln_gguf_dequantize(int type, const uint8_t *w, int64_t rows, int64_t k, float *y) {
    for (int64_t r = 0; r < rows; r++) dequantize_row(type, w + r * (k / QK_K) * BLOCK_BYTES[type], k / QK_K, y + r * k);
}


