// mtpkit::int8_mm(x, codes, scale) -> y:  y[m, n] = scale[n] * sum_k x[m, k] * codes[n, k]
// x float32 [M, K] (contiguous), codes int8 [N, K] (contiguous), scale float32 [N].
//
// Why by hand: torch's CPU int8 kernel (_weight_int8pack_mm) takes bf16 activations and
// runs at ~4.2 G codes/s on this machine's 2 AVX2 cores at two rows (weights streamed from
// memory); its fp32 path is ~10x slower, and inductor's generated dequantize-and-reduce
// loops reach 0.3-1 GB/s. This loop widens each group of 8 codes to fp32 once and feeds it
// to an FMA per row (~6.4 G codes/s at two rows, docs/quantization.md), with fp32
// activations, so it is also more exact.
//
// Exactness: every output is accumulated in the same order whatever the number of rows,
// the row's position in the batch, the thread split or the columns around it (rows are
// taken two at a time, and the one-row kernel does per row what the two-row kernel does).
// Greedy speculative decoding relies on this: a verified row must equal the one-token step.
//
// mtpkit::int8_a8_mm(x, codes, scale) -> y: the W8A8 scheme (compressed-tensors int8 weights
// with dynamic per-token int8 activations, as vLLM runs it). Each row of x is quantized on
// its own, xs[m] = max_k |x[m, k]| / 127, q[m, k] = round_half_even(x[m, k] / xs[m]), and
//   y[m, n] = (float(sum_k q[m, k] * codes[n, k]) * xs[m]) * scale[n]
// The sum is an exact int32 (|q| <= 127, |codes| <= 128, K < 2^17), so it does not depend on
// order, rows or threads at all. Why by hand: torch has no CPU int8 x int8 kernel for a few
// rows that is fast here (torch._int_mm is the reference); vpmaddubsw multiplies 32 code
// pairs per instruction where the fp32 kernel above converts and multiplies 8.
//
// mtpkit::int4_a8_mm(x, packed, scale, zero, group) -> y: W4A8, int4 weights in groups of
// `group` input columns (a multiple of 32) with int8 activations quantized per row as above.
// A weight is w[n, k] = scale[n, g] * (u[n, k] - zu[n, g]) with u in [0, 15] (the signed
// code + 8) and zu the zero point + 8 (8 for symmetric weights: `zero` empty). Then
//   y[m, n] = (sum_g scale[n, g] * float(sum_{k in g} u[n, k] q[m, k])
//              + sum_g (-scale[n, g] * zu[n, g]) * float(sum_{k in g} q[m, k])) * xs[m]
// with both integer sums exact; the float sums run in one fixed order per output, so a row's
// result is the same bits whatever rows, threads or columns come with it. `packed` uint8
// [N, K / 2]: a row's codes in blocks of 32, each pair of blocks as 32 bytes, byte j holding
// the first block's u[j] (low nibble) and the second's (high); an odd last block as 16
// bytes, u[j] and u[j + 16]. `group` 32 or a multiple of 64; `scale` float16 or float32
// [N, G]; `zero` int8 [N, G] or empty. Why by hand: half
// the bytes of int8 codes a step; torch's int4 CPU kernel takes bf16 activations and
// widens codes to floats (docs/quantization.md), and vpmaddubsw takes the unsigned nibbles
// as they are, 32 products per instruction.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "simd.h"

namespace {

using mtpkit_simd::hsum;

// Codes are read once per step, straight from memory; the hardware prefetcher alone leaves
// one thread at ~9 GB/s here, prefetching this far ahead at ~11.5 (streaming a 28 MB weight,
// one row). Addresses past the weight's end are harmless (a prefetch never faults).
constexpr uintptr_t kAhead = 4096;
inline void prefetch(const int8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kAhead), _MM_HINT_T0);
}

inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// R rows of x against output columns [n0, n1), 16 codes per step; two accumulators per
// row break the FMA dependency chain. Not inlined: inlined into the OpenMP region, gcc 12
// spills an accumulator to the stack inside the loop (5.5 instead of 8.3 G codes/s).
template <int R>
__attribute__((noinline)) void rows_kernel(const float* x, int64_t K, const int8_t* w,
                                           const float* s, float* y, int64_t N, int64_t n0,
                                           int64_t n1) {
  const int64_t Kv = K - K % 16;
  for (int64_t n = n0; n < n1; n++) {
    const int8_t* wn = w + n * K;
    __m256 a[R][2];
    for (int r = 0; r < R; r++)
      for (int j = 0; j < 2; j++) a[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < Kv; k += 16) {
      if ((k & 63) == 0) prefetch(wn + k);
      for (int j = 0; j < 2; j++) {
        const __m256 f = widen8(wn + k + 8 * j);
        for (int r = 0; r < R; r++)
          a[r][j] = _mm256_fmadd_ps(f, _mm256_loadu_ps(x + r * K + k + 8 * j), a[r][j]);
      }
    }
    for (int r = 0; r < R; r++) {
      float acc = hsum(_mm256_add_ps(a[r][0], a[r][1]));
      for (int64_t k = Kv; k < K; k++) acc = std::fma(float(wn[k]), x[r * K + k], acc);
      y[r * N + n] = acc * s[n];
    }
  }
}


