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
// that a verified row is the same computation as a one-token step). One call a layer takes
// all of a step's rows, in three passes (scores in 8-key blocks, softmaxes, weighted
// values), so that every row's query heads of a KV head share each key and value row
// loaded; a call per row and head re-read them from L2 and ran at its speed at long spans.
//
// Exactness: a (row, head) result depends only on its own q row, the slots it reads and D;
// the arithmetic order is fixed (whatever the thread split, the head count, the row count or
// the other rows of a step), so every step that computes a row gets the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "aoti_shim.h"

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

// One query head against 8 keys from kj (key stride ks), their sums over d < Dv reduced
// into one vector, lane j = key j. Every key's sum runs in one fixed order (its lanes over
// d, then the same hadd pattern), whatever keys share the block: a score never depends on
// its neighbours. Eight independent FMA chains keep the FMA units busy where one key's
// chain of D/8 dependent FMAs (4 cycles each) left them idle, and one reduction serves
// eight keys where an hsum per key cost about as much as its dot product.
inline __m256 dot8(const float* q, const float* kj, int64_t ks, int64_t Dv) {
  __m256 a[8];
  for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < Dv; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + j * ks + d), a[j]);
  }
  // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]: two levels give
  // [k0..k3 low-half sums | k0..k3 high-half sums] per four keys; the halves then add.
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// s[j] = q . kj[j] * scale for the first n keys of a block (dimensions past the last 8
// added per key after the vector sum).
inline void score_block(const float* q, const float* kj, int64_t ks, int64_t n, int64_t D,
                        int64_t Dv, float scale, float* s) {
  const __m256 r = dot8(q, kj, ks, Dv);
  if (Dv == D && n == 8) {
    _mm256_storeu_ps(s, _mm256_mul_ps(r, _mm256_set1_ps(scale)));
    return;
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, r);
  for (int64_t j = 0; j < n; j++) {
    float x = t[j];
    for (int64_t d = Dv; d < D; d++) x = std::fma(q[d], kj[j * ks + d], x);
    s[j] = x * scale;
  }
}

