// The tiled kernel in C++: the loop of tiled.py (FlashAttention-2's online softmax, forward and
// recomputing backward) with each block's score work fused into a few passes over a block that
// stays in the CPU's cache. The block products are float32 ones by torch's own matrix product (MKL
// here) for float32 operands, and bf16 ones with float32 sums (pair_products.h) for bf16 operands.
//
// The Python loop launches a dozen tensor operations per block, each a full pass over the block in
// memory; here the masks, positions, soft-capping and the softmax update of a row are applied while
// the row is hot. The algorithm, the block skipping and the numerics are those of tiled.py: scores,
// statistics and accumulators in float32, statistics kept per row, a row with no allowed key gives
// zeros and lse = -inf. With bf16 operands, the weights P (and in the backward dS) are rounded to
// bf16 before they are multiplied.
//
// Layout: q (b, h, t, d), pre-scaled; k (b, h_kv, s, d); v (b, h_kv, s, dv): all float32 or all
//   bf16 (bf16 with even d and dv), each row's entries contiguous, the other strides any (bf16:
//   even, and 4-byte aligned). The results go into the caller's tensors, float32, bf16 or float16,
//   rows of contiguous entries, any layout (see write_check): the forward's output (b, h, t, dv),
//   the backward's gradients of q, k and v; a zero column that padded an odd head dim is dropped
//   there (they may be one column narrower). Everything else comes in one TiledOptions (the
//   backward's TiledBackwardOptions extends it with dout, lse, delta, the gradients' tensors,
//   q_scale, alibi_grad and mod_bias_grad):
//   bias: float32, allowed: bool, both expanded to (b, h, t, s) with any strides, or empty;
//   key_mask (b, s) bool or empty; alibi (h,) float32 or empty; softcap 0 for none;
//   window_left, window_right around p(i) = i + s - t + shift, -1 unbounded (shift: 0, or the
//   offset of a chunk of a longer sequence); block_q, block_k: the blocks of queries and keys.
//   tiles: the kernel walks over panels of `tile_rows` queries and, within a panel, over tiles of
//   `tile_keys` keys (multiples of the block sizes; t and s for one tile). `mod_bias`, a Python
//   function or None, gives each tile's additions of a score_mod that adds to the score
//   (score + f(b, h, q_idx, kv_idx)): mod_bias(r0, r1, c0, c1) -> float32 f broadcastable to
//   (b, h, r1 - r0, c1 - c0); in the backward, `mod_bias_grad(r0, r1, c0, c1, dbias)` receives
//   the loss's gradient with respect to it. A tile's f is the only thing of size rows x keys.
//   dropout_p, dropout_seed: dropout of the weights, its mask a hash of the seed, the row and the
//   key (tiled_dropout.h), drawn again by the backward.
// Query head i uses key/value head i / (h / h_kv).
//
// The kernel's parts, one idea a header: tiled_simd.h (exp, tanh and the row passes of the
// softmax), tiled_scores.h (masks and score modifiers), tiled_walk.h (sizes, tiles, query blocks),
// tiled_rows.h (the tensors it reads and writes in place), tiled_blocks.h (the block products,
// float32 or bf16 with pair_products.h), tiled_forward.h and tiled_backward.h. This file holds the
// options, the entry points and the Python module, which also carries two helpers for Python code
// that runs without the kernel: the dropout factors (tiled_dropout.h) and a check that values are
// finite (finite_values.h).

// ATen and torch's pybind11 glue, not <torch/extension.h>: the whole C++ API's headers tripled
// the build's time, and a first call waits for it.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <vector>

#include "finite_values.h"
#include "pair_products.h"
#include "tiled_backward.h"
#include "tiled_blocks.h"
#include "tiled_dropout.h"
#include "tiled_forward.h"
#include "tiled_rows.h"
#include "tiled_scores.h"
#include "tiled_walk.h"

