// The tiled kernel's block products (Q K^T, P V, and the backward's dP, dV, dQ, dK) on blocks that
// stay in cache, by one of two engines with one interface.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "pair_products.h"
#include "tiled_dropout.h"
#include "tiled_rows.h"
#include "tiled_simd.h"
#include "tiled_walk.h"

namespace {

// C (m x n, row stride ldc) = op(A) op(B), plus C if `add`; row-major, op(X) = X or X^T as stored
// (`ta`: A is stored (kk x m); `tb`: B is stored (n x kk)). The product is torch's own (MKL here),
// on views of the block: one BLAS call per product, no copy. On one thread inside parallel_for.
inline void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t kk, const float* a, int64_t lda,
                 const float* b, int64_t ldb, float* c, int64_t ldc, bool add) {
  const auto view = [](const float* x, int64_t rows, int64_t cols, int64_t ld, bool transposed) {
    const int64_t stored_rows = transposed ? cols : rows, stored_cols = transposed ? rows : cols;
    auto t = at::from_blob(const_cast<float*>(x), {stored_rows, stored_cols}, {ld, 1},
                              at::kFloat);
    return transposed ? t.t() : t;
  };
  auto out = at::from_blob(c, {m, n}, {ldc, 1}, at::kFloat);
  const auto lhs = view(a, m, kk, lda, ta), rhs = view(b, kk, n, ldb, tb);
  if (add) {
    at::addmm_out(out, out, lhs, rhs);
  } else {
    at::mm_out(out, lhs, rhs);
  }
}

// The block products of the kernel, in two implementations with one interface: float32 operands
// multiplied by torch's matmul (Float32Blocks), and bf16 operands multiplied in pairs with float32
// sums (Bf16Blocks, pair_products.h). In both, a block of scores, weights or their gradients is
// float32, (bq x n) with row stride `ld` = score_stride(n); results accumulate into float32 rows of
// `width(d)` (or `width(dv)`) entries. `bh` is the query head's index in (b * h), `kv` the key/value
// head's in (b * h_kv), [i0, i0 + bq) the query rows and [j0, j0 + n) the keys.
struct Float32Blocks {
  Sizes z;
  Operand<const float> q, k, v, dout;
  struct Scratch {
    std::vector<float> clean;  // a value block with its non-finite entries zeroed
    explicit Scratch(const Float32Blocks&, int64_t, int64_t) {}
  };

  Float32Blocks(const Sizes& sizes, const at::Tensor& q_, const at::Tensor& k_,
                const at::Tensor& v_, const at::Tensor* dout_)
      : z(sizes), q(of(q_)), k(of(k_)), v(of(v_)),
        dout(dout_ ? of(*dout_) : Operand<const float>()) {}

  static Operand<const float> of(const at::Tensor& x) { return {x, x.data_ptr<float>()}; }
  int64_t score_stride(int64_t n) const { return n; }
  int64_t width(int64_t x) const { return x; }
  const Operand<const float>& values() const { return v; }

