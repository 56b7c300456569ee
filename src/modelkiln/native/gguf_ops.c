/* onnxruntime operators that compute with a GGUF file's blocks, their values as stored.
 *
 * GgufMatMul  Y[..., N] = X[..., K] · Wᵀ, W: a GGUF type's rows in tiles of 16 (convert/gguf/tiles.py);
 *             with attributes split1 (and split2), multiples of 16, Y's columns go to two (three)
 *             outputs, [0, split1), [split1, split2), [split2, N): q, k and v of a fused projection
 *             without a Split node copying them after it; with a third input T (X's shape), the
 *             product is (X · T) Wᵀ, X · T element by element as ONNX's Mul rounds it: the MLP's
 *             silu(gate) · up without a Mul node writing it out first
 * GgufGather  Y[..., K] = the rows of W for token ids, dequantized exactly as gguf-py does
 * (domain "kiln.gguf"; attributes ggml_type, K and N).
 *
 * This file holds the operators, the matmul's work split over onnxruntime's threads (a tile of sixteen
 * columns a task, its rows to AMX, the two-tile or the one-tile kernel) and the switches that choose the
 * kernels. The kernels: gguf_k456.c (Q4_K, Q5_K, Q6_K: types 12-14, and X's quantization per 256 inputs),
 * gguf_k_low.c (Q2_K, Q3_K: 10, 11), gguf_q32.c (the types with a scale per 32 weights: Q4_0, Q4_1, Q5_0,
 * Q5_1, Q8_0), and their AMX forms gguf_k_amx.c and gguf_amx.c. Compiled with -ffp-contract=off so the
 * gather's float operations round as gguf-py's numpy ones do. */
#include <errno.h>
#include <immintrin.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gguf_k.h"
#include "gguf_q32.h"
#include "ort_abi.h"

