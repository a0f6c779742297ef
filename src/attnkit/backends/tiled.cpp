// The tiled kernel in C++: the loop of tiled.py (FlashAttention-2's online softmax, forward and
// recomputing backward) with each block's score work fused into a few passes over a block that
// stays in the CPU's cache. The block products are float32 ones by torch's own matrix product (MKL
// here) for float32 operands, and bf16 ones with float32 sums (pair_products.h) for bf16 operands.
//
// The Python loop launches a dozen tensor operations per block, each a full pass over the block in
// memory; here the masks, positions, soft-capping and the softmax update of a row are applied while
// the row is hot. The algorithm, the block skipping and the numerics are those of tiled.py: scores,
// statistics and accumulators in float32, statistics kept per row, a row with no allowed key gives
// zeros and lse = -inf. With bf16 operands, the weights P (and in the backward dS) are rounded to
// bf16 before they are multiplied.
//
// Layout (contiguous unless said):
//   q (b, h, t, d), pre-scaled; k (b, h_kv, s, d); v (b, h_kv, s, dv): all float32 or all bf16
//   (bf16 with even d and dv);
//   bias: float32, allowed: bool, both expanded to (b, h, t, s) with any strides, or empty;
//   key_mask (b, s) bool or empty; alibi (h,) float32 or empty; softcap 0 for none;
//   window (left, right) around p(i) = i + s - t + shift, -1 unbounded (shift: 0, or the offset
//   of a chunk of a longer sequence).
//   tiles: the kernel walks over panels of `tile_rows` queries and, within a panel, over tiles of
//   `tile_keys` keys (multiples of the block sizes; t and s for one tile). `mod_bias`, a Python
//   function or None, gives each tile's additions of a score_mod that adds to the score
//   (score + f(b, h, q_idx, kv_idx)): mod_bias(r0, r1, c0, c1) -> float32 f broadcastable to
//   (b, h, r1 - r0, c1 - c0); in the backward, `mod_bias_grad(r0, r1, c0, c1, dbias)` receives
//   the loss's gradient with respect to it. A tile's f is the only thing of size rows x keys.
// Query head i uses key/value head i / (h / h_kv).

// ATen and torch's pybind11 glue, not <torch/extension.h>: the whole C++ API's headers tripled
// the build's time, and a first call waits for it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "pair_products.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (and -inf), in a form the compiler vectorises: 2^n * p(f), x log2(e) = n + f,
// |f| <= 1/2, p of degree 6 (below 2e-7 relative error; with the rounding of x log2(e), below 4e-6
// near -87); 0 below -87, where float32 turns denormal. decode.cpp keeps its own copy on purpose:
// built with -ffast-math, which may fold (y + c) - c into y, it rounds with nearbyint instead.
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
// measured on Zen 5: twice as fast as the compiler's vectorisation of exp_nonpositive), and with
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
inline bool finite_value(float x) { return finite(x); }
inline bool finite_value(pairs::Bf16 x) { return pairs::finite(x); }

// A score made infinite or NaN by the inputs is NaN: only a mask gives -inf (attnkit's rule for
// non-finite values, see reference.py).
inline float nan_unless_finite(float x) { return finite(x) ? x : kNaN; }

// A score plus a bias (a score_mod's or a float mask's): -inf masks the key, whether the bias or
// the score (masked by a score_mod before) made it; +inf or NaN is NaN.
inline float masked_or_nan(float x) { return x == kNegInf ? kNegInf : nan_unless_finite(x); }

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

// The scoring of a call with b batches, h query heads, t queries and s keys, after checking that
// every mask fits those sizes (the kernel reads them without bounds checks).
Scoring make_scoring(int64_t b, int64_t h, int64_t t, int64_t s, const at::Tensor& bias,
                     const at::Tensor& allowed, const at::Tensor& key_mask,
                     const at::Tensor& alibi, double softcap, int64_t left, int64_t right,
                     int64_t shift, int64_t block_q, int64_t block_k) {
  TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 4 && bias.scalar_type() == at::kFloat),
              "tiled: bias must be empty or float32 (b, h, t, s)");
  TORCH_CHECK(allowed.numel() == 0 || (allowed.dim() == 4 && allowed.scalar_type() == at::kBool),
              "tiled: allowed must be empty or bool (b, h, t, s)");
  const std::vector<int64_t> full{b, h, t, s};
  TORCH_CHECK(block_q > 0 && block_k > 0, "tiled: block sizes must be positive");
  TORCH_CHECK(bias.numel() == 0 || bias.sizes() == at::IntArrayRef(full),
              "tiled: bias must be (b, h, t, s)");
  TORCH_CHECK(allowed.numel() == 0 || allowed.sizes() == at::IntArrayRef(full),
              "tiled: allowed must be (b, h, t, s)");
  TORCH_CHECK(key_mask.numel() == 0 ||
                  (key_mask.sizes() == at::IntArrayRef({b, s}) &&
                   (s == 1 || key_mask.stride(1) == 1) && key_mask.scalar_type() == at::kBool),
              "tiled: key_mask must be empty or bool (b, s) with contiguous rows");
  TORCH_CHECK(alibi.numel() == 0 || (alibi.numel() == h && alibi.is_contiguous() &&
                                     alibi.scalar_type() == at::kFloat),
              "tiled: alibi must be empty or contiguous float32 (h,)");
  Scoring sc;
  sc.s = s, sc.diagonal = s - t + shift, sc.left = left, sc.right = right;
  sc.softcap = static_cast<float>(softcap);
  sc.alibi = alibi.numel() ? alibi.data_ptr<float>() : nullptr;
  sc.bias = Strided<float>::of(bias);
  sc.allowed = Strided<bool>::of(allowed);
  sc.key_mask = key_mask.numel() ? key_mask.data_ptr<bool>() : nullptr;
  sc.key_mask_stride = key_mask.numel() ? key_mask.stride(0) : 0;
  return sc;
}

