// mtpkit::attend_rows(q, k, v, pos, rows) -> out: attention of a step's query rows.
//   q float32 [T, H, D] (the query heads of T tokens; any row/head strides, D contiguous),
//   k, v float32 [Hkv, S, D] (a cache span; any head/slot strides, D contiguous),
//   pos int64 [T]: the tokens' positions; row j sees cache slots 0..min(pos[j], S-1),
//   rows: rows 0..rows-1 are attended; rows past them are padding and copy row rows-1.
//   out[j, h] = sum_{i<=p_j} softmax_i(q[j,h] . k[h/g, i] / sqrt(D)) v[h/g, i],  g = H / Hkv,
// the same as scaled_dot_product_attention with the mask "key slot <= pos" and query heads
// grouped on their KV head as repeat_interleave does. out is [T, H, D] contiguous, the
// layout o_proj reads, so no transpose follows.
//
// Why by hand: torch's CPU SDPA takes 45-60 us for one query row of SmolLM2 (9 heads, 136
// keys) on this machine's cores, for ~0.16 M multiply-adds: its general blocked kernel
// allocates and transposes per call. Compiled quantized trunks attend one row at a time (so
// that a verified row is the same computation as a one-token step). One call a layer for
// all of a step's rows, rather than one a row: a call's fixed cost (dispatch, the output,
// a parallel region) was most of a row's time, and a k=3 verification made 120 of them.
//
// Exactness: a (row, head) result depends only on its own q row, the slots it reads and D;
// the arithmetic order is fixed (whatever the thread split, the head count, the row count or
// the other rows of a step), so every step that computes a row gets the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "simd.h"

namespace {

using mtpkit_simd::hsum;

// exp for x <= 0 (softmax after subtracting the max): Cody-Waite reduction x = n ln2 + r,
// the Cephes expf polynomial for e^r, then 2^n through the exponent bits. ~1 ulp.
inline __m256 exp_nonpos(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // keeps 2^n a normal float
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Scores of up to 4 query heads (a KV head's group shares each key load) against slots
// 0..P-1: s[a * P + j] = q[a] . k[j] * scale. Each head's sum runs in one fixed order.
template <int G>
void scores(const float* q, int64_t qs, const float* k, int64_t ks, int64_t P, int64_t D,
            float scale, float* s) {
  const int64_t Dv = D - D % 8;
  for (int64_t j = 0; j < P; j++) {
    const float* kj = k + j * ks;
    __m256 a[G];
    for (int h = 0; h < G; h++) a[h] = _mm256_setzero_ps();
    for (int64_t d = 0; d < Dv; d += 8) {
      const __m256 kv = _mm256_loadu_ps(kj + d);
      for (int h = 0; h < G; h++) a[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * qs + d), kv, a[h]);
    }
    for (int h = 0; h < G; h++) {
      float t = hsum(a[h]);
      for (int64_t d = Dv; d < D; d++) t = std::fma(q[h * qs + d], kj[d], t);
      s[h * P + j] = t * scale;
    }
  }
}

// out[d] = sum_i e[i] v[i, d] / sum for NB * 8 lanes from d; each lane sums in i order.
template <int NB>
inline void weigh(const float* e, const float* v, int64_t vs, int64_t P, int64_t d, float sum,
                  float* out) {
  __m256 a[NB];
  for (int c = 0; c < NB; c++) a[c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < P; i++) {
    const __m256 w = _mm256_set1_ps(e[i]);
    for (int c = 0; c < NB; c++) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + i * vs + d + 8 * c), a[c]);
  }
  const __m256 vs_ = _mm256_set1_ps(sum);
  for (int c = 0; c < NB; c++) _mm256_storeu_ps(out + d + 8 * c, _mm256_div_ps(a[c], vs_));
}

