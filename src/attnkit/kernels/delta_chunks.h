// The gated delta rule in chunks, forward and backward: the form of attnkit/linear/chunked.py in
// C++, a chunk of kChunk tokens at a time, every product a small matrix product on one thread.
// Bound in the linear kernel's build (linear.cpp), called from attnkit/linear/kernel.py.
//
// For one value head of one sequence, with S (dk, dv) the state at a chunk's start, c the running
// sum of g inside the chunk, D_ij = exp(c_i - c_j) (j <= i), b = beta and e = exp(c):
//   A = strictly_lower(diag(b) K K^T o D)
//   U = (I + A)^-1 diag(b) V,  W = (I + A)^-1 diag(b e) K      (forward substitution)
//   delta = U - W S                                            (V without beta)
//   O = diag(e) Q S + P delta,  P = lower(Q K^T o D)
//   S' = e_C S + (diag(e_C / e) K)^T delta
// Every exponent is a difference c_i - c_j <= 0 (g <= 0): nothing overflows.
//
// The backward runs the chunks in reverse with the gradient of S', recomputing each chunk's A, U,
// W, P and delta from its starting state. The starting states come from the forward, which keeps
// them when asked (one (dk, dv) state per chunk), or from a first pass over the chunks.
//
// q and k are L2-normalised (where asked) and q scaled as each chunk's rows are gathered, so that
// no normalised copy of them is ever made; the backward takes their gradients back through it.
//
// Layout: q, k (tokens, h_k, dk), v (tokens, h, dv), g, beta (tokens, h) or empty, contiguous
// float32, the tokens of every batch row one after the other; bounds (N + 1) int64 offsets of the
// N sequences in them; states (N, h, dk, dv). Value head j reads query and key head j / (h / h_k).
// Work items are (sequence, value head), spread over the threads.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "small_gemm.h"

namespace chunks {

constexpr int64_t kChunk = 64;  // tokens solved at once, as CHUNK in attnkit/linear/chunked.py
constexpr int64_t kC = kChunk;  // the row stride of every (chunk, chunk) matrix

struct Inputs {
  const float *q, *k, *v, *g, *beta;
  int64_t h_k, h, dk, dv;
  float eps, scale;  // q and k L2-normalised with eps (none where it is negative), q scaled
};

// 1 / sqrt(|x|^2 + eps) for a row of n, or 1 where eps < 0 (no normalisation).
inline float inverse_norm(const float* x, int64_t n, float eps) {
  if (eps < 0.f) return 1.f;
  float sq = 0.f;
  for (int64_t i = 0; i < n; ++i) sq += x[i] * x[i];
  return 1.f / std::sqrt(sq + eps);
}

// out (n) = x * factor.
inline void scaled(const float* x, int64_t n, float factor, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * factor;
}

// One work item: a value head of one sequence, and the chunk being computed.
struct Item {
  int64_t start, length, key_head, head, sequence;
};

// One thread's buffers for one chunk; rows beyond n are never read.
struct Chunk {
  int64_t n = 0, first = 0;  // tokens in the chunk, and the first one's index
  std::vector<float> q, k, v, c, beta, p, a, u, w, delta, out;
  Chunk(int64_t dk, int64_t dv)
      : q(kC * dk), k(kC * dk), v(kC * dv), c(kC), beta(kC), p(kC * kC), a(kC * kC),
        u(kC * dv), w(kC * dk), delta(kC * dv), out(kC * std::max(dk, dv)) {}
};

inline int64_t chunk_count(int64_t length) { return (length + kChunk - 1) / kChunk; }

// The chunk of `item` that starts at token `first`: its rows gathered, its running log decay, and
// what needs no state: P, A / diag(b) (strictly lower K K^T o D, in ch.a), U and W.
inline void prepare(const Inputs& in, const Item& item, int64_t first, Chunk& ch) {
  const int64_t n = ch.n = std::min(kChunk, item.start + item.length - first), dk = in.dk,
                dv = in.dv;
  ch.first = first;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t token = first + i, at = token * in.h + item.head;
    const float *q = in.q + (token * in.h_k + item.key_head) * dk,
                *k = in.k + (token * in.h_k + item.key_head) * dk;
    scaled(q, dk, in.scale * inverse_norm(q, dk, in.eps), ch.q.data() + i * dk);
    scaled(k, dk, inverse_norm(k, dk, in.eps), ch.k.data() + i * dk);
    std::copy_n(in.v + at * dv, dv, ch.v.data() + i * dv);
    ch.c[i] = (i ? ch.c[i - 1] : 0.f) + (in.g ? in.g[at] : 0.f);
    ch.beta[i] = in.beta ? in.beta[at] : 1.f;
  }
  float *p = ch.p.data(), *a = ch.a.data();
  gemm::nt(n, n, dk, 1.f, ch.q.data(), dk, ch.k.data(), dk, 0.f, p, kC);
  if (in.beta) gemm::nt(n, n, dk, 1.f, ch.k.data(), dk, ch.k.data(), dk, 0.f, a, kC);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j <= i; ++j) {
      const float decay = std::exp(ch.c[i] - ch.c[j]);
      p[i * kC + j] *= decay;
      if (in.beta) a[i * kC + j] = j < i ? a[i * kC + j] * decay : 0.f;
    }
    std::fill(p + i * kC + i + 1, p + i * kC + n, 0.f);
  }
  if (!in.beta) return;
  for (int64_t i = 0; i < n; ++i) {  // (I + A) U = diag(b) V, (I + A) W = diag(b e) K
    float* u = ch.u.data() + i * dv;
    float* w = ch.w.data() + i * dk;
    const float b = ch.beta[i], be = b * std::exp(ch.c[i]);
    for (int64_t x = 0; x < dv; ++x) u[x] = b * ch.v[i * dv + x];
    for (int64_t x = 0; x < dk; ++x) w[x] = be * ch.k[i * dk + x];
    for (int64_t j = 0; j < i; ++j) {
      const float aij = b * a[i * kC + j];
      const float *uj = ch.u.data() + j * dv, *wj = ch.w.data() + j * dk;
      for (int64_t x = 0; x < dv; ++x) u[x] -= aij * uj[x];
      for (int64_t x = 0; x < dk; ++x) w[x] -= aij * wj[x];
    }
  }
}