namespace {

// Everything a forward takes besides q, k, v and out, filled once by tiled/native.py from the
// call's plan; the backward's extends it (TiledBackwardOptions) (the first comment above says
// what each field holds).
// The defaults are a call with no mask, no ALiBi, no soft-cap and no score_mod; the block and tile
// sizes have none (0 is refused).
struct TiledOptions {
  at::Tensor bias = at::empty({0}, at::kFloat);     // float32 (b, h, t, s), any strides, or empty
  at::Tensor allowed = at::empty({0}, at::kBool);   // bool (b, h, t, s), any strides, or empty
  at::Tensor key_mask = at::empty({0}, at::kBool);  // bool (b, s), contiguous rows, or empty
  at::Tensor alibi = at::empty({0}, at::kFloat);    // the slopes, float32 (h,), or empty
  double softcap = 0.0;                             // 0 for none
  int64_t window_left = -1, window_right = -1;      // -1 unbounded
  int64_t shift = 0;
  int64_t block_q = 0, block_k = 0;
  int64_t route = 0;  // how bf16 blocks are multiplied (fast_pairs)
  int64_t tile_rows = 0, tile_keys = 0;
  py::object mod_bias = py::none();  // a score_mod's bias per tile, or None
  double dropout_p = 0.0;                 // dropout of the weights (tiled_dropout.h), 0 for none
  int64_t dropout_seed = 0;               // its seed: the same in the forward and the backward

  // The scoring of a call of these sizes, after checking that every mask fits them (the kernel
  // reads them without bounds checks).
  Scoring scoring(const Sizes& z) const {
    TORCH_CHECK(bias.numel() == 0 || (bias.dim() == 4 && bias.scalar_type() == at::kFloat),
                "tiled: bias must be empty or float32 (b, h, t, s)");
    TORCH_CHECK(allowed.numel() == 0 ||
                    (allowed.dim() == 4 && allowed.scalar_type() == at::kBool),
                "tiled: allowed must be empty or bool (b, h, t, s)");
    const std::vector<int64_t> full{z.b, z.h, z.t, z.s};
    TORCH_CHECK(block_q > 0 && block_k > 0, "tiled: block sizes must be positive");
    TORCH_CHECK(bias.numel() == 0 || bias.sizes() == at::IntArrayRef(full),
                "tiled: bias must be (b, h, t, s)");
    TORCH_CHECK(allowed.numel() == 0 || allowed.sizes() == at::IntArrayRef(full),
                "tiled: allowed must be (b, h, t, s)");
    TORCH_CHECK(key_mask.numel() == 0 ||
                    (key_mask.sizes() == at::IntArrayRef({z.b, z.s}) &&
                     (z.s == 1 || key_mask.stride(1) == 1) && key_mask.scalar_type() == at::kBool),
                "tiled: key_mask must be empty or bool (b, s) with contiguous rows");
    TORCH_CHECK(alibi.numel() == 0 || (alibi.numel() == z.h && alibi.is_contiguous() &&
                                       alibi.scalar_type() == at::kFloat),
                "tiled: alibi must be empty or contiguous float32 (h,)");
    Scoring sc;
    sc.s = z.s, sc.diagonal = z.s - z.t + shift, sc.left = window_left, sc.right = window_right;
    sc.softcap = static_cast<float>(softcap);
    sc.alibi = alibi.numel() ? alibi.data_ptr<float>() : nullptr;
    sc.bias = Strided<float>::of(bias);
    sc.allowed = Strided<bool>::of(allowed);
    sc.key_mask = key_mask.numel() ? key_mask.data_ptr<bool>() : nullptr;
    sc.key_mask_stride = key_mask.numel() ? key_mask.stride(0) : 0;
    return sc;
  }

