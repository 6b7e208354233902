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
// the GEMMs are that much less bound by the loop. (Passes of 16, an accumulator a row,
// made a trunk's GEMMs of 16 rows slower than two passes of 8 over each block.) AVX2's 16
// registers hold four rows.
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
  const int32_t* qi = reinterpret_cast<const int32_t*>(q);  // a row's 4-byte groups
  for (int64_t b = b0; b < b1; b++) {
    const int8_t* wb = w + b * 16 * K4;
    __m512i acc[U][R];
#pragma GCC unroll 16
    for (int u = 0; u < U; u++)
#pragma GCC unroll 16
      for (int r = 0; r < R; r++) acc[u][r] = _mm512_setzero_si512();
    int64_t t = 0;
    for (; t < Tu; t += U) {
#pragma GCC unroll 4
      for (int u = 0; u < U; u++) {
        prefetch(wb + 64 * (t + u));
        const __m512i wv = _mm512_loadu_si512((const void*)(wb + 64 * (t + u)));
#pragma GCC unroll 16
        for (int r = 0; r < R; r++)
          acc[u][r] = _mm512_dpbusd_epi32(acc[u][r], _mm512_set1_epi32(qi[r * T + t + u]), wv);
      }
    }
    for (; t < T; t++) {
      const __m512i wv = _mm512_loadu_si512((const void*)(wb + 64 * t));
#pragma GCC unroll 16
      for (int r = 0; r < R; r++)
        acc[0][r] = _mm512_dpbusd_epi32(acc[0][r], _mm512_set1_epi32(qi[r * T + t]), wv);
    }
    const __m512 sv = _mm512_loadu_ps(s + 16 * b);
    const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512((const void*)(colsum + 16 * b)), 7);
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
      __m512i a = acc[0][r];
      for (int u = 1; u < U; u++) a = _mm512_add_epi32(a, acc[u][r]);
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

// `rows` quantized rows against column blocks [c0, c1) in passes of up to kPass rows. Under
// VNNI, where one pass cannot take them all, block by block: the passes after the first
// find a block's codes in L1, where passes over a whole claimed range (often megabytes:
// team.h claims a quarter of a share at first) streamed the codes from memory once a pass,
// with the arithmetic waiting on it (a trunk's GEMMs of several W8A16 rows took about a
// fifth less time block by block). AVX2's loop is bound by its arithmetic: there block by
// block measured slightly slower.
inline void a8_gemm_rows(const int8_t* q, const float* xs, int64_t rows, int64_t K4,
                         const int8_t* w, const float* s, const int32_t* colsum, float* y,
                         int64_t N16, int64_t c0, int64_t c1) {
  const int64_t step = MTPKIT_VNNI && rows > kPass ? 1 : c1 - c0;
  for (int64_t p0 = c0; p0 < c1; p0 += step) {
    const int64_t p1 = std::min(c1, p0 + step);
    mtpkit_simd::over_rows<kPass>(rows, [&](auto R, int64_t m) {
      a8_rows<R.value>(q + m * K4, xs + m, K4, w, s, colsum, y + m * N16, N16, p0, p1);
    });
  }
}

}  // namespace mtpkit_a8
#endif
