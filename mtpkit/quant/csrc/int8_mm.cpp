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
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

inline float hsum(__m256 v) {
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
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

}  // namespace
#endif

static at::Tensor int8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && s.dim() == 1, "int8_mm: x [M,K], w [N,K], s [N]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar &&
                  s.scalar_type() == at::kFloat,
              "int8_mm: x float32, w int8, s float32");
  TORCH_CHECK(x.size(1) == w.size(1) && s.size(0) == w.size(0), "int8_mm: shapes differ");
  at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = s.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  const float* xp = xc.data_ptr<float>();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Threads split the output columns in blocks of 8; a column's arithmetic is independent
  // of which thread computes it.
  at::parallel_for(0, (N + 7) / 8, 4, [&](int64_t b, int64_t e) {
    const int64_t n0 = 8 * b, n1 = std::min(N, 8 * e);
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) rows_kernel<2>(xp + m * K, K, wp, sp, yp + m * N, N, n0, n1);
    if (m < M) rows_kernel<1>(xp + m * K, K, wp, sp, yp + m * N, N, n0, n1);
  });
#else
  TORCH_CHECK(false, "int8_mm was built without AVX2/FMA");
#endif
  return y;
}

TORCH_LIBRARY(mtpkit, m) { m.def("int8_mm(Tensor x, Tensor w, Tensor s) -> Tensor"); }
TORCH_LIBRARY_IMPL(mtpkit, CPU, m) { m.impl("int8_mm", &int8_mm); }
