// y = x W^T on the CPU, for the few rows a decode step, a verify pass or a tree carries.
//
// XLA:CPU multiplies a handful of rows at ~35 GFLOP/s in float32 and ten times slower in bfloat16, so
// a 6-token verify cost 3-4 single-token steps. These handlers stream each weight row once per tile of
// up to 6 (AVX-512) or 4 (AVX2) input rows (the tile's weight rows stay in L1 while every tile of x
// passes over them), so that a pass over a few rows costs about what one row costs: its weights' bytes.
// Two vector paths:
// - AVX-512: float32 FMA; bfloat16 with the VDPBF16PS dot product (AVX512_BF16), float32 accumulation;
//   6 x 4 register tiles.
// - AVX2 + FMA (CPUs without AVX-512, or without AVX512_BF16 for bfloat16): float32 FMA; bfloat16
//   weights widened to float32 in registers (a bfloat16 is the high half of a float32: one shift for
//   the even elements of a 32-bit lane pair, one mask for the odd ones) and multiplied by FMA in
//   float32 with x, which is widened once per call into a float32 copy laid out the same way. Tiles of
//   up to 4 rows of x by 3-4 rows of W (AVX2 has 16 vector registers).
//
// Batch invariance: y[m, n] is the same sequence of vector operations on x[m] and W[n] whatever the
// number of rows M, the row's place in its tile, the tile's shape or which thread computes it, so a
// verify pass computes bit for bit what a one-token step computes (greedy speculative output then
// equals greedy autoregressive output in bfloat16 too). Within one path, that is: the AVX-512 and AVX2
// paths sum in different orders and may differ from each other in the last bits; one call runs one path.
//
// Handlers (XLA FFI, CPU): specjax_matmul_f32(x [M, K] f32, w [N, K] f32) -> y [M, N] f32 and
// specjax_matmul_bf16(x [M, K] bf16, w [N, K] bf16) -> y [M, N] f32. Output rows are split over XLA's
// intra-op thread pool. CPUs with neither vector path run a portable loop (correct, slow: the Python
// side chooses XLA there); `specjax_cpu_features` tells which path runs, `specjax_cpu_limit` caps it
// (tests run every path a CPU has).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECJAX_X86 1
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kTileM = 6;      // rows of x per register tile (6 x 4 = 24 of the 32 vector registers
constexpr int64_t kTileN = 4;      // accumulate; rows of W per tile: a W vector is loaded once for 6 rows;
//                                    the next tile's rows of W are prefetched as this one's are read: the
//                                    hardware prefetcher alone left a 6-row pass at 1.3x a 1-row one)
constexpr int64_t kRowBlock = 96;  // rows of x per pass over a chunk of W (kept in L2 for long prompts)
constexpr int64_t kChunk = 32;     // rows of W per unit of work handed to a thread

float Bf16ToFloat(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

// The portable path: one float32 accumulator per output, k in order.
template <typename T>
void PortableRows(const T* x, const T* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = n0; n < n1; ++n) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        if constexpr (std::is_same_v<T, float>) {
          acc += x[m * K + k] * w[n * K + k];
        } else {
          acc += Bf16ToFloat(x[m * K + k]) * Bf16ToFloat(w[n * K + k]);
        }
      }
      y[m * N + n] = acc;
    }
  }
}

#ifdef SPECJAX_X86

// One register tile: MR rows of x times NR rows of W, over all of K. Every accumulator sees the same
// loads in the same order for any MR, NR: that is what makes the result batch-invariant.
template <int MR, int NR>
__attribute__((target("avx512f"))) inline void StepF32(const float* x, const float* w, int64_t K, int64_t k,
                                                      __mmask16 mask, __m512 (&acc)[MR][NR]) {
  __m512 wv[NR];
  for (int j = 0; j < NR; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (j + kTileN) * K + k), _MM_HINT_T0);
    wv[j] = _mm512_maskz_loadu_ps(mask, w + j * K + k);
  }
  for (int i = 0; i < MR; ++i) {
    const __m512 xv = _mm512_maskz_loadu_ps(mask, x + i * K + k);
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
  }
}

