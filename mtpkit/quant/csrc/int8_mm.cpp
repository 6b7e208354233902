// mtpkit::int8_mm(x, codes, scale) -> y:  y[m, n] = scale[n] * sum_k x[m, k] * codes[n, k]
// x float32 [M, K] (contiguous), codes int8 [N, K] (contiguous), scale float32 [N].
// mtpkit::f32_mm(x, w) -> y = x @ w.T, the same loop over float32 weights [N, K] (no scale).
//
// Why by hand: torch's CPU int8 kernel (_weight_int8pack_mm) takes bf16 activations and
// runs at ~4.2 G codes/s on this machine's 2 AVX2 cores at two rows (weights streamed from
// memory); its fp32 path is ~10x slower, and inductor's generated dequantize-and-reduce
// loops reach 0.3-1 GB/s. This loop widens each group of 8 codes to fp32 once and feeds it
// to an FMA per row (~6.4 G codes/s at two rows, docs/quantization.md), with fp32
// activations, so it is also more exact. f32_mm: the compiled fp32 path's GEMMs. Inductor's
// CPU GEMM templates and the library sgemm differ per row count in blocking, hence in
// rounding, so a verified row would not be a decode step's bits; this loop is (and streams
// weights at the machine's read bandwidth from one row up: ~71 GB/s where a sum read 72-75).
//
// Exactness: every output is accumulated in the same order whatever the number of rows,
// the row's position in the batch, the thread split or the columns around it (rows are
// taken up to four at a time, and every pass does per row what the one-row pass does).
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
// Instruction sets: these loops are AVX2 on every host. AVX-512 forms were measured on Zen 5
// and dropped: 512-bit loops (int8_a8_mm at 2-4 rows, f32_mm) ran faster alone but slower
// inside the compiled steps (a two-row W8A8 verification 4.5-4.6 ms against 3.6-3.7 in two
// of three turns; k=1 generation 282-288 tok/s in three of four runs against 341-360; fp32
// decode 8.5-8.9 against 8.0-8.3 ms), and VNNI on 256-bit vectors (vpdpbusd) gave W8A8 the
// same step times as vpmaddubsw here. int4_a8_mm.cpp keeps a VNNI form, which pays.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "aoti_shim.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "simd.h"

namespace {

using mtpkit_simd::hsum;
using mtpkit_simd::hsum_i32;
using mtpkit_simd::over_columns;
using mtpkit_simd::over_rows;
using mtpkit_simd::prefetch;
using mtpkit_simd::quantize_rows;

inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }

// R rows of x against output columns [n0, n1), 16 weights per step; two accumulators per
// row break the FMA dependency chain. Not inlined: inlined into the OpenMP region, gcc 12
// spills an accumulator to the stack inside the loop (5.5 instead of 8.3 G codes/s).
// W int8 (codes, times s[n]) or float (s null). One prefetch per 64 bytes of weights.
template <int R, class W>
__attribute__((noinline)) void rows_kernel(const float* x, int64_t K, const W* w,
                                           const float* s, float* y, int64_t N, int64_t n0,
                                           int64_t n1) {
  const int64_t Kv = K - K % 16;
  constexpr int64_t kLine = 64 / sizeof(W);
  for (int64_t n = n0; n < n1; n++) {
    const W* wn = w + n * K;
    __m256 a[R][2];
    for (int r = 0; r < R; r++)
      for (int j = 0; j < 2; j++) a[r][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < Kv; k += 16) {
      if ((k & (kLine - 1)) == 0) prefetch(reinterpret_cast<const int8_t*>(wn + k));
      for (int j = 0; j < 2; j++) {
        const __m256 f = widen8(wn + k + 8 * j);
        for (int r = 0; r < R; r++)
          a[r][j] = _mm256_fmadd_ps(f, _mm256_loadu_ps(x + r * K + k + 8 * j), a[r][j]);
      }
    }
    for (int r = 0; r < R; r++) {
      float acc = hsum(_mm256_add_ps(a[r][0], a[r][1]));
      for (int64_t k = Kv; k < K; k++) acc = std::fma(float(wn[k]), x[r * K + k], acc);
      y[r * N + n] = s ? acc * s[n] : acc;
    }
  }
}

// x [M, K] against weights [N, K] (times s[n] where s is given): threads over columns,
// passes of up to four rows over the weights (int8_mm and f32_mm).
template <class W>
void rows_gemm(const float* x, const W* w, const float* s, float* y, int64_t M, int64_t K,
               int64_t N) {
  over_columns(N, [&](int64_t n0, int64_t n1) {
    over_rows(M, [&](auto R, int64_t m) {
      rows_kernel<R.value>(x + m * K, K, w, s, y + m * N, N, n0, n1);
    });
  });
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
      int32_t acc = hsum_i32(a[r]);
      for (int64_t k = Kv; k < K; k++) acc += int32_t(q[r * K + k]) * int32_t(wn[k]);
      y[r * N + n] = (float(acc) * xs[r]) * s[n];
    }
  }
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
  rows_gemm(xc.data_ptr<float>(), wc.data_ptr<int8_t>(), sc.data_ptr<float>(),
            y.data_ptr<float>(), M, K, N);
#else
  TORCH_CHECK(false, "int8_mm was built without AVX2/FMA");
#endif
  return y;
}

static at::Tensor f32_mm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "f32_mm: x [M,K], w [N,K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
              "f32_mm: x and w float32");
  at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  rows_gemm(xc.data_ptr<float>(), wc.data_ptr<float>(), nullptr, y.data_ptr<float>(), M, K,
            N);
#else
  TORCH_CHECK(false, "f32_mm was built without AVX2/FMA");
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
    over_rows(M, [&](auto R, int64_t m) {
      a8_rows<R.value>(qp + m * K, xsp + m, K, wp, sp, yp + m * N, N, n0, n1);
    });
  });
#else
  TORCH_CHECK(false, "int8_a8_mm was built without AVX2/FMA");
#endif
  return y;
}

TORCH_LIBRARY(mtpkit, m) {
  m.def("int8_mm(Tensor x, Tensor w, Tensor s) -> Tensor");
  m.def("int8_a8_mm(Tensor x, Tensor w, Tensor s) -> Tensor");
  m.def("f32_mm(Tensor x, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(mtpkit, CPU, m) {
  m.impl("int8_mm", &int8_mm);
  m.impl("int8_a8_mm", &int8_a8_mm);
  m.impl("f32_mm", &f32_mm);
}

MTPKIT_AOTI_SHIM(int8_mm,
                 (AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle s, AtenTensorHandle* ret0),
                 int8_mm(arg(x), arg(w), arg(s)))
MTPKIT_AOTI_SHIM(int8_a8_mm,
                 (AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle s, AtenTensorHandle* ret0),
                 int8_a8_mm(arg(x), arg(w), arg(s)))
MTPKIT_AOTI_SHIM(f32_mm, (AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0),
                 f32_mm(arg(x), arg(w)))
