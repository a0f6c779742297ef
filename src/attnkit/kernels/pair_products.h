// Block products of bf16 matrices with float32 sums, for the tiled kernel's bf16 inputs.
//
// The operands are bf16 and are packed in pairs along the contraction: a 32-bit word holds two
// neighbours, x[2p] in its low half and x[2p + 1] in its high half. AVX512-BF16's vdpbf16ps takes 16
// such words of each side and adds both products of each pair to a float32 lane, so one instruction
// does 32 multiply-adds and the sums never leave float32.
//
//   C (m x n, row stride ldc) (+)= sum over p of A2(i, p) B2(p, j), where
//   A2(i, p) = a[i * a_row + p * a_pair]: one word, two neighbours of row i of A (any strides);
//   B2(p, j) = b[p * ldb + j]: row p of pairs of B, its columns contiguous, padded to kCols.
//
// Why a kernel of our own: on a CPU with AVX512-BF16 and no AMX it ran faster than torch's bf16
// matmul from C++ (oneDNN), its brgemm and float32 MKL (docs/bench/choices.md), and it is the only
// one of them that gives float32 scores: oneDNN's route would round every score to bf16 before the
// softmax.
//
// Builds without AVX512-BF16 (and tests that ask for it) use the portable tile: the same sums in
// float32 arithmetic, slow, for correctness on every CPU.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace pairs {

// Both may alias any other type: rows are written as bf16 values and read back as pairs, and
// torch's at::BFloat16 storage is read as bits.
typedef uint32_t Pair __attribute__((__may_alias__));
typedef uint16_t Bf16 __attribute__((__may_alias__));  // the bits of a bf16 value

constexpr int64_t kCols = 32;  // columns of C per tile: two vectors of 16 lanes
constexpr int kRows = 8;       // rows of C per tile: 16 accumulators, plus operands, fit 32 registers

inline int64_t padded(int64_t n) { return (n + kCols - 1) / kCols * kCols; }

inline float value(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float32 to bf16, rounding to nearest even; NaN stays NaN, infinities stay infinite.
inline Bf16 round(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<Bf16>((bits >> 16) | 0x40u);
  return static_cast<Bf16>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline Bf16 bits_of(Bf16 x) { return x; }
inline Bf16 bits_of(float x) { return round(x); }

inline bool finite(Bf16 x) { return (x & 0x7f80u) != 0x7f80u; }

inline Pair pair(Bf16 low, Bf16 high) {
  return static_cast<Pair>(low) | (static_cast<Pair>(high) << 16);
}

template <int MR>
inline void tile_portable(int64_t count, const Pair* a, int64_t a_row, int64_t a_pair,
                          const Pair* b, int64_t ldb, float* c, int64_t ldc, bool add) {
  float acc[MR][kCols];
  for (int r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < kCols; ++j) acc[r][j] = add ? c[r * ldc + j] : 0.f;
  }
  float low[kCols], high[kCols];
  for (int64_t p = 0; p < count; ++p) {
    for (int64_t j = 0; j < kCols; ++j) {
      low[j] = value(static_cast<Bf16>(b[p * ldb + j]));
      high[j] = value(static_cast<Bf16>(b[p * ldb + j] >> 16));
    }
    for (int r = 0; r < MR; ++r) {
      const Pair x = a[r * a_row + p * a_pair];
      const float x0 = value(static_cast<Bf16>(x)), x1 = value(static_cast<Bf16>(x >> 16));
      for (int64_t j = 0; j < kCols; ++j) acc[r][j] += x0 * low[j] + x1 * high[j];
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < kCols; ++j) c[r * ldc + j] = acc[r][j];
  }
}

#if defined(__AVX512BF16__)
constexpr bool kHasAvx512Bf16 = true;

template <int MR>
inline void tile_avx512_bf16(int64_t count, const Pair* a, int64_t a_row, int64_t a_pair,
                             const Pair* b, int64_t ldb, float* c, int64_t ldc, bool add) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = add ? _mm512_loadu_ps(c + r * ldc) : _mm512_setzero_ps();
    acc[r][1] = add ? _mm512_loadu_ps(c + r * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < count; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * ldb);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * ldb + 16);
    for (int r = 0; r < MR; ++r) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * a_row + p * a_pair]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(c + r * ldc, acc[r][0]);
    _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
  }
}
#else
constexpr bool kHasAvx512Bf16 = false;
#endif

template <int MR>
inline void tile(bool fast, int64_t count, const Pair* a, int64_t a_row, int64_t a_pair,
                 const Pair* b, int64_t ldb, float* c, int64_t ldc, bool add) {
#if defined(__AVX512BF16__)
  if (fast) return tile_avx512_bf16<MR>(count, a, a_row, a_pair, b, ldb, c, ldc, add);
#endif
  tile_portable<MR>(count, a, a_row, a_pair, b, ldb, c, ldc, add);
}

