/* The sampler's exact arithmetic, in plain C (no vector extensions: every CPU gives the same bits).

   The host sampler (generation/sampling/) chooses a token as numpy would over the whole vocabulary,
   but works on the few tokens that can be chosen. Three pieces need numpy's exact order of
   operations over positions the sampler no longer visits one by one, and are written here:

   - kiln_uniforms: numpy's Philox4x64-10 ``Generator(Philox(counter=position, key=seed)).random()``
     for many (seed, position) pairs at once, without building a Generator for each (~14 us each);
   - kiln_sparse_sum: ``a.sum()`` of a float64 vector that is zero but at a few positions, in numpy's
     order: chunks of the ufunc buffer (8192 items) added to 0.0 in turn, each chunk summed pairwise
     (numpy's pairwise_sum: blocks of at most 128 items over 8 accumulators). Zeros add nothing
     exactly (x + 0.0 == x), so only the blocks that hold a value are visited;
   - kiln_cumulative_pick: the token ``searchsorted(cumsum(p), u * cumsum(p)[-1], side="right")``
     picks, with numpy's sequential cumulative sum, without writing the cumulative sums out.

   - kiln_top_k: top-k's threshold and the tokens at or above it, in one pass with a heap of k;
   - kiln_top_p: top-p's cut, numpy's ``argsort(-p, kind="stable")`` then the first cumulative sum of
     the sorted probabilities that reaches top_p, by a radix sort of the probabilities' bits alone
     (the sums need the values in order, not which token holds each; ties are then taken in token
     order): a flat row's nucleus holds most of the vocabulary, which numpy's merge sort takes ~10 ms
     to order at 128k tokens;
   - kiln_scale: the row's ``(float64(logits) - best) / temperature`` in one pass instead of numpy's
     three (a conversion, a subtraction, a division), vectorised for the CPU at hand: each item is
     rounded twice, as numpy rounds it, whatever the vector width.

   Built with -ffp-contract=off and no fast-math: every + and * rounds as numpy's does. */

#include "sampling.h"

/* Inlined into each caller, so that the callers' vector clones (KILN_VECTOR_CLONES) vectorise it too. */
#define KILN_INLINE static inline __attribute__((always_inline))

/* ---- the scaled row ---------------------------------------------------------------------------- */

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KILN_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KILN_VECTOR_CLONES
#endif

KILN_VECTOR_CLONES
KILN_EXPORT void kiln_scale(const float *logits, int64_t n, double best, double temperature, double *out) {
    for (int64_t i = 0; i < n; i++) {
        out[i] = ((double)logits[i] - best) / temperature;
    }
}

/* ---- Philox4x64-10 as numpy's bit generator (numpy/random/src/philox/philox.h) ---------------- */

static inline uint64_t mulhilo64(uint64_t a, uint64_t b, uint64_t *hi) {
    __uint128_t product = (__uint128_t)a * (__uint128_t)b;
    *hi = (uint64_t)(product >> 64);
    return (uint64_t)product;
}

/* numpy's first draw after seeding: the counter is incremented once, then ten rounds give four
   words of which random() takes the first: (word >> 11) * 2^-53. */