// Which of `rows` rows of `width` values hold a NaN or an infinity (one flag a row), on every thread.
template <typename T>
std::vector<char> nonfinite_rows(const T* x, int64_t rows, int64_t width) {
  std::vector<char> flags(rows);
  at::parallel_for(0, rows, 256, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      bool all_finite = true;
      const T* row = x + i * width;
#pragma omp simd reduction(&& : all_finite)
      for (int64_t c = 0; c < width; ++c) all_finite = all_finite && finite_value(row[c]);
      flags[i] = !all_finite;
    }
  });
  return flags;
}

// The operands' dtype: float32 (products by torch's matmul) or bfloat16 (pair products), the same
// for all; bf16 operands have even head dims (the caller pads them with zeros).
c10::ScalarType check_operands(std::initializer_list<const at::Tensor*> tensors) {
  const auto dtype = (*tensors.begin())->scalar_type();
  for (const auto* x : tensors) {
    TORCH_CHECK(x->dim() == 4 && x->is_contiguous() && x->scalar_type() == dtype &&
                    (dtype == at::kFloat || dtype == at::kBFloat16),
                "tiled: the operands must be contiguous 4-d tensors, all float32 or all bfloat16");
    TORCH_CHECK(dtype == at::kFloat || x->size(3) % 2 == 0,
                "tiled: bfloat16 operands must have an even last dim");
  }
  return dtype;
}

// The i-th of n blocks in the order 0, n-1, 1, n-2, ...: parallel_for hands each thread a
// contiguous range of items, and under a causal mask the later query blocks have more keys to
// visit; in this order every range mixes light and heavy blocks.
inline int64_t zigzag(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

// C (m x n, row stride ldc) = op(A) op(B), plus C if `add`; row-major, op(X) = X or X^T as stored
// (`ta`: A is stored (kk x m); `tb`: B is stored (n x kk)). The product is torch's own (MKL here),
// on views of the block: one BLAS call per product, no copy. On one thread inside parallel_for.
inline void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t kk, const float* a, int64_t lda,
                 const float* b, int64_t ldb, float* c, int64_t ldc, bool add) {
  const auto view = [](const float* x, int64_t rows, int64_t cols, int64_t ld, bool transposed) {
    const int64_t stored_rows = transposed ? cols : rows, stored_cols = transposed ? rows : cols;
    auto t = at::from_blob(const_cast<float*>(x), {stored_rows, stored_cols}, {ld, 1},
                              at::kFloat);
    return transposed ? t.t() : t;
  };
  auto out = at::from_blob(c, {m, n}, {ldc, 1}, at::kFloat);
  const auto lhs = view(a, m, kk, lda, ta), rhs = view(b, kk, n, ldb, tb);
  if (add) {
    at::addmm_out(out, out, lhs, rhs);
  } else {
    at::mm_out(out, lhs, rhs);
  }
}

// The sizes of a call: q (b, h, t, d), k (b, h_kv, s, d), v (b, h_kv, s, dv).
struct Sizes {
  int64_t b, h, h_kv, t, s, d, dv;
};

// The block products of the kernel, in two implementations with one interface: float32 operands
// multiplied by torch's matmul (Float32Blocks), and bf16 operands multiplied in pairs with float32
// sums (Bf16Blocks, pair_products.h). In both, a block of scores, weights or their gradients is
// float32, (bq x n) with row stride `ld` = score_stride(n); results accumulate into float32 rows of
// `width(d)` (or `width(dv)`) entries. `bh` is the query head's index in (b * h), `kv` the key/value
// head's in (b * h_kv), [i0, i0 + bq) the query rows and [j0, j0 + n) the keys.
struct Float32Blocks {
  Sizes z;
  const float *q, *k, *v, *dout;
  struct Scratch {
    std::vector<float> clean;  // a value block with its non-finite entries zeroed
    explicit Scratch(const Float32Blocks&, int64_t, int64_t) {}
  };

  Float32Blocks(const Sizes& sizes, const at::Tensor& q_, const at::Tensor& k_,
                const at::Tensor& v_, const at::Tensor* dout_)
      : z(sizes), q(q_.data_ptr<float>()), k(k_.data_ptr<float>()), v(v_.data_ptr<float>()),
        dout(dout_ ? dout_->data_ptr<float>() : nullptr) {}

  int64_t score_stride(int64_t n) const { return n; }
  int64_t width(int64_t x) const { return x; }
  const float* values(int64_t kv) const { return v + kv * z.s * z.dv; }

