/* One decoder layer for a batch of decodes on the CPU, in one call: the steps the model's
 * Python runs op by op (data_plane/models/llama.py: DecoderLayer), each by the kernel that
 * serves it there (cpu_attention.c, cpu_matmul.c), with no interpreter between them. At one
 * stream the interpreter's ~30 calls per layer cost as much as the layer's arithmetic.
 *
 * residual += x (or residual = x for the first layer), h = RMSNorm(residual) * norm1;
 * qkv = h @ Wqkv.T (+ bias); RoPE on q and k, k and v into the cache; attn = decode attention;
 * residual += attn @ Wo.T, h = RMSNorm(residual) * norm2; gate, up = h @ Wgu.T;
 * out = (silu(gate) * up) @ Wd.T. Float32 activations and cache, int4 weights in
 * int4_blocks' layout. Built with the other kernels into one library (cpu_kernels.py).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_exp.h"

int int4_matmul(const float *x, const uint8_t *codes, const uint16_t *scales, float *out,
                int64_t m, int64_t n, int64_t k, int64_t num_threads);
void rms_norm(float *x, const float *residual, const float *weight, float *out, int64_t rows,
              int64_t dim, float eps);
void rope_write_kv(float *qkv, int64_t n, int64_t row_stride, int64_t num_q_heads,
                   int64_t num_kv_heads, int64_t head_dim, const float *cos, const float *sin,
                   float *cache, const int64_t *slot_rows, int64_t layer_offset,
                   int64_t block_size);
int paged_decode(const float *q, const void *cache, int is_bf16, const int64_t *tables,
                 const int64_t *lens, int64_t n, int64_t width, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 int64_t rows_per_block, int64_t layer_offset, int64_t window, float scale,
                 float *out, int64_t num_threads);

struct int4_weight {
    const uint8_t *codes;
    const uint16_t *scales;
    const float *bias; /* [n] or NULL */
    int64_t n, k;
};

/* Mirrored by cpu_kernels.DecodeLayerArgs (ctypes): keep the two in the same order. */
struct decode_layer_args {
    const float *x;   /* [m, hidden]: the previous layer's output, or the embedding */
    float *residual;  /* [m, hidden]: the residual stream, updated in place */
    float *out;       /* [m, hidden]: this layer's MLP output */
    int64_t first;    /* 1: x is the embedding and `residual` already holds it */
    int64_t m, hidden, intermediate, num_heads, num_kv_heads, head_dim;
    const float *norm1, *norm2;
    float eps, scale;
    struct int4_weight qkv, o, gate_up, down;
    const float *cos, *sin; /* [m, head_dim / 2] */
    float *cache;
    const int64_t *slot_rows, *tables, *lens; /* [m], [m, width], [m] */
    int64_t layer_offset, block_size, width, rows_per_block, window, num_threads;
};

static int matmul(const struct decode_layer_args *a, const struct int4_weight *w, const float *x,
                  float *y) {
    int status = int4_matmul(x, w->codes, w->scales, y, a->m, w->n, w->k, a->num_threads);
    if (status == 0 && w->bias != NULL)
        for (int64_t r = 0; r < a->m; ++r)
            for (int64_t i = 0; i < w->n; ++i) y[r * w->n + i] += w->bias[i];
    return status;
}

/* Returns 0, -1 where the int4 kernel does not compute here, -2 when out of memory. */
int decode_layer(const struct decode_layer_args *a) {
    int64_t m = a->m, hidden = a->hidden, q_width = a->num_heads * a->head_dim;
    int64_t widest = a->qkv.n > 2 * a->intermediate ? a->qkv.n : 2 * a->intermediate;
    float *h = malloc(sizeof(float) * (size_t)(m * hidden));
    float *wide = malloc(sizeof(float) * (size_t)(m * widest));
    float *q = malloc(sizeof(float) * (size_t)(m * q_width));
    float *attn = malloc(sizeof(float) * (size_t)(m * q_width));
    int status = (h && wide && q && attn) ? 0 : -2;
    if (status == 0) {
        rms_norm(a->residual, a->first ? NULL : a->x, a->norm1, h, m, hidden, a->eps);
        status = matmul(a, &a->qkv, h, wide);
    }
    if (status == 0) {
        rope_write_kv(wide, m, a->qkv.n, a->num_heads, a->num_kv_heads, a->head_dim, a->cos,
                      a->sin, a->cache, a->slot_rows, a->layer_offset, a->block_size);
        for (int64_t r = 0; r < m; ++r)
            memcpy(q + r * q_width, wide + r * a->qkv.n, sizeof(float) * (size_t)q_width);
        status = paged_decode(q, a->cache, 0, a->tables, a->lens, m, a->width, a->num_heads,
                              a->num_kv_heads, a->head_dim, a->block_size, a->rows_per_block,
                              a->layer_offset, a->window, a->scale, attn, a->num_threads) ? -2 : 0;
    }
    if (status == 0) status = matmul(a, &a->o, attn, a->out);
    if (status == 0) {
        rms_norm(a->residual, a->out, a->norm2, h, m, hidden, a->eps);
        status = matmul(a, &a->gate_up, h, wide);
    }
    if (status == 0) {
        int64_t inter = a->intermediate;
        for (int64_t r = 0; r < m; ++r) {
            const float *gate = wide + r * 2 * inter, *up = gate + inter;
            float *act = wide + r * inter; /* row r's product over row r's gate: read first */
            for (int64_t i = 0; i < inter; ++i) {
                float g = gate[i];
                act[i] = g / (1.0f + exp_approx(-g)) * up[i];
            }
        }
        status = matmul(a, &a->down, wide, a->out);
    }
    free(h);
    free(wide);
    free(q);
    free(attn);
    return status;
}