template <int MR, int NR>
__attribute__((target("avx512f"))) void TileF32(const float* x, const float* w, float* y, int64_t N, int64_t K) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) StepF32<MR, NR>(x, w, K, k, __mmask16(0xFFFF), acc);
  if (k < K) StepF32<MR, NR>(x, w, K, k, __mmask16((1u << (K - k)) - 1), acc);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int MR, int NR>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void StepBf16(const uint16_t* x, const uint16_t* w,
                                                                          int64_t K, int64_t k, __mmask32 mask,
                                                                          __m512 (&acc)[MR][NR]) {
  __m512bh wv[NR];
  for (int j = 0; j < NR; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (j + kTileN) * K + k), _MM_HINT_T0);
    wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + j * K + k);
  }
  for (int i = 0; i < MR; ++i) {
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + i * K + k);
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
  }
}

template <int MR, int NR>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void TileBf16(const uint16_t* x, const uint16_t* w, float* y,
                                                                    int64_t N, int64_t K) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) StepBf16<MR, NR>(x, w, K, k, __mmask32(0xFFFFFFFFu), acc);
  if (k < K) StepBf16<MR, NR>(x, w, K, k, __mmask32((1ull << (K - k)) - 1), acc);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <typename T, int MR, int NR>
void Tile(const T* x, const T* w, float* y, int64_t N, int64_t K) {
  if constexpr (std::is_same_v<T, float>) {
    TileF32<MR, NR>(x, w, y, N, K);
  } else {
    TileBf16<MR, NR>(x, w, y, N, K);
  }
}

// Dispatches a tile of `mr` x `nr` (1..kTileM, 1..kTileN) rows to its compiled shape.
template <typename T, int MR>
void TileRows(const T* x, const T* w, float* y, int64_t N, int64_t K, int64_t nr) {
  switch (nr) {
    case 4: return Tile<T, MR, 4>(x, w, y, N, K);
    case 3: return Tile<T, MR, 3>(x, w, y, N, K);
    case 2: return Tile<T, MR, 2>(x, w, y, N, K);
    default: return Tile<T, MR, 1>(x, w, y, N, K);
  }
}

template <typename T>
void VectorRows(const T* x, const T* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    for (int64_t n = n0; n < n1; n += kTileN) {
      const int64_t nr = std::min(kTileN, n1 - n);
      for (int64_t m = m0; m < m1; m += kTileM) {
        const T* xm = x + m * K;
        const T* wn = w + n * K;
        float* ym = y + m * N + n;
        switch (std::min(kTileM, m1 - m)) {
          case 6: TileRows<T, 6>(xm, wn, ym, N, K, nr); break;
          case 5: TileRows<T, 5>(xm, wn, ym, N, K, nr); break;
          case 4: TileRows<T, 4>(xm, wn, ym, N, K, nr); break;
          case 3: TileRows<T, 3>(xm, wn, ym, N, K, nr); break;
          case 2: TileRows<T, 2>(xm, wn, ym, N, K, nr); break;
          default: TileRows<T, 1>(xm, wn, ym, N, K, nr); break;
        }
      }
    }
  }
}

// ---- AVX2 + FMA ----------------------------------------------------------------------------------
// Accumulator acc[i][j] holds 8 float32 partial sums of x[i] . W[j]: lane l sums the products of
// elements k = 8b + l (float32) or of the pair 16b + 2l, 16b + 2l + 1 (bfloat16: even element first),
// over blocks b in order, each by one FMA; the K tail is zero-padded (0 * 0 adds +0 to every lane, as in
// any tile); the 8 lanes are then summed by one fixed tree (Sum8). Nothing depends on MR, NR or M.

#define SPECJAX_AVX2 __attribute__((target("avx2,fma")))

// Rows of x per tile, and rows of W per tile for a row block whose widest tile of x has `rows` rows:
// MR x NR accumulators, NR weight vectors and one x vector fill the 16 ymm registers (4 x 3: 12 + 3 + 1);
// a narrow tile takes more rows of W, so that a one-token step still runs several independent FMA chains.
// Measured on a 2-core AMD EPYC (one thread, CPU time, 8960 x 1536): 4 x 3 with x held in a register and
// bfloat16 widened in two halves made a 6-row bfloat16 product ~25% faster than 6 x 2 tiles with x folded
// into every FMA as a memory operand (two loads per FMA pair: load-bound); float32 was within noise.
constexpr int64_t kAvx2TileM = 4;
constexpr int64_t Avx2TileN(int64_t rows) { return rows >= 3 ? 3 : 4; }