  // S = Q K^T
  void scores(int64_t bh, int64_t i0, int64_t bq, int64_t kv, int64_t j0, int64_t n, float* S,
              Scratch&) const {
    gemm(false, true, bq, n, z.d, q + (bh * z.t + i0) * z.d, z.d, k + (kv * z.s + j0) * z.d, z.d,
         S, n, false);
  }
  // Row r of P from its scores: exp(score - top) in place; returns their sum. `top` is finite and
  // the row holds no NaN (a row with one is poisoned before).
  float weights(float* row, int64_t n, float top, int64_t, int64_t, Scratch&) const {
    return exp_row(row, n, top, row);
  }
  // Row r of P when it adds nothing (no key allowed so far, or poisoned).
  void no_weights(float* row, int64_t n, int64_t, int64_t, Scratch&) const {
    std::fill(row, row + n, 0.f);
  }
  // acc += P V; `dirty`: the block's values hold a non-finite entry (a masked key's weight is 0,
  // and 0 * NaN would still be NaN).
  void add_values(const float* P, int64_t bq, int64_t kv, int64_t j0, int64_t n, bool dirty,
                  float* acc, Scratch& w) const {
    const float* block = values(kv) + j0 * z.dv;
    if (dirty) {
      w.clean.resize(n * z.dv);
      for (int64_t i = 0; i < n * z.dv; ++i) w.clean[i] = finite(block[i]) ? block[i] : 0.f;
      block = w.clean.data();
    }
    gemm(false, false, bq, z.dv, n, P, n, block, z.dv, acc, z.dv, true);
  }
  void prepare(int64_t, int64_t, int64_t, Scratch&) const {}
  // dV += P^T dO
  void add_dv(const float* P, int64_t bh, int64_t i0, int64_t bq, int64_t j0, int64_t n,
              float* dv_head, Scratch&) const {
    gemm(true, false, n, z.dv, bq, P, n, dout + (bh * z.t + i0) * z.dv, z.dv, dv_head + j0 * z.dv,
         z.dv, true);
  }
  // dP = dO V^T
  void dprobs(int64_t bh, int64_t i0, int64_t bq, int64_t kv, int64_t j0, int64_t n, float* dP,
              Scratch&) const {
    gemm(false, true, bq, n, z.dv, dout + (bh * z.t + i0) * z.dv, z.dv, values(kv) + j0 * z.dv,
         z.dv, dP, n, false);
  }
  // dQ += dS K
  void add_dq(const float* dS, int64_t bq, int64_t kv, int64_t j0, int64_t n, float* dq_rows,
              Scratch&) const {
    gemm(false, false, bq, z.d, n, dS, n, k + (kv * z.s + j0) * z.d, z.d, dq_rows, z.d, true);
  }
  // dK += dS^T Q
  void add_dk(const float* dS, int64_t bh, int64_t i0, int64_t bq, int64_t j0, int64_t n,
              float* dk_head, Scratch&) const {
    gemm(true, false, n, z.d, bq, dS, n, q + (bh * z.t + i0) * z.d, z.d, dk_head + j0 * z.d, z.d,
         true);
  }
};

// bf16 operands, packed once per call for the products that read them whole (K and V, each in the
// two orientations it is multiplied in) and once per query block for the rest.
struct Bf16Blocks {
  using Pair = pairs::Pair;
  using Bf16 = pairs::Bf16;
  Sizes z;
  bool fast;  // vdpbf16ps, else the portable tile
  const Bf16 *q, *k, *v, *dout;
  int64_t key_cols;             // columns of the packs whose columns are keys: s + kCols, zero-padded
  int64_t d_cols, dv_cols;      // d and dv padded to kCols
  std::vector<Pair> k_by_dim;   // per kv head, (d / 2) x key_cols: pairs along d (for Q K^T)
  std::vector<Pair> v_by_dim;   // (dv / 2) x key_cols, for dO V^T (backward)
  std::vector<Pair> v_by_key;   // ceil(s / 2) x dv_cols: pairs of keys, for P V
  std::vector<Pair> k_by_key;   // ceil(s / 2) x d_cols, for dS K (backward)

  struct Scratch {
    std::vector<Bf16> rows;                       // P or dS rounded, aligned on pairs of keys
    std::vector<Pair> transposed;                 // P or dS, pairs of query rows
    std::vector<Pair> q_rows, dout_rows;          // the query block's Q and dO, pairs of rows
    Scratch(const Bf16Blocks& blocks, int64_t block_q, int64_t block_k)
        : rows(block_q * (block_k + 3)),
          transposed((block_q + 1) / 2 * pairs::padded(block_k)),
          q_rows((block_q + 1) / 2 * blocks.d_cols),
          dout_rows(blocks.dout ? (block_q + 1) / 2 * blocks.dv_cols : 0) {}
  };

  Bf16Blocks(const Sizes& sizes, const at::Tensor& q_, const at::Tensor& k_,
             const at::Tensor& v_, const at::Tensor* dout_, bool fast_)
      : z(sizes), fast(fast_), q(bits(q_)), k(bits(k_)), v(bits(v_)),
        dout(dout_ ? bits(*dout_) : nullptr), key_cols(z.s + pairs::kCols),
        d_cols(pairs::padded(z.d)), dv_cols(pairs::padded(z.dv)) {
    const int64_t heads = z.b * z.h_kv, key_pairs = (z.s + 1) / 2;
    k_by_dim.resize(heads * z.d / 2 * key_cols);
    v_by_key.resize(heads * key_pairs * dv_cols);
    if (dout) {
      v_by_dim.resize(heads * z.dv / 2 * key_cols);
      k_by_key.resize(heads * key_pairs * d_cols);
    }
    at::parallel_for(0, heads, 1, [&](int64_t first, int64_t last) {
      for (int64_t kv = first; kv < last; ++kv) {
        const Bf16 *kh = k + kv * z.s * z.d, *vh = v + kv * z.s * z.dv;
        pairs::pack_transposed(kh, z.s, z.d, z.d, &k_by_dim[kv * z.d / 2 * key_cols], key_cols);
        pairs::pack_row_pairs(vh, z.s, z.dv, z.dv, &v_by_key[kv * key_pairs * dv_cols], dv_cols,
                              true);
        if (dout) {
          pairs::pack_transposed(vh, z.s, z.dv, z.dv, &v_by_dim[kv * z.dv / 2 * key_cols],
                                 key_cols);
          pairs::pack_row_pairs(kh, z.s, z.d, z.d, &k_by_key[kv * key_pairs * d_cols], d_cols,
                                true);
        }
      }
    });
  }

