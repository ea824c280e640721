/* The CPU tier's query attention (kernel.py builds it with rowkernel.c into one library): every
   (query, head) of a pass's short inputs is its own problem, as in the per-query layout, but
   without SDPA's per-problem set-up, which costs more than the arithmetic at one query.

   out = softmax_j(cap(scale * q . k_j)) v_j over the query's visible keys j only, in ascending j
   (cap(x) = softcap * tanh(x / softcap) for Gemma 2's logit soft-cap, else x): each
   score is eight lanes of FMA chains over the head dimension reduced in a fixed order, the
   exponentials are summed in a fixed order, and each output element is one FMA chain over the
   visible keys (a head of 8 or 16 floats: 4 or 2 chains, key j in chain j % chains, then added in
   chain order). A query's numbers depend only on its own vector and the keys and values it sees,
   never on the batch, the row count, the keys' padding, where the keys lie in the pool, or the
   other queries. The keys and values are read in place from the pool, through each input's slots. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define CHAINS 4 /* independent FMA chains a head's weighted sum of values keeps going at least */

/* The sum of x's eight lanes s: ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)). */
static inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* hsum of each of a[0..7], as lanes 0..7: the same additions of the same operands, so bitwise
   hsum's numbers, with the shuffles shared by eight keys. */
static inline __m256 hsum8(const __m256 *a) {
  __m256 y[4];
  for (int u = 0; u < 4; u++) { /* [key 2u's lanes i + (i + 4), i = 0 2 1 3 | key 2u + 1's] */
    y[u] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * u], a[2 * u + 1], 0x20), _mm256_permute2f128_ps(a[2 * u], a[2 * u + 1], 0x31));
    y[u] = _mm256_permute_ps(y[u], _MM_SHUFFLE(3, 1, 2, 0));
  }
  __m256 w = _mm256_hadd_ps(_mm256_hadd_ps(y[0], y[1]), _mm256_hadd_ps(y[2], y[3])); /* keys 0 2 4 6 | 1 3 5 7 */
  return _mm256_permutevar8x32_ps(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
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

/* acc[u] = the lanes of q . k at pool row idx[u], u < KB: an FMA chain a lane over the head's DV
   vectors (KB and DV constants where inlined: the accumulators stay in registers). */
static inline __attribute__((always_inline)) void dots(const float *q, const float *k, const int32_t *idx, int64_t row, int64_t DV,
                                                       int KB, __m256 *acc) {
  _Pragma("GCC unroll 8") for (int u = 0; u < KB; u++) acc[u] = _mm256_setzero_ps();
  for (int64_t d = 0; d < DV; d++) {
    __m256 qd = _mm256_loadu_ps(q + 8 * d);
    _Pragma("GCC unroll 8") for (int u = 0; u < KB; u++) acc[u] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + idx[u] * row + 8 * d), acc[u]);
  }
}

/* One (query, head): m visible keys at pool rows idx, rows `row` floats apart; s: scratch of m + 8 floats.
   DV: the head dimension in 8-float vectors (a constant where inlined). */
