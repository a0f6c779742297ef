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
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

  // Marks in `seen` (a bitmap of s bits) the keys that query i selects and may see: an index of -1
  // (an unused slot), one outside the causal limit or the window, and padding are left out; a key
  // listed twice is marked once, as in the dense mask the indices would make. Returns the range of
  // keys [lo, hi] the query may see at all.
  std::pair<int64_t, int64_t> mark(int64_t batch, int64_t head, int64_t i, uint64_t* seen) const {
    const I* slot = slots(batch, head, i);
    const int64_t p = i + diagonal;
    const int64_t lo = left >= 0 ? std::max<int64_t>(0, p - left) : 0;
    const int64_t hi = right >= 0 ? std::min<int64_t>(s - 1, p + right) : s - 1;
    if (hi < lo) return {lo, hi};  // the query sees no key at all
    const bool* real = key_mask ? key_mask + batch * key_mask_b : nullptr;
    const uint64_t span = static_cast<uint64_t>(hi - lo);
    const int64_t slots_of_query = n;  // a local: stores to `seen` may not alias it
    for (int64_t e = 0; e < slots_of_query; ++e) {
      const int64_t j = static_cast<int64_t>(slot[e]);
      // lo <= j <= hi in one comparison; -1 is out too, as lo >= 0
      if (static_cast<uint64_t>(j - lo) > span || (real && !real[j])) continue;
      seen[j >> 6] |= uint64_t{1} << (j & 63);
    }
    return {lo, hi};
  }
};

// The keys that a block of queries may see, each query's grouped by tile of `tile` keys (a power
// of two), so that the block can be walked tile by tile: the rows of K and V of one tile, read into
// cache once, serve every query of the block that selected them. Long sequences select keys from
// far more rows than the caches hold; walked query by query, each selected row would be read from
// memory anew.
struct BlockKeys {
  int64_t n, tiles, shift;  // tile = 1 << shift
  std::vector<uint64_t> seen;
  std::vector<int64_t> keys;    // (rows, n): each query's keys, ascending
  std::vector<int64_t> starts;  // (rows, tiles + 1): where each tile's keys start in its row

  BlockKeys(int64_t s, int64_t n_, int64_t max_rows, int64_t shift_)
      : n(n_), tiles(std::max<int64_t>(1, (s + (int64_t{1} << shift_) - 1) >> shift_)),
        shift(shift_), seen((s + 63) / 64, 0), keys(max_rows * n_),
        starts(max_rows * (tiles + 1)) {}

  // Queries i0 .. i0 + rows - 1 of (batch, head). Each query's keys are marked in a bitmap and read
  // back in order, which drops the duplicates and sorts them, so that each tile's keys follow
  // one another (and are read in the order they lie in memory).
  template <typename T, typename I>
  void select(const Operands<T, I>& x, int64_t batch, int64_t head, int64_t i0, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) {
      const auto [lo, hi] = x.mark(batch, head, i0 + r, seen.data());
      int64_t* row = keys.data() + r * n;
      int64_t* start = starts.data() + r * (tiles + 1);
      int64_t m = 0, tile = 0;  // start[t]: the first of the row's keys at or beyond tile t
      const int64_t words_per_tile = int64_t{1} << (shift - 6);  // shift >= 6
      for (int64_t word = lo >> 6; word <= (hi >> 6) && hi >= lo; ++word) {
        for (; tile <= word / words_per_tile; ++tile) start[tile] = m;
        for (uint64_t bits = seen[word]; bits != 0; bits &= bits - 1) {
          row[m++] = (word << 6) + __builtin_ctzll(bits);
        }
        seen[word] = 0;
      }
      for (; tile <= tiles; ++tile) start[tile] = m;
    }
  }
  int64_t count(int64_t r) const { return starts[r * (tiles + 1) + tiles]; }
  // The keys of query r in tile t: [begin, end) of its row.
  int64_t begin(int64_t r, int64_t t) const { return starts[r * (tiles + 1) + t]; }
  int64_t end(int64_t r, int64_t t) const { return starts[r * (tiles + 1) + t + 1]; }
  const int64_t* row(int64_t r) const { return keys.data() + r * n; }
};