static void *aligned(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* ---- the matmul, a tile of sixteen columns per task over onnxruntime's threads ---------------- */
/* The two families: K-quants (a super-block of 256 inputs, X in q8_block) and the types with a
 * scale per 32 (gguf_q32.c, X in q8_32). */
static int64_t block_inputs(int64_t type) { return q32_type(type) ? QK32 : QK_K; }
static size_t block_bytes(int64_t type) { return q32_type(type) ? q32_tile_block_bytes(type) : k_tile_block_bytes(type); }
static size_t activation_bytes(int64_t type) { return q32_type(type) ? sizeof(q8_32) : sizeof(q8_block); }

#define MAX_PARTS 3  /* outputs of one GgufMatMul: q, k and v of a fused projection */

typedef struct {
    int type;
    const uint8_t *w;  /* tiles */
    const void *x;     /* q8_block or q8_32, nb a row */
    int64_t rows, n, nb;
    int pairs;         /* a task takes two tiles (matmul_tasks) */
    int parts;         /* Y's columns go to `parts` outputs: columns starts[p] .. starts[p + 1] - 1 to y[p] */
    int64_t starts[MAX_PARTS + 1];
    float *y[MAX_PARTS];
} matmul_job;

/* Where row r's columns from c0 on are written: the output holding column c0 (parts start at
 * multiples of 16, so a tile's columns are all in one). */
static inline float *out_at(const matmul_job *job, int64_t r, int64_t c0) {
    int p = 0;
    while (p + 1 < job->parts && c0 >= job->starts[p + 1]) p++;
    return job->y[p] + r * (job->starts[p + 1] - job->starts[p]) + (c0 - job->starts[p]);
}

/* Rows left at which a tile goes to AMX (where it is on): below it the VNNI kernel, whose four rows'
 * sums stay in registers, is at least as fast in principle; where AMX starts to win is for an AMX
 * CPU to measure (benchmarks/generation/gguf_kernels.py). */
#define AMX_MIN_ROWS 8

/* A thread's buffer for a tile's B tiles, unpacked once (tile_images): it grows to the largest tile
 * asked of that thread and lives as long as the thread (onnxruntime's pool threads, the session's). */
static __thread uint8_t *images_buffer;
static __thread size_t images_capacity;

/* The tile's B tiles, every block's, unpacked once into the thread's buffer: where AMX takes the
 * rows in more than one group of sixteen (a step of 24+ sequences, a prompt chunk), every group
 * reads them instead of unpacking its own. NULL where the type has none to unpack (Q8_0) or no
 * memory was had (each group then unpacks block by block: the same bits). */
static const uint8_t *tile_images(const matmul_job *job, const uint8_t *t, int q32) {
    const size_t bytes = (size_t)job->nb * (q32 ? q32_amx_image_bytes(job->type) : K_IMAGE_BYTES);
    if (!bytes) return NULL;
    if (bytes > images_capacity) {
        free(images_buffer);
        images_buffer = aligned(bytes);
        images_capacity = images_buffer ? bytes : 0;
        if (!images_buffer) return NULL;
    }
    if (q32) q32_amx_images(job->type, t, job->nb, images_buffer);
    else k_amx_images(job->type, t, job->nb, images_buffer);
    return images_buffer;
}

/* Rows r.. of the job against one tile on AMX, sixteen at a time while AMX_MIN_ROWS are left; returns
 * the first row it left to the VNNI kernels. */
static int64_t amx_rows_task(const matmul_job *job, const uint8_t *t, int64_t c0, int64_t columns, int q32) {
    const uint8_t *images = job->rows >= AMX_MAX_ROWS + AMX_MIN_ROWS ? tile_images(job, t, q32) : NULL;
    int64_t r = 0;
    for (int64_t R; job->rows - r >= AMX_MIN_ROWS; r += R) {
        float out[AMX_MAX_ROWS][TILE];
        R = job->rows - r < AMX_MAX_ROWS ? job->rows - r : AMX_MAX_ROWS;
        if (q32) q32_amx_rows(job->type, (int)R, t, images, job->nb, (const q8_32 *)job->x + r * job->nb, out);
        else k_amx_rows(job->type, (int)R, t, images, job->nb, (const q8_block *)job->x + r * job->nb, out);
        for (int i = 0; i < R; i++) memcpy(out_at(job, r + i, c0), out[i], sizeof(float) * (size_t)columns);
    }
    return r;
}

static const uint8_t *tile_weights(const matmul_job *job, size_t tile) {
    return job->w + tile * (size_t)job->nb * block_bytes(job->type);
}

static int64_t tile_columns(const matmul_job *job, size_t tile) {
    const int64_t c0 = (int64_t)tile * TILE;
    return job->n - c0 < TILE ? job->n - c0 : TILE;
}

/* Rows first.. of the job against one tile, up to four rows at a time (inlined: called out of line,
 * the K-quants' 64-row products measured 6% slower on an AMD EPYC Zen 5) */
static inline __attribute__((always_inline)) void tile_rows_task(const matmul_job *job, size_t tile, int64_t first) {
    const uint8_t *t = tile_weights(job, tile);
    const int64_t c0 = (int64_t)tile * TILE, columns = tile_columns(job, tile);
    for (int64_t r = first; r < job->rows; r += MAX_ROWS) {
        const int R = job->rows - r < MAX_ROWS ? (int)(job->rows - r) : MAX_ROWS;
        float out[MAX_ROWS][TILE];
        if (q32_type(job->type)) {
            const q8_32 *x[MAX_ROWS];
            for (int i = 0; i < R; i++) x[i] = (const q8_32 *)job->x + (r + i) * job->nb;
            q32_tile_rows(job->type, R, t, job->nb, x, out);
        } else {
            const q8_block *x[MAX_ROWS];
            for (int i = 0; i < R; i++) x[i] = (const q8_block *)job->x + (r + i) * job->nb;
            k_tile_rows(job->type, R, t, job->nb, x, out);
        }
        for (int i = 0; i < R; i++) memcpy(out_at(job, r + i, c0), out[i], sizeof(float) * (size_t)columns);
    }
}

/* Rows first.. against tiles `tile` and `tile + 1` together, four rows at a time (q32_pair_rows,
 * k_pair_rows_512); returns the first row it left (fewer than four). */
static int64_t pair_rows_task(const matmul_job *job, size_t tile, int64_t first) {
    const uint8_t *t = tile_weights(job, tile), *u = tile_weights(job, tile + 1);
    const int64_t c0 = (int64_t)tile * TILE, columns2 = tile_columns(job, tile + 1);
    int64_t r = first;
    for (; job->rows - r >= MAX_ROWS; r += MAX_ROWS) {
        float out[MAX_ROWS][TILE], out2[MAX_ROWS][TILE];
        if (q32_type(job->type)) {
            const q8_32 *x[MAX_ROWS];
            for (int i = 0; i < MAX_ROWS; i++) x[i] = (const q8_32 *)job->x + (r + i) * job->nb;
            q32_pair_rows(job->type, t, u, job->nb, x, out, out2);
        } else {
            const q8_block *x[MAX_ROWS];
            for (int i = 0; i < MAX_ROWS; i++) x[i] = (const q8_block *)job->x + (r + i) * job->nb;
            k_pair_rows_512(job->type, t, u, job->nb, x, out, out2);
        }
        for (int i = 0; i < MAX_ROWS; i++) {
            memcpy(out_at(job, r + i, c0), out[i], sizeof(float) * TILE);
            memcpy(out_at(job, r + i, c0 + TILE), out2[i], sizeof(float) * (size_t)columns2);
        }
    }
    return r;
}

/* One task: a tile of sixteen columns, or two where the job pairs them (the last may be alone) */
static void matmul_task(void *data, size_t task) {
    const matmul_job *job = data;
    const int64_t tiles = (job->n + TILE - 1) / TILE;
    const size_t tile = job->pairs ? 2 * task : task;
    const int q32 = q32_type(job->type);
    const int two = job->pairs && (int64_t)tile + 1 < tiles;
    int64_t first = 0;  /* AMX's rows depend only on the count, so both tiles leave the same */
    if (q32 ? q32_amx_on() : k_amx_on())
        for (int i = 0; i <= two; i++)
            first = amx_rows_task(job, tile_weights(job, tile + i), (int64_t)(tile + i) * TILE, tile_columns(job, tile + i), q32);
    if (two) first = pair_rows_task(job, tile, first);
    for (int i = 0; i <= two; i++) tile_rows_task(job, tile + i, first);
}

/* The tasks of a job: a tile each, or two each where the two-tile kernel is on and there are at
 * least four rows (with fewer, the weights' bytes, not X's loads, set the speed). */
static size_t matmul_tasks(matmul_job *job) {
    const int64_t tiles = (job->n + TILE - 1) / TILE;
    const int paired_type = q32_type(job->type) || job->type == GGML_Q4_K || job->type == GGML_Q5_K;
    job->pairs = paired_type && q32_pairs_on() && job->rows >= MAX_ROWS;  /* q32_pairs_on: the AVX-512 kernels are on */
    return (size_t)(job->pairs ? (tiles + 1) / 2 : tiles);
}

typedef struct {
    int type;
    const float *x;
    int64_t k, nb;
    void *out;
    const float *times;  /* NULL, or X is x · times, element by element (GgufMatMul's third input) */
} quantize_job;

static void quantize_rows_task(void *data, size_t row) {
    const quantize_job *job = data;
    const float *x = job->x + row * job->k;
    if (!job->times) {
        if (q32_type(job->type)) q32_quantize_row(x, job->k, (q8_32 *)job->out + row * job->nb);
        else k_quantize_row(x, job->k, (q8_block *)job->out + row * job->nb);
        return;
    }
    /* the products, 256 at a time (a K-quant block, eight of a scale per 32), each one float
     * multiplication as ONNX's Mul rounds it, then quantized as X's own values would be */
    const float *times = job->times + row * job->k;
    for (int64_t at = 0; at < job->k; at += QK_K) {
        float product[QK_K];
        const int64_t n = job->k - at < QK_K ? job->k - at : QK_K;
        for (int64_t i = 0; i < n; i++) product[i] = x[at + i] * times[at + i];
        if (q32_type(job->type)) q32_quantize_row(product, n, (q8_32 *)job->out + row * job->nb + at / QK32);
        else k_quantize_row(product, n, (q8_block *)job->out + row * job->nb + at / QK_K);
    }
}

/* ---- the gather: a token's row, dequantized exactly (gguf_k456.c, gguf_q32.c) ----------------------- */
/* Row ``row`` of the matrix (a token's embedding), from its tile. */
static void dequantize_row(int type, const uint8_t *w, int64_t row, int64_t nb, float *y) {
    if (q32_type(type)) {
        q32_dequantize_row(type, w, row, nb, y);
        return;
    }
    k_dequantize_row(type, w, row, nb, y);
}

/* ---- the onnxruntime side ----------------------------------------------------------------------- */
typedef struct {
    const OrtApi *api;
    int gather;
    int64_t type, k, n;
    int parts;  /* GgufMatMul's outputs: attributes split1 (and split2) cut Y's columns into 2 (3) */
    int64_t starts[MAX_PARTS + 1];
} kernel;

static void compute(void *state, OrtKernelContext *context) {
    const kernel *kn = state;
    if (!kn) return;  /* its attributes were refused at creation (the graph writer never does that) */
    const OrtApi *api = kn->api;
    const OrtValue *first, *second;
    CHECK(((KernelContextGetInputFn)kiln_ort_fn(api, SLOT_KernelContext_GetInput))(context, 0, &first));
    CHECK(((KernelContextGetInputFn)kiln_ort_fn(api, SLOT_KernelContext_GetInput))(context, 1, &second));
    int64_t dims[8];
    size_t rank;
    const int64_t nb = kn->k / block_inputs(kn->type);
    const int64_t tile_bytes = nb * (int64_t)block_bytes(kn->type);
    OrtValue *output;
    float *y;
    if (kn->gather) {  /* inputs: W [V / 16 tiles, tile bytes], ids [...] → [..., K]; V is N */
        const uint8_t *w;
        const int64_t *ids;
        int64_t wdims[8];
        size_t wrank;
        if (!shape_of(api, second, dims, &rank) || rank > 7 || !shape_of(api, first, wdims, &wrank) || wrank != 2 ||
            wdims[1] != tile_bytes || wdims[0] * TILE < kn->n)
            return;
        CHECK(((GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData))((OrtValue *)first, (void **)&w));
        CHECK(((GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData))((OrtValue *)second, (void **)&ids));
        int64_t count = 1;
        for (size_t i = 0; i < rank; i++) count *= dims[i];
        dims[rank] = kn->k;
        CHECK(((KernelContextGetOutputFn)kiln_ort_fn(api, SLOT_KernelContext_GetOutput))(context, 0, dims, rank + 1, &output));
        CHECK(((GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData))(output, (void **)&y));
        for (int64_t i = 0; i < count; i++) {
            int64_t id = ids[i] < 0 ? ids[i] + kn->n : ids[i];
            if (id < 0 || id >= kn->n) {  /* out of the vocabulary: NaN, as no real row is */
                for (int64_t j = 0; j < kn->k; j++) y[i * kn->k + j] = NAN;
                continue;
            }
            dequantize_row((int)kn->type, w, id, nb, y + i * kn->k);
        }
        return;
    }
    const float *x, *times = NULL;  /* inputs: X [..., K], W [N / 16 tiles, tile bytes], optionally T [..., K] → (X · T) Wᵀ */
    const uint8_t *w;
    int64_t wdims[8];
    size_t wrank;
    if (!shape_of(api, first, dims, &rank) || rank < 1 || dims[rank - 1] != kn->k || !shape_of(api, second, wdims, &wrank) ||
        wrank != 2 || wdims[1] != tile_bytes || wdims[0] * TILE < kn->n)
        return;
    CHECK(((GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData))((OrtValue *)first, (void **)&x));
    CHECK(((GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData))((OrtValue *)second, (void **)&w));
    const OrtValue *third = NULL;
    CHECK(((KernelContextGetInputFn)kiln_ort_fn(api, SLOT_KernelContext_GetInput))(context, 2, &third));
    if (third) {  /* the same shape as X */
        int64_t tdims[8];
        size_t trank;
        if (!shape_of(api, third, tdims, &trank) || trank != rank || memcmp(tdims, dims, sizeof(int64_t) * rank)) return;
        CHECK(((GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData))((OrtValue *)third, (void **)&times));
    }
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < rank; i++) rows *= dims[i];
    matmul_job job = {(int)kn->type, w, NULL, rows, kn->n, nb, 0, kn->parts, {0}, {NULL}};
    for (int p = 0; p < kn->parts; p++) {
        job.starts[p + 1] = kn->starts[p + 1];
        dims[rank - 1] = kn->starts[p + 1] - kn->starts[p];
        CHECK(((KernelContextGetOutputFn)kiln_ort_fn(api, SLOT_KernelContext_GetOutput))(context, (size_t)p, dims, rank, &output));
        CHECK(((GetTensorMutableDataFn)kiln_ort_fn(api, SLOT_GetTensorMutableData))(output, (void **)&job.y[p]));
    }
    if (rows == 0) return;
    void *qx = aligned(activation_bytes(kn->type) * (size_t)(rows * nb));
    if (!qx) return;
    KernelContextParallelForFn parallel = (KernelContextParallelForFn)kiln_ort_fn(api, SLOT_KernelContext_ParallelFor);
    quantize_job qjob = {(int)kn->type, x, kn->k, nb, qx, times};
    if (rows > 1) {
        OrtStatus *status = parallel(context, quantize_rows_task, (size_t)rows, 0, &qjob);
        if (status) ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status);
    } else {
        quantize_rows_task(&qjob, 0);
    }
    job.x = qx;
    OrtStatus *status = parallel(context, matmul_task, matmul_tasks(&job), 0, &job);
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
    if ((status = attr(info, "ggml_type", &kn->type)) || (status = attr(info, "K", &kn->k)) || (status = attr(info, "N", &kn->n))) {
        ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status);
        free(kn);
        return NULL;
    }
    if ((kn->type < GGML_Q2_K || kn->type > GGML_Q6_K) && !q32_type(kn->type)) {
        free(kn);
        return NULL;
    }
    if (kn->k <= 0 ||
        kn->k % block_inputs(kn->type) || kn->n <= 0) {
        free(kn);
        return NULL;
    }
    kn->parts = 1;
    kn->starts[1] = kn->n;
    for (const char *const *name = (const char *const[]){"split1", "split2", NULL}; !gather && *name; name++) {
        int64_t at;
        if ((status = attr(info, *name, &at))) {  /* absent: no more parts */
            ((ReleaseStatusFn)kiln_ort_fn(api, SLOT_ReleaseStatus))(status);
            break;
        }
        /* each part a whole number of tiles, in order, none empty */
        if (at % TILE || at <= kn->starts[kn->parts - 1] || at >= kn->n) {
            free(kn);
            return NULL;
        }
        kn->starts[kn->parts++] = at;
        kn->starts[kn->parts] = kn->n;
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
static int matmul_input(const OrtCustomOp *op, size_t i) { (void)op; return i == 1 ? KILN_TENSOR_UINT8 : KILN_TENSOR_FLOAT; }
static size_t matmul_inputs(const OrtCustomOp *op) { (void)op; return 3; }
static int gather_input(const OrtCustomOp *op, size_t i) { (void)op; return i == 0 ? KILN_TENSOR_UINT8 : 7 /* int64 */; }
static int float_output(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return KILN_TENSOR_FLOAT; }
static int required(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }
static size_t matmul_outputs(const OrtCustomOp *op) { (void)op; return MAX_PARTS; }
static int first_required(const OrtCustomOp *op, size_t i) { (void)op; return i ? 1 /* optional */ : 0; }
static int two_required(const OrtCustomOp *op, size_t i) { (void)op; return i >= 2 ? 1 /* optional */ : 0; }
static int default_memory(const OrtCustomOp *op, size_t i) { (void)op; (void)i; return 0; }

static const OrtCustomOp MATMUL = {13, create_matmul, matmul_name, cpu, matmul_input, matmul_inputs, float_output, matmul_outputs,
                                   compute, destroy, two_required, first_required, default_memory};
static const OrtCustomOp GATHER = {13, create_gather, gather_name, cpu, gather_input, two, float_output, one,
                                   compute, destroy, required, required, default_memory};

static int amx_state = AMX_OFF;  /* what the last kiln_gguf_use_amx found (kiln_gguf_amx_state) */
/* kiln_gguf_amx_detail: the signal that ended the checks' child (AMX_CRASHED), arch_prctl's errno (AMX_NOT_GRANTED) */
static int amx_detail = 0;

/* Every kernel's check against the AVX-512 kernels, in this process: an amx_state (mode 1 the CPU's
 * tiles, 2 the model of them; 3, for tests, a check that faults as a broken tile instruction would). */
static int amx_checks(int mode) {
    if (mode == 3) __builtin_trap();  /* ud2: SIGILL, as an instruction or tile configuration the CPU rejects */
    const int state = q32_use_amx(mode);
    if (state != AMX_ON && state != AMX_MODEL) return state;
    return k_use_amx(mode) == state ? state : AMX_DISAGREES;
}

/* The checks in a child process first: these kernels' tile instructions may meet a unit they never
 * ran on (a configuration it rejects faults: #UD, #GP), and a fault there must be a refusal with its
 * reason (the signal, in amx_detail), not the end of a server. The child only computes and exits (no
 * locks of its parent's threads are taken: glibc's fork leaves malloc usable). -1: no child could be made. */
static int amx_checks_in_child(int mode) {
    const pid_t child = fork();
    if (child == 0) {  /* a fault ends the child as it is: no handler of the parent's (Python's faulthandler) reports
                        * it as the process's own fatal error in a log that goes on */
        for (int s = 0; s < 4; s++) signal((int[]){SIGILL, SIGSEGV, SIGBUS, SIGFPE}[s], SIG_DFL);
        _exit(amx_checks(mode));
    }
    if (child < 0) return -1;
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR) return -1;
    if (WIFSIGNALED(status)) {
        amx_detail = WTERMSIG(status);
        return AMX_CRASHED;
    }
    return WEXITSTATUS(status);
}

