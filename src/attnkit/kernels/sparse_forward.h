// The sparse kernel's forward: for each query, softmax attention over the keys its indices select,
// in two passes over those keys (their scores, then the weighted sum of their values), gathered
// one row at a time and fetched a few keys ahead.
//
// A work item is a block of queries of one (batch row, key/value head); the g query heads that
// share the key/value head share each gathered row of K and V, and the selection is worked out
// once for them. Rules (rules/nonfinite.py): a row with no visible key gets 0 and lse -inf; a
// visible key whose score is not finite makes its row NaN; a non-finite value makes NaN the
// columns it is in, of the rows that see its key.

#pragma once

#include <ATen/Parallel.h>

#include <vector>

#include "sparse_rows.h"

namespace {

constexpr int64_t kQueriesPerItem = 16;

// Scratch of one thread, sized once for a call.
struct Scratch {
  std::vector<uint64_t> seen;
  std::vector<int64_t> keys;
  std::vector<float> scores, queries, acc, row;

  Scratch(int64_t s, int64_t n, int64_t g, int64_t d, int64_t dv)
      : seen((s + 63) / 64, 0), keys(n), scores(g * n), queries(g * d), acc(g * dv),
        row(std::max(d, dv)) {}
};

// Query i of query heads head * g .. head * g + g - 1: out (b, t, h, dv) memory, lse (b, h, t).
template <typename T, typename I, int64_t D>
void attend_query(const Operands<T, I>& x, int64_t batch, int64_t head, int64_t i, Scratch& w,
                  T* out, float* lse) {
  const int64_t g = x.groups(), d = D ? D : x.d, dv = D ? D : x.dv;
  const int64_t m = x.visible(batch, head, i, w.seen.data(), w.keys.data());
  const int64_t* keys = w.keys.data();
  T* out_row = out + ((batch * x.t + i) * x.h + head * g) * dv;  // g heads side by side
  float* lse_row = lse + (batch * x.h + head * g) * x.t + i;       // stride t between heads
  if (m == 0) {
    std::fill(out_row, out_row + g * dv, static_cast<T>(0.f));
    for (int64_t r = 0; r < g; ++r) lse_row[r * x.t] = -INFINITY;
    return;
  }
  float* queries = w.queries.data();
  for (int64_t r = 0; r < g; ++r) {
    const T* qr = x.query(batch, head * g + r, i);
    for (int64_t c = 0; c < d; ++c) queries[r * d + c] = static_cast<float>(qr[c]) * x.scale;
  }
  float* scores = w.scores.data();  // (g, m)
  for (int64_t e = 0; e < m; ++e) {
    if (e + kAhead < m) fetch_row(x.key(batch, head, keys[e + kAhead]), d);
    const float* key = as_float<T, D>(x.key(batch, head, keys[e]), w.row.data(), d);
    for (int64_t r = 0; r < g; ++r) scores[r * m + e] = dot<D>(queries + r * d, key, d);
  }
  float top[16], total[16];  // g <= 16 (checked by sparse.cpp)
  bool bad[16];
  for (int64_t r = 0; r < g; ++r) {
    float* row = scores + r * m;
    float most = -FLT_MAX;
    bool all_finite = true;
    for (int64_t e = 0; e < m; ++e) {
      most = std::max(most, row[e]);
      all_finite = all_finite && finite(row[e]);
    }
    float sum = 0.f;
    for (int64_t e = 0; e < m; ++e) {
      row[e] = std::exp(row[e] - most);
      sum += row[e];
    }
    top[r] = most, total[r] = sum, bad[r] = !all_finite;
  }
  float* acc = w.acc.data();  // (g, dv)
  std::fill(acc, acc + g * dv, 0.f);
  for (int64_t e = 0; e < m; ++e) {
    if (e + kAhead < m) fetch_row(x.value(batch, head, keys[e + kAhead]), dv);
    const float* value = as_float<T, D>(x.value(batch, head, keys[e]), w.row.data(), dv);
    for (int64_t r = 0; r < g; ++r) add_scaled<D>(acc + r * dv, scores[r * m + e], value, dv);
  }
  for (int64_t r = 0; r < g; ++r) {
    const float inverse = 1.f / total[r];
    for (int64_t c = 0; c < dv; ++c) {
      const float a = acc[r * dv + c];  // inf or NaN only from a non-finite value
      out_row[r * dv + c] = static_cast<T>(bad[r] || !finite(a) ? NAN : a * inverse);
    }
    lse_row[r * x.t] = bad[r] ? NAN : top[r] + std::log(total[r]);
  }
}

// Every query: out (b, t, h, dv) memory, lse (b, h, t) float32.
template <typename T, typename I, int64_t D>
void sparse_forward(const Operands<T, I>& x, T* out, float* lse) {
  const int64_t blocks = (x.t + kQueriesPerItem - 1) / kQueriesPerItem;
  at::parallel_for(0, x.b * x.h_kv * blocks, 1, [&](int64_t first, int64_t last) {
    Scratch w(x.s, x.n, x.groups(), x.d, x.dv);
    for (int64_t item = first; item < last; ++item) {
      const int64_t block = item % blocks, bh = item / blocks;
      const int64_t batch = bh / x.h_kv, head = bh % x.h_kv;
      const int64_t end = std::min(x.t, (block + 1) * kQueriesPerItem);
      for (int64_t i = block * kQueriesPerItem; i < end; ++i) {
        attend_query<T, I, D>(x, batch, head, i, w, out, lse);
      }
    }
  });
}

}  // namespace
