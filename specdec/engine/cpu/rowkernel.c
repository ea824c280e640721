/* The CPU tier's row kernel (kernel.py builds and loads it): y = x w for a few float32 rows.

   y[m][n] = sum over k of x[m][k] w[k][n], with w packed once at load into panels of PW columns,
   p[n / PW][k][PW] (the last panel padded with zeros), so a panel is read as one sequential stream.
   Each output is one chain of fused multiply-adds over k in ascending order, starting from zero,
   whatever the row count, the row's place and the column's panel: a row's numbers never depend on
   its batch-mates. Up to ROWS rows share each read of a panel, so a round of a few rows costs
   about what one row costs; more rows take further blocks over the panel while it is in cache.
   With OpenMP, `threads` threads share the panels out: a panel's columns are all one thread's, so
   the numbers are the same at any thread count.

   row_product_bf16 reads a panel packed in bfloat16 (the float32 weight's upper half) and widens
   each value back to float32 before the same fused multiply-adds: for a weight whose values are
   all bfloat16 values (a bf16 checkpoint run in float32), that is exact, bitwise row_product's
   numbers, at half the bytes to stream. */
#include <immintrin.h>
#include <stdint.h>

#define V 2            /* 8-float vectors per panel */
#define PW (8 * V)     /* columns per panel */
#define ROWS 6         /* rows that share a read of the panel: ROWS * V accumulators, of 16 registers */
#define AHEAD 4096     /* bytes of the panel prefetched ahead of the one read */

/* Eight weights from a panel of float32 (half = 0) or of bfloat16 (half = 1), as float32. */
static inline __attribute__((always_inline)) __m256 weights(const char *q, int half) {
  if (half)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)q)), 16));
  return _mm256_loadu_ps((const float *)q);
}

static inline __attribute__((always_inline)) void block(const float *x, const char *panel, float *y, int64_t rows, int64_t K,
                                                        int64_t N, int64_t n0, int half) {
  const int64_t size = half ? 2 : 4; /* bytes a weight */
  __m256 acc[ROWS][V];
  _Pragma("GCC unroll 8") for (int64_t r = 0; r < rows; r++)
    _Pragma("GCC unroll 8") for (int v = 0; v < V; v++) acc[r][v] = _mm256_setzero_ps();
  const char *q = panel;
  for (int64_t k = 0; k < K; k++, q += PW * size) {
    _mm_prefetch(q + AHEAD, _MM_HINT_T0);
    __m256 w[V];
    _Pragma("GCC unroll 8") for (int v = 0; v < V; v++) w[v] = weights(q + 8 * v * size, half);
    _Pragma("GCC unroll 8") for (int64_t r = 0; r < rows; r++) {
      __m256 b = _mm256_broadcast_ss(x + r * K + k);
      _Pragma("GCC unroll 8") for (int v = 0; v < V; v++) acc[r][v] = _mm256_fmadd_ps(b, w[v], acc[r][v]);
    }
  }
  /* Every index of acc is a constant once unrolled, so the accumulators stay in registers. */
  float t[ROWS][PW];
  _Pragma("GCC unroll 8") for (int64_t r = 0; r < rows; r++)
    _Pragma("GCC unroll 8") for (int v = 0; v < V; v++) _mm256_storeu_ps(t[r] + 8 * v, acc[r][v]);
  int64_t cols = N - n0 < PW ? N - n0 : PW;
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) y[r * N + n0 + c] = t[r][c];
}

int64_t panel_width(void) { return PW; }

/* 1 where built with OpenMP (the kernels then take `threads`), else 0. */
int threaded(void) {
#ifdef _OPENMP
  return 1;
#else
  return 0;
#endif
}

/* Panel j of the product: its columns for every row, in blocks of up to ROWS rows. */
static inline __attribute__((always_inline)) void panel(const float *x, const char *p, float *y, int64_t M, int64_t K, int64_t N,
                                                        int64_t j, int half) {
  const char *pj = p + j * K * PW * (half ? 2 : 4);
  for (int64_t m = 0; m < M; m += ROWS) {
    const float *xm = x + m * K;
    float *ym = y + m * N;
    switch (M - m < ROWS ? M - m : ROWS) {
      case 6: block(xm, pj, ym, 6, K, N, j * PW, half); break;
      case 5: block(xm, pj, ym, 5, K, N, j * PW, half); break;
      case 4: block(xm, pj, ym, 4, K, N, j * PW, half); break;
      case 3: block(xm, pj, ym, 3, K, N, j * PW, half); break;
      case 2: block(xm, pj, ym, 2, K, N, j * PW, half); break;
      default: block(xm, pj, ym, 1, K, N, j * PW, half); break;
    }
  }
}

