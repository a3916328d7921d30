// y = x W^T on the CPU, for the few rows a decode step, a verify pass or a tree carries.
//
// XLA:CPU multiplies a handful of rows at ~35 GFLOP/s in float32 and ten times slower in bfloat16, so
// a 6-token verify cost 3-4 single-token steps. These handlers stream each weight row once per tile of
// up to 6 (AVX-512) or 4 (AVX2) input rows (the tile's weight rows stay in L1 while every tile of x
// passes over them), so that a pass over a few rows costs about what one row costs: its weights' bytes.
// Three vector paths:
// - AMX (AMX-TILE + AMX-BF16), bfloat16 with K a multiple of 32: tile dot products, W read in place, x
//   in AMX's pair layout; a call of up to 16 rows of x reads W once and costs about what one row costs
//   (the AMX section below).
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
// equals greedy autoregressive output in bfloat16 too). Within one path, that is: the AMX, AVX-512 and AVX2
// paths sum in different orders and may differ from each other in the last bits; one call runs one path,
// chosen from the CPU and the weight's shape only (never from M).
//
// Quantized weights (specjax/models/quantized.py), x float32 or bfloat16, y float32:
// - int8: codes [N, K] int8 and one float32 scale per row [N, 1]: y[m, n] = (sum_k x[m, k] code[n, k])
//   * scale[n], the sum in float32 (each product rounded into it by one FMA), then one multiply.
// - int4:G: codes [N, K / 2] uint8 and one bfloat16 scale per group of G inputs [N, K / G]; within a group
//   byte j holds element j in its low nibble and element j + G / 2 in its high one, each as code + 8.
//   y[m, n] = sum_k x[m, k] w[n, k] in float32 with w = (nibble - 8) * scale, exact in float32 (4 bits
//   times a bfloat16's 8 significant bits): the products with the exactly dequantized weights.
// Codes are read as 1 or 1/2 byte a weight and widened in registers to float32 (no dequantized copy);
// x is widened to float32 once per call. llama.cpp's CPU kernels instead quantize x to 8-bit blocks and
// take integer dot products: faster per byte, but a model that computes on rounded activations; these
// multiply float x, so a quantized model computes what its dequantized float model computes (AVX2 and
// AVX-512 paths: the sections below).
// - int4a8:G: int4:G's codes and scales with x quantized per row and group of G to int8 at run time
//   (llama.cpp's Q4_0 x Q8_0 scheme): exact integer dot products per group (AVX512-VNNI's VPDPBUSD), then
//   y = sum over groups of (d * scale) * I in float32, in a fixed order that the portable loop repeats bit
//   for bit (the int4a8 section at the end has the definition and the layout).
//
// Handlers (XLA FFI, CPU): specjax_matmul_f32(x [M, K] f32, w [N, K] f32) -> y [M, N] f32,
// specjax_matmul_bf16(x [M, K] bf16, w [N, K] bf16) -> y [M, N] f32 and the quantized ones,
// SpecjaxMatmul{Int8,Int4,Int4a8}{F32,Bf16}(x, codes, scales) -> y [M, N] f32. Output rows are split over XLA's
// intra-op thread pool. CPUs with no vector path run a portable loop (correct, slow: the Python side
// chooses XLA there); `specjax_cpu_features` tells which path runs, `specjax_cpu_limit` caps it (tests
// run every path a CPU has).

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
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

template <int MR, int NR>
SPECJAX_AVX2 inline void Avx2Zero(__m256 (&acc)[MR][NR]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
}

// acc[i][j] += x[i] * wv[j] for 8 elements of the MR rows of x (XS floats apart), each x vector held in
// a register while the NR weight vectors use it.
template <int MR, int NR>
SPECJAX_AVX2 inline void Avx2Fma(const float* x, int64_t XS, const __m256 (&wv)[NR], __m256 (&acc)[MR][NR]) {
  for (int i = 0; i < MR; ++i) {
    __m256 xv = _mm256_loadu_ps(x + i * XS);
    SPECJAX_IN_REGISTER(xv);
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
  }
}

// One step of 8 elements of K: every W vector loaded once for the MR rows of x.
template <int MR, int NR>
SPECJAX_AVX2 inline void Avx2StepF32(const float* x, const float* w, int64_t K, int64_t k, __m256 (&acc)[MR][NR]) {
  __m256 wv[NR];
  for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
  Avx2Fma<MR, NR>(x + k, K, wv, acc);
}

template <int MR, int NR>
SPECJAX_AVX2 void Avx2TileF32(const float* x, const float* w, float* y, int64_t N, int64_t K) {
  __m256 acc[MR][NR];
  Avx2Zero(acc);
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
  Avx2Fma<MR, NR>(xf + k, KP, wv, acc);
  for (int j = 0; j < NR; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + j * K + k));
    wv[j] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
  }
  Avx2Fma<MR, NR>(xf + k + 8, KP, wv, acc);
}

template <int MR, int NR>
SPECJAX_AVX2 void Avx2TileBf16(const float* xf, int64_t KP, const uint16_t* w, float* y, int64_t N, int64_t K) {
  __m256 acc[MR][NR];
  Avx2Zero(acc);
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

// A tile of `nr` rows of W (1..4) dispatched to its compiled shape: `tiles.Tile<MR, NR>(m, n)`.
template <int MR, typename Tiles>
void GridCols(const Tiles& tiles, int64_t m, int64_t n, int64_t nr) {
  switch (nr) {
    case 4: return tiles.template Tile<MR, 4>(m, n);
    case 3: return tiles.template Tile<MR, 3>(m, n);
    case 2: return tiles.template Tile<MR, 2>(m, n);
    default: return tiles.template Tile<MR, 1>(m, n);
  }
}

// A tile of `mr` (1..MR) rows of x dispatched to its compiled height.
template <int MR, typename Tiles>
void GridRows(const Tiles& tiles, int64_t m, int64_t n, int64_t mr, int64_t nr) {
  if constexpr (MR > 1) {
    if (mr < MR) return GridRows<MR - 1>(tiles, m, n, mr, nr);
  }
  GridCols<MR>(tiles, m, n, nr);
}

// Rows [n0, n1) of W against the M rows of x in register tiles of up to `Tiles::kRows` rows of x by
// `Tiles::Width(rows)` rows of W, row block by row block of `block` rows (every kind of weight: `Tiles`
// computes one).
template <typename Tiles>
void Grid(const Tiles& tiles, int64_t M, int64_t n0, int64_t n1, int64_t block = kRowBlock) {
  constexpr int64_t kRows = Tiles::kRows;
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    const int64_t tile_n = Tiles::Width(std::min(kRows, m1 - m0));
    for (int64_t n = n0; n < n1; n += tile_n) {
      const int64_t nr = std::min(tile_n, n1 - n);
      for (int64_t m = m0; m < m1; m += kRows) GridRows<kRows>(tiles, m, n, std::min(kRows, m1 - m), nr);
    }
  }
}

// Float weights (float32, bfloat16) for Grid.
template <typename T>
struct Avx2FloatTiles {
  const Avx2Operands& a;
  const T* w;
  float* y;
  int64_t N, K;
  static constexpr int64_t kRows = kAvx2TileM;
  static constexpr int64_t Width(int64_t rows) { return Avx2TileN(rows); }
  template <int MR, int NR>
  void Tile(int64_t m, int64_t n) const { Avx2Tile<T, MR, NR>(a, m, w + n * K, y + m * N + n, N, K); }
};

template <typename T>
void Avx2Rows(const Avx2Operands& a, const T* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  Grid(Avx2FloatTiles<T>{a, w, y, N, K}, M, n0, n1);
}

// ---- AVX2 + FMA, quantized weights -----------------------------------------------------------------
// x comes widened to float32 in runs (WidenRuns): the K elements (int8) or each half of a group (int4),
// each zero-padded to a multiple of 8. Codes widen in registers: 8 bytes -> 8 int32 lanes -> float32.
// Accumulator acc[i][j] lane l sums, in order over steps of 8 elements, the FMA products of element
// 8s + l of each run; the lanes are summed by Sum8. int8 then multiplies the sum by the row's scale;
// int4 multiplies dequantized weights, (nibble - 8) * scale, made exactly by one FMA, nibble * scale -
// 8 * scale (a 4-bit code times a bfloat16 scale fits float32's mantissa), and takes each group's low
// nibbles (its first half) then its high ones at every step. Nothing depends on MR, NR or M.

