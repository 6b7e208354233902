// mtpkit::int8_a8_mm(x, packed, scale, colsum) -> y: the W8A8 scheme (compressed-tensors int8
// weights with dynamic per-token int8 activations, as vLLM runs it). Each row of x is
// quantized on its own, xs[m] = max_k |x[m, k]| / 127, q[m, k] = round_half_even(x[m, k] / xs[m]),
// and
//   y[m, n] = (float(sum_k q[m, k] * codes[n, k]) * xs[m]) * scale[n]
// The sum is an exact int32 (|q| <= 127, |codes| <= 128, K < 2^17), so it does not depend on
// order, rows or threads at all. Why by hand: torch has no CPU int8 x int8 kernel for a few
// rows that is fast here (torch._int_mm is the reference).
//
// Layout (linear.pack_a8): output columns in blocks of 16 (N padded to a multiple of 16 with
// zero codes and scales), K padded to a multiple of 4 with zeros; a block's codes as K / 4
// runs of 64 bytes, byte 4c + j of run t holding codes[16b + c, 4t + j]. `colsum` int32 [N16]
// holds sum_k codes[n, k].
//
// Why this layout: with the columns across a register, one broadcast of 4 activations of a
// row multiplies 4 codes of every column, and the outputs come out side by side (no
// horizontal sum per output). With AVX-512 VNNI (kernels.py) a 64-byte run is one 512-bit
// vpdpbusd a row. vpdpbusd wants unsigned activations, so they go in as q + 128 and the sum
// takes 128 * colsum[n] back off (int32 arithmetic wraps, and the true sum fits, so the
// result is exact). The former layout (one column at a time, vpmaddubsw on |w| and
// sign-moved activations, 4 vector operations per 32 codes a row and a horizontal sum per
// output) and 8-column blocks with 256-bit vpdpbusd both made a 4-row verification cost
// clearly more than a decode step; this form brings it closest to one. Unlike the 512-bit
// forms of the one-column loops (int8_mm.cpp's header), it is not slower inside the
// compiled steps. AVX2 (no VNNI): a run as two 256-bit halves
// against one broadcast, with the sign trick (|w| shared by all rows), the same integer sums.
// AMX (amx.h): five rows or more as tiles where the CPU has them, the same integer sums.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "aoti_shim.h"

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "int8_a8.h"
#include "amx.h"
#include "simd.h"
#include "team.h"

using mtpkit_a8::a8_gemm_rows;
using mtpkit_simd::prefetch;
using mtpkit_simd::quantize_rows;
using mtpkit_team::Member;
using mtpkit_team::share_blocks;
using mtpkit_team::Team;
using mtpkit_team::team_size;

#endif

// x float32 [M, K] against pack_a8's operands (packed [N16, K4], scale and colsum [N16]).
static void check_a8_args(const char* op, const at::Tensor& x, const at::Tensor& w,
                          const at::Tensor& s, const at::Tensor& colsum) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && s.dim() == 1 && colsum.dim() == 1,
              op, ": x [M,K], packed [N16,K4], scale [N16], colsum [N16]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar &&
                  s.scalar_type() == at::kFloat && colsum.scalar_type() == at::kInt,
              op, ": x float32, packed int8, scale float32, colsum int32");
  const int64_t K = x.size(1), N16 = w.size(0), K4 = w.size(1);
  TORCH_CHECK(N16 % 16 == 0 && K4 == (K + 3) / 4 * 4 && s.size(0) == N16 && colsum.size(0) == N16,
              op, ": shapes differ (packed [N16,K4] with N16 a multiple of 16 and K4 = K "
              "rounded up to 4, scale and colsum [N16])");
  TORCH_CHECK(K < (1 << 17), op, ": K >= 2^17 could overflow int32");
}

#if defined(__AVX2__) && defined(__FMA__)
// `rows` quantized rows (q, xs; K4 bytes apart) against every column block, the blocks
// claimed by the thread team (team.h) ~16 KB at least: the lm_head (a fifth of a small
// model's step) in static halves left one thread waiting for the other where their streams
// ran unevenly, as the fused layers' GEMMs did. after(c0, c1) runs on each claimed range
// once its rows are done. before(me), where given, runs first on every thread of the region
// (a team barrier after it): work the GEMM's rows wait on, shared out by the team.
struct NoBefore {
  void operator()(Member&) const {}
};

