/* A sampled token from exponentials computed here, or a refusal: never another token than the rule's.

   selection.draw computes every exponential of the row with numpy (float64, ~27 us at 49k tokens)
   and sums them in numpy's order, so that each value is the reference's bit for bit. Yet the token
   depends on those values only through a few comparisons: where top-p's cumulative sum first reaches
   top_p, which tokens min-p keeps, and between which two cumulative sums the uniform's target falls.

   kiln_bounded_draw takes the same decisions on its own exponentials (a vectorised exp fused with the
   scaling and the sums, one pass over the row) and takes each only where its two sides are farther
   apart than every difference the approximation and the two orders of summation can make (``margin``
   below); where one is nearer than that, it returns KILN_DECLINED and the caller takes the exact
   path. The chance of that is about 2 * margin * (tokens kept): under 1e-4 for any row where the
   decisions are taken in float64; where a top-p cut is taken on the float32 pass (its margin a few
   1e-6, below), under 1% of real rows. Flat rows with a top-p cut (``dense``) are drawn over the row
   as it is (``flat_draw``), in float64, declined where the cut splits tokens of equal value.

   The differences, relative to the value compared (n: the vocabulary):
   - an exponential: the scaling multiplies by 1 / temperature where numpy divides (|s| * 3 * 2^-53,
     under 2.4e-13 for s >= -708), the degree-10 polynomial (2.2e-13 truncation, a few ulps of
     rounding), numpy's own exp (about an ulp); exponentials of s < -708 are taken as 0 (the
     reference's are below 1e-307, against a total of at least 1): together under 1e-12;
   - a sum of up to n nonnegative terms, in any order: n * 2^-53 of it, for numpy's sums and for ours;
   - a ratio or product of such values: the sum of their bounds and an ulp.
   ``margin`` is twice the largest of these a decision can carry. */

#include <string.h>

#include "sampling.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KILN_VECTOR_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define KILN_VECTOR_CLONES
#endif

/* This file's rounding need not be numpy's (the margins cover it): contracting the polynomial's
   products and sums into FMAs halves its instructions. */
#pragma GCC optimize("fp-contract=fast")

#define KILN_DECLINED (-1)
#define BLOCK 64 /* tokens per block sum: the inverse transform walks the blocks, then one block */
#define LANES 8


typedef double v8d __attribute__((vector_size(64)));
typedef uint64_t v8u __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static double margin(int64_t n) {
    return 4e-12 + 8.0 * (double)n * 1.1102230246251565e-16;
}

/* The sum of a vector's eight lanes, pairwise (every running-sum pass of this file ends with it). */
static inline double lanes_total(v8d v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* ---- the exponentials ---------------------------------------------------------------------------- */

#define SHIFTER 6755399441055744.0 /* 1.5 * 2^52: adding it rounds to an integer, kept in the low bits */
#define LN2_HI 0.6931471803691238 /* fdlibm's ln2 in two parts: k * LN2_HI is exact for |k| < 2^20 */
#define LN2_LO 1.9082149292705877e-10

/* exp(s) for s <= 0 (or -inf), eight at a time: s = k ln2 + r with |r| <= ln2 / 2, exp(r) by its
   Taylor polynomial to degree 10 (in Estrin's order: four products deep instead of Horner's ten, so
   that the vectors of a block overlap), 2^k added into the exponent; 0 below -708 (where 2^k would
   not be a normal number). */
static inline __attribute__((always_inline)) void exp8(v8d *value) {
    v8d s = *value;
    const v8d zero = {0}, shifter = zero + SHIFTER;
    v8d t = s * 1.4426950408889634 + shifter;
    v8d k = t - shifter;
    v8d r = s - k * LN2_HI;
    r = r - k * LN2_LO;
    v8d r2 = r * r, r4 = r2 * r2, r8 = r4 * r4;
    v8d a0 = r + 1.0, a1 = r * (1.0 / 6.0) + 0.5, a2 = r * (1.0 / 120.0) + 1.0 / 24.0;
    v8d a3 = r * (1.0 / 5040.0) + 1.0 / 720.0, a4 = r * (1.0 / 362880.0) + 1.0 / 40320.0;
    v8d b0 = a1 * r2 + a0, b1 = a3 * r2 + a2, b2 = r2 * (1.0 / 3628800.0) + a4;
    v8d poly = (b2 * r8) + (b1 * r4 + b0);
    v8u scaled = (v8u)poly + (((v8u)t - (v8u)shifter) << 52);
    *value = (v8d)(scaled & ~(v8u)(s < -708.0));
}

/* exp8 for one value (a row's last, partial group; a few kept tokens). */
static inline double exp1(double s) {
    v8d v = {s, s, s, s, s, s, s, s};
    exp8(&v);
    return v[0];
}

/* The test's view of the exponentials: exp(s[i]) as kiln_bounded_draw computes it. */
KILN_VECTOR_CLONES
KILN_EXPORT void kiln_bounded_exp(const double *s, int64_t n, double *out) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        v8d v;
        __builtin_memcpy(&v, s + i, sizeof v);
        exp8(&v);
        __builtin_memcpy(out + i, &v, sizeof v);
    }
    for (; i < n; i++) {
        out[i] = exp1(s[i]);
    }
}

