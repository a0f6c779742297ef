// The tiled kernel's backward: FlashAttention-2's recomputing backward over the tiles of a call.
// Each block of scores is recomputed and turned into P by the forward's lse; then dV += P^T dO,
// dS = P (dP - D) taken back through the score's steps, dQ += dS K and dK += dS^T Q.
//
// Work is split by key/value head, and when there are fewer of those than threads, by key blocks
// too (every `split`-th block, so that causal work spreads evenly): each item owns dK and dV of its
// key blocks, so no two threads write the same rows. dQ, which every key block adds to, goes to one
// buffer per part, summed at the end (extra memory: split x dq, with split <= threads / (b h_kv));
// the slopes' gradient likewise goes to one (b, h) buffer per part.
//
// Where one item makes whole gradients (a call in one tile, each key/value head one item), they are
// summed in the thread's scratch and written into the caller's tensors as soon as they are whole:
// dQ of a query block after its key blocks, dK and dV of a head after its query blocks. The
// buffers of the whole call, in float32, are then not needed.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "tiled_dropout.h"
#include "tiled_rows.h"
#include "tiled_scores.h"
#include "tiled_simd.h"
#include "tiled_walk.h"

namespace {

// How the backward shares a call among threads: `split` parts of each key/value head's key
// blocks (more than one where there are fewer key/value heads, b h_kv, than threads), and whether
// each item makes whole gradients, summed in its thread's scratch (see above: a call in one tile,
// each key/value head one item).
struct BackwardPlan {
  int64_t split;
  bool in_scratch;

  static BackwardPlan of(const Sizes& z, int64_t block_k, const Tiles& tiles) {
    const int64_t blocks = (z.s + block_k - 1) / block_k;
    const int64_t split =
        std::max<int64_t>(1, std::min(blocks, at::get_num_threads() / (z.b * z.h_kv)));
    return {split, tiles.rows >= z.t && tiles.keys >= z.s && split == 1};
  }
};

// The backward of one call: the gradients w.r.t. q, k, v and (if `alibi_grad`) the ALiBi slopes,
// summed in float32 and written into the caller's tensors (`grads`, times `q_scale` for q's); lse
// and delta (b, h, t) as the backward entry point takes them.
template <typename Blocks>
struct BackwardPass {
  const Blocks& blocks;
  const Sizes z;
  Scoring sc;  // the walk sets its tile's score_mod bias
  const Dropout drop;
  const int64_t block_q, block_k;
  const bool alibi_grad, capping;
  const int64_t dq_width, dk_width, dv_width;  // the rows of dq, dk, dv: blocks.width(d or dv)
  const int64_t split;                         // parts of a key/value head's key blocks
  const bool in_scratch;    // the sums in each thread's scratch, not in the buffers below
  const std::array<at::Tensor, 3> grads;
  const float q_scale;
  at::Tensor dq_parts;      // (split, b, h, t, dq_width), unless in_scratch
  at::Tensor dalibi_parts;  // (split, b, h) with alibi_grad, else empty
  at::Tensor dk, dvv;       // (b, h_kv, s, dk_width), (b, h_kv, s, dv_width), unless in_scratch
  const float *lp, *dlp;    // lse and delta, (b h t)
  float *dqp, *dap, *dkp, *dvp;

  // A thread's buffers: P and dS of one block (dS in place of dP), P after dropout, its rows'
  // tanh from Scoring::apply (for the gradient through the soft-cap), and the block products' own;
  // in_scratch, the sums of a query block's dQ and of a key/value head's dK and dV.
  struct Scratch {
    std::vector<float> probs, dscores, dropped, capped, dq, dk, dv;
    typename Blocks::Scratch products;
    explicit Scratch(const BackwardPass& pass)
        : probs(pass.block_q * pass.blocks.score_stride(pass.block_k)),
          dscores(pass.block_q * pass.blocks.score_stride(pass.block_k)),
          dropped(pass.drop.active() ? pass.block_q * pass.blocks.score_stride(pass.block_k) : 0),
          capped(pass.capping ? pass.block_q * pass.block_k : 0),
          dq(pass.in_scratch ? pass.block_q * pass.dq_width : 0),
          dk(pass.in_scratch ? pass.z.s * pass.dk_width : 0),
          dv(pass.in_scratch ? pass.z.s * pass.dv_width : 0),
          products(pass.blocks, pass.block_q, pass.block_k) {}
  };