  // The tiles of a call, and the function that takes the gradient of a score_mod's bias (the
  // backward's; None in the forward).
  Tiles tiles(py::object bias_grad = py::none()) const {
    TORCH_CHECK(tile_rows > 0 && tile_rows % block_q == 0 && tile_keys > 0 &&
                    tile_keys % block_k == 0,
                "tiled: tile sizes must be positive multiples of the block sizes");
    return Tiles{tile_rows, tile_keys, block_k, mod_bias, bias_grad};
  }
};

// The backward's options: the forward's, and what only the backward takes (as flash-attention's
// Flash_bwd_params extends Flash_fwd_params). dout has the operands' dtype; lse and delta are
// contiguous float32 (b, h, t), delta = rowsum(dout * out) minus the lse's gradient, the lse 0 for
// rows with no allowed key; dq, dk and dv receive the gradients (see write_check).
struct TiledBackwardOptions : TiledOptions {
  at::Tensor dout, lse, delta;
  at::Tensor dq, dk, dv;
  double q_scale = 1.0;                   // the gradient of q is that of the pre-scaled q times it
  bool alibi_grad = false;                // the slopes' gradient too
  py::object mod_bias_grad = py::none();  // takes the gradient of a score_mod's bias, or None
};

// The operands' dtype: float32 (products by torch's matmul) or bfloat16 (pair products), the same
// for all. Rows are read in place (tiled_rows.h's Operand): each row's entries contiguous; bf16
// rows are read as pairs, so their head dims and strides are even and their data 4-byte aligned
// (the caller pads or copies those that are not).
c10::ScalarType check_operands(std::initializer_list<const at::Tensor*> tensors) {
  const auto dtype = (*tensors.begin())->scalar_type();
  for (const auto* x : tensors) {
    TORCH_CHECK(x->dim() == 4 && x->scalar_type() == dtype &&
                    (dtype == at::kFloat || dtype == at::kBFloat16),
                "tiled: the operands must be 4-d tensors, all float32 or all bfloat16");
    TORCH_CHECK(x->size(3) <= 1 || x->stride(3) == 1,
                "tiled: each row's entries must be contiguous");
    if (dtype == at::kBFloat16) {
      bool even = x->size(3) % 2 == 0 && reinterpret_cast<uintptr_t>(x->data_ptr()) % 4 == 0;
      for (int dim = 0; dim < 3; ++dim) {
        even = even && (x->size(dim) == 1 || x->stride(dim) % 2 == 0);
      }
      TORCH_CHECK(even, "tiled: bfloat16 operands must have an even last dim, even strides and "
                        "4-byte aligned data");
    }
  }
  return dtype;
}

// The sizes of a call, after checking that q, k and v agree on them.
Sizes sizes_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const Sizes z{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  TORCH_CHECK(z.h % z.h_kv == 0 && k.sizes() == at::IntArrayRef({z.b, z.h_kv, z.s, z.d}) &&
                  v.sizes() == at::IntArrayRef({z.b, z.h_kv, z.s, z.dv}),
              "tiled: q (b, h, t, d), k (b, h_kv, s, d) and v (b, h_kv, s, dv) disagree");
  return z;
}

// Checks a tensor the kernel writes its results into: (`rows`..., `width` or one fewer columns),
// float32, bf16 or float16, each row's entries contiguous, no two entries in one place (threads
// write rows at once).
void write_check(const at::Tensor& x, std::initializer_list<int64_t> rows, int64_t width,
                 const char* name) {
  const auto type = x.scalar_type();
  bool fits = x.dim() == 4 && (x.size(3) == width || x.size(3) == width - 1) &&
              (x.size(3) <= 1 || x.stride(3) == 1) &&
              (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf) &&
              at::has_internal_overlap(x) != at::MemOverlap::Yes;
  int dim = 0;
  for (const int64_t n : rows) fits = fits && x.size(dim++) == n;
  TORCH_CHECK(fits, "tiled: ", name,
              " must be float32, bfloat16 or float16 of the operands' sizes, with contiguous rows "
              "and no overlap");
}

// How bf16 blocks are multiplied: 1 vdpbf16ps (needs a build with AVX512-BF16), else portably.
bool fast_pairs(int64_t route) {
  TORCH_CHECK(route == 0 || route == 1, "tiled: unknown route ", route);
  TORCH_CHECK(route == 0 || pairs::kHasAvx512Bf16, "tiled: this build has no AVX512-BF16 products");
  return route == 1;
}

}  // namespace

