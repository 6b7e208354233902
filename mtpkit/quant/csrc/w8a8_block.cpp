// A decoder layer's W8A8 GEMMs with the small steps between them, each group in one OpenMP
// region (the compiled steps of row-exact W8A8 trunks call these; engine/fast.py):
//
// mtpkit::w8a8_pre(x, ln, eps, w, s, colsum) -> y = qkv(rmsnorm(x) * ln)
// mtpkit::w8a8_post(a, x, o.., ln, eps, gate_up.., down.., inter) -> out, with
//   h = x + o(a);  [g, u] = gate_up(rmsnorm(h) * ln);  out = h + down(silu(g) * u)
// mtpkit::w8a8_attn_post(q, k, v, pos, rows, x, o.., ..) -> w8a8_post(attend_rows(q, k, v,
//   pos, rows), x, o.., ..), the attention's passes (attend.h) run by the same team
// mtpkit::w8a8_layer(x, ln1, eps1, qkv.., cos, sin, kbuf!, vbuf!, pos, span, rows, heads,
//   o.., ..) -> the whole layer: q/k/v = w8a8_pre(x, ..), q and k rotated (Rotary.apply's
//   half rotation, its roundings), k and v written to the caches [1, Hkv, L, hd] at pos,
//   then w8a8_attn_post over the first span slots
// x, a float32 [T, *]; each GEMM is int8_a8_mm's (packed weights, scales, column sums from
// linear.pack_a8, inter = the MLP's width, gate_up's columns [0, inter) being the gate's);
// rmsnorm(v) = v / sqrt(mean(v^2) + eps), in float32.
//
// Why: with a parallel region per GEMM (121 a SmolLM2 decode step), each a fork and a join
// of the OpenMP team, the weight stream idles around every call. SmolLM2's GEMMs alone, from
// C++, streamed at the machine's read bandwidth with one region per layer and barriers
// between its GEMMs (~90 GB/s against 72-78 for a region per GEMM). In the compiled steps
// the gain is smaller (verification 3-7%; attention and glue remain between the regions;
// docs/benchmarks.md, session 24). The whole layer in one region (w8a8_layer, session 25)
// takes the attention's three forks and the glue between the ops out too: verification of
// 4 rows 3-9% faster, a decode step 0-4% (the cache rows' latency stays: ~25 GB/s).
//
// Exactness: every output row is computed from its own input row only, in one fixed order
// whatever the row count, the thread count or the thread split (the GEMMs' integer sums are
// exact; norms, SiLU and residuals are the same code on every row, and where threads
// compute the same row's norm they compute the same bits), so a verified row equals the
// one-token step (engine/fast.py's row-exact steps rely on it).
//
// SiLU's exp: ATen's vectorized one (Sleef), as inductor's generated code uses; 256-bit.
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "aoti_shim.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#include "attend.h"
#include "int8_a8.h"
#include "simd.h"

namespace {

using mtpkit_a8::a8_rows;
using mtpkit_simd::hsum;
using mtpkit_simd::over_rows;
using mtpkit_simd::quantize_rows;

// One packed W8A8 weight (linear.pack_a8): [N16, K4] codes, scales and column sums [N16].
struct Packed {
  const int8_t* w;
  const float* s;
  const int32_t* colsum;
  int64_t N16, K4;
};

Packed packed(const at::Tensor& w, const at::Tensor& s, const at::Tensor& colsum, int64_t K,
              const char* name) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous() &&
                  s.scalar_type() == at::kFloat && s.is_contiguous() &&
                  colsum.scalar_type() == at::kInt && colsum.is_contiguous(),
              "w8a8 block: ", name, " must be contiguous packed int8, float32 scales, int32 sums");
  const int64_t N16 = w.size(0), K4 = w.size(1);
  TORCH_CHECK(N16 % 16 == 0 && K4 == (K + 3) / 4 * 4 && s.numel() == N16 &&
                  colsum.numel() == N16 && K < (1 << 17),
              "w8a8 block: ", name, " packed for another shape (N16 ", N16, ", K4 ", K4,
              ", input width ", K, ")");
  return {w.data_ptr<int8_t>(), s.data_ptr<float>(), colsum.data_ptr<int32_t>(), N16, K4};
}

