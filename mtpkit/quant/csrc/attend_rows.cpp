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
// Why by hand: torch's CPU SDPA is slow for one query row of a small model (SmolLM2: 9
// heads, ~0.16 M multiply-adds at 136 keys): its general blocked kernel
// allocates and transposes per call. Compiled quantized trunks attend one row at a time (so
// that a verified row is the same computation as a one-token step). One call a layer takes
// all of a step's rows (scores in 8-key blocks, softmaxes, weighted values), so that every
// row's query heads of a KV head share each key and value row loaded; a call per row and
// head re-read them from L2 and ran at its speed at long spans. Threads take whole queries
// when each gets a few (one fork), else split the three passes (three forks; attend.h).
//
// Exactness: a (row, head) result depends only on its own q row, the slots it reads and D;
// the arithmetic order is fixed (whatever the thread split, the head count, the row count or
// the other rows of a step), so every step that computes a row gets the same bits.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "aoti_shim.h"
#include "team.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include "attend.h"
#endif

#if defined(__AVX2__) && defined(__FMA__)
// One planned call's passes, its output pointer set.
static void run(mtpkit_attn::Attend& a) {
  thread_local std::vector<float> buf;
  buf.resize(a.scratch());
  a.use(buf.data());
  // Threads split whatever work there is, so a short span stays on one thread, where a fork
  // would cost more than the work.
  if (a.fused(at::get_num_threads())) {
    // One fork: each thread's queries through all three passes.
    mtpkit_team::parallel_for(0, a.items0(), std::max<int64_t>(1, 65536 / (a.pmax * 2 * a.D)),
                     [&](int64_t i0, int64_t i1) { a.pass0(i0, i1); });
  } else {
    const int64_t work1 = a.rows * a.g * 8 * a.D;
    mtpkit_team::parallel_for(0, a.items1(), std::max<int64_t>(1, 65536 / work1),
                     [&](int64_t i0, int64_t i1) { a.pass1(i0, i1); });
    mtpkit_team::parallel_for(0, a.items2(), std::max<int64_t>(1, 65536 / (a.pmax * 8)),
                     [&](int64_t i0, int64_t i1) { a.pass2(i0, i1); });
    const int64_t nq6 = std::min<int64_t>(a.rows * a.g, 6);
    mtpkit_team::parallel_for(0, a.items3(), std::max<int64_t>(1, 65536 / (a.pmax * 16 * nq6)),
                     [&](int64_t i0, int64_t i1) { a.pass3(i0, i1); });
  }
  a.pad_rows();
}
#endif

static at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& pos, int64_t rows) {
#if defined(__AVX2__) && defined(__FMA__)
  mtpkit_attn::Attend a(q, k, v, pos, rows);
  at::Tensor out = at::empty({a.T, a.H, a.D}, q.options());
  a.op = out.data_ptr<float>();
  run(a);
  return out;
#else
  TORCH_CHECK(false, "attend_rows was built without AVX2/FMA");
#endif
}