// Row-wise dynamic quantization (see the header): division and rounding as torch does them
// (IEEE division, round half to even), eight lanes at a time.
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* xs) {
  const __m256 no_sign = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  const int64_t Kv = K - K % 8;
  for (int64_t m = 0; m < M; m++) {
    const float* xm = x + m * K;
    int8_t* qm = q + m * K;
    __m256 vmax = _mm256_setzero_ps();
    for (int64_t k = 0; k < Kv; k += 8)
      vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(xm + k), no_sign));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
    for (int64_t k = Kv; k < K; k++) amax = std::max(amax, std::fabs(xm[k]));
    const float sc = amax / 127.f;
    xs[m] = sc;
    if (!(sc > 0.f)) {
      std::fill(qm, qm + K, int8_t(0));
      continue;
    }
    const __m256 vs = _mm256_set1_ps(sc);
    for (int64_t k = 0; k < Kv; k += 8) {
      __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xm + k), vs),
                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i i = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
      const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
      _mm_storel_epi64((__m128i*)(qm + k), _mm_packs_epi16(w, w));
    }
    for (int64_t k = Kv; k < K; k++) {
      const float v = std::nearbyint(xm[k] / sc);
      qm[k] = (int8_t)std::min(127.f, std::max(-127.f, v));
    }
  }
}

// R quantized rows against columns [n0, n1), 32 codes per step. vpmaddubsw wants one
// unsigned operand: |w| (-128 reads as 128) times x with w's sign moved onto it; pairs of
// products stay below 2 * 128 * 127 < 2^15, so the int16 step never saturates.
template <int R>
__attribute__((noinline)) void a8_rows(const int8_t* q, const float* xs, int64_t K,
                                       const int8_t* w, const float* s, float* y, int64_t N,
                                       int64_t n0, int64_t n1) {
  const int64_t Kv = K - K % 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; n++) {
    const int8_t* wn = w + n * K;
    __m256i a[R];
    for (int r = 0; r < R; r++) a[r] = _mm256_setzero_si256();
    for (int64_t k = 0; k < Kv; k += 32) {
      if ((k & 63) == 0) prefetch(wn + k);
      const __m256i wv = _mm256_loadu_si256((const __m256i*)(wn + k));
      const __m256i aw = _mm256_abs_epi8(wv);
      for (int r = 0; r < R; r++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(q + r * K + k));
        const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv));
        a[r] = _mm256_add_epi32(a[r], _mm256_madd_epi16(p, ones));
      }
    }
    for (int r = 0; r < R; r++) {
      __m128i v = _mm_add_epi32(_mm256_castsi256_si128(a[r]), _mm256_extracti128_si256(a[r], 1));
      v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
      v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
      int32_t acc = _mm_cvtsi128_si32(v);
      for (int64_t k = Kv; k < K; k++) acc += int32_t(q[r * K + k]) * int32_t(wn[k]);
      y[r * N + n] = (float(acc) * xs[r]) * s[n];
    }
  }
}

// Per row and group: the sum of the row's quantized values (the zero-point term's factor),
// rows Gp = G rounded up to 8 long, zero past G.
void group_sums(const int8_t* q, int64_t M, int64_t K, int64_t group, float* gs) {
  const int64_t G = K / group, Gp = (G + 7) & ~int64_t(7);
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t m = 0; m < M; m++) {
    for (int64_t g = 0; g < G; g++) {
      __m256i a = _mm256_setzero_si256();
      for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(q + m * K + k));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, xv), ones16));
      }
      __m128i v = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
      v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
      v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
      gs[m * Gp + g] = float(_mm_cvtsi128_si32(v));
    }
    std::fill(gs + m * Gp + G, gs + (m + 1) * Gp, 0.f);
  }
}

// 32 packed bytes -> two blocks of 32 codes: the low nibbles are the first, the high ones
// the second (one AND, one shift and one AND for 64 codes).
inline void unpack64(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  const __m256i v = _mm256_loadu_si256((const __m256i*)p);
  lo = _mm256_and_si256(v, m);
  hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
}

