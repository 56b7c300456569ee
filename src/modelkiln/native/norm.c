/* KilnSkipNorm: onnxruntime's SkipSimplifiedLayerNormalization (float, no bias), the same bits, eight
 * rows at once.
 *
 *   out, sum = KilnSkipNorm(x, skip, gamma), attribute epsilon; rows of H values:
 *   sum = x + skip;   out = sum / sqrt(Σ_h sum_h · sum_h / H + epsilon) · gamma
 *
 * Why: onnxruntime's kernel adds each row's squares in order, one float add after another (its C++
 * is built without FMA contraction or reassociation: each product and each sum rounded), so a row
 * costs H dependent adds, a few cycles each: 5-6% of a SmolLM2 decode step's node time, more than
 * the copies between its projections. The same operations in the same order, with a row in each lane
 * of a vector (eight rows' columns transposed in registers), keep eight such chains in flight and give each row
 * the bits onnxruntime gives it (tests/native/test_native_norm.py compares them on every run).
 * A row's value depends on that row alone, so on nothing else in its batch.
 *
 * Every step is an IEEE operation rounded once: float adds and products, the division by H and the
 * addition of epsilon in float, a correctly rounded square root (sqrtf; a double sqrt rounded to float
 * is the same value), then each value divided by it and times gamma, in that order. This file is
 * compiled with -ffp-contract=off, like the rest of the library. */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>

#include "ort_abi.h"

#define LANES 8  /* rows a task: one per lane of an AVX2 vector */

typedef struct {
    const float *x, *skip, *gamma;
    float *out, *sum;
    int64_t rows, hidden;
    float epsilon;
} norm_job;

/* An 8 × 8 block of floats transposed in registers: r[i] lane j becomes r[j] lane i */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20), r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
}

/* Rows LANES · task .. of the job */
static void norm_task(void *data, size_t task) {
    const norm_job *job = data;
    const int64_t first = (int64_t)task * LANES, H = job->hidden;
    const int n = job->rows - first < LANES ? (int)(job->rows - first) : LANES;
    const float *x[LANES], *skip[LANES];
    float *sum[LANES];
    for (int r = 0; r < LANES; r++) {  /* lanes past the last row read row `first` again and are not used */
        const int64_t at = (first + (r < n ? r : 0)) * H;
        x[r] = job->x + at, skip[r] = job->skip + at, sum[r] = job->sum + at;
    }
    /* the sums, eight columns of the eight rows at a time, then their squares added in order of h,
     * a row per lane */
    __m256 squares = _mm256_setzero_ps();
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) {
        __m256 v[LANES];
        for (int r = 0; r < LANES; r++) {
            v[r] = _mm256_add_ps(_mm256_loadu_ps(x[r] + h), _mm256_loadu_ps(skip[r] + h));
            if (r < n) _mm256_storeu_ps(sum[r] + h, v[r]);
        }
        transpose8(v);
        for (int j = 0; j < 8; j++) squares = _mm256_add_ps(squares, _mm256_mul_ps(v[j], v[j]));
    }
    float total[LANES];
    _mm256_storeu_ps(total, squares);
    for (int r = 0; r < n; r++) {
        for (int64_t t = h; t < H; t++) {  /* the last columns (H not a multiple of 8), in order */
            sum[r][t] = x[r][t] + skip[r][t];
            total[r] = total[r] + sum[r][t] * sum[r][t];
        }
        const float root = sqrtf(total[r] / (float)H + job->epsilon);
        const __m256 d = _mm256_set1_ps(root);
        float *out = job->out + (first + r) * H;
        int64_t c = 0;
        for (; c + 8 <= H; c += 8)
            _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_div_ps(_mm256_loadu_ps(sum[r] + c), d), _mm256_loadu_ps(job->gamma + c)));
        for (; c < H; c++) out[c] = sum[r][c] / root * job->gamma[c];
    }
}

/* ---- the onnxruntime side ----------------------------------------------------------------------- */
typedef struct {
    const OrtApi *api;
    float epsilon;
} kernel;