/* AMX (gguf_amx_tiles.h): 0 off, 1 the CPU's, 2 a model of its tiles (tests; 3: a check that faults);
 * returns whether the mode took: every kernel's check against the AVX-512 kernels passed, in a child
 * process and then in this one (call after kiln_gguf_use_avx512(1)). Rows go to AMX in groups of up
 * to sixteen while at least AMX_MIN_ROWS are left (fewer: the VNNI kernels, four at a time); the same
 * bits either way. */
__attribute__((visibility("default")))
int kiln_gguf_use_amx(int mode) {
    static int asked = 0;  /* the mode in force: nothing asked yet is AMX off */
    if (mode < 1 || mode > 3) mode = 0;
    /* Every session registers the operators (RegisterCustomOps asks again): the same mode leaves the
     * kernels' pointers alone, which another session's products may be reading right then, and forks
     * no second child (fork copies the page tables of what may be gigabytes of mapped weights). */
    if (mode == asked) return mode == 0 || k_amx_on();
    asked = mode;
    k_use_amx(0);
    q32_use_amx(0);
    amx_detail = 0;
    if (mode == 0) {
        amx_state = AMX_OFF;
        return 1;
    }
    amx_state = q32_amx_available(mode, &amx_detail);  /* nothing to try where this fails: no child */
    if (amx_state != AMX_ON) return 0;
    const int child = amx_checks_in_child(mode);
    if (child < 0 && mode == 3) {  /* no child to fault in: never fault here */
        amx_state = AMX_OFF;
        return 0;
    }
    if (child >= 0 && child != AMX_ON && child != AMX_MODEL) {
        amx_state = child;
        return 0;
    }
    amx_state = amx_checks(mode);  /* each family's kernels go on where their check passes */
    if (amx_state != AMX_ON && amx_state != AMX_MODEL) {
        k_use_amx(0);
        q32_use_amx(0);
        return 0;
    }
    return 1;
}