// This thread's share of the column blocks of a GEMM with N16 columns.
inline void share(int64_t N16, int t, int nt, int64_t& b0, int64_t& b1) {
  const int64_t nb = N16 / 16;
  b0 = nb * t / nt;
  b1 = nb * (t + 1) / nt;
}

// Quantized rows q [T, K4] (scales xs [T]) against this thread's columns of w -> y [T, N16].
void gemm_share(const int8_t* q, const float* xs, int64_t T, const Packed& w, float* y, int t,
                int nt) {
  int64_t b0, b1;
  share(w.N16, t, nt, b0, b1);
  if (b0 == b1) return;
  over_rows(T, [&](auto R, int64_t m) {
    a8_rows<R.value>(q + m * w.K4, xs + m, w.K4, w.w, w.s, w.colsum, y + m * w.N16, w.N16, b0, b1);
  });
}

// y[k] = ln[k] * (x[k] / sqrt(mean(x^2) + eps)) for one row of D, in a fixed order.
void rmsnorm_row(const float* x, const float* ln, float eps, int64_t D, float* y) {
  __m256 acc = _mm256_setzero_ps();
  const int64_t Dv = D - D % 8;
  for (int64_t k = 0; k < Dv; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (int64_t k = Dv; k < D; k++) ss = std::fma(x[k], x[k], ss);
  const float r = 1.f / std::sqrt(ss / float(D) + eps);
  for (int64_t k = 0; k < D; k++) y[k] = ln[k] * (x[k] * r);
}

// silu(g) * u = g / (1 + exp(-g)) * u over [i0, i1) of one row.
void silu_mul(const float* g, const float* u, float* y, int64_t i0, int64_t i1) {
  using V = at::vec::Vectorized<float>;
  int64_t i = i0;
  for (; i + V::size() <= i1; i += V::size()) {
    const V gv = V::loadu(g + i);
    (gv / (V(1.f) + gv.neg().exp()) * V::loadu(u + i)).store(y + i);
  }
  for (; i < i1; i++) y[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
}

// Per-thread scratch, reused across calls (a step makes 60 of these calls).
struct Scratch {
  std::vector<float> f;
  std::vector<int8_t> q;
  std::vector<float> xs;
  void fit(int64_t nf, int64_t nq, int64_t nx) {
    if ((int64_t)f.size() < nf) f.resize(nf);
    if ((int64_t)q.size() < nq) q.resize(nq);
    if ((int64_t)xs.size() < nx) xs.resize(nx);
  }
};

constexpr uint8_t kFlip = MTPKIT_VNNI ? 0x80 : 0;  // a8_rows' activation form

// rmsnorm(x) * ln of T rows of D into buf, quantized into s, against this thread's columns
// of w -> y (w8a8_pre's work, and w8a8_layer's first stage).
void norm_gemm_share(const float* x, const float* ln, float eps, int64_t T, int64_t D,
                     const Packed& w, float* y, Scratch& s, float* buf, int t, int nt) {
  for (int64_t m = 0; m < T; m++) rmsnorm_row(x + m * D, ln, eps, D, buf + m * D);
  quantize_rows(buf, T, D, s.q.data(), s.xs.data(), w.K4, kFlip);
  gemm_share(s.q.data(), s.xs.data(), T, w, y, t, nt);
}

std::vector<Scratch>& scratch(int nt) {
  thread_local std::vector<Scratch> s;  // the calling thread's; its team writes into it
  if ((int)s.size() < nt) s.resize(nt);
  return s;
}

int team() {
  // Inside another parallel region (a caller's at::parallel_for) the work runs on this
  // thread alone, as at::parallel_for would run it.
  return omp_in_parallel() ? 1 : std::max(1, at::get_num_threads());
}

void check_rows(const at::Tensor& x, int64_t D, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == D,
              "w8a8 block: ", name, " must be float32 [T, ", D, "]");
}

at::Tensor contig_vec(const at::Tensor& v, int64_t D, const char* name) {
  TORCH_CHECK(v.dim() == 1 && v.scalar_type() == at::kFloat && v.size(0) == D,
              "w8a8 block: ", name, " must be float32 [", D, "]");
  return v.contiguous();
}

}  // namespace