template <int MR, int NR>
SPECJAX_AVX2 inline void Avx2StepInt8(const float* xf, int64_t XS, const int8_t* w, int64_t K,
                                      __m256 (&acc)[MR][NR]) {
  __m256 wv[NR];
  for (int j = 0; j < NR; ++j) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + j * K));
    wv[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
  Avx2Fma<MR, NR>(xf, XS, wv, acc);
}

template <int MR, int NR>
SPECJAX_AVX2 void Avx2TileInt8(const float* xf, int64_t XS, const int8_t* w, const float* scale, float* y,
                               int64_t N, int64_t K) {
  __m256 acc[MR][NR];
  Avx2Zero(acc);
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {  // one 64-byte line of each W row: prefetch the next tile's
    for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * K + k), _MM_HINT_T0);
    for (int s = 0; s < 64; s += 8) Avx2StepInt8<MR, NR>(xf + k + s, XS, w + k + s, K, acc);
  }
  for (; k + 8 <= K; k += 8) Avx2StepInt8<MR, NR>(xf + k, XS, w + k, K, acc);
  if (k < K) {  // 1..7 codes copied into zero-padded blocks (x is padded already)
    alignas(8) int8_t tail[NR][8] = {};
    for (int j = 0; j < NR; ++j) std::memcpy(tail[j], w + j * K + k, size_t(K - k));
    Avx2StepInt8<MR, NR>(xf + k, XS, &tail[0][0], 8, acc);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = Sum8(acc[i][j]) * scale[j];
}

// 8 bytes of a group (16 codes): the low nibbles against x's first half, then the high ones against its
// second. `s` and `s8` hold each W row's group scale and 8 times it.
template <int MR, int NR>
SPECJAX_AVX2 inline void Avx2StepInt4(const float* xlo, const float* xhi, int64_t XS, const uint8_t* w, int64_t RB,
                                      const __m256 (&s)[NR], const __m256 (&s8)[NR], __m256 (&acc)[MR][NR]) {
  const __m256i nibble = _mm256_set1_epi32(15);
  __m256 wv[NR];
  for (int j = 0; j < NR; ++j) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + j * RB)));
    wv[j] = _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, nibble)), s[j], s8[j]);
  }
  Avx2Fma<MR, NR>(xlo, XS, wv, acc);
  for (int j = 0; j < NR; ++j) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + j * RB)));
    wv[j] = _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), s[j], s8[j]);
  }
  Avx2Fma<MR, NR>(xhi, XS, wv, acc);
}

// W rows of RB bytes (K / 2), `groups` groups of `half` bytes each; x runs of `padded` floats. HALF: the
// group's half (G / 2) known when compiled (16, 32, 64: each group's steps unrolled), or 0 (read from RB).
// At G = 32 the per-group work (the scales, the loop) was a quarter of the tile's time.
template <int MR, int NR, int HALF>
SPECJAX_AVX2 void Avx2TileInt4(const float* xf, int64_t XS, const uint8_t* w, int64_t RB, const uint16_t* scale,
                               int64_t groups, float* y, int64_t N) {
  const int64_t half = HALF ? HALF : RB / groups, padded = (half + 7) / 8 * 8;
  const __m256 eight = _mm256_set1_ps(8.0f);
  __m256 acc[MR][NR];
  Avx2Zero(acc);
  for (int64_t g = 0; g < groups; ++g) {
    __m256 s[NR], s8[NR];
    for (int j = 0; j < NR; ++j) {  // the bfloat16 scale in every 16-bit lane, shifted into float32 lanes
      s[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi16(int16_t(scale[j * groups + g])), 16));
      s8[j] = _mm256_mul_ps(s[j], eight);
    }
    const uint8_t* wg = w + g * half;
    const float* xlo = xf + 2 * g * padded;
    if ((g * half) % 64 < half) {  // the group starts a new 64-byte line: prefetch the next tile's
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(wg + (j + NR) * RB), _MM_HINT_T0);
    }
    int64_t b = 0;
    for (; b + 8 <= half; b += 8) Avx2StepInt4<MR, NR>(xlo + b, xlo + padded + b, XS, wg + b, RB, s, s8, acc);
    if (b < half) {  // G / 2 not a multiple of 8: the rest padded with code 0 (0x88: both nibbles 8)
      alignas(8) uint8_t tail[NR][8];
      std::memset(tail, 0x88, sizeof(tail));
      for (int j = 0; j < NR; ++j) std::memcpy(tail[j], wg + j * RB + b, size_t(half - b));
      Avx2StepInt4<MR, NR>(xlo + b, xlo + padded + b, XS, &tail[0][0], 8, s, s8, acc);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = Sum8(acc[i][j]);
}

// Quantized weights for Grid: x widened into runs (`xf`, rows of XS floats), codes and scales.
struct Avx2QuantTiles {
  const float* xf;
  int64_t XS;
  const void* codes;   // int8 [N, K] or uint8 [N, K / 2]
  const void* scales;  // float32 [N, 1] or bfloat16 [N, groups]
  float* y;
  int64_t N, K, groups;
};

// Calls `tile(half, codes, scales)` for the int4 rows of W from n: `half` is G / 2 as a compile-time
// constant (std::integral_constant) where it is 16, 32 or 64, else 0 (read at run time).
template <typename Tile>
void Int4Tile(const Avx2QuantTiles& t, int64_t n, Tile&& tile) {
  const auto* w = static_cast<const uint8_t*>(t.codes) + n * (t.K / 2);
  const auto* scale = static_cast<const uint16_t*>(t.scales) + n * t.groups;
  switch (t.K / t.groups / 2) {
    case 16: return tile(std::integral_constant<int, 16>{}, w, scale);
    case 32: return tile(std::integral_constant<int, 32>{}, w, scale);
    case 64: return tile(std::integral_constant<int, 64>{}, w, scale);
    default: return tile(std::integral_constant<int, 0>{}, w, scale);
  }
}

// int8: tiles of up to 6 rows of x (a K = 5 verify pass widens each W vector once) by 2 rows of W (12
// accumulators), 3-4 rows of W for narrower tiles, as the float paths.
struct Avx2Int8Tiles : Avx2QuantTiles {
  static constexpr int64_t kRows = 6;
  static constexpr int64_t Width(int64_t rows) { return rows >= 5 ? 2 : Avx2TileN(rows); }
  template <int MR, int NR>
  void Tile(int64_t m, int64_t n) const {
    Avx2TileInt8<MR, NR>(xf + m * XS, XS, static_cast<const int8_t*>(codes) + n * K,
                         static_cast<const float*>(scales) + n, y + m * N + n, N, K);
  }
};

// int4 unpacks each W vector once per tile of x, which costs more than its FMAs: tiles of up to 6 rows of
// x (a K = 5 verify pass in one) by 2 rows of W (4 for a row block of 1-2 rows), the scale vectors read
// from memory where registers run out. Measured on the 2-core AVX2 EPYC, 8960 x 1536 at T = 6: 1.3-1.5x
// bfloat16's time against 1.8x with 4-row tiles (noisy, shared host; int8's 6-row tiles: 0.80x
// against 0.84-0.93x).
struct Avx2Int4Tiles : Avx2QuantTiles {
  static constexpr int64_t kRows = 6;
  static constexpr int64_t Width(int64_t rows) { return rows >= 3 ? 2 : 4; }
  template <int MR, int NR>
  void Tile(int64_t m, int64_t n) const {
    Int4Tile(*this, n, [&](auto half, const uint8_t* w, const uint16_t* scale) {
      Avx2TileInt4<MR, NR, decltype(half)::value>(xf + m * XS, XS, w, K / 2, scale, groups, y + m * N + n, N);
    });
  }
};