static double philox_first_double(uint64_t seed, uint64_t position) {
    uint64_t c0 = position, c1 = 0, c2 = 0, c3 = 0;
    uint64_t k0 = seed, k1 = 0;
    c0 += 1; /* a counter of 2^64 - 1 carries into the next word */
    if (c0 == 0) {
        c1 += 1;
    }
    for (int round = 0; round < 10; round++) {
        if (round > 0) {
            k0 += 0x9E3779B97F4A7C15ULL;
            k1 += 0xBB67AE8584CAA73BULL;
        }
        uint64_t hi0, hi1;
        uint64_t lo0 = mulhilo64(0xD2E7470EE14C6C93ULL, c0, &hi0);
        uint64_t lo1 = mulhilo64(0xCA5A826395121157ULL, c2, &hi1);
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
    return (double)(c0 >> 11) * (1.0 / 9007199254740992.0);
}

KILN_EXPORT void kiln_uniforms(const uint64_t *seeds, const uint64_t *positions, int64_t n, double *out) {
    for (int64_t i = 0; i < n; i++) {
        out[i] = philox_first_double(seeds[i], positions[i]);
    }
}

/* ---- numpy's float64 sum of a sparse vector ---------------------------------------------------- */

#define PW_BLOCKSIZE 128
#define UFUNC_BUFSIZE 8192

/* numpy's pairwise_sum over positions [lo, lo + n) of a vector whose values are ``values`` at the
   sorted positions ``ids[first..last)`` and zero elsewhere. */
static double pairwise(const int64_t *ids, const double *values, int64_t first, int64_t last,
                       int64_t lo, int64_t n) {
    if (first == last) {
        return 0.0; /* every item zero: numpy's sum of them is 0.0 */
    }
    if (n < 8) {
        double res = 0.0;
        for (int64_t k = first; k < last; k++) {
            res += values[k]; /* the zeros between leave res as it is */
        }
        return res;
    }
    if (n <= PW_BLOCKSIZE) {
        /* r[j] accumulates items lo + j, lo + 8 + j, ... up to the last whole group of 8; the rest
           is added to the combined sum one by one. */
        double r[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
        int64_t whole = n - (n % 8);
        int64_t k = first;
        for (; k < last && ids[k] - lo < whole; k++) {
            int64_t j = (ids[k] - lo) & 7; /* ids[k] >= lo */
            r[j] += values[k];
        }
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; k < last; k++) {
            res += values[k];
        }
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    int64_t split = first, above = last; /* the first id at or past lo + n2 (ids are sorted) */
    while (split < above) {
        int64_t mid = split + (above - split) / 2;
        if (ids[mid] < lo + n2) {
            split = mid + 1;
        } else {
            above = mid;
        }
    }
    return pairwise(ids, values, first, split, lo, n2) + pairwise(ids, values, split, last, lo + n2, n - n2);
}

/* The r[0] = a[0] start of numpy's 8-accumulator block is the same as 0.0 + a[0]. */
KILN_EXPORT double kiln_sparse_sum(const int64_t *ids, const double *values, int64_t count, int64_t length) {
    double total = 0.0;
    int64_t k = 0;
    for (int64_t start = 0; start < length; start += UFUNC_BUFSIZE) {
        int64_t size = length - start < UFUNC_BUFSIZE ? length - start : UFUNC_BUFSIZE;
        int64_t end = k;
        while (end < count && ids[end] < start + size) {
            end++;
        }
        if (end > k) {
            total += pairwise(ids, values, k, end, start, size);
        }
        k = end;
    }
    return total;
}

/* ---- top-k's cut --------------------------------------------------------------------------------- */

/* A min-heap of k values with ``at`` out of place below: moved down until its children are not less
   (the bounded draw's top-k too: not static, not exported). */
void kiln_sift_down(double *heap, int64_t k, int64_t at) {
    for (;;) {
        int64_t left = 2 * at + 1, least = at;
        if (left < k && heap[left] < heap[least]) least = left;
        if (left + 1 < k && heap[left + 1] < heap[least]) least = left + 1;
        if (least == at) return;
        double t = heap[at];
        heap[at] = heap[least];
        heap[least] = t;
        at = least;
    }
}

/* The positions of the scores not below the k-th largest (numpy's ``np.partition(s, -k)[-k]``, a
   repeated value counted each time), into ``ids`` in order; returns their number. One pass keeps the
   k largest in a min-heap (a score below its top, the usual case, costs one comparison), a second
   collects; ``heap`` holds k doubles. */
KILN_EXPORT int64_t kiln_top_k(const double *s, int64_t n, int64_t k, double *heap, int64_t *ids) {
    if (k <= 0 || k > n) {
        return 0;
    }
    for (int64_t i = 0; i < k; i++) { /* heapify the first k */
        heap[i] = s[i];
    }
    for (int64_t start = k / 2 - 1; start >= 0; start--) {
        kiln_sift_down(heap, k, start);
    }
    for (int64_t i = k; i < n; i++) {
        if (s[i] > heap[0]) { /* replace the least of the k largest */
            heap[0] = s[i];
            kiln_sift_down(heap, k, 0);
        }
    }
    double kth = heap[0];
    int64_t count = 0;
    for (int64_t i = 0; i < n; i++) {
        if (s[i] >= kth) {
            ids[count++] = i;
        }
    }
    return count;
}

/* ---- the likely tokens -------------------------------------------------------------------------- */

/* The positions i whose probability e[i] / total (rounded as numpy's division of the row) is at
   least a floor a little under ``share`` of the best's, into ``ids`` with those probabilities into
   ``probs``; returns their number. selection._likely's numpy form computes the same floor and the
   same bound a little under floor * total that e[i] must reach. A flat row gives every token (n). */
KILN_INLINE int64_t kiln_likely(const double *e, int64_t n, double total, double share, int64_t *ids, double *probs) {
    double floor = share / total * (1 - 1e-9); /* the best token's exponential is exp(0) = 1 */
    double near = floor * total * (1 - 1e-9);
    /* how many reach the bound, from 1024 tokens spread over the row: it picks the loop below, not
       which tokens are in */
    int64_t step = n > 1024 ? n / 1024 : 1, sampled = 0, reaching = 0;
    for (int64_t i = 0; i < n; i += step, sampled++) {
        reaching += e[i] >= near;
    }
    int64_t k = 0;
    if (reaching < sampled / 8) { /* a peaked row: the division only where the bound is reached, a branch rarely taken */
        for (int64_t i = 0; i < n; i++) {
            if (e[i] >= near) {
                double p = e[i] / total;
                ids[k] = i;
                probs[k] = p;
                k += p >= floor;
            }
        }
        return k;
    }
    /* a flat row: every token. A set holding every token the cuts can keep gives the same cuts, sums
       and draw, and the whole row skips a compaction (a third of a flat row's time at 152k tokens) and
       takes kiln_pick's pass over the row as it is. */
    for (int64_t i = 0; i < n; i++) {
        probs[i] = e[i] / total;
        ids[i] = i;
    }
    return n;
}

/* ---- top-p's cut ---------------------------------------------------------------------------------- */

#define SHORT_RUN 32   /* runs of keys this short or shorter are put in order by insertion */
#define RADIX_PASSES 3 /* of 8 bits each */

/* ``keys`` [n] in ascending order, using ``spare`` [n] (the result is written back into ``keys``).
   The keys of a cut are only compared, never told apart, so the sort need not be stable. Two radix
   passes (8 bits each) order the keys by their 16 leading bits below the bits every key shares
   (a row's probabilities span a few powers of two: the exponent and the mantissa's first bits), then
   each run of keys equal in those bits is ordered the same way, or by insertion where short: about
   two passes over the keys for any row, none of them n^2. */
static void sort_keys(uint64_t *keys, uint64_t *spare, int64_t n) {
    if (n <= SHORT_RUN) {
        for (int64_t i = 1; i < n; i++) {
            uint64_t k = keys[i];
            int64_t j = i;
            while (j > 0 && keys[j - 1] > k) {
                keys[j] = keys[j - 1];
                j--;
            }
            keys[j] = k;
        }
        return;
    }
    uint64_t least = keys[0], most = keys[0];
    for (int64_t i = 1; i < n; i++) {
        least = keys[i] < least ? keys[i] : least;
        most = keys[i] > most ? keys[i] : most;
    }
    if (least == most) {
        return;
    }
    int span = 64 - __builtin_clzll(most - least); /* bits of the largest difference */
    int shift = span > 8 * RADIX_PASSES ? span - 8 * RADIX_PASSES : 0;
    uint32_t counts[RADIX_PASSES][256] = {{0}};
    for (int64_t i = 0; i < n; i++) {
        uint64_t d = (keys[i] - least) >> shift;
        for (int pass = 0; pass < RADIX_PASSES; pass++) {
            counts[pass][(d >> (8 * pass)) & 0xff]++;
        }
    }
    uint64_t *from = keys, *to = spare;
    for (int pass = 0; pass < RADIX_PASSES; pass++) {
        int digit = shift + 8 * pass;
        uint32_t *count = counts[pass];
        if (count[((keys[0] - least) >> digit) & 0xff] == (uint32_t)n) {
            continue; /* every key has this digit: the pass would move nothing */
        }
        uint32_t start = 0;
        for (int b = 0; b < 256; b++) {
            uint32_t c = count[b];
            count[b] = start;
            start += c;
        }
        for (int64_t i = 0; i < n; i++) { /* in order: a stable pass, which the next pass needs */
            uint64_t k = from[i];
            to[count[((k - least) >> digit) & 0xff]++] = k;
        }
        uint64_t *t = from;
        from = to;
        to = t;
    }
    if (from != keys) {
        for (int64_t i = 0; i < n; i++) {
            keys[i] = from[i];
        }
    }
    if (shift == 0) {
        return; /* the 16 bits were all the bits that differ */
    }
    for (int64_t run = 0; run < n;) {
        uint64_t lead = (keys[run] - least) >> shift;
        int64_t end = run + 1;
        while (end < n && (keys[end] - least) >> shift == lead) {
            end++;
        }
        if (end - run > 1) {
            sort_keys(keys + run, spare + run, end - run);
        }
        run = end;
    }
}

static double key_value(uint64_t key) {
    union { uint64_t u; double d; } v = {~key};
    return v.d;
}

/* Where top-p cuts: the tokens above ``threshold`` are in, and the first ``equal`` (in token order) of
   the ``ties`` at it. */
struct cut {
    double threshold;
    int64_t equal, ties;
};

/* Marks of the tokens a cut keeps; where every tie is in (the usual case), a pass without a count
   carried from token to token. */
static void mark_nucleus(const double *p, int64_t n, struct cut cut, unsigned char *marks) {
    if (cut.equal == cut.ties) {
        for (int64_t i = 0; i < n; i++) {
            marks[i] = p[i] >= cut.threshold;
        }
        return;
    }
    int64_t equal = cut.equal;
    for (int64_t i = 0; i < n; i++) {
        int tie = p[i] == cut.threshold && equal > 0;
        equal -= tie;
        marks[i] = (unsigned char)((p[i] > cut.threshold) | tie);
    }
}

/* The tokens in (ids, probs) a cut keeps, compacted in order, in one pass (each move reads before it
   writes: k <= i); their number. */
static int64_t compact_cut(int64_t *ids, double *probs, int64_t m, struct cut cut) {
    int64_t k = 0;
    if (cut.equal == cut.ties) {
        for (int64_t i = 0; i < m; i++) {
            double p = probs[i];
            ids[k] = ids[i];
            probs[k] = p;
            k += p >= cut.threshold;
        }
        return k;
    }
    int64_t equal = cut.equal;
    for (int64_t i = 0; i < m; i++) {
        double p = probs[i];
        int tie = p == cut.threshold && equal > 0;
        equal -= tie;
        ids[k] = ids[i];
        probs[k] = p;
        k += (p > cut.threshold) | tie;
    }
    return k;
}

#define SELECT_MIN 2048 /* rows at least this long try the cut by selection first */
#define SELECT_BITS 11  /* the selection's histogram: 2^11 ranges of keys */

/* Top-p's cut as kiln_top_p's rule makes it, without sorting the row where that can be proven: a
   histogram of the keys' leading bits (below those every key shares) with each range's count and
   mass, the ranges summed from the largest values down to the one where the sum reaches top_p, and
   that range alone sorted. The sums are not the rule's (it adds the values one by one in sorted
   order; here each range's mass is summed in token order, then the ranges), but both are sums of the
   same nonnegative values, so each is within (terms) * 2^-53 * sum of the exact one, and so within
   E (below) of each other. Where the sum before the crossing value is more than E under top_p and
   the sum with it more than E over, the rule's sums cross at the same value, and the cut is the
   rule's (written to ``cut``); otherwise (top_p within ~1e-10 of a sum: rare) returns -1 and the caller
   sorts. A flat row (a nucleus of most of a 128k vocabulary) costs four passes instead of a sort. */
KILN_INLINE int64_t top_p_by_selection(const double *p, int64_t n, double top_p, struct cut *cut, uint64_t *scratch) {
    union bits { double d; uint64_t u; };
    /* the largest value's bits, and the smallest nonzero value's (a zero adds nothing to a sum): a
       zero's bits less one wrap to the largest number, so one unsigned minimum skips zeros (a form
       the compiler vectorises, where a test per value kept the pass scalar) */
    uint64_t top = 0, low_less_one = UINT64_MAX;
    for (int64_t i = 0; i < n; i++) {
        union bits v = {p[i]};
        top = v.u > top ? v.u : top;
        low_less_one = v.u - 1 < low_less_one ? v.u - 1 : low_less_one;
    }
    uint64_t least = ~top, most = ~(low_less_one + 1); /* ascending keys (~bits): descending values */
    if (low_less_one == UINT64_MAX || least >= most) {
        return -1;
    }
    int span = 64 - __builtin_clzll(most - least);
    int shift = span > SELECT_BITS ? span - SELECT_BITS : 0;
    int64_t ranges = (int64_t)((most - least) >> shift) + 1;
    uint32_t counts[1 << SELECT_BITS] = {0};
    double mass[1 << SELECT_BITS] = {0};
    for (int64_t i = 0; i < n; i++) {
        union bits v = {p[i]};
        if (v.u == 0) {
            continue;
        }
        uint64_t r = (~v.u - least) >> shift;
        counts[r]++;
        mass[r] += p[i];
    }
    double above = 0.0; /* the mass of the ranges before the crossing one */
    int64_t before = 0;  /* and their count */
    int64_t crossing = -1;
    for (int64_t r = 0; r < ranges; r++) {
        if (above + mass[r] >= top_p) {
            crossing = r;
            break;
        }
        above += mass[r];
        before += counts[r];
    }
    double bound = (3.0 * (double)n + 4096.0) * 2.220446049250313e-16; /* E / sum, with a margin of 2 */
    if (crossing < 0) { /* no sum reaches top_p, unless it is within E of the total */
        return above < top_p - bound * 2.0 * (above > top_p ? above : top_p) ? n + 1 : -1;
    }
    uint64_t *keys = scratch; /* the crossing range's keys, sorted */
    int64_t m = 0, i = 0;
    for (; i + 8 <= n; i += 8) { /* eight values tested at once (vectorised): most groups hold none */
        int any = 0;
        for (int j = 0; j < 8; j++) {
            union bits v = {p[i + j]};
            any |= (((~v.u - least) >> shift) == (uint64_t)crossing) & (v.u != 0);
        }
        if (!any) {
            continue;
        }
        for (int j = 0; j < 8; j++) {
            union bits v = {p[i + j]};
            keys[m] = ~v.u;
            m += ((~v.u - least) >> shift) == (uint64_t)crossing && v.u != 0;
        }
    }
    for (; i < n; i++) {
        union bits v = {p[i]};
        keys[m] = ~v.u;
        m += ((~v.u - least) >> shift) == (uint64_t)crossing && v.u != 0;
    }
    sort_keys(keys, scratch + n, m);
    double sum = above, previous = above;
    int64_t last = -1;
    for (int64_t j = 0; j < m; j++) {
        previous = sum;
        sum += key_value(keys[j]);
        if (sum >= top_p) {
            last = j;
            break;
        }
    }
    double margin = bound * 2.0 * (sum > top_p ? sum : top_p);
    if (last < 0 || !(previous < top_p - margin) || !(sum >= top_p + margin)) {
        return -1;
    }
    int64_t first = last, end = last + 1; /* the crossing value's places among the sorted keys */
    while (first > 0 && keys[first - 1] == keys[last]) {
        first--;
    }
    while (end < m && keys[end] == keys[last]) {
        end++;
    }
    *cut = (struct cut){key_value(keys[last]), last + 1 - first, end - first};
    return before + last + 1;
}

/* Top-p's cut of the probabilities p [n] (>= 0, so their bits order as their values do): the rule
   sorts them, largest first and ties by position (numpy's stable argsort of -p), and keeps up to the
   first cumulative sum (sequential, in that order) not below top_p. Returns how many it keeps, with
   where it cuts in ``cut``; n + 1 where no sum reaches top_p (``cut`` then unset). Only the sorted
   values are needed for the sums, not which token holds each: the kept tokens are then those above
   the last kept value, and the first of those equal to it in position order. ``scratch`` holds 2n
   64-bit words. */
KILN_INLINE int64_t top_p_cut(const double *p, int64_t n, double top_p, struct cut *cut, uint64_t *scratch) {
    if (n == 0) {
        return 1;
    }
    if (n >= SELECT_MIN) {
        int64_t keep = top_p_by_selection(p, n, top_p, cut, scratch);
        if (keep >= 0) {
            return keep;
        }
    }
    uint64_t *keys = scratch;
    for (int64_t i = 0; i < n; i++) {
        union { double d; uint64_t u; } v = {p[i]};
        keys[i] = ~v.u; /* ascending keys: descending values */
    }
    sort_keys(keys, scratch + n, n);
    double sum = 0.0;
    int64_t last = -1;
    for (int64_t i = 0; i < n; i++) {
        sum += key_value(keys[i]);
        if (sum >= top_p) {
            last = i;
            break;
        }
    }
    if (last < 0) {
        return n + 1;
    }
    int64_t above = last, end = last + 1; /* the last kept value's places among the sorted keys */
    while (above > 0 && keys[above - 1] == keys[last]) {
        above--;
    }
    while (end < n && keys[end] == keys[last]) {
        end++;
    }
    *cut = (struct cut){key_value(keys[last]), last + 1 - above, end - above};
    return last + 1;
}

/* top_p_cut's count, with ``marks[i]`` = 1 for each kept token and 0 for the others (marks untouched
   where no sum reaches top_p): the cut alone, as the tests call it. */
KILN_VECTOR_CLONES
KILN_EXPORT int64_t kiln_top_p(const double *p, int64_t n, double top_p, unsigned char *marks, uint64_t *scratch) {
    struct cut cut = {0.0, 0, 0};
    int64_t keep = top_p_cut(p, n, top_p, &cut, scratch);
    if (keep <= n) {
        mark_nucleus(p, n, cut, marks);
    }
    return keep;
}

/* top_p_cut for the bounded draw's flat rows: how many top-p keeps of p [n] (n + 1 where no sum
   reaches top_p), the least value kept, and how many of the values equal to it are kept, of how many. */
KILN_VECTOR_CLONES
int64_t kiln_top_p_cut(const double *p, int64_t n, double top_p, double *threshold, int64_t *equal, int64_t *ties,
                       uint64_t *scratch) {
    struct cut cut = {0.0, 0, 0};
    int64_t keep = top_p_cut(p, n, top_p, &cut, scratch);
    *threshold = cut.threshold;
    *equal = cut.equal;
    *ties = cut.ties;
    return keep;
}

/* ---- after the probabilities: the cuts and the draw, in one call --------------------------------- */

KILN_EXPORT int64_t kiln_cumulative_pick(const double *p, int64_t count, double u, double *total);

/* The tokens in (ids, probs) compacted to those marked, in order (the bounded draw's nucleus too:
   not static, not exported). */
int64_t kiln_compact(int64_t *ids, double *probs, int64_t m, const unsigned char *marked) {
    int64_t k = 0;
    for (int64_t i = 0; i < m; i++) { /* k <= i: each move reads before it writes */
        ids[k] = ids[i];
        probs[k] = probs[i];
        k += marked[i];
    }
    return k;
}

/* numpy's pairwise_sum of a[0..n) (contiguous, >= 0) with the items under ``floor`` taken as zeros:
   the same additions as ``pairwise`` with every position present. The 8 accumulators are 8 lanes:
   vectorised, each lane rounds as numpy's r[j]. */
#define FLOORED(x) ((x) >= floor ? (x) : 0.0)
static double dense_pairwise(const double *a, int64_t n, double floor) {
    if (n < 8) {
        double res = 0.0;
        for (int64_t i = 0; i < n; i++) {
            res += FLOORED(a[i]);
        }
        return res;
    }
    if (n <= PW_BLOCKSIZE) {
        double r[8];
        for (int j = 0; j < 8; j++) {
            r[j] = FLOORED(a[j]);
        }
        int64_t i = 8;
        for (; i < n - (n % 8); i += 8) {
            for (int j = 0; j < 8; j++) {
                r[j] += FLOORED(a[i + j]);
            }
        }
        double res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) {
            res += FLOORED(a[i]);
        }
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return dense_pairwise(a, n2, floor) + dense_pairwise(a + n2, n - n2, floor);
}

/* numpy's sum of the whole row a[0..length) with the items under ``floor`` as zeros, in its buffer's chunks. */
static double floored_sum(const double *a, int64_t length, double floor) {
    double total = 0.0;
    for (int64_t start = 0; start < length; start += UFUNC_BUFSIZE) {
        int64_t size = length - start < UFUNC_BUFSIZE ? length - start : UFUNC_BUFSIZE;
        total += dense_pairwise(a + start, size, floor);
    }
    return total;
}

/* The kept tokens' probabilities divided by their sum as numpy takes it over the whole row (zeros
   elsewhere). */
static void renormalise(const int64_t *ids, double *probs, int64_t m, int64_t vocab) {
    double sum = kiln_sparse_sum(ids, probs, m, vocab);
    for (int64_t i = 0; i < m; i++) {
        probs[i] = probs[i] / sum;
    }
}

/* What selection.draw does after the exponentials, with the same operations in the same order:
   ``support`` (top-k's tokens, sorted; NULL: every token) with ``values`` their exponentials, or
   ``values`` the whole row's; ``total`` the exponentials' sum as numpy took it. Top-p orders the
   tokens at least ``shares[0]`` of the best's probability, then ``shares[1]``, then all, until its
   nucleus is inside; min-p; each cut renormalised; the inverse transform of ``u``. The work
   buffers hold n items (``radix`` 2n, ``marks`` n bytes). Returns the token, or -1 where the
   settings give no probabilities. */
KILN_VECTOR_CLONES
KILN_EXPORT int64_t kiln_pick(const int64_t *support, const double *values, int64_t n, int64_t vocab, double total,
                              double top_p, double min_p, const double *shares, double u, int64_t *ids, double *probs,
                              uint64_t *radix, unsigned char *marks) {
    int cut = top_p < 1.0 || min_p > 0.0;
    int64_t m;
    int complete; /* every token with a probability is in */
    int next_share = 1;
    if (support != NULL) {
        for (int64_t i = 0; i < n; i++) {
            ids[i] = support[i];
            probs[i] = values[i] / total;
        }
        m = n;
        complete = 1;
    } else if (cut) {
        double share = top_p < 1.0 ? shares[0] : 1.0;
        if (min_p > 0.0 && min_p < share) {
            share = min_p;
        }
        m = kiln_likely(values, n, total, share, ids, probs);
        complete = m == n;
    } else { /* no cut: the inverse transform over the whole row's probabilities */
        for (int64_t i = 0; i < n; i++) {
            probs[i] = values[i] / total;
        }
        double sum;
        int64_t index = kiln_cumulative_pick(probs, n, u, &sum);
        if (!(sum > 0)) {
            return -1;
        }
        return index >= n ? vocab - 1 : index;
    }
    if (top_p < 1.0) {
        for (;;) {
            struct cut cut = {0.0, 0, 0};
            int64_t keep = top_p_cut(probs, m, top_p, &cut, radix);
            if (keep <= m && m == vocab && min_p <= 0.0 && cut.equal == cut.ties) {
                /* every token was in (ids[i] == i), and the cut keeps those at or above its value: the
                   renormalising sum and the draw over the row as it is, the others as zeros (adding a
                   zero leaves a sum as it is: the sums are those over the kept tokens alone) */
                double sum, divisor = floored_sum(probs, m, cut.threshold), floor = cut.threshold;
                for (int64_t i = 0; i < m; i++) {
                    probs[i] = FLOORED(probs[i]) / divisor;
                }
                int64_t index = kiln_cumulative_pick(probs, m, u, &sum);
                if (!(sum > 0)) {
                    return -1;
                }
                return index >= m ? vocab - 1 : index;
            }
            if (keep <= m || complete) {
                if (keep <= m) { /* else no sum reaches top_p: every token is in */
                    m = compact_cut(ids, probs, m, cut);
                }
                break;
            }
            /* the nucleus reaches past the tokens in: take in more of the row */
            double share = next_share < 2 ? shares[next_share] : 0.0;
            next_share++;
            m = kiln_likely(values, n, total, share, ids, probs);
            complete = share == 0.0 || m == n;
        }
        renormalise(ids, probs, m, vocab);
    }
    if (min_p > 0.0) {
        double best = probs[0];
        for (int64_t i = 1; i < m; i++) {
            if (probs[i] > best) {
                best = probs[i];
            }
        }
        double floor = min_p * best;
        for (int64_t i = 0; i < m; i++) {
            marks[i] = probs[i] >= floor;
        }
        m = kiln_compact(ids, probs, m, marks);
        renormalise(ids, probs, m, vocab);
    }
    double sum;
    int64_t index = kiln_cumulative_pick(probs, m, u, &sum);
    if (!(sum > 0)) {
        return -1;
    }
    return index >= m ? vocab - 1 : ids[index];
}

/* ---- the inverse transform in vocabulary order ------------------------------------------------ */

/* The index numpy's ``searchsorted(c, u * c[-1], side="right")`` gives for c = cumsum(p) (p >= 0),
   or ``count`` where the target is not below the last sum. *total receives c[-1]. The sums are
   recomputed in a second pass from the last checkpoint under the target, with the same additions. */
KILN_EXPORT int64_t kiln_cumulative_pick(const double *p, int64_t count, double u, double *total) {
    enum { STRIDE = 256 };
    double checkpoints[4096];
    int64_t saved = 0;
    double sum = 0.0;
    int64_t i = 0;
    for (; i < count; i++) {
        if (i % STRIDE == 0 && saved < 4096) {
            checkpoints[saved++] = sum; /* the sum before item i */
        }
        sum += p[i];
    }
    *total = sum;
    double target = u * sum;
    if (!(target < sum)) {
        return count;
    }
    /* the last checkpoint whose sum is not above the target: the first sum above it lies after it
       (sums never decrease) */
    int64_t block = 0;
    for (int64_t b = 1; b < saved; b++) {
        if (checkpoints[b] <= target) {
            block = b;
        } else {
            break;
        }
    }
    sum = checkpoints[block];
    for (i = block * STRIDE; i < count; i++) {
        sum += p[i];
        if (sum > target) {
            return i;
        }
    }
    return count;
}