  BackwardPass(const Blocks& blocks_, const Sizes& z_, const Scoring& sc_, const Dropout& drop_,
               const at::Tensor& lse, const at::Tensor& delta, int64_t block_q_, int64_t block_k_,
               bool alibi_grad_, const BackwardPlan& plan,
               const std::array<at::Tensor, 3>& grads_, double q_scale_)
      : blocks(blocks_), z(z_), sc(sc_), drop(drop_), block_q(block_q_), block_k(block_k_),
        alibi_grad(alibi_grad_), capping(sc.softcap > 0.f), dq_width(blocks.width(z.d)),
        dk_width(dq_width), dv_width(blocks.width(z.dv)),
        split(plan.split), in_scratch(plan.in_scratch), grads(grads_),
        q_scale(static_cast<float>(q_scale_)),
        dq_parts(at::zeros({in_scratch ? 0 : split, z.b, z.h, z.t, dq_width}, at::kFloat)),
        dalibi_parts(at::zeros({alibi_grad ? split : 0, z.b, z.h}, at::kFloat)),
        dk(at::zeros({in_scratch ? 0 : z.b, z.h_kv, z.s, dk_width}, at::kFloat)),
        dvv(at::zeros({in_scratch ? 0 : z.b, z.h_kv, z.s, dv_width}, at::kFloat)),
        lp(lse.data_ptr<float>()), dlp(delta.data_ptr<float>()), dqp(dq_parts.data_ptr<float>()),
        dap(dalibi_parts.data_ptr<float>()), dkp(dk.data_ptr<float>()),
        dvp(dvv.data_ptr<float>()) {}

  // Writes the gradients of the pre-scaled q (times `q_scale`: those of q itself), k and v into
  // `grads` (see store_rows and store_head_rows); returns them and the slopes' gradient (b, h), empty without
  // alibi_grad.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> run(const Tiles& tiles) {
    const bool bias_grad = !tiles.mod_bias_grad.is_none();
    bool walked = false;  // a call whose queries see no key at all visits no tile
    at::Tensor dbias_memory;  // the tiles' dbias, one after another (see tile_dbias)
    const int64_t largest_tile = z.b * z.h * std::min(tiles.rows, z.t) * std::min(tiles.keys, z.s);
    tiles.walk(z, sc, [&](const Tile& tile) {
      walked = true;
      // dL/df over the tile: dS where a block was visited, 0 elsewhere
      const at::Tensor dbias =
          bias_grad ? tile_dbias(tile, largest_tile, dbias_memory) : at::Tensor();
      float* dbp = bias_grad ? dbias.data_ptr<float>() : nullptr;
      at::parallel_for(0, z.b * z.h_kv * split, 1, [&](int64_t first, int64_t last) {
        c10::InferenceMode no_autograd;
        Scratch scratch(*this);
        for (int64_t item = first; item < last; ++item) {
          key_value_part(item / split, item % split, tile, dbp, scratch);
        }
      });
      if (bias_grad) tiles.mod_bias_grad(tile.r0, tile.r1, tile.c0, tile.c1, dbias);
    });
    auto dalibi = alibi_grad ? dalibi_parts.sum(at::IntArrayRef{0, 1}) : dalibi_parts;
    if (in_scratch && !walked) {
      for (const at::Tensor& g : grads) g.zero_();
    }
    if (!in_scratch) {
      const int64_t dq_part = z.b * z.h * z.t * dq_width;
      store_rows(grads[0], dqp, dq_width, split, dq_part, q_scale);
      store_rows(grads[1], dkp, dk_width, 1, 0, 1.f);
      store_rows(grads[2], dvp, dv_width, 1, 0, 1.f);
    }
    return {grads[0], grads[1], grads[2], dalibi};
  }

  // The zeroed (b, h, rows, keys) dL/df of `tile`, in `memory`, made at the first tile for the
  // largest (`capacity` floats): a tile's dbias is done with once the Python callback returns,
  // and each new one of several MiB would cost the first touch of every page again.
  at::Tensor tile_dbias(const Tile& tile, int64_t capacity, at::Tensor& memory) const {
    const std::vector<int64_t> shape{z.b, z.h, tile.r1 - tile.r0, tile.c1 - tile.c0};
    const int64_t n = c10::multiply_integers(shape);
    if (!memory.defined() || memory.numel() < n) {
      memory = at::empty({std::max(n, capacity)}, at::kFloat);
    }
    return memory.narrow(0, 0, n).view(shape).zero_();
  }