// ---- AVX-512, quantized weights ---------------------------------------------------------------------
// int8 (AVX-512F + BW): x widened to float32 once per call (WidenRuns, one run of K); 16 codes per step
// sign-extended to int32 and converted to float32 in registers, FMA'd into 16-lane accumulators; the
// lane sum (_mm512_reduce_add_ps) times the row's scale. Tiles of up to 6 rows of x by 2 rows of W (4 for
// tiles of up to 4 rows: 6 x 4 made a 6-row product slower than AVX2's 6 x 2).
// int4:G, G = 32, 64 or 128, bfloat16 x (hosts with AVX512_BF16): x is widened to float32 once per call, in
// the order the codes unpack in. A block of 32 code bytes unpacks in registers into float32 integers
// code - 8 (exact) through a 16-entry table (VPERMPS, 16 weights per lookup); per lane, 4 FMAs from zero
// sum x * (code - 8) over 2 bytes of one group (each product exact: 8 by 4 significant bits, each addition
// rounded), in the order two VDPBF16PS would (the kernel's first int4 path, bit for bit; a subnormal x
// counts as 0, as there, though a subnormal partial sum is kept where VDPBF16PS flushed it), and one FMA
// adds the lanes times their groups' scales to the row's accumulator. On this project's AMX host one
// VDPBF16PS held both 512-bit ports about 2 cycles: two of them (64 products) took 8 port-cycles, their 4
// FMAs take 2. One thread, the draft's and target's MLP shapes, against VDPBF16PS: a one-row call 12%
// faster cache-resident, 2-8% streaming its weights; 6 rows 6-31%; 128 rows 3-12%. Unpacking is then about
// 60% of a one-row tile's vector instructions, a fifth of a 6-row tile's: a panel of W unpacked once per 96
// rows of x into a scratch made many rows no faster. Rows of x per row block: RowBlock. The sum is the same
// products' as AVX2's, rounded in another order (per group, then scaled), so the two paths may differ in
// the last bits; each is batch-invariant: nothing depends on MR, NR or M.

#define SPECJAX_AVX512Q __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

template <int MR, int NR>
SPECJAX_AVX512Q inline void Avx512StepInt8(const float* xf, int64_t XS, const int8_t* w, int64_t K, __mmask16 mask,
                                           __m512 (&acc)[MR][NR]) {
  __m512 wv[NR];
  for (int j = 0; j < NR; ++j) wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + j * K)));
  for (int i = 0; i < MR; ++i) {
    const __m512 xv = _mm512_maskz_loadu_ps(mask, xf + i * XS);
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
  }
}

template <int MR, int NR>
SPECJAX_AVX512Q void Avx512TileInt8(const float* xf, int64_t XS, const int8_t* w, const float* scale, float* y,
                                    int64_t N, int64_t K) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {  // one 64-byte line of each W row: prefetch the next tile's
    for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * K + k), _MM_HINT_T0);
    for (int s = 0; s < 64; s += 16) Avx512StepInt8<MR, NR>(xf + k + s, XS, w + k + s, K, __mmask16(0xFFFF), acc);
  }
  for (; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
    Avx512StepInt8<MR, NR>(xf + k, XS, w + k, K, mask, acc);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = _mm512_reduce_add_ps(acc[i][j]) * scale[j];
}

// code - 8 for code = 0 .. 15 (VPERMPS reads the low 4 bits of each 32-bit index).
alignas(64) constexpr float kInt4Codes[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};

// bfloat16 x [M, K] as float32 in the order int4 codes unpack in (rows of XF = 64 per block of 32 code
// bytes): per block, 16 runs of 4 (lane l: bytes 2l and 2l + 1 of the block) laid out as 4 vectors of 16,
// x of byte 2l + 1's low nibble, of byte 2l's low nibble, of 2l + 1's high nibble, of 2l's high nibble
// (zeros for bytes past a row's K / 2). Byte p of a row holds elements g G + e (low) and g G + G / 2 + e
// (high), g = p / (G / 2), e = p % (G / 2). Exact; subnormal x becomes 0, as VDPBF16PS reads it.
void Int4BlockRows(const uint16_t* x, float* xf, int64_t M, int64_t K, int64_t half, int64_t XF) {
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t p = 0; p < XF / 2; ++p) {
      float* out = xf + m * XF + p / 32 * 64 + (p % 2 ? 0 : 16) + p % 32 / 2;
      const int64_t first = p / half * 2 * half + p % half;
      for (int nibble = 0; nibble < 2; ++nibble) {
        const uint16_t bits = p < K / 2 ? x[m * K + first + nibble * half] : 0;
        out[32 * nibble] = (bits & 0x7F80) ? Bf16ToFloat(bits) : 0.0f;
      }
    }
  }
}

// One block of 32 code bytes from byte p of NR rows of W (RB bytes apart; `mask`: its 16-bit pairs present)
// against MR rows of x: the block unpacks into 4 vectors of float32 code - 8 per row of W (in
// Int4BlockRows' order) and its lanes' scales, then every (i, j) takes the same 5 FMAs.
template <int MR, int NR, int HALF>
SPECJAX_AVX512Q inline void Avx512StepInt4(const float* xf, int64_t XF, const uint8_t* w, int64_t RB,
                                           const float* scales, int64_t groups, int64_t p, __mmask16 mask,
                                           __m512 (&acc)[MR][NR]) {
  const __m512 table = _mm512_load_ps(kInt4Codes);
  __m512 wv[NR][4], sv[NR];
  for (int j = 0; j < NR; ++j) {
    const __m512i pairs = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, w + j * RB + p));
    wv[j][0] = _mm512_permutexvar_ps(_mm512_srli_epi32(pairs, 8), table);
    wv[j][1] = _mm512_permutexvar_ps(pairs, table);
    wv[j][2] = _mm512_permutexvar_ps(_mm512_srli_epi32(pairs, 12), table);
    wv[j][3] = _mm512_permutexvar_ps(_mm512_srli_epi32(pairs, 4), table);
    const float* sj = scales + j * groups + p / HALF;
    sv[j] = _mm512_set1_ps(sj[0]);
    if (HALF == 16 && p / HALF + 1 < groups) sv[j] = _mm512_mask_blend_ps(0xFF00, sv[j], _mm512_set1_ps(sj[1]));
  }
  for (int i = 0; i < MR; ++i) {
    const float* xb = xf + i * XF + 2 * p;
    __m512 xv[4];
    for (int r = 0; r < 4; ++r) {
      xv[r] = _mm512_loadu_ps(xb + 16 * r);
      SPECJAX_IN_REGISTER(xv[r]);
    }
    for (int j = 0; j < NR; ++j) {
      __m512 sum = _mm512_fmadd_ps(xv[0], wv[j][0], _mm512_setzero_ps());
      for (int r = 1; r < 4; ++r) sum = _mm512_fmadd_ps(xv[r], wv[j][r], sum);
      acc[i][j] = _mm512_fmadd_ps(sum, sv[j], acc[i][j]);
    }
  }
}

// x (blocked: Int4BlockRows) times NR rows of W of RB = K / 2 bytes in groups of HALF = G / 2 bytes (16, 32
// or 64), a block of 32 bytes at a time: the block's 16 byte pairs widen into 16 32-bit lanes, which
// shifts and table lookups (VPERMPS reads 4 bits) turn into four vectors of float32 code - 8; lane l of a
// row's sum takes the 4 products of bytes 2l, 2l + 1 by 4 FMAs from zero, in VDPBF16PS's order (odd element
// first, low nibbles first), and one FMA adds the lanes times their groups' scales to the row's accumulator
// (G = 32: lanes 0-7 are the block's first group, 8-15 its second).
template <int MR, int NR, int HALF>
SPECJAX_AVX512Q void Avx512TileInt4(const float* xf, int64_t XF, const uint8_t* w, int64_t RB,
                                    const uint16_t* scale, int64_t groups, float* y, int64_t N) {
  thread_local std::vector<float> buffer;  // this tile's scales in float32, [NR, groups]
  buffer.resize(size_t(NR * groups));
  float* const scales = buffer.data();  // read once: each access to a thread_local is a call in a library
  for (int j = 0; j < NR; ++j) {
    for (int64_t g = 0; g < groups; g += 16) {
      const __mmask16 mask = groups - g >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (groups - g)) - 1);
      const __m512i bits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, scale + j * groups + g));
      _mm512_mask_storeu_ps(scales + j * groups + g, mask, _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)));
    }
  }
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + 64 <= RB; p += 64) {  // a 64-byte line of each W row: prefetch the next tile's
    for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * RB + p), _MM_HINT_T0);
    Avx512StepInt4<MR, NR, HALF>(xf, XF, w, RB, scales, groups, p, __mmask16(0xFFFF), acc);
    Avx512StepInt4<MR, NR, HALF>(xf, XF, w, RB, scales, groups, p + 32, __mmask16(0xFFFF), acc);
  }
  for (; p < RB; p += 32) {
    const __mmask16 mask = RB - p >= 32 ? __mmask16(0xFFFF) : __mmask16((1u << ((RB - p) / 2)) - 1);
    Avx512StepInt4<MR, NR, HALF>(xf, XF, w, RB, scales, groups, p, mask, acc);
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * N + j] = _mm512_reduce_add_ps(acc[i][j]);
}

