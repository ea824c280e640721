/* The CPU tier's query attention (kernel.py builds it with rowkernel.c into one library): every
   (query, head) of a pass's short inputs is its own problem, as in the per-query layout, but
   without SDPA's per-problem set-up, which costs more than the arithmetic at one query.

   out = softmax_j(scale * q . k_j) v_j over the query's visible keys j only, in ascending j: each
   score is eight lanes of FMA chains over the head dimension reduced in a fixed order, the
   exponentials are summed in a fixed order, and each output element is one FMA chain over the
   visible keys. A query's numbers depend only on
   its own vector and the keys and values it sees, never on the batch, the row count, the keys'
   padding or the other queries. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define KEYS 4 /* keys scored at once: independent FMA chains */

static inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* e^x for x <= 0: Cody-Waite reduction by ln 2 and a degree-5 polynomial (the Cephes coefficients).
   A NaN stays NaN (max returns its second operand where either is NaN): a failed score shows. */
static inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* One (query, head): m visible keys at idx, rows `row` floats apart; s: scratch of m + 8 floats.
   DV: the head dimension in 8-float vectors (a constant where inlined). */
static inline __attribute__((always_inline)) void head(const float *q, const float *k, const float *v, const int32_t *idx,
                                                       int64_t m, int64_t row, float scale, float *s, float *o, int64_t DV) {
  float mx = -INFINITY;
  int64_t t = 0;
  for (; t + KEYS <= m; t += KEYS) {
    __m256 acc[KEYS];
    _Pragma("GCC unroll 4") for (int u = 0; u < KEYS; u++) acc[u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < DV; d++) {
      __m256 qd = _mm256_loadu_ps(q + 8 * d);
      _Pragma("GCC unroll 4") for (int u = 0; u < KEYS; u++)
        acc[u] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + idx[t + u] * row + 8 * d), acc[u]);
    }
    _Pragma("GCC unroll 4") for (int u = 0; u < KEYS; u++) {
      s[t + u] = hsum(acc[u]) * scale;
      mx = s[t + u] > mx ? s[t + u] : mx;
    }
  }
  for (; t < m; t++) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < DV; d++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * d), _mm256_loadu_ps(k + idx[t] * row + 8 * d), acc);
    s[t] = hsum(acc) * scale;
    mx = s[t] > mx ? s[t] : mx;
  }
  __m256 top = _mm256_set1_ps(mx), total = _mm256_setzero_ps();
  for (t = 0; t + 8 <= m; t += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), top));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  if (t < m) { /* the last few: the same exponential, summed one by one */
    float tail[8] = {0};
    for (int64_t u = t; u < m; u++) tail[u - t] = s[u] - mx;
    _mm256_storeu_ps(tail, exp8(_mm256_loadu_ps(tail)));
    for (int64_t u = t; u < m; u++) sum += s[u] = tail[u - t];
  }
  __m256 acc[32];
  for (int64_t d = 0; d < DV; d++) acc[d] = _mm256_setzero_ps();
  for (t = 0; t < m; t++) {
    __m256 p = _mm256_set1_ps(s[t]);
    const float *vj = v + idx[t] * row;
    for (int64_t d = 0; d < DV; d++) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * d), acc[d]);
  }
  __m256 inv = _mm256_set1_ps(m ? 1.0f / sum : 0.0f);
  for (int64_t d = 0; d < DV; d++) _mm256_storeu_ps(o + 8 * d, _mm256_mul_ps(acc[d], inv));
}

/* q: [B, n, H, D]; k, v: [B, L, Hkv, D]; visible: [B, n, L] (1: the query sees the key); out: [B, n, H, D].
   All row-major, float32; D a multiple of 8, at most 256; H a multiple of Hkv. With OpenMP,
   `threads` threads share the (query, head) problems out, each whole on one thread: the numbers
   are the same at any thread count. Returns 0, or -1 where scratch memory could not be had. */
int attend_queries(const float *q, const float *k, const float *v, const uint8_t *visible, float *out, int64_t B, int64_t n,
                   int64_t H, int64_t Hkv, int64_t D, int64_t L, float scale, int threads) {
  int64_t rep = H / Hkv, row = Hkv * D, problems = B * n * H;
  int failed = 0;
  (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
  {
    int32_t *idx = malloc((L + 1) * sizeof *idx); /* this thread's scratch */
    float *s = malloc((L + 8) * sizeof *s);
    failed |= !idx || !s;
    int64_t at = -1, m = 0; /* the query (b * n + i) whose visible keys idx holds, and their count */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < problems; t++) { /* (b, i, h) in row-major order: q and out at t * D */
      if (!idx || !s)
        continue;
      int64_t query = t / H, h = t % H, b = query / n;
      if (query != at) {
        const uint8_t *seen = visible + query * L;
        m = 0;
        for (int64_t j = 0; j < L; j++)
          if (seen[j]) idx[m++] = (int32_t)j;
        at = query;
      }
      const float *qh = q + t * D, *kh = k + b * L * row + (h / rep) * D, *vh = v + b * L * row + (h / rep) * D;
      float *o = out + t * D;
      switch (D) { /* the common head sizes with their vector count a constant: accumulators in registers */
        case 64: head(qh, kh, vh, idx, m, row, scale, s, o, 8); break;
        case 128: head(qh, kh, vh, idx, m, row, scale, s, o, 16); break;
        default: head(qh, kh, vh, idx, m, row, scale, s, o, D / 8); break;
      }
    }
    free(idx);
    free(s);
  }
  return failed ? -1 : 0;
}
