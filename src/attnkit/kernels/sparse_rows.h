// What the sparse kernel's forward and backward share: the operands of a call, the keys one query
// may see among those its indices select, and rows of K and V as float32.
//
// Like every sparse_*.h, this is a part of sparse.cpp, included by it alone.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t kAhead = 8;  // how many selected keys ahead a row of K or V is fetched

inline bool finite(float x) { return std::fabs(x) <= FLT_MAX; }

// One call's tensors as pointers and strides (in elements). q, k and v have contiguous last dims;
// the indices are contiguous (b, index_heads, t, n), index_heads 1 (shared by every head) or h_kv.
template <typename T, typename I>
struct Operands {
  const T *q, *k, *v;
  int64_t q_b, q_h, q_t, k_b, k_h, k_s, v_b, v_h, v_s;
  const I* indices;
  int64_t index_heads, n;
  const bool* key_mask;  // (b, s) with contiguous rows, or null: every key is real
  int64_t key_mask_b;
  int64_t b, h, h_kv, t, s, d, dv;
  float scale;
  int64_t diagonal;           // query i sits at position i + diagonal
  int64_t left, right;        // the window around it, -1 unbounded

  int64_t groups() const { return h / h_kv; }

  const I* slots(int64_t batch, int64_t head, int64_t i) const {
    const int64_t at = (batch * index_heads + (index_heads == 1 ? 0 : head)) * t + i;
    return indices + at * n;
  }
  const T* key(int64_t batch, int64_t head, int64_t j) const {
    return k + batch * k_b + head * k_h + j * k_s;
  }
  const T* value(int64_t batch, int64_t head, int64_t j) const {
    return v + batch * v_b + head * v_h + j * v_s;
  }
  const T* query(int64_t batch, int64_t head, int64_t i) const {
    return q + batch * q_b + head * q_h + i * q_t;
  }

  // The keys that query i selects and may see, each once, in the order given, into `keys`; their
  // number. An index of -1 (an unused slot), one outside the causal limit or the window, and
  // padding are left out; a key listed twice counts once, as in the dense mask the indices would
  // make. `seen` is a bitmap of s bits, clear on entry and on return.
  int64_t visible(int64_t batch, int64_t head, int64_t i, uint64_t* seen, int64_t* keys) const {
    const I* slot = slots(batch, head, i);
    const int64_t p = i + diagonal;
    const int64_t lo = left >= 0 ? std::max<int64_t>(0, p - left) : 0;
    const int64_t hi = right >= 0 ? std::min<int64_t>(s - 1, p + right) : s - 1;
    const bool* real = key_mask ? key_mask + batch * key_mask_b : nullptr;
    int64_t m = 0;
    for (int64_t e = 0; e < n; ++e) {
      const int64_t j = static_cast<int64_t>(slot[e]);
      if (j < lo || j > hi || (real && !real[j])) continue;  // -1 too: lo >= 0
      uint64_t& word = seen[j >> 6];
      const uint64_t bit = uint64_t{1} << (j & 63);
      if (word & bit) continue;
      word |= bit;
      keys[m++] = j;
    }
    for (int64_t e = 0; e < m; ++e) seen[keys[e] >> 6] = 0;  // every bit set was this row's
    return m;
  }
};

// A row of K or V as float32: the row itself for float32, else converted into `buffer`.
template <typename T, int64_t D>
inline const float* as_float(const T* row, float* buffer, int64_t dim) {
  if constexpr (std::is_same_v<T, float>) {
    return row;
  } else {
    const int64_t n = D ? D : dim;
    for (int64_t c = 0; c < n; ++c) buffer[c] = static_cast<float>(row[c]);
    return buffer;
  }
}

// Ask for a row that a later key will read: the rows a selection names are scattered over K and V,
// where the hardware's prefetchers cannot guess them.
template <typename T>
inline void fetch_row(const T* row, int64_t dim) {
  const char* at = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < dim * static_cast<int64_t>(sizeof(T)); offset += 64) {
    __builtin_prefetch(at + offset, 0, 3);
  }
}

template <int64_t D>
inline float dot(const float* a, const float* b, int64_t dim) {
  const int64_t n = D ? D : dim;
  float sum = 0.f;
  for (int64_t c = 0; c < n; ++c) sum += a[c] * b[c];
  return sum;
}

template <int64_t D>
inline void add_scaled(float* into, float factor, const float* x, int64_t dim) {
  const int64_t n = D ? D : dim;
  for (int64_t c = 0; c < n; ++c) into[c] += factor * x[c];
}

}  // namespace