template <class After, class Before = NoBefore>
static void a8_team(const int8_t* q, const float* xs, int64_t rows, int64_t K4, const int8_t* w,
                    const float* s, const int32_t* colsum, float* y, int64_t N16,
                    const After& after, const Before& before = Before{}) {
#if MTPKIT_AMX
  // Several rows on AMX tiles where the CPU has them (amx.h: the same bits); q's rows are
  // then readable up to amx::padded(rows).
  const bool tiles = rows >= mtpkit_amx::kMinRows && mtpkit_amx::available();
#else
  constexpr bool tiles = false;
#endif
  auto run = [&](int64_t c0, int64_t c1) {
#if MTPKIT_AMX
    if (tiles) {
      mtpkit_amx::a8_tiles(q, xs, rows, K4, w, s, colsum, y, N16, c0, c1);
      after(c0, c1);
      return;
    }
#endif
    a8_gemm_rows(q, xs, rows, K4, w, s, colsum, y, N16, c0, c1);
    after(c0, c1);
  };
  const int nt = team_size();
  Team crew(nt);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
#if MTPKIT_AMX
    if (tiles) mtpkit_amx::configure(K4 / 4 % 16);
#endif
    Member me{omp_get_thread_num(), omp_get_num_threads(), &crew};
    if constexpr (!std::is_same_v<Before, NoBefore>) {
      before(me);
      if (me.nth > 1) me.barrier();
    }
    share_blocks(N16 / 16, mtpkit_a8::a8_piece(K4), me, run);
#if MTPKIT_AMX
    if (tiles) mtpkit_amx::release();
#endif
  }
  (void)tiles;
}

// Rows of quantized activations a8_team may read (whole AMX tiles where it takes them).
static int64_t a8_scratch_rows(int64_t rows) {
#if MTPKIT_AMX
  return mtpkit_amx::padded(rows);
#else
  return rows;
#endif
}
#endif

