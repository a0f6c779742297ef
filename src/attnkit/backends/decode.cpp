// The decode kernel: a few queries against a long key/value cache, in one pass over the cache.
//
// Decoding is bound by memory: every step reads the whole cache once. Two matrix-vector products
// (q . K, then weights . V) read it twice over and, in bf16 on CPUs without bf16 matrix units, run
// at a fraction of the bus speed. Here each work item (batch row, key/value head, split of the keys)
// streams its keys and values once, block by block, with the online softmax of FlashAttention: the
// scores of a block, their running max and sum, and the output rescaled as the max grows. Every
// query row of a key/value head (the group of GQA, times the queries) shares the one read of K and V.
// Arithmetic is in float32 whatever the cache's dtype. The splits are merged in Python
// (attnkit/backends/decode.py) from each split's output, max and sum.
//
// Layout: q (b, h_kv, rows, d) float32 contiguous, already scaled; k, v (b, h_kv, s, d) with the last
// dim contiguous (views of a cache buffer are fine); key_mask (b, s) bool or empty (all real).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;     // keys scored together before one softmax update
constexpr int64_t kMaxRows = 16;   // query rows per key/value head
constexpr int64_t kMaxDim = 256;
constexpr int64_t kPrefetch = 16;  // rows ahead

// exp(x) for x <= 0 that the compiler vectorises: 2^n * p(f) with x log2(e) = n + f, |f| <= 1/2 and
// p of degree 6 (relative error below 2e-7); 0 below -87, where float32 would underflow.
inline float exp_nonpositive(float x) {
  const float y = std::max(x, -87.f) * 1.44269504088896341f;
  const float n = std::nearbyint(y);
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
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return x < -87.f ? 0.f : p;
}

// A row of K or V as float32: the row itself for a float cache, else converted into `buffer`.
template <typename T, int64_t D>
inline const float* as_float(const T* row, float* buffer, int64_t dim) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    const int64_t n = D ? D : dim;
    for (int64_t c = 0; c < n; ++c) buffer[c] = static_cast<float>(row[c]);
    return buffer;
  }
}

