// The output kernels (part of approx_topk.cuh, which is what to include):
// the compaction writes the selected entries to their slots as the plan
// classifies them, and the finish kernel fills the slots the compaction
// left, so that every one of the k slots is written.
//
// Compaction: one pass over the candidates (or all of x) writing the selected
// entries (Classify, topk_common.h).
//   sure  bits > sure_above             -> slot sure_counter++ (< k of them)
//   tie   bits in [tie_low, sure_above] -> c = tie_counter++, slot above + c
//                                          while c < need
//   fill  bits in [bin_low, tie_low)    -> c = fill_counter++, fill list[c]
//                                          while c < need (gaussian only;
//                                          FinishKernel places them)
// Slots come from warp-aggregated atomics (one atomicAdd per warp and class).
// Most warps see no candidate at all and skip with a single ballot.
#ifndef TF_TOPK_CC_KERNELS_APPROX_TOPK_FINISH_CUH_
#define TF_TOPK_CC_KERNELS_APPROX_TOPK_FINISH_CUH_

#include <cstdint>

#include "approx_topk_primitives.cuh"
#include "approx_topk_scratch.cuh"
#include "topk_common.h"

namespace tf_topk {
namespace cuda {

template <typename T>
__global__ void __launch_bounds__(kThreads, MinBlocksPerSm(kCompactBlocksPerSm))
    CompactKernel(const T* __restrict__ x, int64_t n, long long k, Scratch* s,
                  const Candidate* __restrict__ candidates, long long capacity,
                  int32_t* __restrict__ fill_list,
                  typename Traits<T>::Bits* __restrict__ values,
                  int32_t* __restrict__ indices) {
  using Bits = typename Traits<T>::Bits;
  State& st = s->state;
  const uint32_t sure_above = st.sure_above;
  const uint32_t tie_low = st.tie_low;
  const uint32_t bin_low = st.bin_low;
  const long long above = st.above;
  const unsigned long long need =
      st.need > 0 ? static_cast<unsigned long long>(st.need) : 0ull;
  const unsigned lane = threadIdx.x & 31u;
  // Warp-uniform: set once a counter passed `need`; later entries of that
  // class in this warp would get c >= need anyway, so skip their atomics.
  bool ties_full = need == 0;
  bool fills_full = need == 0 || bin_low >= tie_low;

  auto fn = [&](int64_t index, Bits raw, bool valid) {
    const uint32_t bits = MagnitudeBits(Traits<T>::ToFloat(raw));
    const EntryClass c = valid ? Classify(bits, sure_above, tie_low, bin_low)
                               : EntryClass::kSkip;
    const bool sure = c == EntryClass::kSure;
    const bool tie = c == EntryClass::kTie && !ties_full;
    const bool fill = c == EntryClass::kFill && !fills_full;
    if (__ballot_sync(0xffffffffu, sure || tie || fill) == 0u) return;

    unsigned long long first;
    const unsigned sure_mask = __ballot_sync(0xffffffffu, sure);
    if (sure_mask != 0u) {
      const unsigned long long slot =
          ClaimSlots(&st.sure_counter, sure_mask, sure, lane, &first);
      if (sure) {
        if (slot < static_cast<unsigned long long>(k)) {
          values[slot] = raw;
          indices[slot] = static_cast<int32_t>(index);
        } else {
          st.error = kErrorSlotOverflow;
        }
      }
    }
    const unsigned tie_mask = __ballot_sync(0xffffffffu, tie);
    if (tie_mask != 0u) {
      const unsigned long long t =
          ClaimSlots(&st.tie_counter, tie_mask, tie, lane, &first);
      if (tie && t < need) {
        const unsigned long long slot = static_cast<unsigned long long>(above) + t;
        if (slot < static_cast<unsigned long long>(k)) {
          values[slot] = raw;
          indices[slot] = static_cast<int32_t>(index);
        } else {
          st.error = kErrorSlotOverflow;
        }
      }
      if (first + __popc(tie_mask) >= need) ties_full = true;
    }
    const unsigned fill_mask = __ballot_sync(0xffffffffu, fill);
    if (fill_mask != 0u) {
      const unsigned long long f =
          ClaimSlots(&st.fill_counter, fill_mask, fill, lane, &first);
      if (fill && f < need) fill_list[f] = static_cast<int32_t>(index);
      if (first + __popc(fill_mask) >= need) fills_full = true;
    }
  };
  if (st.use_candidates) {  // block-uniform
    ForEachCandidate<T>(candidates, CandidatesKept(st, capacity), fn);
  } else {
    ForEachEntry(x, n, fn);
  }
}

// After the compaction: the slots the tie range left empty,
// [above + ties taken, k), take entries from the fill list in order (gaussian
// only: the exact method's tie range always fills its `need` slots), and the
// slots after those (fewer than k qualify) get value 0 and index 0.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    FinishKernel(const T* __restrict__ x, long long k, const Scratch* s,
                 const int32_t* __restrict__ fill_list,
                 typename Traits<T>::Bits* __restrict__ values,
                 int32_t* __restrict__ indices) {
  using Bits = typename Traits<T>::Bits;
  const State& st = s->state;
  const long long need = st.need > 0 ? st.need : 0;
  const long long fills = FillCount(need, st.tie_counter, st.fill_counter);
  const long long first_fill = st.above + TiesTaken(need, st.tie_counter);
  const long long first_spare = first_fill + fills;
  const Bits* xb = reinterpret_cast<const Bits*>(x);
  for (long long slot = first_fill + blockIdx.x * static_cast<long long>(blockDim.x) +
                        threadIdx.x;
       slot < k; slot += static_cast<long long>(gridDim.x) * blockDim.x) {
    if (slot < first_spare) {
      const int32_t index = fill_list[slot - first_fill];
      values[slot] = xb[index];
      indices[slot] = index;
    } else {
      values[slot] = static_cast<Bits>(0);
      indices[slot] = 0;
    }
  }
}

}  // namespace cuda
}  // namespace tf_topk

#endif  // TF_TOPK_CC_KERNELS_APPROX_TOPK_FINISH_CUH_