// delta = U - W S (V without beta), from the chunk's starting state s.
inline void corrections(const Inputs& in, const float* s, Chunk& ch) {
  const int64_t n = ch.n, dv = in.dv;
  if (!in.beta) {
    std::copy_n(ch.v.data(), n * dv, ch.delta.data());
    return;
  }
  std::copy_n(ch.u.data(), n * dv, ch.delta.data());
  gemm::nn(n, dv, in.dk, -1.f, ch.w.data(), in.dk, s, dv, 1.f, ch.delta.data(), dv);
}

// rows (n, width): row i times exp(c_i) (toward_end: times exp(c_last - c_i)), into out.
inline void decayed(const Chunk& ch, const float* rows, int64_t width, bool toward_end,
                    float* out) {
  const float last = ch.c[ch.n - 1];
  for (int64_t i = 0; i < ch.n; ++i) {
    const float f = std::exp(toward_end ? last - ch.c[i] : ch.c[i]);
    for (int64_t x = 0; x < width; ++x) out[i * width + x] = f * rows[i * width + x];
  }
}

// s = e_C s + (diag(e_C / e) K)^T delta: the state after the chunk, in place.
inline void advance(const Inputs& in, float* s, Chunk& ch) {
  const float gamma = std::exp(ch.c[ch.n - 1]);
  for (int64_t x = 0; x < in.dk * in.dv; ++x) s[x] *= gamma;
  float* kd = ch.out.data();
  decayed(ch, ch.k.data(), in.dk, true, kd);
  gemm::tn(in.dk, in.dv, ch.n, 1.f, kd, in.dk, ch.delta.data(), in.dv, 1.f, s, in.dv);
}

// O = diag(e) Q S + P delta, into ch.out (n, dv).
inline void read(const Inputs& in, const float* s, Chunk& ch) {
  float* o = ch.out.data();
  gemm::nn(ch.n, in.dv, in.dk, 1.f, ch.q.data(), in.dk, s, in.dv, 0.f, o, in.dv);
  decayed(ch, o, in.dv, false, o);
  gemm::nn(ch.n, in.dv, ch.n, 1.f, ch.p.data(), kC, ch.delta.data(), in.dv, 1.f, o, in.dv);
}

// One work item's chunks in order: its outputs into o (tokens, h, dv), its state s advanced in
// place, and each chunk's starting state into kept (h states apart), unless it is null.
inline void forward_item(const Inputs& in, const Item& item, float* s, float* kept, float* o,
                         Chunk& ch) {
  const int64_t size = in.dk * in.dv;
  for (int64_t i = 0; i < chunk_count(item.length); ++i) {
    if (kept) std::copy_n(s, size, kept + i * in.h * size);
    prepare(in, item, item.start + i * kChunk, ch);
    corrections(in, s, ch);
    read(in, s, ch);
    for (int64_t r = 0; r < ch.n; ++r) {
      std::copy_n(ch.out.data() + r * in.dv, in.dv, o + ((ch.first + r) * in.h + item.head) * in.dv);
    }
    advance(in, s, ch);
  }
}

// The items of a call: one per (sequence, value head).
inline std::vector<Item> items_of(const at::Tensor& bounds, int64_t h, int64_t h_k) {
  const int64_t* bp = bounds.data_ptr<int64_t>();
  std::vector<Item> items;
  for (int64_t n = 0; n + 1 < bounds.numel(); ++n) {
    for (int64_t j = 0; j < h; ++j) items.push_back({bp[n], bp[n + 1] - bp[n], j / (h / h_k), j, n});
  }
  return items;
}

