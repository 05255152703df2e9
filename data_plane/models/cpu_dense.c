/* The float32 dense matmul of the CPU path for few rows (decode steps, the sampled rows' lm_head):
 * out = x @ W.T with W [n, k] row-major as torch stores a Linear's weight. BLAS sgemm is tuned
 * for large products; with a handful of rows it reads the weights at a fraction of the memory
 * bandwidth (MKL on an AMD EPYC: 7 rows x a 32000 x 512 lm_head in 13-33 ms, 2-6 ms here).
 *
 * Blocks of W_ROWS weight rows are shared over the OpenMP pool (torch's own); each block stays in
 * L1 while every tile of X_ROWS activation rows passes over it, so W is read from memory once and
 * the activations from cache. A tile keeps W_ROWS x X_ROWS vector accumulators of 16 lanes over
 * k (fp32 throughout), summed across lanes at the end. Built with the other CPU kernels by
 * data_plane/models/cpu_kernels.py.
 */
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#define DENSE_AVX512 1
#endif

/* 2 x 8 accumulators: 1.3-1.6x the 4 x 4 tile at 16-64 rows with the weights streamed from
 * memory, even at 1-8 rows; tiles of 24 or more accumulators spill (measured, AMD Zen 4). */
#define W_ROWS 2
#define X_ROWS 8
#define MIN_MACS_PER_THREAD (1 << 18)   /* multiply-adds: below this one thread does all */
/* Weight blocks ahead whose rows a tile prefetches into L1 as it goes: the rows come from memory
 * while this block computes (weights past a step's cache; 1.2-1.6x at 4-16 rows, 1.1-1.3x at 33;
 * a prefetch past the array's end is a no-op, never a fault). */
#define PREFETCH_BLOCKS 2

/* 1 where f32_matmul computes here (AVX-512), else 0. */
int f32_matmul_available(void) {
#ifdef DENSE_AVX512
    return 1;
#else
    return 0;
#endif
}

#ifdef DENSE_AVX512
static inline __m512 load_k(const float *row, int64_t k, int64_t kk) {
    if (kk + 16 <= k) return _mm512_loadu_ps(row + kk);
    return _mm512_maskz_loadu_ps((__mmask16)((1u << (k - kk)) - 1u), row + kk);
}

/* `rows` (1..X_ROWS, a constant where inlined) activation rows from m0 against one weight block. */
static inline __attribute__((always_inline)) void dense_tile(const int rows,
                                                             const float *const *w_rows,
                                                             const float *x, int64_t m0,
                                                             float *out, int64_t n0, int64_t n,
                                                             int64_t k) {
    __m512 acc[W_ROWS][X_ROWS];
    for (int r = 0; r < W_ROWS; ++r)
        for (int i = 0; i < rows; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk += 16) {
        __m512 w[W_ROWS];
        for (int r = 0; r < W_ROWS; ++r) {
            w[r] = load_k(w_rows[r], k, kk);
            _mm_prefetch((const char *)(w_rows[r] + PREFETCH_BLOCKS * W_ROWS * k + kk), _MM_HINT_T0);
        }
        for (int i = 0; i < rows; ++i) {
            __m512 xv = load_k(x + (m0 + i) * k, k, kk);
            for (int r = 0; r < W_ROWS; ++r) acc[r][i] = _mm512_fmadd_ps(w[r], xv, acc[r][i]);
        }
    }
    for (int i = 0; i < rows; ++i)
        for (int r = 0; r < W_ROWS && n0 + r < n; ++r)
            out[(m0 + i) * n + n0 + r] = _mm512_reduce_add_ps(acc[r][i]);
}

static void dense_block(const float *x, const float *w, float *out, int64_t block, int64_t m,
                        int64_t n, int64_t k) {
    const float *w_rows[W_ROWS];
    for (int r = 0; r < W_ROWS; ++r) {
        int64_t row = block * W_ROWS + r;
        w_rows[r] = w + (row < n ? row : n - 1) * k; /* past the end: read row n-1, not stored */
    }
    int64_t m0 = 0, n0 = block * W_ROWS;
    for (; m0 + X_ROWS <= m; m0 += X_ROWS) dense_tile(X_ROWS, w_rows, x, m0, out, n0, n, k);
    switch (m - m0) { /* the last rows: a constant count each, so the tile unrolls */
    case 1: dense_tile(1, w_rows, x, m0, out, n0, n, k); break;
    case 2: dense_tile(2, w_rows, x, m0, out, n0, n, k); break;
    case 3: dense_tile(3, w_rows, x, m0, out, n0, n, k); break;
    case 4: dense_tile(4, w_rows, x, m0, out, n0, n, k); break;
    case 5: dense_tile(5, w_rows, x, m0, out, n0, n, k); break;
    case 6: dense_tile(6, w_rows, x, m0, out, n0, n, k); break;
    case 7: dense_tile(7, w_rows, x, m0, out, n0, n, k); break;
    default: break;
    }
}
#endif

/* out [m, n] = x [m, k] @ W.T, W [n, k]; all float32, contiguous. Returns 0, or -1 where
 * f32_matmul_available() is 0 (nothing done). */
int f32_matmul(const float *x, const float *w, float *out, int64_t m, int64_t n, int64_t k,
               int64_t num_threads) {
#ifdef DENSE_AVX512
    int64_t num_blocks = (n + W_ROWS - 1) / W_ROWS;
    int64_t threads = m * n * k / MIN_MACS_PER_THREAD;
    threads = threads < num_threads ? threads : num_threads;
    threads = threads < num_blocks ? threads : num_blocks;
    threads = threads < 1 ? 1 : threads;
#pragma omp parallel for num_threads((int)threads) if (threads > 1) schedule(static)
    for (int64_t b = 0; b < num_blocks; ++b) dense_block(x, w, out, b, m, n, k);
    return 0;
#else
    (void)x, (void)w, (void)out, (void)m, (void)n, (void)k, (void)num_threads;
    return -1;
#endif
}