  // S = Q K^T
  void scores(int64_t bh, int64_t i0, int64_t bq, int64_t kv, int64_t j0, int64_t n, float* S,
              Scratch&) const {
    gemm(false, true, bq, n, z.d, q.row(bh, i0), q.ld, k.row(kv, j0), k.ld, S, n, false);
  }
  // Row r of P from its scores: exp(score - top) in place; returns their sum. `top` is finite and
  // the row holds no NaN (a row with one is poisoned before).
  float weights(float* row, int64_t n, float top, int64_t, int64_t, Scratch&) const {
    return exp_row(row, n, top, row);
  }
  // Row r of P when it adds nothing (no key allowed so far, or poisoned).
  void no_weights(float* row, int64_t n, int64_t, int64_t, Scratch&) const {
    std::fill(row, row + n, 0.f);
  }
  // Row r of P with its dropped weights 0 (the kept ones are scaled at the end, with the sum).
  void drop_weights(const Dropout& drop, uint32_t row_hash, float* row, int64_t n, int64_t,
                    int64_t j0, Scratch&) const {
    drop.drop(row, n, row_hash, j0);
  }
  // acc += P V; `dirty`: the block's values hold a non-finite entry (a masked key's weight is 0,
  // and 0 * NaN would still be NaN).
  void add_values(const float* P, int64_t bq, int64_t kv, int64_t j0, int64_t n, bool dirty,
                  float* acc, int64_t acc_ld, Scratch& w) const {
    const float* block = v.row(kv, j0);
    int64_t ld = v.ld;
    if (dirty) {
      w.clean.resize(n * z.dv);
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t c = 0; c < z.dv; ++c) {
          const float x = block[j * ld + c];
          w.clean[j * z.dv + c] = finite(x) ? x : 0.f;
        }
      }
      block = w.clean.data(), ld = z.dv;
    }
    gemm(false, false, bq, z.dv, n, P, n, block, ld, acc, acc_ld, true);
  }
  void prepare(int64_t, int64_t, int64_t, Scratch&) const {}
  void pack_head(int64_t, Scratch&) const {}  // the float32 operands are read where they lie
  // dV += P^T dO
  void add_dv(const float* P, int64_t bh, int64_t i0, int64_t bq, int64_t j0, int64_t n,
              float* dv_head, Scratch&) const {
    gemm(true, false, n, z.dv, bq, P, n, dout.row(bh, i0), dout.ld, dv_head + j0 * z.dv, z.dv,
         true);
  }
  // dP = dO V^T
  void dprobs(int64_t bh, int64_t i0, int64_t bq, int64_t kv, int64_t j0, int64_t n, float* dP,
              Scratch&) const {
    gemm(false, true, bq, n, z.dv, dout.row(bh, i0), dout.ld, v.row(kv, j0), v.ld, dP, n, false);
  }
  // dQ += dS K
  void add_dq(const float* dS, int64_t bq, int64_t kv, int64_t j0, int64_t n, float* dq_rows,
              Scratch&) const {
    gemm(false, false, bq, z.d, n, dS, n, k.row(kv, j0), k.ld, dq_rows, z.d, true);
  }
  // dK += dS^T Q
  void add_dk(const float* dS, int64_t bh, int64_t i0, int64_t bq, int64_t j0, int64_t n,
              float* dk_head, Scratch&) const {
    gemm(true, false, n, z.d, bq, dS, n, q.row(bh, i0), q.ld, dk_head + j0 * z.d, z.d, true);
  }
};

// bf16 operands, packed for the products that read them whole (K and V, each in the two
// orientations it is multiplied in) and once per query block for the rest. K and V are packed once
// per call, every head at once, or, `per_head`, one key/value head at a time into the scratch of
// the thread that works on it (pack_head: the backward's items are whole heads).
struct Bf16Blocks {
  using Pair = pairs::Pair;
  using Bf16 = pairs::Bf16;
  Sizes z;
  bool fast;  // vdpbf16ps, else the portable tile
  Operand<const Bf16> q, k, v, dout;  // rows of pairs: even strides, 4-byte aligned
  int64_t key_cols;             // columns of the packs whose columns are keys: s + kCols, zero-padded
  int64_t d_cols, dv_cols;      // d and dv padded to kCols
  bool per_head;                // the packs are in each thread's Scratch, one head's; else `whole`

  // The packs of K and V, per kv head, or of one (in a Scratch).
  struct Packs {
    std::vector<Pair> k_by_dim;  // (d / 2) x key_cols: pairs along d (for Q K^T)
    std::vector<Pair> v_by_dim;  // (dv / 2) x key_cols, for dO V^T (backward)
    std::vector<Pair> v_by_key;  // ceil(s / 2) x dv_cols: pairs of keys, for P V
    std::vector<Pair> k_by_key;  // ceil(s / 2) x d_cols, for dS K (backward)
  } whole;

  struct Scratch {
    std::vector<Bf16> rows;                       // P or dS rounded, aligned on pairs of keys
    std::vector<Pair> transposed;                 // P or dS, pairs of query rows
    std::vector<Pair> q_rows, dout_rows;          // the query block's Q and dO, pairs of rows
    Packs head;                                   // per_head: the packs of one key/value head,
    int64_t packed = -1;                          // which one (-1: none yet)
    Scratch(const Bf16Blocks& blocks, int64_t block_q, int64_t block_k)
        : rows(block_q * (block_k + 3)),
          transposed((block_q + 1) / 2 * pairs::padded(block_k)),
          q_rows((block_q + 1) / 2 * blocks.d_cols),
          dout_rows(blocks.dout.data ? (block_q + 1) / 2 * blocks.dv_cols : 0) {
      if (blocks.per_head) blocks.size_packs(head, 1);
    }
  };