static void compute(void *state, OrtKernelContext *context) {
    const kernel *kn = state;
    if (!kn) return;
    const OrtApi *api = kn->api;
    const OrtValue *in[3];
    int64_t dims[3][8];
    size_t rank[3];
    for (size_t i = 0; i < 3; i++) {
        CHECK(((KernelContextGetInputFn)kiln_ort_fn(api, SLOT_KernelContext_GetInput))(context, i, &in[i]));
        if (!shape_of(api, in[i], dims[i], &rank[i])) return;
    }
    /* x and skip of the same shape [..., H], gamma [H] */
    const int64_t H = rank[0] ? dims[0][rank[0] - 1] : 0;
    if (rank[0] < 1 || rank[1] != rank[0] || rank[2] != 1 || dims[2][0] != H || H <= 0 || H > (int64_t)INT32_MAX / LANES) return;
    int64_t rows = 1;
    for (size_t i = 0; i < rank[0]; i++) {
        if (dims[1][i] != dims[0][i]) return;
        if (i + 1 < rank[0]) rows *= dims[0][i];
    }
    norm_job job = {.rows = rows, .hidden = H, .epsilon = kn->epsilon};
    GetTensorMutableDataFn data = (GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData);
    CHECK(data((OrtValue *)in[0], (void **)&job.x));
    CHECK(data((OrtValue *)in[1], (void **)&job.skip));
    CHECK(data((OrtValue *)in[2], (void **)&job.gamma));
    OrtValue *out, *sum;
    KernelContextGetOutputFn output = (KernelContextGetOutputFn)kiln_ort_fn(api, SLOT_KernelContext_GetOutput);
    CHECK(output(context, 0, dims[0], rank[0], &out));
    CHECK(output(context, 1, dims[0], rank[0], &sum));
    CHECK(data(out, (void **)&job.out));
    CHECK(data(sum, (void **)&job.sum));
    const size_t tasks = (size_t)((rows + LANES - 1) / LANES);
    if (tasks > 1) {
        OrtStatus *status = ((KernelContextParallelForFn)kiln_ort_fn(api, SLOT_KernelContext_ParallelFor))(context, norm_task, tasks, 0, &job);
        if (status) ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status);
    } else {
        for (size_t t = 0; t < tasks; t++) norm_task(&job, t);
    }
}

static void *create(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info) {
    (void)op;
    kernel *kn = calloc(1, sizeof *kn);
    if (!kn) return NULL;
    kn->api = api;
    OrtStatus *status = ((KernelInfoGetAttributeFloatFn)kiln_ort_fn(api, SLOT_KernelInfoGetAttribute_float))(info, "epsilon", &kn->epsilon);
    if (status || !(kn->epsilon >= 0.0f)) {
        if (status) ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status);
        free(kn);
        return NULL;
    }
    return kn;
}

static void destroy(void *state) { free(state); }
static const char *name(const OrtCustomOp *op) { (void)op; return "KilnSkipNorm"; }
static const char *cpu(const OrtCustomOp *op) { (void)op; return NULL; }
static size_t three(const OrtCustomOp *op) { (void)op; return 3; }
static size_t two(const OrtCustomOp *op) { (void)op; return 2; }
static int float_type(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return KILN_TENSOR_FLOAT; }
static int required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static int default_memory(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }

const OrtCustomOp KILN_SKIP_NORM = {13, create, name, cpu, float_type, three, float_type, two,
                                    compute, destroy, required, required, default_memory};

/* For tests and measurements without onnxruntime: the same on one thread. */
__attribute__((visibility("default")))
void kiln_skip_norm(const float *x, const float *skip, const float *gamma, int64_t rows, int64_t hidden, float epsilon,
                    float *out, float *sum) {
    norm_job job = {x, skip, gamma, out, sum, rows, hidden, epsilon};
    for (size_t t = 0; t < (size_t)((rows + LANES - 1) / LANES); t++) norm_task(&job, t);
}
