// exp(x) for x <= 0 in a form the compiler vectorises, for the kernels built with -ffast-math
// (decode.cpp, sparse.cpp): there (y + c) - c may fold into y, so it rounds with nearbyint.
// tiled_simd.h keeps the form for tiled.cpp, built without -ffast-math.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

// exp(x) for x <= 0 that the compiler vectorises: 2^n * p(f) with x log2(e) = n + f, |f| <= 1/2 and
// p of degree 6 (relative error below 2e-7); 0 below -87, where float32 would underflow.
inline float exp_nonpositive(float x) {
  const float y = std::max(x, -87.f) * 1.44269504088896341f;
  const float n = std::nearbyint(y);
  const float f = y - n;
  float p = 1.5403530393381606e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return x < -87.f ? 0.f : p;
}

}  // namespace