  Bf16Blocks(const Sizes& sizes, const at::Tensor& q_, const at::Tensor& k_,
             const at::Tensor& v_, const at::Tensor* dout_, bool fast_, bool per_head_ = false)
      : z(sizes), fast(fast_), q(of(q_)), k(of(k_)), v(of(v_)),
        dout(dout_ ? of(*dout_) : Operand<const Bf16>()), key_cols(z.s + pairs::kCols),
        d_cols(pairs::padded(z.d)), dv_cols(pairs::padded(z.dv)), per_head(per_head_) {
    if (per_head) return;
    size_packs(whole, z.b * z.h_kv);
    at::parallel_for(0, z.b * z.h_kv, 1, [&](int64_t first, int64_t last) {
      for (int64_t kv = first; kv < last; ++kv) pack(kv, whole, kv);
    });
  }

  void size_packs(Packs& p, int64_t heads) const {
    const int64_t key_pairs = (z.s + 1) / 2;
    p.k_by_dim.resize(heads * z.d / 2 * key_cols);
    p.v_by_key.resize(heads * key_pairs * dv_cols);
    if (dout.data) {
      p.v_by_dim.resize(heads * z.dv / 2 * key_cols);
      p.k_by_key.resize(heads * key_pairs * d_cols);
    }
  }
  // Head kv's K and V into the `slot`-th head of `p`.
  void pack(int64_t kv, Packs& p, int64_t slot) const {
    const int64_t key_pairs = (z.s + 1) / 2;
    const Bf16 *kh = k.row(kv, 0), *vh = v.row(kv, 0);
    pairs::pack_transposed(kh, z.s, z.d, k.ld, &p.k_by_dim[slot * z.d / 2 * key_cols], key_cols);
    pairs::pack_row_pairs(vh, z.s, z.dv, v.ld, &p.v_by_key[slot * key_pairs * dv_cols], dv_cols,
                          true);
    if (dout.data) {
      pairs::pack_transposed(vh, z.s, z.dv, v.ld, &p.v_by_dim[slot * z.dv / 2 * key_cols],
                             key_cols);
      pairs::pack_row_pairs(kh, z.s, z.d, k.ld, &p.k_by_key[slot * key_pairs * d_cols], d_cols,
                            true);
    }
  }
  // Before the products of head kv in a thread: per_head, its packs into the thread's scratch.
  void pack_head(int64_t kv, Scratch& w) const {
    if (!per_head || w.packed == kv) return;
    pack(kv, w.head, 0);
    w.packed = kv;
  }
  // Where head kv's packs are: (the packs, the head's slot in them).
  std::pair<const Packs&, int64_t> packs(int64_t kv, const Scratch& w) const {
    if (per_head) return {w.head, 0};
    return {whole, kv};
  }

  static Operand<const Bf16> of(const at::Tensor& x) {
    return {x, reinterpret_cast<const Bf16*>(x.data_ptr<at::BFloat16>())};
  }
  const Pair* words(const Bf16* rows) const { return reinterpret_cast<const Pair*>(rows); }

  int64_t score_stride(int64_t n) const { return pairs::padded(n); }
  int64_t width(int64_t x) const { return pairs::padded(x); }
  const Operand<const Bf16>& values() const { return v; }

