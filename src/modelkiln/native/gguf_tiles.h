/* What both families of GGUF kernels (gguf_ops.c: the K-quants; gguf_q32.c: a scale per 32 weights)
 * share: the tile of sixteen output columns, how many rows of X meet a tile at once, how far ahead
 * the weights are asked for, and the small loads. */
#ifndef KILN_GGUF_TILES_H
#define KILN_GGUF_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TILE 16     /* output columns a tile: one 32-bit lane of a 64-byte vector each */
#define MAX_ROWS 4  /* rows of X a tile is multiplied with at once: their sums stay in registers */
/* The weights stream from memory once per call: asking for the (super-)block four ahead, and at
 * least PREFETCH_MIN_BYTES ahead, keeps enough reads in flight for one row of X to run at the
 * memory's speed (without it, one row ran slower than the per-row kernel this replaced once a
 * matrix left the caches; four of the 320-byte blocks of a Q4_1 tile were too near). */
#define PREFETCH_AHEAD 4
#define PREFETCH_MIN_BYTES 8192
static inline void prefetch_ahead(const uint8_t *t, int bytes) {
    const int ahead = PREFETCH_AHEAD * bytes > PREFETCH_MIN_BYTES ? PREFETCH_AHEAD * bytes : PREFETCH_MIN_BYTES;
    for (int line = 0; line < bytes; line += 64) __builtin_prefetch(t + ahead + line);
}

static inline float half(const uint8_t *p) {  /* an fp16 as float */
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline int32_t load32(const void *p) {  /* four int8 codes as one int32, any alignment */
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#endif
