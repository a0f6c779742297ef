// The decode kernel's work item for many query rows over a bf16 cache, on AVX512-BF16: the query
// rows of a key/value head (a GQA group, or multi-head latent attention's heads over its latent)
// are the 16 lanes of a vector, so that one vdpbf16ps takes a pair of one key's numbers against
// every row at once, and no dot product needs a sum across lanes. Scores: the key's pairs
// broadcast against the rows' pairs; values: pairs of keys' values broadcast against the rows'
// pairs of weights (rounded to bf16, as bf16 attention's weights are). Sums are float32.
//
// Like every part of decode.cpp, it follows attnkit's rules: padding is never read into a
// result (its weights are 0 and its values are taken as 0), a real key's non-finite score makes
// its row NaN, and a block of keys that are all padding is skipped.

#pragma once

#if defined(__AVX512BF16__)

#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fast_exp.h"

namespace {

constexpr int64_t kPairRows = 16;     // query rows: the lanes of a vector
constexpr int64_t kPairBlock = 32;    // keys scored and added together
constexpr int64_t kPairsFrom = 8;     // fewer rows leave most lanes idle: the float path runs
constexpr int64_t kPairMaxDim = 576;  // decode.cpp's kPairMaxDim

typedef uint32_t Word __attribute__((__may_alias__));  // two bf16 side by side

// The query rows as pairs along the head dim, a vector of 16 rows per pair:
// q2[p * 16 + r] = (q[r][2p], q[r][2p + 1]), rows beyond `rows` 0.
inline void pack_query_pairs(const c10::BFloat16* q, int64_t row_stride, int64_t rows, int64_t d,
                             Word* q2) {
  for (int64_t p = 0; p < d / 2; ++p) {
    for (int64_t r = 0; r < kPairRows; ++r) {
      Word word = 0;
      if (r < rows) std::memcpy(&word, q + r * row_stride + 2 * p, sizeof word);
      q2[p * kPairRows + r] = word;
    }
  }
}

constexpr int64_t kPairAhead = 64;  // keys ahead whose rows are fetched

// Asks for a row of d bf16 numbers into L2: eight rows are read side by side, as eight streams the
// hardware's prefetchers alone kept waiting. (Past a cache's end, a prefetch never faults.)
inline void fetch_into_l2(const c10::BFloat16* row, int64_t d) {
  const char* at = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < 2 * d; offset += 64) __builtin_prefetch(at + offset, 0, 2);
}

// scores[j] (16 rows) = scale * q . k_{j0 + j} for the n keys of a block, eight keys at a time.
inline void pair_scores(const Word* q2, int64_t d, const c10::BFloat16* k, int64_t stride_s,
                        int64_t j0, int64_t n, float scale, __m512* scores) {
  const int64_t pairs = d / 2;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const Word* key[8];
    __m512 sum[8];
    for (int u = 0; u < 8; ++u) {
      key[u] = reinterpret_cast<const Word*>(k + (j0 + j + u) * stride_s);
      sum[u] = _mm512_setzero_ps();
      fetch_into_l2(k + (j0 + j + u + kPairAhead) * stride_s, d);
    }
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh rows = (__m512bh)_mm512_loadu_si512(q2 + p * kPairRows);
      for (int u = 0; u < 8; ++u) {
        sum[u] = _mm512_dpbf16_ps(sum[u], (__m512bh)_mm512_set1_epi32(key[u][p]), rows);
      }
    }
    for (int u = 0; u < 8; ++u) scores[j + u] = _mm512_mul_ps(sum[u], _mm512_set1_ps(scale));
  }
  for (; j < n; ++j) {
    const Word* key = reinterpret_cast<const Word*>(k + (j0 + j) * stride_s);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh rows = (__m512bh)_mm512_loadu_si512(q2 + p * kPairRows);
      sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_set1_epi32(key[p]), rows);
    }
    scores[j] = _mm512_mul_ps(sum, _mm512_set1_ps(scale));
  }
}

// v2[jp * dv + c] = (v[2jp][c], v[2jp + 1][c]) for the keys of a block, a padding key's (or a
// missing last key's) values taken as 0.
inline void pack_value_pairs(const c10::BFloat16* v, int64_t stride_v, const bool* real, int64_t j0,
                             int64_t n, int64_t dv, Word* v2) {
  static const uint16_t zeros[kPairMaxDim] = {};
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                       39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t jp = 0; 2 * jp < n; ++jp) {
    const int64_t a = j0 + 2 * jp, b = a + 1;
    const bool a_real = real == nullptr || real[a];
    const bool b_real = 2 * jp + 1 < n && (real == nullptr || real[b]);
    const void* top = a_real ? static_cast<const void*>(v + a * stride_v) : zeros;
    const void* bottom = b_real ? static_cast<const void*>(v + b * stride_v) : zeros;
    for (int64_t c = 0; c < dv; c += 32) {
      const __m512i x = _mm512_loadu_si512(static_cast<const uint16_t*>(top) + c);
      const __m512i y = _mm512_loadu_si512(static_cast<const uint16_t*>(bottom) + c);
      _mm512_storeu_si512(v2 + jp * dv + c, _mm512_permutex2var_epi16(x, low, y));
      _mm512_storeu_si512(v2 + jp * dv + c + 16, _mm512_permutex2var_epi16(x, high, y));
    }
  }
}