// Writes the output into `out` (b, h, t, dv or dv - 1) and returns it with the lse (b, h, t), float32.
// Operands all float32 or all bf16 (`options.route` says how bf16 blocks are multiplied; see
// fast_pairs).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& out,
                                           const TiledOptions& options) {
  const auto dtype = check_operands({&q, &k, &v});
  const Sizes z = sizes_of(q, k, v);
  write_check(out, {z.b, z.h, z.t}, z.dv, "out (b, h, t, dv)");
  const Scoring sc = options.scoring(z);
  const Tiles tiles = options.tiles();
  const Dropout drop = dropout_of(options.dropout_p, options.dropout_seed);
  const int64_t block_q = options.block_q, block_k = options.block_k;
  if (dtype == at::kFloat) {
    return forward_blocks(Float32Blocks(z, q, k, v, nullptr), z, sc, drop, block_q, block_k,
                          tiles, out);
  }
  return forward_blocks(Bf16Blocks(z, q, k, v, nullptr, fast_pairs(options.route)), z, sc, drop,
                        block_q, block_k, tiles, out);
}

// Writes the gradients w.r.t. q (those of the pre-scaled q times `options.q_scale`), k and v into
// options.dq, dk and dv, and returns them with that of the ALiBi slopes (if `options.alibi_grad`),
// float32 (tiled_backward.h).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const TiledBackwardOptions& options) {
  const at::Tensor& dout = options.dout;
  const at::Tensor& lse = options.lse;
  const at::Tensor& delta = options.delta;
  const auto dtype = check_operands({&dout, &q, &k, &v});
  const Sizes z = sizes_of(q, k, v);
  TORCH_CHECK(dout.sizes() == at::IntArrayRef({z.b, z.h, z.t, z.dv}),
              "tiled: dout must be (b, h, t, dv)");
  TORCH_CHECK(lse.is_contiguous() && delta.is_contiguous() && lse.numel() == z.b * z.h * z.t &&
                  delta.numel() == z.b * z.h * z.t && lse.scalar_type() == at::kFloat &&
                  delta.scalar_type() == at::kFloat,
              "tiled: lse and delta must be contiguous float32 (b, h, t)");
  write_check(options.dq, {z.b, z.h, z.t}, z.d, "dq (b, h, t, d)");
  write_check(options.dk, {z.b, z.h_kv, z.s}, z.d, "dk (b, h_kv, s, d)");
  write_check(options.dv, {z.b, z.h_kv, z.s}, z.dv, "dv (b, h_kv, s, dv)");
  const std::array<at::Tensor, 3> grads{options.dq, options.dk, options.dv};
  const Scoring sc = options.scoring(z);
  const Tiles tiles = options.tiles(options.mod_bias_grad);
  const Dropout drop = dropout_of(options.dropout_p, options.dropout_seed);
  const int64_t block_q = options.block_q, block_k = options.block_k;
  const bool alibi_grad = options.alibi_grad;
  const double q_scale = options.q_scale;
  const BackwardPlan plan = BackwardPlan::of(z, block_k, tiles);
  if (dtype == at::kFloat) {
    return backward_blocks(Float32Blocks(z, q, k, v, &dout), z, sc, drop, lse, delta, block_q,
                           block_k, alibi_grad, plan, tiles, grads, q_scale);
  }
  const bool per_head = plan.in_scratch;  // its items are whole heads: each packs its own
  return backward_blocks(Bf16Blocks(z, q, k, v, &dout, fast_pairs(options.route), per_head), z,
                         sc, drop, lse, delta, block_q, block_k, alibi_grad, plan, tiles, grads,
                         q_scale);
}

