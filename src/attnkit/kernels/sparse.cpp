// The sparse kernel: top-k sparse attention (DeepSeek's DSA), each query attending only to the keys
// its indices name, in O(t n d) time and O(t + s d) memory beyond the inputs, for n indices per
// query: no (t, s) tensor is made.
//
//   sparse_forward.h    the scores of the selected keys, their softmax, the weighted values
//   sparse_backward.h   the gradients, each query's weights recomputed from the lse
//   sparse_rows.h       the selection of one query's keys, rows as float32
//
// Layout: q (b, h, t, d), k (b, h_kv, s, d), v (b, h_kv, s, dv), each with a contiguous last dim
// (views of (b, t, h, d) projections are fine); indices contiguous (b, 1 or h_kv, t, n), int32 or
// int64, -1 for an unused slot. Sums and softmax in float32 whatever the dtype (float32, bf16,
// fp16). Built with -ffast-math but -fno-finite-math-only, so that the checks for NaN and infinity
// stay; sparse/native.py fills the options and checks the indices' range before a call.

// ATen and torch's pybind11 glue, not <torch/extension.h>, whose headers triple the build's time.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "sparse_backward.h"
#include "sparse_forward.h"
#include "sparse_rows.h"

namespace {

constexpr int64_t kMaxGroups = 256;  // query heads per key/value head
constexpr int64_t kMaxSplits = 8;   // copies of dK and dV that the backward's threads add into

// Everything a call takes besides its tensors (the backward's extends it).
struct SparseOptions {
  at::Tensor key_mask = at::empty({0}, at::kBool);  // bool (b, s), contiguous rows, or empty
  double scale = 1.0;
  int64_t window_left = -1, window_right = -1;  // -1 unbounded; causal is (-1, 0)
  int64_t shift = 0;                            // query i sits at i + s - t + shift
};

struct SparseBackwardOptions : SparseOptions {
  at::Tensor dout, lse, delta;  // dout (b, h, t, dv) of q's dtype; lse, delta float32 (b, h, t)
};

template <typename T, typename I>
Operands<T, I> operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& indices, const SparseOptions& o) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "sparse: q, k, v must be 4-D");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "sparse: q, k and v need contiguous last dims");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "sparse: q, k and v must have one dtype");
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  const int64_t h_kv = k.size(1), s = k.size(2), dv = v.size(3);
  TORCH_CHECK(k.size(0) == b && v.size(0) == b && v.size(1) == h_kv && v.size(2) == s &&
                  k.size(3) == d && h_kv > 0 && h % h_kv == 0 && h / h_kv <= kMaxGroups,
              "sparse: q (b, h, t, d), k (b, h_kv, s, d), v (b, h_kv, s, dv), h / h_kv <= 256");
  TORCH_CHECK(indices.dim() == 4 && indices.is_contiguous() && indices.size(0) == b &&
                  (indices.size(1) == 1 || indices.size(1) == h_kv) && indices.size(2) == t,
              "sparse: indices must be contiguous (b, 1 or h_kv, t, n)");
  const auto& km = o.key_mask;
  TORCH_CHECK(km.numel() == 0 || (km.scalar_type() == at::kBool && km.dim() == 2 &&
                                  km.size(0) == b && km.size(1) == s && km.stride(1) == 1),
              "sparse: key_mask must be empty or bool (b, s) with contiguous rows");
  Operands<T, I> x;
  x.q = q.data_ptr<T>(), x.k = k.data_ptr<T>(), x.v = v.data_ptr<T>();
  x.q_b = q.stride(0), x.q_h = q.stride(1), x.q_t = q.stride(2);
  x.k_b = k.stride(0), x.k_h = k.stride(1), x.k_s = k.stride(2);
  x.v_b = v.stride(0), x.v_h = v.stride(1), x.v_s = v.stride(2);
  x.indices = indices.data_ptr<I>(), x.index_heads = indices.size(1), x.n = indices.size(3);
  x.key_mask = km.numel() ? km.data_ptr<bool>() : nullptr;
  x.key_mask_b = km.numel() ? km.stride(0) : 0;
  x.b = b, x.h = h, x.h_kv = h_kv, x.t = t, x.s = s, x.d = d, x.dv = dv;
  x.scale = static_cast<float>(o.scale);
  x.diagonal = s - t + o.shift, x.left = o.window_left, x.right = o.window_right;
  return x;
}

// Runs `body` with T the dtype of q, I that of the indices and D the head dim when it is one of
// the common widths (keys and values alike), else 0.
template <typename Body>
void dispatch(const at::Tensor& q, const at::Tensor& v, const at::Tensor& indices, Body body) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "sparse", [&] {
    using T = scalar_t;
    const int64_t d = q.size(3) == v.size(3) ? q.size(3) : 0;
    AT_DISPATCH_INDEX_TYPES(indices.scalar_type(), "sparse_indices", [&] {
      using I = index_t;
      if (d == 64) {
        body(T{}, I{}, std::integral_constant<int64_t, 64>{});
      } else if (d == 128) {
        body(T{}, I{}, std::integral_constant<int64_t, 128>{});
      } else {
        body(T{}, I{}, std::integral_constant<int64_t, 0>{});
      }
    });
  });
}