// Keeps a loaded vector in a register: without it the compiler folds the load into each FMA that uses
// it, one load per FMA, and the loop runs at the speed of the load ports instead of the FMA units.
#define SPECJAX_IN_REGISTER(v) __asm__("" : "+x"(v))

SPECJAX_AVX2 inline float Sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // lanes l + l+4
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                          // (0+2), (1+3)
  s = _mm_add_ss(s, _mm_movehdup_ps(s));                                           // (0+2) + (1+3)
  return _mm_cvtss_f32(s);
}

// One step of 8 elements of K: every W vector loaded once for the MR rows of x.
template <int MR, int NR>
SPECJAX_AVX2 inline void Avx2StepF32(const float* x, const float* w, int64_t K, int64_t k, __m256 (&acc)[MR][NR]) {
  __m256 wv[NR];
  for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
  for (int i = 0; i < MR; ++i) {
    __m256 xv = _mm256_loadu_ps(x + i * K + k);
    SPECJAX_IN_REGISTER(xv);
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
  }
}

template <int MR, int NR>
SPECJAX_AVX2 void Avx2TileF32(const float* x, const float* w, float* y, int64_t N, int64_t K) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {  // one 64-byte line of each W row: prefetch the next tile's
    for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * K + k), _MM_HINT_T0);
    Avx2StepF32<MR, NR>(x, w, K, k, acc);
    Avx2StepF32<MR, NR>(x, w, K, k + 8, acc);
  }
  if (k + 8 <= K) {
    Avx2StepF32<MR, NR>(x, w, K, k, acc);
    k += 8;
  }
  if (k < K) {  // 1..7 elements: masked loads read zeros beyond K (and never fault)
    alignas(32) static constexpr int32_t kLanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    const __m256i mask = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kLanes + 8 - (K - k)));
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = _mm256_maskload_ps(w + j * K + k, mask);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_maskload_ps(x + i * K + k, mask);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = Sum8(acc[i][j]);
}

// bfloat16: 16 elements of K per step. Each 32-bit lane of a W vector holds the pair (2l, 2l + 1); the
// even element as float32 is the lane shifted left 16 bits, the odd one the lane with its low half
// cleared. x comes already widened (WidenBf16Rows): 8 even elements, then 8 odd ones, per 16. Every
// accumulator takes its even products, then its odd ones (W's rows are read twice from L1, so that only
// NR widened W vectors are live at a time).
template <int MR, int NR>
SPECJAX_AVX2 inline void Avx2StepBf16(const float* xf, int64_t KP, const uint16_t* w, int64_t K, int64_t k,
                                      __m256 (&acc)[MR][NR]) {
  const __m256i high = _mm256_set1_epi32(int32_t(0xFFFF0000u));
  __m256 wv[NR];
  for (int j = 0; j < NR; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k));
    wv[j] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  for (int i = 0; i < MR; ++i) {
    __m256 xe = _mm256_loadu_ps(xf + i * KP + k);
    SPECJAX_IN_REGISTER(xe);
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xe, wv[j], acc[i][j]);
  }
  for (int j = 0; j < NR; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k));
    wv[j] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
  }
  for (int i = 0; i < MR; ++i) {
    __m256 xo = _mm256_loadu_ps(xf + i * KP + k + 8);
    SPECJAX_IN_REGISTER(xo);
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xo, wv[j], acc[i][j]);
  }
}

template <int MR, int NR>
SPECJAX_AVX2 void Avx2TileBf16(const float* xf, int64_t KP, const uint16_t* w, float* y, int64_t N, int64_t K) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {  // one 64-byte line of each W row
    for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * K + k), _MM_HINT_T0);
    Avx2StepBf16<MR, NR>(xf, KP, w, K, k, acc);
    Avx2StepBf16<MR, NR>(xf, KP, w, K, k + 16, acc);
  }
  if (k + 16 <= K) {
    Avx2StepBf16<MR, NR>(xf, KP, w, K, k, acc);
    k += 16;
  }
  if (k < K) {  // 1..15 elements: the W rows' tails copied into zero-padded blocks (x is padded already)
    alignas(32) uint16_t tail[NR][16] = {};
    for (int j = 0; j < NR; ++j) std::memcpy(tail[j], w + j * K + k, size_t(K - k) * sizeof(uint16_t));
    Avx2StepBf16<MR, NR>(xf + k, KP, &tail[0][0], 16, 0, acc);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = Sum8(acc[i][j]);
}