static at::Tensor w8a8_pre(const at::Tensor& x_, const at::Tensor& ln_, double eps,
                           const at::Tensor& w_, const at::Tensor& s_, const at::Tensor& c_) {
  TORCH_CHECK(x_.dim() == 2, "w8a8_pre: x must be [T, D]");
  const int64_t T = x_.size(0), D = x_.size(1);
  check_rows(x_, D, "x");
  const at::Tensor x = x_.contiguous(), ln = contig_vec(ln_, D, "ln");
  const Packed w = packed(w_, s_, c_, D, "the weight");
  at::Tensor y = at::empty({T, w.N16}, x.options());
  const int nt = team();
  auto& sc = scratch(nt);
  for (auto& s : sc) s.fit(T * D, T * w.K4, T);
  const float* xp = x.data_ptr<float>();
  const float* lnp = ln.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int t = omp_get_thread_num();
    // The team OpenMP gave (num_threads is a request): every share is split by it.
    const int nth = omp_get_num_threads();
    Scratch& s = sc[t];
    norm_gemm_share(xp, lnp, float(eps), T, D, w, yp, s, s.f.data(), t, nth);
  }
  return y;
}

// w8a8_layer's first stage: the input norm and the q/k/v GEMM into yq, then each row's heads
// rotated (q into qrot [T, H, D] for the attention, k into the cache) and v copied to it.
struct Pre {
  const float* x;
  const float* ln;
  float eps;
  Packed w;
  int64_t Dm;
  const float *cos, *sin;  // [T, R]
  int64_t R;
  float *kb, *vb;          // the layer's caches [1, Hkv, L, D]
  int64_t k1, k2, v1, v2;  // their head and slot strides
  const int64_t* pos;
  int64_t H, Hkv, D;
  float *yq, *qrot;
};

// dst = the rotary of one head's src (HF half rotation over its first R channels; the rest
// pass through), as Rotary.apply computes it: a product, a product and a sum, each rounded
// (no fused multiply-add), so it gives eager PyTorch's bits.
__attribute__((optimize("fp-contract=off"))) static void rope_head(const float* src, const float* c,
                                                           const float* sn, int64_t R, int64_t D,
                                                           float* dst) {
  const int64_t h = R / 2;
  for (int64_t i = 0; i < h; i++) {
    const float a = src[i] * c[i], b = src[i + h] * sn[i];
    dst[i] = a - b;
  }
  for (int64_t i = h; i < R; i++) {
    const float a = src[i] * c[i], b = src[i - h] * sn[i];
    dst[i] = a + b;
  }
  for (int64_t i = R; i < D; i++) dst[i] = src[i];
}