__attribute__((visibility("default")))
int kiln_gguf_amx_on(void) { return k_amx_on(); }

__attribute__((visibility("default")))
int kiln_gguf_amx_state(void) { return amx_state; }

__attribute__((visibility("default")))
int kiln_gguf_amx_detail(void) { return amx_detail; }

/* The AVX-512 (VNNI) forms where the CPU has them (the same results as the AVX2 forms). */
__attribute__((visibility("default")))
void kiln_gguf_use_avx512(int on) {
    k_use_avx512(on);
    q32_use_avx512(on);
}

extern const OrtCustomOp KILN_ATTENTION, KILN_ATTENTION_F16, KILN_SKIP_NORM;  /* attention.c, norm.c: the library's other operators */

__attribute__((visibility("default")))
OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
    const OrtApi *api = base->GetApi(KILN_ORT_API_VERSION);
    if (!api) return NULL;  /* cannot even make a status: onnxruntime older than the ABI used here */
    kiln_gguf_use_avx512(1);
    const char *amx = getenv("KILN_AMX");  /* opt-in until measured on an AMX CPU (gguf_amx_tiles.h) */
    kiln_gguf_use_amx(amx && !strcmp(amx, "1"));
    OrtCustomOpDomain *domain;
    OrtStatus *status = ((CreateCustomOpDomainFn)kiln_ort_fn(api, SLOT_CreateCustomOpDomain))("kiln.gguf", &domain);
    if (status) return status;
    if ((status = ((CustomOpDomainAddFn)kiln_ort_fn(api, SLOT_CustomOpDomain_Add))(domain, &MATMUL))) return status;
    if ((status = ((CustomOpDomainAddFn)kiln_ort_fn(api, SLOT_CustomOpDomain_Add))(domain, &GATHER))) return status;
    if ((status = ((CustomOpDomainAddFn)kiln_ort_fn(api, SLOT_CustomOpDomain_Add))(domain, &KILN_ATTENTION))) return status;
    if ((status = ((CustomOpDomainAddFn)kiln_ort_fn(api, SLOT_CustomOpDomain_Add))(domain, &KILN_ATTENTION_F16))) return status;
    if ((status = ((CustomOpDomainAddFn)kiln_ort_fn(api, SLOT_CustomOpDomain_Add))(domain, &KILN_SKIP_NORM))) return status;
    return ((AddCustomOpDomainFn)kiln_ort_fn(api, SLOT_AddCustomOpDomain))(options, domain);
}