// int8 for Grid: x widened (xf, rows of XS floats).
struct Avx512Int8Tiles : Avx2QuantTiles {
  static constexpr int64_t kRows = 6;
  static constexpr int64_t Width(int64_t rows) { return rows >= 5 ? 2 : 4; }
  template <int MR, int NR>
  void Tile(int64_t m, int64_t n) const {
    Avx512TileInt8<MR, NR>(xf + m * XS, XS, static_cast<const int8_t*>(codes) + n * K,
                           static_cast<const float*>(scales) + n, y + m * N + n, N, K);
  }
};

// int4 for Grid: bfloat16 x blocked as float32 (`xq`, rows of XQ: Int4BlockRows), G / 2 one of 16, 32, 64
// (`Avx512Int4Fits`).
struct Avx512Int4Tiles : Avx2QuantTiles {
  const float* xq;
  int64_t XQ;
  static constexpr int64_t kRows = 6;
  static constexpr int64_t Width(int64_t rows) { return rows >= 3 ? 2 : 4; }
  // Rows of x per row block: at most 1 MiB of x as float32, which every tile of W passes over (with 96
  // rows of K = 8960, 3.4 MiB, past the L2, a 128-row product took twice as long).
  static constexpr int64_t RowBlock(int64_t XQ) {
    return std::max<int64_t>(kRows, std::min<int64_t>(kRowBlock, (int64_t{1} << 18) / XQ / kRows * kRows));
  }
  template <int MR, int NR>
  void Tile(int64_t m, int64_t n) const {
    Int4Tile(*this, n, [&](auto half, const uint8_t* w, const uint16_t* scale) {
      if constexpr (decltype(half)::value != 0) {  // the path runs only where G / 2 is 16, 32 or 64
        Avx512TileInt4<MR, NR, decltype(half)::value>(xq + m * XQ, XQ, w, K / 2, scale, groups, y + m * N + n, N);
      }
    });
  }
};

bool Avx512Int4Fits(int64_t K, int64_t groups) {
  const int64_t half = K / groups / 2;
  return half == 16 || half == 32 || half == 64;
}

// ---- AMX (AMX-TILE + AMX-BF16), bfloat16 weights ------------------------------------------------------
// y^T = W x^T in tiles: A = 16 rows of W by 32 of K, loaded in place (stride K); B = the same 32 of K by 16
// rows of x in AMX's pair layout (x copied once per call: AmxPairRows); C = 16 x 16 float32 sums. Two
// row tiles of W share each B tile. A call with M <= 16 streams W once, whatever M: the tile's dot
// products cost ~1/30 of what reading W does, so a 6-token verify pass costs what a 1-token step does.
// Batch-invariant: C[n, m] is the same sequence of tile dot products (32 products each, pairs summed
// in the hardware's fixed order, float32 accumulation) over K whatever M or m's column in B. It sums
// in another order than the AVX-512 path, so the two may differ in the last bits; every call on an AMX
// host with K a multiple of 32 runs this one (`PathFor`).

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-1: C (row tiles of W against B), 2-3: A (rows of W), 4: B (x); `rows` rows of W per tile.
TileConfig AmxConfig(int rows) {
  TileConfig config;
  for (int t = 0; t < 4; ++t) config.colsb[t] = 64, config.rows[t] = uint8_t(rows);
  config.colsb[4] = 64, config.rows[4] = 16;
  return config;
}

// Whether AMX runs here: the CPU has it (CPUID 7.0: EDX bits 22, 24) and Linux lets this process use its
// tile state (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, asked once).
bool AmxUsable() {
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 22) & 1) || !((d >> 24) & 1)) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return usable;
}

// x [M, K] bfloat16 as B tiles: [ceil(M / 16)][K / 32][16 pairs of K][16 rows of x][2], zeros past M.
void AmxPairRows(const uint16_t* x, uint16_t* xv, int64_t M, int64_t K) {
  const int64_t blocks = K / 32;
  for (int64_t g = 0; g < (M + 15) / 16; ++g)
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t p = 0; p < 16; ++p)
        for (int64_t m = 0; m < 16; ++m, xv += 2) {
          const bool row = g * 16 + m < M;
          xv[0] = row ? x[(g * 16 + m) * K + b * 32 + 2 * p] : 0;
          xv[1] = row ? x[(g * 16 + m) * K + b * 32 + 2 * p + 1] : 0;
        }
}

// C tiles of TILES (1 or 2) row tiles of W from `w` (rows K apart) against one B group (`xv`), stored to
// `c` ([TILES * 16][16] float32).
template <int TILES>
__attribute__((target("amx-tile,amx-bf16"))) void AmxTiles(const uint16_t* w, int64_t K, const uint16_t* xv,
                                                           float* c) {
  _tile_zero(0);
  if (TILES == 2) _tile_zero(1);
  for (int64_t b = 0; b < K / 32; ++b) {
    _tile_loadd(4, xv + b * 512, 64);
    _tile_loadd(2, w + b * 32, K * 2);
    _tile_dpbf16ps(0, 2, 4);
    if (TILES == 2) {
      _tile_loadd(3, w + 16 * K + b * 32, K * 2);
      _tile_dpbf16ps(1, 3, 4);
    }
  }
  _tile_stored(0, c, 64);
  if (TILES == 2) _tile_stored(1, c + 256, 64);
}

// Rows [n0, n1) of W against every row of x (`xv`: AmxPairRows), 32 rows of W at a time, then 16, then
// the rest with a tile configuration of that many rows.
__attribute__((target("amx-tile,amx-bf16"))) void AmxRows(const uint16_t* w, const uint16_t* xv, float* y,
                                                         int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  alignas(64) float c[2 * 16 * 16];
  const int64_t groups = (M + 15) / 16, group_size = K / 32 * 512;
  auto scatter = [&](int64_t n, int64_t rows, int64_t g) {
    for (int64_t m = g * 16; m < std::min(M, g * 16 + 16); ++m)
      for (int64_t i = 0; i < rows; ++i) y[m * N + n + i] = c[i * 16 + m - g * 16];
  };
  const TileConfig full = AmxConfig(16);
  _tile_loadconfig(&full);
  int64_t n = n0;
  for (; n + 32 <= n1; n += 32)
    for (int64_t g = 0; g < groups; ++g) AmxTiles<2>(w + n * K, K, xv + g * group_size, c), scatter(n, 32, g);
  for (; n + 16 <= n1; n += 16)
    for (int64_t g = 0; g < groups; ++g) AmxTiles<1>(w + n * K, K, xv + g * group_size, c), scatter(n, 16, g);
  if (n < n1) {
    const TileConfig tail = AmxConfig(int(n1 - n));
    _tile_loadconfig(&tail);
    for (int64_t g = 0; g < groups; ++g) AmxTiles<1>(w + n * K, K, xv + g * group_size, c), scatter(n, n1 - n, g);
  }
  _tile_release();
}

bool HasAvx512() { return __builtin_cpu_supports("avx512f"); }
bool HasAvx512Bw() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
bool HasAvx512Bf16() { return HasAvx512Bw() && __builtin_cpu_supports("avx512bf16"); }
bool HasAvx2Fma() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

#else

bool AmxUsable() { return false; }
bool HasAvx512() { return false; }
bool HasAvx512Bw() { return false; }
bool HasAvx512Bf16() { return false; }
bool Avx512Int4Fits(int64_t, int64_t) { return false; }
bool HasAvx2Fma() { return false; }

#endif  // SPECJAX_X86

// The paths, best last; `specjax_cpu_limit` caps which one runs (tests run each path a CPU has).
enum Path : int { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };
std::atomic<int> path_limit{kAmx};

// A float call's path (`K`: its inner width; AMX takes bfloat16 with K a multiple of 32).
template <typename T>
Path PathFor(int64_t K = 32) {
  const int limit = path_limit.load(std::memory_order_relaxed);
  if (std::is_same_v<T, uint16_t> && limit >= kAmx && K % 32 == 0 && AmxUsable()) return kAmx;
  if (limit >= kAvx512 && (std::is_same_v<T, float> ? HasAvx512() : HasAvx512Bf16())) return kAvx512;
  if (limit >= kAvx2 && HasAvx2Fma()) return kAvx2;
  return kPortable;
}

