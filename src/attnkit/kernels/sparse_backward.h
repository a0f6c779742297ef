// The sparse kernel's backward: each query's weights recomputed over the keys it selects, from the
// scores and the forward's log-sum-exp, then
//
//   dP = dO V^T,  dS = P * (dP - delta),  dQ = scale dS K,  dK += scale dS^T Q,  dV += P^T dO
//
// over those keys alone. dQ belongs to its query; dK and dV gather from every query that selects
// a key, so each thread adds into float32 sums of its own (one copy of dK and dV per split of the
// queries of a (batch row, key/value head)), which the caller adds up. As in the forward, a block
// of queries walks its keys tile by tile, so that a tile's rows of K, V, dK and dV stay in cache
// while every query of the block that selected them uses them.

#pragma once

#include <ATen/Parallel.h>

#include <vector>

#include "fast_exp.h"
#include "sparse_forward.h"
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

template <typename T>
struct BackwardScratch {
  BlockKeys selection;
  std::vector<float> queries, douts, dq, lse, delta, weights, dscores;
  std::vector<const T*> query_rows, dout_rows;  // each (query, head)'s rows as given

  BackwardScratch(int64_t s, int64_t n, int64_t block, int64_t g, int64_t d, int64_t dv,
                  int64_t shift)
      : selection(s, n, block, shift), queries(block * g * d), douts(block * g * dv),
        dq(block * g * d), lse(block * g), delta(block * g), weights(4 * g), dscores(4 * g),
        query_rows(block * g),
        dout_rows(block * g) {}
};

// Four keys of query i (rows q = i * g + r of the scratch): their weights and dS for each of the g
// heads, dQ's rows, and the four keys' rows of this split's dK and dV.
// kLocal: the weights and dS of up to 16 heads in arrays of the function's own, which the
// compiler knows no row of dK or dV can overlap (in the scratch, every store to a row would make
// it read them again); more heads use the scratch.
template <typename T, int64_t D, bool kLocal>
inline void four_keys(const T* const key[4], const T* const value[4], const int64_t* j,
                      int64_t i, int64_t g, int64_t d, int64_t dv, BackwardScratch<T>& w, float* dk,
                      float* dv_sums, const T* const* query_rows, const T* const* dout_rows,
                      float scale) {
  float own_p[kLocal ? 64 : 1], own_ds[kLocal ? 64 : 1];
  float* p = kLocal ? own_p : w.weights.data();  // (g, 4)
  float* ds = kLocal ? own_ds : w.dscores.data();
  for (int64_t r = 0; r < g; ++r) {
    const int64_t q = i * g + r;
    float scores[4], dp[4];
    score4<T, D>(w.queries.data() + q * d, query_rows[r], key, scale, d, scores);
    score4<T, D>(w.douts.data() + q * dv, dout_rows[r], value, 1.f, dv, dp);
    for (int u = 0; u < 4; ++u) {
      p[r * 4 + u] = exp_nonpositive(scores[u] - w.lse[q]);
      ds[r * 4 + u] = p[r * 4 + u] * (dp[u] - w.delta[q]);
    }
    add_four<T, D>(w.dq.data() + q * d, ds + r * 4, key, d);
  }
  for (int u = 0; u < 4; ++u) {
    float* dk_row = dk + j[u] * d;
    float* dv_row = dv_sums + j[u] * dv;
    for (int64_t r = 0; r < g; ++r) {  // the queries hold scale * q
      add_scaled<float, D>(dk_row, ds[r * 4 + u], w.queries.data() + (i * g + r) * d, d);
      add_scaled<float, D>(dv_row, p[r * 4 + u], w.douts.data() + (i * g + r) * dv, dv);
    }
  }
}

// One key of query i, as four_keys does four.
template <typename T, int64_t D>
inline void one_key(const T* key, const T* value, int64_t j, int64_t i, int64_t g,
                    int64_t d, int64_t dv, BackwardScratch<T>& w, float* dk, float* dv_sums) {
  for (int64_t r = 0; r < g; ++r) {
    const int64_t q = i * g + r;
    const float* query = w.queries.data() + q * d;
    const float* dout = w.douts.data() + q * dv;
    const float p = exp_nonpositive(dot<T, D>(query, key, d) - w.lse[q]);
    const float ds = p * (dot<T, D>(dout, value, dv) - w.delta[q]);
    add_scaled<T, D>(w.dq.data() + q * d, ds, key, d);
    add_scaled<float, D>(dk + j * d, ds, query, d);
    add_scaled<float, D>(dv_sums + j * dv, p, dout, dv);
  }
}

