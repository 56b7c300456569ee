/* KilnAttention's arithmetic, written once and compiled by attention.c with AVX-512 (V16 is one
 * 16-lane register) and with AVX2 (V16 is two 8-lane halves), each over caches of floats and of
 * halves (attention_caches.h). Every operation below is
 * lane by lane (FMA, multiply, add, max, the exponential's steps) except the few that move data
 * or take an exact maximum, so a lane's value is the same bits in either form: the instruction
 * set changes how many lanes one instruction carries, never what a lane computes.
 *
 * The including file defines before including:
 *   NAME(x)             this form's name for x (x##_512, x##_256; x##_512_f16, x##_256_f16)
 *   CACHE_T, c_load(p)  the caches' element (float, or uint16_t holding an IEEE half) and sixteen
 *                       of them as floats (a half widens exactly, so either form reads the same
 *                       floats); CACHE_HALF 1 for halves, whose keys are always kept in blocks
 *   V16                 sixteen float lanes, with
 *   v_zero(), v_set(f), v_load(p), v_store(p, v), v_fma(a, b, c) = a·b + c rounded once,
 *   v_mul, v_add, v_sub, v_max, v_div, v_round (to nearest, ties to even), v_pow2(n) (2^n for an
 *   integral n), v_zero_below(x, limit, y) (0 where x < limit, else y), v_valid(v, n) (lanes ≥ n
 *   become −∞), v_hmax(v) (an exact maximum), SCORE_QUERIES (the most queries a block's scores take
 *   at once), WIDE_VALUES_QUERIES (the most whose values take four chunks at once; 0: never),
 *   PAIR_QUERIES (the most whose scores take two blocks at once: 4, or 0: never), and
 *   transpose16(keys, valid, head_dim, kt): a block's keys, position-major → kt[d][16] (data only). */

/* exp(x) for x ≤ 0 (Cephes' expf: n = round(x·log2 e), r = x − n·ln 2 in two parts, a degree-7
 * polynomial, times 2^n), about 1 ulp; below −87 (and −∞: a masked lane, an empty past) it is 0.
 * Ours rather than libm's so that both forms compute it lane by lane with the same operations. */
static inline V16 NAME(exp)(V16 x) {
    const V16 xc = v_max(x, v_set(-87.0f));
    const V16 n = v_round(v_mul(xc, v_set(1.44269504088896341f)));
    V16 r = v_fma(n, v_set(-0.693359375f), xc);
    r = v_fma(n, v_set(2.12194440e-4f), r);
    V16 p = v_set(1.9875691500e-4f);
    p = v_fma(p, r, v_set(1.3981999507e-3f));
    p = v_fma(p, r, v_set(8.3334519073e-3f));
    p = v_fma(p, r, v_set(4.1665795894e-2f));
    p = v_fma(p, r, v_set(1.6666665459e-1f));
    p = v_fma(p, r, v_set(5.0000001201e-1f));
    const V16 y = v_add(v_fma(p, v_mul(r, r), r), v_set(1.0f));
    return v_zero_below(x, -87.0f, v_mul(y, v_pow2(n)));
}

/* The weighted values of a block's keys, key by key in position order (one FMA each), into
 * ``chunks`` (1, 2 or 4: constants once inlined) sixteen-float chunks of each query's accumulator
 * from dimension d. Each FMA waits for the one before it on its chunk, so more chunks keep more
 * independent FMAs in flight: a decode step's 3 queries with 2 chunks are 6 chains, too few to
 * fill two FMA units with a 4-cycle latency; 4 chunks make 12. A lane's operations are the same
 * either way. Keys [0, valid[r]) only. */
static inline __attribute__((always_inline)) void NAME(values)(const int count, const int chunks,
                                                                const float (*weights)[16], const int *valid, int fewest,
                                                                int most, const CACHE_T *v, int head_dim,
                                                                float *const *state, int d) {
    V16 acc[4][SCORE_QUERIES];
    for (int c = 0; c < chunks; c++)
        for (int r = 0; r < count; r++) acc[c][r] = v_load(state[r] + 32 + d + 16 * c);
    for (int j = 0; j < most; j++) {
        V16 vj[4];
        for (int c = 0; c < chunks; c++) vj[c] = c_load(v + (size_t)j * head_dim + d + 16 * c);
        for (int r = 0; r < count; r++) {
            if (j >= fewest && j >= valid[r]) continue;  /* (never taken before ``fewest``) */
            const V16 w = v_set(weights[r][j]);
            for (int c = 0; c < chunks; c++) acc[c][r] = v_fma(w, vj[c], acc[c][r]);
        }
    }
    for (int c = 0; c < chunks; c++)
        for (int r = 0; r < count; r++) v_store(state[r] + 32 + d + 16 * c, acc[c][r]);
}

