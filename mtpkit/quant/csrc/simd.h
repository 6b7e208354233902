// Small AVX2 helpers shared by mtpkit's CPU kernels (int8_mm.cpp, attend_rows.cpp).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace mtpkit_simd {

// The sum of a vector's eight lanes, in one fixed order.
inline float hsum(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

}  // namespace mtpkit_simd
#endif
