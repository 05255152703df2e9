/* The weight-only int4 and int8 matmuls of the CPU path: out = x @ W.T with W read in place as
 * 4-bit codes, multiplied much as llama.cpp multiplies its Q4 blocks: the activations quantized per
 * group of 32 (one float scale each, their exact float sum kept), integer dot products of 64
 * weights per instruction (AVX512-VNNI), one float multiply-add per group of 32 per row. Unlike
 * llama.cpp's one int8 digit, each activation is two (the second the first's remainder):
 * ~15 bits, finer than bfloat16's 8, where one digit moved SmolLM2's log-probabilities by 0.2.
 *
 * Layout (data_plane/models/int4_blocks.py builds it): output rows in blocks of 16, input columns
 * in groups of 32, w = q * scale + offset with q in 0..15.
 * - codes [N / 16, K / 32, 4, 16, 4] bytes: for column quarter c (8 columns) of group g, row r
 *   of the block holds 4 bytes, byte i = q[k0 + i] | q[k0 + 4 + i] << 4 with k0 = 32 g + 8 c:
 *   one 64-byte vector per quarter, a 32-bit lane per row.
 * - scales [N / 16, K / 32, 2, 16] bfloat16 bits: the block's 16 scales, then 16 offsets.
 * For row r and group g: sum_k w_k x_k = scale * sum_k q_k x_k + offset * sum_k x_k, and
 * sum_k q_k x_k ~ x_scale * sum_k q_k (codes_k + fine_k / 254), two integer dot products.
 *
 * int8_matmul multiplies an int8 weight (one scale per row, the lm_head's) the same way, its
 * layout with eight 4-column eighths per group instead of four 8-column quarters.
 *
 * Row blocks are shared over the OpenMP pool (torch's own: the process has one libgomp). Built
 * with cpu_attention.c into one library by data_plane/models/cpu_kernels.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define INT4_VNNI 1
#endif

#define GROUP 32
#define BLOCK_ROWS 16
#define ROW_TILE 8                      /* activation rows per pass over a weight block */
#define MIN_WEIGHTS_PER_THREAD (1 << 17) /* weights x rows: below this one thread does all */

static inline float bf16_bits_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float out;
    memcpy(&out, &wide, sizeof out);
    return out;
}

static inline uint16_t float_to_bf16_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16); /* finite values only */
}

/* 1 where int4_matmul computes here (AVX512-VNNI), else 0. */
int int4_matmul_available(void) {
#ifdef INT4_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifdef INT4_VNNI
/* x ~ scale * (codes + fine / FINE_STEPS) per group of 32: two int8 digits per value. */
#define FINE_STEPS 254.0f
struct quantized_x {
    int8_t *codes, *fine; /* [m, k] each */
    float *scales;        /* [m, k / GROUP] */
    float *sums;          /* [m, k / GROUP]: the exact float sums */
    int32_t *digit_sums;  /* [m, k / GROUP, 2]: the sums of the codes and of the fine digits */
};

/* Row `row` of x in two int8 digits per group of 32: codes = round(x / scale) with scale =
 * max |x| / 127, then the remainder (at most half a step) in steps of scale / FINE_STEPS. */
static void quantize_row(const float *x, int64_t k, int64_t row, struct quantized_x *q) {
    for (int64_t g = 0; g < k / GROUP; ++g) {
        const float *v = x + row * k + g * GROUP;
        float amax = 0.0f, sum = 0.0f;
        for (int i = 0; i < GROUP; ++i) {
            amax = fmaxf(amax, fabsf(v[i]));
            sum += v[i];
        }
        if (sum != sum) amax = sum; /* a NaN (fmaxf skips it): the group's scale carries it */
        float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t *codes = q->codes + row * k + g * GROUP, *fine = q->fine + row * k + g * GROUP;
        int32_t code_sum = 0, fine_sum = 0;
        for (int i = 0; i < GROUP; ++i) {
            float steps = inv > 0.0f ? v[i] * inv : 0.0f, coarse = rintf(steps);
            codes[i] = (int8_t)coarse;
            fine[i] = (int8_t)rintf((steps - coarse) * FINE_STEPS);
            code_sum += codes[i];
            fine_sum += fine[i];
        }
        q->scales[row * (k / GROUP) + g] = scale;
        q->sums[row * (k / GROUP) + g] = sum;
        q->digit_sums[2 * (row * (k / GROUP) + g)] = code_sum;
        q->digit_sums[2 * (row * (k / GROUP) + g) + 1] = fine_sum;
    }
}

static inline __m512 bf16x16_to_f32(const uint16_t *bits) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)bits));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

static inline __m512i broadcast_4_bytes(const int8_t *bytes) {
    int32_t word;
    memcpy(&word, bytes, sizeof word);
    return _mm512_set1_epi32(word);
}

