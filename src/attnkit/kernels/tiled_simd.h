// The tiled kernel's vector math: exp and tanh in forms the compiler vectorises, the 16-lane exp
// of AVX-512, and the row passes of the softmax built on them (a row's max, its weights, the
// backward's probabilities).
//
// Like every tiled_*.h, this is a part of tiled.cpp, included by it alone: its names stay in an
// unnamed namespace, with the internal linkage (and the inlining) they had in one file.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "pair_products.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (and -inf), in a form the compiler vectorises: 2^n * p(f), x log2(e) = n + f,
// |f| <= 1/2, p of degree 6 (below 2e-7 relative error; with the rounding of x log2(e), below 4e-6
// near -87); 0 below -87, where float32 turns denormal. The kernels built with -ffast-math, which
// may fold (y + c) - c into y, take fast_exp.h's instead, which rounds with nearbyint.
inline float exp_nonpositive(float x) {
  const float y = std::max(x, -87.f) * 1.44269504088896341f;
  const float n = (y + 12582912.f) - 12582912.f;  // round to nearest: 1.5 * 2^23
  const float f = y - n;
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) * (1 << 23);
  std::memcpy(&p, &bits, sizeof p);
  return x < -87.f ? 0.f : (x == x ? p : x);  // NaN stays NaN
}

// exp(x) on 16 lanes for x <= 0, -inf or NaN, as 2^k * p(f) with vroundscaleps and vscalefps,
// which handle the range without the selects of exp_nonpositive: -inf gives 0, NaN stays NaN.
#if defined(__AVX512F__)
inline __m512 exp16(__m512 x) {
  // max(lowest, x) keeps a NaN x; below -140, 2^k underflows to exactly 0
  x = _mm512_max_ps(_mm512_set1_ps(-140.f), x);
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 k = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(y, k);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}
#endif

// The backward's probabilities: row[j] = exp(row[j] - shift), exactly 0 where row[j] is -inf (a
// masked key, even in a row whose shift is NaN); a NaN score stays NaN.
inline void probs_row(float* row, int64_t n, float shift) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 lse = _mm512_set1_ps(shift), masked = _mm512_set1_ps(kNegInf);
  for (; j + 16 <= n; j += 16) {
    const __m512 x = _mm512_loadu_ps(row + j);
    const __mmask16 hidden = _mm512_cmp_ps_mask(x, masked, _CMP_EQ_OQ);
    const __m512 e = exp16(_mm512_sub_ps(x, lse));
    _mm512_storeu_ps(row + j, _mm512_mask_mov_ps(e, hidden, _mm512_setzero_ps()));
  }
#endif
#pragma omp simd
  for (int64_t i = j; i < n; ++i) row[i] = row[i] == kNegInf ? 0.f : exp_nonpositive(row[i] - shift);
}

// The softmax's hottest loop after the block products: out[j] = exp(row[j] - top) for j < n,
// returning their sum (row without NaN, top finite). With AVX-512, 16 lanes at a time (exp16;
// faster than the compiler's vectorisation of exp_nonpositive: docs/bench/choices.md), and with
// AVX512-BF16 straight into bf16 when Out is bf16 bits, so the float32 row is never stored.
template <typename Out>
inline float exp_row(const float* row, int64_t n, float top, Out* out) {
  float sum = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<Out, float> || pairs::kHasAvx512Bf16) {
    const __m512 shift = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), shift));
      total = _mm512_add_ps(total, e);
      if constexpr (std::is_same_v<Out, float>) {
        _mm512_storeu_ps(out + j, e);
      } else {
#if defined(__AVX512BF16__)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), (__m256i)_mm512_cvtneps_pbh(e));
#endif
      }
    }
    sum = _mm512_reduce_add_ps(total);
  }
#endif
#pragma omp simd reduction(+ : sum)
  for (int64_t i = j; i < n; ++i) {  // the rest, or all of it without the 16-lane loop
    const float e = exp_nonpositive(row[i] - top);
    sum += e;
    if constexpr (std::is_same_v<Out, float>) {
      out[i] = e;
    } else {
      out[i] = pairs::round(e);
    }
  }
  return sum;
}

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

inline bool finite(float x) { return std::fabs(x) <= std::numeric_limits<float>::max(); }

// tanh(x), vectorisable: an odd Taylor polynomial near 0 (where 1 - e^{-2|x|} would cancel), else
// (1 - e) / (1 + e) with e = e^{-2|x|}.
inline float tanh_fast(float x) {
  const float a = std::fabs(x);
  const float x2 = x * x;
  const float near = a * (1.f + x2 * (-1.f / 3 + x2 * (2.f / 15 + x2 * (-17.f / 315))));
  const float e = exp_nonpositive(-2.f * a);
  const float far = (1.f - e) / (1.f + e);
  return std::copysign(a < 0.125f ? near : far, x);
}

// The largest of x[0 .. n), -inf for n = 0, NaN if any is NaN. GCC does not vectorise a running max
// of floats without -ffinite-math-only (which -inf masking forbids), so the lanes are kept in a
// vector of the compiler's own: one register wide (16 lanes with AVX-512, else 8; wider generic
// vectors compile to spills on AVX2). With `any_nonfinite`, an infinity makes it NaN too: the
// row_max of raw scores, which lets a row with nothing to mask skip Scoring::apply's pass.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float FloatLanes __attribute__((vector_size(4 * kLanes)));
typedef int32_t IntLanes __attribute__((vector_size(4 * kLanes)));

template <bool any_nonfinite = false>
inline float row_max(const float* x, int64_t n) {
  FloatLanes lanes = FloatLanes{} + kNegInf;  // a whole vector at once, not lane by lane
  IntLanes nan = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    FloatLanes chunk;
    std::memcpy(&chunk, x + j, sizeof chunk);
    lanes = chunk > lanes ? chunk : lanes;
    if constexpr (any_nonfinite) chunk -= chunk;  // 0, or NaN for an infinity or a NaN
    nan |= chunk != chunk;
  }
  float top = kNegInf;
  bool any_nan = false;
  for (; j < n; ++j) {
    top = x[j] > top ? x[j] : top;
    any_nan |= any_nonfinite ? !finite(x[j]) : x[j] != x[j];
  }
  for (int u = 0; u < kLanes; ++u) {
    top = lanes[u] > top ? lanes[u] : top;
    any_nan |= nan[u] != 0;
  }
  return any_nan ? kNaN : top;
}

}  // namespace
