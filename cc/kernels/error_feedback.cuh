// CUDA kernels of the fused error-feedback selection (ErrorFeedbackTopK). No
// TensorFlow include: the TF glue (error_feedback_topk_op_gpu.cu.cc) and the
// standalone harness (benchmarks/gpu/harness.cu) both compile this header.
//
// What it computes (n >= 1 entries, 0 <= k <= n):
//   accumulated = float(gradient) + residual, written to `remaining` (which
//   may be `residual` itself: the update is element-wise in place);
//   values[0:k], indices[0:k] = what LaunchApproxTopK<float> selects from
//   accumulated (spare slots: value 0, index 0);
//   remaining[indices[j]] = 0 for every filled slot j (values[j] != 0);
//   stats[0:3] (double, device memory) = [sum of squares of the finite
//   accumulated entries, the same of remaining, count of non-finite
//   accumulated entries]. Non-finite entries are never selected (the
//   selection skips them) and add nothing to either sum.
//
//   profile (optional, nullptr: none; double, device memory, [2, kNumBins]
//   row-major) = per magnitude bin BinOf(MagnitudeBits(a)) (the bins of the
//   selection, topk_common.h), the count (row 0) and the sum of squares
//   (row 1) of the accumulated entries a that qualify: finite and non-zero
//   (NaN, +-Inf and zeros are in no bin). The CPU kernel returns the same.
//
// Passes over memory, all enqueued on one stream, nothing read back:
//   [memset of stats (and of the profile)]
//   -> [accumulate: read gradient + residual, write remaining, sums of
//      squares and non-finite count per block, one atomic per block; with
//      the profile, also its per-block histogram (below)]
//   -> the selection's passes over remaining (approx_topk.cuh: one pass when
//      the sampled prefilter works, two to four otherwise)
//   -> [zero selected: O(k), over the output slots only].
// With k == 0 only the first two run: remaining = accumulated and
// stats[1] = stats[0].
//
// The profile costs no extra pass over memory: with it the accumulate pass
// runs a variant of its kernel (chosen at launch, so the profile-free
// variant keeps its registers and speed) that also adds every qualifying
// entry to a block histogram in shared memory, two shared-memory atomics
// per entry (count uint32, square float), and at the end adds the block's
// non-empty bins to the profile, two double atomics per bin. 16 KiB of
// shared memory per block (on sm_90 the float atomic is a compare-and-swap
// loop; the count's increment is native). The float sums hold scaled
// squares, (|a| / 2^e)^2 in [1, 4) (subnormal a: [0, 1)) with 2^e the bin's
// power of two, so they neither overflow nor underflow whatever the
// magnitude; the flush scales them by 4^e in double. Counts are exact. A
// bin's energy is one float sum per block, in the order the atomics land:
// with m of the block's entries in the bin, its relative error is about
// sqrt(m) * 2^-24 for spread values, at worst m * 2^-24 (many equal values);
// at n = 25M on an H100 (528 blocks, ~47k entries each) the fullest bin of
// normal data holds ~2k per block, so ~1e-6 typically, ~1e-4 at worst, and
// ~3e-3 at worst if all of a block's entries share one bin.
//
// Why stats[1] is a difference: the sum of squares of what remains is
// stats[0] minus the squares of the selected entries (every selected entry
// is finite and was counted in stats[0]). The accumulate kernel adds its
// block sums to stats[0] and stats[1] alike, and the zeroing kernel
// subtracts the selected squares from stats[1], so no second pass over
// remaining is needed. Rounding (float partial sums of squares per thread in
// the accumulate kernel, double squares of the selected values here, atomics
// in any order) can leave stats[1] a tiny bit negative when almost all the
// energy is selected; the Python side clamps it at 0. Squares are summed in
// float per thread, so finite entries above ~1.8e19 in magnitude make the
// sums Inf here (the CPU kernel sums such chunks again in double).
#ifndef TF_TOPK_CC_KERNELS_ERROR_FEEDBACK_CUH_
#define TF_TOPK_CC_KERNELS_ERROR_FEEDBACK_CUH_

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>