/* X's rows quantized as the matmul quantizes them (q8_32 or q8_block structs, nb a row): kiln_gguf_matmul's first
 * step, and exported for the tests. */
__attribute__((visibility("default")))
size_t kiln_gguf_activation_bytes(int type) { return activation_bytes(type); }
__attribute__((visibility("default")))
void kiln_gguf_quantize(int type, const float *x, int64_t rows, int64_t k, void *out) {
    quantize_job qjob = {type, x, k, k / block_inputs(type), out, NULL};
    for (int64_t r = 0; r < rows; r++) quantize_rows_task(&qjob, (size_t)r);
}

/* For tests and measurements without onnxruntime: the same kernels on one thread; w is tiles. */
__attribute__((visibility("default")))
void kiln_gguf_matmul(int type, const float *x, int64_t rows, int64_t k, const uint8_t *w, int64_t n, float *y) {
    const int64_t nb = k / block_inputs(type);
    void *qx = aligned(activation_bytes(type) * (size_t)(rows * nb));
    kiln_gguf_quantize(type, x, rows, k, qx);
    matmul_job job = {type, w, qx, rows, n, nb, 0, 1, {0, n}, {y}};
    const size_t tasks = matmul_tasks(&job);
    for (size_t t = 0; t < tasks; t++) matmul_task(&job, t);
    free(qx);
}

__attribute__((visibility("default")))
void kiln_gguf_dequantize(int type, const uint8_t *w, int64_t rows, int64_t k, float *y) {
    for (int64_t r = 0; r < rows; r++) dequantize_row(type, w, r, k / block_inputs(type), y + r * k);
}
