/* The AMX tiles kiln's kernels use, as the AMX instructions or as a plain C model of them (the
 * instructions' definitions in Intel's manual). They come in two sets of three (set 0: C 0, the int32
 * sums, A 1, rows of X's int8 codes, B 2, the weights' codes; set 1: tiles 3, 4, 5), so that a kernel
 * can have two products in flight: a multiply into one C tile waits for the one before it (and for
 * that C to be stored and zeroed again), which would chain every product of a row through one tile;
 * two sets let the second multiply start while the first runs, and the float work on one set's sums
 * run while the other multiplies (llama.cpp's and oneDNN's AMX kernels keep several C tiles for this).
 * A kernel written once over these runs either way (``emulate`` a constant where it is inlined), so its
 * data layout and arithmetic are tested on any CPU with AVX-512: gguf_amx.c (the types with a scale
 * per 32), gguf_k_amx.c (Q4_K, Q5_K, Q6_K) and gguf_k_low.c (Q2_K, Q3_K). */
#ifndef KILN_GGUF_AMX_TILES_H
#define KILN_GGUF_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* AMX's intrinsics came with GCC 11 and clang 12: an older compiler builds the model alone (the
 * library must still build: without it GGUF weights fall back to MatMulNBits). */
#if defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11
#define AMX_COMPILED 1
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,amx-tile,amx-int8")))
#else
#define AMX_COMPILED 0
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
#endif
#define INLINE_AMX AMX_TARGET __attribute__((always_inline)) static inline
#define AMX_MAX_ROWS 16  /* rows of X (of C and A) a tile multiply takes */

/* What turning AMX on found (kiln_gguf_amx_state; native/__init__.py names them): off (not asked), on, on over the
 * model of the tiles (tests), or why it was refused. */
enum amx_state { AMX_OFF, AMX_ON, AMX_MODEL, AMX_NOT_BUILT, AMX_NO_UNIT, AMX_NOT_GRANTED, AMX_DISAGREES, AMX_CRASHED };

typedef struct {  /* palette 1's tile configuration (LDTILECFG's 64 bytes) */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) tile_config;

/* The thread's tile configuration before a kernel configured its own (t_setup), to put back after it
 * (t_done): onnxruntime's own AMX kernels (MLAS's int8 GEMM, in the same pool threads) configure a
 * thread's tiles once and count on them staying so; releasing them, or leaving another shape, would
 * make its next tile instruction fault or compute with the wrong shapes. Where the thread had none
 * configured, kiln's stays: the next kernel with the same shape then loads nothing. */
typedef struct {
    tile_config before;
    int changed;  /* the kernel's configuration differs from ``before``: it was loaded */
} tile_use;

/* The model of the six tiles (a set's C, A, B at 3 · set + 0, 1, 2), a thread's own as real tiles are. */
typedef struct {
    int rows, colsb;
    uint8_t data[16][64];
} model_tile;
static __thread model_tile model[6];
enum { TILE_A = 1, TILE_B = 2 };  /* t_load's ``which`` */

INLINE_AMX void t_config_model(const tile_config *cfg) {
    for (int i = 0; i < 6; i++) model[i].rows = cfg->rows[i], model[i].colsb = cfg->colsb[i];
}

/* The instructions name their tiles in the instruction itself (an immediate): each set's own. */
INLINE_AMX void t_zero_c(int emulate, int set) {
    if (emulate) memset(model[3 * set].data, 0, sizeof model[3 * set].data);
#if AMX_COMPILED
    else if (set == 0) _tile_zero(0);
    else _tile_zero(3);
#endif
}

INLINE_AMX void t_load(int emulate, int set, int which, const void *p, size_t stride) {
    if (emulate) {
        model_tile *m = &model[3 * set + which];
        for (int r = 0; r < m->rows; r++) memcpy(m->data[r], (const uint8_t *)p + r * stride, (size_t)m->colsb);
    }
#if AMX_COMPILED
    else if (set == 0 && which == TILE_A) _tile_loadd(1, p, stride);
    else if (set == 0) _tile_loadd(2, p, stride);
    else if (which == TILE_A) _tile_loadd(4, p, stride);
    else _tile_loadd(5, p, stride);
#endif
}

/* C += A · B: each int32 of C's row m, column n gains Σ over k of A[m][4k+i] · B[k][4n+i], i < 4;
 * A's bytes signed, B's signed (TDPBSSD) or unsigned (TDPBSUD). */
INLINE_AMX void t_multiply(int emulate, int set, int signed_b) {
    if (!emulate) {
#if AMX_COMPILED
        if (set == 0 && signed_b) _tile_dpbssd(0, 1, 2);
        else if (set == 0) _tile_dpbsud(0, 1, 2);
        else if (signed_b) _tile_dpbssd(3, 4, 5);
        else _tile_dpbsud(3, 4, 5);
#endif
        return;
    }
    const model_tile *a = &model[3 * set + TILE_A], *b = &model[3 * set + TILE_B];
    model_tile *c = &model[3 * set];
    for (int m = 0; m < c->rows; m++) {
        int32_t row[16];
        memcpy(row, c->data[m], sizeof row);
        for (int k = 0; k < a->colsb / 4; k++)
            for (int n = 0; n < c->colsb / 4; n++)
                for (int i = 0; i < 4; i++) {
                    const int x = (int8_t)a->data[m][4 * k + i], byte = b->data[k][4 * n + i];
                    row[n] += x * (signed_b ? (int8_t)byte : byte);
                }
        memcpy(c->data[m], row, sizeof row);
    }
}

INLINE_AMX void t_store_c(int emulate, int set, int32_t out[][16]) {
    if (emulate) {
        for (int r = 0; r < model[3 * set].rows; r++) memcpy(out[r], model[3 * set].data[r], 64);
    }
#if AMX_COMPILED
    else if (set == 0) _tile_stored(0, out, 64);
    else _tile_stored(3, out, 64);
#endif
}

/* A configuration of both sets: C and A of ``rows`` rows, A of ``a_bytes`` codes a row, B of
 * a_bytes / 4 rows of sixteen columns' four codes; loaded only where the thread's differs (STTILECFG
 * reads it: LDTILECFG also zeroes every tile). */
INLINE_AMX void t_setup(int emulate, int rows, int a_bytes, tile_use *use) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int set = 0; set < 2; set++) {
        cfg.rows[3 * set] = (uint8_t)rows, cfg.colsb[3 * set] = 64;
        cfg.rows[3 * set + TILE_A] = (uint8_t)rows, cfg.colsb[3 * set + TILE_A] = (uint16_t)a_bytes;
        cfg.rows[3 * set + TILE_B] = (uint8_t)(a_bytes / 4), cfg.colsb[3 * set + TILE_B] = 64;
    }
    use->changed = 0;
    if (emulate) {
        t_config_model(&cfg);
        return;
    }
#if AMX_COMPILED
    _tile_storeconfig(&use->before);
    use->changed = memcmp(&use->before, &cfg, sizeof cfg) != 0;
    if (use->changed) _tile_loadconfig(&cfg);
#endif
}

/* The thread's configuration put back where the kernel changed one it had (none: kiln's stays). */
INLINE_AMX void t_done(int emulate, const tile_use *use) {
#if AMX_COMPILED
    if (!emulate && use->changed && use->before.palette) _tile_loadconfig(&use->before);
#else
    (void)emulate, (void)use;
#endif
}

#endif
