// The tiled kernel's dropout of the attention weights, without a mask in memory: whether the weight
// of row `row_id` ((batch * h + head) * t + i) on key j is kept is a hash of the call's seed, the
// row and the key, so the backward draws the forward's mask again. The hash is dropout.py's, bit
// for bit (MurmurHash3's 32-bit finaliser, twice); the tests compare the two.

#pragma once

#include <cmath>
#include <cstdint>

namespace {

inline uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  return x ^ (x >> 16);
}

struct Dropout {
  uint32_t seed = 0;
  uint32_t threshold = 0;  // a weight whose hash is below it is dropped; 0: no dropout
  float scale = 1.f;       // 1 / (1 - p): what the kept weights are multiplied by

  bool active() const { return threshold != 0; }

  uint32_t row(int64_t row_id) const {
    return fmix32(seed ^ (static_cast<uint32_t>(row_id) * 0x9E3779B1u));
  }

  // The dropped weights of a row over the keys [j0, j0 + n) set to 0 (a float32 or a bf16 row:
  // 0 is all zero bits in both), the kept ones left as they are.
  template <typename T>
  void drop(T* weights, int64_t n, uint32_t row_hash, int64_t j0) const {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t hash = fmix32(row_hash ^ (static_cast<uint32_t>(j0 + j) * 0x85EBCA77u));
      weights[j] = hash < threshold ? T(0) : weights[j];
    }
  }

  // The row's factors over the keys [j0, j0 + n): `scale` where kept, 0 where dropped.
  void factors(float* out, int64_t n, uint32_t row_hash, int64_t j0) const {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t hash = fmix32(row_hash ^ (static_cast<uint32_t>(j0 + j) * 0x85EBCA77u));
      out[j] = hash < threshold ? 0.f : scale;
    }
  }

  // `out` = `weights` times the row's factors: `scale` where kept, 0 where dropped.
  void scaled(const float* weights, float* out, int64_t n, uint32_t row_hash, int64_t j0) const {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t hash = fmix32(row_hash ^ (static_cast<uint32_t>(j0 + j) * 0x85EBCA77u));
      out[j] = hash < threshold ? 0.f : weights[j] * scale;
    }
  }
};

// A call's dropout from its probability and seed (the seed's low 32 bits).
inline Dropout dropout_of(double p, int64_t seed) {
  Dropout d;
  if (p <= 0.0) return d;
  const double threshold = p * 4294967296.0;  // p * 2^32, rounded as dropout.py rounds it
  d.seed = static_cast<uint32_t>(seed);
  d.threshold = threshold >= 4294967295.0 ? 4294967295u
                                          : static_cast<uint32_t>(std::nearbyint(threshold));
  d.scale = static_cast<float>(1.0 / (1.0 - p));
  return d;
}

}  // namespace