  static const Bf16* bits(const at::Tensor& x) {
    return reinterpret_cast<const Bf16*>(x.data_ptr<at::BFloat16>());
  }
  const Pair* words(const Bf16* rows) const { return reinterpret_cast<const Pair*>(rows); }

  int64_t score_stride(int64_t n) const { return pairs::padded(n); }
  int64_t width(int64_t x) const { return pairs::padded(x); }
  const Bf16* values(int64_t kv) const { return v + kv * z.s * z.dv; }

  void scores(int64_t bh, int64_t i0, int64_t bq, int64_t kv, int64_t j0, int64_t n, float* S,
              Scratch&) const {
    const Pair* b = &k_by_dim[kv * z.d / 2 * key_cols] + j0;
    pairs::gemm(fast, bq, pairs::padded(n), z.d / 2, words(q + (bh * z.t + i0) * z.d), z.d / 2,
                1, b, key_cols, S, pairs::padded(n), false);
  }
  // The weights are rounded to bf16 as they are computed, into rows whose pairs of keys start at an
  // even key, as the packs' do: a row carries a leading 0 when j0 is odd, a trailing one when it
  // ends on an odd key.
  static int64_t key_width(int64_t n) { return (n + 3) / 2 * 2; }  // even: whole pairs
  static int64_t key_pairs(int64_t j0, int64_t n) { return (j0 % 2 + n + 1) / 2; }
  Bf16* key_row(Scratch& w, int64_t r, int64_t j0, int64_t n) const {
    Bf16* row = w.rows.data() + r * key_width(n);
    row[0] = 0;
    row[2 * key_pairs(j0, n) - 1] = 0;
    return row + j0 % 2;
  }
  float weights(const float* row, int64_t n, float top, int64_t r, int64_t j0, Scratch& w) const {
    return exp_row(row, n, top, key_row(w, r, j0, n));
  }
  void no_weights(const float*, int64_t n, int64_t r, int64_t j0, Scratch& w) const {
    Bf16* out = key_row(w, r, j0, n);
    std::fill(out, out + n, 0);
  }
  // acc += P V from the rounded rows. The pack's non-finite values are 0 (the output's NaN comes
  // from the selection in the forward, which reads the values themselves).
  void add_values(const float*, int64_t bq, int64_t kv, int64_t j0, int64_t n, bool, float* acc,
                  Scratch& w) const {
    const Pair* b = &v_by_key[(kv * ((z.s + 1) / 2) + j0 / 2) * dv_cols];
    pairs::gemm(fast, bq, dv_cols, key_pairs(j0, n), words(w.rows.data()), key_width(n) / 2, 1, b,
                dv_cols, acc, dv_cols, true);
  }
  // The query block's Q and dO as pairs of rows, for the transposed products.
  void prepare(int64_t bh, int64_t i0, int64_t bq, Scratch& w) const {
    pairs::pack_row_pairs(q + (bh * z.t + i0) * z.d, bq, z.d, z.d, w.q_rows.data(), d_cols, false);
    pairs::pack_row_pairs(dout + (bh * z.t + i0) * z.dv, bq, z.dv, z.dv, w.dout_rows.data(),
                          dv_cols, false);
  }
  // P^T (or dS^T) as pairs of query rows: A2(j, p) = (X[2p][j], X[2p + 1][j]).
  const Pair* transposed(const float* X, int64_t bq, int64_t n, Scratch& w) const {
    pairs::pack_row_pairs(X, bq, n, pairs::padded(n), w.transposed.data(), pairs::padded(n),
                          false);
    return w.transposed.data();
  }
  void add_dv(const float* P, int64_t, int64_t, int64_t bq, int64_t j0, int64_t n,
              float* dv_head, Scratch& w) const {
    const Pair* a = transposed(P, bq, n, w);
    pairs::gemm(fast, n, dv_cols, (bq + 1) / 2, a, 1, pairs::padded(n), w.dout_rows.data(),
                dv_cols, dv_head + j0 * dv_cols, dv_cols, true);
  }
  void dprobs(int64_t bh, int64_t i0, int64_t bq, int64_t kv, int64_t j0, int64_t n, float* dP,
              Scratch&) const {
    const Pair* b = &v_by_dim[kv * z.dv / 2 * key_cols] + j0;
    pairs::gemm(fast, bq, pairs::padded(n), z.dv / 2, words(dout + (bh * z.t + i0) * z.dv),
                z.dv / 2, 1, b, key_cols, dP, pairs::padded(n), false);
  }
  void add_dq(const float* dS, int64_t bq, int64_t kv, int64_t j0, int64_t n, float* dq_rows,
              Scratch& w) const {
    const int64_t width = key_width(n);
    for (int64_t r = 0; r < bq; ++r) pairs::round_row(dS + r * pairs::padded(n), n, key_row(w, r, j0, n));
    const int64_t count = key_pairs(j0, n);
    const Pair* b = &k_by_key[(kv * ((z.s + 1) / 2) + j0 / 2) * d_cols];
    pairs::gemm(fast, bq, d_cols, count, words(w.rows.data()), width / 2, 1, b, d_cols, dq_rows,
                d_cols, true);
  }
  void add_dk(const float* dS, int64_t, int64_t, int64_t bq, int64_t j0, int64_t n,
              float* dk_head, Scratch& w) const {
    const Pair* a = transposed(dS, bq, n, w);
    pairs::gemm(fast, n, d_cols, (bq + 1) / 2, a, 1, pairs::padded(n), w.q_rows.data(), d_cols,
                dk_head + j0 * d_cols, d_cols, true);
  }
};