static at::Tensor int8_a8_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s,
                             const at::Tensor& colsum) {
  check_a8_args("int8_a8_mm", x, w, s, colsum);
  const int64_t M = x.size(0), K = x.size(1), N16 = w.size(0), K4 = w.size(1);
  at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = s.contiguous(), cc = colsum.contiguous();
  at::Tensor y = at::empty({M, N16}, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  // Quantized rows in per-thread scratch rather than tensors: a decode step makes ~120 of
  // these calls, and two tensor allocations each would add up to a visible share of it.
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> xs;
  q.resize(a8_scratch_rows(M) * K4);
  xs.resize(M);
  // Rows K4 apart; the padding's bytes meet zero codes, so their values do not matter.
  // VNNI takes q + 128 as unsigned bytes.
  quantize_rows(xc.data_ptr<float>(), M, K, q.data(), xs.data(), K4, MTPKIT_VNNI ? 0x80 : 0);
  a8_team(q.data(), xs.data(), M, K4, wc.data_ptr<int8_t>(), sc.data_ptr<float>(),
          cc.data_ptr<int32_t>(), y.data_ptr<float>(), N16, [](int64_t, int64_t) {});
#else
  TORCH_CHECK(false, "int8_a8_mm was built without AVX2/FMA");
#endif
  return y;
}

// mtpkit::int8_a16_mm(x, packed, scale, colsum) -> y: int8 weights with float activations
// (W8A16) in exact integer sums, in one of two forms chosen by the instruction set the
// kernels are built for (linear.a16_form; a host runs one form on every path). AVX2 builds:
// one int16 row per row of x (below). AVX-512 VNNI and AMX builds: through the W8A8 loop,
// each row of x as two int8 rows: q1 = its per-token
// int8 quantization (scale xs1, as int8_a8_mm) and q2 that of the remainder r = x - q1 * xs1
// (scale xs2, at most xs1 / 254), so
//   y[m, n] = (float(sum_k q1 * codes) * xs1) * scale[n] + (float(sum_k q2 * codes) * xs2) * scale[n]
// keeps about 15 bits of each activation, against 7 for W8A8: W8A16's accuracy at nearly W8A8's
// speed. Why: int8_mm (float FMAs) widens every code to float, which on a 2-core CPU costs more
// than reading it, so a step of 2 rows costs about 1.4 steps of one; integer dot products make
// the codes' widening free and a few rows nearly as cheap as one. Exact integer sums, so each
// row's bits do not depend on the other rows, the threads or the order.
#if defined(__AVX2__) && defined(__FMA__) && !MTPKIT_VNNI
// AVX2 hosts (no VNNI): W8A16 as one int16 row per activation row,
//   xs[m] = max_k |x[m, k]| / 32767, q[m, k] = round_half_even(x[m, k] / xs[m]) in [-32767, 32767],
//   y[m, n] = (float(sum_k q[m, k] * codes[n, k]) * xs[m]) * scale[n]
// (linear.a16_reference's "int16" form), the sum exact. Why not the two int8 rows above: on
// AVX2 an int8 row costs a sign move, a vpmaddubsw and a vpmaddwd per 32 products, so two of
// them per activation row make a few rows arithmetic-bound; one vpmaddwd of int16 activations
// against codes widened to int16 does 16 products, and a row costs about half as much.
// Chunks of at most 128 runs (512 inputs) keep every int32 lane, and the sum of a column's
// two lanes, below 2 * 128 * 2 * 32767 * 128 < 2^31; the chunks add up exactly in doubles.
constexpr float kA16Levels = 32767.f;
constexpr int64_t kA16Chunk = 128;

// Rows of x as int16 codes (rows ld apart, inputs past K zero) and their scales.
static void quantize_rows16(const float* x, int64_t M, int64_t K, int16_t* q, float* xs,
                            int64_t ld) {
  const __m256 hi = _mm256_set1_ps(kA16Levels), lo = _mm256_set1_ps(-kA16Levels);
  const int64_t Kv = K - K % 8;
  for (int64_t m = 0; m < M; m++) {
    const float* xm = x + m * K;
    int16_t* qm = q + m * ld;
    std::fill(qm + K, qm + ld, int16_t(0));
    const float amax = mtpkit_simd::row_amax(xm, K);
    const float sc = amax / kA16Levels;
    xs[m] = sc;
    if (!(sc > 0.f)) {
      std::fill(qm, qm + K, int16_t(0));
      continue;
    }
    const __m256 vs = _mm256_set1_ps(sc);
    for (int64_t k = 0; k < Kv; k += 8) {
      const __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(xm + k), vs),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i i = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, v)));
      _mm_storeu_si128((__m128i*)(qm + k),
                       _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1)));
    }
    for (int64_t k = Kv; k < K; k++)
      qm[k] = int16_t(std::min(kA16Levels, std::max(-kA16Levels, std::nearbyint(xm[k] / sc))));
  }
}

// R (1 or 2) int16 rows against runs [t0, t1) of one block of 16 columns (wb), the codes
// widened to int16 as they are read: a run's 64 codes as four vectors of 4 columns x 4
// inputs against one 64-bit broadcast of the row's 4 inputs, a lane holding 2 products of a
// column. out[r][c]: the column sums (int32: a chunk). Its own function, so that its 8
// accumulators, 4 code vectors and broadcast keep to registers: inlined into the loop
// over chunks, gcc kept the int64 sums in vector registers and spilled accumulators.
template <int R>
__attribute__((noinline)) void a16_chunk(const int16_t* q, int64_t K4, const int8_t* wb,
                                         int64_t t0, int64_t t1, int32_t (*out)[16]) {
  __m256i acc[R][4];
  for (int r = 0; r < R; r++)
    for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_si256();
  // Two runs a turn (u): gcc left a plain loop over runs (runtime bounds) rolled, which ran
  // clearly slower; four a turn measured slower than two.
  for (int64_t t = t0; t < t1; t += 2) {
    for (int u = 0; u < 2 && t + u < t1; u++) {
      const int8_t* run = wb + 64 * (t + u);
      prefetch(run);
      __m256i wv[4];
      for (int j = 0; j < 4; j++)
        wv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(run + 16 * j)));
      for (int r = 0; r < R; r++) {
        const __m256i xb = _mm256_castpd_si256(
            _mm256_broadcast_sd(reinterpret_cast<const double*>(q + r * K4 + 4 * (t + u))));
        for (int j = 0; j < 4; j++)
          acc[r][j] = _mm256_add_epi32(acc[r][j], _mm256_madd_epi16(wv[j], xb));
      }
    }
  }
  for (int r = 0; r < R; r++)
    for (int h = 0; h < 2; h++) {
      // Lanes 2c, 2c + 1 of acc[r][2h] hold column c's two halves, acc[r][2h + 1] columns
      // 4-7; hadd pairs them within 128-bit halves as columns 0 1 4 5 | 2 3 6 7.
      const __m256i c = _mm256_permute4x64_epi64(
          _mm256_hadd_epi32(acc[r][2 * h], acc[r][2 * h + 1]), 0xD8);
      _mm256_storeu_si256((__m256i*)(out[r] + 8 * h), c);
    }
}

