// The tiled kernel's forward: FlashAttention-2's online softmax over the tiles of a call. Each
// query block walks the key blocks its rows may see; each row of a block of scores is masked, then
// folded into the row's running max, sum and output while it is in cache.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "pair_products.h"
#include "tiled_dropout.h"
#include "tiled_rows.h"
#include "tiled_scores.h"
#include "tiled_simd.h"
#include "tiled_walk.h"

namespace {

inline bool finite_value(float x) { return finite(x); }
inline bool finite_value(pairs::Bf16 x) { return pairs::finite(x); }

// Which of the `n` rows of each of the `heads` heads (in b * heads) of `x` hold a NaN or an
// infinity in their `width` entries (one flag a row, head by head), on every thread.
template <typename T>
std::vector<char> nonfinite_rows(const Operand<const T>& x, int64_t heads, int64_t n,
                                 int64_t width) {
  std::vector<char> flags(heads * n);
  at::parallel_for(0, heads * n, 256, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t j = i % n;
      const T* head = x.row(i / n, 0);
      pairs::prefetch_row(head, j, n, width, x.ld);
      bool all_finite = true;
      const T* row = head + j * x.ld;
#pragma omp simd reduction(&& : all_finite)
      for (int64_t c = 0; c < width; ++c) all_finite = all_finite && finite_value(row[c]);
      flags[i] = !all_finite;
    }
  });
  return flags;
}

// The columns of the values that a row of scores over n keys sees (score not -inf) and that are not
// finite, marked in `touched` (dv flags). `bad_keys`: the keys whose value row is not finite;
// `values`: the n keys' value rows (dv entries, `ld` apart). Selection, not multiplication: only
// the keys a row sees touch it.
template <typename T>
inline void touch(const float* row, int64_t n, const char* bad_keys, const T* values, int64_t ld,
                  int64_t dv, char* touched) {
  for (int64_t j = 0; j < n; ++j) {
    if (!bad_keys[j] || row[j] == kNegInf) continue;
    const T* value = values + j * ld;
    for (int64_t c = 0; c < dv; ++c) touched[c] |= !finite_value(value[c]);
  }
}

// The forward of one call. The running max m, sum l and unnormalised output (the accumulator
// `acc`) of every row live across the tiles; a tile's work is one parallel pass over its panel's
// query blocks. The output goes to `result` (b, h, t, its first dv' <= dv columns), float32, bf16
// or float16 with rows of contiguous entries. The accumulator is `result` itself where it is
// float32 with rows of `width`; else, in a call of one tile, a query block's rows in its thread's
// scratch, rounded into `result` when the block is done; else float32 rows of `width` for the
// whole call (`buffer`), rounded into it at the end.
template <typename Blocks>
struct ForwardPass {
  const Blocks& blocks;
  const Sizes z;
  Scoring sc;  // the walk sets its tile's score_mod bias
  const Dropout drop;
  const int64_t block_q, block_k, width;  // width: the accumulator's row, blocks.width(dv)
  at::Tensor result;                      // (b, h, t, dv')
  const bool in_place, in_scratch;        // the accumulator: `result`; a block's rows in scratch
  at::Tensor buffer, lse;                 // (b, h, t, width) or empty; (b, h, t)
  Operand<float> acc;                     // `result` or `buffer`, unless in_scratch
  std::vector<float> m, l;     // (b h t)
  std::vector<char> poisoned;  // a NaN score met: the row's output and lse are NaN
  std::vector<char> bad;       // (b h_kv s): the keys whose value row is not finite
  // (b h t, dv): a row sees a non-finite value in that column; only if some value is not finite
  std::vector<char> touched;

  // A thread's buffers: one block of scores (P in place), a row's tanh from Scoring::apply (which
  // the forward does not read), and the block products' own.
  struct Scratch {
    std::vector<float> scores, capped, acc;
    typename Blocks::Scratch products;
    explicit Scratch(const ForwardPass& pass)
        : scores(pass.block_q * pass.blocks.score_stride(pass.block_k)), capped(pass.block_k),
          acc(pass.in_scratch ? pass.block_q * pass.width : 0),
          products(pass.blocks, pass.block_q, pass.block_k) {}
  };

  // The rows [i0, i0 + bq) of one query block within the call's state.
  struct Rows {
    float *m, *l, *acc;        // acc: rows of `width` entries, `acc_ld` apart
    int64_t acc_ld;
    char *poisoned, *touched;  // touched: rows of dv, or null
  };