// The rows of the tile after `tile` that query i of a block of `rows` fetches into L2 while the
// block works on this tile (`row_of(j)` gives row j, of `row_bytes`), where the block selects at
// least half as many keys there as the tile holds: then nearly every row is read, and fetched in
// memory order they stream at the bus's speed instead of missing one by one. None otherwise.
template <typename RowOf>
inline void fetch_next_tile(RowOf row_of, int64_t row_bytes, const BlockKeys& sel, int64_t tile,
                            int64_t i, int64_t rows, int64_t s, bool dense) {
  if (!dense) return;
  const int64_t size = int64_t{1} << sel.shift, first = (tile + 1) * size;
  const int64_t count = std::min(size, s - first);
  const int64_t from = first + count * i / rows, to = first + count * (i + 1) / rows;
  for (int64_t j = from; j < to; ++j) {
    const char* at = reinterpret_cast<const char*>(row_of(j));
    for (int64_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(at + offset, 0, 2);
  }
}

// Whether the block selects at least half as many keys in the tile after `tile` as it holds.
inline bool next_tile_dense(const BlockKeys& sel, int64_t tile, int64_t rows) {
  if (tile + 1 >= sel.tiles) return false;
  int64_t selected = 0;
  for (int64_t i = 0; i < rows; ++i) selected += sel.end(i, tile + 1) - sel.begin(i, tile + 1);
  return 2 * selected >= (int64_t{1} << sel.shift);
}

// The tile of keys whose rows take about `bytes` (a power of two of keys, at least 64).
inline int64_t tile_shift(int64_t row_bytes, int64_t bytes) {
  int64_t shift = 6;  // a word of BlockKeys' bitmap
  while ((int64_t{2} << shift) * row_bytes <= bytes) ++shift;
  return shift;
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

// Rows keys[0..3] of K or V (`row_of(j)` gives row j), as they lie, and the rows `kAhead` keys
// further fetched. Half-precision rows are converted as the products read them, in registers: a
// converted copy written and read back at once waited on the store of each vector.
template <typename T, typename RowOf>
inline void four_rows(RowOf row_of, const int64_t* keys, int64_t left, int64_t dim,
                      const T* rows[4]) {
  for (int u = 0; u < 4; ++u) {
    if (u + kAhead < left) fetch_row(row_of(keys[u + kAhead]), dim);
    rows[u] = row_of(keys[u]);
  }
}

#if defined(__AVX512F__)
// 16 numbers of a row from c on, as float32.
template <typename T>
inline __m512 load16(const T* row, int64_t c) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(row + c);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the upper half of a float32
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c)));
  }
}

// The vector forms below run on float32, bf16 and fp16 rows whose width is a multiple of 16.
template <typename T>
constexpr bool kVectorType = !std::is_same_v<T, double>;
#endif

// The sums of the 16 lanes of each of a, b, c and d, in one vector: the four reductions share
// their shuffles (each alone would take eight steps, more than its dot product's products).
#if defined(__AVX512F__)
inline __m128 sum_lanes4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // 128-bit lane u holds four partial sums of the u-th vector
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0x4E));
  x = _mm512_add_ps(x, _mm512_permute_ps(x, 0xB1));
  const __m512i firsts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, x));
}
#endif

// Four dot products of `a` (float32) with rows[0..3] in one pass over a: four independent chains.
template <typename T, int64_t D>
inline void dot4(const float* a, const T* const rows[4], int64_t dim, float* out) {
#if defined(__AVX512F__)
  if (kVectorType<T> && (D ? D : dim) % 16 == 0) {
    const int64_t n = D ? D : dim;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t c = 0; c < n; c += 16) {
      const __m512 x = _mm512_loadu_ps(a + c);
      s0 = _mm512_fmadd_ps(x, load16(rows[0], c), s0);
      s1 = _mm512_fmadd_ps(x, load16(rows[1], c), s1);
      s2 = _mm512_fmadd_ps(x, load16(rows[2], c), s2);
      s3 = _mm512_fmadd_ps(x, load16(rows[3], c), s3);
    }
    _mm_storeu_ps(out, sum_lanes4(s0, s1, s2, s3));
    return;
  }