// Quantized weights: AVX-512 for int8 (AVX-512F + BW) and for int4 with bfloat16 x (AVX512_BF16; float32 x
// runs AVX2); `fits` says whether an int4 call's group width has an AVX-512 tile (G = 32, 64, 128).
template <int Bits, typename X>
Path QuantizedPath(bool fits = true) {
  const int limit = path_limit.load(std::memory_order_relaxed);
  if (limit >= kAvx512 && (Bits == 8 ? HasAvx512Bw() : std::is_same_v<X, uint16_t> && fits && HasAvx512Bf16())) {
    return kAvx512;
  }
  return limit >= kAvx2 && HasAvx2Fma() ? kAvx2 : kPortable;
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
  const uint16_t* xv = nullptr;  // AMX: x as B tiles (AmxPairRows)
#endif

  // Rows [n0, n1) of W against every row of x.
  void Rows(int64_t n0, int64_t n1) const {
#ifdef SPECJAX_X86
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (path == kAmx) return AmxRows(w, xv, y, M, N, K, n0, n1);
    }
    if (path == kAvx512) return VectorRows(x, w, y, M, N, K, n0, n1);
    if (path == kAvx2) return Avx2Rows(avx2, w, y, M, N, K, n0, n1);
#endif
    PortableRows(x, w, y, M, N, K, n0, n1);
  }
};

// Chunks of kChunk rows of W claimed from a shared counter by the calling thread and by up to
// `pool.num_threads() - 1` tasks on XLA's pool. The caller returns once every chunk is done; a task that
// starts after that finds no chunk left and touches nothing (the state it reads is shared-owned).
// `o` is any call's operands: `o.Rows(n0, n1)` computes rows [n0, n1) of W against every row of x.
template <typename Op>
void ParallelRows(ffi::ThreadPool& pool, const Op& o) {
  const int64_t chunks = (o.N + kChunk - 1) / kChunk;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks) - 1;
  if (helpers <= 0 || o.M * o.N * o.K < (int64_t{1} << 18)) {
    return o.Rows(0, o.N);
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, o, chunks]() {
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
      o.Rows(c * kChunk, std::min(o.N, (c + 1) * kChunk));
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
  Operands<T> o{PathFor<T>(K), x.typed_data(), w.typed_data(), y->typed_data(), M, N, K};
#ifdef SPECJAX_X86
  std::unique_ptr<float[]> widened;  // outlives every chunk: ParallelRows returns when all are done
  std::unique_ptr<uint16_t[]> paired;  // likewise
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (o.path == kAmx) {
      paired.reset(new uint16_t[size_t((M + 15) / 16 * 16 * K)]);
      AmxPairRows(o.x, paired.get(), M, K);
      o.xv = paired.get();
    }
  }
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

// ---- Quantized weights -----------------------------------------------------------------------------

template <typename X>
float ToFloat(X value) {
  if constexpr (std::is_same_v<X, float>) {
    return value;
  } else {
    return Bf16ToFloat(value);
  }
}

// The portable path: one float32 accumulator per output, k in order; int8 sums x * code and multiplies
// the sum by the row's scale, int4 sums x * ((nibble - 8) * scale), the weight exact in float32.
template <int Bits, typename X>
void PortableQuantizedRows(const X* x, const void* codes, const void* scales, float* y, int64_t M, int64_t N,
                           int64_t K, int64_t groups, int64_t n0, int64_t n1) {
  const int64_t group = K / groups, half = group / 2;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = n0; n < n1; ++n) {
      float acc = 0.0f;
      if constexpr (Bits == 8) {
        const int8_t* c = static_cast<const int8_t*>(codes) + n * K;
        for (int64_t k = 0; k < K; ++k) acc += ToFloat(x[m * K + k]) * float(c[k]);
        acc *= static_cast<const float*>(scales)[n];
      } else {
        const uint8_t* c = static_cast<const uint8_t*>(codes) + n * (K / 2);
        const uint16_t* scale = static_cast<const uint16_t*>(scales) + n * groups;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t g = k / group, e = k % group;
          const uint8_t byte = c[g * half + e % half];
          const int code = (e < half ? byte & 15 : byte >> 4) - 8;
          acc += ToFloat(x[m * K + k]) * (float(code) * Bf16ToFloat(scale[g]));
        }
      }
      y[m * N + n] = acc;
    }
  }
}

// x [M, K] as float32 runs for the AVX2 quantized tiles: each row's K / run runs of `run` elements, each
// zero-padded to a multiple of 8 (int8: one run of K; int4: each half of each group, G / 2). Exact.
template <typename X>
void WidenRuns(const X* x, float* xf, int64_t M, int64_t K, int64_t run) {
  const int64_t padded = (run + 7) / 8 * 8, runs = K / run;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t r = 0; r < runs; ++r) {
      float* out = xf + (m * runs + r) * padded;
      for (int64_t e = 0; e < padded; ++e) out[e] = e < run ? ToFloat(x[m * K + r * run + e]) : 0.0f;
    }
  }
}

// One quantized call's operands (int8 when Bits = 8, else int4:G with G = K / groups).
template <int Bits, typename X>
struct QuantizedOperands {
  Path path;
  const X* x;
  const void* codes;
  const void* scales;
  float* y;
  int64_t M, N, K, groups;
  const float* xf = nullptr;  // AVX2, AVX-512 int8: x widened into runs (WidenRuns), rows of XS floats
  int64_t XS = 0;
  const float* xq = nullptr;  // AVX-512 int4: x blocked (Int4BlockRows), rows of XQ
  int64_t XQ = 0;

  void Rows(int64_t n0, int64_t n1) const {
#ifdef SPECJAX_X86
    const Avx2QuantTiles tiles{xf, XS, codes, scales, y, N, K, groups};
    if (path == kAvx2) {
      if constexpr (Bits == 8) {
        return Grid(Avx2Int8Tiles{tiles}, M, n0, n1);
      } else {
        return Grid(Avx2Int4Tiles{tiles}, M, n0, n1);
      }
    }
    if (path == kAvx512) {
      if constexpr (Bits == 8) {
        return Grid(Avx512Int8Tiles{tiles}, M, n0, n1);
      } else if constexpr (std::is_same_v<X, uint16_t>) {
        return Grid(Avx512Int4Tiles{tiles, xq, XQ}, M, n0, n1, Avx512Int4Tiles::RowBlock(XQ));
      }
    }
#endif
    PortableQuantizedRows<Bits>(x, codes, scales, y, M, N, K, groups, n0, n1);
  }
};

// y = x W^T for a quantized W: int8 codes [N, K] with float32 scales [N, 1], or int4 codes [N, K / 2]
// (uint8) with bfloat16 scales [N, K / G]; x float32 or bfloat16.
template <int Bits, ffi::DataType XT, ffi::DataType CT, ffi::DataType ST>
ffi::Error QuantizedMatmul(ffi::ThreadPool pool, ffi::Buffer<XT> x, ffi::Buffer<CT> codes, ffi::Buffer<ST> scales,
                           ffi::ResultBuffer<ffi::F32> y) {
  using X = std::remove_const_t<std::remove_pointer_t<decltype(x.typed_data())>>;
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || cd[0] != sd[0]) {
    return ffi::Error::InvalidArgument("specjax quantized matmul: x must be [M, K], codes [N, *], scales [N, *]");
  }
  const int64_t M = xd[0], K = xd[1], N = cd[0], groups = sd[1];
  const bool fits = Bits == 8 ? cd[1] == K && groups == 1
                              : cd[1] * 2 == K && groups > 0 && K % groups == 0 && (K / groups) % 2 == 0;
  if (!fits) {
    return ffi::Error::InvalidArgument(Bits == 8 ? "specjax int8 matmul: codes must be [N, K], scales [N, 1]"
                                                 : "specjax int4 matmul: codes must be [N, K / 2], scales [N, K / G] "
                                                   "with G even");
  }
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(y->typed_data(), y->typed_data() + M * N, 0.0f);
    return ffi::Error::Success();
  }
  QuantizedOperands<Bits, X> o{QuantizedPath<Bits, X>(Avx512Int4Fits(K, groups)), x.typed_data(), codes.typed_data(),
                               scales.typed_data(), y->typed_data(), M, N, K, groups};
  std::unique_ptr<float[]> widened;  // outlives every chunk: ParallelRows returns when all are done
  if (o.path == kAvx2 || (o.path == kAvx512 && Bits == 8)) {
    const int64_t run = Bits == 8 ? K : K / groups / 2;
    o.XS = K / run * ((run + 7) / 8 * 8);
    widened.reset(new float[size_t(M * o.XS)]);
    WidenRuns(o.x, widened.get(), M, K, run);
    o.xf = widened.get();
  }
  std::unique_ptr<float[]> blocked;  // likewise
