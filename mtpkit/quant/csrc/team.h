// An OpenMP region's team for mtpkit's GEMM kernels: a spin barrier and column blocks shared
// by claiming (w8a8_block.cpp's fused layers, int8_a8_mm.cpp's lone GEMMs).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include <immintrin.h>
#include <omp.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace mtpkit_team {

// A barrier for one region's team, made before the region (count and sense zero) and
// shared by its threads, each with its own sense starting at zero. Against libgomp's
// barrier (7 waits a layer) it saves tens of microseconds a decode step. A waiter spins
// briefly, then sleeps on a futex: on a CPU shared with other work the member it waits for
// may be descheduled for a whole time slice, and a spinning (or yielding) waiter holds the
// very core that member needs, which made verification many times slower beside one busy
// thread.
struct Barrier {
  alignas(64) std::atomic<int> count{0};
  alignas(64) std::atomic<int> sense{0};
  std::atomic<int> sleepers{0};

  // Thread's wait, nth the team's size.
  void wait(int& mine, int nth) {
    if (nth == 1) return;
    mine ^= 1;
    if (count.fetch_add(1, std::memory_order_acq_rel) == nth - 1) {
      count.store(0, std::memory_order_relaxed);
      sense.store(mine, std::memory_order_seq_cst);
      if (sleepers.load(std::memory_order_seq_cst) > 0) wake(&sense);
      return;
    }
    for (int spins = 0; sense.load(std::memory_order_acquire) != mine; spins++) {
      if (spins < kSpins) {
        _mm_pause();
        continue;
      }
      // Registered before the last look, so that the releaser sees a sleeper or the
      // sleeper sees the new sense (both seq_cst): no wake-up is lost.
      sleepers.fetch_add(1, std::memory_order_seq_cst);
      if (sense.load(std::memory_order_seq_cst) != mine) sleep_on(&sense, mine ^ 1);
      sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // About 10-40 us of pauses (their latency differs by core): longer than a balanced
  // team's usual wait, far shorter than a scheduler time slice.
  static constexpr int kSpins = 2048;

  static void sleep_on(std::atomic<int>* word, int value) {
#ifdef __linux__
    syscall(SYS_futex, reinterpret_cast<int*>(word), FUTEX_WAIT_PRIVATE, value, nullptr,
            nullptr, 0);
#else
    (void)word, (void)value;
    std::this_thread::yield();
#endif
  }

  static void wake(std::atomic<int>* word) {
#ifdef __linux__
    syscall(SYS_futex, reinterpret_cast<int*>(word), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr,
            nullptr, 0);
#else
    (void)word;
#endif
  }
};

// One thread's share of the GEMM in hand, claimable from both ends: the owner takes column
// blocks from the front, a thread done with its own share half of what is left from the
// back (each keeps a long forward stream for its prefetches; stealing ~16 KB pieces instead
// gained half as much on verification). Packed in one word for compare-and-swap: the GEMM's
// number in the region (16 bits; a slot still holding an earlier GEMM's is that share
// untouched), back and front (24 bits each).
struct alignas(64) Slot {
  std::atomic<uint64_t> w{0};
};

// Why shares move: with static halves, a W8A8 decode step's threads each waited a tenth of
// the step at the barriers after the GEMMs on a 2-core machine, one core's memory stream
// running ahead of the other's by turns. Claimed blocks let the faster thread take over the
// slower one's remainder, which made both verification and decoding faster. A column's
// arithmetic does not depend on the thread that computes it, so no bit changes.
struct Team {
  Barrier bar;
  std::vector<Slot> slots;
  explicit Team(int nt) : slots(nt) {}
};

// A thread's view of its team: its number, the team's size, barrier and slots, its barrier
// sense and how many GEMMs it has shared.
struct Member {
  int t, nth;
  Team* team;
  int sense = 0;
  uint64_t gemms = 0;
  void barrier() { team->bar.wait(sense, nth); }
};

// The team size for a region: inside another parallel region (a caller's at::parallel_for)
// the work runs on this thread alone, as at::parallel_for would run it.
inline int team_size() {
  return omp_in_parallel() ? 1 : std::max(1, at::get_num_threads());
}

// at::parallel_for's split of [begin, end) (at most one piece a thread, pieces of at least
// grain), without its per-thread set-up. That set-up runs once per thread in every library
// that inlines it and resets the thread's OpenMP count to the process's: a thread that
// computes alone beside the engine (threads.compute_alone) would get a team of its own
// back at its first kernel call. f must not throw.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t n = end - begin;
  const int nt = team_size();
  if (n <= grain || n == 1 || nt == 1) {
    f(begin, end);
    return;
  }
  const int64_t pieces = std::min<int64_t>(nt, (n + grain - 1) / std::max<int64_t>(grain, 1));
  const int64_t chunk = (n + pieces - 1) / pieces;
#pragma omp parallel num_threads(static_cast<int>(pieces))
  {
    const int64_t b = begin + omp_get_thread_num() * chunk;
    if (b < end) f(b, std::min(end, b + chunk));
  }
}

// Thread t's static share [b0, b1) of nb blocks.
inline void share(int64_t nb, int t, int nt, int64_t& b0, int64_t& b1) {
  b0 = nb * t / nt;
  b1 = nb * (t + 1) / nt;
}

inline uint64_t slot_word(uint64_t g, int64_t front, int64_t back) {
  return (g & 0xffff) << 48 | uint64_t(back) << 24 | uint64_t(front);
}

// Claims blocks of thread v's share of GEMM g (static share [b0, b1)) into [c0, c1): a
// quarter of what is left from its front (few claims), or half from its back, at least n;
// false once it is empty.
inline bool claim(Slot& slot, uint64_t g, int64_t b0, int64_t b1, int64_t n, bool back,
                  int64_t& c0, int64_t& c1) {
  uint64_t w = slot.w.load(std::memory_order_acquire);
  for (;;) {
    if ((w >> 48) != (g & 0xffff)) {  // untouched: set it to the whole share first
      const uint64_t fresh = slot_word(g, b0, b1);
      if (slot.w.compare_exchange_weak(w, fresh, std::memory_order_acq_rel)) w = fresh;
      continue;
    }
    const int64_t f = int64_t(w & 0xffffff), b = int64_t(w >> 24 & 0xffffff);
    if (f >= b) return false;
    const int64_t k = std::min(std::max(n, back ? (b - f) / 2 : (b - f) / 4), b - f);
    const uint64_t next = back ? slot_word(g, f, b - k) : slot_word(g, f + k, b);
    if (slot.w.compare_exchange_weak(w, next, std::memory_order_acq_rel)) {
      c0 = back ? b - k : f;
      c1 = back ? b : f + k;
      return true;
    }
  }
}

// nb blocks (nb < 2^24) shared by the team: this thread's own share front to back, then
// halves of what the others have left, from the back, at least `piece` blocks a claim;
// run(c0, c1) for each claimed piece [c0, c1). Every member calls it once per GEMM, in the
// same order as the others.
template <class Run>
void share_blocks(int64_t nb, int64_t piece, Member& me, const Run& run) {
  int64_t b0, b1, c0, c1;
  if (me.nth == 1) {
    if (nb > 0) run(int64_t(0), nb);
    return;
  }
  const uint64_t g = ++me.gemms;
  share(nb, me.t, me.nth, b0, b1);
  Slot& own = me.team->slots[me.t];
  while (claim(own, g, b0, b1, piece, false, c0, c1)) run(c0, c1);
  for (int i = 1; i < me.nth; i++) {
    const int v = (me.t + i) % me.nth;
    share(nb, v, me.nth, b0, b1);
    while (claim(me.team->slots[v], g, b0, b1, piece, true, c0, c1)) run(c0, c1);
  }
}

}  // namespace mtpkit_team