  // One item: part `part` of the key blocks of key/value head kv (in b * h_kv), against every
  // query block of the tile of every query head that uses kv. `dbias`: dL/df over the tile, or
  // null.
  void key_value_part(int64_t kv, int64_t part, const Tile& tile, float* dbias, Scratch& scratch) {
    const int64_t groups = z.h / z.h_kv, batch = kv / z.h_kv, kv_head = kv % z.h_kv;
    const int64_t q_blocks = (tile.r1 - tile.r0 + block_q - 1) / block_q;
    blocks.pack_head(kv, scratch.products);
    if (in_scratch) {
      std::fill(scratch.dk.begin(), scratch.dk.end(), 0.f);
      std::fill(scratch.dv.begin(), scratch.dv.end(), 0.f);
    }
    for (int64_t head = kv_head * groups; head < (kv_head + 1) * groups; ++head) {
      for (int64_t qb = 0; qb < q_blocks; ++qb) {
        const int64_t i0 = tile.r0 + qb * block_q;
        const int64_t i1 = std::min(tile.r1, i0 + block_q);
        query_block(QueryBlock::of(z, batch * z.h + head, i0, i1), part, tile, dbias, scratch);
      }
    }
    if (in_scratch) {  // this head's dK and dV are whole
      store_head_rows(grads[1], kv, 0, z.s, scratch.dk.data(), dk_width, 1.f);
      store_head_rows(grads[2], kv, 0, z.s, scratch.dv.data(), dv_width, 1.f);
    }
  }

  // One query block against this part's key blocks of the tile that it may see.
  void query_block(const QueryBlock& qb, int64_t part, const Tile& tile, float* dbias,
                   Scratch& scratch) {
    float* dq_blk = in_scratch ? scratch.dq.data()
                               : dqp + ((part * z.b * z.h + qb.bh) * z.t + qb.i0) * dq_width;
    if (in_scratch) std::fill(dq_blk, dq_blk + qb.bq * dq_width, 0.f);
    const auto [row_lo, row_hi] = sc.block_range(qb.i0, qb.i1);
    const int64_t from = std::max(row_lo, tile.c0), to = std::min(row_hi, tile.c1);
    if (from < to) {  // else no key of the tile visible to this query block
      blocks.prepare(qb.bh, qb.i0, qb.bq, scratch.products);
      // This part's key blocks: those of index part, part + split, ... on the grid of block_k.
      const int64_t first_block = from / block_k + (part - from / block_k % split + split) % split;
      for (int64_t grid = first_block * block_k; grid < to; grid += split * block_k) {
        const int64_t j0 = std::max(grid, from), n = std::min(grid + block_k, to) - j0;
        key_block(qb, j0, n, part, tile, dq_blk, dbias, scratch);
      }
    }
    if (in_scratch) store_head_rows(grads[0], qb.bh, qb.i0, qb.bq, dq_blk, dq_width, q_scale);
  }