// w8a8_post's work, its first GEMM's input being a [T, A] or, with ``att``, that attention's
// output (computed by the same team first: each thread's queries in one pass, or the three
// passes split between barriers where the team is too large for that, Attend::fused).
static at::Tensor post_impl(const char* op, const at::Tensor* a_, mtpkit_attn::Attend* att,
                            Pre* pre, const at::Tensor& x_,
                            const at::Tensor& ow_, const at::Tensor& os_, const at::Tensor& oc_,
                            const at::Tensor& ln_, double eps, const at::Tensor& guw_,
                            const at::Tensor& gus_, const at::Tensor& guc_, const at::Tensor& dw_,
                            const at::Tensor& ds_, const at::Tensor& dc_, int64_t inter) {
  TORCH_CHECK(x_.dim() == 2, op, ": x must be [T, D]");
  const int64_t T = x_.size(0), D = x_.size(1), I = inter;
  TORCH_CHECK(att ? att->T == T : (a_->dim() == 2 && a_->size(0) == T), op,
              att ? ": q [T, H, hd] and x [T, D]" : ": a [T, A] and x [T, D]");
  const int64_t A = att ? att->H * att->D : a_->size(1);
  at::Tensor a;
  if (!att) {
    check_rows(*a_, A, "a");
    a = a_->contiguous();
  }
  check_rows(x_, D, "x");
  const at::Tensor x = x_.contiguous(), ln = contig_vec(ln_, D, pre ? "ln2" : "ln");
  const Packed o = packed(ow_, os_, oc_, A, "o_proj"), gu = packed(guw_, gus_, guc_, D, "gate_up"),
               dn = packed(dw_, ds_, dc_, I, "down_proj");
  TORCH_CHECK(o.N16 >= D && gu.N16 >= 2 * I && dn.N16 >= D,
              op, ": o_proj / down_proj must give D columns and gate_up 2 * inter");
  // at::empty's dispatch cost ~10 us a step (30 calls; in-process A/B, session 27).
  at::Tensor out = at::detail::empty_cpu({T, D}, at::kFloat, /*pin_memory=*/false);
  // Shared between the threads: the attention's output and scratch, each GEMM's output
  // rows, and the MLP's activations.
  thread_local std::vector<float> shared;
  const int64_t n_att = att ? T * A + att->scratch() : 0;
  const int64_t n_o = T * o.N16, n_gu = T * gu.N16, n_dn = T * dn.N16, n_act = T * I;
  const int64_t n_all = n_att + n_o + n_gu + n_dn + n_act;
  if ((int64_t)shared.size() < n_all) shared.resize(n_all);
  float* yo = shared.data() + n_att;
  float* ygu = yo + n_o;
  float* ydn = ygu + n_gu;
  float* act = ydn + n_dn;
  if (att) {
    att->op = shared.data();
    att->use(shared.data() + T * A);
  }
  const int nt = team();
  auto& sc = scratch(nt);
  const int64_t K4max = std::max({o.K4, gu.K4, dn.K4, pre ? pre->w.K4 : int64_t(0)});
  for (auto& s : sc) s.fit(2 * T * D + T * I, T * K4max, T);
  const float* ap = att ? shared.data() : a.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* lnp = ln.data_ptr<float>();
  float* outp = out.data_ptr<float>();
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int t = omp_get_thread_num();
    // The team OpenMP gave (num_threads is a request): every share is split by it.
    const int nth = omp_get_num_threads();
    Scratch& s = sc[t];
    float* h = s.f.data();  // [T, D]: x + o(a), this thread's copy
    float* hn = h + T * D;  // [T, D]: its norm
    if (pre) {
      norm_gemm_share(pre->x, pre->ln, pre->eps, T, pre->Dm, pre->w, pre->yq, s, hn, t, nth);
#pragma omp barrier
      // Every row's heads, padding rows too (their cache slots are written before any read).
      const int64_t per = pre->H + 2 * pre->Hkv, n = T * per, Dh = pre->D;
      for (int64_t item = n * t / nth; item < n * (t + 1) / nth; item++) {
        const int64_t m = item / per, c = item % per;
        const float* row = pre->yq + m * pre->w.N16 + c * Dh;
        const float* cs = pre->cos + m * pre->R;
        const float* sn = pre->sin + m * pre->R;
        if (c < pre->H)
          rope_head(row, cs, sn, pre->R, Dh, pre->qrot + (m * pre->H + c) * Dh);
        else if (c < pre->H + pre->Hkv)
          rope_head(row, cs, sn, pre->R, Dh,
                    pre->kb + (c - pre->H) * pre->k1 + pre->pos[m] * pre->k2);
        else
          std::copy(row, row + Dh,
                    pre->vb + (c - pre->H - pre->Hkv) * pre->v1 + pre->pos[m] * pre->v2);
      }
#pragma omp barrier
    }
    if (att) {
      // Even splits of each pass's items: inside the region a split costs a barrier, not a
      // fork, so even a short span's work is shared.
      if (att->fused(nth)) {
        const int64_t n0 = att->items0();
        att->pass0(n0 * t / nth, n0 * (t + 1) / nth);
      } else {
        const int64_t n1 = att->items1(), n2 = att->items2(), n3 = att->items3();
        att->pass1(n1 * t / nth, n1 * (t + 1) / nth);
#pragma omp barrier
        att->pass2(n2 * t / nth, n2 * (t + 1) / nth);
#pragma omp barrier
        att->pass3(n3 * t / nth, n3 * (t + 1) / nth);
      }
#pragma omp barrier
      if (att->rows < T) {
        if (t == 0) att->pad_rows();
#pragma omp barrier
      }
    }
    quantize_rows(ap, T, A, s.q.data(), s.xs.data(), o.K4, kFlip);
    gemm_share(s.q.data(), s.xs.data(), T, o, yo, t, nth);
#pragma omp barrier
    for (int64_t m = 0; m < T; m++) {
      for (int64_t k = 0; k < D; k++) h[m * D + k] = xp[m * D + k] + yo[m * o.N16 + k];
      rmsnorm_row(h + m * D, lnp, float(eps), D, hn + m * D);
    }
    quantize_rows(hn, T, D, s.q.data(), s.xs.data(), gu.K4, kFlip);
    gemm_share(s.q.data(), s.xs.data(), T, gu, ygu, t, nth);
#pragma omp barrier
    // The activations split by column, then every thread quantizes whole rows.
    const int64_t i0 = I * t / nth, i1 = I * (t + 1) / nth;
    for (int64_t m = 0; m < T; m++)
      silu_mul(ygu + m * gu.N16, ygu + m * gu.N16 + I, act + m * I, i0, i1);
#pragma omp barrier
    quantize_rows(act, T, I, s.q.data(), s.xs.data(), dn.K4, kFlip);
    gemm_share(s.q.data(), s.xs.data(), T, dn, ydn, t, nth);
    int64_t b0, b1;
    share(dn.N16, t, nth, b0, b1);
    const int64_t c1 = std::min(D, 16 * b1);
    for (int64_t m = 0; m < T; m++)
      for (int64_t k = 16 * b0; k < c1; k++) outp[m * D + k] = h[m * D + k] + ydn[m * dn.N16 + k];
  }
  return out;
}