// R (1 or 2) int16 rows against column blocks [b0, b1) of 16: y = (float(sum) * xs) * scale.
template <int R>
void a16_rows(const int16_t* q, const float* xs, int64_t K4, const int8_t* w, const float* s,
              float* y, int64_t N16, int64_t b0, int64_t b1) {
  const int64_t T = K4 / 4;
  for (int64_t b = b0; b < b1; b++) {
    const int8_t* wb = w + b * 16 * K4;
    // The chunks' int32 sums added in doubles, 4 columns a register: exact (every total is
    // far below 2^53), and converting the exact total to float rounds it once, as the
    // scalar float(int64) does. Scalar int64 sums and conversions had cost a sixth of the
    // kernel's time at 8 rows.
    __m256d sums[R][4];
    for (int r = 0; r < R; r++)
      for (int j = 0; j < 4; j++) sums[r][j] = _mm256_setzero_pd();
    alignas(32) int32_t part[R][16];
    for (int64_t t0 = 0; t0 < T; t0 += kA16Chunk) {
      a16_chunk<R>(q, K4, wb, t0, std::min(T, t0 + kA16Chunk), part);
      for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++)
          sums[r][j] = _mm256_add_pd(
              sums[r][j], _mm256_cvtepi32_pd(_mm_load_si128((const __m128i*)(part[r] + 4 * j))));
    }
    for (int r = 0; r < R; r++) {
      const __m256 x = _mm256_set1_ps(xs[r]);
      for (int h = 0; h < 2; h++) {
        const __m256 f = _mm256_set_m128(_mm256_cvtpd_ps(sums[r][2 * h + 1]),
                                         _mm256_cvtpd_ps(sums[r][2 * h]));
        _mm256_storeu_ps(y + r * N16 + 16 * b + 8 * h,
                         _mm256_mul_ps(_mm256_mul_ps(f, x), _mm256_loadu_ps(s + 16 * b + 8 * h)));
      }
    }
  }
}

#endif