// bfloat16 rows of x [M, K] as float32 [M, KP] (KP = K rounded up to 16, zeros beyond K), each block of
// 16 reordered as its 8 even elements then its 8 odd ones (the order Avx2StepBf16 widens W in). Exact.
void WidenBf16Rows(const uint16_t* x, float* xf, int64_t M, int64_t K, int64_t KP) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < KP; ++k) {
      const int64_t block = k & ~int64_t{15}, lane = k & 15;
      const int64_t source = block + (lane < 8 ? 2 * lane : 2 * (lane - 8) + 1);
      xf[m * KP + k] = source < K ? Bf16ToFloat(x[m * K + source]) : 0.0f;
    }
  }
}

// The operands of one call as the AVX2 tiles read them: x itself (float32) or its widened copy.
struct Avx2Operands {
  const float* xf32 = nullptr;  // [M, K] float32 x, or
  const float* xf = nullptr;    // [M, KP] widened bfloat16 x
  int64_t KP = 0;
};

template <typename T, int MR, int NR>
void Avx2Tile(const Avx2Operands& a, int64_t m, const T* w, float* y, int64_t N, int64_t K) {
  if constexpr (std::is_same_v<T, float>) {
    Avx2TileF32<MR, NR>(a.xf32 + m * K, w, y, N, K);
  } else {
    Avx2TileBf16<MR, NR>(a.xf + m * a.KP, a.KP, w, y, N, K);
  }
}

template <typename T, int MR>
void Avx2TileRows(const Avx2Operands& a, int64_t m, const T* w, float* y, int64_t N, int64_t K, int64_t nr) {
  switch (nr) {
    case 4: return Avx2Tile<T, MR, 4>(a, m, w, y, N, K);
    case 3: return Avx2Tile<T, MR, 3>(a, m, w, y, N, K);
    case 2: return Avx2Tile<T, MR, 2>(a, m, w, y, N, K);
    default: return Avx2Tile<T, MR, 1>(a, m, w, y, N, K);
  }
}

template <typename T>
void Avx2Rows(const Avx2Operands& a, const T* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
    const int64_t m1 = std::min(M, m0 + kRowBlock);
    const int64_t tile_n = Avx2TileN(std::min(kAvx2TileM, m1 - m0));
    for (int64_t n = n0; n < n1; n += tile_n) {
      const int64_t nr = std::min(tile_n, n1 - n);
      for (int64_t m = m0; m < m1; m += kAvx2TileM) {
        const T* wn = w + n * K;
        float* ym = y + m * N + n;
        switch (std::min(kAvx2TileM, m1 - m)) {
          case 4: Avx2TileRows<T, 4>(a, m, wn, ym, N, K, nr); break;
          case 3: Avx2TileRows<T, 3>(a, m, wn, ym, N, K, nr); break;
          case 2: Avx2TileRows<T, 2>(a, m, wn, ym, N, K, nr); break;
          default: Avx2TileRows<T, 1>(a, m, wn, ym, N, K, nr); break;
        }
      }
    }
  }
}

bool HasAvx512() { return __builtin_cpu_supports("avx512f"); }
bool HasAvx512Bf16() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}
bool HasAvx2Fma() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

#else

bool HasAvx512() { return false; }
bool HasAvx512Bf16() { return false; }
bool HasAvx2Fma() { return false; }

#endif  // SPECJAX_X86

// The paths, best last; `specjax_cpu_limit` caps which one runs (tests run each path a CPU has).
enum Path : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };
std::atomic<int> path_limit{kAvx512};

