// mtpkit::int4_a8_mm(x, packed, scale, zero, group) -> y: W4A8, int4 weights in groups of
// `group` input columns (a multiple of 32) times int8 activations quantized per row as in
// int8_a8_mm (xs[m] = max_k |x[m, k]| / 127, q = round_half_even(x / xs)).
// A weight is w[n, k] = scale[n, g] * (u[n, k] - zu[n, g]) with u in [0, 15] (the signed
// code + 8) and zu the zero point + 8 (8 for symmetric weights: `zero` empty). Then
//   y[m, n] = xs[m] * sum_g ( (-scale[n, g] * zu[n, g]) * float(sum_{k in g} q[m, k])
//                             + scale[n, g] * float(sum_{k in g} u[n, k] q[m, k]) )
// with both integer sums exact and the float sum over groups in this one order for every
// output, so a row's result is the same bits whatever rows, threads or columns come with it.
//
// Layout (QuantLinear._pack_a4): columns in blocks of 16 (N padded to a multiple of 16),
// each block's codes in chunks of 32 input columns, a chunk as 4 x 64 bytes; 64 bytes hold
// sub-blocks 2p and 2p + 1 (k = 8p .. 8p + 7 of the chunk) of all 16 columns, byte 4c + j
// holding column c's u[8p + j] in its low nibble and u[8p + 4 + j] in its high one.
// `scale` float16 or float32 and `zero` int8 as [N / 16, G, 16] (a block's 16 columns side
// by side), or `zero` empty.
//
// Why by hand, and why this layout: half the bytes of int8 codes a step, and torch's int4
// CPU kernel takes bf16 activations and widens codes to floats (docs/quantization.md). With
// the columns across a register, one broadcast of 4 activations multiplies 4 codes of every
// column, and one widening, conversion and FMA per group serve all the block's outputs (no
// horizontal sum per output). Built with AVX-512 VNNI (kernels.py), a 64-byte run's two
// nibble halves are two 512-bit vpdpbusd a row. AVX2 takes a block as two halves of 8
// columns (the 32-byte halves of each run): vpmaddubsw, with product pairs added up in
// int16 over a whole chunk (8 x 2 x 15 x 127 < 2^15) and widened once, about 2.4 vector
// operations per 32 codes a row. Blocks of 8 with 256-bit vpdpbusd made a 4-row
// verification cost clearly more than a decode step; blocks of 16 with 512-bit bring it
// closer to one.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "aoti_shim.h"

#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "simd.h"


namespace {

using mtpkit_simd::bcast4;
using mtpkit_simd::over_columns;
using mtpkit_simd::hsum_i32;
using mtpkit_simd::over_rows;
using mtpkit_simd::prefetch;
using mtpkit_simd::quantize_rows;

// Per row and group: the sum of the row's quantized values (the zero-point term's factor).
void group_sums(const int8_t* q, int64_t M, int64_t K, int64_t group, float* gs) {
  const int64_t G = K / group;
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < G; g++) {
      __m256i a = _mm256_setzero_si256();
      for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(q + m * K + k));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, xv), ones16));
      }
      gs[m * G + g] = float(hsum_i32(a));
    }
}

#if MTPKIT_VNNI
inline __m512 load16(const at::Half* s) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s));
}
inline __m512 load16(const float* s) { return _mm512_loadu_ps(s); }

