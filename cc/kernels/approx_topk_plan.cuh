// The plan kernels, one block of kPlanThreads each (part of approx_topk.cuh,
// which is what to include): from a histogram, the plan the compaction
// reads (topk_common.h's arithmetic, its searches spread over the block's
// threads), written to the scratch, or the fallback flag when the
// candidates do not suffice. They run on the device so that the launch
// sequence never waits for the host.
#ifndef TF_TOPK_CC_KERNELS_APPROX_TOPK_PLAN_CUH_
#define TF_TOPK_CC_KERNELS_APPROX_TOPK_PLAN_CUH_

#include <cstdint>

#include "approx_topk_histogram.cuh"
#include "approx_topk_primitives.cuh"
#include "approx_topk_scratch.cuh"
#include "topk_common.h"

namespace tf_topk {
namespace cuda {

__device__ inline void StorePlan(const Plan& plan, State* st) {
  st->sure_above = plan.sure_above;
  st->tie_low = plan.tie_low;
  st->bin_low = plan.bin_low;
  st->above = plan.above;
  st->need = plan.need;
}

#if defined(TF_TOPK_DEBUG_CHECKS)
// Debug builds: the parallel crossing must equal the serial one.
template <int kBins>
__device__ void CheckCrossing(const uint32_t* hist, long long want, int bin,
                              long long above, long long total, State* st) {
  long long serial_above, serial_total;
  const int serial_bin =
      FindCrossingSerial(hist, kBins, want, &serial_above, &serial_total);
  if (serial_bin != bin || serial_total != total ||
      (bin >= 0 && serial_above != above)) {
    st->error = kErrorPlanMismatch;
  }
}
#endif

// After the prefilter's pass: whether its candidates make the plan (a
// threshold was set, at least k candidates, all kept). If not, clears hist1
// for the fallback pass and sets the fallback flag. Called by every thread
// after FindCrossing over hist1 (whose reads are then done); block-uniform
// result. (Non-template device functions here are inline: several
// translation units of one library include this header.)
__device__ inline bool CandidatesSuffice(Scratch* s, int bin,
                                         long long capacity) {
  State& st = s->state;
  if (st.prefilter_key != 0u && bin >= 0 &&
      static_cast<long long>(st.candidate_count) <= capacity) {
    return true;
  }
  for (int i = threadIdx.x; i < kNumBins; i += blockDim.x) s->hist1[i] = 0u;
  if (threadIdx.x == 0) st.fallback = 1;
  return false;
}

// The smallest bits b in [low, high] with AboveGaussianThreshold(fit, b), as
// GaussianTieLow's bisection finds it, searched 256 ways per round (one
// candidate per thread): 2^20 candidates in 3 rounds instead of 20
// sequential steps, each of two double-precision erfc. Called by every
// thread of the block; the result is valid in every thread.
__device__ inline uint32_t SearchGaussianThreshold(const GaussianFit& fit,
                                                   uint32_t low,
                                                   uint32_t high) {
  __shared__ int s_first;  // the first thread whose candidate satisfies
  while (low < high) {     // block-uniform: every thread holds low and high
    const uint32_t step = (high - low + kPlanThreads - 1) / kPlanThreads;
    const uint32_t mine = low + threadIdx.x * step;  // candidate of this thread
    // Candidates at or past `high` count as satisfying: high always does.
    const bool above = mine >= high || AboveGaussianThreshold(fit, mine);
    if (threadIdx.x == 0) s_first = kPlanThreads;
    __syncthreads();
    if (above) atomicMin(&s_first, static_cast<int>(threadIdx.x));
    __syncthreads();
    const int first = s_first;
    __syncthreads();  // s_first is rewritten by the next round
    if (first == 0) {
      high = low;
    } else {
      const uint32_t hit = low + first * step;  // satisfies (or is >= high)
      low = low + (first - 1) * step + 1u;      // the one before did not
      if (hit < high) high = hit;
    }
  }
  return low;
}

// Gaussian plan: the threshold bin from hist1, then the tie threshold from
// the normal fit (FitGaussian, shared with the CPU kernel). The first call
// (kFallback false) plans from the candidates when there is a prefilter
// (capacity > 0; with the sample's moments, as the CPU does) or from all of
// x; the fallback call plans from all of x when the candidates did not
// suffice.
template <bool kFallback>
__global__ void __launch_bounds__(kPlanThreads)
    PlanGaussianKernel(Scratch* s, long long k, long long capacity) {
  State& st = s->state;
  if (kFallback && !st.fallback) return;  // block-uniform, before any barrier
  const bool prefiltered = !kFallback && capacity > 0;
  int bin;
  long long above, total;
  FindCrossing<kNumBins>(s->hist1, k, &bin, &above, &total);
  if (prefiltered && !CandidatesSuffice(s, bin, capacity)) return;
  Plan plan = bin >= 0 ? PlanForBin(bin, above, k) : SelectAllPlan(total);
  Moments moments;
  moments.sum = prefiltered ? st.sample_sum : st.sum;
  moments.sum_squares = prefiltered ? st.sample_sum_squares : st.sum_squares;
  moments.count = static_cast<long long>(prefiltered ? st.sample_count : st.count);
  const GaussianFit fit = FitGaussian(plan, s->hist1, moments);
  if (fit.refine) {  // block-uniform: every thread computed the same fit
    plan.tie_low = SearchGaussianThreshold(fit, plan.tie_low, plan.sure_above);
  }
  if (threadIdx.x != 0) return;
#if defined(TF_TOPK_DEBUG_CHECKS)
  CheckCrossing<kNumBins>(s->hist1, k, bin, above, total, &st);
  if (plan.tie_low != GaussianTieLow(bin >= 0 ? PlanForBin(bin, above, k)
                                              : SelectAllPlan(total),
                                     s->hist1, moments)) {
    st.error = kErrorPlanMismatch;
  }
#endif
  StorePlan(plan, &st);
  st.use_candidates = prefiltered ? 1 : 0;
}

// Exact plan after histogram level kLevel (ExactLevelStep, topk_common.h):
// level 1 finds the bin of the k-th largest (or that fewer than k qualify),
// levels 2 and 3 refine the prefix inside it; level 3 leaves the exact bits T
// of the k-th largest and the plan sure_above = tie_low = T. Level 1 has a
// first and a fallback call, as the gaussian plan.
template <int kLevel, bool kFallback>
__global__ void __launch_bounds__(kPlanThreads)
    PlanExactKernel(Scratch* s, long long k, long long capacity) {
  State& st = s->state;
  // Block-uniform exits, before any barrier.
  if (kFallback && !st.fallback) return;
  if (kLevel > 1 && st.exact.done) return;
  const bool prefiltered = kLevel == 1 && !kFallback && capacity > 0;
  const long long want = kLevel == 1 ? k : st.exact.k_rem;
  int bin;
  long long above, total;
  FindCrossing<LevelInfo<kLevel>::kBins>(LevelHist<kLevel>(s), want, &bin,
                                         &above, &total);
  if (prefiltered && !CandidatesSuffice(s, bin, capacity)) return;
  if (threadIdx.x != 0) return;
#if defined(TF_TOPK_DEBUG_CHECKS)
  CheckCrossing<LevelInfo<kLevel>::kBins>(LevelHist<kLevel>(s), want, bin,
                                          above, total, &st);
#endif
  if (kLevel == 1) st.use_candidates = prefiltered ? 1 : 0;
  Plan plan;
  if (ExactLevelStep(kLevel, bin, above, total, k, &st.exact, &plan)) {
    StorePlan(plan, &st);
    if (st.exact.error != 0) st.error = kErrorLevelNotFound;
  }
}

}  // namespace cuda
}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_APPROX_TOPK_PLAN_CUH_
