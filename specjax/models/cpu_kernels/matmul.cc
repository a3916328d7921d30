// y = x W^T on the CPU, for the few rows a decode step, a verify pass or a tree carries.
//
// XLA:CPU multiplies a handful of rows at ~35 GFLOP/s in float32 and ten times slower in bfloat16, so
// a 6-token verify cost 3-4 single-token steps. These handlers stream each weight row once per tile of
// up to 4 input rows, with AVX-512 (float32: FMA; bfloat16: the VDPBF16PS dot product, float32
// accumulation), so that a pass over a few rows costs about what one row costs: its weights' bytes.
//
// Batch invariance: y[m, n] is the same sequence of vector operations on x[m] and W[n] whatever the
// number of rows M, the row's place in its tile, or which thread computes it, so a verify pass computes
// bit for bit what a one-token step computes (greedy speculative output then equals greedy
// autoregressive output in bfloat16 too).
//
// Handlers (XLA FFI, CPU): specjax_matmul_f32(x [M, K] f32, w [N, K] f32) -> y [M, N] f32 and
// specjax_matmul_bf16(x [M, K] bf16, w [N, K] bf16) -> y [M, N] f32. Output rows are split over XLA's
// intra-op thread pool. CPUs without AVX-512 (or without AVX512_BF16 for bfloat16) run a portable loop
// (correct, slow: the Python side chooses XLA there); `specjax_cpu_features` tells which.

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

bool HasAvx512() { return __builtin_cpu_supports("avx512f"); }
bool HasAvx512Bf16() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

#else

bool HasAvx512() { return false; }
bool HasAvx512Bf16() { return false; }

#endif  // SPECJAX_X86

// Rows [n0, n1) of W against every row of x, on the best path this CPU has.
template <typename T>
void Rows(const T* x, const T* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
#ifdef SPECJAX_X86
  if (std::is_same_v<T, float> ? HasAvx512() : HasAvx512Bf16()) {
    return VectorRows(x, w, y, M, N, K, n0, n1);
  }
#endif
  PortableRows(x, w, y, M, N, K, n0, n1);
}

// Chunks of kChunk rows of W claimed from a shared counter by the calling thread and by up to
// `pool.num_threads() - 1` tasks on XLA's pool. The caller returns once every chunk is done; a task that
// starts after that finds no chunk left and touches nothing (the state it reads is shared-owned).
template <typename T>
void ParallelRows(ffi::ThreadPool& pool, const T* x, const T* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), chunks) - 1;
  if (helpers <= 0 || M * N * K < (int64_t{1} << 18)) {
    return Rows(x, w, y, M, N, K, 0, N);
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, x, w, y, M, N, K, chunks]() {
    for (int64_t c; (c = state->next.fetch_add(1)) < chunks;) {
      Rows(x, w, y, M, N, K, c * kChunk, std::min(N, (c + 1) * kChunk));
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
  ParallelRows(pool, x.typed_data(), w.typed_data(), y->typed_data(), M, N, K);
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

// Bit 0: the float32 handler runs vectorised (AVX-512F); bit 1: the bfloat16 one does (AVX512_BF16).
extern "C" int specjax_cpu_features() { return int(HasAvx512()) | (int(HasAvx512Bf16()) << 1); }
