/* KilnAttention's arithmetic, written once and compiled twice by attention.c: with AVX-512 (V16
 * is one 16-lane register) and with AVX2 (V16 is two 8-lane halves). Every operation below is
 * lane by lane (FMA, multiply, add, max, the exponential's steps) except the few that move data
 * or take an exact maximum, so a lane's value is the same bits in either form: the instruction
 * set changes how many lanes one instruction carries, never what a lane computes.
 *
 * The including file defines before including:
 *   NAME(x)             this form's name for x (x##_512, x##_256)
 *   V16                 sixteen float lanes, with
 *   v_zero(), v_set(f), v_load(p), v_store(p, v), v_fma(a, b, c) = a·b + c rounded once,
 *   v_mul, v_add, v_sub, v_max, v_div, v_round (to nearest, ties to even), v_pow2(n) (2^n for an
 *   integral n), v_zero_below(x, limit, y) (0 where x < limit, else y), v_valid(v, n) (lanes ≥ n
 *   become −∞), v_hmax(v) (an exact maximum), SCORE_QUERIES, and
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

/* Scores of one key block for up to SCORE_QUERIES queries (lanes = the block's keys): for each
 * query, d = 0..D-1 in order, s = fma(q[d], kt[d], s). One chain per query; several queries
 * side by side only so the chains overlap in time. */
static inline void NAME(scores)(const float *const *q, int count, const float *kt, int head_dim, V16 *s) {
    V16 acc[SCORE_QUERIES];
    for (int r = 0; r < SCORE_QUERIES; r++) acc[r] = v_zero();
    for (int d = 0; d < head_dim; d++) {
        const V16 k = v_load(kt + 16 * d);
        for (int r = 0; r < SCORE_QUERIES; r++)
            if (r < count) acc[r] = v_fma(v_set(q[r][d]), k, acc[r]);
    }
    for (int r = 0; r < count; r++) s[r] = acc[r];
}

/* One query's online softmax over one block: m its running maximum, lsum its sixteen running
 * partial sums (summed in a fixed order at the end), acc its weighted values (head_dim floats).
 * The block's keys are [0, valid), values at v (position-major, head_dim apart). */
static inline void NAME(absorb)(V16 s, int valid, const float *v, int head_dim, float *m, float *lsum, float *acc) {
    s = v_valid(s, valid);
    const float block_max = v_hmax(s);
    const float m_new = *m > block_max ? *m : block_max;
    const V16 p = NAME(exp)(v_sub(s, v_set(m_new)));
    float weights[16];
    v_store(weights, p);
    if (m_new != *m) {  /* the old sums shrink by exp(m - m_new): 0 for the first block (m = -inf) */
        float alpha[16];
        v_store(alpha, NAME(exp)(v_set(*m - m_new)));
        const V16 a = v_set(alpha[0]);
        v_store(lsum, v_fma(v_load(lsum), a, p));
        for (int d = 0; d < head_dim; d += 16) v_store(acc + d, v_mul(v_load(acc + d), a));
    } else {
        v_store(lsum, v_fma(v_load(lsum), v_set(1.0f), p));
    }
    *m = m_new;
    for (int d = 0; d < head_dim; d += 16) {
        V16 sum = v_load(acc + d);
        for (int j = 0; j < valid; j++) sum = v_fma(v_set(weights[j]), v_load(v + (size_t)j * head_dim + d), sum);
        v_store(acc + d, sum);
    }
}

static inline void NAME(finish)(const float *lsum, const float *acc, int head_dim, float *out) {
    float l = 0.0f;
    for (int i = 0; i < 16; i++) l += lsum[i];  /* in lane order, the same in either form */
    const V16 total = v_set(l);
    for (int d = 0; d < head_dim; d += 16) v_store(out + d, v_div(v_load(acc + d), total));
}

/* A unit: queries (tokens of one cache row × the query heads of one key/value head) over that
 * row's keys, block by block from position 0. A query at position p reads blocks 0..p/16, the
 * last one to p only; its operations are those it would take alone (a decode step), whichever
 * other queries share the block's loads. */
static void NAME(unit)(const attention_unit *u, const attention_job *job) {
    const int head_dim = job->head_dim, group = job->heads / job->kv_heads, queries = u->tokens * group;
    const int stride = 32 + head_dim;  /* per query: m (padded to 16 floats), lsum[16], acc[head_dim] */
    const size_t row_base = ((size_t)u->row * (size_t)job->kv_heads + (size_t)u->kv_head) * (size_t)job->capacity * (size_t)head_dim;
    const float *keys = job->key_cache + row_base, *values = job->value_cache + row_base;
    float state[MAX_QUERIES * (32 + MAX_HEAD_DIM)] __attribute__((aligned(64)));
    float kt[16 * MAX_HEAD_DIM] __attribute__((aligned(64)));
    const float *q_of[MAX_QUERIES];
    int64_t position_of[MAX_QUERIES], last = 0;
    for (int q = 0; q < queries; q++) {
        const int64_t token = u->first + q / group, head = (int64_t)u->kv_head * group + q % group;
        q_of[q] = job->rotated_q + ((size_t)token * (size_t)job->heads + (size_t)head) * (size_t)head_dim;
        position_of[q] = job->positions[token];
        last = position_of[q] > last ? position_of[q] : last;
        float *st = state + (size_t)q * stride;
        st[0] = -INFINITY;
        memset(st + 16, 0, sizeof(float) * (size_t)(16 + head_dim));
    }
    for (int64_t start = 0; start <= last; start += 16) {
        transpose16(keys + (size_t)start * head_dim, last - start + 1 < 16 ? (int)(last - start + 1) : 16, head_dim, kt);
        int ready[MAX_QUERIES], n = 0;  /* the queries whose keys reach this block */
        for (int q = 0; q < queries; q++)
            if (position_of[q] >= start) ready[n++] = q;
        for (int i = 0; i < n; i += SCORE_QUERIES) {
            const int count = n - i < SCORE_QUERIES ? n - i : SCORE_QUERIES;
            const float *qs[SCORE_QUERIES];
            V16 s[SCORE_QUERIES];
            for (int r = 0; r < count; r++) qs[r] = q_of[ready[i + r]];
            NAME(scores)(qs, count, kt, head_dim, s);
            for (int r = 0; r < count; r++) {
                const int q = ready[i + r];
                const int valid = position_of[q] - start + 1 < 16 ? (int)(position_of[q] - start + 1) : 16;
                float *st = state + (size_t)q * stride;
                NAME(absorb)(s[r], valid, values + (size_t)start * head_dim, head_dim, st, st + 16, st + 32);
            }
        }
    }
    for (int q = 0; q < queries; q++) {
        const int64_t token = u->first + q / group, head = (int64_t)u->kv_head * group + q % group;
        const float *st = state + (size_t)q * stride;
        NAME(finish)(st + 16, st + 32, head_dim, job->out + ((size_t)token * (size_t)job->heads + (size_t)head) * (size_t)head_dim);
    }
}
