// mtpkit::argmax_rows(x) -> idx: the greedy pick of a step's logits.
//   x float32 [T, V] (rows contiguous), idx int64 [T]: idx[t] = torch.argmax(x[t]), that is
//   the first index of the row's maximum, where a NaN counts as larger than any number (the
//   first NaN wins).
//
// Why by hand: the compiled steps' argmax is inductor's generic reduction, which opens one
// parallel region per row and carries an index through every vector compare, a visible
// share of a small model's verification step over a 49,152-token vocabulary. This
// takes a row in two plain vector passes over L2-resident data (the maximum, then its first
// position), the rows' column halves split over the threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "aoti_shim.h"
#include "team.h"

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

struct Best {
  float value;
  int64_t index;
  bool nan;
};

// The first maximum of p[0, n) (the first NaN, if any), index offset by `base`.
Best scan(const float* p, int64_t n, int64_t base) {
  int64_t i = 0;
  float m = -INFINITY;
  bool nan = false;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 vm = _mm256_set1_ps(-INFINITY), unord = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(p + i);
    unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vm = _mm256_max_ps(vm, v);
  }
  nan = _mm256_movemask_ps(unord) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float l : lanes) m = l > m ? l : m;
#endif
  for (int64_t j = i; j < n; j++) {
    if (std::isnan(p[j])) nan = true;
    else if (p[j] > m) m = p[j];
  }
  // Second pass: the first position holding the maximum, or the first NaN when there is
  // one (the maximum above is then meaningless: vmaxps passes NaN lanes through unevenly).
  for (int64_t j = 0; j < n; j++) {
    if (nan ? std::isnan(p[j]) : p[j] == m) return {p[j], base + j, nan};
  }
  return {m, base, nan};  // n == 0: unused (every row has V >= 1 columns)
}

// Whether a (found later in the row) beats b (found earlier): only a NaN over a number, or a
// strictly larger number; ties keep the earlier position.
bool beats(const Best& a, const Best& b) {
  if (a.nan || b.nan) return a.nan && !b.nan;
  return a.value > b.value;
}

}  // namespace

static at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "argmax_rows: x float32 [T, V]");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows are empty");
  const at::Tensor xc = x.contiguous();
  const int64_t T = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({T}, x.options().dtype(at::kLong));
  // Each row in `parts` column ranges (rows are few and long): found[t * parts + c].
  const int64_t parts = V >= 4096 ? 2 : 1, width = (V + parts - 1) / parts;
  std::vector<Best> found(T * parts);
  const float* xp = xc.data_ptr<float>();
  mtpkit_team::parallel_for(0, T * parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; w++) {
      const int64_t t = w / parts, c0 = (w % parts) * width, c1 = std::min(V, c0 + width);
      found[w] = scan(xp + t * V + c0, c1 - c0, c0);
    }
  });
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; t++) {
    Best best = found[t * parts];
    for (int64_t c = 1; c < parts; c++)
      if (beats(found[t * parts + c], best)) best = found[t * parts + c];
    op[t] = best.index;
  }
  return out;
}

TORCH_LIBRARY_FRAGMENT(mtpkit, m) { m.def("argmax_rows(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(mtpkit, CPU, m) { m.impl("argmax_rows", &argmax_rows); }

MTPKIT_AOTI_SHIM(argmax_rows,
                 (AtenTensorHandle x, AtenTensorHandle* ret0),
                 (x),
                 argmax_rows(arg(x)))