/* A block's softmax step and weighted values for ``count`` queries, from their scores' two chains. */
static inline __attribute__((always_inline)) void NAME(absorb)(const int count, const V16 *lo, const V16 *hi,
                                                                const int *valid, float *const *state, const CACHE_T *v,
                                                                int head_dim) {
    float weights[SCORE_QUERIES][16] __attribute__((aligned(64)));
    int fewest = 16, most = 0;
    for (int r = 0; r < count; r++) {
        float *m = state[r], *lsum = state[r] + 16, *acc = state[r] + 32;
        const V16 s = v_valid(v_add(lo[r], hi[r]), valid[r]);
        const float block_max = v_hmax(s);
        const float m_new = *m > block_max ? *m : block_max;
        const V16 p = NAME(exp)(v_sub(s, v_set(m_new)));
        v_store(weights[r], p);
        if (m_new != *m) {  /* 0 for the first block (m = -inf): nothing to keep */
            float alpha[16];
            v_store(alpha, NAME(exp)(v_set(*m - m_new)));
            const V16 a = v_set(alpha[0]);
            v_store(lsum, v_fma(v_load(lsum), a, p));
            for (int d = 0; d < head_dim; d += 16) v_store(acc + d, v_mul(v_load(acc + d), a));
        } else {
            v_store(lsum, v_add(v_load(lsum), p));
        }
        *m = m_new;
        fewest = valid[r] < fewest ? valid[r] : fewest;
        most = valid[r] > most ? valid[r] : most;
    }
    int d = 0;
    if (count <= WIDE_VALUES_QUERIES)  /* 4 chunks × count accumulators, the values' 4 and a weight fit the registers */
        for (; d + 64 <= head_dim; d += 64) NAME(values)(count, 4, weights, valid, fewest, most, v, head_dim, state, d);
    for (; d + 32 <= head_dim; d += 32) NAME(values)(count, 2, weights, valid, fewest, most, v, head_dim, state, d);
    for (; d < head_dim; d += 16) NAME(values)(count, 1, weights, valid, fewest, most, v, head_dim, state, d);
}

/* One key block for ``count`` queries (a constant once inlined: their sums stay in registers).
 *
 * Scores, lanes = the block's keys: for each query two chains over d (the first and the second
 * half of the head, each in order, one FMA a step), added at the end; two chains so that even a
 * lone query's FMAs overlap. Then each query's online softmax step: its running maximum m, the old
 * sums scaled by exp(m − new max) where the maximum grew, the weights exp(s − max) added lane by
 * lane into its sixteen partial sums, and its weighted values: key by key in position order, one
 * FMA each, over keys [0, valid) of the block only (later slots may hold a chunk's later tokens,
 * or nothing). ``state`` of a query: m (padded to 16 floats), lsum[16], acc[head_dim]. */
static inline __attribute__((always_inline)) void NAME(block)(const int count, const float *const *q, const int *valid,
                                                               float *const *state, const CACHE_T *kt, const CACHE_T *v,
                                                               int head_dim) {
    V16 lo[SCORE_QUERIES], hi[SCORE_QUERIES];
    for (int r = 0; r < count; r++) lo[r] = hi[r] = v_zero();
    const int half = head_dim / 2;
    for (int d = 0; d < half; d++) {
        const V16 k0 = c_load(kt + 16 * d), k1 = c_load(kt + 16 * (d + half));
        for (int r = 0; r < count; r++) {
            lo[r] = v_fma(v_set(q[r][d]), k0, lo[r]);
            hi[r] = v_fma(v_set(q[r][d + half]), k1, hi[r]);
        }
    }
    NAME(absorb)(count, lo, hi, valid, state, v, head_dim);
}