template <typename T>
Path PathFor() {
  const int limit = path_limit.load(std::memory_order_relaxed);
  if (limit >= kAvx512 && (std::is_same_v<T, float> ? HasAvx512() : HasAvx512Bf16())) return kAvx512;
  if (limit >= kAvx2 && HasAvx2Fma()) return kAvx2;
  return kPortable;
}

// One call's operands on its path (chosen once per call: every row of it runs the same path).
template <typename T>
struct Operands {
  Path path;
  const T* x;
  const T* w;
  float* y;
  int64_t M, N, K;
#ifdef SPECJAX_X86
  Avx2Operands avx2;
#endif
};

// Rows [n0, n1) of W against every row of x.
template <typename T>
void Rows(const Operands<T>& o, int64_t n0, int64_t n1) {
#ifdef SPECJAX_X86
  if (o.path == kAvx512) return VectorRows(o.x, o.w, o.y, o.M, o.N, o.K, n0, n1);
  if (o.path == kAvx2) return Avx2Rows(o.avx2, o.w, o.y, o.M, o.N, o.K, n0, n1);
#endif
  PortableRows(o.x, o.w, o.y, o.M, o.N, o.K, n0, n1);
}

// Chunks of kChunk rows of W claimed from a shared counter by the calling thread and by up to
// `pool.num_threads() - 1` tasks on XLA's pool. The caller returns once every chunk is done; a task that
// starts after that finds no chunk left and touches nothing (the state it reads is shared-owned).
template <typename T>
void ParallelRows(ffi::ThreadPool& pool, const Operands<T>& o) {
  const int64_t chunks = (o.N + kChunk - 1) / kChunk;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks) - 1;
  if (helpers <= 0 || o.M * o.N * o.K < (int64_t{1} << 18)) {
    return Rows(o, 0, o.N);
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, o, chunks]() {
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
      Rows(o, c * kChunk, std::min(o.N, (c + 1) * kChunk));
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  // The chunks still running are at most one per helper, microseconds each: spin, then yield the core
  // (XLA may run another custom call or a task of its own on it meanwhile).
  for (int spins = 0; state->done.load(std::memory_order_acquire) < chunks; ++spins) {
#ifdef SPECJAX_X86
    if (spins < (1 << 16)) {
      _mm_pause();
      continue;
    }
#endif
    std::this_thread::yield();
  }
}

template <ffi::DataType DT>
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<DT> x, ffi::Buffer<DT> w, ffi::ResultBuffer<ffi::F32> y) {
  using T = std::remove_const_t<std::remove_pointer_t<decltype(x.typed_data())>>;
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("specjax matmul: x must be [M, K] and w [N, K]");
  }
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(y->typed_data(), y->typed_data() + M * N, 0.0f);
    return ffi::Error::Success();
  }
  Operands<T> o{PathFor<T>(), x.typed_data(), w.typed_data(), y->typed_data(), M, N, K};
#ifdef SPECJAX_X86
  std::unique_ptr<float[]> widened;  // outlives every chunk: ParallelRows returns when all are done
  if (o.path == kAvx2) {
    if constexpr (std::is_same_v<T, float>) {
      o.avx2.xf32 = o.x;
    } else {
      o.avx2.KP = (K + 15) / 16 * 16;
      widened.reset(new float[size_t(M * o.avx2.KP)]);
      WidenBf16Rows(o.x, widened.get(), M, K, o.avx2.KP);
      o.avx2.xf = widened.get();
    }
  }
#endif
  ParallelRows(pool, o);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxMatmulF32, Matmul<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxMatmulBf16, Matmul<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Which path each handler runs now (under `specjax_cpu_limit`): bits 0-1 the float32 handler's, bits 2-3
// the bfloat16 handler's, each 0 = portable loop, 1 = AVX2 + FMA, 2 = AVX-512 (bfloat16: AVX512_BF16).
extern "C" int specjax_cpu_features() { return int(PathFor<float>()) | (int(PathFor<uint16_t>()) << 2); }

// Caps the path every later call runs at `level` (0 portable, 1 AVX2, 2 AVX-512: the default); returns
// the previous cap. For tests, which run each path the CPU has; not for concurrent use with running calls
// of another cap (a call reads the cap once, at its start).
extern "C" int specjax_cpu_limit(int level) { return path_limit.exchange(level); }