#ifdef SPECJAX_X86
  if constexpr (Bits == 4 && std::is_same_v<X, uint16_t>) {
    if (o.path == kAvx512) {
      o.XQ = (K / 2 + 31) / 32 * 64;
      blocked.reset(new float[size_t(M * o.XQ)]);
      Int4BlockRows(o.x, blocked.get(), M, K, K / groups / 2, o.XQ);
      o.xq = blocked.get();
    }
  }
#endif
  ParallelRows(pool, o);
  return ffi::Error::Success();
}

// ---- int4a8: int4:G weights, x quantized to int8 per group at run time ---------------------------------
// The weights are int4:G's (codes and bfloat16 scales as above); x is quantized per row and per group of G
// inputs, as llama.cpp's Q8_0 activations for its Q4_0 x Q8_0 dot products: d = max |x| / 127 (float32
// division), q = x / d (float32 division) rounded half to even, clipped to [-127, 127] (all 0 when d = 0).
// Per group an exact integer dot product I[g] = sum_k q_k code_k (int32; |I| < 2^24, exact in float32),
// then y = sum over groups of t[g] I[g], t[g] = d[g] * scale[g] rounded to float32, in a fixed float order:
// 16 float32 lanes, lane A8Lane(g) taking the groups mapped to it in increasing g, each by one FMA
// (lane = fma(t[g], I[g], lane), from +0), then one fixed tree over the lanes, A8Sum16: (l + l+8), then
// (+4), (+2), (+1). The portable loop and the AVX512-VNNI path run exactly these operations, so they agree
// bit for bit (unused lanes of the vector path add exact zeros, which change nothing); both are
// batch-invariant (nothing depends on M, a row's place in its tile or the thread).
// AVX512-VNNI (G = 32, 64, 128): x is quantized once per call straight into the order the weight bytes
// unpack in (A8QuantizeBlocked, A8Slot): per block of 256 code bytes (512 weights), 4 vectors of 64 x codes
// for the low nibbles and 4 for the high ones, then the block's d and - 8 sum q per lane. Per block, a row
// of W's 4 vectors of code bytes are transposed as int32 within each 128-bit lane (A8Transpose), so that
// int32 lane 4 c + v of transposed vector s holds bytes 64 v + 16 c + 4 s .. + 3: every lane then sees 16
// consecutive code bytes over the 4 vectors (a group of 32, half a group of 64, a quarter of one of 128,
// whose lanes one or two shuffles add), and one chain of 8 VPDPBUSD per (row of x, row of W), from
// - 8 sum q, sums each group's products (nibble (code + 8) unsigned times x's int8 code, 4 per lane per
// instruction) into one int32 lane: the exact I. The weight vectors are loaded, transposed and unpacked
// (AND, shift) once per tile of up to 8 rows of x; then per (row, lane) one multiply d * scale (d per lane,
// scale per lane through a permute of the block's scales) and one FMA into the lane's float32 accumulator.
// Measured on this project's 2-core AMX host (a Xeon with AVX512-VNNI): docs/quantized-drafts.md.

// The float32 lane of group g (G = 32, 64, 128: where the vector path's reduction leaves it; other G, which
// run the portable loop, g mod 16).
inline int A8Lane(int64_t g, int64_t G) {
  if (G != 32 && G != 64 && G != 128) return int(g % 16);
  const int64_t offset = g % (512 / G) * (G / 2);  // the group's first byte in its block of 256 code bytes
  return int(offset % 64 / 16 * 4 + offset / 64);
}

// The 16 lanes summed: (l + l+8), then (+4), (+2), (+1), the additions of the vector path's A8Sums.
float A8Sum16(const float (&lane)[16]) {
  float s8[8], s4[4], s2[2];
  for (int l = 0; l < 8; ++l) s8[l] = lane[l] + lane[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  for (int l = 0; l < 2; ++l) s2[l] = s4[l] + s4[l + 2];
  return s2[0] + s2[1];
}

// One row of x quantized: codes q [K] int8 (element order) and d [K / G] float32.
template <typename X>
void A8QuantizeRow(const X* x, int64_t K, int64_t G, int8_t* q, float* d) {
  for (int64_t g = 0; g < K / G; ++g) {
    float amax = 0.0f;
    for (int64_t e = 0; e < G; ++e) amax = std::max(amax, std::fabs(ToFloat(x[g * G + e])));
    const float dg = amax / 127.0f;
    for (int64_t e = 0; e < G; ++e) {
      const float r = dg == 0.0f ? 0.0f : std::nearbyint(ToFloat(x[g * G + e]) / dg);  // half to even
      q[g * G + e] = int8_t(std::min(127.0f, std::max(-127.0f, r)));
    }
    d[g] = dg;
  }
}

// The portable path: per group the exact integer dot product, then the float order of the definition.
void A8PortableRows(const int8_t* q, const float* d, const uint8_t* codes, const uint16_t* scales, float* y,
                    int64_t M, int64_t N, int64_t K, int64_t groups, int64_t n0, int64_t n1) {
  const int64_t G = K / groups, half = G / 2;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = n0; n < n1; ++n) {
      float lane[16] = {};
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* c = codes + n * (K / 2) + g * half;
        const int8_t* qg = q + m * K + g * G;
        int32_t dot = 0;
        for (int64_t e = 0; e < half; ++e) dot += qg[e] * ((c[e] & 15) - 8) + qg[half + e] * ((c[e] >> 4) - 8);
        const float t = d[m * groups + g] * Bf16ToFloat(scales[n * groups + g]);
        float& acc = lane[A8Lane(g, G)];
        acc = std::fma(t, float(dot), acc);
      }
      y[m * N + n] = A8Sum16(lane);
    }
  }
}

constexpr int64_t kA8Block = 640;  // bytes per block of 256 code bytes in a blocked x row: 512 codes, 16 d, 16 8 sum q

// Where the x code of each weight byte's nibble goes in a block of 256 code bytes (the vector path's order):
// byte p = 64 v + 16 c + 4 s + b (v, c, s < 4, b < 4) sits in byte b of int32 lane 4 c + v of vector s
// (A8Tile's transpose of the weight bytes), its low nibble's x code at 128 s + 4 (4 c + v) + b and its high
// nibble's 64 bytes on.
inline int64_t A8Slot(int64_t p) { return p % 16 / 4 * 128 + 4 * (p % 64 / 16 * 4 + p / 64) + p % 4; }

#ifdef SPECJAX_X86

#define SPECJAX_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

bool HasAvx512Vnni() { return HasAvx512Bw() && __builtin_cpu_supports("avx512vnni"); }

// 16 elements of x from `x` as float32 (bfloat16 widened: exact).
SPECJAX_VNNI inline __m512 A8Load16(const float* x) { return _mm512_loadu_ps(x); }
SPECJAX_VNNI inline __m512 A8Load16(const uint16_t* x) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