static at::Tensor w8a8_post(const at::Tensor& a, const at::Tensor& x, const at::Tensor& ow,
                            const at::Tensor& os, const at::Tensor& oc, const at::Tensor& ln,
                            double eps, const at::Tensor& guw, const at::Tensor& gus,
                            const at::Tensor& guc, const at::Tensor& dw, const at::Tensor& ds,
                            const at::Tensor& dc, int64_t inter) {
  return post_impl("w8a8_post", &a, nullptr, nullptr, x, ow, os, oc, ln, eps, guw, gus, guc, dw, ds, dc,
                   inter);
}

static at::Tensor w8a8_attn_post(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& pos, int64_t rows, const at::Tensor& x,
                                 const at::Tensor& ow, const at::Tensor& os, const at::Tensor& oc,
                                 const at::Tensor& ln, double eps, const at::Tensor& guw,
                                 const at::Tensor& gus, const at::Tensor& guc, const at::Tensor& dw,
                                 const at::Tensor& ds, const at::Tensor& dc, int64_t inter) {
  mtpkit_attn::Attend att(q, k, v, pos, rows, "w8a8_attn_post");
  return post_impl("w8a8_attn_post", nullptr, &att, nullptr, x, ow, os, oc, ln, eps, guw, gus, guc, dw, ds, dc,
                   inter);
}

static at::Tensor w8a8_layer(const at::Tensor& x_, const at::Tensor& ln1_, double eps1,
                             const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& qc,
                             const at::Tensor& cos_, const at::Tensor& sin_, at::Tensor& kbuf,
                             at::Tensor& vbuf, const at::Tensor& pos_, int64_t span, int64_t rows,
                             int64_t heads, const at::Tensor& ow, const at::Tensor& os,
                             const at::Tensor& oc, const at::Tensor& ln2, double eps2,
                             const at::Tensor& guw, const at::Tensor& gus, const at::Tensor& guc,
                             const at::Tensor& dw, const at::Tensor& ds, const at::Tensor& dc,
                             int64_t inter) {
  TORCH_CHECK(x_.dim() == 2, "w8a8_layer: x must be [T, D]");
  const int64_t T = x_.size(0), Dm = x_.size(1);
  check_rows(x_, Dm, "x");
  const at::Tensor x = x_.contiguous(), ln1 = contig_vec(ln1_, Dm, "ln1");
  TORCH_CHECK(kbuf.dim() == 4 && kbuf.size(0) == 1 && kbuf.sizes() == vbuf.sizes() &&
                  kbuf.scalar_type() == at::kFloat && vbuf.scalar_type() == at::kFloat &&
                  kbuf.stride(3) == 1 && vbuf.stride(3) == 1,
              "w8a8_layer: caches must be float32 [1, Hkv, L, hd] with contiguous rows");
  const int64_t Hkv = kbuf.size(1), L = kbuf.size(2), D = kbuf.size(3), H = heads;
  TORCH_CHECK(Hkv > 0 && H > 0 && H % Hkv == 0 && span >= 1 && span <= L,
              "w8a8_layer: heads a multiple of the KV heads, 1 <= span <= cache length");
  const Packed w = packed(qw, qs, qc, Dm, "q/k/v");
  TORCH_CHECK(w.N16 >= (H + 2 * Hkv) * D, "w8a8_layer: q/k/v gives fewer than (H + 2 Hkv) hd columns");
  const at::Tensor cos = cos_.contiguous(), sin = sin_.contiguous();
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == T &&
                  cos.size(1) % 2 == 0 && cos.size(1) <= D && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "w8a8_layer: cos/sin must be float32 [T, R], R even and at most hd");
  const at::Tensor pos = pos_.contiguous();
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == T && pos.scalar_type() == at::kLong,
              "w8a8_layer: pos must be int64 [T]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t j = 0; j < T; j++)
    TORCH_CHECK(pp[j] >= 0 && pp[j] < L, "w8a8_layer: a position past the cache");
  // The q/k/v rows and the rotated queries, for this call (the attention plan reads qrot).
  thread_local std::vector<float> qbuf;
  if ((int64_t)qbuf.size() < T * w.N16 + T * H * D) qbuf.resize(T * w.N16 + T * H * D);
  float* qrot = qbuf.data() + T * w.N16;
  mtpkit_attn::Attend att(qrot, H * D, D, kbuf.data_ptr<float>(), kbuf.stride(1), kbuf.stride(2),
                          vbuf.data_ptr<float>(), vbuf.stride(1), vbuf.stride(2), T, H, Hkv,
                          span, D, pp, rows, "w8a8_layer");
  Pre pre{x.data_ptr<float>(), ln1.data_ptr<float>(), float(eps1), w, Dm,
          cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(1),
          kbuf.data_ptr<float>(), vbuf.data_ptr<float>(), kbuf.stride(1), kbuf.stride(2),
          vbuf.stride(1), vbuf.stride(2), pp, H, Hkv, D, qbuf.data(), qrot};
  return post_impl("w8a8_layer", nullptr, &att, &pre, x, ow, os, oc, ln2, eps2, guw, gus, guc, dw, ds, dc,
                   inter);
}

