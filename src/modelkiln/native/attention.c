/* KilnAttention: causal attention over a KV cache for packed query tokens of any number of
 * sequences, whose every position gets the same bits however it is computed.
 *
 *   out, present_key, present_value = KilnAttention(q, k, v, past_key, past_value, cache_rows,
 *                                                   positions, cos, sin)
 *   q [..., heads · D], k and v [..., kv_heads · D]: one token each (any leading shape: a token is
 *   a row of it); cache_rows and positions (int64, one per token): the cache row its sequence
 *   owns and its place there (−1: padding, whose output is 0); past/present [rows, kv_heads,
 *   capacity, D] (bind the same buffer as both: it is written in place, as GroupQueryAttention's
 *   shared buffer is; otherwise past is copied into present first); cos, sin [positions, R / 2]:
 *   the rotary tables (rotate-half form on the first R dimensions, as GroupQueryAttention's
 *   do_rotary with rotary_interleaved = 0). Attributes num_heads, kv_num_heads (query head h
 *   reads key/value head h / (num_heads / kv_num_heads)), key_blocks (optional, 0 if absent: see
 *   below). Scale 1/√D. Domain kiln.gguf.
 *
 * The key cache's layout: with key_blocks = 0 each position's D floats in turn (position-major, as
 * GroupQueryAttention keeps it); with key_blocks = 1 (capacity a multiple of 16) each block of 16
 * positions dimension-major, dimension i of position p at block p / 16, offset 16 · i + p % 16: the
 * form the scores read, so a decode step no longer transposes every block of keys for its few
 * queries. The arithmetic and its bits are the same in both. The value cache is position-major.
 *
 * Why: onnxruntime's GroupQueryAttention sums a prompt's positions (several queries, a matrix
 * product) in another order than a decode step's one query, and takes several rows of more than
 * one token only when none has a past. Here every query is reduced the one way a decode step
 * reduces it, so a position's output depends only on its q, its row's cache up to it and its
 * position: the same bits in a decode step, in a prompt chunk of any length, among any other rows.
 *
 * How: first every token's rotated key and value are written into its row at its position (and
 * its query rotated and scaled, q·1/√D); then each query reads its row's keys 0..position in
 * blocks of 16 from position 0: sixteen scores (lanes = keys; two FMA chains, each over one half of
 * the head in order, then added), an
 * online softmax (the block's maximum, the old sums scaled by exp(old − new max), the weights
 * exp(s − max) added to sixteen running partial sums and, key by key in position order, into the
 * weighted values), and at the end the values over the sum of the sixteen partials in lane order.
 * A token's keys at later positions of the same call are never read, which makes a chunk causal.
 * The arithmetic (attention_kernel.h) is compiled for AVX-512 and for AVX2 and gives the same
 * bits in both (lane-wise operations only, explicit FMAs, our own exp; the file is compiled with
 * -ffp-contract=off). Work is split over onnxruntime's threads by (tokens of one row, key/value
 * head): a query's keys are never split, and tokens of one row share each block's loads. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ort_abi.h"

#define MAX_HEAD_DIM 256
#define MAX_QUERIES 64      /* queries of one unit: its tokens × the query heads of its key/value head */
/* Tokens of one row sharing a unit, and so each key block's loads and transposition: a prompt chunk
 * at 8k positions read every block from memory once per 4 tokens (16 here: 1.3-1.5× faster there). */
#define MAX_TILE_TOKENS 16

typedef struct {
    int64_t row;
    int64_t first;  /* its first token; its tokens are first .. first + tokens − 1, all of that row */
    int tokens, kv_head;
} attention_unit;

typedef struct {
    int heads, kv_heads, head_dim, rotary_half;
    int key_blocks;  /* the key cache's layout: 0 position-major, 1 in blocks of 16 positions dimension-major */
    int half_cache;  /* the caches' element: 0 float, 1 IEEE half (uint16_t) */
    int64_t tokens, rows, capacity, table_positions;
    const float *q, *k, *v, *cos, *sin;
    const int64_t *cache_rows, *positions;
    void *key_cache, *value_cache;  /* float or uint16_t (half_cache) */
    float *rotated_q, *out;
    attention_unit *units;
    size_t unit_count;
} attention_job;