#include "approx_topk.cuh"
#include "topk_common.h"

namespace tf_topk {
namespace cuda {

// Positions in stats (the TF glue checks they match ErrorFeedbackStat).
constexpr int kStatAccumulatedSquares = 0;
constexpr int kStatRemainingSquares = 1;
constexpr int kStatNonFinite = 2;
constexpr int kNumStats = 3;

// The profile's rows (the TF glue checks they match kProfileRows): counts,
// then sums of squares, kNumBins doubles each.
constexpr int kProfileRows = 2;
constexpr int kProfileCount = 0;
constexpr int kProfileSquares = 1;

// Entries per vector of the accumulate kernel: one float4 of residual and
// of remaining, and 4 gradient entries in one 16-byte (float) or 8-byte
// (16-bit types) load.
constexpr int kAccumulateVec = 4;

// ---------------------------------------------------------------------------
// Device helpers.

// Four gradient entries as float, from one aligned load.
template <typename T>  // __half, __nv_bfloat16
__device__ __forceinline__ float4 LoadGradient4(const T* p) {
  using Bits = typename Traits<T>::Bits;
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
  // Little endian: the low half of each word comes first.
  return make_float4(Traits<T>::ToFloat(static_cast<Bits>(u.x)),
                     Traits<T>::ToFloat(static_cast<Bits>(u.x >> 16)),
                     Traits<T>::ToFloat(static_cast<Bits>(u.y)),
                     Traits<T>::ToFloat(static_cast<Bits>(u.y >> 16)));
}

template <>
__device__ __forceinline__ float4 LoadGradient4<float>(const float* p) {
  return __ldg(reinterpret_cast<const float4*>(p));
}

// One gradient entry as float.
template <typename T>
__device__ __forceinline__ float LoadGradient(const T* p, int64_t i) {
  using Bits = typename Traits<T>::Bits;
  return Traits<T>::ToFloat(__ldg(reinterpret_cast<const Bits*>(p) + i));
}

// Counts an accumulated entry: its square when finite, else one non-finite.
__device__ __forceinline__ void Tally(float a, float* squares,
                                      unsigned* non_finite) {
  const bool finite = MagnitudeBits(a) < kInfBits;
  *squares += finite ? a * a : 0.0f;
  *non_finite += finite ? 0u : 1u;
}

// The profile's scaled square of a qualifying entry with magnitude bits
// `bits`: (|a| / 2^e)^2, with 2^e = ProfileScale(BinOf(bits))'s square root:
// 2^(E - 127) for the biased exponent E >= 1, 2^-126 for subnormals (E = 0).
// The scaled magnitude is 1.mantissa, or 0.mantissa for subnormals, exactly.
__device__ __forceinline__ float ScaledSquare(uint32_t bits) {
  const float m = __uint_as_float((bits & 0x007fffffu) | 0x3f800000u);
  const float s = (bits >> 23) == 0u ? m - 1.0f : m;
  return s * s;
}

// 4^e for the entries of `bin` (see ScaledSquare): a power of two from 2^-252
// to 2^254, exact in double.
__device__ __forceinline__ double ProfileScale(int bin) {
  const int biased = bin >> (kBinBits - 8);  // the float's exponent field
  const int e = (biased > 1 ? biased : 1) - 127;
  return __longlong_as_double(static_cast<long long>(2 * e + 1023) << 52);
}

// Adds an accumulated entry to the block's profile (shared memory) when it
// qualifies (finite and non-zero).
__device__ __forceinline__ void ProfileAdd(float a, uint32_t* bin_counts,
                                           float* bin_squares) {
  const uint32_t bits = MagnitudeBits(a);
  if (!Qualifies(bits)) return;
  const int bin = BinOf(bits);
  atomicAdd(&bin_counts[bin], 1u);
  atomicAdd(&bin_squares[bin], ScaledSquare(bits));
}

// Sum over the warp; the result is valid in lane 0. Every lane must call it.
__device__ __forceinline__ double WarpSum(double v) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Sums two per-thread values over a block of kBlock threads (whole warps);
// the results are valid in thread 0. Every thread must call it.
template <int kBlock>
__device__ void BlockSum2(double* a, double* b) {
  __shared__ double swarp_a[kBlock / 32];
  __shared__ double swarp_b[kBlock / 32];
  *a = WarpSum(*a);
  *b = WarpSum(*b);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (lane == 0) {
    swarp_a[warp] = *a;
    swarp_b[warp] = *b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double total_a = 0.0, total_b = 0.0;
    for (int w = 0; w < kBlock / 32; ++w) {
      total_a += swarp_a[w];
      total_b += swarp_b[w];
    }
    *a = total_a;
    *b = total_b;
  }
}

// ---------------------------------------------------------------------------
// Kernels.

// remaining = float(gradient) + residual over n entries, grid-stride; the
// block's sum of finite squares goes to stats[0] and stats[1] (the zeroing
// kernel later subtracts the selected part from stats[1]), its non-finite
// count to stats[2]. kVector: gradient, residual and remaining are aligned
// for kAccumulateVec-entry loads (the launcher checks); the < 4 entries of
// the tail, and every entry otherwise, go one at a time. kProfile: the block
// also histograms the qualifying entries in shared memory and adds the
// non-empty bins to profile (zeroed by the launcher); without it, profile is
// not touched and the shared arrays shrink to one element each.
//
// residual and remaining may be the same buffer, so neither is __restrict__
// nor read through the read-only cache: each entry is read, then written, by
// the same thread, and by no other.
template <typename T, bool kVector, bool kProfile>
__global__ void __launch_bounds__(kThreads)
    AccumulateKernel(const T* __restrict__ gradient, const float* residual,
                     int64_t n, float* remaining, double* stats,
                     double* profile) {
  __shared__ uint32_t bin_counts[kProfile ? kNumBins : 1];
  __shared__ float bin_squares[kProfile ? kNumBins : 1];
  if (kProfile) {
    for (int i = threadIdx.x; i < kNumBins; i += blockDim.x) {
      bin_counts[i] = 0u;
      bin_squares[i] = 0.0f;
    }
    __syncthreads();
  }
  float squares = 0.0f;  // per-thread partial sum: a few hundred entries
  unsigned non_finite = 0u;
  auto tally = [&](float a) {
    Tally(a, &squares, &non_finite);
    if (kProfile) ProfileAdd(a, bin_counts, bin_squares);
  };
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t scalar_begin = 0;
  if (kVector) {
    const int64_t nv = n / kAccumulateVec;
    const float4* residual4 = reinterpret_cast<const float4*>(residual);
    float4* remaining4 = reinterpret_cast<float4*>(remaining);
    for (int64_t base = thread; base < nv; base += threads * kUnroll) {
      float4 g[kUnroll], r[kUnroll];
      // All loads first (memory-level parallelism), then the arithmetic.
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t vi = base + u * threads;
        if (vi < nv) {
          g[u] = LoadGradient4(gradient + vi * kAccumulateVec);
          r[u] = residual4[vi];
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t vi = base + u * threads;
        if (vi >= nv) continue;
        const float4 a = make_float4(g[u].x + r[u].x, g[u].y + r[u].y,
                                     g[u].z + r[u].z, g[u].w + r[u].w);
        remaining4[vi] = a;
        tally(a.x);
        tally(a.y);
        tally(a.z);
        tally(a.w);
      }
    }
    scalar_begin = nv * kAccumulateVec;
  }
  for (int64_t i = scalar_begin + thread; i < n; i += threads) {
    const float a = LoadGradient(gradient, i) + residual[i];
    remaining[i] = a;
    tally(a);
  }
  if (kProfile) {  // every thread is here: no early exit above
    __syncthreads();
    for (int bin = threadIdx.x; bin < kNumBins; bin += blockDim.x) {
      const uint32_t count = bin_counts[bin];
      if (count == 0u) continue;
      atomicAdd(&profile[kProfileCount * kNumBins + bin],
                static_cast<double>(count));
      atomicAdd(&profile[kProfileSquares * kNumBins + bin],
                static_cast<double>(bin_squares[bin]) * ProfileScale(bin));
    }
  }
  double block_squares = squares;
  double block_non_finite = non_finite;
  BlockSum2<kThreads>(&block_squares, &block_non_finite);
  if (threadIdx.x != 0) return;
  if (block_squares != 0.0) {
    atomicAdd(&stats[kStatAccumulatedSquares], block_squares);
    atomicAdd(&stats[kStatRemainingSquares], block_squares);
  }
  // Counts are exact in double up to 2^53, far beyond n.
  if (block_non_finite != 0.0) {
    atomicAdd(&stats[kStatNonFinite], block_non_finite);
  }
}

// After the selection: zeroes the selected entries of remaining and
// subtracts their squares (in double) from stats[1], one atomic per warp.
// Filled slots have non-zero, finite values; spare slots (value 0, index 0)
// are skipped. A template, as every kernel of these headers, so that several
// translation units of one library may include them (R is float).
template <typename R>
__global__ void __launch_bounds__(kThreads)
    ZeroSelectedKernel(const R* __restrict__ values,
                       const int32_t* __restrict__ indices, int64_t k,
                       R* __restrict__ remaining, double* stats) {
  double squares = 0.0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       j < k; j += stride) {
    const R v = values[j];
    if (v != R(0)) {
      remaining[indices[j]] = R(0);
      squares += static_cast<double>(v) * static_cast<double>(v);
    }
  }
  squares = WarpSum(squares);  // every lane is here: no early exit above
  if ((threadIdx.x & 31) == 0 && squares != 0.0) {
    atomicAdd(&stats[kStatRemainingSquares], -squares);
  }
}

// ---------------------------------------------------------------------------
// Host side.

// Bytes of device scratch LaunchErrorFeedbackTopK needs: the selection's
// (none when k == 0: nothing is selected).
inline size_t ErrorFeedbackScratchBytes(int64_t n, int64_t k) {
  return k > 0 ? ScratchBytes(n, k) : 0;
}

template <typename T>
inline bool AlignedTo(const T* p, size_t bytes) {
  return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0u;
}

// Whether the accumulate kernel can use its vector loads on these buffers.
template <typename T>
inline bool AccumulateVectorized(const T* gradient, const float* residual,
                                 const float* remaining) {
  return AlignedTo(gradient, kAccumulateVec * sizeof(T)) &&
         AlignedTo(residual, sizeof(float4)) &&
         AlignedTo(remaining, sizeof(float4));
}

// The argument checks of LaunchErrorFeedbackTopK: sizes, alignment to the
// element types, and remaining either equal to residual or disjoint from it
// (a shifted overlap would read entries already overwritten).
template <typename T>
inline bool ErrorFeedbackArgumentsValid(const T* gradient,
                                        const float* residual, int64_t n,
                                        int64_t k, const float* values,
                                        const int32_t* indices,
                                        const float* remaining,
                                        const double* stats,
                                        const double* profile,
                                        const void* scratch) {
  if (gradient == nullptr || residual == nullptr || remaining == nullptr ||
      stats == nullptr || n < 1 || n > 0x7fffffffLL || k < 0 || k > n) {
    return false;
  }
  if (!AlignedTo(gradient, sizeof(T)) || !AlignedTo(residual, sizeof(float)) ||
      !AlignedTo(remaining, sizeof(float)) || !AlignedTo(stats, sizeof(double)) ||
      (profile != nullptr && !AlignedTo(profile, sizeof(double)))) {
    return false;
  }
  const uintptr_t r = reinterpret_cast<uintptr_t>(residual);
  const uintptr_t m = reinterpret_cast<uintptr_t>(remaining);
  const uintptr_t bytes = static_cast<uintptr_t>(n) * sizeof(float);
  if (m != r && m < r + bytes && r < m + bytes) return false;
  // values, indices and scratch are only used when something is selected
  // (TF hands out null data pointers for empty tensors).
  return k == 0 || (values != nullptr && indices != nullptr && scratch != nullptr);
}

// Enqueues the accumulate pass: one wave of AccumulateKernel<T, kVector,
// kProfile>, sized from that variant's own occupancy.
template <typename T, bool kVector, bool kProfile>
void LaunchAccumulate(const T* gradient, const float* residual, int64_t n,
                      float* remaining, double* stats, double* profile,
                      cudaStream_t stream) {
  const int blocks = StreamingBlocks(n, kVector ? kAccumulateVec : 1,
                                     AccumulateKernel<T, kVector, kProfile>);
  AccumulateKernel<T, kVector, kProfile><<<blocks, kThreads, 0, stream>>>(
      gradient, residual, n, remaining, stats, profile);
}

// The fused error-feedback selection (see the top of this file). T: float,
// __half or __nv_bfloat16. Device pointers; `profile` is nullptr (no
// profile) or holds kProfileRows * kNumBins doubles; `scratch` holds
// ErrorFeedbackScratchBytes(n, k) bytes (8-byte aligned) and must not be used
// by anything else until the stream has passed this work. Everything is
// enqueued on `stream`; returns the first error seen while enqueuing.
template <typename T>
cudaError_t LaunchErrorFeedbackTopK(const T* gradient, const float* residual,
                                    int64_t n, int64_t k, Method method,
                                    float* values, int32_t* indices,
                                    float* remaining, double* stats,
                                    double* profile, void* scratch,
                                    cudaStream_t stream) {
  if (!ErrorFeedbackArgumentsValid(gradient, residual, n, k, values, indices,
                                   remaining, stats, profile, scratch)) {
    return cudaErrorInvalidValue;
  }
  // Clear a stale error of an earlier call, so the results below are ours.
  (void)cudaGetLastError();
  cudaError_t err =
      cudaMemsetAsync(stats, 0, kNumStats * sizeof(double), stream);
  if (err != cudaSuccess) return err;
  if (profile != nullptr) {
    err = cudaMemsetAsync(profile, 0, kProfileRows * kNumBins * sizeof(double),
                          stream);
    if (err != cudaSuccess) return err;
  }

  const bool vector = AccumulateVectorized(gradient, residual, remaining);
  if (profile != nullptr) {
    if (vector) {
      LaunchAccumulate<T, true, true>(gradient, residual, n, remaining, stats,
                                      profile, stream);
    } else {
      LaunchAccumulate<T, false, true>(gradient, residual, n, remaining, stats,
                                       profile, stream);
    }
  } else if (vector) {
    LaunchAccumulate<T, true, false>(gradient, residual, n, remaining, stats,
                                     nullptr, stream);
  } else {
    LaunchAccumulate<T, false, false>(gradient, residual, n, remaining, stats,
                                      nullptr, stream);
  }
  // Checked now: LaunchApproxTopK starts by clearing the last error.
  err = cudaGetLastError();
  if (err != cudaSuccess || k == 0) return err;

  err = LaunchApproxTopK<float>(remaining, n, k, method, values, indices,
                                scratch, stream);
  if (err != cudaSuccess) return err;

  // At most k slots, a few per thread: a small grid, as the selection's
  // FinishKernel.
  const int64_t wanted = (k + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 256 ? wanted : 256);
  ZeroSelectedKernel<float><<<blocks, kThreads, 0, stream>>>(
      values, indices, k, remaining, stats);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_ERROR_FEEDBACK_CUH_
