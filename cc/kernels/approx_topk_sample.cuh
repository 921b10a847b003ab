// Stage 1 of the one-pass path, the sample (part of approx_topk.cuh, which
// is what to include): a fixed sample of the input places the prefilter
// threshold, so that the one pass over x keeps only entries that may be
// selected, whatever the distribution.
//
// The sample: kSampleBlocks blocks read one sampled entry (SampleIndex) per
// thread, so the scattered reads spread over many SMs, and add their bins and
// moments to the scratch; the last block to finish places the prefilter
// threshold at the lower edge of the bin of the sampled magnitude of rank
// PrefilterRank (none when too few sampled entries qualify).
#ifndef TF_TOPK_CC_KERNELS_APPROX_TOPK_SAMPLE_CUH_
#define TF_TOPK_CC_KERNELS_APPROX_TOPK_SAMPLE_CUH_

#include <cstdint>

#include "approx_topk_primitives.cuh"
#include "approx_topk_scratch.cuh"
#include "topk_common.h"

namespace tf_topk {
namespace cuda {

template <typename T>
__global__ void __launch_bounds__(kSampleThreads)
    SampleKernel(const T* __restrict__ x, int64_t n, long long k, Scratch* s) {
  using Bits = typename Traits<T>::Bits;
  __shared__ uint32_t shist[kNumBins];
  __shared__ bool s_last;
  State& st = s->state;
  for (int i = threadIdx.x; i < kNumBins; i += blockDim.x) shist[i] = 0u;
  __syncthreads();
  const long long sample =
      static_cast<long long>(blockIdx.x) * kSampleThreads + threadIdx.x;
  const Bits raw = reinterpret_cast<const Bits*>(x)[SampleIndex(sample, n)];
  const float f = Traits<T>::ToFloat(raw);
  const uint32_t bits = MagnitudeBits(f);
  double sum = 0.0, sum_squares = 0.0;
  unsigned long long count = 0;
  if (Qualifies(bits)) {
    atomicAdd(&shist[BinOf(bits)], 1u);
    sum = f;
    sum_squares = static_cast<double>(f) * f;
    count = 1;
  }
  BlockSumMoments<kSampleThreads>(&sum, &sum_squares, &count);
  __syncthreads();
  for (int i = threadIdx.x; i < kNumBins; i += blockDim.x) {
    if (shist[i] != 0u) atomicAdd(&s->sample_hist[i], shist[i]);
  }
  if (threadIdx.x == 0 && count != 0) {
    atomicAdd(&st.sample_sum, sum);
    atomicAdd(&st.sample_sum_squares, sum_squares);
    atomicAdd(&st.sample_count, count);
  }
  // The last block sees every block's additions (fence, then count).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    s_last = atomicAdd(&st.sample_blocks_done, 1u) == gridDim.x - 1u;
  }
  __syncthreads();
  if (!s_last) return;  // block-uniform
  __threadfence();
  for (int i = threadIdx.x; i < kNumBins; i += blockDim.x) {
    shist[i] = __ldcg(&s->sample_hist[i]);  // from L2: other blocks' atomics
  }
  __syncthreads();
  int bin;
  long long above, total;
  const long long rank = PrefilterRank(n, k);  // >= 0: the launcher checked
  FindCrossing<kNumBins, kSampleThreads>(shist, rank + 1, &bin, &above, &total);
  if (threadIdx.x != 0) return;
  const uint32_t key = bin >= 0 ? static_cast<uint32_t>(bin) << kBinShift : 0u;
  st.prefilter_key = Qualifies(key) ? key : 0u;
}

}  // namespace cuda
}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_APPROX_TOPK_SAMPLE_CUH_
