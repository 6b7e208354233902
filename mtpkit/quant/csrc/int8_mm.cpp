// mtpkit::int8_mm(x, codes, scale) -> y:  y[m, n] = scale[n] * sum_k x[m, k] * codes[n, k]
// x float32 [M, K] (contiguous), codes int8 [N, K] (contiguous), scale float32 [N].
// mtpkit::f32_mm(x, w) -> y = x @ w.T, the same loop over float32 weights [N, K] (no scale).
//
// Why by hand: torch's CPU int8 kernel (_weight_int8pack_mm) takes bf16 activations and is
// bound by widening codes, not by memory, at decoding row counts; its fp32 path is far
// slower, and inductor's generated dequantize-and-reduce loops slower still. This loop
// widens each group of 8 codes to fp32 once and feeds it to an FMA per row, with fp32
// activations, so it is also faster and more exact (docs/quantization.md). f32_mm: the
// compiled fp32 path's GEMMs. Inductor's CPU GEMM templates and the library sgemm differ per
// row count in blocking, hence in rounding, so a verified row would not be a decode step's
// bits; this loop is (and streams weights at about the machine's read bandwidth from one
// row up; with prefetches to L2, four rows stream in about a one-row pass's time, see
// simd.h).
//
// Exactness: every output is accumulated in the same order whatever the number of rows,
// the row's position in the batch, the thread split or the columns around it (rows are
// taken up to four at a time, and every pass does per row what the one-row pass does).
// Greedy speculative decoding relies on this: a verified row must equal the one-token step.
//
// Instruction sets: these loops are AVX2 on every host. AVX-512 forms were measured and
// dropped: 512-bit loops (f32_mm, and the W8A8 kernel in its former one-column layout) ran
// faster alone but slower inside the compiled steps (verification, generation and fp32
// decoding all lost). int8_a8_mm.cpp and int4_a8_mm.cpp keep VNNI forms, which pay in their
// blocked layouts.
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
using mtpkit_simd::over_columns;
using mtpkit_simd::over_rows;
using mtpkit_simd::prefetch;

inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
// Half-precision weights widen exactly to float32 (F16C; bf16 is float32's top half).
inline __m256 widen8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 widen8(const at::BFloat16* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

// R rows of x against output columns [n0, n1), 16 weights per step; two accumulators per
// row break the FMA dependency chain. Not inlined: inlined into the OpenMP region, gcc 12
// spills an accumulator to the stack inside the loop, which costs a third of its speed.
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

}  // namespace
#endif

// x float32 [M, K], codes int8 [N, K] and scale float32 [N].
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

// Weights float32, float16 or bfloat16 (widened exactly; the sums are float32's either way).
static at::Tensor f32_mm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "f32_mm: x [M,K], w [N,K]");
  const auto wt = w.scalar_type();
  TORCH_CHECK(x.scalar_type() == at::kFloat &&
                  (wt == at::kFloat || wt == at::kHalf || wt == at::kBFloat16),
              "f32_mm: x float32, w float32, float16 or bfloat16");
  at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  float* yp = y.data_ptr<float>();
  if (wt == at::kHalf)
    rows_gemm(xc.data_ptr<float>(), wc.data_ptr<at::Half>(), nullptr, yp, M, K, N);
  else if (wt == at::kBFloat16)
    rows_gemm(xc.data_ptr<float>(), wc.data_ptr<at::BFloat16>(), nullptr, yp, M, K, N);
  else
    rows_gemm(xc.data_ptr<float>(), wc.data_ptr<float>(), nullptr, yp, M, K, N);
#else
  TORCH_CHECK(false, "f32_mm was built without AVX2/FMA");
#endif
  return y;
}

TORCH_LIBRARY(mtpkit, m) {
  m.def("int8_mm(Tensor x, Tensor w, Tensor s) -> Tensor");
  m.def("f32_mm(Tensor x, Tensor w) -> Tensor");
}
TORCH_LIBRARY_IMPL(mtpkit, CPU, m) {
  m.impl("int8_mm", &int8_mm);
  m.impl("f32_mm", &f32_mm);
}

MTPKIT_AOTI_SHIM(int8_mm,
                 (AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle s, AtenTensorHandle* ret0),
                 (x, w, s),
                 int8_mm(arg(x), arg(w), arg(s)))
MTPKIT_AOTI_SHIM(f32_mm, (AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0),
                 (x, w),
                 f32_mm(arg(x), arg(w)))