/* ---- the arithmetic, in two forms ---------------------------------------------------------------- */
/* AVX-512: one register of sixteen lanes. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq")
typedef __m512 v16_512;
#define V16 v16_512
#define FORM _512
#define SCORE_QUERIES 8
#define WIDE_VALUES_QUERIES 4  /* thirty-two registers: 16 accumulators, 4 values, a weight */
#define PAIR_QUERIES 4         /* 16 score chains, 4 keys, 2 query elements */
#define v_zero _mm512_setzero_ps
#define v_set _mm512_set1_ps
#define v_load _mm512_loadu_ps
#define v_store _mm512_storeu_ps
#define v_fma _mm512_fmadd_ps
#define v_mul _mm512_mul_ps
#define v_add _mm512_add_ps
#define v_sub _mm512_sub_ps
#define v_max _mm512_max_ps
#define v_div _mm512_div_ps
#define v_round(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define v_hmax _mm512_reduce_max_ps
static inline __m512 v_pow2_512(__m512 n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#define v_pow2 v_pow2_512
static inline __m512 v_zero_below_512(__m512 x, float limit, __m512 y) {
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_NLT_UQ), y);
}
#define v_zero_below v_zero_below_512
static inline __m512 v_valid_512(__m512 s, int n) {
    return _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), (__mmask16)((1u << n) - 1), s);
}
#define v_valid v_valid_512

/* sixteen keys (rows of D floats; those from ``valid`` on read as 0) → kt[d][16], in registers */
static void transpose16_512(const float *keys, int valid, int head_dim, float *kt) {
    for (int c = 0; c < head_dim; c += 16) {
        __m512 r[16], t[16], u[16];
        for (int i = 0; i < 16; i++) r[i] = i < valid ? _mm512_loadu_ps(keys + (size_t)i * head_dim + c) : _mm512_setzero_ps();
        for (int i = 0; i < 8; i++) {
            t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
        }
        for (int i = 0; i < 4; i++) {  /* u[4i + k], 128-bit lane L: column 4L + k of rows 4i..4i+3 */
            const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
            const __m512d c2 = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
            u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c2));
            u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c2));
            u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
            u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
        }
        for (int k = 0; k < 4; k++) {
            const __m512 v0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), v1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
            const __m512 w0 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88), w1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
            _mm512_store_ps(kt + 16 * (c + k), _mm512_shuffle_f32x4(v0, w0, 0x88));
            _mm512_store_ps(kt + 16 * (c + 8 + k), _mm512_shuffle_f32x4(v0, w0, 0xDD));
            _mm512_store_ps(kt + 16 * (c + 4 + k), _mm512_shuffle_f32x4(v1, w1, 0x88));
            _mm512_store_ps(kt + 16 * (c + 12 + k), _mm512_shuffle_f32x4(v1, w1, 0xDD));
        }
    }
}
#define transpose16 transpose16_512
#define c_load_half(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#include "attention_caches.h"
#undef c_load_half
#undef V16
#undef FORM
#undef SCORE_QUERIES
#undef WIDE_VALUES_QUERIES
#undef PAIR_QUERIES
#undef v_zero
#undef v_set
#undef v_load
#undef v_store
#undef v_fma
#undef v_mul
#undef v_add
#undef v_sub
#undef v_max
#undef v_div
#undef v_round
#undef v_hmax
#undef v_pow2
#undef v_zero_below
#undef v_valid
#undef transpose16
#pragma GCC pop_options