  ForwardPass(const Blocks& blocks_, const Sizes& z_, const Scoring& sc_, const Dropout& drop_,
              int64_t block_q_, int64_t block_k_, const at::Tensor& result_, bool one_tile)
      : blocks(blocks_), z(z_), sc(sc_), drop(drop_), block_q(block_q_), block_k(block_k_),
        width(blocks.width(z.dv)), result(result_),
        in_place(result.scalar_type() == at::kFloat && width == result.size(3)),
        in_scratch(one_tile && !in_place),
        buffer(in_place || in_scratch ? at::Tensor()
                                      : at::empty({z.b, z.h, z.t, width}, at::kFloat)),
        lse(at::empty({z.b, z.h, z.t}, at::kFloat)),
        acc(in_place     ? Operand<float>(result, result.data_ptr<float>())
            : in_scratch ? Operand<float>()
                         : Operand<float>(buffer, buffer.data_ptr<float>())),
        m(z.b * z.h * z.t, kNegInf), l(z.b * z.h * z.t, 0.f), poisoned(z.b * z.h * z.t, 0),
        bad(nonfinite_rows(blocks.values(), z.b * z.h_kv, z.s, z.dv)),
        touched(std::any_of(bad.begin(), bad.end(), [](char x) { return x; })
                    ? z.b * z.h * z.t * z.dv
                    : 0) {}

  // Returns the result (b, h, t, dv') and lse (b, h, t).
  std::tuple<at::Tensor, at::Tensor> run(const Tiles& tiles) {
    tiles.walk(z, sc, [&](const Tile& tile) {
      const int64_t q_blocks = (tile.r1 - tile.r0 + block_q - 1) / block_q;
      at::parallel_for(0, z.b * z.h * q_blocks, 1, [&](int64_t first, int64_t last) {
        c10::InferenceMode no_autograd;  // the block products' views need no autograd bookkeeping
        Scratch scratch(*this);
        for (int64_t item = first; item < last; ++item) {
          const int64_t qb = zigzag(item % q_blocks, q_blocks), bh = item / q_blocks;
          const int64_t i0 = tile.r0 + qb * block_q;
          query_block(QueryBlock::of(z, bh, i0, std::min(tile.r1, i0 + block_q)), tile, scratch);
        }
      });
    });
    return finish();
  }

  // One query block over the keys of the tile it may see, key block by key block; its rows'
  // accumulators start at 0 in the first tile of its panel, in the thread that fills them.
  void query_block(const QueryBlock& qb, const Tile& tile, Scratch& scratch) {
    const int64_t first_row = qb.bh * z.t + qb.i0;
    float* acc_rows = in_scratch ? scratch.acc.data() : acc.row(qb.bh, qb.i0);
    const Rows rows{m.data() + first_row, l.data() + first_row, acc_rows,
                    in_scratch ? width : acc.ld, poisoned.data() + first_row,
                    touched.empty() ? nullptr : touched.data() + first_row * z.dv};
    for (int64_t r = 0; tile.first && r < qb.bq; ++r) {
      std::fill(rows.acc + r * rows.acc_ld, rows.acc + r * rows.acc_ld + width, 0.f);
    }
    const auto [row_lo, row_hi] = sc.block_range(qb.i0, qb.i1);
    const int64_t from = std::max(row_lo, tile.c0), to = std::min(row_hi, tile.c1);
    for (int64_t j0 = from; j0 < to; j0 += block_k) {
      const int64_t n = std::min(block_k, to - j0), ld = blocks.score_stride(n);
      float* sp = scratch.scores.data();
      const char* bad_keys = bad.data() + qb.kv * z.s + j0;  // keys whose value row is not finite
      const bool clean_block = std::none_of(bad_keys, bad_keys + n, [](char x) { return x; });
      blocks.scores(qb.bh, qb.i0, qb.bq, qb.kv, j0, n, sp, scratch.products);  // S = Q K^T
      for (int64_t r = 0; r < qb.bq; ++r) {
        add_row(qb, r, j0, n, sp + r * ld, clean_block ? nullptr : bad_keys, rows, scratch);
      }
      blocks.add_values(sp, qb.bq, qb.kv, j0, n, !clean_block, rows.acc, rows.acc_ld,
                        scratch.products);  // += P V
    }
    if (in_scratch) write_block(qb, rows.acc);
  }