// Rows of x quantized as A8QuantizeRow does (the same divisions, rounded half to even, so the same codes)
// straight into the vector path's layout: rows of XR = blocks x kA8Block bytes; per block its 512 codes
// (A8Slot: 4 consecutive codes of a half group are one int32), then d per lane (float32 [16], 0 in lanes no
// group uses), then - 8 sum q per lane (int32 [16]: where the lane's dot product starts). G: 32, 64 or 128.
template <typename X>
SPECJAX_VNNI void A8QuantizeBlocked(const X* x, uint8_t* xa, int64_t M, int64_t K, int64_t G, int64_t XR) {
  const int64_t half = G / 2, groups = K / G, per_block = 512 / G;
  const __m512i limit = _mm512_set1_epi32(127);
  std::memset(xa, 0, size_t(M * XR));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const X* xg = x + m * K + g * G;
      __m512 amax = _mm512_setzero_ps();
      for (int64_t e = 0; e < G; e += 16) amax = _mm512_max_ps(_mm512_abs_ps(A8Load16(xg + e)), amax);
      const float dg = _mm512_reduce_max_ps(amax) / 127.0f;
      const __m512 dv = _mm512_set1_ps(dg);
      alignas(64) int8_t codes[128];
      __m512i sum = _mm512_setzero_si512();
      for (int64_t e = 0; e < G; e += 16) {
        __m512i r = _mm512_setzero_si512();
        if (dg != 0.0f) {
          r = _mm512_cvt_roundps_epi32(_mm512_div_ps(A8Load16(xg + e), dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          r = _mm512_max_epi32(_mm512_min_epi32(r, limit), _mm512_sub_epi32(_mm512_setzero_si512(), limit));
        }
        _mm_store_si128(reinterpret_cast<__m128i*>(codes + e), _mm512_cvtepi32_epi8(r));
        sum = _mm512_add_epi32(sum, r);
      }
      uint8_t* block = xa + m * XR + g / per_block * kA8Block;
      const int64_t first = g % per_block * half;  // the group's first code byte in its block
      for (int64_t e = 0; e < half; e += 4) {
        std::memcpy(block + A8Slot(first + e), codes + e, 4);
        std::memcpy(block + A8Slot(first + e) + 64, codes + half + e, 4);
      }
      const int lane = A8Lane(g, G);
      const int32_t minus = -8 * _mm512_reduce_add_epi32(sum);
      std::memcpy(block + 512 + 4 * lane, &dg, 4);
      std::memcpy(block + 576 + 4 * lane, &minus, 4);
    }
  }
}

// The 4 x 4 transpose of int32 within each 128-bit lane: lane 4 c + v of t[s] = lane 4 c + s of w[v].
SPECJAX_VNNI inline void A8Transpose(const __m512i (&w)[4], __m512i (&t)[4]) {
  const __m512i u0 = _mm512_unpacklo_epi32(w[0], w[1]), u1 = _mm512_unpackhi_epi32(w[0], w[1]);
  const __m512i u2 = _mm512_unpacklo_epi32(w[2], w[3]), u3 = _mm512_unpackhi_epi32(w[2], w[3]);
  t[0] = _mm512_unpacklo_epi64(u0, u2);
  t[1] = _mm512_unpackhi_epi64(u0, u2);
  t[2] = _mm512_unpacklo_epi64(u1, u3);
  t[3] = _mm512_unpackhi_epi64(u1, u3);
}

// The lane sums of up to 16 accumulators, each by A8Sum16's additions ((l + l+8), (+4), (+2), (+1): the
// same bits), 16 at a time in 4 rounds of shuffles and adds; out[k] is a[k]'s.
SPECJAX_VNNI inline void A8Sums(const __m512 (&a)[16], float (&out)[16]) {
  __m512 b[8], c[4], d[2];
  for (int k = 0; k < 8; ++k) {  // [a[2k] (l + l+8), a[2k+1] (l + l+8)]
    b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xEE));
  }
  for (int k = 0; k < 4; ++k) {  // 128-bit lane q: a[4k + q]'s 4 sums (+4)
    c[k] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * k], b[2 * k + 1], 0xDD));
  }
  for (int k = 0; k < 2; ++k) {  // 128-bit lane q: a[8k + q]'s 2 sums (+2), a[8k + 4 + q]'s
    d[k] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * k], c[2 * k + 1], 0x44), _mm512_shuffle_ps(c[2 * k], c[2 * k + 1], 0xEE));
  }
  // lane 4 q + r: a[q + 4 r]'s sum (+1), permuted into a's order
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, e));
}

// Which group of its block (0 .. 512 / G - 1) each lane holds, per G / 2 = 16, 32, 64 (lanes no group uses: 0).
alignas(64) constexpr int32_t kA8Groups[3][16] = {
    {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15},
    {0, 2, 4, 6, 0, 0, 0, 0, 1, 3, 5, 7, 0, 0, 0, 0},
    {0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
};

// A tile of MR rows of x (blocked, XR bytes apart) by NR rows of W (RB = K / 2 bytes apart, groups of HALF
// bytes: 16, 32 or 64), over all of K, a block of 256 code bytes at a time.
template <int MR, int NR, int HALF>
SPECJAX_VNNI void A8Tile(const uint8_t* xa, int64_t XR, const uint8_t* w, int64_t RB, const uint16_t* scale,
                         int64_t groups, float* y, int64_t N) {
  constexpr int64_t kPerBlock = 256 / HALF;
  const __m512i low4 = _mm512_set1_epi8(15);
  const __m512i order = _mm512_load_si512(kA8Groups[HALF == 16 ? 0 : HALF == 32 ? 1 : 2]);
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0, b = 0; p < RB; p += 256, ++b) {
    __mmask64 mask[4];
    for (int v = 0; v < 4; ++v) {
      const int64_t left = std::min<int64_t>(64, std::max<int64_t>(0, RB - p - 64 * v));
      mask[v] = left == 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
    }
    const int64_t present = std::min(kPerBlock, groups - b * kPerBlock);
    const __mmask16 smask = __mmask16((1u << present) - 1);
    const uint8_t* xb = xa + b * kA8Block;
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const uint8_t* wj = w + j * RB + p;
      for (int v = 0; v < 4; ++v) _mm_prefetch(reinterpret_cast<const char*>(wj + NR * RB + 64 * v), _MM_HINT_T0);
      __m512i raw[4], t[4], lo[4], hi[4];
      for (int v = 0; v < 4; ++v) raw[v] = _mm512_maskz_loadu_epi8(mask[v], wj + 64 * v);
      A8Transpose(raw, t);
      for (int v = 0; v < 4; ++v) {
        lo[v] = _mm512_and_si512(t[v], low4);
        hi[v] = _mm512_and_si512(_mm512_srli_epi16(t[v], 4), low4);
      }
      const __m512i sbits = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(smask, scale + j * groups + b * kPerBlock));
      const __m512 sv = _mm512_permutexvar_ps(order, _mm512_castsi512_ps(_mm512_slli_epi32(sbits, 16)));
      // The rows' dot products side by side (MR independent chains of 8 VPDPBUSD), from - 8 sum q.
      __m512i dot[MR];
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) dot[i] = _mm512_loadu_si512(xb + i * XR + 576);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) {
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], lo[v], _mm512_loadu_si512(xb + i * XR + 128 * v));
#pragma GCC unroll 16
        for (int i = 0; i < MR; ++i) {
          dot[i] = _mm512_dpbusd_epi32(dot[i], hi[v], _mm512_loadu_si512(xb + i * XR + 128 * v + 64));
        }
      }
#pragma GCC unroll 16
      for (int i = 0; i < MR; ++i) {
        __m512i sum = dot[i];
        if (HALF >= 32) sum = _mm512_add_epi32(sum, _mm512_shuffle_i32x4(sum, sum, 0xB1));  // 128-bit lanes 0+1, 2+3
        if (HALF >= 64) sum = _mm512_add_epi32(sum, _mm512_shuffle_i32x4(sum, sum, 0x4E));  // and all four
        const __m512 t = _mm512_mul_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(xb + i * XR + 512)), sv);
        acc[i][j] = _mm512_fmadd_ps(t, _mm512_cvtepi32_ps(sum), acc[i][j]);
      }
    }
  }
  for (int base = 0; base < MR * NR; base += 16) {  // 16 accumulators at a time (one round for tiles Grid runs)
    __m512 some[16];
    float sums[16];
    for (int k = 0; k < 16; ++k) some[k] = base + k < MR * NR ? acc[(base + k) / NR][(base + k) % NR] : _mm512_setzero_ps();
    A8Sums(some, sums);
    for (int k = 0; k < 16 && base + k < MR * NR; ++k) y[(base + k) / NR * N + (base + k) % NR] = sums[k];
  }
}

// int4a8 for Grid: x blocked (`xa`, rows of XR bytes), G / 2 one of 16, 32, 64.
struct A8Tiles {
  const uint8_t* xa;
  int64_t XR;
  const uint8_t* codes;
  const uint16_t* scales;
  float* y;
  int64_t N, K, groups;
  // Tiles of up to 8 rows of x by 2 rows of W (4 for a row block of 1-2 rows: a one-token step runs 4
  // independent chains): 8 x 1, 8 x 3, 6 x 2 and 4 x 2 measured within noise of 8 x 2 at T = 32.
  static constexpr int64_t kRows = 8;
  static constexpr int64_t Width(int64_t rows) { return rows >= 3 ? 2 : 4; }
  template <int MR, int NR>
  void Tile(int64_t m, int64_t n) const {
    const uint8_t* w = codes + n * (K / 2);
    const uint16_t* s = scales + n * groups;
    float* out = y + m * N + n;
    switch (K / groups / 2) {
      case 16: return A8Tile<MR, NR, 16>(xa + m * XR, XR, w, K / 2, s, groups, out, N);
      case 32: return A8Tile<MR, NR, 32>(xa + m * XR, XR, w, K / 2, s, groups, out, N);
      default: return A8Tile<MR, NR, 64>(xa + m * XR, XR, w, K / 2, s, groups, out, N);
    }
  }
};

