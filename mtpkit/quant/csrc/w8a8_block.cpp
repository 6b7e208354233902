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
// mtpkit::w8a8_trunk(x, ln1[], eps1, qkv..[], cos, sin, kbufs![], vbufs![], pos, span, rows,
//   heads, o..[], ln2[], eps2, gate_up..[], down..[], inter) -> w8a8_layer over each layer's
//   entries in turn (each layer's output the next one's x), all in one region with a
//   barrier between layers; AOTInductor passes each list as an array of handles
// x, a float32 [T, *]; each GEMM is int8_a8_mm's (packed weights, scales, column sums from
// linear.pack_a8, inter = the MLP's width, gate_up's columns [0, inter) being the gate's);
// rmsnorm(v) = v / sqrt(mean(v^2) + eps), in float32.
//
// Why: with a parallel region per GEMM (121 a SmolLM2 decode step), each a fork and a join
// of the OpenMP team, the weight stream idles around every call. With one region per layer
// and barriers between its GEMMs, the GEMMs stream at the machine's read bandwidth. In the
// compiled steps the gain is smaller, since attention and glue remain between the regions.
// The whole layer in one region (w8a8_layer) takes the attention's three forks and the glue
// between the ops out too (the cache rows' latency stays). The whole trunk in one region
// (w8a8_trunk) takes out the fork, join and call setup between layers.
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
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#include "attend.h"
#include "int8_a8.h"
#include "simd.h"
#include "team.h"

namespace {

using mtpkit_simd::hsum;
using mtpkit_simd::quantize_rows;
using mtpkit_team::Member;
using mtpkit_team::share_blocks;
using mtpkit_team::Team;
using mtpkit_team::team_size;

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
                  colsum.numel() == N16 && K < (1 << 17) && N16 < (int64_t(1) << 28),
              "w8a8 block: ", name, " packed for another shape (N16 ", N16, ", K4 ", K4,
              ", input width ", K, ")");
  return {w.data_ptr<int8_t>(), s.data_ptr<float>(), colsum.data_ptr<int32_t>(), N16, K4};
}

// Quantized rows q [T, K4] (scales xs [T]) against column blocks of w -> y [T, N16], shared
// by the team: this thread's own share front to back, then halves of what the others have
// left, from the back, in pieces of at least ~16 KB; done(c0, c1) after each piece, for the
// columns [16 c0, 16 c1) this thread wrote.
template <class Done>
void gemm_share(const int8_t* q, const float* xs, int64_t T, const Packed& w, float* y,
                Member& me, const Done& done) {
  share_blocks(w.N16 / 16, mtpkit_a8::a8_piece(w.K4), me, [&](int64_t c0, int64_t c1) {
    mtpkit_a8::a8_gemm_rows(q, xs, T, w.K4, w.w, w.s, w.colsum, y, w.N16, c0, c1);
    done(c0, c1);
  });
}

