// Whether every value of some tensors is finite, in one call: the check attnkit's NaN rule makes
// around torch's SDPA on every call (nonfinite.py). A float is not finite exactly when its
// exponent bits are all ones, so the check is the largest of the values' exponent fields, an
// integer maximum that the compiler vectorises; torch's way (a sum, read back into Python) costs a
// dispatch and a tensor per input, which a small call pays on top of its attention.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

// Values per thread's share: below it a check runs on the calling thread (at::parallel_for's
// grain), so a small call starts no other thread.
constexpr int64_t kFiniteGrain = int64_t{1} << 16;

// The largest exponent field of n values stored as the unsigned integers `bits` (the values' own
// bits: a float32 as uint32_t, a bf16 or a float16 as uint16_t, a float64 as uint64_t).
template <typename Bits>
Bits largest_exponent(const Bits* bits, int64_t n, Bits exponent) {
  Bits largest = 0;
#pragma omp simd reduction(max : largest)
  for (int64_t i = 0; i < n; ++i) {
    const Bits field = bits[i] & exponent;
    largest = field > largest ? field : largest;
  }
  return largest;
}

template <typename Bits>
bool finite_bits(const at::Tensor& x, Bits exponent) {
  const Bits* bits = static_cast<const Bits*>(x.const_data_ptr());
  std::atomic<bool> finite{true};
  at::parallel_for(0, x.numel(), kFiniteGrain, [&](int64_t begin, int64_t end) {
    if (largest_exponent(bits + begin, end - begin, exponent) == exponent) {
      finite.store(false, std::memory_order_relaxed);
    }
  });
  return finite.load();
}

// Whether the check reads `x` whole: a dense CPU tensor of float32, float64, bf16 or float16, its
// values the `numel` elements from its data pointer in some order (contiguous, or a permutation of
// a contiguous layout such as a transposed (b, t, h, d) view), not a sparse tensor nor torch's
// ZeroTensor (which has no memory), nor a nested tensor (whose parts may leave gaps).
bool reads_whole(const at::Tensor& x) {
  const auto type = x.scalar_type();
  return x.layout() == at::kStrided && x.is_cpu() && !x.is_nested() && !x._is_zerotensor() &&
         x.has_storage() &&
         (type == at::kFloat || type == at::kDouble || type == at::kBFloat16 ||
          type == at::kHalf) &&
         x.is_non_overlapping_and_dense() && (x.numel() == 0 || x.const_data_ptr() != nullptr);
}

// Whether every value of each tensor is finite; nullopt, before reading any, where one tensor is
// not one it reads whole (`reads_whole`): the caller checks them otherwise.
std::optional<bool> all_finite(const std::vector<at::Tensor>& tensors) {
  for (const at::Tensor& x : tensors) {
    if (!reads_whole(x)) return std::nullopt;
  }
  for (const at::Tensor& x : tensors) {
    bool finite = true;
    switch (x.scalar_type()) {
      case at::kFloat:
        finite = finite_bits<uint32_t>(x, 0x7F800000u);
        break;
      case at::kDouble:
        finite = finite_bits<uint64_t>(x, 0x7FF0000000000000ull);
        break;
      case at::kBFloat16:
        finite = finite_bits<uint16_t>(x, uint16_t{0x7F80});
        break;
      case at::kHalf:
        finite = finite_bits<uint16_t>(x, uint16_t{0x7C00});
        break;
      default:  // not a type reads_whole lets through
        TORCH_CHECK(false, "all_finite: unexpected dtype ", x.scalar_type());
    }
    if (!finite) return false;
  }
  return true;
}

}  // namespace
