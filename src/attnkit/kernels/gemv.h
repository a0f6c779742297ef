// The projections' matrix-vector product of a decoding step: y_i = x w_i^T + bias_i for a few
// rows of x and a few weights (one token's query, key and value projections in one call), on every
// thread. Bound in the decode kernel's build (decode.cpp), called from attnkit/kernels/gemv.py.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

namespace gemv {

constexpr int64_t kLinearLanes = 16;  // the float32 lanes of each of linear_rows' dot products

// y[r * out] = x_r . wr + b for one row `wr` of a weight and every row of x (xs: x as float32,
// `rows` rows of `in`, then zero rows up to a multiple of kGroup), kGroup rows of x at a time.
template <typename T, int64_t kGroup>
inline void project(const T* wr, float b, T* y, int64_t out, const float* xs, int64_t rows,
                    int64_t in) {
  const int64_t body = in - in % kLinearLanes;
  for (int64_t r0 = 0; r0 < rows; r0 += kGroup) {
    const float* xr = xs + r0 * in;
    float acc[kGroup][kLinearLanes] = {};
    for (int64_t c = 0; c < body; c += kLinearLanes) {
      for (int64_t lane = 0; lane < kLinearLanes; ++lane) {
        const float weight = static_cast<float>(wr[c + lane]);
        for (int64_t g = 0; g < kGroup; ++g) acc[g][lane] += weight * xr[g * in + c + lane];
      }
    }
    for (int64_t g = 0; g < std::min(kGroup, rows - r0); ++g) {
      float dot = b;
      for (int64_t c = body; c < in; ++c) dot += static_cast<float>(wr[c]) * xr[g * in + c];
      for (int64_t lane = 0; lane < kLinearLanes; ++lane) dot += acc[g][lane];
      y[(r0 + g) * out] = static_cast<T>(dot);
    }
  }
}

// y_i = x w_i^T + bias_i for a few rows of x and a few weights (one token's projections while
// decoding: q, k and v in one call). The threads share the rows of all the weights, each streaming
// its share once, row after row (one sequential stream: faster here than four rows side by side), for
// kGroup rows of x at a time while the row is in L1 (one for one token, else four); each dot product
// in sixteen float32 lanes, half-precision weights converted as they are read. MKL's sgemv ran these
// few rows on one thread, below the bus's speed (docs/bench/choices.md).
template <typename T, int64_t kGroup>
void linear_rows(const at::Tensor& x, const std::vector<at::Tensor>& ws,
                 const std::vector<at::Tensor>& biases, std::vector<at::Tensor>& ys) {
  const int64_t rows = x.size(0), in = x.size(1);
  const int64_t padded = (rows + kGroup - 1) / kGroup * kGroup;
  std::vector<float> xs(padded * in, 0.f);  // x as float32, zero rows up to a multiple of kGroup
  const T* xp = x.data_ptr<T>();
  for (int64_t i = 0; i < rows * in; ++i) xs[i] = static_cast<float>(xp[i]);
  std::vector<int64_t> starts{0};  // weight i's rows are o in [starts[i], starts[i + 1])
  for (const auto& w : ws) starts.push_back(starts.back() + w.size(0));

  at::parallel_for(0, starts.back(), 64, [&](int64_t first, int64_t last) {
    for (size_t i = 0; i < ws.size(); ++i) {
      const int64_t out = ws[i].size(0);
      const T* wp = ws[i].data_ptr<T>();
      const T* bp = biases[i].defined() ? biases[i].data_ptr<T>() : nullptr;
      T* yp = ys[i].data_ptr<T>();
      const int64_t lo = std::max(first, starts[i]) - starts[i];
      const int64_t hi = std::min(last, starts[i + 1]) - starts[i];
      for (int64_t o = lo; o < hi; ++o) {
        const float b = bp ? static_cast<float>(bp[o]) : 0.f;
        project<T, kGroup>(wp + o * in, b, yp + o, out, xs.data(), rows, in);  // one row of w
      }
    }
  });
}

}  // namespace gemv

// [x (..., in) @ w (out_i, in)^T + bias_i (out_i,)] for each weight, all of one dtype, the weights
// and biases contiguous. Returns one (..., out_i) tensor per weight.
inline std::vector<at::Tensor> linear(at::Tensor x, std::vector<at::Tensor> weights,
                                  std::vector<std::optional<at::Tensor>> biases) {
  TORCH_CHECK(!weights.empty() && biases.size() == weights.size(),
              "linear: one bias (or None) for each of one or more weights");
  TORCH_CHECK(x.dim() >= 1, "linear: x must be (..., in)");
  std::vector<at::Tensor> bs, ys;
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && x.size(-1) == w.size(1) && w.is_contiguous() &&
                    x.scalar_type() == w.scalar_type(),
                "linear: x (..., in) and each weight a contiguous (out, in) of x's dtype");
    const auto b = biases[i].value_or(at::Tensor());  // undefined: no bias
    TORCH_CHECK(!b.defined() || (b.dim() == 1 && b.size(0) == w.size(0) && b.is_contiguous() &&
                                  b.scalar_type() == w.scalar_type()),
                "linear: each bias must be None or (out,) contiguous, of its weight's dtype");
    bs.push_back(b);
    ys.push_back(at::empty({rows.size(0), w.size(0)}, x.options()));
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear", [&] {
    if (rows.size(0) == 1) {
      gemv::linear_rows<scalar_t, 1>(rows, weights, bs, ys);
    } else {
      gemv::linear_rows<scalar_t, 4>(rows, weights, bs, ys);
    }
  });
  auto shape = x.sizes().vec();
  for (size_t i = 0; i < ys.size(); ++i) {
    shape.back() = weights[i].size(0);
    ys[i] = ys[i].view(shape);
  }
  return ys;
}

