// The W8A8 kernel's inner loop (int8_a8_mm.cpp's header explains the layout and the
// arithmetic), shared by int8_a8_mm and the fused layer ops (w8a8_block.cpp).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace mtpkit_a8 {

using mtpkit_simd::bcast4;
using mtpkit_simd::prefetch;

// The least column blocks a thread claims at once (team.h) in a GEMM of K4-byte rows: ~16 KB
// of codes, a block holding 16 * K4 bytes.
inline int64_t a8_piece(int64_t K4) {
  return std::max<int64_t>(1, (16384 + 8 * K4) / (16 * K4));
}

// Rows a8_rows takes in one pass at most (over_rows<kPass>). VNNI: eight, their 16
// accumulators in AVX-512's 32 registers, so a 64-byte run loaded once serves twice the rows
// it served at four; in a server's steps of several sequences (W8A16's two int8 rows a row)
// the GEMMs are that much less bound by the loop. AVX2's 16 registers hold four rows.
constexpr int kPass = MTPKIT_VNNI ? 8 : 4;

// R quantized rows (K4 bytes each; q + 128 under VNNI) against column blocks [b0, b1) of 16.
// U accumulators a row, taking runs in turn: one vpdpbusd chain would wait on its latency
// at one row. Not inlined, as in int8_mm.cpp (gcc spills accumulators inside the OpenMP
// region).
#if MTPKIT_VNNI
// A block's 64-byte run in one 512-bit register: one vpdpbusd per run a row.
template <int R>
__attribute__((noinline)) void a8_rows(const int8_t* q, const float* xs, int64_t K4,
                                       const int8_t* w, const float* s, const int32_t* colsum,
                                       float* y, int64_t N16, int64_t b0, int64_t b1) {
  constexpr int U = R == 1 ? 4 : 2;
  const int64_t T = K4 / 4, Tu = T - T % U;
  for (int64_t b = b0; b < b1; b++) {
    const int8_t* wb = w + b * 16 * K4;
    __m512i acc[R][U];
    for (int r = 0; r < R; r++)
      for (int u = 0; u < U; u++) acc[r][u] = _mm512_setzero_si512();
    auto step = [&](int64_t t, int u) {
      const __m512i wv = _mm512_loadu_si512((const void*)(wb + 64 * t));
      for (int r = 0; r < R; r++)
        acc[r][u] = _mm512_dpbusd_epi32(
            acc[r][u], _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(q + r * K4 + 4 * t)), wv);
    };
    for (int64_t t = 0; t < Tu; t += U) {
      for (int u = 0; u < U; u++) prefetch(wb + 64 * (t + u));
      for (int u = 0; u < U; u++) step(t + u, u);
    }
    for (int64_t t = Tu; t < T; t++) step(t, 0);
    const __m512 sv = _mm512_loadu_ps(s + 16 * b);
    const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512((const void*)(colsum + 16 * b)), 7);
    for (int r = 0; r < R; r++) {
      __m512i a = acc[r][0];
      for (int u = 1; u < U; u++) a = _mm512_add_epi32(a, acc[r][u]);
      a = _mm512_sub_epi32(a, off);
      // (float(sum) * xs) * scale, each product rounded as the scalar definition rounds it.
      _mm512_storeu_ps(y + r * N16 + 16 * b,
                       _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(xs[r])), sv));
    }
  }
}
#else
// AVX2: a run as two 256-bit halves (8 columns each) against one broadcast; |w| (-128 reads
// as 128) times x with w's sign moved onto it, pairs of products below 2 * 128 * 127 < 2^15,
// so vpmaddubsw never saturates.
template <int R>
__attribute__((noinline)) void a8_rows(const int8_t* q, const float* xs, int64_t K4,
                                       const int8_t* w, const float* s, const int32_t* colsum,
                                       float* y, int64_t N16, int64_t b0, int64_t b1) {
  const int64_t T = K4 / 4;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = b0; b < b1; b++) {
    const int8_t* wb = w + b * 16 * K4;
    __m256i acc[R][2];
    for (int r = 0; r < R; r++)
      for (int h = 0; h < 2; h++) acc[r][h] = _mm256_setzero_si256();
    for (int64_t t = 0; t < T; t++) {
      prefetch(wb + 64 * t);
      __m256i wv[2], aw[2];
      for (int h = 0; h < 2; h++) {
        wv[h] = _mm256_loadu_si256((const __m256i*)(wb + 64 * t + 32 * h));
        aw[h] = _mm256_abs_epi8(wv[h]);
      }
      for (int r = 0; r < R; r++) {
        const __m256i xb = bcast4(q + r * K4 + 4 * t);
        for (int h = 0; h < 2; h++) {
          const __m256i p = _mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(xb, wv[h]));
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(p, ones));
        }
      }
    }
    for (int r = 0; r < R; r++)
      for (int h = 0; h < 2; h++)
        _mm256_storeu_ps(y + r * N16 + 16 * b + 8 * h,
                         _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_set1_ps(xs[r])),
                                       _mm256_loadu_ps(s + 16 * b + 8 * h)));
  }
  (void)colsum;
}
#endif

}  // namespace mtpkit_a8
#endif
