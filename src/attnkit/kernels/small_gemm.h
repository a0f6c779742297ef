// Small float32 matrix products for the linear kernel: row-major C = alpha op(A) op(B) + beta C on
// one thread, the shapes of a chunk (64 tokens by a head of 64 to 256).
//
// Why BLAS through its Fortran symbol: torch's CPU builds for x86 carry MKL, whose sgemm is the
// fastest small product at hand, and at::native::cpublas::gemm for float is not exported to
// extensions. Called from a thread of at::parallel_for it runs on that thread alone. The symbol is
// weak: where a torch carries no sgemm_, the portable loop below gives the same sums, slower.
#pragma once

#include <cstdint>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc) __attribute__((weak));

namespace gemm {

// C (m, n; row stride ldc) = alpha op(A) op(B) + beta C, op(A) (m, k) and op(B) (k, n); A is
// stored (m, k) with row stride lda, or (k, m) where ta; B (k, n) with row stride ldb, or (n, k)
// where tb.
inline void mm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
               int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
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
inline void nn(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  mm(false, false, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// C = alpha A B^T + beta C
inline void nt(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  mm(false, true, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// C = alpha A^T B + beta C
inline void tn(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
               const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  mm(true, false, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace gemm