// How a call is cut into tiles (see the header), and the Python functions of a score_mod's bias.
struct Tiles {
  int64_t rows, keys, block_k;
  py::object mod_bias, mod_bias_grad;  // None without a score_mod (or, in the backward, its grad)

  // The panels of queries: [r0, r1) for r0 = 0, rows, 2 rows, ...
  template <typename F>
  void panels(int64_t t, F&& f) const {
    for (int64_t r0 = 0; r0 < t; r0 += rows) f(r0, std::min(t, r0 + rows));
  }
  // The tiles of `keys` keys that cover the keys [lo, hi) a panel sees, from the key block of
  // the grid of block_k that holds lo (so that every key block of that grid lies in one tile).
  template <typename F>
  void key_tiles(int64_t lo, int64_t hi, F&& f) const {
    for (int64_t c0 = lo / block_k * block_k; c0 < hi; c0 += keys) f(c0, std::min(hi, c0 + keys));
  }
  // f(r0, r1, c0, c1) for every tile of a call, panel by panel, with `sc` adding the tile's bias.
  template <typename F>
  void walk(const Sizes& z, Scoring& sc, F&& f) const {
    panels(z.t, [&](int64_t r0, int64_t r1) {
      const auto [lo, hi] = sc.block_range(r0, r1);
      key_tiles(lo, hi, [&](int64_t c0, int64_t c1) {
        const at::Tensor tile_bias = bias(z, r0, r1, c0, c1);  // alive while f runs
        sc.set_mod_bias(tile_bias, r0, c0);
        f(r0, r1, c0, c1);
      });
    });
  }
  // The score_mod's bias of the tile, expanded to (b, h, r1 - r0, c1 - c0); undefined without one.
  at::Tensor bias(const Sizes& z, int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    if (mod_bias.is_none()) return {};
    auto f = mod_bias(r0, r1, c0, c1).cast<at::Tensor>();
    TORCH_CHECK(f.dim() == 4 && f.scalar_type() == at::kFloat && f.device().is_cpu(),
                "tiled: mod_bias must return a float32 CPU tensor of 4 dims");
    return f.expand({z.b, z.h, r1 - r0, c1 - c0});
  }
};

Tiles tiles_of(int64_t tile_rows, int64_t tile_keys, int64_t block_q, int64_t block_k,
               py::object mod_bias, py::object mod_bias_grad) {
  TORCH_CHECK(tile_rows > 0 && tile_rows % block_q == 0 && tile_keys > 0 &&
                  tile_keys % block_k == 0,
              "tiled: tile sizes must be positive multiples of the block sizes");
  return Tiles{tile_rows, tile_keys, block_k, std::move(mod_bias), std::move(mod_bias_grad)};
}