#endif
  const int64_t n = D ? D : dim;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  for (int64_t c = 0; c < n; ++c) {
    s0 += a[c] * static_cast<float>(rows[0][c]);
    s1 += a[c] * static_cast<float>(rows[1][c]);
    s2 += a[c] * static_cast<float>(rows[2][c]);
    s3 += a[c] * static_cast<float>(rows[3][c]);
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

// Whether scores of T rows are bf16 pair products (vdpbf16ps: products exact, sums in float32):
// bf16 rows, in a build with AVX512-BF16 (of a width that is a multiple of 32, asked at the call).
template <typename T>
constexpr bool kPairs =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

// Four dot products of a bf16 row `a` with bf16 rows[0..3], 32 numbers per product, times `scale`.
template <typename T, int64_t D>
inline void dot4_pairs(const T* a, const T* const rows[4], float scale, int64_t dim, float* out) {
#if defined(__AVX512BF16__)
  if constexpr (kPairs<T>) {
    const int64_t n = D ? D : dim;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int64_t c = 0; c < n; c += 32) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(a + c);
      s0 = _mm512_dpbf16_ps(s0, x, (__m512bh)_mm512_loadu_si512(rows[0] + c));
      s1 = _mm512_dpbf16_ps(s1, x, (__m512bh)_mm512_loadu_si512(rows[1] + c));
      s2 = _mm512_dpbf16_ps(s2, x, (__m512bh)_mm512_loadu_si512(rows[2] + c));
      s3 = _mm512_dpbf16_ps(s3, x, (__m512bh)_mm512_loadu_si512(rows[3] + c));
    }
    _mm_storeu_ps(out, _mm_mul_ps(sum_lanes4(s0, s1, s2, s3), _mm_set1_ps(scale)));
  }
#endif
}

// Four scores: those of a row `a` of T as given, scaled after (pair products), or of its float32
// copy `a_float`, scaled before.
template <typename T, int64_t D>
inline void score4(const float* a_float, const T* a, const T* const rows[4], float scale,
                   int64_t dim, float* out) {
  if (kPairs<T> && (D ? D : dim) % 32 == 0) {
    dot4_pairs<T, D>(a, rows, scale, dim, out);
  } else {
    dot4<T, D>(a_float, rows, dim, out);
  }
}

// into += f[0] rows[0] + ... + f[3] rows[3]: one load and store of `into` per four rows (adding
// row by row, each add would wait for the store of the one before).
template <typename T, int64_t D>
inline void add_four(float* into, const float* f, const T* const rows[4], int64_t dim) {
#if defined(__AVX512F__)
  if (kVectorType<T> && (D ? D : dim) % 16 == 0) {
    const int64_t n = D ? D : dim;
    const __m512 f0 = _mm512_set1_ps(f[0]), f1 = _mm512_set1_ps(f[1]);
    const __m512 f2 = _mm512_set1_ps(f[2]), f3 = _mm512_set1_ps(f[3]);
    for (int64_t c = 0; c < n; c += 16) {
      __m512 sum = _mm512_loadu_ps(into + c);
      sum = _mm512_fmadd_ps(f0, load16(rows[0], c), sum);
      sum = _mm512_fmadd_ps(f1, load16(rows[1], c), sum);
      sum = _mm512_fmadd_ps(f2, load16(rows[2], c), sum);
      sum = _mm512_fmadd_ps(f3, load16(rows[3], c), sum);
      _mm512_storeu_ps(into + c, sum);
    }
    return;
  }
#endif
  const int64_t n = D ? D : dim;
  for (int64_t c = 0; c < n; ++c) {
    into[c] += f[0] * static_cast<float>(rows[0][c]) + f[1] * static_cast<float>(rows[1][c]) +
               f[2] * static_cast<float>(rows[2][c]) + f[3] * static_cast<float>(rows[3][c]);
  }
}

// The largest of x[0..m), and whether any is NaN or infinite (one pass, no branches).
inline float max_and_finite(const float* x, int64_t m, bool* nonfinite) {
  int64_t e = 0;
  float most = -FLT_MAX;
  bool bad = false;
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(-FLT_MAX);
  __mmask16 flags = 0;
  const __m512 largest = _mm512_set1_ps(FLT_MAX);
  for (; e + 16 <= m; e += 16) {
    const __m512 v = _mm512_loadu_ps(x + e);
    top = _mm512_max_ps(top, v);
    flags |= _mm512_cmp_ps_mask(_mm512_abs_ps(v), largest, _CMP_NLE_UQ);  // NaN or beyond
  }
  most = _mm512_reduce_max_ps(top);
  bad = flags != 0;
#endif
  for (; e < m; ++e) {
    most = std::max(most, x[e]);
    bad = bad || !finite(x[e]);
  }
  *nonfinite = bad;
  return most;
}

template <typename T, int64_t D>
inline float dot(const float* a, const T* b, int64_t dim) {
  const int64_t n = D ? D : dim;
  float sum = 0.f;
  for (int64_t c = 0; c < n; ++c) sum += a[c] * static_cast<float>(b[c]);
  return sum;
}

template <typename T, int64_t D>
inline void add_scaled(float* into, float factor, const T* x, int64_t dim) {
  const int64_t n = D ? D : dim;
  for (int64_t c = 0; c < n; ++c) into[c] += factor * static_cast<float>(x[c]);
}

}  // namespace