// R quantized rows against column blocks [b0, b1) of 16, a 64-byte run (4 codes of 16
// columns, two nibbles a byte) through 512-bit vpdpbusd. Per lane (column) the float steps
// are those of the AVX2 form below, in the same order, so both builds give the same bits.
// Not inlined, as in int8_mm.cpp: inside the OpenMP region gcc spills accumulators.
template <int R, class S>
__attribute__((noinline)) void a4_rows(const int8_t* q, const float* xs, const float* gs,
                                       int64_t K, int64_t group, const uint8_t* w, const S* s,
                                       const int8_t* z, float* y, int64_t N, int64_t b0,
                                       int64_t b1) {
  const int64_t G = K / group, chunks = group / 32;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = b0; b < b1; b++) {
    const uint8_t* wb = w + b * 8 * K;  // 16 columns x K / 2 bytes
    const S* sb = s + b * G * 16;
    const int8_t* zb = z ? z + b * G * 16 : nullptr;
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
      const __m512 sv = load16(sb + 16 * g);
      const __m512 zu = zb ? _mm512_cvtepi32_ps(_mm512_add_epi32(
                                 _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(zb + 16 * g))),
                                 _mm512_set1_epi32(8)))
                           : _mm512_set1_ps(8.f);
      const __m512 ov = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), sv), zu);
      __m512i isum[R];
      for (int r = 0; r < R; r++) {
        acc[r] = _mm512_fmadd_ps(ov, _mm512_set1_ps(gs[r * G + g]), acc[r]);
        isum[r] = _mm512_setzero_si512();
      }
      for (int64_t c = g * chunks; c < (g + 1) * chunks; c++) {
        const uint8_t* wc = wb + 256 * c;
        for (int p = 0; p < 4; p++) prefetch(reinterpret_cast<const int8_t*>(wc + 64 * p));
        for (int p = 0; p < 4; p++) {
          const __m512i v = _mm512_loadu_si512((const void*)(wc + 64 * p));
          const __m512i lo = _mm512_and_si512(v, low);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
          for (int r = 0; r < R; r++) {
            const int8_t* x = q + r * K + 32 * c + 8 * p;
            isum[r] = _mm512_dpbusd_epi32(
                _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x))),
                hi, _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + 4)));
          }
        }
      }
      for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), sv, acc[r]);
    }
    for (int r = 0; r < R; r++)
      _mm512_storeu_ps(y + r * N + 16 * b, _mm512_mul_ps(acc[r], _mm512_set1_ps(xs[r])));
  }
}
#else
inline __m256 load8(const at::Half* s) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s));
}
inline __m256 load8(const float* s) { return _mm256_loadu_ps(s); }

// AVX2: R quantized rows against column blocks [b0, b1) of 16, each as two halves of 8
// columns (the 32-byte halves of every 64-byte run; the second pass over a block reads it
// from L1). Product pairs add up in int16 over a chunk (8 x 2 x 15 x 127 < 2^15), widened
// once. Not inlined (gcc spills accumulators inside the OpenMP region).
template <int R, class S>
__attribute__((noinline)) void a4_rows(const int8_t* q, const float* xs, const float* gs,
                                       int64_t K, int64_t group, const uint8_t* w, const S* s,
                                       const int8_t* z, float* y, int64_t N, int64_t b0,
                                       int64_t b1) {
  const int64_t G = K / group, chunks = group / 32;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = b0; b < b1; b++)
    for (int h = 0; h < 2; h++) {
      const uint8_t* wb = w + b * 8 * K + 32 * h;
      const S* sb = s + b * G * 16 + 8 * h;
      const int8_t* zb = z ? z + b * G * 16 + 8 * h : nullptr;
      __m256 acc[R];
      for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
      for (int64_t g = 0; g < G; g++) {
        const __m256 sv = load8(sb + 16 * g);
        const __m256 zu = zb ? _mm256_cvtepi32_ps(_mm256_add_epi32(
                                   _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(zb + 16 * g))),
                                   _mm256_set1_epi32(8)))
                             : _mm256_set1_ps(8.f);
        const __m256 ov = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), sv), zu);
        __m256i isum[R];
        for (int r = 0; r < R; r++) {
          acc[r] = _mm256_fmadd_ps(ov, _mm256_broadcast_ss(gs + r * G + g), acc[r]);
          isum[r] = _mm256_setzero_si256();
        }
        for (int64_t c = g * chunks; c < (g + 1) * chunks; c++) {
          const uint8_t* wc = wb + 256 * c;
          if (h == 0)
            for (int p = 0; p < 4; p++) prefetch(reinterpret_cast<const int8_t*>(wc + 64 * p));
          __m256i p16[R];
          for (int r = 0; r < R; r++) p16[r] = _mm256_setzero_si256();
          for (int p = 0; p < 4; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i*)(wc + 64 * p));
            const __m256i lo = _mm256_and_si256(v, low);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int r = 0; r < R; r++) {
              const int8_t* x = q + r * K + 32 * c + 8 * p;
              p16[r] = _mm256_add_epi16(p16[r], _mm256_add_epi16(
                  _mm256_maddubs_epi16(lo, bcast4(x)), _mm256_maddubs_epi16(hi, bcast4(x + 4))));
            }
          }
          for (int r = 0; r < R; r++)
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16[r], ones));
        }
        for (int r = 0; r < R; r++)
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), sv, acc[r]);
      }
      for (int r = 0; r < R; r++)
        _mm256_storeu_ps(y + r * N + 16 * b + 8 * h, _mm256_mul_ps(acc[r], _mm256_set1_ps(xs[r])));
    }
}
#endif