/* AVX2: sixteen lanes as two registers of eight, each operation applied to both halves. */
typedef struct { __m256 lo, hi; } v16_256;
#define V16 v16_256
#define FORM _256
#define SCORE_QUERIES 2  /* sixteen registers: a query's two chains take four, the keys four */
#define WIDE_VALUES_QUERIES 0  /* four chunks of two halves each would spill */
#define PAIR_QUERIES 0         /* so would two blocks' chains */
#define BOTH(op, a, b) ((v16_256){op((a).lo, (b).lo), op((a).hi, (b).hi)})
static inline v16_256 v_zero(void) { return (v16_256){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline v16_256 v_set(float f) { return (v16_256){_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
static inline v16_256 v_load(const float *p) { return (v16_256){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v_store(float *p, v16_256 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline v16_256 v_fma(v16_256 a, v16_256 b, v16_256 c) {
    return (v16_256){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline v16_256 v_mul(v16_256 a, v16_256 b) { return BOTH(_mm256_mul_ps, a, b); }
static inline v16_256 v_add(v16_256 a, v16_256 b) { return BOTH(_mm256_add_ps, a, b); }
static inline v16_256 v_sub(v16_256 a, v16_256 b) { return BOTH(_mm256_sub_ps, a, b); }
static inline v16_256 v_max(v16_256 a, v16_256 b) { return BOTH(_mm256_max_ps, a, b); }
static inline v16_256 v_div(v16_256 a, v16_256 b) { return BOTH(_mm256_div_ps, a, b); }
static inline v16_256 v_round(v16_256 a) {
    return (v16_256){_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                     _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
static inline __m256 pow2_8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
static inline v16_256 v_pow2(v16_256 n) { return (v16_256){pow2_8(n.lo), pow2_8(n.hi)}; }
static inline v16_256 v_zero_below(v16_256 x, float limit, v16_256 y) {
    const __m256 l = _mm256_set1_ps(limit);
    return (v16_256){_mm256_and_ps(_mm256_cmp_ps(x.lo, l, _CMP_NLT_UQ), y.lo), _mm256_and_ps(_mm256_cmp_ps(x.hi, l, _CMP_NLT_UQ), y.hi)};
}
static inline v16_256 v_valid(v16_256 s, int n) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), limit = _mm256_set1_epi32(n);
    const __m256 inf = _mm256_set1_ps(-INFINITY);
    const __m256 lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, lane));
    const __m256 hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, _mm256_add_epi32(lane, _mm256_set1_epi32(8))));
    return (v16_256){_mm256_blendv_ps(inf, s.lo, lo), _mm256_blendv_ps(inf, s.hi, hi)};
}
static inline float v_hmax(v16_256 v) {
    float lanes[16], m = -INFINITY;
    v_store(lanes, v);
    for (int i = 0; i < 16; i++) m = lanes[i] > m ? lanes[i] : m;
    return m;
}

/* eight rows of eight floats (from p, ``stride`` apart) → eight columns, at out + 16 · column */
static inline void transpose8(const float *p, int valid, size_t stride, float *out) {
    __m256 r[8], t[8], s[8];
    for (int i = 0; i < 8; i++) r[i] = i < valid ? _mm256_loadu_ps(p + i * stride) : _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]), t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    for (int i = 0; i < 2; i++) {
        s[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        s[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        s[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        s[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(out + 16 * i, _mm256_permute2f128_ps(s[i], s[4 + i], 0x20));
        _mm256_storeu_ps(out + 16 * (4 + i), _mm256_permute2f128_ps(s[i], s[4 + i], 0x31));
    }
}

static void transpose16_256(const float *keys, int valid, int head_dim, float *kt) {
    for (int c = 0; c < head_dim; c += 8) {
        transpose8(keys + c, valid, (size_t)head_dim, kt + 16 * c);
        transpose8(keys + (size_t)8 * head_dim + c, valid - 8, (size_t)head_dim, kt + 16 * c + 8);
    }
}
#define transpose16 transpose16_256
static inline v16_256 c_load_half(const uint16_t *p) {
    return (v16_256){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 8)))};
}
#include "attention_caches.h"

typedef void (*unit_fn)(const attention_unit *, const attention_job *);
static unit_fn attend_unit = unit_256, attend_unit_f16 = unit_256_f16;

/* The AVX-512 form where the CPU has it (the same bits as the AVX2 form). */
__attribute__((visibility("default")))
void kiln_attention_use_avx512(int on) {
    const int avx512 = on && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
    attend_unit = avx512 ? unit_512 : unit_256;
    attend_unit_f16 = avx512 ? unit_512_f16 : unit_256_f16;
}

__attribute__((constructor)) static void choose_form(void) { kiln_attention_use_avx512(1); }

/* ---- the two phases ----------------------------------------------------------------------------- */
static int token_ok(const attention_job *job, int64_t t) {
    const int64_t row = job->cache_rows[t], position = job->positions[t];
    return row >= 0 && row < job->rows && position >= 0 && position < job->capacity && position < job->table_positions;
}

/* rotate-half on the first 2 · half dimensions, then times ``scale`` (1 for keys) */
static void rotate(const float *x, const float *cos, const float *sin, int half, int head_dim, float scale, float *y) {
    for (int i = 0; i < half; i++) {
        const float x1 = x[i], x2 = x[i + half];
        y[i] = (x1 * cos[i] - x2 * sin[i]) * scale;
        y[i + half] = (x2 * cos[i] + x1 * sin[i]) * scale;
    }
    for (int i = 2 * half; i < head_dim; i++) y[i] = x[i] * scale;
}

/* ``n`` floats into ``n`` cache elements ``stride`` apart: as they are, or rounded to the nearest half. */
static void store(const attention_job *job, const float *x, int64_t n, size_t at, size_t stride, void *cache) {
    if (job->half_cache) {
        uint16_t *to = (uint16_t *)cache + at;
        for (int64_t i = 0; i < n; i++) to[(size_t)i * stride] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
    } else {
        float *to = (float *)cache + at;
        for (int64_t i = 0; i < n; i++) to[(size_t)i * stride] = x[i];
    }
}

/* Phase 1, a token: its rotated key and value into its row of the cache, its query rotated. */
static void write_token(void *data, size_t index) {
    const attention_job *job = data;
    const int64_t t = (int64_t)index, d = job->head_dim;
    float *out = job->out + t * job->heads * d;
    if (!token_ok(job, t)) {  /* padding: 0; anything else out of range: NaN, as no real output is */
        const float fill = job->positions[t] == -1 ? 0.0f : NAN;
        for (int64_t i = 0; i < job->heads * d; i++) out[i] = fill;
        return;
    }
    const int64_t position = job->positions[t];
    const float *cos = job->cos + position * job->rotary_half, *sin = job->sin + position * job->rotary_half;
    const float scale = (float)(1.0 / sqrt((double)d));
    for (int h = 0; h < job->heads; h++)
        rotate(job->q + (t * job->heads + h) * d, cos, sin, job->rotary_half, (int)d, scale,
               job->rotated_q + (t * job->heads + h) * d);
    for (int g = 0; g < job->kv_heads; g++) {
        const size_t head = ((size_t)job->cache_rows[t] * (size_t)job->kv_heads + (size_t)g) * (size_t)job->capacity;
        const size_t at = (head + (size_t)position) * (size_t)d;
        float key[MAX_HEAD_DIM];
        rotate(job->k + (t * job->kv_heads + g) * d, cos, sin, job->rotary_half, (int)d, 1.0f, key);
        if (job->key_blocks)  /* dimension i of this position at i · 16 + position % 16 of its block */
            store(job, key, d, (head + (size_t)(position & ~(int64_t)15)) * (size_t)d + (size_t)(position & 15), 16, job->key_cache);
        else
            store(job, key, d, at, 1, job->key_cache);
        store(job, job->v + (t * job->kv_heads + g) * d, d, at, 1, job->value_cache);
    }
}

/* Phase 2, a unit: the last first (a unit's cost grows with its positions; onnxruntime hands the
 * next index to whichever thread is free, so the long ones start first and the short ones fill in). */
static void attend(void *data, size_t index) {
    const attention_job *job = data;
    (job->half_cache ? attend_unit_f16 : attend_unit)(&job->units[job->unit_count - 1 - index], job);
}

/* Runs of tokens of one row, MAX_TILE_TOKENS at most (and MAX_QUERIES queries), times key/value heads. */
static size_t make_units(attention_job *job) {
    const int group = job->heads / job->kv_heads;
    const int tile = MAX_QUERIES / group < MAX_TILE_TOKENS ? MAX_QUERIES / group : MAX_TILE_TOKENS;
    size_t count = 0;
    for (int64_t t = 0; t < job->tokens;) {
        if (!token_ok(job, t)) {
            t++;
            continue;
        }
        int tokens = 1;
        while (tokens < tile && t + tokens < job->tokens && token_ok(job, t + tokens) &&
               job->cache_rows[t + tokens] == job->cache_rows[t])
            tokens++;
        for (int g = 0; g < job->kv_heads; g++) job->units[count++] = (attention_unit){job->cache_rows[t], t, tokens, g};
        t += tokens;
    }
    return count;
}

/* Both phases; ``parallel`` NULL: on this thread. Returns 0 where memory ran out. */
static int run(attention_job *job, const OrtApi *api, const OrtKernelContext *context) {
    job->rotated_q = aligned_alloc(64, ((size_t)job->tokens * (size_t)job->heads * (size_t)job->head_dim * sizeof(float) + 63) / 64 * 64 + 64);
    job->units = malloc(sizeof(attention_unit) * ((size_t)job->tokens * (size_t)job->kv_heads + 1));
    if (!job->rotated_q || !job->units) {
        free(job->rotated_q), free(job->units);
        return 0;
    }
    KernelContextParallelForFn parallel = api ? (KernelContextParallelForFn)kiln_ort_fn(api, SLOT_KernelContext_ParallelFor) : NULL;
    if (parallel && job->tokens > 1) {
        OrtStatus *status = parallel(context, write_token, (size_t)job->tokens, 0, job);
        if (status) ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status);
    } else {
        for (int64_t t = 0; t < job->tokens; t++) write_token(job, (size_t)t);
    }
    const size_t units = job->unit_count = make_units(job);
    if (parallel && units > 1) {
        OrtStatus *status = parallel(context, attend, units, 0, job);
        if (status) ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status);
    } else {
        for (size_t i = 0; i < units; i++) attend(job, i);
    }
    free(job->rotated_q), free(job->units);
    return 1;
}

/* ---- the onnxruntime side ----------------------------------------------------------------------- */
typedef struct {
    const OrtApi *api;
    int64_t heads, kv_heads, key_blocks;
    int half_cache;  /* KilnAttentionF16 */
} kernel;

static int64_t elements(const int64_t *dims, size_t rank) {
    int64_t n = 1;
    for (size_t i = 0; i < rank; i++) n *= dims[i];
    return n;
}

static void compute(void *state, OrtKernelContext *context) {
    const kernel *kn = state;
    if (!kn) return;  /* its attributes were refused at creation (the graph writer never does that) */
    const OrtApi *api = kn->api;
    const OrtValue *in[9];
    for (size_t i = 0; i < 9; i++) CHECK(((KernelContextGetInputFn)kiln_ort_fn(api, SLOT_KernelContext_GetInput))(context, i, &in[i]));
    int64_t qd[8], kd[8], vd[8], cache[8], rd[8], pd[8], cd[8], sd[8], pastv[8];
    size_t qr, kr, vr, cr, rr, pr, cosr, sinr, pvr;
    if (!shape_of(api, in[0], qd, &qr) || !shape_of(api, in[1], kd, &kr) || !shape_of(api, in[2], vd, &vr) ||
        !shape_of(api, in[3], cache, &cr) || !shape_of(api, in[4], pastv, &pvr) || !shape_of(api, in[5], rd, &rr) ||
        !shape_of(api, in[6], pd, &pr) || !shape_of(api, in[7], cd, &cosr) || !shape_of(api, in[8], sd, &sinr))
        return;
    if (qr < 1 || cr != 4 || pvr != 4 || cosr != 2 || sinr != 2) return;
    const int64_t head_dim = cache[3], tokens = elements(qd, qr - 1);
    if (cache[1] != kn->kv_heads || head_dim % 16 || head_dim > MAX_HEAD_DIM || qd[qr - 1] != kn->heads * head_dim ||
        elements(kd, kr) != tokens * kn->kv_heads * head_dim || elements(vd, vr) != tokens * kn->kv_heads * head_dim ||
        elements(rd, rr) != tokens || elements(pd, pr) != tokens || memcmp(cache, pastv, sizeof(int64_t) * 4) ||
        cd[1] != sd[1] || cd[0] != sd[0] || 2 * cd[1] > head_dim || (kn->key_blocks && cache[2] % 16))
        return;
    attention_job job = {(int)kn->heads, (int)kn->kv_heads, (int)head_dim, (int)cd[1], (int)kn->key_blocks,
                         kn->half_cache, tokens, cache[0], cache[2], cd[0]};
    GetTensorMutableDataFn data = (GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData);
    void *p[9];
    for (size_t i = 0; i < 9; i++) CHECK(data((OrtValue *)in[i], &p[i]));
    job.q = p[0], job.k = p[1], job.v = p[2], job.cache_rows = p[5], job.positions = p[6], job.cos = p[7], job.sin = p[8];
    const void *past_key = p[3], *past_value = p[4];
    OrtValue *out, *present_key, *present_value;
    KernelContextGetOutputFn output = (KernelContextGetOutputFn)kiln_ort_fn(api, SLOT_KernelContext_GetOutput);
    CHECK(output(context, 0, qd, qr, &out));
    CHECK(output(context, 1, cache, 4, &present_key));
    CHECK(output(context, 2, cache, 4, &present_value));
    CHECK(data(out, (void **)&job.out));
    CHECK(data(present_key, &job.key_cache));
    CHECK(data(present_value, &job.value_cache));
    const size_t cache_bytes = (size_t)elements(cache, 4) * (kn->half_cache ? sizeof(uint16_t) : sizeof(float));
    if (job.key_cache != past_key) memcpy(job.key_cache, past_key, cache_bytes);  /* not bound in place */
    if (job.value_cache != past_value) memcpy(job.value_cache, past_value, cache_bytes);
    if (tokens > 0) run(&job, api, context);
}

extern const OrtCustomOp KILN_ATTENTION_F16;

static void *create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info) {
    kernel *kn = calloc(1, sizeof *kn);
    if (!kn) return NULL;
    kn->api = api;
    kn->half_cache = op == &KILN_ATTENTION_F16;
    KernelInfoGetAttributeInt64Fn attr = (KernelInfoGetAttributeInt64Fn)kiln_ort_fn(api, SLOT_KernelInfoGetAttribute_int64);
    OrtStatus *status;
    if ((status = attr(info, "num_heads", &kn->heads)) || (status = attr(info, "kv_num_heads", &kn->kv_heads))) {
        ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status);
        free(kn);
        return NULL;
    }
    if ((status = attr(info, "key_blocks", &kn->key_blocks))) {  /* graphs written before the attribute: position-major */
        ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status);
        kn->key_blocks = 0;
    }
    if (kn->heads <= 0 || kn->kv_heads <= 0 || kn->heads % kn->kv_heads || kn->heads / kn->kv_heads > MAX_QUERIES ||
        (kn->key_blocks != 0 && kn->key_blocks != 1) || (kn->half_cache && !kn->key_blocks)) {
        free(kn);
        return NULL;
    }
    return kn;
}

