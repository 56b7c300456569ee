/* The three AMX tiles kiln's kernels use (0: C, the int32 sums; 1: A, rows of X's int8 codes; 2: B,
 * the weights' codes), as the AMX instructions or as a plain C model of them (the instructions'
 * definitions in Intel's manual). A kernel written once over these runs either way (``emulate`` a
 * constant where it is inlined), so its data layout and arithmetic are tested on any CPU with
 * AVX-512: gguf_amx.c (the types with a scale per 32) and gguf_ops.c (the K-quants). */
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

typedef struct {  /* palette 1's tile configuration (LDTILECFG's 64 bytes) */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The model of the three tiles (0: C, 1: A, 2: B), a thread's own as real tiles are. */
typedef struct {
    int rows, colsb;
    uint8_t data[16][64];
} model_tile;
static __thread model_tile model[3];

INLINE_AMX void t_config(int emulate, const tile_config *cfg) {
    if (!emulate) {
#if AMX_COMPILED
        _tile_loadconfig(cfg);
#endif
        return;
    }
    for (int i = 0; i < 3; i++) model[i].rows = cfg->rows[i], model[i].colsb = cfg->colsb[i];
}

INLINE_AMX void t_zero_c(int emulate) {
    if (emulate) memset(model[0].data, 0, sizeof model[0].data);
#if AMX_COMPILED
    else _tile_zero(0);
#endif
}

INLINE_AMX void t_load(int emulate, int which, const void *p, size_t stride) {
    if (emulate) {
        for (int r = 0; r < model[which].rows; r++) memcpy(model[which].data[r], (const uint8_t *)p + r * stride, (size_t)model[which].colsb);
    }
#if AMX_COMPILED
    else if (which == 1) _tile_loadd(1, p, stride);
    else _tile_loadd(2, p, stride);
#endif
}

/* C += A · B: each int32 of C's row m, column n gains Σ over k of A[m][4k+i] · B[k][4n+i], i < 4;
 * A's bytes signed, B's signed (TDPBSSD) or unsigned (TDPBSUD). */
INLINE_AMX void t_multiply(int emulate, int signed_b) {
    if (!emulate) {
#if AMX_COMPILED
        if (signed_b) _tile_dpbssd(0, 1, 2);
        else _tile_dpbsud(0, 1, 2);
#endif
        return;
    }
    for (int m = 0; m < model[0].rows; m++) {
        int32_t row[16];
        memcpy(row, model[0].data[m], sizeof row);
        for (int k = 0; k < model[1].colsb / 4; k++)
            for (int n = 0; n < model[0].colsb / 4; n++)
                for (int i = 0; i < 4; i++) {
                    const int a = (int8_t)model[1].data[m][4 * k + i], byte = model[2].data[k][4 * n + i];
                    row[n] += a * (signed_b ? (int8_t)byte : byte);
                }
        memcpy(model[0].data[m], row, sizeof row);
    }
}

INLINE_AMX void t_store_c(int emulate, int32_t out[][16]) {
    if (emulate) {
        for (int r = 0; r < model[0].rows; r++) memcpy(out[r], model[0].data[r], 64);
    }
#if AMX_COMPILED
    else _tile_stored(0, out, 64);
#endif
}

/* A configuration of the three tiles: C and A of ``rows`` rows, A of ``a_bytes`` codes a row, B of
 * a_bytes / 4 rows of sixteen columns' four codes. */
INLINE_AMX void t_setup(int emulate, int rows, int a_bytes) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    cfg.rows[0] = (uint8_t)rows, cfg.colsb[0] = 64;
    cfg.rows[1] = (uint8_t)rows, cfg.colsb[1] = (uint16_t)a_bytes;
    cfg.rows[2] = (uint8_t)(a_bytes / 4), cfg.colsb[2] = 64;
    t_config(emulate, &cfg);
}

INLINE_AMX void t_done(int emulate) {
#if AMX_COMPILED
    if (!emulate) _tile_release();
#endif
}

#endif