/* The same products with AVX-512, where the CPU has it (`avx512`): a panel's 16 columns are one
   512-bit register, so ROWS512 rows share each read of it and a row takes half the instructions.
   Every output is still one chain of fused multiply-adds over k in ascending order from zero, so
   the numbers are bitwise the AVX2 code's. */
#define ROWS512 12

__attribute__((target("avx512f"))) static inline __attribute__((always_inline)) void block512(const float *x, const char *panel, float *y,
                                                                                             int64_t rows, int64_t K, int64_t N,
                                                                                             int64_t n0, int half) {
  const int64_t size = half ? 2 : 4;
  __m512 acc[ROWS512];
  _Pragma("GCC unroll 12") for (int64_t r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
  const char *q = panel;
  for (int64_t k = 0; k < K; k++, q += PW * size) {
    _mm_prefetch(q + AHEAD, _MM_HINT_T0);
    __m512 w = half ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)q)), 16))
                    : _mm512_loadu_ps((const float *)q);
    _Pragma("GCC unroll 12") for (int64_t r = 0; r < rows; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * K + k]), w, acc[r]);
  }
  int64_t cols = N - n0 < PW ? N - n0 : PW;
  __mmask16 keep = (__mmask16)((1u << cols) - 1);
  _Pragma("GCC unroll 12") for (int64_t r = 0; r < rows; r++) _mm512_mask_storeu_ps(y + r * N + n0, keep, acc[r]);
}

__attribute__((target("avx512f"))) static void product512(const float *x, const char *p, float *y, int64_t M, int64_t K, int64_t N,
                                                          int threads, int half) {
  (void)threads;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t j = 0; j < (N + PW - 1) / PW; j++) {
    const char *pj = p + j * K * PW * (half ? 2 : 4);
    for (int64_t m = 0; m < M; m += ROWS512) {
      const float *xm = x + m * K;
      float *ym = y + m * N;
      switch (M - m < ROWS512 ? M - m : ROWS512) { /* each count a constant: the accumulators in registers */
        case 12: block512(xm, pj, ym, 12, K, N, j * PW, half); break;
        case 11: block512(xm, pj, ym, 11, K, N, j * PW, half); break;
        case 10: block512(xm, pj, ym, 10, K, N, j * PW, half); break;
        case 9: block512(xm, pj, ym, 9, K, N, j * PW, half); break;
        case 8: block512(xm, pj, ym, 8, K, N, j * PW, half); break;
        case 7: block512(xm, pj, ym, 7, K, N, j * PW, half); break;
        case 6: block512(xm, pj, ym, 6, K, N, j * PW, half); break;
        case 5: block512(xm, pj, ym, 5, K, N, j * PW, half); break;
        case 4: block512(xm, pj, ym, 4, K, N, j * PW, half); break;
        case 3: block512(xm, pj, ym, 3, K, N, j * PW, half); break;
        case 2: block512(xm, pj, ym, 2, K, N, j * PW, half); break;
        default: block512(xm, pj, ym, 1, K, N, j * PW, half); break;
      }
    }
  }
}

static int wide = -1; /* the AVX-512 products: -1 until asked (then whether the CPU and the OS have AVX-512F) */

/* Whether the products run the AVX-512 code: on = 0 or 1 sets it (1 only where the CPU has it), -1 asks. */
int avx512(int on) {
  if (wide < 0 || on >= 0) {
    __builtin_cpu_init();
    wide = on != 0 && __builtin_cpu_supports("avx512f");
  }
  return wide;
}

/* x: M x K, row-major; p: the packed weight (float32, or bfloat16 for row_product_bf16); y: M x N, row-major.
   Each has its own parallel loop, so that the weight type is a constant in the code OpenMP outlines. */
void row_product(const float *x, const void *p, float *y, int64_t M, int64_t K, int64_t N, int threads) {
  (void)threads;
  if (avx512(-1)) {
    product512(x, (const char *)p, y, M, K, N, threads, 0);
    return;
  }
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t j = 0; j < (N + PW - 1) / PW; j++) panel(x, (const char *)p, y, M, K, N, j, 0);
}

void row_product_bf16(const float *x, const void *p, float *y, int64_t M, int64_t K, int64_t N, int threads) {
  (void)threads;
  if (avx512(-1)) {
    product512(x, (const char *)p, y, M, K, N, threads, 1);
    return;
  }
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t j = 0; j < (N + PW - 1) / PW; j++) panel(x, (const char *)p, y, M, K, N, j, 1);
}