  // One query block against the keys [j0, j0 + n): P again, then the products and dS.
  void key_block(const QueryBlock& qb, int64_t j0, int64_t n, int64_t part, const Tile& tile,
                 float* dq_blk, float* dbias, Scratch& scratch) {
    const int64_t ld = blocks.score_stride(n);
    float *p = scratch.probs.data(), *ds = scratch.dscores.data();
    float* dk_head = in_scratch ? scratch.dk.data() : dkp + qb.kv * z.s * dk_width;
    float* dv_head = in_scratch ? scratch.dv.data() : dvp + qb.kv * z.s * dv_width;
    auto& w = scratch.products;
    blocks.scores(qb.bh, qb.i0, qb.bq, qb.kv, j0, n, p, w);  // S = Q K^T
    for (int64_t r = 0; r < qb.bq; ++r) {
      float* row = p + r * ld;
      sc.apply(row, capping ? scratch.capped.data() + r * n : nullptr, qb.batch, qb.head,
               qb.i0 + r, j0, n);
      probs_row(row, n, lp[qb.bh * z.t + qb.i0 + r]);  // P
    }
    if (drop.active()) {  // the values were multiplied by P Z, Z = kept / (1 - p): dV = (P Z)^T dO
      float* pz = scratch.dropped.data();
      std::fill(pz, pz + qb.bq * ld, 0.f);  // the padding columns of a bf16 block stay 0
      for (int64_t r = 0; r < qb.bq; ++r) {
        drop.scaled(p + r * ld, pz + r * ld, n, drop.row(qb.bh * z.t + qb.i0 + r), j0);
      }
      blocks.add_dv(pz, qb.bh, qb.i0, qb.bq, j0, n, dv_head, w);
    } else {
      blocks.add_dv(p, qb.bh, qb.i0, qb.bq, j0, n, dv_head, w);  // dV += P^T dO
    }
    blocks.dprobs(qb.bh, qb.i0, qb.bq, qb.kv, j0, n, ds, w);  // dP = dO V^T
    for (int64_t r = 0; drop.active() && r < qb.bq; ++r) {    // d(P Z) = dO V^T, dP = that Z
      float* row = ds + r * ld;
      drop.scaled(row, row, n, drop.row(qb.bh * z.t + qb.i0 + r), j0);
    }
    for (int64_t r = 0; r < qb.bq; ++r) {
      const float* th = capping ? scratch.capped.data() + r * n : nullptr;
      dscores_row(qb, r, j0, n, p + r * ld, ds + r * ld, th, part, tile, dbias);
    }
    blocks.add_dq(ds, qb.bq, qb.kv, j0, n, dq_blk, w);         // dQ += dS K
    blocks.add_dk(ds, qb.bh, qb.i0, qb.bq, j0, n, dk_head, w);  // dK += dS^T Q
  }

  // Row r of dS over the keys [j0, j0 + n), in place of its dP (`dr`), from its P (`pr`): back
  // through the score_mod's f and ALiBi (giving their gradients), then the soft-cap (`th`: the
  // row's tanh, null without one).
  void dscores_row(const QueryBlock& qb, int64_t r, int64_t j0, int64_t n, const float* pr,
                   float* dr, const float* th, int64_t part, const Tile& tile, float* dbias) {
    const float di = dlp[qb.bh * z.t + qb.i0 + r];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {  // dS = P (dP - D): 0 where P is, whatever dP holds
      dr[j] = pr[j] == 0.f ? 0.f : pr[j] * (dr[j] - di);
    }
    if (dbias != nullptr) {  // the score_mod's f is added after the soft-cap and ALiBi
      const int64_t rows = tile.r1 - tile.r0, keys = tile.c1 - tile.c0;
      float* d = dbias + ((qb.bh * rows) + qb.i0 + r - tile.r0) * keys + j0 - tile.c0;
      std::copy(dr, dr + n, d);
    }
    if (alibi_grad) {  // score -= slope |p(i) - j|, after the soft-cap
      const float pos = static_cast<float>(qb.i0 + r + sc.diagonal - j0);
      float dslope = 0.f;
#pragma omp simd reduction(+ : dslope)
      for (int64_t j = 0; j < n; ++j) {
        dslope -= dr[j] * std::fabs(pos - static_cast<float>(j));
      }
      dap[(part * z.b + qb.batch) * z.h + qb.head] += dslope;
    }
    if (capping) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {  // through tanh (th is unset where dS is 0)
        dr[j] = dr[j] == 0.f ? 0.f : dr[j] * (1.f - th[j] * th[j]);
      }
    }
  }
};

template <typename Blocks>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_blocks(
    const Blocks& blocks, const Sizes& z, const Scoring& sc, const Dropout& drop,
    const at::Tensor& lse, const at::Tensor& delta, int64_t block_q, int64_t block_k,
    bool alibi_grad, const BackwardPlan& plan, const Tiles& tiles,
    const std::array<at::Tensor, 3>& grads, double q_scale) {
  TORCH_CHECK(!alibi_grad || sc.alibi != nullptr, "tiled: alibi_grad without ALiBi slopes");
  return BackwardPass<Blocks>(blocks, z, sc, drop, lse, delta, block_q, block_k, alibi_grad, plan,
                              grads, q_scale)
      .run(tiles);
}

}  // namespace