// The running max m, sum l and unnormalised output (kept in `out` until the end) of every row live
// across the tiles; a tile's work is one parallel pass over its panel's query blocks.
template <typename Blocks>
std::tuple<at::Tensor, at::Tensor> forward_blocks(const Blocks& blocks, const Sizes& z,
                                                        Scoring sc, int64_t block_q,
                                                        int64_t block_k, const Tiles& tiles) {
  const int64_t b = z.b, h = z.h, t = z.t, s = z.s, dv = z.dv, groups = z.h / z.h_kv;
  const int64_t width = blocks.width(dv);
  auto out = at::zeros({b, h, t, width}, at::kFloat);
  auto lse = at::empty({b, h, t}, at::kFloat);
  float *op = out.data_ptr<float>(), *lp = lse.data_ptr<float>();
  std::vector<float> m(b * h * t, kNegInf), l(b * h * t, 0.f);
  std::vector<char> poisoned(b * h * t, 0);  // a NaN score met: the row's output and lse are NaN
  const auto* vp = blocks.values(0);

  const std::vector<char> bad = nonfinite_rows(vp, b * z.h_kv * s, dv);
  // (b h t, dv): a row sees a non-finite value in that column; only if some value is not finite
  std::vector<char> touched(std::any_of(bad.begin(), bad.end(), [](char x) { return x; })
                                ? b * h * t * dv
                                : 0);

  tiles.walk(z, sc, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    const int64_t q_blocks = (r1 - r0 + block_q - 1) / block_q;
    at::parallel_for(0, b * h * q_blocks, 1, [&](int64_t first, int64_t last) {
      c10::InferenceMode no_autograd;  // the block products' views need no autograd bookkeeping
      const int64_t ld_max = blocks.score_stride(block_k);
      std::vector<float> scores(block_q * ld_max), capped(block_k);
      typename Blocks::Scratch scratch(blocks, block_q, block_k);
      for (int64_t item = first; item < last; ++item) {
        const int64_t qb = zigzag(item % q_blocks, q_blocks), bh = item / q_blocks;
        const int64_t batch = bh / h, head = bh % h, kv = batch * z.h_kv + head / groups;
        const int64_t i0 = r0 + qb * block_q, i1 = std::min(r1, i0 + block_q), bq = i1 - i0;
        const auto* v_head = vp + kv * s * dv;
        float *mr = m.data() + bh * t + i0, *lr = l.data() + bh * t + i0;
        float* acc = op + (bh * t + i0) * width;
        char* poisoned_rows = poisoned.data() + bh * t + i0;
        char* touched_rows = touched.empty() ? nullptr : touched.data() + (bh * t + i0) * dv;
        const auto [row_lo, row_hi] = sc.block_range(i0, i1);
        const int64_t from = std::max(row_lo, c0), to = std::min(row_hi, c1);
        for (int64_t j0 = from; j0 < to; j0 += block_k) {
          const int64_t n = std::min(block_k, to - j0), ld = blocks.score_stride(n);
          float* sp = scores.data();
          const char* bad_keys = bad.data() + kv * s + j0;  // keys whose value row is not finite
          const bool clean_block = std::none_of(bad_keys, bad_keys + n, [](char x) { return x; });
          blocks.scores(bh, i0, bq, kv, j0, n, sp, scratch);  // S = Q K^T
          for (int64_t r = 0; r < bq; ++r) {
            float* row = sp + r * ld;
            float block_top;
            if (sc.plain(i0 + r, j0, n)) {  // one pass, not two: a non-finite score makes it NaN
              block_top = row_max<true>(row, n);
            } else {
              sc.apply(row, capped.data(), batch, head, i0 + r, j0, n);
              block_top = row_max(row, n);
            }
            if (!clean_block) {  // selection, not multiplication: only the keys a row sees touch it
              for (int64_t j = 0; j < n; ++j) {
                if (!bad_keys[j] || row[j] == kNegInf) continue;
                const auto* value = v_head + (j0 + j) * dv;
                for (int64_t c = 0; c < dv; ++c) {
                  touched_rows[r * dv + c] |= !finite_value(value[c]);
                }
              }
            }
            poisoned_rows[r] |= block_top != block_top;
            const float top = std::max(mr[r], block_top);
            if (top == kNegInf || poisoned_rows[r]) {  // nothing allowed so far, or NaN: adds nothing
              blocks.no_weights(row, n, r, j0, scratch);
              continue;
            }
            const float sum = blocks.weights(row, n, top, r, j0, scratch);  // P, and its row sum
            const float shrink = exp_nonpositive(mr[r] - top);  // 0 when m was -inf
            lr[r] = lr[r] * shrink + sum;
            mr[r] = top;
            if (shrink != 1.f) {
              float* a = acc + r * width;
#pragma omp simd
              for (int64_t c = 0; c < dv; ++c) a[c] *= shrink;
            }
          }
          blocks.add_values(sp, bq, kv, j0, n, !clean_block, acc, scratch);  // += P V
        }
      }
    });
  });
  at::parallel_for(0, b * h * t, 256, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; ++row) {
      float* o = op + row * width;
      const bool empty = l[row] == 0.f && !poisoned[row];
      const float inverse = poisoned[row] ? kNaN : empty ? 0.f : 1.f / l[row];
      for (int64_t c = 0; c < dv; ++c) o[c] *= inverse;
      if (!touched.empty()) {
        for (int64_t c = 0; c < dv; ++c) o[c] = touched[row * dv + c] ? kNaN : o[c];
      }
      lp[row] = poisoned[row] ? kNaN : empty ? kNegInf : m[row] + std::log(l[row]);
    }
  });
  return {width == dv ? out : out.narrow(3, 0, dv), lse};
}