static void destroy(void *state) { free(state); }
static const char *name(const OrtCustomOp *op) { return op == &KILN_ATTENTION_F16 ? "KilnAttentionF16" : "KilnAttention"; }
static const char *cpu(const OrtCustomOp *op) { (void)op; return NULL; }
static size_t nine(const OrtCustomOp *op) { (void)op; return 9; }
static size_t three(const OrtCustomOp *op) { (void)op; return 3; }
static int input_type(const OrtCustomOp *op, size_t i) { (void)op; return i == 5 || i == 6 ? 7 /* int64 */ : KILN_TENSOR_FLOAT; }
static int float_output(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return KILN_TENSOR_FLOAT; }
static int input_type_f16(const OrtCustomOp *op, size_t i) { return i == 3 || i == 4 ? KILN_TENSOR_FLOAT16 : input_type(op, i); }
static int output_type_f16(const OrtCustomOp *op, size_t i) { (void)op; return i ? KILN_TENSOR_FLOAT16 : KILN_TENSOR_FLOAT; }
static int required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static int default_memory(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }

const OrtCustomOp KILN_ATTENTION = {13, create, name, cpu, input_type, nine, float_output, three,
                                    compute, destroy, required, required, default_memory};
/* The same over caches of halves (past/present float16), keys in blocks (key_blocks = 1 required). */
const OrtCustomOp KILN_ATTENTION_F16 = {13, create, name, cpu, input_type_f16, nine, output_type_f16, three,
                                        compute, destroy, required, required, default_memory};

