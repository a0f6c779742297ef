// The sparse kernel's forward: for each query, softmax attention over the keys its indices select,
// in two passes over those keys (their scores, then the weighted sum of their values).
//
// A work item is a block of queries of one (batch row, key/value head). Its keys are walked tile by
// tile (BlockKeys): each tile's rows of K, then of V, are read into cache once for the whole block.
// The g query heads that share the key/value head share each row read, and the selection is worked
// out once for them. Rules (rules/nonfinite.py): a row with no visible key gets 0 and lse -inf; a
// visible key whose score is not finite makes its row NaN; a non-finite value makes NaN the
// columns it is in, of the rows that see its key.

#pragma once

#include <ATen/Parallel.h>

#include <vector>

#include "fast_exp.h"
#include "sparse_rows.h"

namespace {

constexpr int64_t kTileBytes = 1 << 17;      // rows of K (or V) of one tile of keys
constexpr int64_t kBlockScores = 1 << 18;    // scores a block of queries holds at once
constexpr int64_t kMaxBlockQueries = 128;

// The queries of one work item: enough for their g heads' scores to stay within kBlockScores.
inline int64_t block_queries(int64_t g, int64_t n) {
  return std::max<int64_t>(1, std::min(kMaxBlockQueries, kBlockScores / std::max<int64_t>(1, g * n)));
}

// Scratch of one thread, sized once for a call.
struct Scratch {
  BlockKeys selection;
  std::vector<float> scores, queries, acc, top, total;
  std::vector<char> bad;