// The items split into one share per thread, of about equal work (chunks): the longest first,
// each to the share with the least so far. at::parallel_for alone would give each thread a run of
// neighbouring items, and a packed batch's long sequences to one of them.
inline std::vector<std::vector<int64_t>> shares_of(const std::vector<Item>& items) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  std::vector<int64_t> order(items.size());
  for (size_t x = 0; x < order.size(); ++x) order[x] = static_cast<int64_t>(x);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return items[a].length > items[b].length;
  });
  std::vector<std::vector<int64_t>> shares(threads);
  std::vector<int64_t> work(threads, 0);
  for (const int64_t x : order) {
    const auto least = std::min_element(work.begin(), work.end()) - work.begin();
    shares[least].push_back(x);
    work[least] += chunk_count(items[x].length);
  }
  return shares;
}

// The items of shares begin to end, one after the other.
inline std::vector<int64_t> flat(const std::vector<std::vector<int64_t>>& shares, int64_t begin,
                                 int64_t end) {
  std::vector<int64_t> items;
  for (int64_t s = begin; s < end; ++s) items.insert(items.end(), shares[s].begin(), shares[s].end());
  return items;
}

// Where each sequence's kept states start, in chunks: (N + 1) offsets.
inline std::vector<int64_t> chunk_offsets(const at::Tensor& bounds) {
  const int64_t* bp = bounds.data_ptr<int64_t>();
  std::vector<int64_t> offsets{0};
  for (int64_t n = 0; n + 1 < bounds.numel(); ++n) {
    offsets.push_back(offsets.back() + chunk_count(bp[n + 1] - bp[n]));
  }
  return offsets;
}

inline Inputs inputs_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& g, const at::Tensor& beta, double eps, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) % q.size(1) == 0,
              "delta_chunks: q and k must be (tokens, h_k, dk), v (tokens, h, dv), h a multiple of h_k");
  for (const auto& x : {q, k, v}) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(),
                "delta_chunks: q, k and v must be contiguous float32");
  }
  for (const auto& x : {g, beta}) {
    TORCH_CHECK(x.numel() == 0 || (x.scalar_type() == at::kFloat && x.is_contiguous() &&
                                   x.numel() == v.size(0) * v.size(1)),
                "delta_chunks: g and beta must be empty or contiguous float32 (tokens, h)");
  }
  return {q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
          g.numel() ? g.data_ptr<float>() : nullptr, beta.numel() ? beta.data_ptr<float>() : nullptr,
          q.size(1), v.size(1), q.size(2), v.size(2), static_cast<float>(eps),
          static_cast<float>(scale)};
}

}  // namespace chunks

// The forward: o (tokens, h, dv) and the final states (N, h, dk, dv), from state (N, h, dk, dv),
// q and k normalised with eps (where it is not negative) and q times scale; where keep, also every
// chunk's starting state (chunks, h, dk, dv), sequence after sequence, for the backward.
inline std::vector<at::Tensor> delta_chunks_forward(at::Tensor q, at::Tensor k, at::Tensor v,
                                                    at::Tensor g, at::Tensor beta,
                                                    at::Tensor state, at::Tensor bounds,
                                                    double eps, double scale, bool keep) {
  const chunks::Inputs in = chunks::inputs_of(q, k, v, g, beta, eps, scale);
  TORCH_CHECK(bounds.dim() == 1 && bounds.scalar_type() == at::kLong && bounds.numel() >= 2,
              "delta_chunks: bounds must be (N + 1,) int64");
  const int64_t sequences = bounds.numel() - 1, dk = in.dk, dv = in.dv, h = in.h;
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() &&
                  state.sizes() == at::IntArrayRef({sequences, h, dk, dv}),
              "delta_chunks: state must be contiguous float32 (N, h, dk, dv)");
  const auto items = chunks::items_of(bounds, h, in.h_k);
  const auto offsets = chunks::chunk_offsets(bounds);
  auto o = at::empty({q.size(0), h, dv}, v.options());
  auto final_state = state.clone();
  auto kept = at::empty({keep ? offsets.back() : 0, h, dk, dv}, state.options());
  float *op = o.data_ptr<float>(), *sp = final_state.data_ptr<float>();
  float* kp = keep ? kept.data_ptr<float>() : nullptr;
  const auto shares = chunks::shares_of(items);
  at::parallel_for(0, static_cast<int64_t>(shares.size()), 1, [&](int64_t begin, int64_t end) {
    chunks::Chunk ch(dk, dv);
    for (const int64_t x : chunks::flat(shares, begin, end)) {
      const chunks::Item& item = items[x];
      const int64_t slot = item.sequence * h + item.head, first_kept = offsets[item.sequence] * h;
      chunks::forward_item(in, item, sp + slot * dk * dv,
                           kp ? kp + (first_kept + item.head) * dk * dv : nullptr, op, ch);
    }
  });
  return {o, final_state, kept};
}