#else

bool HasAvx512Vnni() { return false; }

#endif  // SPECJAX_X86

// int4a8's path: AVX512-VNNI for G = 32, 64, 128, else the portable loop.
Path A8Path(int64_t G) {
  const int limit = path_limit.load(std::memory_order_relaxed);
  return limit >= kAvx512 && (G == 32 || G == 64 || G == 128) && HasAvx512Vnni() ? kAvx512 : kPortable;
}

struct A8Operands {
  Path path;
  const uint8_t* codes;
  const uint16_t* scales;
  float* y;
  int64_t M, N, K, groups;
  const int8_t* q = nullptr;  // x quantized, [M, K] codes and [M, groups] d (the portable loop)
  const float* d = nullptr;
  const uint8_t* xa = nullptr;  // the vector path: A8QuantizeBlocked, rows of XR bytes
  int64_t XR = 0;

  void Rows(int64_t n0, int64_t n1) const {
#ifdef SPECJAX_X86
    if (path == kAvx512) {
      const int64_t block = std::max<int64_t>(8, std::min<int64_t>(kRowBlock, (int64_t{1} << 20) / XR / 8 * 8));
      return Grid(A8Tiles{xa, XR, codes, scales, y, N, K, groups}, M, n0, n1, block);
    }
#endif
    A8PortableRows(q, d, codes, scales, y, M, N, K, groups, n0, n1);
  }
};

// y = x W^T for int4a8: codes [N, K / 2] uint8, bfloat16 scales [N, K / G], x float32 or bfloat16.
template <ffi::DataType XT>
ffi::Error Int4a8Matmul(ffi::ThreadPool pool, ffi::Buffer<XT> x, ffi::Buffer<ffi::U8> codes,
                        ffi::Buffer<ffi::BF16> scales, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), cd = codes.dimensions(), sd = scales.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2 || cd[0] != sd[0] || cd[1] * 2 != xd[1] || sd[1] <= 0 ||
      xd[1] % sd[1] != 0 || (xd[1] / sd[1]) % 2 != 0) {
    return ffi::Error::InvalidArgument("specjax int4a8 matmul: x must be [M, K], codes [N, K / 2], scales [N, K / G] "
                                       "with G even");
  }
  const int64_t M = xd[0], K = xd[1], N = cd[0], groups = sd[1], G = K / groups;
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(y->typed_data(), y->typed_data() + M * N, 0.0f);
    return ffi::Error::Success();
  }
  A8Operands o{A8Path(G), codes.typed_data(), reinterpret_cast<const uint16_t*>(scales.typed_data()),
               y->typed_data(), M, N, K, groups};
  // x quantized: outlives every chunk (ParallelRows returns when all are done)
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<uint8_t> blocked;
#ifdef SPECJAX_X86
  if (o.path == kAvx512) {
    o.XR = (K / 2 + 255) / 256 * kA8Block;
    blocked.resize(size_t(M * o.XR + 64));
    uint8_t* xa = blocked.data() + (64 - reinterpret_cast<uintptr_t>(blocked.data()) % 64) % 64;
    A8QuantizeBlocked(x.typed_data(), xa, M, K, G, o.XR);
    o.xa = xa;
  }
#endif
  if (o.path == kPortable) {
    q.resize(size_t(M * K));
    d.resize(size_t(M * groups));
    for (int64_t m = 0; m < M; ++m) {
      A8QuantizeRow(x.typed_data() + m * K, K, G, q.data() + m * K, d.data() + m * groups);
    }
    o.q = q.data();
    o.d = d.data();
  }
  ParallelRows(pool, o);
  return ffi::Error::Success();
}

// Rows of a bfloat16 table [V, D] by index, ids [N] clamped into [0, V): the embedding lookup of a bfloat16
// model. XLA:CPU runs that gather by widening the whole table to float32 (or copying its bits), hoisted out of
// the loops, so every call of a program copied each embedding whole to read a few rows; this copies the rows.
ffi::Error TakeRows(ffi::Buffer<ffi::BF16> table, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::BF16> out) {
  const auto dims = table.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("specjax take_rows: the table must be [V, D]");
  const int64_t V = dims[0], D = dims[1], N = static_cast<int64_t>(ids.element_count());
  if (static_cast<int64_t>(out->element_count()) != N * D) {
    return ffi::Error::InvalidArgument("specjax take_rows: the output must be [N, D]");
  }
  const auto* rows = reinterpret_cast<const uint16_t*>(table.typed_data());
  auto* dst = reinterpret_cast<uint16_t*>(out->typed_data());
  for (int64_t i = 0; i < N; ++i) {
    const int64_t row = std::clamp<int64_t>(ids.typed_data()[i], 0, V - 1);
    std::memcpy(dst + i * D, rows + row * D, sizeof(uint16_t) * size_t(D));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SpecjaxTakeRowsBf16, TakeRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());

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

#define SPECJAX_QUANTIZED_HANDLER(name, bits, x_type, code_type, scale_type)                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, (QuantizedMatmul<bits, x_type, code_type, scale_type>),                 \
                                ffi::Ffi::Bind()                                                              \
                                    .Ctx<ffi::ThreadPool>()                                                   \
                                    .Arg<ffi::Buffer<x_type>>()                                               \
                                    .Arg<ffi::Buffer<code_type>>()                                            \
                                    .Arg<ffi::Buffer<scale_type>>()                                           \
                                    .Ret<ffi::Buffer<ffi::F32>>())

SPECJAX_QUANTIZED_HANDLER(SpecjaxMatmulInt8F32, 8, ffi::F32, ffi::S8, ffi::F32);
SPECJAX_QUANTIZED_HANDLER(SpecjaxMatmulInt8Bf16, 8, ffi::BF16, ffi::S8, ffi::F32);
SPECJAX_QUANTIZED_HANDLER(SpecjaxMatmulInt4F32, 4, ffi::F32, ffi::U8, ffi::BF16);
SPECJAX_QUANTIZED_HANDLER(SpecjaxMatmulInt4Bf16, 4, ffi::BF16, ffi::U8, ffi::BF16);

#define SPECJAX_INT4A8_HANDLER(name, x_type)                                                                   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, Int4a8Matmul<x_type>,                                                   \
                                ffi::Ffi::Bind()                                                              \
                                    .Ctx<ffi::ThreadPool>()                                                   \
                                    .Arg<ffi::Buffer<x_type>>()                                               \
                                    .Arg<ffi::Buffer<ffi::U8>>()                                              \
                                    .Arg<ffi::Buffer<ffi::BF16>>()                                            \
                                    .Ret<ffi::Buffer<ffi::F32>>())

SPECJAX_INT4A8_HANDLER(SpecjaxMatmulInt4a8F32, ffi::F32);
SPECJAX_INT4A8_HANDLER(SpecjaxMatmulInt4a8Bf16, ffi::BF16);

// Which path each handler runs now (under `specjax_cpu_limit`): bits 0-1 the float32 handler's, bits 2-3
// the bfloat16 handler's (for K a multiple of 32), bits 4-5 the quantized handlers', bits 6-7 int4a8's (at
// G = 32), each 0 = portable loop, 1 = AVX2 + FMA, 2 = AVX-512 (bfloat16: AVX512_BF16; int4a8:
// AVX512-VNNI), 3 = AMX (bfloat16).
extern "C" int specjax_cpu_features() {
  return int(PathFor<float>()) | (int(PathFor<uint16_t>()) << 2) | (int(QuantizedPath<4, uint16_t>()) << 4) |
         (int(A8Path(32)) << 6);
}

// Caps the path every later call runs at `level` (0 portable, 1 AVX2, 2 AVX-512, 3 AMX: the default); returns
// the previous cap. For tests, which run each path the CPU has; not for concurrent use with running calls
// of another cap (a call reads the cap once, at its start).
extern "C" int specjax_cpu_limit(int level) { return path_limit.exchange(level); }