/* ---- the row's pass ------------------------------------------------------------------------------- */

/* The row's largest logit into *best; 0 where every logit is finite, else 1 (NaN or an infinity:
   the caller declines, the exact path has its own rules for them). Four running maxima, so that
   the comparisons do not wait on one another. */
KILN_VECTOR_CLONES
static int row_best(const float *x, int64_t n, float *best) {
    float m = x[0], bad = 0.0f;
    int64_t i = 0;
    if (n >= 4 * LANES) {
        /* a finiteness sum per running maximum too: one sum for all four made every add wait on the
           one before (a third of the pass's time) */
        v8f most[4], nonfinite[4] = {{0}, {0}, {0}, {0}};
        for (int a = 0; a < 4; a++) {
            __builtin_memcpy(&most[a], x, sizeof most[a]);
        }
        for (; i + 4 * LANES <= n; i += 4 * LANES) {
            for (int a = 0; a < 4; a++) {
                v8f v;
                __builtin_memcpy(&v, x + i + a * LANES, sizeof v);
                v8i greater = v > most[a];
                most[a] = (v8f)(((v8i)v & greater) | ((v8i)most[a] & ~greater));
                nonfinite[a] += v - v; /* 0 for a finite value, NaN for NaN and the infinities */
            }
        }
        for (int a = 0; a < 4; a++) {
            for (int j = 0; j < LANES; j++) {
                m = most[a][j] > m ? most[a][j] : m;
                bad += nonfinite[a][j];
            }
        }
    }
    for (; i < n; i++) {
        m = x[i] > m ? x[i] : m;
        bad += x[i] - x[i];
    }
    *best = m;
    return bad != 0.0f;
}

/* e[i] = exp((x[i] - best) / temperature) for the whole row (multiplied by inverse, the temperature's
   inverse), and each block of BLOCK tokens' sum in sums[]; returns the sums' total. */
KILN_VECTOR_CLONES
static double exponentials(const float *x, int64_t n, double best, double inverse, double *e, double *sums) {
    double total = 0.0;
    int64_t i = 0, b = 0;
    for (; i + BLOCK <= n; i += BLOCK, b++) {
        v8d sum[2] = {{0}, {0}};
        for (int64_t j = i; j < i + BLOCK; j += LANES) {
            v8f xf;
            __builtin_memcpy(&xf, x + j, sizeof xf);
            v8d v = (__builtin_convertvector(xf, v8d) - best) * inverse;
            exp8(&v);
            __builtin_memcpy(e + j, &v, sizeof v);
            sum[(j >> 3) & 1] += v;
        }
        double block = lanes_total(sum[0] + sum[1]);
        sums[b] = block;
        total += block;
    }
    if (i < n) {
        double block = 0.0;
        for (; i < n; i++) {
            e[i] = exp1(((double)x[i] - best) * inverse);
            block += e[i];
        }
        sums[b] = block;
        total += block;
    }
    return total;
}

/* ---- the exponentials in float32, where a cut comes first ----------------------------------------- */

/* Where top-p or min-p cuts, the first decisions (which tokens are candidates, where top-p crosses)
   carry a margin of a few 1e-6 anyway (a cut's values are spread far wider), so the row's pass runs
   in float32, sixteen tokens a vector, and the kept tokens' exponentials are computed again in
   float64 for the decisions after the cut. The error of an exponential here, relative: EXP32_ERROR
   for the polynomial and its rounding, and 2e-7 * |s| for s's three float32 roundings (x - best,
   1 / temperature, the product), which exp turns into a relative error |s| times as large. */
#define EXP32_ERROR 1e-6
#define SCALE32_ERROR 2e-7

typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* exp(s) for s <= 0 (or -inf), sixteen at a time: s = k ln2 + r (ln2 in Cephes' two parts),
   exp(r) to degree 6 (Estrin), 2^k into the exponent; 0 below -87 (the float32 exponent's floor). */
static inline __attribute__((always_inline)) void exp16(v16f *value) {
    v16f s = *value;
    const v16f zero = {0}, shifter = zero + 12582912.0f; /* 1.5 * 2^23 */
    v16f t = s * 1.44269504f + shifter;
    v16f k = t - shifter;
    v16f r = s - k * 0.693359375f;
    r = r - k * -2.12194440e-4f;
    v16f r2 = r * r, r4 = r2 * r2;
    v16f a0 = r + 1.0f, a1 = r * (1.0f / 6.0f) + 0.5f, a2 = r * (1.0f / 120.0f) + (1.0f / 24.0f);
    v16f poly = (a2 + r2 * (1.0f / 720.0f)) * r4 + (a1 * r2 + a0);
    v16u scaled = (v16u)poly + (((v16u)t - (v16u)shifter) << 23);
    *value = (v16f)(scaled & ~(v16u)(s < -87.0f));
}

/* The test's view: exp(s[i]) as the float32 pass computes it (n a multiple of 16). */
KILN_VECTOR_CLONES
KILN_EXPORT void kiln_bounded_exp32(const float *s, int64_t n, float *out) {
    for (int64_t i = 0; i + 16 <= n; i += 16) {
        v16f v;
        __builtin_memcpy(&v, s + i, sizeof v);
        exp16(&v);
        __builtin_memcpy(out + i, &v, sizeof v);
    }
}

/* The float32 pass: e[i] = exp((x[i] - best) / temperature) as floats, and near[i] = 1 where e[i]
   reaches ``floor`` (the first candidates' floor: a flag per token costs two instructions a vector,
   where a block's largest value would cost a chain of comparisons); *spread receives sum(e * |s|),
   which bounds the error the scaling's roundings carry into the total. Returns the total: float32
   sums of 256 tokens (two running sums a lane: at most 13 roundings, SUM32_ERROR), added in float64.
   The row's last partial vector is padded with -inf. */
#define SUM32_ERROR 1e-6
typedef unsigned char v16c __attribute__((vector_size(16)));

/* One vector of the float32 pass at x + j: its exponentials and flags written out, added into the
   running sum and moment given (the caller keeps them in registers: an array indexed by the vector's
   parity kept them in memory, each add waiting on the store before it). ``count`` < 16 for the row's
   last, partial vector (padded with -inf). */
static inline __attribute__((always_inline)) void exponentials32_vector(const float *x, int64_t j, int count,
                                                                       float best, float inverse, float floor,
                                                                       float *e, unsigned char *near, v16f *sum,
                                                                       v16f *moment) {
    v16f v;
    if (count == 16) {
        __builtin_memcpy(&v, x + j, sizeof v);
    } else {
        for (int l = 0; l < 16; l++) {
            v[l] = l < count ? x[j + l] : -__builtin_inff();
        }
    }
    v16f s = (v - best) * inverse;
    v = s;
    exp16(&v);
    v16c hit = __builtin_convertvector(v >= floor, v16c) & 1;
    if (count == 16) {
        __builtin_memcpy(e + j, &v, sizeof v);
        __builtin_memcpy(near + j, &hit, sizeof hit);
    } else {
        for (int l = 0; l < count; l++) {
            e[j + l] = v[l];
            near[j + l] = hit[l];
        }
    }
    *sum += v;
    *moment -= (v16f)((v16i)(v * s) & (v16i)(s > -87.0f)); /* -inf * 0 would be NaN */
}

KILN_VECTOR_CLONES
static double exponentials32(const float *x, int64_t n, float best, float inverse, float floor, float *e,
                             unsigned char *near, double *spread) {
    double total = 0.0, weighted = 0.0;
    const v16f zero = {0};
    for (int64_t i = 0; i < n; i += 256) {
        /* two running sums a lane: vectors 0, 2, 4, ... of the block into the first, 1, 3, 5, ... into
           the second */
        v16f sum0 = zero, sum1 = zero, moment0 = zero, moment1 = zero;
        const int64_t end = i + 256 < n ? i + 256 : n;
        int64_t j = i;
        for (; j + 32 <= end; j += 32) {
            exponentials32_vector(x, j, 16, best, inverse, floor, e, near, &sum0, &moment0);
            exponentials32_vector(x, j + 16, 16, best, inverse, floor, e, near, &sum1, &moment1);
        }
        if (j < end) { /* the row's end: one vector, whole or not, then maybe a partial second */
            int count = end - j < 16 ? (int)(end - j) : 16;
            exponentials32_vector(x, j, count, best, inverse, floor, e, near, &sum0, &moment0);
            j += 16;
            if (j < end) {
                exponentials32_vector(x, j, (int)(end - j), best, inverse, floor, e, near, &sum1, &moment1);
            }
        }
        v16f both = sum0 + sum1, spread16 = moment0 + moment1;
        double block = 0.0, weight = 0.0;
        for (int l = 0; l < 16; l++) {
            block += both[l];
            weight += spread16[l];
        }
        total += block;
        weighted += weight;
    }
    *spread = weighted * 1.01; /* a bound: its own float32 sums, with room */
    return total;
}

/* The positions flagged in ``near`` whose float32 exponential reaches ``floor`` (at least the
   flags' floor), into ids with those values into vals; their number. Eight flags are read at once. */
static int64_t candidates32(const float *e, const unsigned char *near, int64_t n, float floor, int64_t *ids,
                            double *vals) {
    int64_t k = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t flags;
        __builtin_memcpy(&flags, near + i, sizeof flags);
        if (flags == 0) {
            continue;
        }
        for (int64_t j = i; j < i + 8; j++) {
            ids[k] = j;
            vals[k] = e[j];
            k += e[j] >= floor;
        }
    }
    for (; i < n; i++) {
        ids[k] = i;
        vals[k] = e[i];
        k += near[i] && e[i] >= floor;
    }
    return k;
}

/* ---- the decisions --------------------------------------------------------------------------------- */

/* The sum of v[0..n), and of only the marked ones where ``marks`` is not NULL, in sixteen running
   sums (a flat row's nucleus holds most of the vocabulary: one running sum would wait on each add). */
KILN_VECTOR_CLONES
static double sum_of(const double *v, const unsigned char *marks, int64_t n) {
    v8d low = {0}, high = {0};
    int64_t i = 0;
    for (; i + 2 * LANES <= n; i += 2 * LANES) {
        v8d a, b;
        __builtin_memcpy(&a, v + i, sizeof a);
        __builtin_memcpy(&b, v + i + LANES, sizeof b);
        if (marks != NULL) {
            typedef unsigned char v8c __attribute__((vector_size(8)));
            v8c ma, mb;
            __builtin_memcpy(&ma, marks + i, sizeof ma);
            __builtin_memcpy(&mb, marks + i + LANES, sizeof mb);
            a = a * __builtin_convertvector(ma, v8d);
            b = b * __builtin_convertvector(mb, v8d);
        }
        low += a;
        high += b;
    }
    low += high;
    double sum = lanes_total(low);
    for (; i < n; i++) {
        sum += marks == NULL || marks[i] ? v[i] : 0.0;
    }
    return sum;
}

/* The index i in [0, n) whose cumulative sum of v (in order; the values under ``floor`` taken as
   zeros) is the first above ``target``, where every cumulative sum is more than ``gap`` from it;
   KILN_DECLINED where one is nearer, or none is above. Whole blocks of BLOCK values are stepped over
   by their sums (``sums``, of the values at or above the floor, or summed here where the floor is 0). */
static int64_t first_above(const double *v, int64_t n, const double *sums, double floor, double target, double gap) {
    double sum = 0.0;
    int64_t i = 0;
    for (int64_t b = 0; i + BLOCK <= n; b++) {
        double block = sums != NULL ? sums[b] : sum_of(v + i, NULL, BLOCK);
        if (!(sum + block < target - gap)) {
            break;
        }
        sum += block;
        i += BLOCK;
    }
    for (; i < n; i++) {
        if (v[i] < floor) {
            continue;
        }
        double next = sum + v[i];
        if (next > target) {
            return sum < target - gap && next > target + gap ? i : KILN_DECLINED;
        }
        sum = next;
    }
    return KILN_DECLINED;
}

/* Whether top-p's cut at ``last`` (the least value kept; ``with``: the kept values' sum) is the rule's
   on numpy's values: the sums without and with ``last`` more than the margin from the target, so the
   rule's sums cross it at the same value, and ``last`` more than the margin from the nearest values
   on either side (``above``, ``below``), so the rule orders the values around it alike. */
static int cut_holds(double with, double last, double target, double above, double below, double gap) {
    double without = with - last, slack = gap * (with > target ? with : target);
    return without < target - slack && with > target + slack && above > last * (1.0 + gap) &&
           below < last * (1.0 - gap);
}

/* Top-p's nucleus among the m candidates (vals: exponentials; the tokens below ``floor`` are not
   among them), compacted in place; its size, or KILN_DECLINED. kiln_top_p marks the smallest set of
   largest values whose sum reaches top_p * total (ties in token order). The rule's set is that one
   where (a) the sums without and with the last value taken are more than the margin from the
   target, so the rule's sums cross it at the same value, and (b) that value is more than the margin
   from every other value (and from the floor), so the rule orders the values around it alike; where
   the cut splits the tokens of equal value, they must hold equal logits (equal in the rule too). */
static int64_t nucleus(const float *x, int64_t *ids, double *vals, int64_t m, double target, double floor, double gap,
                       unsigned char *marks, uint64_t *radix) {
    int64_t keep = kiln_top_p(vals, m, target, marks, radix);
    if (keep > m) {
        return KILN_DECLINED; /* no sum reaches the target: the caller widens the candidates */
    }
    /* the least value kept; the values nearest it on either side; the tokens holding it (all kept,
       or the first of them in token order, holding equal logits or not). Without branches where
       the values come in no order: a flat row's nucleus is most of the vocabulary. */
    double last = __builtin_inf();
    for (int64_t i = 0; i < m; i++) {
        double v = marks[i] ? vals[i] : __builtin_inf();
        last = v < last ? v : last;
    }
    double nearest_above = __builtin_inf(), nearest_below = floor;
    int64_t kept_at = 0, at = 0, split_logits = 0;
    float logit = 0.0f;
    for (int64_t i = 0; i < m; i++) {
        double v = vals[i];
        double up = v > last ? v : __builtin_inf(), down = v < last ? v : floor;
        nearest_above = up < nearest_above ? up : nearest_above;
        nearest_below = down > nearest_below ? down : nearest_below;
        if (v == last) {
            if (at == 0) {
                logit = x[ids[i]];
            }
            split_logits |= x[ids[i]] != logit;
            at++;
            kept_at += marks[i];
        }
    }
    if (!cut_holds(sum_of(vals, marks, m), last, target, nearest_above, nearest_below, gap)) {
        return KILN_DECLINED;
    }
    if (kept_at < at && split_logits) {
        return KILN_DECLINED;
    }
    return kiln_compact(ids, vals, m, marks);
}

/* vals[j] = exp((x[ids[j]] - best) / temperature) in float64 for the m tokens ids: the kept tokens
   after a cut taken on float32 values, or top-k's tokens. */
static void exps_of(const float *x, const int64_t *ids, int64_t m, double best, double inverse, double *vals) {
    for (int64_t j = 0; j < m; j++) {
        vals[j] = ((double)x[ids[j]] - best) * inverse;
    }
    kiln_bounded_exp(vals, m, vals);
}

/* ---- top-k ---------------------------------------------------------------------------------------- */

static inline int any_lane(const v8i *mask) {
    typedef uint64_t v4u __attribute__((vector_size(32)));
    v4u wide = (v4u)*mask;
    return (wide[0] | wide[1] | wide[2] | wide[3]) != 0;
}

/* The k-th largest logit (a repeated value counted each time), with a heap of k (float32 values held
   exactly as doubles): a group of eight logits none above the heap's least, the usual case once the
   heap holds large values, costs one vector comparison. */
KILN_VECTOR_CLONES
static float kth_largest(const float *x, int64_t n, int64_t k, double *heap) {
    for (int64_t i = 0; i < k; i++) {
        heap[i] = x[i];
    }
    for (int64_t start = k / 2 - 1; start >= 0; start--) {
        kiln_sift_down(heap, k, start);
    }
    int64_t i = k;
    for (; i + LANES <= n; i += LANES) {
        v8f v;
        __builtin_memcpy(&v, x + i, sizeof v);
        v8f least = {0};
        least += (float)heap[0];
        v8i above = v > least;
        if (!any_lane(&above)) {
            continue;
        }
        for (int j = 0; j < LANES; j++) {
            if (x[i + j] > heap[0]) {
                heap[0] = x[i + j];
                kiln_sift_down(heap, k, 0);
            }
        }
    }
    for (; i < n; i++) {
        if (x[i] > heap[0]) {
            heap[0] = x[i];
            kiln_sift_down(heap, k, 0);
        }
    }
    return (float)heap[0];
}

/* Top-k's tokens with their exponentials into ids and vals (in order); their number, or
   KILN_DECLINED. The rule keeps the scaled scores s = (x - best) / temperature (float64) not below
   the k-th largest; s grows with x, so those are the logits not below the k-th largest logit, unless
   the division rounds a lower logit's s to the k-th's: the largest logit below is checked for that. */
KILN_VECTOR_CLONES
static int64_t top_k_tokens(const float *x, int64_t n, int64_t k, float best, double temperature, double inverse,
                            int64_t *ids, double *vals, double *heap) {
    float kth = kth_largest(x, n, k, heap);
    float below = -__builtin_inff(); /* the largest logit under the k-th */
    int64_t m = 0, i = 0;
    v8f kths = {0}, belows = {0};
    kths += kth;
    belows += below;
    for (; i + LANES <= n; i += LANES) {
        v8f v;
        __builtin_memcpy(&v, x + i, sizeof v);
        v8i in = v >= kths, higher = (v > belows) & ~in;
        belows = (v8f)(((v8i)v & higher) | ((v8i)belows & ~higher));
        if (any_lane(&in)) {
            for (int j = 0; j < LANES; j++) {
                ids[m] = i + j;
                m += x[i + j] >= kth;
            }
        }
    }
    for (int j = 0; j < LANES; j++) {
        below = belows[j] > below ? belows[j] : below;
    }
    for (; i < n; i++) {
        ids[m] = i;
        m += x[i] >= kth;
        below = x[i] < kth && x[i] > below ? x[i] : below;
    }
    if (below > -__builtin_inff() && ((double)below - best) / temperature == ((double)kth - best) / temperature) {
        return KILN_DECLINED;
    }
    exps_of(x, ids, m, best, inverse, vals);
    return m;
}

/* ---- the draw -------------------------------------------------------------------------------------- */

#define WIDEN (-2) /* top-p's nucleus may reach past the candidates: take in more of the row */

/* What draw_among needs to compute the kept tokens' exponentials again in float64, after a cut
   taken on float32 ones (NULL: the values are float64 already). */
struct refine {
    float best;
    double inverse;
};

/* The draw among the m candidates (ids, their exponentials vals; the others are below ``floor``),
   ``total`` the whole row's sum: top-p (its decisions within ``cut_gap``), min-p and the inverse
   transform (within ``gap``, on float64 exponentials). */
static int64_t draw_among(const float *x, int64_t *ids, double *vals, int64_t m, double total, double floor,
                          double top_p, double min_p, double u, double cut_gap, double gap, const struct refine *refine,
                          unsigned char *marks, uint64_t *radix) {
    if (top_p < 1.0) {
        double target = top_p * total;
        if (!(sum_of(vals, NULL, m) > target * (1.0 + cut_gap))) {
            return floor > 0.0 ? WIDEN : KILN_DECLINED; /* every token in, their sum within the margin of top_p */
        }
        m = nucleus(x, ids, vals, m, target, floor, cut_gap, marks, radix);
        if (m < 0) {
            return KILN_DECLINED;
        }
    }
    if (refine != NULL) {
        exps_of(x, ids, m, refine->best, refine->inverse, vals);
    }
    if (min_p > 0.0) { /* the best token's exponential is exp(0) = 1 */
        int64_t k = 0;
        for (int64_t i = 0; i < m; i++) {
            double v = vals[i];
            if (!(v > min_p * (1.0 + gap) || v < min_p * (1.0 - gap))) {
                return KILN_DECLINED;
            }
            ids[k] = ids[i];
            vals[k] = v;
            k += v > min_p;
        }
        m = k;
    }
    double kept = sum_of(vals, NULL, m);
    if (!(kept > 0.0)) {
        return KILN_DECLINED;
    }
    int64_t index = first_above(vals, m, NULL, 0.0, u * kept, gap * kept);
    return index < 0 ? KILN_DECLINED : ids[index];
}

/* Whether an eighth or more of 1,024 logits spread over the row are within 12 nats (after the
   temperature) of the best: a flat row (a model with random weights), whose nucleus is most of the
   vocabulary: ``flat_draw`` takes it over the row as it is, where compacted candidates would cost a
   pass of their own. */
static int dense(const float *x, int64_t n, float best, double temperature) {
    double reach = (double)best - 12.0 * temperature * (1.0 + 1e-6);
    int64_t step = n > 1024 ? n / 1024 : 1, sampled = 0, near = 0;
    for (int64_t i = 0; i < n; i += step, sampled++) {
        near += (double)x[i] >= reach;
    }
    return near * 8 >= sampled && n > 4096;
}

/* The sums of the values at or above ``floor`` in each block of BLOCK (into sums[]) and their total;
   the nearest values above and below ``floor`` into *above and *below (inf and 0 where none). */
KILN_VECTOR_CLONES
static double kept_blocks(const double *v, int64_t n, double floor, double *sums, double *above, double *below) {
    const v8d zero = {0}, floors = zero + floor, infinite = zero + __builtin_inf();
    v8d up = infinite, down = zero;
    double total = 0.0;
    int64_t i = 0, b = 0;
    for (; i + BLOCK <= n; i += BLOCK, b++) {
        v8d sum[2] = {{0}, {0}};
        for (int64_t j = i; j < i + BLOCK; j += LANES) {
            v8d x;
            __builtin_memcpy(&x, v + j, sizeof x);
            v8u in = (v8u)(x >= floors);
            sum[(j >> 3) & 1] += (v8d)((v8u)x & in);
            v8d higher = (v8d)(((v8u)x & (v8u)(x > floors)) | ((v8u)infinite & (v8u)(x <= floors)));
            v8d lower = (v8d)((v8u)x & (v8u)(x < floors));
            v8u nearer_up = (v8u)(higher < up), nearer_down = (v8u)(lower > down);
            up = (v8d)(((v8u)higher & nearer_up) | ((v8u)up & ~nearer_up));
            down = (v8d)(((v8u)lower & nearer_down) | ((v8u)down & ~nearer_down));
        }
        double block = lanes_total(sum[0] + sum[1]);
        sums[b] = block;
        total += block;
    }
    double nearest_above = __builtin_inf(), nearest_below = 0.0;
    for (int l = 0; l < LANES; l++) {
        nearest_above = up[l] < nearest_above ? up[l] : nearest_above;
        nearest_below = down[l] > nearest_below ? down[l] : nearest_below;
    }
    double block = 0.0;
    for (; i < n; i++) {
        block += v[i] >= floor ? v[i] : 0.0;
        nearest_above = v[i] > floor && v[i] < nearest_above ? v[i] : nearest_above;
        nearest_below = v[i] < floor && v[i] > nearest_below ? v[i] : nearest_below;
    }
    sums[b] = block;
    *above = nearest_above;
    *below = nearest_below;
    return total + block;
}

/* A flat row's draw (a top-p cut, and min-p's if asked) over the row as it is: its float64 exponentials
   with their block sums (one pass), top-p's cut of them by sampling.c's selection (the rule's cut of
   these values), the kept tokens' block sums, and the inverse transform over them by those sums. The
   cut is the rule's on numpy's values under nucleus()'s conditions: the sums without and with the
   least kept value more than the margin from the target, that value more than the margin from its
   neighbours, and the tokens equal to it all kept (else declined); min-p's floor under draw_among's. */
static int64_t flat_draw(const float *x, int64_t n, float best, double inverse, double top_p, double min_p, double u,
                         double gap, double *e, double *blocks, uint64_t *radix) {
    double total = exponentials(x, n, (double)best, inverse, e, blocks);
    double target = top_p * total, last;
    int64_t equal, ties;
    int64_t keep = kiln_top_p_cut(e, n, target, &last, &equal, &ties, radix);
    if (keep > n || equal != ties) {
        return KILN_DECLINED; /* no sum reaches top_p (it is within rounding of 1), or the cut splits ties */
    }
    double above, below;
    double with = kept_blocks(e, n, last, blocks, &above, &below);
    if (!cut_holds(with, last, target, above, below, gap)) {
        return KILN_DECLINED;
    }
    double floor = last;
    if (min_p > 0.0 && min_p * (1.0 + gap) > last) {
        /* min-p cuts inside the nucleus: the tokens at least min_p of the best's exponential (exp(0) = 1),
           none of the nucleus within the margin of that floor (draw_among's rule) */
        floor = min_p * (1.0 + gap);
        with = kept_blocks(e, n, floor, blocks, &above, &below);
        if (!(below < min_p * (1.0 - gap) || below < last)) {
            return KILN_DECLINED;
        }
    }
    return first_above(e, n, blocks, floor, u * with, gap * with);
}

/* The token selection.reference_draw gives for the row x [n] (float32 logits, bias and penalties
   applied) at this temperature, top_k (0: off), top_p and min_p and uniform u, or KILN_DECLINED:
   where a decision is within the margin, where a logit is not finite, and where the settings leave
   nothing to draw. Work buffers: e [n], blocks [n / BLOCK + 1], ids and vals [n], marks [n], radix [2n]. */
KILN_EXPORT int64_t kiln_bounded_draw(const float *x, int64_t n, double temperature, int64_t top_k, double top_p,
                                      double min_p, double u, double *e, double *blocks, int64_t *ids, double *vals,
                                      unsigned char *marks, uint64_t *radix) {
    float best;
    double inverse = 1.0 / temperature;
    if (n <= 0 || row_best(x, n, &best) || !(inverse > 0.0 && inverse < __builtin_inf()) || !(u >= 0.0 && u < 1.0)) {
        return KILN_DECLINED;
    }
    double gap = margin(n);
    if (top_k > 0 && top_k < n) { /* the other tokens' probabilities are exact zeros */
        int64_t m = top_k_tokens(x, n, top_k, best, temperature, inverse, ids, vals, (double *)radix);
        if (m < 0) {
            return KILN_DECLINED;
        }
        int64_t token = draw_among(x, ids, vals, m, sum_of(vals, NULL, m), 0.0, top_p, min_p, u, gap, gap, NULL,
                                   marks, radix);
        return token < 0 ? KILN_DECLINED : token;
    }
    if (top_p >= 1.0 && min_p <= 0.0) { /* the inverse transform over the whole row, in float64 */
        double total = exponentials(x, n, (double)best, inverse, e, blocks);
        return first_above(e, n, blocks, 0.0, u * total, gap * total);
    }
    if (!((float)inverse < __builtin_inff())) {
        return KILN_DECLINED; /* a temperature under float32's range (1 / T would be inf) */
    }
    if (top_p < 1.0 && dense(x, n, best, temperature)) {
        return flat_draw(x, n, best, inverse, top_p, min_p, u, gap, e, blocks, radix);
    }
    /* the candidates: every token a cut can keep (exponential at least e^-12 of the best's, or min-p's
       floor if lower), then more where top-p's nucleus reaches past them, as the exact path widens;
       the floors sit 1e-4 under the shares, far more than a float32 exponential's error (< 2e-5) */
    static const double shares[] = {6.14421235332821e-06 /* e^-12 */, 4.248354255291589e-18 /* e^-40 */, 0.0};
    double floors[3];
    for (int s = 0; s < 3; s++) {
        double share = top_p < 1.0 ? shares[s] : 1.0;
        floors[s] = (min_p > 0.0 && min_p < share ? min_p : share) * (1.0 - 1e-4);
    }
    double spread;
    float *e32 = (float *)e;
    unsigned char *near = (unsigned char *)(e32 + n);
    double total = exponentials32(x, n, best, (float)inverse, (float)floors[0], e32, near, &spread);
    double total_error = EXP32_ERROR + SUM32_ERROR + SCALE32_ERROR * spread / total; /* relative */
    struct refine refine = {best, inverse};
    for (int s = 0; s < 3; s++) {
        if (s > 0) {
            memset(near, 1, (size_t)n); /* a wider floor: every token is read again */
        }
        int64_t m = candidates32(e32, near, n, (float)floors[s], ids, vals);
        double reach = 0.0; /* the largest |s| among them: their exponentials' error grows with it */
        for (int64_t i = 0; i < m; i++) {
            double far = ((double)best - x[ids[i]]) * inverse;
            reach = far > reach ? far : reach;
        }
        double cut_gap = 2.0 * (EXP32_ERROR + SCALE32_ERROR * reach) + total_error + gap;
        int64_t token = draw_among(x, ids, vals, m, total, floors[s], top_p, min_p, u, cut_gap, gap, &refine, marks,
                                   radix);
        if (token != WIDEN || top_p >= 1.0) {
            return token < 0 ? KILN_DECLINED : token;
        }
    }
    return KILN_DECLINED;
}

/* ---- a step's rows in one call --------------------------------------------------------------------- */

/* The first position of the row's largest logit (numpy's argmax), or KILN_DECLINED where a logit is
   not finite (numpy's argmax has its own answer for NaN). */
static int64_t first_best(const float *x, int64_t n) {
    float best;
    if (row_best(x, n, &best)) {
        return KILN_DECLINED;
    }
    for (int64_t i = 0; i < n; i++) {
        if (x[i] == best) {
            return i;
        }
    }
    return KILN_DECLINED;
}

/* Each row's token (rows: the rows' addresses, each n float32 logits): its argmax at temperature 0,
   else kiln_bounded_draw's, or KILN_DECLINED; one call a step instead of one a row (a call from
   Python costs about as much as the draw of a short row). The work buffers are kiln_bounded_draw's. */
KILN_EXPORT void kiln_bounded_draws(const uint64_t *rows, int64_t count, int64_t n, const double *temperatures,
                                    const int64_t *top_ks, const double *top_ps, const double *min_ps,
                                    const double *us, int64_t *tokens, double *e, double *blocks, int64_t *ids,
                                    double *vals, unsigned char *marks, uint64_t *radix) {
    for (int64_t r = 0; r < count; r++) {
        const float *x = (const float *)(uintptr_t)rows[r];
        tokens[r] = temperatures[r] == 0.0
                        ? first_best(x, n)
                        : kiln_bounded_draw(x, n, temperatures[r], top_ks[r], top_ps[r], min_ps[r], us[r], e, blocks,
                                            ids, vals, marks, radix);
    }
}