// Softmax of one head's scores s[0..P) in place (as exp(s - max)), then its output row.
void finish_head(float* s, const float* v, int64_t vs, int64_t P, int64_t D, float* out) {
  float m = -INFINITY;
  for (int64_t j = 0; j < P; j++) m = std::max(m, s[j]);
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= P; j += 8) {
    const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
    _mm256_storeu_ps(s + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum(vsum);
  if (j < P) {  // the tail through the same vector exp, padded with -inf (unused lanes)
    alignas(32) float t[8];
    for (int i = 0; i < 8; i++) t[i] = j + i < P ? s[j + i] - m : -INFINITY;
    _mm256_store_ps(t, exp_nonpos(_mm256_load_ps(t)));
    for (int64_t i = 0; j + i < P; i++) {
      s[j + i] = t[i];
      sum += t[i];
    }
  }
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) weigh<8>(s, v, vs, P, d, sum, out);
  for (; d + 8 <= D; d += 8) weigh<1>(s, v, vs, P, d, sum, out);
  for (; d < D; d++) {
    float a = 0.f;
    for (int64_t i = 0; i < P; i++) a = std::fma(s[i], v[i * vs + d], a);
    out[d] = a / sum;
  }
}

}  // namespace
#endif

static at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& pos_, int64_t rows) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "attend_rows: q [T,H,D], k/v [Hkv,S,D]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && pos_.scalar_type() == at::kLong,
              "attend_rows: float32 q/k/v, int64 pos");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(0), S = k.size(1);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == D && Hkv > 0 && H % Hkv == 0,
              "attend_rows: shapes differ");
  TORCH_CHECK(pos_.dim() == 1 && pos_.size(0) == T, "attend_rows: pos [T]");
  TORCH_CHECK(rows >= 1 && rows <= T, "attend_rows: 1 <= rows <= T");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "attend_rows: q/k/v need contiguous rows");
  const at::Tensor pos = pos_.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  int64_t pmax = 0;
  for (int64_t j = 0; j < rows; j++) {
    TORCH_CHECK(pp[j] >= 0, "attend_rows: negative position");
    pmax = std::max(pmax, std::min(pp[j] + 1, S));
  }
  at::Tensor out = at::empty({T, H, D}, q.options());
#if defined(__AVX2__) && defined(__FMA__)
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t g = H / Hkv, qt = q.stride(0), qs = q.stride(1);
  const float scale = 1.0f / std::sqrt(float(D));
  // Threads take whole (row, KV head) items, a KV head's query group together; a short
  // span stays on one thread, where a fork would cost more than the work.
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, g * pmax * D));
  at::parallel_for(0, rows * Hkv, grain, [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> s;
    s.resize(g * pmax);
    for (int64_t item = i0; item < i1; item++) {
      const int64_t j = item / Hkv, kv = item % Hkv;
      const int64_t P = std::min(pp[j] + 1, S);
      const float* kk = kp + kv * k.stride(0);
      const float* vv = vp + kv * v.stride(0);
      for (int64_t a = 0; a < g; a += 4) {  // up to 4 query heads per pass over the keys
        const float* qa = qp + j * qt + (kv * g + a) * qs;
        float* sa = s.data() + a * P;
        switch (std::min<int64_t>(4, g - a)) {
          case 4: scores<4>(qa, qs, kk, k.stride(1), P, D, scale, sa); break;
          case 3: scores<3>(qa, qs, kk, k.stride(1), P, D, scale, sa); break;
          case 2: scores<2>(qa, qs, kk, k.stride(1), P, D, scale, sa); break;
          default: scores<1>(qa, qs, kk, k.stride(1), P, D, scale, sa);
        }
      }
      for (int64_t a = 0; a < g; a++)
        finish_head(s.data() + a * P, vv, v.stride(1), P, D, op + (j * H + kv * g + a) * D);
    }
  });
  for (int64_t j = rows; j < T; j++)
    std::copy(op + (rows - 1) * H * D, op + rows * H * D, op + j * H * D);
#else
  TORCH_CHECK(false, "attend_rows was built without AVX2/FMA");
#endif
  return out;
}

TORCH_LIBRARY_FRAGMENT(mtpkit, m) {
  m.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor pos, int rows) -> Tensor");
}
TORCH_LIBRARY_IMPL(mtpkit, CPU, m) { m.impl("attend_rows", &attend_rows); }
