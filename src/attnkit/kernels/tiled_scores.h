// The tiled kernel's scoring: what turns a block of raw scores q . k into the scores the softmax
// takes, row by row while the row is in cache: the window of positions, soft-capping, ALiBi, a
// score_mod's additions, float and bool masks, key padding; and attnkit's rule for non-finite
// scores (rules/nonfinite.py): only a mask gives -inf, anything else not finite is NaN.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>

#include "tiled_simd.h"

namespace {

// A score made infinite or NaN by the inputs is NaN: only a mask gives -inf (attnkit's rule for
// non-finite values, see rules/nonfinite.py).
inline float nan_unless_finite(float x) { return finite(x) ? x : kNaN; }

// A score plus a bias (a score_mod's or a float mask's): -inf masks the key, whether the bias or
// the score (masked by a score_mod before) made it; +inf or NaN is NaN.
inline float masked_or_nan(float x) { return x == kNegInf ? kNegInf : nan_unless_finite(x); }

// A (b, h, t, s) view with any strides (0 where broadcast), or none.
template <typename T>
struct Strided {
  const T* data = nullptr;
  int64_t sb = 0, sh = 0, st = 0, ss = 0;

  static Strided of(const at::Tensor& x) {
    Strided m;
    if (!x.defined() || x.numel() == 0) return m;
    m.data = x.data_ptr<T>();
    m.sb = x.stride(0), m.sh = x.stride(1), m.st = x.stride(2), m.ss = x.stride(3);
    return m;
  }
  const T* row(int64_t batch, int64_t head, int64_t i) const {
    return data ? data + batch * sb + head * sh + i * st : nullptr;
  }
};

// What turns a block of raw scores into masked scores: everything but q, k, v.
struct Scoring {
  int64_t s, diagonal, left, right;  // p(i) = i + diagonal
  float softcap;                // 0: none
  const float* alibi;           // (h,) or null
  Strided<float> mod_bias;      // a score_mod's additions over the current tile, or none
  int64_t mod_row0 = 0, mod_col0 = 0;  // the tile's first query and key
  Strided<float> bias;
  Strided<bool> allowed;
  const bool* key_mask;         // (b, s) contiguous rows, or null
  int64_t key_mask_stride;

  void set_mod_bias(const at::Tensor& tile, int64_t r0, int64_t c0) {
    mod_bias = Strided<float>::of(tile);
    mod_row0 = r0, mod_col0 = c0;
  }

  // The keys [lo, hi) that query i may see by position, clipped to the block [j0, j1) (empty, with
  // lo = hi inside the block, when the row's window lies wholly before or after it).
  std::pair<int64_t, int64_t> visible(int64_t i, int64_t j0, int64_t j1) const {
    const int64_t p = i + diagonal;
    const int64_t lo = left >= 0 ? std::min(j1, std::max(j0, p - left)) : j0;
    const int64_t hi = right >= 0 ? std::min(j1, p + right + 1) : j1;
    return {lo, std::max(lo, hi)};
  }

  // The keys [lo, hi) that queries [i0, i1) may see together (the union of their ranges).
  std::pair<int64_t, int64_t> block_range(int64_t i0, int64_t i1) const {
    const int64_t first = i0 + diagonal, last = i1 - 1 + diagonal;
    const int64_t lo = left >= 0 ? std::max<int64_t>(0, first - left) : 0;
    const int64_t hi = right >= 0 ? std::min(s, last + right + 1) : s;
    return {lo, std::max(lo, hi)};
  }

  // Whether the raw scores of query i over keys [j0, j0 + n) are its scores as they are: nothing
  // modifies or masks them (they still turn NaN where not finite).
  bool plain(int64_t i, int64_t j0, int64_t n) const {
    if (softcap > 0.f || alibi || mod_bias.data || bias.data || allowed.data || key_mask) {
      return false;
    }
    const auto [lo, hi] = visible(i, j0, j0 + n);
    return lo == j0 && hi == j0 + n;
  }

  // Row `row` (query i of head `head`, keys j0 .. j0 + n) of raw scores becomes the masked scores
  // in place, -inf where not allowed and NaN where the inputs made a score non-finite; `capped`
  // (if softcap) gets tanh(u / softcap), for the backward.
  // Returns false when no key of the row is allowed by position (the row is then all -inf).
  bool apply(float* row, float* capped, int64_t batch, int64_t head, int64_t i, int64_t j0,
             int64_t n) const {
    const auto [lo, hi] = visible(i, j0, j0 + n);
    const int64_t a = lo - j0, z = hi - j0;
    TORCH_CHECK(0 <= a && a <= z && z <= n, "tiled: row ", i, " keys [", lo, ", ", hi,
                ") outside the block [", j0, ", ", j0 + n, ")");  // never: would write outside
    std::fill(row, row + a, kNegInf);
    std::fill(row + z, row + n, kNegInf);
    if (a >= z) return false;
    if (softcap > 0.f) {
      const float c = softcap, inv = 1.f / softcap;
#pragma omp simd
      for (int64_t j = a; j < z; ++j) {
        const float th = tanh_fast(nan_unless_finite(row[j]) * inv);  // tanh(inf) would hide it
        capped[j] = th;
        row[j] = c * th;
      }
    }
    if (alibi != nullptr) {
      const float slope = alibi[head];
      const float p = static_cast<float>(i + diagonal - j0);
#pragma omp simd
      for (int64_t j = a; j < z; ++j) row[j] -= slope * std::fabs(p - static_cast<float>(j));
    }
    // The score_mod's f, added in the same pass that makes a non-finite score NaN; a NaN score
    // stays NaN even where f is -inf, as score + f would have it.
    const float* f = mod_bias.row(batch, head, i - mod_row0);
    const int64_t fs = mod_bias.ss;
    if (f == nullptr) {
#pragma omp simd
      for (int64_t j = a; j < z; ++j) row[j] = nan_unless_finite(row[j]);
    } else {
      f += (j0 - mod_col0) * fs;
      if (fs == 1) {
#pragma omp simd
        for (int64_t j = a; j < z; ++j) row[j] = masked_or_nan(nan_unless_finite(row[j]) + f[j]);
      } else {
        for (int64_t j = a; j < z; ++j) {
          row[j] = masked_or_nan(nan_unless_finite(row[j]) + f[j * fs]);
        }
      }
    }
    if (const float* b = bias.row(batch, head, i)) {  // -inf masks; NaN or +inf make a NaN score
      b += j0 * bias.ss;
      if (bias.ss == 1) {
#pragma omp simd
        for (int64_t j = a; j < z; ++j) {
          row[j] = b[j] == kNegInf ? kNegInf : masked_or_nan(row[j] + b[j]);
        }
      } else {
        for (int64_t j = a; j < z; ++j) {
          const float m = b[j * bias.ss];
          row[j] = m == kNegInf ? kNegInf : masked_or_nan(row[j] + m);
        }
      }
    }
    if (const bool* m = allowed.row(batch, head, i)) {
      m += j0 * allowed.ss;
      for (int64_t j = a; j < z; ++j) row[j] = m[j * allowed.ss] ? row[j] : kNegInf;
    }
    if (key_mask != nullptr) {
      const bool* m = key_mask + batch * key_mask_stride + j0;
#pragma omp simd
      for (int64_t j = a; j < z; ++j) row[j] = m[j] ? row[j] : kNegInf;
    }
    return true;
  }
};

}  // namespace
