/* Decode attention over the block-first paged KV cache, read in place (the CPU path).
 *
 * One query token per sequence. The cache is viewed as rows of (kv_heads, head_dim) values;
 * token p of a sequence lives in block tables[p / block_size], and its K for the layer is row
 * block * rows_per_block + layer_offset + p % block_size, its V that row + block_size
 * (data_plane/models/attention.py describes the layout). Each (sequence, KV head) reads its
 * keys and values once for all the query heads of its group: scores, a softmax in float32,
 * then the weighted sum of the values. Nothing is gathered or padded.
 *
 * Built at first use by data_plane/models/cpu_kernels.py (cc -O3 -march=native) and called
 * through ctypes; the torch path stays the reference and the fallback.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_exp.h"

static inline float bf16_to_f32(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float out;
    memcpy(&out, &wide, sizeof out);
    return out;
}

/* Every attended token of sequence `i` in order, its K row (`v_offset` 0) or V row
 * (`v_offset` block_size) at element `at`: the block is looked up once per block. */
#define FOR_EACH_ROW(v_offset, BODY)                                                          \
    for (int64_t b = first / block_size; b * block_size < len; ++b) {                        \
        int64_t base = table[b] * rows_per_block + layer_offset + (v_offset);                 \
        int64_t lo = b * block_size > first ? b * block_size : first;                         \
        int64_t hi = (b + 1) * block_size < len ? (b + 1) * block_size : len;                 \
        for (int64_t p = lo; p < hi; ++p) {                                                   \
            int64_t t = p - first;                                                            \
            int64_t at = (base + p - b * block_size) * row_elems;                             \
            BODY                                                                              \
        }                                                                                     \
    }

struct decode_args {
    const float *q;
    const void *cache;
    const int64_t *tables, *lens;
    int64_t width, num_heads, num_kv_heads, head_dim, block_size, rows_per_block, layer_offset,
        window;
    float scale;
    float *out;
};

/* One sequence's attention; `scores` holds num_heads x its context floats. T is the cache's
 * element type, LOAD turns one into a float. */
#define DEFINE_DECODE_SEQUENCE(NAME, T, LOAD)                                                 \
    static void NAME(const struct decode_args *a, int64_t i, float *scores) {                 \
        int64_t head_dim = a->head_dim, block_size = a->block_size;                           \
        int64_t num_kv = a->num_kv_heads, group = a->num_heads / num_kv;                      \
        int64_t row_elems = num_kv * head_dim;                                                \
        int64_t rows_per_block = a->rows_per_block, layer_offset = a->layer_offset;           \
        int64_t len = a->lens[i];                                                             \
        int64_t first = (a->window > 0 && len > a->window) ? len - a->window : 0;             \
        int64_t count = len - first;                                                          \
        const int64_t *table = a->tables + i * a->width;                                      \
        const float *qs = a->q + i * a->num_heads * head_dim;                                 \
        float *os = a->out + i * a->num_heads * head_dim;                                     \
        const T *cache = (const T *)a->cache;                                                 \
        float scale = a->scale;                                                               \
        FOR_EACH_ROW(0, {                                                                     \
            for (int64_t kv = 0; kv < num_kv; ++kv) {                                         \
                const T *k = cache + at + kv * head_dim;                                      \
                for (int64_t g = 0; g < group; ++g) {                                         \
                    int64_t h = kv * group + g;                                               \
                    const float *qh = qs + h * head_dim;                                      \
                    float s = 0.0f;                                                           \
                    for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * LOAD(k[d]);           \
                    scores[h * count + t] = s * scale;                                        \
                }                                                                             \
            }                                                                                 \
        })                                                                                    \
        for (int64_t h = 0; h < a->num_heads; ++h) {                                          \
            float *sh = scores + h * count;                                                   \
            float top = -INFINITY, total = 0.0f;                                              \
            for (int64_t t = 0; t < count; ++t) top = sh[t] > top ? sh[t] : top;              \
            for (int64_t t = 0; t < count; ++t) {                                             \
                sh[t] = exp_approx(sh[t] - top);                                              \
                total += sh[t];                                                               \
            }                                                                                 \
            float inv = count > 0 ? 1.0f / total : 0.0f;                                      \
            for (int64_t t = 0; t < count; ++t) sh[t] *= inv;                                 \
        }                                                                                     \
        memset(os, 0, sizeof(float) * (size_t)(a->num_heads * head_dim));                     \
        FOR_EACH_ROW(block_size, {                                                            \
            for (int64_t kv = 0; kv < num_kv; ++kv) {                                         \
                const T *v = cache + at + kv * head_dim;                                      \
                for (int64_t g = 0; g < group; ++g) {                                         \
                    int64_t h = kv * group + g;                                               \
                    float w = scores[h * count + t];                                          \
                    float *oh = os + h * head_dim;                                            \
                    for (int64_t d = 0; d < head_dim; ++d) oh[d] += w * LOAD(v[d]);           \
                }                                                                             \
            }                                                                                 \
        })                                                                                    \
    }