inline void gemm_share(const int8_t* q, const float* xs, int64_t T, const Packed& w, float* y,
                       Member& me) {
  gemm_share(q, xs, T, w, y, me, [](int64_t, int64_t) {});
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

// rmsnorm(x) * ln of T rows of D into buf, quantized into s, against the columns of w this
// thread claims -> y (w8a8_pre's work, and w8a8_layer's first stage).
void norm_gemm_share(const float* x, const float* ln, float eps, int64_t T, int64_t D,
                     const Packed& w, float* y, Scratch& s, float* buf, Member& me) {
  for (int64_t m = 0; m < T; m++) rmsnorm_row(x + m * D, ln, eps, D, buf + m * D);
  quantize_rows(buf, T, D, s.q.data(), s.xs.data(), w.K4, kFlip);
  gemm_share(s.q.data(), s.xs.data(), T, w, y, me);
}

std::vector<Scratch>& scratch(int nt) {
  thread_local std::vector<Scratch> s;  // the calling thread's; its team writes into it
  if ((int)s.size() < nt) s.resize(nt);
  return s;
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
  const int nt = team_size();
  auto& sc = scratch(nt);
  for (auto& s : sc) s.fit(T * D, T * w.K4, T);
  const float* xp = x.data_ptr<float>();
  const float* lnp = ln.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  Team crew(nt);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int t = omp_get_thread_num();
    // The team OpenMP gave (num_threads is a request): every share is split by it.
    const int nth = omp_get_num_threads();
    Scratch& s = sc[t];
    Member me{t, nth, &crew};
    norm_gemm_share(xp, lnp, float(eps), T, D, w, yp, s, s.f.data(), me);
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

// A layer's work from its first GEMM's input on (w8a8_post's, and w8a8_layer's with ``pre``
// and ``att``), as planned before its region: operands, sizes and the team's shared buffers.
struct Post {
  mtpkit_attn::Attend* att;  // the attention, computed by the same team first (or null)
  Pre* pre;                  // the input norm, q/k/v, rotary and cache writes (or null)
  const float *ap, *xp, *lnp;  // the first GEMM's input [T, A], the residual [T, D], ln2
  float eps;
  Packed o, gu, dn;
  int64_t T, D, I, A;
  float *yo, *ygu, *ydn, *act, *outp;  // shared: each GEMM's output rows, activations, out
};

// Checks a layer's operands after the attention -> its Post (buffers unset; ``ap`` for a
// caller's [T, A] input); x, the residual, is [T, D] at xp. The tensors behind the pointers
// must outlive the region.
static Post post_plan(const char* op, int64_t T, int64_t A, mtpkit_attn::Attend* att, Pre* pre,
                      int64_t D, const float* xp, const at::Tensor& ow_, const at::Tensor& os_,
                      const at::Tensor& oc_, const at::Tensor& ln, double eps,
                      const at::Tensor& guw_, const at::Tensor& gus_, const at::Tensor& guc_,
                      const at::Tensor& dw_, const at::Tensor& ds_, const at::Tensor& dc_,
                      int64_t inter) {
  const int64_t I = inter;
  const Packed o = packed(ow_, os_, oc_, A, "o_proj"), gu = packed(guw_, gus_, guc_, D, "gate_up"),
               dn = packed(dw_, ds_, dc_, I, "down_proj");
  TORCH_CHECK(o.N16 >= D && gu.N16 >= 2 * I && dn.N16 >= D,
              op, ": o_proj / down_proj must give D columns and gate_up 2 * inter");
  return {att, pre, nullptr, xp, ln.data_ptr<float>(), float(eps), o, gu, dn,
          T, D, I, A, nullptr, nullptr, nullptr, nullptr, nullptr};
}

// The floats a Post shares between the threads: the attention's output and scratch, each
// GEMM's output rows, and the MLP's activations.
static int64_t post_shared(const Post& P) {
  return (P.att ? P.T * P.A + P.att->scratch() : 0) +
         P.T * (P.o.N16 + P.gu.N16 + P.dn.N16 + P.I);
}

static void post_bind(Post& P, float* shared, float* outp) {
  float* f = shared;
  if (P.att) {
    P.att->op = f;
    P.att->use(f + P.T * P.A);
    P.ap = f;
    f += P.T * P.A + P.att->scratch();
  }
  P.yo = f;
  P.ygu = P.yo + P.T * P.o.N16;
  P.ydn = P.ygu + P.T * P.gu.N16;
  P.act = P.ydn + P.T * P.dn.N16;
  P.outp = outp;
}

// Sizes each thread's scratch for a Post.
static void post_fit(const Post& P, std::vector<Scratch>& sc) {
  const int64_t K4max = std::max({P.o.K4, P.gu.K4, P.dn.K4, P.pre ? P.pre->w.K4 : int64_t(0)});
  for (auto& s : sc) s.fit(2 * P.T * P.D + P.T * P.I, P.T * K4max, P.T);
}

// Thread t's part of a Post, inside the team's region (nth threads), barriers included. The
// attention's passes: each thread's queries in one pass, or the three passes split between
// barriers where the team is too large for that (Attend::fused).
static void post_run(const Post& P, Scratch& s, Member& me) {
  const int t = me.t, nth = me.nth;
  const int64_t T = P.T, D = P.D, I = P.I, A = P.A;
  const Packed &o = P.o, &gu = P.gu, &dn = P.dn;
  mtpkit_attn::Attend* att = P.att;
  Pre* pre = P.pre;
  const float *ap = P.ap, *xp = P.xp, *lnp = P.lnp;
  const float eps = P.eps;
  float *yo = P.yo, *ygu = P.ygu, *ydn = P.ydn, *act = P.act, *outp = P.outp;
  float* h = s.f.data();  // [T, D]: x + o(a), this thread's copy
  float* hn = h + T * D;  // [T, D]: its norm
  if (pre) {
    norm_gemm_share(pre->x, pre->ln, pre->eps, T, pre->Dm, pre->w, pre->yq, s, hn, me);
    me.barrier();
    // Every row's heads, padding rows too (their cache slots are written before any read).
    // Dealt out in turn: the k and v items (the last of each row) write cache rows that
    // come from memory, and in halves one thread took them all.
    const int64_t per = pre->H + 2 * pre->Hkv, n = T * per, Dh = pre->D;
    for (int64_t item = t; item < n; item += nth) {
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
    me.barrier();
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
      me.barrier();
      att->pass2(n2 * t / nth, n2 * (t + 1) / nth);
      me.barrier();
      att->pass3(n3 * t / nth, n3 * (t + 1) / nth);
    }
    me.barrier();
    if (att->rows < T) {
      if (t == 0) att->pad_rows();
      me.barrier();
    }
  }
  quantize_rows(ap, T, A, s.q.data(), s.xs.data(), o.K4, kFlip);
  gemm_share(s.q.data(), s.xs.data(), T, o, yo, me);
  me.barrier();
  for (int64_t m = 0; m < T; m++) {
    for (int64_t k = 0; k < D; k++) h[m * D + k] = xp[m * D + k] + yo[m * o.N16 + k];
    rmsnorm_row(h + m * D, lnp, float(eps), D, hn + m * D);
  }
  quantize_rows(hn, T, D, s.q.data(), s.xs.data(), gu.K4, kFlip);
  gemm_share(s.q.data(), s.xs.data(), T, gu, ygu, me);
  me.barrier();
  // The activations split by column, then every thread quantizes whole rows.
  const int64_t i0 = I * t / nth, i1 = I * (t + 1) / nth;
  for (int64_t m = 0; m < T; m++)
    silu_mul(ygu + m * gu.N16, ygu + m * gu.N16 + I, act + m * I, i0, i1);
  me.barrier();
  quantize_rows(act, T, I, s.q.data(), s.xs.data(), dn.K4, kFlip);
  // Each piece's residual as soon as it is computed, by the thread that computed it.
  gemm_share(s.q.data(), s.xs.data(), T, dn, ydn, me, [&](int64_t c0, int64_t c1) {
    const int64_t k1 = std::min(D, 16 * c1);
    for (int64_t m = 0; m < T; m++)
      for (int64_t k = 16 * c0; k < k1; k++) outp[m * D + k] = h[m * D + k] + ydn[m * dn.N16 + k];
  });
}

// w8a8_post's work, its first GEMM's input being a [T, A] or, with ``att``, that attention's
// output, in one region.
static at::Tensor post_impl(const char* op, const at::Tensor* a_, mtpkit_attn::Attend* att,
                            Pre* pre, const at::Tensor& x_,
                            const at::Tensor& ow_, const at::Tensor& os_, const at::Tensor& oc_,
                            const at::Tensor& ln_, double eps, const at::Tensor& guw_,
                            const at::Tensor& gus_, const at::Tensor& guc_, const at::Tensor& dw_,
                            const at::Tensor& ds_, const at::Tensor& dc_, int64_t inter) {
  TORCH_CHECK(x_.dim() == 2, op, ": x must be [T, D]");
  const int64_t T = x_.size(0), D = x_.size(1);
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
  Post P = post_plan(op, T, A, att, pre, D, x.data_ptr<float>(), ow_, os_, oc_, ln, eps, guw_,
                     gus_, guc_, dw_, ds_, dc_, inter);
  // at::empty's dispatch, 30 calls a step, costs more than this direct allocation.
  at::Tensor out = at::detail::empty_cpu({T, D}, at::kFloat, /*pin_memory=*/false);
  thread_local std::vector<float> shared;
  if ((int64_t)shared.size() < post_shared(P)) shared.resize(post_shared(P));
  post_bind(P, shared.data(), out.data_ptr<float>());
  if (!att) P.ap = a.data_ptr<float>();
  const int nt = team_size();
  auto& sc = scratch(nt);
  post_fit(P, sc);
  Team crew(nt);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    // The team OpenMP gave (num_threads is a request): every share is split by it.
    Member me{omp_get_thread_num(), omp_get_num_threads(), &crew};
    post_run(P, sc[me.t], me);
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

// The floats of a layer's q/k/v rows and rotated queries (w8a8_layer's qbuf).
static int64_t qbuf_size(int64_t T, const at::Tensor& qw, int64_t D, int64_t heads) {
  return qw.dim() == 2 ? T * qw.size(0) + T * heads * D : 0;
}

// A layer's K and V caches [1, Hkv, L, D] as pointers and strides (rows contiguous).
struct Caches {
  float *k, *v;
  int64_t Hkv, L, D;
  int64_t k1, k2, v1, v2;  // head and slot strides
};

// One layer's caches from their tensors [1, Hkv, L, D].
static Caches caches_of(const char* op, const at::Tensor& kbuf, const at::Tensor& vbuf) {
  TORCH_CHECK(kbuf.dim() == 4 && kbuf.size(0) == 1 && kbuf.sizes() == vbuf.sizes() &&
                  kbuf.scalar_type() == at::kFloat && vbuf.scalar_type() == at::kFloat &&
                  kbuf.stride(3) == 1 && vbuf.stride(3) == 1,
              op, ": caches must be float32 [1, Hkv, L, hd] with contiguous rows");
  return {kbuf.data_ptr<float>(), vbuf.data_ptr<float>(), kbuf.size(1), kbuf.size(2),
          kbuf.size(3), kbuf.stride(1), kbuf.stride(2), vbuf.stride(1), vbuf.stride(2)};
}

// Layer l's caches out of stacked ones [layers, 1, Hkv, L, D] (checked by the caller): no
// tensor made for a layer's view (each would cost a dispatch).
static Caches caches_at(const at::Tensor& kc, const at::Tensor& vc, int64_t l) {
  return {kc.data_ptr<float>() + l * kc.stride(0), vc.data_ptr<float>() + l * vc.stride(0),
          kc.size(2), kc.size(3), kc.size(4), kc.stride(2), kc.stride(3), vc.stride(2),
          vc.stride(3)};
}

// w8a8_layer's checks of a layer's operands up to its attention: x [T, Dm] (contiguous, the
// caller's), cos/sin [T, R] and pos [T] (contiguous) -> its Pre and its attention's plan,
// with its q/k/v rows and rotated queries in qbuf (qbuf_size floats).
static void layer_plan(const char* op, int64_t T, int64_t Dm, const float* xp,
                       const at::Tensor& ln1, double eps1,
                       const at::Tensor& qw, const at::Tensor& qs, const at::Tensor& qc,
                       const at::Tensor& cos, const at::Tensor& sin, const Caches& c,
                       const at::Tensor& pos, int64_t span, int64_t rows,
                       int64_t heads, float* qbuf, Pre& pre,
                       std::optional<mtpkit_attn::Attend>& att) {
  TORCH_CHECK(ln1.dim() == 1 && ln1.size(0) == Dm && ln1.scalar_type() == at::kFloat &&
                  ln1.is_contiguous(),
              op, ": ln1 must be float32 [", Dm, "] and contiguous");
  const int64_t Hkv = c.Hkv, L = c.L, D = c.D, H = heads;
  TORCH_CHECK(Hkv > 0 && H > 0 && H % Hkv == 0 && span >= 1 && span <= L,
              op, ": heads a multiple of the KV heads, 1 <= span <= cache length");
  const Packed w = packed(qw, qs, qc, Dm, "q/k/v");
  TORCH_CHECK(w.N16 >= (H + 2 * Hkv) * D, op, ": q/k/v gives fewer than (H + 2 Hkv) hd columns");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == T &&
                  cos.size(1) % 2 == 0 && cos.size(1) <= D && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              op, ": cos/sin must be float32 [T, R], R even and at most hd");
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == T && pos.scalar_type() == at::kLong,
              op, ": pos must be int64 [T]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t j = 0; j < T; j++)
    TORCH_CHECK(pp[j] >= 0 && pp[j] < L, op, ": a position past the cache");
  float* qrot = qbuf + T * w.N16;
  att.emplace(qrot, H * D, D, c.k, c.k1, c.k2, c.v, c.v1, c.v2, T, H, Hkv, span, D, pp, rows,
              op);
  pre = Pre{xp, ln1.data_ptr<float>(), float(eps1), w, Dm,
            cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(1),
            c.k, c.v, c.k1, c.k2, c.v1, c.v2, pp, H, Hkv, D, qbuf, qrot};
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
  check_rows(x_, x_.size(1), "x");
  const at::Tensor x = x_.contiguous(), ln1 = contig_vec(ln1_, x_.size(1), "ln1");
  const at::Tensor cos = cos_.contiguous(), sin = sin_.contiguous(), pos = pos_.contiguous();
  // The q/k/v rows and the rotated queries, for this call (the attention plan reads qrot).
  thread_local std::vector<float> qbuf;
  const Caches c = caches_of("w8a8_layer", kbuf, vbuf);
  const int64_t nq = qbuf_size(x.size(0), qw, c.D, heads);
  if ((int64_t)qbuf.size() < nq) qbuf.resize(nq);
  Pre pre;
  std::optional<mtpkit_attn::Attend> att;
  layer_plan("w8a8_layer", x.size(0), x.size(1), x.data_ptr<float>(), ln1, eps1, qw, qs, qc, cos,
             sin, c, pos, span, rows, heads, qbuf.data(), pre, att);
  return post_impl("w8a8_layer", nullptr, &*att, &pre, x, ow, os, oc, ln2, eps2, guw, gus, guc,
                   dw, ds, dc, inter);
}

// A run of whole layers (w8a8_layer's, each layer's output the next one's input) in one
// region, a barrier between layers: no fork, join or call setup between them. caches(l):
// layer l's caches, checked.
template <class List, class CachesOf>
static at::Tensor trunk_impl(const at::Tensor& x_, const List& ln1, double eps1, const List& qw,
                             const List& qs, const List& qc, const at::Tensor& cos_,
                             const at::Tensor& sin_, const CachesOf& caches,
                             const at::Tensor& pos_, int64_t span, int64_t rows, int64_t heads,
                             const List& ow, const List& os, const List& oc, const List& ln2,
                             double eps2, const List& guw, const List& gus, const List& guc,
                             const List& dw, const List& ds, const List& dc, int64_t inter) {
  const char* op = "w8a8_trunk";
  const size_t n = ln1.size();
  for (size_t len : {qw.size(), qs.size(), qc.size(), ow.size(), os.size(), oc.size(),
                     ln2.size(), guw.size(), gus.size(), guc.size(), dw.size(), ds.size(),
                     dc.size()})
    TORCH_CHECK(len == n && n > 0, op, ": every list needs one entry a layer");
  TORCH_CHECK(x_.dim() == 2, op, ": x must be [T, D]");
  const int64_t T = x_.size(0), Dm = x_.size(1);
  check_rows(x_, Dm, "x");
  const at::Tensor x = x_.contiguous();
  const at::Tensor cos = cos_.contiguous(), sin = sin_.contiguous(), pos = pos_.contiguous();
  // Layer l reads its input from bufs[(l + 1) % 2] (layer 0 from x) and writes bufs[l % 2]
  // (the last layer ``out``): the team finishes a layer before the next reads it.
  at::Tensor out = at::detail::empty_cpu({T, Dm}, at::kFloat, /*pin_memory=*/false);
  thread_local std::vector<float> qbuf, shared, pingpong;
  std::vector<Caches> cs(n);
  int64_t nq = 0;
  for (size_t l = 0; l < n; l++) {
    cs[l] = caches(l);
    nq = std::max(nq, qbuf_size(T, qw[l], cs[l].D, heads));
  }
  if ((int64_t)qbuf.size() < nq) qbuf.resize(nq);
  if ((int64_t)pingpong.size() < 2 * T * Dm) pingpong.resize(2 * T * Dm);
  std::vector<Pre> pres(n);
  std::vector<std::optional<mtpkit_attn::Attend>> atts(n);
  std::vector<Post> posts;
  posts.reserve(n);
  int64_t nshared = 0;
  for (size_t l = 0; l < n; l++) {
    // Raw pointers, no tensors: a tensor made for each layer's input costs a dispatch.
    const float* in = l == 0 ? x.data_ptr<float>() : pingpong.data() + ((l + 1) % 2) * T * Dm;
    layer_plan(op, T, Dm, in, ln1[l], eps1, qw[l], qs[l], qc[l], cos, sin, cs[l], pos, span, rows,
               heads, qbuf.data(), pres[l], atts[l]);
    TORCH_CHECK(ln2[l].dim() == 1 && ln2[l].size(0) == Dm && ln2[l].is_contiguous() &&
                    ln2[l].scalar_type() == at::kFloat,
                op, ": ln2 must be float32 [", Dm, "] and contiguous");
    mtpkit_attn::Attend& a = *atts[l];
    posts.push_back(post_plan(op, T, a.H * a.D, &a, &pres[l], Dm, in, ow[l], os[l], oc[l], ln2[l],
                              eps2, guw[l], gus[l], guc[l], dw[l], ds[l], dc[l], inter));
    TORCH_CHECK(posts[l].o.N16 >= Dm && posts[l].dn.N16 >= Dm, op, ": widths differ by layer");
    nshared = std::max(nshared, post_shared(posts[l]));
  }
  if ((int64_t)shared.size() < nshared) shared.resize(nshared);
  const int nt = team_size();
  auto& sc = scratch(nt);
  for (size_t l = 0; l < n; l++) {
    float* o = l + 1 == n ? out.data_ptr<float>() : pingpong.data() + (l % 2) * T * Dm;
    post_bind(posts[l], shared.data(), o);
    post_fit(posts[l], sc);
  }
  Team crew(nt);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    Member me{omp_get_thread_num(), omp_get_num_threads(), &crew};
    for (size_t l = 0; l < n; l++) {
      if (l > 0) me.barrier();
      post_run(posts[l], sc[me.t], me);
    }
  }
  return out;
}

static at::Tensor w8a8_trunk(const at::Tensor& x, at::TensorList ln1, double eps1,
                             at::TensorList qw, at::TensorList qs, at::TensorList qc,
                             const at::Tensor& cos, const at::Tensor& sin, at::TensorList kbufs,
                             at::TensorList vbufs, const at::Tensor& pos, int64_t span,
                             int64_t rows, int64_t heads, at::TensorList ow, at::TensorList os,
                             at::TensorList oc, at::TensorList ln2, double eps2,
                             at::TensorList guw, at::TensorList gus, at::TensorList guc,
                             at::TensorList dw, at::TensorList ds, at::TensorList dc,
                             int64_t inter) {
  TORCH_CHECK(kbufs.size() == ln1.size() && vbufs.size() == ln1.size(),
              "w8a8_trunk: every list needs one entry a layer");
  const auto caches = [&](size_t l) { return caches_of("w8a8_trunk", kbufs[l], vbufs[l]); };
  return trunk_impl(x, ln1, eps1, qw, qs, qc, cos, sin, caches, pos, span, rows, heads, ow, os, oc,
                    ln2, eps2, guw, gus, guc, dw, ds, dc, inter);
}

// The stacked caches [layers, 1, Hkv, L, D] of w8a8_trunk_kv -> layer l's, checked once.
static void check_stacked(const at::Tensor& kc, const at::Tensor& vc, size_t n) {
  TORCH_CHECK(kc.dim() == 5 && kc.size(0) == int64_t(n) && kc.size(1) == 1 &&
                  kc.sizes() == vc.sizes() && kc.scalar_type() == at::kFloat &&
                  vc.scalar_type() == at::kFloat && kc.stride(4) == 1 && vc.stride(4) == 1,
              "w8a8_trunk_kv: caches must be float32 [layers, 1, Hkv, L, hd] with contiguous "
              "rows, one layer a list entry");
}

// w8a8_trunk with each cache list as one stacked tensor: a compiled step's 60 cache inputs
// (SmolLM2) become 2. An AOTInductor call reads each input's metadata, which a step's weight
// stream has evicted from the caches, so 2 inputs cost far less than 60.
static at::Tensor w8a8_trunk_kv(const at::Tensor& x, at::TensorList ln1, double eps1,
                                at::TensorList qw, at::TensorList qs, at::TensorList qc,
                                const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc,
                                at::Tensor& vc, const at::Tensor& pos, int64_t span, int64_t rows,
                                int64_t heads, at::TensorList ow, at::TensorList os,
                                at::TensorList oc, at::TensorList ln2, double eps2,
                                at::TensorList guw, at::TensorList gus, at::TensorList guc,
                                at::TensorList dw, at::TensorList ds, at::TensorList dc,
                                int64_t inter) {
  check_stacked(kc, vc, ln1.size());
  const auto caches = [&](size_t l) { return caches_at(kc, vc, int64_t(l)); };
  return trunk_impl(x, ln1, eps1, qw, qs, qc, cos, sin, caches, pos, span, rows, heads, ow, os, oc,
                    ln2, eps2, guw, gus, guc, dw, ds, dc, inter);
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
template <class List, class CachesOf>
static at::Tensor trunk_impl(const at::Tensor&, const List&, double, const List&, const List&,
                             const List&, const at::Tensor&, const at::Tensor&, const CachesOf&,
                             const at::Tensor&, int64_t, int64_t, int64_t,
                             const List&, const List&, const List&, const List&, double,
                             const List&, const List&, const List&, const List&, const List&,
                             const List&, int64_t) {
  TORCH_CHECK(false, "w8a8_trunk was built without AVX2/FMA");
}
static void check_stacked(const at::Tensor&, const at::Tensor&, size_t) {}
static at::Tensor w8a8_trunk_kv(const at::Tensor&, at::TensorList, double, at::TensorList,
                                at::TensorList, at::TensorList, const at::Tensor&,
                                const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                                int64_t, int64_t, int64_t, at::TensorList, at::TensorList,
                                at::TensorList, at::TensorList, double, at::TensorList,
                                at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                                at::TensorList, int64_t) {
  TORCH_CHECK(false, "w8a8_trunk_kv was built without AVX2/FMA");
}
static at::Tensor w8a8_trunk(const at::Tensor&, at::TensorList, double, at::TensorList,
                             at::TensorList, at::TensorList, const at::Tensor&, const at::Tensor&,
                             at::TensorList, at::TensorList, const at::Tensor&, int64_t, int64_t,
                             int64_t, at::TensorList, at::TensorList, at::TensorList,
                             at::TensorList, double, at::TensorList, at::TensorList,
                             at::TensorList, at::TensorList, at::TensorList, at::TensorList,
                             int64_t) {
  TORCH_CHECK(false, "w8a8_trunk was built without AVX2/FMA");
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
  m.def("w8a8_trunk(Tensor x, Tensor[] ln1, float eps1, Tensor[] qkv_w, Tensor[] qkv_s, "
        "Tensor[] qkv_colsum, Tensor cos, Tensor sin, Tensor(a!)[] kbufs, Tensor(b!)[] vbufs, "
        "Tensor pos, SymInt span, int rows, int heads, Tensor[] o_w, Tensor[] o_s, "
        "Tensor[] o_colsum, Tensor[] ln2, float eps2, Tensor[] gu_w, Tensor[] gu_s, "
        "Tensor[] gu_colsum, Tensor[] down_w, Tensor[] down_s, Tensor[] down_colsum, "
        "int inter) -> Tensor");
  m.def("w8a8_trunk_kv(Tensor x, Tensor[] ln1, float eps1, Tensor[] qkv_w, Tensor[] qkv_s, "
        "Tensor[] qkv_colsum, Tensor cos, Tensor sin, Tensor(a!) kc, Tensor(b!) vc, "
        "Tensor pos, SymInt span, int rows, int heads, Tensor[] o_w, Tensor[] o_s, "
        "Tensor[] o_colsum, Tensor[] ln2, float eps2, Tensor[] gu_w, Tensor[] gu_s, "
        "Tensor[] gu_colsum, Tensor[] down_w, Tensor[] down_s, Tensor[] down_colsum, "
        "int inter) -> Tensor");
}
TORCH_LIBRARY_IMPL(mtpkit, CPU, m) {
  m.impl("w8a8_pre", &w8a8_pre);
  m.impl("w8a8_post", &w8a8_post);
  m.impl("w8a8_attn_post", &w8a8_attn_post);
  m.impl("w8a8_layer", &w8a8_layer);
  m.impl("w8a8_trunk", &w8a8_trunk);
  m.impl("w8a8_trunk_kv", &w8a8_trunk_kv);
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

// AOTInductor passes a Tensor[] argument as an array of handles and its length.
namespace {
struct Handles {
  const AtenTensorHandle* h;
  int64_t n;
  size_t size() const { return size_t(n); }
  const at::Tensor& operator[](size_t i) const { return mtpkit_shim::arg(h[i]); }
};

// Every argument's metadata in one pass, all misses of a level together (~480 tensors for
// SmolLM2): the single tensors and each list's.
template <size_t N>
void warm_all(std::initializer_list<AtenTensorHandle> singles, const Handles (&lists)[N]) {
  thread_local std::vector<AtenTensorHandle> all;
  all.assign(singles);
  for (const Handles& l : lists) all.insert(all.end(), l.h, l.h + l.n);
  mtpkit_shim::warm(all.data(), int64_t(all.size()));
}
}  // namespace

#define MTPKIT_LIST(name) const AtenTensorHandle *name, int64_t name##_len_
extern "C" __attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_w8a8_trunk(
    AtenTensorHandle x, MTPKIT_LIST(ln1), double eps1, MTPKIT_LIST(qkv_w), MTPKIT_LIST(qkv_s),
    MTPKIT_LIST(qkv_colsum), AtenTensorHandle cos, AtenTensorHandle sin, MTPKIT_LIST(kbufs),
    MTPKIT_LIST(vbufs), AtenTensorHandle pos, int64_t span, int64_t rows, int64_t heads,
    MTPKIT_LIST(o_w), MTPKIT_LIST(o_s), MTPKIT_LIST(o_colsum), MTPKIT_LIST(ln2), double eps2,
    MTPKIT_LIST(gu_w), MTPKIT_LIST(gu_s), MTPKIT_LIST(gu_colsum), MTPKIT_LIST(down_w),
    MTPKIT_LIST(down_s), MTPKIT_LIST(down_colsum), int64_t inter, AtenTensorHandle* ret0) {
  using mtpkit_shim::arg;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    const Handles lists[] = {{ln1, ln1_len_}, {qkv_w, qkv_w_len_}, {qkv_s, qkv_s_len_},
                             {qkv_colsum, qkv_colsum_len_}, {kbufs, kbufs_len_},
                             {vbufs, vbufs_len_}, {o_w, o_w_len_}, {o_s, o_s_len_},
                             {o_colsum, o_colsum_len_}, {ln2, ln2_len_}, {gu_w, gu_w_len_},
                             {gu_s, gu_s_len_}, {gu_colsum, gu_colsum_len_},
                             {down_w, down_w_len_}, {down_s, down_s_len_},
                             {down_colsum, down_colsum_len_}};
    warm_all({x, cos, sin, pos}, lists);
    TORCH_CHECK(kbufs_len_ == ln1_len_ && vbufs_len_ == ln1_len_,
                "w8a8_trunk: every list needs one entry a layer");
    const auto caches = [&](size_t l) {
      return caches_of("w8a8_trunk", lists[4][l], lists[5][l]);
    };
    *ret0 = torch::aot_inductor::new_tensor_handle(trunk_impl(
        arg(x), lists[0], eps1, lists[1], lists[2], lists[3], arg(cos), arg(sin), caches,
        arg(pos), span, rows, heads, lists[6], lists[7], lists[8], lists[9], eps2, lists[10],
        lists[11], lists[12], lists[13], lists[14], lists[15], inter));
  });
}
extern "C" __attribute__((visibility("default"))) AOTITorchError aoti_torch_cpu_w8a8_trunk_kv(
    AtenTensorHandle x, MTPKIT_LIST(ln1), double eps1, MTPKIT_LIST(qkv_w), MTPKIT_LIST(qkv_s),
    MTPKIT_LIST(qkv_colsum), AtenTensorHandle cos, AtenTensorHandle sin, AtenTensorHandle kc,
    AtenTensorHandle vc, AtenTensorHandle pos, int64_t span, int64_t rows, int64_t heads,
    MTPKIT_LIST(o_w), MTPKIT_LIST(o_s), MTPKIT_LIST(o_colsum), MTPKIT_LIST(ln2), double eps2,
    MTPKIT_LIST(gu_w), MTPKIT_LIST(gu_s), MTPKIT_LIST(gu_colsum), MTPKIT_LIST(down_w),
    MTPKIT_LIST(down_s), MTPKIT_LIST(down_colsum), int64_t inter, AtenTensorHandle* ret0) {
  using mtpkit_shim::arg;
  using mtpkit_shim::mut;
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    const Handles lists[] = {{ln1, ln1_len_}, {qkv_w, qkv_w_len_}, {qkv_s, qkv_s_len_},
                             {qkv_colsum, qkv_colsum_len_}, {o_w, o_w_len_}, {o_s, o_s_len_},
                             {o_colsum, o_colsum_len_}, {ln2, ln2_len_}, {gu_w, gu_w_len_},
                             {gu_s, gu_s_len_}, {gu_colsum, gu_colsum_len_},
                             {down_w, down_w_len_}, {down_s, down_s_len_},
                             {down_colsum, down_colsum_len_}};
    warm_all({x, cos, sin, pos, kc, vc}, lists);
    at::Tensor &k = mut(kc), &v = mut(vc);
    check_stacked(k, v, size_t(ln1_len_));
    const auto caches = [&](size_t l) { return caches_at(k, v, int64_t(l)); };
    *ret0 = torch::aot_inductor::new_tensor_handle(trunk_impl(
        arg(x), lists[0], eps1, lists[1], lists[2], lists[3], arg(cos), arg(sin), caches,
        arg(pos), span, rows, heads, lists[4], lists[5], lists[6], lists[7], eps2, lists[8],
        lists[9], lists[10], lists[11], lists[12], lists[13], inter));
  });
}
#undef MTPKIT_LIST
