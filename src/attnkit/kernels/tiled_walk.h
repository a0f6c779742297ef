// How the tiled kernel cuts a call up and walks it: the call's sizes, the tiles of queries by keys
// (with a score_mod's bias made per tile), and the blocks of queries the threads share in a tile.

#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>

#include "tiled_scores.h"

namespace {

// The sizes of a call: q (b, h, t, d), k (b, h_kv, s, d), v (b, h_kv, s, dv).
struct Sizes {
  int64_t b, h, h_kv, t, s, d, dv;
};

// A tile of a call: queries [r0, r1) by keys [c0, c1); `first`: the first of its panel.
struct Tile {
  int64_t r0, r1, c0, c1;
  bool first;
};

// A block of queries [i0, i1), bq of them, of one query head: `bh` is the query head's index in
// (b * h), `kv` its key/value head's in (b * h_kv).
struct QueryBlock {
  int64_t bh, batch, head, kv, i0, i1, bq;

  static QueryBlock of(const Sizes& z, int64_t bh, int64_t i0, int64_t i1) {
    const int64_t batch = bh / z.h, head = bh % z.h;
    return {bh, batch, head, batch * z.h_kv + head / (z.h / z.h_kv), i0, i1, i1 - i0};
  }
};

// The i-th of n blocks in the order 0, n-1, 1, n-2, ...: parallel_for hands each thread a
// contiguous range of items, and under a causal mask the later query blocks have more keys to
// visit; in this order every range mixes light and heavy blocks.
inline int64_t zigzag(int64_t i, int64_t n) { return i % 2 == 0 ? i / 2 : n - 1 - i / 2; }

// How a call is cut into tiles (see tiled.cpp's header), and the Python functions of a
// score_mod's bias.
struct Tiles {
  int64_t rows, keys, block_k;
  py::object mod_bias, mod_bias_grad;  // None without a score_mod (or, in the backward, its grad)

  // The panels of queries: [r0, r1) for r0 = 0, rows, 2 rows, ...
  template <typename F>
  void panels(int64_t t, F&& f) const {
    for (int64_t r0 = 0; r0 < t; r0 += rows) f(r0, std::min(t, r0 + rows));
  }
  // The tiles of `keys` keys that cover the keys [lo, hi) a panel sees, from the key block of
  // the grid of block_k that holds lo (so that every key block of that grid lies in one tile).
  template <typename F>
  void key_tiles(int64_t lo, int64_t hi, F&& f) const {
    for (int64_t c0 = lo / block_k * block_k; c0 < hi; c0 += keys) f(c0, std::min(hi, c0 + keys));
  }
  // f(tile) for every tile of a call, panel by panel, with `sc` adding the tile's bias.
  template <typename F>
  void walk(const Sizes& z, Scoring& sc, F&& f) const {
    panels(z.t, [&](int64_t r0, int64_t r1) {
      const auto [lo, hi] = sc.block_range(r0, r1);
      key_tiles(lo, hi, [&](int64_t c0, int64_t c1) {
        const Tile tile{r0, r1, c0, c1, c0 == lo / block_k * block_k};
        const at::Tensor tile_bias = bias(z, tile);  // alive while f runs
        sc.set_mod_bias(tile_bias, r0, c0);
        f(tile);
      });
    });
  }
  // The score_mod's bias of the tile, expanded to (b, h, r1 - r0, c1 - c0); undefined without one.
  at::Tensor bias(const Sizes& z, const Tile& tile) const {
    if (mod_bias.is_none()) return {};
    auto f = mod_bias(tile.r0, tile.r1, tile.c0, tile.c1).cast<at::Tensor>();
    TORCH_CHECK(f.dim() == 4 && f.scalar_type() == at::kFloat && f.device().is_cpu(),
                "tiled: mod_bias must return a float32 CPU tensor of 4 dims");
    return f.expand({z.b, z.h, tile.r1 - tile.r0, tile.c1 - tile.c0});
  }
};

}  // namespace