// A row's odd last block: 16 bytes, u[j] in byte j's low nibble and u[j + 16] in its high.
inline __m256i unpack32(const uint8_t* p) {
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p));
  const __m256i both = _mm256_blend_epi32(b, _mm256_srli_epi16(b, 4), 0xF0);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

inline __m256i dot32(__m256i u, const int8_t* x) {
  const __m256i ones = _mm256_set1_epi16(1);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i*)x)), ones);
}

inline __m256 load8(const at::Half* s) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s));
}
inline __m256 load8(const float* s) { return _mm256_loadu_ps(s); }

// A column's scales as floats (sf) and zero-point offsets of = -scale * zu, Gp = G rounded
// up to 8 long, eight groups at a time. Lanes past G hold the next column's values, which
// the zero group sums there cancel (of is masked, so even a non-finite one cannot leak);
// only the matrix's last column, with nothing after it, takes the scalar loop.
template <class S>
inline void column_tables(const S* s, const int8_t* z, int64_t G, int64_t Gp, bool last,
                          float* sf, float* of) {
  const int64_t Gv = last ? G - G % 8 : Gp;
  int64_t g = 0;
  for (; g < Gv; g += 8) {
    const __m256 sv = load8(s + g);
    const __m256 zu = z ? _mm256_cvtepi32_ps(_mm256_add_epi32(
                              _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(z + g))),
                              _mm256_set1_epi32(8)))
                        : _mm256_set1_ps(8.f);
    __m256 ov = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), sv), zu);
    if (g + 8 > G) {
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(int(G - g)), lane);
      ov = _mm256_and_ps(ov, _mm256_castsi256_ps(keep));
    }
    _mm256_storeu_ps(sf + g, sv);
    _mm256_storeu_ps(of + g, ov);
  }
  for (; g < G; g++) {
    sf[g] = float(s[g]);
    of[g] = -sf[g] * float(z ? z[g] + 8 : 8);
  }
  for (; g < Gp; g++) sf[g] = of[g] = 0.f;
}

// R quantized rows against columns [n0, n1). Per column: its tables, then the zero-point
// term opens the accumulators (an 8-lane dot of offsets and group sums), then every group's
// exact integer sum times its scale. Even and odd groups go to two accumulators: one chain
// of FMAs (4 cycles each) bounded the loop. GROUP 32: 32 packed bytes hold two groups; 64:
// one, whose two blocks' product pairs add in int16 before widening; 0: any multiple of 64.
template <int R, int GROUP, class S>
__attribute__((noinline)) void a4_rows(const int8_t* q, const float* xs, const float* gs,
                                       int64_t K, int64_t group, const uint8_t* w, const S* s,
                                       const int8_t* z, float* y, int64_t N, int64_t n0,
                                       int64_t n1) {
  const int64_t G = K / group, Gp = (G + 7) & ~int64_t(7);
  thread_local std::vector<float> tables;
  tables.resize(2 * Gp);
  float* sf = tables.data();
  float* of = sf + Gp;
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* wn = w + n * (K / 2);
    column_tables(s + n * G, z ? z + n * G : nullptr, G, Gp, n == N - 1, sf, of);
    __m256 acc[R][2];
    for (int r = 0; r < R; r++) {
      acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t g = 0; g < Gp; g += 8)
        acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(of + g), _mm256_loadu_ps(gs + r * Gp + g),
                                    acc[r][0]);
    }
    __m256i lo, hi;
    if (GROUP == 32) {
      int64_t g = 0;
      for (; g + 2 <= G; g += 2) {
        if ((g & 3) == 0) prefetch(reinterpret_cast<const int8_t*>(wn + 16 * g));
        unpack64(wn + 16 * g, lo, hi);
        const __m256 s0 = _mm256_broadcast_ss(sf + g), s1 = _mm256_broadcast_ss(sf + g + 1);
        for (int r = 0; r < R; r++) {
          const int8_t* x = q + r * K + 32 * g;
          acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(lo, x)), s0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(hi, x + 32)), s1, acc[r][1]);
        }
      }
      if (g < G) {
        const __m256i u = unpack32(wn + 16 * g);
        const __m256 s0 = _mm256_broadcast_ss(sf + g);
        for (int r = 0; r < R; r++)
          acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(u, q + r * K + 32 * g)), s0,
                                      acc[r][0]);
      }
    } else if (GROUP == 64) {
      const __m256i ones = _mm256_set1_epi16(1);
      for (int64_t g = 0; g < G; g++) {
        if ((g & 1) == 0) prefetch(reinterpret_cast<const int8_t*>(wn + 32 * g));
        unpack64(wn + 32 * g, lo, hi);
        const __m256 sg = _mm256_broadcast_ss(sf + g);
        for (int r = 0; r < R; r++) {
          const int8_t* x = q + r * K + 64 * g;
          const __m256i p16 = _mm256_add_epi16(
              _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)x)),
              _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(x + 32))));
          acc[r][g & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)), sg,
                                          acc[r][g & 1]);
        }
      }
    } else {
      // Products pairs of up to 8 blocks add up in int16 (8 * 2 * 15 * 127 < 2^15): one
      // widening per 256 codes instead of one per 32.
      const __m256i ones = _mm256_set1_epi16(1);
      for (int64_t g = 0; g < G; g++) {
        __m256i isum[R], p16[R];
        for (int r = 0; r < R; r++) isum[r] = p16[r] = _mm256_setzero_si256();
        for (int64_t k = g * group; k < (g + 1) * group; k += 64) {
          if ((k & 127) == 0) prefetch(reinterpret_cast<const int8_t*>(wn + k / 2));
          unpack64(wn + k / 2, lo, hi);
          for (int r = 0; r < R; r++) {
            const int8_t* x = q + r * K + k;
            p16[r] = _mm256_add_epi16(p16[r], _mm256_add_epi16(
                _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)x)),
                _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(x + 32)))));
          }
          if (((k - g * group) & 255) == 192 || k + 64 == (g + 1) * group)
            for (int r = 0; r < R; r++) {
              isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16[r], ones));
              p16[r] = _mm256_setzero_si256();
            }
        }
        const __m256 sg = _mm256_broadcast_ss(sf + g);
        for (int r = 0; r < R; r++)
          acc[r][g & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), sg, acc[r][g & 1]);
      }
    }
    for (int r = 0; r < R; r++) y[r * N + n] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) * xs[r];
  }
}

