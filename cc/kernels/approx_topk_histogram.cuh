// The histogram passes (part of approx_topk.cuh, which is what to include):
// the plan needs to know where the k-th largest magnitude lies. Level 1 is
// the two-pass path's first pass over x (and the fallback's, when the
// candidates did not suffice); the exact method's levels 2 and 3 narrow the
// threshold bin down to the exact magnitude, over the candidates or x.
//
// kLevel 1: every qualifying entry's bin (+ moments). The fallback call
//           (kFallback) does it only when the prefilter failed.
// kLevel 2: 2048 bins of bits [19:9] over entries whose bits [30:20] equal the
//           level-1 bin (state.exact.prefix); the candidates or all of x.
// kLevel 3: 512 bins of bits [8:0] over entries whose bits [30:9] equal the
//           prefix after level 2.
// Each block counts into shared memory and flushes every non-zero bin with one
// global atomicAdd; moments are reduced per block (warp shuffles) and added
// with one atomic per block.
#ifndef TF_TOPK_CC_KERNELS_APPROX_TOPK_HISTOGRAM_CUH_
#define TF_TOPK_CC_KERNELS_APPROX_TOPK_HISTOGRAM_CUH_

#include <cstdint>

#include "approx_topk_primitives.cuh"
#include "approx_topk_scratch.cuh"
#include "topk_common.h"

namespace tf_topk {
namespace cuda {

template <int kLevel>
struct LevelInfo;
template <>
struct LevelInfo<1> { static constexpr int kBins = kNumBins; };
template <>
struct LevelInfo<2> { static constexpr int kBins = kL2Bins; };
template <>
struct LevelInfo<3> { static constexpr int kBins = kL3Bins; };

template <int kLevel>
__device__ __forceinline__ uint32_t* LevelHist(Scratch* s) {
  return kLevel == 1 ? s->hist1 : kLevel == 2 ? s->hist2 : s->hist3;
}

template <typename T, int kLevel, bool kMoments, bool kFallback>
__global__ void __launch_bounds__(kThreads, MinBlocksPerSm(kHistBlocksPerSm))
    HistogramKernel(const T* __restrict__ x, int64_t n, Scratch* s,
                    Candidate* __restrict__ candidates, long long capacity) {
  using Bits = typename Traits<T>::Bits;
  constexpr int kBins = LevelInfo<kLevel>::kBins;
  __shared__ uint32_t shist[kBins];
  State& st = s->state;

  static_assert(kLevel == 1 || !kFallback, "levels 2 and 3: one pass");
  // Block-uniform exits, before any barrier.
  if (kFallback && !st.fallback) return;
  if (kLevel > 1 && st.exact.done) return;
  const uint32_t prefix = st.exact.prefix;
  const bool from_candidates = kLevel > 1 && st.use_candidates;

  for (int i = threadIdx.x; i < kBins; i += blockDim.x) shist[i] = 0u;
  __syncthreads();

  double sum = 0.0, sum_squares = 0.0;
  unsigned long long count = 0;
  auto count_bins = [&](int64_t, Bits raw, bool valid) {
    const float f = Traits<T>::ToFloat(raw);
    const uint32_t bits = MagnitudeBits(f);
    if (!valid || !Qualifies(bits) || !InExactLevel(bits, kLevel, prefix)) {
      return;
    }
    atomicAdd(&shist[ExactLevelBin(bits, kLevel)], 1u);
    if (kMoments) {
      const double d = f;
      sum += d;
      sum_squares += d * d;
      ++count;
    }
  };
  if (from_candidates) {
    ForEachCandidate<T>(candidates, CandidatesKept(st, capacity), count_bins);
  } else {
    ForEachEntry(x, n, count_bins);
  }
  __syncthreads();

  uint32_t* hist = LevelHist<kLevel>(s);
  for (int i = threadIdx.x; i < kBins; i += blockDim.x) {
    const uint32_t c = shist[i];
    if (c != 0u) atomicAdd(&hist[i], c);
  }
  if (kMoments) {
    BlockSumMoments<kThreads>(&sum, &sum_squares, &count);
    if (threadIdx.x == 0 && count != 0) {
      atomicAdd(&st.sum, sum);
      atomicAdd(&st.sum_squares, sum_squares);
      atomicAdd(&st.count, count);
    }
  }
}

}  // namespace cuda
}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_APPROX_TOPK_HISTOGRAM_CUH_