  void scores(int64_t bh, int64_t i0, int64_t bq, int64_t kv, int64_t j0, int64_t n, float* S,
              Scratch& w) const {
    const auto [p, slot] = packs(kv, w);
    const Pair* b = &p.k_by_dim[slot * z.d / 2 * key_cols] + j0;
    pairs::gemm(fast, bq, pairs::padded(n), z.d / 2, words(q.row(bh, i0)), q.ld / 2, 1, b,
                key_cols, S, pairs::padded(n), false);
  }
  // The weights are rounded to bf16 as they are computed, into rows whose pairs of keys start at an
  // even key, as the packs' do: a row carries a leading 0 when j0 is odd, a trailing one when it
  // ends on an odd key.
  static int64_t key_width(int64_t n) { return (n + 3) / 2 * 2; }  // even: whole pairs
  static int64_t key_pairs(int64_t j0, int64_t n) { return (j0 % 2 + n + 1) / 2; }
  Bf16* key_row(Scratch& w, int64_t r, int64_t j0, int64_t n) const {
    Bf16* row = w.rows.data() + r * key_width(n);
    row[0] = 0;
    row[2 * key_pairs(j0, n) - 1] = 0;
    return row + j0 % 2;
  }
  float weights(const float* row, int64_t n, float top, int64_t r, int64_t j0, Scratch& w) const {
    return exp_row(row, n, top, key_row(w, r, j0, n));
  }
  void no_weights(const float*, int64_t n, int64_t r, int64_t j0, Scratch& w) const {
    Bf16* out = key_row(w, r, j0, n);
    std::fill(out, out + n, 0);
  }
  void drop_weights(const Dropout& drop, uint32_t row_hash, const float*, int64_t n, int64_t r,
                    int64_t j0, Scratch& w) const {
    drop.drop(w.rows.data() + r * key_width(n) + j0 % 2, n, row_hash, j0);  // key_row's place
  }
  // acc += P V from the rounded rows. The pack's non-finite values are 0 (the output's NaN comes
  // from the selection in the forward, which reads the values themselves).
  void add_values(const float*, int64_t bq, int64_t kv, int64_t j0, int64_t n, bool, float* acc,
                  int64_t acc_ld, Scratch& w) const {
    const auto [p, slot] = packs(kv, w);
    const Pair* b = &p.v_by_key[(slot * ((z.s + 1) / 2) + j0 / 2) * dv_cols];
    pairs::gemm(fast, bq, dv_cols, key_pairs(j0, n), words(w.rows.data()), key_width(n) / 2, 1, b,
                dv_cols, acc, acc_ld, true);
  }
  // The query block's Q and dO as pairs of rows, for the transposed products.
  void prepare(int64_t bh, int64_t i0, int64_t bq, Scratch& w) const {
    pairs::pack_row_pairs(q.row(bh, i0), bq, z.d, q.ld, w.q_rows.data(), d_cols, false);
    pairs::pack_row_pairs(dout.row(bh, i0), bq, z.dv, dout.ld, w.dout_rows.data(), dv_cols, false);
  }
  // P^T (or dS^T) as pairs of query rows: A2(j, p) = (X[2p][j], X[2p + 1][j]).
  const Pair* transposed(const float* X, int64_t bq, int64_t n, Scratch& w) const {
    pairs::pack_row_pairs(X, bq, n, pairs::padded(n), w.transposed.data(), pairs::padded(n),
                          false);
    return w.transposed.data();
  }
  void add_dv(const float* P, int64_t, int64_t, int64_t bq, int64_t j0, int64_t n,
              float* dv_head, Scratch& w) const {
    const Pair* a = transposed(P, bq, n, w);
    pairs::gemm(fast, n, dv_cols, (bq + 1) / 2, a, 1, pairs::padded(n), w.dout_rows.data(),
                dv_cols, dv_head + j0 * dv_cols, dv_cols, true);
  }
  void dprobs(int64_t bh, int64_t i0, int64_t bq, int64_t kv, int64_t j0, int64_t n, float* dP,
              Scratch& w) const {
    const auto [p, slot] = packs(kv, w);
    const Pair* b = &p.v_by_dim[slot * z.dv / 2 * key_cols] + j0;
    pairs::gemm(fast, bq, pairs::padded(n), z.dv / 2, words(dout.row(bh, i0)), dout.ld / 2, 1, b,
                key_cols, dP, pairs::padded(n), false);
  }
  void add_dq(const float* dS, int64_t bq, int64_t kv, int64_t j0, int64_t n, float* dq_rows,
              Scratch& w) const {
    const int64_t width = key_width(n);
    for (int64_t r = 0; r < bq; ++r) {
      pairs::round_row(dS + r * pairs::padded(n), n, key_row(w, r, j0, n));
    }
    const int64_t count = key_pairs(j0, n);
    const auto [p, slot] = packs(kv, w);
    const Pair* b = &p.k_by_key[(slot * ((z.s + 1) / 2) + j0 / 2) * d_cols];
    pairs::gemm(fast, bq, d_cols, count, words(w.rows.data()), width / 2, 1, b, d_cols, dq_rows,
                d_cols, true);
  }
  void add_dk(const float* dS, int64_t, int64_t, int64_t bq, int64_t j0, int64_t n,
              float* dk_head, Scratch& w) const {
    const Pair* a = transposed(dS, bq, n, w);
    pairs::gemm(fast, n, d_cols, (bq + 1) / 2, a, 1, pairs::padded(n), w.q_rows.data(), d_cols,
                dk_head + j0 * d_cols, d_cols, true);
  }
};

}  // namespace