// One call's rows, four at a time and the rest in one pass (as int8_a8_mm).
template <int GROUP, class S>
void a4_all_rows(const int8_t* q, const float* xs, const float* gs, int64_t M, int64_t K,
                 int64_t Gp, int64_t group, const uint8_t* w, const S* s, const int8_t* z,
                 float* y, int64_t N, int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    a4_rows<4, GROUP>(q + m * K, xs + m, gs + m * Gp, K, group, w, s, z, y + m * N, N, n0, n1);
  switch (M - m) {
    case 3: a4_rows<3, GROUP>(q + m * K, xs + m, gs + m * Gp, K, group, w, s, z, y + m * N, N, n0, n1); break;
    case 2: a4_rows<2, GROUP>(q + m * K, xs + m, gs + m * Gp, K, group, w, s, z, y + m * N, N, n0, n1); break;
    case 1: a4_rows<1, GROUP>(q + m * K, xs + m, gs + m * Gp, K, group, w, s, z, y + m * N, N, n0, n1); break;
  }
}

// Threads split the output columns [0, N) in blocks of 8 and call f(n0, n1) on their share;
// a column's arithmetic is independent of which thread computes it.
template <class F>
void over_columns(int64_t N, const F& f) {
  at::parallel_for(0, (N + 7) / 8, 4,
                   [&](int64_t b, int64_t e) { f(8 * b, std::min(N, 8 * e)); });
}

}  // namespace
#endif

// Both ops take x float32 [M, K], codes int8 [N, K] and scale float32 [N].
static void check_args(const char* op, const at::Tensor& x, const at::Tensor& w,
                       const at::Tensor& s) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && s.dim() == 1, op, ": x [M,K], w [N,K], s [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar &&
                  s.scalar_type() == at::kFloat,
              op, ": x float32, w int8, s float32");
  TORCH_CHECK(x.size(1) == w.size(1) && s.size(0) == w.size(0), op, ": shapes differ");
}

static at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s) {
  check_args("int8_mm", x, w, s);
  at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = s.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  const float* xp = xc.data_ptr<float>();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_columns(N, [&](int64_t n0, int64_t n1) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) rows_kernel<2>(xp + m * K, K, wp, sp, yp + m * N, N, n0, n1);
    if (m < M) rows_kernel<1>(xp + m * K, K, wp, sp, yp + m * N, N, n0, n1);
  });
#else
  TORCH_CHECK(false, "int8_mm was built without AVX2/FMA");
#endif
  return y;
}