/* Row block `b` for activation rows m0 .. m0 + mt (mt <= ROW_TILE). */
static void int4_block(const struct quantized_x *q, const uint8_t *codes, const uint16_t *scales,
                       float *out, int64_t b, int64_t m0, int64_t mt, int64_t k, int64_t n) {
    const __m512i low = _mm512_set1_epi8(15);
    int64_t groups = k / GROUP;
    __m512 acc[ROW_TILE];
    for (int t = 0; t < ROW_TILE; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *block = codes + (b * groups + g) * 4 * 64;
        __m512i lo[4], hi[4];
        for (int c = 0; c < 4; ++c) {
            __m512i bytes = _mm512_loadu_si512((const void *)(block + 64 * c));
            lo[c] = _mm512_and_si512(bytes, low);
            hi[c] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
        }
        const uint16_t *pairs = scales + (b * groups + g) * 2 * BLOCK_ROWS;
        __m512 scale = bf16x16_to_f32(pairs), offset = bf16x16_to_f32(pairs + BLOCK_ROWS);
        for (int64_t t = 0; t < mt; ++t) {
            int64_t row = m0 + t;
            const int8_t *xq = q->codes + row * k + g * GROUP, *xf = q->fine + row * k + g * GROUP;
            __m512i dot = _mm512_setzero_si512(), dot_fine = _mm512_setzero_si512();
            for (int c = 0; c < 4; ++c) {
                dot = _mm512_dpbusd_epi32(dot, lo[c], broadcast_4_bytes(xq + 8 * c));
                dot = _mm512_dpbusd_epi32(dot, hi[c], broadcast_4_bytes(xq + 8 * c + 4));
                dot_fine = _mm512_dpbusd_epi32(dot_fine, lo[c], broadcast_4_bytes(xf + 8 * c));
                dot_fine =
                    _mm512_dpbusd_epi32(dot_fine, hi[c], broadcast_4_bytes(xf + 8 * c + 4));
            }
            __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_fine),
                                          _mm512_set1_ps(1.0f / FINE_STEPS),
                                          _mm512_cvtepi32_ps(dot));
            __m512 x_scale = _mm512_set1_ps(q->scales[row * groups + g]);
            acc[t] = _mm512_fmadd_ps(both, _mm512_mul_ps(scale, x_scale), acc[t]);
            acc[t] = _mm512_fmadd_ps(offset, _mm512_set1_ps(q->sums[row * groups + g]), acc[t]);
        }
    }
    for (int64_t t = 0; t < mt; ++t)
        _mm512_storeu_ps(out + (m0 + t) * n + b * BLOCK_ROWS, acc[t]);
}

/* Row block `b` of an int8 weight for activation rows m0 .. m0 + mt (mt <= ROW_TILE). The codes
 * are offset by 128 (u = q + 128, unsigned for VNNI): sum u x - 128 sum x, in integers per group
 * from the activations' digit sums, so the offset adds no error. */
static void int8_block(const struct quantized_x *q, const uint8_t *codes, const uint16_t *scales,
                       float *out, int64_t b, int64_t m0, int64_t mt, int64_t k, int64_t n) {
    int64_t groups = k / GROUP;
    __m512 acc[ROW_TILE];
    for (int t = 0; t < ROW_TILE; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t *block = codes + (b * groups + g) * 8 * 64;
        __m512i w[8];
        for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512((const void *)(block + 64 * c));
        for (int64_t t = 0; t < mt; ++t) {
            int64_t row = m0 + t;
            const int8_t *xq = q->codes + row * k + g * GROUP, *xf = q->fine + row * k + g * GROUP;
            const int32_t *digit_sums = q->digit_sums + 2 * (row * groups + g);
            __m512i dot = _mm512_set1_epi32(-128 * digit_sums[0]);
            __m512i dot_fine = _mm512_set1_epi32(-128 * digit_sums[1]);
            for (int c = 0; c < 8; ++c) {
                dot = _mm512_dpbusd_epi32(dot, w[c], broadcast_4_bytes(xq + 4 * c));
                dot_fine = _mm512_dpbusd_epi32(dot_fine, w[c], broadcast_4_bytes(xf + 4 * c));
            }
            __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_fine),
                                          _mm512_set1_ps(1.0f / FINE_STEPS),
                                          _mm512_cvtepi32_ps(dot));
            acc[t] = _mm512_fmadd_ps(both, _mm512_set1_ps(q->scales[row * groups + g]), acc[t]);
        }
    }
    __m512 scale = bf16x16_to_f32(scales + b * BLOCK_ROWS);
    for (int64_t t = 0; t < mt; ++t)
        _mm512_storeu_ps(out + (m0 + t) * n + b * BLOCK_ROWS, _mm512_mul_ps(acc[t], scale));
}

