/* GGUF's types with one scale per 32 weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) for GgufMatMul and
 * GgufGather (gguf_ops.c), their values as the file stores them. gguf_q32.c says how. */
#ifndef KILN_GGUF_Q32_H
#define KILN_GGUF_Q32_H

#include <stddef.h>
#include <stdint.h>

#define QK32 32
enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8 };

/* An activation row, quantized per 32 inputs as llama.cpp's q8_1 is: int8 codes, their scale and
 * their sum (for the weights' offsets: Q4_0's 8, Q5_0's 16, Q4_1's and Q5_1's minimums). */
typedef struct {
    int8_t qs[QK32];
    float d;
    int32_t sum;
} q8_32;

int q32_type(int64_t type);                  /* one of the five */
size_t q32_tile_block_bytes(int64_t type);  /* 16 columns × the file's bytes of one block */
void q32_quantize_row(const float *x, int64_t k, q8_32 *out);
/* out[r][c] = row r of x · column c of a tile (16 columns), 1 ≤ rows ≤ 4 */
void q32_tile_rows(int type, int rows, const uint8_t *t, int64_t nb, const q8_32 *const *x, float out[][16]);
/* Two tiles t and u (the next sixteen columns) against four rows (MAX_ROWS) where q32_pairs_on (AVX-512 VNNI):
 * out the first tile's, out2 the second's; the same bits as q32_tile_rows on each. */
int q32_pairs_on(void);
void q32_pair_rows(int type, const uint8_t *t, const uint8_t *u, int64_t nb, const q8_32 *const *x, float out[][16],
                   float out2[][16]);
void q32_dequantize_row(int type, const uint8_t *w, int64_t row, int64_t nb, float *y);
void q32_use_avx512(int on);
/* AMX (gguf_amx.c): rows 1..AMX_MAX_ROWS (gguf_amx_tiles.h) of X at x, x + nb, ... (one q8_32 array) against a tile, where
 * q32_use_amx turned it on (q32_amx_on); the same bits as q32_tile_rows. ``images``: NULL, or the tile's B tiles unpacked
 * once by q32_amx_images (q32_amx_image_bytes a block; none for Q8_0, whose B is its codes as stored), for many rows. */
int q32_use_amx(int mode);  /* an amx_state */
int q32_amx_on(void);
/* AMX_ON where an AMX mode (kiln_gguf_use_amx's) may be tried here, or why not (with arch_prctl's errno in
 * *error where Linux refused the tile state) */
int q32_amx_available(int mode, int *error);
void q32_amx_rows(int type, int rows, const uint8_t *t, const uint8_t *images, int64_t nb, const q8_32 *x, float out[][16]);
#define Q32_IMAGE_BYTES 512  /* a block's B tile: 8 rows of 64 bytes */
size_t q32_amx_image_bytes(int type);
void q32_amx_images(int type, const uint8_t *t, int64_t nb, uint8_t *images);

#endif
