// The sparse kernel's backward: each query's weights recomputed over the keys it selects, from the
// scores and the forward's log-sum-exp, then
//
//   dP = dO V^T,  dS = P * (dP - delta),  dQ = scale dS K,  dK += scale dS^T Q,  dV += P^T dO
//
// over those keys alone. dQ belongs to its query; dK and dV gather from every query that selects
// a key, so each thread adds into float32 sums of its own (one copy of dK and dV per split of the
// queries of a (batch row, key/value head)), which the caller adds up.

#pragma once

#include <ATen/Parallel.h>

#include <vector>

#include "sparse_rows.h"

namespace {

// The tensors only the backward takes, as pointers; lse and delta (b, h, t) float32, contiguous,
// delta = rowsum(dO * O) minus the lse's gradient.
template <typename T>
struct Gradients {
  const T* dout;
  int64_t do_b, do_h, do_t;
  const float *lse, *delta;
  T* dq;                // (b, h, t, d), contiguous
  float *dk, *dv;       // (splits, b, h_kv, s, d or dv), contiguous
  int64_t splits;
};

struct BackwardScratch {
  std::vector<uint64_t> seen;
  std::vector<int64_t> keys;
  std::vector<float> queries, douts, dq, key, value;

  BackwardScratch(int64_t s, int64_t n, int64_t g, int64_t d, int64_t dv)
      : seen((s + 63) / 64, 0), keys(n), queries(g * d), douts(g * dv), dq(g * d), key(d),
        value(dv) {}
};

// Query i of the g query heads of key/value head `head`, adding into this split's dk and dv rows.
template <typename T, typename I, int64_t D>
void backward_query(const Operands<T, I>& x, const Gradients<T>& y, int64_t batch, int64_t head,
                    int64_t i, float* dk, float* dv, BackwardScratch& w) {
  const int64_t g = x.groups(), d = D ? D : x.d, dvs = D ? D : x.dv;
  T* dq_rows = y.dq + ((batch * x.h + head * g) * x.t + i) * d;  // stride t * d between heads
  const int64_t m = x.visible(batch, head, i, w.seen.data(), w.keys.data());
  if (m == 0) {
    for (int64_t r = 0; r < g; ++r) std::fill_n(dq_rows + r * x.t * d, d, static_cast<T>(0.f));
    return;
  }
  float *queries = w.queries.data(), *douts = w.douts.data(), *dq = w.dq.data();
  float lse[16], delta[16];
  for (int64_t r = 0; r < g; ++r) {
    const int64_t hr = head * g + r, at = (batch * x.h + hr) * x.t + i;
    const T* qr = x.query(batch, hr, i);
    const T* dor = y.dout + batch * y.do_b + hr * y.do_h + i * y.do_t;
    for (int64_t c = 0; c < d; ++c) queries[r * d + c] = static_cast<float>(qr[c]) * x.scale;
    for (int64_t c = 0; c < dvs; ++c) douts[r * dvs + c] = static_cast<float>(dor[c]);
    lse[r] = y.lse[at], delta[r] = y.delta[at];
  }
  std::fill(dq, dq + g * d, 0.f);
  const int64_t* keys = w.keys.data();
  for (int64_t e = 0; e < m; ++e) {
    if (e + kAhead < m) {
      const int64_t ahead = keys[e + kAhead];
      fetch_row(x.key(batch, head, ahead), d);
      fetch_row(x.value(batch, head, ahead), dvs);
      fetch_row(dk + ahead * d, d);
      fetch_row(dv + ahead * dvs, dvs);
    }
    const int64_t j = keys[e];
    const float* key = as_float<T, D>(x.key(batch, head, j), w.key.data(), d);
    const float* value = as_float<T, D>(x.value(batch, head, j), w.value.data(), dvs);
    float* dk_row = dk + j * d;
    float* dv_row = dv + j * dvs;
    for (int64_t r = 0; r < g; ++r) {
      const float p = std::exp(dot<D>(queries + r * d, key, d) - lse[r]);
      const float ds = p * (dot<D>(douts + r * dvs, value, dvs) - delta[r]);
      add_scaled<D>(dq + r * d, ds, key, d);
      add_scaled<D>(dk_row, ds, queries + r * d, d);  // queries hold scale * q
      add_scaled<D>(dv_row, p, douts + r * dvs, dvs);
    }
  }
  for (int64_t r = 0; r < g; ++r) {
    for (int64_t c = 0; c < d; ++c) dq_rows[r * x.t * d + c] = static_cast<T>(dq[r * d + c] * x.scale);
  }
}

// Every query; a work item is one split of the queries of one (batch row, key/value head), adding
// into the split's own copy of dk and dv.
template <typename T, typename I, int64_t D>
void sparse_backward(const Operands<T, I>& x, const Gradients<T>& y) {
  const int64_t splits = y.splits, per_split = (x.t + splits - 1) / splits;
  const int64_t items = x.b * x.h_kv;
  at::parallel_for(0, splits * items, 1, [&](int64_t first, int64_t last) {
    BackwardScratch w(x.s, x.n, x.groups(), x.d, x.dv);
    for (int64_t task = first; task < last; ++task) {
      const int64_t split = task / items, bh = task % items;
      const int64_t batch = bh / x.h_kv, head = bh % x.h_kv;
      float* dk = y.dk + (split * items + bh) * x.s * x.d;
      float* dv = y.dv + (split * items + bh) * x.s * x.dv;
      const int64_t end = std::min(x.t, (split + 1) * per_split);
      for (int64_t i = split * per_split; i < end; ++i) {
        backward_query<T, I, D>(x, y, batch, head, i, dk, dv, w);
      }
    }
  });
}

}  // namespace