// mtpkit::attend_seqs(q, k, v, kbufs, vbufs, pos, sizes) -> out: attend_rows for the rows of
// several sequences laid end to end (a server's batched step), each with caches of its own.
//   q float32 [N, H, D], k/v float32 [N, Hkv, D]: the rotated queries, keys and values of
//   N rows, sizes[b] of them sequence b's; kbufs[b], vbufs[b] [1, Hkv, L, D]: its caches;
//   pos int64 [N]: the rows' positions. Row r's key and value are written at pos[r] in its
//   sequence's caches, then its sequence's rows attend as attend_rows attends them, so each
//   row gets the bits its sequence's own step gives. One call a layer where a loop over the
//   sequences made some twenty PyTorch calls a sequence (the copies, the attention, views).
//
// mtpkit::attend_pool(q, k, v, kpool, vpool, slots, sizes, pos) -> out: attend_seqs with every
// sequence's cache a slot of one pool, kpool/vpool float32 [S, Hkv, L, D], sequence b's at
// slots[b] (int64 [B]), sizes int64 [B]. The same computation, row for row; what differs is
// that the sequences are tensors, not lists, so a compiled program takes any batch (its
// shapes do not depend on how many sequences there are, nor on which slots they hold).
//
// Both plan from raw pointers: a view made for each sequence's cache, query rows and
// positions (six a sequence) cost more than its attention at eight sequences of short spans.
#if defined(__AVX2__) && defined(__FMA__)
namespace {

// One sequence's caches [Hkv, L, D] as pointers and strides (rows contiguous).
struct SeqCache {
  float *k, *v;
  int64_t kh, ks, vh, vs, L;
};

// Writes each row's key and value at its position in its sequence's caches, then attends
// every sequence's rows (attend_rows' arithmetic) -> out [N, H, D].
at::Tensor attend_many(const char* op, const at::Tensor& q_, const at::Tensor& k,
                       const at::Tensor& v, const std::vector<SeqCache>& caches,
                       const at::Tensor& pos_, const int64_t* sizes) {
  TORCH_CHECK(q_.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes() &&
                  k.size(0) == q_.size(0) && k.size(2) == q_.size(2) && k.size(1) > 0 &&
                  q_.size(1) % k.size(1) == 0,
              op, ": q [N,H,D], k/v [N,Hkv,D], H a multiple of Hkv");
  TORCH_CHECK(q_.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && pos_.scalar_type() == at::kLong,
              op, ": float32 q/k/v, int64 pos");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, op, ": k/v need contiguous rows");
  const at::Tensor q = q_.stride(2) == 1 ? q_ : q_.contiguous();
  const at::Tensor pos = pos_.contiguous();
  const int64_t N = q.size(0), H = q.size(1), Hkv = k.size(1), D = k.size(2);
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == N, op, ": pos [N]");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  at::Tensor out = at::detail::empty_cpu({N, H, D}, at::kFloat, /*pin_memory=*/false);
  float* outp = out.data_ptr<float>();
  const int64_t nseq = static_cast<int64_t>(caches.size());
  std::vector<mtpkit_attn::Attend> plans;
  plans.reserve(nseq);
  int64_t r0 = 0;
  for (int64_t b = 0; b < nseq; b++) {
    const int64_t n = sizes[b];
    TORCH_CHECK(n >= 1 && r0 + n <= N, op, ": sizes must add up to N");
    const SeqCache& c = caches[b];
    for (int64_t r = r0; r < r0 + n; r++) {
      TORCH_CHECK(pp[r] >= 0 && pp[r] < c.L, op, ": position outside the cache");
      for (int64_t h = 0; h < Hkv; h++) {
        std::copy_n(kp + r * k.stride(0) + h * k.stride(1), D, c.k + h * c.kh + pp[r] * c.ks);
        std::copy_n(vp + r * v.stride(0) + h * v.stride(1), D, c.v + h * c.vh + pp[r] * c.vs);
      }
    }
    plans.emplace_back(qp + r0 * q.stride(0), q.stride(0), q.stride(1), c.k, c.kh, c.ks, c.v,
                       c.vh, c.vs, n, H, Hkv, c.L, D, pp + r0, n, op);
    plans.back().op = outp + r0 * H * D;
    r0 += n;
  }
  TORCH_CHECK(r0 == N, op, ": sizes must add up to N");
  if (nseq == 1) {
    run(plans[0]);
    return out;
  }
  // Threads take whole sequences (one fork a call, where a sequence's own split forked up
  // to three times); the split does not change a row's arithmetic (attend.h).
  mtpkit_team::parallel_for(0, nseq, 1, [&](int64_t b0, int64_t b1) {
    thread_local std::vector<float> buf;
    for (int64_t b = b0; b < b1; b++) {
      mtpkit_attn::Attend& a = plans[b];
      buf.resize(a.scratch());
      a.use(buf.data());
      a.pass0(0, a.items0());
      a.pad_rows();
    }
  });
  return out;
}

}  // namespace
#endif