static inline __attribute__((always_inline)) void head(const float *q, const float *k, const float *v, const int32_t *idx,
                                                       int64_t m, int64_t row, float scale, float softcap, float *s, float *o,
                                                       int64_t DV) {
  /* Scores keys in blocks: eight for a short head (DV < CHAINS), whose per-key sums would
     cost more than its FMAs, reduced together (hsum8); four for a longer one, each reduced alone.
     Either way each score is hsum's of its own chain, so the block size changes no number. */
  __m256 high = _mm256_set1_ps(-INFINITY), scaled = _mm256_set1_ps(scale);
  float mx = -INFINITY;
  int64_t t = 0;
  if (DV < CHAINS) {
    for (; t + 8 <= m; t += 8) {
      __m256 acc[8];
      dots(q, k, idx + t, row, DV, 8, acc);
      __m256 sc = _mm256_mul_ps(hsum8(acc), scaled);
      _mm256_storeu_ps(s + t, sc);
      high = _mm256_max_ps(high, sc);
    }
  } else {
    for (; t + 4 <= m; t += 4) {
      __m256 acc[4];
      dots(q, k, idx + t, row, DV, 4, acc);
      _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {
        s[t + u] = hsum(acc[u]) * scale;
        mx = s[t + u] > mx ? s[t + u] : mx;
      }
    }
  }
  float h[8];
  _mm256_storeu_ps(h, high);
  for (int u = 0; u < 8; u++)
    mx = h[u] > mx ? h[u] : mx;
  for (; t < m; t++) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < DV; d++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * d), _mm256_loadu_ps(k + idx[t] * row + 8 * d), acc);
    s[t] = hsum(acc) * scale;
    mx = s[t] > mx ? s[t] : mx;
  }
  if (softcap > 0.0f) { /* the soft-cap, in transformers' order (scaled, then capped), each score alone */
    mx = -INFINITY;
    for (t = 0; t < m; t++) {
      s[t] = tanhf(s[t] / softcap) * softcap;
      mx = s[t] > mx ? s[t] : mx;
    }
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
  /* A head of fewer than CHAINS vectors sums its values in C = CHAINS / DV chains over the keys (key
     t in chain t % C), so it does not wait on one chain's FMA latency; the chains are then added in
     their order. A longer head keeps one chain a vector. */
  __m256 acc[32];
  for (int64_t d = 0; d < DV; d++) acc[d] = _mm256_setzero_ps();
  if (DV >= CHAINS) {
    for (t = 0; t < m; t++) {
      __m256 p = _mm256_set1_ps(s[t]);
      const float *vj = v + idx[t] * row;
      for (int64_t d = 0; d < DV; d++) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * d), acc[d]);
    }
  } else {
    const int64_t C = CHAINS / DV;
    __m256 part[CHAINS][CHAINS];
    for (int64_t c = 0; c < C; c++)
      for (int64_t d = 0; d < DV; d++) part[c][d] = _mm256_setzero_ps();
    for (t = 0; t < m;)
      for (int64_t c = 0; c < C && t < m; c++, t++) {
        __m256 p = _mm256_set1_ps(s[t]);
        const float *vj = v + idx[t] * row;
        for (int64_t d = 0; d < DV; d++) part[c][d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * d), part[c][d]);
      }
    for (int64_t c = 0; c < C; c++)
      for (int64_t d = 0; d < DV; d++) acc[d] = c ? _mm256_add_ps(acc[d], part[c][d]) : part[c][d];
  }
  __m256 inv = _mm256_set1_ps(m ? 1.0f / sum : 0.0f);
  for (int64_t d = 0; d < DV; d++) _mm256_storeu_ps(o + 8 * d, _mm256_mul_ps(acc[d], inv));
}

/* q: [B, n, H, D]; k, v: [S, Hkv, D], a pool of S key (value) rows; slots: [B, L], the pool row of
   each input's key positions; visible: [B, n, L] (1: the query sees the key); out: [B, n, H, D];
   softcap: 0, or the logit soft-cap.
   All row-major, float32; D a multiple of 8, at most 256; H a multiple of Hkv. The keys are read in
   place through the slots, never gathered. With OpenMP, `threads` threads share the (query, head)
   problems out, each whole on one thread: the numbers are the same at any thread count. Returns 0,
   -1 where scratch memory could not be had, -2 where a visible key's slot is not a row of the pool
   (nothing is read there). */
int attend_queries(const float *q, const float *k, const float *v, const int32_t *slots, const uint8_t *visible, float *out,
                   int64_t B, int64_t n, int64_t H, int64_t Hkv, int64_t D, int64_t L, int64_t S, float scale, float softcap,
                   int threads) {
  int64_t rep = H / Hkv, row = Hkv * D, problems = B * n * H;
  int failed = 0, outside = 0;
  (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed, outside)
  {
    int32_t *idx = malloc((L + 1) * sizeof *idx); /* this thread's scratch */
    float *s = malloc((L + 8) * sizeof *s);
    failed |= !idx || !s;
    int64_t at = -1, m = 0; /* the query (b * n + i) whose visible keys idx holds, and their count */
#pragma omp for schedule(static)
    for (int64_t t = 0; t < problems; t++) { /* (b, i, h) in row-major order: q and out at t * D */
      if (!idx || !s || outside)
        continue;
      int64_t query = t / H, h = t % H, b = query / n;
      if (query != at) {
        const uint8_t *seen = visible + query * L;
        const int32_t *slot = slots + b * L;
        m = 0;
        for (int64_t j = 0; j < L; j++)
          if (seen[j]) {
            outside |= slot[j] < 0 || slot[j] >= S;
            idx[m++] = slot[j];
          }
        at = query;
        if (outside)
          continue;
      }
      const float *qh = q + t * D, *kh = k + (h / rep) * D, *vh = v + (h / rep) * D;
      float *o = out + t * D;
      switch (D) { /* the common head sizes with their vector count a constant: accumulators in registers */
        case 8: head(qh, kh, vh, idx, m, row, scale, softcap, s, o, 1); break;
        case 16: head(qh, kh, vh, idx, m, row, scale, softcap, s, o, 2); break;
        case 32: head(qh, kh, vh, idx, m, row, scale, softcap, s, o, 4); break;
        case 64: head(qh, kh, vh, idx, m, row, scale, softcap, s, o, 8); break;
        case 128: head(qh, kh, vh, idx, m, row, scale, softcap, s, o, 16); break;
        default: head(qh, kh, vh, idx, m, row, scale, softcap, s, o, D / 8); break;
      }
    }
    free(idx);
    free(s);
  }
  return failed ? -1 : outside ? -2 : 0;
}
