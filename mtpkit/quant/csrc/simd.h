// Small AVX2 helpers shared by mtpkit's CPU kernels (int8_mm.cpp, int8_a8.h and int8_a8_mm.cpp,
// w8a8_block.cpp, int4_a8_mm.cpp, attend_rows.cpp).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <ATen/Parallel.h>

#include "team.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

// Built with AVX-512 VNNI (kernels.py, on hosts that have it): the W8A8 and W4A8 kernels'
// 512-bit vpdpbusd forms.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define MTPKIT_VNNI 1
#else
#define MTPKIT_VNNI 0
#endif

namespace mtpkit_simd {

// The sum of a vector's eight lanes, in one fixed order.
inline float hsum(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

// The sum of eight int32 lanes (exact, so any order).
inline int32_t hsum_i32(__m256i a) {
  __m128i v = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
  v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(v);
}

// 4 int8 activations of a row, the same in every 32-bit lane (one lane per output column of
// a block of 8): a broadcast load, which takes no vector ALU slot (set1 from a register took
// two).
inline __m256i bcast4(const int8_t* x) {
  return _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(x)));
}

// Codes are read once per step, straight from memory; the hardware prefetcher alone leaves
// one thread short of the memory's speed, and a software prefetch ahead of the reads closes
// much of that gap. 16 KB ahead beat 4 KB (most at four rows, where the kernel's arithmetic
// leaves less slack to cover the latency); 32 KB was no better. Addresses past the weight's
// end are harmless (a prefetch never faults).
// The hint is T1: Zen 4 is the first AMD core to fill only L2 for T1/T2 (Zen 3 and older
// fill L1 for every hint, so there T1 is T0 under another name; Intel fills L2 for T1 too).
// On Zen 4, T0 made a four-row pass pay its arithmetic on top of its memory time, as if the
// two could not overlap; with T1 four rows stream in about a one-row pass's time, so a
// verification of 4 rows costs about what a decode step does (docs/benchmarks.md).
constexpr uintptr_t kAhead = 16384;
inline void prefetch(const int8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kAhead), _MM_HINT_T1);
}

// max_k |x[k]| of a row of K floats (exact: any order gives the same maximum).
inline float row_amax(const float* x, int64_t K) {
  const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const int64_t Kv = K - K % 8;
  __m256 vmax = _mm256_setzero_ps();
  int64_t k0 = 0;
#if MTPKIT_VNNI
  // Four 16-lane maxima in turn where AVX-512 is built in: one chain of maxima waited on its
  // latency every 8 floats, and a W8A16 GEMM quantizes each row twice.
  {
    __m512 m[4];
    for (int j = 0; j < 4; j++) m[j] = _mm512_setzero_ps();
    for (; k0 + 64 <= K; k0 += 64)
      for (int j = 0; j < 4; j++)
        m[j] = _mm512_max_ps(m[j], _mm512_abs_ps(_mm512_loadu_ps(x + k0 + 16 * j)));
    for (; k0 + 16 <= K; k0 += 16)
      m[0] = _mm512_max_ps(m[0], _mm512_abs_ps(_mm512_loadu_ps(x + k0)));
    const __m512 m01 = _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]));
    vmax = _mm256_max_ps(_mm512_castps512_ps256(m01),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(m01), 1)));
  }
#endif
  for (int64_t k = k0; k < Kv; k += 8)
    vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + k), no_sign));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
  for (int64_t k = Kv; k < K; k++) amax = std::max(amax, std::fabs(x[k]));
  return amax;
}

// Row-wise dynamic quantization (int8_mm.cpp's header): division and rounding as torch does them
// (IEEE division, round half to even), eight lanes at a time.
// Row m goes to q + m * ld; flip = 0x80 stores q + 128 as unsigned bytes (vpdpbusd's operand).
inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* xs,
                          int64_t ld = -1, uint8_t flip = 0) {
  if (ld < 0) ld = K;
  const __m128i vflip = _mm_set1_epi8(int8_t(flip));
  const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  const int64_t Kv = K - K % 8;
  for (int64_t m = 0; m < M; m++) {
    const float* xm = x + m * K;
    int8_t* qm = q + m * ld;
    const float amax = row_amax(xm, K);
    const float sc = amax / 127.f;
    xs[m] = sc;
    if (!(sc > 0.f)) {
      std::fill(qm, qm + K, int8_t(flip));
      continue;
    }
    const __m256 vs = _mm256_set1_ps(sc);
    int64_t k0 = 0;
#if MTPKIT_VNNI
    // Sixteen lanes a division where AVX-512 is built in: the divisions dominate this pass
    // (a verification of 4 rows quantizes ~13,000 activations a layer on each thread), and
    // the lane width does not change an elementwise result; sixteen lanes measured faster
    // than eight for decoding and verification alike.
    {
      const __m512 vs16 = _mm512_set1_ps(sc), hi16 = _mm512_set1_ps(127.f),
                   lo16 = _mm512_set1_ps(-127.f);
      for (; k0 + 16 <= K; k0 += 16) {
        const __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(xm + k0), vs16),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i i = _mm512_cvtps_epi32(_mm512_min_ps(hi16, _mm512_max_ps(lo16, v)));
        _mm_storeu_si128((__m128i*)(qm + k0), _mm_xor_si128(_mm512_cvtsepi32_epi8(i), vflip));
      }
    }
#endif
    for (int64_t k = k0; k + 8 <= K; k += 8) {
      __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xm + k), vs),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i i = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
      _mm_storel_epi64((__m128i*)(qm + k), _mm_xor_si128(_mm_packs_epi16(w, w), vflip));
    }
    for (int64_t k = Kv; k < K; k++) {  // k0 <= Kv: a multiple of 16 at most K
      const float v = std::nearbyint(xm[k] / sc);
      qm[k] = int8_t(uint8_t(int8_t(std::min(127.f, std::max(-127.f, v)))) ^ flip);
    }
  }
}

// f(std::integral_constant<int, R>{}, m) for the rest of the rows, n of them (R <= n < Wide).
template <int R, int Wide, class F>
inline void rest_rows(int64_t n, int64_t m, const F& f) {
  if constexpr (R < Wide) {
    if (n == R)
      f(std::integral_constant<int, R>{}, m);
    else
      rest_rows<R + 1, Wide>(n, m, f);
  }
}

// Rows [0, M) in passes over the weights: f(std::integral_constant<int, R>{}, m) for rows
// [m, m + R), Wide at a time (a kernel that holds that many rows' accumulators), then the
// rest in one pass, so that the weights stream once per Wide rows (three rows as 2 + 1
// would stream the codes twice, which costs about half as much again). Each kernel computes
// a row the same whatever pass it is in.
template <int Wide = 4, class F>
inline void over_rows(int64_t M, const F& f) {
  int64_t m = 0;
  for (; m + Wide <= M; m += Wide) f(std::integral_constant<int, Wide>{}, m);
  if (M > m) rest_rows<1, Wide>(M - m, m, f);
}

// Threads split the output columns [0, N) in blocks of B (a kernel's column block) and call
// f(n0, n1) on their share, at least 32 columns a thread; a column's arithmetic is
// independent of which thread computes it.
template <int B = 8, class F>
inline void over_columns(int64_t N, const F& f) {
  mtpkit_team::parallel_for(0, (N + B - 1) / B, 32 / B,
                   [&](int64_t b, int64_t e) { f(B * b, std::min(N, B * e)); });
}

}  // namespace mtpkit_simd
#endif