template <typename Blocks>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_blocks(
    const Blocks& blocks, const Sizes& z, Scoring sc, const at::Tensor& lse,
    const at::Tensor& delta, int64_t block_q, int64_t block_k, bool alibi_grad,
    const Tiles& tiles) {
  const int64_t b = z.b, h = z.h, h_kv = z.h_kv, t = z.t, s = z.s, groups = h / h_kv;
  const int64_t dq_width = blocks.width(z.d), dk_width = dq_width, dv_width = blocks.width(z.dv);
  const int64_t k_blocks = (s + block_k - 1) / block_k;
  const int64_t split =
      std::max<int64_t>(1, std::min(k_blocks, at::get_num_threads() / (b * h_kv)));
  TORCH_CHECK(!alibi_grad || sc.alibi != nullptr, "tiled: alibi_grad without ALiBi slopes");
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  auto dq_parts = at::zeros({split, b, h, t, dq_width}, f32);
  auto dalibi_parts = at::zeros({alibi_grad ? split : 0, b, h}, f32);
  float* dap = dalibi_parts.data_ptr<float>();
  auto dk = at::zeros({b, h_kv, s, dk_width}, f32);
  auto dvv = at::zeros({b, h_kv, s, dv_width}, f32);
  const float *lp = lse.data_ptr<float>(), *dlp = delta.data_ptr<float>();
  float* dqp = dq_parts.data_ptr<float>();
  float *dkp = dk.data_ptr<float>(), *dvp = dvv.data_ptr<float>();
  const bool capping = sc.softcap > 0.f, bias_grad = !tiles.mod_bias_grad.is_none();

  tiles.walk(z, sc, [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    const int64_t q_blocks = (r1 - r0 + block_q - 1) / block_q;
    // dL/df over the tile: dS where a block was visited, 0 elsewhere
    const at::Tensor dbias = bias_grad ? at::zeros({b, h, r1 - r0, c1 - c0}, f32)
                                          : at::Tensor();
    float* dbp = bias_grad ? dbias.data_ptr<float>() : nullptr;
    at::parallel_for(0, b * h_kv * split, 1, [&](int64_t first, int64_t last) {
      c10::InferenceMode no_autograd;
      const int64_t ld_max = blocks.score_stride(block_k);
      std::vector<float> probs(block_q * ld_max), dscores(block_q * ld_max);
      std::vector<float> capped(capping ? block_q * block_k : 0);
      typename Blocks::Scratch scratch(blocks, block_q, block_k);
      for (int64_t item = first; item < last; ++item) {
        const int64_t kv = item / split, part = item % split;
        const int64_t batch = kv / h_kv, kv_head = kv % h_kv;
        float* dk_head = dkp + kv * s * dk_width;
        float* dv_head = dvp + kv * s * dv_width;
        for (int64_t head = kv_head * groups; head < (kv_head + 1) * groups; ++head) {
          const int64_t bh = batch * h + head;
          for (int64_t qb = 0; qb < q_blocks; ++qb) {
            const int64_t i0 = r0 + qb * block_q, i1 = std::min(r1, i0 + block_q), bq = i1 - i0;
            float* dq_blk = dqp + ((part * b * h + bh) * t + i0) * dq_width;
            const auto [row_lo, row_hi] = sc.block_range(i0, i1);
            const int64_t from = std::max(row_lo, c0), to = std::min(row_hi, c1);
            if (from >= to) continue;  // no key of the tile visible to this query block
            blocks.prepare(bh, i0, bq, scratch);
            // This part's key blocks: those of index part, part + split, ... on the grid of
            // block_k.
            const int64_t first_block =
                from / block_k + (part - from / block_k % split + split) % split;
            for (int64_t grid = first_block * block_k; grid < to; grid += split * block_k) {
              const int64_t j0 = std::max(grid, from), n = std::min(grid + block_k, to) - j0;
              const int64_t ld = blocks.score_stride(n);
              float *p = probs.data(), *ds = dscores.data();
              blocks.scores(bh, i0, bq, kv, j0, n, p, scratch);  // S = Q K^T
              for (int64_t r = 0; r < bq; ++r) {
                float* row = p + r * ld;
                sc.apply(row, capping ? capped.data() + r * n : nullptr, batch, head, i0 + r, j0,
                         n);
                probs_row(row, n, lp[bh * t + i0 + r]);  // P
              }
              blocks.add_dv(p, bh, i0, bq, j0, n, dv_head, scratch);  // dV += P^T dO
              blocks.dprobs(bh, i0, bq, kv, j0, n, ds, scratch);      // dP = dO V^T
              for (int64_t r = 0; r < bq; ++r) {
                const float* pr = p + r * ld;
                float* dr = ds + r * ld;
                const float di = dlp[bh * t + i0 + r];
#pragma omp simd
                for (int64_t j = 0; j < n; ++j) {  // dS = P (dP - D): 0 where P is, whatever dP holds
                  dr[j] = pr[j] == 0.f ? 0.f : pr[j] * (dr[j] - di);
                }
                if (dbp != nullptr) {  // the score_mod's f is added after the soft-cap and ALiBi
                  float* d = dbp + ((bh * (r1 - r0)) + i0 + r - r0) * (c1 - c0) + j0 - c0;
                  std::copy(dr, dr + n, d);
                }
                if (alibi_grad) {  // score -= slope |p(i) - j|, after the soft-cap
                  const float pos = static_cast<float>(i0 + r + sc.diagonal - j0);
                  float dslope = 0.f;
#pragma omp simd reduction(+ : dslope)
                  for (int64_t j = 0; j < n; ++j) {
                    dslope -= dr[j] * std::fabs(pos - static_cast<float>(j));
                  }
                  dap[(part * b + batch) * h + head] += dslope;
                }
                if (capping) {
                  const float* th = capped.data() + r * n;
#pragma omp simd
                  for (int64_t j = 0; j < n; ++j) {  // through tanh (th is unset where dS is 0)
                    dr[j] = dr[j] == 0.f ? 0.f : dr[j] * (1.f - th[j] * th[j]);
                  }
                }
              }
              blocks.add_dq(ds, bq, kv, j0, n, dq_blk, scratch);       // dQ += dS K
              blocks.add_dk(ds, bh, i0, bq, j0, n, dk_head, scratch);  // dK += dS^T Q
            }
          }
        }
      }
    });
    if (bias_grad) tiles.mod_bias_grad(r0, r1, c0, c1, dbias);
  });
  auto dalibi = alibi_grad ? dalibi_parts.sum(at::IntArrayRef{0, 1}) : dalibi_parts;
  auto dq = split == 1 ? dq_parts[0] : dq_parts.sum(0);
  return {dq.narrow(3, 0, z.d), dk.narrow(3, 0, z.d), dvv.narrow(3, 0, z.dv), dalibi};
}