#else
static at::Tensor w8a8_pre(const at::Tensor&, const at::Tensor&, double, const at::Tensor&,
                           const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "w8a8_pre was built without AVX2/FMA");
}
static at::Tensor w8a8_post(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "w8a8_post was built without AVX2/FMA");
}
static at::Tensor w8a8_attn_post(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "w8a8_attn_post was built without AVX2/FMA");
}
static at::Tensor w8a8_layer(const at::Tensor&, const at::Tensor&, double, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                             int64_t, int64_t, int64_t, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, double, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "w8a8_layer was built without AVX2/FMA");
}
#endif

TORCH_LIBRARY_FRAGMENT(mtpkit, m) {
  m.def("w8a8_pre(Tensor x, Tensor ln, float eps, Tensor w, Tensor s, Tensor colsum) -> Tensor");
  m.def("w8a8_post(Tensor a, Tensor x, Tensor o_w, Tensor o_s, Tensor o_colsum, Tensor ln, "
        "float eps, Tensor gu_w, Tensor gu_s, Tensor gu_colsum, Tensor down_w, Tensor down_s, "
        "Tensor down_colsum, int inter) -> Tensor");
  m.def("w8a8_attn_post(Tensor q, Tensor k, Tensor v, Tensor pos, int rows, Tensor x, "
        "Tensor o_w, Tensor o_s, Tensor o_colsum, Tensor ln, float eps, Tensor gu_w, "
        "Tensor gu_s, Tensor gu_colsum, Tensor down_w, Tensor down_s, Tensor down_colsum, "
        "int inter) -> Tensor");
  m.def("w8a8_layer(Tensor x, Tensor ln1, float eps1, Tensor qkv_w, Tensor qkv_s, "
        "Tensor qkv_colsum, Tensor cos, Tensor sin, Tensor(a!) kbuf, Tensor(b!) vbuf, "
        "Tensor pos, SymInt span, int rows, int heads, Tensor o_w, Tensor o_s, Tensor o_colsum, "
        "Tensor ln2, float eps2, Tensor gu_w, Tensor gu_s, Tensor gu_colsum, Tensor down_w, "
        "Tensor down_s, Tensor down_colsum, int inter) -> Tensor");
}
TORCH_LIBRARY_IMPL(mtpkit, CPU, m) {
  m.impl("w8a8_pre", &w8a8_pre);
  m.impl("w8a8_post", &w8a8_post);
  m.impl("w8a8_attn_post", &w8a8_attn_post);
  m.impl("w8a8_layer", &w8a8_layer);
}