#if PAIR_QUERIES
/* Two key blocks in a row (keys in blocks: the second's at kt + 16 · head_dim) for ``count`` queries
 * that all reach past the first, whose keys then all count. Each block's scores are the same
 * chains as NAME(block)'s, computed side by side: a decode step's 3 queries make 6 chains, each FMA
 * waiting 4 cycles for the one before it; two blocks make 12, enough to keep both FMA units busy,
 * and each query element is broadcast once for both. Then the first block's softmax step and
 * values, then the second's, as two calls of NAME(block) would take them. */
static inline __attribute__((always_inline)) void NAME(block_pair)(const int count, const float *const *q,
                                                                    const int *valid_second, float *const *state,
                                                                    const CACHE_T *kt, const CACHE_T *v, int head_dim) {
    V16 lo[2][PAIR_QUERIES], hi[2][PAIR_QUERIES];
    for (int r = 0; r < count; r++) lo[0][r] = hi[0][r] = lo[1][r] = hi[1][r] = v_zero();
    const int half = head_dim / 2;
    const CACHE_T *kt2 = kt + (size_t)16 * head_dim;
    for (int d = 0; d < half; d++) {
        const V16 k0 = c_load(kt + 16 * d), k1 = c_load(kt + 16 * (d + half));
        const V16 k2 = c_load(kt2 + 16 * d), k3 = c_load(kt2 + 16 * (d + half));
        for (int r = 0; r < count; r++) {
            const V16 qd = v_set(q[r][d]), qh = v_set(q[r][d + half]);
            lo[0][r] = v_fma(qd, k0, lo[0][r]);
            hi[0][r] = v_fma(qh, k1, hi[0][r]);
            lo[1][r] = v_fma(qd, k2, lo[1][r]);
            hi[1][r] = v_fma(qh, k3, hi[1][r]);
        }
    }
    const int whole[PAIR_QUERIES] = {16, 16, 16, 16};
    NAME(absorb)(count, lo[0], hi[0], whole, state, v, head_dim);
    NAME(absorb)(count, lo[1], hi[1], valid_second, state, v + (size_t)16 * head_dim, head_dim);
}

static void NAME(pairs)(int count, const float *const *q, const int *valid_second, float *const *state,
                        const CACHE_T *kt, const CACHE_T *v, int head_dim) {
    switch (count) {
#define CASE(n) case n: NAME(block_pair)(n, q, valid_second, state, kt, v, head_dim); break;
        CASE(1) CASE(2) CASE(3) CASE(4)
#undef CASE
        default: break;
    }
}
#endif

static void NAME(blocks)(int count, const float *const *q, const int *valid, float *const *state, const CACHE_T *kt,
                         const CACHE_T *v, int head_dim) {
    switch (count) {  /* each its own inlined copy, its queries' sums in registers */
#define CASE(n) case n: NAME(block)(n, q, valid, state, kt, v, head_dim); break;
        CASE(1) CASE(2)
#if SCORE_QUERIES > 2
        CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#endif
#undef CASE
        default: break;
    }
}

static inline void NAME(finish)(const float *lsum, const float *acc, int head_dim, float *out) {
    float l = 0.0f;
    for (int i = 0; i < 16; i++) l += lsum[i];  /* in lane order, the same in either form */
    const V16 total = v_set(l);
    for (int d = 0; d < head_dim; d += 16) v_store(out + d, v_div(v_load(acc + d), total));
}

/* Asks for the keys and values of the block at ``start`` (a row's cache), ahead of their use. */
static inline void NAME(prefetch_block)(const CACHE_T *keys, const CACHE_T *values, int64_t start, int head_dim) {
    const char *nk = (const char *)(keys + (size_t)start * head_dim), *nv = (const char *)(values + (size_t)start * head_dim);
    for (size_t at = 0; at < 16 * sizeof(CACHE_T) * (size_t)head_dim; at += 64) __builtin_prefetch(nk + at), __builtin_prefetch(nv + at);
}

/* A unit: queries (tokens of one cache row × the query heads of one key/value head) over that
 * row's keys, block by block from position 0. A query at position p reads blocks 0..p/16, the
 * last one to p only; its operations are those it would take alone (a decode step), whichever
 * other queries share the block's loads. */