// C (m x n) (+)= A2 B2 over `count` pairs; n a multiple of kCols. `fast`: vdpbf16ps (in a build with
// AVX512-BF16), else the portable tile.
inline void gemm(bool fast, int64_t m, int64_t n, int64_t count, const Pair* a, int64_t a_row,
                 int64_t a_pair, const Pair* b, int64_t ldb, float* c, int64_t ldc, bool add) {
  for (int64_t j = 0; j < n; j += kCols) {
    int64_t i = 0;
    for (; i + kRows <= m; i += kRows) {
      tile<kRows>(fast, count, a + i * a_row, a_row, a_pair, b + j, ldb, c + i * ldc + j, ldc, add);
    }
    const Pair* ai = a + i * a_row;
    float* ci = c + i * ldc + j;
    switch (m - i) {
      case 1: tile<1>(fast, count, ai, a_row, a_pair, b + j, ldb, ci, ldc, add); break;
      case 2: tile<2>(fast, count, ai, a_row, a_pair, b + j, ldb, ci, ldc, add); break;
      case 3: tile<3>(fast, count, ai, a_row, a_pair, b + j, ldb, ci, ldc, add); break;
      case 4: tile<4>(fast, count, ai, a_row, a_pair, b + j, ldb, ci, ldc, add); break;
      case 5: tile<5>(fast, count, ai, a_row, a_pair, b + j, ldb, ci, ldc, add); break;
      case 6: tile<6>(fast, count, ai, a_row, a_pair, b + j, ldb, ci, ldc, add); break;
      case 7: tile<7>(fast, count, ai, a_row, a_pair, b + j, ldb, ci, ldc, add); break;
      default: break;
    }
  }
}

// Packing. `clean` writes 0 for a non-finite entry: where a product pairs a zero weight with a
// neighbour's NaN or infinity, 0 * NaN would otherwise reach a result the neighbour has no part in.

// Asks for row j + 8 of the `rows` rows of x, `cols` entries each, which lie `ld` entries apart
// (every cache line of it), unless the rows are contiguous. A module's heads have rows far apart
// (the other heads of the token between them): the hardware prefetchers, which stop at a page's
// end, would leave each row a miss to memory.
template <typename T>
inline void prefetch_row(const T* x, int64_t j, int64_t rows, int64_t cols, int64_t ld) {
  constexpr int64_t kAhead = 8;
  if (ld == cols || j + kAhead >= rows) return;  // contiguous rows: the prefetchers stream them
  const char* row = reinterpret_cast<const char*>(x + (j + kAhead) * ld);
  const int64_t bytes = cols * static_cast<int64_t>(sizeof(T));
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(row + offset);
}

// B2 of x^T, x (rows x cols, row stride ld, cols even): out(p, j) = (x[j][2p], x[j][2p + 1]) for
// p < cols / 2, j < rows; columns rows .. ldb - 1 are 0.
inline void pack_transposed(const Bf16* x, int64_t rows, int64_t cols, int64_t ld, Pair* out,
                            int64_t ldb) {
  for (int64_t j = 0; j < rows; ++j) {  // each row of x read once, its pairs already adjacent
    prefetch_row(x, j, rows, cols, ld);
    const Bf16* row = x + j * ld;
    for (int64_t p = 0; p < cols / 2; ++p) {
      Pair word;
      std::memcpy(&word, row + 2 * p, sizeof word);
      out[p * ldb + j] = word;
    }
  }
  for (int64_t p = 0; p < cols / 2; ++p) std::fill(out + p * ldb + rows, out + (p + 1) * ldb, 0);
}

// B2 of x (rows x cols, row stride ld, T bf16 bits or float): out(p, c) = (x[2p][c], x[2p + 1][c]);
// a missing last row and columns cols .. ldb - 1 are 0. ceil(rows / 2) rows of pairs.
template <typename T>
inline void pack_row_pairs(const T* x, int64_t rows, int64_t cols, int64_t ld, Pair* out,
                           int64_t ldb, bool clean) {
  for (int64_t p = 0; 2 * p < rows; ++p) {
    prefetch_row(x, 2 * p, rows, cols, ld);
    prefetch_row(x, 2 * p + 1, rows, cols, ld);
    Pair* o = out + p * ldb;
    const T* top = x + 2 * p * ld;
    const T* bottom = 2 * p + 1 < rows ? top + ld : nullptr;
    int64_t c = 0;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, float>) {  // the backward's P and dS: 16 pairs at a time
      for (; bottom && !clean && c + 16 <= cols; c += 16) {
        const __m256i low = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(top + c));
        const __m256i high = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(bottom + c));
        const __m512i words = _mm512_or_si512(_mm512_cvtepu16_epi32(low),
                                              _mm512_slli_epi32(_mm512_cvtepu16_epi32(high), 16));
        _mm512_storeu_si512(o + c, words);
      }
    }
#endif
    for (; c < cols; ++c) {
      Bf16 low = bits_of(top[c]), high = bottom ? bits_of(bottom[c]) : 0;
      if (clean) {
        low = finite(low) ? low : 0;
        high = finite(high) ? high : 0;
      }
      o[c] = pair(low, high);
    }
    for (int64_t c = cols; c < ldb; ++c) o[c] = 0;
  }
}

// x[0 .. n) rounded to bf16 (to nearest even) into out.
inline void round_row(const float* x, int64_t n, Bf16* out) {
  int64_t j = 0;
#if defined(__AVX512BF16__)
  for (; j + 16 <= n; j += 16) {  // one instruction for what takes eight below
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + j));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), (__m256i)rounded);
  }
#endif
#pragma omp simd
  for (int64_t i = j; i < n; ++i) out[i] = round(x[i]);
}

}  // namespace pairs
