/* The weight-only int4 matmul of the CPU path: out = x @ W.T with W read in place as 4-bit
 * codes, multiplied much as llama.cpp multiplies its Q4 blocks: the activations quantized per
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
        float scale = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int8_t *codes = q->codes + row * k + g * GROUP, *fine = q->fine + row * k + g * GROUP;
        for (int i = 0; i < GROUP; ++i) {
            float steps = v[i] * inv, coarse = rintf(steps);
            codes[i] = (int8_t)coarse;
            fine[i] = (int8_t)rintf((steps - coarse) * FINE_STEPS);
        }
        q->scales[row * (k / GROUP) + g] = scale;
        q->sums[row * (k / GROUP) + g] = sum;
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

/* out [m, n] = x [m, k] @ W.T, W [n, k] in the layout above (n a multiple of 16, k of 32).
 * Returns 0, -1 where int4_matmul_available() is 0, -2 when out of memory (nothing done). */
int int4_matmul(const float *x, const uint8_t *codes, const uint16_t *scales, float *out,
                int64_t m, int64_t n, int64_t k, int64_t num_threads) {
#ifdef INT4_VNNI
    size_t group_bytes = sizeof(float) * (size_t)(m * k / GROUP);
    struct quantized_x q = {malloc((size_t)(m * k)), malloc((size_t)(m * k)), malloc(group_bytes),
                            malloc(group_bytes)};
    int status = 0;
    if (q.codes == NULL || q.fine == NULL || q.scales == NULL || q.sums == NULL) {
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
                    int4_block(&q, codes, scales, out, b, m0, m - m0 < ROW_TILE ? m - m0 : ROW_TILE,
                               k, n);
        }
    }
    free(q.codes);
    free(q.fine);
    free(q.scales);
    free(q.sums);
    return status;
#else
    (void)x, (void)codes, (void)scales, (void)out, (void)m, (void)n, (void)k, (void)num_threads;
    return -1;
#endif
}
