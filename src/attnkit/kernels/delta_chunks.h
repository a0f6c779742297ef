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

// Rows of float32 or bf16 values, read as float32.
struct Rows {
  const void* data;
  bool bf16;
};

// Row `row` of x (n entries a row) into out, as float32.
inline void load(const Rows& x, int64_t row, int64_t n, float* out) {
  if (!x.bf16) {
    std::copy_n(static_cast<const float*>(x.data) + row * n, n, out);
    return;
  }
  const auto* bits = static_cast<const pairs::Bf16*>(x.data) + row * n;
  for (int64_t i = 0; i < n; ++i) out[i] = pairs::value(bits[i]);
}

struct Inputs {
  Rows q, k, v;
  const float *g, *beta;
  int64_t h_k, h, dk, dv;
  float eps, scale;  // q and k L2-normalised with eps (none where it is negative), q scaled
  bool half;         // every product in bf16 pairs (small_gemm.h)
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
  std::vector<float> q, k, v, c, beta, p, a, t, u, w, delta, out;
  Chunk(int64_t dk, int64_t dv)
      : q(kC * dk), k(kC * dk), v(kC * dv), c(kC), beta(kC), p(kC * kC), a(kC * kC), t(kC * kC),
        u(kC * dv), w(kC * dk), delta(kC * dv), out(kC * std::max(dk, dv)) {}
};

inline int64_t chunk_count(int64_t length) { return (length + kChunk - 1) / kChunk; }

// ch.t = T = (I + diag(b) A)^-1, unit lower triangular, row by row: T_i = e_i - b_i sum_l<i A_il T_l.
// n^3 / 6 multiply-adds, where solving for U and W token by token would take n^2 (dk + dv) / 2 at
// the speed of a vector update rather than of a product.
inline void invert(Chunk& ch) {
  const int64_t n = ch.n;
  float* t = ch.t.data();
  for (int64_t i = 0; i < n; ++i) {
    float* row = t + i * kC;
    std::fill(row, row + n, 0.f);
    for (int64_t l = 0; l < i; ++l) {
      const float a = ch.a[i * kC + l];
      const float* above = t + l * kC;
      for (int64_t j = 0; j <= l; ++j) row[j] += a * above[j];
    }
    for (int64_t j = 0; j < i; ++j) row[j] *= -ch.beta[i];
    row[i] = 1.f;
  }
}

// The chunk of `item` that starts at token `first`: its rows gathered, its running log decay, and
// what needs no state: P, A / diag(b) (strictly lower K K^T o D, in ch.a), T, U and W.
inline void prepare(const Inputs& in, const Item& item, int64_t first, Chunk& ch) {
  const int64_t n = ch.n = std::min(kChunk, item.start + item.length - first), dk = in.dk,
                dv = in.dv;
  ch.first = first;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t token = first + i, at = token * in.h + item.head;
    float *q = ch.q.data() + i * dk, *k = ch.k.data() + i * dk;
    load(in.q, token * in.h_k + item.key_head, dk, q);
    load(in.k, token * in.h_k + item.key_head, dk, k);
    scaled(q, dk, in.scale * inverse_norm(q, dk, in.eps), q);
    scaled(k, dk, inverse_norm(k, dk, in.eps), k);
    load(in.v, at, dv, ch.v.data() + i * dv);
    ch.c[i] = (i ? ch.c[i - 1] : 0.f) + (in.g ? in.g[at] : 0.f);
    ch.beta[i] = in.beta ? in.beta[at] : 1.f;
  }
  float *p = ch.p.data(), *a = ch.a.data();
  gemm::nt(in.half, n, n, dk, 1.f, ch.q.data(), dk, ch.k.data(), dk, 0.f, p, kC);
  if (in.beta) gemm::nt(in.half, n, n, dk, 1.f, ch.k.data(), dk, ch.k.data(), dk, 0.f, a, kC);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j <= i; ++j) {
      const float decay = std::exp(ch.c[i] - ch.c[j]);
      p[i * kC + j] *= decay;
      if (in.beta) a[i * kC + j] = j < i ? a[i * kC + j] * decay : 0.f;
    }
    std::fill(p + i * kC + i + 1, p + i * kC + n, 0.f);
  }
  if (!in.beta) return;
  invert(ch);  // U = T diag(b) V, W = T diag(b e) K: two products (in float32: T's entries grow)
  float* scratch = ch.out.data();
  for (int64_t i = 0; i < n; ++i) scaled(ch.v.data() + i * dv, dv, ch.beta[i], scratch + i * dv);
  gemm::nn(false, n, dv, n, 1.f, ch.t.data(), kC, scratch, dv, 0.f, ch.u.data(), dv);
  for (int64_t i = 0; i < n; ++i) {
    scaled(ch.k.data() + i * dk, dk, ch.beta[i] * std::exp(ch.c[i]), scratch + i * dk);
  }
  gemm::nn(false, n, dk, n, 1.f, ch.t.data(), kC, scratch, dk, 0.f, ch.w.data(), dk);
}

