// Small float32 matrix products for the linear kernel: row-major C = alpha op(A) op(B) + beta C on
// one thread, the shapes of a chunk (64 tokens by a head of 64 to 256).
//
// Why BLAS through its Fortran symbol: torch's CPU builds for x86 carry MKL, whose sgemm is the
// fastest small product at hand, and at::native::cpublas::gemm for float is not exported to
// extensions. Called from a thread of at::parallel_for it runs on that thread alone. The symbol is
// weak: where a torch carries no sgemm_, the portable loop below gives the same sums, slower.
//
// bf16 products: where the caller asks (bf16 inputs, in a build with AVX512-BF16), both operands are
// rounded to bf16, packed in pairs along the sum and multiplied by vdpbf16ps with float32 sums
// (pair_products.h, the tiled kernel's products): twice the multiply-adds of an fp32 instruction.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "pair_products.h"

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));

namespace gemm {

// out(p, i) = (x[i][2p], x[i][2p + 1]) rounded to bf16, for the rows i < rows of x (cols each, row
// stride ld; a missing last entry 0); columns rows .. ld_out - 1 of out are 0.
inline void pack_along_rows(const float* x, int64_t rows, int64_t cols, int64_t ld,
                            pairs::Pair* out, int64_t ld_out) {
  const int64_t count = (cols + 1) / 2;
  thread_local std::vector<pairs::Pair> words;
  words.resize(count);
  auto* rounded = reinterpret_cast<pairs::Bf16*>(words.data());
  for (int64_t i = 0; i < rows; ++i) {  // a row rounded at once, then its words stored apart
    pairs::round_row(x + i * ld, cols, rounded);
    if (cols % 2) rounded[cols] = 0;
    for (int64_t p = 0; p < count; ++p) out[p * ld_out + i] = words[p];
  }
  for (int64_t p = 0; p < count; ++p) std::fill(out + p * ld_out + rows, out + (p + 1) * ld_out, 0);
}

// mm's product in bf16 pairs (see the top of this file), on this thread's buffers.
inline void mm_pairs(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                     const float* a, int64_t lda, const float* b, int64_t ldb, float beta,
                     float* c, int64_t ldc) {
  thread_local std::vector<pairs::Pair> pa, pb;
  thread_local std::vector<float> out;
  const int64_t count = (k + 1) / 2, width = pairs::padded(n);
  pa.resize(count * m);
  pb.resize(count * width);
  out.resize(m * width);
  int64_t a_row = 1, a_pair = m;  // A2(i, p) at pa[p * m + i], or at pa[i * count + p]
  if (ta) {
    pairs::pack_row_pairs(a, k, m, lda, pa.data(), m, false);
  } else {  // A's rows rounded as they lie: their neighbours are the pairs
    a_row = count;
    a_pair = 1;
    for (int64_t i = 0; i < m; ++i) {
      auto* row = reinterpret_cast<pairs::Bf16*>(pa.data() + i * count);
      pairs::round_row(a + i * lda, k, row);
      if (k % 2) row[k] = 0;
    }
  }
  if (tb) {
    pack_along_rows(b, n, k, ldb, pb.data(), width);
  } else {
    pairs::pack_row_pairs(b, k, n, ldb, pb.data(), width, false);
  }
  pairs::gemm(pairs::kHasAvx512Bf16, m, width, count, pa.data(), a_row, a_pair, pb.data(), width,
              out.data(), width, false);
  for (int64_t i = 0; i < m; ++i) {
    float* row = c + i * ldc;
    const float* product = out.data() + i * width;
    for (int64_t j = 0; j < n; ++j) {
      row[j] = alpha * product[j] + (beta == 0.f ? 0.f : beta * row[j]);
    }
  }
}

// C (m, n; row stride ldc) = alpha op(A) op(B) + beta C, op(A) (m, k) and op(B) (k, n); A is
// stored (m, k) with row stride lda, or (k, m) where ta; B (k, n) with row stride ldb, or (n, k)
// where tb. half: the product in bf16 pairs.
inline void mm(bool half, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
               const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
               int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (half && k > 0) return mm_pairs(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (sgemm_ && k > 0) {  // row-major C is column-major C^T = op(B)^T op(A)^T
    const int M = static_cast<int>(n), N = static_cast<int>(m), K = static_cast<int>(k);
    const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
    sgemm_(tb ? "T" : "N", ta ? "T" : "N", &M, &N, &K, &alpha, b, &la, a, &lb, &beta, c, &lc);
    return;
  }
  for (int64_t i = 0; i < m; ++i) {
    float* row = c + i * ldc;
    for (int64_t j = 0; j < n; ++j) row[j] = beta == 0.f ? 0.f : beta * row[j];
    for (int64_t p = 0; p < k; ++p) {
      const float x = alpha * (ta ? a[p * lda + i] : a[i * lda + p]);
      if (tb) {
        for (int64_t j = 0; j < n; ++j) row[j] += x * b[j * ldb + p];
      } else {
        for (int64_t j = 0; j < n; ++j) row[j] += x * b[p * ldb + j];
      }
    }
  }
}

// C = alpha A B + beta C
inline void nn(bool half, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  mm(half, false, false, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// C = alpha A B^T + beta C
inline void nt(bool half, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  mm(half, false, true, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// C = alpha A^T B + beta C
inline void tn(bool half, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  mm(half, true, false, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace gemm