static at::Tensor int8_a16_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s,
                              const at::Tensor& colsum) {
  check_a8_args("int8_a16_mm", x, w, s, colsum);
  const int64_t M = x.size(0), K = x.size(1), N16 = w.size(0), K4 = w.size(1);
  at::Tensor xc = x.contiguous(), wc = w.contiguous(), sc = s.contiguous(), cc = colsum.contiguous();
  at::Tensor y = at::empty({M, N16}, x.options());
#if defined(__AVX2__) && defined(__FMA__) && !MTPKIT_VNNI
  {
    thread_local std::vector<int16_t> q16;
    thread_local std::vector<float> xs16;
    q16.resize(M * K4);
    xs16.resize(M);
    quantize_rows16(xc.data_ptr<float>(), M, K, q16.data(), xs16.data(), K4);
    const int16_t* qp = q16.data();
    const float* xsp = xs16.data();
    const int8_t* wp = wc.data_ptr<int8_t>();
    const float* sp = sc.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int nt = team_size();
    Team crew(nt);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
      Member me{omp_get_thread_num(), omp_get_num_threads(), &crew};
      share_blocks(N16 / 16, mtpkit_a8::a8_piece(K4), me, [&](int64_t c0, int64_t c1) {
        // Rows two at a time over the claimed blocks: the first pair streams the codes from
        // memory, later pairs read them again (from cache where the claim fits; taking the
        // pairs block by block measured no faster, this loop being bound by its arithmetic).
        // Widening a block once into scratch for every row measured slower than widening
        // it again a pair.
        int64_t m = 0;
        for (; m + 2 <= M; m += 2)
          a16_rows<2>(qp + m * K4, xsp + m, K4, wp, sp, yp + m * N16, N16, c0, c1);
        if (m < M) a16_rows<1>(qp + m * K4, xsp + m, K4, wp, sp, yp + m * N16, N16, c0, c1);
      });
    }
    return y;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  thread_local std::vector<int8_t> q;
  thread_local std::vector<float> xs, r, y2;
  const int nt = team_size();
  q.resize(a8_scratch_rows(2 * M) * K4);
  xs.resize(2 * M);
  r.resize(nt * K);  // a thread's remainder row each
  y2.resize(2 * M * N16);
  const uint8_t flip = MTPKIT_VNNI ? 0x80 : 0;
  const float* xp = xc.data_ptr<float>();
  // Pointers, not the vectors: they are this thread's, and the team's others would read
  // their own thread_local copies.
  int8_t* qp = q.data();
  float *xsp = xs.data(), *rp = r.data();
  // Row m's two int8 rows, on the thread whose turn it is: the team quantizes the rows
  // inside the GEMM's region, where one thread alone, before it, held the other idle for a
  // twentieth of a server step of eight rows.
  auto prepare = [&](Member& me) {
    float* rm = rp + me.t * K;
    for (int64_t m = me.t; m < M; m += me.nth) {
      const float* xm = xp + m * K;
      int8_t* q1 = qp + 2 * m * K4;
      quantize_rows(xm, 1, K, q1, xsp + 2 * m, K4, flip);
      const float s1 = xsp[2 * m];
      // One rounding (fma), whatever the compiler would contract: linear.a16_reference.
      for (int64_t k = 0; k < K; k++)
        rm[k] = std::fma(-float(int8_t(q1[k] ^ int8_t(flip))), s1, xm[k]);
      quantize_rows(rm, 1, K, q1 + K4, xsp + 2 * m + 1, K4, flip);
    }
  };
  const float* y2p = y2.data();
  float* yp = y.data_ptr<float>();
  // Each row's two partial products summed on the columns just computed (still in cache).
  a8_team(qp, xsp, 2 * M, K4, wc.data_ptr<int8_t>(), sc.data_ptr<float>(),
          cc.data_ptr<int32_t>(), y2.data(), N16, [&](int64_t c0, int64_t c1) {
            for (int64_t m = 0; m < M; m++)
              for (int64_t n = 16 * c0; n < 16 * c1; n++)
                yp[m * N16 + n] = y2p[2 * m * N16 + n] + y2p[(2 * m + 1) * N16 + n];
          }, prepare);
#else
  TORCH_CHECK(false, "int8_a16_mm was built without AVX2/FMA");
#endif
  return y;
}

TORCH_LIBRARY_FRAGMENT(mtpkit, m) {
  m.def("int8_a8_mm(Tensor x, Tensor w, Tensor s, Tensor colsum) -> Tensor");
  m.def("int8_a16_mm(Tensor x, Tensor w, Tensor s, Tensor colsum) -> Tensor");
}
TORCH_LIBRARY_IMPL(mtpkit, CPU, m) {
  m.impl("int8_a8_mm", &int8_a8_mm);
  m.impl("int8_a16_mm", &int8_a16_mm);
}

MTPKIT_AOTI_SHIM(int8_a8_mm,
                 (AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle s, AtenTensorHandle colsum, AtenTensorHandle* ret0),
                 (x, w, s, colsum),
                 int8_a8_mm(arg(x), arg(w), arg(s), arg(colsum)))
MTPKIT_AOTI_SHIM(int8_a16_mm,
                 (AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle s, AtenTensorHandle colsum, AtenTensorHandle* ret0),
                 (x, w, s, colsum),
                 int8_a16_mm(arg(x), arg(w), arg(s), arg(colsum)))