/* For tests and measurements without onnxruntime: both phases on one thread, the caches in place;
 * q [tokens, heads, D], k and v [tokens, kv_heads, D], caches [rows, kv_heads, capacity, D],
 * cos and sin [table_positions, half]; key_blocks: the key cache's layout, as the attribute; half_cache:
 * caches of halves (uint16_t), as KilnAttentionF16. */
__attribute__((visibility("default")))
int kiln_attention(int heads, int kv_heads, int head_dim, int64_t tokens, const float *q, const float *k, const float *v,
                   const int64_t *cache_rows, const int64_t *positions, int64_t rows, int64_t capacity, void *key_cache,
                   void *value_cache, const float *cos, const float *sin, int64_t table_positions, int half, float *out,
                   int key_blocks, int half_cache) {
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads || heads / kv_heads > MAX_QUERIES || head_dim % 16 ||
        head_dim > MAX_HEAD_DIM || 2 * half > head_dim || (key_blocks != 0 && key_blocks != 1) || (key_blocks && capacity % 16) ||
        (half_cache != 0 && half_cache != 1) || (half_cache && !key_blocks))
        return 0;
    attention_job job = {heads, kv_heads, head_dim, half, key_blocks, half_cache, tokens, rows, capacity, table_positions};
    job.q = q, job.k = k, job.v = v, job.cos = cos, job.sin = sin, job.cache_rows = cache_rows, job.positions = positions;
    job.key_cache = key_cache, job.value_cache = value_cache, job.out = out;
    return tokens > 0 ? run(&job, NULL, NULL) : 1;
}
