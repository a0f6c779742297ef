// The tensors the tiled kernel reads and writes in place: rows of contiguous entries in any layout
// (Operand), and the float32 results rounded into the caller's dtype (store_rows).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>

namespace {

// A (b, heads, n, width) tensor read or written in place: its rows' entries contiguous, its other
// strides any (a module's (b, n, heads, width) projections, seen as (b, heads, n, width), are
// such a view). `bh` is a head's index in (b * heads). T is const for the operands.
template <typename T>
struct Operand {
  T* data = nullptr;
  int64_t heads = 1, batch_stride = 0, head_stride = 0, ld = 0;  // ld: from one row to the next

  Operand() = default;
  Operand(const at::Tensor& x, T* bits)
      : data(bits), heads(x.size(1)), batch_stride(x.stride(0)), head_stride(x.stride(1)),
        ld(x.stride(2)) {}
  T* row(int64_t bh, int64_t i) const {
    return data + bh / heads * batch_stride + bh % heads * head_stride + i * ld;
  }
};

// f(T{}) for T the element type of `x`: float, at::BFloat16 or at::Half (the caller checked).
template <typename F>
void with_element_type(const at::Tensor& x, F&& f) {
  switch (x.scalar_type()) {
    case at::kFloat: return f(float{});
    case at::kBFloat16: return f(at::BFloat16{});
    default: return f(at::Half{});
  }
}

// dst[c] = factor * (the sum of src[c + p * part_stride] over `parts`), c < width, rounded as torch
// rounds to T (to nearest, ties to even).
template <typename T>
inline void store_row(T* dst, const float* src, int64_t width, int64_t parts, int64_t part_stride,
                      float factor) {
  for (int64_t c = 0; c < width; ++c) {
    float x = src[c];
    for (int64_t p = 1; p < parts; ++p) x += src[p * part_stride + c];
    dst[c] = static_cast<T>(x * factor);
  }
}

// Into `out` (b, heads, n, width; float32, bf16 or float16, rows of contiguous entries, any
// layout): `factor` times the sum of `parts` float32 arrays `part_stride` apart, each of
// (b heads n) rows `ld` apart, of which the first `width` columns are kept.
template <typename T>
void store_rows_as(const at::Tensor& out, const float* rows, int64_t ld, int64_t parts,
                   int64_t part_stride, float factor) {
  const Operand<T> o(out, out.data_ptr<T>());
  const int64_t n = out.size(2), width = out.size(3);
  at::parallel_for(0, out.size(0) * out.size(1) * n, 256, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      store_row(o.row(r / n, r % n), rows + r * ld, width, parts, part_stride, factor);
    }
  });
}

inline void store_rows(const at::Tensor& out, const float* rows, int64_t ld, int64_t parts,
                       int64_t part_stride, float factor) {
  with_element_type(out, [&](auto tag) {
    store_rows_as<decltype(tag)>(out, rows, ld, parts, part_stride, factor);
  });
}

// Rows [i0, i0 + count) of head `bh` of `out` (as store_rows takes it): `factor` times the float32
// rows at `rows`, `ld` apart, rounded as store_row rounds.
inline void store_head_rows(const at::Tensor& out, int64_t bh, int64_t i0, int64_t count,
                            const float* rows, int64_t ld, float factor) {
  with_element_type(out, [&](auto tag) {
    using T = decltype(tag);
    const Operand<T> o(out, out.data_ptr<T>());
    for (int64_t r = 0; r < count; ++r) {
      store_row(o.row(bh, i0 + r), rows + r * ld, out.size(3), 1, 0, factor);
    }
  });
}

}  // namespace
