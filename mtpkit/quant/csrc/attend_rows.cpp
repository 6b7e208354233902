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
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "aoti_shim.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include "attend.h"
#endif

static at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& pos, int64_t rows) {
#if defined(__AVX2__) && defined(__FMA__)
  mtpkit_attn::Attend a(q, k, v, pos, rows);
  at::Tensor out = at::empty({a.T, a.H, a.D}, q.options());
  a.op = out.data_ptr<float>();
  thread_local std::vector<float> buf;
  buf.resize(a.scratch());
  a.use(buf.data());
  // Threads split whatever work there is, so a short span stays on one thread, where a fork
  // would cost more than the work.
  if (a.fused(at::get_num_threads())) {
    // One fork: each thread's queries through all three passes.
    at::parallel_for(0, a.items0(), std::max<int64_t>(1, 65536 / (a.pmax * 2 * a.D)),
                     [&](int64_t i0, int64_t i1) { a.pass0(i0, i1); });
  } else {
    const int64_t work1 = a.rows * a.g * 8 * a.D;
    at::parallel_for(0, a.items1(), std::max<int64_t>(1, 65536 / work1),
                     [&](int64_t i0, int64_t i1) { a.pass1(i0, i1); });
    at::parallel_for(0, a.items2(), std::max<int64_t>(1, 65536 / (a.pmax * 8)),
                     [&](int64_t i0, int64_t i1) { a.pass2(i0, i1); });
    const int64_t nq6 = std::min<int64_t>(a.rows * a.g, 6);
    at::parallel_for(0, a.items3(), std::max<int64_t>(1, 65536 / (a.pmax * 16 * nq6)),
                     [&](int64_t i0, int64_t i1) { a.pass3(i0, i1); });
  }
  a.pad_rows();
  return out;
#else
  TORCH_CHECK(false, "attend_rows was built without AVX2/FMA");
#endif
}

TORCH_LIBRARY_FRAGMENT(mtpkit, m) {
  m.def("attend_rows(Tensor q, Tensor k, Tensor v, Tensor pos, int rows) -> Tensor");
}
TORCH_LIBRARY_IMPL(mtpkit, CPU, m) { m.impl("attend_rows", &attend_rows); }

MTPKIT_AOTI_SHIM(attend_rows,
                 (AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle pos, int64_t rows, AtenTensorHandle* ret0),
                 (q, k, v, pos),
                 attend_rows(arg(q), arg(k), arg(v), arg(pos), rows))
