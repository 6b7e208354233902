// The row-wise attention of attend_rows.cpp (its header gives the maths and why it is
// written by hand), as a plan whose three passes any split of their items can run: through
// mtpkit_team::parallel_for (attend_rows) or by the threads of a caller's OpenMP region between its
// barriers (w8a8_block.cpp's w8a8_attn_post and w8a8_layer). An item's arithmetic does not depend on the
// split, so both give the same bits.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace mtpkit_attn {

// 512-bit forms of the score and weighted-value loops where the build has AVX-512 (F, DQ;
// kernels.py's wide build): every lane's arithmetic is the 256-bit form's, so both builds
// give the same bits.
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define MTPKIT_ATTN512 1
#else
#define MTPKIT_ATTN512 0
#endif


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

// dot8's last step: eight keys' lane sums a[0..7] (lanes over d) into one vector, lane j =
// key j.
inline __m256 reduce8(const __m256* a) {
  // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]: two levels give
  // [k0..k3 low-half sums | k0..k3 high-half sums] per four keys; the halves then add.
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
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
  return reduce8(a);
}

// s[j] = q . kj[j] * scale for the first n keys of a block, from dot8's sums r (dimensions
// past the last 8 added per key after the vector sum).
inline void finish_block(__m256 r, const float* q, const float* kj, int64_t ks, int64_t n,
                         int64_t D, int64_t Dv, float scale, float* s) {
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

#if MTPKIT_ATTN512
// dot8 for Q queries against one block, with two keys a 512-bit register (lanes 0-7 key
// 2p, 8-15 key 2p+1, over the same 8 dims) built once per 8 dims for all Q queries: each
// lane runs dot8's chain, and the halves go through its reduction, so every sum has dot8's
// bits with half its multiply-add instructions. The pass gains only 5-10% (the reductions
// and the block's bookkeeping stay).
template <int Q>
inline void dot8_q(const float* const* q, const float* kj, int64_t ks, int64_t Dv, __m256* r) {
  __m512 a[Q][4];
  for (int i = 0; i < Q; i++)
    for (int p = 0; p < 4; p++) a[i][p] = _mm512_setzero_ps();
  for (int64_t d = 0; d < Dv; d += 8) {
    __m512 kv[4];
    for (int p = 0; p < 4; p++)
      kv[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(kj + 2 * p * ks + d)),
                                 _mm256_loadu_ps(kj + (2 * p + 1) * ks + d), 1);
    for (int i = 0; i < Q; i++) {
      const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q[i] + d));
      for (int p = 0; p < 4; p++) a[i][p] = _mm512_fmadd_ps(qv, kv[p], a[i][p]);
    }
  }
  for (int i = 0; i < Q; i++) {
    __m256 h[8];
    for (int p = 0; p < 4; p++) {
      h[2 * p] = _mm512_castps512_ps256(a[i][p]);
      h[2 * p + 1] = _mm512_extractf32x8_ps(a[i][p], 1);
    }
    r[i] = reduce8(h);
  }
}
#endif