static at::Tensor int8_a8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s) {
  check_args("int8_a8_mm", x, w, s);
  TORCH_CHECK(x.size(1) < (1 << 17), "int8_a8_mm: K >= 2^17 could overflow int32");
  at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = s.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  // The quantized rows live in per-thread scratch rather than tensors: a decode step makes
  // ~200 of these calls, and two tensor allocations each cost ~0.6 ms a step here.
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> xs;
  q.resize(M * K);
  xs.resize(M);
  quantize_rows(xc.data_ptr<float>(), M, K, q.data(), xs.data());
  const int8_t* qp = q.data();
  const float* xsp = xs.data();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  over_columns(N, [&](int64_t n0, int64_t n1) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) a8_rows<4>(qp + m * K, xsp + m, K, wp, sp, yp + m * N, N, n0, n1);
    // The rest in one pass too: three rows (a k=2 verification) as 2 + 1 streamed the codes
    // twice (one decode step's GEMMs, SmolLM2 W8A8, in turns: 15.1-16.2 ms, 10.8-11.5 now).
    switch (M - m) {
      case 3: a8_rows<3>(qp + m * K, xsp + m, K, wp, sp, yp + m * N, N, n0, n1); break;
      case 2: a8_rows<2>(qp + m * K, xsp + m, K, wp, sp, yp + m * N, N, n0, n1); break;
      case 1: a8_rows<1>(qp + m * K, xsp + m, K, wp, sp, yp + m * N, N, n0, n1); break;
    }
  });
#else
  TORCH_CHECK(false, "int8_a8_mm was built without AVX2/FMA");
#endif
  return y;
}

template <class S>
static void int4_a8_run(const at::Tensor& xc, const at::Tensor& wc, const S* sp,
                        const int8_t* zp, int64_t group, at::Tensor& y) {
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0), G = K / group;
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> xs, gs;
  const int64_t Gp = (G + 7) & ~int64_t(7);
  q.resize(M * K);
  xs.resize(M);
  gs.resize(M * Gp);
  quantize_rows(xc.data_ptr<float>(), M, K, q.data(), xs.data());
  group_sums(q.data(), M, K, group, gs.data());
  const int8_t* qp = q.data();
  const float *xsp = xs.data(), *gsp = gs.data();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  over_columns(N, [&](int64_t n0, int64_t n1) {
    if (group == 32)
      a4_all_rows<32>(qp, xsp, gsp, M, K, Gp, group, wp, sp, zp, yp, N, n0, n1);
    else if (group == 64)
      a4_all_rows<64>(qp, xsp, gsp, M, K, Gp, group, wp, sp, zp, yp, N, n0, n1);
    else
      a4_all_rows<0>(qp, xsp, gsp, M, K, Gp, group, wp, sp, zp, yp, N, n0, n1);
  });
#else
  TORCH_CHECK(false, "int4_a8_mm was built without AVX2/FMA");
#endif
}

static at::Tensor int4_a8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s,
                             const at::Tensor& z, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && s.dim() == 2,
              "int4_a8_mm: x [M,K], packed [N,K/2], scale [N,G]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte &&
                  (s.scalar_type() == at::kHalf || s.scalar_type() == at::kFloat),
              "int4_a8_mm: x float32, packed uint8, scale float16 or float32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(group > 0 && (group == 32 || group % 64 == 0) && K % group == 0,
              "int4_a8_mm: the group must be 32 or a multiple of 64 dividing K");
  TORCH_CHECK(w.size(1) * 2 == K && s.size(0) == N && s.size(1) == K / group,
              "int4_a8_mm: shapes differ");
  TORCH_CHECK(K < (1 << 17), "int4_a8_mm: K >= 2^17 could overflow int32");
  TORCH_CHECK(z.numel() == 0 || (z.scalar_type() == at::kChar && z.sizes() == s.sizes()),
              "int4_a8_mm: zero int8 [N,G] or empty");
  at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = s.contiguous(), zc = z.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* zp = zc.numel() ? zc.data_ptr<int8_t>() : nullptr;
  if (sc.scalar_type() == at::kHalf)
    int4_a8_run(xc, wc, sc.data_ptr<at::Half>(), zp, group, y);
  else
    int4_a8_run(xc, wc, sc.data_ptr<float>(), zp, group, y);
  return y;
}

TORCH_LIBRARY(mtpkit, m) {
  m.def("int8_mm(Tensor x, Tensor w, Tensor s) -> Tensor");
  m.def("int8_a8_mm(Tensor x, Tensor w, Tensor s) -> Tensor");
  m.def("int4_a8_mm(Tensor x, Tensor w, Tensor s, Tensor z, int group) -> Tensor");
}
TORCH_LIBRARY_IMPL(mtpkit, CPU, m) {
  m.impl("int8_mm", &int8_mm);
  m.impl("int8_a8_mm", &int8_a8_mm);
  m.impl("int4_a8_mm", &int4_a8_mm);
}