  Scratch(int64_t s, int64_t n, int64_t block, int64_t g, int64_t d, int64_t dv, int64_t shift)
      : selection(s, n, block, shift), scores(block * g * n), queries(block * g * d),
        acc(block * g * dv), top(block * g), total(block * g),
        bad(block * g) {}
};

// The scores of one query's g heads (rows of `queries`, times scale, and of `scores`, n apart)
// against its keys[begin .. end), four keys at a time.
template <typename T, typename I, int64_t D>
void score_run(const Operands<T, I>& x, int64_t batch, int64_t head, int64_t query,
               const int64_t* keys, int64_t begin, int64_t end, const float* queries,
               float* scores) {
  const int64_t g = x.groups(), d = D ? D : x.d, n = x.n;
  const auto key_row = [&](int64_t j) { return x.key(batch, head, j); };
  int64_t e = begin;
  for (; e + 4 <= end; e += 4) {
    const T* key[4];
    four_rows<T>(key_row, keys + e, end - e, d, key);
    for (int64_t r = 0; r < g; ++r) {  // q as given too, for pair products
      const T* given = x.query(batch, head * g + r, query);
      score4<T, D>(queries + r * d, given, key, x.scale, d, scores + r * n + e);
    }
  }
  for (; e < end; ++e) {
    const T* key = key_row(keys[e]);
    for (int64_t r = 0; r < g; ++r) scores[r * n + e] = dot<T, D>(queries + r * d, key, d);
  }
}

// acc (one query's g heads, dv apart) += its weights (n apart) times the values of its
// keys[begin .. end), four keys at a time.
template <typename T, typename I, int64_t D>
void value_run(const Operands<T, I>& x, int64_t batch, int64_t head, const int64_t* keys,
               int64_t begin, int64_t end, const float* weights, float* acc) {
  const int64_t g = x.groups(), dv = D ? D : x.dv, n = x.n;
  const auto value_row = [&](int64_t j) { return x.value(batch, head, j); };
  int64_t e = begin;
  for (; e + 4 <= end; e += 4) {
    const T* value[4];
    four_rows<T>(value_row, keys + e, end - e, dv, value);
    for (int64_t r = 0; r < g; ++r) add_four<T, D>(acc + r * dv, weights + r * n + e, value, dv);
  }
  for (; e < end; ++e) {
    const T* value = value_row(keys[e]);
    for (int64_t r = 0; r < g; ++r) add_scaled<T, D>(acc + r * dv, weights[r * n + e], value, dv);
  }
}

// Queries i0 .. i0 + rows - 1 of the g query heads of key/value head `head`: out (b, t, h, dv)
// memory, lse (b, h, t). Scores, weights and sums are kept per (query, head) row, q = i * g + r.
template <typename T, typename I, int64_t D>
void attend_block(const Operands<T, I>& x, int64_t batch, int64_t head, int64_t i0, int64_t rows,
                  Scratch& w, T* out, float* lse) {
  const int64_t g = x.groups(), d = D ? D : x.d, dv = D ? D : x.dv, n = x.n;
  BlockKeys& sel = w.selection;
  sel.select(x, batch, head, i0, rows);
  float *queries = w.queries.data(), *scores = w.scores.data(), *acc = w.acc.data();
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t r = 0; r < g; ++r) {
      const T* qr = x.query(batch, head * g + r, i0 + i);
      float* into = queries + (i * g + r) * d;
      for (int64_t c = 0; c < d; ++c) into[c] = static_cast<float>(qr[c]) * x.scale;
    }
  }
  const auto key_row = [&](int64_t j) { return x.key(batch, head, j); };
  const auto value_row = [&](int64_t j) { return x.value(batch, head, j); };
  const int64_t key_bytes = d * static_cast<int64_t>(sizeof(T));
  const int64_t value_bytes = dv * static_cast<int64_t>(sizeof(T));
  for (int64_t tile = 0; tile < sel.tiles; ++tile) {  // scores, a tile of keys at a time
    const bool dense = next_tile_dense(sel, tile, rows);
    for (int64_t i = 0; i < rows; ++i) {
      fetch_next_tile(key_row, key_bytes, sel, tile, i, rows, x.s, dense);
      score_run<T, I, D>(x, batch, head, i0 + i, sel.row(i), sel.begin(i, tile), sel.end(i, tile),
                         queries + i * g * d, scores + i * g * n);
    }
  }
  for (int64_t q = 0; q < rows * g; ++q) {  // each row's softmax
    float* row = scores + q * n;
    const int64_t m = sel.count(q / g);
    bool nonfinite;
    const float most = max_and_finite(row, m, &nonfinite);
    float sum = 0.f;
    for (int64_t e = 0; e < m; ++e) {
      row[e] = exp_nonpositive(row[e] - most);
      sum += row[e];
    }
    w.top[q] = most, w.total[q] = sum, w.bad[q] = nonfinite;
  }
  std::fill(acc, acc + rows * g * dv, 0.f);
  for (int64_t tile = 0; tile < sel.tiles; ++tile) {  // the weighted values, likewise
    const bool dense = next_tile_dense(sel, tile, rows);
    for (int64_t i = 0; i < rows; ++i) {
      fetch_next_tile(value_row, value_bytes, sel, tile, i, rows, x.s, dense);
      value_run<T, I, D>(x, batch, head, sel.row(i), sel.begin(i, tile), sel.end(i, tile),
                         scores + i * g * n, acc + i * g * dv);
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    T* out_row = out + ((batch * x.t + i0 + i) * x.h + head * g) * dv;  // g heads side by side
    float* lse_row = lse + (batch * x.h + head * g) * x.t + i0 + i;    // stride t between heads
    for (int64_t r = 0; r < g; ++r) {
      const int64_t q = i * g + r;
      if (sel.count(i) == 0) {  // no visible key: 0, lse -inf
        std::fill_n(out_row + r * dv, dv, static_cast<T>(0.f));
        lse_row[r * x.t] = -INFINITY;
        continue;
      }
      const float inverse = 1.f / w.total[q];
      for (int64_t c = 0; c < dv; ++c) {
        const float a = acc[q * dv + c];  // inf or NaN only from a non-finite value
        out_row[r * dv + c] = static_cast<T>(w.bad[q] || !finite(a) ? NAN : a * inverse);
      }
      lse_row[r * x.t] = w.bad[q] ? NAN : w.top[q] + std::log(w.total[q]);
    }
  }
}

// Every query: out (b, t, h, dv) memory, lse (b, h, t) float32.
template <typename T, typename I, int64_t D>
void sparse_forward(const Operands<T, I>& x, T* out, float* lse) {
  const int64_t per_block = block_queries(x.groups(), x.n);
  const int64_t blocks = (x.t + per_block - 1) / per_block;
  const int64_t row_bytes = std::max(x.d, x.dv) * static_cast<int64_t>(sizeof(T));
  const int64_t shift = tile_shift(row_bytes, kTileBytes);
  at::parallel_for(0, x.b * x.h_kv * blocks, 1, [&](int64_t first, int64_t last) {
    Scratch w(x.s, x.n, per_block, x.groups(), x.d, x.dv, shift);
    for (int64_t item = first; item < last; ++item) {
      const int64_t block = item % blocks, bh = item / blocks;
      const int64_t batch = bh / x.h_kv, head = bh % x.h_kv;
      const int64_t i0 = block * per_block;
      attend_block<T, I, D>(x, batch, head, i0, std::min(per_block, x.t - i0), w, out, lse);
    }
  });
}

}  // namespace