  // Row r of the query block's scores over the keys [j0, j0 + n): masked, then folded into the
  // row's running max, sum and output; its weights are left where blocks.add_values reads them.
  // `bad_keys`: the keys whose value row is not finite, null when the key block has none.
  void add_row(const QueryBlock& qb, int64_t r, int64_t j0, int64_t n, float* row,
               const char* bad_keys, const Rows& rows, Scratch& scratch) {
    const int64_t dv = z.dv;
    float block_top;
    if (sc.plain(qb.i0 + r, j0, n)) {  // one pass, not two: a non-finite score makes it NaN
      block_top = row_max<true>(row, n);
    } else {
      sc.apply(row, scratch.capped.data(), qb.batch, qb.head, qb.i0 + r, j0, n);
      block_top = row_max(row, n);
    }
    if (bad_keys != nullptr) {
      const auto& values = blocks.values();
      touch(row, n, bad_keys, values.row(qb.kv, j0), values.ld, dv, rows.touched + r * dv);
    }
    rows.poisoned[r] |= block_top != block_top;
    const float top = std::max(rows.m[r], block_top);
    if (top == kNegInf || rows.poisoned[r]) {  // nothing allowed so far, or NaN: adds nothing
      blocks.no_weights(row, n, r, j0, scratch.products);
      return;
    }
    const float sum = blocks.weights(row, n, top, r, j0, scratch.products);  // P, and its row sum
    if (drop.active()) {  // after the sum: the softmax's denominator keeps every weight
      blocks.drop_weights(drop, drop.row(qb.bh * z.t + qb.i0 + r), row, n, r, j0,
                          scratch.products);
    }
    const float shrink = exp_nonpositive(rows.m[r] - top);  // 0 when m was -inf
    rows.l[r] = rows.l[r] * shrink + sum;
    rows.m[r] = top;
    if (shrink != 1.f) {
      float* a = rows.acc + r * rows.acc_ld;
#pragma omp simd
      for (int64_t c = 0; c < dv; ++c) a[c] *= shrink;
    }
  }

  // Row `row` (in b h t) of the output, from its accumulator `a`: divided by its sum; NaN for a
  // poisoned row, 0 for a row with no allowed key (whose accumulator no tile may have set).
  template <typename T>
  void output_row(int64_t row, const float* a, T* o) const {
    const int64_t dv = result.size(3);  // touched's rows are z.dv wide
    if (poisoned[row] || l[row] == 0.f) {
      std::fill(o, o + dv, static_cast<T>(poisoned[row] ? kNaN : 0.f));
      return;
    }
    store_row(o, a, dv, 1, 0, drop.scale / l[row]);
    if (touched.empty()) return;
    const char* nan_columns = touched.data() + row * z.dv;
    for (int64_t c = 0; c < dv; ++c) o[c] = nan_columns[c] ? static_cast<T>(kNaN) : o[c];
  }

  // A query block's rows, done, from the thread's scratch (`a`, rows of `width`) into the result.
  void write_block(const QueryBlock& qb, const float* a) const {
    with_element_type(result, [&](auto tag) {
      using T = decltype(tag);
      const Operand<T> out(result, result.data_ptr<T>());
      for (int64_t r = 0; r < qb.bq; ++r) {
        output_row(qb.bh * z.t + qb.i0 + r, a + r * width, out.row(qb.bh, qb.i0 + r));
      }
    });
  }

  // Every row's lse (NaN for a poisoned row, -inf for a row with no allowed key), and its output
  // from the call's accumulator; with the accumulator in scratch, where the blocks wrote their
  // rows, the output of the rows with a NaN or no key only (a panel that sees no key visits no
  // block).
  std::tuple<at::Tensor, at::Tensor> finish() {
    with_element_type(result, [&](auto tag) { finish_as<decltype(tag)>(); });
    return {result, lse};
  }

  template <typename T>
  void finish_as() {
    float* lp = lse.data_ptr<float>();
    const Operand<T> out(result, result.data_ptr<T>());
    at::parallel_for(0, z.b * z.h * z.t, 256, [&](int64_t first, int64_t last) {
      for (int64_t row = first; row < last; ++row) {
        const int64_t bh = row / z.t, i = row % z.t;
        const bool empty = l[row] == 0.f && !poisoned[row];
        if (!in_scratch || empty || poisoned[row]) {
          output_row(row, in_scratch ? nullptr : acc.row(bh, i), out.row(bh, i));
        }
        lp[row] = poisoned[row] ? kNaN : empty ? kNegInf : m[row] + std::log(l[row]);
      }
    });
  }
};

template <typename Blocks>
std::tuple<at::Tensor, at::Tensor> forward_blocks(const Blocks& blocks, const Sizes& z,
                                                  const Scoring& sc, const Dropout& drop,
                                                  int64_t block_q, int64_t block_k,
                                                  const Tiles& tiles, const at::Tensor& result) {
  const bool one_tile = tiles.rows >= z.t && tiles.keys >= z.s;
  return ForwardPass<Blocks>(blocks, z, sc, drop, block_q, block_k, result, one_tile).run(tiles);
}

}  // namespace