Sizes sizes_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const Sizes z{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  TORCH_CHECK(z.h % z.h_kv == 0 && k.sizes() == at::IntArrayRef({z.b, z.h_kv, z.s, z.d}) &&
                  v.sizes() == at::IntArrayRef({z.b, z.h_kv, z.s, z.dv}),
              "tiled: q (b, h, t, d), k (b, h_kv, s, d) and v (b, h_kv, s, dv) disagree");
  return z;
}

// How bf16 blocks are multiplied: 1 vdpbf16ps (needs a build with AVX512-BF16), else portably.
bool fast_pairs(int64_t route) {
  TORCH_CHECK(route == 0 || route == 1, "tiled: unknown route ", route);
  TORCH_CHECK(route == 0 || pairs::kHasAvx512Bf16, "tiled: this build has no AVX512-BF16 products");
  return route == 1;
}

}  // namespace

// Returns out (b, h, t, dv) and lse (b, h, t), float32; with bf16 operands out is a view of rows
// padded to a multiple of 32 columns. Operands all float32 or all bf16 (`route` says how bf16
// blocks are multiplied; see fast_pairs).
std::tuple<at::Tensor, at::Tensor> forward(
    at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor bias, at::Tensor allowed,
    at::Tensor key_mask, at::Tensor alibi, double softcap, int64_t left, int64_t right,
    int64_t shift, int64_t block_q, int64_t block_k, int64_t route, int64_t tile_rows,
    int64_t tile_keys, py::object mod_bias) {
  const auto dtype = check_operands({&q, &k, &v});
  const Sizes z = sizes_of(q, k, v);
  const Scoring sc = make_scoring(z.b, z.h, z.t, z.s, bias, allowed, key_mask, alibi, softcap,
                                  left, right, shift, block_q, block_k);
  const Tiles tiles = tiles_of(tile_rows, tile_keys, block_q, block_k, mod_bias, py::none());
  if (dtype == at::kFloat) {
    return forward_blocks(Float32Blocks(z, q, k, v, nullptr), z, sc, block_q, block_k, tiles);
  }
  return forward_blocks(Bf16Blocks(z, q, k, v, nullptr, fast_pairs(route)), z, sc, block_q,
                        block_k, tiles);
}

// Gradients w.r.t. the pre-scaled q, k, v and (if `alibi_grad`) the ALiBi slopes, float32. `delta`
// (b, h, t) is rowsum(dout * out) minus the lse's gradient (d lse_i / d S_ij = P_ij); `lse` has 0
// for the rows with no allowed key (their probabilities are 0 anyway); dout has the operands' dtype.
// Work is split by key/value head, and when there are fewer of those than threads, by key blocks
// too (every `split`-th block, so that causal work spreads evenly): each item owns dK and dV of its
// key blocks, so no two threads write the same rows. dQ, which every key block adds to, goes to one
// buffer per part, summed at the end (extra memory: split x dq, with split <= threads / (b h_kv));
// the slopes' gradient likewise goes to one (b, h) buffer per part.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    at::Tensor dout, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor lse,
    at::Tensor delta, at::Tensor bias, at::Tensor allowed, at::Tensor key_mask,
    at::Tensor alibi, double softcap, int64_t left, int64_t right, int64_t shift,
    int64_t block_q, int64_t block_k, bool alibi_grad, int64_t route, int64_t tile_rows,
    int64_t tile_keys, py::object mod_bias, py::object mod_bias_grad) {
  const auto dtype = check_operands({&dout, &q, &k, &v});
  const Sizes z = sizes_of(q, k, v);
  TORCH_CHECK(dout.sizes() == at::IntArrayRef({z.b, z.h, z.t, z.dv}),
              "tiled: dout must be (b, h, t, dv)");
  TORCH_CHECK(lse.is_contiguous() && delta.is_contiguous() && lse.numel() == z.b * z.h * z.t &&
                  delta.numel() == z.b * z.h * z.t && lse.scalar_type() == at::kFloat &&
                  delta.scalar_type() == at::kFloat,
              "tiled: lse and delta must be contiguous float32 (b, h, t)");
  const Scoring sc = make_scoring(z.b, z.h, z.t, z.s, bias, allowed, key_mask, alibi, softcap,
                                  left, right, shift, block_q, block_k);
  const Tiles tiles = tiles_of(tile_rows, tile_keys, block_q, block_k, mod_bias, mod_bias_grad);
  if (dtype == at::kFloat) {
    return backward_blocks(Float32Blocks(z, q, k, v, &dout), z, sc, lse, delta, block_q, block_k,
                           alibi_grad, tiles);
  }
  return backward_blocks(Bf16Blocks(z, q, k, v, &dout, fast_pairs(route)), z, sc, lse, delta,
                         block_q, block_k, alibi_grad, tiles);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "Tiled attention forward: (out, lse)");
  m.def("backward", &backward, "Tiled attention backward: (dq, dk, dv, dalibi)");
  m.def("has_avx512_bf16", [] { return pairs::kHasAvx512Bf16; },
        "Whether this build multiplies bf16 blocks with AVX512-BF16");
}