template <class S>
void a4_run(const at::Tensor& x, const at::Tensor& w, const S* sp, const int8_t* zp,
            int64_t group, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), G = K / group;
  // Per-thread scratch, as in int8_a8_mm: tensor allocations per call cost more here.
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> xs, gs;
  q.resize(M * K);
  xs.resize(M);
  gs.resize(M * G);
  quantize_rows(x.data_ptr<float>(), M, K, q.data(), xs.data());
  group_sums(q.data(), M, K, group, gs.data());
  const int8_t* qp = q.data();
  const float *xsp = xs.data(), *gsp = gs.data();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  over_columns<16>(N, [&](int64_t n0, int64_t n1) {
    const int64_t b0 = n0 / 16, b1 = n1 / 16;
    over_rows(M, [&](auto R, int64_t m) {
      a4_rows<R.value>(qp + m * K, xsp + m, gsp + m * G, K, group, wp, sp, zp, yp + m * N, N,
                       b0, b1);
    });
  });
}

}  // namespace
#endif

static at::Tensor int4_a8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s,
                             const at::Tensor& z, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && s.dim() == 3,
              "int4_a8_mm: x [M,K], packed [N,K/2], scale [N/16,G,16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte &&
                  (s.scalar_type() == at::kHalf || s.scalar_type() == at::kFloat),
              "int4_a8_mm: x float32, packed uint8, scale float16 or float32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(group > 0 && group % 32 == 0 && K % group == 0,
              "int4_a8_mm: the group must be a multiple of 32 dividing K");
  TORCH_CHECK(N % 16 == 0 && w.size(1) * 2 == K && s.size(0) * 16 == N && s.size(1) == K / group
                  && s.size(2) == 16,
              "int4_a8_mm: shapes differ (N a multiple of 16, packed [N,K/2], scale [N/16,G,16])");
  TORCH_CHECK(K < (1 << 17), "int4_a8_mm: K >= 2^17 could overflow int32");
  TORCH_CHECK(z.numel() == 0 || (z.scalar_type() == at::kChar && z.sizes() == s.sizes()),
              "int4_a8_mm: zero int8 shaped as scale, or empty");
  at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = s.contiguous(), zc = z.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  const int8_t* zp = zc.numel() ? zc.data_ptr<int8_t>() : nullptr;
  if (sc.scalar_type() == at::kHalf)
    a4_run(xc, wc, sc.data_ptr<at::Half>(), zp, group, y);
  else
    a4_run(xc, wc, sc.data_ptr<float>(), zp, group, y);
#else
  TORCH_CHECK(false, "int4_a8_mm was built without AVX2/FMA");
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(mtpkit, m) {
  m.def("int4_a8_mm(Tensor x, Tensor w, Tensor s, Tensor z, int group) -> Tensor");
}
TORCH_LIBRARY_IMPL(mtpkit, CPU, m) { m.impl("int4_a8_mm", &int4_a8_mm); }

MTPKIT_AOTI_SHIM(int4_a8_mm,
                 (AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle s, AtenTensorHandle z, int64_t group, AtenTensorHandle* ret0),
                 (x, w, s, z),
                 int4_a8_mm(arg(x), arg(w), arg(s), arg(z), group))
