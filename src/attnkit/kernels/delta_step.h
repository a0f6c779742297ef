// One decoding step of the gated delta rule: each head's (d_k, d_v) state decayed, read for the
// token's key and query, corrected and written back, a block of columns at a time (read, then
// written while the block is in L1). Bound in the linear kernel's build (linear.cpp), called from
// attnkit/linear/step.py.
//
// q and k are first L2-normalised where asked (x / sqrt(|x|^2 + eps)) and q scaled; g is raised to
// the floor the caller gives. With S the state before the step and e = exp(g):
//   S^T k  and  S^T q          reading a block of S's columns (both times e)
//   delta = (v - e S^T k) beta (or v: no correction)
//   o = e S^T q + delta (k . q)  (the read after the write, without reading S again)
//   S = e S + k delta^T        writing the block in place, from L1
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace delta {

// x (n) normalised (where eps >= 0: x / sqrt(|x|^2 + eps)) and scaled, into out.
inline void prepared(const float* x, int64_t n, float eps, float scale, float* out) {
  float norm = 1.f;
  if (eps >= 0.f) {
    float sq = 0.f;
    for (int64_t i = 0; i < n; ++i) sq += x[i] * x[i];
    norm = 1.f / std::sqrt(sq + eps);
  }
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * norm * scale;
}

// Value columns a block of the state holds: 32 columns of float32 by up to 128 rows are 16 KiB,
// which stay in L1 between the block's read and its write.
constexpr int64_t kColumns = 32;

// The step of one head, s (dk, dv) updated in place, o (dv) written; q and k as prepared. A block of
// kColumns value columns at a time: its rows read once for S^T k and S^T q, then, still in L1,
// decayed and corrected, so that the state crosses the memory bus once each way, as a copy does.
inline void head_step(float* s, const float* q, const float* k, const float* v, float decay,
                      float beta, bool correct, float* o, int64_t dk, int64_t dv) {
  float kq = 0.f;
  for (int64_t i = 0; i < dk; ++i) kq += k[i] * q[i];
  for (int64_t first = 0; first < dv; first += kColumns) {
    const int64_t width = std::min(kColumns, dv - first);
    float read_k[kColumns] = {}, read_q[kColumns] = {}, delta[kColumns];
    for (int64_t i = 0; i < dk; ++i) {
      const float* row = s + i * dv + first;
      const float ki = k[i], qi = q[i];
      for (int64_t j = 0; j < width; ++j) {
        read_k[j] += row[j] * ki;
        read_q[j] += row[j] * qi;
      }
    }
    for (int64_t j = 0; j < width; ++j) {
      const float predicted = decay * read_k[j];  // (e S)^T k
      delta[j] = correct ? (v[first + j] - predicted) * beta : v[first + j];
      o[first + j] = decay * read_q[j] + delta[j] * kq;
    }
    for (int64_t i = 0; i < dk; ++i) {
      float* row = s + i * dv + first;
      const float ki = k[i];
      for (int64_t j = 0; j < width; ++j) row[j] = decay * row[j] + ki * delta[j];
    }
  }
}

}  // namespace delta

// state (b, h, dk, dv) float32, updated in place; q and k (b, h_k, dk), v (b, h, dv) float32; g
// and beta (b, h) float32, or empty (no decay, no correction); eps < 0: q and k as they are, else
// L2-normalised with it; q then times scale; g raised to g_floor. Value head j reads query and key
// head j / (h / h_k). Returns o (b, h, dv).
inline at::Tensor delta_step(at::Tensor state, at::Tensor q, at::Tensor k, at::Tensor v,
                             at::Tensor g, at::Tensor beta, double eps, double scale,
                             double g_floor) {
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat && state.is_contiguous(),
              "delta_step: state must be a contiguous float32 (b, h, dk, dv)");
  const int64_t b = state.size(0), h = state.size(1), dk = state.size(2), dv = state.size(3);
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && q.size(0) == b && q.size(2) == dk &&
                  h % q.size(1) == 0,
              "delta_step: q and k must be (b, h_k, dk), h a multiple of h_k");
  TORCH_CHECK(v.dim() == 3 && v.size(0) == b && v.size(1) == h && v.size(2) == dv,
              "delta_step: v must be (b, h, dv)");
  for (const auto& x : {q, k, v}) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(),
                "delta_step: q, k and v must be contiguous float32");
  }
  for (const auto& x : {g, beta}) {
    TORCH_CHECK(x.numel() == 0 || (x.scalar_type() == at::kFloat && x.is_contiguous() &&
                                   x.numel() == b * h),
                "delta_step: g and beta must be empty or contiguous float32 (b, h)");
  }
  auto o = at::empty({b, h, dv}, v.options());
  const int64_t h_k = q.size(1), r = h / h_k;
  float* sp = state.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* gp = g.numel() ? g.data_ptr<float>() : nullptr;
  const float* bp = beta.numel() ? beta.data_ptr<float>() : nullptr;
  float* op = o.data_ptr<float>();
  at::parallel_for(0, b * h, 1, [&](int64_t first, int64_t last) {
    std::vector<float> qk(2 * dk);  // this head's query and key, prepared
    for (int64_t bh = first; bh < last; ++bh) {
      const int64_t key_head = (bh / h) * h_k + (bh % h) / r;
      delta::prepared(qp + key_head * dk, dk, static_cast<float>(eps), static_cast<float>(scale),
                      qk.data());
      delta::prepared(kp + key_head * dk, dk, static_cast<float>(eps), 1.f, qk.data() + dk);
      const float decay = gp ? std::exp(std::max(gp[bh], static_cast<float>(g_floor))) : 1.f;
      delta::head_step(sp + bh * dk * dv, qk.data(), qk.data() + dk, vp + bh * dv, decay,
                       bp ? bp[bh] : 1.f, bp != nullptr, op + bh * dv, dk, dv);
    }
  });
  return o;
}