static int threads_for(int64_t work, int64_t units, int64_t num_threads) {
    int64_t threads = work / MIN_WEIGHTS_PER_THREAD;
    threads = threads < num_threads ? threads : num_threads;
    threads = threads < units ? threads : units;
    return threads < 1 ? 1 : (int)threads;
}
#endif

/* The weight [n, k] in bfloat16 (round to nearest even) into `out`, for a dense matmul of many
 * rows (prefill chunks), where one pass over the weights serves them all. Portable C. */
void int4_dequantize(const uint8_t *codes, const uint16_t *scales, uint16_t *out, int64_t n,
                     int64_t k, int64_t num_threads) {
    int64_t groups = k / GROUP, num_blocks = n / BLOCK_ROWS;
    int threads = (int)(num_threads < num_blocks ? num_threads : num_blocks);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (int64_t b = 0; b < num_blocks; ++b) {
        for (int64_t g = 0; g < groups; ++g) {
            const uint8_t *block = codes + (b * groups + g) * 4 * 64;
            const uint16_t *pairs = scales + (b * groups + g) * 2 * BLOCK_ROWS;
            for (int r = 0; r < BLOCK_ROWS; ++r) {
                float scale = bf16_bits_to_float(pairs[r]);
                float offset = bf16_bits_to_float(pairs[BLOCK_ROWS + r]);
                uint16_t *row = out + (b * BLOCK_ROWS + r) * k + g * GROUP;
                for (int c = 0; c < 4; ++c)
                    for (int i = 0; i < 4; ++i) {
                        uint8_t byte = block[64 * c + 4 * r + i];
                        row[8 * c + i] = float_to_bf16_bits((float)(byte & 15) * scale + offset);
                        row[8 * c + 4 + i] = float_to_bf16_bits((float)(byte >> 4) * scale + offset);
                    }
            }
        }
    }
}

#ifdef INT4_VNNI
typedef void (*block_fn)(const struct quantized_x *, const uint8_t *, const uint16_t *, float *,
                         int64_t, int64_t, int64_t, int64_t, int64_t);

/* x quantized once, then `block` over every row block: 0, or -2 when out of memory. */
static int quantized_matmul(block_fn block, const float *x, const uint8_t *codes,
                            const uint16_t *scales, float *out, int64_t m, int64_t n, int64_t k,
                            int64_t num_threads) {
    size_t groups = (size_t)(m * k / GROUP);
    struct quantized_x q = {malloc((size_t)(m * k)), malloc((size_t)(m * k)),
                            malloc(sizeof(float) * groups), malloc(sizeof(float) * groups),
                            malloc(2 * sizeof(int32_t) * groups)};
    int status = 0;
    if (!q.codes || !q.fine || !q.scales || !q.sums || !q.digit_sums) {
        status = -2;
    } else {
        int64_t num_blocks = n / BLOCK_ROWS;
        int threads = threads_for(m * n * k, num_blocks, num_threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
        {
#pragma omp for schedule(static)
            for (int64_t row = 0; row < m; ++row) quantize_row(x, k, row, &q);
#pragma omp for schedule(static)
            for (int64_t b = 0; b < num_blocks; ++b)
                for (int64_t m0 = 0; m0 < m; m0 += ROW_TILE)
                    block(&q, codes, scales, out, b, m0, m - m0 < ROW_TILE ? m - m0 : ROW_TILE, k,
                          n);
        }
    }
    free(q.codes);
    free(q.fine);
    free(q.scales);
    free(q.sums);
    free(q.digit_sums);
    return status;
}
#endif

/* out [m, n] = x [m, k] @ W.T, W [n, k] in the layout above (n a multiple of 16, k of 32).
 * Returns 0, -1 where int4_matmul_available() is 0, -2 when out of memory (nothing done). */
int int4_matmul(const float *x, const uint8_t *codes, const uint16_t *scales, float *out,
                int64_t m, int64_t n, int64_t k, int64_t num_threads) {
#ifdef INT4_VNNI
    return quantized_matmul(int4_block, x, codes, scales, out, m, n, k, num_threads);
#else
    (void)x, (void)codes, (void)scales, (void)out, (void)m, (void)n, (void)k, (void)num_threads;
    return -1;
#endif
}

/* The same for an int8 weight: codes [n / 16, k / 32, 8, 16, 4] bytes (row r of the block holds
 * 4 bytes of group g's column eighth c: columns 32 g + 4 c .. + 3), each the code plus 128;
 * scales [n] bfloat16 bits, one per row (data_plane/models/int8_blocks.py). */
int int8_matmul(const float *x, const uint8_t *codes, const uint16_t *scales, float *out,
                int64_t m, int64_t n, int64_t k, int64_t num_threads) {
#ifdef INT4_VNNI
    return quantized_matmul(int8_block, x, codes, scales, out, m, n, k, num_threads);
#else
    (void)x, (void)codes, (void)scales, (void)out, (void)m, (void)n, (void)k, (void)num_threads;
    return -1;
#endif
}