static at::Tensor attend_seqs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              at::TensorList kbufs, at::TensorList vbufs, const at::Tensor& pos,
                              at::IntArrayRef sizes) {
#if defined(__AVX2__) && defined(__FMA__)
  const size_t nseq = sizes.size();
  TORCH_CHECK(kbufs.size() == nseq && vbufs.size() == nseq,
              "attend_seqs: one cache pair a sequence");
  TORCH_CHECK(k.dim() == 3, "attend_seqs: q [N,H,D], k/v [N,Hkv,D]");
  std::vector<SeqCache> caches;
  caches.reserve(nseq);
  for (size_t b = 0; b < nseq; b++) {
    const at::Tensor& kb = kbufs[b];
    const at::Tensor& vb = vbufs[b];
    TORCH_CHECK(kb.dim() == 4 && kb.size(0) == 1 && kb.size(1) == k.size(1) &&
                    kb.size(3) == k.size(2) && kb.sizes() == vb.sizes() &&
                    kb.scalar_type() == at::kFloat && vb.scalar_type() == at::kFloat &&
                    kb.stride(3) == 1 && vb.stride(3) == 1,
                "attend_seqs: caches [1, Hkv, L, D] float32");
    caches.push_back({kb.data_ptr<float>(), vb.data_ptr<float>(), kb.stride(1), kb.stride(2),
                      vb.stride(1), vb.stride(2), kb.size(2)});
  }
  return attend_many("attend_seqs", q, k, v, caches, pos, sizes.data());
#else
  TORCH_CHECK(false, "attend_seqs was built without AVX2/FMA");
#endif
}

static at::Tensor attend_pool(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              at::Tensor& kpool, at::Tensor& vpool, const at::Tensor& slots_,
                              const at::Tensor& sizes_, const at::Tensor& pos) {
#if defined(__AVX2__) && defined(__FMA__)
  TORCH_CHECK(kpool.dim() == 4 && kpool.sizes() == vpool.sizes() && k.dim() == 3 &&
                  kpool.size(1) == k.size(1) && kpool.size(3) == k.size(2) &&
                  kpool.scalar_type() == at::kFloat && vpool.scalar_type() == at::kFloat &&
                  kpool.stride(3) == 1 && vpool.stride(3) == 1,
              "attend_pool: kpool/vpool float32 [S, Hkv, L, D] with contiguous rows");
  TORCH_CHECK(slots_.dim() == 1 && sizes_.dim() == 1 && slots_.size(0) == sizes_.size(0) &&
                  slots_.scalar_type() == at::kLong && sizes_.scalar_type() == at::kLong,
              "attend_pool: slots and sizes int64 [B]");
  const at::Tensor slots = slots_.contiguous(), sizes = sizes_.contiguous();
  const int64_t B = slots.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::vector<SeqCache> caches;
  caches.reserve(B);
  float *kp = kpool.data_ptr<float>(), *vp = vpool.data_ptr<float>();
  for (int64_t b = 0; b < B; b++) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < kpool.size(0), "attend_pool: slot outside the pool");
    caches.push_back({kp + sp[b] * kpool.stride(0), vp + sp[b] * vpool.stride(0),
                      kpool.stride(1), kpool.stride(2), vpool.stride(1), vpool.stride(2),
                      kpool.size(2)});
  }
  return attend_many("attend_pool", q, k, v, caches, pos, sizes.data_ptr<int64_t>());
#else
  TORCH_CHECK(false, "attend_pool was built without AVX2/FMA");
#endif
}

TORCH_LIBRARY_FRAGMENT(mtpkit, m) {
  m.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor pos, int rows) -> Tensor");
  m.def("attend_seqs(Tensor q, Tensor k, Tensor v, Tensor(a!)[] kbufs, Tensor(b!)[] vbufs, "
        "Tensor pos, int[] sizes) -> Tensor");
  m.def("attend_pool(Tensor q, Tensor k, Tensor v, Tensor(a!) kpool, Tensor(b!) vpool, "
        "Tensor slots, Tensor sizes, Tensor pos) -> Tensor");
}
TORCH_LIBRARY_IMPL(mtpkit, CPU, m) {
  m.impl("attend_rows", &attend_rows);
  m.impl("attend_seqs", &attend_seqs);
  m.impl("attend_pool", &attend_pool);
}

MTPKIT_AOTI_SHIM(attend_rows,
                 (AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle pos, int64_t rows, AtenTensorHandle* ret0),
                 (q, k, v, pos),
                 attend_rows(arg(q), arg(k), arg(v), arg(pos), rows))
MTPKIT_AOTI_SHIM(attend_pool,
                 (AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle kpool, AtenTensorHandle vpool, AtenTensorHandle slots, AtenTensorHandle sizes, AtenTensorHandle pos, AtenTensorHandle* ret0),
                 (q, k, v, kpool, vpool, slots, sizes, pos),
                 attend_pool(arg(q), arg(k), arg(v), mut(kpool), mut(vpool), arg(slots), arg(sizes), arg(pos)))