// delta = U - W S (V without beta), from the chunk's starting state s.
inline void corrections(const Inputs& in, const float* s, Chunk& ch) {
  const int64_t n = ch.n, dv = in.dv;
  if (!in.beta) {
    std::copy_n(ch.v.data(), n * dv, ch.delta.data());
    return;
  }
  std::copy_n(ch.u.data(), n * dv, ch.delta.data());
  gemm::nn(in.half, n, dv, in.dk, -1.f, ch.w.data(), in.dk, s, dv, 1.f, ch.delta.data(), dv);
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
  gemm::tn(in.half, in.dk, in.dv, ch.n, 1.f, kd, in.dk, ch.delta.data(), in.dv, 1.f, s, in.dv);
}

// O = diag(e) Q S + P delta, into ch.out (n, dv).
inline void read(const Inputs& in, const float* s, Chunk& ch) {
  float* o = ch.out.data();
  gemm::nn(in.half, ch.n, in.dv, in.dk, 1.f, ch.q.data(), in.dk, s, in.dv, 0.f, o, in.dv);
  decayed(ch, o, in.dv, false, o);
  gemm::nn(in.half, ch.n, in.dv, ch.n, 1.f, ch.p.data(), kC, ch.delta.data(), in.dv, 1.f, o, in.dv);
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
                        const at::Tensor& g, const at::Tensor& beta, double eps, double scale,
                        bool half) {
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.dim() == 3 && v.size(0) == q.size(0) &&
                  v.size(1) % q.size(1) == 0,
              "delta_chunks: q and k must be (tokens, h_k, dk), v (tokens, h, dv), h a multiple of h_k");
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  for (const auto& x : {q, k, v}) {
    TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                    x.scalar_type() == q.scalar_type() && x.is_contiguous(),
                "delta_chunks: q, k and v must be contiguous, all float32 or all bfloat16");
  }
  for (const auto& x : {g, beta}) {
    TORCH_CHECK(x.numel() == 0 || (x.scalar_type() == at::kFloat && x.is_contiguous() &&
                                   x.numel() == v.size(0) * v.size(1)),
                "delta_chunks: g and beta must be empty or contiguous float32 (tokens, h)");
  }
  return {{q.data_ptr(), bf16}, {k.data_ptr(), bf16}, {v.data_ptr(), bf16},
          g.numel() ? g.data_ptr<float>() : nullptr, beta.numel() ? beta.data_ptr<float>() : nullptr,
          q.size(1), v.size(1), q.size(2), v.size(2), static_cast<float>(eps),
          static_cast<float>(scale), half && pairs::kHasAvx512Bf16};
}

}  // namespace chunks

// The forward: o (tokens, h, dv) and the final states (N, h, dk, dv), from state (N, h, dk, dv),
// q and k normalised with eps (where it is not negative) and q times scale, the products in bf16
// where half (in a build with AVX512-BF16); where keep, also every chunk's starting state (chunks,
// h, dk, dv), sequence after sequence, for the backward.
inline std::vector<at::Tensor> delta_chunks_forward(at::Tensor q, at::Tensor k, at::Tensor v,
                                                    at::Tensor g, at::Tensor beta,
                                                    at::Tensor state, at::Tensor bounds,
                                                    double eps, double scale, bool half,
                                                    bool keep) {
  const chunks::Inputs in = chunks::inputs_of(q, k, v, g, beta, eps, scale, half);
  TORCH_CHECK(bounds.dim() == 1 && bounds.scalar_type() == at::kLong && bounds.numel() >= 2 &&
                  bounds.is_cpu() && bounds.is_contiguous(),
              "delta_chunks: bounds must be a contiguous CPU (N + 1,) int64 tensor");
  const int64_t sequences = bounds.numel() - 1, dk = in.dk, dv = in.dv, h = in.h;
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() &&
                  state.sizes() == at::IntArrayRef({sequences, h, dk, dv}),
              "delta_chunks: state must be contiguous float32 (N, h, dk, dv)");
  const auto items = chunks::items_of(bounds, h, in.h_k);
  const auto offsets = chunks::chunk_offsets(bounds);
  auto o = at::empty({q.size(0), h, dv}, state.options());
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