static void NAME(unit)(const attention_unit *u, const attention_job *job) {
    const int head_dim = job->head_dim, group = job->heads / job->kv_heads, queries = u->tokens * group;
    const int stride = 32 + head_dim;  /* per query: m (padded to 16 floats), lsum[16], acc[head_dim] */
    const size_t row_base = ((size_t)u->row * (size_t)job->kv_heads + (size_t)u->kv_head) * (size_t)job->capacity * (size_t)head_dim;
    const CACHE_T *keys = (const CACHE_T *)job->key_cache + row_base, *values = (const CACHE_T *)job->value_cache + row_base;
    float state[MAX_QUERIES * (32 + MAX_HEAD_DIM)] __attribute__((aligned(64)));
#if !CACHE_HALF
    float kt[16 * MAX_HEAD_DIM] __attribute__((aligned(64)));  /* a position-major block, transposed */
#endif
    const float *q_of[MAX_QUERIES];
    int64_t position_of[MAX_QUERIES], last = 0, earliest = INT64_MAX;
    for (int q = 0; q < queries; q++) {
        const int64_t token = u->first + q / group, head = (int64_t)u->kv_head * group + q % group;
        q_of[q] = job->rotated_q + ((size_t)token * (size_t)job->heads + (size_t)head) * (size_t)head_dim;
        position_of[q] = job->positions[token];
        last = position_of[q] > last ? position_of[q] : last;
        earliest = position_of[q] < earliest ? position_of[q] : earliest;
        float *st = state + (size_t)q * stride;
        st[0] = -INFINITY;
        memset(st + 16, 0, sizeof(float) * (size_t)(16 + head_dim));
    }
    for (int64_t start = 0; start <= last; start += 16) {
        if (start + 16 <= last) NAME(prefetch_block)(keys, values, start + 16, head_dim);  /* while this one computes */
#if PAIR_QUERIES
        /* two blocks at once where every query reaches past the first (a decode step's unit, up to
         * its last block); their next two asked for while they compute */
        if (queries <= PAIR_QUERIES && (CACHE_HALF || job->key_blocks) && earliest >= start + 16) {
            if (start + 32 <= last) NAME(prefetch_block)(keys, values, start + 32, head_dim);
            float *states[PAIR_QUERIES];
            int valid_second[PAIR_QUERIES];
            for (int q = 0; q < queries; q++) {
                states[q] = state + (size_t)q * stride;
                valid_second[q] = position_of[q] - start - 16 + 1 < 16 ? (int)(position_of[q] - start - 16 + 1) : 16;
            }
            NAME(pairs)(queries, q_of, valid_second, states, keys + (size_t)start * head_dim,
                        values + (size_t)start * head_dim, head_dim);
            start += 16;
            continue;
        }
#endif
        /* the block's keys dimension-major: as the cache keeps them, or transposed here. Lanes past a
         * query's own position are masked before they count, so the layout changes no bit. */
        const CACHE_T *block_keys = keys + (size_t)start * head_dim;
#if !CACHE_HALF
        if (!job->key_blocks) {
            transpose16(block_keys, last - start + 1 < 16 ? (int)(last - start + 1) : 16, head_dim, kt);
            block_keys = kt;
        }
#endif
        const float *qs[SCORE_QUERIES];
        float *states[SCORE_QUERIES];
        int valid[SCORE_QUERIES], count = 0;
        for (int q = 0; q < queries; q++) {
            if (position_of[q] < start) continue;  /* its keys end before this block */
            qs[count] = q_of[q];
            states[count] = state + (size_t)q * stride;
            valid[count++] = position_of[q] - start + 1 < 16 ? (int)(position_of[q] - start + 1) : 16;
            if (count == SCORE_QUERIES) {
                NAME(blocks)(count, qs, valid, states, block_keys, values + (size_t)start * head_dim, head_dim);
                count = 0;
            }
        }
        if (count) NAME(blocks)(count, qs, valid, states, block_keys, values + (size_t)start * head_dim, head_dim);
    }
    for (int q = 0; q < queries; q++) {
        const int64_t token = u->first + q / group, head = (int64_t)u->kv_head * group + q % group;
        const float *st = state + (size_t)q * stride;
        NAME(finish)(st + 16, st + 32, head_dim, job->out + ((size_t)token * (size_t)job->heads + (size_t)head) * (size_t)head_dim);
    }
}