// Softmax of one head's scores s[0..P) in place, as exp(s - max); returns their sum.
inline float softmax_inplace(float* s, int64_t P) {
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
// 512 keys). Slots every query reads run without the per-query check.
template <int Q, int NB>
inline void weigh_lanes(float* const* e, const int64_t* P, int64_t pmin, int64_t pmax,
                        const float* v, int64_t vs, int64_t d, const float* sum,
                        float* const* out) {
  __m256 a[Q][NB];
  for (int q = 0; q < Q; q++)
    for (int c = 0; c < NB; c++) a[q][c] = _mm256_setzero_ps();
  const auto row = [&](int64_t i, bool all) {
    __m256 vv[NB];
    for (int c = 0; c < NB; c++) vv[c] = _mm256_loadu_ps(v + i * vs + d + 8 * c);
    for (int q = 0; q < Q; q++)
      if (all || i < P[q]) {
        const __m256 w = _mm256_set1_ps(e[q][i]);
        for (int c = 0; c < NB; c++) a[q][c] = _mm256_fmadd_ps(w, vv[c], a[q][c]);
      }
  };
  for (int64_t i = 0; i < pmin; i++) row(i, true);
  for (int64_t i = pmin; i < pmax; i++) row(i, false);
  for (int q = 0; q < Q; q++) {
    const __m256 sv = _mm256_set1_ps(sum[q]);
    for (int c = 0; c < NB; c++) _mm256_storeu_ps(out[q] + d + 8 * c, _mm256_div_ps(a[q][c], sv));
  }
}

#if MTPKIT_ATTN512
// weigh_lanes<Q, 2> in one 512-bit register a query: the same lanes, the same bits.
template <int Q>
inline void weigh16(float* const* e, const int64_t* P, int64_t pmin, int64_t pmax,
                    const float* v, int64_t vs, int64_t d, const float* sum, float* const* out) {
  __m512 a[Q];
  for (int q = 0; q < Q; q++) a[q] = _mm512_setzero_ps();
  const auto row = [&](int64_t i, bool all) {
    const __m512 vv = _mm512_loadu_ps(v + i * vs + d);
    for (int q = 0; q < Q; q++)
      if (all || i < P[q]) a[q] = _mm512_fmadd_ps(_mm512_set1_ps(e[q][i]), vv, a[q]);
  };
  for (int64_t i = 0; i < pmin; i++) row(i, true);
  for (int64_t i = pmin; i < pmax; i++) row(i, false);
  for (int q = 0; q < Q; q++)
    _mm512_storeu_ps(out[q] + d, _mm512_div_ps(a[q], _mm512_set1_ps(sum[q])));
}
#endif

// The weighted values of up to 6 queries of one KV head (e[q][0..P[q]), sums sum[q]) over
// dims [d0, d1), d1 - d0 <= 16: 16 lanes, 8 lanes, then one dim at a time.
template <int Q>
inline void weigh(float* const* e, const int64_t* P, const float* v, int64_t vs, int64_t d0,
           int64_t d1, const float* sum, float* const* out) {
  int64_t pmin = P[0], pmax = P[0];
  for (int q = 1; q < Q; q++) pmin = std::min(pmin, P[q]), pmax = std::max(pmax, P[q]);
  int64_t d = d0;
  if (d + 16 <= d1) {
#if MTPKIT_ATTN512
    weigh16<Q>(e, P, pmin, pmax, v, vs, d, sum, out);
#else
    weigh_lanes<Q, 2>(e, P, pmin, pmax, v, vs, d, sum, out);
#endif
    d += 16;
  }
  if (d + 8 <= d1) {
    weigh_lanes<Q, 1>(e, P, pmin, pmax, v, vs, d, sum, out);
    d += 8;
  }
  for (; d < d1; d++)
    for (int q = 0; q < Q; q++) {
      float a = 0.f;
      for (int64_t i = 0; i < P[q]; i++) a = std::fma(e[q][i], v[i * vs + d], a);
      out[q][d] = a / sum[q];
    }
}


// One call's attention: q [T, H, D] over a cache span k, v [Hkv, S, D]; row j (< rows) reads
// slots 0..min(pos[j], S-1); out [T, H, D] contiguous, rows past ``rows`` copies of the last.
//
// The work comes as items of three passes (scores, softmaxes, weighted values; callers with
// many threads and few queries split each pass and wait between them), or as the items of
// the one-pass form (pass0, where fused() says so): queries, each run through all three
// passes by one thread. Every query's
// arithmetic is the same in both (dot8 per 8-key block, softmax_inplace, weigh's
// lanes in slot order), so the split never changes a bit.
struct Attend {
  const float *qp, *kp, *vp;
  float* op = nullptr;  // out, set by the caller
  int64_t qt, qs, kh, ks, vh, vs;  // strides: q's row and head, k's and v's head and slot
  int64_t T, H, D, Hkv, S, rows, g, Dv, nb, pmax;
  float scale;
  std::vector<int64_t> span;  // span[j]: the slots row j reads
  float* sp = nullptr;        // scores [rows][H][pmax]
  float* sums = nullptr;      // softmax sums [rows][H]

  // Checks the operands and plans a call; then ``op`` and ``use(scratch() floats)``.
  Attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& pos_,
         int64_t rows_, const char* op = "attend_rows") {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
                op, ": q [T,H,D], k/v [Hkv,S,D]");
    TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                    v.scalar_type() == at::kFloat && pos_.scalar_type() == at::kLong,
                op, ": float32 q/k/v, int64 pos");
    TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == q.size(2) && k.size(0) > 0 &&
                    q.size(1) % k.size(0) == 0,
                op, ": shapes differ");
    TORCH_CHECK(pos_.dim() == 1 && pos_.size(0) == q.size(0), op, ": pos [T]");
    TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
                op, ": q/k/v need contiguous rows");
    const at::Tensor pos = pos_.contiguous();
    plan(q.data_ptr<float>(), q.stride(0), q.stride(1), k.data_ptr<float>(), k.stride(0),
         k.stride(1), v.data_ptr<float>(), v.stride(0), v.stride(1), q.size(0), q.size(1),
         k.size(0), k.size(1), q.size(2), pos.data_ptr<int64_t>(), rows_, op);
  }

  // The same plan from raw operands whose shapes the caller checked (w8a8_layer: its own
  // rotated queries and its caches' first S slots, without the cost of making the two
  // caches' views as tensors).
  Attend(const float* q, int64_t qt_, int64_t qs_, const float* k, int64_t kh_, int64_t ks_,
         const float* v, int64_t vh_, int64_t vs_, int64_t T_, int64_t H_, int64_t Hkv_,
         int64_t S_, int64_t D_, const int64_t* pp, int64_t rows_, const char* op) {
    plan(q, qt_, qs_, k, kh_, ks_, v, vh_, vs_, T_, H_, Hkv_, S_, D_, pp, rows_, op);
  }

  int64_t scratch() const { return rows * H * pmax + rows * H; }
  void use(float* buf) { sp = buf, sums = buf + rows * H * pmax; }

  // Items of the one-pass form: the (KV head, row, head of its group) queries in that order,
  // so that a thread's share meets each KV head's rows once.
  int64_t items0() const { return Hkv * rows * g; }
  // Whether ``nth`` threads should take the one-pass form: each gets a few queries (with
  // fewer, two barriers cost less than the idle threads).
  bool fused(int64_t nth) const { return items0() >= 4 * nth; }
  void pass0(int64_t i0, int64_t i1) const {
    const int64_t per = rows * g;
    // The share's cache rows, asked for all at once before the first score (up to half a
    // Zen 5 core's L2): score_blocks' prefetches run only a few blocks ahead of its reads,
    // and each KV head's short streams started cold. Warming them first made decoding and
    // verification faster; at long spans, warming the whole span (more than the L2 holds)
    // gained nothing, hence the cap at half an L2.
    if (i1 > i0) {
      constexpr int64_t kWarm = 512 * 1024;
      const int64_t kv0 = i0 / per, kv1 = std::min(Hkv, (i1 + per - 1) / per);
      const int64_t n = std::min(pmax, kWarm / ((kv1 - kv0) * 8 * D));
      for (int64_t kv = kv0; kv < kv1; kv++) {
        fetch_rows<_MM_HINT_T1>(kp + kv * kh, ks, 0, n, D);
        fetch_rows<_MM_HINT_T1>(vp + kv * vh, vs, 0, n, D);
      }
    }
    for (int64_t kv = i0 / per; kv < Hkv && kv * per < i1; kv++) {
      const int64_t lo = std::max(i0, kv * per) - kv * per;
      const int64_t hi = std::min(i1, (kv + 1) * per) - kv * per;
      score_blocks(kv * nb, (kv + 1) * nb, lo, hi);
      for (int64_t qi = lo; qi < hi; qi++) {
        const int64_t idx = slot(kv, qi);
        sums[idx] = softmax_inplace(sp + idx * pmax, span[qi / g]);
      }
      for (int64_t dc = 0; dc < (D + 15) / 16; dc++)
        for (int64_t q0 = lo; q0 < hi; q0 += 6) weigh_group(kv, q0, std::min(hi, q0 + 6), dc);
    }
  }

  // Pass 1 over (KV head, 8-key block) items: a block's keys come from memory once and
  // from L1 for every row's query heads of that KV head (at 512 keys a pass per query head
  // ran at L2's speed).
  int64_t items1() const { return Hkv * nb; }
  void pass1(int64_t i0, int64_t i1) const { score_blocks(i0, i1, 0, rows * g); }

  // Pass 2: each (row, head)'s softmax.
  int64_t items2() const { return rows * H; }
  void pass2(int64_t i0, int64_t i1) const {
    for (int64_t item = i0; item < i1; item++)
      sums[item] = softmax_inplace(sp + item * pmax, span[item / H]);
  }

  // Pass 3 over (KV head, group of 6 of its queries, 16 dims) items: the weighted sums of
  // the values.
  int64_t groups() const { return (rows * g + 5) / 6; }
  int64_t items3() const { return Hkv * groups() * ((D + 15) / 16); }
  void pass3(int64_t i0, int64_t i1) const {
    const int64_t nq = rows * g, ng = groups(), nd = (D + 15) / 16;
    for (int64_t item = i0; item < i1; item++) {
      const int64_t kv = item / (ng * nd), grp = item / nd % ng;
      weigh_group(kv, 6 * grp, std::min(nq, 6 * grp + 6), item % nd);
    }
  }

  // Rows past ``rows`` (padding) as copies of the last attended one.
  void pad_rows() const {
    for (int64_t j = rows; j < T; j++)
      std::copy(op + (rows - 1) * H * D, op + rows * H * D, op + j * H * D);
  }

 private:
  void plan(const float* q, int64_t qt_, int64_t qs_, const float* k, int64_t kh_, int64_t ks_,
            const float* v, int64_t vh_, int64_t vs_, int64_t T_, int64_t H_, int64_t Hkv_,
            int64_t S_, int64_t D_, const int64_t* pp, int64_t rows_, const char* op) {
    T = T_, H = H_, D = D_, Hkv = Hkv_, S = S_;
    TORCH_CHECK(rows_ >= 1 && rows_ <= T, op, ": 1 <= rows <= T");
    rows = rows_;
    span.resize(rows);
    pmax = 0;
    for (int64_t j = 0; j < rows; j++) {
      TORCH_CHECK(pp[j] >= 0, op, ": negative position");
      span[j] = std::min(pp[j] + 1, S);
      pmax = std::max(pmax, span[j]);
    }
    qp = q, kp = k, vp = v;
    qt = qt_, qs = qs_, kh = kh_, ks = ks_, vh = vh_, vs = vs_;
    g = H / Hkv;
    scale = 1.0f / std::sqrt(float(D));
    Dv = D - D % 8, nb = (pmax + 7) / 8;
  }

  // Query qi of KV head kv (row qi / g, head kv * g + qi % g) as a (row, head) index.
  int64_t slot(int64_t kv, int64_t qi) const { return qi / g * H + kv * g + qi % g; }

  // Scores of queries [q0, q1) of each (KV head, 8-key block) item in [i0, i1). Keys past
  // a row's position but inside the buffer are read with the block and their lanes dropped
  // (lanes never mix); only a block past the buffer's end is copied, zero-filled, into
  // ``pad``.
  void score_blocks(int64_t i0, int64_t i1, int64_t q0, int64_t q1) const {
    thread_local std::vector<float> pad;
    // The cache rows a step reads were last touched a step (a whole weight stream) ago and
    // come from memory in short per-head streams the hardware prefetcher barely ramps up
    // on, so a layer's attention ran far below the memory's speed. Each item asks for the
    // keys kAhead items on and its own block's values, which the weighted sums then find in
    // L2.
    constexpr int64_t kAhead = 4;
    const auto keys_of = [&](int64_t item) {
      const int64_t j0 = 8 * (item % nb);
      fetch_rows<_MM_HINT_T0>(kp + item / nb * kh, ks, j0, std::min<int64_t>(8, S - j0), D);
    };
    for (int64_t item = i0; item < std::min(i1, i0 + kAhead); item++) keys_of(item);
    for (int64_t item = i0; item < i1; item++) {
      const int64_t kv = item / nb, j0 = 8 * (item % nb);
      if (item + kAhead < i1) keys_of(item + kAhead);
      fetch_rows<_MM_HINT_T1>(vp + kv * vh, vs, j0, std::min<int64_t>(8, S - j0), D);
      const float* kj = kp + kv * kh + j0 * ks;
      int64_t kstride = ks;
      const int64_t avail = std::min<int64_t>(8, S - j0);
      if (avail < 8) {
        pad.assign(8 * D, 0.0f);
        for (int64_t j = 0; j < avail; j++)
          std::copy(kj + j * kstride, kj + j * kstride + D, pad.data() + j * D);
        kj = pad.data();
        kstride = D;
      }
      // The queries that read this block, four at a time (dot8_q shares the key loads).
      const float* qs4[4];
      float* s4[4];
      int64_t n4[4];
      int c = 0;
      const auto flush = [&]() {
        __m256 r[4];
#if MTPKIT_ATTN512
        switch (c) {
          case 4: dot8_q<4>(qs4, kj, kstride, Dv, r); break;
          case 3: dot8_q<3>(qs4, kj, kstride, Dv, r); break;
          case 2: dot8_q<2>(qs4, kj, kstride, Dv, r); break;
          default: dot8_q<1>(qs4, kj, kstride, Dv, r);
        }
#else
        for (int i = 0; i < c; i++) r[i] = dot8(qs4[i], kj, kstride, Dv);
#endif
        for (int i = 0; i < c; i++) finish_block(r[i], qs4[i], kj, kstride, n4[i], D, Dv, scale, s4[i]);
        c = 0;
      };
      for (int64_t qi = q0; qi < q1; qi++) {
        const int64_t r = qi / g, P = span[r];
        if (j0 >= P) continue;
        const int64_t h = kv * g + qi % g;
        qs4[c] = qp + r * qt + h * qs;
        s4[c] = sp + (r * H + h) * pmax + j0;
        n4[c] = std::min<int64_t>(8, P - j0);
        if (++c == 4) flush();
      }
      if (c) flush();
    }
  }

  // The weighted values of queries [q0, q1) (at most 6) of KV head kv over the 16 dims of
  // chunk dc.
  void weigh_group(int64_t kv, int64_t q0, int64_t q1, int64_t dc) const {
    float* e[6];
    float* o[6];
    int64_t P[6];
    float sm[6];
    int Q = 0;
    for (int64_t qi = q0; qi < q1; qi++, Q++) {
      const int64_t idx = slot(kv, qi);
      e[Q] = sp + idx * pmax;
      o[Q] = op + idx * D;
      P[Q] = span[qi / g];
      sm[Q] = sums[idx];
    }
    const float* vv = vp + kv * vh;
    const int64_t d0 = 16 * dc, d1 = std::min(D, d0 + 16);
    switch (Q) {
      case 6: weigh<6>(e, P, vv, vs, d0, d1, sm, o); break;
      case 5: weigh<5>(e, P, vv, vs, d0, d1, sm, o); break;
      case 4: weigh<4>(e, P, vv, vs, d0, d1, sm, o); break;
      case 3: weigh<3>(e, P, vv, vs, d0, d1, sm, o); break;
      case 2: weigh<2>(e, P, vv, vs, d0, d1, sm, o); break;
      default: weigh<1>(e, P, vv, vs, d0, d1, sm, o);
    }
  }
};

}  // namespace mtpkit_attn
#endif