// out (b, h, t, dv) in q's dtype (laid out as (b, t, h, dv), so that merging the heads is a view)
// and lse (b, h, t) float32.
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& indices, const SparseOptions& options) {
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), dv = v.size(3);
  auto out = at::empty({b, t, h, dv}, q.options());
  auto lse = at::empty({b, h, t}, q.options().dtype(at::kFloat));
  if (out.numel() == 0 && lse.numel() == 0) return {out.permute({0, 2, 1, 3}), lse};
  dispatch(q, v, indices, [&](auto tag, auto index_tag, auto dim) {
    using T = decltype(tag);
    using I = decltype(index_tag);
    const auto x = operands<T, I>(q, k, v, indices, options);
    sparse_forward<T, I, decltype(dim)::value>(x, out.data_ptr<T>(), lse.data_ptr<float>());
  });
  return {out.permute({0, 2, 1, 3}), lse};
}

// (dq (b, h, t, d) in q's dtype, dk (splits, b, h_kv, s, d) and dv (splits, b, h_kv, s, dv) in
// float32): the caller adds dk and dv over their first dim.
std::vector<at::Tensor> backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& indices, const SparseBackwardOptions& options) {
  const int64_t b = q.size(0), h = q.size(1), t = q.size(2), d = q.size(3);
  const int64_t h_kv = k.size(1), s = k.size(2), dv = v.size(3);
  const auto &dout = options.dout, &lse = options.lse, &delta = options.delta;
  TORCH_CHECK(dout.dim() == 4 && dout.sizes() == at::IntArrayRef({b, h, t, dv}) &&
                  dout.stride(3) == 1 && dout.scalar_type() == q.scalar_type(),
              "sparse: dout must be (b, h, t, dv) of q's dtype with a contiguous last dim");
  for (const auto* x : {&lse, &delta}) {
    TORCH_CHECK(x->sizes() == at::IntArrayRef({b, h, t}) && x->is_contiguous() &&
                    x->scalar_type() == at::kFloat,
                "sparse: lse and delta must be contiguous float32 (b, h, t)");
  }
  const int64_t items = std::max<int64_t>(1, b * h_kv);
  const int64_t wanted = (at::get_num_threads() + items - 1) / items;
  const int64_t splits = std::max<int64_t>(1, std::min({wanted, kMaxSplits, t}));
  auto dq = at::empty({b, h, t, d}, q.options());
  auto dk = at::zeros({splits, b, h_kv, s, d}, q.options().dtype(at::kFloat));
  auto dvs = at::zeros({splits, b, h_kv, s, dv}, q.options().dtype(at::kFloat));
  if (q.numel() == 0 || s == 0) return {dq.zero_(), dk, dvs};
  dispatch(q, v, indices, [&](auto tag, auto index_tag, auto dim) {
    using T = decltype(tag);
    using I = decltype(index_tag);
    const auto x = operands<T, I>(q, k, v, indices, options);
    Gradients<T> y;
    y.dout = dout.data_ptr<T>();
    y.do_b = dout.stride(0), y.do_h = dout.stride(1), y.do_t = dout.stride(2);
    y.lse = lse.data_ptr<float>(), y.delta = delta.data_ptr<float>();
    y.dq = dq.data_ptr<T>(), y.dk = dk.data_ptr<float>(), y.dv = dvs.data_ptr<float>();
    y.splits = splits;
    sparse_backward<T, I, decltype(dim)::value>(x, y);
  });
  return {dq, dk, dvs};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<SparseOptions>(m, "SparseOptions", "Everything a call takes besides its tensors")
      .def(py::init<>())
      .def_readwrite("key_mask", &SparseOptions::key_mask)
      .def_readwrite("scale", &SparseOptions::scale)
      .def_readwrite("window_left", &SparseOptions::window_left)
      .def_readwrite("window_right", &SparseOptions::window_right)
      .def_readwrite("shift", &SparseOptions::shift);
  py::class_<SparseBackwardOptions, SparseOptions>(
      m, "SparseBackwardOptions", "The forward's options and what only the backward takes")
      .def(py::init<>())
      .def_readwrite("dout", &SparseBackwardOptions::dout)
      .def_readwrite("lse", &SparseBackwardOptions::lse)
      .def_readwrite("delta", &SparseBackwardOptions::delta);
  m.def("forward", &forward, "Top-k sparse attention: (out, lse)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("indices"), py::arg("options"));
  m.def("backward", &backward, "Its gradients: (dq, dk per split, dv per split)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("indices"), py::arg("options"));
  m.def("has_avx512_bf16", [] { return kPairs<c10::BFloat16>; },
        "Whether this build multiplies bf16 scores in pairs with AVX512-BF16");
}