// The dropout's factors over the queries [i0, i1) and keys [j0, j1) of `heads` (batch x heads)
// rows of `t` queries each, (heads, i1 - i0, j1 - j0) float32: dropout.py's keep_scale, by the
// forward's hash (tiled_dropout.h), for the weights a call returns after dropout.
at::Tensor dropout_factors(int64_t heads, int64_t t, int64_t i0, int64_t i1, int64_t j0,
                           int64_t j1, double p, int64_t seed) {
  TORCH_CHECK(p > 0.0 && p < 1.0 && 0 <= i0 && i0 <= i1 && i1 <= t && 0 <= j0 && j0 <= j1,
              "tiled: dropout factors need 0 < p < 1 and blocks inside the rows");
  const Dropout drop = dropout_of(p, seed);
  const int64_t rows = i1 - i0, n = j1 - j0;
  at::Tensor out = at::empty({heads, rows, n}, at::kFloat);
  float* data = out.data_ptr<float>();
  at::parallel_for(0, heads * rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t head = r / rows, i = i0 + r % rows;
      drop.factors(data + r * n, n, drop.row(head * t + i), j0);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<TiledOptions>(m, "TiledOptions", "Everything a call takes besides its tensors")
      .def(py::init<>())
      .def_readwrite("bias", &TiledOptions::bias)
      .def_readwrite("allowed", &TiledOptions::allowed)
      .def_readwrite("key_mask", &TiledOptions::key_mask)
      .def_readwrite("alibi", &TiledOptions::alibi)
      .def_readwrite("softcap", &TiledOptions::softcap)
      .def_readwrite("window_left", &TiledOptions::window_left)
      .def_readwrite("window_right", &TiledOptions::window_right)
      .def_readwrite("shift", &TiledOptions::shift)
      .def_readwrite("block_q", &TiledOptions::block_q)
      .def_readwrite("block_k", &TiledOptions::block_k)
      .def_readwrite("route", &TiledOptions::route)
      .def_readwrite("tile_rows", &TiledOptions::tile_rows)
      .def_readwrite("tile_keys", &TiledOptions::tile_keys)
      .def_readwrite("mod_bias", &TiledOptions::mod_bias)
      .def_readwrite("dropout_p", &TiledOptions::dropout_p)
      .def_readwrite("dropout_seed", &TiledOptions::dropout_seed);
  py::class_<TiledBackwardOptions, TiledOptions>(
      m, "TiledBackwardOptions", "The forward's options and what only the backward takes")
      .def(py::init<>())
      .def_readwrite("dout", &TiledBackwardOptions::dout)
      .def_readwrite("lse", &TiledBackwardOptions::lse)
      .def_readwrite("delta", &TiledBackwardOptions::delta)
      .def_readwrite("dq", &TiledBackwardOptions::dq)
      .def_readwrite("dk", &TiledBackwardOptions::dk)
      .def_readwrite("dv", &TiledBackwardOptions::dv)
      .def_readwrite("q_scale", &TiledBackwardOptions::q_scale)
      .def_readwrite("alibi_grad", &TiledBackwardOptions::alibi_grad)
      .def_readwrite("mod_bias_grad", &TiledBackwardOptions::mod_bias_grad);
  m.def("forward", &forward, "Tiled attention forward into out: (out, lse)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("out"), py::arg("options"));
  m.def("backward", &backward,
        "Tiled attention backward into options.dq, dk, dv: (dq, dk, dv, dalibi)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("options"));
  m.def("dropout_factors", &dropout_factors,
        "Dropout factors (heads, i1 - i0, j1 - j0): 1 / (1 - p) where kept, 0 where dropped",
        py::arg("heads"), py::arg("t"), py::arg("i0"), py::arg("i1"), py::arg("j0"), py::arg("j1"),
        py::arg("p"), py::arg("seed"));
  m.def("all_finite", &all_finite,
        "Whether every value of each tensor is finite; None where one is not a dense CPU tensor "
        "of a float type (finite_values.h)",
        py::arg("tensors"), py::call_guard<py::gil_scoped_release>());
  m.def("has_avx512_bf16", [] { return pairs::kHasAvx512Bf16; },
        "Whether this build multiplies bf16 blocks with AVX512-BF16");
}