#define LOAD_F32(x) (x)
DEFINE_DECODE_SEQUENCE(decode_sequence_f32, float, LOAD_F32)
DEFINE_DECODE_SEQUENCE(decode_sequence_bf16, uint16_t, bf16_to_f32)

#define MIN_WORK_PER_THREAD 2048 /* context tokens x heads: below this one thread does all */

/* Returns 0, or -1 when a workspace cannot be allocated. q and out: [n, num_heads, head_dim]
 * float32; cache: float32 (is_bf16 == 0) or bfloat16 rows; tables: [n, width] block ids;
 * lens: [n] context lengths including the new token; window: attend only to the last
 * `window` tokens (0: all). With enough work the sequences are shared out over up to
 * `num_threads` threads of the OpenMP pool (torch's own: the process has one libgomp). */
int paged_decode(const float *q, const void *cache, int is_bf16, const int64_t *tables,
                 const int64_t *lens, int64_t n, int64_t width, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 int64_t rows_per_block, int64_t layer_offset, int64_t window, float scale,
                 float *out, int64_t num_threads) {
    struct decode_args args = {q,          cache,      tables,       lens,
                               width,      num_heads,  num_kv_heads, head_dim,
                               block_size, rows_per_block, layer_offset, window,
                               scale,      out};
    int64_t work = 0, max_len = 1;
    for (int64_t i = 0; i < n; ++i) {
        work += lens[i] * num_heads;
        max_len = lens[i] > max_len ? lens[i] : max_len;
    }
    int64_t threads = work / MIN_WORK_PER_THREAD;
    threads = threads < num_threads ? threads : num_threads;
    threads = threads < n ? threads : n;
    if (threads < 1) threads = 1;
    int status = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : status)
    {
        float *scores = malloc(sizeof(float) * (size_t)(num_heads * max_len));
        if (scores == NULL) status = -1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n; ++i) {
            if (scores == NULL) continue;
            if (is_bf16)
                decode_sequence_bf16(&args, i, scores);
            else
                decode_sequence_f32(&args, i, scores);
        }
        free(scores);
    }
    return status;
}

/* RMSNorm of `rows` rows of `dim` float32 values: out = x / sqrt(mean(x^2) + eps) * weight.
 * With `residual` (may be NULL): x += residual first, in place (the decoder's residual
 * stream), and the sum is normalized. */
void rms_norm(float *restrict x, const float *restrict residual, const float *restrict weight,
              float *restrict out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; ++r) {
        float *xr = x + r * dim;
        if (residual != NULL) {
            const float *rr = residual + r * dim;
            for (int64_t i = 0; i < dim; ++i) xr[i] += rr[i];
        }
        float squares = 0.0f;
        for (int64_t i = 0; i < dim; ++i) squares += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(squares / (float)dim + eps);
        float *orow = out + r * dim;
        for (int64_t i = 0; i < dim; ++i) orow[i] = xr[i] * inv * weight[i];
    }
}

/* RoPE (half rotation, HF layout) of the q and k heads of each token's qkv row, in place, then
 * k and v stored into the float32 cache: token j's K into row slot_rows[j] + layer_offset, its
 * V `block_size` rows further. qkv: [n, row_stride] float32 holding num_q_heads, then
 * num_kv_heads k, then num_kv_heads v heads of head_dim; cos, sin: [n, head_dim / 2]. */
void rope_write_kv(float *restrict qkv, int64_t n, int64_t row_stride, int64_t num_q_heads,
                   int64_t num_kv_heads, int64_t head_dim, const float *restrict cos,
                   const float *restrict sin, float *restrict cache,
                   const int64_t *restrict slot_rows, int64_t layer_offset, int64_t block_size) {
    int64_t half = head_dim / 2, row_elems = num_kv_heads * head_dim;
    for (int64_t j = 0; j < n; ++j) {
        float *row = qkv + j * row_stride;
        const float *c = cos + j * half, *s = sin + j * half;
        for (int64_t h = 0; h < num_q_heads + num_kv_heads; ++h) {
            float *x = row + h * head_dim;
            for (int64_t d = 0; d < half; ++d) {
                float x1 = x[d], x2 = x[d + half];
                x[d] = x1 * c[d] - x2 * s[d];
                x[d + half] = x2 * c[d] + x1 * s[d];
            }
        }
        float *k_row = cache + (slot_rows[j] + layer_offset) * row_elems;
        float *v_row = k_row + block_size * row_elems;
        memcpy(k_row, row + num_q_heads * head_dim, sizeof(float) * (size_t)row_elems);
        memcpy(v_row, row + (num_q_heads + num_kv_heads) * head_dim,
               sizeof(float) * (size_t)row_elems);
    }
}