// One work item: keys [begin, end) of one (batch row, key/value head) for `rows` query rows. D is the
// head dim when known at compile time (the common widths), 0 for any other width `dim`.
template <typename T, int64_t D>
void attend_split(const float* q, int64_t rows, int64_t dim, const T* k, const T* v,
                  int64_t stride_s, const bool* real, int64_t begin, int64_t end, float* out,
                  float* max_out, float* sum_out) {
  const int64_t d = D ? D : dim;
  alignas(64) float scores[kMaxRows][kBlock];
  alignas(64) float acc[kMaxRows][kMaxDim];
  alignas(64) float buffer[kMaxDim];
  float m[kMaxRows], l[kMaxRows];
  for (int64_t r = 0; r < rows; ++r) {
    m[r] = -FLT_MAX;  // no real key yet
    l[r] = 0.f;
    std::fill(acc[r], acc[r] + d, 0.f);
  }
  for (int64_t j0 = begin; j0 < end; j0 += kBlock) {
    const int64_t n = std::min(kBlock, end - j0);
    bool any_real = real == nullptr;
    for (int64_t j = 0; j < n; ++j) {
      const T* kj = k + (j0 + j) * stride_s;
      __builtin_prefetch(kj + kPrefetch * stride_s);
      const bool masked = real != nullptr && !real[j0 + j];
      any_real = any_real || !masked;
      const float* key = as_float<T, D>(kj, buffer, d);
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = q + r * d;
        float dot = 0.f;
        for (int64_t c = 0; c < d; ++c) dot += qr[c] * key[c];
        scores[r][j] = masked ? -FLT_MAX : dot;
      }
    }
    if (!any_real) continue;  // the block adds nothing; its values need not be read
    for (int64_t r = 0; r < rows; ++r) {
      float block_max = m[r];
      for (int64_t j = 0; j < n; ++j) block_max = std::max(block_max, scores[r][j]);
      const float alpha = exp_nonpositive(m[r] - block_max);
      m[r] = block_max;
      float sum = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        // A masked key's -FLT_MAX minus a real max is below -87: its weight is 0.
        const float p = exp_nonpositive(scores[r][j] - block_max);
        scores[r][j] = p;
        sum += p;
      }
      l[r] = l[r] * alpha + sum;
      if (alpha != 1.f) {
        for (int64_t c = 0; c < d; ++c) acc[r][c] *= alpha;
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* vj = v + (j0 + j) * stride_s;
      __builtin_prefetch(vj + kPrefetch * stride_s);
      const float* value = as_float<T, D>(vj, buffer, d);
      for (int64_t r = 0; r < rows; ++r) {
        const float p = scores[r][j];
        for (int64_t c = 0; c < d; ++c) acc[r][c] += p * value[c];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    max_out[r] = m[r];
    sum_out[r] = l[r];
    std::copy(acc[r], acc[r] + d, out + r * d);
  }
}

template <typename T, int64_t D>
void run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
         const torch::Tensor& key_mask, int64_t splits, torch::Tensor& out, torch::Tensor& max,
         torch::Tensor& sum) {
  const int64_t b = q.size(0), h_kv = q.size(1), rows = q.size(2), d = q.size(3), s = k.size(2);
  const int64_t per_split = (s + splits - 1) / splits;
  const float* qp = q.data_ptr<float>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  const bool* mp = key_mask.numel() ? key_mask.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  float* maxp = max.data_ptr<float>();
  float* sump = sum.data_ptr<float>();
  at::parallel_for(0, b * h_kv * splits, 1, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t split = item % splits, bh = item / splits;
      const int64_t batch = bh / h_kv, head = bh % h_kv;
      const int64_t begin = std::min(s, split * per_split);
      const int64_t end = std::min(s, begin + per_split);
      attend_split<T, D>(qp + bh * rows * d, rows, d,
                         kp + batch * k.stride(0) + head * k.stride(1),
                         vp + batch * v.stride(0) + head * v.stride(1), k.stride(2),
                         mp ? mp + batch * key_mask.stride(0) : nullptr, begin, end,
                         op + item * rows * d, maxp + item * rows, sump + item * rows);
    }
  });
}

}  // namespace

// Returns, per (b, h_kv, split), the unnormalised output (b, h_kv, splits, rows, d), the running max
// and the sum of exponentials (b, h_kv, splits, rows); a split with no real key has sum 0.
std::vector<torch::Tensor> decode_partial(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                          torch::Tensor key_mask, int64_t splits) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "decode_partial: q must be a contiguous float32 (b, h_kv, rows, d) tensor");
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes() && v.strides() == k.strides() &&
                  k.stride(3) == 1 && k.scalar_type() == v.scalar_type(),
              "decode_partial: k and v must share shape, strides and dtype, last dim contiguous");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3),
              "decode_partial: q and k disagree on (b, h_kv, d)");
  TORCH_CHECK(q.size(2) <= kMaxRows && q.size(3) <= kMaxDim && splits >= 1,
              "decode_partial: at most 16 query rows per key/value head and head_dim 256");
  TORCH_CHECK(key_mask.numel() == 0 || (key_mask.scalar_type() == torch::kBool &&
                                        key_mask.dim() == 2 && key_mask.stride(1) == 1),
              "decode_partial: key_mask must be an empty tensor or a (b, s) bool tensor");
  const auto sizes = std::vector<int64_t>{q.size(0), q.size(1), splits, q.size(2)};
  auto options = q.options();
  auto out = torch::empty({q.size(0), q.size(1), splits, q.size(2), q.size(3)}, options);
  auto max = torch::empty(sizes, options);
  auto sum = torch::empty(sizes, options);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "decode_partial", [&] {
    switch (q.size(3)) {
      case 64: run<scalar_t, 64>(q, k, v, key_mask, splits, out, max, sum); break;
      case 128: run<scalar_t, 128>(q, k, v, key_mask, splits, out, max, sum); break;
      default: run<scalar_t, 0>(q, k, v, key_mask, splits, out, max, sum);
    }
  });
  return {out, max, sum};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_partial", &decode_partial, "One pass of online-softmax attention over a cache");
}
