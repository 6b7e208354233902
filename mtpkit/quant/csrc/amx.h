// The W8A8 loop (int8_a8.h) on Intel AMX tiles, for GEMMs of several rows.
//
// Why: with VNNI a row costs one vpdpbusd per 64 codes, so a batched server step of eight
// sequences (sixteen int8 rows through int8_a16_mm) spends about as long in arithmetic as in
// reading the weights, and the two overlap poorly: eight rows took twice a one-row pass. One
// tdpbusd multiplies sixteen rows by a 64 x 16 block of codes, so on a CPU with AMX any row
// count up to sixteen streams the weights at about a one-row pass's time.
//
// Exactness: a tile sums the same int32 products as vpdpbusd (unsigned q + 128 times signed
// codes; exact, so the order does not matter) and the float epilogue is int8_a8.h's, so every
// output has the bits of the VNNI loop, whichever rows come with it.
//
// The packed layout (int8_a8_mm.cpp's header) is already what tdpbusd reads as its second
// operand: sixteen 64-byte runs of a block are a 16 x 64 tile, stride 64. The rows' quantized
// activations are the first operand, 64 bytes (16 groups of 4) at a time, stride K4.
#pragma once

#if MTPKIT_VNNI && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "simd.h"

#define MTPKIT_AMX 1

namespace mtpkit_amx {

// Whether this CPU has AMX int8 and the kernel lets the process use its tile state (Linux
// asks each process to request it: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)).
inline bool available() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), int8 = d & (1u << 25);
    if (!tile || !int8) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return ok;
}

// Below this many int8 rows the VNNI loop streams the weights at a one-row pass's speed and
// measured a little faster than the tiles (a W8A16 verification of two rows is four).
constexpr int64_t kMinRows = 5;

struct alignas(64) Config {
  uint8_t palette = 1, start = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-3 accumulate four column blocks; 4 holds 64 activations of 16 rows and 5 a block's
// 16 runs; 6 and 7 the same for the last rem < 16 runs of K4 (a K not a multiple of 64).
__attribute__((target("amx-tile,amx-int8"))) inline void configure(int64_t rem) {
  Config c;
  for (int t = 0; t < 6; t++) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  if (rem) {
    c.rows[6] = 16;
    c.colsb[6] = static_cast<uint16_t>(4 * rem);
    c.rows[7] = static_cast<uint8_t>(rem);
    c.colsb[7] = 64;
  }
  // As an asm statement that reads all of c: gcc 12 takes its ldtilecfg builtin to read
  // only the first byte and drops the stores of the rest as dead.
  asm volatile("ldtilecfg %0" : : "m"(c));
}

// A thread's tiles back to the initial state (the kernel then saves none of them on a
// context switch).
__attribute__((target("amx-tile"))) inline void release() { _tile_release(); }

// Rows padded to what a8_tiles reads: whole tiles of 16.
inline int64_t padded(int64_t rows) { return (rows + 15) / 16 * 16; }

// One chunk: 64 activations of 16 rows (tile A, rows K4 apart from qa) times the matching
// runs of up to nb column blocks (tile B, from wc, blocks 16 * K4 bytes apart), into tiles
// 0-3. A macro because tile numbers are immediates (the intrinsics are asm templates).
#define MTPKIT_AMX_CHUNK(A, B, qa, wc)        \
  do {                                        \
    _tile_loadd(A, (qa), K4);                 \
    _tile_loadd(B, (wc), 64);                 \
    _tile_dpbusd(0, A, B);                    \
    if (nb > 1) {                             \
      _tile_loadd(B, (wc) + 16 * K4, 64);     \
      _tile_dpbusd(1, A, B);                  \
    }                                         \
    if (nb > 2) {                             \
      _tile_loadd(B, (wc) + 32 * K4, 64);     \
      _tile_dpbusd(2, A, B);                  \
    }                                         \
    if (nb > 3) {                             \
      _tile_loadd(B, (wc) + 48 * K4, 64);     \
      _tile_dpbusd(3, A, B);                  \
    }                                         \
  } while (0)

// Rows [0, M) of q (padded with readable rows to a multiple of 16; q + 128 as unsigned
// bytes) against column blocks [b0, b1) of 16, y[m, 16b + c] as a8_rows writes it. Each
// thread configures its tiles (configure(K4 / 4 % 16)) before the first call.
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq"))) inline void
a8_tiles(const int8_t* q, const float* xs, int64_t M, int64_t K4, const int8_t* w,
         const float* s, const int32_t* colsum, float* y, int64_t N16, int64_t b0, int64_t b1) {
  const int64_t T = K4 / 4, full = T / 16, rem = T % 16;
  alignas(64) int32_t acc[4][16 * 16];
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t rows = M - m0 < 16 ? M - m0 : 16;
    const int8_t* qm = q + m0 * K4;
    for (int64_t b = b0; b < b1; b += 4) {
      const int64_t nb = b1 - b < 4 ? b1 - b : 4;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      const int8_t* wb = w + b * 16 * K4;
      for (int64_t c = 0; c < full; c++) {
        const int8_t* wc = wb + 1024 * c;
        // The codes ahead, as the VNNI loop prefetches them (simd.h): at a few rows the
        // tiles wait on memory, and the hardware prefetcher alone leaves a thread short.
        if (m0 == 0)
          for (int64_t j = 0; j < nb; j++)
            for (int l = 0; l < 16; l++) mtpkit_simd::prefetch(wc + 16 * K4 * j + 64 * l);
        MTPKIT_AMX_CHUNK(4, 5, qm + 64 * c, wc);
      }
      if (rem) MTPKIT_AMX_CHUNK(6, 7, qm + 64 * full, wb + 1024 * full);
      _tile_stored(0, acc[0], 64);
      if (nb > 1) _tile_stored(1, acc[1], 64);
      if (nb > 2) _tile_stored(2, acc[2], 64);
      if (nb > 3) _tile_stored(3, acc[3], 64);
      for (int64_t j = 0; j < nb; j++) {
        const int64_t bj = b + j;
        const __m512 sv = _mm512_loadu_ps(s + 16 * bj);
        const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512((const void*)(colsum + 16 * bj)), 7);
        for (int64_t r = 0; r < rows; r++) {
          const __m512i a = _mm512_sub_epi32(_mm512_load_si512((const void*)(acc[j] + 16 * r)), off);
          // int8_a8.h's epilogue, the same operations in the same order.
          _mm512_storeu_ps(y + (m0 + r) * N16 + 16 * bj,
                           _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a),
                                                       _mm512_set1_ps(xs[m0 + r])), sv));
        }
      }
    }
  }
}

#undef MTPKIT_AMX_CHUNK

}  // namespace mtpkit_amx
#else
#define MTPKIT_AMX 0
#endif