// Softmax of one head's scores s[0..P) in place, as exp(s - max); returns their sum.
float softmax_inplace(float* s, int64_t P) {
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= P; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float m = lanes[0];
  for (int i = 1; i < 8; i++) m = std::max(m, lanes[i]);
  for (; j < P; j++) m = std::max(m, s[j]);  // max is exact in any order
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  for (j = 0; j + 8 <= P; j += 8) {
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
  return sum;
}

// Asks for rows j0 .. j0+n-1 of a cache span (row stride `stride` floats, D floats a row):
// to L1 (keys pass 1 reads next) or to L2 (values pass 3 reads later).
template <_mm_hint Hint>
inline void fetch_rows(const float* base, int64_t stride, int64_t j0, int64_t n, int64_t D) {
  for (int64_t j = j0; j < j0 + n; j++)
    for (int64_t d = 0; d < D; d += 16)
      _mm_prefetch(reinterpret_cast<const char*>(base + j * stride + d), Hint);
}

// NB * 8 lanes from d of the weighted values of Q queries: out[q][d..] = sum_i e[q][i]
// v[i, d..] / sum[q], each lane summed in i order, whatever queries come with it. A value
// row is loaded once for all Q queries (one load per query and value ran at L2's speed at
// 512 keys).
template <int Q, int NB>
inline void weigh_lanes(float* const* e, const int64_t* P, int64_t pmax, const float* v,
                        int64_t vs, int64_t d, const float* sum, float* const* out) {
  __m256 a[Q][NB];
  for (int q = 0; q < Q; q++)
    for (int c = 0; c < NB; c++) a[q][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < pmax; i++) {
    __m256 vv[NB];
    for (int c = 0; c < NB; c++) vv[c] = _mm256_loadu_ps(v + i * vs + d + 8 * c);
    for (int q = 0; q < Q; q++)
      if (i < P[q]) {
        const __m256 w = _mm256_set1_ps(e[q][i]);
        for (int c = 0; c < NB; c++) a[q][c] = _mm256_fmadd_ps(w, vv[c], a[q][c]);
      }
  }
  for (int q = 0; q < Q; q++) {
    const __m256 sv = _mm256_set1_ps(sum[q]);
    for (int c = 0; c < NB; c++) _mm256_storeu_ps(out[q] + d + 8 * c, _mm256_div_ps(a[q][c], sv));
  }
}

// The weighted values of up to 6 queries of one KV head (e[q][0..P[q]), sums sum[q]) over
// dims [d0, d1), d1 - d0 <= 16: 16 lanes, 8 lanes, then one dim at a time.
template <int Q>
void weigh(float* const* e, const int64_t* P, const float* v, int64_t vs, int64_t d0,
           int64_t d1, const float* sum, float* const* out) {
  int64_t pmax = 0;
  for (int q = 0; q < Q; q++) pmax = std::max(pmax, P[q]);
  int64_t d = d0;
  if (d + 16 <= d1) {
    weigh_lanes<Q, 2>(e, P, pmax, v, vs, d, sum, out);
    d += 16;
  }
  if (d + 8 <= d1) {
    weigh_lanes<Q, 1>(e, P, pmax, v, vs, d, sum, out);
    d += 8;
  }
  for (; d < d1; d++)
    for (int q = 0; q < Q; q++) {
      float a = 0.f;
      for (int64_t i = 0; i < P[q]; i++) a = std::fma(e[q][i], v[i * vs + d], a);
      out[q][d] = a / sum[q];
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
  // span[j]: the cache slots row j reads, 0..span[j]-1.
  std::vector<int64_t> span(rows);
  int64_t pmax = 0;
  for (int64_t j = 0; j < rows; j++) {
    TORCH_CHECK(pp[j] >= 0, "attend_rows: negative position");
    span[j] = std::min(pp[j] + 1, S);
    pmax = std::max(pmax, span[j]);
  }
  at::Tensor out = at::empty({T, H, D}, q.options());
#if defined(__AVX2__) && defined(__FMA__)
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t g = H / Hkv, qt = q.stride(0), qs = q.stride(1);
  const float scale = 1.0f / std::sqrt(float(D));
  const int64_t Dv = D - D % 8, nb = (pmax + 7) / 8;
  // Scores of all attended rows, [rows][H][pmax], then each (row, head)'s softmax and output.
  thread_local std::vector<float> sbuf;
  sbuf.resize(rows * H * pmax);
  float* sp = sbuf.data();
  // Pass 1 over (KV head, 8-key block) items: a block's keys come from memory once and
  // from L1 for every row's query heads of that KV head (at 512 keys a pass per query head
  // ran at L2's speed). Keys past a row's position but inside the buffer are read with the
  // block and their lanes dropped (lanes never mix); only a block past the buffer's end is
  // copied, zero-filled, into ``pad``. Threads split whatever work there is, so a short
  // span stays on one thread, where a fork would cost more than the work.
  const int64_t work1 = rows * g * 8 * D;
  at::parallel_for(0, Hkv * nb, std::max<int64_t>(1, 65536 / work1), [&](int64_t i0, int64_t i1) {
    thread_local std::vector<float> pad;
    // The cache rows a step reads were last touched a step (a whole weight stream) ago and
    // come from memory in short per-head streams the hardware prefetcher barely ramps up
    // on: a layer's attention ran at 5-7 GB/s (one thread, 65-513 keys, weights streamed
    // between calls). Each item asks for the keys kAhead items on and its own block's
    // values, which pass 3 then finds in L2: 14-25% less time a call (docs/benchmarks.md).
    constexpr int64_t kAhead = 4;
    const auto keys_of = [&](int64_t item) {
      const int64_t j0 = 8 * (item % nb);
      fetch_rows<_MM_HINT_T0>(kp + item / nb * k.stride(0), k.stride(1), j0,
                              std::min<int64_t>(8, S - j0), D);
    };
    for (int64_t item = i0; item < std::min(i1, i0 + kAhead); item++) keys_of(item);
    for (int64_t item = i0; item < i1; item++) {
      const int64_t kv = item / nb, j0 = 8 * (item % nb);
      if (item + kAhead < i1) keys_of(item + kAhead);
      fetch_rows<_MM_HINT_T1>(vp + kv * v.stride(0), v.stride(1), j0,
                              std::min<int64_t>(8, S - j0), D);
      const float* kj = kp + kv * k.stride(0) + j0 * k.stride(1);
      int64_t ks = k.stride(1);
      const int64_t avail = std::min<int64_t>(8, S - j0);
      if (avail < 8) {
        pad.assign(8 * D, 0.0f);
        for (int64_t j = 0; j < avail; j++) std::copy(kj + j * ks, kj + j * ks + D, pad.data() + j * D);
        kj = pad.data();
        ks = D;
      }
      for (int64_t r = 0; r < rows; r++) {
        const int64_t P = span[r];
        if (j0 >= P) continue;
        for (int64_t h = kv * g; h < (kv + 1) * g; h++)
          score_block(qp + r * qt + h * qs, kj, ks, std::min<int64_t>(8, P - j0), D, Dv, scale,
                      sp + (r * H + h) * pmax + j0);
      }
    }
  });
  // Pass 2: each (row, head)'s softmax. Pass 3 over (KV head, group of 6 of its
  // queries, 16 dims) items: the weighted sums of the values.
  thread_local std::vector<float> sums;
  sums.resize(rows * H);
  float* sums_p = sums.data();
  at::parallel_for(0, rows * H, std::max<int64_t>(1, 65536 / (pmax * 8)), [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; item++)
      sums_p[item] = softmax_inplace(sp + item * pmax, span[item / H]);
  });
  const int64_t nq = rows * g, ng = (nq + 5) / 6, nd = (D + 15) / 16;
  at::parallel_for(0, Hkv * ng * nd, std::max<int64_t>(1, 65536 / (pmax * 16 * std::min<int64_t>(nq, 6))),
                   [&](int64_t i0, int64_t i1) {
    for (int64_t item = i0; item < i1; item++) {
      const int64_t kv = item / (ng * nd), grp = item / nd % ng, dc = item % nd;
      float* e[6];
      float* o[6];
      int64_t P[6];
      float sm[6];
      int Q = 0;
      for (int64_t qi = 6 * grp; qi < std::min(nq, 6 * grp + 6); qi++, Q++) {
        const int64_t r = qi / g, idx = r * H + kv * g + qi % g;
        e[Q] = sp + idx * pmax;
        o[Q] = op + idx * D;
        P[Q] = span[r];
        sm[Q] = sums_p[idx];
      }
      const float* vv = vp + kv * v.stride(0);
      const int64_t d0 = 16 * dc, d1 = std::min(D, d0 + 16), vs = v.stride(1);
      switch (Q) {
        case 6: weigh<6>(e, P, vv, vs, d0, d1, sm, o); break;
        case 5: weigh<5>(e, P, vv, vs, d0, d1, sm, o); break;
        case 4: weigh<4>(e, P, vv, vs, d0, d1, sm, o); break;
        case 3: weigh<3>(e, P, vv, vs, d0, d1, sm, o); break;
        case 2: weigh<2>(e, P, vv, vs, d0, d1, sm, o); break;
        default: weigh<1>(e, P, vv, vs, d0, d1, sm, o);
      }
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

MTPKIT_AOTI_SHIM(attend_rows,
                 (AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle pos, int64_t rows, AtenTensorHandle* ret0),
                 attend_rows(arg(q), arg(k), arg(v), arg(pos), rows))