MTPKIT_AOTI_SHIM(w8a8_pre,
                 (AtenTensorHandle x, AtenTensorHandle ln, double eps, AtenTensorHandle w,
                  AtenTensorHandle s, AtenTensorHandle colsum, AtenTensorHandle* ret0),
                 (x, ln, w, s, colsum),
                 w8a8_pre(arg(x), arg(ln), eps, arg(w), arg(s), arg(colsum)))
MTPKIT_AOTI_SHIM(w8a8_post,
                 (AtenTensorHandle a, AtenTensorHandle x, AtenTensorHandle o_w, AtenTensorHandle o_s,
                  AtenTensorHandle o_colsum, AtenTensorHandle ln, double eps,
                  AtenTensorHandle gu_w, AtenTensorHandle gu_s, AtenTensorHandle gu_colsum,
                  AtenTensorHandle down_w, AtenTensorHandle down_s, AtenTensorHandle down_colsum,
                  int64_t inter, AtenTensorHandle* ret0),
                 (a, x, o_w, o_s, o_colsum, ln, gu_w, gu_s, gu_colsum, down_w, down_s,
                  down_colsum),
                 w8a8_post(arg(a), arg(x), arg(o_w), arg(o_s), arg(o_colsum), arg(ln), eps,
                           arg(gu_w), arg(gu_s), arg(gu_colsum), arg(down_w), arg(down_s),
                           arg(down_colsum), inter))
MTPKIT_AOTI_SHIM(w8a8_attn_post,
                 (AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle pos,
                  int64_t rows, AtenTensorHandle x, AtenTensorHandle o_w, AtenTensorHandle o_s,
                  AtenTensorHandle o_colsum, AtenTensorHandle ln, double eps,
                  AtenTensorHandle gu_w, AtenTensorHandle gu_s, AtenTensorHandle gu_colsum,
                  AtenTensorHandle down_w, AtenTensorHandle down_s, AtenTensorHandle down_colsum,
                  int64_t inter, AtenTensorHandle* ret0),
                 (q, k, v, pos, x, o_w, o_s, o_colsum, ln, gu_w, gu_s, gu_colsum, down_w, down_s,
                  down_colsum),
                 w8a8_attn_post(arg(q), arg(k), arg(v), arg(pos), rows, arg(x), arg(o_w),
                                arg(o_s), arg(o_colsum), arg(ln), eps, arg(gu_w), arg(gu_s),
                                arg(gu_colsum), arg(down_w), arg(down_s), arg(down_colsum),
                                inter))
MTPKIT_AOTI_SHIM(w8a8_layer,
                 (AtenTensorHandle x, AtenTensorHandle ln1, double eps1, AtenTensorHandle qkv_w,
                  AtenTensorHandle qkv_s, AtenTensorHandle qkv_colsum, AtenTensorHandle cos,
                  AtenTensorHandle sin, AtenTensorHandle kbuf, AtenTensorHandle vbuf,
                  AtenTensorHandle pos, int64_t span, int64_t rows, int64_t heads,
                  AtenTensorHandle o_w, AtenTensorHandle o_s, AtenTensorHandle o_colsum,
                  AtenTensorHandle ln2, double eps2, AtenTensorHandle gu_w, AtenTensorHandle gu_s,
                  AtenTensorHandle gu_colsum, AtenTensorHandle down_w, AtenTensorHandle down_s,
                  AtenTensorHandle down_colsum, int64_t inter, AtenTensorHandle* ret0),
                 (x, ln1, qkv_w, qkv_s, qkv_colsum, cos, sin, kbuf, vbuf, pos, o_w, o_s, o_colsum,
                  ln2, gu_w, gu_s, gu_colsum, down_w, down_s, down_colsum),
                 w8a8_layer(arg(x), arg(ln1), eps1, arg(qkv_w), arg(qkv_s), arg(qkv_colsum),
                            arg(cos), arg(sin), mut(kbuf), mut(vbuf), arg(pos), span, rows,
                            heads, arg(o_w), arg(o_s), arg(o_colsum), arg(ln2), eps2, arg(gu_w),
                            arg(gu_s), arg(gu_colsum), arg(down_w), arg(down_s),
                            arg(down_colsum), inter))