// acc[c] (16 rows) += sum over the block's keys j of w[j] (16 rows) v[j][c], the weights rounded
// to bf16 and taken two keys at a time; 16 columns' sums stay in registers across the block.
inline void pair_values(const __m512* w, int64_t n, const Word* v2, int64_t dv, __m512* acc) {
  __m512i w2[kPairBlock / 2];
  const int64_t pairs = (n + 1) / 2;
  for (int64_t jp = 0; jp < pairs; ++jp) {
    const __m512i a = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(w[2 * jp]));
    const __m512 second = 2 * jp + 1 < n ? w[2 * jp + 1] : _mm512_setzero_ps();
    const __m512i b = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(second));
    w2[jp] = _mm512_or_si512(a, _mm512_slli_epi32(b, 16));
  }
  for (int64_t c0 = 0; c0 < dv; c0 += 16) {
    __m512 sum[16];
    for (int i = 0; i < 16; ++i) sum[i] = acc[c0 + i];
    for (int64_t jp = 0; jp < pairs; ++jp) {
      const __m512bh weights = (__m512bh)w2[jp];
      const Word* values = v2 + jp * dv + c0;
      for (int i = 0; i < 16; ++i) {
        sum[i] = _mm512_dpbf16_ps(sum[i], (__m512bh)_mm512_set1_epi32(values[i]), weights);
      }
    }
    for (int i = 0; i < 16; ++i) acc[c0 + i] = sum[i];
  }
}

// exp(x) lane by lane, x <= 0 (fast_exp.h's, which the compiler vectorises).
inline __m512 exp_lanes(__m512 x) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, x);
  for (int r = 0; r < 16; ++r) lanes[r] = exp_nonpositive(lanes[r]);
  return _mm512_load_ps(lanes);
}

// attend_split's work item (decode.cpp) for `rows` (<= 16) query rows of bf16 q, d and dv
// multiples of 32: keys [begin, end), out (rows x dv), each row's running max and sum.
inline void attend_split_pairs(const c10::BFloat16* q, int64_t q_row_stride, int64_t rows,
                               int64_t d, int64_t dv, float scale, const c10::BFloat16* k,
                               const c10::BFloat16* v, int64_t stride_s, int64_t stride_v,
                               const bool* real, int64_t begin, int64_t end, float* out,
                               float* max_out, float* sum_out) {
  alignas(64) Word q2[kPairMaxDim / 2 * kPairRows];
  alignas(64) Word v2[kPairBlock / 2 * kPairMaxDim];
  alignas(64) __m512 acc[kPairMaxDim];
  __m512 scores[kPairBlock];
  pack_query_pairs(q, q_row_stride, rows, d, q2);
  for (int64_t c = 0; c < dv; ++c) acc[c] = _mm512_setzero_ps();
  __m512 m = _mm512_set1_ps(-FLT_MAX), l = _mm512_setzero_ps();
  __mmask16 bad = 0;
  const __m512 largest = _mm512_set1_ps(FLT_MAX);
  for (int64_t j0 = begin; j0 < end; j0 += kPairBlock) {
    const int64_t n = std::min(kPairBlock, end - j0);
    const auto is_real = [](bool x) { return x; };
    if (real != nullptr && std::none_of(real + j0, real + j0 + n, is_real)) continue;
    pair_scores(q2, d, k, stride_s, j0, n, scale, scores);
    __m512 top = m;
    for (int64_t j = 0; j < n; ++j) {
      if (real != nullptr && !real[j0 + j]) {
        scores[j] = _mm512_set1_ps(-FLT_MAX);  // weight 0 below
        continue;
      }
      bad |= _mm512_cmp_ps_mask(_mm512_abs_ps(scores[j]), largest, _CMP_NLE_UQ);
      top = _mm512_max_ps(top, scores[j]);
    }
    const __m512 shrink = exp_lanes(_mm512_sub_ps(m, top));
    m = top;
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      scores[j] = exp_lanes(_mm512_sub_ps(scores[j], top));
      total = _mm512_add_ps(total, scores[j]);
    }
    l = _mm512_fmadd_ps(l, shrink, total);
    for (int64_t c = 0; c < dv; ++c) acc[c] = _mm512_mul_ps(acc[c], shrink);
    pack_value_pairs(v, stride_v, real, j0, n, dv, v2);
    pair_values(scores, n, v2, dv, acc);
  }
  alignas(64) float lanes[16];
  for (int64_t c = 0; c < dv; ++c) {
    _mm512_store_ps(lanes, acc[c]);
    for (int64_t r = 0; r < rows; ++r) out[r * dv + c] = lanes[r];
  }
  alignas(64) float maxima[16], sums[16];
  _mm512_store_ps(maxima, m);
  _mm512_store_ps(sums, l);
  for (int64_t r = 0; r < rows; ++r) {
    max_out[r] = maxima[r];
    sum_out[r] = (bad >> r) & 1 ? NAN : sums[r];  // NaN marks the row for the merge
  }
}

}  // namespace

#endif  // __AVX512BF16__