// Queries i0 .. i0 + rows - 1 of the g query heads of key/value head `head`, adding into this
// split's dk and dv.
template <typename T, typename I, int64_t D>
void backward_block(const Operands<T, I>& x, const Gradients<T>& y, int64_t batch, int64_t head,
                    int64_t i0, int64_t rows, float* dk, float* dv_sums, BackwardScratch<T>& w) {
  const int64_t g = x.groups(), d = D ? D : x.d, dv = D ? D : x.dv;
  BlockKeys& sel = w.selection;
  sel.select(x, batch, head, i0, rows);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t r = 0; r < g; ++r) {
      const int64_t q = i * g + r, hr = head * g + r, at = (batch * x.h + hr) * x.t + i0 + i;
      const T* qr = x.query(batch, hr, i0 + i);
      const T* dor = y.dout + batch * y.do_b + hr * y.do_h + (i0 + i) * y.do_t;
      for (int64_t c = 0; c < d; ++c) w.queries[q * d + c] = static_cast<float>(qr[c]) * x.scale;
      for (int64_t c = 0; c < dv; ++c) w.douts[q * dv + c] = static_cast<float>(dor[c]);
      w.lse[q] = y.lse[at], w.delta[q] = y.delta[at];
    }
  }
  std::fill(w.dq.begin(), w.dq.begin() + rows * g * d, 0.f);
  const T** query_rows = w.query_rows.data();
  const T** dout_rows = w.dout_rows.data();
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t r = 0; r < g; ++r) {
      const int64_t hr = head * g + r;
      query_rows[i * g + r] = x.query(batch, hr, i0 + i);
      dout_rows[i * g + r] = y.dout + batch * y.do_b + hr * y.do_h + (i0 + i) * y.do_t;
    }
  }
  const auto key_row = [&](int64_t j) { return x.key(batch, head, j); };
  const auto value_row = [&](int64_t j) { return x.value(batch, head, j); };
  const auto dk_row = [&](int64_t j) { return dk + j * d; };
  const auto dv_row = [&](int64_t j) { return dv_sums + j * dv; };
  const int64_t key_bytes = d * static_cast<int64_t>(sizeof(T));
  const int64_t value_bytes = dv * static_cast<int64_t>(sizeof(T));
  for (int64_t tile = 0; tile < sel.tiles; ++tile) {
    const bool dense = next_tile_dense(sel, tile, rows);
    for (int64_t i = 0; i < rows; ++i) {
      fetch_next_tile(key_row, key_bytes, sel, tile, i, rows, x.s, dense);
      fetch_next_tile(value_row, value_bytes, sel, tile, i, rows, x.s, dense);
      fetch_next_tile(dk_row, 4 * d, sel, tile, i, rows, x.s, dense);
      fetch_next_tile(dv_row, 4 * dv, sel, tile, i, rows, x.s, dense);
      const int64_t* keys = sel.row(i);
      const int64_t end = sel.end(i, tile);
      int64_t e = sel.begin(i, tile);
      for (; e + 4 <= end; e += 4) {
        const T *key[4], *value[4];
        four_rows<T>(key_row, keys + e, end - e, d, key);
        four_rows<T>(value_row, keys + e, end - e, dv, value);
        if (g <= 16)
          four_keys<T, D, true>(key, value, keys + e, i, g, d, dv, w, dk, dv_sums,
                                query_rows + i * g, dout_rows + i * g, x.scale);
        else
          four_keys<T, D, false>(key, value, keys + e, i, g, d, dv, w, dk, dv_sums,
                                 query_rows + i * g, dout_rows + i * g, x.scale);
      }
      for (; e < end; ++e) {
        one_key<T, D>(key_row(keys[e]), value_row(keys[e]), keys[e], i, g, d, dv, w, dk, dv_sums);
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t r = 0; r < g; ++r) {
      T* into = y.dq + ((batch * x.h + head * g + r) * x.t + i0 + i) * d;
      const float* from = w.dq.data() + (i * g + r) * d;
      for (int64_t c = 0; c < d; ++c) into[c] = static_cast<T>(from[c] * x.scale);
    }
  }
}

// Every query; a work item is one split of the queries of one (batch row, key/value head), walked
// in blocks, adding into the split's own copy of dk and dv.
template <typename T, typename I, int64_t D>
void sparse_backward(const Operands<T, I>& x, const Gradients<T>& y) {
  const int64_t splits = y.splits, per_split = (x.t + splits - 1) / splits;
  const int64_t items = x.b * x.h_kv;
  const int64_t per_block = block_queries(x.groups(), x.n);
  const int64_t row_bytes = 2 * std::max(x.d, x.dv) * static_cast<int64_t>(sizeof(T) + 4);
  const int64_t shift = tile_shift(row_bytes, 2 * kTileBytes);
  at::parallel_for(0, splits * items, 1, [&](int64_t first, int64_t last) {
    BackwardScratch<T> w(x.s, x.n, per_block, x.groups(), x.d, x.dv, shift);
    for (int64_t task = first; task < last; ++task) {
      const int64_t split = task / items, bh = task % items;
      const int64_t batch = bh / x.h_kv, head = bh % x.h_kv;
      float* dk = y.dk + (split * items + bh) * x.s * x.d;
      float* dv = y.dv + (split * items + bh) * x.s * x.dv;
      const int64_t end = std::min(x.t, (split + 1) * per_split);
      for (int64_t i0 = split * per_split; i0 < end; i0 += per_block) {
        backward_block<T, I, D>(x, y, batch, head, i0, std::min(per_block, end - i0), dk, dv, w);
      }
    }
  });
}

}  // namespace
